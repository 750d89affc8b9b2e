"""The GPT of the examples and benchmarks: the numerics checker's default model,
which lives in the package (compiled_fsdp/tools/models.py)."""
from compiled_fsdp.tools.models import GPT, MLP, Attention, Block, GPTConfig, batch, bench, loss_fn, tiny, tiny_tied

__all__ = ["GPT", "Attention", "Block", "GPTConfig", "MLP", "batch", "bench", "loss_fn", "tiny", "tiny_tied"]
