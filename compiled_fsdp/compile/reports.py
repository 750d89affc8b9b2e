"""What the passes reported while compiling, on the compile session
(``install.SESSION.reports``): the joint and scheduling reports, the
recordings open, the observers (the debug dump) and the units ``explain()``
lists. The accessors are install.py's (``recording``, ``add_observer``,
``last_reports``, ...)."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx

__all__ = ["Partitioned", "Recording", "Reports"]

_MAX_REPORTS = 64


@dataclasses.dataclass
class Recording:
    """The reports of the passes that ran while ``recording()`` was open."""

    joint: list = dataclasses.field(default_factory=list)  # passes.JointPassReport
    schedule: list = dataclasses.field(default_factory=list)  # passes.ScheduleReport
    # passes.PipelineReport of every graph the passes ran on, joint and
    # partitioned alike: their seconds and node counts (benchmarks/depth.py)
    pipelines: list = dataclasses.field(default_factory=list)
    # ("forward" | "backward", passes.Timeline) of each scheduled graph that
    # calls compile regions, the calls expanded, in compile order (a nested
    # region's graph before its caller's): the step's prediction
    # (passes.region_step.predict_with_regions; benchmarks/emulated.py)
    region_steps: list = dataclasses.field(default_factory=list)


class Reports:
    """What the passes reported (the one owner of these records)."""

    def __init__(self, lock: Any) -> None:
        # (the compile session's lock, which its accessors hold too)
        self.lock = lock
        self.joint: collections.deque = collections.deque(maxlen=_MAX_REPORTS)
        self.schedule: collections.deque = collections.deque(maxlen=_MAX_REPORTS)
        self.recordings: list[Recording] = []
        # Observer(stage, graph_module, report, region=...): the debug dump's hook.
        self.observers: list[Callable[..., None]] = []
        # module_key -> {the parameters one graph read: that graph's unit lines},
        # for ``explain()``. A graph break splits a root's parameters over several
        # graphs; a recompile of a graph replaces its entry. Blocks compiled on
        # their own share ``ENTRY_KEY``.
        self.units: dict[int, dict[frozenset[int], tuple[str, ...]]] = {}

    def add_joint(self, report: Any, units_for_explain: bool = True) -> None:
        with self.lock:
            self.joint.append(report)
            for r in self.recordings:
                r.joint.append(report)
            if not units_for_explain:
                return
            units = report.lowering.units if report.lowering is not None else []
            for key in sorted({u.module_key for u in units}):
                mine = [u for u in units if u.module_key == key]
                params = frozenset(i for u in mine for i in u.param_indices)
                self.units.setdefault(key, {})[params] = tuple(u.describe() for u in mine)

    def add_pipeline(self, report: Any) -> None:
        with self.lock:
            for r in self.recordings:
                r.pipelines.append(report)

    def add_region_step(self, graph: str, timeline: Any) -> None:
        with self.lock:
            for r in self.recordings:
                r.region_steps.append((graph, timeline))

    def add_schedule(self, report: Any) -> None:
        with self.lock:
            self.schedule.append(report)
            for r in self.recordings:
                r.schedule.append(report)

    def notify(self, stage: str, gm: fx.GraphModule, report: Any, region: bool = False) -> None:
        """Shows a graph to the observers; ``region``: a compile region's
        graph (its joint graph, which regions.py's partitioner runs the passes
        on, or what the partitioner returns)."""
        for fn in list(self.observers):
            fn(stage, gm, report, region=region)


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """What observers get for a compile region's partitioned graph (stage
    ``"partition"``): which of the two it is."""

    graph: str  # "forward" | "backward"
