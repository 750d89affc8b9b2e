"""Blocks as compile regions: ``torch.compile(model)`` traces and compiles
each distinct block once (``config.comm.block_regions``, on by default).

[Note: Blocks as compile regions]
``torch.compiler.nested_compile_region`` makes Dynamo trace a function once
and call the one subgraph (``invoke_subgraph``) wherever it is called again
with inputs its guards accept; AOTAutograd partitions that subgraph once and
Inductor compiles it once. ``make_region`` gives a sharded module a subclass
of its class whose ``forward`` is such a region (identical blocks share the
subclass, so the region: Dynamo keys it on the code and checks its guards
against each block's own parameters). The module's hooks stay outside the
region, in the outer graph. Three things make a sharded block's trace fit
every block (each found by trying: RESULTS, "Blocks as compile regions: a
prototype"):

1. A read inside a region (``traced_read`` here) emits a marker keyed
   ``ENTRY_KEY``, with no per-block ``comptime`` record: keyed by its group,
   the next block failed the guard on ``group.key``, each block got its own
   subgraph, and Dynamo inlined every single-use subgraph (today's one graph).
   The region's graph is then the same for every block, as a block compiled
   on its own ([Note: Blocks compiled on their own] in entry.py).
2. The marker reads a plain leaf aliasing the local shard (the entry's
   ``region_shards``), not the ``DTensor``: AOTAutograd flattens a DTensor
   input of ``invoke_subgraph`` while the subgraph still calls
   ``to_local()`` on it (an error on 2.13 and 2.15). The alias's gradient,
   the reduced shard, moves into the ``DTensor``'s ``.grad`` as soon as
   autograd accumulates it (a post-accumulate-grad hook on the alias,
   ``_move_grad``, holding its parameter weakly: the hook is held from C++,
   where gc cannot see the cycle back to the alias, and every model with
   regions outlived its last reference, tests/test_state.py), adding to
   what is there, as autograd would; whatever
   traced the forward, whole or in part. Where the region's reduce is
   waited after its graph, the graph returns no gradient for the alias and
   the registry hands the rows to the same addition (``_add_grad``: [Note:
   A region's reduce-scatter waited outside its graph] in core/registry.py).
   An alias is made again whenever the local shard's storage changed
   (``refresh``, each step before tracing: DCP, ``to_empty``), and a
   gradient a raised backward left on one is dropped there.
3. ``joint_custom_pass`` sees only the outer joint graph, where the regions
   are already partitioned: the region's own partitioner (``_partition``)
   runs the joint passes on its joint graph, then the min-cut partitioner.
   Passing it needs Dynamo's ``enable_invoke_subgraph_regional_compile``
   ("for testing only"), set only while the region is made.
4. The aliases of (2) are explicit arguments of the region's call (``body``
   takes them and leaves them to the reads, which find the same tensors).
   Read only inside the body, they were lifted free variables, and where a
   region of another class ran first (the embedding's, as torchtitan shards
   it) Dynamo's reuse passed the first block's aliases to the second block:
   a silent wrong answer from the first step (0.9 in the output;
   tests/test_chunked_loss.py, the regions case).

[Note: Gathers issued ahead of compile regions]
A region's gathers are lowered inside its own graph, so alone it can overlap
them only with its own compute: each region began by waiting for its gather.
No tensor can pass a gather from one region's graph to the next (a region
is traced once for every block; Dynamo reuses it only if nothing in it
differs between blocks and it has no side effect), so the gather passes
through the registry instead, as the backward re-gathers of blocks compiled
on their own do ([Note: Backward re-gathers prefetched across graphs] in
core/registry.py):

- a read inside a region marks its bucket ``take_ahead``, and the lowering
  gathers it with ``compiled_fsdp::regather``, which takes a gather issued
  for the same shards if one is pending (issued in this forward), and
  otherwise gathers now;
- before the outer graph calls region i it traces
  ``compiled_fsdp::issue_ahead`` on region i+1's shards (``predict_order``:
  the regions in the model's order), which issues that gather if a
  ``regather`` took the bucket before (none in the first step) and does not
  wait for it; before the first region, on its own shards first (issued by
  itself, it waited behind the second region's on the link: 36 ms a step in
  RESULTS' setting);
- in backward, no outer graph runs between the regions' backwards (AOTAutograd
  calls them from the outer backward, whose calls take no token), so the
  chain runs at run time instead: ``_partition`` marks the re-gathers of a
  region's backward graph ``backward``, and each, having taken or issued
  its own gather, issues the gather of the region before it in the model
  (``BackwardGathers.then``, filled by ``predict_order``): FSDP2's backward
  prefetch. The first region's backward in each backward that gathers (the
  last block's, or the one before it where the last is kept from forward)
  takes the gather issued when the root's compiled backward begins, the
  loss done (``_issue_first_region_gather`` in path.py, through the hook
  ``CompiledPath.after_compiled_root`` puts on the forward's outputs), so
  that it uses the link while the head's backward computes, as one graph's
  first backward gather does. Issued when the forward returned instead, it
  went out while the loss computed, and that block's gathered parameters
  were in memory beside the loss's: the peak tensor memory was 1.045x one
  graph's, and is 0.98x now, the step unchanged (RESULTS, 2026-11-30).

The outer graph reads no block's parameters (the regions do), so the passes
take each region's call for another module's reads: the root's units are cut
there (``region_calls`` in passes/graph.py), as at the blocks' reads in one
graph, and no two buckets merge across one. Without it the final norm joined
the root's first reads, not the head: resharded, gathered again in backward.
(A region of the user's own parts them too: it reads other parameters, or
none, and only merges are lost.)

Both ops are opaque to Inductor, which orders the collectives it knows but
not these: so ``issue_ahead`` takes every tensor the region before it takes
(``after``: the output of the one before that among them) and returns a
token that region takes, and the pin (passes/pin.py) keeps it
between the owned collectives before and after it, so every rank issues the
same collectives in the same order (without them the ranks' Inductor
schedules, which differ with uneven shards, mismatched a gather). A wrong
prediction costs a gather waited for and dropped at the iteration's end.

A module whose parameters compute as DTensors (tensor parallelism,
``dp_mesh_dims``) or spmd_types-typed tensors is no region: its activations
and reads would carry those types across the region's boundary, where
AOTAutograd lost the forward's call ("could not find matching fw HOP");
its reads are traced in the root's graph, as without regions, and
``explain`` gives the reason (tests/test_tensor_parallel.py, the regions
case).

Regions are for ``torch.compile(model)``: a block compiled on its own
(``block.compile()``) compiles once already, and runs its plain forward
(its reads are not a region's). A region must be traced whole: at a graph
break inside one the blocks of that class stop being regions and fall back
([Note: A region that breaks the graph]).
Tested by tests/test_block_regions.py; with bf16 parameters and no-sync
accumulation by tests/test_no_sync.py::test_compiled_accumulation_without_sync_regions,
under HSDP by tests/test_hsdp.py::test_hsdp_2x2_matches_reference[regions], sharded
on dims 1 and 2 (one rank's shard empty) by
tests/test_shard_dim.py::test_experts_sharded_on_their_largest_dim[regions], each
block under ``torch.utils.checkpoint`` by
tests/test_eager_parity.py::test_activation_checkpointing[regions]: each
bitwise equal to its single-process reference.
"""
from __future__ import annotations

import json
import warnings
import weakref
from functools import partial
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._dynamo.comptime import comptime

from compiled_fsdp.compile import install
from compiled_fsdp.compile.entry import CompiledEntry, entry_of, param_settings, read_kept, read_syncs
from compiled_fsdp.core import compat, registry
from compiled_fsdp.core.marker import ENTRY_KEY, IssueAhead, Regather, Unshard
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.param import FSDPParam, from_canonical, to_canonical
from compiled_fsdp.runtime.param_group import FSDPParamGroup
from compiled_fsdp.runtime.state import get_fsdp_state

__all__ = ["make_region", "make_region_root", "predict_order", "read_settings", "refresh", "traced_read"]


def _partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """A region's joint graph: the joint passes, then the min-cut partitioner
    (3), then no output that aliases an activation ([Note: A region returns
    no alias of its inputs] in passes/aliasing.py)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from compiled_fsdp.passes.aliasing import clone_outputs_aliasing_inputs, mark_marker_inputs  # (at compile)

    mark_marker_inputs(joint)
    install.run_joint(joint, units_for_explain=False)
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    clone_outputs_aliasing_inputs(forward)
    clone_outputs_aliasing_inputs(backward)
    regather = Regather.op().default
    for node in backward.graph.nodes:  # (the backward's: [Note: Gathers issued ahead of compile regions])
        if node.target is regather:
            node.update_kwarg("backward", True)
    backward.recompile()
    return forward, backward


def _region_of(forward: Callable) -> Callable:
    from torch._higher_order_ops.invoke_subgraph import NestedCompileRegionOptions

    def body(module: nn.Module, token: torch.Tensor, shards: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return forward(module, *args, **kwargs)  # (the reads take ``shards`` from the entry: (4))

    with torch._dynamo.config.patch(enable_invoke_subgraph_regional_compile=True):
        return compat.nested_compile_region(body, NestedCompileRegionOptions(partitioner=_partition))


def make_region(module: nn.Module, group: FSDPParamGroup) -> None:
    """Gives ``module`` (its parameters ``group``) its class's region subclass
    (made once per class). A module compiled on its own (its entry's
    ``active``, set by its pre-forward hook) runs its plain forward."""
    cls = type(module)
    if cls in install.SESSION.broken_regions:  # ([Note: A region that breaks the graph])
        return
    entry = entry_of(group)
    entry.in_region = True
    module.__dict__["_fsdp_region_entry"] = entry
    if getattr(cls, "_fsdp_region", False):
        return
    region_cls = install.SESSION.region_classes.get(cls)
    if region_cls is None:
        plain = cls.forward
        region = _region_of(plain)

        def tracing(ctx: Any) -> None:  # (at trace time, through comptime)
            install.SESSION.region_traced = (cls, compat.outermost_traced_code(ctx))

        def traced(ctx: Any) -> None:
            install.SESSION.region_traced = None

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            entry = self.__dict__["_fsdp_region_entry"]
            if entry.active:  # (block.compile(): one frame per block already)
                return plain(self, *args, **kwargs)
            token = None
            if torch.compiler.is_dynamo_compiling():
                after = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                for ahead in entry.region_ahead:  # (one after the other: the token orders them)
                    token = _issue_ahead(ahead, after if token is None else [token, *after])
            if token is None:  # (the token's like, so that the last region's call is the others')
                token = entry.region_shards[0].new_empty([0]) if entry.region_shards[0] is not None \
                    else torch.empty(0)
            if not torch.compiler.is_dynamo_compiling():
                return region(self, token, _own(entry), *args, **kwargs)
            comptime(tracing)
            comptime(entry.record_region_call)  # ([Note: Agreeing on collectives]: this block's bucket)
            out = region(self, token, _own(entry), *args, **kwargs)
            comptime(traced)
            return out

        region_cls = type(cls.__name__, (cls,), {"forward": forward, "_fsdp_region": True,
                                                  "__module__": cls.__module__})
        install.SESSION.region_classes[cls] = region_cls
    module.__class__ = region_cls


def _own(entry: CompiledEntry) -> list[torch.Tensor]:
    """The aliases a region's reads take, passed to its call ([Note: Blocks as compile regions] (4))."""
    return [a for a in entry.region_shards if a is not None]


# [Note: A region that breaks the graph]
# A region must be traced whole: at a graph break inside one Dynamo raises
# ``UncapturedHigherOrderOpError`` (``invoke_subgraph`` never falls back to
# eager, on 2.11-2.15). So a sharded module with regions below it runs its
# ``forward`` through ``_falling_back``, a frame Dynamo runs as Python
# (``compat.not_a_frame_itself``), which calls the user's forward: for the
# root, the frame ``torch.compile(model)`` (or ``model.compile()``)
# compiles. Each region call records its class, and the code of the frame
# being compiled, while Dynamo traces it (``region_traced``, through
# ``comptime``). Where a compile raises with a region's class recorded, the
# modules of that class stop being regions (their class and entry as
# without ``block_regions``; the class is kept in ``broken_regions``, so
# later ``fully_shard`` calls leave it alone), with one warning. Then:
#
# - where the compile that raised was the root's forward itself, nothing of
#   the step has run yet: the step's compile state is made again
#   (``on_step``: the issue-ahead order, the aliases) and the forward is
#   called again. Dynamo now inlines those blocks, breaks the graph around
#   their calls, and they fall back to the eager runtime, as any block that
#   breaks the graph does ([Note: Fallback decision rule] in frames.py); the
#   other classes stay regions;
# - otherwise (a resume function after an earlier break, whose first part
#   has run; a module other than the root) the error stands, with a note
#   that the next step runs those modules as plain ones: a step is never
#   run twice.
#
# Dynamo leaves its frame callback unset after a compile that raised, for
# the rest of the compiled call: the retry sets it back, or the first step
# ran eagerly. Every rank traces the same code, so every rank takes the
# same decision. Tested by
# tests/test_block_regions.py::test_a_region_that_breaks_the_graph_falls_back.


def make_region_root(module: nn.Module) -> None:
    """Gives ``module``, a sharded module some of whose sharded modules are
    regions (the root, or one on the way to it), a ``forward`` that falls
    back from a region that breaks the graph ([Note: A region that breaks
    the graph]); made once per class."""
    cls = type(module)
    if getattr(cls, "_fsdp_region_root", False) \
            or not any(getattr(type(m), "_fsdp_region", False) for m in module.modules()):
        return
    root_cls = install.SESSION.region_roots.get(cls)
    if root_cls is None:
        plain = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_dynamo_compiling():  # (inlined: traced as it is)
                return plain(self, *args, **kwargs)
            return _falling_back(self, plain, args, kwargs)

        compat.not_a_frame_itself(forward, _falling_back)
        root_cls = type(cls.__name__, (cls,), {"forward": forward, "_fsdp_region_root": True,
                                               "__module__": cls.__module__})
        install.SESSION.region_roots[cls] = root_cls
    module.__class__ = root_cls


def _falling_back(module: nn.Module, plain: Callable, args: tuple, kwargs: dict) -> Any:
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    session = install.SESSION
    callback = compat.frame_callback()
    while True:
        session.region_traced = None
        try:
            return plain(module, *args, **kwargs)
        except UncapturedHigherOrderOpError as exc:
            traced, session.region_traced = session.region_traced, None
            if traced is None or not _leave_regions(module, traced[0]):
                raise
            state = get_fsdp_state(module)
            if traced[1] is not plain.__code__ or state is None or not state.is_root:
                exc.add_note("compiled_fsdp: part of this forward had run when the error came, so it is not "
                             "run again; from the next step on those modules are plain ones.")
                raise
            compiled_path().on_step(state.ctx)
            compat.restore_frame_callback(callback)  # (so that the forward is compiled again)


def _leave_regions(module: nn.Module, cls: type) -> int:
    """The modules of ``cls`` below ``module`` are no longer regions; how many were."""
    region_cls = install.SESSION.region_classes[cls]
    install.SESSION.broken_regions.add(cls)
    left = 0
    for m in module.modules():
        if type(m) is region_cls:
            m.__class__ = cls
            m.__dict__.pop("_fsdp_region_entry").in_region = False
            left += 1
    if left:
        name = getattr(cls, "_fsdp_base_class", cls).__name__
        warnings.warn(f"compiled_fsdp: the sharded modules of class {name!r} break the graph inside their "
                      "compile region (config.comm.block_regions); they run as plain modules from now on, "
                      "and fall back to the eager runtime where the graph breaks. "
                      "compiled_fsdp.explain(model) says which.", stacklevel=4)
    return left


def predict_order(groups: list[FSDPParamGroup]) -> None:
    """Each region's next, in the model's order: the one whose gather the
    outer graph issues before calling it; and backward, the one whose gather
    a region's backward re-gather issues (the one before it)."""
    entries = [entry_of(g) for g in groups if entry_of(g).in_region]
    gathers = registry.CORE.backward_gathers
    gathers.then.clear()
    for entry, after in zip(entries, [*entries[1:], None]):
        entry.region_ahead = [after] if after is not None else []
        if after is not None:
            gathers.chain(after.bucket_key(), entry.issue_backward_gather)
    if entries:  # (the first region's own first: issued ahead of the next, not queued behind it)
        entries[0].region_ahead.insert(0, entries[0])


# [Note: A region's read settings]
# Dynamo reuses a region's graph for the next block after evaluating, on that
# block, every guard the first trace installed. A read's settings (shapes,
# group names, dtypes, the policy) reached through the group and the
# parameter's spec were about 35 guards a parameter, each on a source 8-10
# attributes deep: 800 guards a block, re-evaluated per block (0.15 s under
# cProfile). So a read inside a region takes them from ``read_settings``,
# which Dynamo calls at trace time and takes as constants
# (``assume_constant_result``: no guards), given one string that encodes
# them all (``region_key``, made by ``refresh`` before each step's tracing).
# That one string is guarded: a setter that changes a setting changes the
# key, and the frame recompiles. The key also holds what the read decides
# by (``_read_flags``: sync or not, whether a gradient sink exists, the shard
# dim, whether a DTensor wraps the result), so the region's read
# (``traced_read`` here) reaches only the entry, the parameter's index, its
# alias and, where one exists, its sink: each attribute read on the way
# through the parameter and its group was a guard of its own, on a source
# through that parameter (12 parameters a block). The issue-ahead the outer graph traces
# before each region call (``_issue_ahead``) takes its arguments from the
# same key, all but its group's key (the reads' must not differ between
# blocks): traced through the group and its specs, they cost 55 ms a block
# in Dynamo's trace (its own profiler, ``dynamo_profiler``, warm, 24 blocks),
# 34 ms after. Tested by
# tests/test_block_regions.py::test_a_setting_changed_between_steps_recompiles.


# [Note: No DTensor inputs beside regions]
# A read inside a region takes a plain alias of the local shard (2). In a
# model with regions every other group's read in the outer graph does too
# (``CompiledEntry.reads_alias``, set each step): one ``DTensor`` input
# (the root's embedding, say) turns AOTAutograd's subclass handling on for
# the whole graph, which traces the joint once more to learn the outputs'
# subclass layout, and each of those traces re-traces every region call for
# its schema (``invoke_subgraph``'s mutation check): three traces a region
# call instead of two. Measured under cProfile at 8 blocks: 26 schema
# traces, 18 after. The aliases' gradients move into the ``DTensor``s'
# ``.grad`` as the regions' do (2). A tensor hook (``register_hook``) a user
# puts on such a ``DTensor`` parameter does not see the gradient arrive, nor
# does ``torch.autograd.grad(loss, param)``, as for every region's parameter;
# its post-accumulate-grad hooks run when the gradient lands (``add_grad``),
# as in the eager runtime and FSDP2. Tested by
# tests/test_block_regions.py::test_identical_blocks_compile_once (no
# ``DTensor`` among the outer graph's inputs).


def _ahead_settings(group: FSDPParamGroup) -> dict[str, Any]:
    """The issue-ahead's arguments other than tensors and its group's key
    (which every block's differs in, and the region's reads must not: the
    key is one guard of the outer graph), and whether its shards are
    canonical as they are (every shard dim 0)."""
    first = group.fsdp_params[0]
    return dict(full_shapes=list(entry_of(group).full_shapes), group_name=group.group_name,
                world_size=group.specs[0].world_size, param_dtype=first.param_dtype,
                canonical=all(p.shard_dim == 0 for p in group.fsdp_params))


def _read_flags(param: FSDPParam) -> dict[str, Any]:
    """What else a read inside a region decides by: whether it reduces its
    gradient in the graph, whether it has a gradient sink, its shard dim,
    and whether the module reads the gathered tensor as it is (no DTensor
    or annotated parameter around it)."""
    return dict(sync=read_syncs(param), sink=param.grad_sink is not None, shard_dim=param.shard_dim,
                plain=param.dtensor_spec is None and param.annotated is None)


def _encode(group: FSDPParamGroup) -> str:
    def plain(settings: dict[str, Any]) -> dict[str, Any]:
        return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in settings.items()}

    return json.dumps({"reads": [plain({**param_settings(p), **_read_flags(p)}) for p in group.fsdp_params],
                       "ahead": plain(_ahead_settings(group))}, sort_keys=True)


def _decode(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    # (pairs: a dict made by Dynamo from a constant has no source to guard
    # its keys on; the traced code ``dict()``s them)
    return tuple((k, getattr(torch, v) if k.endswith("_dtype") and v is not None else v)
                 for k, v in settings.items())


@torch._dynamo.assume_constant_result
def read_settings(key: str, index: int) -> tuple[tuple[str, Any], ...]:
    """Parameter ``index``'s ``param_settings`` and ``_read_flags`` from its region's key."""
    return _decode(json.loads(_made(key))["reads"][index])


def _made(key: str) -> str:
    if not key:  # (made by the root's pre-forward hook, run as Python: see [Note: Hooks under Dynamo])
        raise RuntimeError(
            "compiled_fsdp: a compile region (config.comm.block_regions) is traced inside a graph that also "
            "traces its sharded root's call, so the root's pre-forward never ran to prepare it. Compile the "
            "sharded root itself (torch.compile(model) or model.compile()), or set "
            "compiled_fsdp.config.comm.block_regions = False before fully_shard.")
    return key


def traced_read(entry: CompiledEntry, param: FSDPParam) -> torch.Tensor:
    """A read inside a compile region, traced (path.py's ``traced_read``
    otherwise): the alias of the local shard (2), ``ENTRY_KEY``, no per-block
    record (1), its gather taken from one issued ahead, and everything else
    from the region's key ([Note: A region's read settings])."""
    index = param.index
    settings = dict(read_settings(entry.region_key, index))
    sync, sink = settings.pop("sync"), settings.pop("sink")
    shard_dim, plain = settings.pop("shard_dim"), settings.pop("plain")
    full = Unshard.call(shard=to_canonical(entry.region_shards[index], shard_dim), module_key=ENTRY_KEY,
                        kept=read_kept(param, sync, sink), sync=sync, take_ahead=True, **settings)
    full = full if shard_dim == 0 else from_canonical(full, shard_dim).contiguous()
    return full if plain else param.to_compute(full)


@torch._dynamo.assume_constant_result
def _ahead_of(key: str) -> tuple[tuple[str, Any], ...]:
    return _decode(json.loads(_made(key))["ahead"])


def _issue_ahead(entry: CompiledEntry, after: list[torch.Tensor]) -> torch.Tensor:
    """``entry``'s region's gather, issued after ``after`` are computed
    (traced into the outer graph) for its ``regather`` to take; returns the
    token the region before it takes. Its arguments come from the region's
    key, as its reads' do ([Note: A region's read settings])."""
    settings = dict(_ahead_of(entry.region_key))
    shards = entry.region_shards
    if not settings.pop("canonical"):
        shards = [p.to_canonical(shards[p.index]) for p in entry.group.fsdp_params]
    return IssueAhead.call(shards=shards, after=after, module_key=entry.group.key, **settings)


def refresh(group: FSDPParamGroup) -> None:
    """Makes each parameter's alias again where its local shard's storage
    changed, or whether it requires grad (2); and, for a region, the key of
    its reads' settings ([Note: A region's read settings])."""
    entry = entry_of(group)
    if entry.in_region:  # (the others' reads guard their settings themselves)
        entry.region_key = _encode(group)
    shards = entry.region_shards
    for p in group.fsdp_params:
        local = p.graph_shard()
        alias = shards[p.index]
        if alias is not None:
            alias.grad = None  # (left by a backward that raised)
        if alias is None or alias.data_ptr() != local.data_ptr() or alias.shape != local.shape \
                or alias.dtype != local.dtype or alias.requires_grad != p.sharded.requires_grad:
            alias = shards[p.index] = local.detach().requires_grad_(p.sharded.requires_grad)
            if alias.requires_grad:  # (weakly: a hook's reference to its own model, held
                # from C++, is a cycle gc cannot see; the model outlived its last reference)
                alias.register_post_accumulate_grad_hook(partial(_move_grad, weakref.ref(p)))
                # (a reduce waited after the graph: [Note: A region's reduce-scatter waited outside its graph])
                registry.CORE.later_reduces.receive(alias, partial(_add_grad, weakref.ref(p)))


def _move_grad(param_ref: weakref.ref, alias: torch.Tensor) -> None:
    """The alias's gradient into its ``DTensor``'s ``.grad`` (2); none
    without sync, where the graph returns none for it."""
    grad, alias.grad = alias.grad, None
    if grad is not None:
        _add_grad(param_ref, grad)


def _add_grad(param_ref: weakref.ref, grad: torch.Tensor) -> None:
    """``grad`` (the local rows) added to its parameter's ``.grad``."""
    param = param_ref()
    if param is None:
        return
    with compat.no_spmd_typecheck():  # (as the eager runtime's reductions: [Note: spmd_types parameters])
        param.add_grad(param.to_canonical(grad))
