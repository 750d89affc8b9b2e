"""Variants of a block's compile region: a block traced again although it
equals one traced before warns, naming it.

[Note: A region traced again for an equal block]
Dynamo reuses a region's trace for a block only if every guard of the first
trace holds on that block. Blocks of one class in other shapes or settings
are traced again, a variant each, as they must be. But a forward that reads
something else that differs between blocks (a Python attribute such as a
layer index, a global) fails a guard on every block, and each block is then
traced and compiled on its own: the first step grows with depth again, and
nothing said so (``compat.nested_compile_region`` lifts torch's cap of 8
variants, whose error was the only sign). So each time Dynamo traces a
variant (``variant_traced``, through ``comptime`` in the region's body),
the block it is traced for is recorded for its class by its parameters'
shapes, its settings (``region_key``) and its tensor inputs' shapes, dtypes
and whether they require grad, per compile attempt since the root's step
began; a block equal to one traced before warns, once per class, naming the
block. (The same holds where a forward's side effect makes Dynamo refuse to
reuse the trace: transformers' decoder layers update the KV cache under
use_cache=True, and the warning names that too.) (A first block whose
input requires no gradient, where the others'
do, is a variant of its own, as it must be: its backward differs. Recorded
without its inputs, it warned for the second block.) Torch 2.11 traces
every call of a region and keeps one subgraph for equal graphs: there is
no reuse to fail, and no warning. (Its first find was our own: the last
block's token, ``issue_ahead`` in region_reads.py.) Tested by
tests/test_region_variants.py::test_a_region_traced_again_for_an_equal_block_warns
and, for no retrace, tests/test_block_regions.py::test_identical_blocks_compile_once
and tests/test_region_variants.py::test_a_region_block_with_hooks_of_its_users.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from compiled_fsdp.compile import install
from compiled_fsdp.core import compat

__all__ = ["constant", "described", "variant_traced"]

_RETRACED = (
    "compiled_fsdp: Dynamo traced the compile region of {cls!r} again for {block}, whose parameters and FSDP "
    "settings and inputs equal those of a block of that class traced before in this compile: something else "
    "its forward reads differs between the blocks (a Python attribute such as a layer index, a global), or "
    "its forward has a side effect Dynamo does not replay (it updates an object: transformers' KV cache "
    "under use_cache=True). So Dynamo traces each such block on its own (and compiles it on its own where "
    "the traces differ), and the first step grows with the model's depth. TORCH_LOGS=hierarchical_compile "
    "names the guard that failed, or why the trace was not eligible for reuse; make that value the same for "
    "every block or pass it in as a tensor, or leave the side effect out of training (use_cache=False).")


def described(values: Any) -> tuple:
    """Each tensor among ``values`` as a variant tells it apart: its shape,
    dtype and whether it requires grad (traced in a region's body, or run
    at trace time)."""
    return tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in values if isinstance(a, torch.Tensor))


def constant(ctx: Any, name: str) -> Any:
    """At trace time: the traced local ``name``'s value where it is a
    constant (None where it is not: a symbolic shape)."""
    try:
        return ctx.get_local(name).as_python_constant()
    except Exception:  # (NotImplementedError, or Dynamo's own for a symbolic value)
        return None


def variant_traced(cls: type, inputs: Any) -> None:
    """At trace time: Dynamo traces a variant of ``cls``'s region for
    tensor inputs ``inputs`` (see the note above). Not on torch 2.11, which
    traces every call."""
    if not compat.region_traces_reused():
        return
    calling = install.SESSION.regions.calling_now()
    entry = calling() if calling is not None else None
    if entry is None:
        return
    if install.SESSION.region_variant(cls, (entry.region_key, described(entry.region_shards), inputs)) \
            and cls not in install.SESSION.retraced_regions:
        install.SESSION.retraced_regions.add(cls)
        name = getattr(cls, "_fsdp_base_class", cls).__name__
        warnings.warn(_RETRACED.format(cls=name, block=entry.group.label), stacklevel=2)
