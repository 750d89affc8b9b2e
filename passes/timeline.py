"""The predicted timeline of a graph's node order under the cost model, and
its memory estimate.

[Note: Timeline model]
Two resources: one compute stream (the graph's nodes run one after another)
and one communication queue per process (collectives run in issue order, one
at a time). A collective starts at max(its issue time, the end of the previous
collective) and takes ``CostModel.collective_time``; a ``wait_tensor`` blocks
compute until its collective ends, and that blocked time is the collective's
*exposed* communication. Compute is attributed to the unit whose gather was
most recently waited on (graph order), which is exact for the blocks of a
forward graph and approximate for backward prologues/epilogues ("-1": before
any gather). ``ModuleSpan`` is per (module_key, unit).

The one model of a graph's run, for the scheduling pass's reports (a
partitioned graph, the collectives the passes own) and for the debug dump's
predicted timeline (``simulate(..., joint=True, foreign=True)``: a joint
graph, whose backward is what depends on a tangent input; every collective,
a foreign one or a leftover marker priced like an all-gather or a
reduce-scatter of its bytes; a gather chain tagged ``MUST_RECOMPUTE``
issued again right before the first backward node that reads it, as the
partitioner places the re-gather). ``steps`` lists every costed node on its
track (compute, communication, exposed waits) for the dump's Chrome trace
(tools/debug_timeline.py only formats it); every time is in seconds from
the graph's start, ``dataclasses.asdict`` gives plain dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compiled_fsdp.core import ops as _ops  # noqa: F401 (registers the ops named below)
from compiled_fsdp.core.layout import bucket_width, split_specs
from compiled_fsdp.core.marker import IssueAhead, ReduceLater, Regather

from .cost_model import ALL_REDUCES, ALL_TO_ALLS, GATHERS, ISSUES, WAIT, CostModel, node_bytes, tensor_bytes
from .graph import chain_tag, is_reduce_grad, is_unshard, tangent_dependents


@dataclasses.dataclass
class CommEvent:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | a foreign collective's op
    module_key: int
    unit: int  # see passes/units.py
    bytes: int
    issue_s: float
    start_s: float
    end_s: float
    wait_s: float  # when compute reached the wait (-1: never waited)
    exposed_s: float


@dataclasses.dataclass
class ModuleSpan:
    """Compute between one unit's gather wait and the next's (in forward), and
    that unit's communication."""

    module_key: int
    unit: int
    compute_start_s: float
    compute_end_s: float
    compute_s: float
    comm_start_s: float | None
    comm_end_s: float | None
    exposed_s: float


@dataclasses.dataclass
class Step:
    """One costed node on one track: ``compute`` (an op, or ``wait`` for the
    time compute is blocked: exposed communication) or ``communication``."""

    node: str  # the node's name in its graph
    track: str  # "compute" | "communication"
    kind: str  # "compute" | "wait" | "all_gather" | "reduce_scatter" | "all_reduce" | a foreign collective's op
    start_s: float
    dur_s: float
    regather: bool = False  # a gather chain issued again in backward (reshard after forward)
    bytes: int = 0  # a collective's unsharded bytes


@dataclasses.dataclass
class Timeline:
    makespan_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    comms: list[CommEvent] = dataclasses.field(default_factory=list)
    modules: list[ModuleSpan] = dataclasses.field(default_factory=list)
    steps: list[Step] = dataclasses.field(default_factory=list)
    # Host calls ([Note: The sharding's host work priced per call]), priced or not
    host_calls: int = 0
    # (name, start, end) of "forward" and "backward" in a joint graph
    phases: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# [Note: Collectives inside an op]
# Three of the project's ops run their collective inside them, opaque to the
# graph: ``regather`` (a compile region's gather, or a handed-in module's
# backward re-gather: the one issued ahead for its shards, else gathered and
# waited there), ``issue_ahead`` (the next region's gather, issued and not
# waited) and ``reduce_later`` (a region's reduce-scatter, waited after its
# graph). The scheduler leaves them where they are; the dump's timeline
# (``foreign``) draws each on the communication track, a ``regather`` as
# gathered and waited at its node. At run time its gather was issued ahead
# (by the root's graph before the region's call, or in backward by the
# region before it), so the drawing shows at most what it exposes.
# Tested by tests/test_debug_dump.py::test_dump_of_compile_regions.
# ``simulate(..., chain=...)`` runs them as at run time instead ([Note: A
# step with compile regions predicted] in passes/region_step.py).
REGATHER, ISSUE_AHEAD, REDUCE_LATER = Regather.op().default, IssueAhead.op().default, ReduceLater.op().default
IN_OP_MARKERS = {REGATHER: Regather, ISSUE_AHEAD: IssueAhead, REDUCE_LATER: ReduceLater}
IN_OP = tuple(IN_OP_MARKERS)


def is_collective(node: fx.Node) -> bool:
    """A collective that moves data (not its wait): ours, a foreign one, a
    leftover marker, or an op running its own (the note above)."""
    if node.op != "call_function":
        return False
    if is_unshard(node) or is_reduce_grad(node) or node.target in ISSUES or node.target in IN_OP:
        return True
    ns = getattr(node.target, "namespace", None)
    return ns == "_c10d_functional" and "wait_tensor" not in str(node.target)


def is_reduce(node: fx.Node) -> bool:
    """A reduce-scatter, a reduce marker, or our all-to-all reduce (gloo; see
    [Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py)."""
    return ("reduce_scatter" in str(node.target) or is_reduce_grad(node) or node.target is REDUCE_LATER
            or (node.target in ALL_TO_ALLS and chain_tag(node) is not None))


def collective_kind(node: fx.Node) -> str:
    """"all_gather", "reduce_scatter" (markers and our gloo all-to-all
    included), "all_reduce" or, for a collective we do not know, the op's name."""
    if "all_gather" in str(node.target) or is_unshard(node) or node.target in (REGATHER, ISSUE_AHEAD):
        return "all_gather"
    if node.target in ALL_REDUCES:
        return "all_reduce"
    return "reduce_scatter" if is_reduce(node) else str(node.target)


def collective_bytes(node: fx.Node) -> int:
    """Bytes of the full (unsharded) side: a gather's output, a reduce-scatter's input."""
    if node.target in IN_OP_MARKERS:
        return _in_op_bytes(node)
    if is_reduce(node):
        src = node.args[0]
        return tensor_bytes(src.meta.get("val")) if isinstance(src, fx.Node) else 0
    return tensor_bytes(node.meta.get("val"))


def _in_op_bytes(node: fx.Node) -> int:
    """What the collective inside one of the in-op ops moves: its bucket,
    each parameter padded to whole shards ([Note: Bucket layout] in
    compiled_fsdp/core/layout.py), in the gather's dtype (a ``reduce_later``:
    the gradients'); 0 where a tensor has no traced value."""
    m = IN_OP_MARKERS[node.target].bind(node.args, dict(node.kwargs))
    later = node.target is REDUCE_LATER
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else t for t in (m.grads if later else m.shards)]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return 0
    specs = split_specs(m.full_shapes, m.ndims if later else [v.dim() for v in vals], m.world_size)
    dtype = vals[0].dtype if later else m.param_dtype or vals[0].dtype
    return m.world_size * bucket_width(specs) * dtype.itemsize


def communicates(node: fx.Node) -> bool:
    """False for an op that collects inside over a group of one rank: it
    copies and issues nothing (core/ops.py's ``issue_gather`` and
    ``reduce_later``)."""
    return node.target not in IN_OP or collective_world_size(node) > 1


def collective_world_size(node: fx.Node) -> int:
    if node.target in IN_OP_MARKERS:
        return IN_OP_MARKERS[node.target].bind(node.args, dict(node.kwargs)).world_size
    for a in node.args[1:]:
        if isinstance(a, int) and not isinstance(a, bool) and a > 1:
            return a
    return 2


def _comm_s(node: fx.Node, cost: CostModel) -> float:
    """A lowered bucket costs what the cost model estimates for it; a leftover
    marker (one parameter) or a collective we do not own is priced like an
    all-gather or reduce-scatter of its bytes."""
    seconds = cost.collective_time(node)
    if not seconds:
        kind = "reduce_scatter" if is_reduce(node) else "all_gather"
        seconds = cost.comm_time(kind, collective_bytes(node), collective_world_size(node))
    return seconds


class Chain(Protocol):
    """What the ops that collect inside take, wait and issue in an order
    with its regions' calls expanded (passes/region_step.py's ``RunTimeChain``)."""

    sources: dict[fx.Node, fx.Node]  # a copy's input -> the node it stands for; a pinned node -> its op's copy
    issued_first: list[fx.Node]  # the gathers issued when the graph begins

    def issued_ahead(self, n: fx.Node) -> list[fx.Node]: ...

    def taken(self, n: fx.Node) -> fx.Node | None: ...

    def issued_after(self, n: fx.Node) -> list[fx.Node]: ...

    def packed_bytes(self, n: fx.Node) -> int: ...


def simulate(order: list[fx.Node], cost: CostModel, *, joint: bool = False, foreign: bool = False,
             chain: Chain | None = None) -> Timeline:
    """Predicts the timeline of running ``order`` (see [Note: Timeline model]).
    ``foreign``: every collective is communication (else only the passes'
    own, the rest cost as compute); ``joint``: ``order`` is a joint graph's
    nodes, with forward and backward phases and the re-gathers, and the
    timeline lists its ``steps`` (the dump's trace); ``chain``: ``order``
    has its regions' calls expanded, and the ops that collect inside run as
    at run time ([Note: A step with compile regions predicted] in
    passes/region_step.py); not with ``joint``."""
    if joint and chain is not None:
        raise ValueError("simulate: an order with its regions expanded is a partitioned graph's, not a joint one")
    tl = Timeline()
    t, queue_end = 0.0, 0.0
    events: dict[fx.Node, CommEvent] = {}
    unowned: set[fx.Node] = set()  # collectives the passes do not own (``foreign`` only)
    spans: dict[tuple[int, int], ModuleSpan] = {}
    current = (-1, 0)
    backward = tangent_dependents(order[0].graph) if joint and order else set()
    regathered: set = set()
    phase_start, phase = 0.0, "forward"

    earlier: list[CommEvent] = []  # a chain's forward gather, when it is issued again

    def enqueue(dur: float) -> float:
        """A collective of ``dur`` seconds issued now: when it starts."""
        nonlocal queue_end
        start = max(t, queue_end)
        queue_end = start + dur
        tl.comm_s += dur
        return start

    def issue(n: fx.Node, regather: bool = False) -> None:
        if not communicates(n):
            return
        host(n)  # (the issue's host call, then the collective: [Note: The sharding's host work priced per call])
        if n in events:
            earlier.append(events.pop(n))
        info = chain_tag(n)
        dur = cost.collective_time(n) if not foreign else _comm_s(n, cost)
        start = enqueue(dur)
        kind = collective_kind(n)
        if n.target in ISSUES and info is not None:
            buf = n if n.target in GATHERS else n.args[0]
            events[n] = CommEvent(  # (HSDP's all-reduce of a bucket's rows is one of ours)
                kind=kind, module_key=info.module_key, unit=info.unit, bytes=node_bytes(buf),
                issue_s=t, start_s=start, end_s=queue_end, wait_s=-1.0, exposed_s=0.0,
            )
        else:
            unowned.add(n)
            events[n] = CommEvent(kind=kind, module_key=-1, unit=0, bytes=collective_bytes(n),
                                  issue_s=t, start_s=start, end_s=queue_end, wait_s=-1.0, exposed_s=0.0)
        if joint:
            tl.steps.append(Step(n.name, "communication", kind, start, dur, regather, events[n].bytes))

    def wait(waited: fx.Node, at: fx.Node) -> None:
        nonlocal t, current
        ev = events.get(waited)
        if ev is None:  # (an in-op collective over one rank: none issued)
            return
        ev.wait_s = t
        ev.exposed_s = max(0.0, ev.end_s - t)
        if joint and ev.exposed_s > 0:
            tl.steps.append(Step(at.name, "compute", "wait", t, ev.exposed_s))
        t += ev.exposed_s
        tl.exposed_s += ev.exposed_s
        if ev.kind == "all_gather" and waited not in unowned:
            current = (ev.module_key, ev.unit)
        host(at)  # (the wait's host call, in the module it gathered for)

    def spend(n: fx.Node, dt: float) -> None:
        nonlocal t
        if dt <= 0.0:
            return
        if joint:
            tl.steps.append(Step(n.name, "compute", "compute", t, dt))
        span = spans.get(current)
        if span is None:
            span = spans[current] = ModuleSpan(*current, t, t, 0.0, None, None, 0.0)
        span.compute_end_s = t + dt
        span.compute_s += dt
        t += dt
        tl.compute_s += dt

    def host(n: fx.Node) -> None:
        """One host call at ``n``: an issue, a wait, or an op that collects inside."""
        tl.host_calls += 1
        spend(n, cost.compute.host_call_s)

    def compute(n: fx.Node) -> None:
        tl.host_calls += cost.is_host_call(n)  # (its host time in its compute time)
        spend(n, cost.compute_time(n))

    def advance_reduces(at: fx.Node) -> None:
        """Each region reduce in flight one stage on, in issue order, as the
        run time's next ``reduce_later`` does: its reduce-scatter waited and,
        under HSDP, the replicas' all-reduce of its rows issued; that
        all-reduce waited."""
        nonlocal reduces
        later = []
        for key in reduces:
            wait(key, at)
            marker = ReduceLater.bind(key.args, dict(key.kwargs)) if isinstance(key, fx.Node) else None
            if marker is None or marker.replicas <= 1:
                continue
            rows = collective_bytes(key) // max(marker.world_size, 1)
            dur = cost.comm_time("all_reduce", rows, marker.replicas,
                                 across_nodes=cost.spans_nodes(marker.replicate_group_name))
            host(at)  # (its issue)
            start = enqueue(dur)
            events[("all_reduce", key)] = CommEvent("all_reduce", -1, 0, rows, t, start, queue_end, -1.0, 0.0)
            unowned.add(("all_reduce", key))
            later.append(("all_reduce", key))
        reduces = later

    # The region reduces in flight (``chain`` only): a ``reduce_later`` (its
    # reduce-scatter) or ("all_reduce", it) (HSDP's second stage).
    reduces: list = []

    for n in chain.issued_first if chain is not None else ():
        issue(n)
    for n in order:
        if n.op != "call_function":
            continue
        if chain is not None and n.target in IN_OP:  # ([Note: Collectives inside an op])
            if n.target is REDUCE_LATER:
                advance_reduces(n)
            host(n)  # (the op's own call, which may issue nothing)
            if n.target is ISSUE_AHEAD:  # (a gather for each regather that takes a part of its bucket)
                for part in chain.issued_ahead(n):
                    spend(n, chain.packed_bytes(part) / cost.compute.bytes_per_s)
                    issue(part)
                continue
            taken = chain.taken(n)
            if taken is None:
                spend(n, chain.packed_bytes(n) / cost.compute.bytes_per_s)
                issue(n)
            if n.target is REGATHER:
                wait(taken or n, n)
            if n.target is REDUCE_LATER:
                reduces.append(n)
            for then in chain.issued_after(n):
                spend(n, chain.packed_bytes(then) / cost.compute.bytes_per_s)
                issue(then)
            continue
        if joint and n in backward:
            if phase == "forward":
                tl.phases.append(("forward", phase_start, t))
                phase_start, phase = t, "backward"
            for inp in n.all_input_nodes:  # the re-gather of a resharded chain
                tag = chain_tag(inp)
                if (tag is not None and tag not in regathered
                        and inp.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE):
                    regathered.add(tag)
                    c = next((c for c in order if is_collective(c) and chain_tag(c) == tag), None)
                    if c is not None:
                        issue(c, regather=True)
                        if c in events:  # (none over one rank)
                            t = max(t, events[c].end_s)
                            host(n)  # (its wait)
        if n.target in IN_OP:  # (the op's own call, as above)
            host(n)
        info = chain_tag(n)
        owned = n.target in ISSUES and info is not None
        if foreign and joint and n not in backward and n.meta.get("partitioner_tag") == "must_be_in_backward" \
                and is_collective(n):
            continue  # (a backward's collective placed in forward: the re-gather above draws it)
        if owned or (foreign and is_collective(n)):
            issue(n)
            if n.target is not REGATHER:
                continue
        waited = n if n.target is REGATHER else n.args[0] if n.target is WAIT and n.args else None
        while chain is not None and waited in chain.sources:  # (a pinned collective: its op's copy)
            waited = chain.sources[waited]
        if isinstance(waited, fx.Node) and waited in events:
            wait(waited, n)
            continue
        compute(n)
    while reduces:  # (the backward's end waits the last reduces)
        advance_reduces(order[-1])
    tl.makespan_s = max(t, queue_end)
    if joint:
        tl.phases.append((phase, phase_start, tl.makespan_s))
    tl.comms = earlier + list(events.values())
    for n, ev in events.items():
        if n in unowned:
            continue
        key = (ev.module_key, ev.unit)
        span = spans.get(key)
        if span is None:
            span = spans[key] = ModuleSpan(*key, ev.start_s, ev.start_s, 0.0, None, None, 0.0)
        span.comm_start_s = ev.start_s if span.comm_start_s is None else min(span.comm_start_s, ev.start_s)
        span.comm_end_s = ev.end_s if span.comm_end_s is None else max(span.comm_end_s, ev.end_s)
        span.exposed_s += ev.exposed_s
    tl.modules = [spans[k] for k in sorted(spans)]
    return tl


def estimate_peak(order: list[fx.Node], graph: fx.Graph) -> int:
    """Peak bytes of live values when running ``order``: a value lives from its
    node until its last user; graph inputs and outputs live throughout; the
    input of a collective lives until the collective's wait (the backend holds
    it while the collective runs)."""
    pos = {n: i for i, n in enumerate(order)}
    end = len(order)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = set(graph.output_node().all_input_nodes)
    base = sum(node_bytes(n) for n in inputs)
    delta = [0] * (end + 1)
    for n in order:
        if n in outputs:
            last = end
        else:
            last = max((pos[u] for u in n.users if u in pos), default=pos[n])
        size = node_bytes(n)
        delta[pos[n]] += size
        delta[last + 1 if last < end else end] -= size if last < end else 0
        if n.target in ISSUES and chain_tag(n) is not None:
            src = n.args[0]
            waits = [pos[u] for u in n.users if u.target is WAIT and u in pos]
            if isinstance(src, fx.Node) and src in pos and waits:
                src_last = max((pos[u] for u in src.users if u in pos), default=pos[src])
                if waits[0] > src_last:  # kept alive from src's last use until the wait
                    delta[src_last + 1] += node_bytes(src)
                    delta[waits[0] + 1] -= node_bytes(src)
    peak, live = 0, 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return base + peak
