"""SMALL: the CPU-bound workload (target T5 of docs/benchmarks.md).

16 x (Linear 1024->1024 + GELU), 256 tokens, bf16: every kernel is tiny, so the step time is the
host's time to run Python and launch kernels, and any per-tensor CPU cost of offloading shows.

Variants, timed side by side in one process (a training step = forward in TransformerEngine's
call shape + backward + grads set to None):

* ``plain``,
* offload v2, ``num_layers=15``, default ``min_offload_bytes``, with the native extension, and
  again with ``OFFLOAD_NATIVE=0`` (``offload.host.native.reload_native_setting()`` and a fresh context),
* ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.

Per variant: step ms (CUDA events, median), ratio to plain, host ms per step (perf_counter around
the Python call, no synchronisation inside), process CPU ms per step (all threads: autograd runs
the CUDA backward on its own thread), and the tensors offloaded per step.

CPU cost per offloaded tensor, measured two ways:

1. end to end: (host ms of the offload step - host ms of the plain step) / tensors offloaded per
   step. This charges everything the engine adds to the step (hooks, layer entry/exit, schedule,
   events, copy submission, backward markers) to the offloaded tensors: an upper bound.
2. direct: the engine's own ``pack`` / layer boundary (entry, exit with group close, layout, D2H
   submission, releases) / ``unpack`` (the backward marker's reload submission, waits, typed views)
   called by hand in a loop on CUDA tensors, outside autograd, timed with perf_counter, per tensor
   (the loop of ``engine_parts.py``; ``cpu_overhead.py`` shows every part on its own). Two
   shapes: SMALL's (16 layers, 2 tensors of 512 KiB per offloaded layer) and one big group (64
   tensors in one layer).

T5: offload on <= 1.3 x plain step; hooks + submission <= 5 us of CPU per offloaded tensor
(judged on the direct measurement of the SMALL shape with the native extension; the end-to-end
figure is printed next to it).

Usage: ``python benchmarks/small.py [--steps N] [--warmup N]``; ``--cpu-smoke`` for a tiny CPU check.
Writes ``benchmarks/results/small.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

import common
import engine_parts
import workloads

MICRO_SHAPES = {
    # name: (model layers, offloaded layers, tensors per offloaded layer)
    "small-shape": (16, 15, 2),
    "one-group": (2, 1, 64),
}


def set_native(enabled: bool) -> tuple[bool, str]:
    """Turn the native extension on/off for contexts built from now on."""
    from offload.host import native

    os.environ["OFFLOAD_NATIVE"] = "1" if enabled else "0"
    native.reload_native_setting()
    return native.native_available(), native.native_reason()


def micro_pack_unpack(env: common.Env, shape: str, nbytes: int, *, reps: int, warmup: int) -> dict[str, Any]:
    """Host cost of the engine's per-tensor work, called by hand (no autograd in the loop).

    The loop of ``engine_parts.measure_parts`` (default options), its parts summed into three
    columns per offloaded tensor: pack; layer boundary (entry, exit with the group close, layout and
    D2H submission, releases); unpack (the backward marker's reload submission, waits, typed views).
    """
    model_layers, k, per_layer = MICRO_SHAPES[shape]
    parts = engine_parts.measure_parts(
        env, engine_parts.PartsShape(shape, model_layers, k, per_layer, nbytes), reps=reps, warmup=warmup,
    )
    per_tensor = lambda *names: sum(parts[f"{p}_us_t"] or 0.0 for p in names)  # noqa: E731
    res = {
        "shape": shape,
        "model_layers": model_layers,
        "num_layers": k,
        "tensors_per_layer": per_layer,
        "tensor_bytes": nbytes,
        "tensors_per_step": parts["tensors_per_step"],
        "offloaded_per_step": parts["offloaded_per_step"],
        "native": parts["native"],
        "pack_us": per_tensor("pack"),
        "boundary_us": per_tensor("entry", "exit", "release"),
        "unpack_us": per_tensor("reach", "unpack"),
        "parts": parts,
    }
    res["total_us"] = res["pack_us"] + res["boundary_us"] + res["unpack_us"]
    return res


def micro_keep_path(env: common.Env, *, calls: int = 2000) -> float:
    """Host cost (us) of ``pack`` on a tensor the policy keeps (below min_offload_bytes)."""
    ctx, _ = common.offload_context(env, 1, 2)
    t = torch.randn(16, device=env.device)
    ctx.__enter__()
    try:
        for _ in range(100):
            ctx.engine.pack(t)
        a = time.perf_counter()
        for _ in range(calls):
            ctx.engine.pack(t)
        b = time.perf_counter()
    finally:
        ctx.__exit__(None, None, None)
    return (b - a) / calls * 1e6


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=20, steps=200, smoke_warmup=2, smoke_steps=5)
    parser.add_argument("--micro-reps", type=int, default=None, help="reps of the direct pack/unpack loop (default 200; 5 smoke)")
    env = common.setup(parser, argv)
    args = env.args
    micro_reps = args.micro_reps or (5 if env.smoke else 200)

    spec = workloads.small(workloads.scale_for(env.smoke))
    print(spec.describe())
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; {args.warmup} warm-up + {args.steps} timed steps per variant")
    env_native = os.environ.get("OFFLOAD_NATIVE")

    layers, make_input = spec.build(env.device)
    x = make_input()
    k = spec.layers - 1
    rows: list[dict[str, Any]] = []
    micro: list[dict[str, Any]] = []
    natives: dict[str, Any] = {}
    try:
        print("variants:")
        rows.append(common.run_variant(env, "plain", layers, x))
        for on in (True, False):
            live, reason = set_native(on)
            tag = "native" if on else "OFFLOAD_NATIVE=0"
            natives[tag] = {"live": live, "reason": reason}
            if on and not live:
                print(f"  note: the native extension is not live ({reason}); 'native' rows use the Python path")
            row = common.run_variant(env, f"offload v2 k={k} ({tag})", layers, x, offload={"num_layers": k}, want_report=on)
            row["native_live"] = live
            rows.append(row)
        set_native(True)
        rows.append(common.run_variant(env, "save_on_cpu", layers, x, forward_wrapper=common.save_on_cpu_wrapper()))
        rows.append(common.run_variant(env, "plain (again)", layers, x))

        print("direct engine pack/boundary/unpack loop:")
        tensor_bytes = spec.tokens * spec.width * 2
        for on in (True, False):
            live, _ = set_native(on)
            for shape in MICRO_SHAPES:
                try:
                    m = micro_pack_unpack(env, shape, tensor_bytes, reps=micro_reps, warmup=max(3, micro_reps // 10))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    import traceback

                    traceback.print_exc()
                    m = {"shape": shape, "error": f"{type(exc).__name__}: {exc}"}
                m["variant"] = f"{shape} ({'native' if on else 'OFFLOAD_NATIVE=0'})"
                m["native_live"] = live
                micro.append(m)
                print(f"  {m['variant']:<34} " + ("FAILED" if "error" in m else f"{m['total_us']:.2f} us/tensor"), flush=True)
        set_native(True)
        keep_us = micro_keep_path(env)
    finally:
        if env_native is None:
            os.environ.pop("OFFLOAD_NATIVE", None)
        else:
            os.environ["OFFLOAD_NATIVE"] = env_native
        from offload.host import native

        native.reload_native_setting()

    plains = [r for r in rows if r["variant"].startswith("plain") and "error" not in r]
    plain_ms = statistics.fmean(r["step_ms"] for r in plains) if plains else None
    plain_host = statistics.fmean(r["host_ms"] for r in plains) if plains else None
    plain_cpu = statistics.fmean(r["cpu_ms"] for r in plains) if plains else None
    for r in rows:
        if "error" in r:
            continue
        r["ratio"] = r["step_ms"] / plain_ms if plain_ms else None
        n = r.get("offloaded_tensors")
        if n:
            r["host_us_per_tensor"] = (r["host_ms"] - plain_host) * 1e3 / n if plain_host is not None else None
            r["cpu_us_per_tensor"] = (r["cpu_ms"] - plain_cpu) * 1e3 / n if plain_cpu is not None else None

    # -- target T5 ------------------------------------------------------------------------------
    on_row = next((r for r in rows if "(native)" in r["variant"] and "error" not in r), None)
    micro_on = next((m for m in micro if m["variant"] == "small-shape (native)" and "error" not in m), None)
    lines = []
    t5a = None if on_row is None or on_row.get("ratio") is None else on_row["ratio"] <= 1.3
    lines.append(
        f"T5a {common.verdict(t5a)}  offload v2 k={k} step {common.fmt(on_row and on_row['step_ms'], '.2f')} ms = "
        f"{common.fmt(on_row and on_row.get('ratio'), '.2f')}x plain {common.fmt(plain_ms, '.2f')} ms (need <= 1.3x); "
        f"{common.fmt(on_row and on_row.get('offloaded_tensors'))} tensors offloaded per step"
    )
    t5b = None if micro_on is None else micro_on["total_us"] <= 5.0
    lines.append(
        f"T5b {common.verdict(t5b)}  hooks + submission, direct (SMALL shape, native): "
        f"{common.fmt(micro_on and micro_on['total_us'], '.2f')} us/tensor (need <= 5) = pack "
        f"{common.fmt(micro_on and micro_on['pack_us'], '.2f')} + layer boundary/submission "
        f"{common.fmt(micro_on and micro_on['boundary_us'], '.2f')} + unpack {common.fmt(micro_on and micro_on['unpack_us'], '.2f')}"
    )
    e2e = on_row.get("host_us_per_tensor") if on_row else None
    lines.append(
        f"     end to end: (host ms offload - plain) / tensors = {common.fmt(e2e, '.2f')} us/tensor of main-thread time, "
        f"{common.fmt(on_row and on_row.get('cpu_us_per_tensor'), '.2f')} us/tensor of process CPU time "
        f"[{common.verdict(None if e2e is None else e2e <= 5.0)} on this stricter reading]"
    )
    lines.append(f"     keep path (tensor below min_offload_bytes): {keep_us:.2f} us per pack call")
    targets = {
        "T5a": {"ok": t5a, "ratio": on_row and on_row.get("ratio")},
        "T5b": {"ok": t5b, "direct_us_per_tensor": micro_on and micro_on["total_us"], "end_to_end_host_us_per_tensor": e2e,
                "end_to_end_cpu_us_per_tensor": on_row and on_row.get("cpu_us_per_tensor")},
    }

    report = on_row.get("report") if on_row else None
    if report:
        print("\nstats report of the offload (native) run:")
        print(report)
    failed = [r["variant"] for r in rows if "error" in r] + [m["variant"] for m in micro if "error" in m]
    common.write_json("small", env, {
        "workload": spec.describe(),
        "natives": natives,
        "summary": {"plain_ms": plain_ms, "plain_host_ms": plain_host, "plain_cpu_ms": plain_cpu, "keep_path_us": keep_us},
        "targets": targets,
        "rows": rows,
        "micro": micro,
        "failed": failed,
    })

    print("\ntargets (measured in this run):")
    for line in lines:
        print("  " + line)
    for r in rows:
        if "error" in r:
            r["variant"] += " (FAILED)"
    common.print_table("direct engine cost per offloaded tensor (us, host)", micro, [
        ("variant", "loop", ""),
        ("tensors_per_step", "tensors", ""),
        ("pack_us", "pack", ".2f"),
        ("boundary_us", "boundary+submit", ".2f"),
        ("unpack_us", "unpack+reload", ".2f"),
        ("total_us", "total", ".2f"),
    ])
    common.print_table(f"{spec.name} ({common.device_name(env)})", rows, [
        ("variant", "variant", ""),
        ("step_ms", "step ms", ".3f"),
        ("step_min_ms", "min", ".3f"),
        ("step_max_ms", "max", ".3f"),
        ("ratio", "x plain", ".2f"),
        ("wall_ms", "wall ms", ".3f"),
        ("host_ms", "host ms", ".3f"),
        ("cpu_ms", "cpu ms", ".3f"),
        ("offloaded_tensors", "tensors", ""),
        ("host_us_per_tensor", "host us/t", ".2f"),
        ("cpu_us_per_tensor", "cpu us/t", ".2f"),
        ("d2h_gbps", "D2H GB/s", ".1f"),
        ("h2d_gbps", "H2D GB/s", ".1f"),
    ])
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
