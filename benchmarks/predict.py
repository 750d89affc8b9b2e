"""The step of a fully sharded job at W GPUs, predicted from measured compute.

Each block's measured forward and backward seconds (``gpu_workers.py
block_times``) become compute nodes of a small FX graph laid out in the
order FSDP runs a step (each module's all-gather issued one module ahead,
in forward and backward; each block's reduce-scatter issued after its
backward; the root's parameters gathered first and kept to the end), its
collectives sized as the model's buckets (bf16 gathers, fp32 reduces). The
project's one timeline model (``passes.timeline.simulate``, [Note: Timeline
model]) runs it with the cost model's NCCL links: NVLink inside a node, the
network once the group spans nodes ([Note: Calibrated constants]).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from compiled_fsdp.passes.cost_model import AG, RS, WAIT, CostModel
from compiled_fsdp.passes.timeline import simulate


@dataclasses.dataclass(frozen=True)
class MeasuredCost(CostModel):
    """Compute nodes cost what was measured (``meta["measured_s"]``)."""

    def compute_time(self, node: fx.Node) -> float:
        return float(node.meta.get("measured_s", 0.0))


def _measured(s: float) -> None:  # the target of a compute node (never called)
    return None


def step_graph(times: dict[str, Any], n_layers: int, world: int) -> fx.Graph:
    """One step's order of compute and collectives (see the module docstring)."""
    g = fx.Graph()

    def compute(seconds: float) -> None:
        n = g.call_function(_measured, (seconds,))
        n.meta["measured_s"] = seconds

    def gather(param_bytes: int) -> fx.Node:  # bf16 unsharded output
        n = g.call_function(AG, (None, world, "simulated"))
        n.meta["val"] = torch.empty(param_bytes // 4, dtype=torch.bfloat16, device="meta")
        return n

    def reduce(param_bytes: int) -> fx.Node:  # fp32 unsharded input
        src = g.placeholder(f"grads_{len(g.nodes)}")
        src.meta["val"] = torch.empty(param_bytes // 4, dtype=torch.float32, device="meta")
        return g.call_function(RS, (src, "sum", world, "simulated"))

    def wait(c: fx.Node) -> None:
        g.call_function(WAIT, (c,))

    block, root = times["block_param_bytes"], times["head_param_bytes"] + times["embed_param_bytes"]
    wait(gather(root))
    pending = gather(block)
    for i in range(n_layers):  # forward: gather i+1 while block i computes
        wait(pending)
        pending = gather(block) if i + 1 < n_layers else None
        compute(times["block_fwd_s"])
    compute(times["head_fwd_s"])
    pending = gather(block)  # backward: the last block re-gathered during the head's backward
    compute(times["head_bwd_s"])
    reduces = []
    for i in reversed(range(n_layers)):
        wait(pending)
        pending = gather(block) if i > 0 else None
        compute(times["block_bwd_s"])
        reduces.append(reduce(block))
    reduces.append(reduce(root))
    for r in reduces:
        wait(r)
    compute(times.get("other_s", 0.0))  # the optimizer and the rest of the measured step
    return g


def predict(times: dict[str, Any], n_layers: int, world: int, local_tokens: int) -> dict[str, Any]:
    order = list(step_graph(times, n_layers, world).nodes)
    cost = MeasuredCost(**{f.name: getattr(CostModel.nccl(), f.name) for f in dataclasses.fields(CostModel)})
    tl = simulate(order, cost, foreign=True)
    link = "NVLink" if world <= cost.ranks_per_node else "network"
    return {
        "world": world, "link": link, "step_s": tl.makespan_s, "compute_s": tl.compute_s,
        "comm_s": tl.comm_s, "exposed_s": tl.exposed_s, "tokens_per_s_per_gpu": local_tokens / tl.makespan_s,
    }
