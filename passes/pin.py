"""Pinning a schedule for Inductor.

[Note: Inductor reorders for peak memory]
Measured (torch 2.13, CPU): Inductor's scheduler keeps the relative order of
collectives (``comms.decide_global_ordering_of_comms`` chains each to the
previous one) but ``config.reorder_for_peak_memory`` (on by default) re-sorts
all nodes with memory heuristics (lpmf/bfs/dfs, whichever has the lowest
estimated peak) and puts every wait right back after its collective: the
output code of a scheduled graph read ``all_gather, wait, all_gather, wait``
where the FX graph read ``all_gather, all_gather, wait, ...``. Turning that
config off globally would change every user's compile, so instead we make the
schedule a data dependency Inductor must respect: Inductor's own
``preserve_node_ordering`` (``fx_passes/control_dependencies.py``, no triton)
wraps a node in the ``control_deps`` HOP with extra inputs. Each owned wait
gets the compute node and the owned collective just before it as extra
dependencies (it cannot move up), and the compute node just after each owned collective gets the collective
(it cannot move down).

[Note: Inductor's simple_overlap]
From torch 2.14 Inductor's scheduler runs an overlap pass of its own by
default (``simple_overlap``, pytorch#184235): it moves every collective up,
past anything it does not depend on, until the previous collective, and
every wait down until the next wait, as long as its memory estimate of the
graph's peak does not grow. It never swaps two collectives, so the ranks
stay matched, but it knows nothing of our schedule's memory budget: in
a forward graph, whose estimated peak comes at the end, it hoisted every
all-gather to the top (measured on torch 2.15, tests/test_schedule_dist.py:
the output code read ``all_gather`` x4 before the first wait). With
``both_ways`` the pin also keeps each owned collective after the compute
node before it and each owned wait before the compute node after it, so
that pass leaves our collectives where our schedule put them and still
works on any collective we do not own. Measured both ways on torch 2.15
(2 ranks, benchmark GPT; benchmarks/RESULTS.md, "Two schedulers, one order"): the same
step time (paired, pinned / moved 1.009) and the same peak of tensor memory
(398.6 vs 392.6 MiB; two identical configurations differ by as much). So
``overlap.own_order`` (default True) pins both ways wherever this torch has
the pass (``compat.SIMPLE_OVERLAP``): the generated code then runs the order
our schedule chose and its report and timeline describe, within our memory
budget whatever the model's size, and the two schedulers never act on the
same collective.

[Note: Dependencies the graph has]
Each control dependency costs Inductor a ``control_deps`` node: a
subgraph it lowers on its own (``control_deps_op_lowering``) and more
fake tensor updates in its post-grad passes. So the pin adds none that a node
has through its data already: a reduce-scatter of a gradient follows the
compute that produced it, a block's gather issued ahead takes that
block's input, which follows the root's embedding (``follows``: a search
back through inputs, no further than the node depended on, remembering
what it found). And a gather issued ahead of a compile region
(``issue_ahead``, our op) is ordered after the one before it by its own
``after`` argument, as data: the token that orders them goes into a
region call whose body does not use it, so Dynamo drops it and no path
joins one to the next; as control dependencies they were one
``control_deps`` node a block. Measured on torch 2.15, 2 ranks (fake
group), the benchmark GPT, nodes wrapped (forward + backward graph): one
graph at 8 blocks 36 + 65 -> 27 + 45; regions at 32 blocks 36 + 5 -> 3 + 2;
a block compiled on its own 2 + 3 -> 2 + 2. Tested by
tests/test_schedule_fx.py::test_pin_both_ways_holds_collectives_up_and_waits_down
and ::test_pin_orders_gathers_issued_ahead_by_their_after.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from compiled_fsdp.core.marker import IssueAhead

from .cost_model import AG_W, ISSUES, WAIT
from .graph import chain_tag

ISSUE_AHEAD = torch.ops.compiled_fsdp.issue_ahead.default
REGATHER = torch.ops.compiled_fsdp.regather.default
# Our ops that issue collectives Inductor does not know for collectives (gloo's
# all-gather too: [Note: All-gathers on gloo] in compiled_fsdp/core/comm.py).
OPAQUE = (ISSUE_AHEAD, REGATHER, AG_W)
# (an issue-ahead follows what its ``after`` lists: [Note: Dependencies the graph has])
_AFTER = IssueAhead.names().index("after")
# Ops that read only their input's metadata: Inductor orders nothing by them.
_SHAPE_ONLY = frozenset(getattr(torch.ops.aten, name) for name in (
    "new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"))


# [Note: A view anchors nothing]
# The pin holds a wait below "the compute node before it" by making it depend
# on that node. Where that node was a view (``permute``, ``t``, ``view``:
# the transposed weight of the matmul before it, say) the dependency held
# nothing: Inductor computes no view where the graph has it (a view is a
# reinterpretation of its input, ready as soon as that input is), so the
# wait was free to move up to wherever that input existed. Seen in the
# emulated network's record (W=8, one graph, the benchmark's CPU model): the
# head's reduce-scatter, which the schedule waits after the last block's
# backward, was waited 4 ms after its issue in Inductor's code, and compute
# stood still for 16.5 ms of it where the timeline had 0.3 (RESULTS,
# fifty-seventh session). So a view, or an op that reads only its input's
# metadata, is never the node a collective or a wait is pinned against; the
# nearest node that computes is. Tested by
# tests/test_schedule_fx.py::test_pin_anchors_no_view.
def _anchors_nothing(n: object) -> bool:
    """A view (``_unsafe_view`` too, lowered as ``view``; a part of a
    ``split`` through its ``getitem``: the caller) or a metadata read."""
    target = getattr(n, "target", None)
    return bool(getattr(target, "is_view", False)) or target is torch.ops.aten._unsafe_view.default \
        or getattr(target, "overloadpacket", None) in _SHAPE_ONLY


def _with_after(args: tuple, kwargs: dict, value: object) -> tuple[tuple, dict]:
    """An ``issue_ahead``'s arguments with ``value`` added to its ``after``."""
    if "after" in kwargs:
        return args, {**kwargs, "after": [*kwargs["after"], value]}
    return (*args[:_AFTER], [*args[_AFTER], value], *args[_AFTER + 1:]), kwargs


def pin_order(graph: fx.Graph, both_ways: bool = False) -> int:
    """Adds the control dependencies that keep ``graph``'s current placement
    of owned collectives and waits; returns how many were added. With
    ``both_ways`` a collective cannot move up nor a wait down either (see
    [Note: Inductor's simple_overlap])."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]

    def owned(n: fx.Node) -> bool:
        # (a gather issued ahead of a compile region is ours too: [Note:
        # Gathers issued ahead of compile regions] in compiled_fsdp/compile/regions.py)
        return chain_tag(n) is not None or n.target in OPAQUE

    def is_compute(n: fx.Node) -> bool:
        # (a compile region's call cannot be wrapped in ``control_deps``, nor
        # what is taken from its outputs: Inductor lowers the call again inside
        # the wrapper, and a region's backward returns None for the shards
        # whose reduce the registry waits, [Note: A region's reduce-scatter
        # waited outside its graph] in compiled_fsdp/core/registry.py; nor a
        # view, which holds nothing in place: [Note: A view anchors nothing])
        call = n.args[0] if n.target is operator.getitem and n.args else n
        return not owned(n) and getattr(call, "target", None) is not torch.ops.higher_order.invoke_subgraph \
            and not any(_anchors_nothing(x) for x in (n, call))

    pos = {n: i for i, n in enumerate(graph.nodes)}
    known: dict[fx.Node, set[fx.Node]] = {}  # a node -> nodes found to depend on it

    def follows(n: fx.Node, first: fx.Node) -> bool:
        # Whether ``n`` depends on ``first`` through its inputs already, so a
        # dependency added on it changes nothing: see [Note: Dependencies
        # the graph has]. (Only nodes after ``first`` can lead to it.)
        found = known.setdefault(first, set())
        stack, parent = [n], {n: None}
        while stack:
            m = stack.pop()
            for x in () if getattr(m.target, "overloadpacket", None) in _SHAPE_ONLY else m.all_input_nodes:
                if x is first or x in found:
                    while m is not None:  # (the path found depends on it too)
                        found.add(m)
                        m = parent[m]
                    return True
                if pos[x] > pos[first] and x not in parent:
                    parent[x] = m
                    stack.append(x)
        return False

    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    as_data = 0

    def depend(n: fx.Node, first: fx.Node) -> None:
        nonlocal as_data
        if n.target is ISSUE_AHEAD and isinstance(first.meta.get("val"), torch.Tensor):  # (no ``control_deps``)
            n.args, n.kwargs = _with_after(n.args, dict(n.kwargs), first)
            if "eager_input_vals" in n.meta:  # (what Inductor lowers the arguments against, list by list:
                # ``constrain_to_fake_tensors`` zips them, and dropped the one added to the list alone)
                n.meta["eager_input_vals"] = _with_after(*n.meta["eager_input_vals"], first.meta["val"])
            as_data += 1
        else:
            deps.setdefault(n, OrderedSet()).add(first)

    for i, n in enumerate(nodes):
        if not owned(n) or n.target not in (*ISSUES, *OPAQUE, WAIT):
            continue
        if n.target is WAIT:
            prev = next((p for p in reversed(nodes[:i]) if is_compute(p)), None)
            if prev is not None and not follows(n, prev):
                depend(n, prev)
            issued = next((p for p in reversed(nodes[:i]) if p.target in ISSUES
                           and owned(p)), None)
            if issued is not None and not follows(n, issued):
                depend(n, issued)
            if both_ways:
                nxt = next((q for q in nodes[i + 1:] if is_compute(q)), None)
                if nxt is not None and not follows(nxt, n):
                    depend(nxt, n)
        else:
            if n.target in OPAQUE:  # (Inductor orders the collectives it knows; these it does not)
                # (and against each other: two in a row, a region's units' re-gathers)
                before = next((p for p in reversed(nodes[:i]) if p.target in (*ISSUES, *OPAQUE) and owned(p)), None)
                if before is not None and not follows(n, before):
                    depend(n, before)
                after = next((q for q in nodes[i + 1:] if q.target in (*ISSUES, *OPAQUE) and owned(q)), None)
                if after is not None and not follows(after, n):
                    depend(after, n)
            if both_ways:
                prev = next((p for p in reversed(nodes[:i]) if is_compute(p)), None)
                if prev is not None and not follows(n, prev):
                    depend(n, prev)
            nxt = next((q for q in nodes[i + 1:] if is_compute(q)), None)
            if nxt is not None and not follows(nxt, n):
                depend(nxt, n)
    preserve_node_ordering(graph, deps)
    return as_data + sum(len(v) for v in deps.values())
