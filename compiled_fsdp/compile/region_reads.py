"""The reads of compile regions, and their aliases of the local shards: a
read's settings from one guarded key, the issue-ahead's likewise, and each
alias's gradient handed to its parameter. See [Note: Blocks as compile
regions] in regions.py, whose numbered points (1), (2) are cited here."""
from __future__ import annotations

import json
import weakref
from functools import partial
from typing import Any

import torch

from compiled_fsdp.compile import install
from compiled_fsdp.compile.entry import CompiledEntry, entry_of, param_settings, read_kept, read_syncs
from compiled_fsdp.core import compat, registry
from compiled_fsdp.core.layout import from_canonical, to_canonical
from compiled_fsdp.core.marker import ENTRY_KEY, IssueAhead, Unshard
from compiled_fsdp.runtime.param import FSDPParam
from compiled_fsdp.runtime.param_group import FSDPParamGroup
from compiled_fsdp.runtime.reduces import copies_to_host

__all__ = ["in_a_region", "issue_ahead", "read_settings", "refresh", "traced_read"]


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
# before each region call (``issue_ahead``) takes its arguments from the
# same key, all but its group's key (the reads' must not differ between
# blocks): traced through the group and its specs, they cost 55 ms a block
# in Dynamo's trace (its own profiler, ``dynamo_profiler``, warm, 24 blocks),
# 34 ms after. Dynamo still wraps such a constant element by element, each
# element a source of the region's trace, and it re-maps every such source for
# each block it reuses the trace for. Wrapped anew at each read, one block's
# eleven reads gave 275 of its 417 traced sources. So ``read_settings`` gives
# the settings every parameter shares once and each parameter's others apart,
# and both decoders return the same object for the same key
# (``CompileSession.decoded``), which Dynamo wraps once per trace: 76 sources
# (a body's first trace 0.49 s -> 0.37 s at 32 blocks, warm). Tested by
# tests/test_block_regions.py::test_a_setting_changed_between_steps_recompiles.


# [Note: No DTensor inputs beside regions]
# A read inside a region takes a plain alias of the local shard (2). In a
# model with regions every other group's read in the outer graph does too
# (``CompiledEntry.reads_alias``, set each step): one ``DTensor`` input
# (the root's embedding, say) turns AOTAutograd's subclass handling on for
# the whole graph, which traces the joint once more to learn the outputs'
# subclass layout. Before [Note: One schema per region] (region_schema.py)
# each of those traces also re-traced every region call for its schema
# (``invoke_subgraph``'s mutation check): three a call instead of two, 26
# schema traces at 8 blocks under cProfile, 18 after; the extra trace of
# the joint itself remains. The aliases' gradients move into the ``DTensor``s'
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
                world_size=group.specs[0].world_size, param_dtype=first.param_dtype, device=first.gather_device,
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
def read_settings(key: str) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[tuple[str, Any], ...], ...]]:
    """The ``param_settings`` and ``_read_flags`` of the region's reads from
    its key: those every parameter shares, and each parameter's others, in
    the group's order (pairs). Indexed in the traced code, not here: Dynamo
    passes a constant result's arguments as constants, and torch 2.11 gave a
    parameter's index as a symbolic int in a second model's compile of the
    same code (tests/test_hsdp.py::test_replicate); indexing a constant tuple
    with it specializes it. The same object for the same key (see [Note: A
    region's read settings])."""
    return install.SESSION.decoded(key, _shared_and_own)


def _shared_and_own(key: str) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[tuple[str, Any], ...], ...]]:
    """(Shared by every trace and block: the traced code copies, never changes them.)"""
    reads = [_decode(settings) for settings in json.loads(_made(key))["reads"]]
    typed = [{(k, type(v), repr(v)) for k, v in read} for read in reads]  # (1 == True == 1.0: not equal here)
    shared = tuple((k, v) for k, v in reads[0] if all((k, type(v), repr(v)) in t for t in typed[1:]))
    return shared, tuple(tuple((k, v) for k, v in read if (k, v) not in shared) for read in reads)


def _made(key: str) -> str:
    if not key:  # (made by the root's pre-forward hook, run as Python: see [Note: Hooks under Dynamo])
        raise RuntimeError(
            "compiled_fsdp: a compile region (config.comm.block_regions) is traced inside a graph that also "
            "traces its sharded root's call, so the root's pre-forward never ran to prepare it. Compile the "
            "sharded root itself (torch.compile(model) or model.compile()), or set "
            "compiled_fsdp.config.comm.block_regions = False before fully_shard.")
    return key


# [Note: A block whose region never runs]
# A block is made a compile region by its class (``make_region``), so a
# ``forward`` of the instance's own (``module.forward = ...``, as a
# library's hooks set it: accelerate's) is called instead of the region, and
# Dynamo traces the block's reads in the outer graph. Taken as a region's
# reads there, they asked for gathers issued ahead that nothing issued, and
# the lowering left them to their markers' eager code: one collective per
# parameter, each way, and ``explain`` said "compile region". So a read is
# a region's only while Dynamo traces a region's body (``in_a_region``, from
# what the body records at trace time: [Note: Region calls traced once] in
# regions.py; which region is not asked:
# the block's group key, a constant argument, would be a guard that every
# other block fails); otherwise it is traced as the read of a block that is
# no region, gathered and reduced in the outer graph's buckets, and
# ``explain`` says why. Tested by
# tests/test_region_variants.py::test_a_block_with_its_own_forward_is_read_in_the_root_graph.
@torch._dynamo.assume_constant_result
def in_a_region() -> bool:
    """Whether Dynamo is tracing a compile region's body (at trace time; a
    constant to the traced code)."""
    calling = install.SESSION.regions.calling_now()
    return calling is not None and calling() is not None


def traced_read(entry: CompiledEntry, param: FSDPParam) -> torch.Tensor:
    """A read inside a compile region, traced (path.py's ``traced_read``
    otherwise): the alias of the local shard (2), ``ENTRY_KEY``, no per-block
    record (1), its gather taken from one issued ahead, and everything else
    from the region's key ([Note: A region's read settings])."""
    index = param.index
    shared, own = read_settings(entry.region_key)
    settings = dict(shared)
    settings.update(own[index])
    sync, sink = settings.pop("sync"), settings.pop("sink")
    shard_dim, plain = settings.pop("shard_dim"), settings.pop("plain")
    full = Unshard.call(shard=to_canonical(entry.region_shards[index], shard_dim), module_key=ENTRY_KEY,
                        kept=read_kept(param, sync, sink), sync=sync, take_ahead=True, **settings)
    full = full if shard_dim == 0 else from_canonical(full, shard_dim).contiguous()
    return full if plain else param.to_compute(full)


# The issue-ahead's settings (``_ahead_settings``' keys), in the order ``_ahead_of`` returns them.
_AHEAD = ("full_shapes", "group_name", "world_size", "param_dtype", "device", "canonical")


@torch._dynamo.assume_constant_result
def _ahead_of(key: str) -> tuple:
    return install.SESSION.decoded(key, _ahead_decoded)


def _ahead_decoded(key: str) -> tuple:
    settings = dict(_decode(json.loads(_made(key))["ahead"]))
    assert set(settings) == set(_AHEAD), sorted(settings)  # (_ahead_settings' keys, every one taken)
    return tuple(settings[name] for name in _AHEAD)


def issue_ahead(entry: CompiledEntry, after: list[torch.Tensor]) -> torch.Tensor:
    """``entry``'s region's gather, issued after ``after`` are computed
    (traced into the outer graph) for its ``regather`` to take; returns the
    token the region before it takes. Its arguments come from the region's
    key, as its reads' do ([Note: A region's read settings]), as a tuple
    (made a dict, Dynamo traced 90 more instructions a block). The token needs
    no gradient, and has none: the last region takes a token made without
    the op, and a token that required a gradient failed the first block's
    reuse check there, so Dynamo traced the region's body again for the last
    block of every model ([Note: A region traced again for an equal block]
    in region_variants.py found it)."""
    full_shapes, group_name, world_size, param_dtype, device, canonical = _ahead_of(entry.region_key)
    shards = entry.region_shards
    if not canonical:
        shards = [p.to_canonical(shards[p.index]) for p in entry.group.fsdp_params]
    with torch.no_grad():
        return IssueAhead.call(shards=shards, after=after, module_key=entry.group.key, full_shapes=full_shapes,
                               group_name=group_name, world_size=world_size, param_dtype=param_dtype, device=device)


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
                registry.CORE.later_reduces.receive(alias, partial(_add_reduced_rows, weakref.ref(p),
                                                                   weakref.ref(group)))


def _move_grad(param_ref: weakref.ref, alias: torch.Tensor) -> None:
    """The alias's gradient into its ``DTensor``'s ``.grad`` (2); none
    without sync, where the graph returns none for it."""
    grad, alias.grad = alias.grad, None
    if grad is not None:
        _add_grad(param_ref, grad)


def _add_reduced_rows(param_ref: weakref.ref, group_ref: weakref.ref, grad: torch.Tensor) -> None:
    """A later reduce's rows (on the compute device) for its parameter: under
    CPU offload on a device with streams, copied to the host without
    blocking and landed with the group's own at the end of backward ([Note:
    Offloaded gradients land at the end of backward] in runtime/reduces.py);
    otherwise added at once (``_add_grad``)."""
    param, group = param_ref(), group_ref()
    streams = group.ctx.streams if group is not None and group.ctx is not None else None
    if param is not None and copies_to_host(param, streams):
        with compat.no_spmd_typecheck():  # (as ``_add_grad``)
            group.reduces.copy_to_host([(param, param.to_canonical(grad))], streams)
        registry.CORE.later_reduces.land_after(group.key, partial(_land, group_ref))
    else:
        _add_grad(param_ref, grad)


def _land(group_ref: weakref.ref) -> None:
    group = group_ref()
    if group is not None:
        with compat.no_spmd_typecheck():
            group.reduces.land()


def _add_grad(param_ref: weakref.ref, grad: torch.Tensor) -> None:
    """``grad`` (the local rows) added to its parameter's ``.grad``."""
    param = param_ref()
    if param is None:
        return
    with compat.no_spmd_typecheck():  # (as the eager runtime's reductions: [Note: spmd_types parameters])
        param.add_grad(param.to_canonical(grad))
