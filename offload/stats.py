"""Per-step counters and the readable report.

Counters are bumped on the hot path (plain integer and dict updates). Copy and stall times come
from CUDA events, which are only read when somebody asks for the stats (``snapshot``), so the hot
path never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


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


def _elapsed_ms(start: Any, end: Any) -> float:
    if start is None or end is None:
        return 0.0
    end.synchronize()
    return float(start.elapsed_time(end))


def snapshot(c: StepCounters, *, pinned_bytes_held: int, native: bool, transport: str) -> dict[str, Any]:
    """The step's figures as a plain dict (reads the step's CUDA events; may wait for them)."""
    d2h_ms = sum(_elapsed_ms(s, e) for d, _, s, e in c.copies if d == "d2h")
    h2d_ms = sum(_elapsed_ms(s, e) for d, _, s, e in c.copies if d == "h2d")
    # Rates over the timed copies only (untimed copies have no duration to divide by).
    d2h_timed = sum(n for d, n, _, _ in c.copies if d == "d2h")
    h2d_timed = sum(n for d, n, _, _ in c.copies if d == "h2d")
    wait_ms = sum(_elapsed_ms(b, a) for b, a in c.waits)

    def gbps(nbytes: int, ms: float) -> Optional[float]:
        return nbytes / ms / 1e6 if ms > 0 else None

    return {
        "step": c.step,
        "mode": c.mode,
        "transport": transport,
        "native": native,
        "offloaded_tensors": c.offloaded_tensors,
        "offloaded_bytes": c.offloaded_bytes,
        "released_bytes": c.released_bytes,
        "kept": dict(c.kept),
        "kept_tensors": sum(c.kept.values()),
        "groups_offloaded": c.groups_offloaded,
        "groups_kept": c.groups_kept,
        "bytes_d2h": c.bytes_d2h,
        "bytes_h2d": c.bytes_h2d,
        "reloads": c.reloads,
        "d2h_ms": d2h_ms,
        "h2d_ms": h2d_ms,
        "d2h_gbps": gbps(d2h_timed, d2h_ms),
        "h2d_gbps": gbps(h2d_timed, h2d_ms),
        "timed_bytes_d2h": d2h_timed,
        "timed_bytes_h2d": h2d_timed,
        "wait_ms": wait_ms,
        "pinned_bytes_held": pinned_bytes_held,
        "pinned_allocations": c.pinned_allocations,
        "finished": c.finished,
        "captured": c.captured,
    }


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, whichever reads best."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_report(s: dict[str, Any]) -> str:
    """A readable table of one :func:`snapshot`."""

    def rate(v: Optional[float]) -> str:
        return f"{v:.1f} GB/s" if v is not None else "-"

    def timed(timed_bytes: int, total: int, ms: float) -> str:
        if timed_bytes == total:
            return f" in {ms:.2f} ms"
        if timed_bytes == 0:
            return " (not timed: timing=True times every copy)"
        return f" ({format_bytes(timed_bytes)} timed: {ms:.2f} ms)"

    kept = ", ".join(f"{k}={v}" for k, v in sorted(s["kept"].items())) or "none"
    rows = [
        ("step", f"{s['step']} ({'finished' if s['finished'] else 'in progress'}"
                 f"{', captured in a CUDA graph: times not measured' if s['captured'] else ''})"),
        ("mode / transport", f"{s['mode']} / {s['transport']} ({'native' if s['native'] else 'python'} copies)"),
        ("tensors offloaded", f"{s['offloaded_tensors']} in {s['groups_offloaded']} groups"),
        ("bytes offloaded", f"{format_bytes(s['offloaded_bytes'])} ({format_bytes(s['released_bytes'])} released from the GPU)"),
        ("tensors kept", f"{s['kept_tensors']} ({kept})"),
        ("groups kept on GPU", str(s["groups_kept"])),
        ("D2H", f"{format_bytes(s['bytes_d2h'])}{timed(s['timed_bytes_d2h'], s['bytes_d2h'], s['d2h_ms'])}, {rate(s['d2h_gbps'])}"),
        ("H2D", f"{format_bytes(s['bytes_h2d'])}{timed(s['timed_bytes_h2d'], s['bytes_h2d'], s['h2d_ms'])}, {rate(s['h2d_gbps'])} ({s['reloads']} reloads)"),
        ("compute waited", f"{s['wait_ms']:.2f} ms"),
        (
            "pinned held" if s["transport"] == "cuda" else "host arena held",
            f"{format_bytes(s['pinned_bytes_held'])} ({s['pinned_allocations']} allocations this step)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["offload report", "-" * (width + 40)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
