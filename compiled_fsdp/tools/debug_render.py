"""What the dump writes: per-graph records, headers that explain each file,
the pass reports, the index and the README of a dump directory."""
from __future__ import annotations

import dataclasses
import os
import pprint
from typing import Any, Optional

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compiled_fsdp.compile import install
from compiled_fsdp.core import registry
from compiled_fsdp.core.marker import ENTRY_KEY, NEXT_KEY
from compiled_fsdp.passes.graph import chain_tag, is_reduce_grad, is_unshard, region_calls
from compiled_fsdp.passes.timeline import collective_bytes, communicates, is_collective
from compiled_fsdp.tools.debug_timeline import bucket_name, collective_label

__all__ = ["GraphRecord", "count_region_calls", "graph_stats", "module_names", "render_graph", "write_index",
           "write_readme"]


@dataclasses.dataclass
class GraphRecord:
    """Everything the dump knows about one compiled graph (one compile id)."""

    compile_id: str
    dir: str
    frame: str = "?"
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> what it is
    failures: list[str] = dataclasses.field(default_factory=list)
    graph_breaks: list[str] = dataclasses.field(default_factory=list)
    stages: list[str] = dataclasses.field(default_factory=list)
    pass_reports: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    stats: Optional[dict[str, Any]] = None
    dynamo_graphs: int = 0
    inductor_outputs: int = 0
    # The compile regions of this compile ([Note: A region's graphs in a dump]
    # in debug.py), each a record of its own (``region``), and how many times
    # the root's graph calls it.
    regions: list["GraphRecord"] = dataclasses.field(default_factory=list)
    region: bool = False
    calls: int = 0
    # id of each region's forward graph (as its partitioner returned it) -> its record
    region_forwards: dict[int, "GraphRecord"] = dataclasses.field(default_factory=dict)


def module_names(region: bool = False) -> dict[int, str]:
    """module_key (the n-th ``fully_shard`` call) -> ``fqn (Class)``; the root is
    ``<root>``; ``region``: for a compile region's graph."""
    # See [Note: Blocks compiled on their own] in compile/entry.py.
    out = {ENTRY_KEY: "the region's block" if region else
                      "the module this frame was compiled for (a block compiled on its own; every identical "
                      "block runs this graph)",
           # See [Note: Gathers handed to the next block's graph] in compile/entry.py.
           NEXT_KEY: "the module after it (its gather handed over, its gradient reduced here)"}
    for g in registry.owners():
        out[g.key] = f"{g.label} ({g.name})"
    return out


def graph_stats(gm: fx.GraphModule, names: dict[int, str]) -> dict[str, Any]:
    """Collectives of a joint graph; a gather tagged MUST_RECOMPUTE runs again in backward."""
    kinds: dict[str, int] = {}
    total_bytes = 0
    modules: set[str] = set()
    for n in gm.graph.nodes:
        if not is_collective(n) or not communicates(n):
            continue
        kind = collective_label(n)
        if is_unshard(n) or is_reduce_grad(n):
            kind = f"unlowered {kind} marker"
        recomputed = n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
        backward_only = n.meta.get("partitioner_tag") == "must_be_in_backward"
        runs = 2 if recomputed and not backward_only else 1
        kinds[kind] = kinds.get(kind, 0) + runs
        total_bytes += runs * collective_bytes(n)
        tag = chain_tag(n)
        if tag is not None:
            modules.add(bucket_name(tag, names))
    return {"kinds": kinds, "bytes": total_bytes, "buckets": sorted(modules)}


def count_region_calls(rec: GraphRecord, gm: fx.GraphModule) -> None:
    """Sets each region's ``calls``: how many times the root's joint graph
    ``gm`` calls its forward, each call's subgraph named by the identifier
    its first call's graph module has in ``rec.region_forwards``."""
    nodes = list(gm.graph.nodes)
    region_of: dict[str, Optional[GraphRecord]] = {}
    calls: dict[int, int] = {}
    for i in region_calls(gm.graph):
        call = nodes[i]
        name = str(call.args[1])
        if name not in region_of:
            body = getattr(gm, str(getattr(call.args[0], "target", "")), None)
            region_of[name] = rec.region_forwards.get(id(body))
        region = region_of[name]
        if region is not None:  # (a backward's call: its body is no region's forward)
            calls[id(region)] = calls.get(id(region), 0) + 1
    for region in rec.regions:
        region.calls = calls.get(id(region), 0)


def _legend(names: dict[int, str]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in sorted(names.items())) or "none"


def render_graph(what: str, rec: GraphRecord, rank: int, body: str) -> str:
    """A header that a first-time reader needs, then the graph code."""
    return (
        f"# {what}\n"
        f"# graph {rec.compile_id} (frame/compile: a recompile of the same frame gets a new second number), "
        f"rank {rank}; rank{rank}/index.md says which Python function it came from\n"
        "# Reading it: torch.ops.compiled_fsdp.unshard(shard, full_shape, group, world_size, module_key, "
        "param_index, local_rows, reshard_after_forward, reduce_group, ..., outermost)\n"
        "#   marks a read of a sharded parameter, reduce_grad(...) its gradient; our passes replace them with one\n"
        "#   bucketed _c10d_functional.all_gather_into_tensor / reduce_scatter_tensor (on gloo:\n"
        "#   compiled_fsdp.all_gather_by_work / all_to_all_single + sum) (+ wait_tensor) per unit (a layer:\n"
        "#   see the index).\n"
        f"# module_key -> fully sharded module: {_legend(module_names(rec.region))}\n\n"
        + body
    )


def _render_report(obj: Any, names: dict[int, str]) -> str:
    if dataclasses.is_dataclass(obj):
        text = pprint.pformat(dataclasses.asdict(obj), width=110, sort_dicts=False)
    else:
        text = repr(obj)
    return text + f"\n  (module_key legend: {_legend(names)})"


def _joint_report(rec: GraphRecord) -> Any:
    """The ``last_reports()`` entry that holds the reports this graph's observers saw."""
    mine = {id(r) for _, r in rec.pass_reports}
    for report in reversed(install.last_reports()):
        if dataclasses.is_dataclass(report) and any(
            id(getattr(report, f.name)) in mine for f in dataclasses.fields(report)
        ):
            return report
    return None


def _write_reports(rec: GraphRecord) -> None:
    if not rec.pass_reports:
        return
    names = module_names(rec.region)
    joint = _joint_report(rec)
    parts = [f"# What each compiled_fsdp pass did in graph {rec.compile_id}\n"]
    if joint is not None:
        parts.append(f"summary: {joint.summary()}\n")
    for stage, report in rec.pass_reports:
        parts.append(f"## pass '{stage}'\n{_render_report(report, names)}\n")
    with open(os.path.join(rec.dir, "50_pass_reports.txt"), "w") as f:
        f.write("\n".join(parts))
    rec.files["50_pass_reports.txt"] = "what each of our passes did (buckets, recompute tags), with summary()"


def _collectives(rec: GraphRecord, per: str) -> str:
    st = rec.stats
    if st is None:
        return "no compiled_fsdp collectives (no markers: the passes did not run)"
    kinds = ", ".join(f"{v} {k}" for k, v in st["kinds"].items()) or "none"
    return (f"collectives per {per}: {sum(st['kinds'].values())} ({kinds}); "
            f"{st['bytes'] / 1024:.1f} KiB of unsharded data; buckets: {', '.join(st['buckets']) or '-'}")


def _index_line(rec: GraphRecord) -> str:
    n_breaks = len(rec.graph_breaks)
    breaks = f"{n_breaks} graph break(s) (see 00_graph_breaks.txt)" if n_breaks else "0 graph breaks"
    regions = f"; {len(rec.regions)} compile region(s), below" if rec.regions else ""
    return f"- **graph {rec.compile_id}** `{rec.frame}` — {_collectives(rec, 'step')}; {breaks}{regions}"


def _region_line(rec: GraphRecord) -> str:
    return (f"  - **{rec.compile_id}**: a compile region's body, called {rec.calls} time(s) a step by the graph "
            f"above (once per identical block; [Note: Blocks as compile regions]) — {_collectives(rec, 'call')}")


def _unit_lines(rec: GraphRecord, names: dict[int, str]) -> list[str]:
    """The units the lowering cut each application into ([Note: Units] in
    passes/units.py); why each is what it is is in 50_pass_reports.txt. A
    region's units name the block it was traced for (``ENTRY_KEY``), not
    ``names``' legend."""
    joint = _joint_report(rec)
    units = joint.lowering.units if joint is not None and joint.lowering is not None else []
    return [f"  - {'' if rec.region else f'{names.get(u.module_key, u.module_key)} '}{u.describe()}" for u in units]


def _file_lines(rec: GraphRecord, folder: str, indent: str) -> list[str]:
    lines = [f"{indent}- `{folder}/{name}`: {rec.files[name]}" for name in sorted(rec.files)]
    return lines + [f"{indent}- FAILED (dump only; training went on): {failure}" for failure in rec.failures]


def write_index(rank_dir: str, rank: int, records: list[GraphRecord]) -> None:
    os.makedirs(rank_dir, exist_ok=True)
    names = module_names()
    lines = [f"# compiled_fsdp dump, rank {rank}", "",
             "One line per compiled graph, then its files. Start with the README.md one level up.", ""]
    for rec in sorted(records, key=lambda r: r.compile_id):
        if not rec.files and not rec.failures:
            continue
        _write_reports(rec)
        lines.append(_index_line(rec))
        lines.extend(_unit_lines(rec, names))
        if not rec.inductor_outputs and rec.dynamo_graphs:
            lines.append("  - (no Inductor output code: the backend was not Inductor)")
        lines.extend(_file_lines(rec, os.path.basename(rec.dir), "  "))
        for region in rec.regions:
            _write_reports(region)
            lines.append(_region_line(region))
            lines.extend("  " + line for line in _unit_lines(region, names))
            lines.extend(_file_lines(region, f"{os.path.basename(rec.dir)}/{os.path.basename(region.dir)}", "    "))
        lines.append("")
    with open(os.path.join(rank_dir, "index.md"), "w") as f:
        f.write("\n".join(lines))


_README = """# A compiled_fsdp graph dump

compiled_fsdp shards every parameter across ranks (FSDP / ZeRO-3). Under
torch.compile, a read of a sharded parameter becomes a marker op, and our FX
passes replace the markers with one bucketed all-gather per unit (forward) and
one bucketed reduce-scatter of its gradients (backward). A unit is a layer the
passes chose from the graph (see [Note: Units] in passes/units.py): one
`fully_shard(model)` is gathered layer by layer. The index lists the units.

Layout: `rank<r>/index.md` lists, per compiled graph, what was compiled and
how many collectives it runs; `rank<r>/graph_<frame>_<compile>/` holds:

- `00_graph_breaks.txt`: why Dynamo split the Python code there (only if it did)
- `01_dynamo_graph.py`: the FX graph Dynamo traced from Python
- `02_bytecode_decompiled.py`: the bytecode Dynamo generated, decompiled by depyf
- `10_joint_before_passes.py`, `11_joint_after_<pass>.py`, ...: the joint
  forward+backward graph before and after each of our passes, in order
- `20_forward.py`, `21_backward.py`: the graphs after the partitioner split the
  joint graph (with reshard-after-forward, all-gathers appear again in backward)
- `30_inductor_forward.py`, `31_inductor_backward.py`: Inductor's output code
  (only with the Inductor backend)
- `40_timeline.json`: a *predicted* timeline (the scheduling pass's cost
  model, not measured), compute and communication on separate tracks; open it in
  https://ui.perfetto.dev
- `50_pass_reports.txt`: what each pass did
- `region_<k>/`: under `torch.compile(model)` each distinct block is a
  compile region, traced and compiled once and called for every identical
  block: its joint graph before and after our passes, its forward and
  backward graphs as its partitioner returned them, its own predicted
  timeline and reports. The root's graph calls it (`invoke_subgraph`) and issues each
  block's gather ahead of its call (`issue_ahead`); the root's timeline
  prices a call only by the bytes it reads and writes, so the compute and
  collectives inside a call are in the region's own timeline.

`module_key` n is the n-th `fully_shard` call of the program; every file's
header maps the keys to module names. A graph without markers (e.g. a model
that was not fully sharded) shows no joint-graph files.
"""


def write_readme(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "README.md")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(_README)
