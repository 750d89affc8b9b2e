"""Bucketing: merge small per-unit buckets with their neighbours.

[Note: Bucket threshold]
A collective costs a fixed latency plus a per-byte time (see cost_model.py).
Below ``latency_bytes = N * alpha * link_bandwidth`` the fixed part dominates:
on this machine's gloo (measured, 2 ranks) an all-gather of 16 KiB takes
0.52 ms and one of 256 KiB 0.52 ms too, against 1.45 ms for 1 MiB; the model
puts the crossover at ~280 KiB. A LayerNorm-only module of width 512 (4 KiB)
or a bias-only one pays the whole latency for nothing, so buckets whose
unsharded size is below ``config.overlap.bucket_bytes`` (default 256 KiB, the
measured crossover rounded down) join a neighbour -- if they are also at most
1/8 of the graph's largest bucket of their kind. That second condition keeps
buckets of comparable size apart (a model of tiny blocks keeps one gather per
block, so prefetching still has units to overlap) and merges only the odd ones
out: norm-only or bias-only modules, a small root's leftovers.

Neighbours are taken in execution order: gather buckets by their first marker
in the joint graph (forward order), reduce buckets by their last marker
(backward order). Walking that order, a bucket joins the open group when
either is below the threshold and they agree on process group, world size,
dtype and ``reshard_after_forward``. Bucketing changes only which collective
carries an element and where in the flat buffer it sits, never the per-element
reduction (a SUM over the same ranks), which is why 2-rank results stay
bitwise equal to the per-module eager runtime (measured on 3 ranks too: see
DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.fx as fx

from .graph import node_order, region_calls

T = TypeVar("T")


def group_small(items: Sequence[T], size: Callable[[T], int], threshold: int,
                compatible: Callable[[list[T], T], bool],
                largest: int | None = None) -> list[list[T]]:
    """Groups ``items`` (in execution order) as [Note: Bucket threshold] says:
    an item joins the open group when either is small (below ``threshold``
    and at most 1/8 of ``largest``, by default the largest item) and
    ``compatible(group, item)``. ``threshold <= 0`` groups nothing. Used for
    units (units.py) and buckets."""
    if not items:
        return []
    if largest is None:
        largest = max(size(x) for x in items)

    def small(nbytes: int) -> bool:
        return nbytes < threshold and nbytes * 8 <= largest

    groups: list[list[T]] = []
    for x in items:
        if groups:
            last = groups[-1]
            if (small(sum(size(y) for y in last)) or small(size(x))) and compatible(last, x):
                last.append(x)
                continue
        groups.append([x])
    return groups


def _compatible(a, b) -> bool:  # noqa: ANN001
    return (
        a.group_name == b.group_name
        and a.world_size == b.world_size
        and a.by_all_to_all == b.by_all_to_all
        and a.reshard_after_forward == b.reshard_after_forward
        and a.post_forward == b.post_forward
        and a.comm_dtype == b.comm_dtype
        and a.after_reduce == b.after_reduce
        and a.device == b.device
    )


def merge_small_buckets(graph: fx.Graph, buckets: list, threshold: int,
                        combine: Callable[[list], object]) -> list:
    """Groups ``buckets`` (all of one kind) in execution order and returns one
    bucket per group (``combine`` builds a merged one). Deterministic: depends
    on graph order and sizes only. ``threshold <= 0`` merges nothing."""
    if threshold <= 0 or len(buckets) < 2:
        return list(buckets)
    order = node_order(graph)
    pick = min if buckets[0].kind == "gather" else max

    def position(b: Any) -> int:
        return pick(order[m] for s in b.slots for m in s.markers)

    regions = region_calls(graph)  # (a compile region's call between two buckets parts them)

    def joins(group: list, b: Any) -> bool:
        lo, hi = position(group[-1]), position(b)
        return _compatible(group[0], b) and not any(lo < at < hi for at in regions)

    groups = group_small(sorted(buckets, key=position), lambda b: b.nbytes, threshold, joins)
    merged = [g[0] if len(g) == 1 else combine(g) for g in groups]
    return sorted(merged, key=lambda b: (b.module_key, b.unit))
