"""Lowering: marker ops -> one bucketed functional collective per unit.

Each application's parameters are cut into units first ([Note: Units] in
units.py); a unit is one gather bucket and one reduce bucket, before the
bucketing merges small ones across applications ([Note: Bucket threshold]).

The bucket layout is [Note: Bucket layout] in compiled_fsdp/core/layout.py: the
lowering calls the same layout functions as the eager runtime, with its
``NodeBuilder`` as the emitter, so the compiled step's results are bitwise the
eager runtime's. The gradient bucket is summed by ``reduce_scatter_tensor`` (on
gloo by an all-to-all and a local sum, see [Note: Reduce-scatter on gloo] in
compiled_fsdp/core/comm.py).

[Note: Duplicate markers]
Dynamo emits one ``unshard`` per parameter *read*, so one param can have
several markers (read twice, module called twice, tied weight). They read the
same shard (each read may add its own shape-preserving ``view``:
``DTensor.to_local()``) and collapse onto one bucket slot. On the backward side each
marker produced a ``reduce_grad`` and AOTAutograd summed their outputs with
``aten.add`` (through shape-preserving views); we instead sum the full grads first (graph order) and reduce
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

from compiled_fsdp.core import copy_out
from compiled_fsdp.core.layout import cast, joined_shapes, reduce_input
from compiled_fsdp.core.marker import Regather

from ._emit import emit_gather, emit_gather_bytes, emit_pack_grads, emit_reduced, emit_unpack
from .bucketing import merge_small_buckets
from .buckets import BucketKind, BucketPlan, Slot, comm_dtype_of
from .config import overlap
from .graph import (
    ChainTag,
    NodeBuilder,
    accumulation_root,
    chain_meta,
    erase_nodes,
    is_reduce_grad,
    is_tangent,
    is_unshard,
    marker_kept,
    node_order,
    parse_marker,
    region_calls,
    return_none_for,
    stable_topological_sort,
    through_identity_views,
)
from .handoff import HandoffPlan, apply_handoff, handed_in_units, is_handoff_marker, plan_handoff
from .post_forward import backward_reads, gather_again, read_under_checkpoint
from .region_reduce import emit_reduce_later, keep_a_backward_output, reduced_later, region_shards
from .units import Unit, choose_units, slot_uses

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass
class LoweringPlan:
    buckets: list[BucketPlan]
    skipped: list[tuple[str, int, str]]  # (kind, module_key, reason)
    units: list[Unit] = dataclasses.field(default_factory=list)
    # See [Note: Gathers handed to the next block's graph] (handoff.py).
    handoff: HandoffPlan = dataclasses.field(default_factory=HandoffPlan)


@dataclasses.dataclass
class BucketReport:
    kind: BucketKind
    module_key: int
    group_name: str
    world_size: int
    param_indices: list[int]
    module_keys: list[int]
    unit: int
    units: list[tuple[int, int]]
    markers_replaced: int
    numel: int
    reshard_after_forward: bool | None


@dataclasses.dataclass
class LoweringReport:
    buckets: list[BucketReport] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    units: list[Unit] = dataclasses.field(default_factory=list)
    nodes_moved: int = 0
    # Handoff nodes lowered: "issue" (the next block's gather), "reduce" (its
    # gradient), "read" (this block's handed-in gather), "grad" (its gradient
    # packed for the issuer). See handoff.py.
    handoffs: list[str] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.buckets or self.handoffs)

    def count(self, kind: str) -> int:
        return sum(1 for b in self.buckets if b.kind == kind)


class _Skip(Exception):
    pass


def _find_accumulation(slot: Slot) -> None:
    """Finds the tree of ``aten.add`` (and shape-preserving views) that sums this
    slot's reduce_grad outputs, and its single root (see [Note: Duplicate
    markers])."""
    found = accumulation_root(slot.markers)
    if found is None:
        raise _Skip(f"param {slot.args.param_index}: reduce_grad outputs reach several "
                    "consumers outside their accumulation tree")
    slot.root, slot.acc_nodes = found


def _group_markers(
    graph: fx.Graph, kind: str
) -> tuple[dict[int, list[fx.Node]], list[tuple[str, int, str]]]:
    pred = is_unshard if kind == "gather" else is_reduce_grad
    by_module: dict[int, list[fx.Node]] = defaultdict(list)
    skipped: list[tuple[str, int, str]] = []
    for n in graph.nodes:
        if not pred(n) or is_handoff_marker(n):  # (handoff.py lowers those)
            continue
        try:
            _, a = parse_marker(n)
        except ValueError as e:
            if kind != "keep":  # (reported once, under its reduce)
                key = _marker_key(n)
                skipped.append((kind, key, str(e)))
                by_module.pop(key, None)
            continue
        if kind != "gather" and a.sync != (kind == "reduce"):
            continue
        by_module[a.module_key].append(n)
    bad = {k for (_, k, _) in skipped}
    return {k: v for k, v in by_module.items() if k not in bad}, skipped


def _marker_key(n: fx.Node) -> int:
    """The module key of a marker whose arguments do not parse (-1: unknown)."""
    names = [a.name for a in n.target._schema.arguments]
    bound = {**dict(zip(names, n.args)), **n.kwargs}
    key = bound.get("module_key")
    return key if isinstance(key, int) else -1


def _plan_bucket(kind: BucketKind, module_key: int, markers: list[fx.Node]) -> BucketPlan:
    parsed = [parse_marker(m) for m in markers]
    first = parsed[0][1]
    slots: dict[int, Slot] = {}
    for m, (inp, a) in zip(markers, parsed):
        if a.bucket_signature() != first.bucket_signature():
            raise _Skip(f"mixed groups {a.bucket_signature()} vs {first.bucket_signature()}")
        if (a.reshard_after_forward, a.post_forward) != (first.reshard_after_forward, first.post_forward):
            raise _Skip("inconsistent reshard_after_forward")
        slot = slots.get(a.param_index)
        if slot is None:
            slots[a.param_index] = Slot(args=a, markers=[m], inputs=[inp], kept=marker_kept(m))
            continue
        if a.static_values() != slot.args.static_values():
            raise _Skip(f"param {a.param_index}: markers disagree on arguments")
        if kind == "gather" and through_identity_views(inp) is not through_identity_views(slot.inputs[0]):
            raise _Skip(f"param {a.param_index}: markers read different shard nodes")
        if kind == "reduce" and marker_kept(m) is not slot.kept:
            raise _Skip(f"param {a.param_index}: markers add different kept gradients")
        slot.markers.append(m)
        slot.inputs.append(inp)
    ordered = [slots[k] for k in sorted(slots)]
    dtypes = {str(comm_dtype_of(kind, s)) for s in ordered}
    if len(dtypes) != 1 and (kind != "gather" or first.take_ahead or first.post_forward is not None):
        raise _Skip(f"mixed dtypes {sorted(dtypes)} in one bucket")
    for s in ordered:
        shape, spec = tuple(s.inputs[0].meta["val"].shape), s.args.spec
        want = (s.args.local_rows, *spec.rest) if kind == "gather" else s.args.full_shape
        if shape != want or s.args.local_rows > spec.shard_dim0:
            raise _Skip(f"param {s.args.param_index}: input shape {shape} != {want}")
        if kind != "gather":
            _find_accumulation(s)
    return BucketPlan(
        kind=kind,
        module_key=module_key,
        group_name=first.group_name,
        world_size=first.world_size,
        reshard_after_forward=None,  # gathers: set per unit by _by_unit
        slots=ordered,
        by_all_to_all=first.reduce_by_all_to_all,
        units=[(module_key, 0)],
        post_forward=first.post_forward,
    )


def _combine(group: list[BucketPlan]) -> BucketPlan:
    """One bucket for several modules' slots (see [Note: Bucket threshold])."""
    head = group[0]
    key, unit = min(u for b in group for u in b.units)
    return dataclasses.replace(
        head,
        module_key=key,
        unit=unit,
        slots=[s for b in group for s in b.slots],
        units=[u for b in group for u in b.units],
    )


def _plan_units(graph: fx.Graph, gathers: list[BucketPlan], bucket_bytes: int) -> list[Unit]:
    """The units of each application with a gather bucket; see [Note: Units]."""
    order = node_order(graph)
    first_reads = {p.module_key: [min(order[m] for m in s.markers) for s in p.slots] for p in gathers}
    if not overlap.units:
        return [Unit(p.module_key, 0, tuple(s.args.param_index for s in p.slots), ("<whole module>",), p.nbytes,
                     p.slots[0].args.reshards, "one unit: config.overlap.units is off")
                for p in gathers]

    # Per application: its parameters' uses, and where the others' are first read
    # (a compile region's call reads others' parameters too).
    regions = region_calls(graph)
    inputs = []
    for plan in gathers:
        size = {s.args.param_index: plan.slot_bytes(s) for s in plan.slots}
        uses = slot_uses({s.args.param_index: s.markers for s in plan.slots}, size.__getitem__, order)
        others = sorted([*regions, *(at for key, ats in first_reads.items() if key != plan.module_key for at in ats)])
        inputs.append((plan, uses, others))

    opening = _opening(gathers, first_reads)

    def choose(merge_below: int, largest: int | None, cut: int | None) -> list[Unit]:
        return [u for plan, uses, others in inputs for u in choose_units(
            plan.module_key, uses, plan.slots[0].args.outermost,
            bool(plan.slots[0].args.reshard_after_forward), merge_below, overlap.unit_max_bytes,
            others, largest, opening=plan.module_key == cut)]

    # "Small" is relative to the graph's largest unmerged piece (see [Note: Units]),
    # the opening block's taken whole (its cut merges by the threshold alone).
    largest = max((u.nbytes for u in choose(0, None, None)), default=0)
    return choose(bucket_bytes, largest, opening)


def _opening(gathers: list[BucketPlan], first_reads: dict[int, list[int]]) -> int | None:
    """The application cut as the step's opening block ([Note: The step's
    opening block cut by first use] in units.py): the nested one read first,
    where the root's parameters, one application, are read before it in this
    graph; a compile region's block, whose graph is the first block's too
    (``split_regions``); or None (blocks sharded with no root above them are
    roots each)."""
    if len(gathers) == 1 and gathers[0].slots[0].args.take_ahead and not gathers[0].slots[0].args.outermost:
        # ([Note: Every compile region cut as the opening block] in units.py)
        return gathers[0].module_key if overlap.split_regions else None
    if not overlap.split_opening:
        return None
    first = {p.module_key: min(first_reads[p.module_key]) for p in gathers}
    roots = [first[p.module_key] for p in gathers if p.slots[0].args.outermost]
    nested = sorted((first[p.module_key], p.module_key) for p in gathers if not p.slots[0].args.outermost)
    if len(roots) != 1 or not nested or roots[0] > nested[0][0]:
        return None
    return nested[0][1]


def _by_unit(plan: BucketPlan, units: list[Unit]) -> list[BucketPlan]:
    """``plan`` cut into one bucket per unit of its application (a parameter
    no unit holds stays in unit 0)."""
    mine = [u for u in units if u.module_key == plan.module_key]
    if not mine:
        return [plan]
    where = {i: u for u in mine for i in u.param_indices}
    out = []
    for u in mine:
        slots = [s for s in plan.slots if where.get(s.args.param_index, mine[0]) is u]
        if slots:
            out.append(dataclasses.replace(
                plan, slots=slots, unit=u.index, units=[(plan.module_key, u.index)],
                reshard_after_forward=u.reshard_after_forward if plan.kind == "gather" else None))
    return out


def plan_lowering(gm: fx.GraphModule, bucket_bytes: int | None = None) -> LoweringPlan:
    """Groups the markers of ``gm`` by module_key, cuts each application into
    units ([Note: Units]), makes one gather bucket and one reduce bucket per
    unit, then merges buckets smaller than ``bucket_bytes`` (default
    ``config.overlap.bucket_bytes``) with a neighbour. Reads the graph only."""
    if bucket_bytes is None:
        bucket_bytes = overlap.bucket_bytes
    buckets: list[BucketPlan] = []
    skipped: list[tuple[str, int, str]] = []
    units: list[Unit] = []
    for kind in ("gather", "reduce", "keep"):
        groups, bad = _group_markers(gm.graph, kind)
        skipped.extend(bad)
        planned = []
        for key in sorted(groups):
            try:
                planned.append(_plan_bucket(kind, key, groups[key]))
            except _Skip as e:
                skipped.append((kind, key, str(e)))
        if kind == "gather":
            units = _plan_units(gm.graph, planned, bucket_bytes)
            read_shards = region_shards(planned)
        else:
            for bucket in planned:
                for s in bucket.slots:
                    s.target = read_shards.get((bucket.module_key, s.args.param_index))
        planned = [b for p in planned for b in _by_unit(p, units)]
        if kind == "reduce":
            keep_a_backward_output(gm.graph, planned)
        # (a kept gradient is not communicated: nothing to merge)
        buckets.extend(planned if kind == "keep" else
                       merge_small_buckets(gm.graph, planned, bucket_bytes, _combine))
    handoff = plan_handoff(gm.graph)
    units = units + handed_in_units(handoff)
    return LoweringPlan(buckets=buckets, skipped=skipped, units=units, handoff=handoff)


def _copied_meta(src: fx.Node, plan: BucketPlan, role: str | None = None) -> dict:
    return chain_meta(src, ChainTag(
        role=role or f"{plan.kind}_chain", module_key=plan.module_key, unit=plan.unit,
        units=tuple(plan.units), reshard_after_forward=plan.reshard_after_forward,
    ))


# [Note: CPU offload in graphs]
# Under FSDP2's ``CPUOffloadPolicy`` ([Note: CPU offload] in
# runtime/policy.py) a whole-model graph reads the shard where it lives, on
# the CPU: its ``unshard`` says which compute device the gathered parameter
# is on (``device``), and its ``reduce_grad`` the device the reduced rows go
# back to. The lowering copies each shard to the device as the first step of
# its bucket's pack (``to_device`` in core/layout.py, shared with the
# markers' eager code), so the copy belongs to the gather's issue chain and
# the schedule issues it with the gather, ahead of the compute it overlaps
# ([Note: Scheduling rules] in schedule.py); and it copies each reduced
# gradient back as the last step of its reduce's tail, after the wait. A
# bucket never mixes offloaded and resident parameters (``device`` is part
# of the markers' bucket signature). In a compile region the gather is an
# opaque op (``regather``, and the ``issue_ahead`` the outer graph issues it
# with: [Note: Gathers issued ahead of compile regions] in
# compile/regions.py): it takes the CPU shards, keyed by them as always, and
# names the device, and its eager code copies them as the first step of the
# same pack, on the gather stream ([Note: Gathers issued by ops on the
# gather stream] in compiled_fsdp/core/ops.py). A block compiled on its own gathers it in the eager runtime
# ([Note: Extension groups run the eager runtime] in compile/path.py). On a
# machine without an accelerator the compute device is the CPU and no copy
# is emitted. Tested by tests/test_offload.py (the graphs and regions on the
# CPU) and tests/test_offload_fx.py::test_offloaded_shards_copied_in_the_gather_chain
# and ::test_offloaded_region_read_regathers_on_the_device (graphs traced for
# a CUDA device on fake tensors).


def _apply_gather(graph: fx.Graph, plan: BucketPlan) -> None:
    order = node_order(graph)
    first_marker = min((m for s in plan.slots for m in s.markers), key=order.__getitem__)
    specs = [s.args.spec for s in plan.slots]
    # The shard each slot's reads alias (a graph input), defined before any marker.
    sources = [through_identity_views(s.inputs[0]) for s in plan.slots]
    b = NodeBuilder(graph, _copied_meta(first_marker, plan))
    again = None
    with graph.inserting_before(first_marker):
        if plan.slots[0].args.take_ahead and plan.post_forward is None:
            # (taken from a gather issued ahead, if one was: [Note: Gathers
            # issued ahead of compile regions] in compiled_fsdp/compile/regions.py)
            waited = b(Regather.op().default, sources, joined_shapes(specs), plan.group_name, plan.world_size,
                       plan.module_key, plan.slots[0].args.param_dtype, device=plan.device)
        elif plan.as_bytes:
            waited = None
            fulls = emit_gather_bytes(b, sources, specs, [comm_dtype_of("gather", s) for s in plan.slots],
                                      plan.world_size, plan.group_name, plan.device)
        else:
            gathered = emit_gather(b, sources, specs, [s.args.param_dtype for s in plan.slots],
                                   plan.world_size, plan.group_name, device=plan.device)
            waited = b(c10d.wait_tensor.default, gathered)
        if waited is not None:
            fulls = emit_unpack(b, waited, specs)
        if plan.post_forward is not None and plan.reshard_after_forward and any(map(is_tangent, graph.nodes)) \
                and not read_under_checkpoint([m for s in plan.slots for m in s.markers]):
            name, size, rank = plan.post_forward
            part = NodeBuilder(graph, _copied_meta(first_marker, plan, "post_forward_part"))(
                copy_out.keep_part._opoverload, waited, size, rank)
            again_b = NodeBuilder(graph, _copied_meta(first_marker, plan, "post_forward_chain"))
            again = gather_again(again_b, part, size, name, specs)
    for s, full in zip(plan.slots, fulls):
        for m in s.markers:
            m.replace_all_uses_with(full)
    erase_nodes(graph, [m for s in plan.slots for m in s.markers])
    if again is not None:
        backward_reads(graph, fulls, again, again_b.extra_meta)
    # The reads' own views of the shard are dead now.
    for s, source in zip(plan.slots, sources):
        for inp in s.inputs:
            while inp is not source and not inp.users:
                inp, dead = inp.args[0], inp
                graph.erase_node(dead)


def _apply_reduce(graph: fx.Graph, plan: BucketPlan) -> None:
    order = node_order(graph)
    last_marker = max((m for s in plan.slots for m in s.markers), key=order.__getitem__)
    specs = [s.args.spec for s in plan.slots]
    b = NodeBuilder(graph, _copied_meta(last_marker, plan))
    with graph.inserting_before(last_marker):
        if plan.kind == "keep":  # the full gradients, for the sinks
            return _replace_roots(graph, plan, [reduce_input(b, _summed(b, s), s.kept, s.args.reduce_dtype)
                                                for s in plan.slots])
        # (what was kept is added where the bucket is packed: [Note: Kept
        # gradients added where the bucket is packed] in core/ops.py)
        grads = [cast(b, _summed(b, s), s.args.reduce_dtype) for s in plan.slots]
        kept = [s.kept for s in plan.slots]
        if reduced_later(plan):
            emit_reduce_later(b, plan, grads, kept, specs)
            return _replace_roots(graph, plan, [None] * len(plan.slots))
        results = emit_reduced(b, emit_pack_grads(b, grads, specs, kept=kept), specs,
                               [s.args.local_rows for s in plan.slots],
                               [s.args.grad_dtype for s in plan.slots], plan.group_name, plan.by_all_to_all,
                               plan.slots[0].args.replicate_group_name, plan.device)
    _replace_roots(graph, plan, results)


def _summed(b: NodeBuilder, slot: Slot) -> fx.Node:
    """The slot's full gradient: its markers' inputs summed in graph order (see
    [Note: Duplicate markers])."""
    g = slot.inputs[0]
    for other in slot.inputs[1:]:
        g = b(aten.add.Tensor, g, other)
    return g


def _replace_roots(graph: fx.Graph, plan: BucketPlan, results: list[fx.Node | None]) -> None:
    """Each slot's gradient becomes its result (None: the graph returns none)."""
    dead: list[fx.Node] = []
    returned_none: dict[fx.Node, None] = {}
    for s, res in zip(plan.slots, results):
        assert s.root is not None
        if res is None:  # (read by the output only: ``reduced_later`` in region_reduce.py; erasing it checks that)
            returned_none[s.root] = None
            dead.append(s.root)
            continue
        s.root.replace_all_uses_with(res)
    return_none_for(graph, returned_none)  # ([Note: One pass over the output] in graph.py)
    for s in plan.slots:
        dead.extend(s.markers)
        dead.extend(s.acc_nodes)
    erase_nodes(graph, dict.fromkeys(dead))


def apply_lowering(gm: fx.GraphModule, plan: LoweringPlan) -> LoweringReport:
    """Rewrites ``gm`` in place following ``plan``."""
    report = LoweringReport(skipped=list(plan.skipped), units=list(plan.units))
    h = plan.handoff
    if not plan.buckets and not (h.issues or h.reduces or h.handed_in):
        return report
    report.handoffs, skipped = apply_handoff(gm, h)
    report.skipped.extend(skipped)
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
                unit=bucket.unit,
                units=list(bucket.units),
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
