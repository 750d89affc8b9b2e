"""The runtime's one seam to the compile layer.

[Note: The compiled path]
The runtime never imports the compile layer (DESIGN.md, "Layering"). Where a
decision depends on ``torch.compile`` — a parameter read while Dynamo traces,
a module whose forward is compiled as a frame of its own, a compiled root's
backward — the hooks ask the ``CompiledPath`` registered here. This base
class is the answer without a compile layer: nothing is ever compiled, so
every module runs the eager runtime. ``compiled_fsdp/__init__.py`` registers
the compile layer's subclass (compile/path.py) when the package is imported,
so a user always gets it. The compile layer keeps its per-object state in
the ``compiled`` slot of the runtime objects (``FSDPParamGroup.compiled``,
``RootContext.compiled``), which the runtime never reads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from compiled_fsdp.runtime.registry import RUNTIME

# The runtime objects the hooks pass, by role: ``param.FSDPParam``,
# ``param_group.FSDPParamGroup``, ``state.FSDPState`` and ``state.RootContext``.
# Not imported, even for types: each of those modules imports this one
# (tests/test_layers.py forbids the cycle).
FSDPParam = FSDPParamGroup = FSDPState = RootContext = Any

__all__ = ["CompiledPath", "compiled_in_place", "compiled_path", "set_compiled_path"]


class CompiledPath:
    """What the runtime asks about compiled code; the defaults: nothing compiles."""

    def on_fully_shard(self, group: Optional["FSDPParamGroup"]) -> None:
        """``fully_shard`` made ``group`` (None: the module owns no parameter)."""

    def make_region(self, module: "torch.nn.Module", group: "FSDPParamGroup") -> None:
        """``fully_shard`` made ``module`` (its class already the sharded one,
        its parameters ``group``) a compile region: see ``config.comm.block_regions``."""

    def make_region_root(self, module: "torch.nn.Module") -> None:
        """``fully_shard`` made ``module`` a root over sharded modules, some
        of which may be compile regions."""

    def on_step(self, ctx: "RootContext") -> None:
        """A root's forward starts a step (eager or compiled), before anything is traced."""

    def on_backward(self, ctx: "RootContext") -> None:
        """The eager runtime's part of a backward starts (its first pre-backward)."""

    # -- a parameter read ----------------------------------------------------
    def traced_read(self, param: "FSDPParam") -> torch.Tensor:
        """What a read of ``param`` traces while Dynamo traces its module."""
        raise RuntimeError("compiled_fsdp: a fully sharded module is traced by torch.compile, but the "
                           "compile layer is not loaded (import compiled_fsdp, not only its runtime).")

    def untraced_read(self, param: "FSDPParam") -> Optional[torch.Tensor]:
        """A read outside tracing of a module whose forward was left to a
        compiled graph: the frame ran untraced after all. Returns the value
        the eager runtime now serves, or None if this is not such a read."""
        return None

    # -- forward -------------------------------------------------------------
    def root_compiles(self, state: "FSDPState", in_compiled_call: bool) -> bool:
        """The root's pre-forward: whether Dynamo traces its forward, which then
        owns the communication (no hooks run inside it)."""
        return False

    def predicts_own_frame(self, state: "FSDPState") -> bool:
        """Whether ``state``'s module's next forward will be compiled as a frame of its own."""
        return False

    def begins_own_frame(self, state: "FSDPState", in_compiled_call: bool) -> bool:
        """A non-root pre-forward: whether this forward is compiled as a frame
        of its own (and, if so, leave the module to that graph)."""
        return False

    def hand_over(self, target: "FSDPState", in_graph: bool) -> Optional["FSDPParamGroup"]:
        """``target`` is predicted to compile its own frame next: hand it its
        gather (returned, for the current graph to issue, or issued now)."""
        return None

    def compiles_inside(self, state: "FSDPState") -> bool:
        """Whether a submodule of ``state``'s eagerly running module is compiled
        as a frame of its own, so that a parameter's first read may be traced."""
        return False

    def before_eager_forward(self, state: "FSDPState") -> None:
        """``state``'s module runs eagerly after all (a gather handed to it is dropped)."""

    def after_own_frame(self, state: "FSDPState", output: Any) -> bool:
        """A non-root post-forward: True if that forward was compiled as its own frame."""
        return False

    def prefetch_backward(self, group: "FSDPParamGroup", kept: bool = False) -> bool:
        """Issue now the backward re-gather of ``group``, whose module was
        compiled as its own frame, for its graph to take; False if none is due.
        ``kept``: it outlives the end of a backward that did not take it."""
        return False

    def after_compiled_root(self, ctx: "RootContext", output: Any) -> None:
        """The root's post-forward after a compiled forward."""

    def end_forward(self, ctx: "RootContext") -> None:
        """The root's forward is over (eager or compiled)."""

    def end_iteration(self, ctx: "RootContext") -> None:
        """The iteration is over (backward done, or a forward without backward)."""


_EAGER_ONLY = CompiledPath()  # (stateless: no compile layer loaded)


def compiled_path() -> CompiledPath:
    return RUNTIME.path or _EAGER_ONLY


def compiled_in_place(module: torch.nn.Module) -> bool:
    """``module.compile()`` was called: its own call is compiled, no
    ``OptimizedModule`` around it."""
    return getattr(module, "_compiled_call_impl", None) is not None


def set_compiled_path(path: CompiledPath) -> None:
    RUNTIME.path = path

