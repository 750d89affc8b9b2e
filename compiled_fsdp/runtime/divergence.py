"""Every rank issues the same collectives in the same order, or every rank raises.

[Note: Agreeing on collectives]
Collectives pair up across ranks by their order on a process group, nothing
else. A rank that takes another path through the model (skips a block, calls
one twice, compiled another graph) pairs one module's gather with another's:
a silent wrong answer while the sizes match, a hang as soon as one rank waits
for a collective the others never issue. Each rank therefore announces, on a
*check group* of its own (gloo, the same ranks), what it is about to do, at
these points:

- ``STEP``: the root's forward starts (every step, both paths);
- ``BACKWARD``: the step's first compiled backward starts (the compiled
  root's; with blocks compiled on their own, the first block's to run),
  with the modules the forward ran, in order;
- ``COLLECTIVE``: each all-gather and reduce-scatter of the eager runtime
  (``replicate``'s all-reduce of each bucket: [Note: replicate's buckets];
  issued with the collective, awaited before its result is used);
- ``GRAPH``: Dynamo finished compiling a frame that reads sharded parameters
  whose marker sequence no earlier graph had (so before its first run).
  Not while torch's caching precompile is on: a graph loaded from a saved
  trace is never traced, and a rank whose guards differ from the saved
  ones' (it holds other rows) traces while the others load, so only it
  would check (its graph's collectives are the others': [Note:
  Rank-independent graphs]). Tested by
  tests/test_precompile.py::test_a_second_job_loads_its_traces.

A check is a tiny all-gather of a fixed-size message (kind, step, a code of
what is compared, a readable description). The checks themselves pair in
order, so whatever two ranks do instead of each other meets in one check and
is compared there, on every rank at once: all ranks raise the same
``CollectiveMismatchError``, naming what each rank was doing. A compiled
graph's collectives are a function of its marker sequence (the passes never
reorder two collectives of a group, and bucket by parameter bytes only), so
a graph whose markers match an agreed graph's is harmless (a recompile for a
new input shape on one rank) and is not checked again; a new one is checked
before it runs. Its collectives then run unchecked: the hot path of a
compiled step costs two tiny all-gathers (``STEP``, ``BACKWARD``).

A check that does not complete within ``config.comm.check_timeout_s`` means
a rank is stuck or took a path without checks: the waiting ranks raise,
naming the check and the ranks that did not arrive, from each rank's last
announcement in the store (``compiled_fsdp/last/<ranks>/<rank>``). Time a peer spends
compiling (announced by Dynamo's compile callbacks) does not count. The
failing rank records its error in the store, and a rank that arrives later
raises it at its next check instead of running into a collective alone.

Not covered: a rank-dependent choice between graphs that every rank has
already compiled (both marker sequences were agreed, in earlier steps) inside
one compiled forward, and a rank stalling between two frames of a
graph-broken forward. (Such a choice between modules is covered: ``BACKWARD``
compares the forward's modules, and identical blocks compiled on their own
share one graph, so a rank running one block fewer compiles nothing new.) Their collectives
wait as long as the process group's own timeout (``init_process_group``).
Tested by tests/test_divergence.py.
"""
from __future__ import annotations

import ctypes
import hashlib
import struct
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from compiled_fsdp.config import comm
from compiled_fsdp.core import compat
from compiled_fsdp.runtime.registry import RUNTIME

__all__ = ["CollectiveMismatchError"]

STEP, BACKWARD, COLLECTIVE, GRAPH = 1, 2, 3, 4
_MSG_BYTES = 256
_HEADER = struct.Struct("<qqq")  # kind, step, code
_PREFIX = "compiled_fsdp/"
_FAILED = _PREFIX + "failed"  # "<rank>|<message>" of the first rank that raised
_POLL_S = 0.5


class CollectiveMismatchError(RuntimeError):
    """The ranks do not issue the same collectives in the same order, or one of
    them did not reach a collective within ``config.comm.check_timeout_s``."""


@dataclass(frozen=True)
class Checkpoint:
    """What a rank is about to do; ``kind``, ``step`` and ``code`` must be equal
    on every rank, ``what`` says it in words."""

    kind: int
    step: int
    code: int
    what: str

    def encode(self) -> torch.Tensor:
        text = self.what.encode()[: _MSG_BYTES - _HEADER.size]
        buf = bytearray(_MSG_BYTES)
        buf[: _HEADER.size] = _HEADER.pack(self.kind, self.step, self.code)
        buf[_HEADER.size: _HEADER.size + len(text)] = text
        return torch.frombuffer(buf, dtype=torch.uint8).clone()

    @staticmethod
    def decode(row: torch.Tensor) -> "Checkpoint":
        raw = bytes(row.tolist())
        kind, step, code = _HEADER.unpack(raw[: _HEADER.size])
        return Checkpoint(kind, step, code, raw[_HEADER.size:].rstrip(b"\0").decode(errors="replace"))


def stable_code(*parts: object) -> int:
    """A code identical on every rank for equal ``parts`` (Python's hash of a
    string is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _rank() -> int:
    return dist.get_rank()


def set_compiling(active: bool) -> None:
    """Announce that this rank is (no longer) compiling: peers waiting at a
    check do not count that time against the bound. Nothing to announce where
    ranks are not processes ([Note: Helper groups]): no checks run there."""
    if dist.is_initialized() and ranks_are_processes(dist.group.WORLD):
        _store().set(f"{_PREFIX}compiling/{_rank()}", "1" if active else "0")


class PendingCheck:
    """An issued check, not yet compared."""

    def __init__(self, checker: "Checker", cp: Checkpoint, index: int) -> None:
        self.checker, self.cp = checker, cp
        self.index = index  # its number in the step (see ``Checker.issue``)
        self.out = torch.empty(checker.world * _MSG_BYTES, dtype=torch.uint8)
        self.work: Optional[dist.Work] = compat.all_gather_single(
            self.out, cp.encode(), group=checker.group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            self.checker._finish(self, work)


class Checker:
    """Issues and compares checks over one group's ranks (see [Note: Agreeing
    on collectives])."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        # Weakly: see [Note: Process groups at exit] in tools/launch.py.
        self._group = weakref.ref(group)
        self.world = group.size()
        self.ranks = dist.get_process_group_ranks(group)
        self.step = 0  # the current step of the root that checks with this group
        self.groups = 0  # parameter groups registered (see ``register``)
        self._record = f"{_PREFIX}last/{'-'.join(map(str, self.ranks))}/"  # + rank
        self.index = 0  # checks issued in this step (names a check in the records)
        # Codes of the marker sequences every rank has compiled and checked.
        self.agreed_graphs: set[int] = set()

    def register(self) -> int:
        """A number for a new parameter group over these ranks: ``fully_shard``
        runs in the same order on every member rank, so the numbers agree."""
        self.groups += 1
        return self.groups

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("compiled_fsdp: the process group was destroyed (destroy_process_group); "
                               "a model sharded before that cannot run any more.")
        return group

    def alive(self) -> bool:
        """False once ``destroy_process_group`` destroyed the check group."""
        group = self._group()
        return group is not None and group in dist.distributed_c10d._world.pg_map

    def check_step(self, step: int) -> None:
        self.step, self.index = step, 0
        self.check(Checkpoint(STEP, step, 0, "the start of the forward"))

    def check_backward(self, forward: Sequence[tuple[tuple, str]] = ()) -> None:
        """``forward``: the modules this step's forward ran, in order (each
        group's ``identity`` and ``label``), compared too: ranks that ran
        different modules through graphs they had all agreed on (blocks
        compiled on their own share one) differ here, before any collective
        of the backward."""
        what = "the start of the compiled backward"
        if forward:
            what += " after a forward through " + ", ".join(label for _, label in forward)
        self.check(Checkpoint(BACKWARD, self.step, stable_code(tuple(i for i, _ in forward)), what))

    def check_graph(self, code: int, what: str) -> None:
        """A graph reading sharded parameters in a new order is about to run
        its first time; see [Note: Agreeing on collectives]."""
        if code not in self.agreed_graphs:
            self.check(Checkpoint(GRAPH, self.step, code, what))
            self.agreed_graphs.add(code)

    def issue(self, cp: Checkpoint) -> PendingCheck:
        self.index += 1
        _store().set(f"{self._record}{_rank()}", f"{time.time():.3f}|{cp.step}|{self.index}|{cp.what}")
        return PendingCheck(self, cp, self.index)

    def check(self, cp: Checkpoint) -> None:
        self.issue(cp).wait()

    # -- waiting and comparing -----------------------------------------------
    def _finish(self, pending: PendingCheck, work: dist.Work) -> None:
        cp = pending.cp
        deadline = time.monotonic() + comm.check_timeout_s
        while True:
            try:
                work.wait(timedelta(seconds=_POLL_S))
                break
            except RuntimeError as e:
                if "Operation timed out" not in str(e):  # not our poll: the group broke
                    self._raise_failed_peer(cp)
                    self._fail(f"compiled_fsdp: the check before {cp.what} in step {cp.step} failed: {e}. "
                               "A peer process probably exited; see its error.")
                self._raise_failed_peer(cp)
                if time.monotonic() < deadline:
                    continue
                if self._peers_compiling():
                    deadline = time.monotonic() + comm.check_timeout_s
                    continue
                self._fail(self._timeout_message(pending))
        rows = pending.out.view(self.world, _MSG_BYTES)[:, : _HEADER.size]
        if not torch.equal(rows, rows[_rank_in(self.ranks)].expand_as(rows)):
            # Every rank sees this mismatch: no need to record it.
            got = [Checkpoint.decode(r) for r in pending.out.view(self.world, _MSG_BYTES)]
            raise CollectiveMismatchError(_mismatch_message(self.ranks, got))
        # A late rank's check can pair with one a failed rank left behind.
        self._raise_failed_peer(cp)

    def _fail(self, message: str) -> NoReturn:
        """Raise ``message``, first telling the ranks that come later. The check
        stays issued: its group is never destroyed (``_abandon``; see [Note:
        Process groups at exit] in tools/launch.py)."""
        _abandon(self.group)
        _store().set(_FAILED, f"{_rank()}|{message}")
        raise CollectiveMismatchError(message)

    def _raise_failed_peer(self, cp: Checkpoint) -> None:
        report = _failed_report()
        if report is None:
            return
        rank, first = report
        raise CollectiveMismatchError(
            f"compiled_fsdp: stopping before {cp.what} in step {cp.step}: rank {rank} already failed, "
            f"so the ranks' collectives no longer pair up. Rank {rank} reported: {first}")

    def _peers_compiling(self) -> bool:
        store = _store()
        keys = [f"{_PREFIX}compiling/{r}" for r in self.ranks if r != _rank()]
        present = [k for k in keys if store.check([k])]
        return any(store.get(k) == b"1" for k in present)

    def _timeout_message(self, pending: PendingCheck) -> str:
        cp = pending.cp
        store = _store()
        lines, missing = [], []
        for r in self.ranks:
            if r == _rank():
                continue
            key = f"{self._record}{r}"
            if not store.check([key]):
                missing.append(r)
                lines.append(f"rank {r} has not checked anything yet")
                continue
            stamp, step, index, what = store.get(key).decode().split("|", 3)
            if (int(step), int(index)) >= (cp.step, pending.index):  # it got here (or further)
                continue
            missing.append(r)
            ago = time.time() - float(stamp)
            lines.append(f"rank {r}'s last check was {what} in step {step}, {ago:.0f} s ago")
        who = ", ".join(map(str, missing)) or "unknown"
        return (
            f"compiled_fsdp: rank {_rank()} waited {comm.check_timeout_s:g} s at {cp.what} in step {cp.step}; "
            f"rank(s) {who} did not arrive: {'; '.join(lines) or 'no record'}. A rank is stuck (in its data "
            "loader, in a rank-only branch, in user code) or took another path through the model. Every "
            "rank must reach the same collectives; the bound is compiled_fsdp.config.comm.check_timeout_s.")


def _failed_report() -> Optional[tuple[int, str]]:
    """(rank, message) of the first rank that failed a check, if any did."""
    store = _store()
    if not store.check([_FAILED]):
        return None
    rank, message = store.get(_FAILED).decode().split("|", 1)
    return int(rank), message


def annotate_error(exc: BaseException) -> None:
    """Add the first failed rank's report as a note to ``exc``, an error that
    left a forward (typically gloo's "Connection closed by peer" inside a
    compiled graph, after that rank raised and exited)."""
    if isinstance(exc, CollectiveMismatchError) or not hasattr(exc, "add_note") or not dist.is_initialized():
        return
    try:
        report = _failed_report()
    except Exception:  # noqa: BLE001 - the store may be gone with the group; keep the original error
        return
    if report is None:
        return
    rank, message = report
    note = f"Rank {rank} failed first and reported: {message}"
    if rank != _rank() and note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def _mismatch_message(ranks: Sequence[int], got: Sequence[Checkpoint]) -> str:
    doing = "; ".join(f"rank {r}: {_describe(c)}" for r, c in zip(ranks, got))
    kinds = {c.kind for c in got}
    if kinds == {GRAPH}:
        hint = ("The ranks compiled different graphs: the forward takes a rank-dependent path (a branch on "
                "the rank or on rank-local data, a block skipped or called again on some ranks).")
    else:
        hint = ("The forward takes a rank-dependent path (a block skipped or called an extra time on some "
                "ranks, a branch on the rank or on rank-local data), or the ranks run different numbers "
                "of forward/backward passes.")
    return (f"compiled_fsdp: the ranks' collectives differ: {doing}. {hint} Every rank must run the same "
            "sharded modules in the same order; make that control flow identical on every rank.")


def _rank_in(ranks: Sequence[int]) -> int:
    return list(ranks).index(_rank())


def _describe(cp: Checkpoint) -> str:
    return f"{cp.what} in step {cp.step}"


def _abandon(group: dist.ProcessGroup) -> None:
    """A gloo group whose collective still waits for a peer cannot be destroyed
    (its destructor joins the threads that wait, after ``destroy_process_group``
    too), and the interpreter's teardown at exit would destroy it, blocking the
    exit until the peer's process ends: a deadlock when that peer waits for
    this process's other groups to close. So it is kept alive for good: one
    reference more than anything holds, which nothing releases."""
    RUNTIME.abandoned.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
def ranks_are_processes(group: dist.ProcessGroup) -> bool:
    """[Note: Helper groups]
    Whether each rank of ``group`` is a process of its own that runs the
    same program: the groups' backends are gloo or NCCL. Under torch's fake
    process group (one process simulates every rank, collectives move
    nothing) and its multi-thread one (one thread per rank, one process)
    there is no other process to diverge from or agree with, and a gloo
    helper group cannot be made (the fake one has no gloo, and a thread rank
    would wait in a process-wide ``new_group`` for its siblings), so the
    checks and the agreement at ``fully_shard`` step aside there. The reduce
    group follows the data group's backend on every backend; every cache of
    helper groups is keyed by the data group object, so thread ranks (each
    with its own group objects) never share one."""
    parts = {b.split(":")[-1] for b in str(dist.get_backend(group)).split(",")}
    return parts <= {"gloo", "nccl"}


def ranks_are_threads(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s ranks are threads of this process (torch's
    multi-thread group, [Note: Helper groups]): they share the process's
    registries, so whatever one rank decides from them (the compile
    regions' gathers issued ahead: [Note: Blocks as compile regions] in
    compile/regions.py) another would see."""
    return "threaded" in {b.split(":")[-1] for b in str(dist.get_backend(group)).split(",")}


def checker_for(group: dist.ProcessGroup, ranks: Optional[Sequence[int]] = None) -> Optional[Checker]:
    """The checker over ``ranks`` (default: ``group``'s), created
    (collectively, at ``fully_shard``) the first time; None when checks are
    off or cannot run ([Note: Helper groups]). HSDP and ``replicate`` pass
    every rank of their mesh: a rank whose forward differs from the others of
    its shard group must stop the other replicas too, which would otherwise
    wait for it in their all-reduce
    (tests/test_hsdp.py::test_hsdp_and_replicate_with_mixed_precision_no_sync_meta_and_fallback)."""
    if not comm.check_collectives or not ranks_are_processes(group):
        return None
    ranks = tuple(sorted(ranks if ranks is not None else dist.get_process_group_ranks(group)))
    if len(ranks) == 1:
        return None  # (one rank: nothing to pair up with)
    checker = RUNTIME.checker(ranks)
    if checker is None:
        local = len(ranks) != dist.get_world_size()
        check_group = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=local,
                                     group_desc="compiled_fsdp_check")
        assert check_group is not None
        checker = RUNTIME.checkers[ranks] = Checker(check_group)
    return checker
