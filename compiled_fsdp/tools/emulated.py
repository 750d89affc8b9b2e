"""An emulated cluster network: one process plays rank ``r`` of a ``W``-rank
job whose collectives take the time the project's cost model gives them.

    from compiled_fsdp.tools.emulated import Topology, init_emulated_network

    net = init_emulated_network(world_size=64, topology=Topology.nccl(network_gbps=45))
    ...  # build the model, fully_shard / FSDP2, train as usual
    print(net.summary())  # per collective: issue, start, end; exposed waiting

[Note: The emulated network]
What it models. A process group (``torch.distributed.ProcessGroup``
subclass, backend name ``"emulated"``) stands in for every group of a
``W``-rank job in one process, like torch's fake group: outputs are shaped
and sharded as a real group's, and compute and memory are real. Each
collective takes ``CostModel.comm_time`` for its kind, its unsharded bytes
and its group: a ring over ``W`` ranks, ``(W-1)`` latencies plus
``(W-1)/W`` of the bytes over the link, where the link is the node's
(NVLink) while the group's ranks sit in one node of ``ranks_per_node`` and
the network's once they span nodes (an HSDP replica group of 2 ranks on two
nodes is priced on the network). The constants are the passes' own
(``Topology.links`` is what ``CostModel.for_graph`` reads from a group that
declares it), so what the schedule predicted and what a run shows use one
model ([Note: Timeline model] in passes/timeline.py).

Collectives of every group run one after another on one queue, in issue
order, as the timeline model assumes: a collective starts when it is issued
and the one before it has ended. Two groups that share a link therefore
share its bandwidth by taking turns, which ends the last of them when fair
sharing would; the first ends earlier than it would under sharing. On CUDA
the queue is one communication stream: at issue it waits for the issuing
stream (an event), runs a spin kernel (``torch.cuda._sleep``) sized from a
calibrated clock and records a completion event; ``wait()`` makes the
current stream wait for that event without blocking the CPU, as NCCL's work
does. On the CPU a virtual clock does it: ``wait()`` sleeps until the
collective's end.

[Note: What the emulated collectives write]
On the CPU a collective's outputs hold what a real group's would if every
rank held what this rank holds, averaged where it reduces: a gather's
output this rank's input in every rank's place, a reduce-scatter's this
rank's part of its input, an all-to-all's that part in every place; an
all-reduce leaves its tensors as they are (a sum would be W times larger).
One thread of the network's own writes them, in issue order, as gloo's
threads write a real one's. ``wait()`` joins the write of its collective
and of every one issued before it (a collective with nothing to write takes
the last write before it), so the queue stays in issue order. The time a
wait stands still for a write after the clock's end is the emulation's own
cost, not the network's: it is kept apart (``Record.late_s``, the summary's
``late_s``), out of the exposed time, which stays the clock's (counted in, a
tiny model's late writes took its exposed time past its whole communication
time). ``reset`` joins every write.
Left unwritten, as torch's fake group leaves them, they held whatever the
allocator's memory last held (integers, read as floats, are denormal
numbers), every sharded step computed on gathered parameters of that, and
the CPU's arithmetic, which slows on denormals, ran some matmuls up to 20x
longer: a sharded step took 1.1-16x its usual time at random (RESULTS,
2026-12-04). On CUDA nothing is written: a GPU's arithmetic does not slow on
denormals, and the spin kernel stands for the whole collective.

What it leaves out: on CUDA, NCCL kernels occupy SMs and memory bandwidth
while they run (the spin kernel holds one thread block and reads nothing),
so compute that overlaps a real collective runs somewhat slower than here
(on the CPU the writing thread below takes memory bandwidth, as gloo's
threads do); links are not shared between concurrent collectives, only
taken in turns; no congestion, no topology beyond node/network, no
stragglers.

Exposed communication is measured, not modelled: at each ``wait()`` the
group notes when the waiting stream reached it (an event on CUDA, the clock
on the CPU); the time that stream then stood still is ``max(0, end -
reached)``. ``EmulatedNetwork.summary()`` sums it.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from compiled_fsdp.core.comm import EMULATED_BACKEND
from compiled_fsdp.passes.cost_model import (
    GPUS_PER_NODE,
    NCCL_COMM,
    NCCL_INTER_NODE,
    CommConstants,
    ComputeConstants,
    CostModel,
    Links,
    tensor_bytes,
)

__all__ = ["EmulatedNetwork", "Record", "Topology", "init_emulated_network"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Nodes of ``ranks_per_node`` GPUs; within a node each GPU reaches the
    others at ``node_gbps`` (GB/s of ring bandwidth per GPU) with
    ``node_latency_us`` per ring step, across nodes at ``network_gbps`` and
    ``network_latency_us``. ``Topology.nccl()`` gives the cost model's
    published H100 figures ([Note: Calibrated constants])."""

    ranks_per_node: int = GPUS_PER_NODE
    node_gbps: float = NCCL_COMM["all_gather"].link_bytes_per_s / 1e9
    node_latency_us: float = NCCL_COMM["all_gather"].alpha_s * 1e6
    network_gbps: float = NCCL_INTER_NODE["all_gather"].link_bytes_per_s / 1e9
    network_latency_us: float = NCCL_INTER_NODE["all_gather"].alpha_s * 1e6
    # The compute the passes price a graph with, where measured here
    # (``tools.cpu_compute``; None: the cost model's constants): [Note:
    # Compute declared by the network] in passes/cost_model.py.
    compute: Optional[ComputeConstants] = None

    @staticmethod
    def nccl(network_gbps: Optional[float] = None) -> "Topology":
        t = Topology()
        return t if network_gbps is None else dataclasses.replace(t, network_gbps=network_gbps)

    def slower(self, factor: float) -> "Topology":
        """Every link ``factor`` times slower (latency and bandwidth)."""
        return dataclasses.replace(
            self, node_gbps=self.node_gbps / factor, node_latency_us=self.node_latency_us * factor,
            network_gbps=self.network_gbps / factor, network_latency_us=self.network_latency_us * factor)

    @property
    def links(self) -> Links:
        node = CommConstants(alpha_s=self.node_latency_us * 1e-6, link_bytes_per_s=self.node_gbps * 1e9)
        net = CommConstants(alpha_s=self.network_latency_us * 1e-6, link_bytes_per_s=self.network_gbps * 1e9)
        return Links(comm={"all_gather": node, "reduce_scatter": node},
                     inter_node={"all_gather": net, "reduce_scatter": net}, ranks_per_node=self.ranks_per_node,
                     compute=self.compute)


@dataclasses.dataclass
class Record:
    """One collective as the emulated network ran it. Times in seconds from
    the network's epoch (``EmulatedNetwork.reset``); on CUDA they are read
    from events when ``EmulatedNetwork.records()`` is called."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" | "broadcast" (scatter too) | "barrier"
    group: str  # the group's name
    group_size: int
    bytes: int  # the unsharded buffer (a gather's output, a reduce's input)
    duration_s: float  # what the cost model gave it
    issue_s: float  # when the CPU issued it
    start_s: float = 0.0
    end_s: float = 0.0
    reached_s: Optional[float] = None  # when the waiting stream reached its first wait
    waited_s: float = 0.0  # how long that stream stood still for it (exposed)
    handle: Any = dataclasses.field(default=None, repr=False, compare=False)  # CUDA: (start, end) events
    late_s: float = 0.0  # CPU: how long its waits stood still for its outputs' write, after its end
    # CPU: the future of the writing of its outputs, or of the last write before it
    # ([Note: What the emulated collectives write])
    written: Any = dataclasses.field(default=None, repr=False, compare=False)
    reached: Any = dataclasses.field(default=None, repr=False, compare=False)  # CUDA: the first wait's event


class _CudaQueue:
    """The communication stream, its spin kernel and its events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.epoch = torch.cuda.Event(enable_timing=True)
        self.cycles_per_s = self._calibrate()
        self.epoch.record()

    def _calibrate(self) -> float:
        """Cycles of ``torch.cuda._sleep`` per second: the slope between two
        spins timed by events (the launch's fixed cost cancels)."""
        def timed(cycles: int) -> float:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                a.record()
                torch.cuda._sleep(cycles)
                b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3

        timed(1_000_000)  # (warm-up)
        small, large = 2_000_000, 40_000_000
        return (large - small) / max(timed(large) - timed(small), 1e-9)

    def run(self, rec: Record) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            cycles = int(rec.duration_s * self.cycles_per_s)
            if cycles > 0:
                torch.cuda._sleep(cycles)
            end.record()
        return (start, end)

    def wait(self, handle: Any) -> Any:
        reached = torch.cuda.Event(enable_timing=True)
        reached.record()
        torch.cuda.current_stream(self.device).wait_event(handle[1])
        return reached

    def done(self, handle: Any) -> bool:
        return handle[1].query()

    def resolve(self, rec: Record) -> None:
        start, end = rec.handle
        end.synchronize()
        rec.start_s = self.epoch.elapsed_time(start) / 1e3
        rec.end_s = self.epoch.elapsed_time(end) / 1e3
        if rec.reached is not None:
            rec.reached.synchronize()
            rec.reached_s = self.epoch.elapsed_time(rec.reached) / 1e3
            rec.waited_s = max(0.0, rec.end_s - rec.reached_s)


class _Work(dist.Work):
    def __init__(self, net: "EmulatedNetwork", rec: Record) -> None:
        super().__init__()
        self._net, self._rec = net, rec

    def wait(self, timeout: Any = None) -> bool:
        self._net._wait(self._rec)
        return True

    def is_completed(self) -> bool:
        return self._net._done(self._rec)

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut


class EmulatedNetwork:
    """The shared queue, clock and record of every emulated group in this
    process (see [Note: The emulated network])."""

    def __init__(self, topology: Topology, device: torch.device) -> None:
        self.topology = topology
        self.device = device
        self._model = CostModel().with_links(topology.links)  # (only its comm_time is used)
        self._cuda = _CudaQueue(device) if device.type == "cuda" else None
        # (CPU: writes each collective's outputs, in issue order: [Note: What the emulated collectives write])
        self._writer = ThreadPoolExecutor(1, "emulated-network") if self._cuda is None else None
        self._lock = threading.Lock()
        self.store: Optional[dist.Store] = None  # what its groups were made from (init_emulated_network)
        self._records: list[Record] = []
        self.reset()

    def reset(self) -> None:
        """Forgets every record; the clock restarts at 0."""
        with self._lock:
            futures.wait([r.written for r in self._records if r.written is not None])
            self._records = []
            self._last_written: Optional[futures.Future] = None
            self._epoch = time.perf_counter()
            self._queue_end = 0.0
            if self._cuda is not None:
                torch.cuda.synchronize(self.device)
                self._cuda.epoch.record()

    def now(self) -> float:
        return time.perf_counter() - self._epoch

    def set_topology(self, topology: Topology) -> None:
        """Prices every collective issued from now on on ``topology``; graphs
        compiled from now on are priced with its links and compute."""
        with self._lock:
            self.topology = topology
            self._model = CostModel().with_links(topology.links)

    def price(self, kind: str, nbytes: int, ranks: Sequence[int]) -> float:
        """Seconds for ``kind`` over a group of ``ranks`` moving ``nbytes``
        (the cost model's ring; all-to-all and broadcast as a reduce-scatter
        and an all-gather of those bytes, a barrier as an all-reduce of none)."""
        per_node = self.topology.ranks_per_node
        across = len({r // per_node for r in ranks}) > 1
        priced = {"all_to_all": "reduce_scatter", "broadcast": "all_gather", "barrier": "all_reduce"}
        return self._model.comm_time(priced.get(kind, kind), nbytes, len(ranks), across_nodes=across)

    def issue(self, group: "EmulatedGroup", kind: str, nbytes: int,
              write: Optional[Callable[[], None]] = None) -> _Work:
        """Queues a collective; ``write`` (the CPU's only) writes its outputs."""
        ranks = group.ranks()
        rec = Record(kind=kind, group=group.group_name, group_size=len(ranks), bytes=nbytes,
                     duration_s=self.price(kind, nbytes, ranks) if len(ranks) > 1 else 0.0, issue_s=self.now())
        with self._lock:
            self._records.append(rec)
            if self._cuda is not None:
                rec.handle = self._cuda.run(rec)
            else:
                rec.start_s = max(rec.issue_s, self._queue_end)
                rec.end_s = self._queue_end = rec.start_s + rec.duration_s
                if write is not None:
                    self._last_written = self._writer.submit(_written, write)
                rec.written = self._last_written
        return _Work(self, rec)

    def _wait(self, rec: Record) -> None:
        if self._cuda is not None:
            reached = self._cuda.wait(rec.handle)
            if rec.reached is None:
                rec.reached = reached
            return
        reached_s = self.now()
        if rec.reached_s is None:
            rec.reached_s = reached_s
            rec.waited_s = max(0.0, rec.end_s - reached_s)
        if rec.end_s > reached_s:
            time.sleep(rec.end_s - reached_s)
        if rec.written is not None:
            standing = None if rec.written.done() else self.now()
            rec.written.result()  # (an error of the write raises here)
            if standing is not None:
                rec.late_s += self.now() - standing

    def _done(self, rec: Record) -> bool:
        if self._cuda is not None:
            return self._cuda.done(rec.handle)
        return self.now() >= rec.end_s and (rec.written is None or rec.written.done())

    def records(self) -> list[Record]:
        """Every collective since the last ``reset`` (on CUDA: waits for them)."""
        if self._cuda is not None:
            for rec in self._records:
                self._cuda.resolve(rec)
        return list(self._records)

    def summary(self) -> dict[str, Any]:
        """Totals since the last ``reset``: collectives by kind, the queue's
        busy time (the communication-only step), the exposed time, and on the
        CPU the time waits stood still for writes after the clock's end."""
        recs = self.records()
        by_kind: dict[str, int] = {}
        for r in recs:
            by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
        return {"collectives": by_kind, "bytes": sum(r.bytes for r in recs),
                "comm_s": sum(r.duration_s for r in recs), "exposed_s": sum(r.waited_s for r in recs),
                "late_s": sum(r.late_s for r in recs),
                "span_s": max((r.end_s for r in recs), default=0.0)}


def _fill(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out`` filled with ``value``'s elements, repeated as far as they
    reach (a gather's output: ``value`` in every rank's place); an output
    not contiguous is left as it is."""
    if not out.is_contiguous() or value.numel() == 0:
        return
    flat, src = out.view(-1), value.reshape(1, -1)
    whole, size = flat.numel() // src.numel(), src.numel()
    if whole:
        flat[: whole * size].view(whole, size).copy_(src.expand(whole, size))
    if flat.numel() > whole * size:
        flat[whole * size:].copy_(src[0, : flat.numel() - whole * size])


def _written(write: Callable[[], None]) -> None:
    """Runs ``write`` on the network's thread: in-place, whatever mode made
    the outputs (inference tensors too), recording no autograd."""
    with torch.inference_mode():
        write()


class EmulatedGroup(dist.ProcessGroup):
    """One group of the emulated job (the world, or a ``new_group`` /
    DeviceMesh sub-group): it prices and times each collective on its
    network and, on the CPU, writes the outputs ([Note: What the emulated
    collectives write])."""

    def __init__(self, net: EmulatedNetwork, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._net = net
        self._name = ""
        self._ranks: Optional[list[int]] = None

    # -- identity ------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return EMULATED_BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def ranks(self) -> list[int]:
        if self._ranks is None:
            self._ranks = dist.get_process_group_ranks(self) if self.size() > 1 else [self.rank()]
        return self._ranks

    @property
    def links(self) -> Links:
        """What ``CostModel.for_graph`` prices this group's collectives with."""
        return self._net.topology.links

    # -- collectives: (kind, the unsharded bytes) ----------------------------
    def _go(self, kind: str, tensors: Sequence[torch.Tensor],
            pairs: Optional[Callable[[], Sequence[tuple[torch.Tensor, torch.Tensor]]]] = None) -> _Work:
        """Issues ``kind`` moving ``tensors``; ``pairs`` gives each output and
        what it gets, on the network's thread ([Note: What the emulated
        collectives write])."""
        def write() -> None:
            for out, value in pairs():
                _fill(out, value)

        return self._net.issue(self, kind, tensor_bytes(list(tensors)), write if pairs is not None else None)

    def _part(self, input: torch.Tensor, numel: int) -> torch.Tensor:
        """This rank's ``numel`` elements of ``input`` (a reduce-scatter's
        part, an all-to-all's chunk)."""
        return input.reshape(-1)[self.rank() * numel:(self.rank() + 1) * numel]

    def allgather_into_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        return self._go("all_gather", outputs, lambda: list(zip(outputs, inputs)))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._go("all_gather", [output], lambda: [(output, input)])

    _allgather_base = all_gather_single

    def allgather(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        return self._go("all_gather", [t for ts in outputs for t in ts],
                        lambda: [(t, inp) for ts, inp in zip(outputs, inputs) for t in ts])

    def reduce_scatter_tensor_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        return self._go("reduce_scatter", inputs,
                        lambda: [(out, self._part(inp, out.numel())) for out, inp in zip(outputs, inputs)])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._go("reduce_scatter", [input], lambda: [(output, self._part(input, output.numel()))])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        return self._go("reduce_scatter", [t for ts in inputs for t in ts],
                        lambda: [(out, ins[self.rank()]) for out, ins in zip(outputs, inputs)])

    def allreduce(self, tensors: list, opts: Any = None) -> _Work:
        return self._go("all_reduce", tensors)

    allreduce_coalesced = allreduce

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> _Work:
        return self._go("all_to_all", [input], lambda: [(output, self._part(input, input.numel() // self.size()))])

    def broadcast(self, tensors: list, opts: Any = None) -> _Work:
        return self._go("broadcast", tensors)

    def scatter(self, outputs: list, inputs: list, opts: Any = None) -> _Work:
        """Priced as a broadcast of the whole; the source rank (``inputs``
        given) keeps its own chunk, as a real group leaves it, so that a
        ``distribute_tensor`` from this rank shards real values."""
        if inputs and inputs[0]:
            outputs[0].copy_(inputs[0][self.rank()])
        return self._go("broadcast", [t for ts in inputs for t in ts] or outputs)

    def barrier(self, opts: Any = None) -> _Work:
        return self._go("barrier", [])


def init_emulated_network(
    world_size: int, rank: int = 0, topology: Optional[Topology] = None, device: Optional[str] = None,
) -> EmulatedNetwork:
    """Starts the default process group as rank ``rank`` of an emulated
    ``world_size``-rank job on ``topology`` (default: ``Topology.nccl()``),
    timing collectives on ``device`` (default: CUDA when available). Every
    group made later (``new_group``, a DeviceMesh's dimensions) shares the
    returned network. End it with ``torch.distributed.destroy_process_group()``."""
    if dist.is_initialized():
        raise RuntimeError("init_emulated_network: a default process group exists already; call "
                           "torch.distributed.destroy_process_group() first.")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_emulated_network: rank {rank} is not in a world of {world_size} ranks.")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    net = EmulatedNetwork(topology or Topology.nccl(), dev)
    if EMULATED_BACKEND.upper() not in dir(dist.Backend):  # (torch keeps a registration for good)
        dist.Backend.register_backend(EMULATED_BACKEND, _create_group, devices=["cpu", "cuda"])
    # The network travels with the store: every group's creator gets a prefix
    # store over this one (the network keeps it alive, so it stays this object).
    net.store = _NetworkStore(net)
    dist.init_process_group(EMULATED_BACKEND, store=net.store, rank=rank, world_size=world_size)
    return net


class _NetworkStore(dist.Store):
    """A store that only carries the network its groups join (as torch's
    ``FakeStore``, nothing is stored)."""

    def __init__(self, network: EmulatedNetwork) -> None:
        super().__init__()
        self.network = network


def _create_group(store: Any, rank: int, size: int, timeout: Any) -> EmulatedGroup:
    """The backend's creator: the network is the one under ``store``'s prefixes."""
    while store is not None and not isinstance(store, _NetworkStore):
        store = getattr(store, "underlying_store", None)
    if store is None:
        raise RuntimeError("the emulated backend is started by compiled_fsdp.tools.emulated."
                           "init_emulated_network, not by init_process_group directly.")
    return EmulatedGroup(store.network, rank, size)
