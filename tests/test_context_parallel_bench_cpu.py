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
