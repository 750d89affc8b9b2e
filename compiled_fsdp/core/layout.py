"""Where each rank's piece of a parameter lives, and how a bucket packs them.

[Note: Shard layout]
A parameter of full shape ``(d0, *rest)`` on a group of ``N`` ranks is cut on dim 0
into chunks of ``shard_d0 = ceil(d0 / N)`` rows, as ``torch.chunk`` and DTensor's
``Shard(0)`` cut it: rank ``r`` holds rows ``[r * shard_d0, (r + 1) * shard_d0)``
of the parameter, so trailing ranks may hold fewer rows, or none. That local
tensor is what the registered DTensor holds. For communication each rank's rows
are zero-padded to ``shard_d0``, so every rank contributes the same shape (which
the bucketed collectives need) and every size works on every world size.

[Note: Shard dims]
FSDP2's ``shard_placement_fn`` may shard a parameter on another dim than 0
(``Shard(1)``: MoE experts, stacked on dim 0, on their largest dim). The
registered DTensor is then ``Shard(d)``: its local tensor is this rank's
``torch.chunk(param, N, dim=d)`` piece, contiguous in the parameter's own
layout, as FSDP2 holds it. Everything below the parameter (the bucket
layout, the collectives, the marker ops and the passes) sees the parameter
with dim ``d`` moved first, its *canonical* form, where that piece is a
dim-0 chunk ([Note: Shard layout]): ``to_canonical`` is
``movedim(d, 0)``, a view. So the layout and the passes know one dim, and a
``Shard(d)`` parameter costs, beside a dim-0 one, the copy of its gathered
value into its own layout (eager: the unsharded buffer is in the
parameter's layout and the copy-out writes its canonical view; compiled:
``from_canonical`` and a contiguous copy after the marker, which Inductor
fuses with the copy-out, and which backward recomputes: [Note: Layout
copies of a gathered parameter are recomputed] in passes/recompute.py) and
of its gradient into the canonical layout. A
dim smaller than the group is refused (``shard_dim`` in validation.py).
Tested by tests/test_shard_dim.py. Known cost: a ``Shard(d)`` parameter read
twice in one traced graph (a tied weight, a read in a loop) traces two
``movedim`` views, which the lowering does not see as one shard, so its
bucket falls back to a gather per parameter (correct, not bucketed). Tried
2026-11-27: seeing through the permutation buckets the gathers, but the two
reads' gradients meet through two permutes, outside the accumulation tree
the reduce lowering knows, so the reduces stay per parameter. (That attempt
also found a rank holding an empty piece tracing its reads' views with
other strides: ``passes/graph.py`` now ignores an empty tensor's strides.)

[Note: Bucket layout]
A module's parameters are communicated as one bucket, ``T`` elements per rank:
the padded shards flattened and concatenated in parameter order. The all-gather
output ``[N * T]`` viewed ``[N, T]`` holds parameter ``i`` in columns
``[off_i, off_i + n_i)``, viewed ``[N * shard_d0, *rest]`` and cut to ``d0`` rows.
The reduce-scatter input is built the same way from the full gradients
zero-padded to ``N * shard_d0`` rows; its ``[T]`` result (summed over ranks) is
divided by ``N`` and cut per parameter back to the local rows.

With a mixed-precision policy ([Note: Mixed precision] in runtime/policy.py) a shard is
cast to its compute dtype before its pad, a gradient to its reduce dtype before
the pack (``reduce_input``, which also adds what was kept without sync), and a
reduced shard to the parameter's dtype after the cut: the casts are layout
steps like the others, so both paths emit them identically.

The functions below are the one definition of that layout. They take an
``Emit``: the eager runtime and the marker ops pass ``EAGER``, which runs each
step at once; the lowering (passes/lowering.py) passes its ``NodeBuilder``,
which adds the same steps to the graph. Both paths therefore run the same ops in
the same order, so the compiled step's results are bitwise those of the eager
runtime (tests/test_compile_parity.py).

[Note: Rank-independent graphs]
A rank's local shard may have fewer rows than another's, so the traced graphs of
two ranks differ in those input shapes. The passes must still reach the same
decisions on every rank (the collectives' order depends on them), so the nodes a
layout function emits have the same structure and cost estimate on every rank:
the shard's pad is emitted even when it pads nothing (its cost is estimated from
its output, see passes/cost_model.py) and the cut back to the local rows is a
view. Only ``EAGER`` skips a pad of zero rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    world_size: int
    # What the summed gradient is divided by (FSDP2's
    # ``set_gradient_divide_factor``); None: ``divisor``'s mean.
    divide_factor: Optional[float] = None
    # HSDP: how many replicas of this shard group the gradient is also summed
    # over (all-reduced on the replicate group); see [Note: HSDP] in runtime/api.py.
    replicas: int = 1

    @property
    def divisor(self) -> float:
        """What the summed gradient is divided by: the factor set, else the
        number of ranks that contributed (shard group x replicas): the mean."""
        return self.divide_factor or self.world_size * self.replicas

    @property
    def dim0(self) -> int:
        return self.full_shape[0]  # scalar parameters are rejected by fully_shard

    @property
    def rest(self) -> tuple[int, ...]:
        return tuple(self.full_shape[1:])

    @property
    def shard_dim0(self) -> int:
        return -(-self.dim0 // self.world_size)

    @property
    def padded_dim0(self) -> int:
        return self.shard_dim0 * self.world_size

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.shard_dim0, *self.rest)

    @property
    def shard_numel(self) -> int:
        return self.shard_dim0 * math.prod(self.rest)

    def local_dim0(self, rank: int) -> int:
        """Rows of the unpadded parameter that ``rank`` holds: ``torch.chunk``'s
        (and DTensor ``Shard(0)``'s) split, so trailing ranks may hold fewer
        rows, or none. See [Note: Parameters are DTensors] in runtime/param.py."""
        return max(0, min(self.shard_dim0, self.dim0 - rank * self.shard_dim0))

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of ``full`` without padding, as a new contiguous tensor:
        what its DTensor shard holds."""
        lo = min(rank * self.shard_dim0, self.dim0)
        rows = full.reshape(self.dim0, *self.rest)[lo : lo + self.local_dim0(rank)]
        return rows.clone(memory_format=torch.contiguous_format)


def split_specs(full_shapes: Sequence[int], ndims: Sequence[int], world_size: int,
                divide_factor: Optional[float] = None, replicas: int = 1) -> list[ShardSpec]:
    """The specs of a bucket whose full shapes come flattened into one list
    (``gather_next``'s and ``reduce_next``'s ``full_shapes``), with each
    parameter's number of dimensions, the bucket's divide factor and replicas."""
    out, at = [], 0
    for nd in ndims:
        out.append(ShardSpec(tuple(int(d) for d in full_shapes[at:at + nd]), world_size, divide_factor, replicas))
        at += nd
    return out


def joined_shapes(specs: Sequence[ShardSpec]) -> list[int]:
    """The specs' full shapes flattened into one list, as ``split_specs`` reads them."""
    return [d for spec in specs for d in spec.full_shape]


def bucket_offsets(specs: Sequence[ShardSpec]) -> list[int]:
    """Column offset of each parameter inside a ``[N, T]`` bucket. See [Note: Bucket layout]."""
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += spec.shard_numel
    return offsets


def bucket_width(specs: Sequence[ShardSpec]) -> int:
    """``T`` of a ``[N, T]`` bucket: one rank's shards side by side. See [Note: Bucket layout]."""
    return sum(spec.shard_numel for spec in specs)


def to_canonical(t: torch.Tensor, shard_dim: int) -> torch.Tensor:
    """``t`` with ``shard_dim`` first: a view ([Note: Shard dims])."""
    return t if shard_dim == 0 else t.movedim(shard_dim, 0)


def from_canonical(t: torch.Tensor, shard_dim: int) -> torch.Tensor:
    """``to_canonical`` undone: a view."""
    return t if shard_dim == 0 else t.movedim(0, shard_dim)


class Emit(Protocol):
    """Runs (or records) one op of a layout function; see [Note: Bucket layout]."""

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Any: ...

    def value(self, x: Any) -> torch.Tensor:
        """The tensor (or its fake value) that ``x`` stands for."""
        ...


class _Eager:
    """Runs each step at once on real tensors."""

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        if target is aten.constant_pad_nd.default and not any(args[1]):
            return args[0].contiguous()  # see [Note: Rank-independent graphs]
        return target(*args, **kwargs)

    def value(self, x: Any) -> torch.Tensor:
        return x


EAGER: Emit = _Eager()


def _contiguous(op: Emit, x: Any) -> Any:
    if op.value(x).is_contiguous():
        return x
    return op(aten.clone.default, x, memory_format=torch.contiguous_format)


def cast(op: Emit, x: Any, dtype: Optional[torch.dtype]) -> Any:
    """``x`` in ``dtype`` (a new tensor), or ``x`` itself when it already is.
    (The prim, not ``aten._to_copy``: the joint passes run after Inductor's
    decompositions, and Inductor lowers the prim but not ``_to_copy``.)"""
    if dtype is None or op.value(x).dtype == dtype:
        return x
    return op(torch.ops.prims.convert_element_type.default, x, dtype)


def to_device(op: Emit, x: Any, device: Optional[str]) -> Any:
    """``x`` on ``device`` (a new tensor), or ``x`` itself when it is there
    (``device`` None: wherever it is). CPU offload's copies ([Note: CPU
    offload] in runtime/policy.py): a shard to the compute device before its
    gather, non-blocking (from pinned memory the copy overlaps); a reduced
    gradient back to the CPU, blocking (the optimizer reads it at once). The
    prim, not ``aten._to_copy``, as ``cast`` says."""
    if device is None or op.value(x).device == torch.device(device):
        return x
    target = torch.device(device)
    return op(torch.ops.prims.device_put.default, x, target, target.type != "cpu")


def _pad_rows(spec: ShardSpec, rows: int) -> list[int]:
    """``constant_pad_nd``'s pad argument that appends ``rows`` zero rows."""
    return [0, 0] * len(spec.rest) + [0, rows]


def pack_shards(
    op: Emit, shards: Sequence[Any], specs: Sequence[ShardSpec],
    dtypes: Optional[Sequence[Optional[torch.dtype]]] = None, device: Optional[str] = None,
) -> Any:
    """The all-gather input ``[T]``: each local shard copied to ``device``
    (``to_device``), cast to its compute dtype (``dtypes``), zero-padded to
    ``shard_d0`` rows, flattened, concatenated."""
    flats = []
    for i, (shard, spec) in enumerate(zip(shards, specs)):
        shard = cast(op, to_device(op, shard, device), dtypes[i] if dtypes is not None else None)
        missing = spec.shard_dim0 - op.value(shard).shape[0]
        padded = op(aten.constant_pad_nd.default, shard, _pad_rows(spec, missing))
        flats.append(op(aten.view.default, padded, [spec.shard_numel]))
    return op(aten.cat.default, flats) if len(flats) > 1 else flats[0]


def unpack_gathered(
    op: Emit, gathered: Any, specs: Sequence[ShardSpec],
    offsets: Optional[Sequence[int]] = None, total: Optional[int] = None,
) -> list[Any]:
    """Each parameter's full value out of an all-gather output ``[N * T]``.
    ``offsets``/``total``: where ``specs`` sit in a bucket that holds more
    parameters (default: ``specs`` are the whole bucket, in order)."""
    world = specs[0].world_size
    offsets = bucket_offsets(specs) if offsets is None else offsets
    total = bucket_width(specs) if total is None else total
    rows = op(aten.view.default, gathered, [world, total])
    fulls = []
    for spec, off in zip(specs, offsets):
        piece = _contiguous(op, op(aten.slice.Tensor, rows, 1, off, off + spec.shard_numel))
        full = op(aten.view.default, piece, [spec.padded_dim0, *spec.rest])
        if spec.padded_dim0 != spec.dim0:
            full = op(aten.slice.Tensor, full, 0, 0, spec.dim0)
        fulls.append(full)
    return fulls


def post_forward_part(op: Emit, gathered: Any, size: int, rank: int) -> Any:
    """What a rank keeps of an all-gather output ``[N * T]`` after forward when
    it reshards to groups of ``size`` consecutive ranks ([Note: Resharding to
    a smaller group] in runtime/groups.py): its group rank's ``1/size``,
    copied out. An all-gather of the parts over that group is the output again.
    (The lowering emits it as one op, ``copy_out.keep_part``.)"""
    numel = op.value(gathered).numel() // size
    return op(aten.clone.default, op(aten.slice.Tensor, gathered, 0, rank * numel, (rank + 1) * numel))


def reduce_input(op: Emit, grad: Any, kept: Any, dtype: Optional[torch.dtype]) -> Any:
    """The full gradient to reduce: ``grad`` in the reduce dtype, added to the
    gradient ``kept`` from micro-batches without sync (None: nothing kept)."""
    return with_kept(op, cast(op, grad, dtype), kept)


def with_kept(op: Emit, grad: Any, kept: Any) -> Any:
    """``grad`` (already in the reduce dtype; None: no gradient this time)
    added to the gradient ``kept`` from micro-batches without sync (None:
    nothing kept)."""
    if kept is None or grad is None:
        return grad if kept is None else kept
    return op(aten.add.Tensor, kept, grad)


def pack_grads(
    op: Emit, grads: Sequence[Any], specs: Sequence[ShardSpec],
    offsets: Optional[Sequence[int]] = None, total: Optional[int] = None,
) -> Any:
    """The reduce-scatter input ``[N * T]`` from the full gradients. With
    ``offsets``/``total`` (a bucket that holds more parameters than ``specs``,
    or a ``None`` gradient): the columns no gradient fills are zeros."""
    world = specs[0].world_size
    if offsets is None:
        offsets, total = bucket_offsets(specs), bucket_width(specs)
    assert total is not None, "a bucket's total width comes with its offsets"
    cols, cursor, like = [], 0, next(g for g in grads if g is not None)
    for grad, spec, off in sorted(zip(grads, specs, offsets), key=lambda x: x[2]):
        if grad is None:
            continue
        if off > cursor:
            cols.append(_zeros(op, like, [world, off - cursor]))
        g = _contiguous(op, grad)
        if spec.padded_dim0 != spec.dim0:
            g = op(aten.constant_pad_nd.default, g, _pad_rows(spec, spec.padded_dim0 - spec.dim0))
        cols.append(op(aten.view.default, g, [world, spec.shard_numel]))
        cursor = off + spec.shard_numel
    if total > cursor:
        cols.append(_zeros(op, like, [world, total - cursor]))
    cat = op(aten.cat.default, cols, 1) if len(cols) > 1 else cols[0]
    return op(aten.view.default, cat, [world * total])


def _zeros(op: Emit, like: Any, shape: list[int]) -> Any:
    v = op.value(like)
    return op(aten.zeros.default, shape, dtype=v.dtype, device=v.device)


def sum_received(op: Emit, received: Any, world: int) -> Any:
    """The reduce-scatter's sum, from an all-to-all's ``[N * T]`` output (every
    rank's ``[T]`` for this rank, in rank order); see [Note: Reduce-scatter on
    gloo] in comm.py."""
    return op(aten.sum.dim_IntList, op(aten.view.default, received, [world, -1]), [0])


def average(op: Emit, summed: Any, divisor: float) -> Any:
    """The summed ``[T]`` divided by the bucket's ``ShardSpec.divisor``: the
    mean over the ranks that contributed, or the factor set."""
    return op(aten.div.Tensor, summed, divisor)


def split_averaged(
    op: Emit, avg: Any, specs: Sequence[ShardSpec], local_rows: Sequence[int],
    dtypes: Optional[Sequence[Optional[torch.dtype]]] = None, device: Optional[str] = None,
) -> list[Any]:
    """Each local shard's gradient from the averaged ``[T]``, in the
    parameter's dtype (``dtypes``), on ``device`` (``to_device``)."""
    grads = []
    for i, (spec, off, rows) in enumerate(zip(specs, bucket_offsets(specs), local_rows)):
        piece = op(aten.slice.Tensor, avg, 0, off, off + spec.shard_numel)
        shard = op(aten.view.default, piece, list(spec.shard_shape))
        rows_only = op(aten.slice.Tensor, shard, 0, 0, rows)
        grads.append(to_device(op, cast(op, rows_only, dtypes[i] if dtypes is not None else None), device))
    return grads


def split_reduced(
    op: Emit, summed: Any, specs: Sequence[ShardSpec], local_rows: Sequence[int],
    dtypes: Optional[Sequence[Optional[torch.dtype]]] = None, device: Optional[str] = None,
) -> list[Any]:
    """The averaged gradient of each local shard from the summed ``[T]``:
    ``average``, then ``split_averaged``."""
    return split_averaged(op, average(op, summed, specs[0].divisor), specs, local_rows, dtypes, device)
