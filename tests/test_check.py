"""The numerics checker, run as the README runs it (a subprocess launching its
own gloo ranks). Inductor is left to the README's test command, which runs the
checker with every variant after pytest: here it would add ~60 s of compile per
rank and prove nothing about the checker itself."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(*args: str, model: str = "examples.gpt:tiny") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    return subprocess.run(
        [sys.executable, "-m", "compiled_fsdp.check", "--model", model, "--world-size", "2",
         "--timeout", "300", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )


def test_checker_passes_bitwise() -> None:
    """The blocks compiled on their own (``blocks``): bitwise equal to the
    eager runtime. (The default variants, ``aot_eager`` bitwise among them,
    are CI's own command: .ci/run.)"""
    res = _check("--steps", "2", "--variants", "eager,blocks")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK: every variant within tolerance" in res.stdout
    assert res.stdout.count("vs eager: 0 ok") == 2, res.stdout  # per step: blocks


def test_checker_names_the_module_that_skipped_its_reduction() -> None:
    res = _check("--steps", "1", "--variants", "eager", model="_broken_gpt:tiny")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "first module whose gradient diverges: layers.1" in res.stdout, res.stdout


def test_checker_rejects_unknown_variant() -> None:
    res = _check("--variants", "nope")
    assert res.returncode == 2 and "unknown variants" in res.stderr
