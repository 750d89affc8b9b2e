"""The one registry of the core: group key -> the runtime object that owns the
key (a fully sharded module's parameter group), for code that meets a key in
a graph or a marker and must reach its owner (the marker ops' eager
implementations, the compile layer's checks, the tools' reports).

Weak: a group lives as long as its module."""
from __future__ import annotations

import weakref
from typing import Optional, Protocol

__all__ = ["MarkerOwner", "owner_of", "owners", "register_owner"]


class MarkerOwner(Protocol):
    """What the core asks of a key's owner."""

    key: int

    def before_marker_collective(self, op: str, param_index: int) -> None:
        """Called before a marker's eager implementation issues ``op``
        ("all-gather" or "reduce-scatter") for parameter ``param_index``
        (-1: the whole bucket): the runtime agrees on it with the other ranks."""


_OWNERS: "weakref.WeakValueDictionary[int, MarkerOwner]" = weakref.WeakValueDictionary()


def register_owner(owner: MarkerOwner) -> None:
    _OWNERS[owner.key] = owner


def owner_of(key: int) -> Optional[MarkerOwner]:
    return _OWNERS.get(key)


def owners() -> list[MarkerOwner]:
    """Every live owner, by key."""
    return [owner for _, owner in sorted(_OWNERS.items())]
