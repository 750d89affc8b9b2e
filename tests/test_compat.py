"""The torch releases compiled_fsdp supports, decided in one module
(``compiled_fsdp/core/compat.py``, [Note: Supported torch releases]).

The whole suite runs on each supported release through ``.ci/compat X``;
these tests hold the module's own contract: it is the only place that tests a
torch version or probes torch for a feature, an unsupported torch fails at
import naming the range, and the post-grad passes compose on this release."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_fsdp.core import compat

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["compiled_fsdp", "passes", "examples", "benchmarks", "tests"]
COMPAT = ROOT / "compiled_fsdp" / "core" / "compat.py"


def _torch_names(tree: ast.Module) -> set[str]:
    """Names a module binds to torch or to something imported from torch."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript, ast.Call)):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _imports_torch(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "torch" for a in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch"


def _version_dependent(path: Path) -> list[str]:
    """``path``'s lines that test the torch version or probe torch for a feature:
    ``__version__``, ``hasattr``/3-argument ``getattr`` on torch objects, and
    ``try: from torch... import`` with an ``except ImportError/AttributeError``."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = _torch_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("__version__", "version_info") \
                and _root(node) in torch_names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
            if probe and _root(node.args[0]) in torch_names:
                call = f"{node.func.id}({ast.unparse(node.args[0])}, ...)"
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {call}")
        elif isinstance(node, ast.Try):
            imports_torch = any(_imports_torch(n) for stmt in node.body for n in ast.walk(stmt))
            catches = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if imports_torch and catches & {"ImportError", "AttributeError", "ModuleNotFoundError",
                                            "(ImportError, AttributeError)"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: try-import of torch")
    return found


def test_only_the_compat_module_depends_on_the_torch_release() -> None:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py")) if p != COMPAT]
    assert len(files) > 50
    found = [line for p in files for line in _version_dependent(p)]
    assert found == [], "version-dependent code outside compiled_fsdp/core/compat.py:\n" + "\n".join(found)
    # The scan finds what it looks for: the compat module itself is caught.
    assert any("__version__" in line for line in _version_dependent(COMPAT))
    assert any("getattr(dist, ...)" in line for line in _version_dependent(COMPAT))


@pytest.mark.parametrize("version,ok", [
    ("2.10.2", False), ("2.11.0", True), ("2.12.1", True), ("2.13.0+cpu", True),
    ("2.14.1", True), ("2.15.0+cu132", True), ("2.16.0.dev20261120", False), ("3.0.0", False),
])
def test_supported_range(version: str, ok: bool, monkeypatch) -> None:
    monkeypatch.delenv("COMPILED_FSDP_ALLOW_UNSUPPORTED_TORCH", raising=False)
    if ok:
        compat.check_supported(version)
        return
    with pytest.raises(ImportError, match=r"compiled_fsdp supports torch>=2\.11,<2\.16; this is torch "):
        compat.check_supported(version)
    monkeypatch.setenv("COMPILED_FSDP_ALLOW_UNSUPPORTED_TORCH", "1")
    with pytest.warns(UserWarning, match="untested"):
        compat.check_supported(version)


def test_this_torch_is_supported() -> None:
    lo, hi = compat.SUPPORTED
    assert lo <= compat.torch_release() < hi, compat.torch_release()


def test_import_on_an_unsupported_torch_names_the_range() -> None:
    """What a user on torch 2.10 sees: an ImportError at ``import compiled_fsdp``."""
    code = "import torch; setattr(torch, '__version__', '2.10.0'); import compiled_fsdp"
    env = {k: v for k, v in os.environ.items() if k != "COMPILED_FSDP_ALLOW_UNSUPPORTED_TORCH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: compiled_fsdp supports torch>=2.11,<2.16; this is torch 2.10.0"), last


def _to_local_grad_rank(rank: int, world: int) -> tuple[bool, bool]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    class NoGrad(torch.autograd.Function):  # gives its input no gradient, as a marker without sync
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x * 2

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return None

    mesh = DeviceMesh("cpu", list(range(world)))
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(2, 3), mesh, [Shard(0)]))
    NoGrad.apply(param.to_local()).sum().backward()
    return compat.to_local_keeps_none_grads(), param.grad is None


def test_to_local_none_gradient_probe() -> None:
    """``to_local_keeps_none_grads()`` says what DTensor's ``to_local`` does on
    this release with a missing gradient: a shard whose one use gives it no
    gradient keeps ``None``, or gets zeros (torch 2.11, where the runtime puts
    ``None`` back; tests/test_no_sync.py checks that)."""
    from _dist import run_distributed

    [(keeps_none, grad_is_none)] = run_distributed(_to_local_grad_rank, 1)
    assert keeps_none == grad_is_none


class _Recorder:
    """A user's post-grad pass: records the graphs it saw."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __call__(self, graph) -> None:  # noqa: ANN001
        self.log.append(self.name)

    def uuid(self) -> bytes:
        return self.name.encode()


def _custom_pass(name: str, log: list):  # noqa: ANN202
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return type("UserPass", (_Recorder, CustomGraphPass), {})(name, log)


def test_post_grad_passes_compose_under_inductor() -> None:
    """Several post-grad passes run in order under a real Inductor compile on
    this release (2.11 takes one pass: they are chained there), and the value
    reads back as the same passes."""
    from torch._inductor import config as inductor_config

    log: list = []
    first, second = _custom_pass("user", log), _custom_pass("ours", log)
    value = compat.post_grad_value((first, second))
    assert compat.post_grad_passes(value) == (first, second)
    assert compat.post_grad_passes(compat.post_grad_value((first,))) == (first,)
    assert compat.post_grad_value(()) is None and compat.post_grad_passes(None) == ()
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=value, fx_graph_cache=False):
        fn = torch.compile(lambda x: (x.sin() * 2).sum())
        x = torch.randn(8)
        assert torch.allclose(fn(x), (x.sin() * 2).sum())
    assert log == ["user", "ours"]
    torch._dynamo.reset()


def test_compose_with_a_user_post_grad_pass_and_back() -> None:
    """A window of the compile layer appends the scheduling pass after a
    user's post-grad pass and gives the user's back when it closes, on every
    release (2.11 takes one pass: they are chained there)."""
    from torch._inductor import config as inductor_config

    from compiled_fsdp.compile import install

    log: list = []
    user = _custom_pass("user", log)
    old_post = inductor_config.post_grad_custom_post_pass
    try:
        inductor_config.post_grad_custom_post_pass = user
        with install.installed():
            passes = compat.post_grad_passes(inductor_config.post_grad_custom_post_pass)
            assert passes[0] is user and type(passes[1]).__name__ == "_SchedulePass" and len(passes) == 2
        assert inductor_config.post_grad_custom_post_pass is user
    finally:
        inductor_config.post_grad_custom_post_pass = old_post
