"""A/B of two engine trees: GPT-A, LLAMA-1B, SMALL and MOE step times, one process per tree and round, alternating.

For checking that an engine change does not slow steps down: the same workloads run under the
package ``offload`` of this tree and of another tree's copy under ``--base`` (default
``.bench_base``: ``git archive <commit> offload | tar -x -C .bench_base``, with this tree's
built ``_C`` extension copied into ``.bench_base/offload``). The two cannot share a process:
pybind11 refuses to register the extension's types twice, so the second tree would silently run
without its native extension; each worker process imports one, the base through PYTHONPATH. Rounds alternate base, new, new, base, ...
so that the host's drift (tens of percent within minutes on our VM) falls on both alike; the
ratio quoted is new/base of the medians over all rounds.

Contenders per workload: plain, the TransformerEngine call shape (``get_cpu_offload_context``)
and ``OffloadActivations(layers)``, each at the counts given; on LLAMA-1B (HF's model, needs
transformers) plain and ``OffloadActivations(model.model.layers, num_offload_layers=8)``.

``DIRECT-SMALL`` and ``DIRECT-MOE`` time the engine's own calls instead (``engine_parts``, the
direct loop of ``host_parts.py``, SMALL's and MOE's shapes): microseconds per tensor (pack,
unpack) and per group (entry + exit + release + reach). On our VM hosts whole steps drift by tens
of percent between rounds while this loop moves by about 2%, so it is the figure that can tell a
host-cost change apart; it also runs without a GPU (on the CPU transport), for an A/B on any box.

Usage: ``python benchmarks/ab_engine.py [--base .bench_base] [--rounds 3] [--steps 15]
[--workloads GPT-A,LLAMA-1B,SMALL,MOE,DIRECT-SMALL,DIRECT-MOE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import gpt_a, llama_1b, llama_step, moe, small  # noqa: E402


def time_ms(step: Callable[[], None], warmup: int, steps: int) -> tuple[float, float]:
    """(median GPU ms per step, median host ms per step)."""
    import time

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def make_steps(pkg: Any, layers: torch.nn.ModuleList, x: torch.Tensor, counts: list[int]) -> dict[str, Callable[[], None]]:
    """name -> one training step (forward, backward with a fixed gradient, grads dropped)."""
    from offload.models import run_layers  # the model code is the same in both trees

    dy = torch.randn_like(x)
    params = list(layers.parameters())

    def step_with(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def step() -> None:
            forward().backward(dy)
            for p in params:
                p.grad = None
        return step

    steps = {"plain": step_with(lambda: run_layers(layers, x))}
    n = len(layers)
    for k in counts:
        ctx, sync = pkg.get_cpu_offload_context(True, k, n)
        steps[f"te k={k}"] = step_with(lambda ctx=ctx, sync=sync: run_layers(layers, x, ctx, sync))
        oa = pkg.OffloadActivations(layers, num_offload_layers=k)

        def oa_forward(oa: Any = oa) -> torch.Tensor:
            with oa:
                return run_layers(layers, x)

        steps[f"layers k={k}"] = step_with(oa_forward)
    return steps


def direct_parts(workload: str, reps: int) -> dict[str, tuple[float, float]]:
    """The engine's own calls on SMALL's or MOE's shape (``engine_parts.measure_parts``), in us:
    ``{part: (us, us)}``, the pair in the shape of :func:`time_ms`'s."""
    import engine_parts
    from common import Env

    cuda = torch.cuda.is_available()
    env = Env(device=torch.device("cuda" if cuda else "cpu"), smoke=False,
              offload_device=None if cuda else "cpu", args=argparse.Namespace())
    if workload == "DIRECT-SMALL":
        spec = small()
        shape = engine_parts.PartsShape("SMALL shape", spec.layers, spec.layers - 1, 2, spec.tokens * spec.width * 2)
    else:
        spec = moe()
        shape = engine_parts.PartsShape("MOE shape", spec.layers, spec.layers - 1, 300, spec.expert_tokens * spec.ffn * 2)
    row = engine_parts.measure_parts(env, shape, reps=reps, warmup=max(3, reps // 10), options={"min_offload_bytes": 0})
    keys = {"pack us/t": "pack_us_t", "unpack us/t": "unpack_us_t", "release us/g": "release_us_g",
            "exit us/g": "exit_us_g", "all us/t": "total_us_t", "entry+exit+release+reach us/g": "per_group_us"}
    return {label: (row[key], row[key]) for label, key in keys.items()}


def worker(tree: str, workload: str, steps: int) -> None:
    """Time every variant of one workload under one tree's package; print one JSON line."""
    import offload as pkg

    where = Path(pkg.__file__).resolve().parent.parent
    assert tree == "new" or where == Path(tree).resolve(), f"imported offload from {where}, not {tree}"
    assert pkg.native_available(), f"{where}: the native extension is not live"
    if workload.startswith("DIRECT-"):
        print(json.dumps(direct_parts(workload, reps=steps * 4)))
        return
    if workload == "LLAMA-1B":
        model, ids = llama_1b().build(torch.device("cuda"))
        oa = pkg.OffloadActivations(model.model.layers, num_offload_layers=8)
        variants = {"plain": llama_step(model, ids), "layers k=8": llama_step(model, ids, lambda: oa)}
        print(json.dumps({name: time_ms(step, 3, steps) for name, step in variants.items()}))
        return
    spec, counts, n = {"GPT-A": (gpt_a(), [2, 7], steps), "SMALL": (small(), [15], steps * 8),
                       "MOE": (moe(), [7], steps * 2)}[workload]
    layers, make_input = spec.build("cuda")
    x = make_input().requires_grad_(True)
    out = {name: time_ms(step, 3, n) for name, step in make_steps(pkg, layers, x, counts).items()}
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=".bench_base", help="folder holding the other tree's offload package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="timed GPT-A steps a round (SMALL: 8x)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--workloads", default="GPT-A,LLAMA-1B,SMALL,MOE", help="comma-separated")
    parser.add_argument("--worker", nargs=2, metavar=("TREE", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.steps)
        return
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for workload in args.workloads.split(","):
        for r in range(args.rounds):
            order = ("new", "base") if r % 2 else ("base", "new")
            for name in order:
                env = dict(os.environ)
                tree = "new"
                if name == "base":
                    tree = str(Path(args.base).resolve())
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
                done = subprocess.run(
                    [sys.executable, __file__, "--worker", tree, workload, "--steps", str(args.steps)],
                    check=True, capture_output=True, text=True, env=env,
                )
                for variant, timing in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    results.setdefault(f"{workload} {variant}", {}).setdefault(name, []).append(timing)
                    # Progress, so that a run cut short still says what it measured.
                    unit = "" if workload.startswith("DIRECT-") else " ms"
                    print(f"round {r + 1} {name:4s} {workload} {variant}: {timing[0]:.2f}{unit}", flush=True)
    rows = []
    print(f"{'workload (ms; DIRECT-: us)':44s} {'base':>9s} {'new':>9s} {'new/base':>9s} {'host new/base':>14s} {'min new/base':>13s}")
    for key, by in results.items():
        base = statistics.median(g for g, _ in by["base"])
        new = statistics.median(g for g, _ in by["new"])
        base_host = statistics.median(h for _, h in by["base"])
        new_host = statistics.median(h for _, h in by["new"])
        # The fastest round too: on a noisy host the median of three rounds can move by 10%.
        best = min(g for g, _ in by["new"]) / min(g for g, _ in by["base"])
        rows.append({"workload": key, "base_ms": base, "new_ms": new, "ratio": new / base,
                     "host_ratio": new_host / base_host, "min_ratio": best, "rounds": by})
        print(f"{key:44s} {base:9.2f} {new:9.2f} {new / base:9.3f} {new_host / base_host:14.3f} {best:13.3f}")
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        Path(args.out).write_text(json.dumps({"device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
