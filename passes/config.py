"""User-facing knobs of the passes: which run (``pipeline``), and how the
overlap passes bucket and schedule (``overlap``).

Set them before the first compile: ``compiled_fsdp.passes.config.overlap.schedule
= False``. Their values are part of Inductor's cache key (see
``_SchedulePass`` in compiled_fsdp/compile/install.py), so changing them recompiles.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class OverlapConfig:
    # Reorder the partitioned forward/backward graphs (Inductor only: see
    # [Note: Where scheduling runs] in schedule.py).
    schedule: bool = True
    # Bytes that collectives in flight (prefetched gathers and reduce-scatters
    # not yet waited on) may keep alive beyond the module computing: their
    # output buffers and the buckets made for their input (see [Note:
    # In-flight bytes] in schedule.py). None: twice the largest gather's, i.e.
    # at most two gathered modules in flight beyond the one computing.
    budget_bytes: int | None = None
    # A gather is issued no earlier than needed to hide ``cover`` times its
    # estimated duration behind compute (the cost model's estimates are rough:
    # on 2 CPU cores gloo's own threads compete with compute).
    cover: float = 2.0
    # Gather/reduce buckets smaller than this many bytes (unsharded) are merged
    # with their neighbour. See [Note: Bucket threshold] in bucketing.py.
    bucket_bytes: int = 256 * 1024
    # Cut each application into units chosen from the graph (False: one bucket
    # per application, as the eager runtime communicates). See [Note: Units] in
    # units.py.
    units: bool = True
    # Units larger than this many bytes (unsharded) split at the modules they
    # call. None: no ceiling but the root's (half of its bytes).
    unit_max_bytes: int | None = None
    # In a graph that holds the root's reads, cut the first block (the nested
    # application read first) at the modules it calls, as the root is: the
    # step's opening chain of gathers made shorter. See [Note: The step's
    # opening block cut by first use] in units.py.
    split_opening: bool = True
    # With compile regions, whose one graph every block runs, cut every block
    # so (a collective more each way a block). Off: on the CPU's emulated
    # network the host work of the collectives added outweighed the link time
    # hidden. See [Note: Every compile region cut as the opening block] in units.py.
    split_regions: bool = False
    # Where Inductor has its own overlap pass (simple_overlap, torch 2.14+):
    # True pins the schedule both ways so that pass leaves the collectives
    # where ours put them; False lets it move them further (collectives up,
    # waits down). See [Note: Inductor's simple_overlap] in pin.py.
    own_order: bool = True


overlap = OverlapConfig()


@dataclasses.dataclass
class PipelineConfig:
    # Passes switched off, by name (see [Note: One pass pipeline] in
    # pipeline.py): any of "lowering", "recompute", "schedule", "pin".
    disabled: frozenset[str] = frozenset()


pipeline = PipelineConfig()
