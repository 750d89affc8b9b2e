"""The emulated cluster network (compiled_fsdp/tools/emulated.py, [Note: The
emulated network]): its groups' semantics at W = 8 and 64 (shapes, the shard
each rank holds, collective counts, the order works complete in), the clock's
arithmetic checked on the network's own record of issue, start, end and wait
times (never on wall time), the passes pricing with the group's links (and
the compute it declares), and the benchmark's CPU path on a tiny model. Each case runs in a fresh process:
the emulated group is the process's default group."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SEMANTICS = r"""
import json, math, sys, time, torch, torch.distributed as dist, torch.fx as fx
import torch.distributed._functional_collectives as fc
from torch.distributed.device_mesh import init_device_mesh
from compiled_fsdp.tools.emulated import Topology, init_emulated_network
from compiled_fsdp.passes.cost_model import AG, CostModel

world = int(sys.argv[1])
# slow links (ms per collective), so that the clock's arithmetic is visible
# (latencies of milliseconds: with 0.1 ms, a CI run under load once took
# longer to issue two more collectives than the first one took)
topo = Topology(node_gbps=0.5, node_latency_us=2000.0, network_gbps=0.1, network_latency_us=4000.0)
net = init_emulated_network(world, rank=0, topology=topo, device="cpu")
out = {"backend": dist.get_backend(), "size": dist.get_world_size()}
model = CostModel().with_links(topo.links)

def price(kind, nbytes, n, across):
    return model.comm_time(kind, nbytes, n, across_nodes=across)

# eager collectives: shapes as a real group's, one record each, priced by the cost model
x = torch.ones(1000)
g_out = torch.empty(world * 1000)
w1 = dist.all_gather_into_tensor(g_out, x, async_op=True)
returned = net.now()  # (the issue returns before the collective ends)
r_out = torch.empty(1000)
w2 = dist.reduce_scatter_tensor(r_out, torch.ones(world * 1000), async_op=True)
w3 = dist.all_reduce(torch.ones(500), async_op=True)
w3.wait()  # the last one issued: the queue runs in issue order, so the others are done too
out["completed_after_last_wait"] = [w1.is_completed(), w2.is_completed()]
out["returned_before_end"] = returned < net.records()[0].end_s
w1.wait(); w2.wait()
recs = net.records()
out["kinds"] = [r.kind for r in recs]
out["bytes"] = [r.bytes for r in recs]
across = world > 8  # the world spans nodes of 8
expect = [price("all_gather", world * 4000, world, across), price("reduce_scatter", world * 4000, world, across),
          price("all_reduce", 2000, world, across)]
out["priced"] = [abs(r.duration_s - e) < 1e-12 for r, e in zip(recs, expect)]
# the queue: each starts at max(its issue, the previous end) and takes its price
ok, prev_end = True, 0.0
for r in recs:
    ok &= abs(r.start_s - max(r.issue_s, prev_end)) < 1e-9 and abs(r.end_s - (r.start_s + r.duration_s)) < 1e-9
    prev_end = r.end_s
out["fifo"] = ok
# exposed: the first wait (on the last issued) stood still until its end; the later waits found theirs done
out["waited"] = [r.waited_s for r in recs]
out["waited_is_end_minus_reached"] = all(abs(r.waited_s - max(0.0, r.end_s - r.reached_s)) < 1e-9 for r in recs)
out["summary"] = net.summary()

# what the collectives write ([Note: What the emulated collectives write]): what a real group's would if
# every rank held this rank's input; unwritten, the outputs kept their NaNs
net.reset()
src = torch.arange(6.)
gathered, part = torch.full((world * 6,), float("nan")), torch.full((6,), float("nan"))
dist.all_gather_into_tensor(gathered, src)
dist.reduce_scatter_tensor(part, torch.arange(world * 6.))  # (rank 0's part)
listed = [torch.full((6,), float("nan")) for _ in range(world)]
dist.all_gather(listed, src)
out["written"] = [torch.equal(gathered.view(world, 6), src.expand(world, 6)), torch.equal(part, src),
                  all(torch.equal(t, src) for t in listed)]

# a wait long after the end costs nothing
net.reset()
w = dist.all_reduce(torch.ones(10), async_op=True)
time.sleep(net.records()[0].duration_s + 0.01)
w.wait()
out["late_wait"] = net.records()[0].waited_s

# sub-groups: a (W/8, 8) mesh; a group within a node is priced on the node's link, one across nodes on the network
net.reset()
mesh = init_device_mesh("cpu", (world // 8, 8), mesh_dim_names=("replicate", "shard"))
shard, rep = mesh.get_group("shard"), mesh.get_group("replicate")
dist.all_reduce(torch.ones(1000), group=shard)
dist.all_reduce(torch.ones(1000), group=rep)
recs = net.records()
out["sub_sizes"] = [r.group_size for r in recs]
out["sub_priced"] = [abs(recs[0].duration_s - price("all_reduce", 4000, 8, False)) < 1e-12,
                     abs(recs[1].duration_s - price("all_reduce", 4000, world // 8, True)) < 1e-12]
out["node_vs_network"] = recs[0].duration_s < price("all_reduce", 4000, 8, True)
# the passes tell a group within a node from one across nodes by its ranks, as the network does
# (a replica group of shard groups of 4: within a node at W = 8, across at 64; decided by its size and stride)
quarter = init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard")).get_group("replicate")
out["spans_nodes"] = [model.spans_nodes(g.group_name) for g in (shard, rep, quarter)] + [model.spans_nodes(None)]

# functional collectives, compiled: one record per collective, the passes price with the group's links
net.reset()
f = torch.compile(lambda t: fc.all_gather_tensor(t, 0, dist.group.WORLD) * 2, backend="aot_eager")
y = f(torch.ones(8))
out["functional_shape"] = list(y.shape)
out["functional_written"] = torch.equal(y, torch.full((8 * world,), 2.0))
out["functional_kinds"] = [r.kind for r in net.records()]
g = fx.Graph()
inp = g.placeholder("x")
inp.meta["val"] = torch.empty(8)
ag = g.call_function(AG, (inp, world, dist.group.WORLD.group_name))
ag.meta["val"] = torch.empty(8 * world)
out["for_graph_links"] = CostModel.for_graph(g).comm == topo.links.comm
out["for_graph_price"] = abs(CostModel.for_graph(g).collective_time(ag)
                            - price("all_gather", 32 * world, world, across)) < 1e-12
# the compute the network declares prices the graph's compute: [Note: Compute declared by the network]
import dataclasses
from compiled_fsdp.passes.cost_model import CPU_COMPUTE
from compiled_fsdp.tools.cpu_compute import cpu_compute_at
col, row = (g.call_function(torch.ops.aten.view.default, (ag, shape)) for shape in ([8 * world, 1], [1, 8 * world]))
col.meta["val"], row.meta["val"] = torch.empty(8 * world, 1), torch.empty(1, 8 * world)
mm = g.call_function(torch.ops.aten.mm.default, (col, row))
mm.meta["val"] = torch.empty(8 * world, 8 * world)
undeclared = CostModel.for_graph(g).compute_time(mm)
net.topology = dataclasses.replace(topo, compute=cpu_compute_at(CPU_COMPUTE.flops_per_s / 4))
out["declared_compute"] = [CostModel.for_graph(g).compute == net.topology.compute,
                           abs(CostModel.for_graph(g).compute_time(mm) - 4 * undeclared) < 1e-15, undeclared > 0]
net.topology = topo

# fully_shard under it: rank 0 holds ceil(rows / W) rows; the record counts what the runtime issued
from compiled_fsdp import collective_counts, fully_shard, reset_collective_counts
from compiled_fsdp.tools.models import GPT, GPTConfig, batch, loss_fn
torch.manual_seed(0)
m = GPT(GPTConfig(vocab=128, dim=64, n_layers=2, n_heads=2, seq=16))
full = {n: list(p.shape) for n, p in m.named_parameters()}
for block in m.layers:
    fully_shard(block)
fully_shard(m)
out["shard_rows_ok"] = all(list(p.to_local().shape) == [-(-full[n][0] // world)] + full[n][1:]
                           for n, p in m.named_parameters())
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
net.reset(); reset_collective_counts()
tokens = batch(m.cfg, 2, 0)
loss_fn(m(tokens), tokens).backward()
opt.step()
s = net.summary()
out["fsdp_counts"] = [s["collectives"], collective_counts()]
out["fsdp_exposed_le_comm"] = 0 <= s["exposed_s"] <= s["comm_s"] + 1e-9
print(json.dumps(out))
"""


def _run(script: str, *args: str, timeout: int = 300) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("world", [8, 64])
def test_group_semantics_and_clock(world: int) -> None:
    res = _run(_SEMANTICS, str(world))
    assert res["backend"] == "emulated" and res["size"] == world
    assert res["kinds"] == ["all_gather", "reduce_scatter", "all_reduce"]
    assert res["bytes"] == [world * 4000, world * 4000, 2000]  # the unsharded buffers
    assert res["priced"] == [True, True, True]
    assert res["fifo"] and res["waited_is_end_minus_reached"]
    assert res["completed_after_last_wait"] == [True, True] and res["returned_before_end"]
    waited = res["waited"]
    assert waited[2] > 0 and waited[0] == 0 and waited[1] == 0  # only the first wait stood still
    assert res["summary"]["collectives"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}
    assert res["late_wait"] == 0
    assert res["written"] == [True, True, True] and res["functional_written"]
    assert res["sub_sizes"] == [8, world // 8] and res["sub_priced"] == [True, True] and res["node_vs_network"]
    assert res["spans_nodes"] == [False, world > 8, world > 8, True], res["spans_nodes"]
    assert res["functional_shape"] == [8 * world] and res["functional_kinds"] == ["all_gather"]
    assert res["for_graph_links"] and res["for_graph_price"]
    assert res["declared_compute"] == [True, True, True], res["declared_compute"]
    assert res["shard_rows_ok"]
    record_counts, runtime_counts = res["fsdp_counts"]
    # every collective the eager runtime issued went through the network, once
    assert record_counts == {k: runtime_counts[k] for k in ("all_gather", "reduce_scatter")}
    assert res["fsdp_exposed_le_comm"]


_WRITES = r"""
import json, torch, torch.distributed as dist
from compiled_fsdp.tools.emulated import Topology, init_emulated_network

free = Topology(node_gbps=1e12, node_latency_us=0.0, network_gbps=1e12, network_latency_us=0.0)
net = init_emulated_network(8, rank=3, topology=free, device="cpu")
nan = lambda n: torch.full((n,), float("nan"))
src, part, swapped = torch.arange(6.), nan(6), nan(48)
dist.reduce_scatter_tensor(part, torch.arange(48.))
dist.all_to_all_single(swapped, torch.arange(48.))
out = {"part": part.tolist(), "all_to_all": torch.equal(swapped.view(8, 6), torch.arange(18., 24.).expand(8, 6))}
# issue order: waiting on an all-reduce (nothing to write) waits for the large gather issued before it
big, gathered = torch.randn(1 << 20), nan(8 << 20)
w1 = dist.all_gather_into_tensor(gathered, big, async_op=True)
w2 = dist.all_reduce(torch.ones(4), async_op=True)
w2.wait()
out["earlier_done"] = [w1.is_completed(), int(gathered.isnan().sum()), torch.equal(gathered.view(8, -1)[5], big)]
s, recs = net.summary(), net.records()
out["late_apart"] = [s["late_s"] == sum(r.late_s for r in recs), s["exposed_s"] == sum(r.waited_s for r in recs)]
print(json.dumps(out))
"""


def test_collectives_write_this_ranks_part() -> None:
    """[Note: What the emulated collectives write] at rank 3 of 8: a
    reduce-scatter's output is rank 3's part of its input (not rank 0's), an
    all-to-all's is that part in every place, and a wait on a collective
    with nothing to write still waits for the writes of those issued before
    it (a 32 MB gather, links free): the queue's issue order; the time a wait
    stood for a write is summed apart from the exposed time."""
    res = _run(_WRITES)
    assert res["part"] == [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]
    assert res["all_to_all"]
    assert res["earlier_done"] == [True, 0, True], res["earlier_done"]
    assert res["late_apart"] == [True, True]


def test_bad_use_is_a_clear_error() -> None:
    script = r"""
import torch.distributed as dist
from compiled_fsdp.tools.emulated import init_emulated_network
try:
    init_emulated_network(8, rank=8, device="cpu")
except ValueError as e:
    print("rank:", e)
init_emulated_network(8, device="cpu")
try:
    init_emulated_network(8, device="cpu")
except RuntimeError as e:
    print("twice:", e)
print("{}")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 8 is not in a world of 8 ranks" in proc.stdout
    assert "destroy_process_group() first" in proc.stdout


def test_benchmark_cpu_path(tmp_path) -> None:
    """``benchmarks/emulated.py`` on the CPU with a tiny Llama at W = 8: ours
    compiled and eager and FSDP2 eager run; ours and FSDP2 eager send the same
    bytes in the same number of collectives; exposed time is within the step's
    communication, and the step's tensor peak (``step MiB``) holds its
    largest gathered bucket; the schedule's prediction prices exactly the collectives the
    run issued, in the order it issued them, also with compile regions (each
    region's call expanded, its gathers issued ahead and taken, its reduces
    waited later: [Note: A step with compile regions predicted] in
    passes/region_step.py), compiled a second time with the host calls
    measured on a free network ([Note: Host calls measured with collectives
    free] in benchmarks/emulated_rates.py).
    (Not the floor: ~45 s of CI for an unsharded ``torch.compile``; the GPU
    check's quick test runs its floor.)"""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    results = emulated.main(["--device", "cpu", "--model", "tiny", "--worlds", "8", "--links", "match",
                             "--kinds", "ours", "ours_regions", "ours_eager", "fsdp2_eager", "--warmup", "1",
                             "--steps", "2", "--host-call-us", "measure", "--out", str(tmp_path)])
    by_kind = {r["kind"]: r for r in results}
    assert not [r for r in results if "error" in r], [r["error"] for r in results if "error" in r]
    assert set(by_kind) == {"ours", "ours_regions", "ours_eager", "fsdp2_eager"}
    assert by_kind["ours_eager"]["collectives"] == by_kind["fsdp2_eager"]["collectives"]
    assert abs(by_kind["ours_eager"]["comm_s"] - by_kind["fsdp2_eager"]["comm_s"]) < 1e-9
    for kind in ("ours", "ours_regions", "ours_eager", "fsdp2_eager"):
        r = by_kind[kind]
        assert 0 < r["comm_s"] and 0 <= r["exposed_s"] <= r["comm_s"] + 1e-6, r
        # (the step's tensor peak holds at least its largest gathered bucket)
        gathered = max(c["bytes"] for c in r["last_step"] if c["kind"] == "all_gather") / 2**20
        assert r["step_peak_mib"] >= gathered, (kind, r["step_peak_mib"], gathered)
    for kind in ("ours", "ours_regions"):
        r = by_kind[kind]
        assert abs(r["predicted_comm_s"] - r["comm_s"]) < 1e-9, (kind, r["predicted_comm_s"], r["comm_s"])
        predicted = [c[:2] for c in r["predicted_collectives"]]
        assert predicted == [[c["kind"], c["bytes"]] for c in r["last_step"]], kind
    assert all(r["priced_flops_per_s"] > 0 for r in results)  # (measured by each worker)
    # ([Note: Host calls measured with collectives free]: ours' workers measured theirs, compiled
    # again with it, and predicted the run above with it; the others priced none)
    for kind in ("ours", "ours_regions"):  # (the tiny model's sharding costs its step more than its compute)
        r = by_kind[kind]
        assert r["priced_host_call_s"] > 0 and r["free_unpriced_s"] > 0, (kind, r["free_unpriced_s"])
        priced = r["predicted_host_calls"] * r["priced_host_call_s"]  # (what compiling again added)
        # (the work at the free steps' speed: [Note: The block's clock beside each priced step])
        work = r["free_predicted_compute_s"] * r["priced_speed"]
        assert r["predicted_compute_s"] - work == pytest.approx(priced, rel=1e-6), kind
        assert 0.2 < r["priced_speed"] < 5, (kind, r["priced_speed"])
    assert by_kind["ours_eager"]["priced_host_call_s"] == by_kind["fsdp2_eager"]["priced_host_call_s"] == 0.0
    with open(tmp_path / "emulated.json") as f:
        table = json.load(f)["table"].splitlines()
    assert len(table) == 1 + 4 and "x bound" in table[0]


def test_benchmark_regions_cut_predicted(tmp_path) -> None:
    """``benchmarks/emulated.py --split-regions --bucket-bytes 0``: every
    compile region's block gathered and reduced in parts ([Note: Every
    compile region cut as the opening block] in passes/units.py), each part
    issued ahead by the outer graph's issue of the whole bucket, forward and
    backward ([Note: A bucket issued in the parts its graph takes] in
    compiled_fsdp/core/registry.py); the prediction lists the collectives the
    run issued, in its order, with their bytes, and the same busy time, each
    part issued ahead ([Note: A step with compile regions predicted] in
    passes/region_step.py)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    (r,) = emulated.main(["--device", "cpu", "--model", "tiny", "--worlds", "8", "--links", "match",
                          "--kinds", "ours_regions", "--split-regions", "--bucket-bytes", "0",
                          "--warmup", "2", "--steps", "2", "--out", str(tmp_path)])
    assert "error" not in r, r.get("error")
    assert r["variant"] == "splitr", r["variant"]
    layers = r["config"]["n_layers"]
    gathers = [c for c in r["last_step"] if c["kind"] == "all_gather"]
    # (each block's parts: more gathers than one per block, forward and backward, and the root's)
    assert len(gathers) >= 2 * 2 * layers, [c["bytes"] for c in gathers]
    assert [c[:2] for c in r["predicted_collectives"]] == [[c["kind"], c["bytes"]] for c in r["last_step"]]
    assert abs(r["predicted_comm_s"] - r["comm_s"]) < 1e-9


def test_benchmark_levers_hsdp_bf16_reduce(tmp_path) -> None:
    """``benchmarks/emulated.py --hsdp --reduce-dtype bfloat16 --node-ratio
    8`` at W = 16 (two nodes): ours eager and FSDP2 eager send the same
    collectives, each reduce-scatter followed by the replicas' all-reduce,
    and every reduce-scatter carries a bucket's bytes in bf16 (half of the
    same bucket's fp32 gather); with compile regions, the prediction's
    collectives are the network's, in order, each region's all-reduce issued
    by the next ``reduce_later`` ([Note: A step with compile regions
    predicted] in passes/region_step.py)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    results = emulated.main(["--device", "cpu", "--model", "tiny", "--worlds", "16", "--links", "match",
                             "--match-gbps", "0.05", "--node-ratio", "8", "--hsdp", "--reduce-dtype", "bfloat16",
                             "--split-first-block", "--kinds", "ours_eager", "fsdp2_eager", "ours_regions",
                             "--warmup", "1", "--steps", "2", "--out", str(tmp_path)])
    assert not [r for r in results if "error" in r], [r["error"] for r in results if "error" in r]
    ours, fsdp2, regions = results
    assert [c[:2] for c in regions["predicted_collectives"]] == [[c["kind"], c["bytes"]] for c in regions["last_step"]]
    assert abs(regions["predicted_comm_s"] - regions["comm_s"]) < 1e-9
    results = [ours, fsdp2]
    assert ours["variant"] == "hsdp+rs-bf16+split1+nvl8x", ours["variant"]
    # ([Note: The first block split by first use]: the first block's feed-forward gathered apart: the
    # tiny model's 3 * 32 * 48 fp32 parameters, a bucket of its own, where a whole block's is 30,976 bytes)
    for r in (ours, fsdp2, regions):
        gathers = [c["bytes"] for c in r["last_step"] if c["kind"] == "all_gather"]
        assert [b for b in gathers if 3 * 32 * 48 * 4 <= b < 3 * 32 * 48 * 4 + 8 * 64], (r["kind"], gathers)
    assert ours["collectives"] == fsdp2["collectives"], (ours["collectives"], fsdp2["collectives"])
    assert ours["collectives"]["all_reduce"] == ours["collectives"]["reduce_scatter"] > 0, ours["collectives"]
    for r in results:
        gathers = {c["bytes"] for c in r["last_step"] if c["kind"] == "all_gather"}
        reduces = {c["bytes"] for c in r["last_step"] if c["kind"] == "reduce_scatter"}
        assert {2 * b for b in reduces} <= gathers, (r["kind"], reduces, gathers)


def test_benchmark_node_ratio_needs_a_matched_link(tmp_path, capsys) -> None:
    """``--node-ratio`` sets a matched link's speed within a node; with the
    ``nccl`` or ``free`` link it would be ignored while the result still said
    ``nvl8x``: an error before any worker starts."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    for link in ("nccl", "free"):
        with pytest.raises(SystemExit) as exc:
            emulated.main(["--device", "cpu", "--model", "tiny", "--worlds", "8", "--links", link,
                           "--node-ratio", "8", "--kinds", "ours", "--out", str(tmp_path)])
        assert exc.value.code == 2
        assert "--node-ratio sets a matched link's speed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # (no worker ran)



def test_benchmark_host_call_us_refused(tmp_path, capsys) -> None:
    """``--host-call-us`` takes microseconds (0 or more) or ``measure``, only
    on the CPU and beside a compute the workers declare: anything else is an
    error before any worker runs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    refused = (("cpu", "fast", [], "microseconds, or measure"), ("cpu", "-5", [], "0 or more"),
               ("cpu", "nan", [], "0 or more"), ("cuda", "measure", [], "leave it out on CUDA"),
               ("cuda", "100", [], "leave it out on CUDA"),
               ("cpu", "measure", ["--compute-gflops", "0"], "give one or the other"))
    for device, value, more, says in refused:
        with pytest.raises(SystemExit):
            emulated.main(["--device", device, "--model", "tiny", "--worlds", "8", "--links", "match", "--kinds",
                           "ours", "--host-call-us", value, *more, "--out", str(tmp_path)])
        assert says in capsys.readouterr().err, (device, value)
    assert not list(tmp_path.iterdir())  # (no worker ran)

def test_paired_floor_ratios_are_per_pair() -> None:
    """``--paired-floor``'s figures ([Note: The floor paired in one
    process] in benchmarks/emulated.py): each step is divided by its own
    floor step (or its own communication step, where that is longer), then
    the median taken; never one median over the other, which a slow floor
    step in one pair would move. Unequal lists are an error."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import emulated

    times = [1.0, 2.2, 1.1, 1.3]
    floors = [0.9, 2.0, 1.0, 0.5]  # (the machine slowed both in pair 2)
    comm = [0.5, 0.5, 1.2, 0.5]  # (pair 3 bound by its communication)
    got = emulated.paired(times, floors, comm)
    assert got["paired_floor_step_s"] == pytest.approx(0.95)
    assert got["x_floor_paired"] == pytest.approx((1.1 + 1.1111111) / 2)  # (1.111, 1.1, 1.1, 2.6)
    assert got["x_bound_paired"] == pytest.approx((1.1111111 + 1.1) / 2)  # (1.111, 1.1, 0.917, 2.6)
    assert got["floor_step_times_s"] == floors
    with pytest.raises(ValueError, match="pairs of unequal length"):
        emulated.paired(times, floors[:3], comm)


def test_attention_priced_at_its_own_rate() -> None:
    """[Note: Attention's own rate]: a declared attention rate prices the
    fused attention ops of a traced graph, forward and backward, and
    nothing else; the CPU measurement gives one wherever torch's flop
    counter counts the op the CPU runs."""
    import dataclasses

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    from compiled_fsdp.passes.cost_model import _ATTENTION, CPU_COMPUTE, CostModel
    from compiled_fsdp.tools.cpu_compute import measured_cpu_compute

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> list:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) @ w
        return torch.autograd.grad(out.sum(), (q, k, v, w))

    args = [torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3)] + [torch.randn(16, 16, requires_grad=True)]
    gm = make_fx(step)(*args)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    attention = [n for n in nodes if getattr(n.target, "overloadpacket", None) in _ATTENTION]
    assert len(attention) == 2, [str(n.target) for n in nodes]  # (forward and backward)
    plain = CostModel()
    half = dataclasses.replace(plain, compute=dataclasses.replace(
        CPU_COMPUTE, attention_flops_per_s=CPU_COMPUTE.flops_per_s / 2))
    for n in nodes:
        before, after = plain.compute_time(n), half.compute_time(n)
        if n in attention and n.target.overloadpacket in flop_registry:  # (priced by its FLOPs where
            assert before > 0 and abs(after - 2 * before) < 1e-15, n.target  # the counter knows the op)
        elif n not in attention:
            assert after == before, n.target
    counter = FlopCounterMode(display=False)
    with counter:
        step(*args)
    counted = counter.get_flop_counts().get("Global", {})
    rate = measured_cpu_compute(256, 64, 64, reps=3, attention=(2, 4, 4, 64, 16)).attention_flops_per_s
    known = any(packet in _ATTENTION for packet in counted)
    assert (rate is not None and rate > 0) if known else rate is None, (rate, list(counted))


def test_step_calibrated_prices_the_step_measured() -> None:
    """[Note: Compute measured on the model's own step]: the rates come back
    scaled by one ratio, so that the cost model prices the module's
    compiled forward and backward (captured anew) at the seconds the timer
    gave; a module that does not compile into one forward and one backward
    is refused, saying why."""
    import dataclasses

    import torch
    from torch._inductor import config as inductor_config

    from compiled_fsdp.passes.cost_model import CPU_COMPUTE, CostModel
    from compiled_fsdp.tools.cpu_compute import _Priced, step_calibrated

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)
    rates = dataclasses.replace(CPU_COMPUTE, attention_flops_per_s=CPU_COMPUTE.flops_per_s / 3)
    timed: list[int] = []

    def timer(step, reps: int) -> float:
        timed.append(reps)
        step()  # (the compiled step runs outside the capture: no graph is priced again)
        return 0.25

    before = inductor_config.post_grad_custom_post_pass
    got = step_calibrated(mlp, x, rates=rates, reps=3, timer=timer)
    assert inductor_config.post_grad_custom_post_pass is before  # (the pass scoped to the calibration)
    assert timed == [3]
    assert x.grad is None and all(p.grad is None for p in mlp.parameters())  # (nothing left behind)
    scale = got.flops_per_s / rates.flops_per_s
    assert scale != 1.0
    for field in ("bytes_per_s", "host_bytes_per_s", "attention_flops_per_s"):
        assert abs(getattr(got, field) / getattr(rates, field) - scale) < 1e-12, field
    assert step_calibrated(mlp, x, rates=CPU_COMPUTE, timer=lambda step, reps: 0.25).attention_flops_per_s is None
    torch._dynamo.reset()
    priced = _Priced(CostModel(compute=got))
    with inductor_config.patch(post_grad_custom_post_pass=priced, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(mlp)(x).sum().backward()
    assert len(priced.seconds) == 2 and all(t > 0 for t in priced.seconds), priced.seconds
    assert abs(sum(priced.seconds) - 0.25) < 1e-9, priced.seconds

    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            t = self.mlp(t)
            torch._dynamo.graph_break()
            return self.mlp(t)

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="compiled into 4 graphs.*a graph break"):
        step_calibrated(Breaks(), x, rates=rates, timer=lambda step, reps: 0.25)
    assert x.grad is None and all(p.grad is None for p in mlp.parameters())  # (not on a refusal either)
    torch._dynamo.reset()


def _region_step(split: bool, counted: bool = False, host_s: float = 0.0) -> Any:
    """A hand-made outer graph: ``issue_ahead`` on a block's shards (read
    through ``permute``, as a shard on dim 1 is through ``to_canonical``),
    then the block's region call, whose body re-gathers them (whole, or one
    ``regather`` per parameter: reads cut into units). The predicted
    gathers, (bytes, exposed); ``counted``: the host calls instead, and the
    compute they added at ``host_s`` a call."""
    import dataclasses

    import torch

    from compiled_fsdp.passes.cost_model import CPU_COMPUTE, CostModel
    from compiled_fsdp.passes.region_step import INVOKE_SUBGRAPH, RunTimeChain, expand_regions
    from compiled_fsdp.passes.timeline import ISSUE_AHEAD, REGATHER, simulate

    def regather(g: torch.fx.Graph, shards: list, n: int) -> torch.fx.Node:
        node = g.call_function(REGATHER, (shards, [8, 2] * n, "0", 2, 1, None))
        node.meta["val"] = torch.empty(16 * n)
        return node

    def canonical(g: torch.fx.Graph, shard: torch.fx.Node) -> torch.fx.Node:
        node = g.call_function(torch.ops.aten.permute.default, (shard, [1, 0]))
        node.meta["val"] = torch.empty(4, 2)
        return node

    body = torch.fx.Graph()
    token, *shards, _ = (body.placeholder(name) for name in ("token", "w1", "w2", "x"))
    for s in shards:
        s.meta["val"] = torch.empty(2, 4)
    views = [canonical(body, s) for s in shards]
    gathered = [regather(body, [v], 1) for v in views] if split else [regather(body, views, 2)]
    body.output(tuple(gathered))
    outer = torch.fx.GraphModule({}, torch.fx.Graph())
    outer.region = torch.fx.GraphModule({}, body)
    g = outer.graph
    w1, w2 = (g.placeholder(name) for name in ("w1", "w2"))
    for s in (w1, w2):
        s.meta["val"] = torch.empty(2, 4)
    ahead = g.call_function(ISSUE_AHEAD, ([canonical(g, w1), canonical(g, w2)], [], [8, 2, 8, 2], "0", 2, 1, None))
    ahead.meta["val"] = torch.empty(0)
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(512, 512)
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))  # (3 ms at the CPU constants: the gather hides)
    mm.meta["val"] = torch.empty(512, 512)
    call = g.call_function(INVOKE_SUBGRAPH, (g.get_attr("region"), "region", ahead, w1, w2, mm))
    g.output(call)
    users = {n: dict(n.users) for n in g.nodes}
    order, sources = expand_regions(outer, [n for n in g.nodes if n.op not in ("placeholder", "output")])
    assert {n: dict(n.users) for n in g.nodes} == users  # (the outer graph as it was)
    def step(host_s: float) -> Any:
        compute = dataclasses.replace(CPU_COMPUTE, host_call_s=host_s)
        return simulate(order, CostModel(compute=compute), foreign=True, chain=RunTimeChain(order, sources))

    tl = step(host_s)
    if counted:
        return tl.host_calls, tl.compute_s - step(0.0).compute_s
    return [(c.bytes, c.exposed_s) for c in tl.comms]


def test_a_region_takes_the_gather_issued_ahead() -> None:
    """[Note: A step with compile regions predicted]: with a region's call expanded, its
    ``regather`` takes the gather the outer graph issued ahead for the same
    shards, matched through the copy's inputs and through views; where the
    region re-gathers its parameters one by one, the issue ahead of its
    whole bucket issues each part ([Note: A bucket issued in the parts its
    graph takes] in compiled_fsdp/core/registry.py), and both are hidden."""
    whole = _region_step(split=False)
    assert whole == [(2 * 16 * 4, 0.0)], whole  # (the one issued ahead, taken: hidden by the matmul)
    split = _region_step(split=True)
    assert split == [(16 * 4, 0.0), (16 * 4, 0.0)], split  # (each part issued ahead, taken)


def test_region_reduces_staged_under_hsdp() -> None:
    """[Note: A step with compile regions predicted]: a region's
    ``reduce_later`` under HSDP is a reduce-scatter, then, at the next
    ``reduce_later`` (or the backward's end), the replicas' all-reduce of its
    rows, waited one stage later: the order the run time issues them in."""
    import torch

    from compiled_fsdp.passes.cost_model import CostModel
    from compiled_fsdp.passes.region_step import RunTimeChain
    from compiled_fsdp.passes.timeline import REDUCE_LATER, simulate

    g = torch.fx.Graph()
    order = []
    for i in range(2):
        grad = g.placeholder(f"grad_{i}")
        grad.meta["val"] = torch.empty(64)
        later = g.call_function(REDUCE_LATER, ([grad], [None], [], [64], [1], [16], "0", 4), {"replicas": 2,
                                                                                   "replicate_group_name": "1"})
        later.meta["val"] = torch.empty(0)
        order.append(later)
    tl = simulate(order, CostModel(), foreign=True, chain=RunTimeChain(order, {}))
    kinds = [(c.kind, c.bytes) for c in sorted(tl.comms, key=lambda c: c.issue_s)]
    assert kinds == [("reduce_scatter", 256), ("all_reduce", 64), ("reduce_scatter", 256), ("all_reduce", 64)], kinds
    assert all(c.wait_s >= 0 for c in tl.comms)  # (every stage waited, the last ones at the end)
    rs1, ar1, rs2, _ = sorted(tl.comms, key=lambda c: c.issue_s)
    assert rs2.issue_s < ar1.end_s, (rs2, ar1)  # (the all-reduce waited a stage later, not where it was issued)


def test_region_reduce_bytes_padded_and_one_rank_sends_none() -> None:
    """[Note: A step with compile regions predicted]: a ``reduce_later``'s
    reduce-scatter moves its bucket padded to whole shards, as the run time
    packs it (10 rows over 4 ranks: 12); over a shard group of one rank
    (``replicate``) it sends nothing, and only the replicas' all-reduce of
    the rows is left."""
    import torch

    from compiled_fsdp.passes.cost_model import CostModel
    from compiled_fsdp.passes.region_step import RunTimeChain
    from compiled_fsdp.passes.timeline import REDUCE_LATER, simulate

    def step(world: int) -> list[tuple[str, int]]:
        g = torch.fx.Graph()
        grad = g.placeholder("grad")
        grad.meta["val"] = torch.empty(10, 3)
        later = g.call_function(REDUCE_LATER, ([grad], [None], [], [10, 3], [2], [-(-10 // world)], "0", world),
                                {"replicas": 2, "replicate_group_name": "1"})
        later.meta["val"] = torch.empty(0)
        tl = simulate([later], CostModel(), foreign=True, chain=RunTimeChain([later], {}))
        return [(c.kind, c.bytes) for c in sorted(tl.comms, key=lambda c: c.issue_s)]

    assert step(4) == [("reduce_scatter", 4 * 3 * 3 * 4), ("all_reduce", 3 * 3 * 4)], step(4)
    assert step(1) == [("all_reduce", 10 * 3 * 4)], step(1)


def test_region_reduce_prices_the_kept_gradients_it_adds() -> None:
    """[Note: Kept gradients added where the bucket is packed]: a synced
    ``reduce_later`` after accumulation adds each kept gradient as it packs,
    so its pack reads them too: the padded bucket read and written, plus the
    kept bytes."""
    import torch

    from compiled_fsdp.passes.region_step import RunTimeChain
    from compiled_fsdp.passes.timeline import REDUCE_LATER

    def packed(with_kept: bool) -> int:
        g = torch.fx.Graph()
        grad, kept = g.placeholder("grad"), g.placeholder("kept")
        grad.meta["val"] = kept.meta["val"] = torch.empty(12, 3)
        later = g.call_function(REDUCE_LATER, ([grad], [kept if with_kept else None], [], [12, 3], [2], [3], "0", 4))
        later.meta["val"] = torch.empty(0)
        return RunTimeChain([later], {}).packed_bytes(later)

    assert packed(False) == 2 * 12 * 3 * 4, packed(False)
    assert packed(True) == 3 * 12 * 3 * 4, packed(True)


def test_host_calls_priced_where_they_run() -> None:
    """[Note: The sharding's host work priced per call]: with ``host_call_s``
    declared, the timeline spends it at a collective's issue (before the
    collective starts), at its wait (after it) and in a sharding op's
    compute time, and an aten op costs none; so host calls between an issue
    and its wait hide that much more of the collective. ``host_calls``
    counts the same calls priced or not, and at 0 nothing moves. With
    compile regions expanded, an op that collects inside is a call of its
    own besides the issue and the wait inside it."""
    import dataclasses

    import torch

    from compiled_fsdp.core import copy_out  # noqa: F401 (the op)
    from compiled_fsdp.passes.cost_model import CPU_COMPUTE, WAIT, CostModel
    from compiled_fsdp.passes.timeline import simulate

    g = torch.fx.Graph()
    shard = g.placeholder("shard")
    shard.meta["val"] = torch.empty(1 << 16)
    gather = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (shard, 8, "0"))
    gather.meta["val"] = torch.empty(8 << 16)
    average = g.call_function(torch.ops.compiled_fsdp.average_bucket.default, (shard, 2.0))  # (between them)
    average.meta["val"] = torch.empty(1 << 16)
    wait = g.call_function(WAIT, (gather,))
    wait.meta["val"] = torch.empty(8 << 16)
    mm = g.call_function(torch.ops.aten.mm.default, (wait, wait))
    order = [gather, average, wait]

    def timeline(host_s: float) -> Any:
        return simulate(order, CostModel(compute=dataclasses.replace(CPU_COMPUTE, host_call_s=host_s)), foreign=True)

    free, priced = timeline(0.0), timeline(1e-4)
    plain = simulate(order, CostModel(), foreign=True)  # (the constants: nothing moves)
    assert (plain.compute_s, plain.exposed_s, plain.makespan_s) == (free.compute_s, free.exposed_s, free.makespan_s)
    assert free.host_calls == priced.host_calls == 3  # (issue, the op, wait)
    assert priced.compute_s - free.compute_s == pytest.approx(3e-4, abs=1e-12)
    assert free.comm_s == priced.comm_s > 0
    assert priced.exposed_s == pytest.approx(free.exposed_s - 1e-4, abs=1e-12)  # (issued 0.1 ms later, hid 0.2)
    with_host = CostModel(compute=dataclasses.replace(CPU_COMPUTE, host_call_s=1e-4))
    mm.meta["val"] = torch.empty(8, 8)
    assert with_host.compute_time(mm) == CostModel().compute_time(mm) > 0
    assert with_host.compute_time(average) == pytest.approx(CostModel().compute_time(average) + 1e-4)
    assert with_host.compute_time(wait) == 1e-4 and CostModel().compute_time(wait) == 0.0
    # (regions: the issue-ahead's call and its issue, the region's regather's call and its wait)
    assert _region_step(split=False, counted=True) == (4, pytest.approx(0.0))
    calls, spent = _region_step(split=False, counted=True, host_s=1e-4)
    assert calls == 4 and spent == pytest.approx(4e-4, abs=1e-12), spent

