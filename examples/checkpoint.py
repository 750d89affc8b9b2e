"""Periodic checkpoints for the main job: DCP for the model and optimizer (any
world size can load them), a small JSON file for the loop's state (step, data
position, seed, model shape), and each rank's RNG state.

Atomic: every rank writes into ``D/.step-NNNNNN.tmp``; once all have finished
(DCP's metadata is the last file written) rank 0 renames the folder to
``D/step-NNNNNN``. A rename is atomic on one filesystem, so a job killed during a
save leaves the previous checkpoint the latest complete one; the half-written
``.tmp`` folder is ignored and removed by the next save of that step.

Every decision here is made from files all ranks read the same way (the folder
names, DCP's metadata), so every rank raises the same error on bad input.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["check_fresh", "latest", "load", "save"]

_NAME = re.compile(r"^step-(\d{6,})$")
TRAIN_STATE = "train_state.json"


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint under ``directory`` (None: there is none)."""
    if not os.path.isdir(directory):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return os.path.join(directory, max(steps)[1]) if steps else None


def check_fresh(directory: str) -> None:
    """A run that does not resume must not write over a run's checkpoints."""
    found = latest(directory)
    if found is not None:
        raise ValueError(f"--checkpoint-dir {directory} already holds checkpoints (latest: "
                         f"{os.path.basename(found)}); pass --resume to continue that run, or choose "
                         f"another folder; nothing was overwritten")


def save(directory: str, step: int, model: torch.nn.Module, optim: torch.optim.Optimizer,
         train_state: dict[str, Any], keep: int = 2) -> str:
    """Saves a checkpoint of ``step`` (collective); returns its folder. Keeps
    the newest ``keep`` checkpoints."""
    rank = dist.get_rank()
    final = os.path.join(directory, f"step-{step:06d}")
    tmp = os.path.join(directory, f".step-{step:06d}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step killed earlier
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(torch.get_rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
    dist.barrier()  # every rank's files are written
    if rank == 0:
        with open(os.path.join(tmp, TRAIN_STATE), "w") as f:
            json.dump({**train_state, "step": step, "world": dist.get_world_size()}, f, indent=1)
        os.replace(tmp, final)
        done = sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _NAME.match(name)))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(directory, f"step-{old:06d}"), ignore_errors=True)
    dist.barrier()
    return final


def _check_shapes(path: str, model_sd: dict[str, Any]) -> None:
    """A checkpoint of another model is refused by name and shape before DCP
    reads a byte (DCP's own error comes from deep inside its planner)."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for fqn, tensor in model_sd.items():
        item = meta.get(f"model.{fqn}")
        here = list(tensor.shape)
        there = list(getattr(item, "size", [])) if item is not None else None
        if there != here:
            where = "missing there" if there is None else f"{there} there"
            raise ValueError(f"the checkpoint {path} holds another model: {fqn} is {where}, {here} here; "
                             f"resume with the --model it was saved with, or start a new --checkpoint-dir")
    extra = sorted(k[len("model."):] for k in meta if k.startswith("model.") and k[len("model."):] not in model_sd)
    if extra:
        raise ValueError(f"the checkpoint {path} holds another model: it has {extra[0]} (and "
                         f"{len(extra) - 1} more) that this model lacks; resume with the --model it was "
                         f"saved with, or start a new --checkpoint-dir")


def load(directory: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Loads the latest checkpoint under ``directory`` into ``model`` and
    ``optim`` (collective); returns the loop's saved state. This rank's RNG
    state is restored when the world size is the one it was saved at."""
    path = latest(directory)
    if path is None:
        raise ValueError(f"--resume: no checkpoint under {directory!r} (expected a step-NNNNNN folder "
                         f"written by --checkpoint-every); run without --resume to start")
    with open(os.path.join(path, TRAIN_STATE)) as f:
        train_state = json.load(f)
    model_sd, optim_sd = get_state_dict(model, optim)
    _check_shapes(path, model_sd)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = os.path.join(path, f"rng-rank{dist.get_rank()}.pt")
    if train_state["world"] == dist.get_world_size() and os.path.exists(rng):
        torch.set_rng_state(torch.load(rng))
    train_state["path"] = path
    return train_state
