"""Scheduling: reorders a partitioned forward or backward graph so that each
all-gather is issued early (prefetch) and each reduce-scatter as soon as its
gradients exist, with every wait as late as its first use allows, inside a
memory budget.

[Note: Where scheduling runs]
Scheduling must see the partitioned graphs: the partitioner re-places nodes
(recomputed gathers go right before their first backward use), so an order set
in the joint graph does not survive. Under Inductor the pass runs as (part of)
``torch._inductor.config.post_grad_custom_post_pass`` (see compiled_fsdp/compile/install.py).
torch 2.13 has no post-partition hook that runs under ``aot_eager``: AOTAutograd
calls ``joint_custom_pass`` before ``partition_fn`` and hands the two graphs
straight to the backend's ``fw_compiler``/``bw_compiler`` (``boxed_nop`` for
aot_eager). So ``aot_eager`` runs the partitioner's order; a custom
``aot_autograd(fw_compiler=..., bw_compiler=...)`` backend can call
``schedule_graph`` itself (the tests do). Scheduling changes no numerics: it
only permutes nodes that are independent of each other.

[Note: Scheduling rules]
Nodes fall into three classes. *Issue* nodes: an owned collective and its
single-use input chain (view/cat/pad of shards or gradients). *Lazy* nodes: the
collective's wait and its tail (the views, copy-out or local sum that read only
what it returned). *Compute*: everything else, kept in its original relative
order. One walk over the compute nodes emits lazy nodes on demand (a wait lands
right before the first node that needs its tail, and the whole tail follows it
at once: see [Note: In-flight bytes]) and issues
the owned collectives of each process group in their original order -- one
queue per group, so the per-group order is unchanged by construction, while
collectives of two groups may pass each other (a backward all-gather passes the
previous module's reduce-scatter: see [Note: A second group for reduce-scatters]
in compiled_fsdp/runtime/api.py) -- each as soon as:
  * their inputs exist (a reduce-scatter right after its last gradient);
  * no barrier lies before them in the original order and is still unemitted
    (everything issued before a barrier is also waited before it, nothing
    issued after it moves above). A barrier is a collective the passes do not
    own on one of their own process groups, or on a group it cannot name (an
    in-place ``c10d`` op, a leftover marker). A foreign collective on another
    group (tensor parallelism's, traced into the same graph) is compute: it
    keeps its place among the compute nodes, so its own group's order is the
    user's, and ours pass it both ways (see [Note: Foreign collectives] in collectives.py);
  * for a gather, the estimated compute left before its first use is no longer
    more than ``cover`` times its estimated duration (no earlier than useful);
  * the in-flight bytes (issued, not yet waited) stay within the budget; a
    reduce-scatter in flight is waited to make room, a prefetched gather is not
    (see [Note: A reduce-scatter larger than the budget]), and only for a
    gather that is due (see [Note: Room for a gather once it is due]).
A collective needed right away is issued regardless (that is the original
placement). A *handoff* (the next block's gather, which the next block's graph
waits on: [Note: Gathers handed to the next block's graph] in
compiled_fsdp/compile/entry.py) has no wait here: it is issued as soon as its
inputs exist and its group's order allows, whatever is in flight, and is not
counted in flight nor waited at a barrier (the graph returns it, so it is
alive to the end either way; tests/test_handoff_fx.py). Finally the estimated peak
memory of the new order must not exceed the original's plus the budget, or
the original order is kept.

[Note: In-flight bytes]
The budget counts what an issued, not yet waited collective keeps alive: its
output buffer, plus its input when the issue chain made that input for it (the
bucket's ``cat``/pad; a shard or gradient that is alive anyway adds nothing).
Once a collective is waited, its whole tail runs at once: the tail only
re-lays out or shrinks what the collective returned (slices and the copy-out
of a gather; on gloo the sum over ranks that turns the all-to-all's ``[N, T]``
receive buffer into the ``[T]`` gradient shard, see [Note: Reduce-scatter on
gloo] in compiled_fsdp/core/comm.py), so running it frees the collective's buffers. Left
lazy, the reduce's tail ran where the gradients are used -- the graph's end --
and every module's full receive buffer stayed alive until then. Measured on
the benchmark GPT (2 ranks): the backward schedule then raised the estimated
peak by 56 MB against a 24 MB budget, so the pass kept the partitioner's order
and every backward collective was waited right after it was issued (exposed
``wait_tensor`` 0.40-0.58 s per step in a profile); with the tail following
its wait the peak rises by 14 MB and the same profile shows 0.03-0.17 s.

[Note: A reduce-scatter larger than the budget]
A reduce-scatter is issued once no other reduce-scatter is in flight, even
when it alone exceeds the budget: holding it back saves nothing (its
gradients stay alive until it runs) and, first in its group's queue, it
would hold back every later reduce-scatter to the graph's end. Seen on a GPU
(Llama, fp32 gradients of the 128256 x 4096 output layer: 2.1 GB against a
0.98 GB budget): every reduce-scatter went to the end, the estimated peak
rose from 17 to 47 GB, so the backward schedule was dropped and every
collective of the backward was waited right after its issue
(tests/test_schedule_fx.py::test_reduce_scatter_larger_than_budget).

[Note: Room for a gather once it is due]
In backward the budget holds the next module's gather and one reduce-scatter,
not the gather after that. Waiting the reduce-scatter as soon as that gather
was worth issuing (``cover`` times its duration before its use) put the wait
right after the reduce-scatter's issue: compute stopped for the whole
reduce-scatter, and the link then idled while the next module computed,
before its own reduce-scatter (the emulated network's record, the benchmark
GPT at 8 blocks on 8 ranks: each backward reduce-scatter waited 35 ms, its
full time, then 7-10 ms of idle link per block). Now the gather waits
instead, until it is *due* (the compute left before its use no longer covers
its duration once): the reduce-scatter runs behind that much of the next
module's compute, the gather is still issued in time, and the link goes from
one to the next (tests/test_schedule_fx.py::test_a_gather_not_yet_due_leaves_the_reduce_scatter_in_flight).
Nor is a reduce-scatter waited for a gather that the gathers in flight
alone leave no room for: on a slow link a gather is due two modules ahead,
while the previous module's gather is still in flight. The reduce-scatter
was waited as soon as it was issued, for nothing: compute stood still for
all of it, then ran with nothing on the link until that gather fit (the
emulated network's record at W=8, 4x slower than the matched link: 37-60 ms
of idle link before each backward gather, 0.33 s a step; RESULTS,
2026-12-01). Now it stays in flight until the gather fits
(tests/test_schedule_fx.py::test_no_reduce_scatter_waited_for_a_gather_that_cannot_fit).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch.fx as fx

from .collectives import SCHEDULED, Collective, find_collectives, group_of, is_barrier, is_collective_op
from .config import OverlapConfig
from .cost_model import GATHERS, WAIT, CostModel
from .graph import chain_tag, is_tangent
from .timeline import Timeline, estimate_peak, simulate


@dataclasses.dataclass
class Move:
    node: str
    kind: Literal["issue", "wait"]
    bucket: str  # ChainTag.bucket
    from_index: int
    to_index: int


@dataclasses.dataclass
class SchedulePlan:
    order: list[fx.Node]  # every non-placeholder, non-output node
    changed: bool
    budget_bytes: int
    reason: str = ""
    # The owned collectives the plan found (what apply_schedule reports on).
    collectives: list[Collective] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ScheduleReport:
    graph: Literal["forward", "backward", "none"]
    changed: bool = False
    reason: str = ""
    budget_bytes: int = 0
    max_in_flight_bytes: int = 0
    collectives: int = 0
    moves: list[Move] = dataclasses.field(default_factory=list)
    # The owned collectives and waits in final order: "all_gather:<bucket>",
    # "reduce_scatter:<bucket>", "wait:<bucket>" (ChainTag.bucket: "<module_key>.<unit>").
    sequence: list[str] = dataclasses.field(default_factory=list)
    peak_before_bytes: int = 0
    peak_after_bytes: int = 0
    before: Timeline = dataclasses.field(default_factory=Timeline)
    after: Timeline = dataclasses.field(default_factory=Timeline)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_schedule(graph: fx.Graph, config: OverlapConfig, cost: CostModel | None = None) -> SchedulePlan:
    """Computes the new node order; reads the graph only. See [Note:
    Scheduling rules]."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    colls = find_collectives(graph)
    if not colls:
        return SchedulePlan(order=nodes, changed=False, budget_bytes=0, reason="no owned collectives")
    if any(c.wait is None for c in colls if c.kind != "handoff"):
        return SchedulePlan(order=nodes, changed=False, budget_bytes=0, collectives=colls,
                            reason="a collective without exactly one wait")
    budget = config.budget_bytes
    if budget is None:
        gathers = [c.nbytes for c in colls if c.kind != "reduce"]
        budget = 2 * max(gathers or [c.nbytes for c in colls])
    order = _Scheduler(graph, nodes, colls, budget, config.cover, cost or CostModel.for_graph(graph)).run()
    changed = any(a is not b for a, b in zip(order, nodes))
    return SchedulePlan(order=order, changed=changed, budget_bytes=budget, collectives=colls)


def _latest_covering(suffix: list[float], use: int, want: float) -> int:
    """The latest compute index ``p <= use`` whose compute up to ``use``
    (``suffix``: compute from each index to the end) lasts ``want`` seconds;
    0 if none does."""
    p = use
    while p > 0 and suffix[p] - suffix[use] < want:
        p -= 1
    return p


class _Scheduler:
    """One walk over a graph's compute nodes that emits the collectives'
    issue chains and lazy tails around them ([Note: Scheduling rules])."""

    def __init__(self, graph: fx.Graph, nodes: list[fx.Node], colls: list[Collective], budget: int,
                 cover: float, cost: CostModel) -> None:
        self.nodes, self.colls, self.budget = nodes, colls, budget
        self.issue_of: dict[fx.Node, Collective] = {}
        self.lazy_of: dict[fx.Node, Collective] = {}
        for c in colls:
            for n in (*c.cone, c.node):
                self.issue_of[n] = c
            for n in c.tail:
                self.lazy_of[n] = c
        self.compute = [n for n in nodes if n not in self.issue_of and n not in self.lazy_of]
        self.graph_pos = {n: i for i, n in enumerate(nodes)}
        # Every group a chain of ours runs on (HSDP's replicas' all-reduce rides in a tail).
        ours = frozenset(g for n in graph.nodes if chain_tag(n) is not None and is_collective_op(n)
                         and (g := group_of(n)) is not None) | {c.group for c in colls}
        self.is_barrier = {i: is_barrier(n, ours) for i, n in enumerate(self.compute)}
        self.barriers = [i for i, b in self.is_barrier.items() if b]
        self._place(cover, cost)
        self.order: list[fx.Node] = []
        self.emitted: set[fx.Node] = set(n for n in graph.nodes if n.op == "placeholder")
        # One queue per process group, each in original order and issued strictly
        # in that order; the queues are visited in order of their first collective.
        self.queues: dict[str, list[Collective]] = {}
        for c in colls:
            self.queues.setdefault(c.group, []).append(c)
        self.in_flight: list[Collective] = []

    def _place(self, cover: float, cost: CostModel) -> None:
        """Each collective's barrier and, for gathers, the earliest compute
        index worth issuing at (``cover`` times its duration before its first
        use), from the original order."""
        times = [cost.compute_time(n) for n in self.compute]
        suffix = [0.0] * (len(self.compute) + 1)
        for i in range(len(self.compute) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + times[i]
        first_use: dict[int, int] = {}
        for i, n in enumerate(self.compute):
            for a in n.all_input_nodes:
                c = self.lazy_of.get(a)
                if c is not None:
                    first_use.setdefault(id(c), i)
        for c in self.colls:
            c.barrier = sum(1 for b in self.barriers if self.graph_pos[self.compute[b]] < self.graph_pos[c.node]) - 1
            use = first_use.get(id(c), len(self.compute))
            c.desired = _latest_covering(suffix, use, cost.collective_time(c.node) * cover)
            c.due = _latest_covering(suffix, use, cost.collective_time(c.node))

    def emit(self, n: fx.Node) -> None:
        self.order.append(n)
        self.emitted.add(n)

    def issue_head(self, group: str) -> None:
        c = self.queues[group].pop(0)
        for n in (*c.cone, c.node):
            self.emit(n)
        if c.kind != "handoff":  # (waited in the next graph, so never here)
            self.in_flight.append(c)

    def issue_through(self, c: Collective) -> None:
        """Issues ``c`` and whatever precedes it on its group."""
        while c in self.queues[c.group]:
            self.issue_head(c.group)

    def ensure(self, n: fx.Node) -> None:
        if n in self.emitted:
            return
        if n in self.issue_of:
            self.issue_through(self.issue_of[n])
            return
        assert n in self.lazy_of, f"{n} needed before its position"
        # A tail reads only its collective and itself, so the whole tail is
        # emitted at once, in graph order. See [Note: In-flight bytes].
        c = self.lazy_of[n]
        self.issue_through(c)
        for t in c.tail:
            self.emit(t)
        if c in self.in_flight:
            self.in_flight.remove(c)

    def ready(self, c: Collective, at: int, emitted_barriers: int) -> bool:
        if c.barrier >= emitted_barriers:  # a barrier before it is not emitted yet
            return False
        if any(a not in self.emitted and a not in self.issue_of for n in c.cone + [c.node]
               for a in n.all_input_nodes):
            return False
        return not (c.kind == "gather" and at < c.desired)

    def make_room(self, c: Collective, at: int) -> bool:
        """Waits reduce-scatters in flight until ``c`` fits the budget; whether it
        fits. A handoff (the next graph's gather, never waited here) is issued
        as early as its inputs allow, whatever is in flight; a gather not yet
        due waits instead of a reduce-scatter (see [Note: Room for a gather
        once it is due])."""
        if c.kind == "handoff":
            return True
        if c.kind == "gather" and sum(x.nbytes for x in self.in_flight if x.kind != "reduce") + c.nbytes > self.budget:
            return False  # (waiting every reduce-scatter would not make room: none is waited for it)
        while sum(x.nbytes for x in self.in_flight) + c.nbytes > self.budget:
            rs = next((x for x in self.in_flight if x.kind == "reduce"), None)
            if rs is None:  # see [Note: A reduce-scatter larger than the budget]
                return c.kind == "reduce"
            if c.kind == "gather" and at < c.due:
                return False
            assert rs.wait is not None
            self.ensure(rs.wait)
        return True

    def try_issue(self, at: int, emitted_barriers: int) -> None:
        progress = True
        while progress:
            progress = False
            for group, queue in self.queues.items():
                if queue and self.ready(queue[0], at, emitted_barriers) and self.make_room(queue[0], at):
                    self.issue_head(group)
                    progress = True

    def run(self) -> list[fx.Node]:
        done_barriers = 0
        for i, n in enumerate(self.compute):
            if self.is_barrier[i]:
                for c in self.colls:
                    if self.graph_pos[c.node] < self.graph_pos[n]:
                        self.issue_through(c)
                for c in list(self.in_flight):
                    assert c.wait is not None
                    self.ensure(c.wait)
                self.emit(n)
                done_barriers = self.barriers.index(i) + 1
                continue
            self.try_issue(i, done_barriers)
            for a in n.all_input_nodes:
                self.ensure(a)
            self.emit(n)
            self.try_issue(i + 1, done_barriers)
        for c in self.colls:
            self.issue_through(c)
        for n in self.nodes:
            self.ensure(n)
        return self.order


def _sequence(order: list[fx.Node]) -> list[str]:
    seq = []
    for n in order:
        info = chain_tag(n)
        if info is None or n.target not in (*SCHEDULED, WAIT):
            continue
        what = "wait" if n.target is WAIT else "all_gather" if n.target in GATHERS else "reduce_scatter"
        seq.append(f"{what}:{info.bucket}")
    return seq


def apply_schedule(graph: fx.Graph, plan: SchedulePlan, cost: CostModel | None = None) -> ScheduleReport:
    """Reorders ``graph`` to ``plan.order`` when that keeps the estimated peak
    within the original peak plus the budget; reports what it did."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    colls = plan.collectives or find_collectives(graph)  # (a plan made by hand may not carry them)
    backward = any(is_tangent(n) for n in graph.nodes)
    kind = "none" if not colls else "backward" if backward or any(c.kind == "reduce" for c in colls) \
        else "forward"
    report = ScheduleReport(graph=kind, reason=plan.reason, budget_bytes=plan.budget_bytes,
                            collectives=len(colls))
    if not colls:
        return report
    cost = cost or CostModel.for_graph(graph)
    report.sequence = _sequence(nodes)
    report.before = simulate(nodes, cost)
    report.peak_before_bytes = report.peak_after_bytes = estimate_peak(nodes, graph)
    report.after = report.before
    if not plan.changed:
        return report
    peak = estimate_peak(plan.order, graph)
    if peak > report.peak_before_bytes + plan.budget_bytes:
        report.reason = f"estimated peak {peak} exceeds {report.peak_before_bytes} + budget"
        return report
    old = {n: i for i, n in enumerate(nodes)}
    new = {n: i for i, n in enumerate(plan.order)}
    for c in colls:
        for n, what in ((c.node, "issue"), (c.wait, "wait")):
            if n is not None and old[n] != new[n]:
                report.moves.append(Move(n.name, what, c.tag.bucket, old[n], new[n]))
    in_flight, peak_flight = 0, 0
    live: dict[fx.Node, int] = {}
    for n in plan.order:
        if n.target in SCHEDULED and chain_tag(n) is not None:
            c = next(x for x in colls if x.node is n)
            live[n] = c.nbytes
            in_flight += c.nbytes
            peak_flight = max(peak_flight, in_flight)
        elif n.target is WAIT and n.args[0] in live:
            in_flight -= live.pop(n.args[0])  # type: ignore[arg-type]
    report.max_in_flight_bytes = peak_flight
    anchor = graph.find_nodes(op="placeholder")[-1] if graph.find_nodes(op="placeholder") else None
    prev = anchor
    for n in plan.order:
        if prev is None:
            next(iter(graph.nodes)).prepend(n)
        else:
            prev.append(n)
        prev = n
    graph.lint()
    report.changed = True
    report.sequence = _sequence(plan.order)
    report.peak_after_bytes = peak
    report.after = simulate(plan.order, cost)
    return report


def schedule_graph(graph: fx.Graph, config: OverlapConfig | None = None) -> ScheduleReport:
    """Plan + apply in one call. A no-op (``changed=False``) on graphs without
    the passes' collectives or with ``config.schedule`` off."""
    from .config import overlap

    config = config or overlap
    if not config.schedule:
        return ScheduleReport(graph="none", reason="scheduling disabled")
    cost = CostModel.for_graph(graph)
    return apply_schedule(graph, plan_schedule(graph, config, cost), cost)
