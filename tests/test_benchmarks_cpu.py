"""The benchmark scripts' own logic, on the CPU: long_context.py end to end (``--cpu-smoke``), its
verdicts and README row from GPU-like rows, pareto.py's T17 verdict, and the workload helpers
that every LLAMA contender goes through (HF checkpointing on and off, gradients dropped)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GiB = 1 << 30


def bench_module(name: str) -> ModuleType:
    """A benchmark script imported as a module, as the scripts import their helpers (by name,
    from benchmarks/)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def tiny_llama() -> tuple[Any, torch.Tensor, Any]:
    workloads = bench_module("workloads")
    spec = workloads.LlamaSpec("tiny", hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1, batch=1, seq=8,
                               vocab=64, dtype=torch.float32)
    model, ids = spec.build(torch.device("cpu"))
    return model, ids, workloads


def test_long_context_cpu_smoke_reports_every_contender() -> None:
    name = "long_context_pytest"
    out = BENCH / "results" / "smoke" / f"{name}.json"
    # One thread: the tiny GEMMs gain nothing from more, and a shared CI box is oversubscribed.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, str(BENCH / "long_context.py"), "--cpu-smoke", "--name", name],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"long_context.py --cpu-smoke failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        result = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
        out.with_suffix(".png").unlink(missing_ok=True)
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
