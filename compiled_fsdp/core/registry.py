"""The core's process-wide state, on one object (``CORE``): what the marker
ops and the collectives record while they run, and which runtime object owns
a key they meet.

- ``owners``: group key -> the runtime object that owns the key (a fully
  sharded module's parameter group), for code that meets a key in a graph or
  a marker and must reach its owner (the marker ops' eager implementations,
  the compile layer's checks, the tools' reports). Weak: a group lives as
  long as its module.
- ``counts`` / ``sent_bytes``: the eager collectives issued since the last
  ``reset_counts()``, by kind (``compiled_fsdp.collective_counts()``).
- ``added``: kept gradients an eager ``reduce_grad`` has already added (by
  identity, weak); see [Note: Accumulation without sync in graphs] in ops.py.
- ``backward_gathers``: the re-gathers issued ahead of the block graphs'
  backward; see [Note: Backward re-gathers prefetched across graphs].
- ``later_reduces``: compile regions' reduce-scatters, waited after their
  graphs; see [Note: A region's reduce-scatter waited outside its graph].

It is module-level because the marker ops' eager implementations, which
Dynamo and Inductor call with tensors and constants only, must reach it
(DESIGN.md, "State"). ``reset()`` returns it to a new process's state, live
owners apart.
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Callable, Optional, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["CORE", "BackwardGathers", "CoreRegistry", "LaterReduces", "MarkerOwner", "owner_of", "owners",
           "register_owner"]


class MarkerOwner(Protocol):
    """What the core asks of a key's owner."""

    key: int

    def before_marker_collective(self, op: str, param_index: int) -> None:
        """Called before a marker's eager implementation issues ``op``
        ("all-gather" or "reduce-scatter") for parameter ``param_index``
        (-1: the whole bucket): the runtime agrees on it with the other ranks."""

    def issuing_gather(self) -> contextlib.AbstractContextManager:
        """Where a marker op's eager code issues a gather of this key's
        bucket that it leaves in flight: the runtime's gather stream, where
        there is one ([Note: Gathers issued by ops on the gather stream] in
        ops.py)."""


# A bucket: its shards' storages and offsets (``ops.shards_key``).
BucketKey = tuple[tuple[int, int], ...]


# [Note: A bucket issued in the parts its graph takes]
# The issue ahead names a module's whole bucket (a compile region's shards,
# a block's for its backward), but the graph that takes it may gather it in
# parts: a compile region's block cut at the modules it calls ([Note: Every
# compile region cut as the opening block] in passes/units.py) gathers its
# attention's parameters and its feed-forward's apart. Taken whole, no part
# was ever issued ahead, and each part gathered where it stood. So each
# ``regather`` records the bucket it took (its shards, in its order), per
# kind, and forgets any it overlaps (the graph's units changed); an issue
# for a bucket issues each recorded part of it, in the order the parts were
# first taken (forward: the attention's first; backward: the
# feed-forward's), each packed from its own shards in its own order, so
# that taking it is bitwise the part's own gather; a part issued remembers
# its bucket, so that the backward chain (``then``, keyed by buckets) goes
# on from any part's ``regather``. (Two graphs taking overlapping buckets of
# the same shards in one step, two compiled variants alternating, would
# each forget the other's, and the one not taken next is waited and dropped
# at the backward's end: a gather wasted, the same on every rank. A bucket
# whose shards share a place, empty ones, is issued whole or not at all:
# ``ops.issue_if_wanted``.) Tested by
# tests/test_block_regions.py::test_regions_cut_take_their_parts_issued_ahead,
# with a rank's shard of a part empty by
# tests/test_region_variants.py::test_a_cut_region_with_a_rank_holding_no_row,
# and under HSDP by tests/test_hsdp.py::test_hsdp_2x2_matches_reference[regions_cut].
class BackwardGathers:
    """[Note: Backward re-gathers prefetched across graphs]
    A block compiled on its own that reshards after forward gathers its
    parameters again in its backward graph, and a graph can only overlap that
    gather with its own compute: each block's backward used to start by
    waiting for its own gather. FSDP2 issues block i-1's gather when block i's
    backward begins. The same here, through one op: the lowering makes a
    handed-in block's backward re-gather ``compiled_fsdp::regather`` (an
    opaque op that Inductor calls as it is), which takes the gather issued
    for the same shards if one is pending and otherwise gathers now. The
    compile layer issues them (``issue``) in the eager pre-backward hook of a
    block's graph: that block's own gather if not yet issued, then the gather
    of the block before it in the forward order, as FSDP2's backward prefetch
    does. Only buckets whose backward ``regather`` has run once (``takers``,
    per kind: a compile region's forward takes through the same op) are
    issued for a backward: a graph that re-gathers none of its parameters
    (kept from forward) is never sent one, and one that re-gathers them in
    parts is sent those parts ([Note: A bucket issued in the parts its graph
    takes]). A gather left pending at the end of backward is waited
    for and dropped (``drop_pending``). What is gathered is one pack of the
    shards with the layout functions of [Note: Bucket layout], so taking it is
    bitwise the graph's own gather. Every rank runs the same program over the
    same order, so all issue the same gathers. A gather issued when the root's
    forward ended (``kept``: [Note: Prefetch order] in runtime/context.py) outlives
    the end of a backward that did not take it (a chunked loss's backward
    through the head alone) and is dropped when the next step begins, before
    anything could take it after an optimizer step. (A shard's version counter
    cannot tell a stale gather: a DTensor's in-place ops, the optimizer's, do
    not bump its local tensor's.) Keys are storages: ``forget`` drops
    them all when shards move (``module._apply``, a parameter assigned anew),
    so that a storage reused on one rank only never makes the ranks' gathers
    differ. Compile regions use the same map for their forward gathers, and
    chain their backward ones (``then``: [Note: Gathers issued ahead of
    compile regions] in compile/regions.py).
    Tested by tests/test_handoff.py::test_backward_regathers_prefetched."""

    def __init__(self) -> None:
        # (backward, bucket) -> when it was first taken; and (backward, a shard
        # of it) -> that bucket: [Note: A bucket issued in the parts its graph takes]
        self.takers: dict[tuple[bool, BucketKey], int] = {}
        self._holder: dict[tuple[bool, tuple[int, int]], BucketKey] = {}
        self._first_takes = 0
        self.whole: dict[BucketKey, BucketKey] = {}  # a part issued -> the bucket it was issued for
        self.pending: dict[BucketKey, torch.Tensor] = {}
        self.kept: set[BucketKey] = set()  # pending ones that outlive a backward's end
        self.taken = 0  # regathers served by a pending gather (for the tests and the benchmarks)
        # A bucket -> what issues the gather of the module whose backward is
        # expected next, for a backward ``regather`` (compile regions). Weak:
        # the registry outlives models.
        self.then: dict[BucketKey, weakref.WeakMethod] = {}

    def reset(self) -> None:
        self.forget()
        self.taken = 0

    def forget(self) -> None:
        """Shards moved: no key holds any more (pending gathers waited and dropped)."""
        self.drop_pending()
        self.takers.clear()
        self._holder.clear()
        self.whole.clear()
        self.then.clear()

    def chain(self, key: BucketKey, issue: Callable[[], object]) -> None:
        """After the backward ``regather`` of ``key``, call ``issue`` (a bound method)."""
        self.then[key] = weakref.WeakMethod(issue)  # type: ignore[arg-type]

    def issue_next(self, key: BucketKey) -> None:
        """The gather chained after bucket ``key``'s (``then``), if any."""
        ref = self.then.get(key) or self.then.get(self.whole.get(key, key))
        issue = ref() if ref is not None else None
        if issue is not None:
            issue()

    def wanted(self, key: BucketKey, backward: bool) -> list[BucketKey]:
        """The parts of bucket ``key`` to issue for ``regather``s of this
        kind: each bucket such an op took before whose shards are all in
        ``key``, none pending, in the order they were first taken (``key``
        itself where it was taken whole)."""
        shards = set(key)
        parts = {held for shard in key if (held := self._holder.get((backward, shard))) is not None
                 and held not in self.pending and shards.issuperset(held)}
        return sorted(parts, key=lambda part: self.takers[(backward, part)])

    def issue(self, key: BucketKey, gathered: torch.Tensor, kept: bool = False, whole: Optional[BucketKey] = None
              ) -> None:
        """``gathered`` pending for ``key`` (``whole``: the bucket it is a part of)."""
        self.pending[key] = gathered
        if whole is not None:
            self.whole[key] = whole
        if kept:
            self.kept.add(key)

    def take(self, key: BucketKey, backward: bool) -> Optional[torch.Tensor]:
        if (backward, key) not in self.takers:  # (a bucket taken anew: any it overlaps is not taken any more)
            for shard in key:
                held = self._holder.get((backward, shard))
                if held is not None and held != key:
                    self.takers.pop((backward, held), None)
                    for other in held:
                        self._holder.pop((backward, other), None)
            self._holder.update(((backward, shard), key) for shard in key)
            self.takers[(backward, key)] = self._first_takes
            self._first_takes += 1
        self.kept.discard(key)
        gathered = self.pending.pop(key, None)
        if gathered is not None:
            self.taken += 1
        return gathered

    def drop_pending(self, but_kept: bool = False) -> None:
        """Wait for and drop the pending gathers (``but_kept``: all but the kept)."""
        for key in [k for k in self.pending if not (but_kept and k in self.kept)]:
            torch.ops._c10d_functional.wait_tensor(self.pending.pop(key))
        if not but_kept:
            self.kept.clear()


def _where(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage()._cdata, t.storage_offset())


# One stage of a later reduce: it waits its collective and returns each
# shard with its reduced rows, or the next stage (HSDP: the replicas'
# all-reduce, issued on the reduce-scatter's rows).
LaterReduce = Callable[[], Any]


class LaterReduces:
    """[Note: A region's reduce-scatter waited outside its graph]
    A compile region's backward graph returns its parameters' gradients, so
    it waited its reduce-scatter at its end: every byte of it exposed (35 ms
    a block in RESULTS' emulated setting, where one graph waits it behind the
    next block's compute). FSDP2 issues a block's reduce-scatter in its
    post-backward and waits it in the next one's. The same here: the lowering
    makes a region's reduce bucket ``compiled_fsdp::reduce_later`` (an opaque
    op, with a side effect), which packs the gradients and issues the
    reduce-scatter, not waited, and the graph returns no gradient for those
    shards. The next ``reduce_later`` (before packing its own, so that one
    packed bucket is alive at a time) and the end of
    the backward (``finish``, queued on autograd's engine by the first one, so
    before ``backward()`` returns, whatever the model's output) wait the earlier ones and hand each parameter's rows to
    the receiver its shard registered (``receivers``: the region adds them to
    the parameter's ``.grad``, as autograd's accumulation did). The pack, the
    reduce, the divisor and the cut are the layout functions of [Note: Bucket
    layout], so the gradients are bitwise the graph's own. Under HSDP a
    reduce has two stages, as FSDP2's reduce-scatter and all-reduce: the
    next ``reduce_later`` waits the reduce-scatter and issues the replicas'
    all-reduce on its rows, and the one after it (or ``finish``) waits that
    and hands the rows over. In its graph the all-reduce was waited at once,
    and each block's backward stood still for both collectives (RESULTS,
    2026-12-01, thirty-fourth session).
    Tested by tests/test_block_regions.py and, under HSDP, by
    tests/test_hsdp.py::test_hsdp_2x2_matches_reference[regions]."""

    def __init__(self) -> None:
        self.pending: list[LaterReduce] = []
        self.queued = False  # ``finish`` queued for this backward's end
        self.delivered = 0  # reduces waited and handed over (for the tests and the benchmarks)
        # Where a shard's data lives (its storage and offset: the graph may
        # hand the op another tensor on it) -> the shard registered there
        # (weakly) and what takes its reduced rows.
        self.receivers: dict[tuple[int, int], tuple[weakref.ref, Callable[[torch.Tensor], None]]] = {}
        # What runs once ``finish`` handed every pending reduce over (``land_after``), by its key.
        self.landings: dict[object, Callable[[], None]] = {}

    def receive(self, shard: torch.Tensor, receiver: Callable[[torch.Tensor], None]) -> None:
        """``receiver`` takes the reduced rows of ``shard`` (and of any tensor
        on its data) while ``shard`` lives: its entry goes with it, unless a
        later shard on the same data took the entry over."""
        where = _where(shard)

        def forget(ref: weakref.ref) -> None:
            if self.receivers.get(where, (None,))[0] is ref:
                del self.receivers[where]

        self.receivers[where] = (weakref.ref(shard, forget), receiver)

    def issue(self, launch: Callable[[], LaterReduce]) -> None:
        """In a backward: advances the reduces issued before by one stage,
        then issues one (``launch`` packs and issues it, and returns its
        first stage). Advanced first, the earlier bucket is freed before the
        next is packed (the next queues behind it on the link either way)."""
        earlier, self.pending = self.pending, []
        later = self._advance(earlier)
        del earlier  # (the stages run: what they held goes before the next pack)
        self.pending = [*later, launch()]
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Wait every pending reduce and hand its rows over; then run the
        landings asked for (``land_after``)."""
        earlier, self.pending, self.queued = self.pending, [], False
        while earlier:
            earlier = self._advance(earlier)
        landings, self.landings = self.landings, {}
        for land in landings.values():
            land()

    def land_after(self, key: object, land: Callable[[], None]) -> None:
        """``land`` runs once for ``key``, at the next ``finish`` (the end of
        this backward): a receiver that copied its rows without blocking
        lands them there ([Note: Offloaded gradients land at the end of
        backward] in runtime/reduces.py)."""
        self.landings.setdefault(key, land)

    def _advance(self, pending: list[LaterReduce]) -> list[LaterReduce]:
        """Runs each stage in issue order: hands over the rows of the reduces
        that end there; returns the next stages of the others."""
        later = []
        for stage in pending:
            out = stage()
            if callable(out):
                later.append(out)
                continue
            self.delivered += 1
            for shard, grad in out:
                shard_ref, receive = self.receivers.get(_where(shard), (None, None))
                if receive is None or shard_ref() is None:
                    raise RuntimeError("compiled_fsdp: a region's reduced gradient has no receiver (a shard "
                                       "replaced since its region was traced); please report this")
                receive(grad)
        return later

    def reset(self) -> None:
        self.pending, self.queued, self.delivered, self.landings = [], False, 0, {}


class CoreRegistry:
    """The core's state (see the module docstring)."""

    def __init__(self) -> None:
        self.owners: weakref.WeakValueDictionary[int, MarkerOwner] = weakref.WeakValueDictionary()
        self.counts: collections.Counter = collections.Counter()
        self.sent_bytes: collections.Counter = collections.Counter()
        self.added: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.backward_gathers = BackwardGathers()
        self.later_reduces = LaterReduces()

    def reset_counts(self) -> None:
        self.counts.clear()
        self.sent_bytes.clear()

    def reset(self) -> None:
        """Forget what was recorded (owners stay: they die with their modules)."""
        self.reset_counts()
        self.added.clear()
        self.backward_gathers.reset()
        self.later_reduces.reset()


CORE = CoreRegistry()


def register_owner(owner: MarkerOwner) -> None:
    CORE.owners[owner.key] = owner


def owner_of(key: int) -> Optional[MarkerOwner]:
    return CORE.owners.get(key)


def owners() -> list[MarkerOwner]:
    """Every live owner, by key."""
    return [owner for _, owner in sorted(CORE.owners.items())]
