"""CPU offload's copies in graphs traced for a CUDA device on fake tensors
(no GPU needed): [Note: CPU offload in graphs] in passes/lowering.py. The
graphs are hand-built as in tests/test_passes_fx.py, whose helpers they use."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from compiled_fsdp.passes import run_joint_passes
from compiled_fsdp.passes.config import OverlapConfig
from compiled_fsdp.passes.graph import chain_tag
from compiled_fsdp.passes.schedule import schedule_graph

from _graphs import U, ancestors, calls, chain_role, marker_nodes, shard_shape

c10d = torch.ops._c10d_functional
GROUP = "fake_group"


def _offloaded_graph() -> fx.GraphModule:
    """``_two_module_graph`` (``tied``) under CPU offload: the shards on the
    CPU, the parameters and the compute on a CUDA device, traced on fake
    tensors (no GPU needed). The backward is written out (autograd's engine
    wants a real CUDA context): each read's ``reduce_grad`` of a stand-in
    gradient, the tied reads' summed, as AOTAutograd's joint has them."""
    dev = "cuda:0"
    shapes = ([5, 4], [5], [3, 5])

    def R(grad, key, index):  # noqa: N802 - the read's backward, as the marker's autograd calls it
        full = shapes[index if key == 0 else 2]
        return torch.ops.compiled_fsdp.reduce_grad(grad, full, GROUP, 2, key, index, shard_shape(full, 2)[0],
                                                   device="cpu")

    def joint(s_w, s_b, s_w2, x):
        w = U(s_w, [5, 4], GROUP, 2, 0, 0, True, device=dev)
        b = U(s_b, [5], GROUP, 2, 0, 1, True, device=dev)
        w_again = U(s_w, [5, 4], GROUP, 2, 0, 0, True, device=dev)
        h = torch.relu(torch.nn.functional.linear(x, w, b))
        h = h + torch.nn.functional.linear(x, w_again).sum()
        w2 = U(s_w2, [3, 5], GROUP, 2, 1, 0, True, device=dev)
        out = torch.nn.functional.linear(h, w2).sum()
        g_w2 = R(w2 * out, 1, 0)
        g_w = R(w * out, 0, 0) + R(w_again * 2, 0, 0)
        return out, g_w, R(b * out, 0, 1), g_w2

    with FakeTensorMode():
        shards = [torch.randn(shard_shape(s, 2)) for s in shapes]
        x = torch.randn(7, 4, device=dev)
    return make_fx(joint, tracing_mode="fake")(*shards, x)


def test_offloaded_shards_copied_in_the_gather_chain() -> None:
    """[Note: CPU offload in graphs]: each shard (a CPU graph input) is
    copied to the device as the first step of its bucket's pack, inside the
    gather's chain, so the schedule prefetches the copy with the gather
    (module 1's copy moves above module 0's matmul); each reduced gradient is
    copied back to the CPU after its reduce's wait, and the graph returns the
    shards' gradients on the CPU. Without the lowering's copies the pack would
    concatenate CPU shards into a CUDA bucket."""
    gm = _offloaded_graph()
    report = run_joint_passes(gm)
    assert report.lowering.skipped == [] and marker_nodes(gm) == []
    puts = calls(gm, torch.ops.prims.device_put.default)
    to_cuda = [n for n in puts if n.meta["val"].device.type == "cuda"]
    to_cpu = [n for n in puts if n.meta["val"].device.type == "cpu"]
    assert len(to_cuda) == 3 and len(to_cpu) == 3, [n.format_node() for n in puts]
    assert all(n.args[0].op == "placeholder" and n.args[2] is True for n in to_cuda)  # (non-blocking)
    assert all(n.args[2] is False for n in to_cpu)  # (blocking: the optimizer reads it at once)
    assert [chain_role(n) for n in to_cuda] == ["gather_chain"] * 3
    assert [chain_role(n) for n in to_cpu] == ["reduce_chain"] * 3
    for gather in calls(gm, c10d.all_gather_into_tensor.default):
        assert gather.meta["val"].device.type == "cuda"
        assert {n for n in ancestors(gather) if n in to_cuda}, gather.format_node()
    for put in to_cpu:
        assert any(a.target is c10d.wait_tensor.default for a in ancestors(put))
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    assert [o.meta["val"].device.type for o in outputs[1:]] == ["cpu"] * 3
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_mm = min((n for n in gm.graph.nodes if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)),
                   key=order.__getitem__)
    module1_put = next(n for n in to_cuda if chain_tag(n).module_key == 1)
    assert order[module1_put] > order[first_mm]  # (where the lowering put it: at module 1's read)
    schedule_graph(gm.graph, OverlapConfig(cover=1e9))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert order[module1_put] < order[first_mm]


def test_host_copies_priced_at_the_host_link() -> None:
    """[Note: Host copies] in passes/cost_model.py: each offloaded shard's
    copy to the device and each gradient's copy back is priced at the host
    link (50 GB/s on CUDA), not as a device copy (2.3 TB/s), which made the
    schedule take a shard's copy for 40-50x cheaper than it is. And the
    graph is priced as a GPU's: ``CostModel.for_graph`` looked at the first
    tensor only, a CPU shard here, and priced the whole graph as the CPU's."""
    from compiled_fsdp.passes.cost_model import CUDA_COMPUTE, CostModel, node_bytes

    gm = _offloaded_graph()
    run_joint_passes(gm)
    cost = CostModel.for_graph(gm.graph)
    puts = calls(gm, torch.ops.prims.device_put.default)
    assert cost.compute is CUDA_COMPUTE and len(puts) == 6
    for put in puts:
        assert cost.compute_time(put) == node_bytes(put) / 5.0e10 > 0, put.format_node()


def test_offloaded_region_read_regathers_on_the_device() -> None:
    """A compile region's reads under CPU offload ([Note: CPU offload in
    graphs]): the lowering's ``regather`` takes the CPU shards and names the
    device, where it gathers (its eager code copies them first, as the
    issue-ahead's does), so the region computes on the device."""
    def fn(s_w, s_b, x):
        w = U(s_w, [5, 4], GROUP, 2, 0, 0, True, device="cuda:0", take_ahead=True)
        b = U(s_b, [5], GROUP, 2, 0, 1, True, device="cuda:0", take_ahead=True)
        return torch.nn.functional.linear(x, w, b).sum()

    with FakeTensorMode():
        shards = [torch.randn(shard_shape(s, 2)) for s in ([5, 4], [5])]
        x = torch.randn(7, 4, device="cuda:0")
    gm = make_fx(fn, tracing_mode="fake")(*shards, x)
    run_joint_passes(gm)
    (regather,) = calls(gm, torch.ops.compiled_fsdp.regather.default)
    assert regather.kwargs["device"] == "cuda:0" and regather.meta["val"].device.type == "cuda"
    assert [s.op for s in regather.args[0]] == ["placeholder"] * 2
    assert calls(gm, torch.ops.prims.device_put.default) == []
