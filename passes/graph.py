"""The passes' graph vocabulary, public to the tools and tests that read
lowered graphs: marker parsing, the lowering's ``ChainTag``, fake-value node
construction, and a stable topological sort."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Union

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map, tree_map_only

from compiled_fsdp.core.marker import MARKERS, GatherNext, Marker, ReduceGrad, ReduceNext, Unshard

aten = torch.ops.aten

UNSHARD_OP_NAME = Unshard.qualname()
REDUCE_GRAD_OP_NAME = ReduceGrad.qualname()
# A block's graph hands the next block's gather over (see [Note: Gathers handed
# to the next block's graph] in compiled_fsdp/compile/entry.py).
GATHER_NEXT_OP_NAME = GatherNext.qualname()
REDUCE_NEXT_OP_NAME = ReduceNext.qualname()

# Key under which passes record their own bookkeeping in node.meta.
META_KEY = "compiled_fsdp"

# Metadata copied from a marker onto the nodes that replace it, so the
# partitioner keeps forward/backward placement (``partitioner_tag``) and
# debug info (stack traces, module stacks).
COPIED_META = (
    "partitioner_tag", "seq_nr", "stack_trace", "autograd_backward", "nn_module_stack",
    "fwd_nn_module_stack", "source_fn_stack", "fwd_source_fn_stack",
)


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def is_unshard(node: fx.Node) -> bool:
    return _op_name(node) == UNSHARD_OP_NAME


def is_reduce_grad(node: fx.Node) -> bool:
    return _op_name(node) == REDUCE_GRAD_OP_NAME


def is_gather_next(node: fx.Node) -> bool:
    return _op_name(node) == GATHER_NEXT_OP_NAME


def is_reduce_next(node: fx.Node) -> bool:
    return _op_name(node) == REDUCE_NEXT_OP_NAME


_MARKER_OPS = (UNSHARD_OP_NAME, REDUCE_GRAD_OP_NAME, GATHER_NEXT_OP_NAME, REDUCE_NEXT_OP_NAME)


def is_marker(node: fx.Node) -> bool:
    """Whether ``node`` is one of the markers the lowering replaces."""
    return _op_name(node) in _MARKER_OPS


def has_markers(graph: fx.Graph) -> bool:
    return any(is_marker(n) for n in graph.nodes)


# The static arguments of a marker node, parsed (see [Note: The marker
# contract] in compiled_fsdp/core/marker.py).
MarkerArgs = Union[Unshard, ReduceGrad]


def marker_kept(node: fx.Node) -> fx.Node | None:
    """The marker's ``kept`` input: the gradient sink (``sync=False``) or the
    gradient kept from earlier micro-batches; see [Note: Accumulation without
    sync in graphs] in compiled_fsdp/core/ops.py."""
    kept = _marker_type(node).bind(node.args, dict(node.kwargs)).kept
    return kept if isinstance(kept, fx.Node) else None


def marker_gathered(node: fx.Node) -> fx.Node | None:
    """An ``unshard`` marker's handed-over gather (a graph input), or None."""
    gathered = Unshard.bind(node.args, dict(node.kwargs)).gathered
    return gathered if isinstance(gathered, fx.Node) else None


def _marker_type(node: fx.Node) -> type[Marker]:
    name = _op_name(node)
    return next(m for m in MARKERS if m.qualname() == name)


def parse_marker(node: fx.Node) -> tuple[fx.Node, MarkerArgs]:
    """Returns (tensor input node, static args) of an ``unshard`` or
    ``reduce_grad`` node. Raises ValueError when an argument is symbolic (the
    passes only bucket static shapes)."""
    args = _marker_type(node).parse(node)
    inp = args.shard if isinstance(args, Unshard) else args.grad
    if not isinstance(inp, fx.Node):
        raise ValueError("marker input is not a graph node")
    return inp, args


Role = Literal["gather_chain", "reduce_chain", "keep_chain", "handoff_issue", "handoff_chain", "handoff_grad",
               "post_forward_part", "post_forward_chain"]


@dataclasses.dataclass(frozen=True)
class ChainTag:
    """What the lowering records on each node it adds, under
    ``node.meta[META_KEY]``: the contract between the lowering and the passes
    and tools that read its output (recompute tags, scheduling, timelines, dumps)."""

    # "gather_chain" | "reduce_chain" | "keep_chain", and around a handed-over
    # gather: "handoff_issue" (issued for the next block, not waited here),
    # "handoff_chain" (the wait and unpack of this block's), "handoff_grad"
    # (this block's gradient, packed for the issuer); "post_forward_part": what
    # an int reshard_after_forward keeps of a forward gather, "post_forward_chain":
    # its backward's gather of those parts (passes/post_forward.py).
    role: Role
    # The bucket's smallest (module_key, unit): its name. module_key is the n-th
    # ``fully_shard`` call, unit its index in forward use order (see units.py).
    module_key: int
    unit: int
    units: tuple[tuple[int, int], ...]  # every (module_key, unit) in the bucket
    reshard_after_forward: bool | None  # gather chains: recompute in backward

    @property
    def bucket(self) -> str:
        """The bucket's name in reports: ``<module_key>.<unit>``."""
        return f"{self.module_key}.{self.unit}"


def chain_meta(src: fx.Node, tag: ChainTag) -> dict[str, Any]:
    """The metadata of a node the lowering adds in place of marker ``src``:
    the marker's ``COPIED_META`` and ``tag``."""
    meta: dict[str, Any] = {k: src.meta[k] for k in COPIED_META if k in src.meta}
    meta[META_KEY] = tag
    return meta


def chain_tag(node: fx.Node) -> ChainTag | None:
    """The lowering's tag on ``node``, if it made it."""
    tag = node.meta.get(META_KEY)
    return tag if isinstance(tag, ChainTag) else None


class NodeBuilder:
    """Inserts call_function nodes and fills ``meta["val"]`` by running the op
    on the input fake values under the graph's fake mode.

    [Note: meta val on new nodes]
    Every node added to the joint graph must carry ``meta["val"]``: the
    partitioner and Inductor read it (``KeyError: 'val'`` otherwise). We
    compute it by executing the target on the inputs' fake tensors, which also
    validates shapes at pass time rather than at Inductor lowering time.
    """

    def __init__(self, graph: fx.Graph, extra_meta: dict[str, Any] | None = None) -> None:
        self.graph = graph
        vals = [n.meta.get("val") for n in graph.nodes if "val" in n.meta]
        try:
            self.fake_mode = detect_fake_mode(vals)
        except AssertionError:
            # Several fake modes (e.g. make_fx in real mode gives each value
            # its own): fall back to the inputs' own mode per node.
            self.fake_mode = None
        self.extra_meta = dict(extra_meta or {})
        self.created: list[fx.Node] = []

    def __call__(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = tree_map(
            lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, (args, kwargs)
        )
        mode = self.fake_mode
        if mode is None:
            flat = [a for a in torch.utils._pytree.tree_leaves(fake_args)
                    if isinstance(a, torch.Tensor)]
            mode = getattr(flat[0], "fake_mode", None) if flat else None
            if mode is not None:
                fake_args = tree_map(
                    lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, fake_args
                )
        if mode is not None:
            with mode:
                val = target(*fake_args, **fake_kwargs)
        else:  # graphs traced without fake tensors (meta/real "val")
            val = target(*fake_args, **fake_kwargs)
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            from torch.fx.passes.shape_prop import _extract_tensor_metadata

            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        for k, v in self.extra_meta.items():
            node.meta[k] = dict(v) if isinstance(v, dict) else v
        self.created.append(node)
        return node

    @staticmethod
    def value(node: Any) -> Any:
        """The fake value a node stands for (so layout functions in
        compiled_fsdp/core/layout.py can build nodes; see [Note: Bucket layout])."""
        return node.meta["val"] if isinstance(node, fx.Node) else node


_ALIAS_OPS = (aten.view.default, aten.alias.default, aten._unsafe_view.default)


def _identity_view_source(node: fx.Node) -> fx.Node | None:
    """What ``node`` aliases unchanged, if it is a ``view``/``alias`` with its
    input's shape and strides (``DTensor.to_local()`` traces as one per read)."""
    if node.op != "call_function" or node.target not in _ALIAS_OPS:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    va, vb = node.meta.get("val"), src.meta.get("val")
    same = (
        isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
        and tuple(va.shape) == tuple(vb.shape)
        # (an empty tensor's strides mean nothing, and differ: a rank holding no
        # piece of a parameter must see what the others see, [Note: Rank-independent graphs])
        and (va.stride() == vb.stride() or va.numel() == 0)
    )
    return src if same else None


def through_identity_views(node: fx.Node) -> fx.Node:
    """The node ``node`` aliases unchanged, through any shape-preserving views."""
    while (src := _identity_view_source(node)) is not None:
        node = src
    return node


def is_identity_view_of(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a shape-preserving view of ``src``."""
    return _identity_view_source(node) is src


def accumulation_root(markers: Sequence[fx.Node]) -> tuple[fx.Node, list[fx.Node]] | None:
    """The single node that sums the outputs of ``markers`` (a tree of
    ``aten.add`` and shape-preserving views over them, as AOTAutograd builds
    for several uses of one input) and the tree's nodes, or None when their
    sum reaches more than one consumer outside the tree."""
    members = dict.fromkeys(markers)
    acc: list[fx.Node] = []
    grew = True
    while grew:
        grew = False
        for m in list(members):
            for u in m.users:
                if u in members:
                    continue
                is_acc = (
                    u.target is aten.add.Tensor and len(u.args) == 2 and not u.kwargs
                    and all(isinstance(a, fx.Node) and a in members for a in u.args)
                )
                if is_acc or is_identity_view_of(u, m):
                    members[u] = None
                    acc.append(u)
                    grew = True
    roots = [m for m in members if any(u not in members for u in m.users)]
    return (roots[0], acc) if len(roots) == 1 else None


# Ops that only re-lay-out their tensor input (a view, or a copy of one).
_LAYOUT_OPS = frozenset({
    aten.permute, aten.clone, aten.view, aten._unsafe_view, aten.reshape, aten.t,
    aten.transpose, aten.alias, aten.expand, aten.unsqueeze, aten.squeeze,
})


def is_layout_op(n: fx.Node) -> bool:
    """Whether ``n`` only re-lays-out its tensor input (``view.dtype`` included)."""
    return n.op == "call_function" and getattr(n.target, "overloadpacket", None) in _LAYOUT_OPS


def is_tangent(n: fx.Node) -> bool:
    """A gradient input of a joint or backward graph (AOTAutograd names them
    ``tangents_<i>``; its partitioner tells them apart the same way)."""
    return n.op == "placeholder" and str(n.target).startswith("tangents")


def tangent_dependents(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that depend on a tangent input: its backward."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if is_tangent(n) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def region_calls(graph: fx.Graph) -> list[int]:
    """The positions of the calls of compile regions (``invoke_subgraph``), each
    of which reads another module's parameters inside its own graph ([Note:
    Blocks as compile regions] in compiled_fsdp/compile/regions.py): where the
    outer graph's units and buckets must not join across."""
    return [i for i, n in enumerate(graph.nodes) if n.target is torch.ops.higher_order.invoke_subgraph]


def none_from_regions(gm: fx.GraphModule) -> int:
    """Each output of a compile region's call that its graph returns as None
    (the gradient of a shard whose reduce the registry waits: [Note: A
    region's reduce-scatter waited outside its graph] in
    compiled_fsdp/core/registry.py), taken by ``getitem``, becomes None where
    the graph returns it, and a sum of two (a region called twice) the other
    term, or None: the outer graph was traced before the region's graph was
    lowered, and neither Inductor nor ``aten.add`` takes a None. Returns how
    many outputs were None."""
    add = torch.ops.aten.add.Tensor
    none: dict[fx.Node, None] = {}
    for call in gm.graph.nodes:
        if call.op != "call_function" or call.target is not torch.ops.higher_order.invoke_subgraph:
            continue
        body = getattr(gm, str(call.args[0].target), None)
        if isinstance(body, fx.GraphModule):
            outs = body.graph.output_node().args[0]
            none.update((u, None) for u in call.users
                        if u.target is operator.getitem and outs[u.args[1]] is None)
    count = len(none)
    for n in gm.graph.nodes:  # (graph order: a sum's terms come first)
        if n.target is add and not n.kwargs and any(a in none for a in n.args):
            terms = [a for a in n.args if a not in none]
            if terms:
                n.replace_all_uses_with(terms[0])
            else:
                none[n] = None
    for n in none:
        for user in n.users:
            if not (user.op == "output" or user.target is add and user in none
                    or user.target is add and not user.users):
                raise RuntimeError(f"compiled_fsdp: a compile region's gradient, reduced after the region, is "
                                   f"read by {user.format_node()}; please report this")
    return_none_for(gm.graph, none)
    order = node_order(gm.graph)
    dead = list(none) + [n for n in gm.graph.nodes if n.target is add and not n.users
                         and any(a in none for a in n.args)]
    erase_nodes(gm.graph, sorted(dict.fromkeys(dead), key=order.__getitem__))
    return count


def stable_topological_sort(graph: fx.Graph) -> int:
    """Reorders nodes so every node follows its inputs, moving as few as
    possible (a node is only delayed until its inputs exist). Returns the
    number of nodes moved. Deterministic: depends only on graph order."""
    ready: set[fx.Node] = set()
    order: list[fx.Node] = []
    waiting: dict[fx.Node, list[fx.Node]] = {}
    pending: set[fx.Node] = set()

    def emit(first: fx.Node) -> None:
        stack = [first]
        while stack:
            n = stack.pop()
            order.append(n)
            ready.add(n)
            woken = [
                w for w in waiting.pop(n, [])
                if w in pending and all(i in ready for i in w.all_input_nodes)
            ]
            for w in woken:
                pending.discard(w)
            stack.extend(reversed(woken))

    for n in graph.nodes:
        missing = [i for i in n.all_input_nodes if i not in ready]
        if not missing:
            emit(n)
        else:
            pending.add(n)
            for i in missing:
                waiting.setdefault(i, []).append(n)
    if pending:
        raise RuntimeError("graph has a cycle")
    moved = sum(1 for a, b in zip(order, graph.nodes) if a is not b)
    if moved:
        for prev, n in zip(order, order[1:]):
            prev.append(n)
    return moved


# [Note: One pass over the output]
# A pass that makes the graph return None in place of some nodes (gradients
# reduced after a compile region's graph) rewrites the output node once,
# for all of them: a rewrite per node walked the whole output each time
# (a whole model's backward returns a gradient per parameter), quadratic in
# depth: 352 walks of the outer backward's output at 32 blocks, 0.5-0.9 s of
# a cold first step under cProfile (benchmarks/RESULTS.md, fifty-first
# session). Tested by tests/test_region_graph_fx.py::test_none_from_regions_rewrites_the_output_once.
def return_none_for(graph: fx.Graph, nodes: dict[fx.Node, None] | set[fx.Node]) -> None:
    """Where ``graph``'s output returns one of ``nodes``, it returns None
    instead ([Note: One pass over the output])."""
    if nodes:
        out = graph.output_node()
        out.args = tree_map_only(fx.Node, lambda a: None if a in nodes else a, out.args)


def erase_nodes(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erases nodes in reverse graph order (users first)."""
    order = node_order(graph)
    for n in sorted(nodes, key=lambda x: order[x], reverse=True):
        graph.erase_node(n)
