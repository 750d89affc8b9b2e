"""``compiled_fsdp.explain``: after a step, which fully sharded modules ran
compiled and which fell back to the eager runtime, and why, and the units
each one communicates in. See [Note: Fallback decision rule] in _fallback.py
and [Note: Units] in passes/units.py."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from compiled_fsdp.compile.frames import _TRACED_FRAMES, is_split
from compiled_fsdp.core.ops import ENTRY_KEY
from compiled_fsdp.runtime.state import FSDPState, iter_fsdp_states, module_fqns


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    fqn: str  # "" is the root
    module_type: str
    path: str  # "compiled", "fallback" (eager under compile), "eager", or "not run"
    reason: Optional[str]  # the graph break that sent it to the eager runtime
    # What is gathered and reduced together: compiled, the units the passes
    # chose (one line each); eager, the whole module as one bucket.
    units: tuple[str, ...] = ()

    def __str__(self) -> str:
        name = self.fqn or "<root>"
        line = f"{name:<24} {self.module_type:<16} {self.path}"
        line += f"\n{'':<24} reason: {self.reason}" if self.reason else ""
        return line + "".join(f"\n{'':<24} {u}" for u in self.units)


# module_key -> {the parameters one graph read: that graph's unit lines},
# recorded by _compile.py after each joint pass (plain strings: the runtime
# does not import the passes). A graph break splits a root's parameters over
# several graphs; a recompile of a graph replaces its entry. Blocks compiled on
# their own share ``ENTRY_KEY``.
_UNITS: dict[int, dict[frozenset[int], tuple[str, ...]]] = {}


def record_units(module_key: int, params: frozenset[int], lines: tuple[str, ...]) -> None:
    _UNITS.setdefault(module_key, {})[params] = lines


_EAGER_UNIT = ("unit 0: the whole module, one bucket (the eager runtime communicates each fully_shard "
               "application at once; nest fully_shard per layer for layer-by-layer eager communication)",)


def explain(model: nn.Module) -> list[ModuleReport]:
    """After a step: for each fully sharded module, whether its last forward ran
    compiled (in-graph collectives) or fell back to the eager runtime, and why.
    See [Note: Fallback decision rule]."""
    model = getattr(model, "_orig_mod", model)
    fqns = module_fqns(model)
    reports = []
    for state in iter_fsdp_states(model):
        path = _last_path(state)
        reason = None
        if path == "fallback":
            group = state.param_group
            if state.untraced:
                reason = _UNTRACED
            elif state.is_root and group is not None and is_split(group.key):
                brk = _break_reason(state.module)
                reason = _SPLIT + (f"; the break: {brk}" if brk else "")
            else:
                reason = _break_reason(state.module)
        group = state.param_group
        # A block compiled on its own shares its graph: see [Note: Blocks compiled
        # on their own] in _param_group.py.
        key = ENTRY_KEY if state.own_frame and state.path_step == state.ctx.step else getattr(group, "key", None)
        if path == "compiled" and key in _UNITS:
            graphs = _UNITS[key]
            units = tuple(line for params in sorted(graphs, key=min) for line in graphs[params]
                          if key != ENTRY_KEY or max(params) < len(group.fsdp_params))
        else:
            units = _EAGER_UNIT if path in ("fallback", "eager") else ()
        reports.append(ModuleReport(
            fqns.get(state.module, "?"),
            getattr(state.module, "_fsdp_base_class", type(state.module)).__name__, path, reason, units))
    return reports


_UNTRACED = ("Dynamo ran the compiled model's forward without tracing it (an active dispatch mode such "
             "as FlopCounterMode, the recompile limit, a disabled or failed compile); see "
             "[Note: Untraced root frames]")


_SPLIT = ("a parameter of the root was traced in more than one Dynamo frame, so in-graph collectives "
          "would gather and reduce it twice; see [Note: Fallback decision rule]")


def _last_path(state: FSDPState) -> str:
    ctx = state.ctx
    if ctx is not None and state.path_step == ctx.step and state.last_path is not None:
        return state.last_path
    group = state.param_group
    if group is not None and group.key in _TRACED_FRAMES:
        return "compiled"
    return "not run"


def _break_reason(module: nn.Module) -> Optional[str]:
    """The graph break whose user stack runs through ``module``'s forward."""
    code = type(module).forward.__code__
    last_line = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    for reason in reversed(torch._dynamo.utils.graph_break_reasons):
        for frame in reason.user_stack:
            if frame.filename == code.co_filename and code.co_firstlineno <= (frame.lineno or 0) <= last_line:
                return f"{reason.reason.splitlines()[0]} at {frame.filename}:{frame.lineno}"
    return None
