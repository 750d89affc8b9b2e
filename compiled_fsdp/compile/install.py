"""Installs the compiled_fsdp graph passes into torch.compile, for as long as a
compile needs them, and keeps what they report.

[Note: Where the passes hook in]
``torch._functorch.config.joint_custom_pass`` is called by AOTAutograd on
the joint (forward + backward) graph before partitioning, for every
aot_autograd backend: ``aot_eager`` and Inductor alike. It is the one hook
that sees both the gathers and the reduce-scatters before the partitioner
decides what to save, so lowering and recompute tagging both run there.
Scheduling runs in Inductor's ``post_grad_custom_post_pass``, on the
partitioned graphs ([Note: Scheduling under Inductor]). Ours runs before a
user's joint pass (it removes our markers, which theirs would not
understand) and after a user's post-grad passes; on a graph without markers
ours does nothing.

[Note: Passes installed while compiling]
Both hooks are global torch config. The passes are set there only while a
compile may need them and the previous values are restored after, so a
program that has not called ``fully_shard`` never sees them, and a user's
own passes, read when a window opens (or set inside one), keep running
with ours:

- a Dynamo compile: its start callback opens the window, its end callback
  closes it (frames.py; armed at ``fully_shard`` and at every root forward,
  and by the first marker traced when a ``torch._dynamo.reset()`` cleared
  them since);
- a backward: AOTAutograd compiles a backward graph lazily, at its first
  run, outside any Dynamo compile; the window opens when a compiled graph's
  backward (or the eager runtime's part of one) starts and closes when that
  backward ends (or, if it raised, when the next step starts).

Windows nest (a count); ``installed()`` opens one around any code.

[Note: Inference graphs]
``joint_custom_pass`` is *not* called for inference graphs (a frame traced
under ``torch.no_grad()`` or with no parameter requiring grad): AOTAutograd
compiles them without a joint. Under Inductor the post-grad pass below still
sees them, so it lowers their markers there (one bucketed all-gather per
unit, then scheduling as for a forward graph). Under ``aot_eager`` nothing
after Dynamo sees an inference graph, so its markers run their eager
per-parameter collectives: correct, unbucketed, and counted as
``unbucketed_all_gather`` by ``collective_counts()``.

[Note: AOTAutograd cache]
The AOTAutograd cache key (Inductor only; ``aot_eager`` does not cache) is
computed from the Dynamo graph, which holds the markers, and does not include
``joint_custom_pass`` (torch lists it in ``_save_config_ignore``). On a
cache hit the joint pass does not run at all: the cached artifact already
holds the lowered graph, and no report is recorded for that compile. A
change to the passes would therefore be served stale artifacts. To key the
cache on our code, the scheduling pass's ``uuid()`` hashes the source files
of the passes and of the core they emit (``_source_files``); Inductor puts
that uuid into both the FX-graph and the AOTAutograd cache keys. Tests that
read reports disable the cache (``torch._functorch.config.enable_autograd_cache
= False``) or use a fresh ``TORCHINDUCTOR_CACHE_DIR``.

[Note: Scheduling under Inductor]
``_SchedulePass`` is the scheduling pass: Inductor calls it on the
partitioned forward and backward graphs after its own post-grad passes, and
its uuid also hashes ``passes.config.overlap`` (the knobs change the output).
Inductor keeps the relative order of collectives (its scheduler chains each
to the previous one) but its default ``reorder_for_peak_memory`` moves waits
back next to their collectives; ``pin_order`` turns the schedule into control
dependencies it must respect (see [Note: Inductor reorders for peak memory]
in passes/pin.py). Inductor's opt-in ``reorder_for_compute_comm_overlap``
and overlap scheduling (off by default) import triton and fail on CPU; we
leave them off. Under ``aot_eager`` there is no post-partition hook (see
[Note: Where scheduling runs] in passes/schedule.py): the partitioner's
order runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from compiled_fsdp.compile.region_schema import memoize_region_schemas
from compiled_fsdp.compile.region_tracing import RegionTracing
from compiled_fsdp.compile.reports import Partitioned, Recording, Reports
from compiled_fsdp.core import compat, registry

__all__ = [
    "SESSION", "CompileSession", "Recording", "add_observer", "close_window", "installed", "last_reports",
    "last_schedule_reports", "observer_owners", "open_backward_window", "open_window", "recording",
    "remove_observer", "units_of",
]

_lock = threading.RLock()


def run_joint(gm: fx.GraphModule, region: bool = False) -> None:
    """The joint graph's passes on ``gm``, shown to the observers and reported;
    ``region``: a compile region's body, whose units ``explain()`` does not
    list (it lists the root's graph's) and whose graphs a dump shows apart."""
    from compiled_fsdp.passes import run_joint_passes

    observe = functools.partial(SESSION.reports.notify, region=region) if SESSION.reports.observers else None
    report = run_joint_passes(gm, observe)
    symbolic = [why for (_, _, why) in (report.lowering.skipped if report.lowering else ()) if "symbolic" in why]
    if symbolic:  # ([Note: Static ints under dynamic=True] in core/marker.py)
        warnings.warn(_SYMBOLIC.format(n=len(symbolic), why=symbolic[0]), stacklevel=2)
    if report.has_markers:
        SESSION.reports.add_joint(report, units_for_explain=not region)
        SESSION.reports.add_pipeline(report.pipeline)


def show_partitioned(forward: fx.GraphModule, backward: fx.GraphModule) -> None:
    """A compile region's forward and backward graphs, as its partitioner
    returns them, shown to the observers (the scheduling pass shows only
    graphs holding a collective it places, which a region's rarely do)."""
    if SESSION.reports.observers:
        SESSION.reports.notify("partition", forward, Partitioned("forward"), region=True)
        SESSION.reports.notify("partition", backward, Partitioned("backward"), region=True)


_SYMBOLIC = ("compiled_fsdp: {n} parameter read(s) in this graph are left to one eager collective each, unbucketed: "
             "Dynamo made a size or setting the passes bucket by symbolic ({why}). torch.compile(dynamic=True) "
             "does this to a replicated module's parameters; compile with dynamic=None (automatic dynamic "
             "shapes, the default) to bucket them.")


class _JointPass:
    """The callable set as ``joint_custom_pass`` while a window is open; runs
    the pass that was there before after ours."""

    def __init__(self, inner: Callable[[fx.GraphModule, Any], fx.GraphModule] | None) -> None:
        self.inner = inner

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        run_joint(gm)
        if self.inner is not None:
            gm = self.inner(gm, joint_inputs)
        return gm

    def __repr__(self) -> str:
        return f"compiled_fsdp joint pass (then {self.inner!r})"


def _source_files() -> tuple[str, ...]:
    """What the graphs we emit depend on: the passes, the core they emit from,
    this file, and regions.py (a region's partitioner runs the passes: [Note:
    Blocks as compile regions])."""
    import compiled_fsdp.core as core
    import compiled_fsdp.passes as passes_mod

    dirs = [os.path.dirname(os.path.abspath(m.__file__)) for m in (passes_mod, core)]
    files = [os.path.join(d, f) for d in dirs for f in sorted(os.listdir(d)) if f.endswith(".py")]
    here = os.path.dirname(os.path.abspath(__file__))
    return (os.path.abspath(__file__), os.path.join(here, "regions.py"), *files)


def _record_region_step(gm: fx.GraphModule, report: Any) -> None:
    """For an open ``recording()``: a graph that calls compile regions,
    predicted with the calls expanded, in its scheduled order (the observers
    see it pinned: ``predict_with_regions`` runs each pinned node as its
    op). A prediction never fails a compile: a graph it cannot read is
    left out, with a warning."""
    from compiled_fsdp.passes.graph import is_tangent, region_calls
    from compiled_fsdp.passes.region_step import predict_with_regions

    if not region_calls(gm.graph):
        return
    graph = report.graph if report.graph != "none" else \
        "backward" if any(is_tangent(n) for n in gm.graph.nodes) else "forward"
    try:
        timeline = predict_with_regions(gm)
    except Exception as e:  # noqa: BLE001 (a diagnostic: the training goes on)
        warnings.warn(f"compiled_fsdp: the {graph} graph's predicted step with its compile regions failed "
                      f"({type(e).__name__}: {e}); it is left out of the recording", stacklevel=2)
        return
    SESSION.reports.add_region_step(graph, timeline)


class _SchedulePass(CustomGraphPass):
    """Post-grad pass: schedules the partitioned graphs (see [Note: Scheduling
    under Inductor]); its uuid puts our passes' source and the overlap config
    into Inductor's cache keys (see [Note: AOTAutograd cache])."""

    def __call__(self, graph: fx.Graph) -> None:
        from compiled_fsdp.passes import JointPassReport, run_passes

        gm = graph.owning_module
        if gm is None:  # (Inductor hands the graph of a GraphModule)
            return

        def observe(stage: str, gm: fx.GraphModule, report: Any) -> None:
            if stage == "schedule" and SESSION.reports.recordings:
                _record_region_step(gm, report)
            shown = stage == "lowering" or (stage == "schedule" and report.graph != "none")
            if shown and SESSION.reports.observers:
                SESSION.reports.notify(stage, gm, report)

        done = run_passes("partitioned", gm, observe)
        SESSION.reports.add_pipeline(done)
        lowering = done.reports.get("lowering")
        if lowering is not None:  # See [Note: Inference graphs].
            # (explain() describes the training graphs' units)
            SESSION.reports.add_joint(JointPassReport(has_markers=True, lowering=lowering, ran=tuple(done.ran)),
                                      units_for_explain=False)
        schedule = done.reports.get("schedule")
        if schedule is not None and schedule.graph != "none":
            SESSION.reports.add_schedule(schedule)

    def uuid(self) -> bytes:
        from compiled_fsdp.passes import config

        return get_hash_for_files(_source_files(), "compiled_fsdp" + repr(config.overlap)
                                  + repr(sorted(config.pipeline.disabled)))


class _Window:
    """The open windows of [Note: Passes installed while compiling]."""

    def __init__(self) -> None:
        self.depth = 0
        self.saved: tuple[Any, Any] | None = None
        self.backward = 0  # windows opened for a backward, not closed yet
        # what puts torch back when the last window closes: compat.fix_rng_state_order,
        # [Note: One schema per region]
        self.restores: list[Callable[[], None]] = []

    def enter(self) -> None:
        with _lock:
            if self.depth == 0:
                self.saved = (functorch_config.joint_custom_pass, inductor_config.post_grad_custom_post_pass)
                self.restores = [compat.fix_rng_state_order(), memoize_region_schemas()]
            self.depth += 1
            # (at every depth: a pass the user set inside a window keeps ours too)
            joint = functorch_config.joint_custom_pass
            if not isinstance(joint, _JointPass):
                functorch_config.joint_custom_pass = _JointPass(joint if callable(joint) else None)
            passes = compat.post_grad_passes(inductor_config.post_grad_custom_post_pass)
            if not any(isinstance(p, _SchedulePass) for p in passes):
                inductor_config.post_grad_custom_post_pass = compat.post_grad_value((*passes, _SchedulePass()))

    def exit(self) -> None:
        with _lock:
            if self.depth == 0:
                return
            self.depth -= 1
            if self.depth == 0 and self.saved is not None:
                functorch_config.joint_custom_pass, inductor_config.post_grad_custom_post_pass = self.saved
                self.saved = None
                restores, self.restores = self.restores, []
                with contextlib.ExitStack() as stack:  # (each runs, whatever another raised)
                    for restore in restores:
                        stack.callback(restore)


class CompileSession:
    """The compile layer's process-wide state, on one object (``SESSION``):
    what the passes reported, the open windows of [Note: Passes installed
    while compiling], and what frames.py records while Dynamo traces (which
    frames read which parameters, the markers of the compile under way,
    whether a Dynamo compile is open). Module-level because Dynamo's
    callbacks and torch's pass hooks reach it with no model at hand
    (DESIGN.md, "State").

    A group's records go with it: the first record under a group key sets a
    finalizer on the key's owner (``record_trace``), which forgets that key (and a
    block's split key once no live group records under it). ``reset()``
    forgets every record; windows open for a compile under way stay."""

    def __init__(self) -> None:
        self.reports = Reports(_lock)
        self.window = _Window()
        # group key (or a block's entry split key) -> param index -> ids of
        # the Dynamo frames whose graphs read it.
        self.traced_frames: dict[Hashable, dict[int, set[int]]] = {}
        # Compile id -> what its current trace attempt traced, until no compile
        # is under way (frames._on_compile_end takes them: ``end_compiles``).
        self.compile_markers: dict[str, TracedAttempt] = {}
        # Whether a Dynamo compile is under way. Process-wide, as Dynamo's
        # count of pending compiles is: its start and end callbacks run in
        # whichever thread starts the first and ends the last of concurrent compiles.
        self.dynamo_compiling = False
        self.dynamo_lock = threading.Lock()
        self._split_keys: dict[Hashable, set[int]] = {}  # split key -> the group keys recorded under it
        # A sharded module class -> its region subclass ([Note: Blocks as
        # compile regions] in regions.py), and a root's class -> its subclass
        # that falls back from a region that breaks the graph ([Note: A region
        # that breaks the graph]). Kept by reset(): a class is stateless, and a
        # second subclass would be a second region to compile.
        self.region_classes: dict[type, type] = {}
        self.region_roots: dict[type, type] = {}
        # Sharded module classes that broke the graph inside their region
        # ([Note: A region that breaks the graph] in regions.py). Kept by
        # reset(), as region_classes.
        self.broken_regions: set[type] = set()
        self.regions = RegionTracing()  # (each thread's)
        # The compile under way (its trace id), and for each region class the
        # blocks each variant Dynamo traced was made for (their shapes and
        # settings); the classes warned of. See [Note: A region traced again
        # for an equal block] in regions.py.
        self._region_variants: tuple[str, dict[type, set[Hashable]]] = ("", {})
        self.retraced_regions: set[type] = set()
        self._watched: dict[int, int] = {}  # key -> id of the owner whose death forgets it
        self._decoded: dict[tuple[Callable[[str], Any], str], Any] = {}

    def decoded(self, key: str, decode: Callable[[str], Any]) -> Any:
        """``decode(key)``, the same object for the same key until ``reset()``:
        Dynamo wraps a constant result it has wrapped before (the same
        object) once per trace ([Note: A region's read settings] in region_reads.py)."""
        with _lock:
            if (decode, key) not in self._decoded:
                self._decoded[(decode, key)] = decode(key)
            return self._decoded[(decode, key)]

    def forget_region_variants(self) -> None:
        """Each root's step starts afresh: a compile id repeats after
        ``torch._dynamo.reset()``, so the next model's first block looked
        like the last model's, traced again."""
        self._region_variants = ("", {})

    def region_variant(self, cls: type, block: Hashable) -> bool:
        """Records that Dynamo traced a variant of ``cls``'s region for a block
        described by ``block``; whether it traced one for an equal block
        before in the same compile (the same trace attempt, since the step began)."""
        trace = str(torch._guards.CompileContext.current_trace_id())
        if self._region_variants[0] != trace:
            self._region_variants = (trace, {})
        seen = self._region_variants[1].setdefault(cls, set())
        again = block in seen
        seen.add(block)
        return again

    def record_trace(self, key: int, param_index: int, frame: int, split_key: Optional[Hashable]) -> None:
        """A marker of ``key``'s parameter ``param_index`` traced in Dynamo
        frame ``frame`` (recorded under ``split_key`` when given), forgotten
        when the key's owner dies. Keys repeat across owners (a new world
        group counts from 0 again; thread ranks share numbers), so the
        finalizer is the latest owner's."""
        with _lock:
            if split_key is not None:
                self._split_keys.setdefault(split_key, set()).add(key)
            by_index = self.traced_frames.setdefault(key if split_key is None else split_key, {})
            by_index.setdefault(param_index, set()).add(frame)
            owner = registry.owner_of(key)
            if owner is None or self._watched.get(key) == id(owner):
                return
            self._watched[key] = id(owner)
        weakref.finalize(owner, self.forget, key, id(owner)).atexit = False

    def forget(self, key: int, owner_id: int) -> None:
        with _lock:
            if self._watched.get(key) != owner_id:
                return  # (a later owner of the key took it over)
            del self._watched[key]
            self.traced_frames.pop(key, None)
            self.reports.units.pop(key, None)
            for split, keys in list(self._split_keys.items()):
                keys.discard(key)
                if not keys:
                    del self._split_keys[split]
                    self.traced_frames.pop(split, None)

    def end_compiles(self) -> dict[str, TracedAttempt]:
        """What every compile traced in its last attempt (no compile is
        under way: Dynamo's end callback), by compile id; forgotten here."""
        with _lock:
            ended, self.compile_markers = self.compile_markers, {}
        return {key: traced for key, traced in ended.items() if traced.attempt == traced.context.attempt}

    def reset(self) -> None:
        with _lock:
            self.reports.joint.clear()
            self.reports.schedule.clear()
            self.reports.units.clear()
            self.traced_frames.clear()
            self.compile_markers.clear()
            self._split_keys.clear()
            self._region_variants = ("", {})
            self.retraced_regions.clear()
            self._decoded.clear()
        self.regions.reset()  # (this thread's)


@dataclasses.dataclass
class TracedAttempt:
    """What one trace attempt of a Dynamo compile emitted, in order: its
    markers (for [Note: Agreeing on collectives]; index -1 for a whole
    bucket) and its parameter reads (key, index, split key), in Dynamo frame
    ``frame``. ``context``'s ``attempt`` is the compile's last once it ended
    ([Note: Reads of an abandoned trace attempt] in frames.py)."""

    context: Any  # (torch._guards.CompileContext)
    attempt: int
    frame: int
    markers: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    reads: list[tuple[int, int, Optional[Hashable]]] = dataclasses.field(default_factory=list)


SESSION = CompileSession()


def open_window() -> None:
    """Opens a window: the passes are installed until the matching ``close_window()``."""
    SESSION.window.enter()


def close_window() -> None:
    SESSION.window.exit()


def open_backward_window() -> None:
    """Opens a window for the backward under way; it closes when that backward
    ends, or, if that backward raised (autograd then runs no end callback),
    at the next step's start (``close_backward_windows``)."""
    torch.autograd.Variable._execution_engine.queue_callback(_close_backward_window)
    with _lock:
        SESSION.window.backward += 1
        SESSION.window.enter()


def _close_backward_window() -> None:
    with _lock:
        if SESSION.window.backward > 0:
            SESSION.window.backward -= 1
            SESSION.window.exit()


def close_backward_windows() -> None:
    """Closes the windows of backwards that raised (a step starts: none is under way)."""
    with _lock:
        while SESSION.window.backward > 0:
            SESSION.window.backward -= 1
            SESSION.window.exit()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The passes installed around a block of code (torch's config restored after)."""
    open_window()
    try:
        yield
    finally:
        close_window()


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Collects every report the passes make while open."""
    rec = Recording()
    with _lock:
        SESSION.reports.recordings.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            SESSION.reports.recordings.remove(rec)


def add_observer(fn: Callable[..., None]) -> None:
    """Call ``fn(stage, gm, report, region=...)`` around every joint pass (see
    ``run_joint_passes``), with a compile region's forward and backward graphs
    as its partitioner returns them (stage ``"partition"``), and after the
    lowering and scheduling in the post-grad pass. ``region``: a region's
    graph; False in the post-grad pass, which cannot tell."""
    with _lock:
        SESSION.reports.observers.append(fn)


def observer_owners() -> list[Any]:
    """The objects whose bound methods observe the passes (``add_observer``)."""
    with _lock:
        return [getattr(fn, "__self__", None) for fn in SESSION.reports.observers]


def remove_observer(fn: Callable[..., None]) -> None:
    with _lock:
        if fn in SESSION.reports.observers:
            SESSION.reports.observers.remove(fn)


def last_reports() -> list:
    """Reports of the most recent joint-pass runs that saw markers, oldest
    first (bounded)."""
    with _lock:
        return list(SESSION.reports.joint)


def last_schedule_reports() -> list:
    """Reports of the most recent scheduling runs on graphs holding the
    passes' collectives (forward and backward, oldest first, bounded). Each
    has ``before``/``after`` predicted timelines; ``as_dict()`` gives plain
    dicts (seconds from the graph's start)."""
    with _lock:
        return list(SESSION.reports.schedule)


def units_of(module_key: int) -> dict[frozenset[int], tuple[str, ...]]:
    """The units the lowering chose for ``module_key``'s parameters, per graph
    (see [Note: Units] in passes/units.py), for ``explain()``."""
    with _lock:
        return dict(SESSION.reports.units.get(module_key, {}))
