"""The layers import one way (DESIGN.md, "Layering"): core <- runtime <- compile
<- tools, and the passes import only the core; inside the runtime, a module
imports only those below it in ``RUNTIME_ORDER`` (FSDP2's one-way layering:
the parameter never names its group, the group never names the state).
Checked on every import statement of the package, function-level and
type-only ones included, so the layering cannot rot unnoticed."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers its modules may import (besides torch and the stdlib).
ALLOWED = {
    "core": {"core"},
    "config": set(),
    "runtime": {"core", "config", "runtime"},
    "compile": {"core", "config", "runtime", "compile", "passes"},
    "passes": {"core", "passes"},
    "tools": {"core", "config", "runtime", "compile", "passes", "tools"},
    # The package's facade: the public names (tools only lazily, see below).
    "facade": {"core", "config", "runtime", "compile", "tools"},
}


# The runtime's modules, lowest first: each may import only those before it.
RUNTIME_ORDER = ["registry", "generated", "policy", "backward_use", "streams", "divergence", "collectives", "extension",
                 "ext_gather", "placement", "annotated", "param", "reduces", "module_class", "unshard_fn",
                 "param_group", "context", "state", "validation", "module", "groups", "api", "replicate"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "passes":
        parts = ["compiled_fsdp", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "compiled_fsdp":
        return "outside"
    if len(parts) == 1 or parts[1] == "check":
        return "facade"
    return parts[1]


def _package_files() -> list[Path]:
    return sorted([*(ROOT / "compiled_fsdp").rglob("*.py"), *(ROOT / "passes").rglob("*.py")])


def _imports(path: Path, name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import in ``path``,
    the module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            level = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, module_level) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.append((mod, child.lineno, module_level))
                if child.module is None or mod in ("compiled_fsdp", "compiled_fsdp.passes"):
                    out.extend((f"{mod}.{a.name}", child.lineno, module_level) for a in child.names)
            visit(child, level)

    visit(tree, True)
    return out


def _violations(extra: tuple[tuple[Path, str], ...] = ()) -> list[str]:
    """The imports against the layering in the package's files and in
    ``extra`` ((path, module name) pairs)."""
    found = []
    for path, me in [*((p, _module_name(p)) for p in _package_files()), *extra]:
        mine = _layer(me)
        for target, line, module_level in _imports(path, me):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}"
            root = target.split(".")[0]
            if root in ("examples", "tests", "benchmarks"):
                found.append(f"{where}: {me} imports {target} (not part of the package)")
                continue
            if root != "compiled_fsdp":
                continue
            theirs = _layer(target)
            if theirs == "facade" and target == "compiled_fsdp":
                theirs = "facade"
            if theirs not in ALLOWED[mine]:
                found.append(f"{where}: {mine} module {me} imports {target} ({theirs})")
            elif mine == theirs == "runtime" and not _runtime_below(target, me):
                found.append(f"{where}: runtime module {me} imports {target}, which is not below it "
                             f"({' < '.join(RUNTIME_ORDER)})")
            elif mine == "compile" and theirs == "passes" and module_level:
                found.append(f"{where}: {me} imports {target} at import time (the passes load at the first compile)")
            elif mine == "facade" and theirs == "tools" and module_level and me != "compiled_fsdp.check":
                found.append(f"{where}: {me} imports {target} at import time (tools load when used)")
    return found


def _runtime_below(target: str, me: str) -> bool:
    parts, mine = target.split("."), me.split(".")
    if len(parts) < 3 or len(mine) < 3:  # (the runtime package itself)
        return len(mine) < 3
    return RUNTIME_ORDER.index(parts[2]) < RUNTIME_ORDER.index(mine[2])


def test_imports_go_one_way() -> None:
    found = _violations()
    assert found == [], "imports against the layering:\n" + "\n".join(found)


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The walk finds what it forbids: a runtime module importing the compile
    layer inside a function (written to a temporary directory and checked as
    if it were ``compiled_fsdp/runtime/_layering_probe.py``)."""
    fake = tmp_path / "_layering_probe.py"
    fake.write_text("def f():\n    from compiled_fsdp.compile import install\n")
    found = _violations(((fake, "compiled_fsdp.runtime._layering_probe"),))
    assert any("_layering_probe.py:2: runtime module" in f for f in found), found


def test_the_check_sees_a_type_only_import_up() -> None:
    """A type-only import of the group by the parameter is a pointer up."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "param.py"
        fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from compiled_fsdp.runtime.param_group import FSDPParamGroup\n")
        found = _violations(((fake, "compiled_fsdp.runtime.param"),))
    assert any("param.py:3: runtime module compiled_fsdp.runtime.param imports" in f for f in found), found


def test_import_loads_no_pass_and_no_tool() -> None:
    """``import compiled_fsdp`` (and ``fully_shard``'s module) loads neither
    the passes nor the tools: they load at the first compile and when used."""
    code = ("import sys, compiled_fsdp; from compiled_fsdp import fully_shard; "
            "print(sorted(m for m in sys.modules if m.startswith(('compiled_fsdp.passes', 'compiled_fsdp.tools'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
