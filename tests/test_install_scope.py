"""The passes are installed in torch's config only while a compile may need
them ([Note: Passes installed while compiling] in
compiled_fsdp/compile/install.py): a compiled training run leaves a user's
own joint pass in place, runs it after ours on every joint graph, and
leaves torch's config as it found it, also after a backward that raised."""
from __future__ import annotations

import torch

from compiled_fsdp import fully_shard

from _dist import run_distributed
from _graphs import MARKER_OPS, one_graph
from _models import gpt_case


def _scope_rank(rank: int, world: int) -> dict:
    one_graph()  # (its structure: tests/_graphs.py)
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    seen: list[bool] = []

    def user_pass(gm, inputs):  # noqa: ANN001, ANN202
        # ours ran first: no marker is left in the joint graph it sees
        seen.append(not any(str(n.target) in MARKER_OPS for n in gm.graph.nodes))
        return gm

    functorch_config.joint_custom_pass = user_pass
    before_post = inductor_config.post_grad_custom_post_pass
    build, make_batch, loss_fn = gpt_case(False)
    model = build()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    installed_after_shard = functorch_config.joint_custom_pass is user_pass
    runner = torch.compile(model, backend="aot_eager", fullgraph=True)
    between: list[bool] = []
    for step in range(2):
        (tokens,) = make_batch(step)
        loss_fn(runner(tokens), tokens).backward()
        between.append(functorch_config.joint_custom_pass is user_pass
                       and inductor_config.post_grad_custom_post_pass is before_post)
    # A backward that raises after its window opened (a user's hook on a
    # parameter's gradient) leaves no window open past the next step's start.
    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    handle = next(model.parameters()).register_hook(boom)
    (tokens,) = make_batch(2)
    raised = False
    try:
        loss_fn(runner(tokens), tokens).backward()
    except RuntimeError as e:
        raised = "boom" in str(e)
    handle.remove()
    during = functorch_config.joint_custom_pass is not user_pass  # still open: that backward ended in an error
    (tokens,) = make_batch(3)
    loss_fn(runner(tokens), tokens).backward()
    return {"seen": seen, "installed_after_shard": installed_after_shard, "between": between,
            "raised": raised, "during": during, "after": functorch_config.joint_custom_pass is user_pass
            and inductor_config.post_grad_custom_post_pass is before_post}


def test_compiled_run_leaves_torch_config_as_it_was() -> None:
    for res in run_distributed(_scope_rank, 2, timeout=600):
        assert res["installed_after_shard"], res  # fully_shard installs nothing
        assert res["seen"] and all(res["seen"]), res  # the user's pass ran, after ours
        assert res["between"] == [True, True], res  # restored between steps
        assert res["raised"] and res["during"] and res["after"], res
