"""The multi-rank launcher the tests and the checker use: a rank that aborts
at teardown fails the call, even after returning its value; the tests' fork
server starts ranks under the environment they were called in."""
from __future__ import annotations

import atexit
import multiprocessing
import os

import pytest
import torch

from compiled_fsdp.tools.launch import run_distributed as launch

from _dist import FORK_SERVER, ForkServer, run_distributed


def _abort_at_exit_rank(rank: int, world: int) -> int:
    if rank == 1:
        atexit.register(os.abort)  # runs after the result is written, like a teardown abort
    return rank


def _fine_rank(rank: int, world: int) -> int:
    return rank


def _env_rank(rank: int, world: int, name: str) -> str | None:
    return os.environ.get(name)


def test_teardown_abort_fails_the_call() -> None:
    # A spawned rank (the launcher's default) runs the interpreter's teardown, where the abort happens.
    # (spawned ranks returning results: test_fork_server_follows_the_environment)
    spawn = multiprocessing.get_context("spawn")
    with pytest.raises(RuntimeError, match="rank 1 returned a result but exited with code -6"):
        launch(_abort_at_exit_rank, 2, timeout=120, context=spawn)


def test_fork_server_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "COMPILED_FSDP_TEST_LAUNCH_ENV"
    monkeypatch.delenv(name, raising=False)
    assert run_distributed(_fine_rank, 2, timeout=120) == [0, 1]  # the server is running from here on
    assert FORK_SERVER.context().get_start_method() == "forkserver"
    assert run_distributed(_env_rank, 2, name, timeout=120) == [None, None]
    monkeypatch.setenv(name, "set")
    assert FORK_SERVER.context().get_start_method() == "spawn"
    assert run_distributed(_env_rank, 2, name, timeout=120) == ["set", "set"]
    fresh = ForkServer()
    assert fresh.context().get_start_method() == "forkserver"
    fresh.reset()
    assert fresh.started_env is None


def test_a_compile_in_the_caller_keeps_the_fork_server() -> None:
    """Inductor sets two variables in the process that compiles (the Note);
    the ranks started after that still come from the fork server."""
    run_distributed(_fine_rank, 2, timeout=120)
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="inductor")
    compiled(torch.randn(2, 4)).sum().backward()
    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    assert FORK_SERVER.context().get_start_method() == "forkserver"
