"""A compile region's reduce, waited after the region's graph: which
buckets qualify, and the op that issues them. See [Note: A region's
reduce-scatter waited outside its graph] in compiled_fsdp/core/registry.py."""

from __future__ import annotations

import torch.fx as fx
from torch.utils._pytree import tree_leaves

from compiled_fsdp.core.layout import ShardSpec, joined_shapes
from compiled_fsdp.core.marker import ReduceLater

from .buckets import BucketPlan
from .graph import NodeBuilder, tangent_dependents, through_identity_views


def region_shards(gathers: list[BucketPlan]) -> dict[tuple[int, int], fx.Node]:
    """(module_key, param_index) -> the shard input of each read a compile
    region makes (``take_ahead``), where the read takes the graph input itself."""
    out = {}
    for bucket in gathers:
        for s in bucket.slots:
            shard = through_identity_views(s.inputs[0])
            if s.args.take_ahead and shard is s.inputs[0] and shard.op == "placeholder":
                out[(bucket.module_key, s.args.param_index)] = shard
    return out


def keep_a_backward_output(graph: fx.Graph, reduces: list[BucketPlan]) -> None:
    """A region's reduces are waited after its graph only if its backward
    still returns some gradient (its input's): a backward returning None
    alone is a call nothing uses, which the outer graph's partitioner drops,
    reduce and all (a region fed by data that needs no gradient)."""
    roots = {s.root for b in reduces for s in b.slots if s.target is not None}
    if not roots:
        return
    backward = tangent_dependents(graph)
    outs = [a for a in tree_leaves(graph.output_node().args) if isinstance(a, fx.Node)]
    if not any(a in backward and a not in roots for a in outs):
        for b in reduces:
            for s in b.slots:
                s.target = None


def reduced_later(plan: BucketPlan) -> bool:
    """Whether ``plan`` is a compile region's reduce that ``reduce_later``
    issues and the registry waits after the graph: every parameter's shard
    known, its gradient a graph output only (HSDP's all-reduce too: a second
    stage, [Note: A region's reduce-scatter waited outside its graph])."""
    return (plan.kind == "reduce"
            and all(s.target is not None and s.root is not None and s.root.users
                    and all(u.op == "output" for u in s.root.users) for s in plan.slots))


def emit_reduce_later(b: NodeBuilder, plan: BucketPlan, grads: list[fx.Node], kept: list[fx.Node | None],
                      specs: list[ShardSpec]) -> None:
    """``plan``'s ``compiled_fsdp::reduce_later`` on its full gradients ``grads``
    and the gradients ``kept`` from micro-batches without sync."""
    later = ReduceLater(
        grads=grads, kept=kept, targets=[s.target for s in plan.slots], full_shapes=joined_shapes(specs),
        ndims=[len(s.full_shape) for s in specs], local_rows=[s.args.local_rows for s in plan.slots],
        group_name=plan.group_name, world_size=plan.world_size, reduce_by_all_to_all=plan.by_all_to_all,
        divide_factor=plan.slots[0].args.divide_factor, replicate_group_name=plan.slots[0].args.replicate_group_name,
        replicas=plan.slots[0].args.replicas)
    b(ReduceLater.op().default, *later.values().values())
