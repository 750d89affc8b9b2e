"""Analytic cost model: compute time from FLOP and byte counts per FX node,
communication time from an alpha-beta model per backend.

[Note: Estimates, not measurements]
Nothing here runs the graph or times anything at compile time: every rank must
reach the same scheduling decision, so every estimate is a pure function of the
graph (shapes and dtypes in ``node.meta["val"]``) and of the constants below.
Per-rank profiling (DeepCompile's approach) can disagree between ranks and
hangs when shapes vary. The constants were measured once, offline, with
``benchmarks/calibrate.py``; the schedule only needs their *ratios* to be
roughly right (is a gather shorter than the block before it?), not their
absolute values.

Compute: matmul-like ops (mm, addmm, bmm, convolution, attention and their
backward; the formulas of ``torch.utils.flop_counter``) cost
``flops / flops_per_s``; every other op producing or reading tensors costs
``bytes moved / bytes_per_s`` (inputs read + outputs written, less what a
chain of pointwise ops keeps in registers: [Note: Fused elementwise ops]),
views and collectives cost nothing. Communication: ``t = (N-1) * alpha + (N-1)/N * bytes
/ link_bytes_per_s`` for a ring over N ranks, ``bytes`` being the unsharded
buffer (the gather's output, the reduce-scatter's input).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from compiled_fsdp.core import comm, compat, gated
from compiled_fsdp.core.marker import NAMESPACE, IssueAhead, ReduceLater, Regather

c10d = torch.ops._c10d_functional

AG = c10d.all_gather_into_tensor.default
RS = c10d.reduce_scatter_tensor.default
# On gloo a gradient bucket is reduced by an all-to-all plus a local sum (see
# [Note: Reduce-scatter on gloo] in compiled_fsdp/core/comm.py); it plays the reduce-scatter's part.
A2A = c10d.all_to_all_single.default
# HSDP: the reduced shard summed over the replicas (see [Note: HSDP] in
# compiled_fsdp/runtime/api.py); priced as a ring's reduce-scatter plus
# all-gather over the replicate group, across nodes where its ranks are (``CostModel.spans_nodes``).
AR = c10d.all_reduce.default
# The same four, skipped at run time when their last argument says so: a
# handoff's ([Note: A stand-in for the last block's next] in compiled_fsdp/core/gated.py).
AG_IF, RS_IF, A2A_IF, AR_IF = (gated.all_gather_if._opoverload, gated.reduce_scatter_if._opoverload,
                               gated.all_to_all_single_if._opoverload, gated.all_reduce_if._opoverload)
# On gloo an all-gather is the eager collective ([Note: All-gathers on gloo] in
# compiled_fsdp/core/comm.py), with the functional op's arguments.
AG_W = comm.all_gather_by_work._opoverload
GATHERS, REDUCE_SCATTERS, ALL_TO_ALLS, ALL_REDUCES = (AG, AG_IF, AG_W), (RS, RS_IF), (A2A, A2A_IF), (AR, AR_IF)
ISSUES = (*GATHERS, *REDUCE_SCATTERS, *ALL_TO_ALLS, *ALL_REDUCES)  # the collectives the passes issue (one wait each)
WAIT = c10d.wait_tensor.default
# Where each collective's group name is among its arguments.
_GROUP_ARG = {AG: 2, AG_IF: 2, AG_W: 2, RS: 3, RS_IF: 3, A2A: 3, A2A_IF: 3, AR: 2, AR_IF: 2}


def all_gather_op(group_name: str, device: torch.device | str) -> object:
    """The all-gather a graph issues on ``group_name``: torch's, or on gloo ``AG_W``."""
    return AG_W if comm.gathers_by_work(group_name, device) else AG


def collective_group(node: fx.Node) -> str:
    """The group name of one of ``ISSUES``."""
    return str(node.args[_GROUP_ARG[node.target]])


def collective_world(node: fx.Node) -> int:
    """The ranks a gather, reduce-scatter or all-to-all of ``ISSUES`` spans."""
    if node.target in ALL_TO_ALLS:
        return len(node.args[1])
    return int(node.args[2] if node.target in REDUCE_SCATTERS else node.args[1])


@dataclasses.dataclass(frozen=True)
class ComputeConstants:
    flops_per_s: float
    bytes_per_s: float
    host_bytes_per_s: float  # a copy between the host and the device ([Note: Host copies])
    # Fused attention's rate (its FLOPs as torch's flop counter counts them),
    # where it was measured ([Note: Attention's own rate]); None: the matmuls'.
    attention_flops_per_s: float | None = None
    # Host seconds of each call the CPU makes of the sharding's own ops and of
    # each collective's issue and wait, where it was measured ([Note: The
    # sharding's host work priced per call]); 0: none (the constants, a GPU's).
    host_call_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class CommConstants:
    alpha_s: float  # per ring step
    link_bytes_per_s: float


# [Note: Calibrated constants]
# CPU / gloo: measured with benchmarks/calibrate.py on the project's 2-core
# CPU machine, 1 thread per process (the matmul rate again on 2026-11-30:
# 0.88-1.07e11, median 0.90e11, of five runs; the elementwise rate swings
# between 0.7 and 5e10 on this shared VM, so it keeps the earlier figure), 2 gloo ranks on loopback (the raw figures
# and their date: benchmarks/RESULTS.md). The gradient reduce is priced as it
# runs on gloo (all-to-all + sum, see [Note: Reduce-scatter on gloo] in
# compiled_fsdp/core/comm.py). Links are the 2-rank figure / 2.
# CUDA / NCCL: compute measured by ``benchmarks/calibrate.py --gpu`` on one
# H200 (bf16 matmul 782 TFLOP/s on random data, device copy 4.27 TB/s; the
# datasheets: 989 dense bf16, HBM 4.8 TB/s, an H100 3.35): the constants take
# ~75% of the matmul rate for a model's mix of shapes and ~55% of the copy
# rate (an H100's). Links are published figures until a machine with several
# GPUs is measured (one GPU has none; benchmarks/RESULTS.md). Links: within a node, NVLink 4 gives each GPU 450 GB/s
# per direction (900 GB/s both ways); NCCL's all-gather and reduce-scatter
# reach a bus bandwidth of about 370 GB/s on 8 GPUs (nccl-tests on DGX H100);
# between nodes each GPU has one 400 Gb/s NIC (DGX H100: 8x ConnectX-7), 50
# GB/s, of which a ring reaches about 45. A ring spanning nodes runs at its
# slowest link: ``comm_time`` prices a group of more than ``ranks_per_node``
# ranks with ``inter_node``. Latency ~10 us per ring step in a node, ~20 us
# across nodes.


# [Note: Host copies]
# CPU offload's copies in a graph (``prims.device_put``: a shard to the
# device before its gather, a reduced gradient back: [Note: CPU offload in
# graphs] in lowering.py) cross the host link, not the device's memory; in a
# compiled graph they run on the compute stream. They were priced as a
# device copy (2.3e12 B/s on CUDA), 40-50x too cheap. PCIe Gen5 x16 moves
# 64 GB/s a direction on paper; the constant takes 50 GB/s, not measured
# here (no GPU lent since offload landed). On the CPU the copy is the
# memory's. Tested by
# tests/test_offload_fx.py::test_host_copies_priced_at_the_host_link.
CPU_COMPUTE = ComputeConstants(flops_per_s=9.0e10, bytes_per_s=1.05e10, host_bytes_per_s=1.05e10)
GLOO_COMM = {
    "all_gather": CommConstants(alpha_s=3.4e-4, link_bytes_per_s=4.2e8),
    "reduce_scatter": CommConstants(alpha_s=2.7e-4, link_bytes_per_s=6.1e8),
}
CUDA_COMPUTE = ComputeConstants(flops_per_s=6.0e14, bytes_per_s=2.3e12, host_bytes_per_s=5.0e10)
NCCL_COMM = {
    "all_gather": CommConstants(alpha_s=1.0e-5, link_bytes_per_s=3.7e11),
    "reduce_scatter": CommConstants(alpha_s=1.0e-5, link_bytes_per_s=3.7e11),
}
NCCL_INTER_NODE = {
    "all_gather": CommConstants(alpha_s=2.0e-5, link_bytes_per_s=4.5e10),
    "reduce_scatter": CommConstants(alpha_s=2.0e-5, link_bytes_per_s=4.5e10),
}
GPUS_PER_NODE = 8

_NO_COST_OPS = ("view", "_unsafe_view", "reshape", "slice", "select", "expand", "t",
                "transpose", "permute", "squeeze", "unsqueeze", "alias", "as_strided",
                "split", "split_with_sizes", "detach", "getitem")


# [Note: Fused elementwise ops]
# Inductor fuses a chain of pointwise ops into one kernel, which reads the
# chain's inputs and writes its outputs once; the values between stay in
# registers. So a pointwise node's output read only by pointwise nodes and
# reductions (which fuse the chain in front of them) is neither written nor
# read again: pricing every FX node's inputs and output
# counted each such value twice, and the compute of a block came out 1.5x
# what the emulated network's record showed on the CPU (the timeline then
# predicted half the exposed communication it measured). Reductions and
# matmuls still read their inputs and write their outputs.
def _tags(node: fx.Node) -> Any:
    return getattr(node.target, "tags", ()) if node.op == "call_function" else ()


def _in_registers(node: fx.Node) -> bool:
    """A pointwise node whose every user fuses it (a pointwise op or a reduction)."""
    return (torch.Tag.pointwise in _tags(node) and bool(node.users)
            and all(torch.Tag.pointwise in _tags(u) or torch.Tag.reduction in _tags(u) for u in node.users))


def tensor_bytes(val: Any) -> int:
    """Bytes of every tensor in a ``meta["val"]`` value (0 for symbolic sizes)."""
    total = 0
    for t in tree_leaves(val):
        if isinstance(t, torch.Tensor):
            try:
                total += int(t.numel()) * t.element_size()
            except TypeError:  # symbolic numel
                continue
    return total


def node_bytes(node: fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def _collective_kind(node: fx.Node) -> str | None:
    if node.target in GATHERS:
        return "all_gather"
    if node.target in REDUCE_SCATTERS or node.target in ALL_TO_ALLS:
        return "reduce_scatter"
    if node.target in ALL_REDUCES:
        return "all_reduce"
    return None


def _group(group_name: str) -> "torch.distributed.ProcessGroup | None":
    """The live process group of that name; None for a name that is not one
    (a hand-built graph)."""
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(group_name)
    except Exception:  # noqa: BLE001
        return None


def _group_size(group_name: str) -> int:
    """The size of a named process group (the same on every rank); 2 when
    the name is not a live group."""
    group = _group(group_name)
    return 2 if group is None else group.size()


@dataclasses.dataclass(frozen=True)
class Links:
    """A network's links: within a node (``comm``), across nodes
    (``inter_node``), and how many ranks a node holds; and, where the
    network measured it, the compute of the machine it runs on
    (``compute``: [Note: Compute declared by the network]). A process group
    that prices its own collectives (the emulated network,
    compiled_fsdp/tools/emulated.py) declares them as its ``links``
    attribute, and ``CostModel.for_graph`` prices with them."""

    comm: Any
    inter_node: Any
    ranks_per_node: int = GPUS_PER_NODE
    compute: ComputeConstants | None = None


# [Note: Compute declared by the network]
# The CPU constants are one machine's (``CPU_COMPUTE``: [Note: Calibrated
# constants]). The emulated network runs wherever the benchmark does, and
# one core's matmul rate on the machines this project has run on spans
# 0.69-0.95e11 FLOP/s (2026-12-01, one thread), so a run's timeline could
# price every block's compute up to 25% away from what that run computes:
# the comparison of the predicted exposed communication with the measured
# one would then check the machine, not the schedule. So the network may
# declare the compute it measured where it runs (``Topology.compute``,
# carried by ``Links.compute``), and a graph whose group declares it is
# priced with it. Only a group that prices its own collectives declares it:
# one process, so no other rank decides otherwise; a real group's ranks all
# keep the constants.
# Tested by tests/test_emulated.py::test_group_semantics_and_clock.


# [Note: The sharding's host work priced per call]
# On the CPU the host that issues a collective also computes, so what the
# sharding does on the host is time the compute stream spends: each call of
# the sharding's own ops (the bucket's pack and unpack, the gradients' pack
# and average, the ops that collect inside), each collective's issue and
# each wait run Python (the ops' loops over the bucket's parameters, the
# backend's work objects) and copy at the rate a step leaves them. The rates
# priced only their bytes, at an isolated copy's rate: with collectives free
# the emulated benchmark's sharded step (W=8, CPU) was 52-64 ms over what
# its timeline priced, and at the matched link, where a block's gather and
# its compute take about as long, the timeline had each block's gather wait
# 1-2.5 ms where the run waited none (predicted exposed communication
# 1.30-1.35x the measured; RESULTS, 2026-12-05). So a network that measured
# them may declare ``host_call_s``, the seconds one such call costs, and
# the timeline spends it at each: an op's in its compute time, an issue's
# before its collective starts, a wait's after the wait (``host_calls``
# counts them, priced or not). 0 by default: the constants keep their
# decisions, and on a GPU the host's calls overlap the kernels they launch.
# Tested by tests/test_emulated.py::test_host_calls_priced_where_they_run.


# [Note: Attention's own rate]
# Fused attention does its FLOPs slower than a matmul: on this project's CPU
# (one thread, the emulated benchmark's Llama, 2026-12-02) 4.4 ms forward
# and 9.4 ms backward a block where the matmuls' rate priced 2.8 and 7.0 ms,
# 32 ms of a 0.64 s step. At the matched link each block's compute is
# within a few percent of its gather's time, so the timeline then waited
# where the run did not: it over-predicted the exposed communication of a
# step with compile regions by 24-28% there (one graph's by 19-45%; RESULTS,
# forty-fourth session). A network that measured its
# compute declares attention's rate too (``measured_cpu_compute``), and
# ``compute_time`` prices the attention ops with it; the constants keep
# the matmuls' rate. Tested by tests/test_emulated.py::test_attention_priced_at_its_own_rate.
_ATTENTION = compat.attention_ops((
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
        "_efficient_attention_forward", "_efficient_attention_backward"))


# The ops that run a collective inside them ([Note: Collectives inside an
# op] in passes/timeline.py), by name: a group of their own.
_IN_OP_GROUPED = {m.qualname(): m for m in (Regather, IssueAhead, ReduceLater)}


def _declared_links(nodes: Iterable[fx.Node]) -> "Links | None":
    """The ``links`` the process group of the first collective declares, if
    any (the same on every rank: a property of the group); a collective
    inside one of the project's ops counts (a root whose own parameters are
    all read in regions has no other)."""
    for n in nodes:
        in_op = _IN_OP_GROUPED.get(n.target.name()) if isinstance(n.target, torch._ops.OpOverload) else None
        if _collective_kind(n) is None and in_op is None:
            continue
        name = collective_group(n) if in_op is None else in_op.bind(n.args, dict(n.kwargs)).group_name
        links = getattr(_group(name), "links", None)
        return links if isinstance(links, Links) else None
    return None


@dataclasses.dataclass(frozen=True)
class CostModel:
    compute: ComputeConstants = CPU_COMPUTE
    comm: Any = dataclasses.field(default_factory=lambda: dict(GLOO_COMM))
    # Links of a group that spans nodes (None: one kind of link), and how many
    # ranks a node holds (see [Note: Calibrated constants]).
    inter_node: Any = None
    ranks_per_node: int = GPUS_PER_NODE

    @staticmethod
    def nccl() -> "CostModel":
        return CostModel(compute=CUDA_COMPUTE, comm=dict(NCCL_COMM), inter_node=dict(NCCL_INTER_NODE))

    def with_links(self, links: Links) -> "CostModel":
        return dataclasses.replace(self, comm=dict(links.comm), inter_node=dict(links.inter_node),
                                   ranks_per_node=links.ranks_per_node, compute=links.compute or self.compute)

    @staticmethod
    def for_graph(graph: fx.Graph) -> "CostModel":
        """CUDA constants when any of the graph's tensors lives on a GPU (not
        only its first: under CPU offload the first inputs are CPU shards,
        and the whole graph was priced as the CPU's), else CPU/gloo; the
        links its process group declares, if it does (the emulated network).
        Depends only on the graph, so it is the same on every rank."""
        return CostModel.for_nodes(list(graph.nodes))

    @staticmethod
    def for_nodes(nodes: list[fx.Node]) -> "CostModel":
        """``for_graph`` of the graph these nodes make (an order with its
        bodies expanded: passes/region_step.py's ``expand_regions``)."""
        on_gpu = any(isinstance(t, torch.Tensor) and t.device.type == "cuda"
                     for n in nodes for t in tree_leaves(n.meta.get("val")))
        model = CostModel.nccl() if on_gpu else CostModel()
        links = _declared_links(nodes)
        return model if links is None else model.with_links(links)

    @staticmethod
    def is_host_call(node: fx.Node) -> bool:
        """Whether ``node`` is a host call ([Note: The sharding's host work
        priced per call]): one of the sharding's own ops, a collective's
        issue or a wait."""
        return node.op == "call_function" and (
            node.target is WAIT or _collective_kind(node) is not None
            or getattr(node.target, "namespace", None) == NAMESPACE)

    def host_time(self, node: fx.Node) -> float:
        """The host seconds of one call of ``node`` where it is a host call; else 0."""
        return self.compute.host_call_s if self.compute.host_call_s and self.is_host_call(node) else 0.0

    def compute_time(self, node: fx.Node) -> float:
        """Seconds of compute for ``node`` (0 for views; a collective's or a
        wait's only its host call), its host call included."""
        if node.op != "call_function":
            return 0.0
        work = 0.0 if _collective_kind(node) or node.target is WAIT else self._work_time(node)
        return work + self.host_time(node)

    def _work_time(self, node: fx.Node) -> float:
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        name = getattr(packet, "__name__", getattr(target, "__name__", ""))
        if packet in flop_registry:
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a,
                (node.args, node.kwargs),
            )
            try:
                flops = flop_registry[packet](*args, out_val=node.meta.get("val"), **kwargs)
                rate = self.compute.attention_flops_per_s if packet in _ATTENTION else None
                return float(flops) / (rate or self.compute.flops_per_s)
            except Exception:  # noqa: BLE001 - unexpected signature: fall back to bytes
                pass
        if name in _NO_COST_OPS:
            return 0.0
        if target is torch.ops.prims.device_put.default:  # see [Note: Host copies]
            return node_bytes(node) / self.compute.host_bytes_per_s
        if target is torch.ops.aten.constant_pad_nd.default:
            # From the output alone: a shard's pad reads fewer rows on some ranks,
            # and every rank must estimate the same ([Note: Rank-independent graphs]
            # in compiled_fsdp/core/layout.py).
            return 2 * node_bytes(node) / self.compute.bytes_per_s
        # See [Note: Fused elementwise ops].
        read = sum(0 if _in_registers(a) else node_bytes(a) for a in node.all_input_nodes)
        return (read + (0 if _in_registers(node) else node_bytes(node))) / self.compute.bytes_per_s

    def link(self, kind: str, world_size: int, across_nodes: bool = False) -> CommConstants:
        """The constants of a ring over ``world_size`` ranks: its slowest link
        (``across_nodes``: a group known to span nodes: ``spans_nodes``)."""
        spans_nodes = self.inter_node is not None and (across_nodes or world_size > self.ranks_per_node)
        return (self.inter_node if spans_nodes else self.comm)[kind]

    def spans_nodes(self, group_name: str | None) -> bool:
        """Whether the named group's ring crosses nodes, nodes holding
        ``ranks_per_node`` consecutive global ranks. Decided from the world's
        size and the group's size and stride, not its place, so that every
        rank decides the same: none crosses in a world that fits in a node;
        a group of ranks ``r0 + k * stride`` (a mesh dimension's) stays in a
        node on every rank when ``size * stride`` divides a node (HSDP's
        replicas of shard groups smaller than a node). True for a group of
        another pattern or a name that is not a live group with known
        ranks; False for one rank."""
        group = _group(group_name) if group_name else None
        try:
            ranks = torch.distributed.get_process_group_ranks(group) if group is not None else None
        except (KeyError, RuntimeError, ValueError):  # (a group registered by name only)
            ranks = None
        if ranks is None:
            return True
        if len(ranks) <= 1 or torch.distributed.get_world_size() <= self.ranks_per_node:
            return False
        stride = ranks[1] - ranks[0]
        regular = stride > 0 and ranks == list(range(ranks[0], ranks[0] + len(ranks) * stride, stride))
        return not (regular and self.ranks_per_node % (len(ranks) * stride) == 0)

    def comm_time(self, kind: str, unsharded_bytes: int, world_size: int, across_nodes: bool = False) -> float:
        if kind == "all_reduce":
            return (self.comm_time("reduce_scatter", unsharded_bytes, world_size, across_nodes)
                    + self.comm_time("all_gather", unsharded_bytes, world_size, across_nodes))
        c = self.link(kind, world_size, across_nodes)
        steps = max(world_size - 1, 0)
        return steps * c.alpha_s + steps / max(world_size, 1) * unsharded_bytes / c.link_bytes_per_s

    def collective_time(self, node: fx.Node) -> float:
        """Seconds for an all_gather_into_tensor / reduce_scatter_tensor / all_to_all_single node."""
        kind = _collective_kind(node)
        if kind is None:
            return 0.0
        if kind == "all_reduce":
            group = collective_group(node)
            return self.comm_time(kind, node_bytes(node.args[0]), _group_size(group), self.spans_nodes(group))
        buf = node if kind == "all_gather" else node.args[0]
        return self.comm_time(kind, node_bytes(buf), collective_world(node))

    def latency_bytes(self, kind: str, world_size: int) -> int:
        """Buffer size at which the bandwidth term equals the latency term:
        below it a collective is mostly fixed cost (see [Note: Bucket threshold])."""
        c = self.link(kind, world_size)
        return int(world_size * c.alpha_s * c.link_bytes_per_s)
