"""Plan search: the fastest per-layer plan whose predicted peak fits a memory budget.

Every candidate is judged by the cost model (:func:`offload.plan.model.simulate`) at the budget
the runtime will enforce, since forced releases and prefetch limits depend on it. Candidate
actions per layer: KEEP; for a layer with selective candidates (its MLP), KEEP selective, then
OFFLOAD selective of the slots >= each of the ``MAX_THRESHOLDS`` largest distinct slot sizes
(largest threshold first) and of everything; OFFLOAD of the slots >= each threshold and of
everything (plain); RECOMPUTE. Within each kind, most GPU memory left first; OFFLOAD of
everything (plain) and RECOMPUTE, the two that leave the least, are always the last two. Only
under a host budget that binds (below what offloading every layer whole copies: see
:func:`most_copied_bytes`), a layer that saves anything also gets RECOMPUTE with its inputs kept
on the GPU (``keep_inputs``: copies nothing, as gradient checkpointing does), placed just before
those two, so that the indices ``len(c) - 1`` / ``len(c) - 2`` keep their meaning and a plan
made without a binding host budget is searched exactly as before.

Strategy (deterministic):
  * small spaces (at most ``EXHAUSTIVE_LIMIT`` plans) are enumerated;
  * otherwise three sources of plans, all judged by the one evaluator, which keeps the fastest
    plan that fits:
      1. structured families: ``o`` layers offloaded (one threshold for all), ``r`` recomputed,
         ``k`` kept at the end (their D2H would have no time before the head's peak), with the
         offloaded layers first (they reload last, when backward has run longest), spread among
         the recomputed ones, or after them; for each shape the largest ``k`` that fits is found
         by galloping from the neighbouring ``o``'s (keeping replaces a recompute, so it is never
         slower but holds more); every offload variant in the first shape, the best
         ``SCREENED_VARIANTS`` (with their kept kind) in the others;
      2. a greedy descent from all-KEEP: repeatedly the single-layer change with the most peak
         bytes saved per ms added, until the plan fits; lazy (moves are ranked first by an
         estimate, and re-simulated only when they reach the top), so it also scales to
         models whose layers differ, where the families' one-threshold-for-all is weak;
      3. a local improvement of the few best plans found: every other action, and a swap with
         the next layer, at the layers where the action changes (inside a run of equal layers
         doing the same thing, a move anywhere is the same as a move at its ends).
  Each stage has a budget counted in simulated layers; a plan asked only whether it fits is
  simulated until it passes a budget. LLAMA-8B-shaped layers with selective variants
  (``benchmarks/plan_search.py``, one CPU core): N=16 in 0.02-0.07 s, N=32 in 0.04-0.2 s, N=128
  in 0.17-0.63 s (pure Python).
"""

from __future__ import annotations

import heapq
import math
import warnings
from typing import Callable, Optional, Sequence, Union

from ..engine.stats import format_bytes
from .model import backward_cost_ms, held_bytes, layer_figures, offloaded_bytes, resident_bytes, simulate, simulate_figures
from .types import Action, LayerPlan, LayerProfile, Plan, Prediction, StepProfile, slot_keys

MAX_THRESHOLDS = 4         # partial-offload thresholds tried per layer (largest distinct sizes) ...
NEAR_THRESHOLD = 0.01      # ... but not one copying less than this fraction of the layer's bytes less than the next
EXHAUSTIVE_LIMIT = 4096    # enumerate every plan when the space is no larger than this
LOWEST_PEAK_TOLERANCE = 0.01  # lowest_peak: peaks within 1% of the lowest count as equal
IMPROVE_STARTS = 3         # local improvement starts from this many of the best plans found
IMPROVE_EVALS = 80_000     # its budget, in simulated layers (a simulation costs ~ N) ...
IMPROVE_MAX = 900          # ... and in simulations
GREEDY_EVALS = 150_000     # its budget, in simulated layers
SCREENED_VARIANTS = 3      # offload variants the families try in every shape (the best in the first)
FAMILY_PATIENCE = 4        # a family stops after this many more offloaded layers that were no faster
MIN_GAIN = 1e-4            # a move must save this fraction of the step (not chase float noise)
# The cost model's error on a plan's peak, as a fraction of it. Measured on the H100 the model
# predicted peaks within 3.5% (docs/benchmarks.md, LLAMA-1B/2B and hidden 8192); T11's 10% bounds
# step time and peak together and would be loose for memory: a budget 10% under the lowest peak
# followed anyway would run out of memory. Two uses: a budget this close under the lowest peak
# follows the lowest plan with a warning (the difference is below what the model can tell), and
# "lowest" takes another plan over all-recompute only when it is predicted lower by more than it.
PEAK_MODEL_ERROR = 0.04

_KEEP = LayerPlan(Action.KEEP)
_KEEP_SELECTIVE = LayerPlan(Action.KEEP, selective=True)

Key = tuple[int, ...]  # per layer, an index into that layer's candidate list


class BudgetError(ValueError):
    """No plan's predicted peak fits the memory budget."""


def _offload_candidates(slots: Sequence[int], keys: Sequence[int], selective: bool) -> list[LayerPlan]:
    """OFFLOAD of the slots whose largest tensor (``keys``) is >= each of the largest such
    sizes, then of everything (threshold 0)."""
    made: list[tuple[int, int]] = []  # (threshold, bytes copied), fewest bytes first
    sizes = sorted({k for s, k in zip(slots, keys) if s > 0}, reverse=True)
    for i, t in enumerate(sizes[:MAX_THRESHOLDS] + [0]):
        # The smallest size as a threshold offloads everything: spell that as 0 ("all"). The
        # others sit midway (geometric) between their size and the next smaller one: the same
        # tensors pass, and still do at a batch somewhat shorter than the one planned for
        # (plans are made for the top of a bucket of lengths).
        threshold = 0 if (t == 0 or t == sizes[-1]) else max(sizes[i + 1] + 1, math.isqrt(t * sizes[i + 1]))
        nbytes = sum(s for s, k in zip(slots, keys) if k >= threshold)
        if nbytes > 0 and (not made or nbytes > made[-1][1]):
            made.append((threshold, nbytes))
    # A threshold that copies nearly what the next one does (the small tensors between them)
    # is dropped: it would cost the search a variant and a move per layer for a difference
    # below what the cost model can tell.
    near = NEAR_THRESHOLD * sum(slots)
    kept: list[tuple[int, int]] = []
    for threshold, nbytes in reversed(made):
        if not kept or nbytes < kept[-1][1] - near:
            kept.append((threshold, nbytes))
    return [LayerPlan(Action.OFFLOAD, threshold, selective=selective) for threshold, _ in reversed(kept)]


def layer_candidates(layer: LayerProfile, keep_inputs: bool = False, keep_attention: bool = False) -> list[LayerPlan]:
    """The actions the search tries for ``layer`` (see the module notes for their order): the
    last is RECOMPUTE, the one before it the plain OFFLOAD of everything when the layer saves
    anything. ``keep_inputs`` (a host budget binds): RECOMPUTE keeping its inputs on the GPU
    too, before those two, where the layer saves anything (else keeping it holds nothing).
    ``keep_attention``: the recomputes keep attention's outputs."""
    recompute = LayerPlan(Action.RECOMPUTE, keep_attention=keep_attention)
    out = [_KEEP]
    if layer.selective is not None:
        out.append(_KEEP_SELECTIVE)
        out += _offload_candidates(layer.selective.slot_bytes, slot_keys(layer.selective), selective=True)
    out += _offload_candidates(layer.slot_bytes, slot_keys(layer), selective=False)
    if keep_inputs and out[-1].action is Action.OFFLOAD and layer.input_bytes > 0:
        out.insert(len(out) - 1, LayerPlan(Action.RECOMPUTE, keep_inputs=True, keep_attention=keep_attention))
    out.append(recompute)
    return out


def most_copied_bytes(profile: StepProfile) -> int:
    """The most any plan of ``profile`` copies to the host: every layer offloaded whole. A host
    budget at or above it binds nothing."""
    whole = LayerPlan(Action.OFFLOAD)
    return sum(offloaded_bytes(layer, whole) for layer in profile.layers)


class _Evaluator:
    """Simulates keys once each and remembers the fastest one that fits the budget (and the
    host budget: every offloaded byte is held on the host until its layer's backward)."""

    def __init__(self, profile: StepProfile, cands: list[list[LayerPlan]], budget: int,
                 host_budget: Optional[int] = None, pause: Optional[Callable[[], None]] = None) -> None:
        self.profile, self.cands, self.budget, self.host = profile, cands, budget, host_budget
        self.pause = pause  # called before each simulation (a background search lets the step's thread run)
        self.memo: dict[Key, Prediction] = {}
        self.best: Optional[tuple[float, int, Key]] = None
        # What the simulation reads of each layer under each candidate, worked out once.
        self.figures = [[layer_figures(profile, layer, lp) for lp in c] for layer, c in zip(profile.layers, cands)]

        self.over: set[Key] = set()  # keys known not to fit, not simulated to their end

    def __call__(self, key: Key) -> Prediction:
        pred = self.memo.get(key)
        if pred is None:
            pred = self._simulate(key, None)
            assert pred is not None
            self.over.discard(key)
        return pred

    def _simulate(self, key: Key, within: Optional[tuple[int, Optional[int]]]) -> Optional[Prediction]:
        if self.pause is not None:
            self.pause()
        figures = [row[k] for row, k in zip(self.figures, key)]
        pred = simulate_figures(self.profile, figures, self.budget, within)
        if pred is None:
            self.over.add(key)
            return None
        self.memo[key] = pred
        if self.ok(pred):
            rank = (pred.step_ms, pred.peak_bytes, key)
            if self.best is None or rank < self.best:
                self.best = rank
        return pred

    def seen(self) -> int:
        """How many plans were judged (the stages' budgets count these)."""
        return len(self.memo) + len(self.over)

    def ok(self, pred: Prediction) -> bool:
        """Whether a predicted plan fits both budgets."""
        return pred.peak_bytes <= self.budget and (self.host is None or pred.d2h_bytes <= self.host)

    def fitting(self, key: Key) -> Optional[Prediction]:
        """The key's prediction if it fits, else None (a plan that does not is simulated only as
        far as the point where it passes a budget)."""
        pred = self.memo.get(key)
        if pred is None:
            if key in self.over:
                return None
            pred = self._simulate(key, (self.budget, self.host))
        return pred if pred is not None and self.ok(pred) else None

    def fits(self, key: Key) -> bool:
        return self.fitting(key) is not None


# ------------------------------------------------------------------------------------- families

def _offload_indices(cands: list[list[LayerPlan]]) -> list[list[int]]:
    """Per layer, the indices of its OFFLOAD candidates (selective ones first, plain "all" last)."""
    return [[j for j, lp in enumerate(c) if lp.action is Action.OFFLOAD] for c in cands]


def _family(cands: list[list[LayerPlan]], offs: list[list[int]], o: int, k: int, v: int, shape: str,
            keep: int = 0) -> Key:
    """Key of ``o`` offloaded (their ``v``-th OFFLOAD candidate counted back from plain "all"),
    ``k`` kept last (the candidate at index ``keep``: 0 plain, 1 selective where a layer has
    it), the rest recomputed, the offloaded ones placed per ``shape``."""
    n = len(cands)
    r = n - o - k
    head = ["O"] * o + ["R"] * r
    if shape == "spread" and o and r:
        head = ["R"] * (o + r)
        for j in range(o):
            head[j * (o + r) // o] = "O"
    elif shape == "recompute-first":
        head = ["R"] * r + ["O"] * o
    key = []
    for i, kind in enumerate(head + ["K"] * k):
        c = cands[i]
        if kind == "K":
            key.append(keep if keep < len(c) and c[keep].action is Action.KEEP else 0)
        elif kind == "R":
            key.append(len(c) - 1)
        else:
            ids = offs[i]
            key.append(ids[max(0, len(ids) - 1 - v)] if ids else 0)
    return tuple(key)


def _o_grid(n: int) -> list[int]:
    if n <= 24:
        return list(range(n + 1))
    grid = set(range(13))
    x = 12.0
    while x < n:
        x *= 1.15
        grid.add(min(n, round(x)))
    return sorted(grid)


def _search_families(ev: _Evaluator) -> None:
    cands = ev.cands
    n = len(cands)
    offs = _offload_indices(cands)
    variants = max(len(ids) for ids in offs)
    shapes = ["offload-first", "spread", "recompute-first"] if n <= 32 else ["offload-first", "spread"]
    if n > 32:
        variants = min(variants, 3)
    # Kept layers plainly, and (where layers have candidates) selectively.
    keeps = [0, 1] if any(len(c) > 1 and c[1].selective for c in cands) else [0]
    # Every variant in the first shape; the other shapes only for the variants that did best
    # there (where one offload variant beats another, it does so in every shape: the shapes
    # differ in where the offloaded layers sit, the variants in what each copies).
    first = {(v, keep): _family_best(ev, offs, v, shapes[0], keep) for v in range(max(variants, 1)) for keep in keeps}
    for v, keep in sorted(first, key=lambda vk: (first[vk], vk))[:SCREENED_VARIANTS]:
        for shape in shapes[1:]:
            _family_best(ev, offs, v, shape, keep)


def _family_best(ev: _Evaluator, offs: list[list[int]], v: int, shape: str, keep: int) -> float:
    """Judge the family of (variant ``v``, ``shape``, ``keep``) along ``o``: the fastest step found."""
    cands = ev.cands
    n = len(cands)
    best_step, since_best, guess = float("inf"), 0, 0
    for o in _o_grid(n):
        # Largest k that fits: keeping is never slower than recomputing, only bigger.
        fits = lambda k: ev.fits(_family(cands, offs, o, k, v, shape, keep))  # noqa: E731
        k = _largest(fits, n - o, guess)
        if k is None:
            step = float("inf")
        else:
            guess = k
            step = ev(_family(cands, offs, o, k, v, shape, keep)).step_ms
        if step < best_step:
            best_step, since_best = step, 0
        else:
            since_best += 1
            # Past the link's capacity more offload only adds stalls: stop this shape.
            if best_step < float("inf") and since_best >= FAMILY_PATIENCE:
                break
    return best_step


def _largest(fits: Callable[[int], bool], top: int, guess: int) -> Optional[int]:
    """The largest ``k`` in ``[0, top]`` for which ``fits(k)`` (true up to some ``k``, false
    above: keeping one more layer only adds memory), or None if not even 0 does. Galloping from
    ``guess`` (the answer at the neighbouring family member, a layer or two away): a few
    simulations where a bisection over ``[0, top]`` takes log2(top) + 2."""
    guess = min(max(guess, 0), top)
    if fits(guess):
        lo, step = guess, 1  # fits at lo; find the first that does not
        while lo + step <= top and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(top, lo + step - 1)  # lo + step fails (or is past top)
    else:
        hi, step = guess - 1, 1  # fails above hi; find one that fits
        while hi >= 0 and not fits(max(0, hi - step + 1)):
            hi, step = hi - step, step * 2
        if hi < 0:
            return None
        lo = max(0, hi - step + 1)
    while lo < hi:  # fits at lo, fails above hi
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------- local moves

def _boundaries(key: Key, cands: list[list[LayerPlan]]) -> list[int]:
    """Layers where the plan (or the layer itself) changes: the only places where a move on a
    run of equal layers differs from a move elsewhere in that run."""
    n = len(key)
    out = []
    for i in range(n):
        same_prev = i > 0 and key[i - 1] == key[i] and cands[i - 1] == cands[i]
        same_next = i < n - 1 and key[i + 1] == key[i] and cands[i + 1] == cands[i]
        if not (same_prev and same_next):
            out.append(i)
    return out


def _estimate_cost_ms(profile: StepProfile, i: int, lp: LayerPlan) -> float:
    """Rough time a layer's action adds, before any simulation: its recompute, and the compute
    slowdown while its copies run (stalls are what the simulation finds out)."""
    layer, link = profile.layers[i], profile.link
    nbytes = offloaded_bytes(layer, lp)
    copy_ms = nbytes / (link.d2h_gbps * 1e6) + nbytes / (link.h2d_gbps * 1e6)
    return backward_cost_ms(layer, lp, profile.recompute_time_factor) - layer.backward_ms \
        + link.slowdown_one_way * copy_ms


def _greedy(ev: _Evaluator, profile: StepProfile, max_evals: int) -> None:
    """From all-KEEP, apply the change with the most peak bytes saved per ms added until the
    plan fits. Lazy: moves wait in a heap under their last known ratio (at first an estimate)
    and are re-simulated only when they reach the top, so a step costs a few simulations, not
    one per layer and action."""
    cands = ev.cands
    cur = [0] * len(cands)
    now = ev(tuple(cur))
    version, start = 0, ev.seen()
    heap: list[tuple[float, int, int, int]] = []  # (-ratio, layer, candidate, version seen)
    for i, layer in enumerate(profile.layers):
        keep = cands[i][0]
        for c in range(1, len(cands[i])):
            lp = cands[i][c]
            saved = resident_bytes(layer, keep) - resident_bytes(layer, lp)
            saved += (held_bytes(layer, keep) - held_bytes(layer, lp)) / 8  # breaks ties toward R
            cost = max(_estimate_cost_ms(profile, i, lp), 1e-3)
            heapq.heappush(heap, (-saved / cost, i, c, -1))
    while heap and now.peak_bytes > ev.budget and ev.seen() - start < max_evals:
        neg, i, c, seen = heapq.heappop(heap)
        if c <= cur[i]:
            continue  # the layer has moved past this action already
        key = tuple(cur[:i] + [c] + cur[i + 1:])
        if seen != version:
            p = ev(key)
            saved = now.peak_bytes - p.peak_bytes
            ratio = saved / max(p.step_ms - now.step_ms, 1e-3) if saved > 0 else -1.0
            # Fresh and (nearly) as good as the best stale ratio left: take it now.
            if ratio > 0 and (not heap or ratio >= 0.95 * -heap[0][0]):
                neg = -ratio
            else:
                heapq.heappush(heap, (-ratio, i, c, version))
                continue
        if neg >= 0:
            return  # the best move saves nothing
        cur[i] = c
        now = ev(key)
        version += 1


def _improve(ev: _Evaluator, key: Key, max_evals: int) -> None:
    """Best-improvement local search (other action at a boundary layer, or a swap there)."""
    cands = ev.cands
    n = len(key)
    start = ev.seen()
    cur = key
    while ev.seen() - start < max_evals:
        now = ev(cur)
        best = None
        bar = now.step_ms * (1 - MIN_GAIN)  # starts fit; a move must fit and beat this
        for i in _boundaries(cur, cands):
            moves = [cur[:i] + (c,) + cur[i + 1:] for c in range(len(cands[i])) if c != cur[i]]
            if i + 1 < n and cur[i] != cur[i + 1] and max(cur[i], cur[i + 1]) < min(len(cands[i]), len(cands[i + 1])):
                moves.append(cur[:i] + (cur[i + 1], cur[i]) + cur[i + 2:])
            for m in moves:
                if ev.seen() - start >= max_evals:
                    break
                p = ev.fitting(m)
                if p is not None and p.step_ms < bar and (best is None or (p.step_ms, m) < best):
                    best = (p.step_ms, m)
        if best is None:
            return
        cur = best[1]


# --------------------------------------------------------------------------------------- public

def _space(profile: StepProfile, host_budget: Optional[int] = None, keep_attention: bool = False) -> list[list[LayerPlan]]:
    # Kept inputs only where the host room binds: elsewhere they would only widen the search
    # (and slow it) for plans that a host copy beats. ``keep_attention``: every recompute keeps it.
    binds = host_budget is not None and host_budget < most_copied_bytes(profile)
    return [layer_candidates(l, binds, keep_attention) for l in profile.layers]


def _kept_inputs(c: list[LayerPlan]) -> int:
    """Index of RECOMPUTE with inputs kept in a layer's candidates (plain RECOMPUTE where it has none)."""
    return len(c) - 3 if len(c) >= 3 and c[-3].keep_inputs else len(c) - 1


def _check_budget(budget_bytes: object) -> int:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int number of bytes, got {budget_bytes!r}")
    return budget_bytes


def _to_plan(profile: StepProfile, plans: Sequence[LayerPlan], budget: Optional[int]) -> Plan:
    return Plan(tuple(plans), budget, simulate(profile, plans, budget), profile.signature(), profile=profile)


def _recompute_keys(cands: list[list[LayerPlan]], host_budget: Optional[int]) -> set[Key]:
    """Every layer recomputed; under a host budget also the last k (over ``_o_grid``) recomputed
    with their inputs kept, a boundary each rather than a layer's activations (the same key as
    all-recompute where no layer has that candidate)."""
    n = len(cands)
    keys = {tuple(len(c) - 1 for c in cands)}
    if host_budget is not None:
        for k in _o_grid(n):
            keys.add(tuple(_kept_inputs(c) if i >= n - k else len(c) - 1 for i, c in enumerate(cands)))
    return keys


def lowest_recompute(profile: StepProfile, host_budget: Optional[int] = None) -> Plan:
    """The lowest-peak plan (every release forced) of every layer recomputed, within
    ``host_budget`` where it can be: the inputs of the last layers kept on the device when
    sending all of them would copy more than it (None: no limit). Where none is within it, the
    one copying least."""
    cands = _space(profile, host_budget)
    ev = _Evaluator(profile, cands, 1)

    def rank(key: Key) -> tuple[int, int, Key]:
        pred = ev(key)
        over = host_budget is not None and pred.d2h_bytes > host_budget
        return (pred.d2h_bytes if over else 0, pred.peak_bytes, key)

    key = min(_recompute_keys(cands, host_budget), key=rank)
    return _to_plan(profile, [c[k] for c, k in zip(cands, key)], 1)


def _floor(profile: StepProfile, cands: list[list[LayerPlan]], host_budget: Optional[int] = None) -> tuple[int, Key]:
    """The lowest peak of the least-memory plans, forcing every release (a 1-byte budget), among
    those within the host budget (layers kept from the end when all of them copied is too much:
    whole, or recomputed with their inputs kept where the candidates have that)."""
    ev = _Evaluator(profile, cands, 1)
    n = len(cands)
    keys = _recompute_keys(cands, host_budget) | {tuple(max(0, len(c) - 2) for c in cands)}
    for o in _o_grid(n):  # offload-all first, recompute after
        keys.add(tuple(max(0, len(c) - 2) if i < o else len(c) - 1 for i, c in enumerate(cands)))
    if host_budget is not None:
        for k in _o_grid(n):  # the last k layers kept (they copy nothing), the rest recomputed
            keys.add(tuple(0 if i >= n - k else len(c) - 1 for i, c in enumerate(cands)))
    scored = sorted((ev(k).peak_bytes, k) for k in keys)
    within = [(peak, k) for peak, k in scored if host_budget is None or ev(k).d2h_bytes <= host_budget]
    if not within:
        least = min(ev(k).d2h_bytes for _, k in scored)
        raise BudgetError(
            f"every plan needs more host memory than the host budget of {_exact(host_budget or 0)}: the "
            f"least is {_exact(least)}. Raise host_budget_bytes (or offload.host.ledger."
            f"set_process_host_budget), or shrink the step")
    return within[0]


def _search(
    profile: StepProfile, cands: list[list[LayerPlan]], budget: int, seeds: Sequence[Key],
    host_budget: Optional[int] = None,
    pause: Optional[Callable[[], None]] = None,
) -> _Evaluator:
    """Run the search stages at ``budget``; the evaluator returned holds the best fitting key."""
    ev = _Evaluator(profile, cands, budget, host_budget, pause)
    for s in seeds:
        ev(s)
    size = 1
    for c in cands:
        size *= len(c)
        if size > EXHAUSTIVE_LIMIT:
            break
    if size <= EXHAUSTIVE_LIMIT:
        _enumerate(ev, 0, ())
        return ev
    n = len(cands)
    _search_families(ev)
    # The families assume one kind of layer; the greedy also serves models whose layers differ.
    _greedy(ev, profile, max_evals=GREEDY_EVALS // n + 1)
    # Polish the few best distinct plans so far: one start alone often sits in a local optimum.
    fitting = sorted((p.step_ms, k) for k, p in ev.memo.items() if ev.ok(p))
    per_start = min(IMPROVE_EVALS // n, IMPROVE_MAX) // IMPROVE_STARTS + 1
    for _, key in fitting[:IMPROVE_STARTS]:
        _improve(ev, key, max_evals=per_start)
    return ev


def _enumerate(ev: _Evaluator, i: int, prefix: Key) -> None:
    if i == len(ev.cands):
        ev(prefix)
        return
    for c in range(len(ev.cands[i])):
        _enumerate(ev, i + 1, prefix + (c,))


def best_plan(profile: StepProfile, budget_bytes: int, model_error: float = PEAK_MODEL_ERROR,
              host_budget: Optional[int] = None, pause: Optional[Callable[[], None]] = None,
              keep_attention: bool = False) -> Plan:
    """The fastest predicted plan whose predicted peak is at most ``budget_bytes`` (with
    ``keep_attention``, among plans whose recomputed layers all keep attention's outputs).

    When no plan fits but the budget is within ``model_error`` (a fraction) of the lowest peak
    reachable, the model cannot tell them apart: the lowest plan (:func:`lowest_peak`, no
    tolerance) is returned with a ``UserWarning`` naming both figures. Below that, raises
    :class:`BudgetError` naming the lowest peak reachable. ``host_budget``: bytes the plan may
    hold on the host (None: no limit).
    """
    budget = _check_budget(budget_bytes)
    if not 0 <= model_error < 1:
        raise ValueError(f"model_error must be a fraction in [0, 1), got {model_error!r}")
    cands = _space(profile, host_budget, keep_attention)
    floor, floor_key = _floor(profile, cands, host_budget)
    if floor > budget:
        if floor - budget <= model_error * floor:
            warnings.warn(
                f"offload: no plan's predicted peak fits the memory budget of {_exact(budget)}; the "
                f"lowest peak reachable, {_exact(floor)}, is {format_bytes(floor - budget)} above it, "
                f"within the cost model's error ({model_error:.0%}): following the lowest plan. "
                f"Raise the budget to at least {_exact(floor)} to silence this.",
                UserWarning, stacklevel=2,
            )
            return lowest_peak(profile, tolerance=0.0, model_error=model_error, host_budget=host_budget, pause=pause)
        raise BudgetError(
            f"no plan fits a memory budget of {_exact(budget)}: the lowest peak reachable is "
            f"{_exact(floor)}, {format_bytes(floor - budget)} more (weights, optimizer state and "
            f"the head alone take {format_bytes(profile.base_bytes + profile.head_bytes)}). Raise "
            f"the budget to at least {format_bytes(floor)}, or shrink the step: a shorter "
            f"sequence, a smaller batch, or more GPUs (fewer layers or a smaller shard on each)."
        )
    ev = _search(profile, cands, budget, seeds=[floor_key], host_budget=host_budget, pause=pause)
    if ev.best is None:  # the floor plan fits any budget >= its floor: a bug if not
        raise RuntimeError(f"best_plan: the floor plan does not fit {budget} bytes")
    key = ev.best[2]
    return _to_plan(profile, [c[k] for c, k in zip(cands, key)], budget)


def _exact(nbytes: int) -> str:
    """``7.2 GiB (7,730,941,133 bytes)``: rounded figures alone hide a difference of a byte."""
    return f"{format_bytes(nbytes)} ({nbytes:,} bytes)"


def lowest_peak(profile: StepProfile, tolerance: float = LOWEST_PEAK_TOLERANCE,
                model_error: float = PEAK_MODEL_ERROR, host_budget: Optional[int] = None,
                pause: Optional[Callable[[], None]] = None) -> Plan:
    """The plan with the lowest predicted peak; among peaks within ``tolerance`` (a fraction) of
    it, the fastest. The plan's budget is that lowest peak plus the tolerance.

    It never peaks above all-recompute (checkpointing, every layer's inputs offloaded), which is
    always a candidate: another plan is taken only when its predicted peak is lower than
    all-recompute's by more than ``model_error`` (a fraction), since within the model's error
    a plan predicted a little lower may measure higher (the offloading plans' peaks hang on
    when copies end, all-recompute's do not). Otherwise the plan is all-recompute.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    if not 0 <= model_error < 1:
        raise ValueError(f"model_error must be a fraction in [0, 1), got {model_error!r}")
    cands = _space(profile, host_budget)
    floor, floor_key = _floor(profile, cands, host_budget)
    recompute = [c[-1] for c in cands]
    # Its lowest peak: every release forced (as in _floor), so no plan is ever held to less.
    rec = simulate(profile, recompute, 1)
    rec_peak = rec.peak_bytes
    within_host = host_budget is None or rec.d2h_bytes <= host_budget
    certain = int(rec_peak * (1 - model_error))  # predicted below this: lower than all-recompute
    if floor > certain and within_host:
        return _to_plan(profile, recompute, max(1, rec_peak))
    budget = max(1, int(floor * (1 + tolerance)) if not within_host else min(int(floor * (1 + tolerance)), certain))
    ev = _search(profile, cands, budget, seeds=[floor_key], host_budget=host_budget, pause=pause)
    if ev.best is None:  # the floor plan fits any budget >= its floor: a bug if not
        raise RuntimeError(f"lowest_peak: the floor plan does not fit {budget} bytes")
    key = ev.best[2]
    return _to_plan(profile, [c[k] for c, k in zip(cands, key)], budget)


def plan_for(profile: StepProfile, actions: Sequence[Union[Action, LayerPlan, str]],
             budget_bytes: Optional[int] = None) -> Plan:
    """A plan from explicit per-layer actions (an Action means OFFLOAD of everything), with the
    model's prediction at ``budget_bytes`` (None: nothing forced)."""
    if len(actions) != len(profile.layers):
        raise ValueError(f"got {len(actions)} actions for a model of {len(profile.layers)} layers")
    if budget_bytes is not None:
        _check_budget(budget_bytes)
    plans = [a if isinstance(a, LayerPlan) else LayerPlan(Action(a)) for a in actions]
    for i, (layer, lp) in enumerate(zip(profile.layers, plans)):
        if lp.selective and layer.selective is None:
            raise ValueError(f"layer {i} is planned selective, but the probe found no selective candidates in it")
    return _to_plan(profile, plans, budget_bytes)
