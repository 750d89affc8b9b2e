"""The runtime's process-wide state, on one object (``RUNTIME``).

What ``fully_shard`` makes once per process group and shares between the
modules sharded over it, and what the hooks must find from a module alone:

- ``keys``: world group -> the counter that numbers ``fully_shard`` calls
  (a group's key: the same on every rank, so markers and buckets agree).
- ``meshes``, ``reduce_groups``, ``alone_groups``, ``post_forward_groups``:
  the 1-D mesh over a data group (per device type), its reduce group, this
  rank's group of one, and its post-forward groups (per size),
  made once per data group object (per rank: [Note: Helper groups] in
  divergence.py); weakly, see [Note: Process groups at exit] in
  tools/launch.py.
- ``checkers``: ranks -> the divergence checker over them.
- ``abandoned``: check groups with a collective left waiting, kept alive for
  good (``divergence._abandon``).
- ``managed``: original parameter -> its FSDPParam (by identity, weakly), to
  detect a parameter claimed twice.
- ``shards``: id of a shard parameter ``fully_shard`` registered -> its
  FSDPParam (weakly; not a weak reference to the shard, which would stop
  ``to_empty()`` from swapping it), to tell our DTensors from a user's
  (tensor parallelism).
- ``generated``: the classes ``fully_shard`` made, by what each was made
  of (the ``FSDP<Module>`` classes, reused across modules: [Note: Parameter
  property] in module_class.py; compile regions'), and ``metaclasses``:
  the metaclass made for each metaclass they derive from ([Note: Generated
  classes by reference] in generated.py).
- ``path``: the compile layer's seam ([Note: The compiled path] in
  extension.py), set when the compile layer loads.

The per-group entries are weak (a model nobody references is freed with its
groups), the checkers are pruned when their group is destroyed, and the
generated classes live while a module of theirs does. ``reset()`` forgets every
cache (keys and abandoned groups apart: the markers of a live model name
its keys, so a counter restarts only with a new world group). The module state itself is
torch's map (``compat.module_state``), not kept here: see state.py.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RUNTIME", "RuntimeRegistry"]


class _Checker(Protocol):
    """What the registry asks of a checker (``divergence.Checker``)."""

    def alive(self) -> bool:
        """False once its check group was destroyed."""


class RuntimeRegistry:
    """The runtime's state (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: weakref.WeakKeyDictionary[dist.ProcessGroup, Any] = weakref.WeakKeyDictionary()
        self.meshes: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, DeviceMesh]] = (
            weakref.WeakKeyDictionary())
        self.reduce_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
            weakref.WeakKeyDictionary())
        self.alone_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
            weakref.WeakKeyDictionary())
        # shard group -> {size: this rank's post-forward group of that size}
        self.post_forward_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, dist.ProcessGroup]] = (
            weakref.WeakKeyDictionary())
        self.checkers: dict[tuple[int, ...], Any] = {}  # (divergence.Checker)
        self.abandoned: list[dist.ProcessGroup] = []
        self.managed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.shards: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.generated: weakref.WeakValueDictionary[tuple, type] = weakref.WeakValueDictionary()
        self.metaclasses: dict[type, type] = {}
        self.path: Any = None  # (extension.CompiledPath; None: the eager-only default)

    def checker(self, ranks: tuple[int, ...]) -> Any:
        """The live checker over ``ranks`` (a destroyed one is pruned), or None."""
        checker: Optional[_Checker] = self.checkers.get(ranks)
        if checker is not None and not checker.alive():
            del self.checkers[ranks]
            return None
        return checker

    def reset(self) -> None:
        """Forget the helper groups, meshes, checkers and classes (the
        modules that hold them keep them)."""
        self.meshes.clear()
        self.reduce_groups.clear()
        self.alone_groups.clear()
        self.post_forward_groups.clear()
        self.checkers.clear()
        self.generated.clear()


RUNTIME = RuntimeRegistry()
