"""The process groups ``fully_shard`` makes beside its mesh's: the
reduce-scatters' own group, and an int ``reshard_after_forward``'s smaller
group. Each is made once per group (and size), collectively, and kept in
``RUNTIME``.

[Note: Resharding to a smaller group]
FSDP2's int ``reshard_after_forward=N`` (a factor of the shard group's size
``W``) frees the unsharded parameters after forward but keeps ``1/N`` of them:
the backward gathers them again over ``N`` ranks only (on a cluster, within a
node, over the fast links) instead of all ``W``. The groups are ``N``
consecutive ranks of the shard group, FSDP2's ``mesh.view(-1, N)``
(``post_forward_group_for``). In the bucket layout ([Note: Bucket layout]
in core/layout.py) the all-gather output ``[W * T]`` is ``W`` shards in rank
order, so cutting it into ``N`` equal parts gives each rank of a post-forward
group a contiguous part, ``W / N`` shards long, and an all-gather of the parts
over that group is the output again, bitwise: the copy-out is unchanged. Both
paths cut it with ``layout.post_forward_part``: the eager runtime keeps the part
when its forward waits for the gather (state ``SHARDED_POST_FORWARD`` after
``post_forward``), the lowering saves it from the forward's gather for the
backward's ([Note: Resharding to a smaller group in graphs] in
passes/post_forward.py). Tested by tests/test_reshard_int.py. A root forward drops a part left from an
earlier iteration (an evaluation forward has no backward to use it, and an
optimizer step may have changed the shards since). Memory between forward and
backward: ``T * W / N`` per rank instead of ``T``; gathered bytes in backward:
the same output from ``N - 1`` peers instead of ``W - 1``.
"""
from __future__ import annotations

import torch.distributed as dist

from compiled_fsdp.runtime.registry import RUNTIME

__all__ = ["post_forward_group_for", "reduce_group_for"]


def reduce_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
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
    reduce_group = RUNTIME.reduce_groups.get(group)
    if reduce_group is None or reduce_group not in dist.distributed_c10d._world.pg_map:
        # (not created yet, or destroyed with its world by destroy_process_group)
        ranks = dist.get_process_group_ranks(group)
        local = len(ranks) != dist.get_world_size()
        reduce_group = dist.new_group(
            ranks, backend=dist.get_backend(group), use_local_synchronization=local,
            group_desc=f"compiled_fsdp_reduce_{group.group_name}",
        )
        assert reduce_group is not None
        RUNTIME.reduce_groups[group] = reduce_group
    return reduce_group


def post_forward_group_for(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``group`` (FSDP2's
    ``mesh.view(-1, size)``: on a cluster, ranks of one node), which an int
    ``reshard_after_forward`` keeps the parameters sharded over after forward.
    Only its members create it (``use_local_synchronization``), once per
    shard group and size."""
    by_size = RUNTIME.post_forward_groups.setdefault(group, {})
    pf_group = by_size.get(size)
    if pf_group is None or pf_group not in dist.distributed_c10d._world.pg_map:
        ranks = dist.get_process_group_ranks(group)
        first = group.rank() // size * size
        pf_group = dist.new_group(
            ranks[first:first + size], backend=dist.get_backend(group), use_local_synchronization=True,
            group_desc=f"compiled_fsdp_post_forward_{group.group_name}_{size}",
        )
        assert pf_group is not None
        by_size[size] = pf_group
    return pf_group
