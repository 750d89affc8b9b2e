"""A root's context, shared by the fully sharded modules under it: the
iteration, the orders the modules ran in, and the prefetches made from them.

[Note: Roots and iterations]
The first fully sharded module whose forward runs without an owner becomes a
root: it owns a ``RootContext`` shared by every fully sharded module in its
subtree. An iteration starts at the root's pre-forward and ends in a callback
queued on autograd's engine at the first pre-backward (or post-backward), which
runs when ``backward()`` is about to return: it awaits every reduce-scatter,
writes the gradients, and reshards whatever is still unsharded. A forward without
backward (no grad, or an output that does not require grad) ends the iteration
at the root's post-forward. A second root forward before the backward joins the
iteration the first began ([Note: Forwards before one backward]). The outermost module (the root) does not reshard after
forward (see ``FSDPParamGroup.reshards_after_forward``).

[Note: Several backwards of one forward]
torchtitan's chunked loss runs the model's forward up to the final norm, then
for each chunk of the sequence calls the head on its own (outside the root's
forward) and runs that chunk's backward, then one backward through the body
(pytorch's FSDP2 runs it; a call of a list group's module outside the root's
forward begins a group forward of that module alone: see [Note: A list of
modules as one group]). Each backward's callback ends the iteration as above,
so the body's backward comes after an ``end_iteration``. What that backward
still needs stays to the next root forward (``RootContext.begin_iteration``):
the groups' autograd views (activation checkpointing recomputes through them)
and which buckets applied them, the flag that a backward follows (backward
prefetch asks it), and the post-forward order (the prefetch order). The
forward order of an iteration whose root did not run (a module alone after
the end) does not replace the last root forward's. With
``set_manual_backward_finalization(True)`` no backward ends the iteration;
``finalize_backward()`` does. Tested by tests/test_chunked_loss.py.

[Note: Prefetch order]
Forward prefetch follows the previous iteration's pre-forward order; backward
prefetch follows this iteration's post-forward order reversed (the root finishes
its forward last, so its backward starts first), as FSDP2 does; a module
compiled as its own frame counts in both, and its backward prefetch is its
graph's re-gather issued ahead (``CompiledPath.prefetch_backward``): without
it, the eager ``[norm, output]`` of torchtitan's pattern prefetched the
embedding at the backward's start and block 7's re-gather queued behind its
reduce-scatter (RESULTS, 2026-11-29). Unlike FSDP2, the gathers of the first
two modules the backward needs are issued when the root's forward ends
(``prefetch_backward_start``), not when the backward reaches them: the link
is idle while the loss computes (87 ms of a 1.22 s step in torchtitan's
pattern at 8 ranks), and the backward is bound by the link. Their memory is
held through the loss, where FSDP2 holds it from the backward's start: the
step's peak, in the loss, is two gathered buckets higher (on the CPU
benchmark 5.4-6.75 MiB of 106-246, for 1.4% of the step in torchtitan's
pattern: RESULTS, fifty-ninth session). A user who sets
``set_modules_to_backward_prefetch`` replaces it with their own order. They are
kept past the end of a backward that did not reach them (a chunked loss's
backward through the head alone ends the iteration: [Note: Several
backwards of one forward]), and dropped when the next step begins. The
modules after them are prefetched one ahead, as before. Both orders are
recorded from what ran, which is the same on every rank for the same program, so
every rank issues the same prefetch all-gathers in the same order. A prefetch
that turns out unused is still awaited (never dropped mid-flight) and freed at
the end of the iteration.
"""
from __future__ import annotations

import enum
from typing import Any, Optional, Protocol

import torch
import torch.nn as nn

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.divergence import Checker
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.param_group import FSDPParamGroup, Phase, ShardedState
from compiled_fsdp.runtime.streams import CommStreams

__all__ = ["ModuleState", "Path", "RootContext"]


class Path(enum.Enum):
    """How a fully sharded module's last forward ran (``compiled_fsdp.explain``)."""

    COMPILED = "compiled"  # inside a compiled graph (the root's, or inlined into one)
    OWN_FRAME = "compiled as its own frame"  # see [Note: Blocks compiled on their own]
    FALLBACK = "fallback"  # its hooks ran as Python under compile: a graph break inside it
    UNTRACED = "untraced"  # its compiled frame ran untraced: see [Note: Untraced root frames]
    EAGER = "eager"

    @property
    def compiled(self) -> bool:
        return self in (Path.COMPILED, Path.OWN_FRAME)


class ModuleState(Protocol):
    """What the context reads of a fully sharded module's state (``FSDPState``)."""

    modules: tuple[nn.Module, ...]
    module: nn.Module
    param_group: Optional[FSDPParamGroup]
    path: Optional[Path]
    backward_prefetch: Optional[list[Any]]
    manual_finalization: bool
    _to_run: list[nn.Module]


class RootContext:
    def __init__(self, root: ModuleState) -> None:
        self.root = root
        self.states: list[ModuleState] = []
        self.forward_order: list[ModuleState] = []
        self.prev_forward_order: list[ModuleState] = []
        self.post_forward_order: list[ModuleState] = []
        self.callback_queued = False
        # A root forward began this iteration (not only modules run on their
        # own after its end: [Note: Several backwards of one forward]).
        self.root_ran = False
        # FSDPModule.set_manual_backward_finalization: the backward callback
        # does not end the iteration; ``finalize`` does.
        self.manual_finalization = root.manual_finalization
        self.manual_backward_started = False  # a backward ran since the last finalization
        self.pending_reduces: list[FSDPParamGroup] = []
        self.phase = Phase.IDLE
        self.step = 0  # root forwards so far
        # (phase, module fqn) of each prefetch this iteration, and the last step's.
        self.prefetched: list[tuple[str, str]] = []
        self.last_prefetched: list[tuple[str, str]] = []
        # Checks the ranks' collectives (None: off); set at lazy init.
        self.checker: Optional[Checker] = None
        # The compile layer's state for this root (see [Note: The compiled path]).
        self.compiled: Any = None
        # The eager runtime's side streams (see [Note: Streams and events]); set at lazy init.
        self.streams: Optional[CommStreams] = None

    def groups(self) -> list[FSDPParamGroup]:
        return [s.param_group for s in self.states if s.param_group is not None]

    def backward_pending(self) -> bool:
        """Whether this iteration's eager forwards left a backward to run (some
        group applied its autograd function to parameters that need gradients)."""
        return any(g.needs_grad_sync for g in self.groups())

    def begin_iteration(self) -> None:
        """[Note: Forwards before one backward]
        A root forward after another with no backward in between ends the
        earlier iteration only when nothing of it awaits a backward. While
        autograd may still run the earlier forward's graph, the forwards share
        one iteration, as FSDP2's do (DPO's two forwards, a partial forward
        run twice): ending it and beginning anew resharded every group and
        dropped its autograd views, so a group that stays unsharded to the end
        of the iteration (one that does not reshard after forward, a list group
        whose forward was partial) freed storage the earlier graph's saved
        tensors still read, and the backward read freed memory (a SIGSEGV on
        the CPU in PyTorch's test_double_partial_forward_then_backward).
        Sharing the iteration, the later forward reuses the group's autograd
        views, whose one backward runs after every read of both graphs
        (tests/test_eager_parity.py::test_two_forwards_then_one_backward)."""
        joining = self.root_ran and bool(self.forward_order) and self.backward_pending()
        if self.forward_order and not joining:  # (the last forward ran no backward)
            self.end_iteration()
        for g in self.groups():
            if joining:
                g.drop_kept()
            else:
                g.begin_iteration()
        self.root_ran = True
        self.forward_order, self.post_forward_order = [], []
        self.step += 1
        for g in self.groups():  # see [Note: Gradient accumulation without sync] in module.py
            if not g.reduce_grads:
                for p in g.fsdp_params:
                    if p.sharded.requires_grad:
                        p.ensure_grad_sink()
        compiled_path().on_step(self)  # before any tracing (after the sinks: a region's key says which exist)

    def end_iteration(self) -> None:
        """See [Note: Roots and iterations] and [Note: Several backwards of one forward]."""
        with compat.no_spmd_typecheck():
            self._end_iteration()

    def _end_iteration(self) -> None:
        for g in self.pending_reduces:
            g.finish_grad_sync()
        self.pending_reduces = []
        for g in self.groups():  # (before the compiled path reads a gradient: [Note: Offloaded gradients
            g.reduces.land()  # land at the end of backward] in reduces.py)
        compiled_path().end_iteration(self)
        for g in self.groups():
            g.end_iteration()
        if self.root_ran:  # (a module run on its own after the iteration's end leaves the order alone)
            self.prev_forward_order = self.forward_order
            self.last_prefetched, self.prefetched = self.prefetched, []
        else:  # (a later backward of the same forward: the same step's prefetches)
            self.last_prefetched, self.prefetched = self.last_prefetched + self.prefetched, []
        self.root_ran = False
        self.forward_order = []
        self.callback_queued = False
        self.manual_backward_started = False
        if self.streams is not None:
            self.streams.post_optim_event = None

    def reset_iteration(self) -> None:
        """``FSDPModule.reset_iter_state``: after an exception aborted a forward
        or backward, the next forward starts as the first of an iteration
        (tests/test_reset_iter_state.py::test_reset_iter_state_after_exception)."""
        for g in self.groups():
            g.abandon_iteration()
        compiled_path().end_iteration(self)
        self.pending_reduces = []
        self.forward_order, self.post_forward_order = [], []
        self.callback_queued = False
        self.root_ran = False
        self.phase = Phase.IDLE
        self.prefetched = []
        for st in self.states:
            st._to_run = []

    def ensure_callback_queued(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            if self.manual_finalization:
                self.manual_backward_started = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_pass)
            else:
                torch.autograd.Variable._execution_engine.queue_callback(self.end_iteration)
            compiled_path().on_backward(self)

    def _end_backward_pass(self) -> None:
        """With manual finalization, a backward's end: the next backward counts
        its buckets afresh; the iteration goes on to ``finalize``."""
        for g in self.groups():
            g.end_backward_pass()
        self.callback_queued = False

    def finalize(self) -> None:
        """``FSDPModule.finalize_backward``: end the iteration's backward now.
        Gradients kept without sync by the backwards before are reduced first
        when sync is on again (FSDP2's recipe for several backwards, one
        finalization); tests/test_fsdp2_215.py::test_manual_backward_finalization."""
        queued, self.callback_queued = self.callback_queued, True  # (outside backward: queue nothing)
        with compat.no_spmd_typecheck():
            for g in self.groups():
                if g.reduce_grads:
                    g.reduce_kept_grads()
        self.callback_queued = queued
        if self.callback_queued or self.pending_reduces or self.manual_backward_started:
            self.end_iteration()

    def on_reduce_issued(self, group: FSDPParamGroup) -> None:
        self.ensure_callback_queued()
        # Await the other groups' reductions: at most two groups' in flight
        # (a group's own buckets, ``replicate``'s, stay in flight together
        # until the next group reduces or backward ends, as DDP's).
        for g in self.pending_reduces:
            if g is not group:
                g.finish_grad_sync()
        self.pending_reduces = [group]

    def prefetch(self, target: Optional[ModuleState], phase: str, kept: bool = False) -> None:
        """Issue ``target``'s all-gather now, not awaited (``kept``: for its
        backward, past the end of a backward that does not reach it). See
        [Note: Prefetch order]."""
        if target is None or target.param_group is None:
            return
        group = target.param_group
        if target.path is Path.OWN_FRAME and phase == "backward":
            if compiled_path().prefetch_backward(group, kept):
                self.prefetched.append((phase, group.fqn))
        elif group.state in (ShardedState.SHARDED, ShardedState.SHARDED_POST_FORWARD) and (
                phase == "forward" or group.unshard_in_backward):
            group.unshard(async_op=True)
            group.kept_for_backward = kept
            self.prefetched.append((phase, group.fqn))

    def prefetch_next(self, state: ModuleState, in_graph: bool) -> Optional[FSDPParamGroup]:
        """Prefetch for the module expected to run after ``state`` ([Note:
        Prefetch order]). A module predicted to compile its own frame is handed
        its gather instead (``CompiledPath.hand_over``): returned, for
        ``state``'s graph to issue (``in_graph``), or issued now. The first
        iteration has no recorded order: a handoff then goes to the next
        module in the model's order, an eager prefetch to none."""
        path = compiled_path()
        target = self.forward_prefetch_target(state)
        if target is None and not self.prev_forward_order:
            first_guess = self._next_in_model_order(state, outside=in_graph)
            if first_guess is not None and path.predicts_own_frame(first_guess):
                target = first_guess
        if target is None:
            return None
        if not path.predicts_own_frame(target):
            self.prefetch(target, "forward")
            return None
        return path.hand_over(target, in_graph)

    def _next_in_model_order(self, state: ModuleState, outside: bool) -> Optional[ModuleState]:
        """The state after ``state`` in the model's order; with ``outside``, the
        first one outside ``state``'s subtree: a module compiling its own frame
        traces its nested sharded modules inline, so none of them runs next
        (handing one a gather left its gradients None:
        tests/test_fsdp2_api.py::test_nested_modules_compiled_in_place)."""
        at = next(i for i, s in enumerate(self.states) if s is state)
        inside = {id(m) for root in state.modules for m in root.modules()} if outside else set()
        return next((s for s in self.states[at + 1:] if id(s.module) not in inside), None)

    def forward_prefetch_target(self, state: ModuleState) -> Optional[ModuleState]:
        """See [Note: Prefetch order]."""
        i = len(self.forward_order) - 1
        prev = self.prev_forward_order
        if i + 1 < len(prev) and prev[i] is state:
            return prev[i + 1]
        return None

    def prefetch_backward_start(self) -> None:
        """The root's forward ended and a backward follows: issue the gathers of
        the first two modules in backward order that need one (among the first
        three with parameters: none further back), so that they use the link
        while the loss computes ([Note: Prefetch order]). Not where
        the user set ``set_modules_to_backward_prefetch``: that order is theirs."""
        if any(s.backward_prefetch is not None for s in self.states):
            return
        seen: list[ModuleState] = []  # (the first three modules with parameters, at most two gathered)
        issued = 0
        for s in reversed(self.post_forward_order):
            group = s.param_group
            if issued == 2 or len(seen) == 3:
                return
            if group is None or any(s is o for o in seen) or not (
                    group.needs_grad_sync or s.path is Path.OWN_FRAME):
                continue
            if all(p.reads_shard for p in group.fsdp_params):  # (a group of one, replicate's: nothing to gather)
                continue
            seen.append(s)
            before = len(self.prefetched)
            self.prefetch(s, "backward", kept=True)
            issued += len(self.prefetched) > before

    def backward_prefetch_target(self, state: ModuleState) -> Optional[ModuleState]:
        order: list[ModuleState] = []
        for s in reversed(self.post_forward_order):  # last finished first, each state once
            if not any(s is o for o in order):
                order.append(s)
        for i, s in enumerate(order[:-1]):
            if s is state:
                return order[i + 1]
        return None
