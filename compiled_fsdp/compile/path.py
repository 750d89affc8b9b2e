"""The compile layer's answers to the runtime ([Note: The compiled path] in
runtime/extension.py): what a parameter read traces, which forwards are
compiled and by whom, and what a compiled backward must find.

[Note: Untraced root frames]
Under ``torch.compile(model)`` the root's pre-forward runs as Python and
leaves its parameters to the graph Dynamo is about to trace. Dynamo may
instead run the frame eagerly: under an active dispatch mode
(``FlopCounterMode``, ``CommDebugMode``), past the recompile limit, with
``TORCH_COMPILE_DISABLE=1``, when a failing backend falls back under
``suppress_errors``, or at a graph break inside a loop (a block that breaks
the graph, called in ``for layer in self.layers``: Dynamo cannot resume
there and skips the whole frame, as it would for FSDP2's model; explain()
names that break, ``compat.skipped_frame_breaks``). Nothing tells the hook
beforehand, but the first read of a root parameter outside tracing does (``untraced_read``): the root
switches to the eager runtime for this forward (gather through
``UnshardFn``, reduce in its post-backward), as the blocks already do
(their hooks run as Python and fall back). So such a frame trains exactly
like eager, with one reduction per gradient. The same holds for a block
compiled on its own ([Note: Blocks compiled on their own] in entry.py).
Tested by tests/test_untraced_frames.py, and the loop by
tests/test_graph_breaks.py::test_a_break_inside_the_blocks_loop_says_so.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch._dynamo.comptime import comptime
from torch._dynamo.eval_frame import OptimizedModule
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils._pytree import tree_flatten

from compiled_fsdp.compile import frames, install, region_call, region_reads, regions
from compiled_fsdp.compile.entry import CompiledEntry, entry_of, param_settings, read_kept, read_syncs
from compiled_fsdp.core import (
    compat,
    ops,  # noqa: F401 (registers torch.ops.compiled_fsdp)
    registry,
)
from compiled_fsdp.core.marker import ENTRY_KEY, NEXT_KEY, Unshard
from compiled_fsdp.runtime.context import Path, RootContext
from compiled_fsdp.runtime.extension import CompiledPath, compiled_in_place
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.param_group import FSDPParamGroup, Phase
from compiled_fsdp.runtime.state import FSDPState

__all__ = ["TorchCompilePath"]


# [Note: Extension groups run the eager runtime]
# A group holding a parameter with FSDP's all-gather extension ([Note:
# All-gather extensions] in runtime/ext_gather.py: torchao's float8 weights)
# is gathered by the eager runtime, in the extension's form, and its module's
# compiled code reads the unsharded values (torchao's float8 weights) as
# graph inputs. So is a group under CPU offload ([Note: CPU offload] in
# runtime/policy.py), whose shards are copied to the device before a gather,
# but inside a whole-model graph (``group.copies_in_graph``: [Note: CPU
# offload in graphs] in passes/lowering.py).
# A read while Dynamo traces the module inside a larger graph breaks the
# graph there, so the module falls back ([Note: Fallback decision rule] in
# frames.py); a block compiled on its own runs its hooks eagerly and
# compiles its forward alone; a root holding one is not compiled whole. In a
# graph the extension would run its pre-hook on the shard before the gather
# and its post-hook after it: a subclass Dynamo would construct inside the
# graph. The exception is torchao's float8 weights inside a whole-model
# graph (``group.casts_in_graph``): read in high precision, cast by torchao
# in the graph, and the cast moved before the gather by the passes ([Note:
# Float8 weights cast before their gather in graphs] in
# passes/cast_gather.py). Tested by tests/test_float8.py and
# tests/test_offload.py.
_EXTENSION_BREAK = (
    "compiled_fsdp: {fqn!r} of {module} is gathered by the eager runtime, not inside a graph (its all-gather "
    "extension, fsdp_pre_all_gather / fsdp_post_all_gather as torchao's float8 weights define it): its "
    "module runs outside this graph, and its forward is compiled as a frame of its own. Under "
    "fullgraph=True compile such modules on their own (module.compile()) instead of the whole model.")

# See [Note: Generated classes by reference] in runtime/generated.py: a
# loaded trace runs none of what a block's trace records (``comptime``: the
# parameters its graph reads, the gather it hands to the next block), which
# its runtime needs (measured: the second job's loss off by 3e-3 after three
# steps). Tested by tests/test_precompile.py.
_OWN_FRAME_PRECOMPILE = (
    "compiled_fsdp: {module} is compiled on its own (module.compile() or torch.compile(module)) under torch's "
    "caching precompile (TORCH_CACHING_PRECOMPILE=1, torch._dynamo.config.caching_precompile), whose loaded "
    "traces skip what compiled_fsdp records while tracing such a module, so a job that loads them would train "
    "wrong. Compile the whole model instead (torch.compile(model), with compile regions for repeated blocks: "
    "README, 'A job started again can skip Dynamo's trace'), or turn caching precompile off.")


class _RootCompile:
    """The compile layer's state for one root (its ``compiled`` slot)."""

    def __init__(self, ctx: RootContext) -> None:
        # Modules ``torch.compile``d in their parent's place (ids).
        self.wrapped = {id(m._orig_mod) for m in ctx.root.module.modules() if isinstance(m, OptimizedModule)}
        self.backward_checked = False  # this iteration's first compiled backward checked
        # Parameters whose gradient a dropped handoff made zero although their
        # module did not run (see ``_drop_unread_handoffs``).
        self.regrad_none: list[FSDPParam] = []


def _root(ctx: RootContext) -> _RootCompile:
    if ctx.compiled is None:
        ctx.compiled = _RootCompile(ctx)
    return ctx.compiled


class TorchCompilePath(CompiledPath):
    """``torch.compile`` support for the runtime's hooks."""

    def __init__(self) -> None:
        # Called at every fully_shard (the package adds the dump's env hook).
        self.on_fully_shard_hooks: list[Callable[[], None]] = []

    def on_fully_shard(self, group: Optional[FSDPParamGroup]) -> None:
        if group is not None:
            entry_of(group)
        frames.arm()
        for hook in self.on_fully_shard_hooks:
            hook()

    def make_region(self, module: torch.nn.Module, group: FSDPParamGroup) -> None:
        regions.make_region(module, group)

    def make_region_root(self, module: torch.nn.Module) -> None:
        regions.make_region_root(module)

    def on_step(self, ctx: RootContext) -> None:
        registry.CORE.backward_gathers.drop_pending()  # (what the last step kept and did not take)
        frames.arm()  # (again after a torch._dynamo.reset())
        install.close_backward_windows()
        install.SESSION.forget_region_variants()  # ([Note: A region traced again for an equal block])
        _root(ctx).backward_checked = False
        aliased = any(entry_of(g).in_region for g in ctx.groups())
        for g in ctx.groups():  # before any tracing: see [Note: Accumulation without sync in graphs]
            entry_of(g).reset()
            entry_of(g).reads_alias = aliased or g.casts_in_graph
            if entry_of(g).reads_alias:
                region_reads.refresh(g)
            if entry_of(g).in_region:
                region_call.prepare(entry_of(g))
        regions.predict_order(ctx.groups())

    def on_backward(self, ctx: RootContext) -> None:
        install.open_backward_window()

    # -- a parameter read: see [Note: Parameter property] in module_class.py -----
    def traced_read(self, param: FSDPParam) -> torch.Tensor:
        group = param.group
        entry: CompiledEntry = group.compiled
        comptime(_ensure_window)  # see [Note: Passes installed while compiling] in install.py
        own = entry.active  # see [Note: Blocks compiled on their own] in entry.py
        if entry.in_region and not own:
            if region_reads.in_a_region():
                # Inside a compile region (never an extension group's): its
                # settings from one guarded key ([Note: A region's read settings] in region_reads.py).
                return region_reads.traced_read(entry, param)
            comptime(entry.record_region_bypassed)  # ([Note: A block whose region never runs])
        if group.gathers_eagerly and (own or not group.casts_in_graph):
            # See [Note: Extension groups run the eager runtime].
            torch._dynamo.graph_break(msg=_EXTENSION_BREAK.format(fqn=param.fqn, module=group.label))
        # At trace time; see [Note: Fallback decision rule] in frames.py.
        comptime(entry.record_entry_trace[param.index] if own else entry.record_trace[param.index])
        # See [Note: Gathers handed to the next block's graph] in entry.py
        # (read before handing over: a module called again next reads the new one).
        gathered = entry.handoff_in if own else None
        # Read while tracing, so Dynamo guards on it: see [Note: Accumulation
        # without sync in graphs] in core/ops.py. A handed-over gather's issuer
        # keeps or reduces the gradient instead.
        sync = gathered is not None or read_syncs(param)
        kept = None if gathered is not None else read_kept(param, sync, param.grad_sink is not None)
        local = entry.region_shards[param.index] if entry.reads_alias and not own else param.sharded.to_local()
        full = Unshard.call(  # (canonical: [Note: Shard dims] in core/layout.py)
            shard=param.to_canonical(local),
            module_key=ENTRY_KEY if own else group.key,
            kept=kept,
            sync=sync,
            gathered=gathered,
            bucket_offset=param.bucket_offset if gathered is not None else 0,
            bucket_numel=group.bucket_numel if gathered is not None else 0,
            **param_settings(param),
        )
        if own and entry.handoff_next is not None and not entry.handoff_traced:
            # After this module's own first read, so that its own gather
            # (when nothing was handed to it) is queued first.
            entry.handoff_traced = True
            comptime(entry.record_handoff_trace)
            nxt = entry.handoff_next
            nxt.handoff_in = nxt.gather_next_op(NEXT_KEY)
        full = full if param.shard_dim == 0 else param.from_canonical(full).contiguous()
        return param.to_compute(full)  # ([Note: FSDP over DTensor parameters] in runtime/param.py)

    def untraced_read(self, param: FSDPParam) -> Optional[torch.Tensor]:
        """See [Note: Untraced root frames]."""
        group = param.group
        ctx = group.ctx
        entry = entry_of(group)
        root_left_to_graph = ctx is not None and ctx.phase is Phase.COMPILED_FORWARD \
            and ctx.root.param_group is group
        if ctx is None or not (entry.active or root_left_to_graph):
            return None
        state = next(s for s in ctx.states if s.param_group is group)
        if entry.active:  # (in forward_order already)
            # See [Note: Gathers handed to the next block's graph] in entry.py:
            # the graph that would have read and handed over did not run.
            entry.drop_handoff()
            nxt = entry.end()
            if nxt is not None and nxt.handoff_in is None:
                nxt.hand_over_eagerly()
        else:
            ctx.phase = Phase.FORWARD
            ctx.forward_order.insert(0, state)
        state.set_path(Path.UNTRACED)
        group.pre_forward()
        return group.view_of(param.index)

    # -- forward ---------------------------------------------------------------
    def root_compiles(self, state: FSDPState, in_compiled_call: bool) -> bool:
        group = state.param_group
        # ``torch.compile(model)`` (an OptimizedModule calls it) or ``model.compile()``
        # (its own call is compiled in place, which ``in_compiled_call`` includes
        # for a root): tests/test_fsdp2_api.py::test_every_module_compiled
        return in_compiled_call and (group is None or (not frames.is_split(group.key) and not group.gathers_eagerly))

    def predicts_own_frame(self, state: FSDPState) -> bool:
        """As its last forward was; before its first, from how it is compiled
        (``module.compile()``, or ``torch.compile(module)`` in its parent's
        place, before or after ``fully_shard``)."""
        if not _may_compile_own_frame(state):
            return False
        if state.path is not None:
            return state.path is Path.OWN_FRAME
        module = state.module
        return (compiled_in_place(module)
                or id(module) in _root(state.ctx).wrapped or isinstance(module, OptimizedModule))

    def compiles_inside(self, state: FSDPState) -> bool:
        """``module.compile()`` or ``torch.compile(module)`` in its parent's
        place on a submodule that holds one of the group's parameters ([Note:
        replicate's buckets] in runtime/replicate.py). Not seen: a forward
        compiled as a function (``block.forward = torch.compile(block.forward)``)."""
        owners = {id(m) for p in state.param_group.fsdp_params for m, _ in p.owners}
        for top in state.modules:
            for m in top.modules():
                target = m._orig_mod if isinstance(m, OptimizedModule) else m
                compiled = target is not m or compiled_in_place(m)
                if compiled and any(id(x) in owners for x in target.modules()):
                    return True
        return False

    def begins_own_frame(self, state: FSDPState, in_compiled_call: bool) -> bool:
        """Dynamo is about to compile this (non-root) module's forward as a
        frame of its own while the root runs eagerly: ``module.compile()``, or
        ``torch.compile(module)`` in its parent's place. See [Note: Blocks
        compiled on their own] and [Note: Gathers handed to the next block's
        graph] in entry.py."""
        compiled = in_compiled_call or compiled_in_place(state.module)
        if not (compiled and _may_compile_own_frame(state)):
            return False
        if compat.caching_precompile_on():
            raise RuntimeError(_OWN_FRAME_PRECOMPILE.format(module=state.param_group.label))
        ctx = state.ctx
        state.set_path(Path.OWN_FRAME)
        ctx.forward_order.append(state)
        entry = entry_of(state.param_group)
        if torch._C._current_graph_task_id() != -1:
            # A recompute in backward (activation checkpointing): the graph the
            # forward ran, so that it saves what the forward's backward reads
            # (a stand-in's ``live`` flag among them); nothing prefetched.
            entry.begin(entry.forward_handoff)
            return True
        handed = ctx.prefetch_next(state, in_graph=True)
        traces = _may_trace_handoff(state)
        if handed is not None and not traces:
            entry_of(handed).hand_over_eagerly()
            handed = None
        if handed is not None:
            entry.forward_handoff = entry_of(handed)
        else:  # (the last: [Note: A stand-in for the last block's next] in core/gated.py)
            entry.forward_handoff = entry.stand_in() if traces and state.param_group.hand_over_gathers else None
        entry.begin(entry.forward_handoff)
        return True

    def hand_over(self, target: FSDPState, in_graph: bool) -> Optional[FSDPParamGroup]:
        group = target.param_group
        entry = entry_of(group)
        if not group.hand_over_gathers or entry.handoff_in is not None:  # (off, or handed over already)
            return None
        if in_graph:
            return group
        entry.hand_over_eagerly()
        return None

    def before_eager_forward(self, state: FSDPState) -> None:
        entry_of(state.param_group).drop_handoff()  # (predicted to compile its own frame; it does not)

    def after_own_frame(self, state: FSDPState, output: Any) -> bool:
        group = state.param_group
        if group is None or not entry_of(group).active:
            return False
        entry = entry_of(group)
        ctx = state.ctx
        _restore_none_later(ctx, entry.params_left_unread())
        # (its graph took the kept gradients of the module it handed a gather to)
        handed = entry.end()
        _watch_compiled_backward(ctx, output, [group] + ([handed.group] if handed is not None else []),
                                 partial(_issue_backward_gathers, ctx, state))
        return True

    def prefetch_backward(self, group: FSDPParamGroup, kept: bool = False) -> bool:
        return entry_of(group).issue_backward_gather(kept)

    def after_compiled_root(self, ctx: RootContext, output: Any) -> None:
        in_regions = [g for g in ctx.groups() if entry_of(g).in_region]
        _watch_compiled_backward(ctx, output, ctx.groups(),
                                 partial(_issue_first_region_gather, in_regions) if in_regions else None)

    def end_forward(self, ctx: RootContext) -> None:
        _drop_unread_handoffs(ctx)

    def end_iteration(self, ctx: RootContext) -> None:
        registry.CORE.later_reduces.finish()  # (before anything reads a gradient)
        _drop_unread_handoffs(ctx)
        registry.CORE.backward_gathers.drop_pending(but_kept=True)  # (the kept: dropped by on_step)
        root = _root(ctx)
        for p in root.regrad_none:  # see _drop_unread_handoffs
            p.sharded.grad = None
            p.drop_kept_grad()
        root.regrad_none = []


def _ensure_window(ctx: Any) -> None:
    frames.ensure_window()


def _may_trace_handoff(state: FSDPState) -> bool:
    """[Note: Handoffs and activation checkpointing]
    A module compiled on its own hands the next module its gather by storing
    the traced gather on that module's entry: a Python side effect. Inside an
    activation-checkpointed region (``checkpoint_wrapper``, as torchtitan
    applies AC before compile and fully_shard) Dynamo refuses it ("HOP: Unsafe
    side effect"), and ``fullgraph=True`` turns that into an error, unless
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is
    set (torchtitan sets it): the handoff is nothing a recompute should replay.
    Without the flag, a module holding a ``checkpoint_wrapper`` hands over an
    eager gather instead, issued before its frame runs. With the flag, the
    gathers are the same in number as without AC (measured: 9 all-gathers and 5
    reduce-scatters a step for 3 blocks, an embedding and ``[norm, head]``).
    Tested by tests/test_chunked_loss.py."""
    if compat.side_effects_allowed_under_checkpoint():
        return True
    return not any(isinstance(m, ActivationWrapper) for root in state.modules for m in root.modules())


def _may_compile_own_frame(state: FSDPState) -> bool:
    """Not under a compiled root (a module's hooks run as Python there only
    because Dynamo broke the graph inside it: that falls back), and not once
    its frames were split."""
    group, ctx = state.param_group, state.ctx
    if group is None or len(state.modules) > 1:  # (a list: [Note: A list of modules as one group])
        return False
    if ctx.phase is Phase.COMPILED_FORWARD or ctx.root.path is not Path.EAGER:
        return False
    if group.gathers_eagerly or group.copies_in_graph:  # (see [Note: Extension groups run the eager runtime])
        return False
    return not frames.is_split(entry_of(group).split_key)


def _drop_unread_handoffs(ctx: RootContext) -> None:
    """Handoffs no module read by the end of the forward (a predicted module
    did not run): waited and dropped. Their issuers' backward reduces zeros
    into those modules' gradients; a parameter that had no gradient (nor a
    kept one) gets ``None`` back at the iteration's end."""
    ran = {id(s) for s in ctx.forward_order}
    for st in ctx.states:
        group = st.param_group
        if group is None or entry_of(group).handoff_in is None:
            continue
        if id(st) not in ran:
            _restore_none_later(ctx, group.fsdp_params)
        entry_of(group).drop_handoff()


def _restore_none_later(ctx: RootContext, params: list[FSDPParam]) -> None:
    """Parameters a handed-over gather's backward gives a zero gradient they
    would not have had: those with no gradient (nor a kept one) get ``None``
    back at the iteration's end."""
    _root(ctx).regrad_none.extend(p for p in params if p.sharded.grad is None and p.kept_grad() is None)


def _graph_reduced_groups(ctx: RootContext) -> list[FSDPParamGroup]:
    """Groups whose gradients this step's compiled graphs reduce: those with
    sync on that did not fall back to the eager runtime this step."""
    return [
        st.param_group for st in ctx.states
        if st.param_group is not None and st.param_group.reduce_grads
        and st.last_path() not in (Path.FALLBACK, Path.UNTRACED)
    ]


def _issue_first_region_gather(in_regions: list[FSDPParamGroup]) -> None:
    """When the root's compiled backward begins (the loss's done): the gather
    the regions' backward takes first, the last region's whose backward
    gathers, so that it uses the link while the head's backward computes, as
    one graph's first backward gather does ([Note: Gathers issued ahead of
    compile regions] in regions.py)."""
    for g in reversed(in_regions):
        if entry_of(g).issue_backward_gather(kept=True):
            break


def _issue_backward_gathers(ctx: RootContext, state: FSDPState) -> None:
    """When the backward of ``state``'s own graph begins: its re-gather if not
    prefetched yet, then the one of the module before it in the forward order
    (or of those ``set_modules_to_backward_prefetch`` named), as FSDP2's
    backward prefetch; for a module run eagerly (torchtitan's embedding), its
    pre-backward unshard. See [Note: Backward re-gathers prefetched across
    graphs] in core/registry.py."""
    order = ctx.forward_order or ctx.prev_forward_order  # (a backward after the iteration's end: chunked loss)
    if state.backward_prefetch is not None:
        targets = list(state.backward_prefetch)
    else:
        at = max((i for i, s in enumerate(order) if s is state), default=0)
        targets = [order[at - 1]] if at > 0 else []
    with compat.no_spmd_typecheck():  # ([Note: spmd_types parameters] in runtime/annotated.py)
        for target in [state, *targets]:
            group = target.param_group
            if group is None:
                continue
            if target is not state and target.path in (Path.EAGER, Path.FALLBACK):
                if group.needs_grad_sync and not group.backward_done:  # (an eager module before it: its unshard)
                    ctx.prefetch(target, "backward")
            elif entry_of(group).issue_backward_gather() and target is not state:
                ctx.prefetched.append(("backward", group.fqn))


def _backward_follows(output: Any) -> list[torch.Tensor]:
    """The outputs a backward can start from (none under ``no_grad``)."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _watch_compiled_backward(ctx: RootContext, output: Any, groups: list[FSDPParamGroup],
                             before_graph: Optional[Callable[[], None]] = None) -> None:
    """After a compiled forward of ``groups``: when its backward starts, check
    that the gradient-sync flags are still those the graph was traced with,
    and drop the kept gradients the graph took (its backward holds its own
    reference). A forward whose backward never runs keeps them; then
    ``before_graph`` runs (a block's backward gathers, or the regions'
    first under a compiled root). See [Note:
    Accumulation without sync in graphs] in core/ops.py. The first compiled
    backward of the iteration (the compiled root's, or the last block's)
    also agrees with the other ranks that it starts."""
    outs = _backward_follows(output)
    if not outs:
        return
    traced = [(g, g.reduce_grads) for g in groups]
    root = _root(ctx)

    def pre_backward(grads: Any) -> None:
        if ctx.checker is not None and not root.backward_checked:
            # See [Note: Agreeing on collectives] in runtime/divergence.py.
            root.backward_checked = True
            ctx.checker.check_backward([(s.param_group.identity, s.param_group.label) for s in ctx.forward_order
                                        if s.param_group is not None])
        reduced = [g for g in _graph_reduced_groups(ctx) if any(g is h for h in groups)]
        for g, flag in traced:
            if g.reduce_grads != flag:
                raise RuntimeError(
                    f"compiled_fsdp: set_requires_gradient_sync({g.reduce_grads}) on {g.fqn or '<root>'} "
                    "was called between a compiled forward and its backward. Under torch.compile the "
                    "flag takes effect when the forward runs: set it before the forward."
                )
            kept = any(p.kept_grad() is not None for p in g.fsdp_params)
            split = frames.is_split(g.key) or frames.is_split(entry_of(g).split_key)
            if flag and kept and split and g in reduced:
                raise RuntimeError(
                    f"compiled_fsdp: {g.fqn or '<root>'} has gradients kept without sync and its "
                    "parameters are read in more than one compiled frame (a graph break between "
                    "two of its uses), so each frame would add them. Remove the graph break, or "
                    "run the model without torch.compile while accumulating."
                )
        for g in reduced:  # the graph holds them now
            for p in g.fsdp_params:
                p.drop_kept_grad()
        install.open_backward_window()  # this backward's graph may compile now
        if before_graph is not None:
            before_graph()
        if not compat.to_local_keeps_none_grads():  # torch 2.11: see core/compat.py
            unsynced = [p.sharded for g, flag in traced if not flag for p in g.fsdp_params
                        if p.sharded.requires_grad and p.sharded.grad is None]
            if unsynced:
                torch.autograd.Variable._execution_engine.queue_callback(partial(_no_grads, unsynced))

    register_multi_grad_hook(outs, pre_backward, mode="any")


def _no_grads(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None
