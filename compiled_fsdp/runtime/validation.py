"""``fully_shard``'s local checks: what it owns, and FSDP2's errors for bad
input (its exception types and words, raised where FSDP2 raises them). Each
check runs on every rank and its verdict is agreed before anyone raises
([Note: Agreeing at fully_shard] in api.py)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.annotated import annotated_layout
from compiled_fsdp.runtime.ext_gather import extension_of
from compiled_fsdp.runtime.param import sharded_tensor
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy
from compiled_fsdp.runtime.registry import RUNTIME
from compiled_fsdp.runtime.state import get_fsdp_state


def check_mesh(mesh: DeviceMesh) -> None:
    """FSDP2's mesh checks, with its exception types and words (the same
    arguments on every rank, so every rank raises here together)."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: pass a 1-D mesh "
                         "(or None for the whole world).")
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
                "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard')).")


# The device types each backend carries; a backend not named here is not checked.
_BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "fake": None}


def check_device_and_backend(module_name: str, owners: dict, group: dist.ProcessGroup, offload: bool = False
                             ) -> None:
    """Parameters on a device the group communicates on (under CPU offload
    the CPU too: the shards stay there and are copied for each gather)."""
    devices = {p.device.type for p in owners} - ({"cpu"} if offload else set())
    msg = device_backend_error(devices, str(dist.get_backend(group)))
    if msg is not None:
        raise ValueError(f"fully_shard({module_name}): {msg}")


def check_extensions(owners: dict, dims: dict, mesh: Optional[DeviceMesh], shard_size: int) -> None:
    """Parameters with FSDP's all-gather extension ([Note: All-gather
    extensions] in ext_gather.py) that are gathered here: both hooks, dim 0,
    not a DTensor already, a named HSDP mesh, and rows on every rank (a hook
    such as torchao's takes the amax of its shard, and an empty one raises
    on one rank while the others wait in its all-reduce). Decided from the
    shapes alone, so every rank refuses the same parameter."""
    for p, places in owners.items():
        fqn = places[0][2]
        local = sharded_tensor(p)
        if not extension_of(local, fqn):
            continue
        kind = type(local).__name__
        if dims.get(p, 0) != 0 or isinstance(p, DTensor):
            raise NotImplementedError(
                f"fully_shard: parameter {fqn!r} is a {kind} with FSDP's all-gather extension; compiled_fsdp "
                "gathers such parameters sharded on dim 0 and not already DTensors (no shard_placement_fn dim, "
                "no tensor parallelism). Shard it on dim 0, or convert it to a plain tensor.")
        if mesh is not None and mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise ValueError(f"fully_shard: parameter {fqn!r} has FSDP's all-gather extension, which needs "
                             "HSDP's 2-D mesh with named dims (mesh_dim_names=('replicate', 'shard')).")
        rows = p.shape[0] if p.dim() else 0
        if rows <= (shard_size - 1) * -(-rows // shard_size):
            raise ValueError(
                f"fully_shard: parameter {fqn!r} ({kind}, all-gather extension) has {rows} rows on dim 0, "
                f"which leave a rank of the {shard_size} without any: its fsdp_pre_all_gather would run on an "
                "empty shard. Shard it over fewer ranks, or leave this parameter out of the extension.")


def device_backend_error(devices: set[str], backend: str) -> Optional[str]:
    """What is wrong when parameters on ``devices`` are sharded over a group
    with ``backend`` (a CUDA model under gloo, a CPU model under NCCL), or
    None; ``cpu:gloo,cuda:nccl`` style backends carry the devices they name,
    a backend this does not know is not checked."""
    devices = devices - {"meta"}
    if ":" in backend:
        carried: Optional[set[str]] = {part.split(":")[0] for part in backend.split(",")}
    elif backend in _BACKEND_DEVICES:
        carried = _BACKEND_DEVICES[backend]
    else:
        return None
    if not devices or carried is None or devices <= carried:
        return None
    device = sorted(devices - carried)[0]
    hint = ("use init_process_group('nccl') for CUDA parameters" if device == "cuda"
            else f"move the module to the group's device ({', '.join(sorted(carried))}) before fully_shard")
    return (f"its parameters are on {device}, but the process group's backend {backend!r} communicates "
            f"{', '.join(sorted(carried))} tensors: {hint}, or use a backend that carries both "
            "(init_process_group('cpu:gloo,cuda:nccl')).")


def label(modules: Sequence[nn.Module]) -> str:
    """How messages name one application: its module's class, or the list's."""
    names = [type(m).__name__ for m in modules]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def validate(
    modules: Sequence[nn.Module], ignored: set[nn.Parameter], mp: MixedPrecisionPolicy,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    api: str = "fully_shard", shard_size: int = 1,
) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str, str]]], list[str], dict[nn.Parameter, int]]:
    """Local checks, raising FSDP2's exception types with what was wrong and
    what to do: the owned parameters, the names of those another
    application already owns (see ``shared_across_groups``) and each owned
    parameter's shard dim (``shard_placement_fn``'s, on a group of
    ``shard_size``). ``modules``: one module, or the modules of FSDP2's list
    form (one group for all)."""
    if compat.caching_precompile_on() and not compat.saved_traces_load():
        release = ".".join(map(str, compat.torch_release()))
        raise RuntimeError(
            f"{api}: torch {release} cannot save or load the traces of a sharded model under its "
            "caching precompile (TORCH_CACHING_PRECOMPILE=1, torch._dynamo.config.caching_precompile): its "
            "compile fails. Turn it off, or use torch 2.15, where a second job loads the first one's traces "
            "(README, 'A job started again can skip Dynamo's trace').")
    for module in modules:
        state = get_fsdp_state(module)
        if state is not None and state.api != api:
            raise ValueError(
                f"{api} cannot be applied to this {type(module).__name__}: {state.api} was applied to it "
                "already. Apply one of fully_shard and replicate per module (each may be applied to other "
                "submodules of the same model)."
            )
        if state is not None:
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"{api} has already been applied to this {type(module).__name__}: apply it once per module "
                "(blocks first, then the root)."
            )
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {type(module).__name__}. "
                "Apply fully_shard to each module in it, or to the module whose forward calls them."
            )
    module_name = label(modules)
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    conflicts: list[str] = []
    for i, module in enumerate(modules):
        theirs, lost = collect_owned(module, ignored, "" if len(modules) == 1 else f"[{i}]")
        for p, places in theirs.items():
            owners.setdefault(p, []).extend(places)
        conflicts += lost
    dims = {p: shard_dim(places[0][2], p, shard_placement_fn, shard_size) for p, places in owners.items()}
    devices = sorted({str(p.device) for p in owners})
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard({module_name}): its parameters are on several devices {devices}; "
            "move the module to one device (e.g. module.to(device)) before fully_shard."
        )
    # One bucket carries one dtype (see [Note: Mixed precision] in policy.py).
    examples = _several_dtypes(owners, lambda p: mp.for_param(p).compute_dtype(p.dtype))
    if examples:
        raise ValueError(
            f"fully_shard({module_name}): its parameters would be communicated in several "
            f"dtypes: {examples}. One fully_shard application gathers its parameters in one dtype, as "
            "in FSDP2: convert them to one dtype, apply fully_shard to the odd ones' module "
            "separately, or pass them in ignored_params."
        )
    # (torch 2.15: without reduce_dtype a gradient reduces in its parameter's own dtype)
    examples = _several_dtypes({p: places for p, places in owners.items() if p.requires_grad},
                               lambda p: mp.for_param(p).grad_reduce_dtype(p.dtype))
    if examples:
        raise ValueError(
            f"fully_shard({module_name}): its gradients would be reduced in several dtypes: {examples} "
            "(parameters of different dtypes, and no reduce_dtype). FSDP expects a uniform reduce dtype: "
            "set MixedPrecisionPolicy(reduce_dtype=...), convert the parameters to one dtype, or apply "
            "fully_shard to the odd ones' module separately."
        )
    return owners, conflicts, dims


def _several_dtypes(owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]],
                    dtype_of: Callable[[nn.Parameter], torch.dtype]) -> Optional[str]:
    """One parameter of each dtype ``dtype_of`` gives, named for a message,
    where there are several; else None."""
    by_dtype = {str(dtype_of(p)): places[0][2] for p, places in owners.items()}
    if len(by_dtype) < 2:
        return None
    return ", ".join(f"{fqn!r} ({dtype})" for dtype, fqn in sorted(by_dtype.items()))


def collect_owned(
    module: nn.Module, ignored: set[nn.Parameter], prefix: str = ""
) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str, str]]], list[str]]:
    """Parameters this application owns, each with every (module, name, fqn) place
    it is registered at, in ``named_modules`` order, and the names of those
    another application already owns. See [Note: Ownership]."""
    owned: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    conflicts: list[str] = []
    for path, m, in modules_outside_nested(module):
        path = ".".join(part for part in (prefix, path) if part)
        for name, p in list(m._parameters.items()):
            if p is None or p in ignored:
                continue
            fqn = f"{path}.{name}" if path else name
            # (A DTensor that is not our shard was placed by the user's own
            # parallelism: [Note: FSDP over DTensor parameters] in param.py.)
            if p in RUNTIME.managed or _is_our_shard(p):
                conflicts.append(fqn)
                continue
            local = sharded_tensor(p)
            if p.dim() == 0:
                raise ValueError(
                    f"fully_shard({type(module).__name__}): parameter {fqn!r} is a scalar (0-dim); a "
                    f"sharded parameter is a DTensor sharded on dim 0, which a scalar has not. Change {fqn} "
                    "to a 1D tensor with numel equal to 1 (e.g. nn.Parameter(torch.tensor([1.5])))."
                )
            if not local.is_contiguous():
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: fully_shard({type(module).__name__}) "
                    f"got {fqn!r} with shape {tuple(p.shape)} and stride {p.stride()} (e.g. channels_last). "
                    "Make it contiguous (module.to(memory_format=torch.contiguous_format)) before fully_shard."
                )
            owned.setdefault(p, []).append((m, name, fqn))
    return owned, conflicts


def _is_our_shard(p: nn.Parameter) -> bool:
    # (No registry holds our shard itself: a weak reference would stop
    # to_empty() from swapping it, see [Note: Meta-device init].)
    ours = RUNTIME.shards.get(id(p))
    return ours is not None and ours.sharded is p


def shared_across_groups(module_name: str, conflicts: list[str]) -> Optional[str]:
    """The error for parameters another ``fully_shard`` application already
    owns (a weight shared between two fully sharded modules, or a parent
    sharded before its child), or None. As in FSDP2 it is raised at the
    root's first forward (lazy init), on every rank: the same model gives
    every rank the same verdict."""
    if not conflicts:
        return None
    return (f"fully_shard({module_name}): parameter {conflicts[0]!r} is already managed by another "
            "fully_shard application (a weight shared between two fully sharded modules, or fully_shard "
            "applied to a parent before its child). Apply fully_shard to a common ancestor of every module "
            "that uses it (children first, then parents), or pass it in ignored_params.")


def shard_dim(fqn: str, param: nn.Parameter,
              shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]], shard_size: int) -> int:
    """The dim FSDP2's ``shard_placement_fn`` shards ``param`` on (None:
    dim 0), normalised; see [Note: Shard dims] in core/layout.py."""
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise TypeError(f"fully_shard: shard_placement_fn must return a Shard or None, got {placement!r} "
                        f"for {fqn!r}.")
    dim = placement.dim if placement.dim >= 0 else placement.dim + param.dim()
    if not 0 <= dim < param.dim():
        raise AssertionError(f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: {fqn!r}")
    shape = sharded_tensor(param).shape
    if dim != 0 and shape[dim] < shard_size:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for {fqn!r}, whose dim {dim} "
            f"has {shape[dim]} elements for a shard group of {shard_size} ranks: some ranks would hold "
            "nothing of it. Shard it on a dim of at least the group's size (the largest, for experts), or "
            "return None for dim 0.")
    return dim


def modules_outside_nested(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) for ``module``'s subtree, skipping subtrees already sharded."""
    out = []

    def visit(prefix: str, m: nn.Module) -> None:
        out.append((prefix, m))
        for name, child in m.named_children():
            if get_fsdp_state(child) is None:
                visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", module)
    return out


def _dim_names(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)  # type: ignore[arg-type]


def _on_spmd_mesh(modules: tuple[nn.Module, ...], mesh: DeviceMesh, dp_names: tuple[str, ...]) -> list[str]:
    """The FQNs of the parameters FSDP keeps as DTensors on ``mesh``: DTensors
    there, and plain ones whose spmd_types annotations place them there."""
    found = []
    for root in modules:
        for prefix, m in root.named_modules():
            for name, p in m._parameters.items():
                if p is None or p in RUNTIME.managed:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                if isinstance(p, DTensor):
                    kept = p.device_mesh == mesh
                else:
                    annotated = annotated_layout(fqn, p, mesh, dp_names)
                    kept = annotated is not None and annotated.placements is not None
                if kept:
                    found.append(fqn)
    return found


def resolve_dp_mesh_dims(mesh: object, dims: Any, modules: tuple[nn.Module, ...]
                         ) -> tuple[DeviceMesh, tuple[str, ...]]:
    """[Note: dp_mesh_dims]
    torch 2.15's ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(
    shard=..., replicate=...))`` names the data-parallel dims of the full SPMD
    mesh (torchtitan passes it by default). It resolves to the mesh FSDP
    shards over: the ``shard`` dim (several are flattened into one), with
    ``replicate`` in front for HSDP (returned with the dp dims' names). Parameters that come as DTensors on the
    SPMD mesh (torchtitan's ``full_dtensor``: ``Replicate()`` on the dp dims,
    tensor parallelism's placements on the others) stay on it, as FSDP2 keeps
    them: FSDP shards their local tensor over the dp dims, the registered
    DTensor is placed on the SPMD mesh with FSDP's ``Shard`` on the shard dim,
    and the module computes with DTensors on that mesh whose gradient stays
    ``Partial`` over the dp dims for the reduce-scatter ([Note: FSDP over
    DTensor parameters] in param.py). Plain parameters are sharded over the dp
    mesh as without ``dp_mesh_dims``, unless spmd_types annotates them on
    another dim ([Note: spmd_types parameters] in annotated.py). Taken on
    every release, whether or not its FSDP2 has the argument (an object with
    ``shard`` and ``replicate`` will do); DTensor
    parameters need torch 2.13 or newer (``compat.from_local_takes_grad_placements``).
    Tested by tests/test_fsdp2_215.py::test_dp_mesh_dims_and_torch_policies,
    ::test_dp_mesh_dims_with_tensor_parallelism and ::test_dp_mesh_dims_errors."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not isinstance(mesh, DeviceMesh) or names is None:
        raise ValueError("fully_shard: dp_mesh_dims names dims of mesh, so mesh must be a DeviceMesh with "
                         f"mesh_dim_names (init_device_mesh(..., mesh_dim_names=...)), got {mesh!r}.")
    shard, replicate = _dim_names(getattr(dims, "shard", None)), _dim_names(getattr(dims, "replicate", None))
    unknown = [n for n in shard + replicate if n not in names]
    if unknown or not shard:
        raise ValueError(f"fully_shard: dp_mesh_dims={dims!r} must name a shard dim among the mesh's dims "
                         f"{names}" + (f"; unknown: {unknown}" if unknown else "") + ".")
    on_mesh = _on_spmd_mesh(modules, mesh, shard + replicate)
    if on_mesh and not compat.from_local_takes_grad_placements():
        raise NotImplementedError(
            f"fully_shard: parameters {on_mesh[:3]} are DTensors on the dp_mesh_dims mesh; computing with "
            "them needs DTensor.from_local(grad_placements=...), which this torch lacks (torch 2.13 or newer "
            "has it). Pass plain parameters, or the data-parallel sub-mesh: fully_shard(module, mesh=mesh['dp']).")
    if on_mesh and len(shard) > 1:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims flattens the shard dims {shard} into one, and parameters {on_mesh[:3]} "
            "are DTensors on the mesh: not supported. Name one shard dim.")
    sub = mesh[shard[0]] if len(shard) == 1 else mesh[shard]._flatten("_".join(shard))
    if replicate:
        if len(shard) > 1 or len(replicate) > 1:
            raise NotImplementedError("fully_shard: HSDP over several flattened dims is not supported; name "
                                      "one replicate dim and one shard dim.")
        sub = mesh[(replicate[0], shard[0])]
    return sub, shard + replicate
