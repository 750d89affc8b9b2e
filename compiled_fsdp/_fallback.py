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

import torch

# group key -> param index -> ids of the Dynamo frames whose graphs read it.
_TRACED_FRAMES: dict[int, dict[int, set[int]]] = {}


def record_marker_trace(key: int, param_index: int) -> None:
    """Called at Dynamo trace time (through ``comptime``) when a marker is emitted."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    frame = compile_id.frame_id if compile_id is not None else -1
    _TRACED_FRAMES.setdefault(key, {}).setdefault(param_index, set()).add(frame)


def is_split(key: int) -> bool:
    """Whether some parameter of the group was read in more than one Dynamo frame."""
    return any(len(frames) > 1 for frames in _TRACED_FRAMES.get(key, {}).values())
