"""The emulated-network benchmark's report (benchmarks/emulated.py): the
exposed communication read from a CUDA profiler trace, and the table."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Optional

import torch


def trace_exposed(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    """One step under the profiler: the time a spin kernel (an emulated
    collective) runs while no other kernel runs, and the spin kernels' busy time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    comm, compute = [], []
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            (comm if "spin_kernel" in e["name"] else compute).append((e["ts"], e["ts"] + e["dur"]))
    return {"exposed_s_trace": _minus(_union(comm), _union(compute)) / 1e6,
            "comm_busy_s_trace": _length(_union(comm)) / 1e6}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _minus(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> float:
    """Length of ``spans`` outside ``holes`` (both unions)."""
    total, j = 0.0, 0
    for a, b in spans:
        covered = 0.0
        while j < len(holes) and holes[j][1] <= a:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] < b:
            covered += min(b, holes[k][1]) - max(a, holes[k][0])
            k += 1
        total += (b - a) - covered
    return total


def table(results: list[dict[str, Any]]) -> str:
    head = (f"{'W':>4} {'link':8} {'kind':12} {'first s':>8} {'step s':>8} {'tok/s/GPU':>9} {'MFU':>6} "
            f"{'peak GiB':>8} {'comm s':>7} {'bound s':>7} {'x bound':>7} {'exposed':>8} {'predicted':>9} "
            f"{'optim s':>7} {'step MiB':>8} {'paired x':>8}")
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"{r['world']:>4} {r['link']:8} {_name(r):12} FAILED: {r['error'][:80]}")
            continue
        floor = next((f for f in results if f["kind"] == "floor" and f["world"] == r["world"]
                      and "error" not in f), None)
        bound = max(floor["step_s"], r["comm_s"]) if floor else None
        exposed = r.get("exposed_s") if r["device"] == "cpu" else r.get("exposed_s_trace", r.get("exposed_s"))
        lines.append(
            f"{r['world']:>4} {r['link']:8} {_name(r):12} {r['first_step_s']:8.1f} {r['step_s']:8.3f} "
            f"{r['tokens_per_s']:9.0f} {_pct(r.get('mfu')):>6} {_num(r.get('peak_mem_gib'), '8.1f')} "
            f"{r['comm_s']:7.3f} {_num(bound, '7.3f')} {_num(bound and r['step_s'] / bound, '7.3f')} "
            f"{exposed:8.3f} {_num(r.get('predicted_exposed_s'), '9.3f')} {_num(r.get('optimizer_s'), '7.3f')} "
            f"{_num(r.get('step_peak_mib'), '8.1f')} {_num(r.get('x_bound_paired'), '8.3f')}")
    return "\n".join(lines)


def _name(r: dict[str, Any]) -> str:
    return r["kind"] + (f" {r['variant']}" if r.get("variant") else "")


def _num(v: Optional[float], spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"
