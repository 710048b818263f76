"""Where the probe reads time and memory: marks on one device's timeline (CUDA events, or the
host clock on CPU) and the allocator's peak, segment by segment.

Apart from :mod:`offload.planner.probe` so that the probe reads as what it records, not how.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

__all__ = ["Clock", "Meter"]


class Clock:
    """Marks on one device's timeline: CUDA events, or the host clock on CPU."""

    # The host's time source, in seconds: a class attribute so that a test can give the probe a
    # clock of its own and check what the probe attributes to what without reading wall time.
    host_now: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """Now, on the current stream (an event recorded) or the host clock (seconds)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.host_now()

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end`` (0 if either is missing); waits for ``end``."""
        if start is None or end is None:
            return 0.0
        if self.cuda:
            end.synchronize()
            return max(0.0, float(start.elapsed_time(end)))
        return max(0.0, (end - start) * 1e3)


class Meter:
    """Device memory, segment by segment: each :meth:`segment` returns the allocator's peak since
    the last one and starts a new one, so a layer's own peak can be told from the step's.
    Reads nothing on CPU (the host has no allocator to ask)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peak = 0  # the whole step's

    def now(self) -> int:
        """Bytes allocated now (0 on CPU)."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def segment(self) -> int:
        """The peak since the last segment; starts the next one."""
        if not self.cuda:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device)
        self.peak = max(self.peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak
