"""Casts before gathers: a float8 cast that a graph applies to a gathered
parameter moves in front of the gather.

[Note: Float8 weights cast before their gather in graphs]
torchao's float8 training weights (``Float8LinearConfig(
enable_fsdp_float8_all_gather=True)``) are an all-gather extension
([Note: All-gather extensions] in compiled_fsdp/runtime/ext_gather.py):
under FSDP2 each rank casts its shard to float8, with the amax all-reduced
over the mesh, gathers one byte per element and wraps the bytes into the
float8 weight. In a whole-model graph the read of such a weight instead
returns its high-precision value through an ordinary ``unshard`` marker
(the local shard's high-precision tensor, aliased: ``graph_shard`` in
runtime/param.py), and torchao's ``Float8Linear`` casts that plain weight
itself, as it casts any weight: ``abs -> max`` (the amax), a chain of scalar
ops (the scale), and ``mul -> clamp -> to float8``. This pass moves that
cast in front of the gather, on the joint graph before the lowering:

- the amax becomes the shard's own amax (of its rows and a zero, so a rank
  holding none still takes part) and a ``max`` all-reduce over the shard
  group, one for all the graph's reads: exactly the global amax, as FSDP2's
  pre-hook computes it;
- the scalar chain and the elementwise cast run on the shard (elementwise
  ops commute with the gather, row by row); these run at the graph's start,
  where they read only graph inputs (the shard is made again from its input
  there, through ``movedim`` for ``Shard(d > 0)``), so the gather that
  follows is free to move as any other (a collective at each read was a
  barrier to the schedule);
- the float8 shard is gathered as bytes (``uint8``: gloo has no float8) by
  an ``unshard`` marker of its own, viewed back as float8, and the views
  that led from the marker to the cast are replayed on it.

A read marked ``cast_from_shard`` (torchao's float8 weights: the graph reads
them in their compute dtype, as FSDP2's post-hook makes them) is cast from
the shard in its own dtype, not in ``param_dtype``: what FSDP2's pre-hook
casts, so bf16 mixed precision with float8 stays bitwise FSDP2's.

The backward's cast of the same weight (torchao recasts the saved weight for
the input's gradient) is the same chain, so it maps to the same nodes: one
float8 gather a read, and the lowering's recompute
tags regather the float8 bytes in backward where the module reshards. The
nodes on the shards are tagged to be recomputed too (all but the amaxes'
all-reduce, which the partitioner saves): backward casts the shard again
from the fp32 shard, a graph input, rather than keeping every float8 shard
from forward (a quarter of the fp32 shards of those weights). The
weight's gradient still flows through the high-precision marker's
``reduce_grad``. Nothing is approximated: the float8 bytes and the scale are
the ones the high-precision path computes (from the shard's dtype where the
read says so), so the result is bitwise that path's, and FSDP2's wherever
torchao's two casts agree (not with ``round_scales_to_power_of_2``, which
only the matmul's own cast applies).

A read is rewritten only when every use of its gathered value (through
views) is such a cast: otherwise the high-precision gather is needed anyway,
and the read is left as it is. Reads handed over between graphs or issued
ahead (blocks compiled on their own, compile regions) are left as they are
too (a torchao float8 weight is not read in those graphs: its group runs the
eager runtime's extension gather there). Tested by
tests/test_float8.py and tests/test_passes_fx.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compiled_fsdp.core.marker import Unshard

from .cost_model import AR, WAIT
from .graph import (
    NodeBuilder,
    aten,
    is_layout_op,
    is_tangent,
    is_unshard,
    node_order,
    parse_marker,
)
from .recompute import FSDP_AC_GRAPH_ID

prims = torch.ops.prims

FLOAT8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
# Elementwise ops of the cast itself (a tensor operand, scalars, constants).
_ELEMENTWISE = frozenset({
    aten.mul.Tensor, aten.div.Tensor, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten._to_copy.default, prims.convert_element_type.default,
})
# And of the scale's scalar chain (torchao's power-of-two rounding included).
_SCALAR = _ELEMENTWISE | frozenset({
    aten.reciprocal.default, aten.log2.default, aten.floor.default, aten.exp2.default, aten.pow.Scalar,
})
_AMAX = frozenset({aten.max.default, aten.amax.default})


@dataclasses.dataclass
class CastGatherReport:
    # Reads whose float8 cast moved before their gather: "<module_key>.<param_index>".
    moved: list[str] = dataclasses.field(default_factory=list)
    # Reads with a float8 cast left after the gather, and why.
    kept: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.moved)


def _is_copy_to(n: fx.Node) -> Optional[torch.dtype]:
    """The dtype a pure dtype conversion converts to."""
    if n.target is aten._to_copy.default and set(n.kwargs) == {"dtype"}:
        return n.kwargs["dtype"]
    if n.target is prims.convert_element_type.default:
        return n.args[1]
    return None


def _tensor_args(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _is_scalar(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


class _Read:
    """One ``unshard`` marker and what its gathered value flows into (every
    collection ordered as the graph is, so every rank rewrites alike)."""

    def __init__(self, marker: fx.Node) -> None:
        self.marker = marker
        # The marker's value and its views: node -> the views leading to it.
        self.views: dict[fx.Node, list[fx.Node]] = {marker: []}
        stack = [marker]
        while stack:
            v = stack.pop()
            for u in v.users:
                if u not in self.views and is_layout_op(u) and _tensor_args(u) == [v]:
                    self.views[u] = self.views[v] + [u]
                    stack.append(u)
        self.casts: dict[fx.Node, fx.Node] = {}  # each float8 conversion -> the view it converts
        self.chain: dict[fx.Node, None] = {}  # their elementwise nodes and scales
        # Scalars computed from the value's amaxes by scalar ops: the scales.
        self.scales: dict[fx.Node, None] = {}
        stack = [u for v in self.views for a in v.users if a.target is aten.abs.default
                 for u in a.users if self._amax(u)]
        while stack:
            n = stack.pop()
            if n not in self.scales:
                self.scales[n] = None
                stack.extend(u for u in n.users if u.target in _SCALAR and _is_scalar(u))
        # Nodes the cast reads as they are (constants, other inputs): defined before the marker?
        self.outside: dict[fx.Node, None] = {}

    def _amax(self, n: fx.Node) -> bool:
        if n.target not in _AMAX or not _is_scalar(n):
            return False
        (src,) = _tensor_args(n) or [None]
        return src is not None and src.target is aten.abs.default and _tensor_args(src)[0] in self.views \
            and len(src.users) == 1

    def _scale(self, n: fx.Node, seen: dict[fx.Node, None]) -> bool:
        """Whether scalar ``n`` depends on the value only through amaxes
        (the value's other uses are refused by ``match``)."""
        if n in seen:
            return True
        if n not in self.scales:
            self.outside[n] = None  # (independent of the value)
            return True
        seen[n] = None
        if self._amax(n):
            seen[n.args[0]] = None
            return True
        return all(self._scale(a, seen) for a in _tensor_args(n))

    def _elementwise(self, n: fx.Node, seen: dict[fx.Node, None], leaf: list[fx.Node]) -> bool:
        """Whether ``n`` is elementwise in one view of the value, with scales."""
        if n in self.views:
            leaf.append(n)
            return True
        if _is_scalar(n):
            return self._scale(n, seen)
        if n.target not in _ELEMENTWISE:
            return False
        seen[n] = None
        return all(self._elementwise(a, seen, leaf) for a in _tensor_args(n))

    def match(self, order: dict[fx.Node, int]) -> Optional[str]:
        """Finds the casts; the reason when the read cannot be rewritten."""
        users = {u: None for v in self.views for u in v.users if u not in self.views}
        for n in users:
            for cast in [n] if _is_copy_to(n) in FLOAT8 else _casts_below(n):
                seen: dict[fx.Node, None] = {}
                leaf: list[fx.Node] = []
                outside = dict(self.outside)
                if not self._elementwise(cast.args[0], seen, leaf) or len(set(leaf)) != 1:
                    self.outside = outside
                    continue  # (a cast of something else: the activation a norm's weight scales)
                self.casts[cast] = leaf[0]
                self.chain.update(seen)
        if not self.casts:
            return "no float8 cast"
        for u in users:
            if u not in self.chain:
                return f"{u.name} reads the high-precision value"
        for n in self.chain:
            if not _is_scalar(n) and any(u not in self.chain and u not in self.casts for u in n.users):
                return f"{n.name} is read outside the cast"
        for n in self.outside:
            if is_tangent(n) or n.op != "placeholder" and order[n] > order[self.marker]:
                return f"the cast reads {n.name}, computed after the gather"
        for n in self.chain:
            if self._amax(n) and any(u not in self.chain for u in n.users):
                return f"its amax {n.name} is read outside the cast"
        return None


def _casts_below(n: fx.Node) -> list[fx.Node]:
    """The float8 conversions reached from ``n`` through elementwise ops."""
    out, stack, seen = [], [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if _is_copy_to(m) in FLOAT8:
            out.append(m)
        elif m.target in _ELEMENTWISE or m.target is aten.abs.default or m.target in _AMAX:
            stack.extend(m.users)
    return out


class _Replay:
    """Re-emits reads' casts on their parameter's shard, one node per distinct
    expression (the reads of one parameter, and the forward's and backward's
    cast of one read, share them)."""

    def __init__(self, b: NodeBuilder, shard: fx.Node, amax: fx.Node) -> None:
        self.b, self.shard, self.amax = b, shard, amax
        self.memo: dict[Any, fx.Node] = {}

    def key(self, n: fx.Node, read: _Read) -> Any:
        if n in read.views:
            return ("value",)
        if read._amax(n):
            return ("amax",)
        if n not in read.chain and n not in read.casts:
            return ("node", n)  # (outside: a constant or another input, used as it is)
        args = tuple(self.key(a, read) if isinstance(a, fx.Node) else a for a in n.args)
        kwargs = tuple(sorted((k, self.key(v, read) if isinstance(v, fx.Node) else v) for k, v in n.kwargs.items()))
        return (n.target, args, kwargs)

    def emit(self, n: fx.Node, read: _Read) -> fx.Node:
        k = self.key(n, read)
        if k == ("value",):
            return self.shard
        if k == ("amax",):
            return self.amax
        if k[0] == "node":
            return n
        if k not in self.memo:
            args = tuple(self.emit(a, read) if isinstance(a, fx.Node) else a for a in n.args)
            kwargs = {name: self.emit(v, read) if isinstance(v, fx.Node) else v for name, v in n.kwargs.items()}
            self.memo[k] = self.b(n.target, *args, **kwargs)
        return self.memo[k]


_PERMUTES = frozenset({aten.permute.default, aten.t.default, aten.transpose.int})


def _shard_views(m: Unshard) -> Optional[list[fx.Node]]:
    """The layout ops from a graph input to the marker's shard (a parameter
    sharded on another dim than 0 is read through ``movedim``), or None
    where the shard is not a view of a graph input."""
    views, n = [], m.shard
    while n.op != "placeholder":
        if not is_layout_op(n) or len(_tensor_args(n)) != 1:
            return None
        views.append(n)
        n = _tensor_args(n)[0]
    return views[::-1]


def _shard(b: NodeBuilder, m: Unshard) -> fx.Node:
    """The marker's shard, made again from its graph input at ``b``'s place,
    contiguous (a copy where a view permutes it: decided by the ops, alike
    on every rank), in its compute dtype: what its gather would send."""
    views = _shard_views(m)
    assert views is not None
    shard = _tensor_args(views[0])[0] if views else m.shard
    for view in views:
        shard = b(view.target, shard, *view.args[1:], **view.kwargs)
    if any(v.target in _PERMUTES for v in views):
        shard = b(aten.clone.default, shard, memory_format=torch.contiguous_format)
    if m.param_dtype is not None and m.param_dtype != shard.meta["val"].dtype and not m.cast_from_shard:
        shard = b(prims.convert_element_type.default, shard, m.param_dtype)
    return shard


def _param_key(m: Unshard) -> tuple[int, int]:
    return (m.module_key, m.param_index)


def _amaxes(b: NodeBuilder, shards: dict[tuple[int, int], fx.Node], groups: dict[tuple[int, int], str]
            ) -> dict[tuple[int, int], fx.Node]:
    """Each parameter's global amax, in its shard's dtype: its shard's (of its
    rows and a zero: a rank may hold none), all-reduced (``max``) with the
    other parameters' on its group in one collective, in float64 (exact for
    every float dtype)."""
    out: dict[tuple[int, int], fx.Node] = {}
    for group in dict.fromkeys(groups.values()):
        keys = [k for k in shards if groups[k] == group]
        local = []
        for k in keys:
            flat = b(aten.view.default, b(aten.abs.default, shards[k]), [-1])
            padded = b(aten.constant_pad_nd.default, flat, [0, 1])
            wide = b(prims.convert_element_type.default, b(aten.max.default, padded), torch.float64)
            local.append(b(aten.view.default, wide, [1]))
        both = b(aten.cat.default, local) if len(local) > 1 else local[0]
        summed = b(WAIT, b(AR, both, "max", group))
        for i, k in enumerate(keys):
            out[k] = b(prims.convert_element_type.default, b(aten.select.int, summed, 0, i),
                       shards[k].meta["val"].dtype)
    return out


def _rewrite(graph: fx.Graph, reads: list[_Read]) -> None:
    """Everything on the shards at the graph's start (only graph inputs are
    read: the gathers stay free to move as any other), then each read's
    float8 gather in its place."""
    start = next(n for n in graph.nodes if n.op != "placeholder")
    parsed = {r: Unshard.parse(r.marker) for r in reads}
    with graph.inserting_before(start):
        b = NodeBuilder(graph)
        shards: dict[tuple[int, int], fx.Node] = {}
        for r, m in parsed.items():
            if _param_key(m) not in shards:
                shards[_param_key(m)] = _shard(b, m)
        groups = {_param_key(m): m.group_name for m in parsed.values()}
        amaxes = _amaxes(b, shards, groups)
        replays = {k: _Replay(b, shards[k], amaxes[k]) for k in shards}
        wires: dict[fx.Node, fx.Node] = {}
        for r, m in parsed.items():
            replay = replays[_param_key(m)]
            for cast in r.casts:
                q = replay.emit(cast, r)
                if q not in wires:
                    wires[q] = b(aten.view.dtype, q, torch.uint8)
            # A scale read outside the cast (the matmul's dequantization) reads the shard's.
            for n in [n for n in r.chain if _is_scalar(n) and not r._amax(n)]:
                n.replace_all_uses_with(replay.emit(n, r), delete_user_cb=lambda u, r=r: u not in r.chain)
    for n in b.created:  # (made again in backward from the shards and the all-reduced amaxes, not saved)
        if n.target not in (AR, WAIT):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = FSDP_AC_GRAPH_ID
    for r, m in parsed.items():
        replay = replays[_param_key(m)]
        with graph.inserting_before(r.marker):
            # (the module stack too: the units place a parameter where it is first read, [Note: Units])
            b = NodeBuilder(graph, {k: r.marker.meta[k] for k in ("partitioner_tag", "stack_trace", "nn_module_stack")
                                    if k in r.marker.meta})
            gathered: dict[fx.Node, fx.Node] = {}
            for cast, leaf in r.casts.items():
                q = replay.emit(cast, r)
                if q not in gathered:
                    fields = dataclasses.replace(m, shard=wires[q], param_dtype=None).values()
                    gathered[q] = b(aten.view.dtype, b(Unshard.op().default, **fields), q.meta["val"].dtype)
                out = gathered[q]
                for view in r.views[leaf]:
                    out = b(view.target, out, *view.args[1:], **view.kwargs)
                cast.replace_all_uses_with(out)
    # What the reads no longer use, users first (one graph order for all reads).
    order = node_order(graph)
    replaced = {n: None for r in reads for n in (*r.casts, *r.chain, *r.views)}
    for n in sorted(replaced, key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)


def cast_before_gather(gm: fx.GraphModule) -> CastGatherReport:
    """Moves each read's float8 casts in front of its gather ([Note: Float8
    weights cast before their gather in graphs])."""
    report = CastGatherReport()
    reads: list[_Read] = []
    order = node_order(gm.graph)
    for marker in [n for n in gm.graph.nodes if is_unshard(n)]:
        try:
            _, m = parse_marker(marker)
        except ValueError:
            continue
        name = f"{m.module_key}.{m.param_index}"
        if m.gathered is not None or m.take_ahead or m.post_forward is not None:
            continue
        read = _Read(marker)
        reason = read.match(order)
        if reason is None and _shard_views(m) is None:
            reason = "its shard is not a view of a graph input"
        if reason == "no float8 cast":
            continue
        if reason is not None:
            report.kept[name] = reason
            continue
        reads.append(read)
        if name not in report.moved:
            report.moved.append(name)
    if reads:
        _rewrite(gm.graph, reads)
        gm.graph.lint()
        gm.recompile()
    return report
