"""The generated module classes: one property per managed parameter.

[Note: Parameter property]
``fully_shard`` swaps the class of every module that owns a managed parameter for
a generated subclass with one property per managed parameter name. The property
decides what ``module.weight`` means at the moment it is read:

- while the eager runtime has the owning group unsharded (its pre-forward hook ran
  and its post-forward hook has not): the unsharded tensor the hooks gathered;
- while Dynamo traces the module and the hooks have not gathered it: the
  ``compiled_fsdp::unshard`` marker applied to the shard, which the passes lower
  to a bucketed in-graph all-gather;
- otherwise (user code, ``state_dict()``, optimizers, guard evaluation): the local
  shard. A read outside forward/backward never communicates;
- except during another module's eager forward (a parent reading a child's
  parameter): the shard would be silently wrong there, so that raises.

``state_dict()`` and ``parameters()`` read ``_parameters`` directly, so they see
the shards under the original FQNs.
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.nn as nn

from compiled_fsdp.core import compat
from compiled_fsdp.runtime.generated import make
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.registry import RUNTIME

__all__ = ["install_class"]


# [Note: The getter's name a constant of its code]
# A property's getter names its parameter in a constant of its own code, not
# in a closure cell: Dynamo reads a cell through a source of its own
# (``type(module).__dict__[name].fget.__closure__[0].cell_contents``), as
# deep as the module, with a guard; a compile region's trace re-maps every
# such source for each block it is reused for: one of a region body's
# sources per parameter read, 219 -> 209 in a GPT block (RESULTS,
# 2026-12-02). The code is the template's with the placeholder replaced;
# each getter is never a frame of its own. Tested by
# tests/test_api.py::test_sharding_and_state_dicts (no getter has a cell)
# and tests/test_untraced_frames.py (the getters as frames).
_PLACEHOLDER = "\0managed parameter name"


def _getter_template(self: nn.Module) -> torch.Tensor:
    return self._fsdp_params["\0managed parameter name"].current_value()


def _make_property(name: str) -> property:
    template = _getter_template.__code__
    code = template.replace(co_consts=tuple(name if c == _PLACEHOLDER else c for c in template.co_consts))
    getter = types.FunctionType(code, _getter_template.__globals__, f"_fsdp_param_{name}")
    compat.never_a_frame(getter)  # ([Note: The property as a frame])
    return property(getter, doc=f"managed parameter {name!r}; see [Note: Parameter property]")


# [Note: The property as a frame]
# Inlined into a frame Dynamo traces, the property emits the marker. But when
# Dynamo runs a frame as Python (it skipped the frame, or its backend failed),
# it still evaluates the functions that frame calls as frames of their own,
# and the getter was one: on torch 2.13.0 a root frame skipped for a graph
# break in its loop over the blocks, or whose backend failed, had each root
# parameter read compiled as a one-read getter graph that gathered it (and
# reduced its gradient) in a graph; on 2.15.0, in a second model compiled in
# the same process with a full backward pre-hook on a sharded block, the
# getter hit the recompile limit as a frame and Dynamo traced the eager
# runtime behind it, down to the divergence checker's message, which raised
# in every step. Called from Python, the read is the eager runtime's, so the
# getter's code is skipped by frame evaluation, with every frame it calls, as
# the hooks are ([Note: Hooks under Dynamo] in state.py); inlining is
# unaffected. Tested by tests/test_untraced_frames.py (the second model; and
# the failing backend and disabled block, untraced from the first step).


def install_class(
    module: nn.Module, names: Optional[dict[str, FSDPParam]] = None, mixin: Optional[type] = None
) -> None:
    """Swap ``module``'s class for a generated subclass of its original class with
    a property for each managed parameter it owns (``names``) and, for a module
    ``fully_shard`` was applied to, the ``FSDPModule`` methods (``mixin``).
    Calls accumulate: the class always has every property and mixin so far."""
    params = module.__dict__.setdefault("_fsdp_params", {})
    params.update(names or {})
    mixins = module.__dict__.get("_fsdp_mixins", ())
    if mixin is not None and mixin not in mixins:
        mixins = module.__dict__["_fsdp_mixins"] = (*mixins, mixin)
    # (looked up on the class: a module that forwards unknown attributes to a
    # wrapped one, as ``checkpoint_wrapper``, would answer with the wrapped
    # module's base class and become an embedding: tests/test_chunked_loss.py)
    base = getattr(type(module), "_fsdp_base_class", type(module))
    key = ("fsdp", base, tuple(sorted(params)), mixins)
    cls = RUNTIME.generated.get(key)
    if cls is None:
        attrs: dict[str, Any] = {n: _make_property(n) for n in sorted(params)}
        attrs["_fsdp_base_class"] = base
        cls = make(f"FSDP{base.__name__}", (*mixins, base), attrs, key)
    module.__class__ = cls
