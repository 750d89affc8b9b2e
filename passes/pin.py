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
"""

from __future__ import annotations

import torch.fx as fx
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
from torch.utils._ordered_set import OrderedSet

from .cost_model import ISSUES, WAIT
from ._graph import chain_tag


def pin_order(graph: fx.Graph, both_ways: bool = False) -> int:
    """Adds the control dependencies that keep ``graph``'s current placement
    of owned collectives and waits; returns how many were added. With
    ``both_ways`` a collective cannot move up nor a wait down either (see
    [Note: Inductor's simple_overlap])."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]

    def is_compute(n: fx.Node) -> bool:
        return chain_tag(n) is None

    deps: dict[fx.Node, OrderedSet[fx.Node]] = {}
    for i, n in enumerate(nodes):
        if chain_tag(n) is None or n.target not in (*ISSUES, WAIT):
            continue
        if n.target is WAIT:
            prev = next((p for p in reversed(nodes[:i]) if is_compute(p)), None)
            if prev is not None and prev not in n.all_input_nodes:
                deps.setdefault(n, OrderedSet()).add(prev)
            issued = next((p for p in reversed(nodes[:i]) if p.target in ISSUES
                           and chain_tag(p) is not None), None)
            if issued is not None and issued not in n.all_input_nodes:
                deps.setdefault(n, OrderedSet()).add(issued)
            if both_ways:
                nxt = next((q for q in nodes[i + 1:] if is_compute(q)), None)
                if nxt is not None and n not in nxt.all_input_nodes:
                    deps.setdefault(nxt, OrderedSet()).add(n)
        else:
            if both_ways:
                prev = next((p for p in reversed(nodes[:i]) if is_compute(p)), None)
                if prev is not None and prev not in n.all_input_nodes:
                    deps.setdefault(n, OrderedSet()).add(prev)
            nxt = next((q for q in nodes[i + 1:] if is_compute(q)), None)
            if nxt is not None and n not in nxt.all_input_nodes:
                deps.setdefault(nxt, OrderedSet()).add(n)
    preserve_node_ordering(graph, deps)
    return sum(len(v) for v in deps.values())
