"""``replicate``: composable data parallelism (the composable API the project
grew from had ``replicate`` beside ``fully_shard``).

[Note: replicate]
``replicate(module)`` keeps full parameters on every rank and averages the
gradients over the ranks. It is HSDP with shard groups of one rank ([Note:
HSDP] in api.py): each rank is its own shard group (a process group of one,
made locally), so the gather and the reduce-scatter move nothing, and every
reduced bucket is summed over the replicas, the ``replicate`` group. The
parameters are DTensors ``Replicate()`` on a 1-D mesh over that group (the
same mesh object ``fully_shard`` builds over it), so ``clip_grad_norm_``, DCP
and the state-dict API handle them as they handle shards, and a model that
mixes both (a replicated embedding, sharded blocks) is one model to them.
The state is the runtime's ``FSDPState`` with ``api == "replicate"``, found
the same way from any submodule (one registry); ``fully_shard`` on a
replicated module and the reverse are refused on every rank.

The hooks expose the parameter's own storage as its unsharded value (no
second copy; with a ``param_dtype`` cast, the cast copy): [Note: A group of
one reads its shards] in param.py.

[Note: replicate's buckets]
DDP all-reduces gradients in buckets of at most ``bucket_cap_mb`` (25 MB by
default), filled in reverse registration order, so the last layers' bucket
is on the wire while backward computes the earlier ones. ``replicate`` does
the same in eager: ``FSDPParamGroup.set_reduce_buckets`` cuts the
application's parameters into such buckets, and the group's autograd
function is applied once per bucket ([Note: Eager autograd through
UnshardFn]), so each bucket's all-reduce is issued as soon as its last
gradient exists; the buckets stay in flight together until another group
reduces or backward ends. For that, autograd must run the bucket's function
early: its engine runs the ready node created last first, so a function
applied at the module's pre-forward (before any of its compute) would run
only after the whole backward. Each bucket's function is therefore applied
at the first read of one of its parameters (``FSDPParamGroup.view_of``),
in a module whose forward runs in a plain eager call. Where Dynamo would
trace that first read, every bucket is applied at the pre-forward instead,
and reduced when backward is done with the module: inside a compiled call
(the fallback path), and when a submodule is compiled as a frame of its own
(``block.compile()``: the application function's side effects would break
its graph, an error under ``fullgraph=True``). ``fully_shard`` keeps one bucket per application, as
FSDP2. Under compile the reductions are the graph's: the passes cut the
application into units at the modules it calls and merge small ones
([Note: Units] in passes/units.py), one all-reduce per unit, scheduled for
overlap as the reduce-scatters are. On 2 ranks the bucketing changes no
result (one addition per element); on more, a ring all-reduce's order of
summation depends on where an element falls in the buffer, so the last
bits may differ. Tested by
tests/test_hsdp.py::test_replicate_buckets_overlap_backward (and
``..._with_a_block_compiled_on_its_own``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from compiled_fsdp.runtime.api import ShardingOptions, _shard_one, check_initialized, mesh_group
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy
from compiled_fsdp.runtime.registry import RUNTIME
from compiled_fsdp.runtime.state import FSDPState, get_fsdp_state

__all__ = ["replicate"]


def _group_of_one(group: dist.ProcessGroup) -> dist.ProcessGroup:
    alone = RUNTIME.alone_groups.get(group)
    if alone is None or alone not in dist.distributed_c10d._world.pg_map:
        rank = dist.get_rank()
        alone = dist.new_group([rank], backend=dist.get_backend(group), use_local_synchronization=True,
                               group_desc=f"compiled_fsdp_alone_{group.group_name}")
        assert alone is not None
        RUNTIME.alone_groups[group] = alone
    return alone


def replicate(
    module: nn.Module,
    *,
    mesh: Union[DeviceMesh, dist.ProcessGroup, None] = None,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    bucket_cap_mb: float = 25,
) -> nn.Module:
    """Replicate ``module``'s parameters on every rank of ``mesh`` (a 1-D mesh,
    a process group, or None: the world) and average their gradients over it
    during each backward, in all-reduces of at most ``bucket_cap_mb``
    megabytes issued as each bucket's gradients exist (DDP's buckets: [Note:
    replicate's buckets]); ``set_requires_gradient_sync(False)`` accumulates
    without. Composes with ``fully_shard`` on other submodules; returns the
    same module. See [Note: replicate]."""
    check_initialized("replicate")
    if isinstance(mesh, DeviceMesh) and mesh.ndim != 1:
        raise ValueError(f"replicate expects a 1-D DeviceMesh, got {mesh}: for replicas of shard groups "
                         "use fully_shard with a 2-D (replicate, shard) mesh (HSDP).")
    group = mesh_group("replicate", mesh)
    options = ShardingOptions(
        _group_of_one(group), False, None, mesh if isinstance(mesh, DeviceMesh) else None, mp_policy,
        replicate_group=group, api="replicate", bucket_cap_mb=bucket_cap_mb,
    )
    _shard_one((module,), options, ignored_params)
    return module


def _replicate_state(module: nn.Module) -> Optional[FSDPState]:
    """The state ``replicate`` attached to ``module``, or None."""
    state = get_fsdp_state(module)
    return state if state is not None and state.api == "replicate" else None


replicate.state = _replicate_state  # type: ignore[attr-defined]  # as fully_shard.state
