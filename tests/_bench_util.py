"""Helpers of the benchmark scripts' CPU tests: import a script as a module, run one's CPU smoke."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """A benchmark script imported as a module, as the scripts import their helpers (by name,
    from benchmarks/)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def run_smoke(script: str, name: str, *args: str) -> dict[str, Any]:
    """``benchmarks/<script> --cpu-smoke --name <name> *args`` in a process of its own (it spawns
    its workers); its JSON, removed after reading."""
    out = BENCH / "results" / "smoke" / f"{name}.json"
    # One thread: the tiny GEMMs gain nothing from more, and a shared CI box is oversubscribed.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, str(BENCH / script), "--cpu-smoke", "--name", name, *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{script} --cpu-smoke failed:\n{done.stdout[-6000:]}\n{done.stderr[-4000:]}"
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
