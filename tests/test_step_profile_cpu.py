"""benchmarks/step_profile.py on the CPU: which steps are profiled, what a profiled step records
(the host calls, the training thread's sampled lines, the gzipped trace), and the stack sampler
naming the line a thread waits on."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from _bench_util import bench_module

step_profile = bench_module("step_profile")


def _waits_here() -> None:
    time.sleep(0.2)  # releases the GIL, as a driver call inside a torch op does


def test_the_sampler_names_the_line_the_thread_waits_on() -> None:
    with step_profile.StackSampler(threading.get_ident(), interval_s=0.002) as sampler:
        _waits_here()
    top = sampler.top(3)
    assert sampler.samples > 20
    assert "_waits_here" in top["innermost"][0]["frame"] and top["innermost"][0]["share"] > 0.5


def test_only_the_named_steps_are_profiled_and_their_traces_kept(tmp_path: Path) -> None:
    assert step_profile.Profiling.from_args(SimpleNamespace(profile_step="", trace_dir=None), "x") is None
    assert step_profile.Profiling.from_args(SimpleNamespace(profile_step="-1", trace_dir=None), "x") is None
    profiling = step_profile.Profiling.from_args(SimpleNamespace(profile_step="1,3", trace_dir=str(tmp_path / "t")), "case")
    assert profiling.steps == {1, 3}

    def step() -> torch.Tensor:
        a = torch.randn(64, 64, requires_grad=True)
        (a @ a).sum().backward()
        return a.grad

    into: dict = {}
    assert profiling.wrap(step, 0, into) is step
    out = profiling.wrap(step, 1, into)()
    assert out.shape == (64, 64)
    assert into["profile"] and all({"name", "calls", "self_host_ms"} <= set(row) for row in into["profile"])
    assert set(into["stack"]) == {"innermost", "ours"}
    trace = tmp_path / "t" / "case_step1.json.gz"
    assert into["trace"] == str(trace)
    with gzip.open(trace) as f:
        assert "traceEvents" in json.load(f)
