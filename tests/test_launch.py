"""The multi-rank launcher the tests and the checker use: a rank that aborts
at teardown fails the call, even after returning its value."""
from __future__ import annotations

import atexit
import os

import pytest

from _dist import run_distributed


def _abort_at_exit_rank(rank: int, world: int) -> int:
    if rank == 1:
        atexit.register(os.abort)  # runs after the result is written, like a teardown abort
    return rank


def _fine_rank(rank: int, world: int) -> int:
    return rank


def test_teardown_abort_fails_the_call() -> None:
    assert run_distributed(_fine_rank, 2, timeout=120) == [0, 1]
    with pytest.raises(RuntimeError, match="rank 1 returned a result but exited with code -6"):
        run_distributed(_abort_at_exit_rank, 2, timeout=120)
