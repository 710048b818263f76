"""Pictures of a step: a copy timeline, a memory curve, and step time against peak.

Two layers, so that data can be tested and reused without a plotting library:

- data (no matplotlib): :class:`Timeline` (lanes of ``(label, start_ms, end_ms)`` intervals),
  :class:`MemoryCurve` (``(t_ms, bytes)`` samples), :class:`ParetoPoint`, and
  :func:`record_step`, which runs one call of a step function under ``torch.profiler`` and
  returns both;
- renderers (matplotlib, imported when called; ``pip install matplotlib`` or the ``plot``
  extra): :func:`plot_timeline`, :func:`plot_memory`, :func:`plot_pareto`, each writing a PNG.

    from offload.plot import record_step, plot_timeline, plot_memory
    recording = record_step(train_step, offloader=oa)     # oa: the OffloadActivations in use
    plot_timeline(recording.timeline, "timeline.png")
    plot_memory(recording.memory, "memory.png")
"""

from .data import D2H, H2D, COMPUTE, WAITS, Interval, MemoryCurve, ParetoPoint, StepRecording, Timeline
from .record import record_step
from .render import plot_memory, plot_pareto, plot_timeline

__all__ = [
    "COMPUTE",
    "D2H",
    "H2D",
    "Interval",
    "MemoryCurve",
    "ParetoPoint",
    "StepRecording",
    "Timeline",
    "WAITS",
    "plot_memory",
    "plot_pareto",
    "plot_timeline",
    "record_step",
]
