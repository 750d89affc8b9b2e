"""The main job (examples/train.py) as a user runs it, under torchrun on 2
gloo ranks: a run SIGKILLed mid-way and resumed ends bitwise equal to one that
was never interrupted; a resume at another world size continues the loss; bad
input stops every rank with one clear line and overwrites nothing.
The loader itself: tests/test_data.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
# A small slice of the corpus keeps start-up short; the model is the tiny one.
COMMON = ["--model", "tiny", "--batch", "4", "--micro-batches", "2", "--log-every", "1", "--eval-every", "4",
          "--val-batches", "2", "--precision", "fp32"]


def _cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            TRAIN, *COMMON, *args]


def _run(nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(nproc, *args), capture_output=True, text=True, timeout=420, cwd=ROOT)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _records(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics-ours.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


def _kill_matching(marker: str) -> int:
    """SIGKILL every process whose command line holds ``marker`` (the ranks
    run in sessions of their own, so killing torchrun's group would miss them)."""
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def test_kill_and_resume_is_bitwise(tmp_path) -> None:
    """8 steps straight, against 8 steps with checkpoints every 2, the ranks
    SIGKILLed while step 6 runs (after step 5 finished, so its work is lost;
    a half-written save of step 6 beside it) and the job resumed from step 4: the same losses from step 5 on and the
    same parameter bytes at the end. Compiled (aot_eager) against an eager
    reference (aot_eager is bitwise the eager runtime; one compile less of CI):
    the eager runtime holds the same DTensor state, and resumes the checkpoint at 3 ranks."""
    steps = ["--steps", "8", "--compile", "aot_eager"]
    ref_out = str(tmp_path / "ref")
    _run(2, "--steps", "8", "--compile", "none", "--out", ref_out)
    ref = _records(ref_out)

    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    args = [*steps, "--out", out, "--checkpoint-dir", ckpt, "--checkpoint-every", "2"]
    job = subprocess.Popen(_cmd(2, *args, "--stall-at-step", "6"), cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    metrics = os.path.join(out, "metrics-ours.jsonl")
    while not (os.path.exists(metrics) and 5 in _losses(_records(out))):
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()[-3000:]
        time.sleep(0.2)
    assert sorted(os.listdir(ckpt)) == ["step-000002", "step-000004"]
    assert _kill_matching(ckpt) >= 3  # torchrun and both ranks
    job.wait(timeout=60)
    assert job.returncode != 0

    # What a kill during the save of step 6 would have left: ignored, then replaced.
    os.makedirs(os.path.join(ckpt, ".step-000006.tmp"))
    with open(os.path.join(ckpt, ".step-000006.tmp", "__0_0.distcp"), "wb") as f:
        f.write(b"half a shard")
    _run(2, *args, "--resume")
    run = _records(out)
    assert [r["resumed_at"] for r in run if r["event"] == "start"] == [None, 4]
    resumed = [r for r in run[run.index(next(r for r in run if r.get("resumed_at") == 4)):] if r["event"] == "step"]
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    ref_losses = _losses(ref)
    assert all(r["loss"] == ref_losses[r["step"]] for r in resumed), (resumed, ref_losses)
    assert run[-1]["digest"] == ref[-1]["digest"], (run[-1], ref[-1])
    assert sorted(os.listdir(ckpt)) == ["step-000006", "step-000008"]  # the newest two kept

    # the same checkpoint at 3 ranks, eager: the loss goes on from where it was
    _run(3, "--steps", "10", "--compile", "none", "--out", str(tmp_path / "three"), "--checkpoint-dir", ckpt,
         "--resume")
    three = _losses(_records(str(tmp_path / "three")))
    assert sorted(three) == [9, 10]
    assert abs(three[9] - ref_losses[8]) < 0.25 < ref_losses[1] - three[9], (three, ref_losses)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(line for line in proc.stderr.splitlines() if line.startswith("train.py: rank "))


def test_bad_input_stops_every_rank(tmp_path) -> None:
    """Each mistake: exit non-zero, the same single line from both ranks,
    nothing written. (A glob that matches no file and a resume without a
    checkpoint are checked in-process: tests/test_data.py and
    ``test_resume_without_a_checkpoint``; ~30 s of CI less.)"""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 100)
    ckpt = str(tmp_path / "ckpt")
    _run(2, "--steps", "2", "--compile", "none", "--out", str(tmp_path / "ok"), "--checkpoint-dir", ckpt,
         "--checkpoint-every", "2")
    saved = sorted(os.listdir(os.path.join(ckpt, "step-000002")))
    cases = {
        "not UTF-8": (["--data", str(bad)], "is not UTF-8"),
        "other shape": (["--model", "small", "--checkpoint-dir", ckpt, "--resume"], "holds another model"),
        "would overwrite": (["--checkpoint-dir", ckpt, "--checkpoint-every", "1"], "already holds checkpoints"),
    }
    for name, (args, words) in cases.items():
        out = str(tmp_path / name.replace(" ", "_"))
        proc = _run(2, "--steps", "2", "--compile", "none", "--out", out, *args, check=False)
        lines = _error_lines(proc)
        assert proc.returncode != 0 and len(lines) == 2, (name, proc.stderr[-3000:])
        assert lines[0][len("train.py: rank 0"):] == lines[1][len("train.py: rank 1"):], lines
        assert words in lines[0], (name, lines)
        assert not os.path.exists(out), name  # no metrics file begun
    assert sorted(os.listdir(ckpt)) == ["step-000002"]
    assert sorted(os.listdir(os.path.join(ckpt, "step-000002"))) == saved


def test_resume_without_a_checkpoint(tmp_path) -> None:
    """``--resume`` on a folder without a checkpoint: a clear error before any collective."""
    from examples import checkpoint

    with pytest.raises(ValueError, match="no checkpoint under .* run without --resume to start"):
        checkpoint.load(str(tmp_path / "empty"), None, None)

