"""``fully_shard``: the public entry point.

[Note: HSDP]
A 2-D mesh is FSDP2's HSDP mesh: dim 0 replicates, dim 1 shards (whatever
the names; FSDP2 asks only that there are some). Parameters are DTensors
``(Replicate(), Shard(0))`` on it; each shard group (the ranks of one row)
gathers and reduce-scatters as a 1-D application does, and each reduced
shard is then summed over its replicas (an all-reduce on the column's
group) and divided by every contributing rank (R x S: the mean, as FSDP2).
One definition of that: ``ShardSpec.replicas`` and ``divisor`` (core/layout.py),
which the eager runtime (``finish_grad_sync``), the markers and the lowering
(``emit_reduced``: the all-reduce after the bucket's reduce) all read. The replicas'
all-reduce runs on its own group and rides in its reduce's lazy tail in the
schedule (passes/schedule.py); the cost model prices it on the inter-node link.
Gathers handed between blocks' graphs ([Note: Gathers handed to the next
block's graph]) carry the replicas' group too, and their reduce all-reduces.
Tested by tests/test_hsdp.py.

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
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from compiled_fsdp.config import comm
from compiled_fsdp.core.comm import ONE_PROCESS_BACKENDS, backend_on, uses_all_to_all
from compiled_fsdp.runtime.divergence import Checker, checker_for, ranks_are_processes, ranks_are_threads
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.groups import post_forward_group_for, reduce_group_for
from compiled_fsdp.runtime.module import FSDPModule, ManagedByAncestor
from compiled_fsdp.runtime.module_class import install_class
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.param_group import FSDPParamGroup
from compiled_fsdp.runtime.placement import compute_device, mesh_device_type, move_buffers
from compiled_fsdp.runtime.policy import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    check_offload,
    check_policy,
)
from compiled_fsdp.runtime.registry import RUNTIME
from compiled_fsdp.runtime.state import FSDPState, get_fsdp_state, iter_fsdp_states
from compiled_fsdp.runtime.validation import (
    check_device_and_backend,
    check_extensions,
    check_mesh,
    label,
    resolve_dp_mesh_dims,
    shared_across_groups,
    validate,
)

Policy = Union[Iterable[type], Callable[[nn.Module], bool]]

# The exception types ``fully_shard``'s checks raise (FSDP2's, for the same
# mistakes); one found on any rank is raised on every rank ([Note: Agreeing at fully_shard]).
_AGREED_ERRORS = (TypeError, ValueError, AssertionError, NotImplementedError)


def _next_key() -> int:
    """The next group key: the n-th application of fully_shard in a program is
    key n on every rank, so markers and buckets agree across ranks. Counted per
    rank (per world group object, in ``RUNTIME.keys``: thread ranks each have
    their own; see [Note: Helper groups])."""
    world = dist.distributed_c10d._get_default_group()
    counter = RUNTIME.keys.get(world)
    if counter is None:
        counter = RUNTIME.keys[world] = itertools.count()
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
    # The user's mesh (1-D, or HSDP's 2-D), or None: one is built over
    # ``process_group`` for the parameters' device type (see ``mesh_for``).
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
    # ``config.comm.block_regions``: see [Note: Blocks as compile regions] in compile/regions.py.
    block_regions: bool = False
    # FSDP2's ``CPUOffloadPolicy``, or None: see [Note: CPU offload] in policy.py.
    offload: Optional[CPUOffloadPolicy] = None
    # ``dp_mesh_dims``'s full SPMD mesh, or None: DTensor parameters on it keep
    # it ([Note: dp_mesh_dims] in validation.py).
    spmd_mesh: Optional[DeviceMesh] = None
    spmd_dp_names: tuple[str, ...] = ()  # (its data-parallel dims)
    # FSDP2's per-parameter placement hook (checked in validation.py).
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None
    # HSDP: the replicas' group (the mesh's dim 0), or None. See [Note: HSDP].
    replicate_group: Optional[dist.ProcessGroup] = None
    # An int ``reshard_after_forward`` between 1 and the shard group's size:
    # that size, and (made by ``_with_groups``) this rank's group of it; 0 and
    # None otherwise. See [Note: Resharding to a smaller group] in groups.py.
    post_forward_size: int = 0
    post_forward_group: Optional[dist.ProcessGroup] = None
    # Which composable API applies it: "fully_shard" or "replicate" (see
    # [Note: replicate] in replicate.py).
    api: str = "fully_shard"
    # ``replicate``'s ``bucket_cap_mb`` as the user passed it (checked, on
    # every rank together, by ``_shard_one``): see [Note: replicate's buckets].
    bucket_cap_mb: object = None

    def mesh_for(self, device_type: str) -> DeviceMesh:
        """The mesh the parameters' DTensors live on (``replicate``'s: over
        the replicas)."""
        if self.mesh is not None:
            return self.mesh
        over = self.replicate_group if self.api == "replicate" else self.process_group
        meshes = RUNTIME.meshes.setdefault(over, {})
        mesh = meshes.get(device_type)
        if mesh is None or mesh.get_group() not in dist.distributed_c10d._world.pg_map:
            mesh = meshes[device_type] = DeviceMesh.from_group(over, device_type)
        return mesh



def _resolve_options(
    mesh: Union[DeviceMesh, dist.ProcessGroup, None], reshard_after_forward: bool, mp_policy: object
) -> ShardingOptions:
    check_initialized("fully_shard")
    if reshard_after_forward is None:  # FSDP2's "auto": every module but the root, as True does here
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, "
            f"not {reshard_after_forward!r}: pass True, False or None."
        )
    if isinstance(mesh, DeviceMesh):
        check_mesh(mesh)
    group = mesh_group("fully_shard", mesh)
    hsdp = isinstance(mesh, DeviceMesh) and mesh.ndim == 2
    reshard, post_forward_size = _reshard_rule(reshard_after_forward, group.size())
    return ShardingOptions(group, reshard, None, mesh if isinstance(mesh, DeviceMesh) else None, mp_policy,
                           replicate_group=mesh.get_group(0) if hsdp else None,
                           post_forward_size=post_forward_size)


def mesh_group(api: str, mesh: Union[DeviceMesh, dist.ProcessGroup, None]) -> dist.ProcessGroup:
    """The group ``api`` communicates over: the world for None, a process group
    as given, a mesh's last dimension (HSDP's shard dimension)."""
    if mesh is None:
        return dist.distributed_c10d._get_default_group()
    if isinstance(mesh, DeviceMesh):
        return mesh.get_group(mesh.ndim - 1)
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(f"{api}: mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}.")


def check_initialized(api: str) -> None:
    """The error for a composable API applied before ``init_process_group``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{api}: torch.distributed is not initialized. Call "
            "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) first; "
            "under torchrun the rendezvous variables are already set."
        )


def _reshard_rule(reshard_after_forward: Union[bool, int], shard_size: int) -> tuple[bool, int]:
    """FSDP2's int form names the size of the groups the parameters stay
    sharded over after forward ([Note: Resharding to a smaller group] in
    groups.py): 1 is ``False`` (FSDP2 warns and does the same), the shard
    group's size is ``True``, a factor between reshards after forward and keeps
    that size (the second value; 0: the whole shard group)."""
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward, 0
    size = reshard_after_forward
    if size < 1 or size > shard_size or shard_size % size:
        raise ValueError(
            f"fully_shard: reshard_after_forward={size} (an int: the size of the groups the parameters stay "
            f"sharded over after forward) must be a factor of the shard group's size, {shard_size}: one of "
            f"{[d for d in range(1, shard_size + 1) if shard_size % d == 0]}; or pass True or False.")
    if size == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=False (bool): treated as False.", stacklevel=4)
        return False, 0
    return True, 0 if size == shard_size else size


# The ``config.comm`` settings that decide which groups exist and which
# collectives run: every rank must have the same (see [Note: Agreeing at
# fully_shard]).
_AGREED_SETTINGS = ("separate_reduce_group", "check_collectives", "gloo_reduce_by_all_to_all",
                    "hand_over_gathers", "block_regions")


def _comm_settings() -> tuple[bool, ...]:
    return tuple(getattr(comm, name) for name in _AGREED_SETTINGS)


def _with_groups(options: ShardingOptions) -> ShardingOptions:
    """``options`` with its reduce group and checker, created collectively."""
    group = options.process_group
    reduce_group = reduce_group_for(group) if comm.separate_reduce_group else group
    post_forward = post_forward_group_for(group, options.post_forward_size) if options.post_forward_size else None
    return replace(options, reduce_group=reduce_group, checker=checker_for(group, _mesh_ranks(options)),
                   post_forward_group=post_forward,
                   hand_over_gathers=comm.hand_over_gathers, block_regions=comm.block_regions,
                   gloo_reduce_by_all_to_all=comm.gloo_reduce_by_all_to_all)


def _mesh_ranks(options: ShardingOptions) -> Optional[list[int]]:
    """Every rank that HSDP's or ``replicate``'s collectives connect (None: the
    shard group's alone)."""
    if options.replicate_group is None:
        return None
    if options.mesh is not None:
        return options.mesh.mesh.flatten().tolist()
    return dist.get_process_group_ranks(options.replicate_group)  # replicate over a group



def _policy_matches(policy: Policy) -> Callable[[nn.Module], bool]:
    if callable(policy) and not isinstance(policy, type):
        return policy
    classes = tuple(policy)
    return lambda m: isinstance(m, classes)


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Union[DeviceMesh, dist.ProcessGroup, None] = None,
    reshard_after_forward: Union[bool, int, None] = True,
    policy: Optional[Policy] = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    offload_policy: Optional[OffloadPolicy] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    dp_mesh_dims: Optional[Any] = None,
) -> Union[nn.Module, list[nn.Module]]:
    """Shard ``module``'s parameters over ``mesh`` (default: the whole world) and
    return the same module object.

    Apply it to each block, then to the root; or once to the root with ``policy``,
    a set of module classes (or a predicate) whose instances are sharded first.
    A list of modules (FSDP2's form) is one group: its parameters are gathered
    when the first of them runs and freed after the last.
    ``reshard_after_forward=True`` frees the unsharded parameters after forward
    and gathers them again in backward (ZeRO-3); ``False`` keeps them to backward.
    ``mp_policy`` gathers and computes in ``param_dtype`` and reduces gradients in
    ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy``); default: full precision.
    ``offload_policy``: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy()``
    (shards, gradients and the optimizer step on the CPU: [Note: CPU offload]
    in policy.py). ``shard_placement_fn``: each parameter's
    ``Shard(dim)``, or None for dim 0 ([Note: Shard dims] in core/layout.py). ``dp_mesh_dims``
    (torch 2.15's ``DataParallelMeshDims``): ``mesh`` is the full SPMD mesh and
    this names its data-parallel dims ([Note: dp_mesh_dims] in validation.py).
    torch's own policy classes are taken as ours. See README.md, "FSDP2's arguments and methods".
    """
    modules = _as_modules(module)
    spmd_mesh, dp_names = None, ()
    if dp_mesh_dims is not None:
        spmd_mesh, (mesh, dp_names) = mesh, resolve_dp_mesh_dims(mesh, dp_mesh_dims, modules)
    options = _resolve_options(mesh, reshard_after_forward, mp_policy)
    options = replace(options, shard_placement_fn=shard_placement_fn, offload=check_offload(offload_policy),
                      spmd_mesh=spmd_mesh, spmd_dp_names=dp_names)
    if policy is not None:
        matches = _policy_matches(policy)
        for root in modules:
            targets = [m for m in root.modules() if m is not root and matches(m)]
            for m in reversed(targets):  # post-order: children before parents
                if get_fsdp_state(m) is None:
                    _shard_one((m,), options, ignored_params)
    _shard_one(modules, options, ignored_params)
    return module


def _as_modules(module: Union[nn.Module, list[nn.Module]]) -> tuple[nn.Module, ...]:
    """One module, or FSDP2's list form without the modules nested in another
    of the list (its ``_get_root_modules``)."""
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, (list, tuple)) or not module or not all(isinstance(m, nn.Module) for m in module):
        raise TypeError(f"fully_shard expects an nn.Module or a non-empty list of them, got {module!r}.")
    inside: set[int] = set()
    for m in module:
        inside.update(id(d) for d in m.modules() if d is not m)
    return tuple(m for i, m in enumerate(module) if id(m) not in inside and all(m is not n for n in module[:i]))


fully_shard.state = get_fsdp_state  # type: ignore[attr-defined]  # FSDP2's ``fully_shard.state(module)``


def _shard_one(modules: tuple[nn.Module, ...], options: ShardingOptions,
               ignored_params: Optional[set[nn.Parameter]]) -> None:
    ignored = set(ignored_params or ())
    error: Optional[tuple[str, str]] = None
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    conflicts: list[str] = []
    dims: dict[nn.Parameter, int] = {}
    mp = MixedPrecisionPolicy()
    bucket_bytes: Optional[int] = None
    try:
        mp = check_policy(options.mp_policy)
        bucket_bytes = _bucket_bytes(options.bucket_cap_mb)
        owners, conflicts, dims = validate(modules, ignored, mp, options.shard_placement_fn, options.api,
                                           options.process_group.size())
        check_device_and_backend(label(modules), owners, options.process_group, options.offload is not None)
        check_extensions(owners, dims, options.mesh, options.process_group.size())
    except _AGREED_ERRORS as exc:
        error = (type(exc).__name__, str(exc))
    fingerprint = [(places[0][2], tuple(p.shape), str(p.dtype), str(mp.for_param(p).param_dtype), dims.get(p),
                    options.reshard_after_forward, options.post_forward_size) for p, places in owners.items()]
    for agreeing in (options.process_group, options.replicate_group):  # (HSDP: the replicas too)
        if agreeing is not None:
            _agree(agreeing, label(modules), error, (fingerprint, mp.agreed(), bucket_bytes), _comm_settings())
    options = _with_groups(options)
    group = None
    if owners:
        mesh = options.mesh_for(_mesh_device_type(next(iter(owners)), options.process_group,
                                                  options.offload is not None))
        if mesh.device_type not in ("cpu", "meta"):
            move_buffers(modules, compute_device(mesh.device_type))
        rank = options.process_group.rank()
        shard_size = options.process_group.size()
        fsdp_params = []
        for param, places in owners.items():
            fp = FSDPParam(param, [(m, n) for m, n, _ in places], places[0][2], mesh, rank, mp,
                           shard_size=shard_size, shard_dim=dims[param], offload=options.offload,
                           spmd_mesh=options.spmd_mesh, spmd_dp_names=options.spmd_dp_names)
            RUNTIME.managed[param] = fp
            fsdp_params.append(fp)
        group = FSDPParamGroup(
            fsdp_params, options.process_group, options.reduce_group, _next_key(),
            options.reshard_after_forward, label(modules), options.checker,
            reduce_by_all_to_all=uses_all_to_all(options.reduce_group, options.gloo_reduce_by_all_to_all),
            # (a handed-over gather is not cut for a smaller group: [Note: Resharding to a smaller group])
            hand_over_gathers=options.hand_over_gathers and not options.post_forward_size,
            replicate_group=options.replicate_group,
            block_regions=options.block_regions,
            post_forward_group=options.post_forward_group,
        )
        if bucket_bytes is not None:
            group.set_reduce_buckets(bucket_bytes)
        by_module: dict[nn.Module, dict[str, FSDPParam]] = {}
        for fp in fsdp_params:
            for m, n in fp.owners:
                by_module.setdefault(m, {})[n] = fp
        for m, names in by_module.items():
            install_class(m, names, mixin=None if any(m is n for n in modules) else ManagedByAncestor)
            m.register_load_state_dict_post_hook(_reset_after_load(list(names.values())))
    for module in modules:
        for m in module.modules():  # Dynamo traces FSDP-managed modules unspecialized (pytorch#127843).
            m._is_fsdp_managed_module = True
            m._fsdp_use_orig_params = True
        for nested in iter_fsdp_states(module):
            if nested.param_group is not None:
                nested.param_group.outermost = False
    state = FSDPState(modules, group, mp, options.api)
    state.deferred_error = shared_across_groups(label(modules), conflicts)
    for module in modules:
        install_class(module, mixin=FSDPModule)
        # (a module holding other sharded modules, a root, stays outside: its
        # forward runs once a step, and the regions are its blocks)
        if options.block_regions and len(iter_fsdp_states(module)) > 1:
            _make_regions_below(module)
            compiled_path().make_region_root(module)
    compiled_path().on_fully_shard(group)


def _make_regions_below(module: nn.Module) -> None:
    """The sharded modules below ``module`` that hold no sharded module
    themselves (its blocks), sharded with ``config.comm.block_regions``,
    become compile regions: only once a module above them is sharded, so
    that a root is never one (its forward runs once a step, and no root
    above it would fall back from a graph break inside it:
    tests/test_block_regions.py::test_a_root_is_no_region). See [Note:
    Blocks as compile regions] in compile/regions.py."""
    for state in iter_fsdp_states(module):
        group = state.param_group
        if state.module is module or group is None or not group.block_regions or group.region_refusal \
                or len(iter_fsdp_states(state.module)) > 1:
            continue
        group.region_refusal = _region_refusal(group, state.modules)
        if group.region_refusal is None:
            compiled_path().make_region(state.module, group)


def _region_refusal(group: FSDPParamGroup, modules: list[nn.Module]) -> Optional[str]:
    """Why a module that ``config.comm.block_regions`` would make a compile
    region is none (its reads are traced in the root's graph instead), or
    None: what ``compiled_fsdp.explain`` says of it. See [Note: Blocks as
    compile regions] in compile/regions.py."""
    if ranks_are_threads(group.process_group):  # (one rank's prediction issued a gather the others did not)
        return ("its ranks are threads (torch's multi-thread group), which share the registry a region's "
                "gathers go through")
    if group.casts_in_graph:
        return ("its float8 weights are cast before their gather by the root graph's passes ([Note: Float8 "
                "weights cast before their gather in graphs] in passes/cast_gather.py)")
    if group.gathers_eagerly:
        return ("its parameters are gathered by the eager runtime (an all-gather extension)")
    if group.computes_dtensors:
        return ("its parameters compute as DTensors (tensor parallelism, dp_mesh_dims) or spmd_types-typed "
                "tensors, which cannot cross a region's boundary")
    if len(modules) > 1:
        return ("it is sharded in a list with other modules (torchtitan's [norm, output]), whose bucket no one "
                "region holds")
    return None


def _bucket_bytes(bucket_cap_mb: object) -> Optional[int]:
    """``replicate``'s ``bucket_cap_mb`` in bytes (None: one bucket)."""
    if bucket_cap_mb is None:
        return None
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"replicate: bucket_cap_mb must be a positive number of megabytes (DDP's meaning), "
                         f"got {bucket_cap_mb!r}.")
    return max(1, int(min(bucket_cap_mb, 2.0 ** 40) * 1024 * 1024))  # (inf: one bucket)


def _mesh_device_type(param: nn.Parameter, group: dist.ProcessGroup, offload: bool = False) -> str:
    """``placement.mesh_device_type`` for this process and ``group``."""
    def carries(device_type: str) -> bool:
        backend = backend_on(group, device_type)
        return backend is not None and not isinstance(backend, dist.ProcessGroupGloo)

    accelerator = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    return mesh_device_type(param.device.type, offload, accelerator, dist.get_backend(group) in ONE_PROCESS_BACKENDS,
                            carries)


def _reset_after_load(fsdp_params: list[FSDPParam]) -> Callable:
    """A post-hook for ``load_state_dict(assign=True)``, which registers the
    loaded tensors in place of ours: see ``FSDPParam.reset_sharded_param``."""

    def hook(module: nn.Module, incompatible_keys: object) -> None:
        for fp in fsdp_params:
            fp.reset_sharded_param()

    return hook


def _agree(
    group: dist.ProcessGroup, module_name: str, error: Optional[tuple[str, str]], fingerprint: object,
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
                f"fully_shard({module_name}): rank {r} has compiled_fsdp.config.comm settings "
                f"({', '.join(_AGREED_SETTINGS)}) = {theirs}, rank "
                f"{group.rank()} has {settings}. Set them the same way on every rank, before fully_shard."
            )
    for r, (_, fp, _) in enumerate(verdicts):
        if fp != fingerprint:
            raise ValueError(
                f"fully_shard({module_name}): rank {r} shards different parameters than rank "
                f"{group.rank()} (a different number of parameters, different names, shapes or dtypes, or "
                "a different mp_policy or bucket_cap_mb). Build the same model on every rank (same config and seed) "
                "and "
                "call fully_shard with the same arguments."
            )
