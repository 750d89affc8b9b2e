"""[Note: spmd_types parameters]
torchtitan's default SPMD backend (``spmd_types``) leaves each parameter a
plain tensor holding this rank's piece, annotated with a local SPMD type per
mesh axis (``spmd.assert_type(w, {dp: R, tp: S(0)})``), and calls
``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``. torch 2.15's FSDP2 stores
such a parameter as the DTensor its annotations describe on the SPMD mesh,
and the module computes with a plain tensor whose gradient has the
annotations' backward types: an ``R`` weight's gradient is ``Partial`` over
tensor parallelism and is summed there before the data-parallel reduction.

Ours takes the same road through the ``full_dtensor`` path ([Note:
dp_mesh_dims] in validation.py): ``annotated_layout`` reads the annotations
once, at ``fully_shard``; ``FSDPParam`` registers the DTensor they describe,
placed as any DTensor parameter on that mesh; the compute view is the
gathered DTensor's ``to_local(grad_placements=...)``, a plain tensor whose
gradient comes back with the backward types, is redistributed to the
parameter's own placements (tensor parallelism's sum) and stays ``Partial``
over the data-parallel dims for the reduce-scatter. Annotations that name
no dim of size above 1 besides the data-parallel ones describe a plain
parameter (FSDP alone, torchtitan's default without TP): it is sharded as
one. An annotation on an axis the data-parallel dims contain (torchtitan's
HSDP annotates its flattened ``dp`` axis) counts as theirs, as in FSDP2.
An eager compute view carries its annotations again, the data-parallel
dims ``R`` where left out, for spmd_types' type checking (as FSDP2's
``_restore_spmd_types``), and the runtime's hooks run with type checking
off (``compat.no_spmd_typecheck``), as FSDP2's do. Annotated parameters
without ``dp_mesh_dims`` are refused, as FSDP2 refuses them. One
difference: under a mixed-precision policy FSDP2 sums a gradient that is
partial over tensor parallelism in the reduce dtype, ours in the compute
dtype (``from_local``'s backward). Tested by
tests/test_spmd_types.py::test_spmd_types_annotations; tests/test_torchtitan.py
trains torchtitan's default backend (FSDP alone: annotated, sharded plain).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from compiled_fsdp.core import compat

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Annotated:
    """What a parameter's annotations say, on the ``dp_mesh_dims`` mesh: the
    DTensor ``placements`` to store it as (``Replicate()`` on the
    data-parallel dims) and the plain compute view's gradient placements
    (``Partial()`` on those dims, the backward types elsewhere), or None for
    both where it is plain; and the annotations to restore."""

    placements: Optional[Placements]
    compute_grad: Optional[Placements]
    restore_type: Any
    partition_spec: Any

    def as_dtensor(self, param: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
        """The DTensor parameter the annotations describe (no copy)."""
        local = DTensor.from_local(param.detach(), mesh, self.placements, run_check=False)
        return nn.Parameter(local, requires_grad=param.requires_grad)

    def plain(self, view: torch.Tensor) -> torch.Tensor:
        """The plain tensor the module computes with, from the compute view
        (a DTensor where the annotations made one), annotated again in eager."""
        out = view if self.placements is None else view.to_local(grad_placements=self.compute_grad)
        if not torch.compiler.is_compiling():  # (made in the hooks, with type checking off)
            compat.spmd_types_package().assert_type(out, self.restore_type, partition_spec=self.partition_spec)
        return out


def annotated_layout(fqn: str, param: torch.Tensor, spmd_mesh: Optional[DeviceMesh],
                     dp_names: tuple[str, ...]) -> Optional[Annotated]:
    """What spmd_types annotations say of a plain parameter on ``spmd_mesh``
    (whose data-parallel dims are ``dp_names``), or None where it has none.
    A clear ValueError for annotations FSDP cannot store, as FSDP2 raises."""
    spmd = compat.spmd_types_package()
    if spmd is None or isinstance(param, DTensor):
        return None
    local_type = spmd.get_local_type(param)
    if not local_type:
        return None
    if spmd_mesh is None:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} has spmd_types annotations; they need the full SPMD mesh and its "
            "data-parallel dims: fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims("
            "shard=..., replicate=...)) (as FSDP2 requires).")
    from spmd_types._mesh_axis import flatten_axes
    from spmd_types.types import partition_spec_to_shard_types

    partition_spec = spmd.get_partition_spec(param)
    types = dict(local_type)
    if partition_spec is not None:
        types.update(partition_spec_to_shard_types(partition_spec))
    names = spmd_mesh.mesh_dim_names
    axes = [spmd.MeshAxis.of(spmd_mesh.get_group(name)) for name in names]
    dp_axis = flatten_axes(tuple(a for a, n in zip(axes, names) if n in dp_names))
    for axis, kind in types.items():
        on_mesh = axis in axes
        in_dp = names[axes.index(axis)] in dp_names if on_mesh else axis <= dp_axis
        if not (on_mesh or in_dp):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} has an spmd_types annotation on {axis}, which is neither a dim "
                f"of fully_shard's mesh {names} nor within its data-parallel dims {dp_names}: annotate the "
                "parameter on the dims of the mesh passed with dp_mesh_dims.")
        if in_dp and kind is not spmd.R:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is annotated {kind} on the data-parallel axis {axis}; FSDP "
                "reduces its gradient over that axis and needs R there (as FSDP2 does).")
    restore_type = dict(local_type)
    if not any(axis <= dp_axis or dp_axis <= axis for axis in local_type):  # (left out: R, as FSDP2 fills them)
        restore_type.update({a: spmd.R for a, n in zip(axes, names) if n in dp_names})
    if all(name in dp_names or spmd_mesh.size(i) == 1 for i, name in enumerate(names)):
        return Annotated(None, None, restore_type, partition_spec)  # (a plain parameter: FSDP alone)
    placements: list[Placement] = []
    grads: list[Placement] = []
    for i, (name, axis) in enumerate(zip(names, axes)):
        kind = types.get(axis)
        if name in dp_names:
            placements.append(Replicate())
            grads.append(Partial())
        elif kind is None:
            if spmd_mesh.size(i) > 1:
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} has no spmd_types annotation on the dim {name!r} of its "
                    f"mesh {names} (size {spmd_mesh.size(i)}): annotate every dim besides the data-parallel ones.")
            placements.append(Replicate())
            grads.append(Replicate())
        else:
            placements.append(spmd.spmd_type_to_dtensor_placement(kind))
            grads.append(spmd.spmd_type_to_dtensor_placement(kind.backward_type()))
    return Annotated(tuple(placements), tuple(grads), restore_type, partition_spec)
