"""The project's process-wide state lives on three objects (DESIGN.md,
"State"): ``core.registry.CORE``, ``runtime.registry.RUNTIME`` and
``compile.install.SESSION``. A model deleted and another built in the same
process leaves nothing behind on them: checked with ``gc`` and a weak
reference, for a whole-model compile and for blocks compiled on their own."""
from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

import compiled_fsdp
from compiled_fsdp import fully_shard
from compiled_fsdp.compile.install import SESSION
from compiled_fsdp.core.registry import CORE
from compiled_fsdp.runtime.registry import RUNTIME

from _dist import run_distributed
from _models import gpt_case

ROOT = Path(__file__).resolve().parents[1]


def _sizes() -> dict:
    return {
        "owners": len(CORE.owners), "added": len(CORE.added), "pending": len(CORE.backward_gathers.pending),
        "receivers": len(CORE.later_reduces.receivers),
        "managed": len(RUNTIME.managed),
        "traced_frames": sorted(map(repr, SESSION.traced_frames)),
        "units": sorted(k for k in SESSION.reports.units if k >= 0),
        "compile_markers": len(SESSION.compile_markers),
    }


def _train(how: str) -> tuple[weakref.ref, dict]:
    build, make_batch, loss_fn = gpt_case()
    model = build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    run = model
    if how == "blocks":
        for block in model.layers:
            block.compile(backend="aot_eager")
    elif how == "model":
        run = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        (tokens,) = make_batch(step)
        loss_fn(run(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    during = _sizes()
    return weakref.ref(model), during


HOW = ("model", "blocks", "eager")  # torch.compile(model), block.compile() per block, no compile


def _rank(rank: int, world: int, regions: bool = False) -> dict:
    compiled_fsdp.config.comm.block_regions = regions
    before = _sizes()
    out: dict = {"before": before}
    for how in HOW:
        ref, during = _train(how)
        gc.collect()
        out[how] = {"freed": ref() is None, "during": during, "after": _sizes()}
    return out


@pytest.mark.parametrize("regions", [False, True])
def test_a_deleted_model_leaves_nothing_behind(regions: bool) -> None:
    """Also with the blocks compile regions ([Note: Blocks as compile
    regions]): a region's gradient hook on its shard's alias held its
    parameter, from C++, where gc cannot see the cycle; every model
    outlived its last reference until the hook held it weakly. The receivers
    of regions' later reduces outlived their shards until each entry went
    with its shard."""
    for res in run_distributed(_rank, 2, regions):
        before = res["before"]
        for how in HOW:
            r = res[how]
            assert r["freed"], f"{how}: the model outlived its last reference"
            # (the records existed while the model lived, so the check can fail)
            assert r["during"]["owners"] == 3 and (r["during"]["traced_frames"] or how == "eager"), r["during"]
            # (each region's shard registers where its reduced rows go: [Note:
            # A region's reduce-scatter waited outside its graph])
            assert (r["during"]["receivers"] > 0) == regions, r["during"]
            assert r["after"] == before, (how, r["after"], before)
    # (The FSDP<Module> classes are held weakly (RUNTIME.generated) but not
    # counted: Dynamo stores each compiled function in the traced code's module
    # globals, past torch._dynamo.reset(), and with it the classes its guards name.)


# The module-level objects changed at run time, each with its reason in
# DESIGN.md ("State"). Anything else assigned a mutable value at module level,
# or rebound with ``global``, fails the test below.
STATE_OBJECTS = {
    ("compiled_fsdp/core/registry.py", "CORE"),
    ("compiled_fsdp/runtime/registry.py", "RUNTIME"),
    ("compiled_fsdp/compile/install.py", "SESSION"),
}
# Module-level values that are not state: configuration the user sets (as
# torch._dynamo.config), locks, a stateless default; and names in capitals,
# constants by convention (the cost model's tables).
NOT_STATE = {"__all__", "_lock", "comm", "overlap", "pipeline", "_EAGER_ONLY", "_path", "EAGER", "SIMPLE_OVERLAP",
             "_HEADER", "M", "T", "_LAZY", "_TRACE_FILES", "_TRACKS", "_BACKEND_DEVICES"}


def test_state_lives_on_named_objects() -> None:
    found = set()
    for path in sorted([*(ROOT / "compiled_fsdp").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            assert not isinstance(node, ast.Global), f"{rel}:{node.lineno}: global {node.names}"
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.Call, ast.DictComp, ast.ListComp, ast.SetComp)):
                for t in targets:
                    name = ast.unparse(t)
                    if name not in NOT_STATE and not name.isupper() or name in {n for _, n in STATE_OBJECTS}:
                        found.add((rel, name))
    assert found == STATE_OBJECTS
