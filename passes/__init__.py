"""FX passes of compiled_fsdp (installed as ``compiled_fsdp.passes``).

Every pass has a plan/apply split, iterates in graph order, returns a report,
and leaves a graph without ``compiled_fsdp`` markers untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.fx as fx

from . import config
from .cast_gather import CastGatherReport, cast_before_gather
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
from .pipeline import PASSES, Observer, PipelineReport, run_passes
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
    "CastGatherReport",
    "cast_before_gather",
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
    "PASSES",
    "PipelineReport",
    "run_joint_passes",
    "run_passes",
    "tag_recompute",
]


@dataclasses.dataclass
class JointPassReport:
    has_markers: bool
    cast_gather: CastGatherReport | None = None
    lowering: LoweringReport | None = None
    recompute: RecomputeReport | None = None
    ran: tuple[str, ...] = ()  # the passes that ran, in order
    pipeline: Optional[PipelineReport] = None  # (their times and node counts)

    @property
    def changed(self) -> bool:
        return bool(
            (self.cast_gather and self.cast_gather.changed)
            or (self.lowering and self.lowering.changed)
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


def run_joint_passes(gm: fx.GraphModule, observe: Optional[Observer] = None) -> JointPassReport:
    """Runs the joint graph's passes on ``gm`` in place ([Note: One pass
    pipeline] in pipeline.py: float8 casts moved before their gathers,
    lowering with bucketing, then recompute
    tagging). A graph without markers is returned untouched. Scheduling runs
    later, on the partitioned graphs (see schedule.py)."""
    if not has_markers(gm.graph):
        return JointPassReport(has_markers=False)
    if observe is not None:
        observe("before", gm, None)
    done = run_passes("joint", gm, observe)
    return JointPassReport(has_markers=True, cast_gather=done.reports.get("cast_gather"),
                           lowering=done.reports.get("lowering"),
                           recompute=done.reports.get("recompute"), ran=tuple(done.ran), pipeline=done)
