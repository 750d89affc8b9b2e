"""``compiled_fsdp.explain``: after a step, which fully sharded modules ran
compiled and which fell back to the eager runtime, and why, and the units
each one communicates in. See [Note: Fallback decision rule] in
compile/frames.py and [Note: Units] in passes/units.py."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from compiled_fsdp.compile import frames, install
from compiled_fsdp.compile.entry import entry_of
from compiled_fsdp.core import compat
from compiled_fsdp.core.marker import ENTRY_KEY
from compiled_fsdp.runtime.context import Path
from compiled_fsdp.runtime.param_group import FSDPParamGroup
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


_EAGER_UNIT = ("unit 0: the whole module, one bucket (the eager runtime communicates each fully_shard "
               "application at once; nest fully_shard per layer for layer-by-layer eager communication)",)


def _eager_units(buckets: int) -> tuple[str, ...]:
    if buckets == 1:
        return _EAGER_UNIT
    return (f"unit 0: the whole module gathered at once, its gradients reduced in {buckets} buckets "
            "(replicate's bucket_cap_mb)",)


def explain(model: nn.Module) -> list[ModuleReport]:
    """After a step: for each fully sharded module, whether its last forward ran
    compiled (in-graph collectives) or fell back to the eager runtime, and why.
    See [Note: Fallback decision rule]."""
    model = getattr(model, "_orig_mod", model)
    fqns = module_fqns(model)
    reports = []
    for state in iter_fsdp_states(model):
        path = _last_path(state)
        group = state.param_group
        if path == "not run" and group is not None and entry_of(group).in_region and state.ctx is not None:
            path = _region_path(state.ctx.root)
        reason = None
        last = state.last_path()
        if group is not None and _gathered_eagerly(group, path):
            reason = _EXTENSION
        elif path == "compiled" and group is not None and group.region_refusal is not None:
            reason = _NOT_A_REGION + group.region_refusal
        elif path == "compiled" and group is not None and entry_of(group).region_dynamic:
            reason = _NOT_A_REGION + _DYNAMIC_TRUE
        elif path == "compiled" and group is not None and entry_of(group).region_bypassed:
            reason = _NOT_A_REGION + _OWN_FORWARD
        elif (path == "compiled" and group is not None and group.block_regions and not entry_of(group).in_region
              and not state.is_root and last is not Path.OWN_FRAME and len(iter_fsdp_states(state.module)) == 1):
            reason = _NOT_A_REGION + _ROOT_SAID_NO
        elif path == "fallback":
            if last is Path.UNTRACED:
                reason = _untraced_reason(state.module)
            elif state.is_root and group is not None and frames.is_split(group.key):
                brk = _break_reason(state.module)
                reason = _SPLIT + (f"; the break: {brk}" if brk else "")
            else:
                reason = _break_reason(state.module)
                if reason is None and not state.is_root and state.ctx is not None \
                        and state.ctx.root.last_path() is Path.UNTRACED:
                    reason = _UNDER_UNTRACED
        # A block compiled on its own shares its graph: see [Note: Blocks compiled
        # on their own] in compile/entry.py.
        key = ENTRY_KEY if last is Path.OWN_FRAME else getattr(group, "key", None)
        graphs = install.units_of(key) if key is not None else {}
        if path == "compiled" and group is not None and entry_of(group).in_region and last is not Path.OWN_FRAME \
                and not entry_of(group).region_bypassed:
            units = _REGION_UNIT
        elif path == "compiled" and graphs:
            units = tuple(line for params in sorted(graphs, key=min) for line in graphs[params]
                          if key != ENTRY_KEY or max(params) < len(group.fsdp_params))
        else:
            eager = path in ("fallback", "eager") and group is not None  # (a root that owns no parameter: none)
            units = _eager_units(len(group.reduce_buckets)) if eager else ()
        reports.append(ModuleReport(
            fqns.get(state.module, "?"),
            getattr(state.module, "_fsdp_base_class", type(state.module)).__name__, path, reason, units))
    return reports


_REGION_UNIT = ("a compile region (config.comm.block_regions): one subgraph, traced and compiled once for "
                "every identical block, gathers the whole module and reduces its gradients in one bucket; see "
                "[Note: Blocks as compile regions] in compile/regions.py",)


_NOT_A_REGION = "not a compile region (config.comm.block_regions; its reads are traced in the root's graph): "
_ROOT_SAID_NO = ("the module above it was sharded with config.comm.block_regions off (it was on when this one was "
                 "sharded: set it once, before the first fully_shard)")


_OWN_FORWARD = ("its region never ran: the module has a forward of its own (module.forward = ..., set by the "
                "user or a library's hook), which its region's class does not call; see [Note: A block whose "
                "region never runs] in compile/region_reads.py")


_DYNAMIC_TRUE = ("compiled with every size dynamic (torch.compile(dynamic=True)), under which torch's "
                 "nested_compile_region fails; automatic dynamic shapes (dynamic=None, the default) keep the "
                 "regions; see [Note: No compile regions under dynamic=True] in compile/regions.py")


_UNTRACED = ("Dynamo ran the compiled model's forward without tracing it (an active dispatch mode such "
             "as FlopCounterMode, the recompile limit, a disabled or failed compile); see "
             "[Note: Untraced root frames] in compile/path.py")


_SKIPPED = ("Dynamo skipped its forward's frame and ran it as Python: a graph break inside a loop there (a "
            "block called in `for layer in self.layers`, say) cannot be resumed from, so every sharded module it "
            "calls communicates through the eager runtime. The break: {brk} (the module whose forward breaks "
            "names where). Remove that break, or call the blocks without a loop")


_UNDER_UNTRACED = "its root's forward ran untraced, and it with it: see the root's reason"


_EXTENSION = ("its parameters are gathered by the eager runtime, around its compiled code: in their all-gather "
              "extension's form (fsdp_pre_all_gather: torchao's float8 weights as float8), or copied from the CPU "
              "first (CPU offload, in a block compiled on its own: compile the whole model to copy them in its "
              "graph); see [Note: Extension groups run the eager runtime] in compile/path.py")


_SPLIT = ("a parameter of the root was traced in more than one Dynamo frame, so in-graph collectives "
          "would gather and reduce it twice; see [Note: Fallback decision rule]")


def _gathered_eagerly(group: FSDPParamGroup, path: str) -> bool:
    """Whether ``group``'s module ran outside the graphs because the eager
    runtime gathers it ([Note: Extension groups run the eager runtime] in
    compile/path.py). A whole-model graph gathers torchao's float8 weights
    (``casts_in_graph``) and offloaded shards (``copies_in_graph``) itself:
    such a module that fell back there did so at a graph break of its own,
    which explain() names instead."""
    if path == "eager":
        return group.gathers_eagerly or group.copies_in_graph
    return path == "fallback" and group.gathers_eagerly and not group.casts_in_graph


def _last_path(state: FSDPState) -> str:
    last = state.last_path()
    if last is not None:
        return "compiled" if last.compiled else "fallback" if last in (Path.FALLBACK, Path.UNTRACED) else "eager"
    group = state.param_group
    if group is not None and frames.was_traced(group.key):
        return "compiled"
    return "not run"


def _region_path(root: FSDPState) -> str:
    """[Note: A region's path is its graph's]
    A compile region's reads leave no record of their own: the root's graph
    ran them. A root that fell back because a graph break split its reads
    (its parameters gathered by the eager runtime: a tied embedding and head
    with a break between them) still ran its graphs, regions included, their
    collectives in them: the regions were compiled. A root frame Dynamo
    skipped whole ran its blocks' hooks eagerly, and they have records of
    their own. Said "fallback", with no reason, before. Tested by
    tests/test_hf_models.py::test_gpt2_tied_weights_split_by_a_break."""
    return "compiled" if root.last_path() is Path.FALLBACK else _last_path(root)


def _untraced_reason(module: nn.Module) -> str:
    """Why a module's frame ran untraced: the graph break that made Dynamo
    skip it, where one did (see [Note: Untraced root frames] in compile/path.py)."""
    base = getattr(type(module), "_fsdp_base_class", type(module))
    skipped = compat.skipped_frame_breaks(base.forward.__code__)
    return _SKIPPED.format(brk=skipped[0].splitlines()[0]) if skipped else _UNTRACED


def _break_reason(module: nn.Module) -> Optional[str]:
    """The graph break whose user stack runs through ``module``'s forward
    (its own class's: a region root's wraps it, compile/regions.py)."""
    code = getattr(type(module), "_fsdp_base_class", type(module)).forward.__code__
    last_line = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    for reason in reversed(torch._dynamo.utils.graph_break_reasons):
        for frame in reason.user_stack:
            if frame.filename == code.co_filename and code.co_firstlineno <= (frame.lineno or 0) <= last_line:
                return f"{reason.reason.splitlines()[0]} at {frame.filename}:{frame.lineno}"
    return None
