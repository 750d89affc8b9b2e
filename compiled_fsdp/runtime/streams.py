"""The eager runtime's streams: all-gathers and reduce-scatters off the compute
stream, so communication overlaps compute on an accelerator.

[Note: Streams and events]
On a device with streams (CUDA, or any ``torch.accelerator``) each root has
two side streams besides the compute (current) stream::

    compute  |pack grads i|--------- backward i-1 ---------|copy-out j|-- forward j --
                  |  wait_stream                    wait (event) ^
    reduce        +-> reduce-scatter i (NCCL) ------+            |
    gather   wait_stream -> |pack shards j| all-gather j (NCCL) -+

* An all-gather (its copy-in: the cast and pack of the shards, and the
  collective) is issued on the gather stream after that stream waits for
  the compute stream (the shards the optimizer last wrote). Its output is
  copied out on the compute stream after the compute stream waits for the
  collective (``work.wait()`` blocks the stream, not the CPU). The next
  module's all-gather is issued one module ahead (ctx.prefetch_next /
  backward_prefetch_target), so it runs while this module computes.
* A gather on a group of one rank communicates nothing (``comm.all_gather_flat``
  hands back its input), so no work orders the compute stream behind its
  copy-in (the shards' copy from the CPU under offload, their cast to the
  compute dtype, the pack): ``joined`` records an event on the gather
  stream after it, and the compute stream waits for that event where it
  would have waited for the work. Without it the copy-out read the buffer
  while the gather stream still wrote it (world size 1 with mixed
  precision or offload, ``replicate``, HSDP with shards of one rank; the
  helper review of 2026-11-30 found it by reading). Tested by
  tests/test_streams.py::test_a_gather_of_one_rank_is_waited_by_event.
* A reduce-scatter's input is packed on the compute stream (the gradients
  are the compute stream's and freed there), then the reduce stream waits
  for the compute stream and issues the collective; the result is read on
  the compute stream at the end of backward, after it waits for the work.
* ``set_post_optim_event``: the first gather after it waits for that event
  instead of the compute stream, and the event is then spent, as FSDP2
  waits for it once, at the root's pre-forward. Kept for the whole step, it
  let every gather skip the compute stream, so the gather stream reused a
  block the compute stream was still reading (the rule below broken; a
  helper's reading review of 2026-12-01 found it). Tested by
  tests/test_streams.py::test_the_post_optim_event_orders_the_first_gather_only.
* Memory without ``record_stream``: a side stream allocates only right after
  it waited for the compute stream, so a block it frees (the gathered
  buffer, once copied out; the reduce output, once added to ``.grad``) is
  reused only behind every compute kernel enqueued before that wait,
  including the ones that read it. A compute-stream block that a collective
  reads (the packed gradients) is held by the collective's work until it is
  waited (NCCL's allocator-safety stash). Nothing else crosses streams.

On the CPU there are no streams: every method here is a no-op and the
runtime runs as before. The logic is tested on the CPU by a recording
stand-in (tests/test_streams.py); the CUDA path by the GPU check.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from compiled_fsdp.core import compat
from compiled_fsdp.core.comm import PendingCollective

__all__ = ["CommStreams"]


class CommStreams:
    """The side streams of one root on one device (no-ops without streams)."""

    def __init__(self, device: torch.device, make_stream: Optional[Callable[[torch.device], Any]] = None,
                 current: Optional[Callable[[torch.device], Any]] = None) -> None:
        self.device = device
        # (a stand-in's ``make_stream``/``current``: tests/test_streams.py)
        self.enabled = make_stream is not None or compat.has_streams(device)
        make_stream = make_stream or compat.new_stream
        self._current = current or compat.current_stream
        self.gather = make_stream(device) if self.enabled else None
        self.reduce = make_stream(device) if self.enabled else None
        # FSDPModule.set_post_optim_event: the next all-gathers wait for this
        # event instead of the compute stream; cleared at the end of the step.
        self.post_optim_event: Any = None

    @contextlib.contextmanager
    def _on(self, side: Any, after: Any = None) -> Iterator[None]:
        """Issue on ``side`` once it waited for the compute stream, or only for
        the event ``after`` (see [Note: Streams and events])."""
        if side is None:
            yield
            return
        if after is not None:
            side.wait_event(after)
        else:
            side.wait_stream(self._current(self.device))
        with side:
            yield

    def on_gather(self) -> contextlib.AbstractContextManager:
        """Where an all-gather's copy-in and collective are issued: after the
        compute stream, or, for the first gather after ``set_post_optim_event``,
        after that event only (see [Note: Streams and events])."""
        event, self.post_optim_event = self.post_optim_event, None
        return self._on(self.gather, event)

    def joined(self, pending: PendingCollective) -> PendingCollective:
        """``pending``, an all-gather issued on the gather stream, made safe
        to read on the compute stream: one that communicated nothing waits
        for an event instead of a work (see [Note: Streams and events])."""
        if self.gather is None or pending.work is not None:
            return pending
        event = self.gather.record_event()
        finish = pending.finish

        def waited(out: torch.Tensor) -> torch.Tensor:
            self._current(self.device).wait_event(event)
            return finish(out) if finish is not None else out

        return PendingCollective(pending.output, None, finish=waited)

    def compute_event(self) -> Any:
        """An event recorded on the compute stream now ([Note: Offloaded
        gradients land at the end of backward] in reduces.py); None without streams."""
        return self._current(self.device).record_event() if self.enabled else None

    def on_reduce(self) -> contextlib.AbstractContextManager:
        """Where a reduce-scatter's collective is issued (after its input is packed)."""
        return self._on(self.reduce)
