"""Installs the compiled_fsdp joint-graph passes into torch.compile.

[Note: Where the passes hook in]
``torch._functorch.config.joint_custom_pass`` is called by AOTAutograd on
the joint (forward + backward) graph before partitioning, for every
aot_autograd backend: ``aot_eager`` and Inductor alike. It is the one hook
that sees both the gathers and the reduce-scatters before the partitioner
decides what to save, so lowering and recompute tagging both run there.

[Note: Inference graphs]
``joint_custom_pass`` is *not* called for inference graphs (a frame traced
under ``torch.no_grad()`` or with no parameter requiring grad): AOTAutograd
compiles them without a joint. Under Inductor the post-grad pass below still
sees them, so it lowers their markers there (one bucketed all-gather per
unit, then scheduling as for a forward graph). Under ``aot_eager`` nothing
after Dynamo sees an inference graph, so its markers run their eager
per-parameter collectives: correct, unbucketed, and counted as
``unbucketed_all_gather`` by ``collective_counts()``.

``install()`` wraps whatever pass the user already configured: ours runs
first (it removes our markers, which a user pass would not understand), then
theirs. It is idempotent. On a graph without markers ours does nothing.

[Note: AOTAutograd cache]
The AOTAutograd cache key (Inductor only; ``aot_eager`` does not cache) is
computed from the Dynamo graph, which holds the markers, and does not include
``joint_custom_pass`` (torch 2.13 lists it in ``_save_config_ignore``). On a
cache hit the joint pass does not run at all: the cached artifact already
holds the lowered graph, and ``last_reports()`` stays empty for that compile.
Measured: a second process compiling the same model hits the cache, gets the
same numerics, and records no report. A change to the passes would therefore
be served stale artifacts. To key the cache on our code, ``install()`` also
appends a no-op ``CustomGraphPass`` to Inductor's
``post_grad_custom_post_pass`` (a tuple is accepted there) whose ``uuid()``
hashes the source files of the passes; Inductor puts that uuid into both the
FX-graph and the AOTAutograd cache keys. Tests that read reports should
still disable the cache (``torch._functorch.config.enable_autograd_cache =
False``) or use a fresh ``TORCHINDUCTOR_CACHE_DIR``.

[Note: Scheduling under Inductor]
The same ``_SchedulePass`` is the scheduling pass: Inductor calls it on the
partitioned forward and backward graphs after its own post-grad passes, and
its uuid also hashes ``passes.config.overlap`` (the knobs change the output).
Inductor keeps the relative order of collectives (its scheduler chains each
to the previous one) but its default ``reorder_for_peak_memory`` moves waits
back next to their collectives; ``pin_order`` turns the schedule into control
dependencies it must respect (see [Note: Inductor reorders for peak memory]
in passes/pin.py). Inductor's opt-in ``reorder_for_compute_comm_overlap``
and overlap scheduling (off by default) import triton and fail on CPU; we
leave them off. Under ``aot_eager`` there is no
post-partition hook (see [Note: Where scheduling runs] in passes/schedule.py):
the partitioner's order runs. ``last_schedule_reports()`` returns what the
pass did, with the predicted timelines (the debug dump reads them).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

# Importing _ops registers the marker ops, so any graph the passes see runs.
import compiled_fsdp.core.ops  # noqa: F401
from compiled_fsdp.compile import frames as _fallback
from compiled_fsdp.core import compat
from compiled_fsdp.tools.explain import record_units
from compiled_fsdp.passes import JointPassReport, Observer, has_markers, lower_markers, run_joint_passes
from compiled_fsdp import config as comm_config
from compiled_fsdp.passes import config as passes_config
from compiled_fsdp.passes.pin import pin_order
from compiled_fsdp.passes.schedule import ScheduleReport, schedule_graph

__all__ = [
    "add_observer",
    "clear_reports",
    "install",
    "is_installed",
    "last_reports",
    "last_schedule_reports",
    "remove_observer",
    "uninstall",
]

_MAX_REPORTS = 64
_reports: collections.deque[JointPassReport] = collections.deque(maxlen=_MAX_REPORTS)
_schedule_reports: collections.deque[ScheduleReport] = collections.deque(maxlen=_MAX_REPORTS)
_lock = threading.Lock()
_observers: list["Observer"] = []

JointPass = Callable[[fx.GraphModule, Any], fx.GraphModule]


class _CompiledFSDPJointPass:
    """The callable installed as ``joint_custom_pass``; composes with the
    pass that was there before."""

    def __init__(self, inner: JointPass | None) -> None:
        self.inner = inner

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        report = run_joint_passes(gm, _notify if _observers else None)
        if report.has_markers:
            with _lock:
                _reports.append(report)
            _record_units(report)
        if self.inner is not None:
            gm = self.inner(gm, joint_inputs)
        return gm

    def __repr__(self) -> str:
        return f"compiled_fsdp joint pass (then {self.inner!r})"


def _record_units(report: JointPassReport) -> None:
    """Hands the units to ``explain()`` ([Note: Units] in passes/units.py)."""
    units = report.lowering.units if report.lowering is not None else []
    for key in sorted({u.module_key for u in units}):
        mine = [u for u in units if u.module_key == key]
        record_units(key, frozenset(i for u in mine for i in u.param_indices),
                     tuple(u.describe() for u in mine))


def _source_files() -> tuple[str, ...]:
    import compiled_fsdp.core.layout as layout_mod
    import compiled_fsdp.core.ops as ops_mod
    import compiled_fsdp.core.reduce as reduce_mod
    import compiled_fsdp.passes as passes_mod

    pdir = os.path.dirname(os.path.abspath(passes_mod.__file__))
    files = [os.path.join(pdir, f) for f in sorted(os.listdir(pdir)) if f.endswith(".py")]
    # The lowering emits the layout and the gloo reduce of these runtime modules.
    shared = (layout_mod.__file__, reduce_mod.__file__)
    return (os.path.abspath(__file__), os.path.abspath(ops_mod.__file__),
            *(os.path.abspath(f) for f in shared), *files)


class _SchedulePass(CustomGraphPass):
    """Post-grad pass: schedules the partitioned graphs (see [Note: Scheduling
    under Inductor]); its uuid puts our passes' source and the overlap config
    into Inductor's cache keys (see [Note: AOTAutograd cache])."""

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is not None and has_markers(graph):  # See [Note: Inference graphs].
            lowering = lower_markers(gm)
            with _lock:
                _reports.append(JointPassReport(has_markers=True, lowering=lowering))
            if _observers:
                _notify("lowering", gm, lowering)
        report = schedule_graph(graph, passes_config.overlap)
        if report.changed:
            pin_order(graph, both_ways=compat.SIMPLE_OVERLAP and passes_config.overlap.own_order)
        if report.graph != "none":
            with _lock:
                _schedule_reports.append(report)
            if _observers and graph.owning_module is not None:
                _notify("schedule", graph.owning_module, report)

    def uuid(self) -> bytes:
        return get_hash_for_files(
            _source_files(), "compiled_fsdp" + repr(passes_config.overlap) + repr(comm_config.comm)
        )


def _install_schedule_pass() -> None:
    passes = compat.post_grad_passes(inductor_config.post_grad_custom_post_pass)
    if any(isinstance(p, _SchedulePass) for p in passes):
        return
    inductor_config.post_grad_custom_post_pass = compat.post_grad_value((*passes, _SchedulePass()))


def install() -> None:
    """Installs the joint pass and the compile callbacks (idempotent). Called by ``fully_shard``."""
    with _lock:
        _fallback.arm_compile_callbacks()  # see [Note: Agreeing on collectives] in _divergence.py
        _install_schedule_pass()
        current = functorch_config.joint_custom_pass
        if isinstance(current, _CompiledFSDPJointPass):
            return
        functorch_config.joint_custom_pass = _CompiledFSDPJointPass(
            current if callable(current) else None
        )


def uninstall() -> None:
    """Restores the passes that were set before ``install()`` (if ours is
    still the installed one)."""
    with _lock:
        _fallback.disarm_compile_callbacks()
        current = functorch_config.joint_custom_pass
        if isinstance(current, _CompiledFSDPJointPass):
            functorch_config.joint_custom_pass = current.inner
        post = compat.post_grad_passes(inductor_config.post_grad_custom_post_pass)
        rest = tuple(p for p in post if not isinstance(p, _SchedulePass))
        inductor_config.post_grad_custom_post_pass = compat.post_grad_value(rest)


def add_observer(fn: Observer) -> None:
    """Call ``fn(stage, gm, report)`` around every joint pass (see ``run_joint_passes``)."""
    with _lock:
        _observers.append(fn)


def remove_observer(fn: Observer) -> None:
    with _lock:
        if fn in _observers:
            _observers.remove(fn)


def _notify(stage: str, gm: fx.GraphModule, report: Any) -> None:
    for fn in list(_observers):
        fn(stage, gm, report)


def is_installed() -> bool:
    return isinstance(functorch_config.joint_custom_pass, _CompiledFSDPJointPass)


def last_reports() -> list[JointPassReport]:
    """Reports of the most recent joint-pass runs that saw markers, oldest
    first (bounded)."""
    with _lock:
        return list(_reports)


def last_schedule_reports() -> list[ScheduleReport]:
    """Reports of the most recent scheduling runs on graphs holding the
    passes' collectives (forward and backward, oldest first, bounded). Each
    has ``before``/``after`` predicted timelines; ``as_dict()`` gives plain
    dicts (seconds from the graph's start)."""
    with _lock:
        return list(_schedule_reports)


def clear_reports() -> None:
    with _lock:
        _reports.clear()
        _schedule_reports.clear()

