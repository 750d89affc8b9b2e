"""Where each rank's piece of a parameter lives.

[Note: Shard layout]
A parameter of full shape ``(d0, *rest)`` on a group of ``N`` ranks is padded
with zero rows to ``padded_d0 = ceil(d0 / N) * N`` and cut on dim 0: rank ``r``
holds rows ``[r * shard_d0, (r + 1) * shard_d0)`` with ``shard_d0 = padded_d0 / N``.
A 0-dim parameter is treated as shape ``(1,)``. Padding makes every size work on
every world size (3 ranks and odd sizes included) and makes every rank's shard the
same shape, which the bucketed collectives need.

A module's parameters are communicated as one bucket: the flattened shards in
parameter order, ``T`` elements per rank. The all-gather output ``[N * T]`` viewed
``[N, T]`` holds parameter ``i`` in columns ``[off_i, off_i + n_i)``; the
reduce-scatter input is built the same way from the padded full gradients. The
eager runtime and the compiled lowering use exactly this layout, so the reduction
order inside the collective, and therefore every bit of the result, is the same
on both paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class ShardSpec:
    full_shape: tuple[int, ...]
    world_size: int

    @property
    def dim0(self) -> int:
        return self.full_shape[0] if self.full_shape else 1

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
        rows, or none. See [Note: Parameters are DTensors] in _param.py."""
        return max(0, min(self.shard_dim0, self.dim0 - rank * self.shard_dim0))

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows of ``full`` without padding: what its DTensor shard holds."""
        return self.shard(full, rank)[: self.local_dim0(rank)]

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's rows of ``full`` (zero-padded), as a new contiguous tensor."""
        flat = full.reshape(self.dim0, *self.rest)
        out = full.new_zeros(self.shard_shape)
        lo = rank * self.shard_dim0
        hi = min(lo + self.shard_dim0, self.dim0)
        if hi > lo:
            out[: hi - lo].copy_(flat[lo:hi])
        return out

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[padded_dim0, *rest]`` -> the full (unpadded) parameter shape."""
        return padded[: self.dim0].reshape(self.full_shape)

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """The full gradient, zero-padded to ``[padded_dim0, *rest]``."""
        flat = full.reshape(self.dim0, *self.rest)
        if self.padded_dim0 == self.dim0:
            return flat
        pad = full.new_zeros((self.padded_dim0 - self.dim0, *self.rest))
        return torch.cat([flat, pad])


def bucket_offsets(specs: Sequence[ShardSpec]) -> list[int]:
    """Column offset of each parameter inside a ``[N, T]`` bucket. See [Note: Shard layout]."""
    offsets, total = [], 0
    for spec in specs:
        offsets.append(total)
        total += spec.shard_numel
    return offsets
