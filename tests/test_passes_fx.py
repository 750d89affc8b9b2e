"""Pure-FX tests of compiled_fsdp.passes on hand-built joint graphs.

The graphs are traced with make_fx on fake tensors through autograd, so they
look like AOTAutograd joint graphs: unshard markers in the forward part and
reduce_grad markers (plus the ``add`` accumulating duplicates) in the
backward part. No process group is needed: the group name is fake.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import compiled_fsdp.core.ops  # noqa: F401  (registers the marker ops)
from compiled_fsdp.compile import install as _compile
from compiled_fsdp.passes import (
    FSDP_AC_GRAPH_ID,
    apply_lowering,
    lower_markers,
    plan_lowering,
    run_joint_passes,
    tag_recompute,
)
from compiled_fsdp.passes.graph import chain_tag, through_identity_views

from _graphs import AG, U, ancestors, calls, chain_role, marker_nodes, shard_shape

c10d = torch.ops._c10d_functional
GROUP = "fake_group"


def _joint(fn, shapes: list[list[int]], n: int, extra: list[torch.Tensor], rank: int = 0,
           device: str = "cpu") -> fx.GraphModule:
    """make_fx of ``fn(*shards, *extra)`` followed by autograd.grad w.r.t. the
    shards, as rank ``rank`` traces it."""

    def joint(*args):
        shards = args[: len(shapes)]
        out = fn(*args)
        grads = torch.autograd.grad(out, shards, allow_unused=True)
        return (out, *grads)

    shards = [torch.randn(shard_shape(s, n, rank), requires_grad=True, device=device) for s in shapes]
    return make_fx(joint, tracing_mode="fake")(*shards, *[e.to(device) for e in extra])


def _two_module_graph(n: int = 2, tied: bool = True, raf1: bool = False, device: str = "cpu") -> fx.GraphModule:
    """module 0: W (5, 4) + b (5), W read twice if tied; module 1: W2 (3, 5)."""

    def fn(s_w, s_b, s_w2, x):
        w = U(s_w, [5, 4], GROUP, n, 0, 0, True)
        b = U(s_b, [5], GROUP, n, 0, 1, True)
        w2 = U(s_w2, [3, 5], GROUP, n, 1, 0, raf1)
        h = torch.relu(torch.nn.functional.linear(x, w, b))
        if tied:
            w_again = U(s_w, [5, 4], GROUP, n, 0, 0, True)
            h = h + torch.nn.functional.linear(x, w_again).sum()
        return torch.nn.functional.linear(h, w2).sum()

    return _joint(fn, [[5, 4], [5], [3, 5]], n, [torch.randn(7, 4)], device=device)


def test_markers_present_before_lowering() -> None:
    gm = _two_module_graph()
    names = [str(m.target) for m in marker_nodes(gm)]
    assert names.count("compiled_fsdp.unshard.default") == 4
    assert names.count("compiled_fsdp.reduce_grad.default") == 4


def test_one_bucket_per_module_and_markers_gone() -> None:
    gm = _two_module_graph()
    report = run_joint_passes(gm)
    assert report.has_markers and report.changed
    low = report.lowering
    assert [(b.kind, b.module_key, b.param_indices) for b in low.buckets] == [
        ("gather", 0, [0, 1]), ("gather", 1, [0]), ("reduce", 0, [0, 1]), ("reduce", 1, [0]),
    ]
    assert low.skipped == []
    assert marker_nodes(gm) == []
    assert len(calls(gm, c10d.all_gather_into_tensor.default)) == 2
    assert len(calls(gm, c10d.reduce_scatter_tensor.default)) == 2
    assert len(calls(gm, c10d.wait_tensor.default)) == 4
    # bucket sizes: module 0 = 3*4 + 3 shard elements, module 1 = 2*5
    assert [b.numel for b in low.buckets] == [15, 10, 15, 10]


def test_every_node_has_val() -> None:
    gm = _two_module_graph()
    run_joint_passes(gm)
    for node in gm.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node.format_node()


def test_gather_output_shapes_and_layout() -> None:
    gm = _two_module_graph(n=2)
    run_joint_passes(gm)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    assert [tuple(g.meta["val"].shape) for g in gathers] == [(30,), (20,)]
    # module 0 input: its shards packed in param_index order, one op ([Note: One copy-out per bucket])
    pack = gathers[0].args[0]
    assert pack.target is torch.ops.compiled_fsdp.pack_bucket.default
    assert [a.meta["val"].numel() for a in pack.args[0]] == [12, 3]
    rs = calls(gm, c10d.reduce_scatter_tensor.default)
    assert [r.args[1] for r in rs] == ["sum", "sum"]
    assert sorted(tuple(r.meta["val"].shape) for r in rs) == [(10,), (15,)]
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    assert [tuple(o.meta["val"].shape) for o in outputs[1:]] == [(3, 4), (3,), (2, 5)]


def test_copies_are_aten_ops_off_the_cpu() -> None:
    """[Note: One copy-out per bucket]: the one-op copies are for buckets on
    the CPU; elsewhere (a GPU; here the meta device stands for one) the
    bucket's pack, copy-out and gradient pack stay aten ops for Inductor to
    fuse. So does the reduce's division ([Note: The reduce's arithmetic as
    ops on the CPU]), which on the CPU runs the layout's own ``average``."""
    copy_ops = {torch.ops.compiled_fsdp.pack_bucket.default, torch.ops.compiled_fsdp.unpack_bucket.default,
                torch.ops.compiled_fsdp.pack_bucket_grads.default, torch.ops.compiled_fsdp.average_bucket.default}
    on = {device: _two_module_graph(n=2, device=device) for device in ("cpu", "meta")}
    for gm in on.values():
        run_joint_passes(gm)
    targets = {device: {n.target for n in gm.graph.nodes if n.op == "call_function"} for device, gm in on.items()}
    assert targets["cpu"] >= copy_ops
    assert not targets["meta"] & copy_ops
    # On the CPU a bucket of one parameter packs by the op too: its aten pack
    # (a pad of zero rows) is a clone, one more C++ kernel to build.
    packs = [g.args[0].target for g in calls(on["cpu"], c10d.all_gather_into_tensor.default)]
    assert packs == [torch.ops.compiled_fsdp.pack_bucket.default] * 2
    gathers = calls(on["meta"], c10d.all_gather_into_tensor.default)
    assert [g.args[0].target for g in gathers] == [torch.ops.aten.cat.default, torch.ops.aten.view.default]
    assert [tuple(g.meta["val"].shape) for g in gathers] == [(30,), (20,)]
    assert len(calls(on["meta"], torch.ops.aten.div.Tensor)) == 2  # (one per bucket, for Inductor to fuse)
    assert not calls(on["cpu"], torch.ops.aten.div.Tensor)
    averaged = calls(on["cpu"], torch.ops.compiled_fsdp.average_bucket.default)
    assert [(a.args[0].target, a.args[1]) for a in averaged] == [(c10d.wait_tensor.default, 2.0)] * 2


def test_duplicate_reduce_grads_are_summed_before_one_reduce_scatter() -> None:
    gm = _two_module_graph(tied=True)
    before = len(calls(gm, torch.ops.aten.add.Tensor))
    report = run_joint_passes(gm)
    assert report.lowering.buckets[2].markers_replaced == 3  # 2 reads of W + b
    # the add of two reduce_grad outputs is gone; one add of two full grads appears
    rs0 = next(r for r in calls(gm, c10d.reduce_scatter_tensor.default) if r.meta["val"].shape[0] == 15)
    full_grad_adds = [
        a for a in calls(gm, torch.ops.aten.add.Tensor) if tuple(a.meta["val"].shape) == (5, 4)
    ]
    assert len(full_grad_adds) == 1
    assert len(calls(gm, torch.ops.aten.add.Tensor)) == before  # one removed, one added
    assert full_grad_adds[0] in ancestors(rs0)  # that add feeds module 0's reduce-scatter


def test_recompute_tags() -> None:
    gm = _two_module_graph(raf1=False)
    report = run_joint_passes(gm)
    assert report.recompute.buckets_recompute == ["0.0"]
    assert report.recompute.buckets_save == ["1.0"]
    for node in gm.graph.nodes:
        info = chain_tag(node)
        if info and info.role == "gather_chain":
            want = CheckpointPolicy.MUST_RECOMPUTE if info.module_key == 0 else CheckpointPolicy.MUST_SAVE
            assert node.meta["recompute"] == want, node.format_node()
            assert node.meta["ac_graph_id"] == FSDP_AC_GRAPH_ID
        elif info and info.role == "reduce_chain":
            assert "recompute" not in node.meta
    # the whole chain is tagged: cat, gather, wait and every view/slice/clone
    ag = calls(gm, c10d.all_gather_into_tensor.default)[0]
    assert ag.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert ag.args[0].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    chain, frontier = [], list(ag.users)
    while frontier:
        cur = frontier.pop()
        if chain_role(cur) == "gather_chain":
            chain.append(cur)
            frontier.extend(cur.users)
    # (the parameters copied out by one op: [Note: One copy-out per bucket])
    assert torch.ops.compiled_fsdp.unpack_bucket.default in {c.target for c in chain}
    assert len(chain) >= 4 and all(c.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE for c in chain)


def test_forward_side_metadata_kept_for_partitioner() -> None:
    gm = _two_module_graph()
    run_joint_passes(gm)
    wait_of_rs = [w for w in calls(gm, c10d.wait_tensor.default)
                  if w.args[0].target is c10d.reduce_scatter_tensor.default]
    assert len(wait_of_rs) == 2


def test_noop_without_markers() -> None:
    def fn(w, x):
        return torch.nn.functional.linear(x, w).relu().sum()

    gm = _joint(fn, [[3, 4]], 1, [torch.randn(2, 4)])
    code, nodes = gm.code, [(n.name, n.target, n.args) for n in gm.graph.nodes]
    report = run_joint_passes(gm)
    assert not report.has_markers and not report.changed
    assert gm.code == code and [(n.name, n.target, n.args) for n in gm.graph.nodes] == nodes
    assert all("recompute" not in n.meta for n in gm.graph.nodes)


def test_deterministic() -> None:
    codes = []
    for _ in range(2):
        gm = _two_module_graph()
        run_joint_passes(gm)
        codes.append(gm.code)
    assert codes[0] == codes[1]


def test_plan_apply_split() -> None:
    gm = _two_module_graph()
    code = gm.code
    plan = plan_lowering(gm)
    assert gm.code == code  # planning does not mutate
    assert [(b.kind, b.module_key) for b in plan.buckets] == [
        ("gather", 0), ("gather", 1), ("reduce", 0), ("reduce", 1)]
    report = apply_lowering(gm, plan)
    assert report.count("gather") == 2 and report.count("reduce") == 2
    assert tag_recompute(gm).must_recompute > 0


def _uneven_world_3(rank: int) -> fx.GraphModule:
    n = 3

    def fn(s_scale, s_w, x):
        scale = U(s_scale, [1], GROUP, n, 7, 0, True)
        w = U(s_w, [5, 2], GROUP, n, 7, 1, True)
        return (torch.nn.functional.linear(x, w) * scale).sum()

    gm = _joint(fn, [[1], [5, 2]], n, [torch.randn(4, 2)], rank)
    report = run_joint_passes(gm)
    assert report.lowering.count("gather") == 1 and report.lowering.count("reduce") == 1
    assert marker_nodes(gm) == []
    return gm


def test_uneven_shards_world_3() -> None:
    """Rank 2 of 3 holds no row of a 1-row parameter and one of a 5-row one: the
    bucket pads them to the common shard shape, and every rank's graph runs the
    same ops (see [Note: Rank-independent graphs] in compiled_fsdp/core/layout.py)."""
    graphs = [_uneven_world_3(rank) for rank in range(3)]
    for rank, gm in enumerate(graphs):
        ag = calls(gm, c10d.all_gather_into_tensor.default)[0]
        assert tuple(ag.meta["val"].shape) == (3 * (1 + 4),)  # padded shards (1,) and (2, 2)
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        want = {0: [(1,), (2, 2)], 1: [(0,), (2, 2)], 2: [(0,), (1, 2)]}[rank]
        assert [tuple(o.meta["val"].shape) for o in outputs[1:]] == want
    ops = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs]
    assert ops[0] == ops[1] == ops[2]


def test_mixed_dtypes_gather_as_bytes_and_reduce_per_parameter() -> None:
    """The gathers of parameters of two dtypes share one byte bucket ([Note:
    Byte buckets]); their reduces, of two dtypes too, fall back to markers."""
    def fn(s_a, s_b, x):
        a = U(s_a, [4, 2], GROUP, 2, 0, 0, True)
        b = U(s_b.double(), [4, 2], GROUP, 2, 0, 1, True)
        return (torch.nn.functional.linear(x, a).sum() + (b * 2).sum().float())

    gm = _joint(fn, [[4, 2], [4, 2]], 2, [torch.randn(5, 2)])
    report = run_joint_passes(gm)
    assert [s[:2] for s in report.lowering.skipped] == [("reduce", 0)]
    assert "mixed dtypes" in report.lowering.skipped[0][2]
    (gather,) = calls(gm, c10d.all_gather_into_tensor.default)
    # 2 rows of 2 float32 and 2 rows of 2 float64 a rank, as bytes
    assert gather.args[0].meta["val"].dtype == torch.uint8 and gather.args[0].meta["val"].numel() == 2 * 8 + 2 * 16
    assert [m for m in marker_nodes(gm) if "unshard" in str(m.target)] == []
    # the leftover reduce markers' gradients; the byte gather is tagged for reshard-after-forward
    assert gather.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE


@pytest.fixture
def single_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    fd, path = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()
    if os.path.exists(path):
        os.unlink(path)


def test_lowered_graph_matches_markers_numerically(single_rank_group: str) -> None:
    g = single_rank_group

    def fn(s_w, s_b, x):
        w = U(s_w, [5, 4], g, 1, 0, 0, True)
        b = U(s_b, [5], g, 1, 0, 1, True)
        w2 = U(s_w, [5, 4], g, 1, 0, 0, True)
        return (torch.nn.functional.linear(x, w, b) * torch.nn.functional.linear(x, w2)).sum()

    def joint(s_w, s_b, x):
        out = fn(s_w, s_b, x)
        return (out, *torch.autograd.grad(out, [s_w, s_b]))

    args = [torch.randn(5, 4, requires_grad=True), torch.randn(5, requires_grad=True), torch.randn(3, 4)]
    gm = make_fx(joint, tracing_mode="fake")(*args)
    expected = gm(*args)  # markers run their eager (real) implementations
    lower_markers(gm)
    assert marker_nodes(gm) == []
    got = gm(*args)
    for e, r in zip(expected, got):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_windows_install_compose_and_restore() -> None:
    """See [Note: Passes installed while compiling] in compiled_fsdp/compile/install.py:
    a window installs our joint pass before a user's (theirs still runs) and
    our scheduling pass after theirs; windows nest; the last one to close
    restores exactly what the user had."""
    from torch._functorch import config as fc
    from torch._inductor import config as ic

    from compiled_fsdp.core import compat

    seen = []

    def user_pass(gm, inputs):
        seen.append(gm)
        return gm

    old_joint, old_post = fc.joint_custom_pass, ic.post_grad_custom_post_pass
    try:
        fc.joint_custom_pass = user_pass
        with _compile.installed():
            with _compile.installed():  # nested: one install
                assert fc.joint_custom_pass.inner is user_pass
                assert len(compat.post_grad_passes(ic.post_grad_custom_post_pass)) == 1 + (old_post is not None)
            assert fc.joint_custom_pass is not user_pass  # still open
            with _compile.recording() as rec:
                gm = _two_module_graph()
                out = fc.joint_custom_pass(gm, None)
                assert out is gm and seen == [gm] and marker_nodes(gm) == []
                assert len(rec.joint) == 1
                gm2 = _joint(lambda w, x: (x @ w).sum(), [[4, 2]], 1, [torch.randn(3, 4)])
                fc.joint_custom_pass(gm2, None)
                assert len(rec.joint) == 1  # no markers -> no report
        assert fc.joint_custom_pass is user_pass
        assert ic.post_grad_custom_post_pass == old_post
    finally:
        fc.joint_custom_pass, ic.post_grad_custom_post_pass = old_joint, old_post


BF16, CAST = torch.bfloat16, torch.ops.prims.convert_element_type.default


def _mixed_precision_graph(device: str = "cpu") -> fx.GraphModule:
    """module 0 gathers in bf16 and reduces in fp32 (W read twice); module 1 is fp32."""

    def fn(s_w, s_w2, x):
        mp = {"param_dtype": BF16, "reduce_dtype": torch.float32}
        w = U(s_w, [6, 4], GROUP, 2, 0, 0, True, **mp)
        w_again = U(s_w, [6, 4], GROUP, 2, 0, 0, True, **mp)
        w2 = U(s_w2, [3, 6], GROUP, 2, 1, 0, True)
        h = torch.nn.functional.linear(x.to(BF16), w) * torch.nn.functional.linear(x.to(BF16), w_again)
        return torch.nn.functional.linear(h.float(), w2).sum()

    return _joint(fn, [[6, 4], [3, 6]], 2, [torch.randn(5, 4)], device=device)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_mixed_precision_casts_sit_in_the_chains(device: str) -> None:
    """See [Note: Mixed precision]: the shard is cast before the gather (so the
    gather moves bf16) and the cast is tagged with the chain, so it is recomputed
    with the gather; the two bf16 gradients of W are summed, cast to fp32 once and
    reduced in fp32; the shard gradient is fp32. A bf16 and an fp32 bucket are
    never merged, however small. On the CPU the cast is the bucket's pack op's
    ([Note: One copy-out per bucket]); the meta device stands for a GPU."""
    gm = _mixed_precision_graph(device)
    report = apply_lowering(gm, plan_lowering(gm, bucket_bytes=1 << 30))
    tag_recompute(gm)
    gathers = sorted(calls(gm, c10d.all_gather_into_tensor.default),
                     key=lambda n: chain_tag(n).module_key)
    assert [g.args[0].meta["val"].dtype for g in gathers] == [BF16, torch.float32]
    assert report.count("gather") == 2
    casts = [c for c in calls(gm, CAST) if chain_role(c) == "gather_chain"]
    if device == "cpu":
        assert not casts
        pack = gathers[0].args[0]
        assert pack.target is torch.ops.compiled_fsdp.pack_bucket.default and pack.args[-1] == BF16
        assert [s.op for s in pack.args[0]] == ["placeholder"]  # the fp32 shard itself
        assert pack.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    else:
        assert len(casts) == 1 and casts[0].args[1] == BF16
        assert casts[0].meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert casts[0].args[0].op == "placeholder"  # the fp32 shard itself
    reduces = sorted(calls(gm, c10d.reduce_scatter_tensor.default),
                     key=lambda n: chain_tag(n).module_key)
    assert [r.args[0].meta["val"].dtype for r in reduces] == [torch.float32, torch.float32]
    grad_casts = [c for c in calls(gm, CAST) if chain_role(c) == "reduce_chain"]
    assert len(grad_casts) == 1 and grad_casts[0].args[0].target is torch.ops.aten.add.Tensor
    assert grad_casts[0].args[0].meta["val"].dtype == BF16  # summed in bf16, then cast
    out = gm.graph.output_node().args[0]
    assert [o.meta["val"].dtype for o in out[1:]] == [torch.float32, torch.float32]


def _no_sync_graph(sync: bool, device: str = "cpu", with_kept: bool = True) -> fx.GraphModule:
    """One module, W read twice, reduce in fp32 from bf16 compute. ``sync=False``:
    the second input is the gradient sink; ``sync=True``: a kept gradient
    (``with_kept=False``: nothing kept, one micro-batch's step)."""

    def joint(s_w, kept, x):
        mp = {"param_dtype": BF16, "reduce_dtype": torch.float32, "kept": kept if with_kept else None,
              "sync": sync}
        w = U(s_w, [6, 4], GROUP, 2, 0, 0, True, **mp)
        w_again = U(s_w, [6, 4], GROUP, 2, 0, 0, True, **mp)
        out = (torch.nn.functional.linear(x, w) * torch.nn.functional.linear(x, w_again)).sum()
        wrt = [s_w] if sync else [kept]
        return (out, *torch.autograd.grad(out, wrt))

    kept = torch.empty_strided((6, 4), (0, 0), device=device).requires_grad_(not sync)
    if sync:
        kept = torch.randn(6, 4, device=device)
    shard = torch.randn(3, 4, requires_grad=True, device=device)
    return make_fx(joint, tracing_mode="fake")(shard, kept, torch.randn(5, 4, dtype=BF16, device=device))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_kept_gradients_without_sync(device: str) -> None:
    """See [Note: Accumulation without sync in graphs]. Without sync the backward
    has no collective: the two reads' bf16 gradients are summed and cast to fp32
    for the sink. With sync, the kept fp32 gradient is added to the cast sum
    before the one reduce-scatter: on the CPU by the bucket's pack op, so the
    graph is op for op the one that keeps nothing ([Note: Kept gradients added
    where the bucket is packed]); on the meta device, which stands for a GPU,
    by an add in the graph."""
    off = _no_sync_graph(sync=False, device=device)
    report = run_joint_passes(off)
    assert [b.kind for b in report.lowering.buckets] == ["gather", "keep"]
    assert marker_nodes(off) == [] and not calls(off, c10d.reduce_scatter_tensor.default)
    sink_grad = off.graph.output_node().args[0][1]
    assert sink_grad.target is CAST and sink_grad.args[0].target is torch.ops.aten.add.Tensor
    assert tuple(sink_grad.meta["val"].shape) == (6, 4) and sink_grad.meta["val"].dtype == torch.float32

    on = _no_sync_graph(sync=True, device=device)
    report = run_joint_passes(on)
    assert [b.kind for b in report.lowering.buckets] == ["gather", "reduce"]
    (rs,) = calls(on, c10d.reduce_scatter_tensor.default)
    kept = [n for n in on.graph.nodes if n.op == "placeholder"][1]
    (user,) = kept.users
    assert user in ancestors(rs)
    if device == "meta":
        assert user.target is torch.ops.aten.add.Tensor and user.args[0] is kept and user.args[1].target is CAST
        return
    assert user.target is torch.ops.compiled_fsdp.pack_bucket_grads.default and user.args[1] == [kept]
    assert user.args[0][0].target is CAST
    nothing_kept = _no_sync_graph(sync=True, device=device, with_kept=False)
    run_joint_passes(nothing_kept)
    # (the same ops but the pack: one unpadded gradient packs as views of it when nothing is kept)
    (rs_alone,) = calls(nothing_kept, c10d.reduce_scatter_tensor.default)
    views = [rs_alone.args[0], rs_alone.args[0].args[0]]
    assert [v.target for v in views] == [torch.ops.aten.view.default] * 2 and views[1].args[0].target is CAST
    assert ([n.target for n in on.graph.nodes if n is not user]
            == [n.target for n in nothing_kept.graph.nodes if n not in views])


def test_mixed_precision_and_kept_lowering_matches_markers(single_rank_group: str) -> None:
    """The lowered graph computes bitwise what the markers' eager implementations
    compute, with casts and a kept gradient (one read per parameter: with two,
    the markers reduce each read's bf16 gradient cast on its own, the lowering
    their bf16 sum, which rounds differently)."""
    g = single_rank_group

    def joint(s_w, s_b, kept, x):
        mp = {"param_dtype": BF16, "reduce_dtype": torch.float32}
        w = U(s_w, [5, 4], g, 1, 0, 0, True, kept=kept, **mp)
        b = U(s_b, [5], g, 1, 0, 1, True, **mp)
        out = torch.nn.functional.linear(x, w, b).float().square().sum()
        return (out, *torch.autograd.grad(out, [s_w, s_b]))

    args = [torch.randn(5, 4, requires_grad=True), torch.randn(5, requires_grad=True),
            torch.randn(5, 4), torch.randn(3, 4, dtype=BF16)]
    gm = make_fx(joint, tracing_mode="fake")(*args)
    expected = gm(*args)
    lower_markers(gm)
    assert marker_nodes(gm) == []
    for e, r in zip(expected, gm(*args)):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_pipeline_runs_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: One pass pipeline]: the joint graph's passes run in order, any
    of them is switched off by name, and an unknown name is refused."""
    from compiled_fsdp.passes import config, run_passes

    gm = _two_module_graph()
    before = len(gm.graph.nodes)
    report = run_joint_passes(gm)
    assert report.ran == ("cast_gather", "lowering", "recompute")
    # (what benchmarks/depth.py reports: each pass's seconds, the nodes it left)
    assert list(report.pipeline.seconds) == ["cast_gather", "lowering", "recompute"]
    assert report.pipeline.nodes == (before, len(gm.graph.nodes)) and before != len(gm.graph.nodes)
    monkeypatch.setattr(config.pipeline, "disabled", frozenset({"recompute"}))
    gm = _two_module_graph()
    report = run_joint_passes(gm)
    assert report.ran == ("cast_gather", "lowering") and report.recompute is None and marker_nodes(gm) == []
    assert not any("recompute" in n.meta for n in gm.graph.nodes)
    monkeypatch.setattr(config.pipeline, "disabled", frozenset({"lowering"}))
    gm = _two_module_graph()
    done = run_passes("joint", gm)
    assert done.disabled == ["lowering"] and done.ran == ["cast_gather", "recompute"] and len(marker_nodes(gm)) == 8
    monkeypatch.setattr(config.pipeline, "disabled", frozenset({"lowring"}))
    with pytest.raises(ValueError, match="names no pass: \\['lowring'\\]"):
        run_passes("joint", _two_module_graph())


def test_an_empty_shard_views_like_the_others() -> None:
    """A rank holding no piece of a parameter traces ``to_local()``'s view of
    it with other strides than its input's (an empty tensor's strides mean
    nothing): still an identity view, as on the ranks that hold a piece, so
    every rank's lowering decides alike ([Note: Rank-independent graphs])."""
    for local in (torch.empty_strided((8, 2), (2, 1)), torch.empty_strided((8, 0), (0, 1))):
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = local
        v = g.call_function(torch.ops.aten.view.default, (x, list(local.shape)))
        v.meta["val"] = local.view(list(local.shape)) if local.numel() else torch.empty_strided((8, 0), (1, 1))
        g.output(v)
        assert through_identity_views(v) is x


def test_region_outputs_aliasing_inputs_are_cloned() -> None:
    """[Note: A region returns no alias of its inputs]: a region's graph that
    returns an activation it takes (as the partitioner saves a block's input),
    a view of one, or a piece of one split, returns a clone instead; a shard
    a marker reads (through a permute, as a shard on dim 1 is read) is
    returned as it is (the outer graph's input: a clone would cost memory
    and key the backward re-gather by the clone's storage), and so is a
    fresh value."""
    from compiled_fsdp.passes.aliasing import MARKER_INPUT, clone_outputs_aliasing_inputs, mark_marker_inputs

    def region(s_w, x):
        w = U(s_w.t(), [5, 4], GROUP, 2, 0, 0, True)
        return torch.nn.functional.linear(x, w), x, x.view(-1), x, s_w, x.unbind(0)[1]

    gm = make_fx(region, tracing_mode="fake")(torch.randn(4, 3), torch.randn(7, 4))
    s_w, x = gm.graph.find_nodes(op="placeholder")
    mark_marker_inputs(gm)
    assert s_w.meta.get(MARKER_INPUT) and not x.meta.get(MARKER_INPUT)
    assert clone_outputs_aliasing_inputs(gm) == 3  # (x returned twice: one clone)
    out, x_again, x_view, x_third, shard, piece = gm.graph.output_node().args[0]
    assert out.op == "call_function" and out.target is not torch.ops.aten.clone.default
    assert x_again is x_third and x_again.target is torch.ops.aten.clone.default and x_again.args[0] is x
    assert x_view.target is torch.ops.aten.clone.default and x_view.args[0].target is torch.ops.aten.view.default
    assert piece.target is torch.ops.aten.clone.default and piece.meta["val"].shape == (4,)
    assert shard is s_w and x_view.meta["val"].shape == (28,)
    assert clone_outputs_aliasing_inputs(gm) == 0  # (idempotent)


class _Float8Read(torch.autograd.Function):
    """torchao's tensorwise float8 cast of ``w`` and its emulated matmul's
    dequantization (as ``Float8Linear`` traces it with ``emulate=True``); its
    gradient passes straight through, as torchao's matmul computes the
    weight's gradient without the cast."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        scale = (torch.reciprocal(w.abs().max().to(torch.float64).clamp(min=1e-12)) * 448.0).to(torch.float32)
        q = (w * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return q.to(torch.float32) / scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return grad


_float8_read = _Float8Read.apply


@pytest.mark.parametrize("hp_use,param_dtype", [(False, None), (False, torch.bfloat16), (True, None)])
def test_float8_cast_moves_before_the_gather(single_rank_group: str, hp_use: bool,
                                             param_dtype: torch.dtype | None) -> None:
    """[Note: Float8 weights cast before their gather in graphs]: the cast of
    a gathered weight (through its transpose, twice, as torchao's forward and
    backward cast it) becomes one amax all-reduce and one gather of float8
    bytes, bitwise equal to the markers' eager run (with a bfloat16 compute
    dtype too: the shard is cast to it first); a weight also read in high
    precision keeps its gather."""
    g = single_rank_group

    def joint(s_w, s_b, x):
        w = U(s_w, [6, 4], g, 1, 0, 0, True, param_dtype=param_dtype)
        b = U(s_b, [6], g, 1, 0, 1, True, param_dtype=param_dtype)
        x = x if param_dtype is None else x.to(param_dtype)
        out = (x @ _float8_read(w.t()).to(x.dtype) + b).sum() + (x @ _float8_read(w.t()).to(x.dtype)).sum()
        if hp_use:
            out = out + w.sum()
        return (out, *torch.autograd.grad(out, [s_w, s_b]))

    args = [torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True), torch.randn(3, 4)]
    gm = make_fx(joint, tracing_mode="fake")(*args)
    expected = gm(*args)
    report = run_joint_passes(gm)
    gathers = [n.args[0].meta["val"].dtype for n in calls(gm, AG)]  # (a gloo group's: _graphs.AG)
    if hp_use:
        assert report.cast_gather.moved == [] and "reads the high-precision value" in report.cast_gather.kept["0.0"]
        assert gathers == [torch.float32] and calls(gm, c10d.all_reduce.default) == []
    else:
        assert report.cast_gather.moved == ["0.0"] and report.cast_gather.kept == {}
        # one byte bucket: the float8 weight beside the float32 bias ([Note: Byte buckets])
        assert gathers == [torch.uint8] and report.lowering.skipped == []
        assert len(calls(gm, c10d.all_reduce.default)) == 1
        assert not any(n.target is torch.ops.aten.abs.default and n.meta["val"].shape == (4, 6) for n in gm.graph.nodes)
    for e, r in zip(expected, gm(*args)):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_float8_cast_of_permuted_and_tied_reads(single_rank_group: str) -> None:
    """A float8 weight read through a permuted view of its shard (``Shard(1)``'s
    ``movedim``), after another one, a weight read twice, and a norm-like
    weight scaling an activation that is cast to float8 (not the weight's
    cast: left alone, unreported): the shards'
    casts are made at the graph's start from the graph inputs, the two reads
    of one weight share one float8 gather, and one byte bucket holds them
    with a float32 bias whose offset is odd in bytes (one rank: the pieces
    are views); bitwise equal to the markers' eager run."""
    g = single_rank_group

    def joint(s_w, s_w2, s_b, x):
        w = U(s_w, [5, 5], g, 1, 0, 0, True)
        b = U(s_b, [5], g, 1, 0, 2, True)
        h = _float8_read(x * b) @ _float8_read(w.t())  # (b scales an activation cast to float8: not b's cast)
        w2 = U(s_w2.t(), [5, 5], g, 1, 0, 1, True)
        again = U(s_w, [5, 5], g, 1, 0, 0, True)
        out = (h @ _float8_read(w2.t()) @ _float8_read(again)).sum()
        return (out, *torch.autograd.grad(out, [s_w, s_w2, s_b]))

    args = [torch.randn(5, 5, requires_grad=True), torch.randn(5, 5, requires_grad=True),
            torch.randn(5, requires_grad=True), torch.randn(3, 5)]
    gm = make_fx(joint, tracing_mode="fake")(*args)
    expected = gm(*args)
    report = run_joint_passes(gm)
    assert report.cast_gather.moved == ["0.0", "0.1"] and report.cast_gather.kept == {}
    assert report.lowering.skipped == []
    (gather,) = calls(gm, AG)  # (a gloo group's: _graphs.AG)
    assert gather.args[0].meta["val"].numel() == 25 + 25 + 5 * 4
    assert len(calls(gm, c10d.all_reduce.default)) == 1
    for e, r in zip(expected, gm(*args)):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_traced_gathers_on_gloo_become_the_eager_collective(single_rank_group: str) -> None:
    """[Note: All-gathers on gloo]: a functional all-gather Dynamo traced into
    a graph (tensor parallelism's) on a gloo group becomes
    ``compiled_fsdp::all_gather_by_work`` before the partitioned graph's
    passes; on a group no process group has (a hand-built graph's) it stays."""
    from compiled_fsdp.passes.collectives import gloo_gathers_by_work

    def graph(group: str) -> fx.GraphModule:
        def f(x: torch.Tensor) -> torch.Tensor:
            out = c10d.all_gather_into_tensor.default(x, 1, group)
            return c10d.wait_tensor.default(out) * 2
        return make_fx(f, tracing_mode="fake")(torch.randn(4))

    gm = graph(single_rank_group)
    assert gloo_gathers_by_work(gm.graph) == 1
    assert len(calls(gm, AG)) == 1 and calls(gm, c10d.all_gather_into_tensor.default) == []
    gm.recompile()
    torch.testing.assert_close(gm(torch.ones(4)), torch.full((4,), 2.0))
    fake = graph(GROUP)
    assert gloo_gathers_by_work(fake.graph) == 0 and len(calls(fake, c10d.all_gather_into_tensor.default)) == 1
