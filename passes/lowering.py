"""Lowering: marker ops -> one bucketed functional collective per module.

[Note: Bucket layout]
For one fully sharded module (``module_key``) with params sorted by
``param_index``, the all-gather input is ``cat([shard_i.reshape(-1)])`` of
length T; the output ``[N*T]`` is viewed ``[N, T]`` and param i is
``out[:, off_i:off_i+n_i].reshape(padded_d0_i, *rest)[:d0_i]``. The
reduce-scatter input is every full grad zero-padded to ``padded_d0_i``,
viewed ``[N, n_i]``, concatenated along dim 1 and flattened; after the SUM
reduce-scatter (on gloo an all-to-all and a sum over ranks, see [Note:
Reduce-scatter on gloo] in compiled_fsdp/_reduce.py) the ``[T]`` result is divided by N
and split by ``n_i``. The
eager runtime uses the same layout, so results are bitwise identical.

[Note: Duplicate markers]
Dynamo emits one ``unshard`` per parameter *read*, so one param can have
several markers (read twice, module called twice, tied weight). They share
the shard input and collapse onto one bucket slot. On the backward side each
marker produced a ``reduce_grad`` and AOTAutograd summed their outputs with
``aten.add``; we instead sum the full grads first (graph order) and reduce
once, which is what the eager runtime does (autograd accumulates into the
unsharded grad before its reduce-scatter). The ``add`` tree is removed.

[Note: Fallback per module]
When a module's markers cannot be bucketed (symbolic shapes, mixed dtypes,
inconsistent arguments, a grad that escapes the accumulation tree), that
module's markers are left in place: their eager implementations are correct
collectives, just unbucketed. The report lists the reason.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.fx as fx

from compiled_fsdp._reduce import reduce_by_all_to_all

from .bucketing import merge_small_buckets
from .config import overlap
from ._graph import (
    META_KEY,
    MarkerArgs,
    NodeBuilder,
    erase_nodes,
    is_reduce_grad,
    is_unshard,
    node_order,
    parse_marker,
    stable_topological_sort,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Metadata copied from the marker onto the nodes that replace it, so the
# partitioner keeps forward/backward placement (``partitioner_tag``) and
# debug info (stack traces, module stacks).
_COPIED_META = (
    "partitioner_tag", "seq_nr", "stack_trace", "autograd_backward", "nn_module_stack",
    "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack",
)


@dataclasses.dataclass
class Slot:
    """One parameter in a bucket, with every marker that refers to it."""

    args: MarkerArgs
    markers: list[fx.Node]  # graph order
    inputs: list[fx.Node]  # marker tensor inputs, same order
    acc_nodes: list[fx.Node] = dataclasses.field(default_factory=list)  # reduce only
    root: fx.Node | None = None  # reduce only: node whose uses get the shard grad


@dataclasses.dataclass
class BucketPlan:
    kind: str  # "gather" | "reduce"
    module_key: int
    group_name: str
    world_size: int
    reshard_after_forward: bool | None
    slots: list[Slot]  # sorted by (module order in the bucket, param_index)
    # Every module in the bucket; more than one after bucketing merged small ones.
    module_keys: list[int] = dataclasses.field(default_factory=list)

    @property
    def total_numel(self) -> int:
        return sum(s.args.spec.shard_numel for s in self.slots)


@dataclasses.dataclass
class LoweringPlan:
    buckets: list[BucketPlan]
    skipped: list[tuple[str, int, str]]  # (kind, module_key, reason)


@dataclasses.dataclass
class BucketReport:
    kind: str
    module_key: int
    group_name: str
    world_size: int
    param_indices: list[int]
    module_keys: list[int]
    markers_replaced: int
    numel: int
    reshard_after_forward: bool | None


@dataclasses.dataclass
class LoweringReport:
    buckets: list[BucketReport] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    nodes_moved: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.buckets)

    def count(self, kind: str) -> int:
        return sum(1 for b in self.buckets if b.kind == kind)


class _Skip(Exception):
    pass


def _find_accumulation(slot: Slot) -> None:
    """Finds the ``aten.add`` tree that sums this slot's reduce_grad outputs
    and its single root (see [Note: Duplicate markers])."""
    members = dict.fromkeys(slot.markers)
    if len(slot.markers) > 1:
        graph = slot.markers[0].graph
        for n in graph.nodes:  # graph order; acc adds follow their operands
            if (
                n.op == "call_function"
                and n.target is aten.add.Tensor
                and len(n.args) == 2
                and not n.kwargs
                and all(isinstance(a, fx.Node) and a in members for a in n.args)
            ):
                members[n] = None
                slot.acc_nodes.append(n)
    roots = [m for m in members if any(u not in members for u in m.users)]
    if len(roots) != 1:
        raise _Skip(
            f"param {slot.args.param_index}: reduce_grad outputs reach {len(roots)} "
            "consumers outside their accumulation tree"
        )
    slot.root = roots[0]


def _group_markers(
    graph: fx.Graph, kind: str
) -> tuple[dict[int, list[fx.Node]], list[tuple[str, int, str]]]:
    pred = is_unshard if kind == "gather" else is_reduce_grad
    by_module: dict[int, list[fx.Node]] = defaultdict(list)
    skipped: list[tuple[str, int, str]] = []
    for n in graph.nodes:
        if not pred(n):
            continue
        try:
            _, a = parse_marker(n)
        except ValueError as e:
            key = n.args[4] if len(n.args) > 4 and isinstance(n.args[4], int) else -1
            skipped.append((kind, key, str(e)))
            by_module.pop(key, None)
            continue
        by_module[a.module_key].append(n)
    bad = {k for (_, k, _) in skipped}
    return {k: v for k, v in by_module.items() if k not in bad}, skipped


def _shard_source(node: fx.Node) -> object:
    """What a gather marker's input reads. A rank whose DTensor shard has fewer
    rows than the common shard shape pads it at every read (see [Note:
    Parameters are DTensors] in compiled_fsdp/_param.py): such reads of one
    shard are one source."""
    if node.target is aten.constant_pad_nd.default:
        return ("pad", node.args[0], tuple(node.args[1]))
    return node


def _plan_bucket(kind: str, module_key: int, markers: list[fx.Node]) -> BucketPlan:
    parsed = [parse_marker(m) for m in markers]
    first = parsed[0][1]
    slots: dict[int, Slot] = {}
    for m, (inp, a) in zip(markers, parsed):
        if a.bucket_signature() != first.bucket_signature():
            raise _Skip(f"mixed groups {a.bucket_signature()} vs {first.bucket_signature()}")
        if a.reshard_after_forward != first.reshard_after_forward:
            raise _Skip("inconsistent reshard_after_forward")
        slot = slots.get(a.param_index)
        if slot is None:
            slots[a.param_index] = Slot(args=a, markers=[m], inputs=[inp])
            continue
        if a != slot.args:
            raise _Skip(f"param {a.param_index}: markers disagree on arguments")
        if kind == "gather" and _shard_source(inp) != _shard_source(slot.inputs[0]):
            raise _Skip(f"param {a.param_index}: markers read different shard nodes")
        slot.markers.append(m)
        slot.inputs.append(inp)
    ordered = [slots[k] for k in sorted(slots)]
    dtypes = {str(s.inputs[0].meta["val"].dtype) for s in ordered}
    if len(dtypes) != 1:
        raise _Skip(f"mixed dtypes {sorted(dtypes)} in one bucket")
    for s in ordered:
        val = s.inputs[0].meta["val"]
        want = s.args.spec.shard_shape if kind == "gather" else s.args.full_shape
        if tuple(val.shape) != tuple(want):
            raise _Skip(f"param {s.args.param_index}: input shape {tuple(val.shape)} != {want}")
        if kind == "reduce":
            _find_accumulation(s)
    return BucketPlan(
        kind=kind,
        module_key=module_key,
        group_name=first.group_name,
        world_size=first.world_size,
        reshard_after_forward=first.reshard_after_forward,
        slots=ordered,
        module_keys=[module_key],
    )


def _combine(group: list[BucketPlan]) -> BucketPlan:
    """One bucket for several modules' slots (see [Note: Bucket threshold])."""
    head = group[0]
    return dataclasses.replace(
        head,
        module_key=min(b.module_key for b in group),
        slots=[s for b in group for s in b.slots],
        module_keys=[k for b in group for k in b.module_keys],
    )


def plan_lowering(gm: fx.GraphModule, bucket_bytes: int | None = None) -> LoweringPlan:
    """Groups the markers of ``gm`` into one gather bucket and one reduce
    bucket per module_key, then merges buckets smaller than ``bucket_bytes``
    (default ``config.overlap.bucket_bytes``) with a neighbour. Reads the
    graph only."""
    if bucket_bytes is None:
        bucket_bytes = overlap.bucket_bytes
    buckets: list[BucketPlan] = []
    skipped: list[tuple[str, int, str]] = []
    for kind in ("gather", "reduce"):
        groups, bad = _group_markers(gm.graph, kind)
        skipped.extend(bad)
        planned = []
        for key in sorted(groups):
            try:
                planned.append(_plan_bucket(kind, key, groups[key]))
            except _Skip as e:
                skipped.append((kind, key, str(e)))
        buckets.extend(merge_small_buckets(gm.graph, planned, bucket_bytes, _combine))
    return LoweringPlan(buckets=buckets, skipped=skipped)


def _copied_meta(src: fx.Node, plan: BucketPlan) -> dict:
    meta = {k: src.meta[k] for k in _COPIED_META if k in src.meta}
    meta[META_KEY] = {
        "role": f"{plan.kind}_chain",
        "module_key": plan.module_key,
        "module_keys": list(plan.module_keys),
        "reshard_after_forward": plan.reshard_after_forward,
    }
    return meta


def _apply_gather(graph: fx.Graph, plan: BucketPlan) -> None:
    order = node_order(graph)
    first_marker = min((m for s in plan.slots for m in s.markers), key=order.__getitem__)
    n_ranks = plan.world_size
    b = NodeBuilder(graph, _copied_meta(first_marker, plan))
    with graph.inserting_before(first_marker):
        flats = []
        for s in plan.slots:
            shard = s.inputs[0]
            if not shard.meta["val"].is_contiguous():
                shard = b(aten.clone.default, shard, memory_format=torch.contiguous_format)
            flats.append(b(aten.view.default, shard, [s.args.spec.shard_numel]))
        cat = b(aten.cat.default, flats) if len(flats) > 1 else flats[0]
        gathered = b(c10d.all_gather_into_tensor.default, cat, n_ranks, plan.group_name)
        waited = b(c10d.wait_tensor.default, gathered)
        out2d = b(aten.view.default, waited, [n_ranks, plan.total_numel])
        off = 0
        for s in plan.slots:
            a = s.args
            piece = b(aten.slice.Tensor, out2d, 1, off, off + a.spec.shard_numel)
            off += a.spec.shard_numel
            if not piece.meta["val"].is_contiguous():
                piece = b(aten.clone.default, piece, memory_format=torch.contiguous_format)
            full = b(aten.view.default, piece, [a.spec.padded_dim0, *a.spec.rest])
            if a.spec.padded_dim0 != a.spec.dim0:
                full = b(aten.slice.Tensor, full, 0, 0, a.spec.dim0)
            if len(a.full_shape) == 0:
                full = b(aten.view.default, full, [])
            for m in s.markers:
                m.replace_all_uses_with(full)
    erase_nodes(graph, [m for s in plan.slots for m in s.markers])


def _apply_reduce(graph: fx.Graph, plan: BucketPlan) -> None:
    order = node_order(graph)
    last_marker = max((m for s in plan.slots for m in s.markers), key=order.__getitem__)
    n_ranks = plan.world_size
    b = NodeBuilder(graph, _copied_meta(last_marker, plan))
    with graph.inserting_before(last_marker):
        pieces = []
        for s in plan.slots:
            a = s.args
            g = s.inputs[0]
            for other in s.inputs[1:]:  # graph order of markers
                g = b(aten.add.Tensor, g, other)
            if not g.meta["val"].is_contiguous():
                g = b(aten.clone.default, g, memory_format=torch.contiguous_format)
            if len(a.full_shape) == 0:
                g = b(aten.view.default, g, [1])
            pad = a.spec.padded_dim0 - a.spec.dim0
            if pad:
                g = b(aten.constant_pad_nd.default, g, [0, 0] * (len(a.spec.rest)) + [0, pad])
            pieces.append(b(aten.view.default, g, [n_ranks, a.spec.shard_numel]))
        cat = b(aten.cat.default, pieces, 1) if len(pieces) > 1 else pieces[0]
        flat = b(aten.view.default, cat, [n_ranks * plan.total_numel])
        if reduce_by_all_to_all(plan.group_name):  # See [Note: Reduce-scatter on gloo].
            splits = [plan.total_numel] * n_ranks
            a2a = b(c10d.all_to_all_single.default, flat, splits, splits, plan.group_name)
            rows = b(aten.view.default, b(c10d.wait_tensor.default, a2a), [n_ranks, plan.total_numel])
            summed = b(aten.sum.dim_IntList, rows, [0])
        else:
            rs = b(c10d.reduce_scatter_tensor.default, flat, "sum", n_ranks, plan.group_name)
            summed = b(c10d.wait_tensor.default, rs)
        avg = b(aten.div.Tensor, summed, n_ranks)
        off = 0
        results = []
        for s in plan.slots:
            a = s.args
            piece = b(aten.slice.Tensor, avg, 0, off, off + a.spec.shard_numel)
            off += a.spec.shard_numel
            results.append(b(aten.view.default, piece, list(a.spec.shard_shape)))
    dead: list[fx.Node] = []
    for s, res in zip(plan.slots, results):
        assert s.root is not None
        s.root.replace_all_uses_with(res)
        dead.extend(s.markers)
        dead.extend(s.acc_nodes)
    erase_nodes(graph, dead)


def apply_lowering(gm: fx.GraphModule, plan: LoweringPlan) -> LoweringReport:
    """Rewrites ``gm`` in place following ``plan``."""
    report = LoweringReport(skipped=list(plan.skipped))
    if not plan.buckets:
        return report
    for bucket in plan.buckets:
        if bucket.kind == "gather":
            _apply_gather(gm.graph, bucket)
        else:
            _apply_reduce(gm.graph, bucket)
        report.buckets.append(
            BucketReport(
                kind=bucket.kind,
                module_key=bucket.module_key,
                group_name=bucket.group_name,
                world_size=bucket.world_size,
                param_indices=[s.args.param_index for s in bucket.slots],
                module_keys=list(bucket.module_keys),
                markers_replaced=sum(len(s.markers) for s in bucket.slots),
                numel=bucket.total_numel,
                reshard_after_forward=bucket.reshard_after_forward,
            )
        )
    # Inserting a reduce bucket at its last marker can leave a consumer of an
    # earlier grad before it; a stable sort fixes that with minimal motion.
    report.nodes_moved = stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return report


def lower_markers(gm: fx.GraphModule) -> LoweringReport:
    """Plan + apply in one call."""
    return apply_lowering(gm, plan_lowering(gm))
