"""Launch a function on several local gloo ranks: real process groups, a timeout
that fails instead of hanging, and each rank's exception re-raised in the caller.
Used by the numerics checker and by the tests."""
from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.context import BaseContext
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0
# Lines of a crashed rank's stderr its error quotes (all of it is on stderr).
_TAIL_LINES = 80


def _worker(rank: int, world_size: int, store_path: str, result_dir: str, fn: Callable, args: tuple) -> None:
    """[Note: Process groups at exit]
    A gloo process group that outlives ``destroy_process_group`` is destroyed
    during interpreter finalization, which can abort the process
    (``terminate called without an active exception``; pytorch/pytorch#179291).
    Sharded models keep their groups alive through reference cycles, and the
    project's caches hold its own groups only weakly, so collecting right after
    ``destroy_process_group`` destroys every group while the interpreter is
    alive. A check group with a collective left waiting (a check that raised)
    is the exception: destroying it blocks until its peer's process ends (its
    destructor joins gloo's threads), so runtime/divergence.py keeps it alive
    for good (the interpreter's teardown destroyed it before, blocking the
    exit when the modules happened to be torn down in the wrong order).
    ``faulthandler`` prints every thread's Python stack if a rank aborts
    anyway."""
    # This rank's stderr (glibc's heap messages and faulthandler's stacks
    # included) goes to a file the launcher reads back: see ``_report``.
    sys.stderr.flush()
    fd = os.open(_err_path(result_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    # One Inductor compile thread per rank (the ranks already share the cores).
    # Inductor reads the variable when it is imported, which a fork server's
    # preload or the unpickling of ``fn`` has done by now, hence the config too.
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = int(os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1"))
    result: dict[str, Any]
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args)}
            _wait_for_peers(store, rank, world_size)
        finally:
            dist.destroy_process_group()
            gc.collect()  # see the Note above
    except BaseException:  # noqa: BLE001 - everything goes back to the test process
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _err_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.err")


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _report(result_dir: str, world_size: int) -> dict[int, str]:
    """Each rank's stderr, copied to this process's stderr (where pytest
    captures it), and returned by rank."""
    out = {}
    for r in range(world_size):
        try:
            with open(_err_path(result_dir, r), errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        if text:
            sys.stderr.write(f"----- rank {r} stderr -----\n{text}")
        out[r] = text
    sys.stderr.flush()
    return out


def _wait_for_peers(store: dist.Store, rank: int, world_size: int, timeout_s: float = 15.0) -> None:
    """Before tearing its group down, a rank whose ``fn`` returned waits (up to
    ``timeout_s``) until every peer's returned too: a rank that finished first
    closed its gloo connections while a slower peer was still connecting in
    ``init_process_group`` ("Gloo connectFullMesh failed ... Connection closed
    by peer", seen once in CI under load, tests/test_launch.py). The bound is
    short because the wait can be circular: a peer left blocked in a
    collective with this rank (a divergence test's rank that did not raise)
    returns only when this rank's connections close, as they would when a
    failed rank's process exits (tests/test_divergence.py's
    ``test_rank_compiles_another_path_later`` waited the whole bound, 60 s
    before)."""
    store.set(f"compiled_fsdp_launch/returned/{rank}", "1")
    try:
        store.wait([f"compiled_fsdp_launch/returned/{r}" for r in range(world_size)],
                   datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # (a peer raised or hangs: run_distributed reports it)
        pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
                    context: BaseContext | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's value.

    ``fn`` must be importable (module level). A rank that raises fails the call with
    its traceback; ranks still running after ``timeout`` seconds are killed and the
    call fails: a hang is a test failure, never a stuck CI job. A rank that exits
    with a non-zero code fails it too, even after returning its value (a job that
    aborts at teardown is a failed job under torchrun).

    Each rank is a fresh process, started by ``context`` (a ``multiprocessing``
    context; "spawn" when none is given). The tests pass a fork server's
    (tests/_dist.py, [Note: The tests' fork server]).
    """
    ctx = context if context is not None else mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, tmp, fn, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        stderr = _report(tmp, world_size)
        results = []
        errors, crashes = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                # A crash: its own stderr says where (glibc, faulthandler), and
                # comes first: the other ranks' errors follow from it.
                tail = "\n".join(stderr[r].splitlines()[-_TAIL_LINES:])
                crashes.append(f"rank {r}: no result ({_exit_reason(procs[r].exitcode)}); "
                               f"the end of its stderr:\n{tail}")
                continue
            with open(path, "rb") as f:
                res = pickle.load(f)
            if not res["ok"]:
                errors.append(f"rank {r} raised:\n{res['error']}")
            elif procs[r].exitcode != 0 and r not in hung:
                # a crash after the result was written, e.g. an abort at interpreter teardown
                errors.append(f"rank {r} returned a result but exited ({_exit_reason(procs[r].exitcode)})")
            else:
                results.append(res["value"])
        errors = crashes + errors
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f}s (a hang); killed.\n"
                               + "\n".join(errors))
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
