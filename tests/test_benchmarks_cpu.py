"""The benchmark scripts' own logic, on the CPU: long_context.py and extrapolate.py end to end
(``--cpu-smoke``), long_context's verdicts and README row from GPU-like rows, pareto.py's T17
verdict, and the workload helpers that every LLAMA contender goes through (HF checkpointing on and
off, gradients dropped)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _bench_util import BENCH, ROOT, bench_module, run_smoke  # noqa: E402

GiB = 1 << 30


def tiny_llama() -> tuple[Any, torch.Tensor, Any]:
    workloads = bench_module("workloads")
    spec = workloads.LlamaSpec("tiny", hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1, batch=1, seq=8,
                               vocab=64, dtype=torch.float32)
    model, ids = spec.build(torch.device("cpu"))
    return model, ids, workloads


def test_long_context_cpu_smoke_reports_every_contender() -> None:
    name = "long_context_pytest"
    try:
        result = run_smoke("long_context.py", name)
    finally:
        (BENCH / "results" / "smoke" / f"{name}.png").unlink(missing_ok=True)  # its plot
    rows = {r["variant"]: r for r in result["rows"]}
    expected = ["plain", "HF checkpointing", "offload all but the last", "MLP selective + offload k=4",
                "MLP selective + offload k=8", "MLP selective + offload k=15", "plan @ device", "plan @ lowest"]
    assert list(rows) == expected, f"the contenders reported: {list(rows)}"
    failed = {v: r["error"] for v, r in rows.items() if "error" in r}
    assert not failed, f"contenders failed on the CPU: {failed}"
    left = {v: r["left_on_model"] for v, r in rows.items() if "left_on_model" in r}
    assert not left, f"contenders left the model changed: {left}"
    assert "needs a CUDA device" in rows["plan @ device"]["skipped"]
    for v in expected[:6] + expected[7:]:
        assert rows[v]["step_ms"] > 0, f"{v} has no step time"
    lowest = rows["plan @ lowest"]
    assert lowest["planning_s"] > 0 and lowest["probe_steps"] >= 1, lowest
    assert lowest["plan"] and lowest["budget_reason"].startswith("lowest"), lowest
    assert "layer" in lowest["plan_report"], "the plan's per-layer table is missing"
    assert [t["target"] for t in result["targets"]] == ["T16 (plan @ lowest)"]
    assert result["readme_row"].startswith("| HF Llama 1B, seq 64, batch 1 |")


def gpu_like_rows(device_ms: float, planning_s: float) -> list[dict[str, Any]]:
    """Rows as a GPU run of long_context.py records them: plain and the lowest plan out of memory."""
    return [
        {"variant": "plain", "error": "out of memory"},
        {"variant": "HF checkpointing", "step_ms": 2600.0, "peak_bytes": int(23.5 * GiB), "peak_gib": 23.5},
        {"variant": "offload all but the last", "step_ms": 3220.0, "peak_bytes": int(27.5 * GiB), "peak_gib": 27.5},
        {"variant": "MLP selective + offload k=4", "step_ms": 2090.0, "peak_bytes": 71 * GiB, "peak_gib": 71.0},
        {"variant": "MLP selective + offload k=15", "step_ms": 2120.0, "peak_bytes": 49 * GiB, "peak_gib": 49.0},
        {"variant": "plan @ device", "step_ms": device_ms, "peak_bytes": 60 * GiB, "peak_gib": 60.0,
         "planning_s": planning_s, "probe_steps": 3, "planning_peak_gib": 30.0},
        {"variant": "plan @ lowest", "error": "out of memory", "failed_in": "planning"},
    ]


def test_long_context_verdicts_follow_the_targets() -> None:
    lc = bench_module("long_context")
    rows = gpu_like_rows(device_ms=2100.0, planning_s=8.0)  # 0.81x checkpointing; 3.1 checkpointed steps
    targets = {t["target"]: t for t in lc.check_targets(rows, lc.add_ratios(rows), 80 * GiB)}
    assert targets["T15"]["ok"] is True and "0.808x" in targets["T15"]["figure"]
    assert targets["T16 (plan @ device)"]["ok"] is True and "3.08x" in targets["T16 (plan @ device)"]["figure"]
    assert targets["T16 (plan @ lowest)"]["ok"] is False
    assert targets["T16 (plan @ lowest)"]["figure"] == "out of memory (in planning)"

    slow = gpu_like_rows(device_ms=2150.0, planning_s=11.0)  # 0.83x; 4.2 checkpointed steps
    targets = {t["target"]: t for t in lc.check_targets(slow, lc.add_ratios(slow), 80 * GiB)}
    assert targets["T15"]["ok"] is False, "a step of 0.83x checkpointing's must miss T15 (<= 0.82x)"
    assert targets["T16 (plan @ device)"]["ok"] is False, "planning for 4.2 checkpointed steps must miss T16 (<= 4x)"
    over = gpu_like_rows(device_ms=2100.0, planning_s=8.0)
    targets = {t["target"]: t for t in lc.check_targets(over, lc.add_ratios(over), 50 * GiB)}
    assert targets["T15"]["ok"] is False, "a peak above the device's capacity must miss T15"


def test_long_context_readme_row_has_every_figure() -> None:
    lc = bench_module("long_context")
    rows = gpu_like_rows(device_ms=2100.0, planning_s=8.0)
    lc.add_ratios(rows)
    row = lc.readme_row(lc.long_1b(), rows)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["HF Llama 1B, seq 49152, batch 1", "does not fit", "2.60 s, 23.5 GiB", "", ""], cells
    for part in ("@ device: 0.81x, 60.0 GiB (planning 8.0 s)", "lowest: out of memory (in planning)",
                 "MLP selective + offload, by hand: 0.80-0.82x, 49-71 GiB", "all but the last layer offloaded: 1.24x"):
        assert part in cells[5], f"{part!r} not in the README row's offload cell: {cells[5]}"


class FakePlanner:
    """Stands in for ``OffloadActivations(layers, memory_budget_bytes=...)``: its plan comes into
    force at the entry of step ``at_entry``, or at the exit of step ``at_exit``."""

    def __init__(self, at_entry: int = 0, at_exit: int = 0, planned_entry_s: float = 0.0) -> None:
        self.at_entry, self.at_exit, self.planned_entry_s = at_entry, at_exit, planned_entry_s
        self.plan = None
        self.steps = 0

    def __enter__(self) -> "FakePlanner":
        if self.plan is not None:
            time.sleep(self.planned_entry_s)  # a planned step's entry: not planning any more
        self.steps += 1
        if self.steps == self.at_entry:
            self.plan = "a plan"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.steps == self.at_exit:
            self.plan = "a plan"


@pytest.mark.parametrize("planner, probe_steps", [
    (dict(at_entry=4), 3), (dict(at_exit=2), 2), (dict(at_entry=1), 0), (dict(at_exit=1, planned_entry_s=0.5), 1),
])
def test_long_context_counts_the_steps_before_the_plan(planner: dict[str, int], probe_steps: int) -> None:
    lc = bench_module("long_context")
    env = lc.Env(device=torch.device("cpu"), smoke=True, offload_device="cpu", args=None)

    def plan(make: Any) -> dict[str, Any]:
        wrapper = lc.ContenderContext(env, make)

        def step() -> None:
            with wrapper():
                pass

        row: dict[str, Any] = {"variant": "plan"}
        lc.plan_first(wrapper, step, row)
        return row

    row = plan(lambda: FakePlanner(**planner))
    assert row["probe_steps"] == probe_steps, row
    assert 0 <= row["planning_s"] < 0.5, "planning time runs on into the first planned step"
    with pytest.raises(RuntimeError, match="no plan after 8 steps"):
        plan(FakePlanner)


def test_long_context_plot_draws_ratios_to_checkpointing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    lc = bench_module("long_context")
    rows = gpu_like_rows(device_ms=2100.0, planning_s=8.0)
    lc.add_ratios(rows)
    drawn: dict[str, Any] = {}
    import offload.plot

    real = offload.plot.plot_pareto
    monkeypatch.setattr(offload.plot, "plot_pareto", lambda panels, path, **kw: drawn.update(panels, **kw) or real(panels, path, **kw))
    written = lc.plot(lc.long_1b(), rows, tmp_path / "long.png")
    assert written is not None and written.stat().st_size > 1000
    assert drawn.pop("baseline") == "HF checkpointing"
    (points,) = drawn.values()
    by = {p.label: p for p in points}
    assert set(by) == {"HF checkpointing", "offload all but the last", "MLP selective + offload k=4",
                       "MLP selective + offload k=15", "plan @ device"}, "failed contenders have no point"
    assert by["HF checkpointing"].step_vs_plain == 1.0 and by["plan @ device"].step_vs_plain == pytest.approx(2100 / 2600)


def test_pareto_reports_t17_for_the_lowest_plan() -> None:
    pareto = bench_module("pareto")
    plain = {"step_ms": 300.0, "peak_bytes": 35 * GiB}
    ckpt = {"step_ms": 380.0, "peak_bytes": 9 * GiB}

    def t17(lowest_peak: int) -> bool:
        lowest = {"step_ms": 380.0, "peak_bytes": lowest_peak, "predicted_step_ms": 380.0, "predicted_peak_bytes": lowest_peak}
        (target,) = [t for t in pareto.check_targets(plain, ckpt, [("lowest", lowest)]) if t["target"] == "T17"]
        return target["ok"]

    assert t17(9 * GiB) is True, "a lowest plan at checkpointing's peak meets T17 (<= 1.00x)"
    assert t17(9 * GiB + 1) is False, "a lowest plan one byte above checkpointing's peak misses T17"


def test_hf_checkpointing_is_undone_after_the_with() -> None:
    model, ids, workloads = tiny_llama()

    def state() -> tuple[bool, int]:
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        return model.model.gradient_checkpointing, hooks

    before = state()
    assert before == (False, 0)
    with workloads.hf_checkpointing(model):
        assert model.model.gradient_checkpointing, "checkpointing is not on inside the with"
    assert state() == before, f"the model after HF checkpointing: {state()}, before: {before}"
    with pytest.raises(RuntimeError, match="inside"):
        with workloads.hf_checkpointing(model):
            raise RuntimeError("inside")
    assert state() == before, "a failure inside the with left checkpointing on"


def test_llama_step_drops_gradients_when_backward_fails() -> None:
    # An out-of-memory error in backward must not leave gradients that count in the next
    # contender's peak; any failure stands in for it here.
    model, ids, workloads = tiny_llama()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")

    # The embedding's gradient comes last: every layer's is set by the time this raises.
    handle = model.model.embed_tokens.weight.register_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="backward failed"):
            workloads.llama_step(model, ids)()
    finally:
        handle.remove()
    left = [name for name, p in model.named_parameters() if p.grad is not None]
    assert not left, f"a failed step left gradients on {left}"


def test_no_selective_is_passed_only_where_offload_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    lc = bench_module("long_context")

    class Taking:
        def __init__(self, layers: Any = None, *, selective: Any = None, **options: Any) -> None: ...

    class NotTaking:
        def __init__(self, layers: Any = None, **options: Any) -> None: ...

    monkeypatch.setattr(lc.offload, "OffloadActivations", Taking)
    assert lc.selective_option(True)[0] == {"selective": False}
    assert lc.selective_option(False)[0] == {}, "without --no-selective the default candidates apply"
    monkeypatch.setattr(lc.offload, "OffloadActivations", NotTaking)
    kw, note = lc.selective_option(True)
    assert kw == {} and "no effect" in note


# -- varlen.py and device_everywhere.py (issue 33: T22, T23, T24) --------------------------------------
def test_varlen_cpu_smoke_runs_the_stream_in_three_processes() -> None:
    result = run_smoke("varlen.py", "varlen_pytest", "--jobs", "3")
    runs = result["contenders"]
    assert list(runs) == ["ours", "ckpt", "plain"]
    assert not {c: r["error"] for c, r in runs.items() if "error" in r}, "a worker failed"
    assert len({r["info"]["pid"] for r in runs.values()}) == 3, "the contenders did not run in processes of their own"
    lengths = result["lengths"]
    assert len(lengths) == 5 and set(lengths) <= {16, 32, 64, 96, 128}
    for c, r in runs.items():
        assert [s["length"] for s in r["steps"]] == lengths, c
        assert not [s for s in r["steps"] if "error" in s], f"{c}: steps failed on the CPU"
        assert all(s["ms"] > 0 and s["loss"] > 0 for s in r["steps"]), c
    phases = [s["phase"] for s in runs["ours"]["steps"]]
    assert phases[0] == "probe" and "planned" in phases, f"ours never planned: {phases}"
    assert all(s.get("plan") for s in runs["ours"]["steps"] if s["phase"] == "planned")
    assert runs["ours"]["budget_bytes"] == 24 << 20, "the smoke budget is 24 MiB"
    # Each step of ours says what its arena did: blocks pinned over the stream add up to those held.
    ours_steps = runs["ours"]["steps"]
    assert all("d_pinned_allocations" in s and "d_trimmed_for_plan" in s for s in ours_steps)
    assert sum(s["d_pinned_allocations"] for s in ours_steps) >= 1, "no step of ours pinned a block"
    assert "check" not in runs["ckpt"], "only ours and plain are checked bit for bit"
    rows = {r["length"]: r for r in result["bitwise"]}
    assert set(rows) == set(lengths)
    assert all(r["bitwise"] is True and r["plain_repeatable"] is True for r in rows.values()), result["bitwise"]
    targets = {t["target"]: t for t in result["targets"]}
    assert list(targets) == ["T22 peak", "T22 time", "T22 bitwise", "T22 new buckets"]
    assert targets["T22 bitwise"]["ok"] is True
    assert targets["T22 peak"]["ok"] is None and targets["T22 time"]["ok"] is None, "no verdict on CPU numbers"
    assert len(result["rows"]) == 5 and all(r["ours_ms"] and r["ckpt_ms"] and r["plain_ms"] for r in result["rows"])


def test_varlen_counts_what_each_step_of_the_arena_did() -> None:
    varlen = bench_module("varlen")
    before = {"pinned_allocations": 3, "trimmed_for_plan": 1, "background_pin_s": 0.5, "cuda_mallocs": 7}
    after = {"pinned_allocations": 5, "trimmed_for_plan": 1, "background_pin_s": 0.75, "cuda_mallocs": 7}
    deltas = varlen.counter_deltas(before, after)
    assert deltas == {"d_pinned_allocations": 2, "d_trimmed_for_plan": 0, "d_background_pin_s": 0.25, "d_cuda_mallocs": 0}
    assert varlen.counters_text(deltas) == "  [pinned 2, background pin 0.250 s]"
    assert varlen.counters_text(varlen.counter_deltas(before, before)) == ""


def test_varlen_verdicts_follow_the_targets() -> None:
    varlen = bench_module("varlen")
    budget = 24 * GiB

    def results(peaks: list[float], ours_ms: float, ckpt_ms: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        steps = [{"step": i, "length": 1024, "ms": ours_ms / len(peaks), "peak_bytes": int(p * budget)} for i, p in enumerate(peaks)]
        res = {"ours": {"steps": steps, "summary": {"total_ms": ours_ms, "failed": 0}},
               "ckpt": {"steps": [], "summary": {"total_ms": ckpt_ms, "failed": 0}}}
        return res, varlen.stream_table(res, budget)

    bitwise = [{"length": 1024, "bitwise": True}, {"length": 8192, "bitwise": None, "note": "plain: out of memory"}]
    res, rows = results([0.9, 1.02, 1.0], ours_ms=850.0, ckpt_ms=1000.0)
    ok = {t["target"]: t["ok"] for t in varlen.check_targets(res, rows, bitwise, budget, smoke=False)}
    assert ok == {"T22 peak": True, "T22 time": True, "T22 bitwise": True, "T22 new buckets": None}, \
        "a length where plain does not fit is not judged"
    res, rows = results([0.9, 1.03], ours_ms=910.0, ckpt_ms=1000.0)
    targets = {t["target"]: t for t in varlen.check_targets(res, rows, [{"length": 1024, "bitwise": False}], budget, smoke=False)}
    assert targets["T22 peak"]["ok"] is False and "step 1" in targets["T22 peak"]["figure"]
    assert targets["T22 time"]["ok"] is False and targets["T22 bitwise"]["ok"] is False
    res["ours"]["steps"][1] = {"step": 1, "length": 8192, "ms": 10.0, "error": "out of memory"}
    assert varlen.check_targets(res, varlen.stream_table(res, budget), [], budget, smoke=False)[0]["ok"] is False


def test_varlen_judges_each_new_buckets_first_step_against_its_steady_step() -> None:
    # Issue 50 s2: bucket 2048's first step (a stand-in) is 1.4x its steady step (the median of
    # its later steps on its own plan), bucket 4096's 2.0x: over 1.5x.
    varlen = bench_module("varlen")

    def step(i: int, length: int, ms: float, new: bool, kind: str) -> dict[str, Any]:
        return {"step": i, "length": length, "ms": ms, "bucket": length, "new_bucket": new, "plan_kind": kind,
                "oneoff_s": 0.01 if new else 0.0}

    steps = [step(0, 2048, 140.0, True, "stand-in"), step(1, 2048, 100.0, False, "own"),
             step(2, 4096, 400.0, True, "stand-in"), step(3, 4096, 210.0, False, "stand-in"),
             step(4, 4096, 200.0, False, "own"), step(5, 4096, 200.0, False, "own")]
    ckpt = [{"step": i, "length": s["length"], "ms": s["ms"] * 1.1} for i, s in enumerate(steps)]
    buckets = varlen.bucket_table({"ours": {"steps": steps}, "ckpt": {"steps": ckpt}})
    assert [(b["bucket"], b["first_plan"], b["steady_ms"]) for b in buckets] == [(2048, "stand-in", 100.0),
                                                                                (4096, "stand-in", 200.0)]
    assert [round(b["first_x_steady"], 2) for b in buckets] == [1.4, 2.0]
    target = varlen.first_step_target(buckets, smoke=False)
    assert target["ok"] is False and "1 of 2 buckets over" in target["figure"] and "bucket 4096" in target["figure"]
    assert varlen.first_step_target(buckets[:1], smoke=False)["ok"] is True
    assert varlen.first_step_target(buckets, smoke=True)["ok"] is None
    # Checkpointing's own first step at each length against its steady one, beside ours.
    assert [b["ckpt_first_x_steady"] for b in buckets] == [pytest.approx(154 / 110), pytest.approx(440 / 220)]
    assert "checkpointing's first step there 2.00x its steady" in target["figure"]
    # The stream with every planned step at its bucket's steady time (a probe step as it ran):
    # 2048's first at 100, 4096's first two at 200, the probe's 50 kept.
    probe = {"step": 6, "length": 8192, "ms": 50.0}
    assert varlen.steady_floor([*steps, probe], buckets) == 100 + 100 + 200 * 4 + 50


def test_varlen_compares_digests_per_length(tmp_path: Path) -> None:
    varlen = bench_module("varlen")
    same, other = {"a": "1", "b": "2"}, {"a": "1", "b": "3"}
    results = {
        "ours": {"check": [{"length": 1024, "digests": same}, {"length": 2048, "digests": other},
                           {"length": 8192, "digests": same}]},
        "plain": {"check": [{"length": 1024, "digests": same}, {"length": 1024, "digests": same},
                            {"length": 2048, "digests": same}, {"length": 2048, "digests": other},
                            {"length": 8192, "error": "out of memory"}]},
    }
    rows = {r["length"]: r for r in varlen.compare_lengths(results, tmp_path)}
    assert rows[1024]["bitwise"] is True and rows[1024]["plain_repeatable"] is True
    assert rows[2048]["bitwise"] is False and rows[2048]["first_differing"] == ["b"]
    assert rows[2048]["plain_repeatable"] is False
    assert rows[8192]["bitwise"] is None and "out of memory" in rows[8192]["note"]


def test_varlen_stream_is_fixed_and_covers_every_length() -> None:
    varlen = bench_module("varlen")
    stream = varlen.draw_lengths(varlen.LENGTHS, 30, 0)
    assert stream == varlen.draw_lengths(varlen.LENGTHS, 30, 0) and set(stream) == set(varlen.LENGTHS)
    a = varlen.batch_ids(0, 3, 16, 2, 100, torch.device("cpu"))
    assert torch.equal(a, varlen.batch_ids(0, 3, 16, 2, 100, torch.device("cpu")))
    assert not torch.equal(a, varlen.batch_ids(0, 4, 16, 2, 100, torch.device("cpu")))


def test_device_everywhere_cpu_smoke_runs_each_case_and_contender() -> None:
    result = run_smoke("device_everywhere.py", "device_everywhere_pytest", "--cases", "8b-16384", "--contenders",
                       "ckpt,device", "--jobs", "2", "--profile-step", "1", "--pinner-workers", "1")
    runs = result["runs"]
    assert {run["pinner_workers"] for run in runs.values()} == {1}
    for run in runs.values():  # the step profiled, and no other
        profiled = [s for s in run["steps"] if "profile" in s]
        assert [s["step"] for s in profiled] == [1], [s["step"] for s in run["steps"]]
        assert profiled[0]["profile"] and all(r["self_host_ms"] >= 0 and r["calls"] >= 1 for r in profiled[0]["profile"])
    assert list(runs) == ["8b-16384:ckpt", "8b-16384:device"]
    assert not {k: r["error"] for k, r in runs.items() if "error" in r}
    dev = runs["8b-16384:device"]
    assert dev["budget"] == "lowest", "the CPU runs 'lowest' in place of 'device'"
    assert dev["frozen_base"] is True
    workloads = bench_module("workloads")
    spec = workloads.llama_8b_shape(workloads.SMOKE_SCALE)
    assert dev["trainable_params"] == (2 * spec.layers + 1) * spec.hidden, "only the RMSNorm weights train"
    phases = [s["phase"] for s in dev["steps"]]
    assert phases.count("timed") == 2 and phases[0] == "probe" and "warmup" in phases, phases
    assert [s["phase"] for s in runs["8b-16384:ckpt"]["steps"]] == ["warmup", "timed", "timed"]
    rows = {r["contender"]: r for r in result["rows"]}
    assert rows["ckpt"]["status"] == rows["device"]["status"] == "ok"
    assert rows["ckpt"]["x_ckpt"] == 1.0 and rows["device"]["x_ckpt"] > 0 and rows["device"]["plan"]
    (target,) = result["targets"]
    assert target["target"] == "T23 8b-16384" and target["ok"] is None, "no verdict on CPU numbers"
    ref, t14 = result["t14"]
    assert ref["target"].startswith("T14 8b-16384 ckpt (reference") and ref["ok"] is None
    assert t14["target"] == "T14 8b-16384 device" and t14["ok"] is None and t14["max_x_steady"] > 0
    kinds = [r["kind"] for r in dev["first_steps"]]
    assert kinds[-2:] == ["planned", "planned"] and "measure" in kinds, kinds


def test_device_recovery_cpu_smoke_goes_on_after_the_failed_step() -> None:
    result = run_smoke("device_everywhere.py", "device_recovery_pytest", "--recovery")
    steps = result["result"]["steps"]
    capped = [s for s in steps if s["phase"] == "capped"]
    assert len(capped) == 3 and capped[0]["error"] == "out of memory"
    assert not [s for s in capped[1:] if "error" in s], "the loop did not go on after the out-of-memory step"
    assert result["result"]["plan_before"]["plan"] and result["result"]["plan_after"]["plan_report"]
    (target,) = result["targets"]
    assert target["ok"] is None and target["logic_ok"] is True and "simulated" in target["figure"]


def test_device_everywhere_verdicts_follow_the_targets() -> None:
    de = bench_module("device_everywhere")

    def run(ms: list[float], failed: int = 0) -> dict[str, Any]:
        steps = [{"phase": "timed", "ms": m, "peak_bytes": 40 * GiB} for m in ms]
        steps += [{"phase": "probe", "ms": 1.0, "error": "out of memory"}] * failed
        return {"summary": de.summarize(steps), "plan": "offload 20"}

    def t23(device_ms: list[float], failed: int = 0) -> Any:
        results = {"8b-16384:ckpt": run([2000.0] * 5), "8b-16384:device": run(device_ms, failed)}
        rows = de.t23_rows(["8b-16384"], ["ckpt", "device"], results)
        (target,) = de.t23_targets(["8b-16384"], rows, smoke=False)
        return target["ok"]

    assert t23([1800.0] * 5) is True
    assert t23([1800.0] * 4 + [1920.0]) is False, "each step must be <= 0.95x checkpointing's"
    assert t23([1800.0] * 5, failed=1) is False, "an out-of-memory probe step misses T23"

    def t14(ms: list[float], steady: float = 1000.0) -> Any:
        steps = [{"step": i, "phase": "probe", "ms": m} for i, m in enumerate(ms)]
        steps += [{"step": len(ms) + i, "phase": "timed", "ms": steady} for i in range(5)]
        results = {f"8b-16384:{name}": {"steps": steps, "summary": de.summarize(steps)} for name in ("ckpt", "device")}
        reference, target = de.t14_targets(["8b-16384"], ["ckpt", "device"], results, smoke=False)
        assert reference["ok"] is None and "reference" in reference["target"], "checkpointing plans nothing: a reference"
        assert reference["max_x_steady"] == target["max_x_steady"]
        return target["ok"]

    assert t14([1400.0, 1400.0, 1200.0]) is True  # 5 first steps: 1.4 + 1.4 + 1.2 + 1 + 1 = 6.0 steady
    assert t14([1400.0, 1400.0, 1300.0]) is False, "the first 5 steps must cost at most 6 steady steps"
    assert t14([1600.0, 1000.0]) is False, "no step may take over 1.5x a steady step"

    def t24(errors: list[bool]) -> Any:
        steps = [{"phase": "capped", "ms": 1.0, "peak_bytes": GiB, **({"error": "out of memory"} if e else {})} for e in errors]
        return de.t24_target({"steps": steps, "cap_bytes": 30 * GiB}, smoke=False)["ok"]

    assert t24([True, False, False]) is True
    assert t24([False, False, False]) is None, "no out-of-memory step: the case was not produced"
    assert t24([True, True, False]) is False
    assert t24([False, False, True]) is False, "the last step out of memory: nothing shows it recovers"


def test_worker_options_are_stripped_with_their_values() -> None:
    workers = bench_module("workers")
    argv = ["--cpu-smoke", "--contenders", "ours", "--jobs=3", "--steps", "4", "--out", "x.json"]
    assert workers.strip_parent_options(argv, ("--contenders", "--jobs", "--out")) == ["--cpu-smoke", "--steps", "4"]


def sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The benchmark modules ``path`` imports, wherever in the file (a function's import counts:
    it closes a circle as surely as a module-level one)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & siblings - {path.stem}


def test_benchmarks_have_no_import_circle_and_no_file_over_600_lines() -> None:
    files = {p.stem: p for p in BENCH.glob("*.py")}
    graph = {name: sibling_imports(path, set(files)) for name, path in files.items()}
    assert graph["common"] == set(), f"common.py is the bottom layer; it imports {graph['common']}"
    assert graph["measure"] == {"common"} and graph["workloads"] == set(), (graph["measure"], graph["workloads"])
    # Depth-first search for a back edge: any circle, however long.
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            assert state.get(dep) != 1, f"import circle in benchmarks/: {' -> '.join(path + [name, dep])}"
            if dep not in state:
                visit(dep, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    long = {p.name: n for p in files.values() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"files over 600 lines in benchmarks/: {long}"


def test_run_all_runs_every_script_the_readme_gives_a_target_to() -> None:
    # The README's table names, for each question, the script that gives its target's figure;
    # run_all.sh runs each such script (or says why not, in its header).
    readme = (BENCH / "README.md").read_text()
    run_all = (BENCH / "run_all.sh").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| T")]
    assert rows, "the README has no table of targets"
    suite = run_all[run_all.index("SUITE=("):run_all.index(")", run_all.index("SUITE=("))]
    for row in rows:
        for script in re.findall(r"`(\w+)\.py", row.split("|")[3]):
            assert (BENCH / f"{script}.py").exists(), f"the README names {script}.py, which is not in benchmarks/"
            assert f'"{script}' in suite, f"{script}.py gives {row.split('|')[1].strip()} but run_all.sh does not run it"


def test_measure_step_records_out_of_memory_and_raises_other_errors() -> None:
    records = bench_module("step_records")
    env = bench_module("common").Env(device=torch.device("cpu"), smoke=True, offload_device="cpu", args=None)
    cleaned = []

    def oom() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    rec = records.measure_step(env, oom, on_failure=lambda: cleaned.append(1))
    assert rec["error"] == "out of memory" and rec["detail"].startswith("CUDA out of memory") and cleaned == [1]
    assert records.measure_step(env, lambda: torch.tensor(2.5))["loss"] == 2.5
    with pytest.raises(ZeroDivisionError):
        records.measure_step(env, lambda: 1 / 0)


def test_probe_steps_report_the_peak_their_probe_read() -> None:
    # The probe resets the device's peak counter layer by layer: the reading after a probe step
    # covers its last layers only, so the step's record takes the probe's own (larger) figure.
    records = bench_module("step_records")
    steps = [{"peak_bytes": 10}, {"peak_bytes": 30}, {"peak_bytes": 50}, {"error": "out of memory", "peak_bytes": None}]
    first = [{"step": 1, "peak_bytes": 40}, {"step": 2, "peak_bytes": 20}, {"step": 3, "peak_bytes": None},
             {"step": 4, "peak_bytes": 99}]
    records.with_probe_peaks(steps, first)
    assert [s["peak_bytes"] for s in steps] == [40, 30, 50, None]
    assert steps[0]["counter_peak_bytes"] == 10 and "counter_peak_bytes" not in steps[2]


def test_ab_engine_direct_worker_reports_the_engine_parts_on_the_cpu() -> None:
    # The DIRECT- workloads run without a GPU: one worker (this tree), one JSON line of parts.
    done = subprocess.run(
        [sys.executable, str(BENCH / "ab_engine.py"), "--worker", "new", "DIRECT-SMALL", "--steps", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parts = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(parts) == {"pack us/t", "unpack us/t", "release us/g", "exit us/g", "all us/t", "entry+exit+release+reach us/g"}
    for label, (us, again) in parts.items():
        assert us == again and us > 0, (label, us)
    assert parts["all us/t"] > parts["pack us/t"] + parts["unpack us/t"]


def test_results_name_the_source_that_ran_by_digest(tmp_path: Path) -> None:
    # git's state is stale on the device machine's copy of the tree; the digest is not.
    common = bench_module("common")
    for name in ("offload/engine/group.py", "csrc/torch/entry_table.cpp", "offload/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    before = common.source_digest(tmp_path)
    assert before and len(before) == 16
    (tmp_path / "offload" / "__pycache__").mkdir()
    (tmp_path / "offload" / "__pycache__" / "x.py").write_text("ignored")
    assert common.source_digest(tmp_path) == before
    (tmp_path / "csrc/torch/entry_table.cpp").write_text("// changed\n")
    assert common.source_digest(tmp_path) != before
    assert common.source_digest(tmp_path / "empty") is None


def test_the_registration_stall_is_the_loops_time_beyond_quiet_against_the_pinning() -> None:
    first_step = bench_module("first_step")
    figures = first_step.stall_figures([10.0, 30.0, 10.0, 50.0], quiet_ms=10.0, pin_s=0.1)
    assert figures["iterations"] == 4
    assert abs(figures["stall_s"] - 0.06) < 1e-12 and abs(figures["stall_share"] - 0.6) < 1e-9
    # Faster than quiet is no stall, and no pinning time gives no share.
    assert first_step.stall_figures([5.0, 5.0], 10.0, 0.0) == {"iterations": 2, "stall_s": 0.0, "pin_s": 0.0, "stall_share": 0.0}


def test_a_new_length_case_times_three_steps_at_each_length() -> None:
    # first_step.py --new-lengths runs each case in a process of its own; one case in this one.
    new_lengths = bench_module("new_lengths")
    common = bench_module("common")
    env = common.setup(common.make_parser("", warmup=0, steps=3), ["--cpu-smoke", "--no-json"])
    row = new_lengths.run_worker(env, "case:ckpt,on")  # (what a --worker spec runs)
    assert row["case"] == "ckpt, copy on" and row["copies"] == 0  # (the copy is CUDA's alone)
    assert all(len(row[str(n)]) == 3 and min(row[str(n)]) > 0 for n in new_lengths.LENGTHS)


def test_where_a_new_length_goes_times_its_halves_and_the_ops_that_grew() -> None:
    new_lengths = bench_module("new_lengths")
    common = bench_module("common")
    env = common.setup(common.make_parser("", warmup=0, steps=3), ["--cpu-smoke", "--no-json"])
    row = new_lengths.run_worker(env, "where:plain")
    for n in new_lengths.WHERE_LENGTHS:
        figures = row[str(n)]
        assert len(figures["first_ms"]) == len(figures["second_ms"]) == 2 and min(figures["first_ms"]) > 0
        assert 0 < len(figures["host_grew_ms"]) <= new_lengths.TOP_OPS


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_extrapolate_cpu_smoke_predicts_the_saved_bytes_measured_at_other_lengths(tmp_path: Path, attention: str) -> None:
    out = tmp_path / "extrapolate.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH / "extrapolate.py"), "--cpu-smoke", "--attention", attention,
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["attention"] == attention and [r["length"] for r in doc["rows"]] == [40, 64]
    for row in doc["rows"]:
        assert abs(row["error"]["saved_bytes"]) < 0.01 and abs(row["error"]["input_bytes"]) < 0.01, row["error"]
        assert row["plain_peak_measured"] == 0  # (the CPU has no peak counter)
