"""torch's fake process group (one process plays rank 0 of W; collectives move
nothing): ``fully_shard`` runs there at world sizes 8 and 64, eager and
compiled, each rank holding 1/W of the parameters ([Note: Helper groups] in
compiled_fsdp/runtime/divergence.py). Each case runs in a fresh process (the
fake group is the process's default group); the GPU check's simulated
8-GPU job runs on this path."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
world = int(sys.argv[1])
dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
from compiled_fsdp import collective_counts, fully_shard, reset_collective_counts
from compiled_fsdp.tools.models import GPT, GPTConfig, batch, loss_fn
out = {}
for mode in ("eager", "aot_eager"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, dim=64, n_layers=2, n_heads=2, seq=16))
    full = {n: list(p.shape) for n, p in model.named_parameters()}
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    local = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    run = model if mode == "eager" else torch.compile(model, backend=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reset_collective_counts()
    for step in range(2):
        tokens = batch(model.cfg, 2, step)
        loss_fn(run(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    grads = {n: list(p.grad.to_local().shape) for n, p in model.named_parameters() if p.grad is not None}
    out[mode] = {"full": full, "local": local, "grads": grads, "counts": collective_counts()}
print(json.dumps(out))
"""


@pytest.mark.parametrize("world", [8, 64])
def test_fake_group_holds_one_wth(world: int) -> None:
    """Eager, then ``aot_eager``, in one process (one interpreter start per world size)."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(world)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == {"eager", "aot_eager"}, results

    def numel(shapes: dict) -> int:
        return sum(math.prod(s) for s in shapes.values())

    for mode, res in results.items():
        assert res["grads"] == {}, mode  # zero_grad(): set to None
        for name, shape in res["full"].items():
            # rank 0 holds the first ceil(rows / W) rows (FSDP2's Shard(0) with padding)
            assert res["local"][name] == [-(-shape[0] // world)] + shape[1:], (mode, name, shape)
        # the large parameters dominate: rank 0 holds about 1/W of the model
        assert numel(res["local"]) <= numel(res["full"]) / world * 1.25, (mode, numel(res["local"]))
    # the eager runtime communicated (through the fake group)
    counts = results["eager"]["counts"]
    assert counts.get("all_gather", 0) > 0 and counts.get("reduce_scatter", 0) > 0, counts
