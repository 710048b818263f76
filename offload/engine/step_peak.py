"""A planned step's peak of allocated device memory, as the plan report's "measured" figure.

CUDA has one peak counter per device, and anybody may reset it: a training loop that logs each
step's peak, a benchmark (``torch.cuda.reset_peak_memory_stats()`` before each step), a profiler.
Read only at the next step's entry, the counter covers just what ran since the last reset, which
after such a loop's reset is the gap before our entry: the weights. The plan report then read
"measured 15.0 GiB" for LLAMA-8B's shape at 16384 tokens, whose step peaked at 74.95 GiB (issue
48). So the counter is read where a step's memory is highest, before anyone else can reset it:
at the forward's end (the saved activations and the head) and at the backward's end (autograd's
final callback, queued at the backward's first layer), and once more at the next step's entry
(the optimizer's step and anything else the loop ran); the step's figure is the largest reading.
Each reading is one ``torch.cuda.max_memory_allocated`` call (tens of microseconds), three a step.
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["StepPeak"]


class StepPeak:
    """The largest reading of ``device``'s peak counter since :meth:`reset` (a step's entry)."""

    __slots__ = ("device", "bytes", "_queued")

    def __init__(self, device: Union[torch.device, str]) -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self._queued = False  # a read is queued for the end of the backward running now

    def reset(self) -> None:
        """A step begins: reset the counter (the step's figures start here)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.bytes = 0
        self._queued = False  # (a backward that raised never ran its callback)

    def read(self) -> int:
        """Read the counter now; the largest reading since :meth:`reset`."""
        self.bytes = max(self.bytes, int(torch.cuda.max_memory_allocated(self.device)))
        return self.bytes

    def read_after_backward(self) -> None:
        """From inside a backward (a hook): read the counter when that backward ends (once per
        backward call, however many layers ask)."""
        if self._queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        except RuntimeError:
            return  # not inside a backward after all: the next reading covers it
        self._queued = True

    def _backward_done(self) -> None:
        self._queued = False
        self.read()
