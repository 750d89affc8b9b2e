"""What this thread's Dynamo is tracing of compile regions: see [Note:
Region calls traced once] in regions.py. (The compile session holds one:
``install.SESSION.regions``.)"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

__all__ = ["RegionTracing"]


class RegionTracing(threading.local):
    """This thread's Dynamo in compile regions ([Note: Region calls traced
    once] in regions.py): the block whose region call it traced last
    (``next``); while it traces a body, its class and frame's code
    (``traced``), and the block it is for (``calling``; entries weakly), in
    the trace attempt ``trace``: one that restarted left its state behind."""

    def __init__(self) -> None:
        self.next: Any = None
        self.traced: Optional[tuple[type, Any]] = None
        self.calling: Any = None
        self.trace: Optional[str] = None
        self._outer: list[tuple[Optional[tuple[type, Any]], Any]] = []  # (a body traced inside another's)

    def called(self, entry: Any) -> None:
        """Dynamo traces a region call, for ``entry``."""
        trace = _trace_id()
        if self.trace != trace:  # (another attempt: no body of the last one is being traced)
            self.reset()
            self.trace = trace
        self.next = entry

    def enter(self, cls: type, code: Any) -> None:
        """Dynamo begins tracing the body of ``cls``'s region, for ``next``."""
        self._outer.append((self.traced, self.calling))
        self.traced, self.calling, self.next, self.trace = (cls, code), self.next, None, _trace_id()

    def calling_now(self) -> Any:
        """``calling``, if set in the trace attempt under way."""
        return self.calling if self.trace == _trace_id() else None

    def leave(self) -> None:
        """Dynamo traced that body to its end."""
        self.traced, self.calling = self._outer.pop() if self._outer else (None, None)

    def reset(self) -> None:
        self.next = self.traced = self.calling = self.trace = None
        self._outer.clear()


def _trace_id() -> Optional[str]:
    trace = torch._guards.CompileContext.current_trace_id()
    return None if trace is None else str(trace)
