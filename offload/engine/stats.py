"""Per-step counters and the readable report.

Counters are bumped on the hot path (plain integer and dict updates). Copy and stall times come
from CUDA events, which are only read when somebody asks for the stats (``snapshot``), so the hot
path never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, TypedDict


@dataclass
class StepCounters:
    """What happened in one step (one forward and its backward)."""

    step: int
    mode: str
    kept: dict[str, int] = field(default_factory=dict)
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0        # bytes of the storage spans copied out (after dedup)
    released_bytes: int = 0         # of those, bytes whose GPU originals were then dropped
    groups_offloaded: int = 0
    groups_kept: int = 0            # groups left on the GPU because no host region could be had
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    reloads: int = 0
    reloads_on_demand: int = 0      # of those, started only when backward needed the group
    # (direction, bytes, start event, end event) per *timed* copy (the transport's ``timing``);
    # (before, after) events around each stall of a timed group.
    copies: list[tuple[str, int, Any, Any]] = field(default_factory=list)
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    pinned_allocations: int = 0
    finished: bool = False
    # Recorded into a CUDA graph: the figures describe what every replay does; copy and stall
    # times are not measured (captured work does not run at capture time, and replays run no
    # Python).
    captured: bool = False

    def keep(self, reason: str, count: int = 1) -> None:
        """Count ``count`` tensors kept for ``reason``."""
        self.kept[reason] = self.kept.get(reason, 0) + count


class StepStats(TypedDict):
    """The figures of one step, as ``ctx.stats`` / ``OffloadActivations.stats`` return them.

    "D2H" is the copy out of the layer's memory (GPU to pinned host memory on the CUDA
    transport, a host-to-host copy into the arena on the ``cpu`` transport), "H2D" the copy back.
    A step is one forward and its backward.

    - ``step`` (int): the step's number, counted from 1 by the context (every step of an
      ``OffloadActivations`` with a budget, its probe steps included).
    - ``mode`` (str): the schedule: ``"v1"``, ``"v2"``, ``"planned"``, with ``" (manual)"`` for
      ``manual_synchronization=True``; ``"auto"`` for ``OffloadActivations()`` without layers
      (groups found by bytes); ``"disabled"`` for a context made with ``enabled=False`` (every
      figure then 0 but ``weight_cache_bytes``).
    - ``transport`` (str): ``"cuda"`` (side-stream copies to pinned memory) or ``"cpu"`` (host
      copies, ``device="cpu"``); ``"none"`` for a graphed layer without an engine or a disabled
      context.
    - ``native`` (bool): the copies went through the native extension (``offload._C``), not the
      pure-Python ``copy_`` loop.
    - ``offloaded_tensors`` (int, tensors): saved tensors copied out (quantized storages count
      once per component).
    - ``offloaded_bytes`` (int, bytes): bytes of the storage spans copied out, after dedup (a
      storage saved twice counts once).
    - ``released_bytes`` (int, bytes): of ``offloaded_bytes``, the bytes whose originals were
      then dropped: the memory offloading really freed during the step.
    - ``kept`` (dict[str, int], tensors per reason): saved tensors left where they were, keyed by
      the reasons ``offload.engine.policy`` defines (its ``KEEP_*`` names: ``"parameter"``,
      ``"marked"``, ``"small"``, ``"budget"``, ...); a reason never seen has no key.
    - ``kept_tensors`` (int, tensors): the sum of ``kept``.
    - ``groups_offloaded`` (int, groups): layer groups copied out (one group per offloaded layer).
    - ``groups_kept`` (int, groups): groups left in place because no host region could be had
      (the host budget or a pinned allocation failed: ``kept["budget"]``; or the region was still
      being pinned and the GPU had room, ``kept["pinning"]``, see ``wait_for_pinning``): nothing
      is lost, memory is not saved.
    - ``bytes_d2h`` (int, bytes): bytes copied out (the slot spans).
    - ``bytes_h2d`` (int, bytes): bytes copied back (whole regions: slots plus alignment padding).
    - ``reloads`` (int, copies): copies back, one per group reloaded.
    - ``reloads_on_demand`` (int, copies): of ``reloads``, those started only when backward
      needed the group (no prefetch had started it), so compute waited for the whole copy. 0
      when every reload was prefetched, with several micro-batches in flight too.
    - ``d2h_ms`` / ``h2d_ms`` (float, milliseconds): the *timed* copies' summed durations (CUDA
      events on the copy streams; host clock on the ``cpu`` transport). Which copies are timed
      is the ``timing`` option: all, none, or (default) those of 4 MiB or more. 0 when none was
      timed (graph capture, ``timing=False``, only small copies). On the ``cpu`` transport the
      copy back writes into a buffer allocated for it, so ``h2d_ms`` includes the first touch of
      every page of that buffer (the kernel zero-fills it), not only the copy.
    - ``timed_bytes_d2h`` / ``timed_bytes_h2d`` (int, bytes): the bytes of the timed copies.
    - ``d2h_gbps`` / ``h2d_gbps`` (float or None, GB/s = 1e9 bytes per second): timed bytes over
      timed time, None when no copy was timed (on the ``cpu`` transport ``h2d_gbps`` is therefore
      no copy rate, and the report does not show it).
    - ``wait_ms`` (float, milliseconds): time the compute stream waited for timed copies (release
      waits on a D2H, use waits on an H2D): the part of the copies not hidden under compute.
    - ``pinned_bytes_held`` (int, bytes): host memory the arena holds now, as really locked
      (page rounding included; pinned on CUDA, plain host memory on the ``cpu`` transport),
      reused from step to step.
    - ``host_budget_bytes`` (int, bytes): the cap on host memory the arena may hold; a group that
      does not fit stays where it is (``kept["budget"]``).
    - ``host_budget_source`` (str): where the cap came from: ``"host_budget_bytes"`` (given), or
      the default's formula (the node's total less the floor left for others, divided by
      ``LOCAL_WORLD_SIZE``, with the figures).
    - ``host_needed_bytes`` (int or None, bytes): host memory the plan in force needs (its
      regions' blocks, as the allocator holds them); None when no plan is in force.
    - ``host_bound_bytes`` (int or None, bytes): the most the arena holds for its plans: the
      needs of its recent plans together plus a slack (``offload.host.room``); idle blocks beyond it are dropped, least
      recently used first. None when no plan is in force.
    - ``host_peak_bytes`` (int, bytes): the most host memory the arena has held at once (blocks
      being pinned included), since the context was made.
    - ``host_node_available_bytes`` / ``host_node_floor_bytes`` (int or None, bytes): the node's
      available memory when it was last read (before the pool last grew, or a plan was made) and
      the floor left for the OS and other processes (``offload.host.node``); the arena holds at
      most available + its own bytes - floor. None before any read.
    - ``host_numa_node`` (int or None): the NUMA node the arena's host blocks are bound to (the
      GPU's own node, read from sysfs), None when they are not bound.
    - ``host_numa_source`` (str): why: the GPU and its node, or the reason for no binding (a
      single-node host, no node in sysfs, the ``cpu`` transport, no native extension).
    - ``pinned_allocations`` (int, allocations): host blocks allocated during the step (0 in a
      steady step: the arena is reused).
    - ``finished`` (bool): the step's backward is done (else the figures are of a step still in
      progress).
    - ``captured`` (bool): the step was recorded into a CUDA graph: the figures describe every
      replay, and copy and wait times are not measured.
    - ``weight_cache_bytes`` (int or None, bytes): GPU (or host) memory held now by the FP8 weight
      copies of the context's modules (``OffloadActivations``' layers, or ``params_from``), as
      :func:`offload.fp8.weight_cache_bytes` counts them, with ``enabled=False`` too; None when
      the context was given no modules. Not activation memory: it is there whether or not
      anything is offloaded.
    """

    step: int
    mode: str
    transport: str
    native: bool
    offloaded_tensors: int
    offloaded_bytes: int
    released_bytes: int
    kept: dict[str, int]
    kept_tensors: int
    groups_offloaded: int
    groups_kept: int
    bytes_d2h: int
    bytes_h2d: int
    reloads: int
    reloads_on_demand: int
    d2h_ms: float
    h2d_ms: float
    d2h_gbps: Optional[float]
    h2d_gbps: Optional[float]
    timed_bytes_d2h: int
    timed_bytes_h2d: int
    wait_ms: float
    pinned_bytes_held: int
    host_budget_bytes: int
    host_budget_source: str
    host_needed_bytes: Optional[int]
    host_bound_bytes: Optional[int]
    host_peak_bytes: int
    host_node_available_bytes: Optional[int]
    host_node_floor_bytes: Optional[int]
    host_numa_node: Optional[int]
    host_numa_source: str
    pinned_allocations: int
    finished: bool
    captured: bool
    weight_cache_bytes: Optional[int]


def weight_cache_bytes(modules: Iterable[Any]) -> int:
    """Bytes held by the weight caches of ``modules`` and their submodules, each module counted
    once: a module that keeps derived copies of its weights (``offload.fp8``'s layers) has a
    ``weight_cache`` with an ``nbytes``. Read by attribute so that this floor needs no FP8 code."""
    seen: set[int] = set()
    total = 0
    for root in modules:
        for module in root.modules():
            cache = getattr(module, "weight_cache", None)
            if cache is not None and id(module) not in seen:
                seen.add(id(module))
                total += int(getattr(cache, "nbytes", 0))
    return total


def _elapsed_ms(start: Any, end: Any) -> float:
    if start is None or end is None:
        return 0.0
    end.synchronize()
    return float(start.elapsed_time(end))


def snapshot(
    c: StepCounters,
    *,
    pinned_bytes_held: int,
    native: bool,
    transport: str,
    host_budget_bytes: int,
    host_budget_source: str,
    host_needed_bytes: Optional[int] = None,
    host_bound_bytes: Optional[int] = None,
    host_peak_bytes: int = 0,
    host_node_available_bytes: Optional[int] = None,
    host_node_floor_bytes: Optional[int] = None,
    host_numa_node: Optional[int] = None,
    host_numa_source: str = "not bound",
    weight_cache_bytes: Optional[int] = None,
) -> StepStats:
    """The step's figures as a plain dict, keys as :class:`StepStats` documents them (reads the
    step's CUDA events; may wait for them)."""
    d2h_ms = sum(_elapsed_ms(s, e) for d, _, s, e in c.copies if d == "d2h")
    h2d_ms = sum(_elapsed_ms(s, e) for d, _, s, e in c.copies if d == "h2d")
    # Rates over the timed copies only (untimed copies have no duration to divide by).
    d2h_timed = sum(n for d, n, _, _ in c.copies if d == "d2h")
    h2d_timed = sum(n for d, n, _, _ in c.copies if d == "h2d")
    wait_ms = sum(_elapsed_ms(b, a) for b, a in c.waits)

    def gbps(nbytes: int, ms: float) -> Optional[float]:
        return nbytes / ms / 1e6 if ms > 0 else None

    return StepStats(
        step=c.step,
        mode=c.mode,
        transport=transport,
        native=native,
        offloaded_tensors=c.offloaded_tensors,
        offloaded_bytes=c.offloaded_bytes,
        released_bytes=c.released_bytes,
        kept=dict(c.kept),
        kept_tensors=sum(c.kept.values()),
        groups_offloaded=c.groups_offloaded,
        groups_kept=c.groups_kept,
        bytes_d2h=c.bytes_d2h,
        bytes_h2d=c.bytes_h2d,
        reloads=c.reloads,
        reloads_on_demand=c.reloads_on_demand,
        d2h_ms=d2h_ms,
        h2d_ms=h2d_ms,
        d2h_gbps=gbps(d2h_timed, d2h_ms),
        h2d_gbps=gbps(h2d_timed, h2d_ms),
        timed_bytes_d2h=d2h_timed,
        timed_bytes_h2d=h2d_timed,
        wait_ms=wait_ms,
        pinned_bytes_held=pinned_bytes_held,
        host_budget_bytes=host_budget_bytes,
        host_budget_source=host_budget_source,
        host_needed_bytes=host_needed_bytes,
        host_bound_bytes=host_bound_bytes,
        host_peak_bytes=host_peak_bytes,
        host_node_available_bytes=host_node_available_bytes,
        host_node_floor_bytes=host_node_floor_bytes,
        host_numa_node=host_numa_node,
        host_numa_source=host_numa_source,
        pinned_allocations=c.pinned_allocations,
        finished=c.finished,
        captured=c.captured,
        weight_cache_bytes=weight_cache_bytes,
    )


DISABLED_REPORT = "offload report: disabled (enabled=False): nothing is offloaded"


def disabled_stats(modules: Any = ()) -> StepStats:
    """The figures of a context made with ``enabled=False``: every key of :class:`StepStats`,
    ``mode`` ``"disabled"``, transport ``"none"``, every count 0. A disabled context answers
    ``stats`` like an enabled one, so code that logs the figures runs with offloading off.

    ``modules``: the modules the context was given (a module, or an iterable of them: its layers
    or ``params_from``). ``weight_cache_bytes`` is then what their FP8 weight copies hold now,
    the figure an enabled context reports (those copies exist whether or not anything is
    offloaded); None when no module was given, as for an enabled context."""
    # A module is one root (weight_cache_bytes walks its submodules); anything else is a
    # collection of roots, made a tuple so that "no module given" can be told (a generator is
    # always truthy).
    roots = (modules,) if callable(getattr(modules, "modules", None)) else tuple(modules)
    return snapshot(
        StepCounters(step=0, mode="disabled"), pinned_bytes_held=0, native=False, transport="none",
        host_budget_bytes=0, host_budget_source="offloading disabled (enabled=False)",
        host_numa_source="offloading disabled (enabled=False)",
        weight_cache_bytes=weight_cache_bytes(roots) if roots else None,
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, whichever reads best."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


# The report's words for each transport: a GPU's copies go over PCIe to pinned memory; the host
# transport copies within host memory, where "GPU" and "D2H" would be false.
_REPORT_WORDS = {
    "cuda": {"released": "released from the GPU", "out": "D2H", "back": "H2D",
             "kept_groups": "groups kept on GPU", "held": "pinned held"},
    "cpu": {"released": "originals freed after the host copy", "out": "host copy out",
            "back": "host copy back", "kept_groups": "groups kept in place", "held": "host arena held"},
}

# What each schedule (``StepStats["mode"]``) does, in a few words, so that the report's first
# lines read without the docs.
_SCHEDULE_WORDS = {
    "v2": "offloaded layers copied out as they end, reloaded ahead of their backward",
    "v1": "TransformerEngine v1's group windows, one group in flight",
    "planned": "per layer keep, offload or recompute, as the plan says",
    "auto": "no layers given: groups cut by bytes saved",
    "disabled": "enabled=False: nothing offloaded",
}
_MANUAL = " (manual)"

_TRANSPORT_WORDS = {
    "cuda": "side-stream copies to pinned host memory",
    "cpu": 'host-to-host copies, device="cpu"',
    "none": "no copies",
}


def _schedule_row(mode: str) -> str:
    """``mode`` with what it means, e.g. ``v2 (offloaded layers copied out as they end, ...)``."""
    manual = mode.endswith(_MANUAL)
    base = mode[: -len(_MANUAL)] if manual else mode
    words = "manual_synchronization=True: the caller starts each copy" if manual else _SCHEDULE_WORDS.get(base)
    return f"{base} ({words})" if words else mode


def _transport_row(transport: str, native: bool) -> str:
    """The transport with what it copies between, and by which path."""
    words = _TRANSPORT_WORDS.get(transport)
    path = "native batched copies" if native else "torch copy_, offload._C not in use"
    if transport == "none":
        return f"none ({words})"
    return f"{transport} ({words}; {path})" if words else f"{transport} ({path})"


def _host_needed_row(s: StepStats) -> str:
    """What the plan needs on the host against what is held, and the node's room."""
    held = f"{format_bytes(s['pinned_bytes_held'])} held, {format_bytes(s['host_peak_bytes'])} at peak"
    if s["host_needed_bytes"] is None:
        text = f"- (no plan); {held}"
    else:
        text = (f"{format_bytes(s['host_needed_bytes'])} by the plan, held at most "
                f"{format_bytes(s['host_bound_bytes'] or 0)} with slack; {held}")
    if s["host_node_available_bytes"] is not None:
        text += (f"; node {format_bytes(s['host_node_available_bytes'])} available, "
                 f"{format_bytes(s['host_node_floor_bytes'] or 0)} left for others")
    return text


def format_report(s: StepStats) -> str:
    """A readable table of one :func:`snapshot`, worded for its transport (GPU and D2H/H2D on
    ``cuda``; host copies and the host arena on ``cpu``). The FP8 weight copies' line is shown
    only when they hold memory."""
    host = s["transport"] == "cpu"
    words = _REPORT_WORDS["cpu" if host else "cuda"]

    def rate(v: Optional[float]) -> str:
        return f"{v:.1f} GB/s" if v is not None else "-"

    def timed(timed_bytes: int, total: int, ms: float) -> str:
        if timed_bytes == total:
            return f" in {ms:.2f} ms"
        if timed_bytes == 0:
            return " (not timed: timing=True times every copy)"
        return f" ({format_bytes(timed_bytes)} timed: {ms:.2f} ms)"

    # On the host transport each copy back writes into a buffer allocated for it (torch.empty:
    # fresh pages), so its time includes the kernel zero-filling every page on first touch
    # (measured on a 2-core VM: all 2048 pages of an 8 MiB reload faulted, and the copy back ran
    # at 1.5-4 GB/s against 6-12 GB/s into a pre-touched buffer). The copy out goes into the
    # arena's reused, already touched region, and a GPU's reload buffer comes from the caching
    # allocator: those are copy rates; this one is not, so it is not shown.
    back_rate = "" if host else f", {rate(s['h2d_gbps'])}"
    reloads = f"{s['reloads']} reloads, {s['reloads_on_demand']} on demand"
    if host and s["timed_bytes_h2d"]:
        reloads += "; no GB/s: the time includes the new buffers' first-touch page faults"
    kept = ", ".join(f"{k}={v}" for k, v in sorted(s["kept"].items())) or "none"
    rows = [
        ("step", f"{s['step']} ({'finished' if s['finished'] else 'in progress'}"
                 f"{', captured in a CUDA graph: times not measured' if s['captured'] else ''})"),
        ("schedule", _schedule_row(s["mode"])),
        ("transport", _transport_row(s["transport"], s["native"])),
        ("tensors offloaded", f"{s['offloaded_tensors']} in {s['groups_offloaded']} group{'' if s['groups_offloaded'] == 1 else 's'}"),
        ("bytes offloaded", f"{format_bytes(s['offloaded_bytes'])} ({format_bytes(s['released_bytes'])} {words['released']})"),
        ("tensors kept", f"{s['kept_tensors']} ({kept})"),
        (words["kept_groups"], str(s["groups_kept"])),
        (words["out"], f"{format_bytes(s['bytes_d2h'])}{timed(s['timed_bytes_d2h'], s['bytes_d2h'], s['d2h_ms'])}, {rate(s['d2h_gbps'])}"),
        (words["back"], f"{format_bytes(s['bytes_h2d'])}{timed(s['timed_bytes_h2d'], s['bytes_h2d'], s['h2d_ms'])}{back_rate} ({reloads})"),
        ("compute waited", f"{s['wait_ms']:.2f} ms"),
        (words["held"], f"{format_bytes(s['pinned_bytes_held'])} ({s['pinned_allocations']} allocations this step)"),
        ("host budget", f"{format_bytes(s['host_budget_bytes'])} ({s['host_budget_source']})"),
        ("host needed", _host_needed_row(s)),
        ("host NUMA node", f"{'-' if s['host_numa_node'] is None else s['host_numa_node']} ({s['host_numa_source']})"),
    ]
    # Only a figure to show: 0 B (modules without FP8 layers) or None (no modules) says nothing.
    if s["weight_cache_bytes"]:
        rows.append(("FP8 weight copies", f"{format_bytes(s['weight_cache_bytes'])} (held by the modules, not offloaded)"))
    width = max(len(k) for k, _ in rows)
    lines = ["offload report", "-" * (width + 40)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
