"""Rules both paths apply, defined once.

[Note: The reshard rule]
A fully sharded module's parameters are freed after its forward and gathered
again in backward when the user asked for it (``reshard_after_forward``),
except the part of the outermost application (the root: no fully sharded
module contains it) that forward uses last: backward needs it first, so a
re-gather would be wasted (FSDP2 keeps its root gathered the same way). The
eager runtime communicates an application whole, so for it that part is the
whole root; the passes cut the root into units and keep only the unit used
last (see [Note: Units] in passes/units.py). Deciding from structure (the
``outermost`` flag, set by ``fully_shard``) rather than from which module's
hooks ran keeps the eager runtime and the markers in agreement even when the
root's hooks never run as Python.
"""
from __future__ import annotations

__all__ = ["reshards_after_forward"]


def reshards_after_forward(requested: bool, outermost: bool, used_last: bool = True) -> bool:
    """Whether a module (or a unit of one: ``used_last`` says whether forward
    uses it last) frees its gathered parameters after forward. See [Note: The
    reshard rule]."""
    return bool(requested) and not (outermost and used_last)
