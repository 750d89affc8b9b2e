"""The GPU check: one command, one table, a JSON and a Perfetto trace.

    python benchmarks/gpu_check.py [--out DIR] [--parts ws1 sim predict] [--quick]

On a machine with one GPU (torch with CUDA, NCCL), in under 9 minutes:

ws1      World size 1, NCCL, real collectives: a Llama-style 1.1B model
         (d=2048, 16 blocks, GQA 16/8 heads, FFN 8192, vocab 32000), batch 4 x
         2048 tokens, bf16 compute on fp32 master weights, AdamW.
           floor          the model unsharded, compiled whole: compute only
           ours_compiled  compiled_fsdp, fully_shard per block + root, torch.compile(model)
                          (the default: each block a compile region, compiled once)
           ours_onegraph  the same with config.comm.block_regions = False: one graph
           ours_eager     compiled_fsdp's eager runtime
           fsdp2_blocks   FSDP2 with each block compiled (torchtitan's recipe)
         Loss diff: the largest |loss - floor's loss| over the steps (same seed, data).
sim      An 8-GPU job simulated on the one GPU: torch's fake process group at
         world size 8 (collectives move nothing; compute, memory and copies
         are real), Llama-3.1-8B dimensions, sequence 8192, local batch 1,
         activation checkpointing per block: ours compiled against FSDP2 +
         per-block compile. Per-rank peak memory and tokens/s per GPU.
f8offload (only when named; needs torchao) torchtitan's per-block pattern at
         world size 1: torchao float8 linears gathered as float8, then CPU
         offload, each under ours and FSDP2: step, tokens/s, peak memory;
         and ours float8 compiled whole (the cast moved before the gather).
predict  The step at 8 GPUs (one node, NVLink) and 64 (8 nodes, network):
         one block's and the head's measured compute fed through the
         project's timeline model (benchmarks/predict.py): how much
         communication stays exposed under the schedule.

Columns: first step (compile included), step (median), tokens/s (per GPU),
MFU (model FLOPs as torchtitan counts them, against 989 TFLOP/s dense bf16),
peak memory (``torch.cuda.max_memory_allocated`` over the measured steps),
the ratio to the floor (ws1) or to FSDP2 (sim). Each configuration runs in a
fresh process (gpu_workers.py). ``--quick`` runs tiny models on the CPU (the
fake group included): what CI tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_workers  # noqa: E402
from predict import predict  # noqa: E402

PARTS = ("ws1", "sim", "predict", "f8offload")


def run_worker(kind: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """One configuration in a fresh process; an error is reported, not raised."""
    result = os.path.join(args.out, f"{kind}.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, gpu_workers.__file__, kind, "--result", result] + extra
    env = dict(os.environ)
    if args.dump and kind in args.dump_kinds:  # the compiled graphs and pass reports (README: dumps)
        env["COMPILED_FSDP_DUMP"] = os.path.join(args.dump, kind)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout, env=env)
        tail = (proc.stdout + proc.stderr)[-3000:]
        ok = proc.returncode == 0 and os.path.exists(result)
    except subprocess.TimeoutExpired as e:
        tail, ok = f"timed out after {args.worker_timeout}s\n{(e.stderr or b'')[-2000:]!r}", False
    wall = time.perf_counter() - start
    if not ok:
        print(f"[{kind}] FAILED after {wall:.0f}s:\n{tail}", file=sys.stderr)
        return {"kind": kind, "error": tail.strip().splitlines()[-1] if tail.strip() else "failed"}
    with open(result) as f:
        res = json.load(f)
    res["wall_s"] = wall
    print(f"[{kind}] done in {wall:.0f}s", file=sys.stderr)
    return res


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict[str, dict[str, Any]], predictions: list[dict[str, Any]]) -> str:
    lines = [f"{'part':7} {'configuration':15} {'W':>3} {'first s':>8} {'step s':>8} {'tok/s/GPU':>10} "
             f"{'MFU':>6} {'peak GiB':>9} {'ratio':>12} {'loss diff':>10}"]
    floor = results.get("floor", {})
    for kind, res in results.items():
        if kind == "block_times":
            continue
        part = "sim" if kind in gpu_workers.SIM_KINDS else "ws1"
        if "error" in res:
            lines.append(f"{part:7} {kind:15} FAILED: {res['error'][:90]}")
            continue
        ratio, diff = "", "-"
        if part == "ws1" and "step_s" in floor:
            ratio = f"{res['step_s'] / floor['step_s']:.3f} x floor"
            diff = f"{max(abs(a - b) for a, b in zip(res['losses'], floor['losses'])):.2e}"
        elif part == "sim" and "step_s" in results.get("sim_fsdp2", {}):
            ratio = f"{res['step_s'] / results['sim_fsdp2']['step_s']:.3f} x FSDP2"
        lines.append(
            f"{part:7} {kind:15} {res['world']:>3} {res['first_step_s']:8.1f} {res['step_s']:8.3f} "
            f"{res['tokens_per_s']:10.0f} {res['mfu'] * 100:5.1f}% {_fmt(res['peak_mem_gib'], '9.1f')} "
            f"{ratio:>12} {diff:>10}")
    for p in predictions:
        lines.append(
            f"{'predict':7} {'W=' + str(p['world']) + ' ' + p['link']:15} {p['world']:>3} {'':8} "
            f"{p['step_s']:8.3f} {p['tokens_per_s_per_gpu']:10.0f} {'':6} {'':9} "
            f"{'exposed ' + format(p['exposed_s'] * 1e3, '.1f') + 'ms':>12} {'':10}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check_out", help="folder for the JSON, the trace and each worker's result")
    p.add_argument("--parts", nargs="+", default=["ws1", "sim", "predict"], choices=PARTS)
    p.add_argument("--kinds", nargs="*", default=None, help="only these configurations")
    p.add_argument("--predict-worlds", nargs="+", type=int, default=[8, 64])
    p.add_argument("--worker-timeout", type=float, default=300.0)
    p.add_argument("--dump", default=None, help="dump the compiled graphs of --dump-kinds here")
    p.add_argument("--dump-kinds", nargs="*", default=["ours_compiled", "sim_ours"])
    gpu_workers.add_arguments(p)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.trace_dir = args.trace_dir or args.out
    extra = _strip_driver_values(argv if argv is not None else sys.argv[1:])
    extra += ["--trace-dir", args.trace_dir]

    kinds = []
    if "ws1" in args.parts:
        kinds += list(gpu_workers.WS1_KINDS)
    if "sim" in args.parts:
        kinds += list(gpu_workers.SIM_KINDS)
    if "f8offload" in args.parts:
        kinds += list(gpu_workers.F8_OFFLOAD_KINDS)
    if "predict" in args.parts:
        kinds.append("block_times")
    if args.kinds:
        kinds = [k for k in kinds if k in args.kinds]
    start = time.perf_counter()
    results = {k: run_worker(k, args, extra) for k in kinds}
    predictions = []
    times = results.get("block_times", {})
    if "block_fwd_s" in times:
        cfg = times["config"]
        sim = results.get("sim_ours", {})
        blocks = cfg["n_layers"] * (times["block_fwd_s"] + times["block_bwd_s"])
        measured_step = sim.get("step_s")
        # What the simulated step spent besides blocks and head (optimizer, embedding, launch).
        times["other_s"] = max(0.0, measured_step - blocks - times["head_fwd_s"] - times["head_bwd_s"]) \
            if measured_step else 0.0
        tokens = times["batch"] * cfg["seq"]
        predictions = [predict(times, cfg["n_layers"], w, tokens) for w in args.predict_worlds]
    out = {"args": {k: v for k, v in vars(args).items()}, "results": results, "predictions": predictions,
           "wall_s": time.perf_counter() - start, "torch": _torch_version(), "device_name": _device_name()}
    text = table(results, predictions)
    out["table"] = text
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"gpu_check on {out['device_name']}, torch {out['torch']}, {out['wall_s']:.0f}s")
    print(text)
    return out


def _strip_driver_values(argv: list[str]) -> list[str]:
    """Drop the values that followed the driver's own options (space-separated form)."""
    out, skip = [], False
    driver = ("--out", "--parts", "--kinds", "--predict-worlds", "--worker-timeout", "--dump", "--dump-kinds")
    for a in argv:
        if a.startswith("--"):
            name = a.split("=")[0]
            skip = name in driver and "=" not in a
            if name not in driver:
                out.append(a)
        elif not skip:
            out.append(a)
    return out


def _torch_version() -> str:
    """For the report (the project decides nothing from it: core/compat.py does)."""
    from importlib.metadata import version
    return version("torch")


def _device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
