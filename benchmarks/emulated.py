"""Ours against FSDP2 under an emulated cluster network: what a W-GPU job
would do, in one process per configuration (compiled_fsdp/tools/emulated.py,
[Note: The emulated network]).

    python benchmarks/emulated.py [--device cuda|cpu] [--worlds 8 64 512]
        [--links nccl | match match/4] [--layers N] [--kinds KIND ...] [--out DIR]

Kinds (each in a fresh process, rank 0 of W, local batch ``--batch``):
  floor         compute only: the unsharded model (bf16 on a GPU) compiled
                whole, AdamW stepping 1/W of the parameters (fp32)
  ours          compiled_fsdp, fully_shard per block + root, torch.compile(model)
  ours_regions  the same, each block a compile region (config.comm.block_regions):
                traced and compiled once, the next block's gather issued ahead
  ours_blocks   the same, each block compiled on its own (block.compile())
  ours_eager    compiled_fsdp's eager runtime
  fsdp2_eager   torch.distributed.fsdp.fully_shard
  fsdp2_blocks  FSDP2, each block compiled then sharded (torchtitan's recipe)
  graph_trainer torchtitan's graph_trainer: SimpleFSDP, the training step
                traced whole and rewritten by its passes (graph_trainer_peer.py;
                the patterns plain and titan_plain, where torchtitan imports)

Links: ``nccl`` is the cost model's H100 cluster (NVLink in a node of 8, 45
GB/s per GPU between nodes); ``match`` scales every link so that one block's
all-gather takes as long as the block's forward (a GPU job's ratio, for the
CPU), ``match/4`` 4x slower (communication-bound). ``--node-ratio R`` makes
the link within a node R times the match link (NVLink against a network:
about 8).

The levers of a network-bound job: ``--split-first-block`` (the first
block's feed-forward sharded on its own), ``--split-regions`` (every compile
region's block gathered and reduced in parts, ``overlap.split_regions``),
``--hsdp`` (a 2-D mesh, replicated
across the nodes, sharded within one, for ours and FSDP2) and
``--reduce-dtype bfloat16`` (gradients reduced in bf16).

Per configuration: step (median), first step, tokens/s per GPU, MFU (GPU),
peak memory (on the CPU the step's peak of tensor memory above what existed
before it, ``step MiB``: [Note: Measuring memory on CPU] in
benchmarks/workloads.py), the communication-only step (the queue's busy time: every
collective of a step, one after another), the lower bound max(floor step,
communication step), exposed communication (measured: on CUDA from a
profiler trace, the time a collective's spin kernel runs while no other
kernel does; on the CPU the time the waiting thread stood still), and for
``ours`` the schedule's predicted exposed communication (the passes'
timeline model over the compiled forward and backward graphs; for
``ours_regions`` with each region's call expanded as it runs:
``passes.region_step.predict_with_regions``), and the
optimizer's step with ``zero_grad`` (host time: all of it on the CPU); on the
CPU ``--host-call-us measure`` prices the sharding's host calls at what
each of ours' workers measured with collectives free (emulated_rates.py;
``priced_speed``: how much slower than its calibration the worker ran those
steps, by an eager block's clock read beside each). With
``--paired-floor``, each kind's process also times the floor, a floor step
beside each of its steps, and the table's ``paired x`` is the median of each
step over its own bound ([Note: The floor paired in one process]).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/ (after the installed package)

import llama  # noqa: E402
from emulated_build import build, titan_step  # noqa: E402
from emulated_rates import host_calls_measured, match_gbps, priced_compute, sync  # noqa: E402
from emulated_report import table, trace_exposed  # noqa: E402
from workloads import tensor_peak_mb  # noqa: E402

KINDS = ("floor", "ours", "ours_regions", "ours_blocks", "ours_eager", "fsdp2_eager", "fsdp2_blocks", "graph_trainer")
MODELS = {  # --model: the GPU job (Llama-3.1-8B dimensions), the CPU's, the tests'
    "8b": llama.LLAMA_3_1_8B.with_(checkpoint_blocks=True),
    "cpu": llama.LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn=768, vocab=4096, seq=256),
    "tiny": llama.LLAMA_TINY,
}


def _config(args: argparse.Namespace) -> llama.LlamaConfig:
    cfg = MODELS[args.model]
    kw: dict[str, Any] = {}
    if args.layers:
        kw["n_layers"] = args.layers
    if args.seq:
        kw["seq"] = args.seq
    return cfg.with_(**kw)


def _topology(link: str, args: argparse.Namespace):
    from compiled_fsdp.tools.emulated import Topology

    if link == "free":
        return Topology(node_gbps=1e12, node_latency_us=0.0, network_gbps=1e12, network_latency_us=0.0)
    if link == "nccl":
        return Topology.nccl(args.network_gbps)
    base, _, slower = link.partition("/")
    if base != "match" or args.match_gbps is None:
        raise ValueError(f"unknown link {link!r} (nccl, free, match, match/K)")
    t = Topology(node_gbps=args.match_gbps * args.node_ratio, node_latency_us=0.0, network_gbps=args.match_gbps,
                 network_latency_us=0.0)
    return t.slower(float(slower)) if slower else t


# --- one configuration (the worker: its models in emulated_build.py) ----------

def _mesh(args: argparse.Namespace, per_node: int) -> Any:
    """``--hsdp``: a 2-D mesh, replicated across the nodes of ``per_node``
    ranks and sharded within one (None: the world, sharded)."""
    if not args.hsdp:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if args.world % per_node:
        raise ValueError(f"--hsdp: a world of {args.world} ranks is no whole number of nodes of {per_node}")
    return init_device_mesh(args.device, (args.world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def _stepper(args: argparse.Namespace, kind: str, run: Any, opt: Any,
             optimizer: Optional[list[float]] = None) -> Callable[[int], None]:
    """One training step of ``kind`` on batch ``i`` (``optimizer``: each
    step's optimizer step and zero_grad, host time, appended)."""
    cfg, device = _config(args), torch.device(args.device)

    def step(i: int = 0) -> None:
        tokens = llama.batch(cfg, args.batch, seed=i, device=device)
        # (titan_plain: torchtitan's pattern with a plain loss, the head in the model's forward)
        if kind == "graph_trainer":  # (its graph runs the backward too)
            run(tokens)
        else:
            loss = titan_step(run, tokens) if args.pattern == "titan" else llama.loss_fn(run(tokens), tokens)
            loss.backward()
        t_opt = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=kind != "floor")
        if optimizer is not None:
            optimizer.append(time.perf_counter() - t_opt)

    return step


def _timed(step: Callable[[int], None], i: int, device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    step(i)
    sync(device)
    return time.perf_counter() - t


# [Note: The floor paired in one process]
# On this 2-core machine fresh processes of one configuration spread by
# 20-31% (the floor ran 0.474-0.623 s a step in three processes of one run:
# RESULTS, 2026-12-04), more than the goals' margins (1.10x the bound, 1.05x
# the floor). So ``--paired-floor`` builds the floor beside the kind in the
# kind's own process, compiled and warmed after it (outside the passes'
# recording; the two warm steps alternated), and times one floor step beside
# each measured step, before it at even steps and after it at odd ones: each
# step's ratio is to a floor step run moments away in the same process, and
# the table's ``paired x`` is the median of ``step / max(floor step,
# communication step)``. The floor's model stays in memory, so a paired run
# reports no CUDA peak (its ``step MiB``, the CPU's, is a step's own peak
# above what it began with). Tested by
# tests/test_emulated.py::test_paired_floor_ratios_are_per_pair.
def _paired_floor(args: argparse.Namespace, cfg: llama.LlamaConfig, device: torch.device,
                  step: Callable[[int], None]) -> Callable[[int], None]:
    """The floor's step, built in this process and warmed, a step of the
    kind's (``step``) after each of its own."""
    _, run, opt = build("floor", cfg, device, args.world, args.pattern)
    floor_step = _stepper(args, "floor", run, opt)
    for i in range(args.warmup):
        floor_step(i)
        step(i)
    return floor_step


def paired(times: list[float], floor_times: list[float], comm: list[float]) -> dict[str, Any]:
    """A kind's steps against the floor's steps paired with them (the note
    above): the floor's median, and the medians of each pair's ratio to the
    floor step and to the bound max(floor step, the step's communication)."""
    if not len(times) == len(floor_times) == len(comm):
        raise ValueError(f"pairs of unequal length: {len(times)} steps, {len(floor_times)} floor steps, "
                         f"{len(comm)} communication steps")
    return {"floor_step_times_s": floor_times, "paired_floor_step_s": statistics.median(floor_times),
            "x_floor_paired": statistics.median([t / f for t, f in zip(times, floor_times)]),
            "x_bound_paired": statistics.median([t / max(f, c) for t, f, c in zip(times, floor_times, comm)])}


def _predicted(timelines: list[Any]) -> dict[str, Any]:
    """The timeline model's step (passes/timeline.py): exposed and busy
    communication, compute, and its collectives (kind, bytes, exposed ms) in issue
    order, as the network's ``last_step`` lists them."""
    comms = [c for tl in timelines for c in sorted(tl.comms, key=lambda c: c.issue_s)]
    return {"predicted_exposed_s": sum(tl.exposed_s for tl in timelines),
            "predicted_comm_s": sum(tl.comm_s for tl in timelines),
            "predicted_compute_s": sum(tl.compute_s for tl in timelines),
            "predicted_host_calls": sum(tl.host_calls for tl in timelines),
            "predicted_collectives": [[c.kind, c.bytes, round(1e3 * c.exposed_s, 1)] for c in comms]}


def _prediction(kind: str, rec: Any) -> dict[str, Any]:
    """The timeline model's step for ``kind`` from what ``rec`` recorded (the
    last forward and backward compiled; with regions each region's call
    expanded); none for a kind the passes do not schedule."""
    last = {r.graph: r.after for r in rec.schedule if r.graph in ("forward", "backward")}
    if kind == "ours_regions":
        last = {graph: timeline for graph, timeline in rec.region_steps}
    if kind not in ("ours", "ours_regions") or set(last) != {"forward", "backward"}:
        return {}
    return _predicted([last["forward"], last["backward"]])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from compiled_fsdp.compile.install import recording
    from compiled_fsdp.passes.config import overlap
    from compiled_fsdp.tools.emulated import init_emulated_network

    device = torch.device(args.device)
    cfg = _config(args)
    # Cold caches: the first step is the compile a user waits for, and a cache
    # hit would skip the passes (no schedule report, no prediction). (The
    # driver gives each worker an empty kernel cache directory: run_one.)
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    compute, clock = priced_compute(args, cfg)
    topology = dataclasses.replace(_topology(args.link, args), compute=compute)
    # ([Note: Host calls measured with collectives free]: compiled first on a free network)
    measuring = args.host_call_us == "measure" and args.kind in ("ours", "ours_regions")
    overlap.split_regions = args.split_regions
    if args.bucket_bytes is not None:
        overlap.bucket_bytes = args.bucket_bytes
    net = init_emulated_network(args.world, device=args.device, topology=dataclasses.replace(
        _topology("free", args), compute=compute) if measuring else topology)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    optimizer: list[float] = []  # (each step's optimizer step and zero_grad, host time)
    with recording() as rec:
        model, run, opt = build(args.kind, cfg, device, args.world, args.pattern, _mesh(args, topology.ranks_per_node),
                                 args.reduce_dtype, args.split_first_block)
        step = _stepper(args, args.kind, run, opt, optimizer)
        first = _timed(step, 0, device)
        # Where the compile went: Dynamo's timers (seconds summed, calls), and how
        # many frames it compiled (identical blocks share one).
        compile_s = {k: [round(sum(v), 3), len(v)] for k, v in torch._dynamo.utils.compilation_time_metrics.items()}
        frames_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        free = _prediction(args.kind, rec) if measuring else {}
        if measuring:  # (then compiled again, the schedule priced with them)
            measured, unpriced, speed = host_calls_measured(
                args, lambda i: (net.reset(), _timed(step, i, device))[1], optimizer, free, compute, clock)
            topology = dataclasses.replace(topology, compute=measured)
            net.set_topology(topology)
            torch._dynamo.reset()
            step(0)
        for i in range(1, args.warmup):
            step(i)
    floor_step = _paired_floor(args, cfg, device, step) if args.paired_floor and args.kind != "floor" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, comm, exposed, late, floor_times = [], [], [], [], []
    optimizer.clear()
    faults = 0
    for i in range(args.steps):
        if floor_step is not None and i % 2 == 0:  # ([Note: The floor paired in one process])
            floor_times.append(_timed(floor_step, args.warmup + i, device))
        net.reset()
        faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times.append(_timed(step, args.warmup + i, device))
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        s = net.summary()
        comm.append(s["comm_s"])
        exposed.append(s["exposed_s"])
        late.append(s["late_s"])
        if floor_step is not None and i % 2 == 1:
            floor_times.append(_timed(floor_step, args.warmup + i, device))
    res: dict[str, Any] = {
        "kind": args.kind, "world": args.world, "link": args.link, "device": str(device), "variant": _variant(args),
        "config": cfg.__dict__, "batch": args.batch, "first_step_s": first, "step_s": statistics.median(times),
        "step_times_s": times, "optimizer_s": statistics.median(optimizer),
        "minor_faults_per_step": faults / args.steps,
        "comm_s": statistics.median(comm), "exposed_s": statistics.median(exposed),
        "late_s": statistics.median(late),  # ([Note: What the emulated collectives write])
        # (the rates the run declared: under --host-call-us measure at the free steps' speed)
        "priced_flops_per_s": topology.compute.flops_per_s if topology.compute is not None else None,
        "priced_attention_flops_per_s": topology.compute.attention_flops_per_s if topology.compute is not None
        else None,
        "collectives": s["collectives"], "topology": dataclasses.asdict(net.topology),
        "compile_s": compile_s, "unique_graphs": frames_compiled,
        # The last step's collectives as the network ran them (ms from the step's start):
        # where the link idled and where the step waited.
        "last_step": [{"kind": r.kind, "bytes": r.bytes, "issue": round(1e3 * r.issue_s, 1),
                       "start": round(1e3 * r.start_s, 1), "end": round(1e3 * r.end_s, 1),
                       "waited": round(1e3 * r.waited_s, 1), "late": round(1e3 * r.late_s, 1)}
                      for r in net.records()],
        "last_step_ms": round(1e3 * times[-1], 1),
        # (not beside a paired floor, whose unsharded model would count: [Note: The floor paired in one process])
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" and not floor_times
        else None,
    }
    if floor_times:
        res.update(paired(times, floor_times, comm))
    if device.type == "cuda":
        res.update(trace_exposed(lambda: step(0), device))
    else:  # (one step more, profiled: after the records above were read)
        res["step_peak_mib"] = tensor_peak_mb(lambda: step(args.warmup + args.steps))
    res.update(_prediction(args.kind, rec))
    res["priced_host_call_s"] = topology.compute.host_call_s if topology.compute is not None else None
    if measuring:  # ([Note: Host calls measured with collectives free])
        res.update(free_predicted_compute_s=free["predicted_compute_s"], free_unpriced_s=unpriced, priced_speed=speed)
    res["tokens_per_s"] = args.batch * cfg.seq / res["step_s"]
    res["mfu"] = res["tokens_per_s"] * model.flops_per_token() / args.peak_flops if device.type == "cuda" else None
    dist.destroy_process_group()
    return res


# --- the driver ----------------------------------------------------------------

# [Note: Freed memory kept on the CPU]
# glibc gives large freed blocks back to the kernel (munmap, or trimming the
# heap's top) and takes them again at the next allocation, each page a fault
# on first touch: at W=8 with collectives free, 10,400 minor faults a step in
# the floor, 12,200 in one graph, 18,000 with regions (fresh buffers of
# gathers and reduces), and the medians of fresh processes spread 4-7%. A
# GPU's caching allocator keeps freed blocks. ``--keep-freed-memory`` runs
# every CPU worker with glibc told to do the same (no trimming, no mmap below
# 32 MB, 256 MB of top pad): faults per step then 0-400 (RESULTS, 2026-12-01).
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 36),
                     "MALLOC_TOP_PAD_": str(256 << 20)}


def _variant(args: argparse.Namespace) -> str:
    """What this run changes of the plain job: ``hsdp``, ``rs-bf16``, ``split1``, ``nvlXR``."""
    short = {"bfloat16": "bf16", "float32": "fp32"}
    parts = (["hsdp"] if args.hsdp else []) + ([f"rs-{short[args.reduce_dtype]}"] if args.reduce_dtype else []) \
        + (["split1"] if args.split_first_block else []) + (["splitr"] if args.split_regions else [])
    return "+".join(parts + ([f"nvl{args.node_ratio:g}x"] if args.node_ratio != 1 else []))


def run_one(kind: str, world: int, link: str, args: argparse.Namespace) -> dict[str, Any]:
    variant = _variant(args)
    tag = f"_{variant}" if variant else ""
    result = os.path.join(args.out, f"{args.pattern}_{kind}_W{world}_{link.replace('/', '-')}{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--world", str(world), "--link", link,
           "--result", result, "--device", args.device, "--model", args.model, "--batch", str(args.batch),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--layers", str(args.layers or 0),
           "--threads", str(args.threads), "--pattern", args.pattern,
           "--seq", str(args.seq or 0)]
    if args.match_gbps is not None:
        cmd += ["--match-gbps", str(args.match_gbps)]
    if args.compute_gflops is not None:
        cmd += ["--compute-gflops", str(args.compute_gflops)]
    if args.host_call_us:
        cmd += ["--host-call-us", str(args.host_call_us)]
    if args.attention_gflops is not None:
        cmd += ["--attention-gflops", str(args.attention_gflops)]
    if args.network_gbps is not None:
        cmd += ["--network-gbps", str(args.network_gbps)]
    cmd += ["--node-ratio", str(args.node_ratio)] + (["--hsdp"] if args.hsdp else []) \
        + (["--reduce-dtype", args.reduce_dtype] if args.reduce_dtype else []) \
        + (["--paired-floor"] if args.paired_floor else []) \
        + (["--split-first-block"] if args.split_first_block else []) \
        + (["--split-regions"] if args.split_regions else []) \
        + (["--bucket-bytes", str(args.bucket_bytes)] if args.bucket_bytes is not None else [])
    start = time.perf_counter()
    # Cold: a cache directory of its own (Inductor's compiled kernels, Triton's),
    # so no configuration's first step reuses kernels another run compiled.
    with tempfile.TemporaryDirectory(prefix="emulated_cache_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        if args.keep_freed_memory and args.device == "cpu":
            env.update(KEEP_FREED_MEMORY)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout, env=env)
            ok, tail = proc.returncode == 0 and os.path.exists(result), (proc.stdout + proc.stderr)[-2500:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.worker_timeout}s"
    if not ok:
        print(f"[{kind} W={world} {link}] FAILED:\n{tail}", file=sys.stderr, flush=True)
        return {"kind": kind, "world": world, "link": link, "error": tail.strip().splitlines()[-1] if tail else ""}
    with open(result) as f:
        res = json.load(f)
    print("RESULT " + json.dumps({k: v for k, v in res.items() if k not in ("config", "topology")}), flush=True)
    print(f"[{kind} W={world} {link}] {time.perf_counter() - start:.0f}s: step {res['step_s']:.3f}s", file=sys.stderr,
          flush=True)
    return res


def _torch_version() -> str:
    """For the report (the project decides nothing from it: core/compat.py does)."""
    from importlib.metadata import version
    return version("torch")


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, choices=sorted(MODELS), help="default: 8b on CUDA, cpu on the CPU")
    p.add_argument("--layers", type=int, default=0, help="blocks (0: the model's own)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (0: the model's own)")
    p.add_argument("--batch", type=int, default=0, help="local batch (0: 1 on CUDA, 4 on the CPU)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process (the CPU runs)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="CPU runs: glibc keeps freed memory, as a caching allocator does "
                        "([Note: Freed memory kept on the CPU])")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    p.add_argument("--links", nargs="+", default=None, help="default: nccl on CUDA, match match/4 on the CPU")
    p.add_argument("--network-gbps", type=float, default=None, help="nccl: GB/s per GPU between nodes")
    p.add_argument("--match-gbps", type=float, default=None,
                   help="the match link's GB/s (default: measured per world; give one to pair runs)")
    p.add_argument("--compute-gflops", type=float, default=None,
                   help="CPU: the matmul GFLOP/s the passes price compute with (default: measured by each "
                        "worker at its start; 0: the cost model's constants)")
    p.add_argument("--attention-gflops", type=float, default=None,
                   help="CPU, with --compute-gflops: fused attention's GFLOP/s (default: the matmuls'; "
                        "measured with the matmul's when neither is given; used where torch's flop counter "
                        "has a formula for the CPU's attention op: 2.15, not 2.11 or 2.13)")
    p.add_argument("--host-call-us", default="0",
                   help="CPU: the host microseconds the passes price each call of the sharding's ops and each "
                        "collective's issue and wait with ([Note: The sharding's host work priced per call] in "
                        "passes/cost_model.py); measure: each of ours' workers its own, from steps with "
                        "collectives free before it compiles again ([Note: Host calls measured with "
                        "collectives free] in emulated_rates.py)")
    p.add_argument("--node-ratio", type=float, default=1.0,
                   help="match links: the link within a node this many times the match link's GB/s "
                        "(NVLink against the network: about 8)")
    p.add_argument("--hsdp", action="store_true", help="HSDP: replicate across nodes, shard within one")
    p.add_argument("--split-first-block", action="store_true",
                   help="the first block's feed-forward sharded on its own, for ours and FSDP2 "
                        "([Note: The first block split by first use] in emulated_build.py)")
    p.add_argument("--split-regions", action="store_true",
                   help="ours: every compile region cut as the opening block (compiled_fsdp.passes.config."
                        "overlap.split_regions; [Note: Every compile region cut as the opening block])")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="ours: compiled_fsdp.passes.config.overlap.bucket_bytes (0: no bucket merges)")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default=None,
                   help="the gradients' reduce dtype (default: fp32)")
    p.add_argument("--paired-floor", action="store_true",
                   help="time the floor beside each kind in its own process, a floor step beside each step "
                        "(the table's 'paired x': [Note: The floor paired in one process])")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--pattern", default="plain", choices=("plain", "titan", "titan_plain"),
                   help="titan: torchtitan's per-block compile, selective AC and chunked loss (not 'ours'); "
                        "titan_plain: the same with a plain loss")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak-flops", type=float, default=989e12)
    p.add_argument("--out", default="emulated_out")
    p.add_argument("--worker-timeout", type=float, default=600.0)
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--link", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host_call_us != "measure":
        try:
            args.host_call_us = float(args.host_call_us)
        except ValueError:
            p.error(f"--host-call-us: microseconds, or measure, not {args.host_call_us!r}")
        if not args.host_call_us >= 0:  # (NaN too)
            p.error(f"--host-call-us: microseconds, 0 or more, not {args.host_call_us}")
    if args.host_call_us and args.device != "cpu":
        p.error("--host-call-us prices the CPU's host calls, which a CPU worker declares with its compute; a "
                "GPU's host calls overlap its kernels: leave it out on CUDA")
    if args.host_call_us and args.compute_gflops == 0:
        p.error("--host-call-us prices host calls beside the compute a CPU worker declares; --compute-gflops 0 "
                "declares none (the cost model's constants): give one or the other")
    args.model = args.model or ("8b" if args.device == "cuda" else "cpu")
    args.batch = args.batch or (1 if args.device == "cuda" else 4)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    if args.worker:
        args.kind = args.worker
        res = measure(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return [res]
    if args.attention_gflops is not None and args.compute_gflops is None:
        p.error("--attention-gflops fixes attention's rate beside a fixed matmul rate: give --compute-gflops "
                "too (without either, each worker measures both)")
    links = args.links or (["nccl"] if args.device == "cuda" else ["match", "match/4"])
    if args.node_ratio != 1 and not all(link.startswith("match") for link in links):
        p.error("--node-ratio sets a matched link's speed within a node; the nccl link has its own "
                "NVLink figure and a free one costs nothing: run those without it")
    if args.split_first_block and (args.pattern != "plain" or "graph_trainer" in args.kinds):
        p.error("--split-first-block shards the plain pattern's first block in two; torchtitan's pattern and "
                "graph_trainer build their own: leave it out with --pattern titan* and --kinds graph_trainer")
    if args.pattern.startswith("titan"):
        args.kinds = [k for k in args.kinds if k not in ("ours", "ours_regions")]
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    results = []
    given = args.match_gbps  # (fixed: runs to pair share one link)
    for world in args.worlds:
        if given is None and any(link.startswith("match") for link in links):
            args.match_gbps = match_gbps(args, _config(args), world)
            print(f"W={world}: link {args.match_gbps:.3f} GB/s matches a block's forward", file=sys.stderr)
        for i, link in enumerate(links):  # the floor communicates nothing: once per world
            results += [run_one(kind, world, link, args) for kind in args.kinds if kind != "floor" or i == 0]
    text = table(results)
    out = {"results": results, "table": text, "wall_s": time.perf_counter() - start, "torch": _torch_version(),
           "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "argv": argv or sys.argv}
    with open(os.path.join(args.out, "emulated.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"emulated network on {out['device_name']}, torch {out['torch']}, {out['wall_s']:.0f}s")
    print(text)
    return results


if __name__ == "__main__":
    main()
