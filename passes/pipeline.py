"""The passes, as one named list run by one runner.

[Note: One pass pipeline]
Every graph pass is an entry of ``PASSES``: its name, the graphs it runs on
(``"joint"``: the forward+backward graph AOTAutograd hands
``joint_custom_pass``; ``"partitioned"``: each forward or backward graph
after the partitioner, in Inductor's post-grad pass) and the function that
plans and applies it, returning its report. ``run_passes`` runs them in list
order, and shows each graph to the observers (the debug dumps) after its
pass, or after the passes that amend it (``pin`` finishes ``schedule``); any of them is switched off by name with
``compiled_fsdp.passes.config.pipeline.disabled`` (part of Inductor's cache
key, as the overlap settings are). Its report says which ran, which were
off, and what each reported. The compile layer calls it for both kinds of
graph (compiled_fsdp/compile/install.py) and nothing else runs a pass.

Switching a pass off stays correct: without ``cast_gather`` a float8
weight is gathered in high precision and cast after the gather; without ``lowering`` the markers run
their eager implementations (one unbucketed collective per parameter read);
without ``recompute`` the partitioner saves gathered parameters for the
backward instead of gathering again; without ``schedule`` the partitioner's
order is kept; without ``pin`` Inductor may move the collectives again.
Tested by tests/test_passes_fx.py::test_pipeline_runs_by_name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal, Optional

import torch.fx as fx

from compiled_fsdp.core import compat

from . import config
from .cast_gather import CastGatherReport, cast_before_gather
from .collectives import gloo_gathers_by_work
from .graph import has_markers, none_from_regions
from .lowering import lower_markers
from .recompute import tag_recompute
from .schedule import schedule_graph

Stage = Literal["joint", "partitioned"]
# observe(pass name, graph module, its report): the debug dump's hook.
Observer = Callable[[str, fx.GraphModule, Optional[Any]], None]


@dataclasses.dataclass
class PipelineReport:
    """What one run of the pipeline did on one graph."""

    stage: Stage
    ran: list[str] = dataclasses.field(default_factory=list)
    disabled: list[str] = dataclasses.field(default_factory=list)
    reports: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Seconds each pass took, and the graph's node count before the first
    # and after the last: the passes' share of a compile (benchmarks/depth.py).
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    nodes: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    stages: tuple[Stage, ...]
    run: Callable[[fx.GraphModule, PipelineReport], Any]
    # Finishes the pass before it (the observers see that pass's graph after this one).
    amends: bool = False


def _lowering(gm: fx.GraphModule, done: PipelineReport) -> Any:
    # (a partitioned graph still holds markers only when no joint graph was
    # made: an inference graph; see [Note: Inference graphs] in install.py)
    return lower_markers(gm) if has_markers(gm.graph) else None


def _cast_gather(gm: fx.GraphModule, done: PipelineReport) -> Optional[CastGatherReport]:
    # (reported, and shown to the dumps, where the graph casts a gathered value to float8)
    report = cast_before_gather(gm)
    return report if report.moved or report.kept else None


def _pin(gm: fx.GraphModule, done: PipelineReport) -> Optional[str]:
    from .pin import pin_order  # (Inductor's control dependencies: loaded when first needed)

    schedule = done.reports.get("schedule")
    if schedule is None or not schedule.changed:
        return None
    # See [Note: Inductor's simple_overlap] in pin.py.
    both_ways = compat.SIMPLE_OVERLAP and config.overlap.own_order
    pin_order(gm.graph, both_ways=both_ways)
    return "both ways" if both_ways else "waits after their collectives"


PASSES: tuple[GraphPass, ...] = (
    GraphPass("cast_gather", ("joint",), _cast_gather),
    GraphPass("lowering", ("joint", "partitioned"), _lowering),
    GraphPass("recompute", ("joint",), lambda gm, done: tag_recompute(gm)),
    GraphPass("schedule", ("partitioned",), lambda gm, done: schedule_graph(gm.graph, config.overlap)),
    GraphPass("pin", ("partitioned",), _pin, amends=True),
)


def run_passes(stage: Stage, gm: fx.GraphModule, observe: Optional[Observer] = None) -> PipelineReport:
    """Runs the passes of ``stage`` on ``gm`` in place, in ``PASSES`` order,
    except those ``config.pipeline.disabled`` names. ``observe`` is called
    after each pass that ran."""
    names = {p.name for p in PASSES}
    unknown = sorted(set(config.pipeline.disabled) - names)
    if unknown:
        raise ValueError(f"compiled_fsdp: config.pipeline.disabled names no pass: {unknown}; "
                         f"the passes are {[p.name for p in PASSES]}")
    done = PipelineReport(stage)
    before = len(gm.graph.nodes)
    if none_from_regions(gm):  # (not a pass: the graph runs only with it)
        gm.recompile()
    if stage == "partitioned" and gloo_gathers_by_work(gm.graph):  # (nor this: gloo runs it safely only so)
        gm.recompile()
    shown: list[tuple[str, Any]] = []  # (observed once the passes amending it ran)

    def show() -> None:
        for name, report in shown:
            if observe is not None:
                observe(name, gm, report)
        shown.clear()

    for p in PASSES:
        if stage not in p.stages:
            continue
        if p.name in config.pipeline.disabled:
            done.disabled.append(p.name)
            continue
        if not p.amends:
            show()
        start = time.perf_counter()
        report = p.run(gm, done)
        done.seconds[p.name] = time.perf_counter() - start
        done.ran.append(p.name)
        done.reports[p.name] = report
        if report is not None and not p.amends:
            shown.append((p.name, report))
    show()
    done.nodes = (before, len(gm.graph.nodes))
    return done
