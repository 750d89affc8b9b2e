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

1. A read inside a region (``traced_read`` in region_reads.py) emits a marker keyed
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
   ``_move_grad`` in region_reads.py, holding its parameter weakly: the hook is held from C++,
   where gc cannot see the cycle back to the alias, and every model with
   regions outlived its last reference, tests/test_state.py), adding to
   what is there, as autograd would; whatever
   traced the forward, whole or in part. Where the region's reduce is
   waited after its graph, the graph returns no gradient for the alias and
   the registry hands the rows to the alias's receiver (``_add_reduced_rows``:
   the same addition, or under CPU offload a copy to the host landed at the
   end of backward; [Note: A region's reduce-scatter waited outside its
   graph] in core/registry.py).
   An alias is made again whenever the local shard's storage changed
   (``refresh`` in region_reads.py, each step before tracing: DCP, ``to_empty``), and a
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
  ``regather`` took the bucket before (none in the first step), or the
  gather of each part of it that one took ([Note: A bucket issued in the
  parts its graph takes] in core/registry.py), and does not
  wait for it; before the first region, on its own shards first (issued by
  itself, it waited behind the second region's on the link: 36 ms a step in
  RESULTS' setting);
- in backward, no outer graph runs between the regions' backwards (AOTAutograd
  calls them from the outer backward, whose calls take no token), so the
  chain runs at run time instead: ``_partition`` marks the re-gathers of a
  region's backward graph ``backward``, and each, having taken or issued
  its own gather, issues the gather of the region before it in the model
  (its first does; the others find it pending)
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
between the owned collectives before and after it (after the issue-ahead
before it by adding that one's token to its ``after``: the region drops the
token it takes; [Note: Dependencies the graph has]), so every rank issues the
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

[Note: One source per region]
Dynamo names an object by the source it first reached it through, and keeps
that name wherever the object turns up again. When each region's entry held
the next one, the outer graph reached block k+1's entry, and its shards,
through block k's: block k's shards were graph inputs whose source was k
steps long (``..._fsdp_region_entry.region_ahead[1].region_ahead[0]...``).
Whatever walks the inputs' sources then walked the square of the depth: the
guards on them, and AOTAutograd's cache key, which pickles every input's
source without a memo (at 80 blocks 3.7 MB, 0.85 s of a warm first step;
0.56 MB now). So every entry holds the model's one list of regions
(``region_order``) and the positions in it of those it issues ahead
(``region_ahead``): each entry after the first is one index below that list,
and a source is as long at 80 blocks as at 8. Tested by
tests/test_block_regions.py::test_identical_blocks_compile_once (the shards'
source depths).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._dynamo.comptime import comptime
from torch.utils._pytree import tree_leaves, tree_map_only

from compiled_fsdp.compile import install
from compiled_fsdp.compile.entry import entry_of
from compiled_fsdp.compile.region_call import region_call
from compiled_fsdp.compile.region_reads import issue_ahead
from compiled_fsdp.compile.region_variants import constant, described, variant_traced
from compiled_fsdp.core import compat, registry
from compiled_fsdp.core.marker import Regather, sizes_dynamic
from compiled_fsdp.runtime.extension import compiled_path
from compiled_fsdp.runtime.generated import make
from compiled_fsdp.runtime.param_group import FSDPParamGroup
from compiled_fsdp.runtime.state import get_fsdp_state

__all__ = ["make_region", "make_region_root", "predict_order"]


def _partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """A region's joint graph: the joint passes, then the min-cut partitioner
    (3), then no output that aliases an activation ([Note: A region returns
    no alias of its inputs] in passes/aliasing.py)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from compiled_fsdp.passes.aliasing import clone_outputs_aliasing_inputs, mark_marker_inputs  # (at compile)

    mark_marker_inputs(joint)
    install.run_joint(joint, region=True)
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    clone_outputs_aliasing_inputs(forward)
    clone_outputs_aliasing_inputs(backward)
    regather = Regather.op().default
    for node in backward.graph.nodes:  # (the backward's: [Note: Gathers issued ahead of compile regions])
        if node.target is regather:
            node.update_kwarg("backward", True)
    backward.recompile()
    install.show_partitioned(forward, backward)
    return forward, backward


def _region_of(forward: Callable, cls: type) -> Callable:
    from torch._higher_order_ops.invoke_subgraph import NestedCompileRegionOptions

    def entering(ctx: Any) -> None:  # ([Note: Region calls traced once])
        install.SESSION.regions.enter(cls, compat.outermost_traced_code(ctx))
        variant_traced(cls, constant(ctx, "inputs"))  # ([Note: A region traced again for an equal block])

    def leaving(ctx: Any) -> None:
        install.SESSION.regions.leave()

    def body(module: nn.Module, token: torch.Tensor, shards: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        inputs = described((*args, *kwargs.values()))  # noqa: F841 (read by ``entering``)
        comptime(entering)
        out = forward(module, *args, **kwargs)  # (the reads take ``shards`` from the entry: (4))
        comptime(leaving)
        if not torch.compiler.is_dynamo_compiling():  # (eager: the body is the block's forward)
            return out
        return _returned(out, [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)])

    with torch._dynamo.config.patch(enable_invoke_subgraph_regional_compile=True):
        return compat.nested_compile_region(body, NestedCompileRegionOptions(partitioner=_partition))


# [Note: What a region returns]
# ``invoke_subgraph`` takes from a region's body no tensor that is its input
# or another of its outputs (on 2.11-2.15), and from 2.13 on reuses a body's
# trace only where it returns one tensor or a tuple or list of tensors (2.11
# traces every call and keeps one subgraph for equal graphs). Blocks return
# more: T5's return ``(hidden, self_bias, cross_bias)``, the cross-attention
# bias None in the encoder, and hand the self-attention bias on untouched
# from the second block on. So, under Dynamo, the body returns, and the
# block's ``forward`` takes back:
#
# - a tensor that *is* one of the body's inputs (at any depth of its
#   arguments), or an output returned before it, cloned: the same values,
#   its gradient handed on by the clone's backward. Returned as it was, the
#   first step of ``torch.compile(model)`` failed ("Encountered aliasing
#   during higher order op tracing"). A view of an input is not caught: that
#   error then carries a note saying what to do (``_REFUSED``);
# - None in a top-level tuple or list, as an empty tensor of a shape no
#   block returns (``_NONE``, on the device of the output's first tensor),
#   made None again by the block's ``forward``. Left as it was, Dynamo traced
#   the body again for every block (T5's encoder: "output contains
#   non-tensor types"), and the project's warning blamed something the
#   forward reads. None deeper down still keeps a trace from reuse. (A list
#   comes back from a reused trace as a tuple: torch's.)
#
# Eager, the body runs as the block's forward and returns what it returns.
# Tested by tests/test_hf_models.py::test_t5_encoder_decoder.
_NONE = (0, 1511)  # (an empty uint8 tensor of this shape stands for None)


def _returned(out: Any, inputs: list[torch.Tensor]) -> Any:
    """Traced in a region's body: what it returns for ``out`` (the note above)."""
    seen = list(inputs)

    def fresh(x: torch.Tensor) -> torch.Tensor:
        if any(x is a for a in seen):
            return x.clone()
        seen.append(x)
        return x

    out = tree_map_only(torch.Tensor, fresh, out)
    if type(out) not in (tuple, list) or not any(x is None for x in out):
        return out
    like = next((x for x in out if isinstance(x, torch.Tensor)), None)
    none = like.new_empty(_NONE, dtype=torch.uint8) if like is not None else torch.empty(_NONE, dtype=torch.uint8)
    return type(out)(none if x is None else x for x in out)


def _taken_back(out: Any) -> Any:
    """The block's output from its region's (the note above)."""
    if type(out) not in (tuple, list):
        return out
    return type(out)(None if isinstance(x, torch.Tensor) and x.dtype is torch.uint8 and tuple(x.shape) == _NONE
                     else x for x in out)


def make_region(module: nn.Module, group: FSDPParamGroup) -> None:
    """Gives ``module`` (its parameters ``group``) its class's region subclass
    (made once per class). A module compiled on its own (its entry's
    ``active``, set by its pre-forward hook) runs its plain forward."""
    cls = type(module)
    if cls in install.SESSION.broken_regions:  # ([Note: A region that breaks the graph])
        return
    entry = entry_of(group)
    entry.in_region = True
    entry.region_module = weakref.ref(module)
    module.__dict__["_fsdp_region_entry"] = entry
    if getattr(cls, "_fsdp_region", False):
        return
    region_cls = install.SESSION.region_classes.get(cls)
    if region_cls is None:
        plain = cls.forward
        region = _region_of(plain, cls)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            entry = self.__dict__["_fsdp_region_entry"]
            # (eager, the region's body is the block's forward; block.compile(): one frame per block already)
            if not torch.compiler.is_dynamo_compiling() or entry.active:
                return plain(self, *args, **kwargs)
            if sizes_dynamic():
                comptime(entry.record_region_dynamic)  # ([Note: No compile regions under dynamic=True])
                return plain(self, *args, **kwargs)
            token = None
            after = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for ahead in entry.region_ahead:  # (one after the other: the token orders them; the
                # entry through the list: [Note: One source per region])
                token = issue_ahead(entry.region_order[ahead], after if token is None else [token, *after])
            if token is None:  # (the token's like, so that the last region's call is the others')
                token = entry.region_shards[0].new_empty([0]) if entry.region_shards[0] is not None \
                    else torch.empty(0)
            comptime(entry.record_region_call)  # ([Note: Agreeing on collectives]: this block's bucket;
            # [Note: Region calls traced once]) (the aliases its reads take, (4), as the entry's own
            # list: a new list cost Dynamo 104 traced instructions a block; [Note: What a region returns])
            return _taken_back(region(self, token, entry.region_shards, *args, **kwargs))

        attrs = {"forward": forward, "_fsdp_region": True, "__module__": cls.__module__}
        if cls.__call__ is nn.Module.__call__ and cls._call_impl is nn.Module._call_impl:  # (a class's own
            attrs["__call__"] = region_call  # call, a checkpointing layer's say, stays: region_call.py)
        region_cls = make(cls.__name__, (cls,), attrs, ("region", cls))
        install.SESSION.region_classes[cls] = region_cls
    module.__class__ = region_cls


# [Note: No compile regions under dynamic=True]
# ``torch.compile(model, dynamic=True)`` (Dynamo's
# ``assume_static_by_default`` off) fails in torch's own
# ``nested_compile_region`` on 2.15, with nothing of this project in it: a
# block whose forward computes with its input's sizes raised "Freevar has
# no source" when Dynamo recorded the region for reuse. So a block traced
# under it runs its plain forward, its reads traced in the root's graph
# (as a block whose region never runs), and ``explain`` says why; automatic
# dynamic shapes (the default, ``dynamic=None``) keep the regions. Tested by
# tests/test_dynamic_shapes.py::test_dynamic_true_buckets_every_collective.


# [Note: Region calls traced once]
# Dynamo traces the outer graph's call of every block's region, but a
# region's body only for the first block of each variant. What must be known
# while a body is traced (which block's reads these are: ``in_a_region`` and
# the variant's record; which class broke the graph, for the fallback) is
# therefore set and cleared by ``comptime`` calls inside the body
# (``entering``, ``leaving``: ``RegionTracing`` in region_tracing.py), from the one
# ``comptime`` each call makes (``record_region_call``: its bucket, for
# [Note: Agreeing on collectives], and the block the body would be traced
# for). Set around each call in the outer graph instead, they cost two more
# ``comptime`` calls a block in Dynamo's trace: 0.2 s at 32 blocks, warm
# (RESULTS, 2026-12-01, thirty-fourth session). A body traced inside another
# body gives the outer one its state back when it leaves. Tested by
# tests/test_block_regions.py::test_a_region_that_breaks_the_graph_falls_back,
# tests/test_region_variants.py::test_a_block_with_its_own_forward_is_read_in_the_root_graph
# and ::test_a_region_traced_again_for_an_equal_block_warns.

# [Note: A region that breaks the graph]
# A region must be traced whole: at a graph break inside one Dynamo raises
# ``UncapturedHigherOrderOpError`` (``invoke_subgraph`` never falls back to
# eager, on 2.11-2.15). So a sharded module with regions below it runs its
# ``forward`` through ``_falling_back``, a frame Dynamo runs as Python
# (``compat.not_a_frame_itself``), which calls the user's forward: for the
# root, the frame ``torch.compile(model)`` (or ``model.compile()``)
# compiles. While Dynamo traces a region's body it records the region's
# class and the code of the frame being compiled (``RegionTracing.traced``,
# [Note: Region calls traced once]); a body that breaks the graph raises
# before it is traced to its end, so the record stays. Where a compile raises with a region's class recorded, the
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
        root_cls = make(cls.__name__, (cls,), {"forward": forward, "_fsdp_region_root": True,
                                                         "__module__": cls.__module__}, ("region_root", cls))
        install.SESSION.region_roots[cls] = root_cls
    module.__class__ = root_cls


def _falling_back(module: nn.Module, plain: Callable, args: tuple, kwargs: dict) -> Any:
    from torch._dynamo.exc import BackendCompilerFailed, UncapturedHigherOrderOpError

    session = install.SESSION
    callback = compat.frame_callback()
    while True:
        session.regions.reset()
        try:
            return plain(module, *args, **kwargs)
        except BackendCompilerFailed as exc:  # (a region changing its input: refused by the backend)
            if "invoke_subgraph" in str(exc):
                exc.add_note(_REFUSED)
            raise
        except UncapturedHigherOrderOpError as exc:
            traced = session.regions.traced
            session.regions.reset()
            if traced is None:  # (refused after a body's trace: an output aliasing an input's view, say)
                exc.add_note(_REFUSED)
                raise
            if not _leave_regions(module, traced[0]):
                raise
            state = get_fsdp_state(module)
            if traced[1] is not plain.__code__ or state is None or not state.is_root:
                exc.add_note("compiled_fsdp: part of this forward had run when the error came, so it is not "
                             "run again; from the next step on those modules are plain ones.")
                raise
            compiled_path().on_step(state.ctx)
            compat.restore_frame_callback(callback)  # (so that the forward is compiled again)


_REFUSED = ("compiled_fsdp: where the error names invoke_subgraph, torch refused a sharded block's compile "
            "region (config.comm.block_regions) after tracing it: a block may not return a view of its "
            "input, nor change an input in place ([Note: What a region returns] in compiled_fsdp/compile/"
            "regions.py). Return a copy (.clone()), or set compiled_fsdp.config.comm.block_regions = False before "
            "the first fully_shard to compile the blocks inline.")


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
    for i, (entry, after) in enumerate(zip(entries, [*entries[1:], None])):
        entry.region_order = entries
        entry.region_ahead = (i + 1,) if after is not None else ()
        if after is not None:
            gathers.chain(after.bucket_key(), entry.issue_backward_gather)
    if entries:  # (the first region's own first: issued ahead of the next, not queued behind it)
        entries[0].region_ahead = (0, *entries[0].region_ahead)
