"""``benchmarks/context_parallel.py --smoke`` (issue 51's T29-T32 script) on the CPU: 2 gloo
processes, a tiny Llama with eager attention (the CPU has no ring kernel), the planned contender
going on until a step ran under its plan; the JSON has its row (the figures mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from _bench_util import BENCH, bench_module  # noqa: E402


def test_smoke_runs_the_planned_contender_on_two_ranks(tmp_path) -> None:
    out = tmp_path / "cp.json"
    done = subprocess.run([sys.executable, str(BENCH / "context_parallel.py"), "--smoke", "--contenders", "ours",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"context_parallel.py --smoke failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "ours step 0: 64 tokens on 2 ranks" in done.stdout, done.stdout[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["contender"] == "ours" and not row["errors"], row
    assert row["steps_finished"] >= 3 and row["median_steady_ms"] > 0, row  # probe steps, then a planned one
    assert row["plan"], "the plan in force is not reported"


def _smoke(tmp_path, *options: str) -> tuple[str, dict]:
    out = tmp_path / "cp.json"
    done = subprocess.run([sys.executable, str(BENCH / "context_parallel.py"), "--smoke", "--contenders", "ours",
                           "--out", str(out), *options], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"context_parallel.py --smoke failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    (row,) = json.loads(out.read_text())["rows"]
    assert not row["errors"], row
    return done.stdout, row


def test_t29_preflight_probes_short_inside_the_first_call_prints_progress_and_extrapolates(tmp_path) -> None:
    # T29's path (issue 51): FSDP2 + CP, the first full-length call probed short inside it (the
    # short probe cut to 8 tokens here), a preflight of 1 of the 2 layers, progress every layer.
    stdout, row = _smoke(tmp_path, "--layers", "1", "--short-probe-tokens", "8", "--progress", "1",
                         "--time-left-s", "600")
    assert "ours step 0: forward layer 0/1" in stdout and "ours step 0: backward layer 0/1" in stdout, stdout[-2000:]
    assert row["first_full_phase"] == "probed short, planned", row  # no full-length probe step
    assert row["full_length_steps"] == 1, "the preflight ran more than its one full-length step"
    assert row["layer_ms"][0] and row["layer_ms"][0] > 0, row
    for extrapolated in row["preflight"]:
        assert extrapolated["layers"] == 2 and extrapolated["step_ms"] > 0 and "error" not in extrapolated, extrapolated
    assert "ours 2 layers, the planner" in stdout and "ours verdict: GO" in stdout, stdout[-2000:]


def test_a_probe_length_gives_the_plan_before_the_first_full_length_step(tmp_path) -> None:
    stdout, row = _smoke(tmp_path, "--probe-length", "32", "--steps", "1")
    assert "ours step 0: 32 tokens on 2 ranks" in stdout, stdout[-2000:]
    assert row["first_full_phase"] == "planned" and row["full_length_steps"] == 1, row


def test_plan_only_gives_the_whole_models_own_plan_and_runs_no_step(tmp_path) -> None:
    # --plan-only (T29's check before a step of minutes): every layer, probed short inside the
    # first full-length call, planned, and stopped as its first layer begins: no layer runs at
    # the full length (the progress lines would show it), each rank's plan is reported.
    stdout, row = _smoke(tmp_path, "--plan-only", "--short-probe-tokens", "8", "--progress", "1", "--time-left-s", "600")
    assert row["first_full_phase"] == "plan only" and row["full_length_steps"] == 1, row
    assert "forward layer" not in stdout and "backward layer" not in stdout, stdout[-2000:]
    assert len(row["planned"]) == 2 and all(p["plan"] and p["step_ms"] > 0 for p in row["planned"]), row
    assert "ours plan only, 64 tokens on 2 ranks" in stdout and "ours verdict: GO" in stdout, stdout[-2000:]


def test_plan_only_says_no_go_where_the_node_or_the_planner_says_no() -> None:
    report = bench_module("cp_long_step").plan_only_report
    planned = {"plan": "recompute 32", "step_ms": 6e5, "peak_bytes": 1 << 37, "host_bytes": 128 << 30,
               "budget_reason": "device"}
    ok = report({"planned": [planned, planned]}, 1 << 20, 2, 512 << 30, 500 << 30)
    assert ok[-1] == "verdict: GO", ok
    full = report({"planned": [planned, planned]}, 1 << 20, 2, 256 << 30, 250 << 30)
    assert full[-1].startswith("verdict: NO-GO") and "DOES NOT FIT" in full[-1], full
    late = report({"planned": [planned, planned]}, 1 << 20, 2, 512 << 30, 500 << 30, time_left_s=300)
    assert late[-1].startswith("verdict: NO-GO") and "10.0 min" in late[-1], late
    none = report({"planned": [], "errors": ["BudgetError: no plan fits"]}, 1 << 20, 2, 512 << 30, 500 << 30)
    assert none[-1].startswith("verdict: NO-GO") and "BudgetError" in none[0], none
