"""One rank's side of each benchmark configuration (run by ``benchmarks/run.py``
on 2 gloo ranks, 1 thread each).

[Note: Measuring memory on CPU]
There is no ``torch.cuda.max_memory_allocated`` for CPU tensors. A sampler
thread reads the process's resident set size (``/proc/self/statm``) every
2 ms during the measured steps. Reported: ``rss_peak_mb``, the peak RSS in the
measured window (includes Python, torch, compiled code, glibc caches), and
``step_peak_mb``, that peak minus the RSS just before the window: the
transient memory of one step (activations, gathered parameters, gradient
buffers) once the persistent state (shards, optimizer state) exists. Limits:
a sample can miss a peak shorter than 2 ms, and memory glibc keeps cached
after ``free`` still counts as resident. Two identical configurations
measured 137.7 and 106.0 MiB of ``step_peak_mb`` in one run (2026-11-25), so
it cannot compare schedules. ``tensor_peak_mb`` can: one more step under
``torch.profiler`` with ``profile_memory=True``, whose memory events carry
the CPU allocator's running total of bytes allocated since profiling began
("Total Allocated"); its maximum is the step's peak of tensor memory above
what existed before the step (as ``torch.cuda.max_memory_allocated`` minus
the memory allocated at the step's start), exact and the same on every run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import threading
import time
import types
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from paired import rotate_steps

from examples.gpt import GPTConfig, batch, bench, loss_fn

BATCH = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _RssSampler:
    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self) -> "_RssSampler":
        self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


_OWN_CLASSES: dict[tuple[type, str], type] = {}


def _own_code(model: torch.nn.Module, tag: str) -> torch.nn.Module:
    """Gives each configuration its own copy of the model classes' forward
    code, as separate processes would. Dynamo keeps its caches and skip marks
    per code object: a frame skipped for one configuration ("graph break in
    loop": FSDP2 compiled breaks at every block) is skipped for every model
    running that code. Measured: built after FSDP2 compiled in the paired
    run, ours compiled ran its root untraced, each block compiled as a frame
    of its own, from its first paired step on. Not isolated: what every
    module shares, such as ``nn.Module._call_impl``, which ``block.compile()``
    compiles (the ``_blocks`` kinds)."""
    for module in model.modules():
        cls = type(module)
        if "forward" not in vars(cls) or cls.__module__.startswith("torch."):  # (the model's own classes)
            continue
        own = _OWN_CLASSES.get((cls, tag))
        if own is None:
            fwd = vars(cls)["forward"]
            code = fwd.__code__.replace(co_name=f"{fwd.__code__.co_name}_{tag}",
                                        co_qualname=f"{fwd.__code__.co_qualname}_{tag}")
            forward = types.FunctionType(code, fwd.__globals__, code.co_name, fwd.__defaults__, fwd.__closure__)
            forward.__kwdefaults__ = fwd.__kwdefaults__
            own = _OWN_CLASSES[(cls, tag)] = type(cls.__name__, (cls,), {"forward": forward,
                                                                           "__module__": cls.__module__})
        module.__class__ = own
    return model


def _build(kind: str, n_layers: int = 8, tag: str = "", dim: int = 512,
           caches: bool = False, own_code: bool = True) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Returns (model whose parameters the optimizer steps, callable to run).
    A ``_bf16`` kind gathers and computes in bf16 and reduces in fp32 (both
    FSDPs' ``MixedPrecisionPolicy``); its compute floor runs a bf16 model. A
    ``_blocks`` kind compiles each block on its own (``block.compile()``, the
    root eager: torchtitan's pattern; see [Note: Blocks compiled on their own]);
    ``_blocks_nohandoff`` without the gathers handed from block to block.
    ``own_code`` False: the model's classes as they are (one configuration
    a process; a saved trace names its code by its class)."""
    model = _own_code(bench(n_layers, dim), tag or kind) if own_code else bench(n_layers, dim)
    if kind.endswith("_float8"):  # the blocks' linears in torchao's float8, gathered as float8
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("layers"))
        kind = kind.removesuffix("_float8")
    # Shards, gradients and AdamW on the CPU (both FSDPs' CPUOffloadPolicy; on
    # a CPU-only machine the compute device is the CPU, so no copies).
    offload = kind.endswith("_offload")
    kind = kind.removesuffix("_offload")
    bf16 = kind.endswith("_bf16")
    mesh = None
    if kind.endswith("_hsdp"):  # 2 replicas, each sharded over half the ranks
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world < 4 or world % 2:
            raise ValueError(f"{kind}: HSDP needs an even world of at least 4 ranks (--world 4), not {world}")
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        kind = kind.removesuffix("_hsdp")
    # Every configuration compiles from scratch (the first step is the compile
    # time a user waits for), and for ours a cache hit would skip the passes,
    # leaving the schedule report empty; ``caches`` keeps torch's defaults (on:
    # the warm start of benchmarks/depth.py).
    torch._functorch.config.enable_autograd_cache = caches
    torch._inductor.config.fx_graph_cache = caches
    if kind.startswith("ours"):
        import compiled_fsdp

        mp = compiled_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
        policy = compiled_fsdp.CPUOffloadPolicy(pin_memory=False) if offload else None
        if "_single" not in kind:  # manual nesting; else one call (see [Note: Units])
            for block in model.layers:
                compiled_fsdp.fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
        compiled_fsdp.fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    elif kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = mesh or init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    elif bf16:
        model.to(torch.bfloat16)
    if "_blocks" in kind:
        for block in model.layers:
            block.compile()
        return model, model
    if kind == "compute_compiled_regions":  # torch's own compile regions, nothing sharded
        cls = type(model.layers[0])
        region = type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(cls.forward),
                                             "__module__": cls.__module__})
        for block in model.layers:
            block.__class__ = region
    compiled = kind.startswith("ours_compiled") or kind.removesuffix("_bf16").removesuffix("_regions").endswith(
        "compiled")
    return model, (torch.compile(model) if compiled else model)


@contextlib.contextmanager
def _knobs(kind: str) -> Iterator[None]:
    """The overlap knobs of ``kind`` while it is sharded, compiled and warmed
    up (they are read then); the defaults again afterwards, so configurations
    built later in the same process (paired mode) are not affected."""
    from compiled_fsdp import config as comm_config
    from compiled_fsdp.passes import config

    kind = kind.removesuffix("_offload")  # (a policy, no knob: see ``_build``)
    saved = dataclasses.replace(config.overlap)
    saved_comm = dataclasses.replace(comm_config.comm)
    config.overlap.schedule = kind != "ours_compiled_nosched"
    config.overlap.units = not kind.endswith("_nounits")
    config.overlap.own_order = kind != "ours_compiled_composed"
    comm_config.comm.separate_reduce_group = kind != "ours_compiled_onegroup"
    comm_config.comm.gloo_reduce_by_all_to_all = kind != "ours_compiled_gloors"
    comm_config.comm.check_collectives = not kind.endswith("_nocheck")
    comm_config.comm.hand_over_gathers = not kind.endswith("_nohandoff")
    comm_config.comm.block_regions = kind.endswith("_regions")
    try:
        yield
    finally:
        for field in dataclasses.fields(saved):
            setattr(config.overlap, field.name, getattr(saved, field.name))
        for field in dataclasses.fields(saved_comm):
            setattr(comm_config.comm, field.name, getattr(saved_comm, field.name))


def _train_step(kind: str, rank: int, n_layers: int = 8, tag: str = "", dim: int = 512,
                caches: bool = False, own_code: bool = True) -> Callable[[], float]:
    """Builds one training configuration; returns its timed step. Build and
    warm it up inside ``_knobs(kind)``: the knobs are read when the model is
    sharded and when it first compiles."""
    torch.manual_seed(0)
    model, run = _build(kind, n_layers, tag or kind, dim, caches, own_code)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = batch(GPTConfig(), BATCH, seed=rank)

    precompute = _float8_precompute(kind)

    def step() -> float:
        t0 = time.perf_counter()
        loss = loss_fn(run(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute(model)
        return time.perf_counter() - t0

    return step


def _float8_precompute(kind: str) -> Callable[[torch.nn.Module], None]:
    """A ``_float8`` kind's step ends as torchao asks both FSDPs' users to:
    ``precompute_float8_dynamic_scale_for_fsdp`` after the optimizer step."""
    if kind.endswith("_float8") and not kind.startswith("compute"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return precompute_float8_dynamic_scale_for_fsdp
    return lambda model: None


def _schedule_summary() -> list[dict]:
    from compiled_fsdp.compile.install import last_schedule_reports

    return [
        {"graph": r.graph, "changed": r.changed, "moves": len(r.moves),
         "budget_bytes": r.budget_bytes, "max_in_flight_bytes": r.max_in_flight_bytes,
         "predicted_exposed_before_s": r.before.exposed_s,
         "predicted_exposed_after_s": r.after.exposed_s,
         "predicted_compute_s": r.after.compute_s, "predicted_comm_s": r.after.comm_s}
        for r in last_schedule_reports()
    ]


def tensor_peak_mb(step: Callable[[], Any]) -> float:
    """MiB: the peak of tensor memory above what existed before ``step``
    (one call of it, profiled). See [Note: Measuring memory on CPU]."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    return max([0, *totals]) / 2**20


def train_rank(rank: int, world: int, kind: str, warmup: int, steps: int, n_layers: int = 8) -> dict:
    """Step times and memory of one configuration on this rank."""
    with _knobs(kind):
        step = _train_step(kind, rank, n_layers)
        first = [step() for _ in range(warmup)]
    before = _rss()
    with _RssSampler() as mem:
        times = [step() for _ in range(steps)]
    out = {
        "step_s": statistics.median(times), "times_s": times, "first_step_s": first[0],
        "rss_peak_mb": mem.peak / 2**20, "step_peak_mb": (mem.peak - before) / 2**20,
        "tensor_peak_mb": tensor_peak_mb(step),
    }
    if kind.startswith("ours_compiled"):
        out["schedule"] = _schedule_summary()
    return out


# Dynamo's timers that say where a compile goes (seconds summed over calls):
# tracing bytecode, AOTAutograd's joint trace and partition, Inductor (forward
# and backward graphs), and the whole of it (the forward frame's compile and
# the backward's, compiled at its first run).
COMPILE_PHASES = {"dynamo_trace": ("bytecode_tracing",), "aot_trace": ("aot_trace_joint_graph",),
                  "partition": ("min_cut_rematerialization_partition",), "inductor": ("compile_fx_inner",),
                  "total": ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")}


def compile_rank(rank: int, world: int, kind: str, steps: int, n_layers: int, dim: int, caches: bool,
                 cache_dir: str, precompile: bool = False) -> dict:
    """The first step of one configuration and where its compile went: Dynamo's
    phases, the passes' own seconds and node counts, the graphs Dynamo made,
    and the cache hits (``caches``: torch's caches on, for a warm start), with
    Inductor's cache directory ``cache_dir``. ``precompile``: Dynamo's traces
    saved there too and loaded from there (torch's caching precompile: [Note:
    Generated classes by reference] in compiled_fsdp/runtime/generated.py)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    from compiled_fsdp.compile.install import recording

    # (Inductor reads the variable at each use; a forked rank starts with the server's)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    with torch._dynamo.config.patch(caching_precompile=precompile):
        with _knobs(kind), recording() as rec:
            step = _train_step(kind, rank, n_layers, dim=dim, caches=caches, own_code=not precompile)
            first = step()
        times = [step() for _ in range(steps)]
        if precompile:
            torch.compiler.save_cache_artifacts()
    phases = {name: round(sum(sum(compilation_time_metrics.get(k, [])) for k in keys), 3)
              for name, keys in COMPILE_PHASES.items()}
    passes: dict[str, float] = {}
    for p in rec.pipelines:
        for name, secs in p.seconds.items():
            passes[f"{p.stage}.{name}"] = round(passes.get(f"{p.stage}.{name}", 0.0) + secs, 3)
    return {"first_step_s": first, "step_s": statistics.median(times), "phases_s": phases, "passes_s": passes,
            "nodes": [(p.stage, *p.nodes) for p in rec.pipelines],
            "graphs": counters["stats"]["unique_graphs"],
            "cache": {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
                      if k.startswith(("fxgraph_cache", "autograd_cache"))}}


def bucket_numels(world: int) -> tuple[list[int], list[int], list[int]]:
    """Shard numel of each bucket of the compiled nested step, padded like the
    lowering: the root's first units (embed, and pos: 512 KiB is above the
    merge threshold), the blocks, the root's last unit (norm + head), as
    [Note: Units] cuts them."""
    model = bench()

    def shard_numel(params: list[torch.nn.Parameter]) -> int:
        total = 0
        for p in params:
            d0 = p.shape[0] if p.dim() else 1
            rest = p.numel() // d0 if p.dim() else 1
            total += -(-d0 // world) * rest
        return total

    blocks = [shard_numel(list(b.parameters())) for b in model.layers]
    first = [shard_numel([model.embed.weight]), shard_numel([model.pos])]
    last = shard_numel(list(model.norm.parameters()) + list(model.head.parameters()))
    return first, blocks, [last]


def _timed(fn: Callable[[], None]) -> Callable[[], float]:
    def step() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return step


def _comm_step(world: int) -> tuple[Callable[[], None], int, int]:
    """One step's collectives, in the compiled step's order and sizes: forward
    gathers (the root's first unit, blocks, its last unit), backward re-gathers
    (blocks, reversed: the embeddings' backward reads no weight, the last unit
    is kept), one gradient reduce per bucket, as the project runs it
    (on gloo an all-to-all plus a sum, see [Note: Reduce-scatter on gloo]);
    each waited at once. Returns (step function, collective count, unsharded bytes)."""
    from compiled_fsdp.config import comm
    from compiled_fsdp.core.comm import reduce_scatter_flat, uses_all_to_all

    fc = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    first, blocks, last = bucket_numels(world)
    every = first + blocks + last
    shards = {n: torch.randn(n) for n in set(every)}
    fulls = {n: torch.randn(n * world) for n in set(every)}
    plan = ([("ag", n) for n in every] + [("ag", n) for n in reversed(blocks)]
            + [("rs", n) for n in reversed(every)])

    def step() -> None:
        for kind, n in plan:
            if kind == "ag":
                fc.wait_tensor(fc.all_gather_into_tensor(shards[n], world, group))
            else:
                reduce_scatter_flat(fulls[n], dist.group.WORLD,
                                    uses_all_to_all(dist.group.WORLD, comm.gloo_reduce_by_all_to_all)).wait()

    return step, len(plan), sum(n * world * 4 for _, n in plan)


def comm_rank(rank: int, world: int, warmup: int, steps: int) -> dict:
    """The step's collectives alone (see ``_comm_step``)."""
    comm, count, nbytes = _comm_step(world)
    step = _timed(comm)
    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    return {"step_s": statistics.median(times), "times_s": times, "collectives": count,
            "bytes_unsharded": nbytes}


def _overlap_step(rank: int, world: int) -> Callable[[], float]:
    """The ``overlap_limit`` step (see ``overlap_limit_rank``): the unsharded
    compiled step on this thread, the step's collectives on a second one."""
    compute = _train_step("compute_compiled", rank, tag="overlap_limit")
    comm, _, _ = _comm_step(world)
    go, done = threading.Semaphore(0), threading.Semaphore(0)

    def comm_loop() -> None:
        while True:
            go.acquire()
            comm()
            done.release()

    threading.Thread(target=comm_loop, daemon=True).start()

    def step() -> float:
        t0 = time.perf_counter()
        go.release()
        compute()
        done.acquire()
        return time.perf_counter() - t0

    return step


def overlap_limit_rank(rank: int, world: int, warmup: int, steps: int) -> dict:
    """The best overlap this machine allows.

    [Note: The overlap limit]
    ``max(compute-only, comm-only)`` assumes communication costs no compute
    time. On this machine it does: gloo moves loopback bytes with CPU copies
    (its worker threads and the kernel's TCP stack) on the same two cores the
    ranks compute on. So this configuration measures the limit directly: each
    rank runs the unsharded compiled step (``compute_compiled``) on its main
    thread while a second thread runs the step's collectives (``comm_only``)
    back to back, with no data dependence between the two. No schedule can
    overlap better than that, because nothing ever waits for a collective it
    needs; the step ends when both are done. ``(compute + comm - limit) /
    comm`` is the fraction of the communication that can hide here at all."""
    step = _overlap_step(rank, world)
    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    return {"step_s": statistics.median(times), "times_s": times}


def paired_rank(rank: int, world: int, kinds: list[str], warmup: int, steps: int, n_layers: int = 8) -> dict:
    """Several configurations in one process pair, alternating step by step.
    See [Note: Paired steps] in benchmarks/run.py."""
    fns: dict[str, Callable[[], float]] = {}
    for kind in kinds:
        with _knobs(kind):  # compiles now, under this kind's knobs
            if kind == "comm_only":
                fn = _timed(_comm_step(world)[0])
            elif kind == "overlap_limit":
                fn = _overlap_step(rank, world)
            else:
                fn = _train_step(kind, rank, n_layers)
            for _ in range(warmup):
                fn()
        fns[kind] = fn
    dist.barrier()  # (the ranks finish compiling and warming up apart: start the steps together)
    return {"times_s": rotate_steps(fns, steps)}
