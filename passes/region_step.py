"""A step with compile regions, predicted: each region's call and each
pinned node run as their bodies, the collectives inside ops as at run time.

[Note: A step with compile regions predicted]
With the regions' calls expanded (``expand_regions``) and a ``RunTimeChain``,
``simulate`` runs the ops that collect inside ([Note: Collectives inside an
op] in passes/timeline.py) as at run time ([Note: Gathers issued
ahead of compile regions] in compiled_fsdp/compile/regions.py): an
``issue_ahead``'s gather is taken by the ``regather`` of the same shards;
a backward ``regather`` takes the gather issued for it (the first one's
when the graph begins: the root's compiled backward begins) and then
issues the next backward ``regather``'s; a ``reduce_later`` first moves
the earlier ones a stage on, and the graph's end waits the last ([Note: A region's
reduce-scatter waited outside its graph] in compiled_fsdp/core/registry.py).
Under HSDP the next ``reduce_later`` waits the reduce-scatter and issues
the replicas' all-reduce of its rows, and the one after it waits that
(on the inter-node link only where the replicas' ranks span nodes:
``CostModel.spans_nodes``). Each collective moves its bucket padded to
whole shards, as the run time packs it; over a shard group of one rank
(``replicate``) it moves nothing and is not issued. A nested region's own
graph is predicted too, before the graph that calls it. Tested by
tests/test_emulated.py::test_benchmark_cpu_path,
test_a_region_takes_the_gather_issued_ahead,
test_region_reduces_staged_under_hsdp,
test_region_reduce_bytes_padded_and_one_rank_sends_none and
test_benchmark_levers_hsdp_bf16_reduce.
"""

from __future__ import annotations

import collections
import operator

import torch
import torch.fx as fx

from compiled_fsdp.core.marker import ReduceLater, Regather

from .cost_model import CostModel, node_bytes
from .timeline import (
    IN_OP_MARKERS,
    REDUCE_LATER,
    REGATHER,
    Timeline,
    collective_bytes,
    collective_world_size,
    simulate,
)

__all__ = ["RunTimeChain", "expand_regions", "predict_with_regions"]


INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _body(owner: fx.GraphModule, n: fx.Node) -> fx.GraphModule | None:
    """The graph a node runs as its body: a compile region's call
    (``invoke_subgraph(body, identifier, *operands)``) or a node the pin
    pass wrapped (Inductor's ``control_deps(deps, body, *operands)``: [Note:
    Inductor reorders for peak memory] in pin.py)."""
    if n.op != "call_function":
        return None
    if n.target is INVOKE_SUBGRAPH:
        attr = n.args[0]
    elif isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() == "control_deps":
        attr = n.args[1]
    else:
        return None
    if not (isinstance(attr, fx.Node) and attr.op == "get_attr"):
        return None
    try:
        body = operator.attrgetter(str(attr.target))(owner)
    except AttributeError:
        return None
    return body if isinstance(body, fx.GraphModule) else None


def expand_regions(owner: fx.GraphModule, order: list[fx.Node]) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """``order`` (nodes of ``owner``'s graph) with each node that runs a body
    graph (``_body``: a compile region's call, a pinned node) replaced by a
    copy of the body's nodes, one copy per call, so that each call's nodes
    are distinct; and the source of each copy's input (the call's operand
    it stands for) and of a pinned node (its op's copy). The copies live in
    graphs of their own: the owner's graph is left as it is."""
    out: list[fx.Node] = []
    sources: dict[fx.Node, fx.Node] = {}
    for n in order:
        body = _body(owner, n)
        if body is None:
            out.append(n)
            continue
        copy = fx.Graph()
        result = copy.graph_copy(body.graph, {})
        inputs = copy.find_nodes(op="placeholder")
        sources.update((p, a) for p, a in zip(inputs, n.args[2:]) if isinstance(a, fx.Node))
        if n.target is not INVOKE_SUBGRAPH and isinstance(result, fx.Node):
            sources[n] = result
        inner, more = expand_regions(body, [c for c in copy.nodes if c.op not in ("placeholder", "output")])
        for c in inner:  # (each copy names the call of the owner's graph it runs in: ``RunTimeChain``)
            c.meta["region_call"] = n
        out += inner
        sources.update(more)
    return out, sources


def predict_with_regions(gm: fx.GraphModule) -> Timeline:
    """The timeline of a graph that calls compile regions, each call run as
    its body and each pinned node as its op (``expand_regions``), the
    collectives inside ops as at run time (the note above), every
    collective communication: what the graph's run exposes."""
    expanded, sources = expand_regions(gm, [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")])
    chain = RunTimeChain(expanded, sources)
    return simulate(expanded, CostModel.for_nodes(expanded), foreign=True, chain=chain)


class RunTimeChain:
    """What the ops that collect inside take, wait and issue in an order
    with its regions' calls expanded (the note above; ``timeline.Chain``).

    The run time keys a pending gather by its shards' storage: here, by the
    nodes the shards come from, through the copies' inputs and through views
    (a shard on a dim other than 0 is read through ``to_canonical``). An
    ``issue_ahead`` issues the gather of each part of its bucket some
    forward ``regather`` reads, in the order they are read (the whole bucket
    where one reads it whole; [Note: A bucket issued in the parts its graph
    takes] in compiled_fsdp/core/registry.py), each standing for the
    ``regather`` that takes it; the backward's chain runs through the region
    calls that re-gather, each issuing every re-gather of the next call
    when its first re-gather runs."""

    def __init__(self, order: list[fx.Node], sources: dict[fx.Node, fx.Node]) -> None:
        self.sources = sources
        regathers = [n for n in order if n.target is REGATHER]
        backward = [n for n in regathers if Regather.bind(n.args, dict(n.kwargs)).backward]
        calls: dict[object, list[fx.Node]] = collections.defaultdict(list)
        for n in backward:  # (by the outermost call: a pinned node's body is a copy of its own)
            calls[n.meta.get("region_call", n.graph)].append(n)
        groups = list(calls.values())
        behind = set(backward)
        self.forward_reads = [(self._key(n), n) for n in regathers if n not in behind]  # (keyed once)
        self.next = {group[0]: later for group, later in zip(groups, groups[1:])}
        self.issued_first = groups[0] if groups else []  # (when the root's compiled backward begins)
        self.pending: dict[object, fx.Node] = {n: n for n in self.issued_first}

    def _source(self, x: object) -> object:
        while True:
            if x in self.sources:
                x = self.sources[x]
            elif isinstance(x, fx.Node) and x.op == "call_function" and getattr(x.target, "is_view", False):
                x = x.args[0]
            else:
                return x

    def _key(self, n: fx.Node) -> object:
        if n.target is REGATHER and Regather.bind(n.args, dict(n.kwargs)).backward:
            return n
        return tuple(self._source(s) for s in IN_OP_MARKERS[n.target].bind(n.args, dict(n.kwargs)).shards)

    def issued_ahead(self, n: fx.Node) -> list[fx.Node]:
        """The forward ``regather``s an ``issue_ahead`` issues for, one
        gather each (none: it issues nothing)."""
        whole, parts, seen = set(self._key(n)), [], set()
        for key, r in self.forward_reads:
            if key not in seen and whole.issuperset(key):
                seen.add(key)
                parts.append(r)
                self.pending[key] = r
        return parts

    def taken(self, n: fx.Node) -> fx.Node | None:
        """The node whose gather a ``regather`` takes (None: it gathers)."""
        return self.pending.pop(self._key(n), None) if n.target is REGATHER else None

    def issued_after(self, n: fx.Node) -> list[fx.Node]:
        """A region call's first backward ``regather`` issues the next call's."""
        then = self.next.get(n, [])
        for t in then:
            self.pending[t] = t
        return then

    def packed_bytes(self, n: fx.Node) -> int:
        """What an op that collects inside copies before its collective: the
        shards it packs (a gather's), or the gradients (a ``reduce_later``'s),
        each byte read and written once; and a ``reduce_later``'s kept
        gradients, read once more by their add ([Note: Kept gradients added
        where the bucket is packed] in compiled_fsdp/core/ops.py)."""
        full = collective_bytes(n)
        if n.target is not REDUCE_LATER:
            return 2 * (full // max(collective_world_size(n), 1))
        kept = ReduceLater.bind(n.args, dict(n.kwargs)).kept
        return 2 * full + sum(node_bytes(k) for k in kept if isinstance(k, fx.Node))
