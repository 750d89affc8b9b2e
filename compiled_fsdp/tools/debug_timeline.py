"""A predicted timeline of one compiled training step, as a Chrome trace.

[Note: Predicted timeline]
The dump predicts a timeline from the joint graph *after* our passes, in
graph order, with the scheduling pass's cost model (``passes/cost_model.py``:
FLOPs and bytes per node, calibrated alpha-beta per collective). Two tracks, as a runtime with one compute stream and one
communication stream would run it:

* a collective (``_c10d_functional.*`` but ``wait_tensor``) starts when the
  compute track reaches it *and* the communication track is free;
* ``wait_tensor`` blocks the compute track until its collective is done (the
  gap is exposed communication); every other op runs on the compute track.

Forward and backward are told apart as the partitioner does: a node that
depends on a ``tangents_*`` input is backward. A gather chain tagged
``MUST_RECOMPUTE`` (reshard after forward) runs again in backward; the
timeline issues that re-gather right before the first backward node that
reads the chain. View ops cost nothing and are left out.

The timeline is a plain list of ``Slice``s, and ``chrome_trace`` only
formats it: a schedule report with real estimates replaces
``estimate_timeline`` without touching the writer.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from compiled_fsdp.passes._graph import ChainTag, chain_tag, is_reduce_grad, is_unshard
from compiled_fsdp.passes.cost_model import A2A, CostModel, tensor_bytes

__all__ = ["Slice", "chrome_trace", "collective_bytes", "estimate_timeline", "is_collective"]

COMPUTE, COMM, PHASE = "compute", "communication", "phase"
_TRACKS = {PHASE: 0, COMPUTE: 1, COMM: 2}

aten = torch.ops.aten
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.slice.Tensor,
    aten.select.int, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.split.Tensor,
    aten.split_with_sizes.default, aten.alias.default, aten.detach.default,
}


@dataclasses.dataclass
class Slice:
    name: str
    track: str  # COMPUTE | COMM | PHASE
    start_us: float
    dur_us: float
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


def is_collective(node: fx.Node) -> bool:
    """A collective that moves data (not its wait), ours or a leftover marker."""
    if node.op != "call_function":
        return False
    if is_unshard(node) or is_reduce_grad(node):
        return True
    ns = getattr(node.target, "namespace", None)
    return ns == "_c10d_functional" and "wait_tensor" not in str(node.target)


def _is_reduce(node: fx.Node) -> bool:
    """A reduce-scatter, a reduce marker, or our all-to-all reduce (gloo; see
    [Note: Reduce-scatter on gloo] in compiled_fsdp/_reduce.py)."""
    return ("reduce_scatter" in str(node.target) or is_reduce_grad(node)
            or (node.target is A2A and chain_tag(node) is not None))


def collective_bytes(node: fx.Node) -> int:
    """Bytes of the full (unsharded) side: a gather's output, a reduce-scatter's input."""
    if _is_reduce(node):
        src = node.args[0]
        return tensor_bytes(src.meta.get("val")) if isinstance(src, fx.Node) else 0
    return tensor_bytes(node.meta.get("val"))


def _world_size(node: fx.Node) -> int:
    for a in node.args[1:]:
        if isinstance(a, int) and not isinstance(a, bool) and a > 1:
            return a
    return 2


def _comm_us(node: fx.Node, cost: CostModel) -> float:
    """A lowered bucket costs what the scheduling pass estimates; a leftover marker
    (one parameter) or a collective we do not own is priced like an all-gather or
    reduce-scatter of its bytes."""
    seconds = cost.collective_time(node)
    if not seconds:
        kind = "reduce_scatter" if _is_reduce(node) else "all_gather"
        seconds = cost.comm_time(kind, collective_bytes(node), _world_size(node))
    return seconds * 1e6


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    bw: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in bw for a in n.all_input_nodes):
            bw.add(n)
    return bw


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


def estimate_timeline(
    gm: fx.GraphModule, module_names: dict[int, str]
) -> list[Slice]:
    """See [Note: Predicted timeline]."""
    graph = gm.graph
    cost = CostModel.for_graph(graph)
    backward = _backward_nodes(graph)
    slices: list[Slice] = []
    t_compute = t_comm = 0.0
    done_at: dict[fx.Node, float] = {}  # collective -> when its data is there
    regathered: set[ChainTag] = set()
    phase_start, phase = 0.0, "forward"

    def issue(node: fx.Node, name: str) -> None:
        nonlocal t_comm
        start = max(t_compute, t_comm)
        dur = _comm_us(node, cost)
        args = _label(node, module_names)
        args["bytes"] = collective_bytes(node)
        slices.append(Slice(name, COMM, start, dur, args))
        t_comm = done_at[node] = start + dur

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node in backward and phase == "forward":
            slices.append(Slice("forward", PHASE, phase_start, t_compute - phase_start))
            phase_start, phase = t_compute, "backward"
        if node in backward:
            for inp in node.all_input_nodes:
                tag = chain_tag(inp)
                if (
                    inp.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
                    and tag is not None and tag not in regathered
                ):
                    regathered.add(tag)
                    for c in graph.nodes:  # the chain's collective
                        if is_collective(c) and chain_tag(c) == tag:
                            issue(c, f"re-gather {bucket_name(tag, module_names)} (reshard after forward)")
                            t_compute = max(t_compute, done_at[c])
                            break
        if is_collective(node):
            issue(node, _collective_name(node, module_names))
        elif "wait_tensor" in str(node.target):
            src = node.args[0]
            ready = done_at.get(src, t_compute) if isinstance(src, fx.Node) else t_compute
            if ready > t_compute:
                slices.append(Slice("wait (exposed communication)", COMPUTE, t_compute, ready - t_compute,
                                    _label(node, module_names)))
                t_compute = ready
        elif node.target not in _VIEWS and not str(node.target).startswith("<built-in function getitem"):
            dur = cost.compute_time(node) * 1e6
            slices.append(Slice(str(getattr(node.target, "__name__", node.target)), COMPUTE, t_compute, dur,
                                _label(node, module_names)))
            t_compute += dur
    end = max(t_compute, t_comm)
    slices.append(Slice(phase, PHASE, phase_start, end - phase_start))
    return slices


def collective_label(node: fx.Node) -> str:
    """"all-gather", "reduce-scatter" (markers and our gloo all-to-all included)
    or, for a collective we do not know, the op's name."""
    if "all_gather" in str(node.target) or is_unshard(node):
        return "all-gather"
    return "reduce-scatter" if _is_reduce(node) else str(node.target)


def _collective_name(node: fx.Node, module_names: dict[int, str]) -> str:
    kind = collective_label(node)
    tag = chain_tag(node)
    if tag is not None:
        return f"{kind} {bucket_name(tag, module_names)}"
    if is_unshard(node) or is_reduce_grad(node):
        return f"{kind} (unbucketed marker) {module_names.get(node.args[4], '')}".strip()
    return kind


def bucket_name(tag: ChainTag, module_names: dict[int, str]) -> str:
    """``fqn (Class) unit u`` (``+ k more`` when the bucketing merged units)."""
    name = module_names.get(tag.module_key, f"module_key {tag.module_key}")
    more = len(tag.units) - 1
    return f"{name} unit {tag.unit}" + (f" + {more} more" if more else "")


def chrome_trace(slices: list[Slice], process_name: str, pid: int = 0) -> dict[str, Any]:
    """Chrome-trace JSON (opens in Perfetto / chrome://tracing): one track per kind."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}},
    ]
    for track, tid in _TRACKS.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for s in slices:
        events.append({
            "name": s.name, "cat": s.track, "ph": "X", "pid": pid, "tid": _TRACKS[s.track],
            "ts": round(s.start_us, 3), "dur": round(max(s.dur_us, 0.001), 3),
            "args": s.args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"note": "predicted from graph order with the passes' cost model; not measured"}}
