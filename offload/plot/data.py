"""What the plots show, as plain data: a step's timeline, its memory curve, step/peak points.

Nothing here needs matplotlib or a profiler; the recorder fills these, the renderers draw them.
Times are milliseconds from the start of the recorded step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# Lane names of a Timeline. D2H / H2D name the direction of the copy (out of the layer's memory,
# back into it) on both transports; the renderer words them for the device (host copies on CPU).
COMPUTE = "compute"
D2H = "D2H"
H2D = "H2D"
WAITS = "waits"


class Interval(NamedTuple):
    """One bar: ``label`` (e.g. ``"L3"`` for layer 3's forward; ``""`` when unattributed) from
    ``start_ms`` to ``end_ms``."""

    label: str
    start_ms: float
    end_ms: float

    @property
    def ms(self) -> float:
        """The interval's length in milliseconds."""
        return self.end_ms - self.start_ms


@dataclass
class Timeline:
    """Lanes of intervals over one step.

    ``lanes`` maps a lane name (:data:`COMPUTE`, :data:`D2H`, :data:`H2D`, :data:`WAITS`) to its
    intervals in time order. ``device`` is ``"cuda"`` or ``"cpu"``; ``copy_source`` says where
    the copy bars came from (the profiler's memcpy activities, the engine's ``offload::``
    ranges, or the engine's own copy records), ``compute_source`` what the compute bars are.
    """

    step_ms: float
    device: str
    copy_source: str = "none"
    compute_source: str = ""
    lanes: dict[str, list[Interval]] = field(default_factory=dict)

    def lane(self, name: str) -> list[Interval]:
        """The intervals of lane ``name`` (empty if the lane has none)."""
        return self.lanes.get(name, [])

    def busy_ms(self, name: str) -> float:
        """Summed length of lane ``name``'s intervals, in milliseconds."""
        return sum(i.ms for i in self.lane(name))


@dataclass
class MemoryCurve:
    """Memory allocated over one step: ``samples`` of ``(t_ms, bytes)`` in time order.

    On CUDA, the bytes the caching allocator has handed out on the device (what
    ``torch.cuda.memory_allocated`` reads), starting from its value at the step's start. On CPU,
    the net bytes torch allocated for CPU tensors since the step began (starts at 0).
    ``what`` says which, in words, for the plot.
    """

    device: str
    what: str
    samples: list[tuple[float, int]] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The highest sample (0 for an empty curve)."""
        return max((b for _, b in self.samples), default=0)

    @property
    def start_bytes(self) -> int:
        """The first sample (0 for an empty curve)."""
        return self.samples[0][1] if self.samples else 0


@dataclass(frozen=True)
class ParetoPoint:
    """One contender on a step-time-against-peak chart.

    ``peak_bytes`` its measured peak, ``step_vs_plain`` its step time over the plain step's,
    ``kind`` picks the marker: ``"plan"``, ``"offload"`` or anything else (a baseline).
    """

    label: str
    peak_bytes: int
    step_vs_plain: float
    kind: str = "baseline"


@dataclass
class StepRecording:
    """What :func:`offload.plot.record_step` returns: the step's timeline and memory curve."""

    timeline: Timeline
    memory: MemoryCurve
