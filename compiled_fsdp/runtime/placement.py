"""Where a sharded parameter's DTensor lives: the device type of its mesh,
the mesh and placements ``fully_shard`` registers it with, as FSDP2 places
it, and what the compute view asks of its gradient; and the module's
buffers, moved to the mesh's device. Decided once, at ``fully_shard``, from
the parameter, the module's mesh and the shard spec; see [Note: FSDP over
DTensor parameters] in param.py."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from compiled_fsdp.core.layout import ShardSpec

Placements = tuple[Placement, ...]


def mesh_device_type(param_device: str, offload: bool, accelerator: Optional[str], one_process: bool,
                     carries: Callable[[str], bool]) -> str:
    """The device type of the parameters' mesh: the parameters' own, but for
    a model on ``meta`` ([Note: Meta-device init] in param.py) or on the CPU
    under CPU offload, where it is the accelerator's (``accelerator``: this
    process's, None without one) if the group communicates its tensors
    (``carries``: a backend other than gloo for that device: NCCL, the
    default ``init_process_group()``, ``cpu:gloo,cuda:nccl``) or is torch's
    fake group or the emulated network (``one_process``), else the CPU. It
    asked for the backend's name to be ``nccl``, so the other two forms gave
    an offloaded model a CPU mesh on a GPU (tests/test_offload.py::
    test_the_mesh_of_an_offloaded_model)."""
    if param_device != "meta" and not (offload and param_device == "cpu"):
        return param_device
    if accelerator is not None and (one_process or carries(accelerator)):
        return accelerator
    return "cpu"


def compute_device(device_type: str) -> torch.device:
    """The device of a mesh of ``device_type``: this process's current one."""
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    return torch.device(device_type, torch.accelerator.current_device_index())


def move_buffers(modules: Sequence[nn.Module], device: torch.device) -> None:
    """The modules' buffers on ``device`` (the mesh's, an accelerator's), as
    FSDP2 moves a managed module's states at ``fully_shard``: a model built
    on the CPU for CPU offload keeps its shards there, and its buffers (a
    rotary table, a mask) go where the forward runs. Buffers on ``meta``
    stay (deferred init); each moved one is replaced, as ``nn.Module.to``
    replaces it."""
    for module in modules:
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.device != device and buf.device.type != "meta":
                    sub._buffers[name] = buf.to(device)


def registered_layout(fqn: str, mesh: DeviceMesh, spec: ShardSpec, shard_dim: int,
                      dtensor_spec: Optional[DTensorSpec], spmd_mesh: Optional[DeviceMesh] = None,
                      ) -> tuple[DeviceMesh, Placements, Optional[Placements]]:
    """The registered DTensor's mesh and placements, and the compute view's
    ``grad_placements`` (None but on a ``dp_mesh_dims`` mesh): ``Shard(d)`` on
    the module's mesh; on HSDP's 2-D mesh ``(Replicate(), Shard(d))``; for a
    DTensor parameter on another mesh (tensor parallelism), those followed by
    its own placements, on the two meshes concatenated; for one on
    ``spmd_mesh`` (``dp_mesh_dims``'s, whose data-parallel dims ``mesh`` is),
    its own with FSDP's on the dp dims."""
    shard: Placement = Shard(shard_dim)
    if mesh.ndim == 1 and spec.world_size == 1 and spec.replicas > 1:
        shard = Replicate()  # (``replicate``: a group of one over the replicas)
    placements: Placements = (Replicate(), shard) if mesh.ndim == 2 else (shard,)
    if dtensor_spec is None:
        return mesh, placements, None
    if spmd_mesh is not None and dtensor_spec.mesh == spmd_mesh:
        dp_dims = tuple(spmd_mesh.mesh_dim_names.index(n) for n in mesh.mesh_dim_names)
        return (spmd_mesh, *_on_its_own_mesh(fqn, dtensor_spec, dp_dims, placements, shard_dim))
    return (*_beside_its_mesh(fqn, mesh, dtensor_spec, placements, shard_dim), None)


def _beside_its_mesh(fqn: str, mesh: DeviceMesh, dtensor_spec: DTensorSpec, placements: Placements,
                     shard_dim: int) -> tuple[DeviceMesh, Placements]:
    """FSDP over ``mesh``, the parameter's own parallel dim on another mesh of
    the same parent: the two concatenated."""
    if len(dtensor_spec.placements) != 1:
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a DTensor placed {dtensor_spec.placements} on a "
            f"{dtensor_spec.mesh.ndim}-D mesh; FSDP over DTensor parameters supports one parallel dim (1-D "
            "tensor or expert parallelism), as FSDP2 on most releases.")
    if None in (mesh.mesh_dim_names, dtensor_spec.mesh.mesh_dim_names):
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on the mesh {dtensor_spec.mesh} (tensor parallelism); "
            "FSDP over it needs both meshes named sub-meshes of one parent: mesh = init_device_mesh("
            "device, (dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(block, mesh['tp'], plan); "
            "fully_shard(block, mesh=mesh['dp']).")
    try:
        outer = DeviceMesh._concatenate([mesh, dtensor_spec.mesh])  # (private; on every supported release)
    except RuntimeError as exc:
        raise ValueError(
            f"fully_shard: parameter {fqn!r} is a DTensor on the mesh {dtensor_spec.mesh}, which is not another "
            f"dim of the parent of fully_shard's mesh {mesh} ({exc}). Take both from one mesh: "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); mesh['dp'] for "
            "fully_shard, mesh['tp'] for parallelize_module.") from None
    if placements[-1].is_shard():
        # The parallel dim already splits the shard dim: FSDP's rows of
        # the local tensor interleave, as FSDP2 places them.
        split = dtensor_spec.num_shards_map[shard_dim]
        if split > 1:
            placements = (*placements[:-1], _StridedShard(shard_dim, split_factor=split))
    return outer, (*placements, *dtensor_spec.placements)


def _on_its_own_mesh(fqn: str, dtensor_spec: DTensorSpec, dp_dims: tuple[int, ...], placements: Placements,
                     shard_dim: int) -> tuple[Placements, Placements]:
    """A parameter that came as a DTensor on the ``dp_mesh_dims`` mesh: its own
    placements with FSDP's on the dp dims (``_StridedShard`` where later dims
    split the shard dim too, FSDP2's rule), and the compute view's
    ``grad_placements``: ``Partial()`` on the dp dims, for the reduce-scatter."""
    own = dtensor_spec.placements
    out = list(own)
    for i, mine in zip(dp_dims, placements):
        if not own[i].is_replicate():
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is placed {own[i]} on the data-parallel dim "
                f"{dtensor_spec.mesh.mesh_dim_names[i]!r} of its mesh; FSDP shards over that dim and needs "
                "Replicate() there (as FSDP2 does).")
        if mine.is_shard():
            split = 1
            for j in range(i + 1, dtensor_spec.mesh.ndim):
                if isinstance(own[j], (Shard, _StridedShard)) and own[j].dim == shard_dim:
                    split *= dtensor_spec.mesh.size(j)
            mine = _StridedShard(shard_dim, split_factor=split) if split > 1 else mine
        out[i] = mine
    return tuple(out), tuple(Partial() if i in dp_dims else p for i, p in enumerate(own))
