"""The parameter group: all managed parameters of one fully sharded module, the
unit of communication (one all-gather, one reduce-scatter).

[Note: Eager autograd through UnshardFn]
In eager mode a group's unsharded parameters are the outputs of one autograd
function, ``_UnshardFn``, whose inputs are the shards. Autograd runs its backward
exactly once per backward pass, after every use of every parameter of the group
has produced its gradient (a module called twice included: autograd sums the
uses). That moment is the group's post-backward: it issues one bucketed
reduce-scatter and returns no gradient to the shards; the reduced gradients are
written to ``shard.grad`` when the reduce-scatter is awaited (in the root's
end-of-backward callback, so every reduce-scatter has finished when
``backward()`` returns). The outputs are views of the unsharded buffers, so
freeing a buffer's storage after forward (reshard) and refilling it before
backward is seen by autograd's saved tensors; the refill preserves the version
counter, as FSDP2 does.

[Note: Blocks compiled on their own]
torchtitan compiles each block, not the model: ``block.compile()`` (or
``torch.compile(block)`` in the parent's place) after ``fully_shard``, the root
running eagerly. Dynamo then runs the block's hooks as Python and compiles its
``forward`` as a frame of its own, and every identical block reuses that frame's
graph: Dynamo's cache is keyed on the code object and passes the guards of
another block of the same structure. So compile time does not grow with depth,
provided nothing in the traced graph names the block.

The pre-forward hook recognises the pattern (the module's own call is compiled
while the root runs eagerly; ``_state.py``) and leaves the group to the graph,
as the root does under ``torch.compile(model)``: ``compiled_entry`` is set for
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
root does ([Note: Fallback decision rule] in _fallback.py). Tested by
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
- The backward re-gather of a block that reshards after forward stays in its
  own backward graph, from its saved shards: there is no channel that hands a
  tensor from one backward graph to the next.
- Which block is next: the previous iteration's forward order, the one the
  eager runtime prefetches by; in the first step the modules' order in the
  model. Only a module predicted to compile its own frame gets a handoff
  (``FSDPState.predicts_own_frame``). The last block issues nothing, so its
  graph is a second variant (Dynamo guards ``handoff_next``), compiled once.
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

import contextlib
import enum
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from compiled_fsdp.runtime.collectives import (
    PendingCollective,
    all_gather_bucket,
    copy_out_all_gather,
    reduce_scatter_bucket,
)
from compiled_fsdp.runtime.divergence import COLLECTIVE, Checker, Checkpoint, PendingCheck, stable_code
from compiled_fsdp.core.layout import EAGER, bucket_offsets, split_reduced
from compiled_fsdp.compile.frames import record_handoff_trace, record_marker_trace, traced_reads
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp._testing import skips_grad_reduction

if TYPE_CHECKING:
    from compiled_fsdp.runtime.state import _RootContext


# Group key -> group (naming the modules of a compiled graph's markers).
_GROUPS: "weakref.WeakValueDictionary[int, FSDPParamGroup]" = weakref.WeakValueDictionary()


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather issued, not awaited (a prefetch)
    UNSHARDED = "unsharded"


class _UnshardFn(torch.autograd.Function):
    """See [Note: Eager autograd through UnshardFn]."""

    @staticmethod
    def forward(ctx: Any, group: "FSDPParamGroup", *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)
        outs = tuple(p.unsharded.view_as(p.unsharded) for p in group.fsdp_params)
        ctx.mark_non_differentiable(
            *(o for o, p in zip(outs, group.fsdp_params) if not p.sharded.requires_grad)
        )
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[None, ...]:
        ctx.group.post_backward(grads)
        return (None,) * (1 + len(grads))


class FSDPParamGroup:
    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        process_group: dist.ProcessGroup,
        reduce_group: dist.ProcessGroup,
        key: int,
        reshard_after_forward: bool,
        name: str,
        checker: Optional[Checker] = None,
        *,
        hand_over_gathers: bool,
    ) -> None:
        self.fsdp_params = fsdp_params
        self.process_group = process_group
        self.group_name = process_group.group_name
        # See [Note: A second group for reduce-scatters] in _api.py.
        self.reduce_group = reduce_group
        self.reduce_group_name = reduce_group.group_name
        self.key = key
        self.name = name
        self.fqn = name  # the module's name under its root, set at the root's lazy init
        self.reshard_after_forward = reshard_after_forward
        # See [Note: Gradient accumulation without sync] in _module.py.
        self.reduce_grads = True
        self.reshard_after_backward = True
        # No fully sharded module contains this one (yet): see ``reshards_after_forward``.
        self.outermost = True
        self.specs = [p.spec for p in fsdp_params]
        # This forward's graph is compiled for this module alone, and identical
        # blocks share it: see [Note: Blocks compiled on their own].
        self.compiled_entry = False
        self.entry_split_key = ("entry", name, tuple(s.full_shape for s in self.specs))
        # See [Note: Gathers handed to the next block's graph]: this module's
        # gathered bucket, issued (not waited) by whoever ran before it; the
        # module whose gather this module's graph issues, while it runs.
        self.hand_over_gathers = hand_over_gathers  # may be handed its gather (agreed at fully_shard)
        self.handoff_in: Optional[torch.Tensor] = None
        self.handoff_next: Optional[FSDPParamGroup] = None
        self.handoff_traced = False  # this forward's trace issued handoff_next's gather
        self._handed_eagerly: Optional[torch.Tensor] = None  # the handoff_in issued outside a graph
        self._handoff_read: Optional[torch.Tensor] = None  # the handoff_in this forward reads
        # (per parameter: where it lies in the gathered bucket of [Note: Bucket layout])
        self.bucket_numel = sum(s.shard_numel for s in self.specs)
        self._full_shapes = tuple(d for s in self.specs for d in s.full_shape)
        self._local_rows = tuple(p.local_rows for p in fsdp_params)
        self.record_handoff_trace = lambda ctx: record_handoff_trace(self)
        for i, (p, offset) in enumerate(zip(fsdp_params, bucket_offsets(self.specs))):
            p.group, p.index, p.bucket_offset = self, i, offset
            # Run by comptime when Dynamo traces this parameter's marker (a function
            # object that exists before tracing, as comptime requires).
            p.record_trace = lambda ctx, i=i: record_marker_trace(key, i)
            p.record_entry_trace = lambda ctx, i=i: record_marker_trace(key, i, self.entry_split_key)
        self.state = ShardedState.SHARDED
        # See [Note: Agreeing on collectives] in _divergence.py.
        self.checker = checker
        self.check_number = checker.register() if checker is not None else -1
        _GROUPS[key] = self
        self._pending_gather: Optional[PendingCollective] = None
        self._gather_check: Optional[PendingCheck] = None
        self._pending_reduce: Optional[tuple[PendingCollective, list[FSDPParam]]] = None
        self._reduce_check: Optional[PendingCheck] = None
        # Views handed to the module's code while it runs eagerly; see [Note: Parameter property].
        self.exposed_views: Optional[tuple[torch.Tensor, ...]] = None
        # Autograd outputs of this iteration's _UnshardFn, reused by later calls.
        self._iter_views: Optional[tuple[torch.Tensor, ...]] = None
        self.needs_grad_sync = False  # a backward was registered for this iteration
        # The root's _RootContext (see [Note: Roots and iterations]), set at lazy init.
        self.ctx: Optional["_RootContext"] = None

    @property
    def reshards_after_forward(self) -> bool:
        """The policy in effect: an outermost module (the root) never reshards after
        forward, since its backward starts right after (FSDP2 does the same). Decided
        from structure, so the eager runtime and the markers agree even when the
        root's hooks never run as Python."""
        return self.reshard_after_forward and not self.outermost

    @property
    def label(self) -> str:
        """The module's name under its root, for messages ("<root>" for the root)."""
        return self.fqn or "<root>"

    @property
    def identity(self) -> tuple:
        """What names this group the same on every rank, for the checks of
        [Note: Agreeing on collectives]: its number among the groups of its
        checker (``fully_shard`` order on the checker's ranks; not the key,
        which counts every ``fully_shard`` call in the process and so differs
        between ranks that also shard models on subgroups of their own) and
        its parameters' full shapes."""
        return (self.check_number, tuple(s.full_shape for s in self.specs))

    def forward_active(self) -> bool:
        """Whether the eager runtime is inside a forward of this group's root."""
        return self.ctx is not None and self.ctx.in_forward

    # -- handoff: see [Note: Gathers handed to the next block's graph] --------
    def gather_next_op(self, module_key: int) -> torch.Tensor:
        """This module's bucketed all-gather, not waited, with what its
        backward needs (kept gradients or sinks, the sync flag): traced into
        the graph of the module before it (``module_key=NEXT_KEY``), or run
        eagerly by it (the group's own key)."""
        sync = self.reduce_grads
        params = self.fsdp_params
        # (the sinks of [Note: Accumulation without sync in graphs] in _ops.py)
        kept = [p.kept_grad() for p in params] if sync else [None] * len(params)
        sink_params = [] if sync else [i for i, p in enumerate(params) if p.sharded.requires_grad]
        first = params[0]
        return torch.ops.compiled_fsdp.gather_next(
            [p.sharded.to_local() for p in params], kept, [params[i].grad_sink for i in sink_params],
            sink_params, self._full_shapes,
            self._local_rows, self.group_name, self.specs[0].world_size,
            module_key, self.reduce_group_name, first.param_dtype, first.reduce_dtype, sync)

    def reset_handoff(self) -> None:
        """At an iteration's start: nothing handed over yet."""
        self.handoff_in = self.handoff_next = self._handed_eagerly = None

    def hand_over_eagerly(self) -> None:
        """Issue this module's handoff now, outside any graph (by the root, or
        for a module whose predecessor's frame ran untraced)."""
        self.handoff_in = self._handed_eagerly = self.gather_next_op(self.key)

    def begin_compiled_entry(self, handoff_next: Optional["FSDPParamGroup"]) -> None:
        """Before a forward compiled for this module alone: what its graph
        reads (``handoff_in``) and hands over (``handoff_next``'s gather)."""
        self.compiled_entry = True
        self.handoff_next = handoff_next
        self.handoff_traced = False
        self._handoff_read = self.handoff_in

    def end_compiled_entry(self) -> Optional["FSDPParamGroup"]:
        """After that forward: forget the handoff it read (the graph holds what
        its backward needs); returns the module it handed a gather to."""
        self.compiled_entry = False
        if self.handoff_in is self._handoff_read:  # (not one handed over since, to a second call)
            self.handoff_in = self._handed_eagerly = None
        self._handoff_read = None
        handed, self.handoff_next = self.handoff_next, None
        return handed

    def params_left_unread(self) -> list[FSDPParam]:
        """Called in the post-forward of a forward compiled for this module
        alone: the parameters its graph did not read although it read a
        handed-in gather, whose backward reduces a zero gradient for them
        (none in one graph or the eager runtime). From what the markers
        recorded at trace time for this structure."""
        if self._handoff_read is None:
            return []
        read = traced_reads(self.entry_split_key)
        return [p for p in self.fsdp_params if p.index not in read]

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
        if by_graph and self.reduce_grads:
            for p in self.fsdp_params:
                p.drop_kept_grad()
        return True

    # -- all-gather ----------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Issue the group's all-gather (if sharded); with ``async_op=False`` also wait."""
        if self.state is ShardedState.SHARDED:
            self._gather_check = self._issue_check("all-gather")
            self._pending_gather = all_gather_bucket(
                [p.local_shard() for p in self.fsdp_params], self.specs, self.process_group,
                [p.param_dtype for p in self.fsdp_params],
            )
            self.state = ShardedState.GATHERING
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.state is not ShardedState.GATHERING:
            return
        if self._gather_check is not None:
            check, self._gather_check = self._gather_check, None
            check.wait()
        flat = self._pending_gather.wait()
        self._pending_gather = None
        dests = [p.alloc_unsharded() for p in self.fsdp_params]
        with contextlib.ExitStack() as stack:
            for d in dests:  # autograd's saved views must not see a version bump
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(d))
            copy_out_all_gather(flat, self.specs, dests)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        if self.state is ShardedState.GATHERING:
            self.wait_for_unshard()  # the collective was issued on every rank: finish it
        for p in self.fsdp_params:
            p.free_unsharded()
        self.state = ShardedState.SHARDED

    # -- forward -------------------------------------------------------------
    def pre_forward(self) -> None:
        self.unshard()
        if self._iter_views is None:
            shards = [p.sharded for p in self.fsdp_params]
            if torch.is_grad_enabled() and any(s.requires_grad for s in shards):
                self._iter_views = _UnshardFn.apply(self, *shards)
                self.needs_grad_sync = True
            else:
                self._iter_views = tuple(p.unsharded.view_as(p.unsharded) for p in self.fsdp_params)
        self.exposed_views = self._iter_views

    def post_forward(self, reshard: bool) -> None:
        self.exposed_views = None
        if reshard:
            self.reshard()

    # -- backward ------------------------------------------------------------
    def pre_backward(self) -> None:
        self.unshard()

    def post_backward(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        """Reshard and issue the group's reduce-scatter (not awaited here)."""
        if self.reshard_after_backward:
            self.reshard()
        if not self.reduce_grads:  # see [Note: Gradient accumulation without sync]
            for p, g in zip(self.fsdp_params, grads):
                p.accumulate_unsharded_grad(g)
            return
        owned = [(p, p.take_unsharded_grad(g)) for p, g in zip(self.fsdp_params, grads)]
        owned = [(p, g) for p, g in owned if g is not None]
        if not owned or skips_grad_reduction(self.fqn):
            return
        params = [p for p, _ in owned]
        self._reduce_check = self._issue_check("reduce-scatter")
        # take_unsharded_grad cast them to the reduce dtype: see [Note: Mixed precision].
        pending = reduce_scatter_bucket([g for _, g in owned], [p.spec for p in params], self.reduce_group)
        self._pending_reduce = (pending, params)
        if self.ctx is not None:
            self.ctx.on_reduce_issued(self)

    def finish_grad_sync(self) -> None:
        """Await the reduce-scatter and accumulate the averaged shards into ``.grad``."""
        if self._reduce_check is not None:
            check, self._reduce_check = self._reduce_check, None
            check.wait()
        if self._pending_reduce is not None:
            pending, params = self._pending_reduce
            self._pending_reduce = None
            grads = split_reduced(
                EAGER, pending.wait(), [p.spec for p in params], [p.local_rows for p in params],
                [p.orig_dtype for p in params],
            )
            for p, g in zip(params, grads):
                p.add_grad(g)

    def _issue_check(self, op: str) -> Optional[PendingCheck]:
        """Announce this group's next eager collective; see [Note: Agreeing on collectives]."""
        if self.checker is None:
            return None
        what = f"the eager {op} of {self.label} ({len(self.fsdp_params)} parameters)"
        return self.checker.issue(Checkpoint(COLLECTIVE, self.checker.step, stable_code(op, self.identity), what))

    def end_iteration(self) -> None:
        """Reset per-iteration state: finish communication, free unsharded memory."""
        self.finish_grad_sync()
        if self.reshard_after_backward or not self.needs_grad_sync:
            self.reshard()
        self.exposed_views = None
        self._iter_views = None
        self.needs_grad_sync = False
