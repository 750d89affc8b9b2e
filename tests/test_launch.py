"""The multi-rank launcher the tests and the checker use: a rank that aborts
at teardown fails the call, even after returning its value; a rank that
crashes is reported first, with its own stderr; the tests' fork server starts
ranks under the environment they were called in."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import sys

import pytest
import torch

from compiled_fsdp.tools.launch import run_distributed as launch

from _dist import FORK_SERVER, ForkServer, run_distributed


def _abort_at_exit_rank(rank: int, world: int) -> int:
    if rank == 1:
        atexit.register(os.abort)  # runs after the result is written, like a teardown abort
    return rank


def _crash_rank(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        print("rank 1 about to crash", file=sys.stderr, flush=True)
        os.abort()  # as glibc aborts on a corrupted heap
    dist.barrier()  # rank 0 then fails in gloo, because rank 1 is gone
    return rank


def _fine_rank(rank: int, world: int) -> int:
    return rank


def _env_rank(rank: int, world: int, name: str) -> str | None:
    return os.environ.get(name)


def test_teardown_abort_fails_the_call() -> None:
    # A spawned rank (the launcher's default) runs the interpreter's teardown, where the abort happens.
    # (spawned ranks returning results: test_fork_server_follows_the_environment)
    spawn = multiprocessing.get_context("spawn")
    with pytest.raises(RuntimeError, match="rank 1 returned a result but exited \\(killed by SIGABRT\\)"):
        launch(_abort_at_exit_rank, 2, timeout=120, context=spawn)


def test_a_crashed_rank_is_reported_first_with_its_stderr(capfd: pytest.CaptureFixture) -> None:
    """A rank killed by a signal fails the call with the end of its stderr
    (here faulthandler's stack of the crash; glibc's message where glibc
    aborted), ahead of the errors it caused on its peers (CI once showed only
    rank 0's "Connection reset by peer" and "rank 1: no result (exit code -6)")."""
    with pytest.raises(RuntimeError) as info:
        run_distributed(_crash_rank, 2, timeout=120)
    message = str(info.value)
    assert message.startswith("rank 1: no result (killed by SIGABRT); the end of its stderr:"), message
    assert "rank 1 about to crash" in message and "Fatal Python error: Aborted" in message, message
    assert "_crash_rank" in message, message  # the crashing frame
    assert message.index("rank 1: no result") < message.index("rank 0 raised"), message
    assert "----- rank 1 stderr -----" in capfd.readouterr().err


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
