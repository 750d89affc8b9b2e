"""Per-module state, the registry that maps modules to it, and the eager hooks.

[Note: Hooks under Dynamo]
A hook either is inlined into a graph Dynamo traces, or runs as Python:

1. Inlined (a module called from traced code, including the compiled root's
   own ``__call__`` when nothing breaks): ``torch.compiler.is_dynamo_compiling()``
   is True and the hook returns at once, tracing to nothing. Parameter reads emit
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

[Note: A root compiled in place]
``model.compile()`` compiles the root's ``_call_impl`` in place: no
``OptimizedModule`` wraps the call, so ``_is_in_optimized_module()`` is False
for the sharded modules its frame calls as Python (Dynamo breaks the graph
there, or, for a parameterless ``Sequential`` root, never traces them), and
they were served as in plain eager, outside any iteration the compiled root
began: with micro-batches accumulating without sync, their gradients came out
0.06 off, silently (FSDP2's test_train_parity_hsdp with every module
compiled in place). A module run as Python while its root's forward is
compiled (``Phase.COMPILED_FORWARD``) is in a compiled call either way: it is
served as a fallback, exactly as under ``torch.compile(model)``. So is the
root itself: its call is compiled, so where it cannot stay compiled (a break
splits its reads) it falls back, and its regions, which run in its graphs,
are compiled (it ran as "eager" before, its regions reported so, and
``explain()`` named no reason). Tested by tests/test_compile_in_place.py.

[Note: Traced in this thread]
The hooks and the parameter property ask ``torch.compiler.is_dynamo_compiling()``,
called inline, not ``is_compiling()``: that reads a process-wide flag, True in
every thread while any one compiles, so with thread ranks (torch's
multi-thread process group) a rank whose hooks ran as Python while another
rank compiled skipped its pre-forward as if traced (measured: half the
aot_eager runs hung in a reduce-scatter). ``is_dynamo_compiling()`` is False
when the code runs and folded to True while Dynamo traces it, so it holds per
thread. Inline, not in a helper of ours: Dynamo converts a helper called from
a frame it evaluates into a frame that returns the folded True (measured:
per-parameter collectives ran eagerly under a failing backend). Tested by
tests/test_fsdp2_api.py::test_thread_ranks[aot_eager] and
tests/test_untraced_frames.py.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.nn as nn
from torch._dynamo.eval_frame import _is_in_optimized_module
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.backward_use import backward_reads_params, only_embeddings_hold
from compiled_fsdp.runtime.context import Path, RootContext
from compiled_fsdp.runtime.divergence import annotate_error
from compiled_fsdp.runtime.extension import compiled_in_place, compiled_path
from compiled_fsdp.runtime.param_group import FSDPParamGroup, Phase
from compiled_fsdp.runtime.policy import MixedPrecisionPolicy, cast_floating
from compiled_fsdp.runtime.streams import CommStreams

__all__ = ["FSDPState", "get_fsdp_state", "iter_fsdp_states", "module_fqns"]

# A module's state is recorded once, in torch's map of composable-API states
# (compat.register_composable_state), where torch's tools look too. Both
# weakly: the module keeps its state alive through its hooks (bound methods
# of the state), so a model nobody references is freed with its groups.


def module_fqns(root: nn.Module) -> dict[nn.Module, str]:
    """Each submodule's name under ``root``, without the ``_orig_mod`` of a
    ``torch.compile`` wrapper in its parent's place (as FSDP2's state dict)."""
    return {m: ".".join(p for p in name.split(".") if p != "_orig_mod") for name, m in root.named_modules()}


def get_fsdp_state(module: nn.Module) -> Optional["FSDPState"]:
    """The state of ``module`` if ``fully_shard`` was applied to it, else None."""
    state = compat.module_state(module)
    return state if isinstance(state, FSDPState) else None


def iter_fsdp_states(module: nn.Module) -> list["FSDPState"]:
    """States of ``module``'s subtree (itself included) in ``module.modules()`` order."""
    out: list[FSDPState] = []
    for m in module.modules():
        st = get_fsdp_state(m)
        if st is not None and not any(st is o for o in out):  # (a list's state: once)
            out.append(st)
    return out


# How many forward pre-hooks and forward hooks ``FSDPState`` registers on each
# of its modules (``__init__``); a compile region's call counts on them
# ([Note: A region's call under Dynamo] in compile/region_call.py).
FORWARD_HOOKS = (1, 2)


class FSDPState(compat.torch_fsdp_state_class()):  # type: ignore[misc]
    """What ``fully_shard`` attaches to one module: its parameter group and hooks.
    Derives from torch's FSDP2 state only to be recognised as one: see
    [Note: Seen as FSDP2's state] in core/compat.py."""

    def __init__(
        self, modules: tuple[nn.Module, ...], param_group: Optional[FSDPParamGroup], mp_policy: MixedPrecisionPolicy,
        api: str = "fully_shard",
    ) -> None:
        self.api = api  # the composable API that made it: "fully_shard" or "replicate"
        # One module, or FSDP2's list form: see [Note: A list of modules as one group].
        self.modules = modules
        self.module = modules[0]
        # Modules of the list still to run in this forward (empty: none ran yet).
        self._to_run: list[nn.Module] = []
        self.param_group = param_group
        self.mp_policy = mp_policy
        self.ctx: Optional[RootContext] = None
        # How the last forward ran (see compiled_fsdp.explain) and in which step.
        self.path: Optional[Path] = None
        self.path_step = -1
        # A mistake found at fully_shard that FSDP2 reports at lazy init (a
        # weight shared across applications: api._shared_across_groups).
        self.deferred_error: Optional[str] = None
        # FSDPModule.set_modules_to_{forward,backward}_prefetch: explicit
        # targets in place of [Note: Prefetch order]'s in context.py (None: implicit).
        self.forward_prefetch: Optional[list[FSDPState]] = None
        self.backward_prefetch: Optional[list[FSDPState]] = None
        # Set on the root before its first forward (FSDPModule.set_manual_backward_finalization).
        self.manual_finalization = False
        for module in modules:
            compat.register_composable_state(module, self)
            if len(modules) == 1:
                compat.register_first_forward_pre_hook(module, self._pre_forward)
                module.register_forward_hook(self._post_forward)
            else:
                compat.register_first_forward_pre_hook(module, self._list_pre_forward)
                module.register_forward_hook(self._list_post_forward)
            module.register_forward_hook(_annotate_failed_forward, always_call=True)

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    @property
    def _is_root(self) -> Optional[bool]:
        """FSDP2's name for ``is_root``, None before the first forward."""
        return None if self.ctx is None else self.is_root

    def _lazy_init(self) -> None:
        """See [Note: Roots and iterations] in context.py. Refuses what FSDP2 refuses, with
        its messages: a root of several modules, and a module whose state a
        forward of its own initialised before the root's."""
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self.modules}")
        states = iter_fsdp_states(self.module)
        fqns = module_fqns(self.module)
        for st in states:
            if st is not self and st.ctx is not None:
                raise RuntimeError(f"FSDP state has already been lazily initialized for {fqns[st.module]}\n"
                                   "FSDP requires running forward through the root module first")
        for st in states:  # every rank reaches the same verdict: the same model
            if st.deferred_error is not None:
                raise ValueError(st.deferred_error)
            if st.param_group is not None:
                for p in st.param_group.fsdp_params:  # (assigned anew by the user's init)
                    p.reset_sharded_param()
                st.param_group.check_materialized(fqns[st.module])
        ctx = RootContext(self)
        ctx.states = states
        ctx.checker = next(
            (st.param_group.checker for st in states if st.param_group is not None), None)
        device = next((st.param_group.fsdp_params[0].device for st in states  # (offload: the compute device)
                       if st.param_group is not None and st.param_group.fsdp_params), torch.device("cpu"))
        ctx.streams = CommStreams(device)
        for st in ctx.states:
            st.ctx = ctx
            if st.param_group is not None:
                st.param_group.ctx = ctx
                st.param_group.fqn = fqns[st.module]
                if st.param_group.decides_unshard_in_backward is None:  # (the user has not chosen)
                    st.param_group.decides_unshard_in_backward = len(st.modules) == 1 and only_embeddings_hold(
                        (p.sharded for p in st.param_group.fsdp_params), self.module)

    def set_path(self, path: Path) -> None:
        self.path, self.path_step = path, self.ctx.step

    def last_path(self) -> Optional[Path]:
        """How this module's forward ran in the current step (None: it did not run)."""
        return self.path if self.ctx is not None and self.path_step == self.ctx.step else None

    # -- hooks -------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """See [Note: Hooks under Dynamo]. Traced inside a graph, only the input
        casts remain: the passes own this module's communication."""
        if not torch.compiler.is_dynamo_compiling():
            with compat.no_spmd_typecheck():  # ([Note: spmd_types parameters] in annotated.py)
                self._eager_pre_forward(_is_in_optimized_module())
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: Any, kwargs: Any) -> Any:
        """A pre-forward hook's result: the inputs cast, or None where nothing is cast."""
        inputs, _ = self.forward_casts()
        return cast_floating(inputs, (args, kwargs)) if inputs is not None else None

    def forward_casts(self) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
        """The dtypes this module's forward hooks cast its floating-point
        inputs and its output to (None: no cast); [Note: Mixed precision]."""
        mp = self.mp_policy
        return mp.param_dtype if mp.cast_forward_inputs else None, mp.output_dtype

    def _list_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        """[Note: A list of modules as one group]
        ``fully_shard([m1, m2])`` (FSDP2's list form) makes one group of the
        modules' parameters, with one state, registered for each module. The
        group's pre-forward runs when the first of them starts (gather), its
        post-forward when the last of them finishes (reshard, backward hooks),
        as FSDP2's group forward hooks do. One of them called outside the
        root's forward (torchtitan's chunked loss calls the head on its own:
        [Note: Several backwards of one forward] in context.py), or called again after it ran,
        begins a group forward of its own. A forward in which some of them do
        not run leaves the group unsharded to the end of the iteration (it is
        completed at the root's post-forward, without resharding: the
        backward of those that ran reads the gathered parameters; its
        pre-backward hook is registered on the root's outputs, so a
        backward that finds it resharded gathers it first). Such a
        group never compiles a frame of its own: its modules are separate
        frames. Tested by tests/test_fsdp2_api.py::test_list_of_modules."""
        if torch.compiler.is_dynamo_compiling():
            return self._pre_forward(module, args, kwargs)
        if not any(m is module for m in self._to_run):  # (none of the group runs, or this one ran already)
            ctx = self.ctx
            on_its_own = ctx is not None and not self.is_root and ctx.phase is Phase.IDLE
            self._to_run = [module] if on_its_own else list(self.modules)
            return self._pre_forward(module, args, kwargs)
        return self._cast_inputs(args, kwargs)

    def _list_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return self._post_forward(module, args, output)
        self._to_run = [m for m in self._to_run if m is not module]
        if not self._to_run:
            return self._post_forward(module, args, output)
        return cast_floating(self.forward_casts()[1], output)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.compiler.is_dynamo_compiling():
            with compat.no_spmd_typecheck():
                output = self._eager_post_forward(output)
        return cast_floating(self.forward_casts()[1], output)

    def _eager_pre_forward(self, in_compiled_call: bool) -> None:
        if self.ctx is None:
            self._lazy_init()
        ctx = self.ctx
        path = compiled_path()
        if self.is_root:
            # [Note: A root compiled in place]: its own call is compiled.
            in_compiled_call = in_compiled_call or compiled_in_place(self.module)
            ctx.begin_iteration()
            if ctx.checker is not None:  # see [Note: Agreeing on collectives] in divergence.py
                ctx.checker.check_step(ctx.step)
            if path.root_compiles(self, in_compiled_call):
                ctx.phase = Phase.COMPILED_FORWARD  # Dynamo traces the forward: markers, no hooks
                self.set_path(Path.COMPILED)
                return
            ctx.phase = Phase.FORWARD
        else:
            # A root compiled in place (``model.compile()``: no OptimizedModule
            # around the call) is in a compiled forward all the same; see
            # [Note: A root compiled in place].
            # So is a root's forward that fell back there (a break split its reads).
            in_compiled_call = in_compiled_call or ctx.phase is Phase.COMPILED_FORWARD \
                or (ctx.phase is Phase.FORWARD and ctx.root.last_path() is Path.FALLBACK)
            if path.begins_own_frame(self, in_compiled_call):
                return
        # See [Note: Fallback decision rule] in compile/frames.py.
        self.set_path(Path.FALLBACK if in_compiled_call else Path.EAGER)
        self.run_eagerly()

    def run_eagerly(self) -> None:
        """This module's forward runs the eager runtime: gather, expose, prefetch."""
        ctx = self.ctx
        ctx.forward_order.append(self)
        if self.param_group is not None:
            path = compiled_path()
            path.before_eager_forward(self)
            group = self.param_group
            lazy = self.path is Path.EAGER and len(group.reduce_buckets) > 1 and not path.compiles_inside(self)
            group.pre_forward(lazy_buckets=lazy)
        if self.forward_prefetch is not None:
            for target in self.forward_prefetch:
                ctx.prefetch(target, "forward")
        else:
            ctx.prefetch_next(self, in_graph=False)

    def _eager_post_forward(self, output: Any) -> Any:
        ctx = self.ctx
        path = compiled_path()
        if path.after_own_frame(self, output):
            if torch._C._current_graph_task_id() == -1:  # (not a recompute in backward)
                ctx.post_forward_order.append(self)  # ([Note: Prefetch order])
            return output
        partial: list[FSDPState] = []
        if self.is_root:
            for st in ctx.states:  # see [Note: A list of modules as one group]
                if st._to_run:
                    partial.append(st)
                st._to_run = []
            compiled = ctx.phase is Phase.COMPILED_FORWARD
            ctx.phase = Phase.IDLE
            path.end_forward(ctx)
            if compiled:
                path.after_compiled_root(ctx, output)
                return output
        ctx.post_forward_order.append(self)
        grad_outputs = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        backward_follows = torch.is_grad_enabled() and bool(grad_outputs)
        if self.param_group is not None:
            group = self.param_group
            if backward_follows and group.decides_unshard_in_backward:  # ([Note: Embeddings are not gathered ...])
                views = group.exposed_views
                reads = views is None or backward_reads_params(grad_outputs, views)
                again = sum(s is self for s in ctx.post_forward_order) > 1  # (a second call: either may read)
                group.unshard_in_backward = reads or (again and group.unshard_in_backward)
            reshard = not backward_follows or group.reshards_after_forward
            group.post_forward(reshard, backward_follows)
        if backward_follows:
            register_multi_grad_hook(grad_outputs, self._pre_backward, mode="any")
            for st in partial:  # (gathered again before its backward, e.g. a second backward of a retained graph)
                register_multi_grad_hook(grad_outputs, st._pre_backward, mode="any")
            if self.is_root:
                with compat.no_spmd_typecheck():
                    ctx.prefetch_backward_start()
        elif self.is_root:
            ctx.end_iteration()
        return output

    def _pre_backward(self, grad: Any) -> None:
        with compat.no_spmd_typecheck():
            self._eager_pre_backward()

    def _eager_pre_backward(self) -> None:
        ctx = self.ctx
        ctx.ensure_callback_queued()
        if self.param_group is not None:
            self.param_group.pre_backward()
        targets = ([ctx.backward_prefetch_target(self)] if self.backward_prefetch is None
                   else self.backward_prefetch)
        for target in targets:  # (a graph's own backward needs no eager views: its entry decides)
            if target is not None and target.param_group is not None and (
                    target.param_group.needs_grad_sync or target.path is Path.OWN_FRAME):
                ctx.prefetch(target, "backward")


def _annotate_failed_forward(module: nn.Module, args: Any, output: Any) -> None:
    """Runs after every forward, also one that raised (``always_call``): a
    collective error there (a peer exited after a failed check) gets that
    peer's report as a note. See [Note: Agreeing on collectives] in divergence.py."""
    if output is None and not torch.compiler.is_dynamo_compiling():  # (None: the forward raised)
        exc = sys.exc_info()[1]
        if exc is not None:
            annotate_error(exc)


# See [Note: Hooks under Dynamo]: skip these frames and every frame they call.
compat.never_a_frame(FSDPState._pre_forward, FSDPState._post_forward, FSDPState._list_pre_forward,
                     FSDPState._list_post_forward, _annotate_failed_forward)
