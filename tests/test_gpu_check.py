"""benchmarks/gpu_check.py's parts that need no GPU: argument handling, the
table and the JSON, the fake-group simulation (tiny Llama, world size 8),
and the timeline prediction."""
from __future__ import annotations

import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
from predict import predict  # noqa: E402


def test_driver_options_are_not_passed_to_workers() -> None:
    argv = ["--out", "d", "--quick", "--parts", "ws1", "sim", "--steps=2", "--dump=x", "--backend", "aot_eager"]
    assert gpu_check._strip_driver_values(argv) == ["--quick", "--steps=2", "--backend", "aot_eager"]


def test_quick_run_table_json_and_trace(tmp_path) -> None:
    # (Not ours_eager and sim_fsdp2: each a process of its own, ~15 s of CI;
    # the paths they take are ours_compiled's and sim_ours's workers.)
    out = gpu_check.main(["--quick", "--device", "cpu", "--backend", "aot_eager", "--warmup", "1",
                          "--steps", "2", "--out", str(tmp_path), "--worker-timeout", "600",
                          "--kinds", "floor", "ours_compiled", "fsdp2_blocks", "sim_ours", "block_times"])
    res = out["results"]
    assert set(res) == {"floor", "ours_compiled", "fsdp2_blocks", "sim_ours", "block_times"}
    assert not [k for k, r in res.items() if "error" in r], {k: r["error"] for k, r in res.items() if "error" in r}
    with open(tmp_path / "gpu_check.json") as f:
        assert json.load(f)["table"] == out["table"]
    for kind in ("floor", "ours_compiled", "fsdp2_blocks"):
        r = res[kind]
        assert r["world"] == 1 and r["params_local"] == r["params_full"] and len(r["losses"]) == 3
        # the same model, data and mixed precision: losses agree with the floor's (bf16 compute)
        assert max(abs(a - b) for a, b in zip(r["losses"], res["floor"]["losses"])) < 2e-2
    r = res["sim_ours"]  # each rank holds about 1/8 of the parameters
    assert r["world"] == 8 and r["params_local"] <= r["params_full"] / 8 * 1.3
    assert [p["world"] for p in out["predictions"]] == [8, 64]
    lines = out["table"].splitlines()
    assert len(lines) == 1 + 4 + 2 and "x floor" in lines[2] and "x floor" in lines[3], lines
    with gzip.open(res["ours_compiled"]["trace"]) as f:  # a Perfetto-readable trace of one step
        assert json.load(f)["traceEvents"]


def test_prediction_hides_nvlink_and_exposes_the_network() -> None:
    """Blocks of 10 ms forward, 20 ms backward, 100 MB of fp32 parameters:
    within a node each gather (50 MB bf16) hides behind a block; across 8 nodes
    at 45 GB/s the backward's gather + reduce (~3.3 ms) still hide, and the
    root's first gather does not."""
    times = {"block_fwd_s": 0.010, "block_bwd_s": 0.020, "head_fwd_s": 0.005, "head_bwd_s": 0.010,
             "block_param_bytes": 100 << 20, "head_param_bytes": 40 << 20, "embed_param_bytes": 40 << 20}
    p8, p64 = (predict(times, 4, w, 1000) for w in (8, 64))
    compute = 4 * 0.030 + 0.015
    assert abs(p8["compute_s"] - compute) < 1e-9
    assert p8["exposed_s"] < 0.002 < p64["exposed_s"]
    assert p8["step_s"] < p64["step_s"] and p64["link"] == "network" and p8["link"] == "NVLink"
