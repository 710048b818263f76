"""The cost model: step time and peak memory of a plan, by simulating one step.

This docstring is the spec the runtime follows; where the two differ, one of them is wrong.

Resources. Three serial resources: the compute stream, the D2H link and the H2D link; each link
runs its copies one at a time, first queued first served. A copy costs ``latency_ms`` then its
bytes at the link's rate: ``d2h_gbps`` / ``h2d_gbps`` alone; while both directions copy, each gets
its share of ``duplex_gbps`` (split in proportion to the one-way rates, never above them). Compute
runs ``1 + slowdown_one_way`` times slower while one direction copies, ``1 + slowdown_duplex``
while both do (the rate changes at each copy start and end). GB/s are 1e9 bytes per second.

Per layer, by action (sizes from :func:`offloaded_bytes`, :func:`held_bytes`,
:func:`resident_bytes`; a KEEP or OFFLOAD layer planned ``selective`` uses its
``LayerProfile.selective`` figures instead of its own: its slots, its cached bytes, and its
backward longer by ``extra_backward_ms``, see :func:`layer_slots`):
  KEEP       holds saved_bytes until its backward ends; copies nothing.
  OFFLOAD    holds saved_bytes until released, then the resident slots;
             copies the slots whose largest tensor is >= min_offload_bytes (``slot_keys``: the
             engine decides tensor by tensor) out, and back before its backward.
  RECOMPUTE  holds input_bytes until released, then nothing; copies its inputs out and back;
             its backward costs forward_ms + backward_ms and holds saved_bytes transiently.
             Planned ``keep_inputs``: holds input_bytes until its backward ends and copies
             nothing (as KEEP does, with a recompute's backward): for a host room that cannot
             take every layer's inputs. Planned ``keep_attention``: also holds
             ``attention_bytes`` (never offloaded) until its backward, whose recompute then
             costs forward_ms less ``attention_forward_ms``.
  A layer whose copy would be 0 bytes copies nothing and is never "in flight".
  KEEP and OFFLOAD layers also hold their ``cached_bytes`` (selective recompute's caches, never
  offloaded) until their backward; a RECOMPUTE layer holds none (they run plainly inside it).

Forward. ``pre_ms``; then for each layer i in order:
  1. every group whose D2H has finished is released (free);
  2. with a budget, while ``base + held + forward_need(i) > budget`` the oldest in-flight group
     is released by force: compute waits for its D2H to end (forward stall); forward_need(i) is
     the layer's measured forward peak (``forward_peak_bytes``), at least its saved_bytes, for
     every action: a checkpointed forward builds its activations transiently too;
  3. memory ``base + held + forward_need(i)`` is a peak candidate ("forward layer i");
  4. compute ``forward_ms``; then the layer holds ``held_bytes`` and its D2H is queued.
After the last layer: step 1; with a budget, step 2 with ``base + held + head_bytes``; the peak
candidate ``base + held + head_bytes`` ("end of forward"); compute ``head_ms``.
Without a budget nothing is forced: D2H runs on into backward (duplex with H2D).

Backward, for i = N-1 .. 0:
  1. layer i's own group, if its D2H was queued but the group was not released, is never
     released: backward uses the originals and the copy counts as wasted;
  2. groups below i still in flight stay so (releasing them now would only add an H2D: memory
     falls through backward, and step 4 releases them when the budget needs it);
  3. if layer i's group was released and not yet reloaded, its H2D is queued now (on demand);
  4. with a budget, while ``base + held + grads + transient(i) > budget`` the oldest in-flight
     group below i is released by force (backward stall). ``grads`` is what backward has left
     allocated so far (``head_residual_bytes``, then each finished layer's ``grad_bytes``);
     transient(i) = the layer's ``backward_peak_bytes``; for RECOMPUTE, ``recompute_factor`` x
     (saved_bytes + backward_peak_bytes), the recomputed activations and the backward together;
  5. prefetch: the next ``PREFETCH_DEPTH`` groups below i that copy bytes, nearest first; each
     one released and not reloaded gets its H2D queued if ``base + held + grads + its bytes +
     transient(i) <= budget`` (always without a budget); the first that does not fit stops it.
     Reloaded bytes are held from the moment their H2D is queued (the buffer is allocated then);
  6. compute waits for layer i's H2D if any (backward stall);
  7. the peak candidate ``base + held + grads + transient(i)`` ("backward layer i");
  8. compute ``backward_ms`` (+ ``recompute_time_factor`` x the recompute, for RECOMPUTE); then
     every byte of layer i is
     freed, and its ``grad_bytes`` join ``grads``.
Then ``post_ms``. The step ends when compute is done and both links are idle (a copy still
running then delays the next step; that wait counts as backward stall).

Peak = the largest candidate, and ``base_bytes`` at the start. Step = compute (stretched by the
slowdowns) + stalls.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Optional, Sequence

from .layer_costs import (  # noqa: F401 - re-exported: the cost model's per-layer figures
    backward_cost_ms, cached_bytes, copied_at, copied_slots, forward_need_bytes, held_bytes, layer_slots, offloaded_bytes,
    resident_bytes, transient_bytes,
)
from .types import LayerPlan, LayerProfile, Prediction, StepProfile

PREFETCH_DEPTH = 2  # groups reloaded ahead of the layer backward is at (besides its own)

# Group states in the simulation.
_HELD, _IN_FLIGHT, _RELEASED, _RELOADING, _ORIGINALS, _FREED = range(6)
_INF = float("inf")


class _Link:
    """One FIFO copy direction. ``lat``/``left`` describe the copy at the head of the queue."""

    __slots__ = ("alone", "both", "latency", "queue", "lat", "left", "done_at")

    def __init__(self, alone: float, both: float, latency: float, n: int) -> None:
        self.alone = alone      # bytes per ms while the other direction is idle
        self.both = both        # bytes per ms while it copies too
        self.latency = latency
        self.queue: deque[tuple[int, int]] = deque()  # (layer, bytes), head is running
        self.lat = 0.0
        self.left = 0.0
        self.done_at: list[Optional[float]] = [None] * n

    def submit(self, layer: int, nbytes: int) -> None:
        self.queue.append((layer, nbytes))
        if len(self.queue) == 1:
            self.lat, self.left = self.latency, float(nbytes)

    def advance(self, dt: float, rate: float, until: float, now: float) -> None:
        """``dt`` ms pass at ``rate`` (bytes per ms); ``until``: when the running copy (or its
        latency phase) would end. A copy that ends is marked done at ``now``."""
        if until <= dt:  # this copy (or its latency phase) ends now
            if self.lat > 0:
                self.lat = 0.0
                if self.left > 0:
                    return
            layer, _ = self.queue.popleft()
            self.done_at[layer] = now
            if self.queue:
                self.lat, self.left = self.latency, float(self.queue[0][1])
        elif self.lat > 0:
            self.lat -= dt
        else:
            self.left -= dt * rate


class _Sim:
    """One step's timeline. Compute is the program; the links run on in the background."""

    def __init__(self, profile: StepProfile) -> None:
        link = profile.link
        n = len(profile.layers)
        total = link.d2h_gbps + link.h2d_gbps

        def both(gbps: float) -> float:
            # Duplex: each direction gets its share of the combined rate, never above its own.
            return min(gbps, link.duplex_gbps * gbps / total) * 1e6

        self.d2h = _Link(link.d2h_gbps * 1e6, both(link.d2h_gbps), link.latency_ms, n)
        self.h2d = _Link(link.h2d_gbps * 1e6, both(link.h2d_gbps), link.latency_ms, n)
        self.slow1 = 1.0 + link.slowdown_one_way
        self.slow2 = 1.0 + link.slowdown_duplex
        self.t = 0.0
        self.stall = [0.0, 0.0]  # forward, backward
        self.phase = 0
        self.peak = -1
        self.peak_at = ("", -1)  # where (a format taking the layer), the layer

    def mark(self, mem: int, where: str, layer: int = -1) -> None:
        """A peak candidate at ``where`` (formatted with ``layer`` once the simulation is over)."""
        if mem > self.peak:
            self.peak, self.peak_at = mem, (where, layer)

    def compute(self, ms: float) -> None:
        """``ms`` of compute, slower while copies run; each copy's end is an event."""
        d, h = self.d2h, self.h2d
        work = ms
        while work > 0:
            dq, hq = bool(d.queue), bool(h.queue)
            if not (dq or hq):  # nothing copies: full speed
                self.t += work
                return
            # (Inline, and comparisons rather than min(): this is the simulation's innermost loop.)
            if dq and hq:
                rd, rh, slow = d.both, h.both, self.slow2
            else:
                rd, rh, slow = d.alone, h.alone, self.slow1
            dt = full = work * slow
            td = (d.lat if d.lat > 0 else d.left / rd) if dq else _INF
            if td < dt:
                dt = td
            th = (h.lat if h.lat > 0 else h.left / rh) if hq else _INF
            if th < dt:
                dt = th
            self.t = now = self.t + dt
            work = 0.0 if dt >= full else work - dt / slow
            if dq:
                d.advance(dt, rd, td, now)
            if hq:
                h.advance(dt, rh, th, now)

    def _stall(self) -> None:
        """Compute waits until the next copy ends (the copies' rates as in :meth:`compute`)."""
        d, h = self.d2h, self.h2d
        dq, hq = bool(d.queue), bool(h.queue)
        rd, rh = (d.both, h.both) if dq and hq else (d.alone, h.alone)
        td = (d.lat if d.lat > 0 else d.left / rd) if dq else _INF
        th = (h.lat if h.lat > 0 else h.left / rh) if hq else _INF
        dt = td if td < th else th
        if dt == _INF:
            raise RuntimeError("simulation waits on a link that has nothing queued")  # a bug here
        self.t = now = self.t + dt
        self.stall[self.phase] += dt
        if dq:
            d.advance(dt, rd, td, now)
        if hq:
            h.advance(dt, rh, th, now)

    def wait(self, link: _Link, layer: int) -> None:
        while link.done_at[layer] is None:
            self._stall()

    def drain(self) -> None:
        while self.d2h.queue or self.h2d.queue:
            self._stall()


def simulate(
    profile: StepProfile, layers: Sequence[LayerPlan], budget_bytes: Optional[int] = None
) -> Prediction:
    """Predict step time and peak memory of running ``profile`` with per-layer ``layers``.

    ``budget_bytes`` drives forced releases and prefetch limits as the runtime would (see the
    module docstring); the peak may still exceed it when no release can help. Pure, deterministic.
    """
    n = len(profile.layers)
    if len(layers) != n:
        raise ValueError(f"plan has {len(layers)} layer actions, profile has {n} layers")
    for i, lp in enumerate(layers):
        if not isinstance(lp, LayerPlan):
            raise ValueError(f"layers[{i}] must be a LayerPlan, got {type(lp).__name__}")
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
    made = simulate_figures(profile, [layer_figures(profile, l, lp) for l, lp in zip(profile.layers, layers)],
                            budget_bytes)
    assert made is not None  # (no limit to stop at)
    return made


class LayerFigures(NamedTuple):
    """What the simulation reads of one layer under its action (the search computes them once
    per layer and candidate, not once per simulated plan)."""

    offloaded: int      # offloaded_bytes
    held: int           # held_bytes
    transient: int      # transient_bytes
    forward_need: int   # forward_need_bytes
    forward_ms: float
    backward_ms: float  # backward_cost_ms
    grad_bytes: int


def layer_figures(profile: StepProfile, layer: LayerProfile, lp: LayerPlan) -> LayerFigures:
    """The :class:`LayerFigures` of ``layer`` (one of ``profile``'s) under ``lp``."""
    return LayerFigures(offloaded_bytes(layer, lp), held_bytes(layer, lp),
                        transient_bytes(layer, lp, profile.recompute_factor), forward_need_bytes(layer),
                        layer.forward_ms, backward_cost_ms(layer, lp, profile.recompute_time_factor), layer.grad_bytes)


def simulate_figures(profile: StepProfile, figures: Sequence[LayerFigures], budget_bytes: Optional[int] = None,
                     within: Optional[tuple[int, Optional[int]]] = None) -> Optional[Prediction]:
    """:func:`simulate` from each layer's :func:`layer_figures`, unchecked (the search's inner
    loop: its figures come from :func:`layer_figures`, its budget from its own check).
    ``within``: (peak bytes, host bytes or None): stop and return None as soon as the plan's peak
    or the bytes it copies to the host pass these (a search asking only whether it fits)."""
    peak_limit, host_limit = within if within is not None else (None, None)
    n = len(figures)
    off = [f.offloaded for f in figures]
    pre = [f.held for f in figures]
    trans = [f.transient for f in figures]
    state = [_HELD] * n
    sim = _Sim(profile)
    base, budget = profile.base_bytes, budget_bytes
    held = 0
    inflight: deque[int] = deque()  # groups whose D2H was queued and that are not released, FIFO
    d2h_bytes = h2d_bytes = wasted = 0

    d2h_done = sim.d2h.done_at

    # (The calls below are made only where they have something to do: the checks before them
    # are their loops' first tests, this being the search's innermost loop.)
    def release_finished(below: int) -> None:
        nonlocal held
        while inflight and d2h_done[inflight[0]] is not None and inflight[0] < below:
            j = inflight.popleft()
            state[j] = _RELEASED
            held -= off[j]

    grads = 0  # weight and activation gradients backward has left allocated so far

    def force_release(extra: int, below: int) -> None:
        nonlocal held
        while inflight and inflight[0] < below and base + held + grads + extra > budget:
            j = inflight[0]
            sim.wait(sim.d2h, j)
            inflight.popleft()
            state[j] = _RELEASED
            held -= off[j]

    sim.mark(base, "start of forward")
    sim.compute(profile.pre_ms)
    for i, fig in enumerate(figures):
        if inflight and d2h_done[inflight[0]] is not None:
            release_finished(n)
        need = fig.forward_need
        if budget is not None and inflight and base + held + need > budget:
            force_release(need, n)
        if base + held + need > sim.peak:
            sim.mark(base + held + need, "forward layer {}", i)
            if peak_limit is not None and sim.peak > peak_limit:
                return None
        sim.compute(fig.forward_ms)
        held += pre[i]
        if off[i] > 0:
            sim.d2h.submit(i, off[i])
            d2h_bytes += off[i]
            if host_limit is not None and d2h_bytes > host_limit:
                return None
            inflight.append(i)
            state[i] = _IN_FLIGHT
    release_finished(n)
    if budget is not None:
        force_release(profile.head_bytes, n)
    sim.mark(base + held + profile.head_bytes, "end of forward")
    if peak_limit is not None and sim.peak > peak_limit:
        return None
    sim.compute(profile.head_ms)

    sim.phase = 1
    grads = profile.head_residual_bytes
    offl = [i for i in range(n) if off[i] > 0]  # groups that copy, ascending
    below = len(offl)  # offl[:below] are the groups under the layer backward is at
    for i in range(n - 1, -1, -1):
        while below and offl[below - 1] >= i:
            below -= 1
        if state[i] == _IN_FLIGHT:
            # Its copy is still queued or just done; the originals are here, use them.
            state[i] = _ORIGINALS
            wasted += off[i]
        # Groups >= i left in the FIFO are wasted ones: drop them as their copies end.
        while inflight and state[inflight[0]] == _ORIGINALS and d2h_done[inflight[0]] is not None:
            inflight.popleft()
        if state[i] == _RELEASED:
            sim.h2d.submit(i, off[i])
            h2d_bytes += off[i]
            held += off[i]
            state[i] = _RELOADING
        if budget is not None and inflight and base + held + grads + trans[i] > budget:
            force_release(trans[i], i)
        for j in offl[max(0, below - PREFETCH_DEPTH):below][::-1]:
            if state[j] != _RELEASED:
                continue
            if budget is not None and base + held + grads + off[j] + trans[i] > budget:
                break
            sim.h2d.submit(j, off[j])
            h2d_bytes += off[j]
            held += off[j]
            state[j] = _RELOADING
        if state[i] == _RELOADING:
            sim.wait(sim.h2d, i)
        if base + held + grads + trans[i] > sim.peak:
            sim.mark(base + held + grads + trans[i], "backward layer {}", i)
            if peak_limit is not None and sim.peak > peak_limit:
                return None
        sim.compute(figures[i].backward_ms)
        held -= pre[i]
        grads += figures[i].grad_bytes
        state[i] = _FREED
    sim.compute(profile.post_ms)
    sim.drain()
    return Prediction(
        step_ms=sim.t,
        peak_bytes=sim.peak,
        forward_stall_ms=sim.stall[0],
        backward_stall_ms=sim.stall[1],
        d2h_bytes=d2h_bytes,
        h2d_bytes=h2d_bytes,
        peak_at=sim.peak_at[0].format(sim.peak_at[1]),
        wasted_d2h_bytes=wasted,
    )
