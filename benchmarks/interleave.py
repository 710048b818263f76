"""Step-interleaved timing: every variant's step in turn, and the ratios taken per turn.

Why: on the H100 VM the host drifts by 27-36% between blocks of steps a few seconds apart (the
plain MOE step read 148, 150 and 202 ms in three rounds of one run), and a variant's place in a
round moved it by up to 10%. Timing each variant as a block of 20-100 steps, even in alternating
rounds, lets that drift fall on one variant and not another, so three or ten rounds could not tell
1.05x from 1.25x. Here every variant's context is built up front, and each *cycle* runs one step
of every variant (each cycle starting one variant later). A variant's ratio is taken against the
plain step of its own cycle, a second or less apart, and the median over cycles is quoted.

Each step is timed on the host from its call to the end of a device synchronize, so the GPU
work of one variant never runs into the next one's time. The synchronize is the same for every
variant; it adds the step's GPU tail, which a host-bound step (SMALL, MOE) barely has.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import common


@dataclass
class Variant:
    """One contender: its label, its step, and its offload context (for stats; None if none)."""

    label: str
    step: Callable[[], None]
    context: Any = None
    step_ms: list[float] = field(default_factory=list)


def run_cycles(env: common.Env, variants: list[Variant], *, warmup: int, cycles: int) -> None:
    """Warm every variant up (``warmup`` steps each), then time ``cycles`` cycles of one step of
    each; cycle ``c`` starts at variant ``c % len(variants)``. Fills each variant's ``step_ms``."""
    for v in variants:
        for _ in range(warmup):
            v.step()
    env.sync()
    n = len(variants)
    for c in range(cycles):
        for k in range(n):
            v = variants[(c + k) % n]
            t0 = time.perf_counter()
            v.step()
            env.sync()
            v.step_ms.append((time.perf_counter() - t0) * 1e3)


def summarize(variants: list[Variant], baseline: str = "plain") -> list[dict[str, Any]]:
    """Per variant: the median of its per-cycle ratios to ``baseline``'s step of the same cycle,
    their quartiles, and its median step time; the context's groups and tensors a step."""
    base = next(v for v in variants if v.label == baseline).step_ms
    rows = []
    for v in variants:
        ratios = [a / b for a, b in zip(v.step_ms, base)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        stats: Optional[dict[str, Any]] = None if v.context is None else common.offload_stats(v.context)
        rows.append({
            "variant": v.label,
            "ratio_median": statistics.median(ratios),
            "ratio_p25": q[0],
            "ratio_p75": q[2],
            "step_ms": statistics.median(v.step_ms),
            "cycles": len(v.step_ms),
            "groups": None if stats is None else stats.get("groups_offloaded"),
            "offloaded_tensors": None if stats is None else stats.get("offloaded_tensors"),
        })
    return rows
