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
one. An eager compute view carries its annotations again, for spmd_types'
type checking (as FSDP2's ``_restore_spmd_types``), and the runtime's hooks
run with type checking off (``compat.no_spmd_typecheck``), as FSDP2's do. Tested by
tests/test_fsdp2_215.py::test_spmd_types_annotations and
tests/test_torchtitan.py (torchtitan's default backend).
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
    """What a parameter's annotations say, on the ``dp_mesh_dims`` mesh:
    ``placements`` (``Replicate()`` on the data-parallel dims) and the plain
    compute view's gradient placements (``Partial()`` on those dims, the
    backward types elsewhere), with the annotations to restore."""

    placements: Placements
    compute_grad: Placements
    local_type: Any
    partition_spec: Any

    def as_dtensor(self, param: torch.Tensor, mesh: DeviceMesh) -> nn.Parameter:
        """The DTensor parameter the annotations describe (no copy)."""
        local = DTensor.from_local(param.detach(), mesh, self.placements, run_check=False)
        return nn.Parameter(local, requires_grad=param.requires_grad)

    def plain(self, view: DTensor) -> torch.Tensor:
        """The plain tensor the module computes with, from the DTensor view."""
        out = view.to_local(grad_placements=self.compute_grad)
        if not torch.compiler.is_compiling():  # (made in the hooks, with type checking off)
            compat.spmd_types_package().assert_type(out, self.local_type, partition_spec=self.partition_spec)
        return out


def annotated_layout(fqn: str, param: torch.Tensor, spmd_mesh: Optional[DeviceMesh],
                     dp_names: tuple[str, ...]) -> Optional[Annotated]:
    """The layout spmd_types annotations give a plain parameter on ``spmd_mesh``
    (whose data-parallel dims are ``dp_names``), or None where there are none
    or they describe a plain parameter. A clear ValueError for annotations
    FSDP cannot store, as FSDP2 raises."""
    spmd = compat.spmd_types_package()
    if spmd is None or spmd_mesh is None or isinstance(param, DTensor):
        return None
    local_type = spmd.get_local_type(param)
    if not local_type:
        return None
    partition_spec = spmd.get_partition_spec(param)
    types = dict(local_type)
    if partition_spec is not None:
        from spmd_types.types import partition_spec_to_shard_types

        types.update(partition_spec_to_shard_types(partition_spec))
    names = spmd_mesh.mesh_dim_names
    axes = [spmd.MeshAxis.of(spmd_mesh.get_group(name)) for name in names]
    unknown = [str(axis) for axis in types if axis not in axes]
    if unknown:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} has spmd_types annotations on {unknown}, which are not dims of "
            f"fully_shard's mesh {names}: annotate the parameter on the dims of the mesh passed with dp_mesh_dims.")
    placements: list[Placement] = []
    grads: list[Placement] = []
    for i, (name, axis) in enumerate(zip(names, axes)):
        kind = types.get(axis)
        if name in dp_names:
            if kind is not None and kind is not spmd.R:
                raise ValueError(
                    f"fully_shard: parameter {fqn!r} is annotated {kind} on the data-parallel dim {name!r}; FSDP "
                    "reduces its gradient over that dim and needs R there (as FSDP2 does).")
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
    if all(name in dp_names or spmd_mesh.size(i) == 1 for i, name in enumerate(names)):
        return None
    return Annotated(tuple(placements), tuple(grads), local_type, partition_spec)
