"""The collectives a graph holds, as the scheduling pass sees them: the
ones the passes own (each with its issue chain and its lazy tail) and the
foreign ones (tensor parallelism's) that may or may not pin them."""

from __future__ import annotations

import dataclasses
import operator
from typing import Literal

import torch
import torch.fx as fx

from .cost_model import (
    AG,
    AG_W,
    ALL_TO_ALLS,
    GATHERS,
    REDUCE_SCATTERS,
    WAIT,
    all_gather_op,
    collective_group,
    node_bytes,
)
from .graph import ChainTag, chain_tag

__all__ = ["SCHEDULED", "CollKind", "Collective", "find_collectives", "gloo_gathers_by_work", "group_of", "is_barrier",
           "is_collective_op"]

# The collectives the schedule places. HSDP's all-reduce over the replicas
# (cost_model.AR) is not one of them: it reads only its reduce-scatter's
# result, so it rides in that collective's lazy tail (issued and waited when
# the reduced gradient is needed or the budget asks for room). Scheduled on
# its own, its cone swallowed the reduce-scatter's wait and the planner
# looped (a 4-rank HSDP job under Inductor hung in make_room).
SCHEDULED = (*GATHERS, *REDUCE_SCATTERS, *ALL_TO_ALLS)

_FOREIGN_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd", "compiled_fsdp")


# What the schedule places: a gather waited in this graph, a reduce-scatter
# (or gloo's all-to-all), or a handoff (the next block's gather, waited in the
# next graph).
CollKind = Literal["gather", "reduce", "handoff"]


@dataclasses.dataclass
class Collective:
    """One owned collective as the plan found it."""

    node: fx.Node
    kind: CollKind
    tag: ChainTag
    nbytes: int
    group: str  # process group name
    cone: list[fx.Node]  # issue chain, graph order
    wait: fx.Node | None
    barrier: int  # index of the last foreign collective before it (in barrier order), or -1
    tail: list[fx.Node] = dataclasses.field(default_factory=list)  # wait and after, graph order
    desired: int = 0  # earliest compute index worth issuing at (gathers)
    due: int = 0  # first compute index at which the compute left no longer hides it (gathers)


# [Note: Foreign collectives]
# Under FSDP x TP, Dynamo traces tensor parallelism's collectives (DTensor's
# redistributes: an all-gather before the column-wise matmuls, a
# reduce-scatter after the row-wise ones, with sequence parallelism) into the
# graph beside ours, on the ``tp`` group. As barriers they pinned every
# prefetch to the block it was for: a gather could not be issued above the
# previous block's last TP collective. They are ordered within their group
# (they stay in the compute order, which the schedule never permutes) and
# independent of ours (another group; every rank's graph has the same order,
# so no two ranks issue two groups' collectives in opposite orders), so only
# one on one of our groups, or on a group the plan cannot name, stays a
# barrier. Tested by tests/test_schedule_fx.py::test_tp_collectives_do_not_pin_the_gathers
# and tests/test_tensor_parallel.py.
_GROUPLESS = ("c10d", "compiled_fsdp")


def group_of(n: fx.Node) -> str | None:
    """The process group a functional collective, or the wait of one, runs on
    (its ``group_name``: the last string argument); None where it names none."""
    while n.target is WAIT or n.target is operator.getitem:
        if not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    name = n.kwargs.get("group_name")
    if name is None:
        names = [a for a in n.args if isinstance(a, str)]
        name = names[-1] if names else None
    return name


def is_barrier(n: fx.Node, ours: frozenset[str]) -> bool:
    """See [Note: Foreign collectives]."""
    if not _is_foreign_collective(n):
        return False
    group = None if n.target.namespace in _GROUPLESS else group_of(n)
    return group is None or group in ours


def _is_foreign_collective(n: fx.Node) -> bool:
    return chain_tag(n) is None and is_collective_op(n)


def is_collective_op(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    target = n.target
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return target.namespace in _FOREIGN_NAMESPACES


def _same_chain(a: fx.Node, tag: ChainTag) -> bool:
    return a.op == "call_function" and chain_tag(a) == tag


def find_collectives(graph: fx.Graph) -> list[Collective]:
    colls = []
    for n in graph.nodes:
        info = chain_tag(n)
        if info is None or n.target not in SCHEDULED:
            continue
        cone: list[fx.Node] = []
        stack = list(n.all_input_nodes)
        members = {n}
        while stack:
            a = stack.pop()
            if a in members or not _same_chain(a, info) or any(u not in members for u in a.users):
                continue
            members.add(a)
            cone.append(a)
            stack.extend(a.all_input_nodes)
        waits = [u for u in n.users if u.target is WAIT]
        kind = "handoff" if info.role == "handoff_issue" else "gather" if n.target in GATHERS else "reduce"
        colls.append(Collective(
            node=n, kind=kind,
            tag=info, nbytes=_held_bytes(n, cone), group=collective_group(n), cone=cone,
            wait=waits[0] if len(waits) == 1 else None, barrier=-1,
        ))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for c in colls:
        c.cone.sort(key=order.__getitem__)
        c.tail = sorted(_lazy_tail(c), key=order.__getitem__)
    return colls


def _held_bytes(n: fx.Node, cone: list[fx.Node]) -> int:
    """Bytes that collective ``n`` keeps alive while in flight. See [Note: In-flight bytes]."""
    src = n.args[0]
    assert isinstance(src, fx.Node)
    made_for_it = src in cone and any(not getattr(m.target, "is_view", False) for m in cone)
    return node_bytes(n) + (node_bytes(src) if made_for_it else 0)


def _lazy_tail(c: Collective) -> list[fx.Node]:
    """The wait and the nodes after it that read only the wait's chain (views,
    copy-out, the local sum of a gloo reduce)."""
    if c.wait is None:
        return []
    info = chain_tag(c.node)
    assert info is not None
    tail, stack = {c.wait: None}, list(c.wait.users)
    while stack:
        u = stack.pop()
        if u in tail or not _same_chain(u, info) or any(a not in tail for a in u.all_input_nodes):
            continue
        tail[u] = None
        stack.extend(u.users)
    return list(tail)


def gloo_gathers_by_work(graph: fx.Graph) -> int:
    """Every functional all-gather left in ``graph`` on a gloo group (one
    Dynamo traced: tensor parallelism's, [Note: Foreign collectives]) made
    the eager collective the lowering emits there ([Note: All-gathers on
    gloo] in compiled_fsdp/core/comm.py); returns how many. Same arguments,
    same ``wait_tensor``."""
    moved = 0
    for n in graph.nodes:
        if n.target is not AG or not isinstance(n.args[0], fx.Node):
            continue
        val = n.args[0].meta.get("val")
        if isinstance(val, torch.Tensor) and all_gather_op(collective_group(n), val.device) is AG_W:
            n.target = AG_W
            moved += 1
    return moved
