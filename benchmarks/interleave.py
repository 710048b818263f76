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

How sure a median is: on MOE the per-cycle ratios spread widely (quartiles 1.0-1.27 around a
median of 1.12), so a 40-cycle run and a 150-cycle run of the same variant can differ by 0.1.
Each row therefore carries the distribution-free 95% interval of its median ratio (order
statistics, no assumption on the spread's shape), and the ratio of the variant's fast steps (its
10th-percentile step over plain's), which interference on the shared host, always a slowdown,
touches least. The raw step times are kept, to be read again. Each step's host time (to its
return, before the synchronize) is kept and compared as well: it says whether what a variant
adds is host work or waiting on the GPU; where a step reports its forward's return
(:meth:`Variant.forward_done`), the host time is split into the forward's and the backward's.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import common
import measure


@dataclass
class Variant:
    """One contender: its label, its step, and its offload context (for stats; None if none)."""

    label: str
    step: Callable[[], None]
    context: Any = None
    step_ms: list[float] = field(default_factory=list)
    host_ms: list[float] = field(default_factory=list)  # from the call to its return, before the sync
    forward_ms: list[float] = field(default_factory=list)  # from the call to the forward's return
    started: float = 0.0  # perf_counter at the timed step's call

    def forward_done(self) -> None:
        """Mark the forward's return in the step being timed (``make_step``'s ``on_forward``)."""
        if self.started:
            self.forward_ms.append((time.perf_counter() - self.started) * 1e3)


def run_cycles(env: common.Env, variants: list[Variant], *, warmup: int, cycles: int) -> None:
    """Warm every variant up (``warmup`` steps each), then time ``cycles`` cycles of one step of
    each; cycle ``c`` starts at variant ``c % len(variants)``. Fills each variant's ``step_ms``
    (to the end of the synchronize) and ``host_ms`` (to the step's return, before it)."""
    for v in variants:
        v.started = 0.0  # warm-up steps are not timed
        for _ in range(warmup):
            v.step()
    env.sync()
    n = len(variants)
    for c in range(cycles):
        for k in range(n):
            v = variants[(c + k) % n]
            t0 = v.started = time.perf_counter()
            v.step()
            t1 = time.perf_counter()
            env.sync()
            v.step_ms.append((time.perf_counter() - t0) * 1e3)
            v.host_ms.append((t1 - t0) * 1e3)


def median_interval(values: list[float]) -> tuple[float, float]:
    """The distribution-free 95% confidence interval of the median of ``values``: the order
    statistics of ranks n/2 - 0.98 sqrt(n) rounded down and 1 + n/2 + 0.98 sqrt(n) rounded up,
    counted from 1 (the normal approximation to the binomial count of values under the median).
    With fewer than 6 values, their whole range."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 6:
        return ordered[0], ordered[-1]
    half = 0.98 * math.sqrt(n)
    lo = max(1, math.floor(n / 2 - half))
    hi = min(n, math.ceil(1 + n / 2 + half))
    return ordered[lo - 1], ordered[hi - 1]


def fast_step(step_ms: list[float]) -> float:
    """A variant's fast step: the 10th percentile of its step times (the least touched by
    interference, which only ever slows a step down)."""
    if len(step_ms) < 2:
        return step_ms[0]
    return statistics.quantiles(step_ms, n=10)[0]


def summarize(variants: list[Variant], baseline: str = "plain") -> list[dict[str, Any]]:
    """Per variant: the median of its per-cycle ratios to ``baseline``'s step of the same cycle,
    their quartiles and the median's 95% interval (:func:`median_interval`), the ratio of its
    fast step to the baseline's (:func:`fast_step`), its median step time and the raw ones; the
    context's groups and tensors a step."""
    base_variant = next(v for v in variants if v.label == baseline)
    base = base_variant.step_ms
    rows = []
    for v in variants:
        ratios = [a / b for a, b in zip(v.step_ms, base)]
        host_ratios = [a / b for a, b in zip(v.host_ms, base_variant.host_ms)]
        split = len(v.forward_ms) == len(v.host_ms) and len(base_variant.forward_ms) == len(base_variant.host_ms)
        forward_ratios = [a / b for a, b in zip(v.forward_ms, base_variant.forward_ms)] if split else []
        backward_ratios = [(a - fa) / (b - fb) for a, fa, b, fb in
                           zip(v.host_ms, v.forward_ms, base_variant.host_ms, base_variant.forward_ms)] if split else []
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        lo, hi = median_interval(ratios)
        stats: Optional[dict[str, Any]] = None if v.context is None else measure.offload_stats(v.context)
        rows.append({
            "variant": v.label,
            "ratio_median": statistics.median(ratios),
            "ratio_p25": q[0],
            "ratio_p75": q[2],
            "ratio_ci95": [lo, hi],
            "ratio_fast": fast_step(v.step_ms) / fast_step(base),
            # The same ratio of the host's time alone (the step's return, before the synchronize):
            # where it rises as much as the whole step's, what a variant adds is host work; where
            # the whole step rises more, the rest waits on the GPU.
            "host_ratio_median": statistics.median(host_ratios) if host_ratios else None,
            # The host time split at the forward's return, where the steps report it.
            "forward_ratio_median": statistics.median(forward_ratios) if forward_ratios else None,
            "backward_ratio_median": statistics.median(backward_ratios) if backward_ratios else None,
            "forward_ms": statistics.median(v.forward_ms) if split and v.forward_ms else None,
            "step_ms": statistics.median(v.step_ms),
            "cycles": len(v.step_ms),
            "groups": None if stats is None else stats.get("groups_offloaded"),
            "offloaded_tensors": None if stats is None else stats.get("offloaded_tensors"),
            "steps_ms": [round(t, 3) for t in v.step_ms],
            "host_steps_ms": [round(t, 3) for t in v.host_ms],
            "forward_steps_ms": [round(t, 3) for t in v.forward_ms],
        })
    return rows
