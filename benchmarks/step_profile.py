"""Where one step's host time goes: ``torch.profiler``'s table of host calls, a sample of the
training thread's Python stack, and (optionally) the step's Chrome trace.

Why both: the profiler names the CUDA runtime call that waited (a ``cudaMalloc`` or a synchronise
behind a host-memory registration), the stack sample names the line of our code or the model's
that made it. The trace gives each kernel's launch and start, so how far the host ran ahead of
the GPU can be read off afterwards (``benchmarks/first_step.py`` explains why that lead decides
whether a registration stalls a step).
"""

from __future__ import annotations

import collections
import gzip
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

SAMPLE_S = 0.002  # the training thread's stack, every 2 ms
OUR_CODE = ("/offload/", "/transformers/", "/benchmarks/")


def _frame_key(frame: Any) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"


class StackSampler:
    """Samples one thread's Python stack from a daemon thread: per sample, the innermost frame
    and the innermost frame in our code or the model's (``OUR_CODE``). Torch's bindings release
    the GIL inside an op, so a thread blocked in the driver is still sampled, at its Python line."""

    def __init__(self, thread_id: int, interval_s: float = SAMPLE_S) -> None:
        self._thread_id = thread_id
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.innermost: collections.Counter[str] = collections.Counter()
        self.ours: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="step-stack-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            frame = sys._current_frames().get(self._thread_id)
            if frame is None:
                continue
            self.samples += 1
            self.innermost[_frame_key(frame)] += 1
            while frame is not None and not any(part in frame.f_code.co_filename for part in OUR_CODE):
                frame = frame.f_back
            if frame is not None:
                self.ours[_frame_key(frame)] += 1

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def top(self, count: int = 15) -> dict[str, list[dict[str, Any]]]:
        """The most sampled frames, each with its share of the samples and the time it stands for."""
        def rows(counter: collections.Counter[str]) -> list[dict[str, Any]]:
            return [{"frame": key, "share": n / max(1, self.samples), "ms": n * self._interval_s * 1e3}
                    for key, n in counter.most_common(count)]
        return {"innermost": rows(self.innermost), "ours": rows(self.ours)}


def profiled(step: Callable[[], Any], into: dict[str, Any], trace_path: Optional[Path] = None) -> Callable[[], Any]:
    """``step`` under ``torch.profiler`` and :class:`StackSampler`: the 20 host calls of longest
    own time go to ``into["profile"]``, the most sampled frames to ``into["stack"]``, and both are
    printed; ``trace_path``: the step's Chrome trace is also written there, gzipped."""
    def run() -> Any:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof, StackSampler(threading.get_ident()) as sampler:
            started = time.perf_counter()
            out = step()
            into["profiled_wall_ms"] = (time.perf_counter() - started) * 1e3
        table = prof.key_averages()
        top = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
        into["profile"] = [{"name": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1e3,
                            "host_ms": e.cpu_time_total / 1e3} for e in top]
        into["stack"] = sampler.top()
        print(table.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
        for kind, rows in into["stack"].items():
            print(f"  stack samples ({kind}, {sampler.samples} in all):", flush=True)
            for row in rows:
                print(f"    {row['share']:6.1%} {row['ms']:9.1f} ms  {row['frame']}", flush=True)
        if trace_path is not None:
            plain = trace_path.with_suffix("")
            prof.export_chrome_trace(str(plain))
            with open(plain, "rb") as src, gzip.open(trace_path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            plain.unlink()
            into["trace"] = str(trace_path)
        return out
    return run


class Profiling:
    """Which steps of a run to profile (``--profile-step K[,K]``) and where their traces go
    (``--trace-dir``, one file per step: ``<label>_step<K>.json.gz``)."""

    def __init__(self, steps: set[int], trace_dir: Optional[Path], label: str) -> None:
        self.steps = steps
        self.trace_dir = trace_dir
        self.label = label

    @classmethod
    def from_args(cls, args: Any, label: str) -> Optional["Profiling"]:
        """None when ``--profile-step`` names no step."""
        steps = {int(k) for k in str(getattr(args, "profile_step", "") or "").split(",") if k.strip() not in ("", "-1")}
        if not steps:
            return None
        trace_dir = Path(args.trace_dir) if getattr(args, "trace_dir", None) else None
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
        return cls(steps, trace_dir, label)

    def wrap(self, step: Callable[[], Any], index: int, into: dict[str, Any]) -> Callable[[], Any]:
        """``step`` itself, or (step ``index`` is named) :func:`profiled` around it."""
        if index not in self.steps:
            return step
        trace = self.trace_dir / f"{self.label}_step{index}.json.gz" if self.trace_dir is not None else None
        return profiled(step, into, trace)
