"""Per-rank, per-graph dumps of what torch.compile and our passes did.

[Note: Dump hooks]
Every artifact comes from a supported torch 2.13 hook; nothing in torch is
patched:

* ``torch._logging`` structured trace: the logger ``torch.__trace`` emits a
  record per compile artifact (``dynamo_output_graph``, ``aot_forward_graph``,
  ``aot_backward_graph``, ``aot_inference_graph``, ``inductor_output_code``,
  ``dynamo_graph_break_reason``) with its compile id, but only while it has a
  handler (``trace_structured`` checks ``trace_log.handlers``). We add a
  handler for the dump's lifetime; ``TORCH_TRACE`` keeps working beside it.
  Under ``aot_eager`` there is no Inductor output code, and the index says so.
* ``compiled_fsdp.compile.install.add_observer``: the joint graph before and after
  each of our passes, with each pass's report.
* ``torch._dynamo.convert_frame.register_bytecode_hook``: the bytecode Dynamo
  generated for a frame, decompiled with ``depyf.decompile``. depyf 0.20 fails
  on some resume functions on torch 2.13 (``DecompilationError``, opcode
  ``SWAP``); any failure is recorded in the index, never raised.
* ``torch._dynamo.callback_handler`` end callbacks: rewrite the index after
  each compile.

``COMPILED_FSDP_DUMP=<dir>`` starts a session at the first ``fully_shard``
(nothing is registered at import).

[Note: Dumps survive a reset]
``torch._dynamo.reset()`` clears every ``callback_handler`` registration and
restarts Dynamo's frame counter, so compile ids repeat. The session notices at
the next structured-trace record (its trace handler and bytecode hook are not
touched by a reset): it registers its end callback again and, if it has
recorded graphs already, starts a new generation, whose graph folders are
prefixed ``r<n>_`` so they never overwrite the graphs from before the reset.
Tested by tests/test_debug_dump.py.

The compile id (``CompileContext.current_compile_id()``, ``"frame/compile"``)
ties the artifacts of one graph together. AOTAutograd's cache would skip the
joint pass on a hit (see [Note: AOTAutograd cache] in ``compile/install.py``) and
Inductor's FX-graph cache the post-grad scheduling pass, so a dump turns
``torch._functorch.config.enable_autograd_cache`` and
``torch._inductor.config.fx_graph_cache`` off and restores them when the dump
ends. Nothing else changes: numerics are unaffected.

[Note: A dump never breaks training]
Every hook body runs under ``_guard``: an exception is recorded in the graph's
``failures`` (shown in the index) and swallowed.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import traceback
from collections.abc import Iterator
from types import CodeType
from typing import Any, Optional

import torch.distributed as dist
import torch.fx as fx
from torch._dynamo import callback_handler
from torch._dynamo.convert_frame import register_bytecode_hook
from torch._functorch import config as functorch_config
from torch._guards import CompileContext
from torch._inductor import config as inductor_config
from torch._logging._internal import trace_log

from compiled_fsdp.compile import install
from compiled_fsdp.passes.graph import region_calls
from compiled_fsdp.tools.debug_render import (
    GraphRecord,
    count_region_calls,
    graph_stats,
    module_names,
    render_graph,
    write_index,
    write_readme,
)
from compiled_fsdp.tools.debug_timeline import chrome_trace, timeline_slices

__all__ = ["DUMP_ENV", "DumpSession", "dump_graphs"]

DUMP_ENV = "COMPILED_FSDP_DUMP"

# What the bytecode file says where the optional depyf is not installed.
_NO_DEPYF = ("# depyf is not installed, so the bytecode Dynamo generated is not decompiled here.\n"
             "# Install it to get this file: pip install depyf  (or: pip install 'compiled_fsdp[debug]')\n")

# structured-trace event -> (file name, what it is)
_TRACE_FILES = {
    "dynamo_output_graph": ("01_dynamo_graph.py", "the FX graph Dynamo traced from Python (markers not yet lowered)"),
    "aot_forward_graph": ("20_forward.py", "the forward graph after partitioning (what runs in forward)"),
    "aot_backward_graph": ("21_backward.py", "the backward graph after partitioning (what runs in backward)"),
    "aot_inference_graph": ("20_inference.py", "the inference graph (no backward: markers run eagerly)"),
}


class _TraceHandler(logging.Handler):
    def __init__(self, session: "DumpSession") -> None:
        super().__init__(logging.DEBUG)
        self.session = session

    def emit(self, record: logging.LogRecord) -> None:
        self.session._on_trace(getattr(record, "metadata", {}), getattr(record, "payload", None))


class DumpSession:
    """Writes ``<root>/rank<r>/graph_<frame>_<compile>/...`` and ``rank<r>/index.md``
    while started. See [Note: Dump hooks]."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.graphs: dict[str, GraphRecord] = {}
        self._lock = threading.RLock()
        self._handler = _TraceHandler(self)
        self._hook_handle: Any = None
        self._saved_caches: Optional[tuple[bool, bool]] = None
        self.active = False
        self.from_env = False  # started by COMPILED_FSDP_DUMP (start_from_env)
        self._generation = 0  # resets seen; see [Note: Dumps survive a reset]

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        self._saved_caches = (functorch_config.enable_autograd_cache, inductor_config.fx_graph_cache)
        functorch_config.enable_autograd_cache = False
        inductor_config.fx_graph_cache = False
        trace_log.addHandler(self._handler)
        self._hook_handle = register_bytecode_hook(self._on_bytecode)
        install.add_observer(self._on_pass)
        callback_handler.register_end_callback(self._on_compile_end)
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._on_compile_end in callback_handler.end_callbacks:  # (gone after a reset)
            callback_handler.remove_end_callback(self._on_compile_end)
        install.remove_observer(self._on_pass)
        self._hook_handle.remove()
        trace_log.removeHandler(self._handler)
        assert self._saved_caches is not None
        functorch_config.enable_autograd_cache, inductor_config.fx_graph_cache = self._saved_caches
        self.flush()

    def flush(self) -> None:
        """(Re)write the index of this rank."""
        with self._guard(None):
            with self._lock:
                write_readme(self.root)
                write_index(self.rank_dir(), self.rank(), list(self.graphs.values()))

    # -- places ------------------------------------------------------------
    @staticmethod
    def rank() -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return int(os.environ.get("RANK", "0"))

    def rank_dir(self) -> str:
        return os.path.join(self.root, f"rank{self.rank()}")

    def _graph(self, compile_id: Optional[str]) -> GraphRecord:
        cid = compile_id or "unknown"
        if self._generation:
            cid = f"r{self._generation}:{cid}"
        rec = self.graphs.get(cid)
        if rec is None:
            folder = "graph_" + cid.replace("/", "_").replace(":", "_")
            rec = self.graphs[cid] = GraphRecord(cid, os.path.join(self.rank_dir(), folder))
        return rec

    def _rearm(self) -> None:
        """See [Note: Dumps survive a reset]."""
        if self.active and self._on_compile_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_compile_end)
            if self.graphs:  # compile ids from here on may repeat earlier ones
                self._generation += 1

    @contextlib.contextmanager
    def _guard(self, rec: Optional[GraphRecord], what: str = "dump") -> Iterator[None]:
        """See [Note: A dump never breaks training]."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            msg = f"{what}: {type(e).__module__}.{type(e).__name__}: {e}".splitlines()[0]
            if rec is not None:
                rec.failures.append(msg)
            else:
                logging.getLogger(__name__).warning("compiled_fsdp dump failed: %s\n%s", msg, traceback.format_exc())

    def _write(self, rec: GraphRecord, name: str, what: str, text: str) -> None:
        os.makedirs(rec.dir, exist_ok=True)
        with open(os.path.join(rec.dir, name), "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        rec.files[name] = what

    # -- hooks -------------------------------------------------------------
    def _on_trace(self, metadata: dict[str, Any], payload: Optional[str]) -> None:
        with self._lock:
            self._rearm()
        if not metadata:
            return
        event = next(iter(metadata))
        detail = metadata[event] if isinstance(metadata[event], dict) else {}
        if event == "artifact":
            event = detail.get("name", "")
        if event not in _TRACE_FILES and event not in ("inductor_output_code", "dynamo_graph_break_reason"):
            return
        frame, comp = metadata.get("frame_id"), metadata.get("frame_compile_id")
        cid = f"{frame}/{comp}" if frame is not None else None
        with self._lock:
            rec = self._graph(cid)
            with self._guard(rec, event):
                if event == "dynamo_graph_break_reason":
                    rec.graph_breaks.append((payload or "").strip())
                    self._write(rec, "00_graph_breaks.txt", "why Dynamo split the code here (graph breaks)",
                                "\n\n".join(rec.graph_breaks))
                elif event == "inductor_output_code":
                    # forward is compiled first, then backward
                    part = ("forward", "backward", "extra")[min(rec.inductor_outputs, 2)]
                    rec.inductor_outputs += 1
                    self._write(rec, f"3{rec.inductor_outputs - 1}_inductor_{part}.py",
                                f"Inductor's generated Python/C++ for the {part} graph", payload or "")
                else:
                    name, what = _TRACE_FILES[event]
                    self._write(rec, name, what, render_graph(what, rec, self.rank(), payload or ""))
                    if event == "dynamo_output_graph":
                        rec.dynamo_graphs += 1

    def _on_bytecode(self, code: CodeType, new_code: CodeType) -> None:
        with self._lock:
            rec = self._graph(str(CompileContext.current_compile_id()))
            rec.frame = f"{getattr(code, 'co_qualname', code.co_name)} " \
                        f"({code.co_filename}:{code.co_firstlineno})"
            with self._guard(rec, "depyf.decompile"):
                what = ("the Python bytecode Dynamo generated for the frame, decompiled by depyf "
                        "(calls the compiled graph, then resume functions after graph breaks)")
                try:
                    import depyf  # optional and heavy: imported only once a dump is asked for
                except ImportError:
                    self._write(rec, "02_bytecode_decompiled.py", what, _NO_DEPYF)
                    return None
                self._write(rec, "02_bytecode_decompiled.py", what, depyf.decompile(new_code))
        return None

    def _on_pass(self, stage: str, gm: fx.GraphModule, report: Optional[Any], region: bool = False) -> None:
        with self._lock:
            rec = self._graph(str(CompileContext.current_compile_id()))
            with self._guard(rec, f"graph {stage}"):
                # The scheduling pass and a region's partitioner say which graph it is.
                kind = report.graph if stage in ("schedule", "partition") else _graph_kind(gm)
                found = _graph_of(rec, stage, kind, gm, region)
                if found is None:
                    return
                rec = found
                names = module_names(rec.region)
                rec.stages.append(stage)
                idx = 10 + len(rec.stages) - 1
                if stage == "before":
                    fname = f"{idx}_joint_before_passes.py"
                    what = "the joint forward+backward graph AOTAutograd built, before our passes"
                elif stage == "partition":
                    fname = f"{idx}_{kind}_after_partition.py"
                    what = f"the region's {kind} graph as its partitioner returned it (what runs in {kind})"
                else:
                    fname, what = f"{idx}_{kind}_after_{stage}.py", f"the {kind} graph after our '{stage}' pass"
                    rec.pass_reports.append((f"{stage} ({kind})", report))
                body = gm.print_readable(print_output=False, include_stride=False, include_device=False)
                self._write(rec, fname, what, render_graph(what, rec, self.rank(), body))
                if kind == "joint":  # see [Note: Predicted timeline]: from the joint graph
                    rec.stats = graph_stats(gm, names)
                    if not region:
                        count_region_calls(rec, gm)
                    trace = chrome_trace(timeline_slices(gm, names),
                                         f"rank {self.rank()} graph {rec.compile_id} (predicted)", pid=self.rank())
                    self._write(rec, "40_timeline.json",
                                "predicted timeline (Chrome trace: open in https://ui.perfetto.dev)",
                                json.dumps(trace, indent=0))

    def _on_compile_end(self, args: Any) -> None:
        self.flush()


# [Note: A region's graphs in a dump]
# A whole-model compile with compile regions ([Note: Blocks as compile
# regions] in compile/regions.py) compiles, in one compile id, the root's
# graph and each region's body. A region's partitioner shows the observers
# its joint graph (``region`` True, before and after each pass), then its
# forward and backward graphs as it returns them (stage ``"partition"``).
# Each region's files go to ``region_<k>/`` of the root's folder (k: the
# order the partitioner ran, which is torch's, not the model's), with its own
# predicted timeline and reports. The root's joint graph names each region's
# forward by its subgraph: the index says how many times the root calls it
# (``count_region_calls``, by the forward graph object the partitioner
# returned). Inductor's post-grad pass shows a region's graph only where it
# holds a collective the scheduler places (rarely: a gradient also used
# elsewhere); which region such a graph belongs to cannot be told from it, so
# the dump leaves it out (a graph calling no region, in a compile that has
# regions) rather than file it under the wrong one.
# Tested by tests/test_debug_dump.py::test_dump_of_compile_regions and
# test_graphs_of_compile_regions_find_their_region.


def _graph_of(rec: GraphRecord, stage: str, kind: str, gm: fx.GraphModule, region: bool) -> Optional[GraphRecord]:
    """The record a graph the passes ran on belongs to: ``rec`` (the
    compile's), one of its regions', or None (left out; the note above)."""
    if region:
        if stage == "before" or not rec.regions:
            k = len(rec.regions)
            rec.regions.append(GraphRecord(f"{rec.compile_id} region {k}", os.path.join(rec.dir, f"region_{k}"),
                                           region=True))
        if stage == "partition" and kind == "forward":
            rec.region_forwards[id(gm)] = rec.regions[-1]
        return rec.regions[-1]
    if stage == "schedule" and rec.regions and not region_calls(gm.graph):
        return None
    return rec


def _graph_kind(gm: fx.GraphModule) -> str:
    """For the graphs the lowering and recompute passes see: joint (it has
    tangent inputs) or forward (an inference graph, lowered by the post-grad
    pass). A partitioned backward graph has tangents too, so the scheduling
    pass's graphs are named from its report instead."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return "joint" if any(n.startswith("tangents") for n in names) else "forward"


@contextlib.contextmanager
def dump_graphs(directory: str) -> Iterator[DumpSession]:
    """Dump every graph compiled inside the ``with`` block (per rank, per graph)
    under ``directory``; see README "Debug dumps". Configuration it changes is
    restored on exit."""
    session = DumpSession(directory)
    session.start()
    try:
        yield session
    finally:
        session.stop()


def start_from_env() -> None:
    """``COMPILED_FSDP_DUMP=<dir>`` dumps the rest of the process; called by
    ``fully_shard`` (idempotent)."""
    root = os.environ.get(DUMP_ENV)
    if not root or any(isinstance(s, DumpSession) and s.from_env for s in install.observer_owners()):
        return
    session = DumpSession(root)
    session.from_env = True  # (held by its observer, on install.SESSION)
    session.start()
