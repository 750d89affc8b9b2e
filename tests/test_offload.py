"""FSDP2's ``CPUOffloadPolicy``: [Note: CPU offload] in
compiled_fsdp/runtime/policy.py. On this CPU-only machine the compute device
is the CPU, so the copies to and from it are none: what is checked is where
every tensor lives after training (shards, gradients, AdamW's state: the
CPU), the numerics through the offload paths (eager, ``aot_eager`` whole and
per block, meta-device init) against a single-process reference and FSDP2's
offload, and that a whole-model graph gathers such modules itself. The
copies themselves need an accelerator (benchmarks/gpu_check.py); their place
in a graph is checked on fake CUDA tensors by
tests/test_offload_fx.py::test_offloaded_shards_copied_in_the_gather_chain."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_fsdp
from compiled_fsdp import CPUOffloadPolicy, fully_shard

from _dist import run_distributed
from _graphs import GraphCapture
from _parity import full_diff, full_params, in_regions, reference_grads

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 3 * D)
        self.down = nn.Linear(3 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return h.pow(2).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 5, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, world: int, model: nn.Module, run: Any) -> dict:
    ref = Model()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    worst, devices = 0.0, set()
    for step in range(3):
        compiled_fsdp.reset_collective_counts()
        run(_batch(step, rank)).backward()
        eager_collectives = compiled_fsdp.collective_counts()
        devices |= {("grad", p.grad.to_local().device.type) for p in model.parameters()}
        reference_grads(ref, lambda r: ref(_batch(step, r)), world)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst = max(worst, full_diff(full_params(model), ref))
    devices |= {("param", p.to_local().device.type) for p in model.parameters()}
    devices |= {("optim", t.device.type) for state in opts[0].state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0}
    return {"worst": worst, "devices": sorted(devices), "eager_collectives": eager_collectives}


def _shard(model: nn.Module, fn: Any, policy: Any) -> nn.Module:
    for layer in model.layers:
        fn(layer, offload_policy=policy)
    fn(model, offload_policy=policy)
    return model


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor import distribute_tensor

    out = {}
    eager = _shard(Model(), fully_shard, CPUOffloadPolicy())
    out["eager"] = _train(rank, world, eager, eager)
    whole = _shard(Model(), fully_shard, TorchOffload(pin_memory=False))  # (torch's class, taken as ours)
    capture = GraphCapture()
    out["aot_eager"] = _train(rank, world, whole, torch.compile(whole, backend=capture.backend, fullgraph=True))
    out["in_graph"] = capture.take_runtime()
    out["graphs"] = len(capture.forward), len(capture.backward)
    out["explain"] = {r.fqn: (r.path, r.reason) for r in compiled_fsdp.explain(whole)}
    out["regions"] = in_regions(whole)
    blocks = _shard(Model(), fully_shard, CPUOffloadPolicy())
    for layer in blocks.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    out["blocks"] = _train(rank, world, blocks, blocks)
    with torch.device("meta"):
        meta = _shard(Model(), fully_shard, CPUOffloadPolicy())
    meta.to_empty(device="cpu")
    with torch.no_grad():  # each rank's piece, as torch's distribute_tensor cuts it
        for p, r in zip(meta.parameters(), Model().parameters()):
            p.to_local().copy_(distribute_tensor(r.detach(), p.device_mesh, p.placements).to_local())
    out["meta"] = _train(rank, world, meta, meta)
    theirs = _shard(Model(), fsdp2_shard, TorchOffload(pin_memory=False))
    out["fsdp2"] = _train(rank, world, theirs, theirs)
    out["vs_fsdp2"] = max((a.to_local() - b.to_local()).abs().max().item()
                          for a, b in zip(eager.parameters(), theirs.parameters()))
    return out


def test_cpu_offload() -> None:
    """Eager, ``aot_eager`` (the whole model in one graph, ``fullgraph=True``:
    every module gathered and reduced in it, no eager collective; the blocks
    compile regions) and per block, and from a
    meta-device init: bitwise to the reference after 3 AdamW steps, and eager
    bitwise to FSDP2's offload; shards, gradients and AdamW's state on the
    CPU. See [Note: CPU offload in graphs] in passes/lowering.py."""
    for res in run_distributed(_rank, 2, timeout=600):
        for case in ("eager", "aot_eager", "blocks", "meta", "fsdp2"):
            assert res[case]["worst"] == 0.0, (case, res[case])
            assert res[case]["devices"] == [("grad", "cpu"), ("optim", "cpu"), ("param", "cpu")], (case, res)
        assert res["vs_fsdp2"] == 0.0, res
        assert res["aot_eager"]["eager_collectives"] == {}, res["aot_eager"]
        assert res["blocks"]["eager_collectives"].get("all_gather", 0) >= 2, res["blocks"]
        assert res["graphs"] == (1, 1), res["graphs"]
        runs = res["in_graph"]  # (3 steps; small buckets merge, so at least one gather a step each way)
        assert runs.get("fw_all_gather", 0) >= 3 and runs.get("bw_reduce_scatter", 0) >= 3, runs
        assert {path for path, _ in res["explain"].values()} == {"compiled"}, res["explain"]
        assert res["regions"] == [False, True, True], res["regions"]  # (the blocks, not the root)


def _features_rank(rank: int, world: int) -> dict:
    """Per feature, the parameters after 3 steps with and without offload
    (``aot_eager``, one graph), and the eager collectives of an offloaded step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from compiled_fsdp import MixedPrecisionPolicy

    out = {}
    for feature in ("mixed_precision", "no_sync", "checkpoint"):
        params, eager = {}, None
        for offload in (True, False):
            torch._dynamo.reset()
            model = Model()
            kw: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if offload else {}
            if feature == "mixed_precision":
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if feature == "checkpoint":
                for i, layer in enumerate(model.layers):
                    model.layers[i] = checkpoint_wrapper(layer)
            for layer in model.layers:
                fully_shard(layer, **kw)
            fully_shard(model, **kw)
            run = torch.compile(model, backend="aot_eager", fullgraph=True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(3):
                compiled_fsdp.reset_collective_counts()
                if feature == "no_sync":  # (the gradient sink's micro-batch, then the synced one)
                    model.set_requires_gradient_sync(False)
                    run(_batch(step + 10, rank)).backward()
                    model.set_requires_gradient_sync(True)
                run(_batch(step, rank)).backward()
                eager = compiled_fsdp.collective_counts() if offload else eager
                opt.step()
                opt.zero_grad()
            params[offload] = [p.to_local().clone() for p in model.parameters()]
        out[feature] = {"diff": max((a - b).abs().max().item() for a, b in zip(params[True], params[False])),
                        "eager_collectives": eager}
    return out


def test_cpu_offload_in_graphs_with_other_features() -> None:
    """Mixed precision (bf16), accumulation without sync, activation
    checkpointing: the whole model in one graph under offload trains bitwise
    as without it, with no eager collective ([Note: CPU offload in graphs] in
    passes/lowering.py: the markers carry the device, the sink stays on it)."""
    for res in run_distributed(_features_rank, 2, timeout=600):
        for feature, r in res.items():
            assert r == {"diff": 0.0, "eager_collectives": {}}, (feature, r)


_CUDA_MESH_SCRIPT = r"""
import json, types, torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from compiled_fsdp.runtime.param import FSDPParam
dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
mesh = DeviceMesh("cuda", torch.arange(2))  # (NCCL's mesh: no GPU is touched making it)
param = types.SimpleNamespace(_dtensor_specs={}, global_shape=(6, 8), spmd_mesh=mesh, spmd_placements=(Shard(0),))
out = []
for dtype in (torch.float32, torch.float32, torch.bfloat16):  # (the second of a dtype reuses its spec)
    local = torch.ones(3, 8, dtype=dtype)
    made = FSDPParam.to_dtensor(param, local)
    out.append([made._local_tensor is local, made.device_mesh.device_type, list(made.shape), str(made.dtype)])
print(json.dumps(out))
"""


def test_offloaded_shards_stay_on_the_cpu_under_a_cuda_mesh() -> None:
    """Under NCCL an offloaded shard lives on the CPU while its mesh is
    CUDA's: ``FSDPParam.to_dtensor`` (the registered shard, each ``.grad``)
    wraps the CPU tensor as it is. It was ``DTensor.from_local``, which moves
    a tensor to its mesh's device: on a GPU every offloaded shard went there
    (and the first forward refused it, "should be materialized on CPU"); on
    this machine it raised "Found no NVIDIA driver". A CUDA mesh over torch's
    fake group, in a fresh process; no GPU is touched."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _CUDA_MESH_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = json.loads(proc.stdout.strip().splitlines()[-1])
    assert made == [[True, "cuda", [6, 8], "torch.float32"]] * 2 + [[True, "cuda", [6, 8], "torch.bfloat16"]], made


def test_the_mesh_of_an_offloaded_model() -> None:
    """``placement.mesh_device_type``: a model on the CPU under CPU offload
    (or on ``meta``) gets the accelerator's mesh when the group carries the
    accelerator's tensors with a backend other than gloo, whatever the
    backend's name: ``nccl``, the default ``init_process_group()`` (named
    "undefined") and ``cpu:gloo,cuda:nccl`` alike. It asked for the name to
    be ``nccl``, so the other two gave an offloaded model a CPU mesh on a
    GPU (its gathers on gloo, or none). Here gloo's group, which also
    registers CUDA, carries no CUDA tensors for it."""
    import torch.distributed as dist

    from compiled_fsdp.runtime.api import _mesh_device_type
    from compiled_fsdp.runtime.placement import mesh_device_type

    def nccl(device: str) -> bool:
        return True

    def gloo(device: str) -> bool:
        return False

    cases = [  # (param device, offload, accelerator, one process group, carries) -> mesh
        (("cpu", True, "cuda", False, nccl), "cuda"),
        (("cpu", True, "cuda", False, gloo), "cpu"),
        (("cpu", True, None, False, nccl), "cpu"),
        (("cpu", True, "cuda", True, gloo), "cuda"),  # (the fake group, the emulated network)
        (("meta", False, "cuda", False, nccl), "cuda"),
        (("meta", False, None, False, gloo), "cpu"),
        (("cpu", False, "cuda", False, nccl), "cpu"),  # (not offloaded: its own device)
        (("cuda", False, "cuda", False, nccl), "cuda"),
    ]
    assert [mesh_device_type(*args) for args, _ in cases] == [want for _, want in cases]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        param = nn.Parameter(torch.zeros(2))
        assert _mesh_device_type(param, dist.group.WORLD, offload=True) == "cpu"
    finally:
        dist.destroy_process_group()


def test_buffers_move_to_the_mesh_device() -> None:
    """``placement.move_buffers`` (run at ``fully_shard`` when the mesh is an
    accelerator's, as FSDP2 moves a managed module's states): a model built
    on the CPU for offload had its buffers left there, and its forward mixed
    them with the gathered parameters on the GPU. ``meta`` ones are left for
    deferred init. On this machine the only other device is ``meta``, so
    that is the target here."""
    from compiled_fsdp.runtime.placement import move_buffers

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].register_buffer("table", torch.ones(3))
    model[1].register_buffer("deferred", torch.ones(3, device="meta"))
    move_buffers([model], torch.device("meta"))
    assert model[0].table.device.type == "meta" and model[0].table.shape == (3,)
    assert model[1].deferred.device.type == "meta"
    assert all(p.device.type == "cpu" for p in model.parameters())  # (parameters are fully_shard's)
