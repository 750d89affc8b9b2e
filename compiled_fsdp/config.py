"""Settings the runtime reads: how parameters and gradients are communicated, on both paths.

``compiled_fsdp.config.comm.<name> = ...``, before ``fully_shard``, which
agrees on them across ranks and keeps them per module
(``separate_reduce_group``, ``check_collectives``, ``hand_over_gathers``,
``gloo_reduce_by_all_to_all``, ``block_regions``), or before the first step
(``check_timeout_s``). The compiled graphs see them through the markers'
arguments ([Note: The marker contract] in core/marker.py), so they are part
of every graph and its cache key. The overlap passes' own knobs are in
``compiled_fsdp.passes.config``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CommConfig:
    # Read by ``fully_shard``: run the reduce-scatters on a second process group
    # with the same ranks, so backward all-gathers can be issued ahead of the
    # previous module's reduce-scatter. See [Note: A second group for
    # reduce-scatters] in runtime/api.py.
    separate_reduce_group: bool = True
    # Read by ``fully_shard``: on gloo, reduce gradient buckets with an
    # all-to-all and a local sum instead of gloo's all-reduce-based
    # reduce-scatter (both runtimes). See
    # [Note: Reduce-scatter on gloo] in core/comm.py.
    gloo_reduce_by_all_to_all: bool = True
    # Read by ``fully_shard``: check that every rank issues the same collectives
    # in the same order (one small gloo group per set of ranks). See [Note:
    # Agreeing on collectives] in runtime/divergence.py.
    check_collectives: bool = True
    # How long a rank waits at a check for the others (time a peer spends
    # compiling does not count) before raising CollectiveMismatchError.
    check_timeout_s: float = 30.0
    # Read by ``fully_shard`` (every rank must agree), which keeps it for the
    # modules it shards: blocks compiled on their own hand over gathers, each block's graph
    # issuing the next block's all-gather and reducing its gradient, so
    # communication overlaps across blocks (False: each block's graph gathers
    # and reduces its own, exposed). See [Note: Gathers handed to the next
    # block's graph] in compile/entry.py.
    hand_over_gathers: bool = True
    # Read by ``fully_shard`` (every rank must agree): under
    # ``torch.compile(model)``, each sharded module below a sharded one that
    # holds no sharded module itself (a block) is a
    # ``torch.compiler.nested_compile_region``, so identical blocks are traced
    # and compiled once; each block's gather is issued while the block before
    # it runs. False: the whole model is one graph. A block compiled on its
    # own (``block.compile()``) is unaffected; ``compiled_fsdp.explain`` says
    # why a block is no region. See [Note: Blocks as compile
    # regions] in compile/regions.py.
    block_regions: bool = True


comm = CommConfig()
