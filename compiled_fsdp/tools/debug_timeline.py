"""A predicted timeline of one compiled training step, as a Chrome trace.

[Note: Predicted timeline]
The dump predicts a timeline from the joint graph *after* our passes, in
graph order, with the passes' one timeline model (``simulate(...,
joint=True, foreign=True)`` in passes/timeline.py: the scheduling pass's cost
model, one compute track and one communication track, re-gathers in backward
for resharded chains, every collective priced). This module only formats it:
one slice per costed node, named after its module, bucket and op, and one
per phase; the trace opens in https://ui.perfetto.dev.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from compiled_fsdp.core.marker import ReduceGrad, Unshard
from compiled_fsdp.passes.cost_model import CostModel
from compiled_fsdp.passes.graph import ChainTag, chain_tag, is_reduce_grad, is_unshard
from compiled_fsdp.passes.timeline import ISSUE_AHEAD, REDUCE_LATER, REGATHER, Step, collective_kind, simulate

__all__ = ["bucket_name", "chrome_trace", "collective_label", "timeline_slices"]

COMPUTE, COMM, PHASE = "compute", "communication", "phase"
_TRACKS = {PHASE: 0, COMPUTE: 1, COMM: 2}


# What the ops that run their collective inside them are ([Note: Collectives
# inside an op] in passes/timeline.py), for the index and the trace.
_IN_OP = {REGATHER: "all-gather (regather: the one issued ahead, else gathered here)",
          ISSUE_AHEAD: "all-gather issued ahead for a region (its regather takes it)",
          REDUCE_LATER: "reduce-scatter waited after the graph (reduce_later)"}


def collective_label(node: fx.Node) -> str:
    """"all-gather", "reduce-scatter" (markers and our gloo all-to-all included),
    what an op running its own collective is, or, for a collective we do not
    know, the op's name."""
    if node.target in _IN_OP:
        return _IN_OP[node.target]
    kind = collective_kind(node)
    return {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce"}.get(kind, kind)


def bucket_name(tag: ChainTag, module_names: dict[int, str]) -> str:
    """``fqn (Class) unit u`` (``+ k more`` when the bucketing merged units)."""
    name = module_names.get(tag.module_key, f"module_key {tag.module_key}")
    more = len(tag.units) - 1
    return f"{name} unit {tag.unit}" + (f" + {more} more" if more else "")


def _label(node: fx.Node, module_names: dict[int, str]) -> dict[str, Any]:
    args: dict[str, Any] = {"node": node.name, "op": str(node.target)}
    tag = chain_tag(node)
    if tag is not None:
        args["module"] = bucket_name(tag, module_names)
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack and "module" not in args:
        args["module"] = list(stack.values())[-1][0]
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        args["shape"] = list(val.shape)
    return args


def _name(step: Step, node: fx.Node, module_names: dict[int, str]) -> str:
    if step.kind == "wait":
        return "wait (exposed communication)"
    if step.track == COMPUTE:
        return str(getattr(node.target, "__name__", node.target))
    kind = collective_label(node)
    tag = chain_tag(node)
    if tag is not None:
        name = f"{kind} {bucket_name(tag, module_names)}"
        return f"re-gather {bucket_name(tag, module_names)} (reshard after forward)" if step.regather else name
    if is_unshard(node) or is_reduce_grad(node):
        key = (Unshard if is_unshard(node) else ReduceGrad).bind(node.args, dict(node.kwargs)).module_key
        return f"{kind} (unbucketed marker) {module_names.get(key, '')}".strip()
    return kind


def timeline_slices(gm: fx.GraphModule, module_names: dict[int, str]) -> list[dict[str, Any]]:
    """The predicted timeline of ``gm`` (a joint graph after our passes), one
    plain slice per costed node and per phase: name, track, start and
    duration in microseconds, args. See [Note: Predicted timeline]."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    tl = simulate(list(graph.nodes), CostModel.for_graph(graph), joint=True, foreign=True)
    out = [{"name": name, "track": PHASE, "start_us": start * 1e6, "dur_us": (end - start) * 1e6, "args": {}}
           for name, start, end in tl.phases]
    for step in tl.steps:
        node = nodes[step.node]
        args = _label(node, module_names)
        if step.track == COMM:
            args["bytes"] = step.bytes
        out.append({"name": _name(step, node, module_names), "track": step.track,
                    "start_us": step.start_s * 1e6, "dur_us": step.dur_s * 1e6, "args": args})
    return out


def chrome_trace(slices: list[dict[str, Any]], process_name: str, pid: int = 0) -> dict[str, Any]:
    """Chrome-trace JSON (opens in Perfetto / chrome://tracing): one track per kind."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}},
    ]
    for track, tid in _TRACKS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for s in slices:
        events.append({
            "name": s["name"], "cat": s["track"], "ph": "X", "pid": pid, "tid": _TRACKS[s["track"]],
            "ts": round(s["start_us"], 3), "dur": round(max(s["dur_us"], 0.001), 3),
            "args": s["args"],
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"note": "predicted from graph order with the passes' cost model; not measured"}}
