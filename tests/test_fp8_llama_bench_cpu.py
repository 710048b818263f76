"""benchmarks/fp8_llama.py's code path on the CPU (``--cpu-smoke``: a tiny Llama): every
contender runs, the FP8 rows come from ``offload.fp8.convert`` and ``convert_llama_ops``, the weight cache's two settings
show their bytes, the targets are judged, and the JSON is written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_fp8_llama_benchmark_runs_every_contender_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import common
    import fp8_llama

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert fp8_llama.main(["--cpu-smoke", "--warmup", "0", "--steps", "1"]) == 0
    doc = json.loads((tmp_path / "smoke" / "fp8_llama.json").read_text())["results"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert not [r for r in rows.values() if "error" in r], [r["error"] for r in rows.values() if "error" in r]
    expected = {f"{p} {c}" for p in ("fp32", "FP8") for c in ("plain", "offload k=4", "offload k=7", "plan @ 75% of fp32 plain")}
    assert expected | {"FP8 plain (both layouts)", "FP8 plain (Linears only)"} == set(rows)
    assert doc["converted"] == 8 * 7, "convert did not swap the 56 decoder Linears"
    assert "8 Llama-style layers; swapped 16 RMSNorms and 8 MLPs" in doc["llama_ops"], doc["llama_ops"]
    assert rows["fp32 plain"]["weight_cache_bytes"] == 0
    one, both = rows["FP8 plain"]["weight_cache_bytes"], rows["FP8 plain (both layouts)"]["weight_cache_bytes"]
    assert 0 < one and both == 2 * one  # one layout: half the bytes (data and scale alike, tensorwise)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert abs(doc["loss"]["FP8"] - doc["loss"]["fp32"]) < 0.05
    assert [t["target"] for t in doc["targets"]] == ["T18", "T19"]
    if "torchao" not in sys.modules and importlib.util.find_spec("torchao") is None:
        assert "torchao not importable" in doc["torchao"]
