"""PyTorch's own FSDP2 unit tests run against compiled_fsdp: how many of those
FSDP2 passes on this machine pass with the project bound in.

    python benchmarks/fsdp2_tests/run.py --tests DIR [--modes fsdp2 eager compiled]
        [--files init state training] [-k EXPR] [--out results.json]

``DIR`` holds PyTorch's ``test_fully_shard_*.py`` (``test/distributed/
_composable/fsdp`` of a PyTorch checkout: the tests are not in the wheel, and
no copy of them lives in this repository). Needs ``expecttest``. Modes, each a
separate pytest run over the same files:

  fsdp2     torch's FSDP2 itself (the baseline: which tests pass here at all)
  eager     ``torch.distributed.fsdp.fully_shard``, ``FSDPModule``,
            ``UnshardHandle``, ``register_fsdp_forward_method`` bound to
            compiled_fsdp's in every process (bind/sitecustomize.py)
  compiled  the same, every sharded module also compiled in place with
            ``aot_eager``
  fsdp2_compiled
            FSDP2 with every sharded module compiled in place the same way:
            the peer of ``compiled`` (not run unless named in ``--modes``)

Tests marked for 2+ GPUs run on the CPU too (gloo), unless ``--gpu-skips``;
a test counts when FSDP2 itself passes it here.

Prints, per test that FSDP2 passes, the outcome under each mode and the first
line of each failure, and the counts; writes them all to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("fsdp2", "eager", "compiled", "fsdp2_compiled")


def _outcomes(junit_xml: str) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the message)."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (el.text or el.get("message") or "").strip()  # (the message can stop at its first line)
                message = _first_cause(text)
                break
        out[name] = (outcome, message)
    return out


_ERROR_LINE = re.compile(r"^(E\s+)?(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)|AssertionError)\b(:.*)?$")
_WRAPPERS = re.compile(r"(Thread|Process) \d+ exited|exited with exit code|Caught exception")


def _first_cause(text: str) -> str:
    """The error a rank raised: the last line naming an exception that is not
    the test harness's report that a rank (thread or process) failed."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if _ERROR_LINE.match(ln) and not _WRAPPERS.search(ln)]
    line = named[-1] if named else lines[0] if lines else ""
    return re.sub(r"^E\s+", "", line)[:240]


def run_mode(mode: str, files: list[str], keyword: str | None, timeout: float,
             gpu_tests_on_cpu: bool) -> dict[str, tuple[str, str]]:
    env = dict(os.environ)
    env["COMPILED_FSDP_BIND"] = mode if mode != "fsdp2" else ""
    env["COMPILED_FSDP_GPU_TESTS_ON_CPU"] = "1" if gpu_tests_on_cpu else "0"
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "bind")] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        if keyword:
            cmd += ["-k", keyword]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
        print(f"[{mode}] {time.perf_counter() - t0:.0f}s: {last}", flush=True)
        if not os.path.exists(xml):
            raise RuntimeError(f"pytest wrote no report for mode {mode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return _outcomes(xml)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests", required=True, help="directory with PyTorch's test_fully_shard_*.py")
    p.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    p.add_argument("--files", nargs="+", default=["init", "state", "training"])
    p.add_argument("-k", dest="keyword", default=None)
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument("--out", default="fsdp2_tests.json")
    p.add_argument("--gpu-skips", action="store_true",
                   help="keep the skips of tests marked for 2+ GPUs (default: run them on the CPU too)")
    args = p.parse_args()
    files = [os.path.join(os.path.abspath(args.tests), f"test_fully_shard_{f}.py") for f in args.files]
    for f in files:
        if not os.path.exists(f):
            raise SystemExit(f"{f} not found: --tests must name PyTorch's test/distributed/_composable/fsdp")
    results = {mode: run_mode(mode, files, args.keyword, args.timeout, not args.gpu_skips) for mode in args.modes}
    base = "fsdp2" if "fsdp2" in results else None
    names = sorted(set().union(*[r.keys() for r in results.values()]))
    considered = [n for n in names if base is None or results[base].get(n, ("?", ""))[0] == "passed"]
    for n in considered:
        row = "  ".join(f"{m}={results[m].get(n, ('-', ''))[0]:7s}" for m in args.modes)
        print(f"{n:78s} {row}")
        for m in args.modes:
            outcome, msg = results[m].get(n, ("-", ""))
            if outcome == "failed":
                print(f"    {m}: {msg}")
    counts = {m: sum(results[m].get(n, ("-",))[0] == "passed" for n in considered) for m in args.modes}
    print(f"of {len(considered)} tests" + (" that FSDP2 passes here" if base else "") + ": "
          + ", ".join(f"{m} {c}" for m, c in counts.items()))
    from importlib.metadata import version  # (the release, read as the other benchmarks read it)

    with open(args.out, "w") as f:
        json.dump({"torch": version("torch"), "files": args.files, "gpu_tests_on_cpu": not args.gpu_skips,
                   "considered": len(considered), "counts": counts,
                   "results": {m: {n: list(v) for n, v in r.items()} for m, r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
