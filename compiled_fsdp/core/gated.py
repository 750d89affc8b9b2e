"""Collectives a handed-over gather may skip at run time.

[Note: A stand-in for the last block's next]
A block compiled on its own issues the next block's gather from its graph
([Note: Gathers handed to the next block's graph] in compile/entry.py). The
last block has no next block; traced without the gather, its graph would be a
second variant that Dynamo compiles again (guarding ``handoff_next``), which
doubled the first step in torchtitan's pattern (benchmarks/RESULTS.md, "Where
the per-block first step goes"). So the last block hands its gather to a
*stand-in* instead: a copy of its own group whose parameters are detached
aliases of its own shards (same shapes, dtypes, placements and
``requires_grad``), so that Dynamo's guards pass and every block of the same
structure runs one graph. What differs is a tensor, not a guard: the
handoff's ``live`` flag (a 0-d bool on the CPU), false for a stand-in.

A forward recomputed in backward (activation checkpointing around a block
compiled on its own) hands its gather to whom the forward did
(``CompiledEntry.forward_handoff``): the recompute's saved tensors replace
the forward's, a stand-in's ``live`` flag and shards among them, and a
recompute that handed to another module made the backward reduce for the
wrong one (tests/test_fsdp2_api.py::test_nested_modules_compiled_in_place).

The handoff's collectives are lowered to the ops below, which take the
arguments of the ``_c10d_functional`` op they stand for and ``live`` last
(the passes read both kinds through ``passes/cost_model.py``'s
``collective_group`` and ``collective_world``).
With ``live`` true each runs its collective, not waited; with it false it
communicates nothing and returns an unspecified tensor of the right shape,
which only the stand-in's own leaves receive (its gather is read by no
graph; its reduce gives the stand-in's aliases a gradient nobody reads).
``wait_tensor`` on such a tensor returns at once (no work is registered for
it). The passes schedule and price them as the collectives they stand for:
the graph is the one the blocks whose handoff is live run. What a stand-in
still costs per step: its bucket's pack in the forward, and in the backward
the cast and pack of a zero gradient of the bucket's size (AOTAutograd's
tangent for an output nothing used). Tested by
tests/test_block_compile.py (one graph for every block, under aot_eager and
Inductor, and per step n - 1 handoff gathers and reduces run for n blocks:
the stand-in's are skipped), tests/test_handoff_fx.py (the lowering passes
``live`` to both collectives) and tests/test_no_sync.py (accumulation without
sync: one graph per flag value, the last block's included).
"""
from __future__ import annotations

import torch

from compiled_fsdp.core import comm, compat

__all__ = ["all_gather_if", "all_reduce_if", "all_to_all_single_if", "reduce_scatter_if"]

_c10d = torch.ops._c10d_functional
_TAGS = compat.cudagraph_unsafe_tags()  # (a replay would skip the choice)


@torch.library.custom_op("compiled_fsdp::all_gather_if", mutates_args=(), tags=_TAGS)
def all_gather_if(inp: torch.Tensor, group_size: int, group_name: str, live: torch.Tensor) -> torch.Tensor:
    """``all_gather_into_tensor`` if ``live``, not waited ([Note: All-gathers
    on gloo] in comm.py: on gloo, the eager collective)."""
    if bool(live):
        return comm.all_gather_unwaited(inp, group_size, group_name)
    return inp.new_empty([group_size * inp.shape[0], *inp.shape[1:]])


@all_gather_if.register_fake
def _(inp: torch.Tensor, group_size: int, group_name: str, live: torch.Tensor) -> torch.Tensor:
    return inp.new_empty([group_size * inp.shape[0], *inp.shape[1:]])


@torch.library.custom_op("compiled_fsdp::reduce_scatter_if", mutates_args=(), tags=_TAGS)
def reduce_scatter_if(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str,
                      live: torch.Tensor) -> torch.Tensor:
    """``reduce_scatter_tensor`` if ``live``, not waited."""
    if bool(live):
        return _c10d.reduce_scatter_tensor(inp, reduce_op, group_size, group_name)
    return inp.new_zeros([inp.shape[0] // group_size, *inp.shape[1:]])


@reduce_scatter_if.register_fake
def _(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str, live: torch.Tensor) -> torch.Tensor:
    return inp.new_empty([inp.shape[0] // group_size, *inp.shape[1:]])


@torch.library.custom_op("compiled_fsdp::all_to_all_single_if", mutates_args=(), tags=_TAGS)
def all_to_all_single_if(inp: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                         group_name: str, live: torch.Tensor) -> torch.Tensor:
    """``all_to_all_single`` if ``live``, not waited."""
    if bool(live):
        return _c10d.all_to_all_single(inp, output_split_sizes, input_split_sizes, group_name)
    return inp.new_zeros([sum(output_split_sizes), *inp.shape[1:]])


@all_to_all_single_if.register_fake
def _(inp: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group_name: str,
      live: torch.Tensor) -> torch.Tensor:
    return inp.new_empty([sum(output_split_sizes), *inp.shape[1:]])


@torch.library.custom_op("compiled_fsdp::all_reduce_if", mutates_args=(), tags=_TAGS)
def all_reduce_if(inp: torch.Tensor, reduce_op: str, group_name: str, live: torch.Tensor) -> torch.Tensor:
    """``all_reduce`` if ``live``, not waited."""
    if bool(live):
        return _c10d.all_reduce(inp, reduce_op, group_name)
    return inp.clone()


@all_reduce_if.register_fake
def _(inp: torch.Tensor, reduce_op: str, group_name: str, live: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(inp)
