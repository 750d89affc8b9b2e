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

This is the form the debug dump turns into a Chrome trace: every time is in
seconds from the graph's start, ``dataclasses.asdict`` gives plain dicts.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ._graph import chain_tag
from .cost_model import AG, ISSUES, WAIT, CostModel, node_bytes


@dataclasses.dataclass
class CommEvent:
    kind: str  # "all_gather" | "reduce_scatter"
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
class Timeline:
    makespan_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    comms: list[CommEvent] = dataclasses.field(default_factory=list)
    modules: list[ModuleSpan] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def simulate(order: list[fx.Node], cost: CostModel) -> Timeline:
    """Predicts the timeline of running ``order`` (see [Note: Timeline model])."""
    tl = Timeline()
    t, queue_end = 0.0, 0.0
    events: dict[fx.Node, CommEvent] = {}
    spans: dict[tuple[int, int], ModuleSpan] = {}
    current = (-1, 0)
    for n in order:
        info = chain_tag(n)
        if n.target in ISSUES and info is not None:
            dur = cost.collective_time(n)
            start = max(t, queue_end)
            queue_end = start + dur
            buf = n if n.target is AG else n.args[0]
            assert isinstance(buf, fx.Node)
            events[n] = CommEvent(
                kind="all_gather" if n.target is AG else "reduce_scatter",
                module_key=info.module_key, unit=info.unit, bytes=node_bytes(buf),
                issue_s=t, start_s=start, end_s=queue_end, wait_s=-1.0, exposed_s=0.0,
            )
            tl.comm_s += dur
            continue
        if n.target is WAIT and isinstance(n.args[0], fx.Node) and n.args[0] in events:
            ev = events[n.args[0]]
            ev.wait_s = t
            ev.exposed_s = max(0.0, ev.end_s - t)
            t += ev.exposed_s
            tl.exposed_s += ev.exposed_s
            if ev.kind == "all_gather":
                current = (ev.module_key, ev.unit)
            continue
        dt = cost.compute_time(n)
        if dt <= 0.0:
            continue
        span = spans.get(current)
        if span is None:
            span = spans[current] = ModuleSpan(*current, t, t, 0.0, None, None, 0.0)
        span.compute_end_s = t + dt
        span.compute_s += dt
        t += dt
        tl.compute_s += dt
    tl.makespan_s = max(t, queue_end)
    tl.comms = list(events.values())
    for ev in tl.comms:
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
