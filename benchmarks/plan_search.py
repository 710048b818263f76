"""How long the plan search takes on deep models of identical layers (issue 50 s1, T14's "plan
search" share), on the CPU: no GPU, no model, the search alone.

The search (:func:`offload.planner.search.best_plan`) is pure Python and runs on the host at the
first planned step (and at each new length bucket), so its time is part of that step. Its input is
a :class:`~offload.planner.types.StepProfile`; here the profiles are synthetic but shaped like a
probe's: every layer is one LLAMA decoder layer as the probe recorded it on the CPU (19 saved
slots, its MLP as a selective candidate with 15), scaled to LLAMA-8B's shape at 16384 tokens
(about 2.9 GiB saved a layer, 16 ms forward, 26 ms backward, a 50 GB/s link: copies take longer
than compute, so the best plans mix keep, offload and recompute), with a 16 GiB base and an
8 GiB head. :func:`cases` lists the budgets (fractions of the way from all-recompute's peak to
the plain peak) and depths timed; the CPU test of the search's quality
(``tests/test_plan_search_cpu.py``) plans the same cases.

    python benchmarks/plan_search.py                  # 32, 64 and 128 layers, ~10 s
    python benchmarks/plan_search.py --layers 32 --repeat 5
    python benchmarks/plan_search.py --contention      # a background search beside a busy step

``--contention``: what searches in the background (a new bucket's own plan, made while a stand-in
step runs) cost a host-bound step on the main thread: two step stand-ins of about 150 ms alone,
pure Python and torch ops (a training step's threads give the interpreter away in every op), each
timed alone and beside 32-layer searches on a thread, on a thread giving way
(:class:`offload.planner.ahead.Yielding`), and in their own process
(:mod:`offload.planner.search_process`) (``plan_search_contention.json``).

Prints one row per case (seconds per search, the plan's predicted step) and writes
``benchmarks/results/plan_search.json`` (``--out``). Target: <= 0.2 s for 32 layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

try:
    import offload  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from offload.planner.model import simulate  # noqa: E402
from offload.planner.search import best_plan  # noqa: E402
from offload.planner.types import Action, LayerPlan, LayerProfile, LinkProfile, SelectiveProfile, StepProfile  # noqa: E402

TARGET_S = 0.2  # for 32 layers
GiB = 1 << 30

# One LLAMA decoder layer (hidden 128, MLP 448, 4 heads, 2 KV heads, 512 tokens, fp32) as
# offload.planner.profile_step recorded it on the CPU: its saved slots in order (the last four
# are the MLP's), and with the MLP run selectively (its insides give way to its input).
_SLOTS = (262144, 2048, 262144, 262144, 65536, 65536, 131072, 262144, 131072, 8192, 262144, 262144, 2048,
          262144, 262144, 917504, 917504, 917504, 917504)
_SELECTIVE_SLOTS = _SLOTS[:15]
_INPUT = 266240
_CACHED = 2097152     # the selective MLP's kept GEMM outputs
_FORWARD_MS, _BACKWARD_MS, _EXTRA_MS, _SEL_FORWARD_MS = 6.29, 10.23, 0.88, 2.50
_SCALE = 512          # bytes: 512 tokens of width 128 in fp32 -> 16384 of width 4096 in bf16
_TIME = 2.5           # times: about LLAMA-8B's layer at 16384 tokens on an H100


def layer(scale: float = 1.0, selective: bool = True, ms: Optional[float] = None) -> LayerProfile:
    """One decoder layer at LLAMA-8B's shape at 16384 tokens, its bytes times ``scale`` and its
    times times ``ms`` (default ``scale``)."""
    k, ms = int(_SCALE * scale), scale if ms is None else ms
    slots = tuple(s * k for s in _SLOTS)
    sel = SelectiveProfile(tuple(s * k for s in _SELECTIVE_SLOTS), _CACHED * k, _EXTRA_MS * _TIME,
                           slot_keys=tuple(s * k for s in _SELECTIVE_SLOTS), forward_ms=_SEL_FORWARD_MS * _TIME)
    saved = sum(slots)
    return LayerProfile(slots, _INPUT * k, _FORWARD_MS * _TIME * ms, _BACKWARD_MS * _TIME * ms,
                        f"llama-like:{k}", forward_peak_bytes=saved // 2, backward_peak_bytes=saved // 3,
                        selective=sel if selective else None, slot_keys=slots)


def profile(layers: list[LayerProfile], gbps: float = 50.0) -> StepProfile:
    """A step of these layers, with LLAMA-8B's base and head and a link of ``gbps`` each way (an
    H100's: 50)."""
    saved = sum(l.saved_bytes for l in layers)
    return StepProfile(tuple(layers), LinkProfile(gbps, gbps, 1.7 * gbps), 16 * GiB, 8 * GiB, 4.1, 60.0, 1.2,
                       sum(l.forward_ms + l.backward_ms for l in layers) + 65.3, 24 * GiB + saved, "cuda",
                       shape=(1, 16384))


def between(p: StepProfile, fraction: float) -> int:
    """The budget ``fraction`` of the way from all-recompute's lowest peak to the plain peak."""
    n = len(p.layers)
    low = simulate(p, [LayerPlan(Action.RECOMPUTE)] * n, 1).peak_bytes
    high = simulate(p, [LayerPlan(Action.KEEP)] * n, None).peak_bytes
    return int(low + (high - low) * fraction)


def cases(depths: tuple[int, ...] = (32,)) -> list[dict[str, Any]]:
    """The searches timed (and, in the CPU test, checked): name, profile, budget, host budget."""
    out = []
    for n in depths:
        p = profile([layer()] * n)
        for fraction in (0.15, 0.3, 0.5, 0.7, 0.9):
            out.append({"name": f"{n} layers, budget {fraction:.2f}", "profile": p, "budget": between(p, fraction)})
        if n != 32:
            continue
        most = simulate(p, [LayerPlan(Action.OFFLOAD)] * n, None).d2h_bytes
        out.append({"name": "32 layers, budget 0.50, host 15%", "profile": p, "budget": between(p, 0.5),
                    "host": int(0.15 * most)})
        plain = profile([layer(selective=False)] * n)
        out.append({"name": "32 layers, no selective, budget 0.40", "profile": plain, "budget": between(plain, 0.4)})
        mixed = profile([layer(1.0 if i % 3 else 1.6) for i in range(24)])
        out.append({"name": "24 mixed layers, budget 0.50", "profile": mixed, "budget": between(mixed, 0.5)})
        for gbps in (25.0, 100.0):  # a slower link (copies cost more), a faster one (offload wins more)
            linked = profile([layer()] * n, gbps)
            for fraction in (0.3, 0.6):
                out.append({"name": f"32 layers, {gbps:.0f} GB/s, budget {fraction:.2f}", "profile": linked,
                            "budget": between(linked, fraction)})
        dense = profile([layer(0.5, ms=1.0)] * n)  # half the bytes for the same compute: a shorter sequence
        out.append({"name": "32 layers, half the bytes, budget 0.30", "profile": dense, "budget": between(dense, 0.3)})
    return out


def run(case: dict[str, Any], repeat: int) -> dict[str, Any]:
    """Time ``repeat`` searches of one case: the median wall and CPU seconds (the search is one
    Python thread: on an idle host the two agree, on a shared one the CPU time is the search's
    own), and the plan."""
    times, cpu, plan = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = best_plan(case["profile"], case["budget"], host_budget=case.get("host"))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    assert plan is not None
    return {"name": case["name"], "layers": len(case["profile"].layers), "seconds": statistics.median(times),
            "cpu_seconds": statistics.median(cpu),
            "step_ms": plan.prediction.step_ms, "peak_bytes": plan.prediction.peak_bytes,
            "budget_bytes": case["budget"], "plan": plan.describe()}


def _python_step(units: int) -> float:
    """A host-bound step's stand-in in pure Python: ``units`` slices of work; its wall seconds."""
    start = time.perf_counter()
    for _ in range(units):
        total = 0
        for i in range(2000):
            total += i * i
    return time.perf_counter() - start


def _ops_step(units: int) -> float:
    """A step's stand-in that dispatches torch ops, as a training step's threads do (each op gives
    the interpreter away while it runs): ``units`` x 50 small CPU ops; its wall seconds."""
    import torch

    x = torch.zeros(64, 64)
    start = time.perf_counter()
    for _ in range(units * 50):
        x = torch.add(x, 1.0)
    return time.perf_counter() - start


def contention(repeat: int) -> dict[str, Any]:
    """Each step stand-in's time alone and beside background searches (medians of ``repeat``):
    on a thread, on a thread giving way (:class:`offload.planner.ahead.Yielding`), and in the
    searches' own process (:class:`offload.planner.search_process.SearchProcess`)."""
    import threading

    import torch

    from offload.planner.ahead import Yielding
    from offload.planner.search_process import SearchProcess

    torch.set_num_threads(1)
    case = cases((32,))[2]  # 32 layers, budget 0.50
    child = SearchProcess()
    child.make(time.time)  # started (its imports are not timed)
    searches = {"thread": lambda: best_plan(case["profile"], case["budget"]),
                "yielding_thread": lambda: best_plan(case["profile"], case["budget"], pause=Yielding()),
                "process": lambda: child.make(best_plan, case["profile"], case["budget"])}
    out: dict[str, Any] = {"case": case["name"]}
    for kind, step in (("python", _python_step), ("ops", _ops_step)):
        units = max(1, int(0.15 / max(step(20) / 20, 1e-6)))  # about 150 ms alone
        out[f"{kind}_alone_s"] = statistics.median(step(units) for _ in range(repeat))
        for where, search in searches.items():
            done = threading.Event()

            def background() -> None:
                while not done.is_set():
                    search()

            worker = threading.Thread(target=background)
            worker.start()
            out[f"{kind}_beside_{where}_s"] = statistics.median(step(units) for _ in range(repeat))
            done.set()
            worker.join()
    child.close()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="32,64,128", help="depths, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="searches per case (the median is reported)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "plan_search.json"))
    parser.add_argument("--contention", action="store_true", help="time a busy step beside a background search")
    args = parser.parse_args(argv)
    if args.contention:
        row = contention(args.repeat)
        for kind in ("python", "ops"):
            alone = row[f"{kind}_alone_s"]
            print(f"{kind} step alone {alone:.3f} s; beside searches on a thread "
                  + ", giving way ".join(f"{row[f'{kind}_beside_{w}_s']:.3f} s" for w in ("thread", "yielding_thread"))
                  + f"; beside searches in their own process {row[f'{kind}_beside_process_s']:.3f} s", flush=True)
        out = Path(args.out).with_name("plan_search_contention.json")
        out.write_text(json.dumps({"host": platform.processor() or platform.machine(),
                                   "python": platform.python_version(), **row}, indent=1))
        return 0
    depths = tuple(int(d) for d in args.layers.split(","))
    rows = []
    for case in cases(depths):
        row = run(case, args.repeat)
        rows.append(row)
        print(f"{row['name']:<40} {row['seconds']:6.3f} s ({row['cpu_seconds']:.3f} s CPU)  step {row['step_ms']:8.2f} ms  "
              f"{row['plan']}", flush=True)
    at32 = [r["cpu_seconds"] for r in rows if r["layers"] == 32]
    ok = bool(at32) and max(at32) <= TARGET_S
    verdict = f"32 layers: at most {max(at32):.3f} s of CPU a search (target <= {TARGET_S} s): {'met' if ok else 'MISSED'}" \
        if at32 else "32 layers not run"
    print(verdict)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"host": platform.processor() or platform.machine(),
                                          "python": platform.python_version(), "rows": rows, "verdict": verdict},
                                         indent=1))
    return 0 if ok or not at32 else 1


if __name__ == "__main__":
    sys.exit(main())
