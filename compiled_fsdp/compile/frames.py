"""Graph breaks: which fully sharded modules run compiled, which fall back to the
eager hook runtime, and why.

[Note: Fallback decision rule]
Dynamo decides, not us, where a graph ends; the rule follows from where the
module's hooks run (see [Note: Hooks under Dynamo] in runtime/state.py):

- A module whose call Dynamo inlines into a graph (hooks traced to nothing) is
  **compiled**: its parameter reads emit markers, lowered to one bucketed
  all-gather per unit of the graph (see [Note: Units] in passes/units.py), its
  gradients to one reduce-scatter per unit.
- A non-root module whose hooks run as Python inside a compiled call was called
  from Python because Dynamo broke the graph somewhere inside it: it **falls
  back**. The eager runtime gathers it once (bucketed, prefetched), the compiled
  fragments of its forward read the gathered tensors as plain graph inputs (no
  marker, so never a second gather), and its gradients are reduce-scattered once
  by the runtime's post-backward.
- The root's hooks always run as Python under ``torch.compile(model)``, and a
  break anywhere below it splits its forward into several Dynamo frames (the
  frame and its resume functions). Each fragment gathers the root parameters it
  reads (cut into units per fragment) and reduces their gradients, which is exactly
  once per parameter as long as every parameter is read in one fragment only:
  the root stays compiled. A parameter read in two fragments (a tied embedding
  and head with a break between them) would be gathered and reduced twice, so
  then the root falls back. Markers record the frame they are traced in (at
  compile time, via ``comptime``; a trace attempt Dynamo abandoned does not
  count: [Note: Reads of an abandoned trace attempt]), so such a split is known once the first step
  has compiled; from the next step on the root falls back (its fragments are
  recompiled once, since its gathered views are now graph inputs). The first
  step's math is the same: each fragment reduces its own reads' gradients,
  which sum to the parameter's. Under a ``param_dtype`` below the reduce
  dtype it rounds differently: it sums a tied parameter's two gradients
  after the cast, where later steps (and FSDP2) sum them in the
  ``param_dtype`` first (measured: one bf16 ulp of the gradient; RESULTS,
  2026-12-01, thirty-eighth session). The fallback's reduce, in fp32:
  tests/test_hsdp.py::test_replicate_buckets_in_a_root_that_falls_back.

A break between modules in a parent's forward leaves the children compiled:
each child is inlined whole into one fragment.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch
from torch._dynamo.callback import CallbackArgs, callback_handler

from compiled_fsdp.compile import install
from compiled_fsdp.core import compat, registry
from compiled_fsdp.runtime.divergence import set_compiling, stable_code
from compiled_fsdp.runtime.param_group import FSDPParamGroup

__all__ = ["arm", "ensure_window", "is_split", "record_bucket_trace", "record_marker_trace",
           "traced_reads", "was_traced"]

# (What this module records lives on install.SESSION.)


def record_marker_trace(key: int, param_index: int, split_key: Optional[Hashable] = None) -> None:
    """Called at Dynamo trace time (through ``comptime``) when a marker is emitted.
    ``split_key``: what the frames are recorded under, when not ``key`` (a block
    compiled as its own frame: see [Note: Blocks compiled on their own] in
    entry.py). Recorded once the compile ends, if its trace attempt was the
    last ([Note: Reads of an abandoned trace attempt])."""
    traced = _this_attempt()
    if traced is None:
        install.SESSION.record_trace(key, param_index, -1, split_key)
        return
    traced.markers.append((key, param_index))
    traced.reads.append((key, param_index, split_key))


def traced_reads(key: Hashable) -> set[int]:
    """The parameter indices some traced frame read, recorded under ``key``."""
    return set(install.SESSION.traced_frames.get(key, ()))


def was_traced(key: Hashable) -> bool:
    """Whether any graph read a parameter recorded under ``key``."""
    return key in install.SESSION.traced_frames


# [Note: Reads of an abandoned trace attempt]
# Dynamo may trace a frame more than once: a graph break inside a function
# it inlined restarts the analysis, and the next attempt stops at that
# function's call. What the abandoned attempt traced is in no graph. A
# decorated ``forward`` (transformers wraps every model's) is such a call:
# with a break anywhere below it, the wrapper's frame traced the whole
# forward, every root parameter read, then gave up; so did the next
# wrapper's; only the forward's own frame compiled them. Recorded at trace
# time, those reads made each root parameter "read in more than one Dynamo
# frame", and the root fell back for nothing (GPT-2, whose loss breaks the
# graph: its embedding and head gathered eagerly every step). So what a
# compile traced is kept per attempt (``install.TracedAttempt``) and taken
# when no compile is under way any more (Dynamo's end callback), from a
# compile's last attempt only; the same holds for the markers [Note:
# Agreeing on collectives] checks. Tested by
# tests/test_hf_models.py::test_gpt2_break_in_its_loss_keeps_the_root_compiled (the root
# stays compiled) and tests/test_graph_breaks.py (a real split still falls back).
def _this_attempt() -> Optional[install.TracedAttempt]:
    """What the compile under way traced in its current attempt (None outside one)."""
    context = torch._guards.CompileContext.try_get()
    if context is None or context.compile_id is None:
        return None
    key = str(context.compile_id)
    traced = install.SESSION.compile_markers.get(key)
    if traced is None or traced.attempt != context.attempt:  # (Dynamo restarted the analysis)
        traced = install.SESSION.compile_markers[key] = install.TracedAttempt(
            context, context.attempt, context.compile_id.frame_id)
    return traced


def record_bucket_trace(key: int) -> None:
    """Called at trace time (through ``comptime``) where a graph communicates
    for a whole bucket of module ``key`` without reading its parameters in
    this frame: a block's graph issuing the next block's gather ([Note:
    Gathers handed to the next block's graph] in entry.py), or the outer
    graph calling a block's compile region (whose reads are traced once for
    every block: [Note: Blocks as compile regions] in regions.py). Part of
    the graph's collectives for [Note: Agreeing on collectives] (as a read of
    the whole bucket, index -1), not a read of its parameters in this frame."""
    traced = _this_attempt()
    if traced is not None:
        traced.markers.append((key, -1))


def arm() -> None:
    """Register the compile callbacks with Dynamo unless they are (again
    after ``torch._dynamo.reset()``, which clears every registration). Called
    by ``fully_shard`` and at each root forward, before Dynamo compiles it."""
    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_compile_end)


def ensure_window() -> None:
    """Called while Dynamo traces a marker: a compile that started with the
    callbacks unregistered (a reset since the last root forward) opens its
    window now, and closes it at its end like any other."""
    if not install.SESSION.dynamo_compiling:
        arm()
        _on_compile_start(None)


def _on_compile_start(args: Optional[CallbackArgs]) -> None:
    """Dynamo's compile-start callback: peers waiting at a check wait on, and
    the passes are installed for this compile."""
    with install.SESSION.dynamo_lock:
        if not install.SESSION.dynamo_compiling:
            install.SESSION.dynamo_compiling = True
            install.open_window()
    set_compiling(True)


def _on_compile_end(args: CallbackArgs) -> None:
    """Dynamo's compile-end callback (no compile under way any more): what
    the compiles traced is recorded ([Note: Reads of an abandoned trace
    attempt]), and a frame that reads sharded parameters in an order no
    earlier graph did is checked against the other ranks before it runs. See
    [Note: Agreeing on collectives] in runtime/divergence.py."""
    try:
        with install.SESSION.dynamo_lock:
            if install.SESSION.dynamo_compiling:
                install.SESSION.dynamo_compiling = False
                install.close_window()
        ended = install.SESSION.end_compiles()
        for traced in ended.values():
            for key, index, split_key in traced.reads:
                install.SESSION.record_trace(key, index, traced.frame, split_key)
        _check_new_graph(ended.get(str(args.compile_id)))
    except BaseException:
        compat.end_callback_raised()
        raise


def _check_new_graph(traced: Optional[install.TracedAttempt]) -> None:
    """(Another thread's compile that ended before this one is not checked:
    its rank's checker runs in its own thread.)"""
    set_compiling(False)
    seq = traced.markers if traced is not None else []
    if not seq or compat.caching_precompile_on():  # ([Note: Agreeing on collectives]: GRAPH)
        return
    groups = [registry.owner_of(key) for key, _ in seq]
    first = groups[0]
    if not isinstance(first, FSDPParamGroup) or first.checker is None:
        return
    names = ["?" if g is None else g.label for g in groups]
    modules = [name for i, name in enumerate(names) if i == 0 or names[i - 1] != name]
    code = stable_code(tuple((None if g is None else g.identity, index) for g, (_, index) in zip(groups, seq)))
    first.checker.check_graph(code, "a new compiled graph reading " + ", ".join(modules))


def is_split(key: Hashable) -> bool:
    """Whether some parameter of the group was read in more than one Dynamo frame."""
    return any(len(frames) > 1 for frames in install.SESSION.traced_frames.get(key, {}).values())
