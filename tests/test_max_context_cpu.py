"""benchmarks/max_context.py on the CPU: the length search as a pure function, the time-per-token
column, the longest-length summary and its README rows, HF's offload option detected, and the
script end to end (``--smoke``: tiny models, a worker process per length)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import max_context as mc  # noqa: E402

K = 1024


class Oracle:
    """``fits(n)``: n <= ``longest`` (None: nothing fits); every length asked is noted."""

    def __init__(self, longest: Optional[int]) -> None:
        self.longest = longest
        self.asked: list[int] = []

    def __call__(self, n: int) -> bool:
        self.asked.append(n)
        return self.longest is not None and n <= self.longest


def check_search(found: Any, oracle: Oracle, multiple: int = K) -> None:
    assert len(oracle.asked) == len(set(oracle.asked)), f"a length was asked twice (a worker run twice): {oracle.asked}"
    assert all(n % multiple == 0 and n >= multiple for n in oracle.asked), f"lengths not multiples of {multiple}: {oracle.asked}"
    assert [n for n, _ in found.tried] == oracle.asked
    assert all(ok == (oracle.longest is not None and n <= oracle.longest) for n, ok in found.tried), \
        "a length's outcome was recorded wrongly"


@pytest.mark.parametrize("longest", [70_000, 65_536, 131_071, 300_000, 524_288, 600_000, 1_000_000, 3_000_000])
def test_search_doubles_then_bisects_to_an_eighth(longest: int) -> None:
    oracle = Oracle(longest)
    found = mc.search_longest(oracle, 64 * K, limit=4 << 20)
    check_search(found, oracle)
    assert found.longest is not None and found.longest <= longest < found.first_failure, found
    gap = found.first_failure - found.longest
    assert gap <= max(K, found.longest / 8), f"the search stopped {gap} tokens short of the failure above {found.longest}"
    doubled = [n for n in oracle.asked if n & (n - 1) == 0]
    assert doubled[0] == 64 * K and doubled == sorted(doubled), f"not doubling from --start first: {oracle.asked}"
    assert len(oracle.asked) <= 12, f"{len(oracle.asked)} workers for one search: {oracle.asked}"


def test_search_with_nothing_fitting_halves_down_to_one_multiple() -> None:
    oracle = Oracle(None)
    found = mc.search_longest(oracle, 64 * K, limit=4 << 20)
    check_search(found, oracle)
    assert found.longest is None and found.first_failure == K
    assert oracle.asked == [64 * K, 32 * K, 16 * K, 8 * K, 4 * K, 2 * K, K]


def test_search_below_the_start_halves_then_bisects() -> None:
    oracle = Oracle(20_000)
    found = mc.search_longest(oracle, 64 * K, limit=4 << 20)
    check_search(found, oracle)
    assert oracle.asked[:3] == [64 * K, 32 * K, 16 * K], "a failing start must halve first"
    assert found.longest <= 20_000 < found.first_failure and found.first_failure - found.longest <= max(K, found.longest / 8)


@pytest.mark.parametrize("cap", [4 << 20, 3_000_000, 64 * K])
def test_search_with_everything_up_to_the_cap_fitting_stops_at_the_cap(cap: int) -> None:
    oracle = Oracle(10 << 20)
    found = mc.search_longest(oracle, 64 * K, limit=cap)
    check_search(found, oracle)
    top = cap // K * K
    assert found.longest == top and found.first_failure is None, found
    assert oracle.asked[-1] == top and all(oracle.asked[i] < oracle.asked[i + 1] for i in range(len(oracle.asked) - 1))


def test_search_takes_other_multiples_for_tiny_models() -> None:
    oracle = Oracle(100)
    found = mc.search_longest(oracle, 32, limit=256, multiple=16)
    check_search(found, oracle, multiple=16)
    assert found.longest == 96 and found.first_failure == 112, found


def row(method: str, length: int, status: str = "ok", step_s: Optional[float] = 1.0, model: str = "llama_1b",
        **extra: Any) -> dict[str, Any]:
    return {"model": model, "method": method, "length": length, "status": status, "step_s": step_s,
            "peak_gib": 70.0 if status == "ok" else None, "detail": extra.pop("detail", None), **extra}


def test_time_per_token_only_where_two_methods_fit() -> None:
    rows = [row("hf_ckpt", 131072, step_s=40.0), row("ours", 131072, step_s=32.0),
            row("hf_ckpt", 262144, "OOM", None), row("ours", 262144, step_s=100.0),
            row("ours", 524288, step_s=300.0), row("ours_lowest", 524288, step_s=330.0),
            row("hf_ckpt", 524288, "timeout", None), row("ours", 524288, step_s=5.0, model="llama_8b_shape")]
    per = {(r["model"], r["method"], r["length"]): r["us_per_token"] for r in mc.add_time_per_token(rows)}
    assert per[("llama_1b", "hf_ckpt", 131072)] == pytest.approx(40.0e6 / 131072)
    assert per[("llama_1b", "ours", 131072)] == pytest.approx(32.0e6 / 131072)
    assert per[("llama_1b", "ours", 262144)] is None, "one method alone fit at 262144: nothing to compare"
    assert per[("llama_1b", "hf_ckpt", 262144)] is None
    assert per[("llama_1b", "ours", 524288)] == pytest.approx(300.0e6 / 524288)
    assert per[("llama_1b", "ours_lowest", 524288)] == pytest.approx(330.0e6 / 524288)
    assert per[("llama_8b_shape", "ours", 524288)] is None, "another model's fit does not count"


def test_readme_rows_give_the_longest_per_method() -> None:
    rows = [row("hf_ckpt", 131072, step_s=40.0), row("hf_ckpt", 262144, "OOM", None),
            row("hf_offload", 65536, "unsupported", None, detail="unsupported by transformers 5.17 (its ... takes no offload=)"),
            row("ours", 458752, step_s=250.0), row("ours", 524288, "BudgetError", None),
            row("ours_lowest", 4 << 20, step_s=900.0),
            row("hf_ckpt", 65536, "OOM", None, model="llama_8b_shape")]
    longest = {(e["model"], e["method"]): e for e in mc.longest_per_method(rows, limit=4 << 20)}
    assert longest[("llama_1b", "hf_ckpt")]["longest"] == 131072 and longest[("llama_1b", "hf_ckpt")]["first_failure"] == 262144
    assert longest[("llama_1b", "ours_lowest")]["capped"] is True
    assert longest[("llama_1b", "ours")]["capped"] is False
    first, second = mc.readme_rows(list(longest.values()))
    cells = [c.strip() for c in first.strip("|").split("|")]
    assert cells == ["HF Llama 1B (every weight trains), longest context, batch 1", "",
                     "128K tokens (256K did not), 40.0 s/step, 70.0 GiB", "",
                     "HF `offload=True`: unsupported by transformers 5.17",
                     '@ `"device"`: 448K tokens (512K did not), 250.0 s/step, 70.0 GiB; '
                     "lowest: >= 4M tokens (the cap; longer not tried), 900.0 s/step, 70.0 GiB"], cells
    assert second.startswith("| HF Llama-3-8B shape (base frozen), longest context, batch 1 | | did not train at 64K |")
    assert mc.tokens(524288) == "512K" and mc.tokens(1 << 20) == "1M" and mc.tokens(96) == "96"


def test_a_killed_worker_is_a_timeout_and_a_crash_an_error() -> None:
    killed = {"model": "llama_1b", "method": "ours", "length": 1 << 20, "error": "worker exited with status -9 and wrote no result",
              "output_tail": ["step 0: ...", "killed after 560.0 s (--worker-timeout)"]}
    crashed = {**killed, "output_tail": ["Segmentation fault"]}
    assert mc.run_row(killed)["status"] == "timeout" and mc.run_row(crashed)["status"] == "error"
    assert mc.status_of("out of memory") == "OOM" and mc.status_of("BudgetError: no plan fits 70 GiB") == "BudgetError"
    assert mc.status_of("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate") == "OOM"
    assert mc.status_of("RuntimeError: shape mismatch") == "error" and mc.status_of(None) == "ok"


def test_hf_offload_is_unsupported_where_transformers_takes_no_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import PreTrainedModel

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(PreTrainedModel, name):
            monkeypatch.setattr(PreTrainedModel, name, lambda self, gradient_checkpointing_kwargs=None: None)
    monkeypatch.setattr(mc, "transformers_version", lambda: "5.17.0")
    assert mc.hf_offload_support() == "unsupported by transformers 5.17 (its checkpointing enable takes no offload=)"
    monkeypatch.setattr(PreTrainedModel, "activation_checkpointing_enable", lambda self, offload=False: None, raising=False)
    assert mc.hf_offload_support() is None


def smoke(out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """``max_context.py --smoke *args --out OUT`` in a process of its own (it spawns its workers);
    its JSON and its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCH / "max_context.py"), "--smoke", *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"max_context.py --smoke {' '.join(args)} failed:\n{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
    return json.loads(out.read_text()), done.stdout


def test_max_context_smoke_searches_each_method_in_processes_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "max_context.json"
    result, stdout = smoke(out, "--search", "--start", "32", "--max-length", "32", "--multiple", "16",
                           "--models", "llama_1b,llama_8b_shape", "--jobs", "2")
    assert {"meta", "mode", "models", "methods", "search", "hf_offload", "rows", "longest", "readme_rows", "runs"} <= set(result)
    meta = result["meta"]
    assert meta["host_ram_gib"] > 0 and meta["transformers"] and meta["torch"] == torch.__version__ and meta["device"] == "cpu"
    assert result["mode"] == "search" and result["methods"] == list(mc.METHODS)
    trained = [m for m in mc.METHODS if m != "hf_offload"]  # HF's offload pins host memory: not on the CPU
    for model in ("llama_1b", "llama_8b_shape"):
        searched = result["search"]["results"][model]
        assert "unsupported" in searched["hf_offload"], searched["hf_offload"]
        for method in trained:
            assert searched[method]["longest"] == 32 and searched[method]["tried"] == [[32, True]], (model, method)
            run = result["runs"][f"{model}:{method}:32"]
            assert run["status"] == "ok", (model, method, run.get("error"))
            assert len(run["steps"]) >= 2 and all(s["ms"] > 0 and s["host_rss_peak_bytes"] > 0 for s in run["steps"])
            assert run["sdpa"]["chosen"] != "unknown" and run["sdpa"]["math"] is False, run["sdpa"]
            assert "t27_steps" in run and run["frozen_base"] is (model == "llama_8b_shape")
        option = result["runs"][f"{model}:ours:32"]["model_option"]
        assert option == "passed" or option.startswith("not taken"), option
        lowest = result["runs"][f"{model}:ours_lowest:32"]
        assert lowest["plan_in_force"] and lowest["plan"] and lowest["plan_table"], "the lowest plan never came into force"
    pids = [r["info"]["pid"] for r in result["runs"].values() if "info" in r]
    assert len(set(pids)) == len(pids), "two runs shared a process"
    assert all(r["us_per_token"] is not None for r in result["rows"] if r["status"] == "ok"), "three methods fit at 32"
    assert [r.split("|")[1].strip() for r in result["readme_rows"]] == [
        "HF Llama 1B (every weight trains), longest context, batch 1", "HF Llama-3-8B shape (base frozen), longest context, batch 1"]
    assert all(">= 32 tokens (the cap" in r for r in result["readme_rows"])
    assert out.with_suffix(".png").exists() or "no plot" in stdout

    # A search split over two commands: the second takes 32 from the JSON and runs 64 only.
    again, stdout = smoke(out, "--search", "--start", "32", "--max-length", "64", "--multiple", "16", "--models", "llama_1b",
                          "--methods", "hf_ckpt", "--reuse")
    assert again["search"]["results"]["llama_1b"]["hf_ckpt"]["tried"] == [[32, True], [64, True]]
    assert "[llama_1b:hf_ckpt:32]" not in stdout and "[llama_1b:hf_ckpt:64]" in stdout, "32 ran again instead of being reused"
    assert again["runs"]["llama_1b:hf_ckpt:32"] == result["runs"]["llama_1b:hf_ckpt:32"]
    assert [(r["length"], r["status"]) for r in again["rows"]] == [(32, "ok"), (64, "ok")]
