"""A model for the numerics checker whose sharding is broken on purpose: the
tiny GPT, with ``layers.1``'s gradients never reduce-scattered (its shards
keep ``grad=None``), to prove the checker fails and names the module. Test
code only: it replaces one group's post-backward after ``fully_shard``."""
from __future__ import annotations

import torch.nn as nn

from compiled_fsdp import fully_shard, get_fsdp_state
from compiled_fsdp.tools.models import tiny

__all__ = ["tiny", "shard"]


def shard(model: nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    group = get_fsdp_state(model.layers[1]).param_group
    group.post_backward = lambda grads, bucket=0: group.reshard()  # reduces nothing
