"""The plan of one bucket: the parameters (slots) one collective carries,
with every marker that refers to each, as the lowering (lowering.py) and the
reduces waited after a compile region (region_reduce.py) read them."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.fx as fx

from .graph import MarkerArgs


@dataclasses.dataclass
class Slot:
    """One parameter in a bucket, with every marker that refers to it."""

    args: MarkerArgs
    markers: list[fx.Node]  # graph order
    inputs: list[fx.Node]  # marker tensor inputs, same order
    acc_nodes: list[fx.Node] = dataclasses.field(default_factory=list)  # reduce only
    root: fx.Node | None = None  # reduce only: node whose uses get the shard grad
    # reduce only: the gradient kept from micro-batches without sync (a graph input).
    kept: fx.Node | None = None
    # reduce only: the shard a compile region's read took (a graph input),
    # whose parameter a later reduce hands the gradient (see [Note: A
    # region's reduce-scatter waited outside its graph] in compiled_fsdp/core/registry.py).
    target: fx.Node | None = None


# "keep": a gradient kept without sync, no collective (see [Note:
# Accumulation without sync in graphs] in compiled_fsdp/core/ops.py).
BucketKind = Literal["gather", "reduce", "keep"]


@dataclasses.dataclass
class BucketPlan:
    kind: BucketKind
    module_key: int
    group_name: str
    world_size: int
    reshard_after_forward: bool | None
    slots: list[Slot]  # sorted by (module order in the bucket, param_index)
    # reduce buckets: an all-to-all and a local sum (the markers say; see
    # [Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py)
    by_all_to_all: bool = False
    unit: int = 0  # module_key's unit (see units.py)
    # Every (module_key, unit) in the bucket; more than one after bucketing
    # merged small ones.
    units: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # gathers of an int reshard_after_forward: (group, size, rank) kept after
    # forward ([Note: Resharding to a smaller group in graphs] in
    # post_forward.py); None otherwise.
    post_forward: tuple[str, int, int] | None = None

    @property
    def after_reduce(self) -> tuple:
        """What follows the bucket's reduce, which a merged bucket must share:
        the all-reduce over the replicas (HSDP) and the divisor."""
        args = self.slots[0].args
        return (args.replicate_group_name, args.spec.divisor)

    @property
    def device(self) -> str | None:
        """Where CPU offload copies the bucket's shards before its gather, or
        its reduced rows after its reduce (None: no copy)."""
        return self.slots[0].args.device

    @property
    def module_keys(self) -> list[int]:
        """Every application in the bucket."""
        return sorted({k for k, _ in self.units})

    @property
    def total_numel(self) -> int:
        """A rank's elements in the bucket, in its ``comm_dtype``."""
        return sum(self.slot_bytes(s) for s in self.slots) // (self.world_size * self.comm_dtype.itemsize)

    @property
    def as_bytes(self) -> bool:
        """Whether the bucket gathers its slots as their bytes: [Note: Byte buckets] in _emit.py."""
        return self.kind == "gather" and len({comm_dtype_of(self.kind, s) for s in self.slots}) > 1

    @property
    def comm_dtype(self) -> torch.dtype:
        """The dtype the bucket's collective moves (one per bucket)."""
        return torch.uint8 if self.as_bytes else comm_dtype_of(self.kind, self.slots[0])

    def slot_bytes(self, slot: Slot) -> int:
        """Unsharded bytes of one slot in this bucket's collective."""
        return slot.args.spec.shard_numel * self.world_size * comm_dtype_of(self.kind, slot).itemsize

    @property
    def nbytes(self) -> int:
        return sum(self.slot_bytes(s) for s in self.slots)


def comm_dtype_of(kind: str, slot: Slot) -> torch.dtype:
    """The gathered (compute) dtype, or the reduce dtype, of one slot; see
    [Note: Mixed precision] in compiled_fsdp/runtime/policy.py."""
    wanted = slot.args.param_dtype if kind == "gather" else slot.args.reduce_dtype
    return wanted or slot.inputs[0].meta["val"].dtype
