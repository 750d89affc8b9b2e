"""FX passes of compiled_fsdp (installed as ``compiled_fsdp.passes``).

Every pass has a plan/apply split, iterates in graph order, returns a report,
and leaves a graph without ``compiled_fsdp`` markers untouched.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ._graph import has_markers
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

__all__ = [
    "BucketReport",
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
            f"buckets, {len(low.skipped)} skipped; recompute on modules {rec.modules_recompute}, "
            f"save on modules {rec.modules_save}"
        )


def run_joint_passes(gm: fx.GraphModule) -> JointPassReport:
    """Runs every joint-graph pass on ``gm`` in place: lowering, then
    recompute tagging. A graph without markers is returned untouched."""
    if not has_markers(gm.graph):
        return JointPassReport(has_markers=False)
    lowering = lower_markers(gm)
    recompute = tag_recompute(gm)
    return JointPassReport(has_markers=True, lowering=lowering, recompute=recompute)
