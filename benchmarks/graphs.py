"""CUDA graphs with offloading (target T7 of docs/benchmarks.md): eager steps against graph replays.

Workloads: SMALL (offload v2, num_layers=15 of 16: host-bound, where graphs pay off) and GPT-A
(num_layers=2 of 8, T1's setting: GPU-bound). Variants, in one process:

* ``eager plain`` / ``eager offload``: a training step run eagerly (forward in TransformerEngine's
  call shape, backward, grads set to None), as in the other benchmarks;
* ``replay plain`` / ``replay offload``: the same step captured once in a ``torch.cuda.graph``
  (after two eager steps on a side stream, which also warm the offload arena) and replayed. A
  timed replay step copies a fresh input into the static input and replays the graph.

Per variant: step ms (CUDA events, median), host CPU ms per step (``time.process_time``: all the
process's threads, no synchronisation inside the step), wall ms per step. For the offload
variants: what a step offloads (a captured step's figures are those of every replay).

T7: on SMALL, replay-with-offload CPU time per step <= 0.2 x eager-with-offload. Bitwise equality
of replays with eager is checked by the tests (tests/test_graphs_gpu.py), not here.

Usage: ``python benchmarks/graphs.py [--steps N] [--warmup N] [--only small|gpt_a]``;
``--cpu-smoke`` runs the eager variants only (graphs need CUDA). Writes
``benchmarks/results/graphs.json``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

import common
import measure
import workloads

OFFLOADED = {"small": 15, "gpt_a": 2}


def replay_variant(env: common.Env, label: str, layers: torch.nn.ModuleList, x: torch.Tensor, offload: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Capture one training step (with the offload context inside, if any) and time its replays."""
    import traceback

    row: dict[str, Any] = {"variant": label}
    ctx = sync = graph = None
    t0 = time.perf_counter()
    try:
        if offload is not None:
            kw = dict(offload)
            row["num_layers"] = kw["num_layers"]
            ctx, sync = measure.offload_context(env, kw.pop("num_layers"), len(layers), retain_pinned_cpu_buffers=True, **kw)
        step = measure.make_step(layers, x, context=ctx, sync=sync)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        c0 = time.perf_counter()
        with torch.cuda.graph(graph):
            step()
        row["capture_s"] = time.perf_counter() - c0
        fresh = x.detach().clone()
        captured = graph

        def replay() -> None:
            with torch.no_grad():
                x.copy_(fresh)
            captured.replay()

        timing = measure.time_steps(replay, env)
        s = timing.summary()
        row.update(step_ms=timing.median_ms, host_ms=s["host_ms"]["median"], cpu_ms=s["cpu_ms"]["median"],
                   wall_ms=s["wall_ms_per_step"], timing=s)
        if ctx is not None:
            stats = measure.offload_stats(ctx)
            row.update(stats=stats, offloaded_bytes=stats["offloaded_bytes"], offloaded_tensors=stats["offloaded_tensors"],
                       captured=stats["captured"], graph_owned_blocks=ctx.engine.arena.counters.graph_owned_blocks)
    except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        del ctx, sync, graph
        x.grad = None
        for p in layers.parameters():
            p.grad = None
        common.free_memory(env)
    shown = "FAILED" if "error" in row else f"{row['step_ms']:.2f} ms/step, {row['cpu_ms']:.3f} CPU ms/step"
    print(f"  {label:<28} {shown}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return row


def run_workload(env: common.Env, name: str) -> dict[str, Any]:
    spec = workloads.WORKLOADS[name](workloads.scale_for(env.smoke))
    print(spec.describe())
    layers, make_input = spec.build(env.device)
    x = make_input()
    k = min(OFFLOADED[name], len(layers) - 1)
    offload = {"num_layers": k}
    rows = [
        measure.run_variant(env, "eager plain", layers, x),
        measure.run_variant(env, f"eager offload k={k}", layers, x, offload={**offload, "retain_pinned_cpu_buffers": True}),
    ]
    if env.cuda:
        rows.append(replay_variant(env, "replay plain", layers, x, None))
        rows.append(replay_variant(env, f"replay offload k={k}", layers, x, offload))
    by = {r["variant"].split(" k=")[0]: r for r in rows if "error" not in r}
    summary: dict[str, Any] = {"workload": spec.describe(), "num_layers": k}
    eager, replay = by.get("eager offload"), by.get("replay offload")
    if eager and replay:
        summary["cpu_ratio_replay_vs_eager"] = replay["cpu_ms"] / eager["cpu_ms"]
        summary["step_ratio_replay_vs_eager"] = replay["step_ms"] / eager["step_ms"]
    if by.get("eager plain") and replay:
        summary["replay_offload_vs_eager_plain"] = replay["step_ms"] / by["eager plain"]["step_ms"]
    if by.get("replay plain") and replay:
        summary["replay_offload_vs_replay_plain"] = replay["step_ms"] / by["replay plain"]["step_ms"]
    common.print_table(
        f"{spec.name}: eager vs CUDA-graph replay",
        rows,
        [("variant", "variant", ""), ("step_ms", "step ms", ".3f"), ("cpu_ms", "CPU ms/step", ".3f"),
         ("host_ms", "host ms", ".3f"), ("wall_ms", "wall ms", ".3f"), ("offloaded_tensors", "tensors off", "")],
    )
    del layers, x
    common.free_memory(env)
    return {"summary": summary, "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=10, steps=50, smoke_warmup=1, smoke_steps=2)
    parser.add_argument("--only", choices=sorted(OFFLOADED), default=None, help="run one workload")
    env = common.setup(parser, argv)
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; {env.args.warmup} warm-up + {env.args.steps} timed steps per variant")
    if not env.cuda:
        print("note: graph replays need CUDA; the smoke run times the eager variants only")
    results = {name: run_workload(env, name) for name in OFFLOADED if env.args.only in (None, name)}
    small = results.get("small", {}).get("summary", {})
    ratio = small.get("cpu_ratio_replay_vs_eager")
    t7 = None if ratio is None else ratio <= 0.2
    line = f"T7 {common.verdict(t7)}  SMALL replay CPU time per step = {common.fmt(ratio, '.3f')} x eager with offload (need <= 0.2)"
    print()
    print(line)
    for name, res in results.items():
        s = res["summary"]
        print(f"  {name}: replay/eager step {common.fmt(s.get('step_ratio_replay_vs_eager'), '.3f')}x, "
              f"CPU {common.fmt(s.get('cpu_ratio_replay_vs_eager'), '.3f')}x; replay offload vs replay plain "
              f"{common.fmt(s.get('replay_offload_vs_replay_plain'), '.3f')}x")
    common.write_json("graphs", env, {"workloads": results, "targets": {"T7": {"pass": t7, "cpu_ratio": ratio, "line": line}}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
