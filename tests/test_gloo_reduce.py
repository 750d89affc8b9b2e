"""On gloo, gradient buckets are reduced by an all-to-all and a local sum (see
[Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py), in the eager runtime
and in the lowered graphs alike."""
from __future__ import annotations

import pytest
import torch

from examples.gpt import batch

from _dist import run_distributed
from _graphs import A2A, RS, GraphCapture, count, one_graph
from _models import gpt_case, shard_each
from _parity import run_parity


def _rank(rank: int, world: int, by_all_to_all: bool) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    from compiled_fsdp import config

    config.comm.gloo_reduce_by_all_to_all = by_all_to_all
    build, _, loss = gpt_case(False)
    cfg = build().cfg
    # Each rank its own batch, so the ranks' gradients differ and the order of
    # their sum shows in the bits; the reference trains on all of them at once.
    make_batch = lambda step: (batch(cfg, 2, seed=100 * step + rank),)  # noqa: E731
    make_ref_batch = lambda step: (torch.cat([batch(cfg, 2, seed=100 * step + r) for r in range(world)]),)  # noqa: E731

    def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in model.parameters()]

    eager = run_parity(rank, build, shard_each, make_batch, loss, after_step=snapshot, make_ref_batch=make_ref_batch)
    capture = GraphCapture()
    compiled = run_parity(
        rank, build, shard_each, make_batch, loss, after_step=snapshot, make_ref_batch=make_ref_batch,
        wrap=lambda m: torch.compile(m, backend=capture.backend, fullgraph=True),
    )
    same = all(torch.equal(a, b) for sa, sb in zip(eager.pop("after"), compiled.pop("after"))
               for a, b in zip(sa, sb))
    return {"eager": eager, "compiled": compiled, "same_grads": same,
            "a2a": sum(count(g, A2A) for g in capture.backward),
            "rs": sum(count(g, RS) for g in capture.backward),
            "sums": sum(count(g, torch.ops.compiled_fsdp.sum_ranks.default) for g in capture.backward)}


@pytest.mark.parametrize("by_all_to_all", [True, False])
def test_gloo_reduce(by_all_to_all: bool) -> None:
    """3 ranks with different batches, so the order of the sum shows: the eager
    runtime and aot_eager reduce the same way and give bitwise equal gradients,
    both within 1e-6 of the reference trained on the global batch; the backward graphs hold one all-to-all per reduce
    bucket (the knob turned off: one reduce_scatter_tensor) and no other reduce, each all-to-all summed by
    one ``sum_ranks`` ([Note: The reduce's arithmetic as ops on the CPU])."""
    for res in run_distributed(_rank, 3, by_all_to_all):
        for key in ("eager", "compiled"):
            for what in ("loss", "grad", "param"):
                assert max(res[key][what]) <= 1e-6, (key, what, res[key][what])
        assert res["compiled"]["counts"] == [{}] * 3
        assert res["same_grads"]
        n_buckets = 4  # two blocks and the root's two units (see [Note: Units])
        assert (res["a2a"], res["rs"]) == ((n_buckets, 0) if by_all_to_all else (0, n_buckets))
        assert res["sums"] == res["a2a"]


def _in_flight_rank(rank: int, world: int, rounds: int) -> tuple:
    import torch.distributed as dist

    from compiled_fsdp.core import comm

    name = dist.group.WORLD.group_name
    wrong = 0
    for i in range(rounds):
        xs = [torch.full((1000 + (i * 7919 + j * 104729) % 20000,), float(rank + i + j)) for j in range(2)]
        outs = [comm.all_gather_unwaited(x, world, name) for x in xs]  # (two in flight, then waited)
        for x, out in zip(xs, outs):
            out = torch.ops._c10d_functional.wait_tensor(out)
            want = torch.cat([x - rank + r for r in range(world)])
            wrong += int(not torch.equal(out, want))
    return comm.gathers_by_work(name, "cpu"), wrong, torch._C._distributed_c10d._get_work_registry_size()


def test_gathers_in_flight_on_gloo() -> None:
    """[Note: All-gathers on gloo]: 4,000 rounds of two all-gathers in flight
    on one gloo group, of changing sizes, each value checked after its
    ``wait_tensor``, no work left registered. Through torch's functional op
    the same loop killed a rank within 8-30 s (10^4 rounds) on every
    supported release; this is the op every unwaited gather of the package
    takes on gloo, in graphs and in the eager prefetches."""
    for by_work, wrong, left in run_distributed(_in_flight_rank, 2, 4000, timeout=300):
        assert by_work and wrong == 0 and left == 0, (by_work, wrong, left)
