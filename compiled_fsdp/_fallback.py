"""Graph breaks: which fully sharded modules run compiled, which fall back to the
eager hook runtime, and why.

[Note: Fallback decision rule]
Dynamo decides, not us, where a graph ends; the rule follows from where the
module's hooks run (see [Note: Hooks under Dynamo] in _state.py):

- A module whose call Dynamo inlines into a graph (hooks traced to nothing) is
  **compiled**: its parameter reads emit markers, lowered to one bucketed
  all-gather per graph, its gradients to one reduce-scatter.
- A non-root module whose hooks run as Python inside a compiled call was called
  from Python because Dynamo broke the graph somewhere inside it: it **falls
  back**. The eager runtime gathers it once (bucketed, prefetched), the compiled
  fragments of its forward read the gathered tensors as plain graph inputs (no
  marker, so never a second gather), and its gradients are reduce-scattered once
  by the runtime's post-backward.
- The root's hooks always run as Python under ``torch.compile(model)``, and a
  break anywhere below it splits its forward into several Dynamo frames (the
  frame and its resume functions). Each fragment gathers the root parameters it
  reads (one bucket per fragment) and reduces their gradients, which is exactly
  once per parameter as long as every parameter is read in one fragment only:
  the root stays compiled. A parameter read in two fragments (a tied embedding
  and head with a break between them) would be gathered and reduced twice, so
  then the root falls back. Markers record the frame they are traced in (at
  compile time, via ``comptime``), so such a split is known once the first step
  has compiled; from the next step on the root falls back (its fragments are
  recompiled once, since its gathered views are now graph inputs). The first
  step is numerically exact either way.

A break between modules in a parent's forward leaves the children compiled:
each child is inlined whole into one fragment.
"""
from __future__ import annotations

from typing import Any

import torch

from ._divergence import set_compiling, stable_code

# group key -> param index -> ids of the Dynamo frames whose graphs read it.
_TRACED_FRAMES: dict[int, dict[int, set[int]]] = {}
# Compile id -> (trace attempt, the markers traced in it, in order), until the
# compile ends: see ``on_compile_end``.
_COMPILE_MARKERS: dict[str, tuple[int, list[tuple[int, int]]]] = {}


def record_marker_trace(key: int, param_index: int) -> None:
    """Called at Dynamo trace time (through ``comptime``) when a marker is emitted."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    frame = compile_id.frame_id if compile_id is not None else -1
    _TRACED_FRAMES.setdefault(key, {}).setdefault(param_index, set()).add(frame)
    trace = torch._guards.CompileContext.current_trace_id()
    if compile_id is not None and trace is not None:
        attempt, seq = _COMPILE_MARKERS.get(str(compile_id), (trace.attempt, []))
        if trace.attempt != attempt:  # Dynamo restarted the analysis: keep the last attempt's
            seq = []
        seq.append((key, param_index))
        _COMPILE_MARKERS[str(compile_id)] = (trace.attempt, seq)


def on_compile_start(args: Any) -> None:
    """Dynamo's compile-start callback: peers waiting at a check wait on."""
    set_compiling(True)


def on_compile_end(args: Any) -> None:
    """Dynamo's compile-end callback: a frame that reads sharded parameters in
    an order no earlier graph did is checked against the other ranks before it
    runs. See [Note: Agreeing on collectives] in _divergence.py."""
    set_compiling(False)
    _, seq = _COMPILE_MARKERS.pop(str(args.compile_id), (0, []))
    if not seq:
        return
    from ._param_group import _GROUPS

    group = _GROUPS.get(seq[0][0])
    if group is None or group.checker is None:
        return
    names: list[str] = []
    for key, _ in seq:
        other = _GROUPS.get(key)
        name = "?" if other is None else other.fqn or "<root>"
        if not names or names[-1] != name:
            names.append(name)
    group.checker.check_graph(stable_code(tuple(seq)), "a new compiled graph reading " + ", ".join(names))


def is_split(key: int) -> bool:
    """Whether some parameter of the group was read in more than one Dynamo frame."""
    return any(len(frames) > 1 for frames in _TRACED_FRAMES.get(key, {}).values())
