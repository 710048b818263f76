"""Record one step under ``torch.profiler`` into a :class:`Timeline` and a :class:`MemoryCurve`.

Where each lane comes from, in order of preference:

- compute: on CUDA, the kernels of the compute stream (the stream with the most kernel time
  that is not a copy), each attributed to the layer whose forward launched it (through the
  launch's correlation id); on CPU, the top-level operators run on the step's thread. Layer
  forwards are the ``offload::layer<N>`` ranges when the engine records them, else ranges this
  recorder puts around the given layers' forwards (``plot::layer<N>``), only while recording.
- copies (D2H / H2D): on CUDA, the profiler's ``Memcpy DtoH`` / ``Memcpy HtoD`` activities (CUPTI
  reports the native extension's batched copies as such on our H100); failing that, the engine's
  ``offload::offload`` / ``offload::reload`` ranges (on CUDA: when the copies were submitted, not
  when they ran); failing that, on the host transport, the engine's own per-copy records of the
  step (host clock), since a native ``memcpy`` is invisible to the profiler.
- waits: the engine's ``offload::release_wait`` ranges, if it records them.
- memory: the profiler's allocation events (``profile_memory=True``), summed over time from the
  allocator's reading at the step's start. They are stamped in host time, and on CUDA those made
  on autograd's backward thread are missing (seen with torch 2.11 on our H100), so there the
  curve is right for the forward only; the allocator's own history
  (``torch.cuda.memory._record_memory_history``) would cover the backward too.

The kineto events are read through ``prof.profiler.kineto_results``, as torch's own parser does:
the ``[memory]`` events attributed to an operator are folded into it in ``prof.events()``.
"""

from __future__ import annotations

import bisect
import re
import time
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from .data import COMPUTE, D2H, H2D, WAITS, Interval, MemoryCurve, StepRecording, Timeline

STEP_RANGE = "plot::step"
_LAYER_RANGE = re.compile(r"^(offload|plot)::layer(\d+)$")
_ENGINE_COPY_RANGES = {"offload::offload": D2H, "offload::reload": H2D}
_WAIT_RANGE = "offload::release_wait"
_MEMORY_EVENT = "[memory]"
# Kernels closer than this (ms) with the same label are drawn as one bar: thousands of bars of a
# few microseconds each would neither render nor read.
MERGE_GAP_MS = 0.02


def record_step(
    step_fn: Callable[[], Any],
    *,
    offloader: Any = None,
    layers: Optional[Iterable[torch.nn.Module]] = None,
    device: Union[None, str, torch.device] = None,
) -> StepRecording:
    """Run ``step_fn()`` once (forward and backward) under ``torch.profiler`` and return its
    :class:`Timeline` and :class:`MemoryCurve`.

    ``offloader``: the ``OffloadActivations`` or per-layer context the step uses (its layers and
    device are taken from it, and on the host transport its copy records). ``layers``: the
    modules whose forwards label the compute lane (default: the offloader's). ``device``: the
    device the step runs on (default: the offloader's, else CUDA when available, else CPU).
    Run a warm-up step first: a first step also allocates pinned memory and compiles kernels.
    """
    if not callable(step_fn):
        raise TypeError(f"offload.plot.record_step: step_fn must be callable, got {type(step_fn).__name__}")
    engine = getattr(offloader, "engine", None)
    if offloader is not None and not hasattr(offloader, "engine"):
        raise TypeError(
            "offload.plot.record_step: offloader must be an OffloadActivations or a context from "
            f"get_cpu_offload_context, got {type(offloader).__name__}"
        )
    dev = _device(engine, device)
    layer_list = list(layers) if layers is not None else list(getattr(offloader, "layers", None) or [])
    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(dev)
    start_bytes = torch.cuda.memory_allocated(dev) if cuda else 0
    hooks = _LayerRanges(layer_list)
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        with hooks:
            host_start = time.perf_counter()
            with record_function(STEP_RANGE):
                step_fn()
                if cuda:
                    torch.cuda.synchronize(dev)
            host_end = time.perf_counter()
    events = _Events(prof, cuda=cuda)
    timeline = events.timeline(dev.type)
    if not timeline.lane(D2H) and not timeline.lane(H2D) and engine is not None and not cuda:
        _add_engine_copy_records(timeline, engine, host_start, host_end)
    return StepRecording(timeline=timeline, memory=events.memory(dev, start_bytes))


def _device(engine: Any, device: Union[None, str, torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if engine is not None:
        return engine.transport.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _LayerRanges:
    """Profiler ranges around each forward call of the given layers, while recording only.

    Calls are numbered in order (a weight-shared module listed twice is two layers); calls beyond
    the number of layers are recomputes (checkpointing in backward) and get no range.
    """

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        self.handles: list[Any] = []
        self.open: list[Any] = []
        self.calls = 0

    def __enter__(self) -> "_LayerRanges":
        for module in dict.fromkeys(self.layers):
            self.handles.append(module.register_forward_pre_hook(self._before))
            self.handles.append(module.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        while self.open:  # a forward that raised leaves its range open
            self._close()

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        index = self.calls
        self.calls += 1
        if index >= len(self.layers):
            self.open.append(None)
            return
        rf = record_function(f"plot::layer{index}")
        rf.__enter__()
        self.open.append(rf)

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.open:
            self._close()

    def _close(self) -> None:
        rf = self.open.pop()
        if rf is not None:
            rf.__exit__(None, None, None)


def _is_cuda(event: Any) -> bool:
    return str(event.device_type()).endswith("CUDA")


class _Events:
    """The kineto events of one recording, in milliseconds from the step range's start."""

    def __init__(self, prof: Any, *, cuda: bool) -> None:
        self.cuda = cuda
        self.events = list(prof.profiler.kineto_results.events())
        step = [e for e in self.events if e.name() == STEP_RANGE and not _is_cuda(e)]
        if not step:
            raise RuntimeError("offload.plot.record_step: the profiler did not record the step range")
        self.origin_ns = step[0].start_ns()
        self.step_ms = self.ms(_end_ns(step[0]))
        self.thread = step[0].start_thread_id()

    def ms(self, ns: int) -> float:
        return (ns - self.origin_ns) / 1e6

    def span(self, event: Any, label: str = "") -> Interval:
        return Interval(label, self.ms(event.start_ns()), self.ms(_end_ns(event)))

    def host_ranges(self, names: Callable[[str], bool]) -> list[Any]:
        return sorted((e for e in self.events if not _is_cuda(e) and names(e.name())), key=lambda e: e.start_ns())

    # -- lanes -------------------------------------------------------------------------------
    def layer_ranges(self) -> list[Interval]:
        ranges = self.host_ranges(lambda n: _LAYER_RANGE.match(n) is not None)
        # The engine's own layer ranges win over the recorder's, when both are there.
        engine_ranges = [e for e in ranges if e.name().startswith("offload::")]
        chosen = engine_ranges or ranges
        return [self.span(e, f"L{_LAYER_RANGE.match(e.name()).group(2)}") for e in chosen]  # type: ignore[union-attr]

    def timeline(self, device: str) -> Timeline:
        layers = self.layer_ranges()
        timeline = Timeline(step_ms=self.step_ms, device=device)
        if self.cuda:
            timeline.lanes[COMPUTE] = self._kernels(layers)
            timeline.compute_source = "kernels on the compute stream, by the layer that launched them"
        else:
            timeline.lanes[COMPUTE] = self._host_ops(layers)
            timeline.compute_source = "top-level operators on the step's thread"
        self._copies(timeline)
        waits = self.host_ranges(lambda n: n == _WAIT_RANGE)
        if waits:
            timeline.lanes[WAITS] = [self.span(e, "release wait") for e in waits]
        return timeline

    def _kernels(self, layers: list[Interval]) -> list[Interval]:
        kernels = [e for e in self.events if _is_cuda(e) and not _is_copy(e.name()) and e.name() != _MEMORY_EVENT]
        busy: dict[int, int] = {}
        for e in kernels:
            busy[e.device_resource_id()] = busy.get(e.device_resource_id(), 0) + _end_ns(e) - e.start_ns()
        if not busy:
            return []
        compute_stream = max(busy, key=lambda s: busy[s])
        launched = {e.correlation_id(): e.start_ns() for e in self.events if not _is_cuda(e) and e.correlation_id()}
        bars = []
        for e in sorted(kernels, key=lambda e: e.start_ns()):
            if e.device_resource_id() != compute_stream:
                continue
            launch = launched.get(e.correlation_id())
            label = _label_at(layers, self.ms(launch)) if launch is not None else ""
            bars.append(self.span(e, label))
        return _merge(bars)

    def _host_ops(self, layers: list[Interval]) -> list[Interval]:
        ops = sorted(
            (e for e in self.events
             if not _is_cuda(e) and e.start_thread_id() == self.thread and not e.is_user_annotation()
             and e.name() != _MEMORY_EVENT and not e.name().startswith(("offload::", "plot::"))),
            key=lambda e: (e.start_ns(), -_end_ns(e)),
        )
        bars, covered_until = [], None
        for e in ops:  # top-level only: an operator inside another is already covered
            if covered_until is not None and _end_ns(e) <= covered_until:
                continue
            covered_until = _end_ns(e)
            span = self.span(e)
            bars.append(span._replace(label=_label_at(layers, span.start_ms)))
        return _merge(bars)

    def _copies(self, timeline: Timeline) -> None:
        memcpy = sorted((e for e in self.events if _is_cuda(e) and _is_copy(e.name())), key=lambda e: e.start_ns())
        d2h = [self.span(e) for e in memcpy if e.name().startswith("Memcpy DtoH")]
        h2d = [self.span(e) for e in memcpy if e.name().startswith("Memcpy HtoD")]
        if d2h or h2d:
            timeline.lanes[D2H], timeline.lanes[H2D] = d2h, h2d
            timeline.copy_source = "profiler memcpy activities (device time)"
            return
        ranges = self.host_ranges(lambda n: n in _ENGINE_COPY_RANGES)
        if ranges:
            for e in ranges:
                timeline.lanes.setdefault(_ENGINE_COPY_RANGES[e.name()], []).append(self.span(e))
            timeline.copy_source = (
                "engine ranges offload::offload / offload::reload"
                + (" (host submission times)" if self.cuda else " (host copies)")
            )

    def memory(self, device: torch.device, start_bytes: int) -> MemoryCurve:
        cuda = device.type == "cuda"
        deltas = sorted(
            (e.start_ns(), e.nbytes()) for e in self.events
            if e.name() == _MEMORY_EVENT and _is_cuda(e) == cuda
            and (not cuda or e.device_index() == device.index)
        )
        # The profiler stamps an allocation when the host queues the operator (the GPU runs it
        # later), and on CUDA it misses those made on autograd's backward thread (seen on our
        # H100): the curve is the forward's, in host time.
        what = ("GPU memory allocated (host time; backward-thread allocations not recorded)" if cuda
                else "host memory allocated by torch since the step began")
        curve = MemoryCurve(device=device.type, what=what, samples=[(0.0, start_bytes)])
        level = start_bytes
        for ns, nbytes in deltas:
            t = self.ms(ns)
            if t < 0 or t > self.step_ms:
                continue
            level += nbytes
            curve.samples.append((t, level))
        curve.samples.append((self.step_ms, level))
        return curve


def _end_ns(event: Any) -> int:
    end = getattr(event, "end_ns", None)
    return end() if end is not None else event.start_ns() + event.duration_ns()


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def _label_at(layers: list[Interval], t_ms: float) -> str:
    """The label of the layer range that contains ``t_ms`` (ranges are in time order)."""
    i = bisect.bisect_right([r.start_ms for r in layers], t_ms) - 1
    return layers[i].label if i >= 0 and t_ms <= layers[i].end_ms else ""


def _merge(bars: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for bar in bars:
        last = merged[-1] if merged else None
        if last is not None and last.label == bar.label and bar.start_ms - last.end_ms <= MERGE_GAP_MS:
            merged[-1] = last._replace(end_ms=max(last.end_ms, bar.end_ms))
        else:
            merged.append(bar)
    return merged


def _add_engine_copy_records(timeline: Timeline, engine: Any, host_start: float, host_end: float) -> None:
    """The host transport's own copy records that fall inside the step (host clock, perf_counter).

    ``host_start`` was read just before the step range opened, so it stands for its time 0 (to a
    few microseconds).
    """
    counters = [c for c in (engine.last_finished, getattr(engine.step, "counters", None)) if c is not None]
    seen = set()
    for c in counters:
        for direction, start, end in c.copies:
            t0, t1 = getattr(start, "t", None), getattr(end, "t", None)
            if t0 is None or t1 is None or not host_start <= t0 <= host_end or id(start) in seen:
                continue
            seen.add(id(start))
            lane = D2H if direction == "d2h" else H2D
            timeline.lanes.setdefault(lane, []).append(Interval("", (t0 - host_start) * 1e3, (t1 - host_start) * 1e3))
    for lane in (D2H, H2D):
        if lane in timeline.lanes:
            timeline.lanes[lane].sort(key=lambda i: i.start_ms)
    if timeline.lane(D2H) or timeline.lane(H2D):
        timeline.copy_source = "the engine's copy records (host clock)"
