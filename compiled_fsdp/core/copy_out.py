"""A gathered bucket's parameters copied out in one op.

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
are the eager runtime's, bitwise), every output a fresh tensor.
Tested by tests/test_block_compile.py and tests/test_passes_fx.py.
"""
from __future__ import annotations

import torch

from compiled_fsdp.core.layout import EAGER, split_specs, unpack_gathered

__all__ = ["unpack_bucket"]


def _specs(full_shapes: list[int], ndims: list[int], world_size: int) -> list:
    return split_specs(full_shapes, ndims, world_size)


@torch.library.custom_op("compiled_fsdp::unpack_bucket", mutates_args=())
def unpack_bucket(flat: torch.Tensor, full_shapes: list[int], ndims: list[int], world_size: int,
                  offsets: list[int], total: int) -> list[torch.Tensor]:
    """Each parameter's full value (``full_shapes`` joined, ``ndims`` each)
    from the all-gather output ``flat``, at ``offsets`` in a bucket ``total``
    wide per rank: copies, none aliasing ``flat``."""
    out = unpack_gathered(EAGER, flat, _specs(full_shapes, ndims, world_size), offsets, total)
    base = flat.untyped_storage().data_ptr()
    return [t.clone() if t.untyped_storage().data_ptr() == base else t for t in out]


@unpack_bucket.register_fake
def _(flat: torch.Tensor, full_shapes: list[int], ndims: list[int], world_size: int,
      offsets: list[int], total: int) -> list[torch.Tensor]:
    return [flat.new_empty(list(s.full_shape)) for s in _specs(full_shapes, ndims, world_size)]
