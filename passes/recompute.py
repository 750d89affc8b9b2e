"""Recompute tagging: reshard-after-forward under compile, per unit.

[Note: Reshard after forward through recompute tags]
After lowering, each unit's forward gather is a chain
``view(shard) -> cat -> all_gather_into_tensor -> wait_tensor -> view ->
slice -> clone -> view -> slice``, recorded in
``ChainTag.role == "gather_chain"`` (passes/graph.py), one chain per unit
(passes/units.py). We tag *every* node of the chain:

* ``reshard_after_forward=True``: ``CheckpointPolicy.MUST_RECOMPUTE``. The
  min-cut partitioner then saves only the chain's inputs (the shards, which
  are graph inputs anyway) and re-runs cat + all-gather + views in the
  backward graph. Tagging only the collective is not enough: an untagged view
  after it would be saved instead, keeping the unsharded weight alive between
  forward and backward.
* ``reshard_after_forward=False``: ``CheckpointPolicy.MUST_SAVE``: nothing in
  the chain may be recomputed, so backward reads the saved unsharded params.

The partitioner (torch 2.13 ``force_save_collectives``) forces every
``_c10d_functional`` node to MUST_SAVE *unless* it is already tagged
MUST_RECOMPUTE, so tagging the collective itself is what allows the re-gather.

[Note: ac_graph_id]
``cleanup_recompute_tags`` turns a MUST_RECOMPUTE node into MUST_SAVE when one
of its users is MUST_RECOMPUTE with a *larger* ``ac_graph_id`` (the boundary
between two consecutive user checkpoint regions). A gathered weight used
inside a user's ``torch.utils.checkpoint`` region would hit that rule and get
saved unsharded. Our chains therefore use an ``ac_graph_id`` larger than any
id Dynamo assigns to user regions (they count up from 1), so the rule never
fires on our nodes. All our chains share it; they never feed each other.

Unshard markers that lowering left in place (see [Note: Fallback per module])
are tagged the same way, so fallback modules still reshard after forward.

[Note: Layout copies of a gathered parameter are recomputed]
What the traced module reads can be a copy of the chain's last view, not the
view itself: a parameter sharded on dim ``d > 0`` is read as
``from_canonical(full).contiguous()`` (a permute and a clone: [Note: Shard
dims] in compiled_fsdp/runtime/param.py). The default partitioner saves every
untagged forward node that backward reads, so that clone, a full copy of the
weight, was saved for backward although its module reshards after forward
(and saved beside the unsharded weight when it does not). So the forward
nodes that only re-lay-out a tagged node (``is_layout_op`` in graph.py,
one tensor input)
are tagged ``MUST_RECOMPUTE`` too, whatever the chain's own policy: backward
recomputes the copy from the regathered (or saved) weight. Tested by
tests/test_shard_dim.py (nothing gathered is saved for backward).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .graph import chain_tag, is_layout_op, is_unshard, parse_marker, tangent_dependents

FSDP_AC_GRAPH_ID = 2**31 - 1


@dataclasses.dataclass
class TagPlan:
    # (node, policy) in graph order
    tags: list[tuple[fx.Node, CheckpointPolicy]]


@dataclasses.dataclass
class RecomputeReport:
    must_recompute: int = 0
    must_save: int = 0
    # Copies of a tagged node recomputed with it: [Note: Layout copies of a
    # gathered parameter are recomputed].
    layout_copies: int = 0
    # The gather buckets tagged (ChainTag.bucket, "<module_key>.<unit>"), or
    # "<module_key>" for markers the lowering left in place.
    buckets_recompute: list[str] = dataclasses.field(default_factory=list)
    buckets_save: list[str] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.must_recompute or self.must_save)


def _chain_info(node: fx.Node) -> tuple[str, bool] | None:
    tag = chain_tag(node)
    if tag is not None and tag.role == "gather_chain":
        return tag.bucket, bool(tag.reshard_after_forward)
    if tag is not None and tag.role == "post_forward_chain":
        return tag.bucket, True
    if tag is not None and tag.role == "post_forward_part":
        # What backward gathers again over the smaller group: saved (see
        # [Note: Resharding to a smaller group in graphs] in post_forward.py).
        return tag.bucket, False
    if tag is not None and tag.role == "handoff_chain" and not tag.reshard_after_forward:
        # A gather handed to a block that keeps its parameters: its backward reads
        # it. (One that reshards reads it in forward only: see passes/handoff.py.)
        return tag.bucket, False
    if is_unshard(node):
        try:
            _, a = parse_marker(node)
        except ValueError:
            return None
        return str(a.module_key), a.reshards
    return None


def _is_layout_copy(n: fx.Node, tagged: set[fx.Node]) -> bool:
    if not is_layout_op(n):
        return False
    tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return len(tensors) == 1 and tensors[0] in tagged


def plan_recompute_tags(gm: fx.GraphModule) -> TagPlan:
    tags: list[tuple[fx.Node, CheckpointPolicy]] = []
    tagged: set[fx.Node] = set()
    backward: set[fx.Node] | None = None
    for n in gm.graph.nodes:
        info = _chain_info(n)
        if info is not None:
            _, reshard = info
            tags.append((n, CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE))
            tagged.add(n)
        elif tagged and _is_layout_copy(n, tagged):
            backward = tangent_dependents(gm.graph) if backward is None else backward
            if n not in backward:
                tags.append((n, CheckpointPolicy.MUST_RECOMPUTE))
                tagged.add(n)
    return TagPlan(tags=tags)


def apply_recompute_tags(gm: fx.GraphModule, plan: TagPlan) -> RecomputeReport:
    report = RecomputeReport()
    recompute_keys: set[str] = set()
    save_keys: set[str] = set()
    for n, policy in plan.tags:
        n.meta["recompute"] = policy
        n.meta["ac_graph_id"] = FSDP_AC_GRAPH_ID
        tag = chain_tag(n)
        if tag is not None and tag.role == "post_forward_chain":
            # Run in backward only: [Note: Resharding to a smaller group in graphs] in post_forward.py.
            n.meta["partitioner_tag"] = "must_be_in_backward"
        info = _chain_info(n)
        if info is None:  # ([Note: Layout copies of a gathered parameter are recomputed])
            report.layout_copies += 1
            continue
        if policy == CheckpointPolicy.MUST_RECOMPUTE:
            report.must_recompute += 1
            recompute_keys.add(info[0])
        else:
            report.must_save += 1
            save_keys.add(info[0])
    report.buckets_recompute = sorted(recompute_keys)
    report.buckets_save = sorted(save_keys)
    return report


def tag_recompute(gm: fx.GraphModule) -> RecomputeReport:
    """Plan + apply in one call."""
    return apply_recompute_tags(gm, plan_recompute_tags(gm))
