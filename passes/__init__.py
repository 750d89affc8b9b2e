"""FX passes of compiled_fsdp (installed as ``compiled_fsdp.passes``).

Every pass has a plan/apply split, iterates in graph order, returns a report,
and leaves a graph without ``compiled_fsdp`` markers untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch.fx as fx

from . import config
from .cost_model import CostModel
from .graph import has_markers
from .lowering import (
    BucketReport,
    LoweringPlan,
    LoweringReport,
    apply_lowering,
    lower_markers,
    plan_lowering,
)
from .recompute import (
    FSDP_AC_GRAPH_ID,
    RecomputeReport,
    apply_recompute_tags,
    plan_recompute_tags,
    tag_recompute,
)
from .schedule import (
    Move,
    SchedulePlan,
    ScheduleReport,
    apply_schedule,
    plan_schedule,
    schedule_graph,
)
from .timeline import CommEvent, ModuleSpan, Timeline

__all__ = [
    "BucketReport",
    "CommEvent",
    "CostModel",
    "ModuleSpan",
    "Move",
    "SchedulePlan",
    "ScheduleReport",
    "Timeline",
    "apply_schedule",
    "config",
    "plan_schedule",
    "schedule_graph",
    "FSDP_AC_GRAPH_ID",
    "JointPassReport",
    "LoweringPlan",
    "LoweringReport",
    "RecomputeReport",
    "apply_lowering",
    "apply_recompute_tags",
    "has_markers",
    "lower_markers",
    "plan_lowering",
    "plan_recompute_tags",
    "Observer",
    "run_joint_passes",
    "tag_recompute",
]


@dataclasses.dataclass
class JointPassReport:
    has_markers: bool
    lowering: LoweringReport | None = None
    recompute: RecomputeReport | None = None

    @property
    def changed(self) -> bool:
        return bool(
            (self.lowering and self.lowering.changed)
            or (self.recompute and self.recompute.changed)
        )

    def summary(self) -> str:
        if not self.has_markers:
            return "no compiled_fsdp markers"
        low = self.lowering or LoweringReport()
        rec = self.recompute or RecomputeReport()
        return (
            f"{low.count('gather')} all-gather buckets, {low.count('reduce')} reduce-scatter "
            f"buckets, {len(low.skipped)} skipped; recompute buckets {rec.buckets_recompute}, "
            f"saved buckets {rec.buckets_save}"
        )


# observe(stage, graph_module, report_or_None): called before the first pass
# ("before") and after each pass (its name) -- the debug dump's hook.
Observer = Callable[[str, fx.GraphModule, Optional[Any]], None]


def run_joint_passes(gm: fx.GraphModule, observe: Optional[Observer] = None) -> JointPassReport:
    """Runs every joint-graph pass on ``gm`` in place: lowering (with
    bucketing of small modules), then recompute tagging. A graph without
    markers is returned untouched. Scheduling runs later, on the partitioned
    graphs (see schedule.py)."""
    if not has_markers(gm.graph):
        return JointPassReport(has_markers=False)
    if observe is not None:
        observe("before", gm, None)
    lowering = lower_markers(gm)
    if observe is not None:
        observe("lowering", gm, lowering)
    recompute = tag_recompute(gm)
    if observe is not None:
        observe("recompute", gm, recompute)
    return JointPassReport(has_markers=True, lowering=lowering, recompute=recompute)
