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
  group: exactly the global amax, as FSDP2's pre-hook computes it;
- the scalar chain and the elementwise cast run on the shard (elementwise
  ops commute with the gather, row by row);
- the float8 shard is gathered as bytes (``uint8``: gloo has no float8) by
  an ``unshard`` marker of its own, viewed back as float8, and the views
  that led from the marker to the cast are replayed on it.

The backward's cast of the same weight (torchao recasts the saved weight for
the input's gradient) is the same chain, so it maps to the same nodes: one
amax all-reduce and one float8 gather a read, and the lowering's recompute
tags regather the float8 bytes in backward where the module reshards. The
weight's gradient still flows through the high-precision marker's
``reduce_grad``. Nothing is approximated: the float8 bytes and the scale are
the ones the high-precision path computes, so the result is bitwise that
path's (and FSDP2's, wherever torchao's two casts agree: not with
``round_scales_to_power_of_2``, which only the matmul's own cast applies).

A read is rewritten only when every use of its gathered value (through
views) is such a cast: otherwise the high-precision gather is needed anyway,
and the read is left as it is. Reads handed over between graphs or issued
ahead (blocks compiled on their own, compile regions) are not rewritten:
those groups run the eager runtime's extension gather. Tested by
tests/test_float8.py and tests/test_passes_fx.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx

from compiled_fsdp.core.marker import Unshard

from .cost_model import AR, WAIT
from .graph import (
    NodeBuilder,
    aten,
    erase_nodes,
    is_layout_op,
    is_unshard,
    node_order,
    parse_marker,
    through_identity_views,
)

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

    @property
    def amax_dtype(self) -> torch.dtype:
        """The dtype of the value's amax (its compute dtype)."""
        return self.marker.meta["val"].dtype

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
                if not self._elementwise(cast.args[0], seen, leaf) or len(set(leaf)) != 1:
                    return f"{cast.name}: not an elementwise float8 cast of one view"
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
            if n.op != "placeholder" and order[n] > order[self.marker]:
                return f"the cast reads {n.name}, computed after the gather"
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
    """Re-emits a read's cast on its shard, one node per distinct expression."""

    def __init__(self, b: NodeBuilder, read: _Read, shard: fx.Node, amax: fx.Node) -> None:
        self.b, self.read, self.shard, self.amax = b, read, shard, amax
        self.memo: dict[Any, fx.Node] = {}
        self.keys: dict[fx.Node, Any] = {}

    def key(self, n: fx.Node) -> Any:
        if n in self.read.views:
            return ("value",)
        if self.read._amax(n):
            return ("amax",)
        if n not in self.read.chain and n not in self.read.casts:
            return ("node", n)  # (outside: a constant or another input, used as it is)
        if n not in self.keys:
            args = tuple(self.key(a) if isinstance(a, fx.Node) else a for a in n.args)
            kwargs = tuple(sorted((k, self.key(v) if isinstance(v, fx.Node) else v) for k, v in n.kwargs.items()))
            self.keys[n] = (n.target, args, kwargs)
        return self.keys[n]

    def emit(self, n: fx.Node) -> fx.Node:
        k = self.key(n)
        if k == ("value",):
            return self.shard
        if k == ("amax",):
            return self.amax
        if k[0] == "node":
            return n
        if k not in self.memo:
            args = tuple(self.emit(a) if isinstance(a, fx.Node) else a for a in n.args)
            kwargs = {name: self.emit(v) if isinstance(v, fx.Node) else v for name, v in n.kwargs.items()}
            self.memo[k] = self.b(n.target, *args, **kwargs)
        return self.memo[k]


def _shard(b: NodeBuilder, m: Unshard) -> fx.Node:
    """The marker's shard (the graph input its reads alias, defined before
    every marker) in its compute dtype: what its gather would send."""
    shard = through_identity_views(m.shard)
    if m.param_dtype is not None and m.param_dtype != shard.meta["val"].dtype:
        return b(prims.convert_element_type.default, shard, m.param_dtype)
    return shard


def _amaxes(graph: fx.Graph, reads: list[_Read]) -> list[fx.Node]:
    """The reads' global amaxes, one ``max`` all-reduce for all: each shard's
    amax, of its rows and a zero (a rank may hold none)."""
    first = min((r.marker for r in reads), key=node_order(graph).__getitem__)
    m0 = Unshard.parse(first)
    with graph.inserting_before(first):
        b = NodeBuilder(graph, {k: first.meta[k] for k in ("partitioner_tag", "stack_trace") if k in first.meta})
        local = []
        for r in reads:
            flat = b(aten.view.default, b(aten.abs.default, _shard(b, Unshard.parse(r.marker))), [-1])
            padded = b(aten.constant_pad_nd.default, flat, [0, 1])
            local.append(b(aten.max.default, b(prims.convert_element_type.default, padded, torch.float32)))
        ones = [b(aten.view.default, x, [1]) for x in local]
        both = b(aten.cat.default, ones) if len(ones) > 1 else ones[0]
        summed = b(WAIT, b(AR, both, "max", m0.group_name))
        out = []
        for i, r in enumerate(reads):
            amax = b(aten.select.int, summed, 0, i)
            dtype = r.amax_dtype
            out.append(amax if dtype == torch.float32 else b(prims.convert_element_type.default, amax, dtype))
        return out


def _rewrite(graph: fx.Graph, read: _Read, amax: fx.Node) -> None:
    marker = read.marker
    m = Unshard.parse(marker)
    with graph.inserting_before(marker):
        b = NodeBuilder(graph, {k: marker.meta[k] for k in ("partitioner_tag", "stack_trace") if k in marker.meta})
        replay = _Replay(b, read, _shard(b, m), amax)
        gathered: dict[fx.Node, fx.Node] = {}
        for cast, leaf in read.casts.items():
            q = replay.emit(cast)
            if q not in gathered:
                wire = b(aten.view.dtype, q, torch.uint8)
                fields = dataclasses.replace(m, shard=wire, param_dtype=None).values()
                full = b(Unshard.op().default, **fields)
                gathered[q] = b(aten.view.dtype, full, q.meta["val"].dtype)
            out = gathered[q]
            for view in read.views[leaf]:
                out = b(view.target, out, *view.args[1:], **view.kwargs)
            cast.replace_all_uses_with(out)
        # A scale read outside the cast (the matmul's dequantization) reads the shard's.
        for n in [n for n in read.chain if _is_scalar(n) and not read._amax(n)]:
            n.replace_all_uses_with(replay.emit(n), delete_user_cb=lambda u: u not in read.chain)
    dead = list({n: None for n in (*read.casts, *read.chain, *read.views)})
    while dead:
        gone = [n for n in dead if not n.users]
        if not gone:
            break
        erase_nodes(graph, gone)
        dead = [n for n in dead if n not in gone]


def cast_before_gather(gm: fx.GraphModule) -> CastGatherReport:
    """Moves each read's float8 casts in front of its gather ([Note: Float8
    weights cast before their gather in graphs])."""
    report = CastGatherReport()
    by_group: dict[tuple[int, str], list[_Read]] = {}
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
        if reason == "no float8 cast":
            continue
        if reason is not None:
            report.kept[name] = reason
            continue
        by_group.setdefault((m.module_key, m.group_name), []).append(read)
        report.moved.append(name)
    for reads in by_group.values():
        for read, amax in zip(reads, _amaxes(gm.graph, reads)):
            _rewrite(gm.graph, read, amax)
    if report.changed:
        gm.graph.lint()
        gm.recompile()
    return report
