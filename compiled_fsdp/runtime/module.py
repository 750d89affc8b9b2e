"""``FSDPModule``: the methods ``fully_shard`` adds to the module it is applied
to, with FSDP2's names and meaning.

[Note: Gradient accumulation without sync]
``set_requires_gradient_sync(False)`` makes each group's post-backward keep its
full gradients, summed over micro-batches, in a per-parameter unsharded buffer
and issue no reduce-scatter. The first backward with sync on adds its own
gradients to that sum (in micro-batch order, as autograd sums a reference's
``.grad``) and reduce-scatters the total once. ``set_reshard_after_backward(False)``
keeps the gathered parameters after backward, so the next micro-batch's forward
does not gather them again; as on FSDP2, turn it back on before the optimizer
step changes the shards. Tested by tests/test_no_sync.py.
"""
from __future__ import annotations

import copyreg
import functools
import warnings
from typing import Any, Iterable, Optional

import torch.nn as nn

from compiled_fsdp.core import registry
from compiled_fsdp.runtime.state import FSDPState, get_fsdp_state, iter_fsdp_states

__all__ = ["FSDPModule", "GradientReductionHandle", "ManagedByAncestor", "UnshardHandle",
           "register_fsdp_forward_method"]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` makes the
    module's parameters unsharded (FSDP2's ``UnshardHandle``)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns; the reductions
    finished before it was returned."""

    def wait(self) -> None:
        return None


def _unconstructed(cls: type) -> Any:
    """An instance of ``cls`` whose state unpickling sets."""
    return super(FSDPModule, cls).__new__(cls)


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to, so
    ``isinstance(m, compiled_fsdp.FSDPModule)`` tells which they are. The
    methods are FSDP2's, with its names and meaning (README.md, "FSDP2's
    arguments and methods"; why some differ: DESIGN.md, "FSDP2's API")."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A module built from this class anew (slicing a sharded nn.Sequential
        # calls ``self.__class__(...)``) is a plain module of the original
        # class, as in FSDP2: it has no fully_shard state.
        orig = cls._fsdp_base_class
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled (torch's caching precompile saves the modules its guards
        # read: [Note: Generated classes by reference] in generated.py), it
        # is rebuilt as it was, not made anew as ``__new__`` above makes it.
        rv = super().__reduce_ex__(protocol)
        if isinstance(rv, tuple) and rv and rv[0] is copyreg.__newobj__:
            return (_unconstructed, *rv[1:])
        return rv

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(
            "FSDP does not support deepcopy of a module fully_shard was applied to: copy the model before "
            "fully_shard, or save and load its state dict (torch.distributed.checkpoint)."
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module._apply`` (``.to``, ``.double()``, ...), then the group's
        parameters follow their shards' new dtype: [Note: module.to(dtype)
        after fully_shard] in param.py."""
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        registry.CORE.backward_gathers.forget()  # (the shards may live elsewhere now)
        state = get_fsdp_state(self)  # type: ignore[arg-type]
        group = state.param_group if state is not None else None
        if group is not None and any(p.sharded.dtype != p.orig_dtype for p in group.fsdp_params):
            group.reshard()
            for p in group.fsdp_params:
                p.follow_dtype()
        return ret

    def _get_fsdp_state(self) -> FSDPState:
        """This module's fully_shard state (FSDP2's accessor of that name)."""
        return self._state("_get_fsdp_state")

    def _state(self, what: str) -> FSDPState:
        state = get_fsdp_state(self)  # type: ignore[arg-type]
        if state is None:
            raise TypeError(f"{what}: this module has no fully_shard state (it was built anew, not sharded).")
        return state

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now (all-gather); with ``async_op``
        return a handle to ``wait()`` on. The next forward uses them without
        gathering again; ``reshard()`` (or the end of the step) frees them."""
        group = self._state("unshard").param_group
        if group is not None:
            group.unshard(async_op=True)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters (keep only the shards)."""
        group = self._state("reshard").param_group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: on the root module,
        await and drop what the iteration had in flight (its gradients are
        lost, as on FSDP2), reshard every group, and clear the iteration's
        bookkeeping, so that the next forward and backward run cleanly."""
        state = self._state("reset_iter_state")
        if state.ctx is None:  # nothing ran yet
            return
        if not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module (the module the "
                               "outermost fully_shard was applied to), not on a nested one.")
        state.ctx.reset_iteration()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the gathered parameters are freed after forward (and gathered
        again in backward). A compiled graph keeps the choice it was traced with:
        set it before the first compiled step. As FSDP2's, it takes a bool:
        an int ``reshard_after_forward`` given to ``fully_shard`` becomes True
        (over the whole shard group) or False."""
        for group in _groups(self, "set_reshard_after_forward", reshard_after_forward, recurse):
            group.reshard_after_forward = reshard_after_forward
            group.set_post_forward_group(None)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Gather ``modules``' parameters when this module's forward starts, in
        place of the implicit next module ([Note: Prefetch order] in context.py)."""
        self._state("set_modules_to_forward_prefetch").forward_prefetch = _states(
            modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Gather ``modules``' parameters when this module's backward starts, in
        place of the implicit next module."""
        self._state("set_modules_to_backward_prefetch").backward_prefetch = _states(
            modules, "set_modules_to_backward_prefetch")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False for a module whose backward does not read its parameters: its
        backward then gathers nothing."""
        for group in _groups(self, "set_unshard_in_backward", unshard_in_backward, False):
            group.unshard_in_backward = unshard_in_backward
            group.decides_unshard_in_backward = False  # (the user's choice, not the runtime's)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's flag for several backwards per step (pipelining). Here every
        backward finishes its gradient reductions before it returns, so the
        gradients are complete after any backward, the last included: the flag
        is accepted and checked, and changes nothing."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward: expected True or False, got {is_last_backward!r}.")

    def set_post_optim_event(self, event: Any) -> None:
        """The next all-gather (the step's first) waits for ``event`` (recorded
        after the optimizer step) instead of for the whole compute stream, as
        FSDP2's root pre-forward does ([Note: Streams and events]); on the CPU
        there are no streams and nothing waits."""
        state = self._state("set_post_optim_event")
        if state.ctx is not None and state.ctx.streams is not None:
            state.ctx.streams.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of the
        number of ranks (1.0: the sum, as torchtitan sets it). As in FSDP2 it
        applies to this module's group only. A compiled graph keeps the factor
        it was traced with: set it before the first compiled step."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: expected a positive number, got {factor!r}.")
        group = self._state("set_gradient_divide_factor").param_group
        if group is not None:
            group.set_divide_factor(float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of ``set_gradient_divide_factor``."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor.",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2 then reduces with SUM and divides apart (no PREMUL_SUM or AVG).
        compiled_fsdp always does: every reduction here is a SUM followed by a
        division by the factor. Accepted and checked; changes nothing."""
        _check_bool("set_force_sum_reduction_for_comms", enable)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward also all-reduces the reduced shards over the
        replicas. Skipping it (gradient accumulation with reduce-scatter only)
        is not implemented; without HSDP there is no all-reduce, so either
        value holds."""
        for group in _groups(self, "set_requires_all_reduce", requires_all_reduce, recurse):
            if not requires_all_reduce and group.replicate_group is not None:
                raise NotImplementedError(
                    "set_requires_all_reduce(False): compiled_fsdp always all-reduces HSDP's reduced "
                    "shards over the replicas. Accumulate without sync instead "
                    "(set_requires_gradient_sync(False)), or keep the all-reduce on.")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' storage when the eager runtime
        reshards (same data pointers for the next gather, at the memory of an
        unsharded copy). Compiled graphs allocate their own gathered buffers;
        the setting does not reach them."""
        for group in _groups(self, "set_keep_unsharded_storage", keep, recurse):
            for p in group.fsdp_params:
                p.keep_unsharded_storage = keep

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's cap on reduce-scatter input buffers in flight. Here each
        reduction writes a fresh input buffer (no recycling, so no stall to
        trade against memory): the value is checked and changes nothing."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatters on a process group of their own, so they overlap the
        all-gathers. compiled_fsdp does so by default ([Note: A second group for
        reduce-scatters], ``config.comm.separate_reduce_group``, read at
        ``fully_shard``): ``True`` holds already; a change of group after
        ``fully_shard`` is refused."""
        for group in _groups(self, "set_separate_reduce_scatter_group", enable, recurse):
            if (group.reduce_group is not group.process_group) != enable:
                raise NotImplementedError(
                    f"set_separate_reduce_scatter_group({enable}): this module's reduce-scatters "
                    f"{'share' if enable else 'have'} a group of their own, as "
                    "compiled_fsdp.config.comm.separate_reduce_group was at fully_shard. Set that before "
                    "fully_shard instead.")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2 then stages communication buffers in the process group's own
        allocator. Here the buffers come from the caching allocator (graph
        buffers are Inductor's): accepted and checked; changes nothing."""
        _check_bool("set_allocate_memory_from_process_group_for_comm", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory all-gathers are not implemented here: refused."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): compiled_fsdp does not stage all-gathers in symmetric "
            "memory; its collectives use the process group's ordinary buffers. Leave it off "
            "(torchtitan: parallelism.enable_fsdp_symm_mem=False).")

    def set_custom_all_gather(self, comm: Any) -> None:
        """Refused: the all-gathers are emitted by the passes into compiled
        graphs and by the eager runtime from one bucket layout; a user's
        communication object has no place in either."""
        _no_custom("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Refused, as ``set_custom_all_gather``."""
        _no_custom("set_custom_reduce_scatter")

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """Refused: a Python hook on each reduced shard cannot run inside a
        compiled graph, and the two paths must reduce alike."""
        _no_custom("set_all_reduce_hook")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Reduce zeros for a parameter that got no gradient, so ranks that used
        different parameters still reduce the same buffers (as DDP's
        ``find_unused_parameters``). In eager backward; a compiled graph
        reduces every parameter of a module it traced already."""
        for group in _groups(self, "set_reduce_scatter_unused_params", reduce_scatter_unused_params, recurse):
            group.reduce_unused = reduce_scatter_unused_params

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: backward no longer finishes the iteration (awaits the
        reductions, writes ``.grad``, reshards); ``finalize_backward()`` does,
        after every backward of the logical step, first reducing what
        backwards with gradient sync off kept (turn sync on before it). See
        [Note: Several backwards of one forward] in context.py."""
        _check_bool("set_manual_backward_finalization", enabled)
        state = self._state("set_manual_backward_finalization")
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module.")
        ctx = state.ctx
        if ctx is not None and ctx.manual_backward_started and enabled != ctx.manual_finalization:
            raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts: "
                               "call finalize_backward() first.")
        state.manual_finalization = enabled
        if ctx is not None:
            ctx.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> Optional["GradientReductionHandle"]:
        """Finish the iteration's backward now: await every reduction, write the
        gradients, reshard (with ``set_manual_backward_finalization(True)``).
        A no-op before the first forward. ``async_op=True`` returns a handle
        whose ``wait()`` returns at once: the work is done when this returns."""
        state = self._state("finalize_backward")
        if state.ctx is not None:
            if not state.is_root:
                raise RuntimeError("finalize_backward must be called on the root FSDP module.")
            state.ctx.finalize()
        return GradientReductionHandle() if async_op else None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (default) or accumulates them
        unsharded on each rank; see [Note: Gradient accumulation without sync].
        ``recurse`` applies it to every fully sharded module below too."""
        for group in _groups(self, "set_requires_gradient_sync", requires_gradient_sync, recurse):
            group.reduce_grads = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether the gathered parameters are freed after backward (default) or
        kept for the next forward; see [Note: Gradient accumulation without sync]."""
        for group in _groups(self, "set_reshard_after_backward", reshard_after_backward, recurse):
            group.reshard_after_backward = reshard_after_backward


class ManagedByAncestor:
    """Mixed into modules that own managed parameters without ``fully_shard``
    having been applied to them (their parameters belong to an ancestor's
    group): FSDP2's methods there say where to call them instead."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        _not_sharded(self, "set_requires_gradient_sync")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        _not_sharded(self, "set_reshard_after_backward")


def _not_sharded(module: object, what: str) -> None:
    raise TypeError(
        f"{what}: this {type(module).__name__} was not passed to fully_shard; its parameters are "
        f"communicated by an ancestor's fully_shard group. Call {what} on a module fully_shard was "
        "applied to (the root, with recurse=True, covers every module below it)."
    )


def _check_bool(what: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected True or False, got {value!r}.")


def _no_custom(what: str) -> None:
    raise NotImplementedError(
        f"{what}: compiled_fsdp places its collectives itself (the passes in compiled graphs, the eager "
        "runtime from the same bucket layout), so a user's communication object or hook cannot be "
        "honoured in both. Leave it unset; see DESIGN.md, \"FSDP2's API\".")


def _states(modules: Iterable[Any], what: str) -> list[FSDPState]:
    out = []
    for m in modules:
        state = get_fsdp_state(m) if isinstance(m, nn.Module) else None
        if state is None:
            raise ValueError(f"{what}: expects modules fully_shard was applied to, got {type(m).__name__}.")
        out.append(state)
    return out


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (a method other than ``forward``, e.g.
    ``generate``) run the module's fully_shard hooks around it, as FSDP2's
    function of that name: parameters are gathered for it and freed after."""
    state = get_fsdp_state(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method: expects a module fully_shard was applied to, got "
                         f"{type(module).__name__}.")
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}.")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cast = state._pre_forward(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        out = orig(*args, **kwargs)
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def _groups(module: object, what: str, value: object, recurse: bool) -> list:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected True or False, got {value!r}.")
    states = iter_fsdp_states(module) if recurse else [get_fsdp_state(module)]  # type: ignore[arg-type]
    return [st.param_group for st in states if st is not None and st.param_group is not None]
