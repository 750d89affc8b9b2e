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

import functools
from typing import Any, Iterable, Optional

import torch.nn as nn

from compiled_fsdp.runtime.state import FSDPState, get_fsdp_state, iter_fsdp_states

__all__ = ["FSDPModule", "ManagedByAncestor", "UnshardHandle", "register_fsdp_forward_method"]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` makes the
    module's parameters unsharded (FSDP2's ``UnshardHandle``)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to, so
    ``isinstance(m, compiled_fsdp.FSDPModule)`` tells which they are. The
    methods are FSDP2's, with its names and meaning (DESIGN.md, "FSDP2's API")."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A module built from this class anew (slicing a sharded nn.Sequential
        # calls ``self.__class__(...)``) is a plain module of the original
        # class, as in FSDP2: it has no fully_shard state.
        orig = cls._fsdp_base_class
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(
            "FSDP does not support deepcopy of a module fully_shard was applied to: copy the model before "
            "fully_shard, or save and load its state dict (torch.distributed.checkpoint)."
        )

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
        set it before the first compiled step."""
        for group in _groups(self, "set_reshard_after_forward", reshard_after_forward, recurse):
            group.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Gather ``modules``' parameters when this module's forward starts, in
        place of the implicit next module ([Note: Prefetch order] in state.py)."""
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

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's flag for several backwards per step (pipelining). Here every
        backward finishes its gradient reductions before it returns, so the
        gradients are complete after any backward, the last included: the flag
        is accepted and checked, and changes nothing."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward: expected True or False, got {is_last_backward!r}.")

    def set_post_optim_event(self, event: Any) -> None:
        """The next all-gathers wait for ``event`` (recorded after the optimizer
        step) instead of for the whole compute stream ([Note: Streams and
        events]); on the CPU there are no streams and nothing waits."""
        state = self._state("set_post_optim_event")
        if state.ctx is not None and state.ctx.streams is not None:
            state.ctx.streams.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the world size
        (for this module and every one below). A compiled graph keeps the
        factor it was traced with: set it before the first compiled step."""
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_reduce_scatter_divide_factor: expected a positive number, got {factor!r}.")
        for group in _groups(self, "set_reduce_scatter_divide_factor", True, True):
            group.set_divide_factor(float(factor))

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
