"""``benchmarks/context_parallel.py --smoke`` (issue 51's T29-T32 script) on the CPU: 2 gloo
processes, a tiny Llama with eager attention (the CPU has no ring kernel), the planned contender
going on until a step ran under its plan; the JSON has its row (the figures mean nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from _bench_util import BENCH  # noqa: E402


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
