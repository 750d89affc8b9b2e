"""The unit choice on hand-built inputs and graphs (no process group). See
[Note: Units] in passes/units.py."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import compiled_fsdp.core.ops  # noqa: F401  (registers the marker ops)
from compiled_fsdp.passes import plan_lowering, run_joint_passes
from compiled_fsdp.passes.config import overlap
from compiled_fsdp.passes.graph import chain_tag, is_unshard, parse_marker
from compiled_fsdp.passes.units import SlotUse, choose_units

KB = 1024
BUCKET = 256 * KB  # the default threshold: merges pieces below it and below 1/8 of the largest


def _path(*names: str) -> tuple:
    # Stack keys are opaque ids (Dynamo uses id(module)); the name is for display.
    return tuple((f"key:{n}", n) for n in names)


def _gpt_uses() -> list[SlotUse]:
    """A root that calls embed, reads pos itself, calls two blocks (each with
    attn and mlp), a norm and a head -- parameter index, path, use, bytes."""
    rows = [
        (0, (), 1, 4 * KB),  # pos, read by the root itself, after embed
        (1, _path("embed"), 0, 64 * KB),
        (2, _path("layers.0", "layers.0.attn"), 2, 100 * KB),
        (3, _path("layers.0", "layers.0.mlp"), 3, 200 * KB),
        (4, _path("layers.1", "layers.1.attn"), 4, 100 * KB),
        (5, _path("layers.1", "layers.1.mlp"), 5, 200 * KB),
        (6, _path("norm"), 6, 1 * KB),
        (7, _path("head"), 7, 64 * KB),
    ]
    return [SlotUse(i, p, t, t, b) for i, p, t, b in rows]


def _layout(units) -> list[tuple]:
    return [(u.modules, u.param_indices, u.reshard_after_forward) for u in units]


def test_root_splits_into_the_modules_it_calls() -> None:
    units = choose_units(0, _gpt_uses(), outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert _layout(units) == [
        (("embed", "<compiled module> (own reads)"), (0, 1), True),  # pos is small: merged
        (("layers.0",), (2, 3), True),
        (("layers.1", "norm"), (4, 5, 6), True),  # so is the norm
        (("head",), (7,), False),  # used last in forward: kept for backward
    ]
    assert [u.index for u in units] == list(range(4))
    assert units[1].nbytes == 300 * KB
    assert "a module the root calls" in units[1].reason
    assert "small neighbours merged" in units[0].reason
    assert "not resharded" in units[-1].reason
    # Without merging (threshold 0) every module the root calls is a unit.
    units = choose_units(0, _gpt_uses(), outermost=True, reshard=True, bucket_bytes=0, max_bytes=None)
    assert [u.modules for u in units] == [
        ("embed",), ("<compiled module> (own reads)",), ("layers.0",), ("layers.1",), ("norm",),
        ("head",)]


def test_small_pieces_merge_only_with_neighbours_in_use_order() -> None:
    """The root's leftovers when the user nested the blocks: pos (read first)
    and norm (read last) are not neighbours; each joins its adjacent piece."""
    uses = [u for u in _gpt_uses() if u.param_index in (0, 1, 6, 7)]
    others = [2, 3, 4, 5]  # the nested blocks' parameters are read in between
    units = choose_units(9, uses, outermost=True, reshard=True, bucket_bytes=BUCKET,
                         max_bytes=None, others=others)
    assert _layout(units) == [
        (("embed", "<compiled module> (own reads)"), (0, 1), True),
        (("norm", "head"), (6, 7), False),
    ]


def test_reshard_off_keeps_every_unit() -> None:
    units = choose_units(0, _gpt_uses(), outermost=True, reshard=False, bucket_bytes=BUCKET, max_bytes=None)
    assert not any(u.reshard_after_forward for u in units)


def test_a_nested_application_is_one_unit() -> None:
    """The user's own nesting is respected: a block sharded on its own stays whole."""
    uses = [u for u in _gpt_uses() if u.param_index in (2, 3)]
    units = choose_units(3, uses, outermost=False, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert _layout(units) == [(("layers.0",), (2, 3), True)]
    assert "nesting" in units[0].reason


def test_the_opening_block_is_cut_by_first_use() -> None:
    """[Note: The step's opening block cut by first use]: the nested block
    read first is cut at the modules it calls, as the root is; its norms
    merge with a neighbour."""
    norm = [SlotUse(8, _path("layers.0", "layers.0.norm1"), 1, 1, 1 * KB),
            SlotUse(9, _path("layers.0", "layers.0.norm2"), 2, 2, 1 * KB)]
    uses = [dataclasses.replace(u, nbytes=3 * u.nbytes) for u in _gpt_uses() if u.param_index in (2, 3)] + norm
    units = choose_units(3, uses, outermost=False, reshard=True, bucket_bytes=BUCKET, max_bytes=None,
                         opening=True)
    assert _layout(units) == [(("layers.0.norm1", "layers.0.attn", "layers.0.norm2"), (2, 8, 9), True),
                              (("layers.0.mlp",), (3,), True)]
    assert "the step's opening block" in units[1].reason
    # A part below the bucket threshold (the attention's 100 KiB) is not worth a collective: one
    # unit, though it is more than 1/8 of the largest piece.
    uses = [u for u in _gpt_uses() if u.param_index in (2, 3)] + norm
    units = choose_units(3, uses, outermost=False, reshard=True, bucket_bytes=BUCKET, max_bytes=None,
                         opening=True)
    assert [u.param_indices for u in units] == [(2, 3, 8, 9)]
    assert "the user's fully_shard nesting" in units[0].reason, units[0].reason  # (whole: said so)


def test_ceiling_splits_at_submodules() -> None:
    units = choose_units(0, _gpt_uses(), outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=150 * KB)
    assert [u.modules for u in units][1:5] == [
        ("layers.0.attn",), ("layers.0.mlp",), ("layers.1.attn",), ("layers.1.mlp", "norm")]
    assert "split from layers.0" in units[1].reason
    nested = choose_units(3, [u for u in _gpt_uses() if u.param_index in (2, 3)],
                          outermost=False, reshard=True, bucket_bytes=BUCKET, max_bytes=150 * KB)
    assert [u.modules for u in nested] == [("layers.0.attn",), ("layers.0.mlp",)]


def test_a_container_holding_most_of_the_root_is_split() -> None:
    """Blocks inside an ``nn.Sequential`` called as one module: that child holds
    more than half of the root, so it splits into the blocks."""
    uses = [
        SlotUse(0, _path("embed"), 0, 0, 10 * KB),
        SlotUse(1, _path("trunk", "trunk.0"), 1, 1, 100 * KB),
        SlotUse(2, _path("trunk", "trunk.1"), 2, 2, 100 * KB),
        SlotUse(3, _path("trunk", "trunk.2"), 3, 3, 100 * KB),
        SlotUse(4, _path("head"), 4, 4, 10 * KB),
    ]
    units = choose_units(0, uses, outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert [u.modules for u in units] == [
        ("embed", "trunk.0"), ("trunk.1",), ("trunk.2", "head")]


def test_a_wrapper_root_splits_below_the_common_path() -> None:
    """A root whose every parameter is read inside one child (a wrapper) is cut
    at that child's calls: the application's node is the path all share."""
    uses = [SlotUse(i, _path("inner", f"inner.{i}"), i, i, 50 * KB) for i in range(3)]
    units = choose_units(0, uses, outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert [u.modules for u in units] == [("inner.0",), ("inner.1",), ("inner.2",)]


def test_a_wrapper_above_the_ceiling_is_looked_through() -> None:
    """A piece read inside one module only (an encoder wrapping a container of
    blocks) splits at that module's calls when above the ceiling."""
    uses = [SlotUse(0, _path("embed"), 0, 0, 10 * KB)] + [
        SlotUse(i, _path("enc", "enc.trunk", f"enc.trunk.{i}"), i, i, 100 * KB) for i in (1, 2, 3)]
    units = choose_units(0, uses, outermost=True, reshard=True, bucket_bytes=0, max_bytes=None)
    assert [u.modules for u in units] == [
        ("embed",), ("enc.trunk.1",), ("enc.trunk.2",), ("enc.trunk.3",)]


def test_tied_weight_unit_is_kept_and_stays_whole() -> None:
    """A weight read first (embedding) and last (head) belongs to its first
    reader's unit, whose last use is then the last of all: kept for backward."""
    uses = [
        SlotUse(0, _path("embed"), 0, 9, 64 * KB),  # also read by the head at 9
        SlotUse(1, _path("block"), 1, 1, 300 * KB),
        SlotUse(2, _path("norm"), 2, 2, 1 * KB),
    ]
    units = choose_units(0, uses, outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert _layout(units) == [(("embed",), (0,), False), (("block", "norm"), (1, 2), True)]


def test_no_module_stack_gives_one_unit() -> None:
    uses = [SlotUse(i, (), i, i, KB) for i in range(3)]
    units = choose_units(0, uses, outermost=True, reshard=True, bucket_bytes=BUCKET, max_bytes=None)
    assert _layout(units) == [(("<compiled module>",), (0, 1, 2), False)]
    assert "no module calls" in units[0].reason


# --- the lowering on a hand-built joint graph with module stacks -------------

N = 2
GROUP = "fake_group"
SHAPES = [[48, 48]] * 3  # 9 KiB each: comparable, never merged


def _graph() -> fx.GraphModule:
    """One outermost application whose three weights are read by three modules
    in turn (``a``, ``b``, ``c``), as Dynamo would record them."""

    def joint(s0, s1, s2, x):
        h = x
        for i, s in enumerate((s0, s1, s2)):
            w = torch.ops.compiled_fsdp.unshard(s, SHAPES[i], GROUP, N, 0, i, s.shape[0], True,
                                                outermost=True)
            h = torch.tanh(h @ w.t())
        out = h.sum()
        return (out, *torch.autograd.grad(out, (s0, s1, s2)))

    shards = [torch.randn(24, 48, requires_grad=True) for _ in range(3)]
    gm = make_fx(joint, tracing_mode="fake")(*shards, torch.randn(4, 48))
    for node in gm.graph.nodes:
        if is_unshard(node):
            i = parse_marker(node)[1].param_index
            node.meta["nn_module_stack"] = {f"k{i}": ("L['self']." + "abc"[i], torch.nn.Linear)}
    return gm


def test_lowering_buckets_per_unit() -> None:
    gm = _graph()
    plan = plan_lowering(gm, bucket_bytes=overlap.bucket_bytes)
    assert [(u.modules, u.reshard_after_forward) for u in plan.units] == [
        (("a",), True), (("b",), True), (("c",), False)]
    assert [(b.kind, b.units, b.reshard_after_forward) for b in plan.buckets] == [
        ("gather", [(0, 0)], True), ("gather", [(0, 1)], True), ("gather", [(0, 2)], False),
        ("reduce", [(0, 0)], None), ("reduce", [(0, 1)], None), ("reduce", [(0, 2)], None),
    ]
    report = run_joint_passes(gm)
    assert report.lowering.count("gather") == 3 and report.lowering.count("reduce") == 3
    ag = torch.ops._c10d_functional.all_gather_into_tensor.default
    tags = {chain_tag(n).unit: n.meta["recompute"] for n in gm.graph.nodes if n.target is ag}
    assert tags == {0: CheckpointPolicy.MUST_RECOMPUTE, 1: CheckpointPolicy.MUST_RECOMPUTE,
                    2: CheckpointPolicy.MUST_SAVE}


def test_units_off_is_one_bucket_per_application() -> None:
    gm = _graph()
    overlap.units = False
    try:
        plan = plan_lowering(gm)
    finally:
        overlap.units = True
    assert [(b.kind, b.units, b.reshard_after_forward) for b in plan.buckets] == [
        ("gather", [(0, 0)], False), ("reduce", [(0, 0)], None)]


def _nested_graph() -> fx.GraphModule:
    """A root (module 0: ``embed``, then ``head``) around two nested blocks
    (modules 1 and 2), each reading ``attn`` then ``mlp``."""
    reads = [(0, 0, "embed"), (1, 0, "layers.0.attn"), (1, 1, "layers.0.mlp"),
             (2, 0, "layers.1.attn"), (2, 1, "layers.1.mlp"), (0, 1, "head")]

    def joint(*args):
        *shards, x = args
        h = x
        for s, (key, index, _) in zip(shards, reads):
            w = torch.ops.compiled_fsdp.unshard(s, [48, 48], GROUP, N, key, index, s.shape[0], True,
                                                outermost=key == 0)
            h = torch.tanh(h @ w.t())
        out = h.sum()
        return (out, *torch.autograd.grad(out, shards))

    shards = [torch.randn(24, 48, requires_grad=True) for _ in reads]
    gm = make_fx(joint, tracing_mode="fake")(*shards, torch.randn(4, 48))
    by_read = {(key, index): name for key, index, name in reads}
    for node in gm.graph.nodes:
        if is_unshard(node):
            args = parse_marker(node)[1]
            name = by_read[(args.module_key, args.param_index)]
            stack = [(f"k{name}", ("L['self']." + name, torch.nn.Linear))]
            if name.startswith("layers"):
                stack.insert(0, (f"k{name[:8]}", ("L['self']." + name[:8], torch.nn.Module)))
            node.meta["nn_module_stack"] = dict(stack)
    return gm


def test_only_the_opening_block_is_cut_in_the_lowering() -> None:
    """The first nested block gathers and reduces as two buckets, the second
    as one; ``split_opening`` off, both whole ([Note: The step's opening
    block cut by first use])."""
    plan = plan_lowering(_nested_graph(), bucket_bytes=0)
    gathers = sorted(b.units for b in plan.buckets if b.kind == "gather")
    assert gathers == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)], [(2, 0)]], gathers
    reduces = sorted(b.units for b in plan.buckets if b.kind == "reduce")
    assert reduces == gathers
    overlap.split_opening = False
    try:
        plan = plan_lowering(_nested_graph(), bucket_bytes=0)
    finally:
        overlap.split_opening = True
    assert sorted(b.units for b in plan.buckets if b.kind == "gather") == [[(0, 0)], [(0, 1)], [(1, 0)], [(2, 0)]]
