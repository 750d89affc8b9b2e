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

from compiled_fsdp.runtime.state import get_fsdp_state, iter_fsdp_states


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to, so
    ``isinstance(m, compiled_fsdp.FSDPModule)`` tells which they are."""

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


def _groups(module: object, what: str, value: object, recurse: bool) -> list:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected True or False, got {value!r}.")
    states = iter_fsdp_states(module) if recurse else [get_fsdp_state(module)]  # type: ignore[arg-type]
    return [st.param_group for st in states if st is not None and st.param_group is not None]
