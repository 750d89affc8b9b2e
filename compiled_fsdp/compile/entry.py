"""The compile layer's state for one fully sharded module: a forward compiled
as a frame of its own, and the gathers handed between such frames.

[Note: Blocks compiled on their own]
torchtitan compiles each block, not the model: ``block.compile()`` (or
``torch.compile(block)`` in the parent's place) after ``fully_shard``, the root
running eagerly. Dynamo then runs the block's hooks as Python and compiles its
``forward`` as a frame of its own, and every identical block reuses that frame's
graph: Dynamo's cache is keyed on the code object and passes the guards of
another block of the same structure. So compile time does not grow with depth,
provided nothing in the traced graph names the block.

The pre-forward hook recognises the pattern (the module's own call is compiled
while the root runs eagerly: ``CompiledPath.begins_own_frame``) and leaves the group to the graph,
as the root does under ``torch.compile(model)``: ``CompiledEntry.active`` is set for
the duration of the forward, the parameter reads emit markers, and the passes
lower them to in-graph collectives. Those markers carry ``ENTRY_KEY`` instead of
the group's key (the n-th ``fully_shard`` call, a different constant per block
that Dynamo would guard on, recompiling per block and falling back to eager past
its recompile limit); everything else in the marker is the same for identical
blocks. ``ENTRY_KEY`` means "the module this frame was compiled for"; a fully
sharded module nested inside the block is traced inline and keeps its own key
(so such blocks recompile per block). The passes compare keys for equality only.

A graph break inside such a block splits its forward into frames, and those
frames are reused by every identical block too, so a split is recorded under a
key the blocks share (``entry_split_key``: the class and parameter shapes); a
split block falls back to the eager runtime from the next step on, as a split
root does ([Note: Fallback decision rule] in frames.py). Tested by
tests/test_block_compile.py.

[Note: Gathers handed to the next block's graph]
Inside one graph a block can overlap its collectives only with its own compute.
So that blocks compiled on their own keep the overlap across blocks that one
graph for the whole model has, each block's forward graph issues the *next*
block's all-gather and hands it over unwaited:

- While Dynamo traces block i, its first parameter read also traces
  ``compiled_fsdp::gather_next`` on block i+1's shards (``handoff_next``) and
  stores the result in block i+1's ``handoff_in`` (a side effect Dynamo
  replays after every run of the graph). The lowering makes it the bucket's
  pack and an ``all_gather_into_tensor`` with no wait: it runs while block i
  computes. Block i+1's parameter reads pass ``handoff_in`` to their markers
  (``gathered``), and its graph waits on it right before the first use.
- Autograd places the gradients: the gather's backward is the reduce-scatter,
  so block i+1's reduce-scatter runs in block i's backward graph, issued when
  that graph starts and overlapping block i's backward compute. Block i+1's
  backward graph returns its gradient packed in the gather's layout.
  ``gather_next`` also carries block i+1's kept gradients and sync flag, so
  accumulation without sync works as in a single graph (the casts and adds
  of [Note: Bucket layout] commute with the packing, so the result equals the
  eager runtime's exactly, up to the sign of a zero).
- The first block's gather is issued eagerly by the module before it (the
  root's pre-forward), whose eager backward reduces it.
- The backward re-gather of a block that reshards after forward is its own
  backward graph's, from its saved shards, but issued before that graph
  runs: no tensor passes from one backward graph to the next, so the graph
  calls an opaque op that takes the gather the eager pre-backward hooks
  issued, FSDP2's backward prefetch ([Note: Backward re-gathers prefetched
  across graphs] in core/registry.py).
- Which block is next: the previous iteration's forward order, the one the
  eager runtime prefetches by; in the first step the modules' order in the
  model. Only a module predicted to compile its own frame gets a handoff
  (``CompiledPath.predicts_own_frame``). The last block hands its gather to
  a stand-in that communicates nothing, so that its graph is the other
  blocks' ([Note: A stand-in for the last block's next] in core/gated.py).
- A wrong prediction stays correct. A block handed nothing gathers itself (a
  variant compiled when first needed). A handoff its module did not read (it
  ran eagerly, or not at all) is waited and dropped (``drop_handoff``); its
  backward then reduces zeros into that module's gradients, and the root puts
  back ``None`` where the module had no gradient and did not run (and where
  a module that ran did not read the parameter: ``params_left_unread``). Kept
  gradients the dropped handoff carried are left to that backward to reduce;
  a gather issued eagerly (whose backward never runs once dropped) leaves
  them to the module (tests/test_no_sync.py, ``untraced_last``).

Tested by tests/test_handoff.py.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Optional

import torch
from torch import nn

from compiled_fsdp.compile import frames, install
from compiled_fsdp.core import ops, registry
from compiled_fsdp.core.layout import joined_shapes
from compiled_fsdp.core.marker import GatherNext
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.param_group import FSDPParamGroup

__all__ = ["CompiledEntry", "entry_of", "param_settings", "read_kept", "read_syncs"]


def param_settings(param: FSDPParam) -> dict[str, Any]:
    """A read's marker arguments that are the parameter's and its group's
    settings (the same at every read until a setter changes one)."""
    group = param.group
    spec = param.spec
    settings = dict(
        full_shape=list(spec.full_shape), group_name=group.group_name, world_size=spec.world_size,
        param_index=param.index, local_rows=param.local_rows,
        # The user's policy; the passes apply [Note: The reshard rule] per unit.
        reshard_after_forward=group.reshard_after_forward, reduce_group_name=group.reduce_group_name,
        param_dtype=param.param_dtype, reduce_dtype=param.reduce_dtype, outermost=group.outermost,
        reduce_by_all_to_all=group.reduce_by_all_to_all, replicate_group_name=group.replicate_group_name,
        replicas=spec.replicas, divide_factor=spec.divide_factor)
    if param.offload:  # (copied to the device before its gather: [Note: CPU offload] in runtime/policy.py)
        settings.update(device=param.gather_device)
    if param.extension is not None and param.extension.casts_in_graph:
        settings.update(cast_from_shard=True)  # (torchao's float8 weights: FSDP2 casts their shard)
    if group.post_forward_args is not None:  # ([Note: Resharding to a smaller group] in runtime/groups.py)
        name, size, rank = group.post_forward_args
        settings.update(post_forward_group_name=name, post_forward_size=size, post_forward_rank=rank)
    return settings


def read_syncs(param: FSDPParam) -> bool:
    """Whether a read's gradient is reduced in the graph (else kept in its
    sink: [Note: Accumulation without sync in graphs] in core/ops.py)."""
    return param.group.reduce_grads or not param.sharded.requires_grad


def read_kept(param: FSDPParam, sync: bool, sink: bool) -> Optional[torch.Tensor]:
    """A read's ``kept`` argument: with sync, the gradient its sink kept (or
    None); without, the sink itself. ``sink``: whether it has one."""
    if not sink:
        if not sync:
            raise RuntimeError(
                f"compiled_fsdp: {param.fqn!r} has gradient sync off but no gradient sink; "
                "call the model through its root module (the sinks are made there)."
            )
        return None
    return param.kept_grad() if sync else param.grad_sink


class CompiledEntry:
    """What the compile layer keeps for one parameter group (in its
    ``compiled`` slot: see [Note: The compiled path] in runtime/extension.py)."""

    def __init__(self, group: FSDPParamGroup) -> None:
        self.group = group
        # This forward's graph is compiled for this module alone, and identical
        # blocks share it: see [Note: Blocks compiled on their own].
        self.active = False
        # What a split of such a frame is recorded under: the blocks share it.
        self.split_key = ("entry", group.name, tuple(s.full_shape for s in group.specs))
        # See [Note: Gathers handed to the next block's graph]: this module's
        # gathered bucket, issued (not waited) by whoever ran before it; the
        # module whose gather this module's graph issues, while it runs.
        self.handoff_in: Optional[torch.Tensor] = None
        self.handoff_next: Optional[CompiledEntry] = None
        self.forward_handoff: Optional[CompiledEntry] = None  # the last forward's, for a recompute
        self.handoff_traced = False  # this forward's trace issued handoff_next's gather
        self._handed_eagerly: Optional[torch.Tensor] = None  # the handoff_in issued outside a graph
        self._handoff_read: Optional[torch.Tensor] = None  # the handoff_in this forward reads
        # Whether this module's handed-over gather communicates: false for a
        # stand-in (``stand_in``); the graph reads this tensor (``live``: as a bool, eagerly).
        self.live_flag = torch.ones((), dtype=torch.bool)
        self._stand_in: Optional[tuple[tuple, CompiledEntry]] = None
        # Whether the module is a compile region and, per parameter, the leaf
        # aliasing its local shard that a read inside it takes ([Note: Blocks
        # as compile regions] in regions.py).
        self.in_region = False
        # Whether its reads were traced outside its region, which never ran
        # ([Note: A block whose region never runs] in region_reads.py).
        self.region_bypassed = False
        # Whether it ran its plain forward, traced with every size dynamic
        # ([Note: No compile regions under dynamic=True] in regions.py).
        self.region_dynamic = False
        # Whether a read in a graph takes ``region_shards``, not the DTensor's
        # local tensor: every group's, in a model with regions ([Note: No
        # DTensor inputs beside regions] in regions.py).
        self.reads_alias = False
        self.region_shards: list[Optional[torch.Tensor]] = [None] * len(group.fsdp_params)
        # Its reads' ``param_settings`` and flags and its issue-ahead's
        # arguments, encoded ([Note: A region's read settings] in region_reads.py).
        self.region_key = ""
        # The model's regions in its order, one list for all of them, and the
        # positions in it of those whose gathers the outer graph issues before
        # calling this one: the one expected to run after it (and the first
        # region's own) ([Note: Gathers issued ahead of compile regions] and
        # [Note: One source per region] in regions.py).
        self.region_order: list[CompiledEntry] = []
        self.region_ahead: tuple[int, ...] = ()
        # Its module (weakly), and, set each step before tracing, the casts
        # of its state's forward hooks where the region's call makes them
        # itself under Dynamo (None: it takes torch's call) ([Note: A region's
        # call under Dynamo] in region_call.py).
        self.region_module: Optional[weakref.ref] = None
        self.region_casts: Optional[tuple[Optional[torch.dtype], Optional[torch.dtype]]] = None
        self.full_shapes = tuple(joined_shapes(group.specs))
        self.local_rows = tuple(p.local_rows for p in group.fsdp_params)
        key, split_key = group.key, self.split_key
        # Run by comptime when Dynamo traces a marker (function objects that
        # exist before tracing, as comptime requires); see [Note: Fallback decision rule].
        self.record_trace = [lambda ctx, i=i: frames.record_marker_trace(key, i) for i in range(len(group.fsdp_params))]
        self.record_entry_trace = [lambda ctx, i=i: frames.record_marker_trace(key, i, split_key)
                                   for i in range(len(group.fsdp_params))]
        self.record_handoff_trace = lambda ctx: self._record_handoff()
        self.record_region_call = lambda ctx: self._region_called()
        self.record_region_bypassed = lambda ctx: setattr(self, "region_bypassed", True)
        self.record_region_dynamic = lambda ctx: setattr(self, "region_dynamic", True)

    def _region_called(self) -> None:
        self.region_dynamic = self.region_bypassed = False  # (a region again, after a compile without one)
        frames.record_bucket_trace(self.group.key)
        # ([Note: A region traced again for an equal block] in region_variants.py)
        install.SESSION.regions.called(weakref.ref(self))

    def _record_handoff(self) -> None:
        if self.handoff_next is not None:
            frames.record_bucket_trace(self.handoff_next.group.key)

    # -- the gather handed over ------------------------------------------------
    def gather_next_op(self, module_key: int) -> torch.Tensor:
        """This module's bucketed all-gather, not waited, with what its
        backward needs (kept gradients or sinks, the sync flag): traced into
        the graph of the module before it (``module_key=NEXT_KEY``), or run
        eagerly by it (the group's own key)."""
        group = self.group
        sync = group.reduce_grads
        params = group.fsdp_params
        # (the sinks of [Note: Accumulation without sync in graphs] in core/ops.py)
        kept = [p.kept_grad() for p in params] if sync else [None] * len(params)
        sink_params = [] if sync else [i for i, p in enumerate(params) if p.sharded.requires_grad]
        first = params[0]
        return GatherNext.call(
            shards=[p.to_canonical(p.sharded.to_local()) for p in params], kept=kept,
            sinks=[params[i].grad_sink for i in sink_params], sink_params=sink_params,
            full_shapes=self.full_shapes, local_rows=self.local_rows, group_name=group.group_name,
            world_size=group.specs[0].world_size, module_key=module_key,
            reduce_group_name=group.reduce_group_name, param_dtype=first.param_dtype,
            reduce_dtype=first.reduce_dtype, sync=sync, reduce_by_all_to_all=group.reduce_by_all_to_all,
            divide_factor=group.specs[0].divide_factor, replicate_group_name=group.replicate_group_name,
            replicas=group.specs[0].replicas, live=self.live_flag)

    @property
    def live(self) -> bool:
        return bool(self.live_flag)

    def stand_in(self) -> "CompiledEntry":
        """A module like this one for this module's graph to hand a gather to
        when no module follows: the same structure, communicating nothing.
        See [Note: A stand-in for the last block's next] in core/gated.py."""
        group = self.group
        sync = group.reduce_grads
        key = (sync, tuple(id(p.sharded) for p in group.fsdp_params),
               tuple(p.grad_sink is None for p in group.fsdp_params))
        if self._stand_in is None or self._stand_in[0] != key:
            copied = copy.copy(group)
            copied.fsdp_params = [_stand_in_param(p, sync) for p in group.fsdp_params]
            entry = CompiledEntry(copied)
            entry.live_flag = torch.zeros((), dtype=torch.bool)
            self._stand_in = (key, entry)
        return self._stand_in[1]

    def issue_backward_gather(self, kept: bool = False) -> bool:
        """This module's gather for its backward graph's ``regather``, issued
        now, not waited, if that op gathers this bucket and none is pending,
        or of each part such ops gather (see [Note: Backward re-gathers
        prefetched across graphs] and [Note: A bucket issued in the parts its
        graph takes] in core/registry.py). Returns whether any was issued."""
        group = self.group
        return ops.issue_if_wanted([p.canonical_shard() for p in group.fsdp_params], list(group.specs),
                                   group.fsdp_params[0].param_dtype, group.group_name, group.key,
                                   backward=True, kept=kept, device=group.fsdp_params[0].gather_device)

    def bucket_key(self) -> registry.BucketKey:
        """The registry's key of this module's whole bucket (``ops.shards_key``)."""
        return ops.shards_key([p.canonical_shard() for p in self.group.fsdp_params])

    def reset(self) -> None:
        """At an iteration's start: not compiled yet, nothing handed over."""
        self.active = False  # (left set by a forward that raised)
        self.handoff_in = self.handoff_next = self._handed_eagerly = None

    def hand_over_eagerly(self) -> None:
        """Issue this module's handoff now, outside any graph (by the root, or
        for a module whose predecessor's frame ran untraced)."""
        self.handoff_in = self._handed_eagerly = self.gather_next_op(self.group.key)

    def begin(self, handoff_next: Optional["CompiledEntry"]) -> None:
        """Before a forward compiled for this module alone: what its graph
        reads (``handoff_in``) and hands over (``handoff_next``'s gather)."""
        self.active = True
        self.handoff_next = handoff_next
        self.handoff_traced = False
        self._handoff_read = self.handoff_in

    def end(self) -> Optional["CompiledEntry"]:
        """After that forward: forget the handoff it read (the graph holds what
        its backward needs); returns the module it handed a gather to."""
        self.active = False
        if self.handoff_in is self._handoff_read:  # (not one handed over since, to a second call)
            self.handoff_in = self._handed_eagerly = None
        self._handoff_read = None
        handed, self.handoff_next = self.handoff_next, None
        if handed is not None and not handed.live:
            handed.handoff_in = None  # (nothing in flight: see gated.py)
            for p in handed.group.fsdp_params:  # (its gradient from the last backward)
                p.sharded.grad = None
            return None
        return handed

    def params_left_unread(self) -> list[FSDPParam]:
        """Called in the post-forward of a forward compiled for this module
        alone: the parameters its graph did not read although it read a
        handed-in gather, whose backward reduces a zero gradient for them
        (none in one graph or the eager runtime). From what the markers
        recorded at trace time for this structure."""
        if self._handoff_read is None:
            return []
        read = frames.traced_reads(self.split_key)
        return [p for p in self.group.fsdp_params if p.index not in read]

    def drop_handoff(self) -> bool:
        """A gather handed to this module that its forward does not read (it
        runs eagerly, or did not run): wait for it and let it go. Issued by a
        graph, that graph's backward still runs and adds the kept gradients the
        gather carried, so they are no longer this module's to reduce; issued
        eagerly, its backward never runs and they stay. Returns whether there
        was one."""
        if self.handoff_in is None:
            return False
        torch.ops._c10d_functional.wait_tensor(self.handoff_in)
        by_graph = self.handoff_in is not self._handed_eagerly
        self.handoff_in = self._handed_eagerly = None
        if by_graph and self.group.reduce_grads:
            for p in self.group.fsdp_params:
                p.drop_kept_grad()
        return True


def _stand_in_param(p: FSDPParam, sync: bool) -> FSDPParam:
    """``p`` for a stand-in: its shard a new leaf aliasing ``p``'s (what the
    stand-in's backward gives it is dropped); with sync, ``p``'s kept gradient
    (passed to a reduce that does not run); without, a sink of its own."""
    c = copy.copy(p)
    c.sharded = nn.Parameter(p.sharded.detach(), requires_grad=p.sharded.requires_grad)
    if not sync and p.grad_sink is not None:
        c.grad_sink = None
        c.ensure_grad_sink()
    return c


def entry_of(group: FSDPParamGroup) -> CompiledEntry:
    """``group``'s compile state, made on first use."""
    entry = group.compiled
    if entry is None:
        entry = group.compiled = CompiledEntry(group)
    return entry
