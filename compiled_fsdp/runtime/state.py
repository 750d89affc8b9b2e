"""Per-module state, the registry that maps modules to it, and the eager hooks.

[Note: Roots and iterations]
The first fully sharded module whose forward runs without an owner becomes a
root: it owns a ``_RootContext`` shared by every fully sharded module in its
subtree. An iteration starts at the root's pre-forward and ends in a callback
queued on autograd's engine at the first pre-backward (or post-backward), which
runs when ``backward()`` is about to return: it awaits every reduce-scatter,
writes the gradients, and reshards whatever is still unsharded. A forward without
backward (no grad, or an output that does not require grad) ends the iteration
at the root's post-forward. The outermost module (the root) does not reshard after
forward (see ``FSDPParamGroup.reshards_after_forward``).

[Note: Prefetch order]
Forward prefetch follows the previous iteration's pre-forward order; backward
prefetch follows this iteration's post-forward order reversed (the root finishes
its forward last, so its backward starts first), as FSDP2 does. Both orders are
recorded from what ran, which is the same on every rank for the same program, so
every rank issues the same prefetch all-gathers in the same order. A prefetch
that turns out unused is still awaited (never dropped mid-flight) and freed at
the end of the iteration.

[Note: Hooks under Dynamo]
A hook either is inlined into a graph Dynamo traces, or runs as Python:

1. Inlined (a module called from traced code, including the compiled root's
   own ``__call__`` when nothing breaks): ``torch.compiler.is_compiling()`` is
   True and the hook returns at once, tracing to nothing. Parameter reads emit
   markers; the passes own the module's communication.
2. Python, inside a ``torch.compile``d call (``_is_in_optimized_module()``):
   for the root, the compiled forward follows and owns the communication, so
   the root does nothing. Any other module's hook runs as Python only because
   Dynamo broke the graph around its call: the eager runtime serves that
   module, and the compiled fragments of its forward read the gathered
   parameters as plain inputs (no marker, so no second gather).
3. Python, plain eager: the hook runtime below.

Left alone, Dynamo compiles a hook that is called as Python as a frame of its
own; ``is_compiling()`` is True while it traces, so that compiled hook would do
nothing, silently (measured: the pre-hook of a graph-broken child never ran).
So the hook code objects, and every frame they call, are skipped by Dynamo's
frame evaluation (``set_code_exec_strategy``); inlining is unaffected.
Measured on torch 2.13: with the hooks skipped, ``torch.compile(model)`` runs
the root's hooks as Python and compiles ``forward`` as the frame; without
skipping, it traces ``_wrapped_call_impl`` with the hooks inlined.
"""
from __future__ import annotations

import sys
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule, _is_in_optimized_module, set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.divergence import Checker, annotate_error
from compiled_fsdp.compile.frames import arm_compile_callbacks, is_split
from compiled_fsdp.runtime.param_group import FSDPParamGroup, ShardedState
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy, cast_floating

if TYPE_CHECKING:
    from compiled_fsdp.runtime.param import FSDPParam

_MODULE_STATE: "weakref.WeakKeyDictionary[nn.Module, FSDPState]" = weakref.WeakKeyDictionary()


def module_fqns(root: nn.Module) -> dict[nn.Module, str]:
    """Each submodule's name under ``root``, without the ``_orig_mod`` of a
    ``torch.compile`` wrapper in its parent's place (as FSDP2's state dict)."""
    return {m: ".".join(p for p in name.split(".") if p != "_orig_mod") for name, m in root.named_modules()}


def get_fsdp_state(module: nn.Module) -> Optional["FSDPState"]:
    """The state of ``module`` if ``fully_shard`` was applied to it, else None."""
    return _MODULE_STATE.get(module)


def iter_fsdp_states(module: nn.Module) -> list["FSDPState"]:
    """States of ``module``'s subtree (itself included) in ``module.modules()`` order."""
    out = []
    for m in module.modules():
        st = _MODULE_STATE.get(m)
        if st is not None:
            out.append(st)
    return out


class _RootContext:
    def __init__(self, root: "FSDPState") -> None:
        self.root = root
        self.states: list[FSDPState] = []
        self.forward_order: list[FSDPState] = []
        self.prev_forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self.callback_queued = False
        self.pending_reduces: list[FSDPParamGroup] = []
        self.in_forward = False  # the root's forward runs eagerly, now
        self.compiled_forward = False  # the root's forward runs under Dynamo, now
        self.step = 0  # root forwards so far
        # (phase, module fqn) of each prefetch this iteration, and the last iteration's.
        self.prefetched: list[tuple[str, str]] = []
        self.last_prefetched: list[tuple[str, str]] = []
        # Checks the ranks' collectives (None: off); set at lazy init.
        self.checker: Optional[Checker] = None
        # Modules ``torch.compile``d in their parent's place (ids), set at lazy
        # init; and parameters whose gradient a dropped handoff made zero
        # although their module did not run (see ``drop_unread_handoffs``).
        self.wrapped: set[int] = set()
        self.regrad_none: list[FSDPParam] = []
        self.backward_checked = False  # this iteration's first compiled backward checked

    def groups(self) -> list[FSDPParamGroup]:
        return [s.param_group for s in self.states if s.param_group is not None]

    def begin_iteration(self) -> None:
        if self.forward_order:  # the last iteration ran no backward
            self.end_iteration()
        self.forward_order, self.post_forward_order = [], []
        self.step += 1
        self.backward_checked = False
        for g in self.groups():  # before any tracing: see [Note: Accumulation without sync in graphs]
            g.compiled_entry = False  # (left set by a forward that raised)
            g.reset_handoff()
            if not g.reduce_grads:
                for p in g.fsdp_params:
                    if p.sharded.requires_grad:
                        p.ensure_grad_sink()

    def fall_back_untraced(self, group: FSDPParamGroup) -> None:
        """[Note: Untraced root frames]
        Under ``torch.compile(model)`` the root's pre-forward runs as Python and
        leaves its parameters to the graph Dynamo is about to trace. Dynamo may
        instead run the frame eagerly: under an active dispatch mode
        (``FlopCounterMode``, ``CommDebugMode``), past the recompile limit, with
        ``TORCH_COMPILE_DISABLE=1``, or when a failing backend falls back under
        ``suppress_errors``. Nothing tells the hook beforehand, but the first read
        of a root parameter outside tracing does: it lands here and the root
        switches to the eager runtime for this forward (gather through
        ``_UnshardFn``, reduce in its post-backward), as the blocks already do
        (their hooks run as Python and fall back). So such a frame trains exactly
        like eager, with one reduction per gradient. The same holds for a block
        compiled on its own ([Note: Blocks compiled on their own] in
        _param_group.py): ``group`` is then that block's. Tested by
        tests/test_untraced_frames.py."""
        state = next(s for s in self.states if s.param_group is group)
        if group.compiled_entry:  # (in forward_order already)
            # See [Note: Gathers handed to the next block's graph] in _param_group.py:
            # the graph that would have read and handed over did not run.
            group.drop_handoff()
            nxt = group.end_compiled_entry()
            if nxt is not None and nxt.handoff_in is None:
                nxt.hand_over_eagerly()
        else:
            self.compiled_forward = False
            self.in_forward = True
            self.forward_order.insert(0, state)
        state._set_path("fallback")
        state.untraced = True
        group.pre_forward()

    def watch_compiled_backward(self, output: Any, groups: list[FSDPParamGroup]) -> None:
        """After a compiled forward of ``groups``: when its backward starts, check
        that the gradient-sync flags are still those the graph was traced with,
        and drop the kept gradients the graph took (its backward holds its own
        reference). A forward whose backward never runs keeps them. See [Note:
        Accumulation without sync in graphs] in _ops.py. The first compiled
        backward of the iteration (the compiled root's, or the last block's)
        also agrees with the other ranks that it starts."""
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not outs:
            return
        traced = [(g, g.reduce_grads) for g in groups]

        def pre_backward(grads: Any) -> None:
            if self.checker is not None and not self.backward_checked:
                # See [Note: Agreeing on collectives] in _divergence.py.
                self.backward_checked = True
                self.checker.check_backward()
            reduced = [g for g in self._graph_reduced_groups() if any(g is h for h in groups)]
            for g, flag in traced:
                if g.reduce_grads != flag:
                    raise RuntimeError(
                        f"compiled_fsdp: set_requires_gradient_sync({g.reduce_grads}) on {g.fqn or '<root>'} "
                        "was called between a compiled forward and its backward. Under torch.compile the "
                        "flag takes effect when the forward runs: set it before the forward."
                    )
                kept = any(p.kept_grad() is not None for p in g.fsdp_params)
                if flag and kept and (is_split(g.key) or is_split(g.entry_split_key)) and g in reduced:
                    raise RuntimeError(
                        f"compiled_fsdp: {g.fqn or '<root>'} has gradients kept without sync and its "
                        "parameters are read in more than one compiled frame (a graph break between "
                        "two of its uses), so each frame would add them. Remove the graph break, or "
                        "run the model without torch.compile while accumulating."
                    )
            for g in reduced:  # the graph holds them now
                for p in g.fsdp_params:
                    p.drop_kept_grad()
            if not compat.to_local_keeps_none_grads():  # torch 2.11: see core/compat.py
                unsynced = [p.sharded for g, flag in traced if not flag for p in g.fsdp_params
                            if p.sharded.requires_grad and p.sharded.grad is None]
                if unsynced:
                    torch.autograd.Variable._execution_engine.queue_callback(partial(_no_grads, unsynced))

        register_multi_grad_hook(outs, pre_backward, mode="any")

    def _graph_reduced_groups(self) -> list[FSDPParamGroup]:
        """Groups whose gradients this step's compiled graphs reduce: those with
        sync on that did not fall back to the eager runtime this step."""
        return [
            st.param_group for st in self.states
            if st.param_group is not None and st.param_group.reduce_grads
            and not (st.last_path == "fallback" and st.path_step == self.step)
        ]


    def end_iteration(self) -> None:
        """See [Note: Roots and iterations]."""
        for g in self.pending_reduces:
            g.finish_grad_sync()
        self.pending_reduces = []
        self.drop_unread_handoffs()
        for p in self.regrad_none:  # see drop_unread_handoffs
            p.sharded.grad = None
            p.drop_kept_grad()
        self.regrad_none = []
        for g in self.groups():
            g.end_iteration()
        self.prev_forward_order = self.forward_order
        self.forward_order, self.post_forward_order = [], []
        self.callback_queued = False
        self.last_prefetched, self.prefetched = self.prefetched, []

    def ensure_callback_queued(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_iteration)

    def on_reduce_issued(self, group: FSDPParamGroup) -> None:
        self.ensure_callback_queued()
        # Await earlier reduce-scatters so at most two buckets are in flight.
        for g in self.pending_reduces:
            g.finish_grad_sync()
        self.pending_reduces = [group]

    def prefetch(self, target: Optional["FSDPState"], phase: str) -> None:
        """Issue ``target``'s all-gather now, not awaited. See [Note: Prefetch order]."""
        if target is None or target.param_group is None:
            return
        group = target.param_group
        if group.state is ShardedState.SHARDED:
            group.unshard(async_op=True)
            self.prefetched.append((phase, group.fqn))

    def prefetch_next(self, state: "FSDPState", in_graph: bool) -> Optional[FSDPParamGroup]:
        """Prefetch for the module expected to run after ``state`` ([Note:
        Prefetch order]). A module predicted to compile its own frame is handed
        its gather ([Note: Gathers handed to the next block's graph] in
        _param_group.py): returned, for ``state``'s graph to issue
        (``in_graph``), or issued now; any other module is prefetched eagerly.
        The first iteration has no recorded order: a handoff then goes to the
        next module in the model's order, an eager prefetch to none."""
        target = self.forward_prefetch_target(state)
        if target is None and not self.prev_forward_order:
            at = next(i for i, s in enumerate(self.states) if s is state)
            first_guess = self.states[at + 1] if at + 1 < len(self.states) else None
            if first_guess is not None and first_guess.predicts_own_frame():
                target = first_guess
        if target is None:
            return None
        group = target.param_group
        if not target.predicts_own_frame():
            self.prefetch(target, "forward")
            return None
        if not group.hand_over_gathers:
            return None
        if group.handoff_in is not None:  # (handed over already)
            return None
        if in_graph:
            return group
        group.hand_over_eagerly()
        return None

    def drop_unread_handoffs(self) -> None:
        """Handoffs no module read by the end of the forward (a predicted
        module did not run): waited and dropped. Their issuers' backward
        reduces zeros into those modules' gradients; a parameter that had no
        gradient (nor a kept one) gets ``None`` back at the iteration's end."""
        ran = {id(s) for s in self.forward_order}
        for st in self.states:
            group = st.param_group
            if group is None or group.handoff_in is None:
                continue
            if id(st) not in ran:
                self.restore_none_later(group.fsdp_params)
            group.drop_handoff()

    def restore_none_later(self, params: list[FSDPParam]) -> None:
        """Parameters a handed-over gather's backward gives a zero gradient
        they would not have had: those with no gradient (nor a kept one) now
        get ``None`` back at the iteration's end."""
        self.regrad_none.extend(p for p in params if p.sharded.grad is None and p.kept_grad() is None)

    def forward_prefetch_target(self, state: "FSDPState") -> Optional["FSDPState"]:
        """See [Note: Prefetch order]."""
        i = len(self.forward_order) - 1
        prev = self.prev_forward_order
        if i + 1 < len(prev) and prev[i] is state:
            return prev[i + 1]
        return None

    def backward_prefetch_target(self, state: "FSDPState") -> Optional["FSDPState"]:
        order: list[FSDPState] = []
        for s in reversed(self.post_forward_order):  # last finished first, each state once
            if not any(s is o for o in order):
                order.append(s)
        for i, s in enumerate(order[:-1]):
            if s is state:
                return order[i + 1]
        return None


class FSDPState:
    """What ``fully_shard`` attaches to one module: its parameter group and hooks."""

    def __init__(
        self, module: nn.Module, param_group: Optional[FSDPParamGroup], mp_policy: MixedPrecisionPolicy
    ) -> None:
        self.module = module
        self.param_group = param_group
        self.mp_policy = mp_policy
        self.ctx: Optional[_RootContext] = None
        # How the last forward ran (see compiled_fsdp.explain) and in which step.
        self.last_path: Optional[str] = None
        self.path_step = -1
        # The root's last forward ran untraced: see [Note: Untraced root frames].
        self.untraced = False
        self.own_frame = False
        _MODULE_STATE[module] = self
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        module.register_forward_hook(_annotate_failed_forward, always_call=True)

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    def _lazy_init(self) -> None:
        """See [Note: Roots and iterations]."""
        states = iter_fsdp_states(self.module)
        for st in states:  # every rank reaches the same verdict: the same model
            for p in st.param_group.fsdp_params if st.param_group is not None else ():
                p.check_materialized()
        ctx = _RootContext(self)
        ctx.states = states
        ctx.wrapped = {id(m._orig_mod) for m in self.module.modules() if isinstance(m, OptimizedModule)}
        ctx.checker = next(
            (st.param_group.checker for st in states if st.param_group is not None), None)
        fqns = module_fqns(self.module)
        for st in ctx.states:
            st.ctx = ctx
            if st.param_group is not None:
                st.param_group.ctx = ctx
                st.param_group.fqn = fqns[st.module]

    def _set_path(self, path: str, own_frame: bool = False) -> None:
        self.last_path, self.path_step = path, self.ctx.step
        self.untraced = False
        # Compiled as a frame of its own: see [Note: Blocks compiled on their own].
        self.own_frame = own_frame

    # -- hooks -------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """See [Note: Hooks under Dynamo]. Traced inside a graph, only the input
        casts remain: the passes own this module's communication."""
        if not torch.compiler.is_compiling():
            self._eager_pre_forward(_is_in_optimized_module())
        mp = self.mp_policy
        if mp.cast_forward_inputs and mp.param_dtype is not None:  # [Note: Mixed precision]
            return cast_floating(mp.param_dtype, (args, kwargs))
        return None

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.compiler.is_compiling():
            output = self._eager_post_forward(output)
        return cast_floating(self.mp_policy.output_dtype, output)

    def _eager_pre_forward(self, in_compiled_call: bool) -> None:
        if self.ctx is None:
            self._lazy_init()
        ctx = self.ctx
        if self.is_root:
            ctx.begin_iteration()
            if ctx.checker is not None:  # see [Note: Agreeing on collectives] in _divergence.py
                arm_compile_callbacks()
                ctx.checker.check_step(ctx.step)
            group = self.param_group
            if in_compiled_call and (group is None or not is_split(group.key)):
                ctx.compiled_forward = True  # Dynamo traces the forward: markers, no hooks
                self._set_path("compiled")
                return
            ctx.in_forward = True
        elif self._compiles_own_frame(in_compiled_call):
            # See [Note: Blocks compiled on their own] and [Note: Gathers handed
            # to the next block's graph] in _param_group.py.
            self._set_path("compiled", own_frame=True)
            ctx.forward_order.append(self)
            self.param_group.begin_compiled_entry(ctx.prefetch_next(self, in_graph=True))
            return
        # See [Note: Fallback decision rule] in _fallback.py.
        self._set_path("fallback" if in_compiled_call else "eager")
        ctx.forward_order.append(self)
        if self.param_group is not None:
            self.param_group.drop_handoff()  # (predicted to compile its own frame; it does not)
            self.param_group.pre_forward()
        ctx.prefetch_next(self, in_graph=False)

    def predicts_own_frame(self) -> bool:
        """Whether this module's next forward will be compiled as a frame of
        its own (``_compiles_own_frame``): as its last one was; before its
        first, from how it is compiled (``module.compile()``, or
        ``torch.compile(module)`` in its parent's place, before or after
        ``fully_shard``)."""
        if not self._may_compile_own_frame():
            return False
        if self.last_path is not None:
            return self.own_frame
        module = self.module
        return (getattr(module, "_compiled_call_impl", None) is not None or id(module) in self.ctx.wrapped
                or isinstance(module, OptimizedModule))

    def _compiles_own_frame(self, in_compiled_call: bool) -> bool:
        """Whether Dynamo is about to compile this (non-root) module's forward as
        a frame of its own while the root runs eagerly: ``module.compile()``, or
        ``torch.compile(module)`` in its parent's place."""
        compiled = in_compiled_call or getattr(self.module, "_compiled_call_impl", None) is not None
        return compiled and self._may_compile_own_frame()

    def _may_compile_own_frame(self) -> bool:
        """Not under a compiled root (a module's hooks run as Python there only
        because Dynamo broke the graph inside it: that falls back), and not
        once its frames were split."""
        group, ctx = self.param_group, self.ctx
        if group is None or ctx.compiled_forward or ctx.root.last_path != "eager":
            return False
        return not is_split(group.entry_split_key)

    def _eager_post_forward(self, output: Any) -> Any:
        ctx = self.ctx
        group = self.param_group
        if group is not None and group.compiled_entry:
            ctx.restore_none_later(group.params_left_unread())
            # (its graph took the kept gradients of the module it handed a gather to)
            handed = group.end_compiled_entry()
            ctx.watch_compiled_backward(output, [group] + ([handed] if handed is not None else []))
            return output
        if self.is_root:
            ctx.in_forward = False
            ctx.drop_unread_handoffs()
            if ctx.compiled_forward:
                ctx.compiled_forward = False
                ctx.watch_compiled_backward(output, ctx.groups())
                return output
        ctx.post_forward_order.append(self)
        grad_outputs = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        backward_follows = torch.is_grad_enabled() and bool(grad_outputs)
        if self.param_group is not None:
            reshard = not backward_follows or self.param_group.reshards_after_forward
            self.param_group.post_forward(reshard)
        if backward_follows:
            register_multi_grad_hook(grad_outputs, self._pre_backward, mode="any")
        elif self.is_root:
            ctx.end_iteration()
        return output

    def _pre_backward(self, grad: Any) -> None:
        ctx = self.ctx
        ctx.ensure_callback_queued()
        if self.param_group is not None:
            self.param_group.pre_backward()
        target = ctx.backward_prefetch_target(self)
        if target is not None and target.param_group is not None and target.param_group.needs_grad_sync:
            ctx.prefetch(target, "backward")


def _no_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _annotate_failed_forward(module: nn.Module, args: Any, output: Any) -> None:
    """Runs after every forward, also one that raised (``always_call``): a
    collective error there (a peer exited after a failed check) gets that
    peer's report as a note. See [Note: Agreeing on collectives] in _divergence.py."""
    if output is None and not torch.compiler.is_compiling():  # (None: the forward raised)
        exc = sys.exc_info()[1]
        if exc is not None:
            annotate_error(exc)


# See [Note: Hooks under Dynamo]: skip these frames and every frame they call.
_SKIP_RECURSIVELY = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
for _hook in (FSDPState._pre_forward, FSDPState._post_forward, _annotate_failed_forward):
    set_code_exec_strategy(_hook.__code__, _SKIP_RECURSIVELY)
