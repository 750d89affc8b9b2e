"""Lowering of the gathers handed from one block's graph to the next (see
[Note: Gathers handed to the next block's graph] in
compiled_fsdp/compile/entry.py).

A block compiled on its own has up to four kinds of handoff nodes in its joint
graph, each lowered with the layout functions the eager runtime uses ([Note:
Bucket layout]), so the results stay bitwise the eager runtime's:

* ``gather_next`` (forward): the next block's bucket, packed and gathered
  with no wait: the graph returns it for the next graph to wait on.
* ``reduce_next`` (backward): that bucket's gradient, which the next block's
  backward graph packed, cast to the reduce dtype, added to what was kept
  without sync and reduced; or, without sync, unpacked for the sinks.
* ``unshard`` markers reading a handed-in gather (``gathered``): one wait,
  then each parameter's columns. When the block reshards after forward, the
  backward part of the graph reads a re-gather from the block's own shards
  instead (kept out of the forward graph: collectives are never dead code),
  also through what the forward computed from the weights alone (``t(w)``):
  nothing derived from the handed-in buffer is saved. That re-gather is one
  ``regather`` op, which takes the gather prefetched when the backward began
  ([Note: Backward re-gathers prefetched across graphs] in
  compiled_fsdp/core/registry.py). A block that keeps its parameters reads the
  handed-in gather throughout.
* their ``reduce_grad`` markers (backward): the block's gradients, packed in
  the gather's layout (the gradient of the handed-in buffer) instead of
  reduced: the issuer's ``reduce_next`` reduces them.

A handoff the plan cannot lower keeps its nodes, whose eager implementations
are correct; the report says why.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compiled_fsdp.core.layout import (
    ShardSpec,
    cast,
    joined_shapes,
    reduce_input,
    split_specs,
    unpack_gathered,
)
from compiled_fsdp.core.marker import ENTRY_KEY, NEXT_KEY, GatherNext, ReduceGrad, ReduceNext, Regather, Unshard

from ._emit import emit_gather, emit_pack_grads, emit_reduced, emit_unpack
from .graph import (
    ChainTag,
    MarkerArgs,
    NodeBuilder,
    Role,
    accumulation_root,
    chain_meta,
    erase_nodes,
    is_gather_next,
    is_reduce_grad,
    is_reduce_next,
    is_unshard,
    marker_gathered,
    node_order,
    parse_marker,
    tangent_dependents,
    through_identity_views,
)
from .units import Unit

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class HandedIn:
    """A handed-in gather this graph reads: its reads per parameter, and the
    ``reduce_grad`` markers that give it its gradient."""

    gathered: fx.Node
    reads: dict[int, list[fx.Node]]  # param index -> unshard markers, graph order
    args: dict[int, MarkerArgs]
    grads: list[fx.Node] = dataclasses.field(default_factory=list)

    @property
    def specs(self) -> list[ShardSpec]:
        return [self.args[i].spec for i in sorted(self.reads)]

    @property
    def offsets(self) -> list[int]:
        return [self.args[i].bucket_offset for i in sorted(self.reads)]


@dataclasses.dataclass
class HandoffPlan:
    issues: list[fx.Node] = dataclasses.field(default_factory=list)  # gather_next
    reduces: list[fx.Node] = dataclasses.field(default_factory=list)  # reduce_next
    handed_in: list[HandedIn] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)


def is_handoff_marker(node: fx.Node) -> bool:
    """Whether ``node`` is an ``unshard``/``reduce_grad`` marker of a handed-in
    gather (the bucket lowering leaves those to this pass)."""
    if not (is_unshard(node) or is_reduce_grad(node)):
        return False
    marker = Unshard if is_unshard(node) else ReduceGrad
    return bool(marker.bind(node.args, dict(node.kwargs)).bucket_numel)


def plan_handoff(graph: fx.Graph) -> HandoffPlan:
    """Finds the handoff nodes of ``graph``; reads the graph only."""
    plan = HandoffPlan()
    by_gathered: dict[fx.Node, HandedIn] = {}
    grads: dict[int, list[fx.Node]] = defaultdict(list)
    for n in graph.nodes:
        if is_gather_next(n):
            plan.issues.append(n)
        elif is_reduce_next(n):
            plan.reduces.append(n)
        elif is_handoff_marker(n):
            try:
                _, a = parse_marker(n)
            except ValueError as e:
                plan.skipped.append(("handoff", ENTRY_KEY, str(e)))
                continue
            if is_reduce_grad(n):
                grads[a.bucket_numel].append(n)
                continue
            gathered = marker_gathered(n)
            assert gathered is not None
            h = by_gathered.setdefault(gathered, HandedIn(gathered, {}, {}))
            h.reads.setdefault(a.param_index, []).append(n)
            h.args.setdefault(a.param_index, a)
    for h in by_gathered.values():
        numel = next(iter(h.args.values())).bucket_numel
        # (one handed-in gather per graph: its gradient markers are those of its width)
        mine = grads.pop(numel, []) if len(by_gathered) == 1 else []
        plan.handed_in.append(dataclasses.replace(h, grads=mine))
    for numel in grads:
        plan.skipped.append(("handoff", ENTRY_KEY, f"gradient markers of a {numel}-wide bucket "
                             "no handed-in gather of this graph has"))
    return plan


def handed_in_units(plan: HandoffPlan) -> list[Unit]:
    """The unit each handed-in gather is (for ``explain()`` and the dumps):
    the whole module, gathered and reduced by the graph before it."""
    out = []
    for h in plan.handed_in:
        a = h.args[min(h.args)]
        nbytes = a.bucket_numel * a.world_size * (a.param_dtype or h.gathered.meta["val"].dtype).itemsize
        out.append(Unit(a.module_key, 0, tuple(sorted(h.reads)), ("<compiled module>",), nbytes,
                        a.reshards, "handed over: gathered by the graph of the module before it, "
                        "reduced in that graph's backward"))
    return out


def _meta(src: fx.Node, role: Role, module_key: int, reshard: bool | None) -> dict:
    return chain_meta(src, ChainTag(role=role, module_key=module_key, unit=0, units=((module_key, 0),),
                                    reshard_after_forward=reshard))


def _apply_issue(graph: fx.Graph, n: fx.Node) -> None:
    a = GatherNext.parse(n)
    shards = list(a.shards)
    specs = split_specs(a.full_shapes, [s.meta["val"].dim() for s in shards], a.world_size, a.divide_factor,
                        a.replicas)
    b = NodeBuilder(graph, _meta(n, "handoff_issue", NEXT_KEY, None))
    with graph.inserting_before(n):
        gathered = emit_gather(b, shards, specs, [a.param_dtype] * len(specs), a.world_size, a.group_name,
                               live=a.live)
    n.replace_all_uses_with(gathered)
    graph.erase_node(n)


def _apply_reduce(graph: fx.Graph, n: fx.Node) -> None:
    a = ReduceNext.parse(n)
    specs = split_specs(a.full_shapes, a.ndims, a.world_size, a.divide_factor, a.replicas)
    b = NodeBuilder(graph, _meta(n, "reduce_chain" if a.sync else "keep_chain", NEXT_KEY, None))
    with graph.inserting_before(n):
        if not a.sync:  # the full gradients, for the sinks
            results = unpack_gathered(b, cast(b, a.grad, a.reduce_dtype), specs)
        else:
            kept = list(a.kept)
            kept_flat = emit_pack_grads(b, kept, specs) if any(k is not None for k in kept) else None
            flat = reduce_input(b, a.grad, kept_flat, a.reduce_dtype)
            results = emit_reduced(b, flat, specs, list(a.local_rows), [a.grad_dtype] * len(specs), a.group_name,
                                   a.reduce_by_all_to_all, a.replicate_group_name, live=a.live)
    for u in list(n.users):
        assert u.target is operator.getitem, u
        u.replace_all_uses_with(results[u.args[1]])
        graph.erase_node(u)
    graph.erase_node(n)


def _apply_reads(graph: fx.Graph, h: HandedIn, backward: set[fx.Node]) -> None:
    order = node_order(graph)
    indices = sorted(h.reads)
    markers = [m for i in indices for m in h.reads[i]]
    first = min(markers, key=order.__getitem__)
    args = h.args[indices[0]]
    reshard = args.reshards
    specs, total = h.specs, args.bucket_numel
    b = NodeBuilder(graph, _meta(first, "handoff_chain", args.module_key, reshard))
    with graph.inserting_before(first):
        waited = b(c10d.wait_tensor.default, h.gathered)
        fulls = dict(zip(indices, emit_unpack(b, waited, specs, h.offsets, total)))
    again: dict[int, fx.Node] = {}
    rb = None
    if reshard:  # the backward re-gathers from the shards (see the module docstring)
        shards = [through_identity_views(parse_marker(h.reads[i][0])[0]) for i in indices]
        meta = _meta(first, "gather_chain", args.module_key, True)
        # (collectives are impure: left to the partitioner, an unused copy of
        # the chain would stay in the forward graph)
        meta["partitioner_tag"] = "must_be_in_backward"
        rb = NodeBuilder(graph, meta)
        with graph.inserting_before(first):
            # (taken from the gather prefetched when the graph's backward began,
            # if one was: [Note: Backward re-gathers prefetched across graphs])
            g = rb(Regather.op().default, shards, joined_shapes(specs), args.group_name,
                   args.world_size, args.module_key, args.param_dtype, backward=True)
            again = dict(zip(indices, emit_unpack(rb, g, specs)))
    for i in indices:
        for m in h.reads[i]:
            m.replace_all_uses_with(fulls[i])
    if rb is not None and not _read_again_in_backward(graph, {fulls[i]: again[i] for i in indices}, backward):
        erase_nodes(graph, rb.created)  # (no backward use: a collective is never dead code)
    inputs = [parse_marker(m)[0] for m in markers]
    erase_nodes(graph, markers)
    for inp in inputs:  # the reads' own views of the shards, now dead
        while inp.op == "call_function" and not inp.users:
            inp, dead = inp.args[0], inp
            graph.erase_node(dead)


def _read_again_in_backward(graph: fx.Graph, again: dict[fx.Node, fx.Node], backward: set[fx.Node]) -> bool:
    """Backward uses of the handed-in weights (the keys of ``again``) read
    copies computed from the re-gathered weights instead; so do backward uses
    of what the forward computed from them, either from the weights alone (a
    transpose, a cast) or from weights and activations where activation
    checkpointing recomputes the value in backward (``_recomputed``: a norm's
    scaled output). Left as they were, the partitioner would save for the
    backward views of the handed-in buffer, or the whole buffer to recompute
    from (tests/test_chunked_loss.py::test_torchtitan_chunked_loss[blocks+flag]).
    A random or impure op is never copied (a copy would draw anew: dropout's
    mask must be the forward's); the copies read its forward value.
    Returns whether the backward reads the weights at all."""
    weight_only, derived = set(again), set(again)
    for n in graph.nodes:
        if (n.op != "call_function" or n in backward or n in derived or not n.all_input_nodes
                or not _replayable(n)):
            continue
        if all(a in weight_only for a in n.all_input_nodes):
            weight_only.add(n)
            derived.add(n)
        elif _recomputed(n) and any(a in derived for a in n.all_input_nodes):
            derived.add(n)
    order = node_order(graph)
    copies = dict(again)

    def copy_of(v: fx.Node, before: fx.Node) -> fx.Node:
        if v not in copies:
            for a in v.all_input_nodes:
                if a in derived:
                    copy_of(a, before)
            with graph.inserting_before(before):
                copies[v] = graph.node_copy(v, lambda a: copies.get(a, a))
        return copies[v]

    read = False
    for v in sorted(derived, key=order.__getitem__):
        users = sorted((u for u in v.users if u in backward and u.op != "output"), key=order.__getitem__)
        if users:
            read = True
            c = copy_of(v, users[0])
            for u in users:
                u.replace_input_with(v, c)
    return read


def _replayable(n: fx.Node) -> bool:
    """Whether a copy of ``n`` computes what ``n`` did: neither impure nor random."""
    return not n.is_impure() and torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ())


def _recomputed(n: fx.Node) -> bool:
    """Whether activation checkpointing recomputes ``n`` in backward (its
    policy tag, as torch.utils.checkpoint's selective policy set it)."""
    return n.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _apply_grads(graph: fx.Graph, h: HandedIn) -> str | None:
    """Replaces the sum of the gradient markers with one pack; the reason when
    it cannot."""
    found = accumulation_root(h.grads)
    if found is None:
        return "the handed-in gather's gradient reaches several consumers"
    root, acc = found
    order = node_order(graph)
    last = max(h.grads, key=order.__getitem__)
    by_index: dict[int, list[fx.Node]] = defaultdict(list)
    for m in sorted(h.grads, key=order.__getitem__):
        by_index[parse_marker(m)[1].param_index].append(m)
    args = h.args[min(h.args)]
    indices = sorted(by_index)
    b = NodeBuilder(graph, _meta(last, "handoff_grad", args.module_key, None))
    with graph.inserting_before(last):
        grads = []
        for i in indices:
            g = parse_marker(by_index[i][0])[0]
            for other in by_index[i][1:]:
                g = b(torch.ops.aten.add.Tensor, g, parse_marker(other)[0])
            grads.append(g)
        specs = [parse_marker(by_index[i][0])[1].spec for i in indices]
        offsets = [parse_marker(by_index[i][0])[1].bucket_offset for i in indices]
        packed = emit_pack_grads(b, grads, specs, offsets, args.bucket_numel)
    root.replace_all_uses_with(packed)
    erase_nodes(graph, [*h.grads, *acc])
    return None


def apply_handoff(gm: fx.GraphModule, plan: HandoffPlan) -> tuple[list[str], list[tuple[str, int, str]]]:
    """Lowers ``plan`` in ``gm``'s graph; returns what it lowered ("issue",
    "reduce", "read", "grad", one per op or handed-in gather) and what it left
    in place, and why."""
    graph = gm.graph
    done: list[str] = []
    skipped = list(plan.skipped)
    for n in plan.issues:
        _apply_issue(graph, n)
        done.append("issue")
    for n in plan.reduces:
        _apply_reduce(graph, n)
        done.append("reduce")
    backward = tangent_dependents(graph)
    for h in plan.handed_in:
        if h.grads:
            reason = _apply_grads(graph, h)
            if reason is not None:
                skipped.append(("handoff", ENTRY_KEY, reason))
            else:
                done.append("grad")
        _apply_reads(graph, h, backward)
        done.append("read")
    return done, skipped
