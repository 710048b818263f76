"""The planner's pure part: cost model by hand, search against enumeration, types, the table.

The hand cases use a link of 1e6 bytes per ms (1 GB/s), no slowdown and no latency unless a test
says otherwise, so every figure below can be checked with pencil and paper; the comments give
the timeline.
"""

from __future__ import annotations

import itertools
import math
import re
import time

import pytest

from offload.planner import (
    Action,
    BudgetError,
    LayerPlan,
    LayerProfile,
    LinkProfile,
    Plan,
    StepProfile,
    best_plan,
    format_plan,
    held_bytes,
    layer_candidates,
    lowest_peak,
    offloaded_bytes,
    plan_for,
    resident_bytes,
    simulate,
)
from offload.planner import search as search_mod

MB = 1_000_000
MiB = 1 << 20
GiB = 1 << 30
K, O, R = LayerPlan(Action.KEEP), LayerPlan(Action.OFFLOAD), LayerPlan(Action.RECOMPUTE)


def link(d2h=1.0, h2d=1.0, duplex=2.0, one_way=0.0, both=0.0, latency=0.0) -> LinkProfile:
    return LinkProfile(d2h, h2d, duplex, slowdown_one_way=one_way, slowdown_duplex=both, latency_ms=latency)


def hand_layer(slots=(3 * MB, 1 * MB), fwd=10.0, bwd=20.0, name="hand") -> LayerProfile:
    return LayerProfile(slots, MB // 2, fwd, bwd, name)


def profile(layers, lk=None, base=100 * MB, head=2 * MB, pre=1.0, head_ms=5.0, post=2.0) -> StepProfile:
    layers = tuple(layers)
    saved = sum(l.saved_bytes for l in layers)
    plain_ms = pre + head_ms + post + sum(l.forward_ms + l.backward_ms for l in layers)
    return StepProfile(layers, lk or link(), base, head, pre, head_ms, post, plain_ms, base + saved + head, "cuda")


def two_layers(**kw) -> StepProfile:
    return profile([hand_layer(), hand_layer()], **kw)


def llama_1b(n: int = 16) -> StepProfile:
    """LLAMA-1B-like (docs/benchmarks.md): ~1.5 GiB saved per layer in 14 slots, 64 MiB inputs,
    6 ms forward / 12 ms backward per layer, the H100 link, 4 GiB base, 3 GiB head."""
    slots = (256 * MiB,) * 4 + (64 * MiB,) * 8 + (16 * MiB,) * 2
    layer = LayerProfile(slots, 64 * MiB, 6.0, 12.0, "llama-1b-layer")
    return profile([layer] * n, lk=LinkProfile(54.0, 54.0, 86.6), base=4 * GiB, head=3 * GiB,
                   pre=3.0, head_ms=12.0, post=2.0)


# ------------------------------------------------------------------------------ model, by hand

def test_all_keep_is_the_plain_step():
    p = two_layers(lk=link(one_way=0.3, both=0.5, latency=1.0))  # no copy: no slowdown, no latency
    pred = simulate(p, [K, K])
    assert pred.step_ms == pytest.approx(1 + 10 + 10 + 5 + 20 + 20 + 2)
    assert pred.peak_bytes == 100 * MB + 8 * MB + 2 * MB
    assert pred.peak_at == "end of forward"
    assert (pred.d2h_bytes, pred.h2d_bytes, pred.forward_stall_ms, pred.backward_stall_ms) == (0, 0, 0, 0)

    big = llama_1b()
    pred = simulate(big, [K] * 16)
    assert pred.step_ms == pytest.approx(3 + 16 * 6 + 12 + 16 * 12 + 2)
    assert pred.peak_bytes == big.plain_peak_bytes


def test_offload_first_layer_by_hand():
    # pre 0-1, L0 1-11, its D2H 11-15 (4 MB), L1 11-21 (L0 still held at its start: 108 MB),
    # L0 released at 21, head 21-26 (106 MB), L1 bwd 26-46 with L0's reload 26-30 prefetched
    # (108 MB), L0 bwd 46-66, post 66-68: no stall, the plain step.
    pred = simulate(two_layers(), [O, K])
    assert pred.step_ms == pytest.approx(68.0)
    assert pred.peak_bytes == 108 * MB
    assert pred.peak_at == "forward layer 1"
    assert (pred.d2h_bytes, pred.h2d_bytes, pred.wasted_d2h_bytes) == (4 * MB, 4 * MB, 0)
    assert pred.forward_stall_ms == 0 and pred.backward_stall_ms == 0


def test_budget_forces_release_and_limits_prefetch():
    # Budget 106 MB: L1 cannot start while L0 is held (108 MB), so compute waits for L0's D2H
    # (11-15, stall 4). In backward L0's reload does not fit beside L1 (108 MB), so it is loaded
    # on demand at L0's backward (50-54, stall 4). Step 68 + 4 + 4.
    pred = simulate(two_layers(), [O, K], budget_bytes=106 * MB)
    assert pred.forward_stall_ms == pytest.approx(4.0)
    assert pred.backward_stall_ms == pytest.approx(4.0)
    assert pred.step_ms == pytest.approx(76.0)
    assert pred.peak_bytes == 106 * MB and pred.peak_at == "end of forward"


def test_copy_longer_than_compute_stalls_forward_under_budget():
    # D2H of L0 at 0.2 GB/s takes 20 ms against L1's 10 ms: the forced release waits all of it.
    slow = simulate(two_layers(lk=link(d2h=0.2)), [O, K], budget_bytes=106 * MB)
    assert slow.forward_stall_ms == pytest.approx(20.0)
    fast = simulate(two_layers(), [O, K], budget_bytes=106 * MB)
    assert slow.step_ms - fast.step_ms == pytest.approx(16.0)


def test_slow_reload_stalls_backward():
    # H2D at 0.1 GB/s: L0's 4 MB reload starts at L1's backward (26) and ends at 66; L0's
    # backward would start at 46: stall 20.
    pred = simulate(two_layers(lk=link(h2d=0.1)), [O, K])
    assert pred.backward_stall_ms == pytest.approx(20.0)
    assert pred.step_ms == pytest.approx(88.0)


def test_unfinished_copy_is_wasted_not_reloaded():
    # Without a budget nothing waits: L0's 20 ms D2H (11-31) is not done at the end of forward
    # (21) nor when backward passes L1 (26); at L0's own backward the originals are used.
    pred = simulate(two_layers(lk=link(d2h=0.2)), [O, K])
    assert pred.wasted_d2h_bytes == 4 * MB and pred.h2d_bytes == 0
    assert pred.peak_bytes == two_layers().plain_peak_bytes
    assert pred.step_ms == pytest.approx(68.0)


def test_copies_slow_compute_down():
    # slowdown 0.5 while one direction copies: L1's forward overlaps the 4 ms D2H and only gets
    # 4 / 1.5 ms of work done in it (+4/3 ms); same for L1's backward during the reload.
    pred = simulate(two_layers(lk=link(one_way=0.5)), [O, K])
    assert pred.step_ms == pytest.approx(68.0 + 2 * 4 / 3)


def test_duplex_shares_the_link():
    # L1's 20 MB D2H (21-) is still running when backward reloads L0 (2 MB, at 26). Both
    # directions share 1.5 GB/s: 0.75 each, so the reload takes 8/3 ms and L0's backward (ready
    # at 27, after L1's 1 ms backward) waits 5/3 ms; with room for both (duplex 2), 1 ms.
    layers = [hand_layer(slots=(2 * MB,)), hand_layer(slots=(20 * MB,), bwd=1.0)]
    shared = simulate(profile(layers, lk=link(duplex=1.5)), [O, O])
    free = simulate(profile(layers, lk=link(duplex=2.0)), [O, O])
    assert shared.backward_stall_ms == pytest.approx(5 / 3)
    assert free.backward_stall_ms == pytest.approx(1.0)
    assert shared.wasted_d2h_bytes == 20 * MB  # L1's own copy never finished in time


def test_latency_is_paid_per_copy():
    pred = simulate(two_layers(lk=link(h2d=0.1, latency=0.5)), [O, K])
    assert pred.backward_stall_ms == pytest.approx(20.5)  # the reload: 0.5 ms + 40 ms


def test_recompute_by_hand():
    # L0's inputs (0.5 MB) go out 11-11.5 and back 26-26.5; L0's backward is its forward again
    # plus its backward (30 ms) with its activations (4 MB) rebuilt on top of its inputs.
    pred = simulate(two_layers(), [R, K])
    assert pred.step_ms == pytest.approx(68.0 + 10.0)
    assert pred.peak_bytes == 106 * MB and pred.peak_at == "end of forward"
    assert (pred.d2h_bytes, pred.h2d_bytes) == (MB // 2, MB // 2)


def test_all_recompute_with_fast_link_is_checkpointing():
    p = profile([hand_layer(fwd=f) for f in (3.0, 5.0, 7.0)], lk=link(1000.0, 1000.0, 2000.0))
    pred = simulate(p, [R, R, R])
    assert pred.step_ms == pytest.approx(p.plain_step_ms + 15.0, abs=0.01)
    # Peak: a layer's rebuilt activations on top of a few inputs, or the head.
    assert pred.peak_bytes <= p.base_bytes + max(p.head_bytes, 4 * MB + 3 * (MB // 2))
    assert pred.peak_bytes < p.plain_peak_bytes


def test_partial_offload_sizes():
    layer = LayerProfile((8, 4, 4, 1), 2, 1.0, 1.0, "x")
    part = LayerPlan(Action.OFFLOAD, min_offload_bytes=4)
    assert offloaded_bytes(layer, part) == 16 and resident_bytes(layer, part) == 1
    assert offloaded_bytes(layer, O) == 17 and resident_bytes(layer, O) == 0
    assert (offloaded_bytes(layer, K), resident_bytes(layer, K)) == (0, 17)
    assert (offloaded_bytes(layer, R), held_bytes(layer, R), resident_bytes(layer, R)) == (2, 2, 0)
    # Floors sit midway (geometric) between tensor sizes: 8 and 4 -> 5, 4 and 1 -> 2.
    floors = [lp.min_offload_bytes for lp in layer_candidates(layer)[1:-1]]
    assert floors == [5, 2, 0]
    assert [offloaded_bytes(layer, LayerPlan(Action.OFFLOAD, f)) for f in floors] == [8, 16, 17]


def test_simulate_is_deterministic():
    p = llama_1b()
    plans = [O, O, R, LayerPlan(Action.OFFLOAD, 256 * MiB)] + [R] * 8 + [K] * 4
    assert simulate(p, plans, 12 * GiB) == simulate(p, plans, 12 * GiB)


# ------------------------------------------------------------------------------------- search

def _hetero4() -> StepProfile:
    layers = [
        LayerProfile((6 * MB, 3 * MB, 1 * MB), MB, 4.0, 8.0, "a"),
        LayerProfile((2 * MB, 2 * MB), MB // 2, 9.0, 18.0, "b"),
        LayerProfile((12 * MB, 4 * MB, 4 * MB, 1 * MB), 2 * MB, 3.0, 6.0, "c"),
        LayerProfile((5 * MB, 5 * MB), MB, 6.0, 12.0, "d"),
    ]
    return profile(layers, lk=link(1.0, 1.0, 1.6, one_way=0.09, both=0.19, latency=0.01),
                   base=20 * MB, head=8 * MB)


@pytest.mark.parametrize("budget_mb", [42, 48, 55, 62, 69, 80])
def test_best_plan_fits_budget_and_beats_every_enumerated_plan(budget_mb):
    p = _hetero4()
    budget = budget_mb * MB
    best = None
    for combo in itertools.product(*(layer_candidates(l) for l in p.layers)):
        pred = simulate(p, combo, budget)
        if pred.peak_bytes <= budget and (best is None or pred.step_ms < best):
            best = pred.step_ms
    plan = best_plan(p, budget)
    assert plan.prediction.peak_bytes <= budget
    assert plan.prediction.step_ms <= best + 1e-9, "best_plan is slower than an enumerated plan"
    assert plan.budget_bytes == budget and plan.prediction == simulate(p, plan.layers, budget)


@pytest.mark.parametrize("frac", [0.1, 0.45, 0.8])
def test_heuristic_search_is_near_the_exhaustive_optimum(monkeypatch, frac):
    layer = LayerProfile((6 * MB, 3 * MB, 3 * MB, 1 * MB), MB, 4.0, 8.0, "u")
    p = profile([layer] * 5, lk=link(1.0, 1.0, 1.6, one_way=0.09, both=0.19), base=20 * MB, head=8 * MB)
    floor = lowest_peak(p).prediction.peak_bytes
    budget = int(floor + (p.plain_peak_bytes - floor) * frac)
    exhaustive = best_plan(p, budget).prediction.step_ms
    monkeypatch.setattr(search_mod, "EXHAUSTIVE_LIMIT", 0)  # force families + greedy + polish
    heuristic = best_plan(p, budget)
    assert heuristic.prediction.peak_bytes <= budget
    assert heuristic.prediction.step_ms <= exhaustive * 1.01


def test_budget_error_names_budget_and_lowest_peak():
    p = llama_1b()
    lowest = lowest_peak(p).prediction.peak_bytes
    with pytest.raises(BudgetError) as err:
        best_plan(p, 5 * GiB)
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert "5.0 GiB" in msg and "Raise the budget" in msg
    floor = float(re.search(r"lowest peak reachable is ([\d.]+) GiB", msg).group(1))
    assert floor * GiB == pytest.approx(lowest, rel=0.015)


def test_lowest_peak_is_lowest_then_fastest():
    p = llama_1b()
    low = lowest_peak(p)
    rec = simulate(p, [R] * 16, low.budget_bytes)
    assert low.prediction.peak_bytes <= rec.peak_bytes * 1.01
    assert low.prediction.step_ms <= rec.step_ms + 1e-9
    assert low.prediction.peak_bytes <= low.budget_bytes


def test_llama_like_search_is_fast_and_mixes_actions():
    p = llama_1b()
    rec = simulate(p, [R] * 16)
    t0 = time.perf_counter()
    low = lowest_peak(p)
    budgets = [int(low.prediction.peak_bytes + (p.plain_peak_bytes - low.prediction.peak_bytes) * f)
               for f in (0.25, 0.5, 0.75)]
    plans = [best_plan(p, b) for b in budgets]
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0, f"four searches at N=16 took {elapsed:.1f} s (expected well under 1 s each)"
    steps = []
    for b, plan in zip(budgets, plans):
        kinds = {lp.action for lp in plan.layers}
        assert len(kinds) > 1, f"budget {b / GiB:.1f} GiB gave a single-action plan: {plan.describe()}"
        assert plan.prediction.peak_bytes <= b
        assert plan.prediction.step_ms < rec.step_ms
        steps.append(plan.prediction.step_ms)
    assert steps == sorted(steps, reverse=True), "a larger budget gave a slower plan"
    full = best_plan(p, p.plain_peak_bytes)
    assert full.describe() == "keep 16" and full.prediction.step_ms == pytest.approx(p.plain_step_ms)
    assert best_plan(p, budgets[1]) == plans[1]  # deterministic


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9])
def test_search_beats_every_simple_mix(frac):
    # Independently enumerated: o layers offloaded (all, or slots >= 256 MiB), then r recomputed,
    # then k kept. The search must find nothing slower than the best of these.
    p = llama_1b()
    low = lowest_peak(p).prediction.peak_bytes
    budget = int(low + (p.plain_peak_bytes - low) * frac)
    best = math.inf
    for off in (O, LayerPlan(Action.OFFLOAD, 256 * MiB)):
        for o in range(17):
            for k in range(17 - o):
                pred = simulate(p, [off] * o + [R] * (16 - o - k) + [K] * k, budget)
                if pred.peak_bytes <= budget:
                    best = min(best, pred.step_ms)
    assert best_plan(p, budget).prediction.step_ms <= best + 1e-9


def test_search_scales_to_128_layers():
    p = llama_1b(128)
    t0 = time.perf_counter()
    plan = best_plan(p, p.plain_peak_bytes // 2)
    elapsed = time.perf_counter() - t0
    assert elapsed < 30.0, f"N=128 search took {elapsed:.1f} s (expected a few seconds)"
    assert plan.prediction.peak_bytes <= p.plain_peak_bytes // 2
    assert plan.prediction.step_ms < simulate(p, [R] * 128).step_ms


def test_plan_for_builds_explicit_plans():
    p = two_layers()
    plan = plan_for(p, [Action.OFFLOAD, "keep"])
    assert plan.layers == (O, K) and plan.budget_bytes is None
    assert plan.prediction == simulate(p, [O, K])
    assert plan_for(p, [O, K], budget_bytes=106 * MB).prediction.step_ms == pytest.approx(76.0)
    with pytest.raises(ValueError, match="2 layers"):
        plan_for(p, [K])


# ------------------------------------------------------------------------------- types, table

def test_check_matches_names_what_differs():
    p = two_layers()
    plan = plan_for(p, [O, K])
    plan.check_matches(p.signature(), 2)
    three = profile([hand_layer()] * 3)
    with pytest.raises(ValueError, match="plan made for 2 layers, model has 3"):
        plan.check_matches(three.signature(), 3)
    changed = profile([hand_layer(), hand_layer(name="other shapes")])
    with pytest.raises(ValueError, match="layer 1's saved tensors differ"):
        plan.check_matches(changed.signature(), 2)
    with pytest.raises(ValueError, match="not a planner signature"):
        plan.check_matches("garbage", 2)


def test_describe_and_round_trip():
    p = llama_1b(4)
    plan = plan_for(p, [K, O, LayerPlan(Action.OFFLOAD, 64 * MiB), R])
    assert plan.describe() == "keep 1, offload 2 (1 partial), recompute 1"
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: LayerProfile((1, -1), 0, 1.0, 1.0, "x"), "slot_bytes"),
        (lambda: LayerProfile((1,), -5, 1.0, 1.0, "x"), "input_bytes"),
        (lambda: LayerProfile((1,), 0, math.nan, 1.0, "x"), "forward_ms"),
        (lambda: LayerProfile((1,), 0, 1.0, -2.0, "x"), "backward_ms"),
        (lambda: LayerProfile((True,), 0, 1.0, 1.0, "x"), "slot_bytes"),
        (lambda: LinkProfile(0.0, 1.0, 1.0), "d2h_gbps"),
        (lambda: LinkProfile(1.0, 1.0, math.inf), "duplex_gbps"),
        (lambda: profile([]), "no layers"),
        (lambda: profile([hand_layer()], base=-1), "base_bytes"),
        (lambda: profile([hand_layer()], pre=math.nan), "pre_ms"),
        (lambda: LayerPlan(Action.KEEP, min_offload_bytes=5), "OFFLOAD only"),
        (lambda: LayerPlan("sideways"), "action"),
        (lambda: simulate(two_layers(), [K]), "2 layers"),
        (lambda: simulate(two_layers(), [K, K], budget_bytes=0), "budget_bytes"),
        (lambda: best_plan(two_layers(), 1.5e9), "budget_bytes"),
        (lambda: best_plan(two_layers(), -1), "budget_bytes"),
    ],
)
def test_bad_inputs_are_refused_clearly(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_format_plan_shows_layers_prediction_and_error():
    p = two_layers()
    plan = plan_for(p, [LayerPlan(Action.OFFLOAD, 2 * MiB), K])
    text = format_plan(plan, p)
    assert "offload >= 2.0 MiB" in text and "keep" in text
    assert len([l for l in text.splitlines() if re.match(r"\s+[01]\s", l)]) == 2
    assert "predicted step 68.0 ms (1.000x plain)" in text
    assert "measured" not in text

    text = format_plan(plan, p, measured={"step_ms": 80.0, "peak_bytes": plan.prediction.peak_bytes})
    step_line = next(l for l in text.splitlines() if l.startswith("step"))
    assert "68.0 ms" in step_line and "80.0 ms" in step_line and step_line.endswith("-15.0%")
    assert next(l for l in text.splitlines() if l.startswith("peak")).endswith("+0.0%")
    with pytest.raises(ValueError, match="measured takes"):
        format_plan(plan, p, measured={"step": 1})
    with pytest.raises(ValueError, match="plan made for 2 layers"):
        format_plan(plan, profile([hand_layer()] * 3))


# ------------------------------------------------------------------ measured memory, gradients

def test_gradients_and_backward_peaks_move_the_peak_into_backward():
    # Each layer: 4 MB saved, backward peaks 1 MB above its start, and leaves 10 MB of weight
    # gradients. The head leaves 3 MB behind. Checkpointing both layers:
    #   end of forward: base 100 + inputs 0.5 + 0.5 + head 2 = 103 MB
    #   backward layer 1: 100 + 0.5 + 0.5 (both inputs) + grads 3 + (4 rebuilt + 1) = 109 MB
    #   backward layer 0: 100 + 0.5 + grads 3 + 10 + (4 + 1) = 118.5 MB  <- the peak
    layer = LayerProfile((3 * MB, 1 * MB), MB // 2, 10.0, 20.0, "g", backward_peak_bytes=MB, grad_bytes=10 * MB)
    p = StepProfile((layer, layer), link(), 100 * MB, 2 * MB, 1.0, 5.0, 2.0, 68.0, 130 * MB, "cuda", head_residual_bytes=3 * MB)
    pred = simulate(p, [R, R])
    assert pred.peak_at == "backward layer 0"
    assert pred.peak_bytes == 100 * MB + MB // 2 + 3 * MB + 10 * MB + 5 * MB
    # Without the gradients and the measured backward peak the model would put the peak at
    # layer 1, 13.5 MB too low: the case of LLAMA-2B, whose weight gradients outweigh its head.
    bare = LayerProfile((3 * MB, 1 * MB), MB // 2, 10.0, 20.0, "g")
    p0 = StepProfile((bare, bare), link(), 100 * MB, 2 * MB, 1.0, 5.0, 2.0, 68.0, 130 * MB, "cuda")
    assert simulate(p0, [R, R]).peak_bytes == 100 * MB + MB + 4 * MB


def test_measured_forward_peak_is_what_a_layer_needs():
    # A layer whose forward peaks at 6 MB above its start though it keeps only 4 MB.
    layer = LayerProfile((3 * MB, 1 * MB), MB // 2, 10.0, 20.0, "f", forward_peak_bytes=6 * MB)
    p = profile([layer], head=0)
    pred = simulate(p, [K])
    assert pred.peak_bytes == 100 * MB + 6 * MB and pred.peak_at == "forward layer 0"


# ------------------------------------------------------- "lowest" and budgets near the lowest peak

def near_tie() -> StepProfile:
    """Offloading everything is predicted 2.4% under all-recompute (24.00 MB against 24.58 MB):
    within the model's peak error, so it may well measure above checkpointing."""
    import dataclasses

    p = profile([hand_layer()] * 4, base=20 * MB)
    return dataclasses.replace(p, recompute_factor=1.02)


def test_all_recompute_is_always_a_candidate():
    for layer in (hand_layer(), llama_1b().layers[0], LayerProfile((), 0, 1.0, 1.0, "empty")):
        assert layer_candidates(layer)[-1] == R


def test_lowest_prefers_all_recompute_within_the_model_error():
    p = near_tie()
    rec = simulate(p, [R] * 4, 1).peak_bytes
    # The old choice (no allowance for the model's error): the offloading plan, predicted lower.
    old = lowest_peak(p, model_error=0.0)
    assert old.recomputes() is False and old.prediction.peak_bytes < rec
    assert old.prediction.peak_bytes > rec * (1 - search_mod.PEAK_MODEL_ERROR)
    # Now: the two are closer than the model can tell, so checkpointing's peak is the one to trust.
    low = lowest_peak(p)
    assert low.describe() == "recompute 4", f"lowest chose {low.describe()} over all-recompute"
    assert low.prediction.peak_bytes <= rec and low.budget_bytes == rec


def test_lowest_takes_a_plan_clearly_under_all_recompute():
    import dataclasses

    p = dataclasses.replace(near_tie(), recompute_factor=1.3)  # recompute now peaks 7% higher
    rec = simulate(p, [R] * 4, 1).peak_bytes
    low = lowest_peak(p)
    assert low.describe() != "recompute 4"
    assert low.prediction.peak_bytes <= rec * (1 - search_mod.PEAK_MODEL_ERROR)


def test_budget_error_shows_the_difference_in_bytes():
    p = llama_1b()
    floor = search_mod._floor(p, search_mod._space(p))[0]
    budget = int(floor * (1 - 2 * search_mod.PEAK_MODEL_ERROR))
    with pytest.raises(BudgetError) as err:
        best_plan(p, budget)
    msg = str(err.value)
    assert f"({budget:,} bytes)" in msg and f"({floor:,} bytes)" in msg, msg
    assert "shorter sequence" in msg and "smaller batch" in msg and "more GPUs" in msg


def test_budget_within_the_model_error_follows_the_lowest_plan_and_warns():
    p = llama_1b()
    floor = search_mod._floor(p, search_mod._space(p))[0]
    budget = floor - 1  # one byte short: the rounded figures read the same
    with pytest.warns(UserWarning, match="within the cost model's error") as got:
        plan = best_plan(p, budget)
    msg = str(got[0].message)
    assert f"({budget:,} bytes)" in msg and f"({floor:,} bytes)" in msg, msg
    assert plan == lowest_peak(p, tolerance=0.0)
    with pytest.raises(BudgetError):
        best_plan(p, int(floor * (1 - search_mod.PEAK_MODEL_ERROR)) - 1)
