"""Ordering invariants of the scheduling pass on hand-built FX graphs: two
"modules", each gathered (all_gather + wait + view) then used by a matmul, and
optionally a reduce-scatter of each module's gradient, as the lowering emits
them (``node.meta["compiled_fsdp"]``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from compiled_fsdp.passes.config import OverlapConfig
from compiled_fsdp.passes.cost_model import ComputeConstants, CostModel
from compiled_fsdp.passes.graph import ChainTag, chain_tag
from compiled_fsdp.passes.schedule import ScheduleReport, apply_schedule, plan_schedule, schedule_graph

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
AG, RS, A2A, WAIT = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                     c10d.all_to_all_single.default, c10d.wait_tensor.default)
GROUP = "g0"
D = 64


def _builders(g: fx.Graph):
    """``node(target, *args, meta=)`` and ``ph(name, shape)``: nodes added to
    ``g`` with their fake values (and ``meta`` as their chain tag)."""
    mode = FakeTensorMode()

    def node(target, *args, meta=None):
        n = g.call_function(target, args)
        with mode:
            n.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        if meta:
            n.meta["compiled_fsdp"] = meta
        return n

    def ph(name, shape):
        n = g.placeholder(name)
        with mode:
            n.meta["val"] = torch.empty(shape)
        return n

    return node, ph


def _build(n_modules: int = 3, reduce: bool = False, foreign_at: int | None = None,
           interleaved: bool = False, reduce_group: str = GROUP, all_to_all: bool = False,
           first_reduce_factor: int = 1, replicas_group: str | None = None,
           foreign_group: str = GROUP) -> fx.Graph:
    """x -> [gather_i, x = x @ w_i] for each module, then optional reduce-scatters
    of ``x``-derived grads; a foreign all_reduce before module ``foreign_at``.
    ``interleaved``: each module's reduce-scatter right after its compute, as in
    a backward graph (gather i, compute i, reduce i, gather i+1, ...).
    ``all_to_all``: reduce as the lowering does on gloo (a bucket made by
    a copy, all-to-all, then a local sum over ranks). ``first_reduce_factor``:
    module 0's gradient is that many times larger (the output layer's).
    ``replicas_group``: HSDP, each reduced shard then all-reduced on that group.
    ``foreign_group``: the foreign all_reduce's group (another: tensor parallelism's)."""
    g = fx.Graph()
    node, ph = _builders(g)

    def reduce_scatter(i: int, out: fx.Node) -> fx.Node:
        meta = ChainTag("reduce_chain", i, 0, ((i, 0),), None)
        k = first_reduce_factor if i == 0 else 1
        gr = node(aten.mul.Tensor, node(aten.repeat.default, out, [k, 1]) if k > 1 else out, 2.0)
        flat = node(aten.view.default, gr, [k * D * D], meta=meta)
        if all_to_all:
            bucket = node(aten.clone.default, flat, meta=meta)  # the lowering's pad + cat
            a2a = node(A2A, bucket, [D * D // 2] * 2, [D * D // 2] * 2, reduce_group, meta=meta)
            rows = node(aten.view.default, node(WAIT, a2a, meta=meta), [2, D * D // 2], meta=meta)
            summed = node(aten.sum.dim_IntList, rows, [0], meta=meta)
            if replicas_group is not None:
                summed = node(WAIT, node(c10d.all_reduce.default, summed, "sum", replicas_group, meta=meta),
                              meta=meta)
            return node(aten.div.Tensor, summed, 2, meta=meta)
        rs = node(RS, flat, "sum", 2, reduce_group, meta=meta)  # (k * D * D / 2 out)
        return node(aten.div.Tensor, node(WAIT, rs, meta=meta), 2, meta=meta)

    x = ph("x", (D, D))
    shards = [ph(f"shard{i}", (D // 2 * D,)) for i in range(n_modules)]
    outs = []
    for i, s in enumerate(shards):
        if foreign_at == i:
            ar = node(c10d.all_reduce.default, x, "sum", foreign_group)
            x = node(WAIT, ar)
        meta = ChainTag("gather_chain", i, 0, ((i, 0),), True)
        ag = node(AG, s, 2, GROUP, meta=meta)
        w = node(aten.view.default, node(WAIT, ag, meta=meta), [D, D], meta=meta)
        x = node(aten.relu.default, node(aten.mm.default, x, w))
        outs.append(x)
        if interleaved:
            outs.append(reduce_scatter(i, x))
    if reduce:
        for i in reversed(range(n_modules)):
            outs.append(reduce_scatter(i, outs[i]))
    g.output(tuple(outs))
    return g


def _pos(g: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(g.nodes)}


def _collectives(g: fx.Graph) -> list[tuple[str, int]]:
    return [(str(n.target), chain_tag(n).module_key if chain_tag(n) else -1)
            for n in g.nodes if n.op == "call_function" and n.target in (AG, RS, c10d.all_reduce.default)]


def _check_invariants(g: fx.Graph) -> None:
    g.lint()  # every node after its inputs
    pos = _pos(g)
    for n in g.nodes:
        if n.target in (AG, RS, A2A):
            (wait,) = [u for u in n.users if u.target is WAIT]
            assert pos[n] < pos[wait]
            users = [u for u in wait.users]
            assert all(pos[wait] < pos[u] for u in users)


def test_prefetch_moves_gathers_early_and_waits_late() -> None:
    g = _build()
    before = _collectives(g)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))  # cover: prefetch as far as the budget allows
    _check_invariants(g)
    assert rep.changed and rep.graph == "forward"
    assert _collectives(g) == before  # collective order unchanged
    seq = rep.sequence
    # gathers 0 and 1 issued before wait 0 (prefetch), wait i right before module i's matmul
    assert seq[:3] == ["all_gather:0.0", "all_gather:1.0", "wait:0.0"]
    pos = _pos(g)
    for n in g.nodes:
        if n.target is WAIT:
            (view,) = n.users
            mm = next(iter(view.users))
            assert pos[mm] - pos[n] == 2  # wait, view, mm


def test_budget_bounds_in_flight() -> None:
    one = D * D * 4  # bytes of one gathered module
    for budget, most in ((0, one), (one, 2 * one), (2 * one, 3 * one)):
        g = _build(n_modules=5)
        rep = schedule_graph(g, OverlapConfig(cover=1e9, budget_bytes=budget))
        _check_invariants(g)
        assert rep.max_in_flight_bytes <= most, (budget, rep.max_in_flight_bytes)
        assert rep.peak_after_bytes <= rep.peak_before_bytes + budget
    # the default budget: two gathered modules beyond the one computing
    g = _build(n_modules=5)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))
    assert rep.budget_bytes == 2 * one and rep.max_in_flight_bytes <= 3 * one


def test_reduce_scatter_issued_early_waited_late_order_kept() -> None:
    g = _build(reduce=True)
    before = _collectives(g)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))
    _check_invariants(g)
    assert rep.graph == "backward" and rep.changed
    assert _collectives(g) == before
    nodes = list(g.nodes)
    pos = _pos(g)
    for n in g.nodes:
        if n.target is RS:
            grad = n.args[0].args[0]  # view <- mul
            # issued right after its gradient: only its input view and waits
            # (making room within the budget) in between
            between = nodes[pos[grad] + 1: pos[n]]
            assert all(b is n.args[0] or b.target is WAIT for b in between), between
    # the first reduce-scatter's wait is deferred past the second's issue
    seq = rep.sequence
    assert seq.index("reduce_scatter:1.0") < seq.index("wait:2.0", seq.index("reduce_scatter:2.0"))


def _per_group(g: fx.Graph) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for n in g.nodes:
        if n.op == "call_function" and n.target in (AG, RS, A2A):
            out.setdefault(n.args[-1], []).append((str(n.target), chain_tag(n).module_key))
    return out


def test_gather_passes_reduce_scatter_only_on_another_group() -> None:
    """Backward shape (gather i, compute i, reduce i, gather i+1, ...): on one
    group the next gather stays behind the reduce-scatter; with the
    reduce-scatters on their own group it is issued before it (prefetched
    behind module i's compute), and each group keeps its order."""
    one = _build(n_modules=4, interleaved=True)
    before = _collectives(one)
    schedule_graph(one, OverlapConfig(cover=1e9))
    _check_invariants(one)
    assert _collectives(one) == before  # one group: the total order is the group's order

    two = _build(n_modules=4, interleaved=True, reduce_group="g1")
    before = _per_group(two)
    rep = schedule_graph(two, OverlapConfig(cover=1e9))
    _check_invariants(two)
    assert _per_group(two) == before
    seq = rep.sequence
    for i in range(3):
        assert seq.index(f"all_gather:{i + 1}.0") < seq.index(f"reduce_scatter:{i}.0"), seq


def test_reduce_scatter_larger_than_budget() -> None:
    """See [Note: A reduce-scatter larger than the budget]: with a budget
    smaller than one reduce-scatter, each is still issued right after its
    gradient (the one before it waited to make room), not at the end."""
    g = _build(n_modules=4, interleaved=True, reduce_group="g1", first_reduce_factor=8)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))  # default budget: 2 gathers (32 KiB) < 64 KiB
    _check_invariants(g)
    assert rep.changed and rep.graph == "backward", rep.reason
    nodes, pos = list(g.nodes), _pos(g)
    for n in g.nodes:
        if n.target is RS:
            grad = n.args[0].args[0]  # view <- mul
            between = nodes[pos[grad] + 1: pos[n]]
            assert all(b is n.args[0] or b.target is WAIT or b.args[0].target is WAIT for b in between), between
    assert rep.peak_after_bytes <= rep.peak_before_bytes + rep.budget_bytes


def _backward_scheduled(n_modules: int, matmul_in_gathers: float) -> tuple[fx.Graph, ScheduleReport]:
    """Backward's shape (each module's reduce-scatter after its compute),
    each module's matmul priced at ``matmul_in_gathers`` gathers, scheduled
    with the default budget (two gathers); the invariants checked and each
    group's order kept."""
    g = _build(n_modules=n_modules, interleaved=True, reduce_group="g1")
    before = _per_group(g)
    gather_s = CostModel().comm_time("all_gather", D * D * 4, 2)
    matmul = ComputeConstants(flops_per_s=2 * D ** 3 / (matmul_in_gathers * gather_s), bytes_per_s=1e18,
                              host_bytes_per_s=1e18)
    cost = dataclasses.replace(CostModel(), compute=matmul)
    rep = apply_schedule(g, plan_schedule(g, OverlapConfig(), cost), cost)
    _check_invariants(g)
    assert rep.changed and _per_group(g) == before, rep.reason
    return g, rep


def test_a_gather_not_yet_due_leaves_the_reduce_scatter_in_flight() -> None:
    """[Note: Room for a gather once it is due]: backward's shape, each
    module's matmul priced at 1.5 gathers, the default budget (two gathers).
    Gather i+2 is worth issuing during module i's matmul, but room for it
    means waiting reduce-scatter i; it waits instead until it is due, and
    reduce-scatter i runs behind module i+1's matmul (it was waited right
    after its issue, nothing between them)."""
    g, rep = _backward_scheduled(n_modules=5, matmul_in_gathers=1.5)
    assert rep.graph == "backward"
    assert rep.max_in_flight_bytes <= rep.budget_bytes + D * D * 4
    nodes, pos = list(g.nodes), _pos(g)
    for n in g.nodes:
        if n.target is RS and chain_tag(n).module_key < 3:  # (the last two: nothing after them to wait for)
            (wait,) = n.users
            between = [m.target for m in nodes[pos[n] + 1: pos[wait]]]
            assert aten.mm.default in between, (chain_tag(n).module_key, rep.sequence)


def test_no_reduce_scatter_waited_for_a_gather_that_cannot_fit() -> None:
    """[Note: Room for a gather once it is due], a slow link: each module's
    matmul priced at a quarter of a gather, so each gather is due two modules
    ahead, while the default budget (two gathers) is full of the two gathers
    in flight. A reduce-scatter is waited only where a gather then fits: the
    next collective after its wait is a gather's issue. It was waited right
    after its issue, for nothing, the next module's gather wait following."""
    g, rep = _backward_scheduled(n_modules=6, matmul_in_gathers=0.25)
    nodes = list(g.nodes)
    comm = [n for n in nodes if n.target in (AG, RS) or n.target is WAIT and n.args[0].target in (AG, RS)]
    last_gather = max(i for i, n in enumerate(comm) if n.target is AG)
    rs_waits = [i for i, n in enumerate(comm) if n.target is WAIT and n.args[0].target is RS and i < last_gather]
    assert rs_waits, rep.sequence
    for i in rs_waits:
        assert comm[i + 1].target is AG, (comm[i + 1], rep.sequence)


def test_a_pointwise_chain_is_priced_as_one_kernel() -> None:
    """[Note: Fused elementwise ops]: x -> add -> mul -> sum. The chain reads
    x once and the sum writes its output; the values between the pointwise
    ops are neither written nor read again (each was counted twice)."""
    g = fx.Graph()
    mode = FakeTensorMode()
    x = g.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(1024, 1024)
    nodes = {}
    prev = x
    for name, target, extra in (("add", aten.add.Tensor, (1.0,)), ("mul", aten.mul.Tensor, (2.0,)),
                                ("sum", aten.sum.default, ())):
        n = g.call_function(target, (prev, *extra))
        with mode:
            n.meta["val"] = target(prev.meta["val"], *extra)
        nodes[name], prev = n, n
    g.output(prev)
    cost = CostModel()
    one = 1024 * 1024 * 4 / cost.compute.bytes_per_s  # one pass over x
    assert cost.compute_time(nodes["add"]) == pytest.approx(one)  # reads x, keeps its output
    assert cost.compute_time(nodes["mul"]) == 0.0  # all in registers
    assert cost.compute_time(nodes["sum"]) == pytest.approx(4 / cost.compute.bytes_per_s)  # writes one float


def test_reduce_tail_follows_its_wait() -> None:
    """On gloo the reduce's wait returns a full-size [N, T] buffer that the
    local sum shrinks N-fold: the sum (and the rest of the tail) must run
    right after the wait, not at the graph's end where its result is used, or
    every deferred buffer stays alive and the schedule busts the budget.
    Measured on the benchmark GPT: with the tail deferred, the backward
    schedule raised the estimated peak by 2.3x the budget and was dropped."""
    g = _build(n_modules=6, interleaved=True, reduce_group="g1", all_to_all=True)
    before = _per_group(g)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))
    _check_invariants(g)
    assert rep.changed and rep.graph == "backward", rep.reason
    assert _per_group(g) == before
    assert rep.peak_after_bytes <= rep.peak_before_bytes + rep.budget_bytes
    nodes = list(g.nodes)
    for i, n in enumerate(nodes):
        if n.target is WAIT and n.args[0].target is A2A:
            assert [m.target for m in nodes[i + 1:i + 4]] == [
                aten.view.default, aten.sum.dim_IntList, aten.div.Tensor], nodes[i:i + 4]
    seq = rep.sequence
    for i in range(5):  # and the overlap it is for: the next gather passes the reduce
        assert seq.index(f"all_gather:{i + 1}.0") < seq.index(f"reduce_scatter:{i}.0"), seq


def test_hsdp_all_reduce_rides_in_its_reduce_tail() -> None:
    """HSDP: each reduced shard is all-reduced over the replicas. The
    all-reduce is part of its reduce's tail (right after the local sum, before
    the divide), the reduces keep their order, and the planner terminates
    (scheduled as a collective of its own, its cone swallowed the reduce's
    wait and make_room looped forever: a 4-rank HSDP job hung in Inductor)."""
    g = _build(n_modules=4, interleaved=True, reduce_group="g1", all_to_all=True, replicas_group="g2")
    before = _per_group(g)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))
    _check_invariants(g)
    assert rep.changed and rep.graph == "backward", rep.reason
    assert _per_group(g) == before
    nodes = list(g.nodes)
    ars = [i for i, n in enumerate(nodes) if n.target is c10d.all_reduce.default]
    assert len(ars) == 4
    for i in ars:
        assert nodes[i - 1].target is aten.sum.dim_IntList and nodes[i + 1].target is WAIT, nodes[i - 1:i + 2]
        assert nodes[i + 2].target is aten.div.Tensor, nodes[i:i + 3]


def test_foreign_collective_is_a_barrier() -> None:
    g = _build(n_modules=4, foreign_at=2)
    before = _collectives(g)
    schedule_graph(g, OverlapConfig(cover=1e9))
    _check_invariants(g)
    assert _collectives(g) == before
    pos = _pos(g)
    (ar,) = [n for n in g.nodes if n.target is c10d.all_reduce.default]
    for n in g.nodes:
        if n.target is AG:
            key = chain_tag(n).module_key
            (wait,) = n.users
            if key < 2:  # issued and waited before the barrier
                assert pos[wait] < pos[ar]
            else:  # nothing from after it moves above it
                assert pos[n] > pos[ar]


def test_tp_collectives_do_not_pin_the_gathers() -> None:
    """[Note: Foreign collectives]: an all_reduce on another group (tensor
    parallelism's) is compute: module 2's gather is prefetched above it, and
    it keeps its place among the compute nodes. On one of our groups it
    stays a barrier (the test above)."""
    g = _build(n_modules=4, foreign_at=2, foreign_group="tp")
    compute_before = [n.name for n in g.nodes if chain_tag(n) is None]
    schedule_graph(g, OverlapConfig(cover=1e9))
    _check_invariants(g)
    assert [n.name for n in g.nodes if chain_tag(n) is None] == compute_before
    pos = _pos(g)
    (ar,) = [n for n in g.nodes if n.target is c10d.all_reduce.default]
    (gather2,) = [n for n in g.nodes if n.target is AG and chain_tag(n).module_key == 2]
    assert pos[gather2] < pos[ar]


def test_noop_without_collectives_and_when_disabled() -> None:
    g = fx.Graph()
    a = g.placeholder("a")
    g.output(g.call_function(aten.relu.default, (a,)))
    code = g.python_code("self").src
    rep = schedule_graph(g, OverlapConfig())
    assert not rep.changed and rep.graph == "none" and g.python_code("self").src == code
    g2 = _build()
    code2 = g2.python_code("self").src
    rep2 = schedule_graph(g2, OverlapConfig(schedule=False))
    assert not rep2.changed and g2.python_code("self").src == code2


def test_deterministic_and_idempotent() -> None:
    g1, g2 = _build(reduce=True), _build(reduce=True)
    schedule_graph(g1, OverlapConfig())
    schedule_graph(g2, OverlapConfig())
    assert g1.python_code("self").src == g2.python_code("self").src
    again = copy.deepcopy(g1)
    rep = schedule_graph(again, OverlapConfig())
    assert not rep.changed  # a pass with nothing left to do changes nothing


def test_timeline_report() -> None:
    g = _build(reduce=True)
    rep = schedule_graph(g, OverlapConfig(cover=1e9))
    d = rep.as_dict()
    tl = d["after"]
    assert {m["module_key"] for m in tl["modules"]} >= {0, 1, 2}
    for c in tl["comms"]:
        assert c["issue_s"] <= c["start_s"] <= c["end_s"] and c["exposed_s"] >= 0
    assert tl["exposed_s"] <= d["before"]["exposed_s"] + 1e-12
    assert tl["makespan_s"] <= d["before"]["makespan_s"] + 1e-12


def _ancestors(n: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(n.all_input_nodes)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return seen


def _pinned(both_ways: bool) -> tuple[dict[str, list[str]], list[str], fx.GraphModule, dict[str, set[str]]]:
    """Schedule, pin, and return which nodes got ordering-only dependencies
    (node -> its extra inputs), the collectives' order afterwards, the
    pinned module, and each node's ancestors by data before the pin."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    from compiled_fsdp.passes.pin import pin_order

    g = _build(reduce=True)
    gm = fx.GraphModule(torch.nn.Module(), g)
    schedule_graph(g, OverlapConfig(cover=1e9))
    order = [n.name for n in g.nodes if n.target in (AG, RS, WAIT)]
    data = {n.name: {a.name for a in _ancestors(n)} for n in g.nodes}
    added = pin_order(g, both_ways=both_ways)
    gm.recompile()
    g.lint()
    deps = {n.name: sorted(d.name for d in n.args[0]) for n in g.nodes if n.target is control_deps}
    assert added == sum(len(v) for v in deps.values())
    return deps, order, gm, data


def test_pin_both_ways_holds_collectives_up_and_waits_down() -> None:
    """See [Note: Inductor's simple_overlap] in passes/pin.py: the usual pin
    keeps waits from moving up and collectives from moving down; both ways
    it also ties each owned collective to the compute node before it, and
    the compute node after each owned wait to that wait, so a pass that
    hoists collectives and sinks waits (Inductor's simple_overlap) cannot
    move ours. Nothing else changes. A dependency the graph has already,
    through data, is not added ([Note: Dependencies the graph has]): the
    reduce-scatters here take gradients of the compute before them."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    one, order, _, _ = _pinned(False)
    both, order_both, gm, data = _pinned(True)
    assert order == order_both
    # the usual pin: no collective is wrapped
    assert not any(name.startswith(("all_gather", "reduce_scatter")) for name in one)
    # both ways: every collective after the first compute node is held after
    # the compute node before it, by its data (the reduce-scatters) or by a
    # dependency added (the gathers, whose shards are inputs)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    wrapped = {n: getattr(gm, n.args[1].target) for n in nodes if n.target is control_deps}

    def target(n: fx.Node) -> object:
        return next(m.target for m in wrapped[n].graph.nodes if m.op == "call_function") if n in wrapped else n.target

    def compute(n: fx.Node) -> bool:
        return chain_tag(n) is None and target(n) in (aten.mm.default, aten.relu.default, aten.mul.Tensor)

    held = 0
    for i, n in enumerate(nodes):
        if target(n) in (AG, RS):
            prev = next((p for p in reversed(nodes[:i]) if compute(p)), None)
            if prev is not None:
                assert prev in _ancestors(n), n.name
                held += 1
    assert held >= 4
    assert any(name.startswith("all_gather") for name in both)
    # no dependency added that the node had through its data already
    for n in wrapped:
        assert not {d.name for d in n.args[0]} & data[n.name], (n.name, [d.name for d in n.args[0]])
    assert not any(name.startswith("reduce_scatter") for name in both), both
    # and each dependency of the usual pin is still there
    for name, deps in one.items():
        assert set(deps) <= set(both.get(name, [])), (name, deps, both.get(name))
    # the compute node after each wait follows it (a wait cannot sink), here
    # by data: each gathered weight is used next
    waits = 0
    for i, n in enumerate(nodes):
        if target(n) is WAIT and chain_tag(n) is not None:
            nxt = next((q for q in nodes[i + 1:] if compute(q)), None)
            if nxt is not None:
                assert n in _ancestors(nxt), (n.name, nxt.name)
                waits += 1
    assert waits >= 3


def test_pin_orders_gathers_issued_ahead_by_their_after() -> None:
    """[Note: Dependencies the graph has] in passes/pin.py: two gathers
    issued ahead of compile regions, the second after compute that does
    not use the first (as in the outer graph, whose region calls drop the
    token). The pin orders the second after the first by its own ``after``
    list, not by a ``control_deps`` node, and adds nothing the data has."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    import compiled_fsdp.core.ops  # noqa: F401 (the ops)
    from compiled_fsdp.passes.pin import ISSUE_AHEAD, pin_order

    mode = FakeTensorMode()
    g = fx.Graph()
    vals: dict[fx.Node, torch.Tensor] = {}

    def ph(name: str, shape: list[int]) -> fx.Node:
        n = g.placeholder(name)
        with mode:
            n.meta["val"] = vals[n] = torch.empty(shape)
        return n

    def node(target, *args) -> fx.Node:
        n = g.call_function(target, args)
        with mode:
            n.meta["val"] = vals[n] = target(*[[vals.get(x, x) for x in a] if isinstance(a, list)
                                               else vals.get(a, a) for a in args])
        return n

    def issue_ahead(shard: fx.Node, after: fx.Node, key: int) -> fx.Node:
        n = node(ISSUE_AHEAD, [shard], [after], [D, D], GROUP, 2, key)
        # (as tracing records them: the values the arguments had, which Inductor lowers them against)
        n.meta["eager_input_vals"] = fx.node.map_aggregate(
            (n.args, dict(n.kwargs)), lambda v: vals[v] if isinstance(v, fx.Node) else None)
        return n

    x, w, s0, s1 = ph("x", [D, D]), ph("w", [D, D]), ph("s0", [D // 2, D]), ph("s1", [D // 2, D])
    h = node(aten.mm.default, x, w)
    first = issue_ahead(s0, h, 0)
    h2 = node(aten.relu.default, h)  # (a region's call, in the outer graph)
    second = issue_ahead(s1, h2, 1)
    g.output((node(aten.mm.default, h2, w), first, second))
    gm = fx.GraphModule(torch.nn.Module(), g)
    added = pin_order(g, both_ways=True)
    gm.recompile()
    g.lint()
    after = [a.name for a in second.args[1]]  # (the relu is wrapped: it follows ``first``)
    assert after == ["relu_default", first.name], after  # ordered by its argument, not a control_deps node
    wrapped = [n for n in g.nodes if n.target is control_deps]
    assert not any(n.name.startswith("issue_ahead") for n in wrapped), [n.name for n in wrapped]
    assert added == 1 + sum(len(n.args[0]) for n in wrapped)
    # and Inductor's lowering keeps it: it constrains each argument to the
    # traced value, list element by list element (a list is zipped)
    from torch._inductor.lowering import constrain_to_fake_tensors
    from torch.fx.operator_schemas import normalize_function

    args, kwargs = normalize_function(ISSUE_AHEAD, second.args, dict(second.kwargs))
    fake_args, fake_kwargs = normalize_function(ISSUE_AHEAD, *second.meta["eager_input_vals"])
    lowered, _ = constrain_to_fake_tensors(args, kwargs, fake_args, fake_kwargs)
    assert [a.name for a in lowered[1]] == after


def test_pin_anchors_no_view() -> None:
    """[Note: A view anchors nothing] in passes/pin.py: the node before a
    wait is a view of an input (ready at the graph's start); the wait is
    held below the matmul before it, and nothing is held below the view."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    from compiled_fsdp.passes.pin import pin_order

    g = fx.Graph()
    node, ph = _builders(g)
    a, b, grad = ph("a", (D, D)), ph("b", (D, D)), ph("grad", (D * D,))
    meta = ChainTag("reduce_chain", 0, 0, ((0, 0),), None)
    rs = node(RS, grad, "sum", 2, GROUP, meta=meta)
    m1 = node(aten.mm.default, a, b)
    p = node(aten.permute.default, a, [1, 0])
    wait = node(WAIT, rs, meta=meta)
    m2 = node(aten.mm.default, m1, p)
    g.output((m2, node(aten.div.Tensor, wait, 2, meta=meta)))
    fx.GraphModule(torch.nn.Module(), g)  # (the pin wraps nodes in subgraphs of the graph's module)
    pin_order(g, both_ways=True)
    held = [d.name for n in g.nodes if n.target is control_deps for d in n.args[0]]
    assert m1.name in held, held  # the wait below the matmul before it
    assert p.name not in held, held  # never below the view
