"""Which blocks share a compile region's trace and which are traced again:
blocks of one class in several shapes (variants, each traced once), a
block with a forward of its own (read in the root's graph), and a block
that differs from its equals in a Python int (traced again, with a
warning). See [Note: A region traced again for an equal block] in
compiled_fsdp/compile/regions.py and [Note: A block whose region never
runs] in compiled_fsdp/compile/region_reads.py; a block with hooks of
its user's; and a region cut in its modules' parts where a rank's shard
of a part is empty."""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from test_block_regions import _caught, _stack_parity

import compiled_fsdp
from compiled_fsdp.core import compat

from _dist import run_distributed
from _models import shard_each
from _parity import assert_close, in_regions, run_parity


class _Widening(torch.nn.Module):
    """A block of one class whose width depends on its place: each one's
    region traced as a variant of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, width)
        self.down = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(torch.nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Widening(8 + 4 * i) for i in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def _variants_rank(rank: int, world: int) -> dict:
    compiled_fsdp.config.comm.block_regions = True
    return _stack_parity(rank, lambda: _Stack(10), 2, after_step=in_regions)


def test_blocks_of_one_class_in_ten_shapes() -> None:
    """Ten blocks of one class, each of another width: ten variants of one
    region, each traced and compiled once, bitwise equal to the reference
    after 2 steps under ``aot_eager``. torch 2.13 and 2.15 cap a region's
    variants at 8 and raised "exceeded maximum reuse entries" at the ninth
    block (``compat.nested_compile_region`` lifts the cap)."""
    for res in run_distributed(_variants_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["after"][-1] == [False] + [True] * 10, res["after"]


def _own_forward_rank(rank: int, world: int) -> dict:
    compiled_fsdp.config.comm.block_regions = True

    def build() -> _Stack:
        stack = _Stack(3)
        for block in stack.layers[1:]:  # (an instance's own forward, as a library's hook sets one;
            block.forward = partial(_Widening.forward, block)  # the first block's region runs before them)
        return stack

    return _stack_parity(rank, build, 3, after_step=lambda m: [r.reason for r in compiled_fsdp.explain(m)])


def test_a_block_with_its_own_forward_is_read_in_the_root_graph() -> None:
    """[Note: A block whose region never runs]: blocks whose instances have a
    forward of their own never call their region; their reads are traced in
    the root's graph and gathered and reduced in its buckets. Before, they
    were taken as a region's reads there, and each parameter was gathered
    and reduced on its own by the markers' eager code (17 gathers and 12
    reduces a step here) while ``explain`` said "compile region". The first
    block runs its region before them: once its body is traced, nothing may
    take the reads after it for its own ([Note: Region calls traced once]).
    Bitwise after 3 steps, no eager collective, and ``explain`` names the
    cause."""
    for res in run_distributed(_own_forward_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{}] * 3, res["counts"]
        root, first, *blocks = res["after"][-1]
        assert "a forward of its own" not in (first or ""), res["after"][-1]
        assert all("a forward of its own" in (r or "") for r in blocks), res["after"][-1]


class _Indexed(torch.nn.Module):
    """A block whose forward reads its index, a Python int that differs
    between blocks (a guard on every block)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * (1.0 + self.index / 8)


class _IndexedStack(_Stack):
    def __init__(self, blocks: int) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Indexed(i) for i in range(blocks))


def _retraced_rank(rank: int, world: int, indexed: bool) -> dict:
    compiled_fsdp.config.comm.block_regions = True
    build = (lambda: _IndexedStack(4)) if indexed else (lambda: _Stack(10))
    with _caught("traced the compile region") as found:
        res = _stack_parity(rank, build, 2, after_step=in_regions)
    res["warnings"] = found
    return res


@pytest.mark.parametrize("indexed", [True, False])
def test_a_region_traced_again_for_an_equal_block_warns(indexed: bool) -> None:
    """Blocks whose forward reads a per-block Python int are each traced
    and compiled on their own: one warning on every rank, naming the class
    and the third block (the first block's input needs no gradient, so the
    second is a variant of its own: its input differs), and the numbers
    still bitwise the reference's.
    Blocks of one class in ten shapes (variants that must be) do not warn.
    Torch 2.11 traces every call of a region (no reuse to fail): no warning
    there. See [Note: A region traced again for an equal block]."""
    for res in run_distributed(_retraced_rank, 2, indexed, timeout=900):
        assert_close(res, 0.0)
        if indexed and compat.region_traces_reused():
            assert len(res["warnings"]) == 1 and "'_Indexed'" in res["warnings"][0] \
                and "layers.2" in res["warnings"][0], res["warnings"]
        else:  # (torch 2.11 traces every call: nothing to warn of)
            assert res["warnings"] == [], res["warnings"]


def _two_models_rank(rank: int, world: int) -> list[str]:
    compiled_fsdp.config.comm.block_regions = True
    with _caught("traced the compile region") as found:
        for _ in range(2):  # (as the numerics checker's variants do)
            torch._dynamo.reset()
            _stack_parity(rank, lambda: _Stack(3), 1)
    return found


def test_a_second_model_after_a_dynamo_reset_does_not_warn() -> None:
    """Compile ids start again after ``torch._dynamo.reset()``: the second
    model's first block was taken for the first model's, traced again, and
    warned (the numerics checker's Inductor variant in CI); each root's
    step now starts the record afresh."""
    for res in run_distributed(_two_models_rank, 2, timeout=900):
        assert res == [], res


class _EqualStack(_Stack):
    def __init__(self, blocks: int) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Widening(8) for _ in range(blocks))


def _hook(block: torch.nn.Module) -> None:
    """A user's forward pre-hook and forward hook that change what flows."""
    block.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    block.register_forward_hook(lambda m, args, out: out + 1.0)


def _user_hooks_rank(rank: int, world: int, when: str) -> dict:
    compiled_fsdp.config.comm.block_regions = True

    def build() -> _EqualStack:
        stack = _EqualStack(3)
        _hook(stack.layers[1])
        return stack

    def prepare(ref: torch.nn.Module) -> torch.nn.Module:
        model = copy.deepcopy(ref)  # (its hooks too: registered before fully_shard)
        if when == "after":
            model.layers[1]._forward_pre_hooks.clear()
            model.layers[1]._forward_hooks.clear()
        for block in model.layers:
            compiled_fsdp.fully_shard(block)
        compiled_fsdp.fully_shard(model)
        if when == "after":
            _hook(model.layers[1])
        return model

    def after_step(model: torch.nn.Module) -> dict:
        hooks = model.layers[1]._forward_pre_hooks
        return {"regions": in_regions(model), "first_hook": getattr(next(iter(hooks.values())), "__name__", ""),
                "one_order": list(hooks) == list(dict.keys(hooks))}

    with _caught("traced the compile region") as found:
        res = _stack_parity(rank, build, 3, prepare=prepare, after_step=after_step)
    res["warnings"] = found
    return res


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_region_block_with_hooks_of_its_users(when: str) -> None:
    """Three equal blocks, the second with a forward pre-hook and a forward
    hook of its user's, registered after ``fully_shard`` or before it:
    traced around its region's call, in ``_call_impl``'s order with FSDP's.
    Bitwise equal to the reference with the same hooks after 3 steps under
    ``aot_eager``, no eager collective, every block a region, and the
    region traced once for the blocks whose input requires grad (the first
    block's does not: a variant of its own, and no warning, [Note: A region
    traced again for an equal block]). A region call that passed the hooks
    by would leave the second block's input not halved, its output not
    shifted. FSDP's pre-hook comes first either way, and the hooks' order is
    the dict's insertion order too: on torch 2.11, where Dynamo names a hook
    by that order, ``prepend``'s reordering made the "before" case raise at
    the first compile (``compat.register_first_forward_pre_hook``)."""
    for res in run_distributed(_user_hooks_rank, 2, when, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{}] * 3, res["counts"]
        assert res["after"][-1] == {"regions": [False, True, True, True], "first_hook": "_pre_forward",
                                    "one_order": True}, res["after"]
        assert res["warnings"] == [], res["warnings"]  # (the region traced once)


def _hooks_added_rank(rank: int, world: int) -> dict:
    compiled_fsdp.config.comm.block_regions = True
    made: dict[str, torch.nn.Module] = {}

    def build() -> _EqualStack:
        made["ref"] = _EqualStack(3)
        return made["ref"]

    def prepare(ref: torch.nn.Module) -> torch.nn.Module:
        model = made["model"] = copy.deepcopy(ref)
        shard_each(model)
        return model

    def make_batch(step: int) -> tuple:
        if step == 1:  # (after the first step's compile, before the second step's forward)
            _hook(made["ref"].layers[1])
            _hook(made["model"].layers[1])
        return (torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step)),)

    def after_step(model: torch.nn.Module) -> dict:
        from torch._dynamo.utils import counters

        return {"regions": in_regions(model), "graphs": counters["stats"]["unique_graphs"],
                "direct": [m.__dict__["_fsdp_region_entry"].region_casts is not None for m in model.layers]}

    torch._dynamo.utils.counters.clear()
    return run_parity(rank, build, shard_each, make_batch, lambda out, x: out.square().mean(), steps=3,
                      wrap=partial(torch.compile, backend="aot_eager"), prepare=prepare, after_step=after_step)


def test_hooks_of_a_users_added_after_the_first_step_run() -> None:
    """The same hooks as above, registered on the second block after the
    first step: the next step recompiles, the hooks run in the region's
    call, and the model stays bitwise equal to its reference (hooked at the
    same step) after 3 steps under ``aot_eager``, every block a region. The
    region's call decides each step whether it may cast and call the
    block's forward itself ([Note: A region's call under Dynamo]): a
    decision made once, or not guarded, left the hooks unrun (the second
    block's input not halved, its output not shifted). The blocks without
    a user's hook take that direct call throughout, the hooked one torch's
    from the second step; one graph more is traced at the second step,
    none at the third."""
    for res in run_distributed(_hooks_added_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{}] * 3, res["counts"]
        after = res["after"]
        assert [a["regions"] for a in after] == [[False, True, True, True]] * 3, after
        assert [a["direct"] for a in after] == [[True] * 3, [True, False, True], [True, False, True]], after
        graphs = [a["graphs"] for a in after]
        assert graphs[1] == graphs[0] + 1 and graphs[2] == graphs[1], graphs


class _Halving(_Widening):
    """A block whose class has a ``__call__`` of its own (as an older
    transformers' ``GradientCheckpointingLayer``): it halves what the call returns."""

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        return super().__call__(*args, **kwargs) * 0.5


class _HalvingStack(_Stack):
    def __init__(self, blocks: int) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Halving(8) for _ in range(blocks))


def _own_call_rank(rank: int, world: int) -> dict:
    compiled_fsdp.config.comm.block_regions = True
    return _stack_parity(rank, lambda: _HalvingStack(3), 3, after_step=in_regions)


def test_a_region_block_with_a_call_of_its_own() -> None:
    """Three blocks whose class defines ``__call__``: every block a region,
    the class's call kept, bitwise equal to the reference after 3 steps
    under ``aot_eager``. A region class's own ``__call__`` ([Note: A
    region's call under Dynamo]) had replaced it: the output was not halved."""
    for res in run_distributed(_own_call_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["after"][-1] == [False, True, True, True], res["after"]


class _Returning(torch.nn.Module):
    """A block that returns what ``invoke_subgraph`` refuses or will not reuse
    ([Note: What a region returns]): its result twice beside None and an
    input it was handed inside a tuple ("handed"); a view of its input
    ("view"); or it changes its input in place ("changed")."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.how = how

    def forward(self, x: torch.Tensor, carried: tuple[torch.Tensor]) -> tuple:
        if self.how == "changed":
            x.mul_(1.0)
        h = x + self.lin(x)
        if self.how == "view":
            return h, x[:, :1], None
        return h, h, None, carried[0]


class _ReturningStack(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(_Returning(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        carried = (x * 2,)
        total = x.new_zeros(())
        for block in self.layers:
            x, twice, none, handed = block(x, carried)
            assert none is None
            carried = (handed,)
            total = total + twice.sum() + handed.sum()
        return total + x.square().sum()


def _returning_rank(rank: int, world: int, how: str) -> dict:
    compiled_fsdp.config.comm.block_regions = True
    try:
        with _caught("traced the compile region") as retraced:
            res = _stack_parity(rank, partial(_ReturningStack, how), 3)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "notes": getattr(exc, "__notes__", [])}
    res["retraced"] = retraced
    return res


@pytest.mark.parametrize("how", ["handed", "view", "changed"])
def test_what_a_region_returns(how: str) -> None:
    """[Note: What a region returns]: a block returning its result twice, None
    and the input it was handed inside a tuple trains bitwise equal to the
    reference under ``aot_eager`` after 3 steps, its region traced once (no
    warning; None kept the trace from reuse, the repeated and handed tensors
    raised torch's aliasing error). A block returning a view of its input,
    or changing its input in place, is refused by torch on every rank, the
    error saying what to do."""
    for res in run_distributed(_returning_rank, 2, how, timeout=600):
        if how == "handed":
            assert "error" not in res, res
            assert_close(res, 0.0)
            assert res["counts"] == [{}] * 3 and res["retraced"] == [], res
        else:
            assert res["error"] in ("UncapturedHigherOrderOpError", "BackendCompilerFailed"), res
            assert any("block_regions = False" in n for n in res["notes"]), res


class _Row(torch.nn.Module):
    """A scale of one row: over 2 ranks the second holds none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(1, 8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Gated(_Widening):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.gate = _Row()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.gate(x))))


class _GatedStack(_Stack):
    def __init__(self, blocks: int) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Gated(12) for _ in range(blocks))
        self.shift = torch.nn.Parameter(torch.zeros(8))  # (every block's input then requires grad: one trace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.shift)


def _cut_empty_rank(rank: int, world: int) -> dict:
    from compiled_fsdp.core.registry import CORE
    from compiled_fsdp.passes.config import overlap

    compiled_fsdp.config.comm.block_regions = True
    overlap.bucket_bytes = 0  # (nothing merges: each module a part of its own)
    overlap.split_regions = True
    CORE.backward_gathers.reset()
    CORE.later_reduces.reset()
    return _stack_parity(rank, lambda: _GatedStack(3), 3, after_step=lambda m: (
        in_regions(m), CORE.backward_gathers.taken, CORE.later_reduces.delivered))


def test_a_cut_region_with_a_rank_holding_no_row() -> None:
    """[Note: Every compile region cut as the opening block] where one part's
    parameter has fewer rows than ranks: each block's region cut into its
    three modules (gate, up, down), the gate's one row held by rank 0 alone,
    rank 1's shard of it empty. Every part is taken from a gather issued ahead
    from the second step on, forward and backward, each part's reduce waited
    after the region's graph; no eager collective; bitwise equal to the
    reference after 3 steps under ``aot_eager``."""
    for res in run_distributed(_cut_empty_rank, 2, timeout=900):
        assert_close(res, 0.0)
        assert res["counts"] == [{}] * 3, res["counts"]
        n = 3 * 3  # (parts a block, blocks)
        assert [a[1:] for a in res["after"]] == [(0, n), (2 * n, 2 * n), (4 * n, 3 * n)], res["after"]
        assert res["after"][-1][0] == [False] + [True] * 3, res["after"]
