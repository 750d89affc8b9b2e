"""Settings the runtime reads: how parameters and gradients are communicated, on both paths.

Set them before ``fully_shard`` (``separate_reduce_group``, ``check_collectives``,
``hand_over_gathers``)
or before the first step (``gloo_reduce_by_all_to_all``, ``check_timeout_s``): ``compiled_fsdp.config.comm.<name> = ...``.
The compile integration puts them into Inductor's cache key (see
``compiled_fsdp._compile._SchedulePass``), since the lowering reads them too.
The overlap passes' own knobs are in ``compiled_fsdp.passes.config``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CommConfig:
    # Read by ``fully_shard``: run the reduce-scatters on a second process group
    # with the same ranks, so backward all-gathers can be issued ahead of the
    # previous module's reduce-scatter. See [Note: A second group for
    # reduce-scatters] in _api.py.
    separate_reduce_group: bool = True
    # On gloo, reduce gradient buckets with an all-to-all and a local sum
    # instead of gloo's all-reduce-based reduce-scatter (both runtimes). See
    # [Note: Reduce-scatter on gloo] in _reduce.py.
    gloo_reduce_by_all_to_all: bool = True
    # Read by ``fully_shard``: check that every rank issues the same collectives
    # in the same order (one small gloo group per set of ranks). See [Note:
    # Agreeing on collectives] in _divergence.py.
    check_collectives: bool = True
    # How long a rank waits at a check for the others (time a peer spends
    # compiling does not count) before raising CollectiveMismatchError.
    check_timeout_s: float = 30.0
    # Read by ``fully_shard`` (every rank must agree), which keeps it for the
    # modules it shards: blocks compiled on their own hand over gathers, each block's graph
    # issuing the next block's all-gather and reducing its gradient, so
    # communication overlaps across blocks (False: each block's graph gathers
    # and reduces its own, exposed). See [Note: Gathers handed to the next
    # block's graph] in _param_group.py.
    hand_over_gathers: bool = True


comm = CommConfig()
