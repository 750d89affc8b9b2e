"""The classes ``fully_shard`` makes, pickled by what they are made of.

[Note: Generated classes by reference]
``fully_shard`` swaps the class of each module it manages for one it makes:
the ``FSDP<Module>`` classes ([Note: Parameter property] in
module_class.py), and under compile regions a block's region class and its
root's (compile/regions.py). Pickle saves a class by its module and name,
and finds none of these there. Torch's caching precompile
(``TORCH_CACHING_PRECOMPILE=1``, saved by
``torch.compiler.save_cache_artifacts()``) pickles Dynamo's guards, which
check every module's class, so a sharded model's trace could not be saved
and every job traced its whole model again (a "package bypass"). So each
class is made with a metaclass of this module's (one per metaclass of the
class it derives from), which ``copyreg`` pickles as the key it was made
from: its kind and the classes and names it was made of, these classes
pickled as usual (by name; the user's module class must be importable, as
pickle asks of any class). Unpickled, the key finds the class this process
made from the same key (``find``), so the guards check the modules'
classes again. A class not made yet in the loading process (``fully_shard``
runs before the compiled call that loads the trace) fails the load, and
Dynamo traces as before. Where torch fails to load such a trace
(``compat.saved_traces_load``: 2.13), the classes pickle by name as before,
so none is saved. The names stay FSDP2's (``FSDPLinear``). Tested by
tests/test_precompile.py::test_a_second_job_loads_its_traces.
"""
from __future__ import annotations

import copyreg
from collections.abc import Hashable
from typing import Any

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.registry import RUNTIME

__all__ = ["find", "make"]

_KEY = "_fsdp_generated_key"


def make(name: str, bases: tuple[type, ...], attrs: dict[str, Any], key: tuple[Hashable, ...]) -> type:
    """A class ``name`` of ``bases`` and ``attrs``, found again by ``key``
    (its kind first, then classes and names: picklable) where it is unpickled.
    Replaces a class made from ``key`` before (callers look it up first)."""
    metas = [type(b) for b in bases]
    # (the most derived, as Python picks it; a made class's own for a region class of an FSDP<Module> class)
    base_meta = next((m for m in metas if all(issubclass(m, other) for other in metas)), metas[-1])
    meta = base_meta if base_meta in RUNTIME.metaclasses.values() else RUNTIME.metaclasses.get(base_meta)
    if meta is None:
        meta = type(f"Generated{base_meta.__name__}", (base_meta,), {"__module__": __name__})
        if compat.saved_traces_load():  # (elsewhere pickled by name, so no trace is saved)
            copyreg.pickle(meta, _reduce)
        RUNTIME.metaclasses[base_meta] = meta
    cls = meta(name, bases, {**attrs, _KEY: key})
    RUNTIME.generated[key] = cls
    return cls


def _reduce(cls: type) -> tuple[Any, tuple[Hashable, ...]]:
    return find, cls.__dict__[_KEY]


def find(*key: Hashable) -> type:
    """The class this process made from ``key`` (see the note above)."""
    cls = RUNTIME.generated.get(key)
    if cls is None:
        raise LookupError(
            f"compiled_fsdp: no class made from {key!r} in this process: a saved trace of a sharded model "
            "loads after fully_shard has sharded the model alike (call fully_shard before the first "
            "compiled call).")
    return cls
