"""Draw the plot data to PNG files with matplotlib (imported here, when a renderer is called).

The renderers use matplotlib's object interface (``matplotlib.figure.Figure``), not ``pyplot``:
no global figure state and no backend switch in the caller's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from ..engine.stats import format_bytes
from .data import COMPUTE, D2H, H2D, WAITS, MemoryCurve, ParetoPoint, Timeline

PathLike = Union[str, Path]

# What each lane is called on the plot, per device: the host transport's copies are host copies.
_LANE_TITLES = {
    "cuda": {COMPUTE: "compute stream", D2H: "D2H (to pinned host)", H2D: "H2D (back to GPU)", WAITS: "compute waits"},
    "cpu": {COMPUTE: "compute (host ops)", D2H: "host copy out", H2D: "host copy back", WAITS: "waits"},
}
_LANE_ORDER = (COMPUTE, D2H, H2D, WAITS)
_COPY_COLORS = {D2H: "tab:orange", H2D: "tab:green", WAITS: "tab:red"}


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "offload.plot needs matplotlib to draw: pip install matplotlib (or pip install -e '.[plot]')"
        ) from exc
    return Figure(figsize=(width, height))


def _target(path: PathLike, api: str) -> Path:
    """``path`` as a Path, refused before anything is drawn when its directory does not exist.
    Nothing is created for the caller: a mistyped path would otherwise leave directories
    wherever it pointed (even at the filesystem's root)."""
    out = Path(path)
    if not out.parent.is_dir():
        raise ValueError(
            f"offload.plot.{api}: the directory {str(out.parent)!r} of {str(path)!r} does not exist; "
            "create it first, or pass a path in an existing directory"
        )
    return out


def _save(fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def plot_timeline(timeline: Timeline, path: PathLike) -> Path:
    """Draw ``timeline`` as one row of bars per lane (compute, D2H, H2D, waits) over the step's
    milliseconds; layer forwards on the compute row are coloured and labelled ``L<N>``.
    Returns the path written."""
    out = _target(path, "plot_timeline")
    lanes = [name for name in _LANE_ORDER if name in timeline.lanes] + [
        name for name in timeline.lanes if name not in _LANE_ORDER
    ]
    if not lanes:
        raise ValueError("offload.plot.plot_timeline: the timeline has no lanes (was anything recorded?)")
    titles = _LANE_TITLES.get(timeline.device, _LANE_TITLES["cuda"])
    fig = _figure(12, 1.0 + 0.8 * len(lanes))
    ax = fig.add_subplot()
    # The tab10 colours without its grey (C7), which marks compute outside the layer forwards.
    palette = [f"C{i}" for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
    for row, name in enumerate(reversed(lanes)):
        for bar in timeline.lane(name):
            if name == COMPUTE:
                color = palette[int(bar.label[1:]) % len(palette)] if bar.label.startswith("L") else "lightgray"
            else:
                color = _COPY_COLORS.get(name, "tab:purple")
            # A copy of microseconds in a step of hundreds of ms would be drawn zero pixels wide.
            width = max(bar.ms, timeline.step_ms / 400)
            ax.broken_barh([(bar.start_ms, width)], (row - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.5)
            if bar.label and bar.ms > timeline.step_ms / 60:
                ax.text(bar.start_ms + bar.ms / 2, row, bar.label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [titles.get(n, n) for n in reversed(lanes)])
    ax.set_xlim(0, max(timeline.step_ms, 1e-3))
    ax.set_xlabel("ms from the start of the step")
    copied = f"out {timeline.busy_ms(D2H):.2f} ms, back {timeline.busy_ms(H2D):.2f} ms"
    ax.set_title(f"one step on {timeline.device}: {timeline.step_ms:.1f} ms; copies {copied}\n"
                 f"copies from {timeline.copy_source}; grey: compute outside layer forwards", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, out)


def plot_memory(curve: MemoryCurve, path: PathLike) -> Path:
    """Draw ``curve`` (bytes against ms) as a step line, its peak marked. Returns the path written."""
    out = _target(path, "plot_memory")
    if not curve.samples:
        raise ValueError("offload.plot.plot_memory: the memory curve has no samples")
    fig = _figure(10, 4)
    ax = fig.add_subplot()
    t = [s[0] for s in curve.samples]
    mib = [s[1] / 2**20 for s in curve.samples]
    ax.step(t, mib, where="post")
    peak_at = max(range(len(mib)), key=lambda i: mib[i])
    ax.plot([t[peak_at]], [mib[peak_at]], "v", color="tab:red")
    ax.set_xlabel("ms from the start of the step")
    ax.set_ylabel("MiB")
    ax.set_title(f"{curve.what} ({curve.device}): peak {format_bytes(curve.peak_bytes)}, "
                 f"start {format_bytes(curve.start_bytes)}", fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, out)


def plot_pareto(panels: Mapping[str, Sequence[ParetoPoint]], path: PathLike, *, baseline: str = "plain") -> Path:
    """Step time (as a multiple of ``baseline``'s, plain's by default) against peak memory, one
    panel per model (the mapping's keys are the panel titles). Returns the path written."""
    out = _target(path, "plot_pareto")
    panels = {name: points for name, points in panels.items() if points}
    if not panels:
        raise ValueError("offload.plot.plot_pareto: no points to draw")
    fig = _figure(7 * len(panels), 5)
    markers = {"plan": "o", "offload": "s"}
    for i, (name, points) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for p in points:
            gib = p.peak_bytes / 2**30
            ax.scatter(gib, p.step_vs_plain, marker=markers.get(p.kind, "^"))
            ax.annotate(p.label, (gib, p.step_vs_plain), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(name)
        ax.set_xlabel("peak GiB")
        ax.set_ylabel(f"step time / {baseline}")
        ax.grid(alpha=0.3)
    return _save(fig, out)
