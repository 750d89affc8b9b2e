"""Real text for examples/train.py: byte-level tokens, a file-level split, a resumable loader.

The corpus is available offline everywhere: by default the ``.py`` sources of
Python's standard library (``sysconfig.get_paths()["stdlib"]``, without
site-packages, test suites, idlelib, lib2to3), or the files named by ``--data``
(a directory: every regular, non-hidden file under it; otherwise a glob, with
``**``). Files are sorted by path and taken in that order until the next one
would bring the total past ``max_bytes``. Each must be UTF-8; tokens are its bytes (vocab 256),
files joined by a 0 byte. Every file whose index in that order is ``% 10 == 9``
goes to validation (with 2-9 files, the last one; with one file, its last 10%).

``Loader`` gives each rank its own batches with ``DistributedSampler``
semantics (shuffled by seed and epoch, disjoint between ranks, ``drop_last``).
Its state is ``{"epoch": e, "samples": g}``: ``g`` is the number of samples the
whole job consumed in epoch ``e`` (batches per rank x batch x world), the same
on every rank and independent of the world size. The permutation of an epoch
depends only on seed and epoch, and a world of ``W`` ranks consumes its first
positions in order (rank ``r`` takes positions ``r, r + W, ...``); a loader of
``W`` ranks resuming from ``g`` starts each rank at ``ceil(g / W)`` in its own
list, i.e. at position ``ceil(g / W) * W >= g``. So no sample of the epoch is
seen twice, and fewer than ``W`` are skipped by the rounding (plus the usual
``drop_last`` tail). At the same world size it resumes exactly.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler

DEFAULT_MAX_BYTES = 8_000_000
SEPARATOR = 0  # byte between files; never in ordinary text
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenDataset(Dataset):
    """Windows of ``seq + 1`` tokens at stride ``seq``: sample ``i`` is
    ``tokens[i*seq : i*seq + seq + 1]`` as (input = first ``seq``, target = last ``seq``), int64."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq)

    def __getitem__(self, i: int) -> Batch:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        start = (i % n) * self.seq
        window = self.tokens[start:start + self.seq + 1].long()
        return window[:-1], window[1:]


@dataclass(frozen=True)
class Corpus:
    """A loaded corpus: ``train``/``val`` datasets and where they came from."""

    name: str  # "stdlib" or the --data argument
    train: TokenDataset
    val: TokenDataset
    files: tuple[str, ...]  # every file used, in order
    val_files: tuple[str, ...]  # those of them in validation
    train_bytes: int  # tokens in each split, separators included
    val_bytes: int
    skipped_files: int = 0  # matched but left out by max_bytes

    def describe(self) -> str:
        """One line, e.g. ``stdlib corpus: 450 files, 7.2 MB train, 0.8 MB val``."""
        n = len(self.files)
        capped = f" (first {n} of {n + self.skipped_files} files)" if self.skipped_files else ""
        return (f"{self.name} corpus: {len(self.files)} files, {self.train_bytes / 1e6:.1f} MB train, "
                f"{self.val_bytes / 1e6:.1f} MB val{capped}")


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (no tests, site-packages, idlelib, lib2to3), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    return _walk(root, keep=lambda name: name.endswith(".py"), skip_dirs=_STDLIB_SKIP)


def _walk(root: str, keep: Callable[[str], bool], skip_dirs: Collection[str] = ()) -> list[str]:
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
        for name in names:
            path = os.path.join(here, name)
            if not name.startswith(".") and keep(name) and os.path.isfile(path):
                found.append(path)
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def find_files(data: str | None) -> list[str]:
    """The files of a corpus, sorted: the stdlib for None, a directory's files, or a glob's matches."""
    if data is None:
        files = stdlib_files()
        if not files:
            raise ValueError(f"no .py files under the standard library {sysconfig.get_paths()['stdlib']!r}: "
                             "pass --data DIR or a glob of UTF-8 text files")
        return files
    if os.path.isdir(data):
        files = _walk(data, keep=lambda name: True)
        if not files:
            raise ValueError(f"--data {data!r}: the directory holds no (non-hidden) files; "
                             "pass a directory or glob of UTF-8 text files")
        return files
    files = sorted(p for p in glob.glob(data, recursive=True) if os.path.isfile(p))
    if not files:
        raise ValueError(f"--data {data!r} matched no files (from {os.getcwd()!r}): pass an existing directory "
                         "or a glob such as 'texts/**/*.txt'")
    return files


def _read_utf8(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {e.start} "
                         f"({e.reason}); convert it to UTF-8 or pass --data a pattern that leaves it out") from None
    return raw


def _tokens(parts: Sequence[bytes]) -> torch.Tensor:
    joined = bytearray(bytes([SEPARATOR]).join(parts))
    if not joined:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(joined, dtype=torch.uint8)


def load_corpus(data: str | None, seq: int, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Load the corpus named by ``data`` (None: the stdlib) as byte tokens split by file.

    Files are taken in sorted order until the next would bring the total past ``max_bytes``.
    Raises ValueError when nothing matches, a file is not UTF-8, or a split is
    shorter than ``seq + 1`` tokens.
    """
    if seq < 1:
        raise ValueError(f"seq must be >= 1, got {seq}")
    found = find_files(data)
    files, total = [], 0
    for path in found:
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        files.append(path)
        total += size
    if not files:
        raise ValueError(f"the first file {found[0]!r} ({os.path.getsize(found[0])} bytes) is larger than "
                         f"max_bytes={max_bytes}: raise max_bytes")
    raw = [_read_utf8(p) for p in files]
    if len(files) == 1:
        cut = len(raw[0]) * 9 // 10
        train, val, val_files = _tokens([raw[0][:cut]]), _tokens([raw[0][cut:]]), tuple(files)
    else:
        is_val = [i % 10 == 9 for i in range(len(files))] if len(files) >= 10 else [False] * (len(files) - 1) + [True]
        train = _tokens([b for b, v in zip(raw, is_val) if not v])
        val = _tokens([b for b, v in zip(raw, is_val) if v])
        val_files = tuple(p for p, v in zip(files, is_val) if v)
    if min(len(train), len(val)) < seq + 1:
        raise ValueError(f"corpus too small for seq={seq}: the train split has {len(train)} bytes and the "
                         f"validation split {len(val)} ({len(files)} files, {total} bytes); each needs at least "
                         f"seq + 1 = {seq + 1}: add text, raise max_bytes or lower seq")
    return Corpus(name="stdlib" if data is None else repr(data), train=TokenDataset(train, seq),
                  val=TokenDataset(val, seq), files=tuple(files), val_files=val_files,
                  train_bytes=len(train), val_bytes=len(val), skipped_files=len(found) - len(files))


def _stack(dataset: Sequence[Batch], indices: Sequence[int]) -> Batch:
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)


def _check(batch: int, rank: int, world: int) -> None:
    if batch < 1 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"need batch >= 1, world >= 1 and 0 <= rank < world; "
                         f"got batch={batch}, rank={rank}, world={world}")


class Loader:
    """This rank's training batches, epoch after epoch, with a resumable, world-size independent state.

    Rank ``rank`` of ``world`` reads ``DistributedSampler(shuffle=True, seed=seed,
    drop_last=True)``'s indices for the epoch in batches of ``batch``; an epoch
    ends when fewer than ``batch`` are left. See the module docstring for resuming.
    """

    def __init__(self, dataset: Sequence[Batch], batch: int, rank: int, world: int, seed: int = 0) -> None:
        _check(batch, rank, world)
        if len(dataset) // world < batch:
            raise ValueError(f"dataset too small: {len(dataset)} samples, but {world} ranks x batch {batch} need "
                             f"at least {world * batch}: add text or lower batch/seq")
        self.dataset, self.batch, self.rank, self.world = dataset, batch, rank, world
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                          drop_last=True)
        self._epoch, self._pos = 0, 0  # _pos: entries of this rank's list consumed in the epoch
        self._order: list[int] | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def _indices(self) -> list[int]:
        if self._order is None:
            self.sampler.set_epoch(self._epoch)
            self._order = list(self.sampler)
        return self._order

    def next_indices(self) -> list[int]:
        """The dataset indices of the next batch (advances like ``next_batch``)."""
        if self._pos + self.batch > len(self._indices()):
            self._epoch, self._pos, self._order = self._epoch + 1, 0, None
        start, self._pos = self._pos, self._pos + self.batch
        return self._indices()[start:self._pos]

    def next_batch(self) -> Batch:
        """The next (input, target) batch, each [batch, seq] int64."""
        return _stack(self.dataset, self.next_indices())

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "samples": g}``: samples consumed by all ranks in epoch ``e``."""
        return {"epoch": self._epoch, "samples": self._pos * self.world}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``, saved at any world size: each rank starts at ``ceil(samples / world)``."""
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if epoch < 0 or samples < 0:
            raise ValueError(f"bad loader state {state!r}: epoch and samples must be >= 0")
        self._epoch, self._pos, self._order = epoch, -(-samples // self.world), None


def val_batches(dataset: Sequence[Batch], batch: int, n_batches: int, rank: int, world: int) -> list[Batch]:
    """A fixed set of validation batches for this rank: no shuffle, the same every call.

    ``n_batches * batch * world`` samples evenly spaced over the whole dataset, dealt
    to the ranks in turn (disjoint); fewer batches if the dataset is too short.
    """
    _check(batch, rank, world)
    available = len(dataset) // world // batch
    if available < 1 or n_batches < 1:
        raise ValueError(f"no validation batch: {len(dataset)} samples, n_batches={n_batches}, {world} ranks x "
                         f"batch {batch} need at least {world * batch} samples")
    m = min(n_batches, available) * batch * world
    mine = [k * len(dataset) // m for k in range(m)][rank::world]
    return [_stack(dataset, mine[i:i + batch]) for i in range(0, len(mine), batch)]
