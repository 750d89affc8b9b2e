"""The tests' multi-process harness: the package's own launcher, its ranks
forked from a fork server that has imported torch once.

[Note: The tests' fork server]
A spawned rank imports torch, Dynamo, Inductor and the package before it runs
a line of the test: about 8 s of a 2-rank call on two cores, paid some 250
times in the suite. A fork server (``multiprocessing``'s "forkserver") imports
them once, in a process that does nothing else, and forks each rank from it:
the rank is still a fresh process with its own process group and nothing a
previous test left behind, but it starts in half a second. What a fork does
not carry is an environment changed since the server started: modules read
some variables when imported (``TORCH_LOGS``, ``TORCHINDUCTOR_*``), so a call
made under another environment than the server's is spawned as before.
Three variables that do not count are set in the calling process by its own
tools: ``PYTEST_CURRENT_TEST`` by pytest for every test, and by Inductor at
its first compile ``TORCHINDUCTOR_CACHE_DIR`` (to the default a fresh process
finds too) and ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`` (an address in
that process, set again by whichever process loads Inductor's C++ helper).
Nor does a forked rank tear an interpreter down: it leaves with ``os._exit``
after writing its result, so an abort at interpreter exit ([Note: Process
groups at exit]) shows only in a spawned rank; tests/test_launch.py spawns
that case, and the main-job tests run ``torchrun``'s full interpreters."""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext
from typing import Any, Callable

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from compiled_fsdp.tools.launch import DEFAULT_TIMEOUT_S
from compiled_fsdp.tools.launch import run_distributed as _launch

__all__ = ["DEFAULT_TIMEOUT_S", "ForkServer", "run_distributed"]

VOLATILE = frozenset({"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"})
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo",
           "torch._inductor.compile_fx", "pytest", "compiled_fsdp", "compiled_fsdp.tools.launch")


class ForkServer:
    """Chooses the start method of a call: the fork server while the
    environment is the one it started under, otherwise spawn."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload
        self.reset()

    def reset(self) -> None:
        """Forget the server's environment: the next call starts under the current one."""
        self.started_env: dict[str, str] | None = None

    def context(self) -> BaseContext:
        env = _environment()
        if self.started_env is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(self.preload))
            self.started_env = env
            return ctx
        if env == self.started_env:
            return multiprocessing.get_context("forkserver")
        return multiprocessing.get_context("spawn")


def _environment() -> dict[str, str]:
    """The environment a rank would start under, less what does not count (the Note)."""
    env = {k: v for k, v in os.environ.items() if k not in VOLATILE}
    if env.get("TORCHINDUCTOR_CACHE_DIR") == os.path.abspath(default_cache_dir()):
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


FORK_SERVER = ForkServer()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """``compiled_fsdp.tools.launch.run_distributed``, started by :data:`FORK_SERVER`."""
    return _launch(fn, world_size, *args, timeout=timeout, context=FORK_SERVER.context())
