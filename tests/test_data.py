"""examples/data.py: the corpus, its file-level split, the per-rank resumable loader, clear errors."""
from __future__ import annotations

import os
import sysconfig

import pytest
import torch

from examples.data import Loader, TokenDataset, load_corpus, stdlib_files, val_batches

SEQ = 32


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None, seq=SEQ, max_bytes=300_000)


class IndexDataset:
    """Sample i is (full(i), full(i)): a batch's content names its samples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((4,), i), torch.full((4,), i)


def ids(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    return batch[0][:, 0].tolist()


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_stdlib_corpus(corpus) -> None:
    assert corpus.describe().startswith(f"stdlib corpus: {len(corpus.files)} files, ")
    files = stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    root = sysconfig.get_paths()["stdlib"]
    rel = [os.path.relpath(f, root).split(os.sep) for f in files]
    assert rel == sorted(rel, key="/".join) and any(len(r) > 1 for r in rel)
    assert not {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"} & {p for r in rel for p in r}
    assert corpus.files == tuple(files[:len(corpus.files)])
    assert sum(os.path.getsize(f) for f in corpus.files) <= 300_000 and corpus.skipped_files > 0
    # every 10th file in validation, the splits disjoint, each file's bytes in its split
    assert corpus.val_files == corpus.files[9::10]
    train_bytes = corpus.train.tokens.numpy().tobytes()
    val_bytes = corpus.val.tokens.numpy().tobytes()
    for i, f in enumerate(corpus.files):
        with open(f, "rb") as fh:
            raw = fh.read()
        if len(raw) > 200:
            assert (raw in val_bytes) == (i % 10 == 9) and (raw in train_bytes) == (i % 10 != 9), f
    assert corpus.train_bytes == len(corpus.train.tokens) > 0 and corpus.val_bytes == len(corpus.val.tokens) > 0
    again = load_corpus(None, seq=SEQ, max_bytes=300_000)
    assert again.files == corpus.files and torch.equal(again.train.tokens, corpus.train.tokens)
    assert torch.equal(again.val.tokens, corpus.val.tokens)


def test_windows_shift_by_one(corpus) -> None:
    ds = corpus.train
    assert len(ds) == (len(ds.tokens) - 1) // SEQ
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ,)
        assert torch.equal(x, ds.tokens[i * SEQ:i * SEQ + SEQ].long())
        assert torch.equal(y, ds.tokens[i * SEQ + 1:i * SEQ + SEQ + 1].long())
        assert torch.equal(x[1:], y[:-1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def write_files(root, n: int, size: int = 300) -> list[str]:
    paths = []
    for i in range(n):
        path = root / "sub" / f"f{i:02d}.txt" if i % 3 else root / f"f{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((f"marker-{i:02d} é " * size)[:size])
        paths.append(str(path))
    return paths


def test_user_files_split_by_file(tmp_path) -> None:
    write_files(tmp_path, 12)
    (tmp_path / ".hidden").write_bytes(b"\xff")  # hidden files are left out
    c = load_corpus(str(tmp_path), seq=8)
    rel = [os.path.relpath(f, tmp_path) for f in c.files]
    assert rel == sorted(rel, key=lambda p: p.replace(os.sep, "/")) and len(rel) == 12
    val_bytes, train_bytes = c.val.tokens.numpy().tobytes(), c.train.tokens.numpy().tobytes()
    for i, f in enumerate(c.files):
        marker = open(f).read()[:9].encode()
        assert (marker in val_bytes) == (f in c.val_files) == (i == 9), f
        assert (marker in train_bytes) == (i != 9), f
    assert 0 in c.train.tokens.tolist()  # the separator
    # a glob gives the same corpus, and loading again the same tokens
    g = load_corpus(str(tmp_path / "**" / "*.txt"), seq=8)
    assert sorted(g.files) == sorted(c.files) and len(g.val_files) == 1
    again = load_corpus(str(tmp_path), seq=8)
    assert torch.equal(again.train.tokens, c.train.tokens) and torch.equal(again.val.tokens, c.val.tokens)
    assert c.describe().startswith(f"{str(tmp_path)!r} corpus: 12 files")


def test_few_files_and_one_file(tmp_path) -> None:
    paths = write_files(tmp_path, 3)
    c = load_corpus(str(tmp_path), seq=8)
    size = os.path.getsize(paths[0])  # 300 characters, some of two bytes
    assert c.val_files == (c.files[-1],) and c.val_bytes == size and c.train_bytes == 2 * size + 1
    one = load_corpus(paths[0], seq=8)
    raw = open(paths[0], "rb").read()
    assert one.train_bytes == size * 9 // 10 and one.val_bytes == size - size * 9 // 10
    assert one.train.tokens.numpy().tobytes() + one.val.tokens.numpy().tobytes() == raw


def test_loader_deterministic(corpus) -> None:
    for rank in (0, 1):
        a, b = Loader(corpus.train, 4, rank, 2, seed=3), Loader(corpus.train, 4, rank, 2, seed=3)
        xa = [a.next_batch() for _ in range(5)]
        assert_same(xa, [b.next_batch() for _ in range(5)])
        x, y = xa[0]
        assert x.shape == y.shape == (4, SEQ) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    other = Loader(corpus.train, 4, 0, 2, seed=4).next_batch()
    assert not torch.equal(other[0], Loader(corpus.train, 4, 0, 2, seed=3).next_batch()[0])


def test_ranks_disjoint_and_epochs_shuffled(corpus) -> None:
    n, world, batch = 103, 2, 4
    loaders = [Loader(IndexDataset(n), batch, r, world, seed=0) for r in range(world)]
    per_rank = (n // world) // batch  # batches in an epoch
    epochs = []
    for _ in range(2):
        seen = [[i for _ in range(per_rank) for i in ids(ld.next_batch())] for ld in loaders]
        assert not set(seen[0]) & set(seen[1])
        assert len(set(seen[0] + seen[1])) == world * per_rank * batch
        epochs.append(seen[0])
    assert all(ld.epoch == 1 for ld in loaders)
    assert epochs[0] != epochs[1]
    # on real data too: the two ranks' first batches hold different windows
    a, b = Loader(corpus.train, 4, 0, 2).next_batch(), Loader(corpus.train, 4, 1, 2).next_batch()
    assert not torch.equal(a[0], b[0])


@pytest.mark.parametrize("steps", [3, 7, 12])  # 5 batches an epoch: within the first, across one, in the third
def test_resume_same_world(steps: int) -> None:
    ds = IndexDataset(43)
    for rank in (0, 1):
        ref = Loader(ds, 4, rank, 2, seed=5)
        for _ in range(steps):
            ref.next_batch()
        state = ref.state_dict()
        assert set(state) == {"epoch", "samples"} and state["epoch"] == (steps - 1) // 5
        new = Loader(ds, 4, rank, 2, seed=5)
        new.load_state_dict(dict(state))
        assert_same([new.next_batch() for _ in range(8)], [ref.next_batch() for _ in range(8)])


def test_resume_real_corpus(corpus) -> None:
    ref = Loader(corpus.train, 2, 1, 2, seed=1)
    for _ in range(4):
        ref.next_batch()
    new = Loader(corpus.train, 2, 1, 2, seed=1)
    new.load_state_dict(ref.state_dict())
    assert_same([new.next_batch() for _ in range(3)], [ref.next_batch() for _ in range(3)])


def test_resume_other_world() -> None:
    n, batch = 1000, 4
    ds = IndexDataset(n)
    old = [Loader(ds, batch, r, 2, seed=7) for r in range(2)]
    before = [i for _ in range(7) for ld in old for i in ids(ld.next_batch())]
    states = [ld.state_dict() for ld in old]
    assert states[0] == states[1] == {"epoch": 0, "samples": 7 * batch * 2}
    new = [Loader(ds, batch, r, 3, seed=7) for r in range(3)]
    for ld in new:
        ld.load_state_dict(states[0])
    after = []
    while all(ld.epoch == 0 for ld in new):
        batches = [ld.next_batch() for ld in new]
        if any(ld.epoch != 0 for ld in new):
            assert all(ld.epoch == 1 for ld in new)  # the ranks roll over together
            break
        after += [i for b in batches for i in ids(b)]
    # no sample of the epoch twice; the unseen ones are the rounding (< 3), drop_last's tail (n % 3)
    # and each rank's last partial batch (< batch)
    assert len(before + after) == len(set(before + after))
    assert n - len(before + after) <= 2 + n % 3 + 3 * (batch - 1)
    assert len(after) >= 900
    resumed = new[0].state_dict()
    assert resumed["epoch"] == 1 and resumed["samples"] == 3 * batch


def test_val_batches(corpus) -> None:
    a = val_batches(corpus.val, 4, 3, 0, 2)
    assert len(a) == 3 and all(x.shape == y.shape == (4, SEQ) for x, y in a)
    assert_same(a, val_batches(corpus.val, 4, 3, 0, 2))
    ds = IndexDataset(100)
    ranks = [[i for b in val_batches(ds, 4, 5, r, 2) for i in ids(b)] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 20 and not set(ranks[0]) & set(ranks[1])
    assert max(ranks[0] + ranks[1]) >= 90  # spread over the whole split
    assert len(val_batches(ds, 4, 1000, 0, 3)) == 100 // 3 // 4  # as many as there are
    with pytest.raises(ValueError, match="no validation batch"):
        val_batches(IndexDataset(5), 4, 1, 0, 2)


def test_error_no_files(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"'.*\*\.nope' matched no files"):
        load_corpus(str(tmp_path / "*.nope"), seq=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .*files"):
        load_corpus(str(tmp_path / "empty"), seq=8)


def test_error_not_utf8(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("fine text " * 20)
    (tmp_path / "bad.txt").write_bytes(b"hello \xff\xfe world")
    with pytest.raises(ValueError, match=r"bad\.txt' is not UTF-8 text: byte 0xff at byte offset 6"):
        load_corpus(str(tmp_path), seq=8)


def test_error_too_small(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("x" * 50)
    with pytest.raises(ValueError, match=r"too small for seq=64: the train split has 45 bytes .* validation split 5"):
        load_corpus(str(tmp_path / "a.txt"), seq=64)
    (tmp_path / "b.txt").write_text("y" * 500)
    with pytest.raises(ValueError, match="larger than max_bytes=100"):
        load_corpus(str(tmp_path / "b.txt"), seq=8, max_bytes=100)
    with pytest.raises(ValueError, match="dataset too small: 10 samples, but 2 ranks x batch 8 need at least 16"):
        Loader(TokenDataset(torch.zeros(81, dtype=torch.uint8), 8), 8, 0, 2)
