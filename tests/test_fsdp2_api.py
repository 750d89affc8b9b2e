"""FSDP2's API and behaviour, side by side with ``torch.distributed.fsdp.fully_shard``
in the same ranks where the math allows (issue 36): the FSDPModule methods,
the errors FSDP2 raises for bad input, a module called twice with every
sharded module compiled, world size 1, and thread ranks."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import compiled_fsdp
from compiled_fsdp import fully_shard

from _dist import run_distributed
from _parity import whole


class TwiceInner(nn.Module):
    """A sharded module called twice per step (FSDP2's test_multi_forward_module)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def _inputs(step: int, world: int) -> list[torch.Tensor]:
    return [torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]


def _train(rank: int, world: int, shard: Callable[[nn.Module], None], backend: str,
           configure: Callable[[nn.Module], None] = lambda m: None,
           dtype: torch.dtype = torch.float32) -> tuple[dict, list]:
    """3 Adam steps, each rank on its own batch; returns the full parameters
    and the reference's (one process, the mean loss over the ranks' batches).
    ``dtype``: the sharded model is cast to it after ``fully_shard``, the
    reference and the batches before."""
    torch.manual_seed(42)
    model = TwiceInner()
    ref = copy.deepcopy(model).to(dtype)
    shard(model)
    if dtype != torch.float32:
        model.to(dtype)
    configure(model)
    if backend != "eager":
        for m in (model.inner, model):  # every sharded module compiled in place, as FSDP2's tests do
            m.compile(backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        xs = [x.to(dtype) for x in _inputs(step, world)]
        model(xs[rank]).sum().backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x).sum() for x in xs) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}
    diffs = [(full[n] - p).abs().max().item() for n, p in ref.named_parameters()]
    return full, diffs


def _ours(m: nn.Module) -> None:
    fully_shard(m.inner)
    fully_shard(m)


def _theirs(m: nn.Module) -> None:
    torch_fsdp.fully_shard(m.inner)
    torch_fsdp.fully_shard(m)


def _module_called_twice(rank: int, world: int, backend: str) -> dict:
    ours, diffs = _train(rank, world, _ours, backend)
    theirs, _ = _train(rank, world, _theirs, "eager")
    return {"ref": max(diffs), "fsdp2": max((ours[n] - theirs[n]).abs().max().item() for n in ours)}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_every_module_compiled(backend: str) -> None:
    """A module called twice per step, with every sharded module compiled in
    place (``module.compile()``): bitwise equal to the reference and to FSDP2
    (on 2 ranks one addition, see [Note: Reduce-scatter on gloo]). Before the
    fix a root compiled in place ran its hooks as eager and the inner module's
    gradients were lost in the first step."""
    for res in run_distributed(_module_called_twice, 2, backend):
        # Bitwise against FSDP2. Against the one-process reference, bitwise on the
        # Intel machines this was written on; 7.5e-9 (one ulp: the reference's
        # own float order) on the AMD EPYC of 2026-11-26, at the commit before too.
        assert res["fsdp2"] == 0.0 and res["ref"] <= 1e-8, res


def _to_dtype(rank: int, world: int, backend: str) -> dict:
    ours, diffs = _train(rank, world, _ours, backend, dtype=torch.float64)
    theirs, _ = _train(rank, world, _theirs, "eager", dtype=torch.float64)
    return {"ref": max(diffs), "fsdp2": max((ours[n] - theirs[n]).abs().max().item() for n in ours),
            "dtypes": sorted({str(p.dtype) for p in ours.values()})}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_to_dtype_after_fully_shard(backend: str) -> None:
    """``model.to(torch.float64)`` after ``fully_shard`` (PyTorch's
    test_to_float64_after_init): the model trains in float64, bitwise equal
    to FSDP2 doing the same and within 1e-15 of a float64 reference. Before,
    the gathered parameters stayed float32 and the forward failed on mixed
    dtypes ([Note: module.to(dtype) after fully_shard] in runtime/param.py)."""
    for res in run_distributed(_to_dtype, 2, backend):
        assert res["fsdp2"] == 0.0 and res["ref"] <= 1e-15 and res["dtypes"] == ["torch.float64"], res


class Block(nn.Module):
    """A block with two nested sharded modules and parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = nn.Linear(8, 8)
        self.ff = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm(x))
        return h + self.ff(torch.relu(h))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _nested_compiled(rank: int, world: int, checkpointed: bool, backend: str = "aot_eager") -> float:
    """Each block and both of its nested sharded modules compiled in place
    (``module.compile()``), the root eager, as FSDP2's DPO test shards them;
    two forwards before one backward. Before the fix the first block's
    handoff went to its own nested module (traced inline, so it never read
    it) and that module's gradients came back None."""
    from torch.distributed._composable import checkpoint

    torch.manual_seed(42)
    model = Nested()
    ref = copy.deepcopy(model)
    if checkpointed:
        for m in (*model.layers, *ref.layers):
            checkpoint(m)
    for block in model.layers:
        for m in (block.attn, block.ff, block):
            fully_shard(m)
            if backend != "eager":
                m.compile(backend=backend)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def dpo(m: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (m(a).sum() - m(b).sum()).pow(2)

    for step in range(3):
        xs, ys = _inputs(step, world), _inputs(step + 10, world)
        xs, ys = [x.repeat(1, 2) for x in xs], [y.repeat(1, 2) for y in ys]
        dpo(model, xs[rank], ys[rank]).backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        opt.step()
        opt.zero_grad()
        (sum(dpo(ref, x, y) for x, y in zip(xs, ys)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("checkpointed", [False, True])
def test_nested_modules_compiled_in_place(checkpointed: bool) -> None:
    """FSDP2's test_double_forward_with_nested_fsdp_and_checkpoint, compiled
    (aot_eager), against the one-process reference after 3 Adam steps."""
    for diff in run_distributed(_nested_compiled, 2, checkpointed):
        assert diff < 1e-6, diff


class NormHead(nn.Module):
    """FSDP2's list form: ``fully_shard([model.norm, model.head])``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(torch.relu(self.body(x)))
        return h if skip_head else self.head(h)


def _list_of_modules(rank: int, world: int, backend: str) -> dict:
    out: dict[str, Any] = {}
    for name, fs in (("ours", fully_shard), ("fsdp2", torch_fsdp.fully_shard)):
        torch.manual_seed(0)
        model = NormHead()
        ref = copy.deepcopy(model)
        fs([model.norm, model.head])
        fs(model)
        same = fully_shard.state(model.norm) is fully_shard.state(model.head) if name == "ours" else None
        run = model if backend == "eager" or name == "fsdp2" else torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        gathers = []
        for step in range(3):
            xs = [x.repeat(1, 2) for x in _inputs(step, world)]
            compiled_fsdp.reset_collective_counts()
            skip = step == 1  # the head does not run: the group completes at the root's post-forward
            run(xs[rank], skip).pow(2).sum().backward()
            gathers.append(compiled_fsdp.collective_counts().get("all_gather"))
            opt.step()
            opt.zero_grad()
            (sum(ref(x, skip).pow(2).sum() for x in xs) / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        full = {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}
        out[name] = {n: full[n] for n, _ in ref.named_parameters()}
        out[name + "_ref"] = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
        if name == "ours":
            out["same_state"], out["gathers"] = same, gathers
    out["fsdp2"] = max((out["ours"][n] - out["fsdp2"][n]).abs().max().item() for n in out["ours"])
    del out["ours"]
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_list_of_modules(backend: str) -> None:
    """``fully_shard([norm, head])``: one state and one group for both modules
    (one all-gather for the pair in forward and one in backward), a step where
    the head does not run, equal to the reference and to FSDP2."""
    for res in run_distributed(_list_of_modules, 2, backend):
        assert res["same_state"] is True, res
        assert res["ours_ref"] < 1e-6 and res["fsdp2"] < 1e-6, res
        if backend == "eager":  # root, [norm, head]: forward and backward
            assert res["gathers"][0] == 3, res


def _methods(rank: int, world: int) -> dict:
    out: dict[str, Any] = {}

    def configure(m: nn.Module) -> None:
        m.set_modules_to_forward_prefetch([m.inner])
        m.inner.set_modules_to_backward_prefetch([])
        m.set_reshard_after_forward(False)
        m.inner.set_unshard_in_backward(True)
        m.set_is_last_backward(True)

    _, diffs = _train(rank, world, _ours, "eager", configure)
    out["explicit"] = max(diffs)
    torch.manual_seed(0)
    model = TwiceInner()
    _ours(model)
    state = fully_shard.state(model)
    from torch.distributed._composable_state import _get_module_state
    out["state"] = (state is not None and state is not fully_shard.state(model.inner)
                    and _get_module_state(model) is state)
    handle = model.inner.unshard(async_op=True)
    handle.wait()
    out["unsharded"] = state.param_group is not None and model.inner._get_fsdp_state().param_group.state.value
    compiled_fsdp.reset_collective_counts()
    x = _inputs(0, world)[rank]
    model(x).sum().backward()  # the inner module was gathered already: one all-gather fewer
    gathers = compiled_fsdp.collective_counts().get("all_gather")
    compiled_fsdp.reset_collective_counts()
    model(x).sum().backward()
    out["gathers"] = (gathers, compiled_fsdp.collective_counts().get("all_gather"))
    model.reshard()
    model.inner.reshard()
    # Divide factor: the gradient is the sum over ranks divided by the factor.
    for p in model.parameters():
        p.grad = None
    for m in (model, model.inner):  # (per module, as FSDP2's)
        m.set_gradient_divide_factor(1.0)
    model(x).sum().backward()
    summed = {n: whole(p.grad) for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    for m in (model, model.inner):
        with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):  # FSDP2's deprecated name
            m.set_reduce_scatter_divide_factor(float(world))
    model(x).sum().backward()
    mean = {n: whole(p.grad) for n, p in model.named_parameters()}
    out["factor"] = max((summed[n] / world - mean[n]).abs().max().item() for n in mean)
    # register_fsdp_forward_method: a method other than forward gathers and frees.
    model.score = lambda t: model.outer(model.inner(t)).mean()  # type: ignore[attr-defined]
    compiled_fsdp.register_fsdp_forward_method(model, "score")
    with torch.no_grad():
        full = {n: whole(p) for n, p in model.named_parameters()}
        expect = torch.nn.functional.linear(
            torch.nn.functional.linear(x, full["inner.weight"], full["inner.bias"]),
            full["outer.weight"], full["outer.bias"]).mean()
        out["method"] = model.score(x).item() == expect.item()
    out["resharded"] = model._get_fsdp_state().param_group.state.value
    return out


def test_fsdp_module_methods() -> None:
    """FSDPModule's methods, with FSDP2's names and meaning, on 2 gloo ranks."""
    for res in run_distributed(_methods, 2):
        assert res["explicit"] <= 1e-8, res  # explicit prefetch and flags: bitwise (one ulp on AMD EPYC, as above)
        assert res["state"] is True, res
        assert res["unsharded"] == "unsharded", res
        # root 1, inner 3 (called twice, and its backward) without unshard(); one fewer with it
        assert res["gathers"] == (3, 4), res
        assert res["factor"] < 1e-6, res
        assert res["method"] is True, res
        assert res["resharded"] == "sharded", res


def _errors(rank: int, world: int) -> dict:
    """Each bad input, given to ours and to FSDP2: (exception type, message)."""
    cases: dict[str, Callable[[Callable], object]] = {
        "reapply": lambda fs: fs(fs(nn.Linear(4, 4))),
        "module_list": lambda fs: fs(nn.ModuleList([nn.Linear(4, 4)])),
        "module_dict": lambda fs: fs(nn.ModuleDict({"a": nn.Linear(4, 4)})),
        "scalar": lambda fs: fs(_with_scalar()),
        "channels_last": lambda fs: fs(nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)),
        "mesh_3d": lambda fs: fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, world))),
        "mesh_2d_unnamed": lambda fs: fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, world))),
        "shared_across": lambda fs: _shared_across(fs),
        "deepcopy": lambda fs: copy.deepcopy(fs(nn.Linear(4, 4))),
        "child_forward_first": lambda fs: _child_forward_first(fs),
        "list_root": lambda fs: _list_root(fs),
    }
    out = {}
    for name, case in cases.items():
        row = []
        for fs in (fully_shard, torch_fsdp.fully_shard):
            try:
                case(fs)
                row.append(None)
            except Exception as exc:  # noqa: BLE001 (the point is which)
                row.append((type(exc).__name__, str(exc)))
        out[name] = row
    seq = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    out["slice"] = (type(seq[:1]).__name__, isinstance(seq[:1], compiled_fsdp.FSDPModule))
    return out


def _with_scalar() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4))
    m.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.5)))
    return m


def _shared_across(fs: Callable) -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    fs(model[0])
    fs(model[1])
    fs(model)
    model(torch.arange(4))  # FSDP2 raises here, at lazy init


def _child_forward_first(fs: Callable) -> None:
    """A sharded child's forward before the root's: the child becomes a root."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fs(model[0])
    fs(model)
    model[0](torch.ones(2, 4))
    model(torch.ones(2, 4))


def _list_root(fs: Callable) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fs([model[0], model[1]])
    model(torch.ones(2, 4))


# Words of FSDP2's message that ours says too.
_SAME_WORDS = {
    "reapply": "can only be applied to a module once",
    "module_list": "does not support containers that do not implement forward",
    "module_dict": "does not support containers that do not implement forward",
    "scalar": "Change scalar_p to a 1D tensor with numel equal to 1",
    "channels_last": "FSDP does not support non-contiguous parameters",
    "mesh_3d": "expects a 1D or 2D DeviceMesh",
    "mesh_2d_unnamed": "Please init the 2D mesh for HSDP with mesh_dim_names specified",
    "shared_across": "already managed by another",
    "deepcopy": "FSDP does not support deepcopy",
    "child_forward_first": "FSDP state has already been lazily initialized for 0\nFSDP requires running "
                           "forward through the root module first",
    "list_root": "FSDP requires a single root module but got ",
}


# Refused by FSDP2 in torch 2.13 and 2.15; 2.11's runs the forward without a
# word. Ours refuses on every release, in FSDP2's words.
_FSDP2_CHECKS_LATER = {"shared_across"}


def test_bad_input_as_fsdp2() -> None:
    """The same exception type as FSDP2, at the same point, with its words,
    on every rank (2 gloo ranks; a hang would fail the launcher's timeout)."""
    for res in run_distributed(_errors, 2):
        for name, words in _SAME_WORDS.items():
            ours, theirs = res[name]
            if theirs is None and name in _FSDP2_CHECKS_LATER:
                assert ours is not None and words in ours[1], (name, ours)
                continue
            assert theirs is not None and ours is not None, (name, ours, theirs)
            assert ours[0] == theirs[0], (name, ours, theirs)
            assert words in ours[1] and words in theirs[1], (name, ours, theirs)
        assert res["slice"] == ("Sequential", False), res


def _world_of_one(rank: int, world: int) -> dict:
    counts = {}
    for name, fs in (("ours", fully_shard), ("fsdp2", torch_fsdp.fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5))
        fs(model[0])
        fs(model)
        with CommDebugMode() as mode:
            model(_inputs(0, 1)[0]).sum().backward()
        counts[name] = mode.get_total_counts()
    return counts


def test_world_size_one_communicates_nothing() -> None:
    assert run_distributed(_world_of_one, 1) == [{"ours": 0, "fsdp2": 0}]


def _managed(rank: int, world: int) -> dict:
    """What torch's own helpers see of modules sharded by ours and by FSDP2."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_managed_modules
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    out = {}
    for name, fs in (("ours", fully_shard), ("fsdp2", torch_fsdp.fully_shard)):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        (compiled_fsdp.replicate if name == "ours" else fs)(model[0])
        fs(model[2])
        index = {m: i for i, m in enumerate(model.modules())}
        out[name] = {
            "managed": sorted(index[m] for m in _get_managed_modules((model,))),
            "state": [_get_module_fsdp_state(m) is not None for m in model],
        }
    return out


def test_torch_helpers_see_sharded_modules() -> None:
    """torch's ``_get_managed_modules`` (what fully_shard and tools walk) stops
    at a module sharded (or replicated) here as at one sharded by FSDP2
    ([Note: Seen as FSDP2's state] in core/compat.py). Before, it descended
    into ours: the expected [0, 4, 5, 6] came out as all ten."""
    res = run_distributed(_managed, 1)[0]
    assert res["ours"]["managed"] == res["fsdp2"]["managed"] == [0, 4, 5, 6], res
    assert res["ours"]["state"] == res["fsdp2"]["state"] == [True, False, True], res


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "regions"])
def test_thread_ranks(backend: str) -> None:
    """torch's multi-thread process group (one thread per rank) at world size 4:
    per-rank helper groups, no hang ([Note: Helper groups]); the losses and
    parameters bitwise equal to the reference. In a fresh process (the
    threaded group replaces the process's default group), under a timeout.
    Under aot_eager half the runs hung before [Note: Traced in this thread] (state.py).
    ``regions``: ``config.comm.block_regions`` asked for, under ``aot_eager``;
    thread ranks get no regions (``ranks_are_threads``: they would share the
    registry the regions' gathers go through, and hung in the first backward)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sys; from test_fsdp2_api import thread_ranks_main; thread_ranks_main(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, backend], capture_output=True, text=True, timeout=300,
                          cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("thread ranks OK"), proc.stdout[-2000:]


def thread_ranks_main(backend: str) -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from compiled_fsdp.tools.models import GPT, GPTConfig, batch, loss_fn

    world = 4
    compiled_fsdp.config.comm.block_regions = backend == "regions"
    backend = "aot_eager" if backend == "regions" else backend
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=8))
    lock = threading.Lock()
    results: dict[int, Any] = {}

    def rank_main(rank: int, store: dist.Store) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            with lock:
                ref, model = copy.deepcopy(base), copy.deepcopy(base)
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
            run = model if backend == "eager" else torch.compile(model, backend=backend)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                tokens = batch(ref.cfg, 2, step)
                loss = loss_fn(run(tokens), tokens)
                loss.backward()
                opt.step()
                opt.zero_grad()
                ref_loss = loss_fn(ref(tokens), tokens)
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append((loss.item(), ref_loss.item()))
            full = {n.replace("_orig_mod.", ""): whole(p) for n, p in model.named_parameters()}
            results[rank] = (losses, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))

        except BaseException as exc:  # noqa: BLE001 (reported below)
            results[rank] = exc

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        store = dist.HashStore()
        threads = [threading.Thread(target=rank_main, args=(r, store), daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), "a thread rank hung"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    for rank in range(world):
        res = results.get(rank)
        assert not isinstance(res, BaseException) and res is not None, (rank, res)
        losses, diff = res
        assert all(a == b for a, b in losses), (rank, losses)
        assert diff == 0.0, (rank, diff)
    print("thread ranks OK")
