"""The emulated-network benchmark's models (benchmarks/emulated.py): each
kind built as its users build it, and the floor beside them."""
from __future__ import annotations

from typing import Any, Optional

import llama
import torch
import torch.nn as nn

__all__ = ["build", "build_titan", "floor_optimizer", "sharding_api", "titan_step"]


def floor_optimizer(model: nn.Module, device: torch.device, world: int) -> torch.optim.Optimizer:
    """The floor's optimizer: AdamW stepping 1/W of the parameters (fp32),
    as one rank of a sharded job does."""
    n = sum(p.numel() for p in model.parameters())
    master = torch.zeros((n + world - 1) // world, device=device, requires_grad=True)
    master.grad = torch.zeros_like(master)
    return torch.optim.AdamW([master], lr=1e-4, fused=device.type == "cuda")


def sharding_api(kind: str, cuda: bool, reduce_dtype: Optional[str] = None) -> tuple[Any, Any]:
    """``fully_shard`` (ours for the ``ours*`` kinds, FSDP2's otherwise) and
    its mixed-precision policy: bf16 compute on a GPU; gradients reduced in
    ``reduce_dtype`` (default fp32)."""
    if kind.startswith("ours"):
        from compiled_fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    reduce = getattr(torch, reduce_dtype) if reduce_dtype else torch.float32 if cuda else None
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=reduce)
    return fully_shard, mp


# [Note: The floor's weights drawn as the sharded runs' are]
# Every sharded kind draws its weights with ``Llama.init_weights`` (normal,
# std 0.02), after meta init. The floor kept ``nn.Linear``'s own draw
# (uniform, 1/sqrt(fan_in): 0.0625 at d=256) until 2026-12-04, so the two
# computed on different values: on the CPU the sharded runs' matmuls met
# denormal numbers the floor's did not, and took longer for the same shapes
# (d=256, W=8, collectives free, a step profiled beside the floor in one
# process: the key and value projections' 16 matmuls 10.7-13.8 ms against
# 7.3-7.7; with ``torch.set_flush_denormal(True)``, 7.3 against 7.5). The
# floor now draws its weights the same way.
# [Note: The first block split by first use]
# At a link where a block's gather takes as long as its forward, a step's
# exposed communication is one chain across the optimizer step: the
# embedding's gather and the first block's open the step, the first block's
# reduce-scatter and the embedding's close it (DESIGN, "What no schedule
# hides"). With the first block's feed-forward sharded on its own, the
# block's gather holds its norms and attention alone (a quarter of its
# bytes); the feed-forward's gather runs behind the attention's compute,
# and in backward its reduce-scatter behind the attention's backward.
# ``--split-first-block`` measures it, for ours and FSDP2 alike (RESULTS,
# fifty-sixth session: at W=8 on the CPU the exposed communication 67-69 ->
# 52-60 ms).
def build(kind: str, cfg: llama.LlamaConfig, device: torch.device, world: int,
          pattern: str = "plain", mesh: Any = None, reduce_dtype: Optional[str] = None,
          split_first_block: bool = False) -> tuple[nn.Module, Any, Any]:
    """(the model, what a step calls, the optimizer). ``split_first_block``:
    the first block's feed-forward sharded on its own, before the block
    ([Note: The first block split by first use])."""
    cuda = device.type == "cuda"
    if kind == "graph_trainer":  # (its own recipe: the loss in its graph, so not the chunked one)
        import graph_trainer_peer

        if pattern == "titan":
            raise ValueError("graph_trainer traces its own loss: use --pattern plain or titan_plain")
        torch.manual_seed(0)
        with torch.device(device):
            model = llama.Llama(cfg.with_(checkpoint_blocks=False))
        model.init_weights()
        dtypes = (torch.bfloat16, torch.float32) if cuda else (None, None)
        model, step = graph_trainer_peer.build(model, device, *dtypes, llama.loss_fn)
        return model, step, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    if pattern.startswith("titan"):
        return build_titan(kind, cfg, device, world)
    if kind == "floor":  # ([Note: The floor's weights drawn as the sharded runs' are])
        torch.manual_seed(0)
        with torch.device(device):
            model = llama.Llama(cfg)
        model.init_weights()
        model.to(torch.bfloat16 if cuda else torch.float32)
        return model, torch.compile(model), floor_optimizer(model, device, world)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    fully_shard, mp = sharding_api(kind, cuda, reduce_dtype)
    if kind.startswith("ours"):  # (named: regions are the default, "ours" is one graph)
        import compiled_fsdp

        compiled_fsdp.config.comm.block_regions = kind == "ours_regions"
    for i, block in enumerate(model.layers):
        if kind == "fsdp2_blocks":  # torchtitan: compile each block, then shard
            block.compile()
        if split_first_block and i == 0:
            fully_shard(block.feed_forward, mp_policy=mp, mesh=mesh)
        fully_shard(block, mp_policy=mp, mesh=mesh)
        if kind == "ours_blocks":
            block.compile()
    fully_shard(model, mp_policy=mp, mesh=mesh)
    model.to_empty(device=device)
    model.init_weights()
    run = torch.compile(model) if kind in ("ours", "ours_regions") else model
    return model, run, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)


def build_titan(kind: str, cfg: llama.LlamaConfig, device: torch.device,
                world: int) -> tuple[nn.Module, Any, Any]:
    """torchtitan's pattern (examples/torchtitan_pattern.py): selective AC,
    each block compiled (``fullgraph=True``) before sharding, the embedding
    and ``[norm, output]`` eager, the chunked loss (``titan_step``). The
    floor: the same unsharded, AdamW stepping 1/W of the parameters."""
    from compiled_fsdp.core import compat
    from examples.torchtitan_pattern import selective_ac, shard_like_torchtitan

    if kind == "ours":
        raise ValueError("--pattern titan compiles each block on its own: use the kind ours_blocks")
    cuda = device.type == "cuda"
    compat.set_side_effects_under_checkpoint(True)  # as torchtitan's apply_compile
    with torch.device("meta" if kind != "floor" else device):
        model = llama.Llama(cfg.with_(checkpoint_blocks=False))
    for i, block in enumerate(model.layers):
        model.layers[i] = selective_ac(block)
        if kind != "ours_eager" and kind != "fsdp2_eager":
            model.layers[i].compile(fullgraph=True)
    if kind == "floor":
        model.init_weights()
        model.to(torch.bfloat16 if cuda else torch.float32)
        return model, model, floor_optimizer(model, device, world)
    fully_shard, mp = sharding_api(kind, cuda)
    shard_like_torchtitan(fully_shard, model, model.tok_embeddings, list(model.layers), model.norm, model.output,
                          mp_policy=mp)
    model.to_empty(device=device)
    model.init_weights()
    return model, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)


def titan_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    from examples.torchtitan_pattern import chunked_loss

    return chunked_loss(model.output, model(tokens, skip_head=True), torch.roll(tokens, -1, dims=1), chunks=8)
