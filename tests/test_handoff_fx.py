"""Pure-FX tests of the handoff between blocks' graphs ([Note: Gathers handed
to the next block's graph] in compiled_fsdp/compile/entry.py; passes/handoff.py)
on a hand-built joint graph: a block that reads two of its three parameters
from a gather handed to it and hands the next block's gather over, traced with
make_fx through autograd with the tangents as inputs, as AOTAutograd builds
it. No process group: the group name is fake."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import compiled_fsdp.core.ops  # noqa: F401  (registers the marker ops)
from compiled_fsdp.core.layout import ShardSpec, bucket_offsets
from compiled_fsdp.core.marker import ENTRY_KEY, NEXT_KEY
from compiled_fsdp.passes import lower_markers, tag_recompute
from compiled_fsdp.passes.config import OverlapConfig
from compiled_fsdp.passes.graph import ChainTag, chain_tag, has_markers, tangent_dependents
from compiled_fsdp.passes.schedule import schedule_graph

from _graphs import ancestors, calls, chain_role

c10d = torch.ops._c10d_functional
AG, RS, WAIT = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                c10d.wait_tensor.default)
REGATHER = torch.ops.compiled_fsdp.regather.default  # a resharding block's backward re-gather
# A handoff's collectives, skipped for a stand-in ([Note: A stand-in for the last block's next]).
AG_IF, RS_IF = torch.ops.compiled_fsdp.all_gather_if.default, torch.ops.compiled_fsdp.reduce_scatter_if.default
GROUP, N = "fake_group", 2
# The block's bucket: w (5, 4), u (3) -- never read here --, b (5).
OWN = [(5, 4), (3,), (5,)]
SPECS = [ShardSpec(s, N) for s in OWN]
OFFSETS, TOTAL = bucket_offsets(SPECS), sum(s.shard_numel for s in SPECS)
NEXT = [(5, 4), (4,)]  # the next block's parameters


def _joint(reshard: bool, kept: bool) -> fx.GraphModule:
    def fn(s_w, s_b, n_w, n_b, gathered, x, k_w, k_b, live, t_out, t_next):
        kw = {"gathered": gathered, "bucket_numel": TOTAL}
        w = torch.ops.compiled_fsdp.unshard(s_w, [5, 4], GROUP, N, ENTRY_KEY, 0, 3, reshard,
                                            bucket_offset=OFFSETS[0], **kw)
        b = torch.ops.compiled_fsdp.unshard(s_b, [5], GROUP, N, ENTRY_KEY, 2, 3, reshard,
                                            bucket_offset=OFFSETS[2], **kw)
        nxt = torch.ops.compiled_fsdp.gather_next(
            [n_w, n_b], [k_w, k_b] if kept else [None, None], [], live, [], [5, 4, 4], [3, 2], GROUP, N,
            NEXT_KEY, None, None, None, True, False, None, None, 1)
        out = torch.nn.functional.linear(x, w, b).tanh()
        grads = torch.autograd.grad([out, nxt], [s_w, s_b, n_w, n_b, gathered, x], [t_out, t_next],
                                    allow_unused=True)
        return (out, nxt, *grads)

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    args = (leaf(3, 4), leaf(3), leaf(3, 4), leaf(2), leaf(N * TOTAL), leaf(7, 4),
            torch.randn(5, 4), torch.randn(4), torch.ones((), dtype=torch.bool), torch.randn(7, 5),
            torch.randn(N * 14))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    for ph, name in zip(gm.graph.find_nodes(op="placeholder")[-2:], ("tangents_1", "tangents_2")):
        ph.target = ph.name = name  # as AOTAutograd names them
    gm.recompile()
    return gm


def _pure_functions_of(node: fx.Node) -> set[fx.Node]:
    """``node`` and the nodes computed from it alone (views, casts, transposes
    of a weight): what keeps its buffer alive if saved."""
    out = {node}
    for n in node.graph.nodes:
        if n.op == "call_function" and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


@pytest.mark.parametrize("reshard", [True, False])
def test_handoff_lowering(reshard: bool) -> None:
    gm = _joint(reshard, kept=True)
    report = lower_markers(gm)
    tag_recompute(gm)
    assert not has_markers(gm.graph)
    assert sorted(report.handoffs) == ["grad", "issue", "read", "reduce"]
    gathered = gm.graph.find_nodes(op="placeholder")[4]
    outputs = gm.graph.output_node().args[0]
    # The next block's gather: issued, not waited here, returned.
    (issue,) = [g for g in calls(gm, AG_IF) if chain_role(g) == "handoff_issue"]
    assert not any(u.target is WAIT for u in issue.users) and outputs[1] is issue
    # This block's: one wait on the handed-in input; the forward reads it.
    (wait,) = [w for w in calls(gm, WAIT) if w.args[0] is gathered]
    assert chain_role(wait) == "handoff_chain"
    regathers = [g for g in calls(gm, REGATHER) if chain_role(g) == "gather_chain"]
    if reshard:  # the backward re-gathers from the shards (one regather op), only in backward, recomputed
        (again,) = regathers
        assert again.meta["partitioner_tag"] == "must_be_in_backward"
        assert again.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        # No backward node reads the handed-in buffer, not even through the
        # forward's transposed weight: the backward's weights descend from the re-gather.
        backward = tangent_dependents(gm.graph)
        from_handed_in = _pure_functions_of(wait)
        assert not any(a in from_handed_in for n in backward for a in n.all_input_nodes)
        from_again = _pure_functions_of(again)
        assert any(a in from_again for n in backward for a in n.all_input_nodes)
    else:  # the backward reads the handed-in gather, which is saved
        assert regathers == [] and wait.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    # The handed-in gather's gradient: one pack ([Note: One copy-out per bucket]) of the
    # read parameters' gradients at their offsets; the unread parameter's columns stay zero.
    grad_of_gathered = outputs[2 + 4]
    assert chain_role(grad_of_gathered) == "handoff_grad"
    assert grad_of_gathered.target is torch.ops.compiled_fsdp.pack_bucket_grads.default
    assert list(grad_of_gathered.args[5]) == [OFFSETS[0], OFFSETS[2]] and grad_of_gathered.args[6] == TOTAL
    # The next block's gradient: kept gradients packed and added, one reduce-scatter.
    (rs,) = calls(gm, RS_IF)
    assert chain_role(rs) == "reduce_chain" and chain_tag(rs).module_key == NEXT_KEY
    live = gm.graph.find_nodes(op="placeholder")[8]  # both run or both skip, as the marker says
    assert issue.args[-1] is live and rs.args[-1] is live
    assert outputs[2 + 2].meta["val"].shape == (3, 4) and outputs[2 + 3].meta["val"].shape == (2,)


def test_handoff_without_sync_unpacks_for_the_sinks() -> None:
    def fn(n_w, sink, live, t_next):
        nxt = torch.ops.compiled_fsdp.gather_next([n_w], [None], [sink], live, [0], [5, 4], [3], GROUP, N,
                                                  NEXT_KEY, None, None, torch.float32, False, False, None,
                                                  None, 1)
        return (nxt, *torch.autograd.grad([nxt], [n_w, sink], [t_next], allow_unused=True))

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(3, 4, requires_grad=True),
                                          torch.zeros(5, 4, requires_grad=True), torch.ones((), dtype=torch.bool),
                                          torch.randn(N * 12))
    gm.graph.find_nodes(op="placeholder")[-1].target = "tangents_1"
    report = lower_markers(gm)
    assert report.handoffs == ["issue", "reduce"] and not has_markers(gm.graph)
    assert calls(gm, RS) == calls(gm, RS_IF) == []  # nothing communicated: the sink gets the full gradient
    out = gm.graph.output_node().args[0]
    assert out[1] is None and out[2].meta["val"].shape == (5, 4) and chain_role(out[2]) == "keep_chain"


def test_handoff_issue_scheduled_first() -> None:
    """A forward graph: compute, then the next block's gather (no wait in the
    graph): the schedule issues it before the compute (allocating its buffer
    earlier: within the estimated peak's allowance of the default budget)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = fx.Graph()
    with mode:
        x, shard = g.placeholder("x"), g.placeholder("next_shard")
        x.meta["val"], shard.meta["val"] = torch.empty(64, 64), torch.empty(64 * 32)
        h = g.call_function(torch.ops.aten.mm.default, (x, x))
        h.meta["val"] = torch.empty(64, 64)
        h2 = g.call_function(torch.ops.aten.mm.default, (h, x))
        h2.meta["val"] = torch.empty(64, 64)
        issue = g.call_function(AG, (shard, N, GROUP))
        issue.meta["val"] = torch.empty(64 * 64)
    issue.meta["compiled_fsdp"] = ChainTag("handoff_issue", NEXT_KEY, 0, ((NEXT_KEY, 0),), None)
    g.output((h2, issue))
    report = schedule_graph(g, OverlapConfig())
    assert report.changed and report.sequence == ["all_gather:-2.0"]
    assert [n.target for n in g.nodes if n.op == "call_function"] == [AG, torch.ops.aten.mm.default,
                                                                       torch.ops.aten.mm.default]


def test_handoff_before_a_foreign_collective() -> None:
    """A block graph with a collective of the user's own after the handed-over
    gather (tensor parallelism, an MoE all-to-all): the handoff is never waited
    in this graph, so the barrier waits nothing of it and the schedule
    completes (it used to assert on the handoff's missing wait). The foreign
    collective keeps its place after the compute it follows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = fx.Graph()
    with mode:
        x, shard = g.placeholder("x"), g.placeholder("next_shard")
        x.meta["val"], shard.meta["val"] = torch.empty(64, 64), torch.empty(64 * 32)
        issue = g.call_function(AG, (shard, N, GROUP))
        issue.meta["val"] = torch.empty(64 * 64)
        h = g.call_function(torch.ops.aten.mm.default, (x, x))
        h.meta["val"] = torch.empty(64, 64)
        ar = g.call_function(c10d.all_reduce.default, (h, "sum", "user_group"))
        ar.meta["val"] = torch.empty(64, 64)
        done = g.call_function(WAIT, (ar,))
        done.meta["val"] = torch.empty(64, 64)
        h2 = g.call_function(torch.ops.aten.mm.default, (done, x))
        h2.meta["val"] = torch.empty(64, 64)
    issue.meta["compiled_fsdp"] = ChainTag("handoff_issue", NEXT_KEY, 0, ((NEXT_KEY, 0),), None)
    g.output((h2, issue))
    report = schedule_graph(g, OverlapConfig())
    assert report.collectives == 1
    order = [n.target for n in g.nodes if n.op == "call_function"]
    assert order == [AG, torch.ops.aten.mm.default, c10d.all_reduce.default, WAIT, torch.ops.aten.mm.default]


def test_random_ops_are_not_copied_into_the_backward() -> None:
    """Under selective AC (here every forward op tagged PREFER_RECOMPUTE) the
    values computed from a handed-in weight that the backward reads are
    copied there from the re-gathered weights, but a random op is not: its
    copy would draw a new dropout mask (passes/handoff.py, ``_replayable``)."""

    def fn(s_w, s_b, gathered, x, t_out):
        kw = {"gathered": gathered, "bucket_numel": TOTAL}
        w = torch.ops.compiled_fsdp.unshard(s_w, [5, 4], GROUP, N, ENTRY_KEY, 0, 3, True,
                                            bucket_offset=OFFSETS[0], **kw)
        b = torch.ops.compiled_fsdp.unshard(s_b, [5], GROUP, N, ENTRY_KEY, 2, 3, True,
                                            bucket_offset=OFFSETS[2], **kw)
        h = torch.nn.functional.dropout(x * b.sum(), p=0.5, training=True)
        out = torch.nn.functional.linear(h, w)
        grads = torch.autograd.grad([out], [s_w, s_b, gathered, x], [t_out], allow_unused=True)
        return (out, *grads)

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    gm = make_fx(fn, tracing_mode="fake")(leaf(3, 4), leaf(3), leaf(N * TOTAL), leaf(7, 4), torch.randn(7, 5))
    (tangent,) = gm.graph.find_nodes(op="placeholder")[-1:]
    tangent.target = tangent.name = "tangents_1"
    backward = tangent_dependents(gm.graph)
    for n in gm.graph.nodes:  # (what torch.utils.checkpoint's selective policy tags)
        if n.op == "call_function" and n not in backward:
            n.meta["recompute"], n.meta["ac_graph_id"] = CheckpointPolicy.PREFER_RECOMPUTE, 1
    lower_markers(gm)

    def random_ops() -> list[fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function"
                and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]

    assert len(random_ops()) == 1, random_ops()
    # (the weight-only value the backward reads, b.sum(), is read from the re-gather)
    (again,) = calls(gm, REGATHER)
    now = tangent_dependents(gm.graph)
    read = [n for n in calls(gm, torch.ops.aten.sum.default) if any(u in now for u in n.users)]
    assert read and all(again in ancestors(n) for n in read), read
