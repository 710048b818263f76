"""benchmarks/host_profile.py on the CPU (``--cpu-smoke``): it profiles offloaded steps and names
the engine's functions with their calls per step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_profile_smoke_counts_the_engines_calls_per_group() -> None:
    # The Python hooks, whose calls the profile counts (the native ones, on request, have none).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OFFLOAD_NATIVE_HOOKS": "0"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_profile.py"), "--cpu-smoke", "--steps", "5",
                           "--top", "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    head = re.search(r"(\d+) groups and (\d+) tensors offloaded a step; .* run (\d+) calls a step \((\d+) a group\)",
                     done.stdout)
    assert head is not None, done.stdout[:2000]
    groups, tensors, calls, per_group = map(int, head.groups())
    assert (groups, tensors) == (1, 29) and calls > 0  # the 15 small layers share one group and abs(per_group - calls / groups) <= 1
    # The engine's own hooks are among the functions listed, with one pack per saved tensor.
    assert re.search(r"\s45\.0\s+engine/packing\.py:\d+ pack\b", done.stdout), done.stdout


def test_the_engines_functions_are_told_by_the_packages_directory_in_a_clone_named_offload(tmp_path: Path) -> None:
    # `git clone` names the checkout "offload": its package is then .../offload/offload/, and
    # the benchmarks' own files are under an "/offload/" too (issue 48).
    from _bench_util import bench_module

    host_profile = bench_module("host_profile")
    package = tmp_path / "offload" / "offload"
    (package / "engine").mkdir(parents=True)
    (tmp_path / "offload" / "benchmarks").mkdir()
    assert host_profile.package_path(str(package / "engine" / "packing.py"), package) == "engine/packing.py"
    assert host_profile.package_path(str(package / "__init__.py"), package) == "__init__.py"
    assert host_profile.package_path(str(tmp_path / "offload" / "benchmarks" / "host_profile.py"), package) is None
    assert host_profile.package_path(str(tmp_path / "offload" / "offload.py"), package) is None
