"""Capture the forward and backward graphs AOTAutograd hands to its compilers,
after the project's joint passes and the min-cut partitioner (what aot_eager runs)."""
from __future__ import annotations

import collections
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import compiled_fsdp
from compiled_fsdp.core.marker import MARKERS
from compiled_fsdp.passes.graph import chain_tag


def one_graph() -> None:
    """For a test of one whole-model graph's structure (the collectives a
    backend captures, its buckets, its schedule, the timeline it predicts):
    no compile regions (``config.comm.block_regions``, on by default), whose
    subgraphs hold the blocks' collectives. Call it first in the rank
    function. Regions are tested by tests/test_block_regions.py, and by every
    compiled test that does not call this."""
    compiled_fsdp.config.comm.block_regions = False


# The markers' op names, as ``str(node.target)`` prints them (the lowering's own
# ops live in the same namespace: compiled_fsdp/core/gated.py, copy_out.py).
MARKER_OPS = frozenset(str(m.op().default) for m in MARKERS)

# The all-gather of the graphs the suite's gloo ranks compile: the eager
# collective ([Note: All-gathers on gloo] in compiled_fsdp/core/comm.py; torch's
# functional op on other groups: the FX tests', the emulated network's).
AG = torch.ops.compiled_fsdp.all_gather_by_work.default
RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
# the gloo reduce ([Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py)
A2A = torch.ops._c10d_functional.all_to_all_single.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
AR = torch.ops._c10d_functional.all_reduce.default  # HSDP's sum over the replicas
# A handed-in block's backward re-gather, one opaque op (see [Note: Backward
# re-gathers prefetched across graphs] in compiled_fsdp/core/registry.py): counted
# as the graph's all-gather.
REGATHER = torch.ops.compiled_fsdp.regather.default
# A handoff's collectives, skipped when their last argument (``live``) is
# false: [Note: A stand-in for the last block's next] in compiled_fsdp/core/gated.py.
AG_IF = torch.ops.compiled_fsdp.all_gather_if.default
RS_IF = torch.ops.compiled_fsdp.reduce_scatter_if.default
A2A_IF = torch.ops.compiled_fsdp.all_to_all_single_if.default
AR_IF = torch.ops.compiled_fsdp.all_reduce_if.default
_GATED = {AG_IF: "all_gather", RS_IF: "reduce_scatter", A2A_IF: "reduce_scatter", AR_IF: "all_reduce"}


def _gated_inputs(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """Each gated collective's kind and the position of the graph input that
    says whether it runs."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _GATED:
            live = n.args[-1]
            assert live.op == "placeholder", live
            out.append((_GATED[n.target], inputs.index(live)))
    return out


class GraphCapture:
    """A torch.compile backend: aot_eager plus a record of every fw/bw graph and
    of the in-graph collectives that actually ran (``runtime``, resettable)."""

    def __init__(self) -> None:
        self.forward: list[fx.GraphModule] = []
        self.backward: list[fx.GraphModule] = []
        self.runtime: collections.Counter = collections.Counter()

        def compiler(graphs: list[fx.GraphModule], phase: str) -> Any:
            def compile_one(gm: fx.GraphModule, example_inputs: Any) -> Any:
                graphs.append(gm)
                n_ag, n_rs, n_ar = count(gm, AG) + count(gm, REGATHER), count(gm, RS) + count(gm, A2A), count(gm, AR)
                gated = _gated_inputs(gm)  # (counted as they run)

                def run(args: list) -> Any:
                    self.runtime[f"{phase}_all_gather"] += n_ag
                    self.runtime[f"{phase}_reduce_scatter"] += n_rs
                    self.runtime[f"{phase}_all_reduce"] += n_ar
                    for kind, i in gated:
                        self.runtime[f"{phase}_{kind}"] += int(bool(args[i]))
                    return gm(*args)

                run._boxed_call = True  # take the argument list, as AOTAutograd prefers
                return run

            return compile_one

        self.backend = aot_autograd(
            fw_compiler=compiler(self.forward, "fw"),
            bw_compiler=compiler(self.backward, "bw"),
            partition_fn=min_cut_rematerialization_partition,
        )

    def take_runtime(self) -> dict[str, int]:
        """In-graph collectives run since the last call (zero entries dropped)."""
        out = {k: v for k, v in self.runtime.items() if v}
        self.runtime.clear()
        return out


def count(gm: fx.GraphModule, target: Any) -> int:
    """Calls of ``target`` in ``gm``, and in each compile region it calls, per
    call (torch 2.13 and 2.15 inline a region called once; 2.11 keeps it)."""
    total = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is target:
            total += 1
        elif n.target is torch.ops.higher_order.invoke_subgraph and n.args[0].op == "get_attr":
            total += count(gm.get_submodule(n.args[0].target), target)
    return total


def count_reduces(gm: fx.GraphModule) -> int:
    """Gradient reduces: reduce-scatters, or on gloo the all-to-alls that stand
    in for them (see [Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py);
    a handoff's included."""
    return count(gm, RS) + count(gm, A2A) + count(gm, RS_IF) + count(gm, A2A_IF)


def resharded_gathers(gm: fx.GraphModule) -> list[fx.Node]:
    """All-gathers the lowering marked as belonging to a module that reshards after forward."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is AG
        and (tag := chain_tag(n)) is not None and tag.reshard_after_forward
    ]


def handed_in_waits(gm: fx.GraphModule) -> list[fx.Node]:
    """Waits on a gather handed to the graph (see [Note: Gathers handed to the
    next block's graph]) of a module that reshards after forward."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is WAIT and n.args[0].op == "placeholder"
        and (tag := chain_tag(n)) is not None and tag.role == "handoff_chain" and tag.reshard_after_forward
    ]


def saved_gathered(fw: fx.GraphModule) -> list[str]:
    """Forward outputs saved for backward that are the result of a resharded
    module's all-gather (or of the wait on a gather handed to it, or of a
    compile region's ``regather``), or of a
    single-input chain of ops on one: an unsharded parameter kept alive
    although its module reshards after forward."""
    gathered: set[fx.Node] = set()
    regathers = {n for n in fw.graph.nodes if n.op == "call_function" and n.target is REGATHER
                 and (tag := chain_tag(n)) is not None and tag.reshard_after_forward}
    seeds = set(resharded_gathers(fw)) | set(handed_in_waits(fw)) | regathers
    for n in fw.graph.nodes:
        if n.op != "call_function":
            continue
        tensor_inputs = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if n in seeds or (len(tensor_inputs) == 1 and tensor_inputs[0] in gathered):
            gathered.add(n)
        elif n.target is operator.getitem and n.args[0] in gathered:
            gathered.add(n)
    out = fw.graph.output_node()
    return [a.name for a in out.args[0] if isinstance(a, fx.Node) and a in gathered]


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it (transitively) reads."""
    seen, stack = set(), [node]
    while stack:
        cur = stack.pop()
        seen.add(cur)
        stack.extend(i for i in cur.all_input_nodes if i not in seen)
    return seen


def U(shard, full, group, n, key, index, reshard, **kw):  # noqa: ANN001, ANN201, N802 - the marker, as the property calls it
    """An ``unshard`` marker of ``shard`` (a hand-built graph's parameter read)."""
    return torch.ops.compiled_fsdp.unshard(shard, full, group, n, key, index, shard.shape[0], reshard, **kw)


def shard_shape(full: list[int], n: int, rank: int = 0) -> list[int]:
    """``rank``'s local shard shape (``torch.chunk``'s rows)."""
    rows = -(-full[0] // n)
    return [max(0, min(rows, full[0] - rank * rows)), *full[1:]]


def calls(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    """The nodes of ``gm`` that call ``target``."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def chain_role(n: fx.Node) -> str | None:
    """The role the lowering tagged ``n`` with (None: not its node)."""
    tag = chain_tag(n)
    return tag.role if tag is not None else None


def marker_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The marker ops left in ``gm``."""
    ops = {m.op().default for m in MARKERS}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]

