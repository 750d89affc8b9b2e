"""``fully_shard``: the public entry point.

[Note: Ownership]
Each application of ``fully_shard`` owns the parameters of its subtree that no
nested application already owns (the "fully sharded module" of pytorch#90933): apply it to
the blocks first, then to the root, which picks up the leftovers (embedding,
final norm, head). A parameter object reachable from several modules (a tied
weight) is one managed parameter with several owners, as long as all of them
fall under the same application; a parameter split across two applications
cannot be gathered by one of them alone and is rejected.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from compiled_fsdp.config import comm
from compiled_fsdp.core.comm import uses_all_to_all
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.divergence import Checker, checker_for, ranks_are_processes
from compiled_fsdp.runtime.module import FSDPModule, ManagedByAncestor
from compiled_fsdp.runtime.param import FSDPParam, install_class
from compiled_fsdp.runtime.param_group import FSDPParamGroup
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy, OffloadPolicy, check_offload, check_policy
from compiled_fsdp.runtime.state import FSDPState, get_fsdp_state, iter_fsdp_states

Policy = Union[Iterable[type], Callable[[nn.Module], bool]]

# Original parameter -> its FSDPParam, to detect a parameter claimed twice.
# (Keyed by identity: tensors compare elementwise.)
_MANAGED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The exception types ``fully_shard``'s checks raise (FSDP2's, for the same
# mistakes); one found on any rank is raised on every rank ([Note: Agreeing at fully_shard]).
_AGREED_ERRORS = (TypeError, ValueError, AssertionError, NotImplementedError)
# Group keys: the n-th application of fully_shard in a program is key n on every
# rank, so markers and buckets agree across ranks. Counted per rank (per world
# group object: thread ranks each have their own; see [Note: Helper groups]).
_KEYS: "weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count]" = weakref.WeakKeyDictionary()


def _next_key() -> int:
    world = dist.distributed_c10d._get_default_group()
    counter = _KEYS.get(world)
    if counter is None:
        counter = _KEYS[world] = itertools.count()
    return next(counter)


@dataclass(frozen=True)
class ShardingOptions:
    """The frozen per-application policy."""

    process_group: dist.ProcessGroup
    reshard_after_forward: bool
    # Same ranks as ``process_group``; carries every reduce-scatter. See
    # [Note: A second group for reduce-scatters]. Made (with ``checker``) by
    # ``_with_groups`` once the ranks agreed on the settings.
    reduce_group: Optional[dist.ProcessGroup] = None
    # The user's 1-D mesh, or None: one is built over ``process_group`` for the
    # parameters' device type (see ``mesh_for``).
    mesh: Optional[DeviceMesh] = None
    # What the user passed as ``mp_policy``; checked (on every rank together) by
    # ``_shard_one``. See [Note: Mixed precision] in policy.py.
    mp_policy: object = None
    # Checks that the ranks' collectives pair up, or None (checks off). See
    # [Note: Agreeing on collectives] in divergence.py.
    checker: Optional[Checker] = None
    # ``config.comm.hand_over_gathers`` and ``gloo_reduce_by_all_to_all`` as
    # agreed at this ``fully_shard`` (read then, like the settings above, not
    # at each step): see [Note: Gathers handed to the next block's graph] in
    # compile/entry.py and [Note: Reduce-scatter on gloo] in core/comm.py.
    hand_over_gathers: bool = True
    gloo_reduce_by_all_to_all: bool = True
    # FSDP2's per-parameter placement hook (checked in ``_validate``).
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None

    def mesh_for(self, device_type: str) -> DeviceMesh:
        """The mesh the parameters' DTensors live on."""
        if self.mesh is not None:
            return self.mesh
        meshes = _MESHES.setdefault(self.process_group, {})
        mesh = meshes.get(device_type)
        if mesh is None or mesh.get_group() not in dist.distributed_c10d._world.pg_map:
            mesh = meshes[device_type] = DeviceMesh.from_group(self.process_group, device_type)
        return mesh


# Process group -> device type -> the 1-D mesh built over it (see [Note: Helper
# groups] in divergence.py: keyed by the group object, so per rank).
_MESHES: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, DeviceMesh]]" = weakref.WeakKeyDictionary()


def _resolve_options(
    mesh: Union[DeviceMesh, dist.ProcessGroup, None], reshard_after_forward: bool, mp_policy: object
) -> ShardingOptions:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) first; "
            "under torchrun the rendezvous variables are already set."
        )
    if reshard_after_forward is None:  # FSDP2's "auto": every module but the root, as True does here
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"fully_shard: reshard_after_forward must be True or False, got {reshard_after_forward!r} "
            "(resharding to a smaller group, FSDP2's int form, is not supported)."
        )
    if mesh is None:
        group = dist.distributed_c10d._get_default_group()
    elif isinstance(mesh, DeviceMesh):
        _check_mesh(mesh)
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}.")
    return ShardingOptions(group, reshard_after_forward, None,
                           mesh if isinstance(mesh, DeviceMesh) else None, mp_policy)


def _check_mesh(mesh: DeviceMesh) -> None:
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
        raise NotImplementedError(
            f"fully_shard: a 2-D mesh {mesh} (HSDP: replicate x shard) is not supported yet; pass the "
            "1-D shard mesh (mesh['shard']) to shard within it.")


# The ``config.comm`` settings that decide which groups exist and which
# collectives run: every rank must have the same (see [Note: Agreeing at
# fully_shard]).
_AGREED_SETTINGS = ("separate_reduce_group", "check_collectives", "gloo_reduce_by_all_to_all",
                    "hand_over_gathers")


def _comm_settings() -> tuple[bool, ...]:
    return tuple(getattr(comm, name) for name in _AGREED_SETTINGS)


def _with_groups(options: ShardingOptions) -> ShardingOptions:
    """``options`` with its reduce group and checker, created collectively."""
    group = options.process_group
    reduce_group = _reduce_group_for(group) if comm.separate_reduce_group else group
    return replace(options, reduce_group=reduce_group, checker=checker_for(group),
                   hand_over_gathers=comm.hand_over_gathers,
                   gloo_reduce_by_all_to_all=comm.gloo_reduce_by_all_to_all)


# Gather group -> its reduce group, created once per gather group (keyed by the
# group object: per rank, see [Note: Helper groups] in divergence.py). Weakly:
# see [Note: Process groups at exit] in tools/launch.py.
_REDUCE_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = weakref.WeakKeyDictionary()


def _reduce_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """[Note: A second group for reduce-scatters]
    The overlap passes never reorder two collectives on one process group (the
    order is what keeps ranks matched), and in backward the next module's
    all-gather comes after this module's reduce-scatter in program order. On
    one group the gather could therefore never be issued before the
    reduce-scatter, i.e. never hidden behind this module's backward compute.
    With the reduce-scatters on a group of their own (same ranks, same
    backend), each group keeps its order and the gather moves freely across
    the reduce-scatter. The eager runtime uses the same two groups, so a
    compiled and an eager module never interleave differently on one group.

    Created the first time ``fully_shard`` sees the gather group. Every rank
    calls ``fully_shard`` in the same order (see [Note: Agreeing at
    fully_shard]), so every member creates it at the same point: for a group
    spanning the world with ``new_group`` (which all ranks join), for a
    smaller group with ``use_local_synchronization`` (only its members join).
    """
    reduce_group = _REDUCE_GROUPS.get(group)
    if reduce_group is None or reduce_group not in dist.distributed_c10d._world.pg_map:
        # (not created yet, or destroyed with its world by destroy_process_group)
        ranks = dist.get_process_group_ranks(group)
        local = len(ranks) != dist.get_world_size()
        reduce_group = dist.new_group(
            ranks, backend=dist.get_backend(group), use_local_synchronization=local,
            group_desc=f"compiled_fsdp_reduce_{group.group_name}",
        )
        assert reduce_group is not None
        _REDUCE_GROUPS[group] = reduce_group
    return reduce_group


def _policy_matches(policy: Policy) -> Callable[[nn.Module], bool]:
    if callable(policy) and not isinstance(policy, type):
        return policy
    classes = tuple(policy)
    return lambda m: isinstance(m, classes)


def fully_shard(
    module: nn.Module,
    *,
    mesh: Union[DeviceMesh, dist.ProcessGroup, None] = None,
    reshard_after_forward: Optional[bool] = True,
    policy: Optional[Policy] = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (default: the whole world) and
    return the same module object.

    Apply it to each block, then to the root; or once to the root with ``policy``,
    a set of module classes (or a predicate) whose instances are sharded first.
    ``reshard_after_forward=True`` frees the unsharded parameters after forward
    and gathers them again in backward (ZeRO-3); ``False`` keeps them to backward.
    ``mp_policy`` gathers and computes in ``param_dtype`` and reduces gradients in
    ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy``); default: full precision.
    ``offload_policy``: ``OffloadPolicy()`` (none) or, for parameters already on
    the CPU, ``CPUOffloadPolicy()``. ``shard_placement_fn``: each parameter's
    ``Shard(0)`` or None (dim 0); other dims are refused. See DESIGN.md, "FSDP2's API".
    """
    check_offload(offload_policy, module)
    options = _resolve_options(mesh, reshard_after_forward, mp_policy)
    options = replace(options, shard_placement_fn=shard_placement_fn)
    if policy is not None:
        matches = _policy_matches(policy)
        targets = [m for m in module.modules() if m is not module and matches(m)]
        for m in reversed(targets):  # post-order: children before parents
            if get_fsdp_state(m) is None:
                _shard_one(m, options, ignored_params)
    return _shard_one(module, options, ignored_params)


fully_shard.state = get_fsdp_state  # type: ignore[attr-defined]  # FSDP2's ``fully_shard.state(module)``


def _shard_one(module: nn.Module, options: ShardingOptions, ignored_params: Optional[set[nn.Parameter]]) -> nn.Module:
    ignored = set(ignored_params or ())
    error: Optional[tuple[str, str]] = None
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    conflicts: list[str] = []
    mp = MixedPrecisionPolicy()
    try:
        mp = check_policy(options.mp_policy)
        owners, conflicts = _validate(module, ignored, mp, options.shard_placement_fn)
        _check_device_and_backend(module, owners, options.process_group)
    except _AGREED_ERRORS as exc:
        error = (type(exc).__name__, str(exc))
    fingerprint = [(places[0][2], tuple(p.shape), str(p.dtype)) for p, places in owners.items()]
    _agree(options.process_group, module, error, (fingerprint, repr(mp)), _comm_settings())
    options = _with_groups(options)
    group = None
    if owners:
        mesh = options.mesh_for(_mesh_device_type(next(iter(owners)), options.process_group))
        rank = options.process_group.rank()
        fsdp_params = []
        for param, places in owners.items():
            fp = FSDPParam(param, [(m, n) for m, n, _ in places], places[0][2], mesh, rank, mp)
            _MANAGED[param] = fp
            fsdp_params.append(fp)
        group = FSDPParamGroup(
            fsdp_params, options.process_group, options.reduce_group, _next_key(),
            options.reshard_after_forward, type(module).__name__, options.checker,
            reduce_by_all_to_all=uses_all_to_all(options.reduce_group, options.gloo_reduce_by_all_to_all),
            hand_over_gathers=options.hand_over_gathers,
        )
        by_module: dict[nn.Module, dict[str, FSDPParam]] = {}
        for fp in fsdp_params:
            for m, n in fp.owners:
                by_module.setdefault(m, {})[n] = fp
        for m, names in by_module.items():
            install_class(m, names, mixin=None if m is module else ManagedByAncestor)
            m.register_load_state_dict_post_hook(_reset_after_load(list(names.values())))
    for m in module.modules():  # Dynamo traces FSDP-managed modules unspecialized (pytorch#127843).
        m._is_fsdp_managed_module = True
        m._fsdp_use_orig_params = True
    for nested in iter_fsdp_states(module):
        if nested.param_group is not None:
            nested.param_group.outermost = False
    state = FSDPState(module, group, mp)
    state.deferred_error = _shared_across_groups(module, conflicts)
    install_class(module, mixin=FSDPModule)
    compiled_path().on_fully_shard(group)
    return module


def _mesh_device_type(param: nn.Parameter, group: dist.ProcessGroup) -> str:
    """The device type of the parameters' mesh. For a model built on ``meta``
    (see [Note: Meta-device init] in param.py) it is the device the process
    group communicates on: CUDA for NCCL, the accelerator (if any) for torch's
    fake group, else CPU."""
    if param.device.type != "meta":
        return param.device.type
    backend = dist.get_backend(group)
    if backend == "fake" and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return "cuda" if backend == "nccl" else "cpu"


# The device types each backend carries; a backend not named here is not checked.
_BACKEND_DEVICES = {"gloo": {"cpu"}, "nccl": {"cuda"}, "fake": None}


def _check_device_and_backend(module: nn.Module, owners: dict, group: dist.ProcessGroup) -> None:
    msg = device_backend_error({p.device.type for p in owners}, str(dist.get_backend(group)))
    if msg is not None:
        raise ValueError(f"fully_shard({type(module).__name__}): {msg}")


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


def _reset_after_load(fsdp_params: list[FSDPParam]) -> Callable:
    """A post-hook for ``load_state_dict(assign=True)``, which registers the
    loaded tensors in place of ours: see ``FSDPParam.reset_sharded_param``."""

    def hook(module: nn.Module, incompatible_keys: object) -> None:
        for fp in fsdp_params:
            fp.reset_sharded_param()

    return hook


def _validate(
    module: nn.Module, ignored: set[nn.Parameter], mp: MixedPrecisionPolicy,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str, str]]], list[str]]:
    """Local checks, raising FSDP2's exception types with what was wrong and
    what to do: the owned parameters and the names of those another
    application already owns (see ``_shared_across_groups``)."""
    if get_fsdp_state(module) is not None:
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once. fully_shard "
            f"has already been applied to this {type(module).__name__}: apply it once per module "
            "(blocks first, then the root)."
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {type(module).__name__}. "
            "Apply fully_shard to each module in it, or to the module whose forward calls them."
        )
    owners, conflicts = _collect_owned(module, ignored)
    for p, places in owners.items():
        _check_placement(places[0][2], p, shard_placement_fn)
    devices = sorted({str(p.device) for p in owners})
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard({type(module).__name__}): its parameters are on several devices {devices}; "
            "move the module to one device (e.g. module.to(device)) before fully_shard."
        )
    # One bucket carries one dtype (see [Note: Mixed precision] in policy.py).
    dtypes = {str(mp.compute_dtype(p.dtype)): places[0][2] for p, places in owners.items()}
    if len(dtypes) > 1:
        examples = ", ".join(f"{fqn!r} ({dtype})" for dtype, fqn in sorted(dtypes.items()))
        raise ValueError(
            f"fully_shard({type(module).__name__}): its parameters would be communicated in several "
            f"dtypes: {examples}. One fully_shard application gathers its parameters in one dtype, as "
            "in FSDP2: convert them to one dtype, apply fully_shard to the odd ones' module "
            "separately, or pass them in ignored_params."
        )
    return owners, conflicts


def _agree(
    group: dist.ProcessGroup, module: nn.Module, error: Optional[tuple[str, str]], fingerprint: object,
    settings: object = None,
) -> None:
    """[Note: Agreeing at fully_shard]
    A check that fails on one rank only would let the other ranks run on into the
    first all-gather and wait forever. So every rank shares its verdict, the
    names, shapes and dtypes of what it is about to shard, and the ``config.comm``
    settings that decide which groups it creates next (one small collective per
    call, at set-up only, before any group is created), and all ranks raise
    together if any rank failed or the ranks disagree. (A rank with the checks
    or the reduce group off would otherwise skip a ``new_group`` the others
    wait in. Tested by tests/test_api.py::test_bad_input_is_a_clear_error_on_every_rank.)"""
    verdicts: list = [None] * group.size()
    if not ranks_are_processes(group):  # no other process to agree with: [Note: Helper groups]
        verdicts = [(error, fingerprint, settings)] * group.size()
    else:
        dist.all_gather_object(verdicts, (error, fingerprint, settings), group=group)
    failed = [(r, e) for r, (e, _, _) in enumerate(verdicts) if e is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        error_type = next(t for t in _AGREED_ERRORS if t.__name__ == kind)
        raise error_type(f"{msg} (found on rank {rank}; every rank stops here)")
    for r, (_, _, theirs) in enumerate(verdicts):
        if theirs != settings:
            raise ValueError(
                f"fully_shard({type(module).__name__}): rank {r} has compiled_fsdp.config.comm settings "
                f"({', '.join(_AGREED_SETTINGS)}) = {theirs}, rank "
                f"{group.rank()} has {settings}. Set them the same way on every rank, before fully_shard."
            )
    for r, (_, fp, _) in enumerate(verdicts):
        if fp != fingerprint:
            raise ValueError(
                f"fully_shard({type(module).__name__}): rank {r} shards different parameters than rank "
                f"{group.rank()} (a different number of parameters, different names, shapes or dtypes, or "
                "a different mp_policy). Build the same model on every rank (same config and seed) and "
                "call fully_shard with the same arguments."
            )


def _collect_owned(
    module: nn.Module, ignored: set[nn.Parameter]
) -> tuple[dict[nn.Parameter, list[tuple[nn.Module, str, str]]], list[str]]:
    """Parameters this application owns, each with every (module, name, fqn) place
    it is registered at, in ``named_modules`` order, and the names of those
    another application already owns. See [Note: Ownership]."""
    owned: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    conflicts: list[str] = []
    for prefix, m, in _modules_outside_nested(module):
        for name, p in list(m._parameters.items()):
            if p is None or p in ignored:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            # (A shard is a DTensor; no registry holds it: a weak reference would stop
            # to_empty() from swapping it, see [Note: Meta-device init].)
            if p in _MANAGED or isinstance(p, DTensor):
                conflicts.append(fqn)
                continue
            if p.dim() == 0:
                raise ValueError(
                    f"fully_shard({type(module).__name__}): parameter {fqn!r} is a scalar (0-dim); a "
                    f"sharded parameter is a DTensor sharded on dim 0, which a scalar has not. Change {fqn} "
                    "to a 1D tensor with numel equal to 1 (e.g. nn.Parameter(torch.tensor([1.5])))."
                )
            if not p.is_contiguous():
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: fully_shard({type(module).__name__}) "
                    f"got {fqn!r} with shape {tuple(p.shape)} and stride {p.stride()} (e.g. channels_last). "
                    "Make it contiguous (module.to(memory_format=torch.contiguous_format)) before fully_shard."
                )
            owned.setdefault(p, []).append((m, name, fqn))
    return owned, conflicts


def _shared_across_groups(module: nn.Module, conflicts: list[str]) -> Optional[str]:
    """The error for parameters another ``fully_shard`` application already
    owns (a weight shared between two fully sharded modules, or a parent
    sharded before its child), or None. As in FSDP2 it is raised at the
    root's first forward (lazy init), on every rank: the same model gives
    every rank the same verdict."""
    if not conflicts:
        return None
    return (f"fully_shard({type(module).__name__}): parameter {conflicts[0]!r} is already managed by another "
            "fully_shard application (a weight shared between two fully sharded modules, or fully_shard "
            "applied to a parent before its child). Apply fully_shard to a common ancestor of every module "
            "that uses it (children first, then parents), or pass it in ignored_params.")


def _check_placement(fqn: str, param: nn.Parameter,
                     shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]]) -> None:
    """FSDP2's ``shard_placement_fn``: None or ``Shard(0)`` are dim 0, the only
    layout the bucket ([Note: Bucket layout]) and the passes know."""
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if placement is None:
        return
    if not isinstance(placement, Shard):
        raise TypeError(f"fully_shard: shard_placement_fn must return a Shard or None, got {placement!r} "
                        f"for {fqn!r}.")
    dim = placement.dim if placement.dim >= 0 else placement.dim + param.dim()
    if not 0 <= dim < param.dim():
        raise AssertionError(f"Shard dim {placement.dim} is invalid for {param.dim()}D tensor: {fqn!r}")
    if dim != 0:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for {fqn!r}; compiled_fsdp "
            "shards every parameter on dim 0 (its bucket layout and passes know no other). Return None or "
            "Shard(0).")


def _modules_outside_nested(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(prefix, module) for ``module``'s subtree, skipping subtrees already sharded."""
    out = []

    def visit(prefix: str, m: nn.Module) -> None:
        out.append((prefix, m))
        for name, child in m.named_children():
            if get_fsdp_state(child) is None:
                visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", module)
    return out
