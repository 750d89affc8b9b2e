"""A bucket's parameters copied in and out, one op each.

[Note: One copy-out per bucket]
In an all-gather's output ``[N * T]`` a parameter's rows lie in column range
``[off, off + shard_numel)`` of each rank's ``[T]``: strided by ``T``, so no
view of the bucket is the parameter (unless the bucket holds only it), and
``unpack_gathered`` copies each one out ([Note: Bucket layout] in layout.py).
Lowered as aten ops, each copy is a kernel Inductor generates and compiles:
a block's graphs held 24 C++ kernels against FSDP2's 13 for the same block,
most of the difference these copies and their like, which FSDP2 makes
eagerly outside its graph (benchmarks/RESULTS.md, "One graph for blocks
compiled on their own"). The lowering emits this op instead: one opaque call
per bucket, whose implementation is ``unpack_gathered`` itself (so the values
are the eager runtime's, bitwise), every output a fresh tensor. The same
holds for the way in: the gather's input (``pack_shards``: each shard cast,
padded, concatenated) and the reduce's (``pack_grads``) are one op each,
``pack_bucket`` and ``pack_bucket_grads``; ``pack_bucket`` for a bucket of
one parameter too, whose aten pack (a pad of zero rows, and its cast) Inductor
built as a kernel per shard shape (the main job's embedding and position
shards: 26 -> 24 C++ kernels). A block's graphs then compile as
many kernels as FSDP2's (measured: benchmarks/RESULTS.md). What Inductor no
longer does is fuse a cast into the copy; the ops run the eager runtime's
code, a few ATen kernels per bucket.

So the ops are emitted for buckets on the CPU only (``_as_one_op`` in
passes/_emit.py). On a GPU Inductor compiles its Triton kernels in parallel
and fuses each cast into its copy, and there the ops cost the step: on one
H100, the whole 8-block Llama compiled at W=8 stepped in 0.260-0.267 s with
them against 0.248 s without (paired, benchmarks/RESULTS.md, "The GPU after
the stand-in and the copy ops"), and gained no first step. Tested by
tests/test_block_compile.py and tests/test_passes_fx.py (a graph on the meta
device keeps the aten copies).

[Note: The reduce's arithmetic as ops on the CPU]
What a gradient bucket's reduce computes after its collective, the sum over
ranks of gloo's all-to-all (``sum_received``) and the division by the
divisor (``average``), Inductor compiled as a kernel of its own for each
bucket size: two of the nine C++ kernels a whole-model compile of the
benchmark GPT with regions built beyond torch's own regions (RESULTS,
thirty-fifth session: the root's two buckets of 131,136 and 139,264
elements), about 0.9 s each in a cold first step on this machine. On the
CPU the lowering emits them as ``sum_ranks`` and ``average_bucket``
(``emit_reduced`` in passes/_emit.py), which run the layout's own functions:
no kernel to compile (but for the cast of each gradient to its parameter's
dtype, where it reduces in another), and the values are the eager runtime's,
bitwise. HSDP's all-reduce over the replicas runs between the two. Tested by
tests/test_passes_fx.py::test_copies_are_aten_ops_off_the_cpu (no division
left as an aten op) and tests/test_gloo_reduce.py::test_gloo_reduce (each
all-to-all summed by one ``sum_ranks``, the gradients bitwise the eager
runtime's).
"""
from __future__ import annotations

from typing import Optional

import torch

from compiled_fsdp.core.comm import unaliased
from compiled_fsdp.core.layout import (
    EAGER,
    average,
    bucket_width,
    pack_grads,
    pack_shards,
    post_forward_part,
    split_specs,
    sum_received,
    unpack_gathered,
    with_kept,
)

__all__ = ["average_bucket", "keep_part", "pack_bucket", "pack_bucket_grads", "sum_ranks", "unpack_bucket"]


@torch.library.custom_op("compiled_fsdp::unpack_bucket", mutates_args=())
def unpack_bucket(flat: torch.Tensor, full_shapes: list[int], ndims: list[int], world_size: int,
                  offsets: list[int], total: int) -> list[torch.Tensor]:
    """Each parameter's full value (``full_shapes`` joined, ``ndims`` each)
    from the all-gather output ``flat``, at ``offsets`` in a bucket ``total``
    wide per rank: copies, none aliasing ``flat``."""
    out = unpack_gathered(EAGER, flat, split_specs(full_shapes, ndims, world_size), offsets, total)
    return [unaliased(t, flat) for t in out]


def _unaliased_by_all(out: torch.Tensor, inputs: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """``out``, copied if it shares an input's storage (``comm.unaliased`` for each)."""
    for inp in inputs:
        if inp is not None:
            out = unaliased(out, inp)
    return out


@unpack_bucket.register_fake
def _(flat: torch.Tensor, full_shapes: list[int], ndims: list[int], world_size: int,
      offsets: list[int], total: int) -> list[torch.Tensor]:
    return [flat.new_empty(list(s.full_shape)) for s in split_specs(full_shapes, ndims, world_size)]


@torch.library.custom_op("compiled_fsdp::pack_bucket", mutates_args=())
def pack_bucket(shards: list[torch.Tensor], full_shapes: list[int], ndims: list[int], world_size: int,
                dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The all-gather input ``[T]`` of ``shards`` (``pack_shards``, each cast to ``dtype``)."""
    specs = split_specs(full_shapes, ndims, world_size)
    return _unaliased_by_all(pack_shards(EAGER, shards, specs, [dtype] * len(specs)), list(shards))


@pack_bucket.register_fake
def _(shards: list[torch.Tensor], full_shapes: list[int], ndims: list[int], world_size: int,
      dtype: Optional[torch.dtype]) -> torch.Tensor:
    total = bucket_width(split_specs(full_shapes, ndims, world_size))
    return shards[0].new_empty([total], dtype=dtype or shards[0].dtype)


@torch.library.custom_op("compiled_fsdp::pack_bucket_grads", mutates_args=())
def pack_bucket_grads(grads: list[Optional[torch.Tensor]], kept: list[Optional[torch.Tensor]],
                      full_shapes: list[int], ndims: list[int], world_size: int, offsets: list[int],
                      total: int) -> torch.Tensor:
    """The reduce-scatter input ``[N * T]`` of the full gradients ``grads``
    (``pack_grads``; a None gradient's columns zero), each added to what
    ``kept`` holds for it ([Note: Kept gradients added where the bucket is
    packed])."""
    specs = split_specs(full_shapes, ndims, world_size)
    summed = [with_kept(EAGER, g, k) for g, k in zip(grads, kept)]
    return _unaliased_by_all(pack_grads(EAGER, summed, specs, offsets, total), list(grads) + list(kept))


@pack_bucket_grads.register_fake
def _(grads: list[Optional[torch.Tensor]], kept: list[Optional[torch.Tensor]], full_shapes: list[int],
      ndims: list[int], world_size: int, offsets: list[int], total: int) -> torch.Tensor:
    like = next(g for g in grads if g is not None)
    return like.new_empty([world_size * total])


@torch.library.custom_op("compiled_fsdp::sum_ranks", mutates_args=())
def sum_ranks(received: torch.Tensor, world_size: int, width: int) -> torch.Tensor:
    """``layout.sum_received``: the ``[width]`` sum of an all-to-all's
    ``[world_size * width]`` output ([Note: The reduce's arithmetic as ops on the CPU])."""
    assert received.numel() == world_size * width, (received.shape, world_size, width)
    return sum_received(EAGER, received, world_size)


@sum_ranks.register_fake
def _(received: torch.Tensor, world_size: int, width: int) -> torch.Tensor:
    return received.new_empty([width])  # ([Note: Static sizes in the reduce] in passes/_emit.py)


@torch.library.custom_op("compiled_fsdp::average_bucket", mutates_args=())
def average_bucket(summed: torch.Tensor, divisor: float) -> torch.Tensor:
    """``layout.average`` ([Note: The reduce's arithmetic as ops on the CPU])."""
    return average(EAGER, summed, divisor)


@average_bucket.register_fake
def _(summed: torch.Tensor, divisor: float) -> torch.Tensor:
    return torch.empty_like(summed)


@torch.library.custom_op("compiled_fsdp::keep_part", mutates_args=())
def keep_part(gathered: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """``layout.post_forward_part`` as one op, which the lowering emits in a
    joint graph on every device: [Note: Resharding to a smaller group in
    graphs] in passes/post_forward.py. It is registered as having a side
    effect so that the partitioner counts it as forward work although no
    forward output reads it; only then does it save the part rather than
    recompute it, and the forward's whole gather with it, in backward."""
    return post_forward_part(EAGER, gathered, size, rank)


@keep_part.register_fake
def _(gathered: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    return gathered.new_empty([gathered.numel() // size])


torch.fx.node.has_side_effect(keep_part._opoverload)

