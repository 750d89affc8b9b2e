"""What the main job shows: a line per logged step on rank 0 (plain lines, fit
for a terminal and for a log file alike), a JSON-lines metrics file, and at the
end a PNG of the loss curves and step times (matplotlib, the ``bench`` extra).
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Optional, Sequence

import torch

__all__ = ["Metrics", "flops_per_token", "peak_flops", "peak_memory_mb", "plot"]

# Dense bf16 peak of the GPUs a user is likely to train on (FLOP/s): MFU's denominator.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(device: torch.device) -> Optional[float]:
    """The device's bf16 peak (None on a CPU or an unknown GPU: no MFU shown)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def flops_per_token(n_params: int, n_layers: int, dim: int, seq: int) -> float:
    """Training FLOPs per token: 6 per parameter, plus causal attention's
    score and value products (the PaLM paper's estimate, appendix B)."""
    return 6 * n_params + 12 * n_layers * dim * seq


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: allocated on a GPU, resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Metrics:
    """Records one dict per event; rank 0 prints and appends to ``path``."""

    def __init__(self, path: Optional[str], enabled: bool, resume: bool = False) -> None:
        self.enabled = enabled
        self.path = path
        self.records: list[dict[str, Any]] = []
        if enabled and path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            if not resume and os.path.exists(path):
                os.remove(path)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        print(self._line(record), flush=True)

    @staticmethod
    def _line(r: dict[str, Any]) -> str:
        if r.get("event") == "eval":
            return f"step {r['step']:5d}  val {r['val_loss']:.4f}"
        if r.get("event") != "step":
            return "  ".join(f"{k} {v}" for k, v in r.items() if k != "event")
        parts = [f"step {r['step']:5d}", f"loss {r['loss']:.4f}"]
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.4f}")
        parts += [f"{r['tokens_per_s']:8.0f} tok/s", f"{r['step_s'] * 1000:7.1f} ms/step",
                  f"peak {r['peak_mem_mb']:.0f} MB"]
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        return "  ".join(parts)


def read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(runs: Sequence[tuple[str, list[dict[str, Any]]]], path: str) -> Optional[str]:
    """Loss curves (training and validation) and step times of one or more
    runs in one PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install -e '.[bench]')"
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for label, records in runs:
        steps = [r for r in records if r.get("event") == "step"]
        line, = ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=f"{label} train",
                             linewidth=1)
        val = [r for r in records if "val_loss" in r]
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=line.get_color(),
                     label=f"{label} validation", markersize=3)
        # The first logged window holds compilation: left out of the time plot.
        timed = steps[1:] if len(steps) > 1 else steps
        ax_time.plot([r["step"] for r in timed], [1000 * r["step_s"] for r in timed], label=label, linewidth=1)
    ax_loss.set(xlabel="step", ylabel="loss (nats/byte)", title="loss")
    ax_time.set(xlabel="step", ylabel="ms per step", title="step time (after the first window)")
    ax_loss.legend(fontsize=7)
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return None


if __name__ == "__main__":  # redraw: python examples/metrics.py OUT.png A.jsonl [B.jsonl ...]
    out, *files = sys.argv[1:]
    print(plot([(os.path.basename(f).removesuffix(".jsonl"), read(f)) for f in files], out) or out)
