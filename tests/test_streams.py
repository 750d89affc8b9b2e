"""The eager runtime's stream logic ([Note: Streams and events] in
compiled_fsdp/runtime/streams.py), on the CPU: a no-op without streams, and,
with a recording stand-in for the streams, each collective issued where the
note says (real gloo ranks, real collectives, parity with the reference)."""
from __future__ import annotations

import contextlib

import torch
from test_eager_parity import _shard_nested

import compiled_fsdp
from compiled_fsdp import get_fsdp_state
from compiled_fsdp.runtime.streams import CommStreams

from _dist import run_distributed
from _models import gpt_case
from _parity import assert_close, run_parity


def test_cpu_has_no_streams() -> None:
    streams = CommStreams(torch.device("cpu"))
    assert not streams.enabled and streams.gather is None and streams.reduce is None
    for ctx in (streams.on_gather(), streams.on_reduce()):
        with ctx:  # nothing to enter
            pass


class _Recorder:
    """Stands in for a device stream: records what the runtime does with it,
    with the eager collective counts at that moment."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def _note(self, what: str, other: str = "") -> None:
        self.log.append((self.name, what, other, dict(compiled_fsdp.collective_counts())))

    def wait_stream(self, other: "_Recorder") -> None:
        self._note("wait_stream", other.name)

    def record_event(self) -> "_Event":
        self._note("record_event")
        return _Event(self)

    def wait_event(self, event: "_Event") -> None:
        self._note("wait_event", event.stream.name)

    def __enter__(self) -> None:
        self._note("enter")

    def __exit__(self, *exc: object) -> None:
        self._note("exit")


class _Event:
    """Stands in for an event: the stream it was recorded on, and the host's
    waits for it (recorded on that stream's log)."""

    def __init__(self, stream: _Recorder) -> None:
        self.stream = stream

    def synchronize(self) -> None:
        self.stream._note("synchronize")


def _recording_rank(rank: int, world: int, hooks: bool = False, wrap: object = None, post_optim: bool = False,
                    **shard_kwargs: object) -> dict:
    build, make_batch, loss = gpt_case(False)
    log: list = []
    compute = _Recorder("compute", log)
    names = iter(["gather", "reduce"])
    hooked: list[str] = []

    def install(model) -> list:  # after the first step (lazy init made the real, CPU ones)
        ctx = get_fsdp_state(model).ctx
        if not isinstance(ctx.streams.gather, _Recorder):
            ctx.streams = CommStreams(torch.device("cpu"), make_stream=lambda d: _Recorder(next(names), log),
                                      current=lambda d: compute)
            for name, param in model.named_parameters() if hooks else ():
                param.register_post_accumulate_grad_hook(lambda p, n=name: log.append(("hook", n, "", {})))
                hooked.append(name)
        step_log = list(log)
        log.clear()
        if post_optim:  # (after the optimizer step, as a user records it)
            model.set_post_optim_event(compute.record_event())
        return step_log

    res = run_parity(rank, build, lambda m: _shard_nested(m, reshard_after_forward=True, **shard_kwargs),
                     make_batch, loss, after_step=install, wrap=wrap)
    return {**res, "hooked": hooked}


def _spans(step_log: list, stream: str) -> list[tuple[tuple, tuple, tuple]]:
    """(the wait before, the enter, the exit) of each use of ``stream``."""
    out = []
    for i, (name, what, _, _) in enumerate(step_log):
        if name == stream and what == "enter":
            exit_ = next(e for e in step_log[i:] if e[0] == stream and e[1] == "exit")
            out.append((step_log[i - 1], step_log[i], exit_))
    return out


def test_collectives_issued_on_their_streams() -> None:
    results = run_distributed(_recording_rank, 2)
    n_modules, n_blocks = 3, 2
    for res in results:
        assert_close(res, 0.0)  # the streams change no numerics
        first, *recorded = res["after"]
        assert first == []  # the CPU ones record nothing
        for step_log in recorded:
            gathers, reduces = _spans(step_log, "gather"), _spans(step_log, "reduce")
            assert len(gathers) == n_modules + n_blocks and len(reduces) == n_modules, step_log
            for (wait, enter, exit_) in gathers + reduces:
                # every use of a side stream starts by waiting for the compute stream
                assert wait[:3] == (enter[0], "wait_stream", "compute"), (wait, enter)
            for _, enter, exit_ in gathers:  # copy-in and all-gather inside
                assert exit_[3].get("all_gather", 0) == enter[3].get("all_gather", 0) + 1
            for wait, enter, exit_ in reduces:  # packed before, on the compute stream
                assert exit_[3].get("reduce_scatter") == enter[3].get("reduce_scatter")
                assert wait[3].get("reduce_scatter", 0) >= 1


def _offload_rank(rank: int, world: int) -> dict:
    return _recording_rank(rank, world, offload_policy=compiled_fsdp.CPUOffloadPolicy(pin_memory=False))


def test_a_gather_of_one_rank_is_waited_by_event() -> None:
    """One rank under CPU offload (the GPU check's offload rows): each gather
    copies its shards to the device and packs them on the gather stream and
    communicates nothing, so no work orders the compute stream behind it;
    the compute stream waits for an event recorded on the gather stream
    after the copy-in, once per gather, before its copy-out reads the
    buffer. Two ranks: none, their collectives'
    works order the streams. Bitwise to the reference both ways. Without
    [Note: Streams and events]' event the copy-out raced the copy-in on a GPU."""
    for world, rank_fn in ((1, _offload_rank), (2, _recording_rank)):
        for res in run_distributed(rank_fn, world):
            assert_close(res, 0.0)
            for step_log in res["after"][1:]:
                events = [(name, what, other) for name, what, other, _ in step_log if "event" in what]
                n_gathers = len(_spans(step_log, "gather"))
                if world == 1:
                    records = [e == ("gather", "record_event", "") for e in events]
                    waits = [e == ("compute", "wait_event", "gather") for e in events]
                    assert n_gathers == 5 and sum(records) == sum(waits) == n_gathers, events
                    # (each wait after its record; a gather prefetched ahead records before the last one's wait)
                    assert all(sum(waits[:i + 1]) <= sum(records[:i + 1]) for i in range(len(events))), events
                else:
                    assert events == [], events


def test_streams_context_is_restored_on_error() -> None:
    log: list = []
    streams = CommStreams(torch.device("cpu"), make_stream=lambda d: _Recorder("side", log),
                          current=lambda d: _Recorder("compute", log))
    with contextlib.suppress(ValueError), streams.on_gather():
        raise ValueError("inside")
    assert [w for _, w, _, _ in log] == ["wait_stream", "enter", "exit"]


def _compute_events(step_log: list) -> tuple[list, list[int], list[int]]:
    """A step's (stream, what) entries, and where the compute stream recorded
    an event and where the host synchronized one."""
    entries = [(name, what) for name, what, _, _ in step_log]
    return (entries, [i for i, e in enumerate(entries) if e == ("compute", "record_event")],
            [i for i, e in enumerate(entries) if e == ("compute", "synchronize")])


def _offload_hooks_rank(rank: int, world: int) -> dict:
    return _recording_rank(rank, world, hooks=True,
                           offload_policy=compiled_fsdp.CPUOffloadPolicy(pin_memory=False))


def test_offloaded_gradients_land_after_their_event() -> None:
    """Two ranks under CPU offload: each group's reduced gradient is copied
    to the host without blocking, on the compute stream, and an event is
    recorded after it; the host synchronizes that event once per group at the
    end of backward, after every reduce was issued, and only then do
    ``.grad`` and the post-accumulate-grad hooks see the gradient. Bitwise to
    the reference. Without [Note: Offloaded gradients land at the end of
    backward] each copy blocked the host in the middle of backward (no event,
    no synchronize)."""
    n_modules = 3
    for res in run_distributed(_offload_hooks_rank, 2):
        assert_close(res, 0.0)
        for step_log in res["after"][1:]:
            entries, records, syncs = _compute_events(step_log)
            hooks = [i for i, e in enumerate(entries) if e[0] == "hook"]
            last_reduce = max(i for i, e in enumerate(entries) if e == ("reduce", "exit"))
            assert len(records) == len(syncs) == n_modules, entries
            assert sorted(step_log[i][1] for i in hooks) == sorted(res["hooked"]), entries  # (each once)
            assert all(i < j for i, j in zip(records, syncs)), entries
            assert syncs[0] > last_reduce, entries  # (at the end of backward)
            assert hooks[0] > syncs[0], entries  # (no hook before its gradient landed)


def _raising_rank(rank: int, world: int) -> dict:
    import copy

    from compiled_fsdp.tools.models import GPT, GPTConfig, batch, loss_fn

    from _parity import full_diff, full_params

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab=67, dim=24, n_layers=3, n_heads=2, seq=16))
    model = copy.deepcopy(ref)
    policy = compiled_fsdp.CPUOffloadPolicy(pin_memory=False)
    for block in model.layers:
        compiled_fsdp.fully_shard(block, offload_policy=policy)
    compiled_fsdp.fully_shard(model, offload_policy=policy)
    armed = {"raise": False}

    def raise_in_backward(module: torch.nn.Module, grad_output: object) -> None:
        if armed["raise"]:  # (layers.2 and layers.1 reduced, layers.2's finished)
            raise RuntimeError("boom in backward")

    model.layers[0].register_full_backward_pre_hook(raise_in_backward)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    log: list = []
    out: dict = {}
    for step in range(4):
        tokens = [batch(ref.cfg, 2, 100 * step + r) for r in range(world)]
        armed["raise"] = step == 1
        try:
            loss_fn(model(tokens[rank]), tokens[rank]).backward()
        except RuntimeError:
            entries = [(name, what) for name, what, _, _ in log]
            out["copied_before_reset"] = entries.count(("compute", "record_event"))
            out["landed_before_reset"] = sum(p.grad is not None for p in model.parameters())
            model.reset_iter_state()
            out["landed_at_reset"] = sum(p.grad is not None for p in model.parameters())
            opt.zero_grad()
            continue
        if step == 0:  # (lazy init made the real, CPU ones)
            model_ctx = get_fsdp_state(model).ctx
            model_ctx.streams = CommStreams(torch.device("cpu"), make_stream=lambda d: _Recorder("side", log),
                                            current=lambda d: _Recorder("compute", log))
        opt.step()
        opt.zero_grad()
        (sum(loss_fn(ref(t), t) for t in tokens) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = full_diff(full_params(model), ref)
    return out


def test_offloaded_gradients_of_a_backward_that_raised() -> None:
    """Under CPU offload, a backward raises after two blocks reduced and the
    first of them finished: its copies to the host were made (an event
    recorded) but not landed; ``reset_iter_state`` lands them, as they were in ``.grad``
    before [Note: Offloaded gradients land at the end of backward], and the
    ``zero_grad`` after it drops them. Training goes on bitwise equal to the
    reference trained on the steps that finished."""
    for res in run_distributed(_raising_rank, 2):
        assert res["diff"] == 0.0, res
        assert res["copied_before_reset"] >= 1 and res["landed_before_reset"] == 0, res
        assert res["landed_at_reset"] > 0, res


def _offload_regions_rank(rank: int, world: int) -> dict:
    from functools import partial

    return _recording_rank(rank, world, hooks=True, wrap=partial(torch.compile, backend="aot_eager"),
                           offload_policy=compiled_fsdp.CPUOffloadPolicy(pin_memory=False))


def test_offloaded_rows_of_a_region_land_after_their_event() -> None:
    """The whole model compiled (``aot_eager``), each block a compile region,
    under CPU offload: a region's later reduce hands each parameter's rows
    to the host without blocking, an event after each, and they land with
    the group's own at the end of backward (every block parameter's hook
    after a synchronize). It copied each parameter's back blocking: a host
    sync a parameter on a GPU. Bitwise to the reference."""
    for res in run_distributed(_offload_regions_rank, 2):
        assert_close(res, 0.0)
        for step_log in res["after"][1:]:
            entries, records, syncs = _compute_events(step_log)
            block_hooks = [i for i, (name, what) in enumerate(entries) if name == "hook" and "layers." in what]
            assert len(records) == len(syncs) > 0 and block_hooks, entries
            assert all(i > syncs[0] for i in block_hooks), entries


def _regions_rank(rank: int, world: int) -> dict:
    from functools import partial

    return _recording_rank(rank, world, wrap=partial(torch.compile, backend="aot_eager"))


def test_region_gathers_issued_on_the_gather_stream() -> None:
    """The whole model compiled (``aot_eager``), each of the two blocks a
    compile region: the gathers the ops issue ahead of the regions (one a
    block in forward, one in backward) are packed and issued on the gather
    stream, each after it waited for the compute stream, as the eager
    runtime's ([Note: Gathers issued by ops on the gather stream] in
    core/ops.py). They ran on the compute stream, where under CPU offload
    each block's copy from the host held up the kernels behind it. Bitwise
    to the reference."""
    n_blocks = 2
    for res in run_distributed(_regions_rank, 2):
        assert_close(res, 0.0)
        for step_log in res["after"][1:]:
            gathers = _spans(step_log, "gather")
            assert len(gathers) == 2 * n_blocks, step_log
            assert all(wait[:3] == ("gather", "wait_stream", "compute") for wait, _, _ in gathers), step_log


def _post_optim_rank(rank: int, world: int) -> dict:
    return _recording_rank(rank, world, post_optim=True)


def test_the_post_optim_event_orders_the_first_gather_only() -> None:
    """``set_post_optim_event`` after each optimizer step (eager, two ranks):
    the step's first gather waits for that event instead of the compute
    stream; every later one waits for the compute stream, as FSDP2 waits for
    the event once, at the root's pre-forward. The event was kept for the
    whole step, so no gather waited for the compute stream, and the gather
    stream could reuse a block the compute stream still read. Bitwise to
    the reference."""
    for res in run_distributed(_post_optim_rank, 2):
        assert_close(res, 0.0)
        for step_log in res["after"][2:]:  # (from the first step with the event set)
            waits = [wait[:3] for wait, _, _ in _spans(step_log, "gather")]
            assert waits[0] == ("gather", "wait_event", "compute"), waits
            assert len(waits) > 1 and all(w == ("gather", "wait_stream", "compute") for w in waits[1:]), waits
