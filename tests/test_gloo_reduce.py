"""On gloo, gradient buckets are reduced by an all-to-all and a local sum (see
[Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py), in the eager runtime
and in the lowered graphs alike."""
from __future__ import annotations

import pytest
import torch

from compiled_fsdp import fully_shard
from examples.gpt import batch

from _dist import run_distributed
from _graphs import A2A, RS, GraphCapture, count, one_graph
from _models import gpt_case
from _parity import run_parity


def _shard(model: torch.nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


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

    eager = run_parity(rank, build, _shard, make_batch, loss, after_step=snapshot, make_ref_batch=make_ref_batch)
    capture = GraphCapture()
    compiled = run_parity(
        rank, build, _shard, make_batch, loss, after_step=snapshot, make_ref_batch=make_ref_batch,
        wrap=lambda m: torch.compile(m, backend=capture.backend, fullgraph=True),
    )
    same = all(torch.equal(a, b) for sa, sb in zip(eager.pop("after"), compiled.pop("after"))
               for a, b in zip(sa, sb))
    return {"eager": eager, "compiled": compiled, "same_grads": same,
            "a2a": sum(count(g, A2A) for g in capture.backward),
            "rs": sum(count(g, RS) for g in capture.backward)}


@pytest.mark.parametrize("by_all_to_all", [True, False])
def test_gloo_reduce(by_all_to_all: bool) -> None:
    """3 ranks with different batches, so the order of the sum shows: the eager
    runtime and aot_eager reduce the same way and give bitwise equal gradients,
    both within 1e-6 of the reference trained on the global batch; the backward graphs hold one all-to-all per reduce
    bucket (the knob turned off: one reduce_scatter_tensor) and no other reduce."""
    for res in run_distributed(_rank, 3, by_all_to_all):
        for key in ("eager", "compiled"):
            for what in ("loss", "grad", "param"):
                assert max(res[key][what]) <= 1e-6, (key, what, res[key][what])
        assert res["compiled"]["counts"] == [{}] * 3
        assert res["same_grads"]
        n_buckets = 4  # two blocks and the root's two units (see [Note: Units])
        assert (res["a2a"], res["rs"]) == ((n_buckets, 0) if by_all_to_all else (0, n_buckets))
