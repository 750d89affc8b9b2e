"""FSDP2's all-gather extensions: parameters whose local shard is a tensor
subclass that says how it is gathered.

[Note: All-gather extensions]
A shard may define ``fsdp_pre_all_gather(mesh)`` (or FSDP2's longer form
``(mesh, outer_size, outer_stride, module, mp_policy)``) returning
``(inputs, metadata)``: the tensors to gather in its place, and what the
other hook needs; and ``fsdp_post_all_gather(outputs, metadata,
param_dtype, *, out=None)`` returning ``(unsharded, inner_tensors)`` from
the gathered ``outputs``, or, given ``out`` (the unsharded tensor it made
before), refreshing it in place. torchao's float8 training weights
(``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``) are such
shards: the pre-hook casts the shard to float8 (its amax all-reduced over
the mesh, or a scale ``precompute_float8_dynamic_scale_for_fsdp`` set),
so one byte per element crosses the wire, and the post-hook wraps the
gathered bytes and the scale into the float8 weight the matmul reads.

The gather of a group holding such a shard packs, per rank, every
parameter's pieces (a plain parameter's one piece: its shard cast to its
compute dtype; an extension's: its pre-hook's inputs), each zero-padded to
the group's shard rows ([Note: Shard layout] in core/layout.py) as a plain
shard is, so uneven sizes work (FSDP2 asks the hook to pad itself), as long
as every rank holds rows (``check_extensions`` in validation.py: a hook
takes its shard's amax). A hook that returns inputs of another shape raises
on the ranks that see it, before their gather, as under FSDP2. The pieces
travel as one flat bucket: in their dtype when they share one that every
backend carries, else as their bytes (``uint8``; gloo has no float8 dtype,
and FSDP2's group of only float8 weights fails there).
The gathered pieces are copied out into buffers that live as long as the
parameter (their storage freed at reshard and refilled at the next gather,
so autograd's saved views see the new bytes, as [Note: Eager autograd
through UnshardFn] needs), and the post-hook turns them into the unsharded
value, once, then refreshes it with ``out=``, as FSDP2 does. Gradients are
the plain gradients of that value and are reduced as any other.

The layout of the pieces (their shapes and dtypes) and the metadata come
from the last pre-hook and are kept until the next: an int
``reshard_after_forward`` regathers the forward's bytes in backward
([Note: Resharding to a smaller group] in groups.py) and the
post-hook gets the forward's metadata again (FSDP2 refuses that case;
checked once, not in CI: 4 ranks, ``reshard_after_forward=2``, torchao's
float8 blocks, eager and ``aot_eager``, bitwise to the reference).

Compiled: a group with an extension parameter is gathered by this eager
runtime around compiled code (compile/path.py), so its weights cross the
wire in the extension's form; except torchao's float8 weights in a
whole-model graph, which the graph gathers itself, cast before the gather
by the passes ([Note: Float8 weights cast before their gather in graphs]
in passes/cast_gather.py). Tested by tests/test_float8.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from compiled_fsdp.core import comm
from compiled_fsdp.core.comm import PendingCollective
from compiled_fsdp.core.layout import EAGER, cast
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy
from compiled_fsdp.runtime.streams import CommStreams

__all__ = ["Extension", "ExtensionGather", "casts_in_graph", "extension_of"]


def extension_of(local: torch.Tensor, fqn: str) -> bool:
    """Whether ``local`` (a parameter's local tensor) defines the all-gather
    extension; a ValueError if it defines one hook of the two."""
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        has, lacks = ("fsdp_pre_all_gather", "fsdp_post_all_gather")[:: 1 if pre else -1]
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a {type(local).__name__}, which defines {has} but not "
            f"{lacks}. FSDP's all-gather extension needs both: fsdp_pre_all_gather(mesh) -> (inputs, "
            "metadata) and fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> "
            "(unsharded, inner_tensors). Define the missing one, or neither (the tensor is gathered as is).")
    if pre:
        n = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
        if n not in (1, 5):
            raise ValueError(
                f"fully_shard: parameter {fqn!r}: {type(local).__name__}.fsdp_pre_all_gather takes {n} "
                "arguments; FSDP calls it as fsdp_pre_all_gather(mesh) or fsdp_pre_all_gather(mesh, "
                "outer_size, outer_stride, module, mp_policy).")
    return pre


def casts_in_graph(local: torch.Tensor) -> bool:
    """Whether ``local`` is torchao's float8 training weight, whose hooks a
    compiled graph replaces by its own cast ([Note: Float8 weights cast
    before their gather in graphs] in passes/cast_gather.py)."""
    cls = type(local)
    return cls.__name__ == "WeightWithDynamicFloat8CastTensor" and cls.__module__.startswith("torchao.float8") \
        and isinstance(getattr(local, "_tensor", None), torch.Tensor)


class Extension:
    """One extension parameter's gather state: its hooks' last metadata, its
    gathered buffers and the unsharded value the post-hook made of them."""

    def __init__(self, local: torch.Tensor, module: nn.Module, mesh: DeviceMesh, outer_size: torch.Size,
                 outer_stride: tuple[int, ...], mp_policy: MixedPrecisionPolicy) -> None:
        self.casts_in_graph = casts_in_graph(local)
        # FSDP2's two forms of the pre-hook, told apart once by its arity (``extension_of`` checked it).
        self.long_form = len(inspect.signature(local.fsdp_pre_all_gather).parameters) == 5
        self.module = module
        self.mesh = mesh  # the shard mesh (HSDP: its last dim), FSDP2's ``shard_mesh_from_root``
        self.outer_size, self.outer_stride = outer_size, outer_stride
        self.mp_policy = mp_policy
        self.metadata: Any = None
        self.outputs: list[torch.Tensor] = []  # the gathered inputs, full rows
        self.unsharded: Optional[torch.Tensor] = None

    def inputs(self, local: torch.Tensor) -> list[torch.Tensor]:
        """The pre-hook's inputs for ``local`` (its metadata kept)."""
        if self.long_form:
            inputs, self.metadata = local.fsdp_pre_all_gather(
                self.mesh, self.outer_size, self.outer_stride, self.module, self.mp_policy)
        else:
            inputs, self.metadata = local.fsdp_pre_all_gather(self.mesh)
        return list(inputs)

    def buffers(self, pieces: Sequence["Piece"], rows: int) -> list[torch.Tensor]:
        """The gathered buffers (``rows`` rows each), their storage allocated."""
        if [(tuple(t.shape), t.dtype) for t in self.outputs] != [((rows, *p.rest), p.dtype) for p in pieces]:
            self.outputs = [torch.empty((rows, *p.rest), dtype=p.dtype, device=p.device) for p in pieces]
            self.unsharded = None  # (the post-hook wraps the buffers: made anew over the new ones)
        for t in self.outputs:
            nbytes = t.numel() * t.element_size()
            if t.untyped_storage().size() != nbytes:
                t.untyped_storage().resize_(nbytes)
        return self.outputs

    def finish(self, local: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
        """The post-hook over the filled buffers: the unsharded value."""
        outputs = tuple(self.outputs)
        if self.unsharded is None:
            self.unsharded, _ = local.fsdp_post_all_gather(outputs, self.metadata, param_dtype)
        else:
            local.fsdp_post_all_gather(outputs, self.metadata, param_dtype, out=self.unsharded)
        return self.unsharded

    def free(self) -> None:
        for t in self.outputs:
            t.untyped_storage().resize_(0)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor of a rank's all-gather input: one of parameter ``param``'s
    inputs, in order; ``rest`` its trailing shape, ``offset``/``numel`` its
    columns in the wire dtype."""

    param: int
    rest: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    offset: int
    numel: int


def _wire_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    """The bucket's dtype on the wire: the pieces' own when they share one
    that every backend carries (not a one-byte float: gloo has none), else bytes."""
    (only,) = dtypes if len(dtypes) == 1 else (torch.uint8,)
    return torch.uint8 if only.is_floating_point and only.itemsize == 1 else only


class ExtensionGather:
    """A group's gather when one of its parameters is an extension: see
    [Note: All-gather extensions]. ``params``: the group's ``FSDPParam``s."""

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = params
        self.pieces: list[Piece] = []
        self.wire = torch.uint8
        self.width = 0  # a rank's input, in wire elements

    def all_gather(self, group: dist.ProcessGroup, streams: Optional[CommStreams]) -> PendingCollective:
        """Run the pre-hooks and issue the bucket's all-gather: ``[N * width]``.
        Everything from the pre-hooks on runs on the gather stream ([Note:
        Streams and events] in streams.py), so its blocks are that stream's."""
        with streams.on_gather() if streams is not None else contextlib.nullcontext():
            flats = self._pack()
            flat_in = torch.cat(flats) if len(flats) > 1 else flats[0]
            if group.size() > 1:
                comm.count("all_gather", flat_in.numel() * flat_in.element_size())
            return comm.all_gather_flat(flat_in, group, async_op=True)

    def _pack(self) -> list[torch.Tensor]:
        """Each parameter's pieces, padded to whole rows, flattened in the wire dtype."""
        tensors: list[torch.Tensor] = []
        owners: list[int] = []
        for i, p in enumerate(self.params):
            local = p.local_shard()
            if p.offload:  # (as FSDP2, the hook runs on the shard on the device: [Note: CPU offload] in policy.py)
                local = local.to(p.compute_device, non_blocking=True)
            ins = p.extension.inputs(local) if p.extension is not None else [
                cast(EAGER, p.to_canonical(local).detach(), p.param_dtype)]
            for t in ins:
                if t.dim() == 0 or t.shape[0] not in (p.local_rows, p.spec.shard_dim0):
                    raise ValueError(
                        f"compiled_fsdp: {type(local).__name__}.fsdp_pre_all_gather of {p.fqn!r} returned an "
                        f"input of shape {tuple(t.shape)}; FSDP gathers inputs of this rank's {p.local_rows} "
                        f"rows (or padded to {p.spec.shard_dim0}) on dim 0.")
                tensors.append(t)
                owners.append(i)
        self.wire = _wire_dtype({t.dtype for t in tensors})
        flats, self.pieces, at = [], [], 0
        for i, t in zip(owners, tensors):
            rows = self.params[i].spec.shard_dim0
            # Rows kept apart, so that the padding appends zero rows in any dtype.
            w = t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:])).view(self.wire)
            if w.shape[0] < rows:
                w = torch.cat([w, w.new_zeros((rows - w.shape[0], w.shape[1]))])
            flats.append(w.view(-1))
            self.pieces.append(Piece(i, tuple(t.shape[1:]), t.dtype, t.device, at, flats[-1].numel()))
            at += flats[-1].numel()
        self.width = at
        return flats

    def copy_out(self, flat: torch.Tensor) -> None:
        """Each piece out of the gathered ``flat`` into its parameter's
        buffers, then the post-hooks: the parameters' unsharded values."""
        world = flat.numel() // self.width
        rows_of = flat.view(world, self.width)
        by_param: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            by_param.setdefault(piece.param, []).append(piece)
        with torch.no_grad():
            for i, pieces in by_param.items():
                p = self.params[i]
                dim0 = p.spec.dim0
                if p.extension is None:
                    dests = [p.to_canonical(p.alloc_unsharded())]
                else:
                    dests = p.extension.buffers(pieces, dim0)
                for piece, dest in zip(pieces, dests):
                    cols = rows_of[:, piece.offset:piece.offset + piece.numel].contiguous()
                    if cols.dtype != piece.dtype:
                        cols = cols.view(piece.dtype)
                    full = cols.view(world * p.spec.shard_dim0, *piece.rest)[:dim0]
                    with torch.autograd._unsafe_preserve_version_counter(dest):
                        dest.copy_(full)
                if p.extension is not None:
                    p.unsharded = p.extension.finish(p.local_shard(), p.param_dtype)
