"""Gradient accumulation without sync: FSDP2's ``set_requires_gradient_sync`` /
``set_reshard_after_backward``, in the eager runtime and inside compiled graphs.
See [Note: Gradient accumulation without sync] in compiled_fsdp/runtime/module.py."""
from __future__ import annotations

import contextlib
import copy
from typing import Optional

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from compiled_fsdp.core.marker import ReduceLater
from compiled_fsdp.core.registry import CORE
from compiled_fsdp.tools.check_worker import max_diff, shard_specs

from _dist import run_distributed
from _graphs import GraphCapture
from _models import gpt_case
from _parity import in_regions


def _local(spec, full: Optional[torch.Tensor], rank: int) -> Optional[torch.Tensor]:  # noqa: ANN001
    return None if full is None else spec.local(full, rank)


def _kept_by_reduce_later(graphs: list[torch.fx.GraphModule]) -> list[int]:
    """How many kept gradients each region reduce (``reduce_later``) of the
    backward graphs ``graphs`` takes, each a graph input that nothing else
    reads: added where the bucket is packed, not in the graph ([Note: Kept
    gradients added where the bucket is packed] in compiled_fsdp/core/ops.py)."""
    counts = []
    for gm in graphs:
        for sub in gm.modules():  # (a region's graph is a submodule of the graph that calls it)
            for n in sub.graph.nodes if isinstance(sub, torch.fx.GraphModule) else ():
                if n.target is ReduceLater.op().default:
                    kept = [k for k in ReduceLater.bind(n.args, dict(n.kwargs)).kept if k is not None]
                    assert all(k.op == "placeholder" and list(k.users) == [n] for k in kept), kept
                    counts.append(len(kept))
    return counts


def _accumulate_rank(rank: int, world: int, micro: int, keep_gathered: bool,
                     backend: Optional[str] = None, bf16: bool = False, variant: str = "") -> dict:
    """``variant`` ("+"-separated): "frozen" freezes layers.0's MLP, "frozen_last"
    the last block's too; "eval" runs
    a forward with sync on and no backward before the last micro-batch;
    "blocks" compiles each block on its own; "untraced_last" runs the last
    micro-batch under ``torch.compiler.set_stance("force_eager")``, where
    Dynamo runs every frame eagerly; "regions" makes the blocks compile
    regions (``config.comm.block_regions``)."""
    variants = set(variant.split("+"))
    compiled_fsdp.config.comm.block_regions = "regions" in variants
    build, make_batch, loss_fn = gpt_case(True)  # tied, uneven rows
    ref = build()
    if "frozen" in variants:
        ref.layers[0].mlp.requires_grad_(False)
    if "frozen_last" in variants:
        ref.layers[-1].mlp.requires_grad_(False)
    model = copy.deepcopy(ref)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    specs = shard_specs(model)
    capture = GraphCapture() if backend == "aot_eager" else None
    runner = model
    if backend is not None and "blocks" in variants:  # see tests/test_block_compile.py
        for block in model.layers:
            block.compile(backend=capture.backend if capture else backend, fullgraph=True)
    elif backend is not None:
        runner = torch.compile(model, backend=capture.backend if capture else backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    named_ref = dict(ref.named_parameters())

    def ref_forward(tokens: torch.Tensor) -> torch.Tensor:
        if not bf16:
            return ref(tokens)
        params = {n: p.to(torch.bfloat16) for n, p in named_ref.items()}
        return torch.func.functional_call(ref, params, (tokens,))

    out = {"grad": [], "param": [], "counts": [], "graph_runs": [], "graphs": [],
           "grad_none_before_sync": True}
    for step in range(3):
        compiled_fsdp.reset_collective_counts()
        for i in range(micro):
            last = i == micro - 1
            model.set_requires_gradient_sync(last)
            if keep_gathered:
                model.set_reshard_after_backward(last)
            if last and "eval" in variants:  # a forward whose backward never runs
                runner(make_batch(99)[0]).sum()
            (tokens,) = make_batch(10 * step + i)
            untraced = last and "untraced_last" in variants
            with torch.compiler.set_stance("force_eager") if untraced else contextlib.nullcontext():
                loss_fn(runner(tokens), tokens).backward()
            loss_fn(ref_forward(tokens), tokens).backward()
            if not last:
                out["grad_none_before_sync"] &= all(p.grad is None for p in model.parameters())
        out["counts"].append(compiled_fsdp.collective_counts())
        if capture is not None:
            out["graph_runs"].append(capture.take_runtime())
            out["graphs"].append(len(capture.forward))
        out["grad"].append(max(max_diff(p.grad, _local(specs[id(p)], named_ref[n].grad, rank))
                               for n, p in model.named_parameters()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["param"].append(max(max_diff(p, specs[id(p)].local(named_ref[n].detach(), rank))
                                for n, p in model.named_parameters()))
    out["is_fsdp_module"] = [isinstance(m, FSDPModule) for m in (model, *model.layers, model.norm)]
    out["regions"] = in_regions(model)
    out["taken"] = CORE.backward_gathers.taken
    out["kept_by_reduce_later"] = _kept_by_reduce_later(capture.backward) if capture is not None else []
    fsdp_params = [(f"{st.param_group.fqn}.{fp.fqn}".lstrip("."), fp)
                   for st in compiled_fsdp.iter_fsdp_states(model) if st.param_group
                   for fp in st.param_group.fsdp_params]
    out["sinks"] = sorted(name for name, fp in fsdp_params if fp.grad_sink is not None)
    out["trainable"] = sorted(name for name, fp in fsdp_params if fp.sharded.requires_grad)
    return out


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_accumulation_without_sync_matches_the_reference(keep_gathered: bool) -> None:
    """3 micro-batches per step, sync only on the last: bitwise equal to a reference
    that accumulates the same micro-batches; one reduce-scatter per module per
    step (3 modules); no gradient on the shards before the synced backward. With
    the parameters kept after backward, the next micro-batch gathers nothing."""
    for res in run_distributed(_accumulate_rank, 2, 3, keep_gathered):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]
        for counts in res["counts"]:
            assert counts["reduce_scatter"] == 3
            # forward gathers per micro-batch: 3 modules; backward re-gathers the 2
            # resharded blocks (the root keeps its parameters: FSDP2's rule)
            per_micro = 3 + 2
            assert counts["all_gather"] == (per_micro if keep_gathered else 3 * per_micro) + (
                2 * 2 if keep_gathered else 0)
        assert res["is_fsdp_module"] == [True, True, True, False]


@pytest.mark.parametrize("bf16,variant", [(False, ""), (True, ""), (False, "frozen"), (False, "eval")])
def test_compiled_accumulation_without_sync(bf16: bool, variant: str) -> None:
    """The same under torch.compile(fullgraph=True) with aot_eager, in fp32 and
    with bf16 parameters reduced in fp32: bitwise equal to the reference; two
    graphs in all (one per flag value, both made in the first step, none
    after); per step the graphs run exactly one reduce-scatter per module (in
    the synced backward) and no eager collective. See [Note: Accumulation
    without sync in graphs] in compiled_fsdp/core/ops.py. Frozen parameters get no
    gradient sink. A forward with sync on whose backward never runs (e.g. a
    validation loss) leaves the kept gradients for the next synced backward."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "aot_eager", bf16, variant, timeout=600):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]
        assert res["counts"] == [{}] * 3
        assert res["graphs"] == [2, 2, 2]
        extra = 3 if variant == "eval" else 0  # the forward without backward gathers too
        for runs in res["graph_runs"]:
            assert runs == {"fw_all_gather": 3 * 3 + extra, "bw_all_gather": 3 * 2, "bw_reduce_scatter": 3}
        assert res["sinks"] == res["trainable"]
        if variant == "frozen":
            assert "layers.0.mlp.up.weight" not in res["sinks"] and "layers.1.mlp.up.weight" in res["sinks"]


def test_compiled_accumulation_without_sync_regions() -> None:
    """The same with the blocks as compile regions ([Note: Blocks as compile
    regions] in compiled_fsdp/compile/regions.py), bf16 parameters reduced in
    fp32: bitwise equal to the reference, no eager collective, the kept
    gradients taken by the regions' reductions in the synced backward."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "aot_eager", True, "regions", timeout=600):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]
        assert res["counts"] == [{}] * 3
        assert res["regions"] == [False, True, True], res["regions"]  # (the root, then its two blocks)
        assert res["taken"] > 0  # (gathers issued ahead of the regions were taken)
        # (the synced backward's region graph, shared by both blocks: one reduce of the block's
        # 11 parameters, each taking what was kept)
        assert res["kept_by_reduce_later"] == [11], res["kept_by_reduce_later"]


def test_accumulation_without_sync_blocks_compiled_on_their_own() -> None:
    """Each block compiled on its own, the root eager: bitwise equal to the
    reference. layers.0's graph carries layers.1's sync flag and kept
    gradients with the gather it hands over ([Note: Gathers handed to the next
    block's graph]): one graph per flag value, and layers.1's graph is the
    same one (it hands its gather to a stand-in with its own flag: [Note: A
    stand-in for the last block's next]): 2 graphs, made in the first step. Per
    micro-batch the root gathers itself and layers.0 eagerly and layers.0's
    graph gathers layers.1; each block re-gathers in backward; gradients are
    reduced once per step, in the synced backward: layers.1's in layers.0's
    graph, the root's and layers.0's eagerly."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "aot_eager", False, "blocks", timeout=600):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]
        assert res["graphs"] == [2, 2, 2]
        for runs, counts in zip(res["graph_runs"], res["counts"]):
            assert runs == {"fw_all_gather": 3, "bw_all_gather": 3 * 2, "bw_reduce_scatter": 1}
            assert counts == {"all_gather": 3 * 2, "reduce_scatter": 2}
        assert res["sinks"] == res["trainable"]


def test_accumulation_without_sync_blocks_frozen() -> None:
    """The same with frozen parameters in both blocks: the root hands layers.0
    its gather, and layers.0's graph hands layers.1 its gather, each with the
    sinks of the parameters that train only ([Note: Gathers handed to the next
    block's graph]); bitwise equal to the reference."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "aot_eager", False,
                               "blocks+frozen+frozen_last", timeout=600):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["sinks"] == res["trainable"]
        assert not any(".mlp." in name for name in res["sinks"]), res["sinks"]
        assert "layers.1.attn.qkv.weight" in res["sinks"]


def test_accumulation_without_sync_blocks_untraced_last() -> None:
    """Each block compiled on its own, the synced micro-batch's frames left
    untraced (``torch.compiler.set_stance("force_eager")``): the gathers handed over
    eagerly (by the root, then by each block falling back) are dropped, and the
    gradients the earlier micro-batches kept are still reduced, by the blocks'
    eager runtime: bitwise equal to the reference ([Note: Gathers handed to
    the next block's graph] in compiled_fsdp/compile/entry.py)."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "aot_eager", False,
                               "blocks+untraced_last", timeout=600):
        assert max(res["grad"]) == 0.0 and max(res["param"]) == 0.0, res
        assert res["grad_none_before_sync"]


def _flag_between_rank(rank: int, world: int) -> str:
    build, make_batch, loss_fn = gpt_case(False)
    model = build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    runner = torch.compile(model, backend="aot_eager")
    (tokens,) = make_batch(0)
    model.set_requires_gradient_sync(False)
    loss = loss_fn(runner(tokens), tokens)
    model.set_requires_gradient_sync(True)  # after the forward: too late under compile
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_flag_changed_between_compiled_forward_and_backward_raises() -> None:
    for msg in run_distributed(_flag_between_rank, 2, timeout=300):
        assert "between a compiled forward and its backward" in msg and "before the forward" in msg, msg


def test_compiled_accumulation_with_markers_unlowered() -> None:
    """backend="eager" runs the markers' own implementations (no passes): the
    tied weight's two reads each reduce, and the kept gradient is added once.
    Added twice, the tied weight's gradient would be off by the kept sum itself
    (measured 0.4 when added per read); added once, only the order of the last two additions differs
    from the reference's (kept + read 1) + read 2 against kept + (read 1 + read 2)."""
    for res in run_distributed(_accumulate_rank, 2, 3, False, "eager", False, timeout=600):
        assert max(res["grad"]) <= 1e-6 and max(res["param"]) <= 1e-6, res
        assert res["grad_none_before_sync"]


def test_compiled_accumulation_inductor() -> None:
    """Inductor takes the zero-stride gradient sinks and the kept gradients as
    graph inputs too: close to the reference, no eager collective."""
    for res in run_distributed(_accumulate_rank, 2, 2, False, "inductor", False, timeout=900):
        assert max(res["grad"]) <= 1e-5 and max(res["param"]) <= 1e-5, res
        assert res["counts"] == [{}] * 3


def _bad_rank(rank: int, world: int) -> list[str]:
    build, _, _ = gpt_case(False)
    model = build()
    fully_shard(model)
    msgs = []
    try:
        model.set_requires_gradient_sync("no")
    except TypeError as exc:
        msgs.append(str(exc))
    return msgs


def test_bad_flag_is_a_clear_error() -> None:
    for msgs in run_distributed(_bad_rank, 2, timeout=120):
        assert len(msgs) == 1 and "expected True or False" in msgs[0]
