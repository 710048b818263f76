"""The engine's CPU cost per offloaded tensor and per group (issue 12; target T5 of docs/benchmarks.md).

In the spirit of TransformerEngine's ``benchmark_linear_cpu_overhead``: host-bound workloads where
every microsecond the engine spends shows in the step.

Workloads (TransformerEngine's call shape, ``get_cpu_offload_context`` + sync function, all
layers but the last offloaded, ``min_offload_bytes=0``):

* SMALL: 16 x (Linear 1024->1024 + GELU), 256 tokens, bf16: 2 tensors of 512 KiB per group;
* MOE: 8 MoE layers of 64 expert MLPs on fixed token slices (``workloads.MoESpec``): ~257 small
  tensors per group.

1. End to end, one process, the contenders side by side (``common.run_variant``): per step the
   step time (CUDA events), host wall time of the Python call, and process CPU time
   (``time.process_time``: all threads, autograd's backward device thread included); the
   deltas offload minus plain per offloaded tensor and per offloaded group (counts from
   ``ctx.stats``: ``offloaded_tensors``, ``groups_offloaded``). Each delta charges *all* the
   engine's cost to that unit. Variants: plain, offload with the default options, and, where the
   engine takes ``timing=`` (issue 12), ``timing=False`` and ``timing=True``; on SMALL also
   ``save_on_cpu(pin_memory=True)``; plain again last (plain figures are the mean of both).
2. Per part, direct (``engine_parts.measure_parts``: the engine's own methods called by hand, no
   autograd, perf_counter): forward pack (per tensor), layer entry, layer exit (group close +
   layout + D2H submission), release; backward: the marker's reload submission
   (``on_backward_reach``), unpack (per tensor, the compute stream's wait and the typed view). Two
   shapes: SMALL's (16 layers, 15 offloaded, 2 x 512 KiB) and MOE's (8 layers, 7 offloaded, 300
   tensors of 64 KiB), with the same option variants.

Targets: T5a SMALL offload (default options) step <= 1.3x plain. T5b <= 5 us of CPU per offloaded
tensor (pack + unpack, direct) and <= 20 us per group (entry + exit + release + reach, direct),
judged on the SMALL shape with the default options (both threads' parts summed); the MOE shape's
figures and the end-to-end process-CPU deltas are printed next to it.

The script runs on the engine before issue 12 too (for before/after tables): options it lacks
are skipped, and the JSON's ``features`` says which were there.

Usage: ``python benchmarks/cpu_overhead.py [--steps N] [--moe-steps N] [--micro-reps N]``;
``--cpu-smoke`` for a tiny CPU check. Writes ``benchmarks/results/cpu_overhead.json``.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from typing import Any, Optional

import torch

import common
import engine_parts
import workloads

MOE_TENSORS_PER_GROUP = 300  # the direct MOE shape; a MOE workload layer saves 4 * 64 + 1 = 257
MIN_OFFLOAD_BYTES = 0        # every saved activation is offloaded, however small: the worst case
T5A_RATIO, T5B_TENSOR_US, T5B_GROUP_US = 1.3, 5.0, 20.0


def option_variants() -> list[tuple[str, dict[str, Any]]]:
    """(label, extra options) to measure: the defaults, and ``timing=`` both ways if taken."""
    variants: list[tuple[str, dict[str, Any]]] = [("default", {})]
    if engine_parts.supports_option("timing"):
        variants += [("timing=False", {"timing": False}), ("timing=True", {"timing": True})]
    return variants


def end_to_end(env: common.Env, spec: Any, steps: int, variants: list[tuple[str, dict[str, Any]]], *, save_on_cpu: bool) -> dict[str, Any]:
    """Time plain, the offload variants (and ``save_on_cpu``) on one workload; add the deltas."""
    print(f"\n{spec.describe()}", flush=True)
    layers, make_input = spec.build(env.device)
    x = make_input()
    k = spec.layers - 1
    rows = [common.run_variant(env, "plain", layers, x, steps=steps)]
    for label, extra in variants:
        options = {"num_layers": k, "min_offload_bytes": MIN_OFFLOAD_BYTES, **extra}
        row = common.run_variant(env, f"offload k={k} ({label})", layers, x, offload=options, steps=steps)
        row["options"] = label
        rows.append(row)
    if save_on_cpu:
        rows.append(common.run_variant(env, "save_on_cpu", layers, x, forward_wrapper=common.save_on_cpu_wrapper(), steps=steps))
    rows.append(common.run_variant(env, "plain (again)", layers, x, steps=steps))
    del layers, x
    common.free_memory(env)

    plains = [r for r in rows if r["variant"].startswith("plain") and "error" not in r]
    plain = {key: statistics.fmean(r[key] for r in plains) if plains else None for key in ("step_ms", "host_ms", "cpu_ms")}
    for r in rows:
        if "error" in r:
            continue
        r["ratio"] = r["step_ms"] / plain["step_ms"] if plain["step_ms"] else None
        stats = r.get("stats") or {}
        r["groups_offloaded"] = stats.get("groups_offloaded")
        for what in ("host", "cpu"):
            delta_us = None if plain[f"{what}_ms"] is None else (r[f"{what}_ms"] - plain[f"{what}_ms"]) * 1e3
            r[f"{what}_delta_us"] = delta_us
            for unit, count in (("t", r.get("offloaded_tensors")), ("g", r.get("groups_offloaded"))):
                r[f"{what}_us_{unit}"] = delta_us / count if delta_us is not None and count else None
    return {"workload": spec.describe(), "plain": plain, "rows": rows}


def direct(env: common.Env, shapes: list[engine_parts.PartsShape], variants: list[tuple[str, dict[str, Any]]], reps: int) -> list[dict[str, Any]]:
    """``engine_parts.measure_parts`` for every shape and option variant; a failure is a row."""
    out = []
    for shape in shapes:
        for label, extra in variants:
            try:
                row = engine_parts.measure_parts(env, shape, reps=reps, warmup=max(3, reps // 10),
                                                 options={"min_offload_bytes": MIN_OFFLOAD_BYTES, **extra})
            except Exception as exc:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                row = {"shape": shape.name, "error": f"{type(exc).__name__}: {exc}"}
                common.free_memory(env)
            row["variant"] = f"{shape.name} ({label})"
            row["options_label"] = label
            out.append(row)
            shown = "FAILED" if "error" in row else (
                f"{row['per_tensor_us']:.2f} us/tensor (pack + unpack), {row['per_group_us']:.2f} us/group")
            print(f"  {row['variant']:<34} {shown}", flush=True)
    return out


def find(rows: list[dict[str, Any]], variant: str) -> Optional[dict[str, Any]]:
    return next((r for r in rows if r.get("variant") == variant and "error" not in r), None)


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=20, steps=200, smoke_warmup=1, smoke_steps=3)
    parser.add_argument("--moe-steps", type=int, default=None, help="timed steps per MOE variant (default 50; --steps with --cpu-smoke)")
    parser.add_argument("--micro-reps", type=int, default=None, help="reps of the direct loop per shape and option (default 100; 3 smoke)")
    env = common.setup(parser, argv)
    args = env.args
    scale = workloads.scale_for(env.smoke)
    small, moe = workloads.small(scale), workloads.moe(scale)
    moe_steps = args.moe_steps or (args.steps if env.smoke else 50)
    micro_reps = args.micro_reps or (3 if env.smoke else 100)
    variants = option_variants()
    features = {
        "timing_option": engine_parts.supports_option("timing"),
        "options_measured": [label for label, _ in variants],
        "on_backward_reach": None,  # filled from the direct loop
    }
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; {args.warmup} warm-up + {args.steps} timed steps "
          f"per SMALL variant, {moe_steps} per MOE variant; option variants: {', '.join(features['options_measured'])}")
    if not features["timing_option"]:
        print("  note: this engine takes no timing= option; only its defaults are measured")

    e2e = {
        "SMALL": end_to_end(env, small, args.steps, variants, save_on_cpu=True),
        "MOE": end_to_end(env, moe, moe_steps, variants, save_on_cpu=False),
    }

    print("\ndirect engine parts (no autograd):", flush=True)
    shapes = [
        engine_parts.PartsShape("SMALL shape", small.layers, small.layers - 1, 2, small.tokens * small.width * 2),
        engine_parts.PartsShape("MOE shape", moe.layers, moe.layers - 1, MOE_TENSORS_PER_GROUP, moe.expert_tokens * moe.ffn * 2),
    ]
    micro = direct(env, shapes, variants, micro_reps)
    features["on_backward_reach"] = next((m["reach_available"] for m in micro if "error" not in m), None)

    # -- targets -----------------------------------------------------------------------------------
    k = small.layers - 1
    on_row = find(e2e["SMALL"]["rows"], f"offload k={k} (default)")
    plain_ms = e2e["SMALL"]["plain"]["step_ms"]
    t5a = None if on_row is None or on_row.get("ratio") is None else on_row["ratio"] <= T5A_RATIO
    lines = [
        f"T5a {common.verdict(t5a)}  SMALL offload k={k} (default) step {common.fmt(on_row and on_row['step_ms'], '.3f')} ms = "
        f"{common.fmt(on_row and on_row.get('ratio'), '.2f')}x plain {common.fmt(plain_ms, '.3f')} ms (need <= {T5A_RATIO}x)"
    ]
    targets: dict[str, Any] = {"T5a": {"ok": t5a, "ratio": on_row and on_row.get("ratio")}}
    for shape, workload in (("SMALL shape", "SMALL"), ("MOE shape", "MOE")):
        m = find(micro, f"{shape} (default)")
        row = find(e2e[workload]["rows"], f"offload k={(small if workload == 'SMALL' else moe).layers - 1} (default)")
        ok = None if m is None else (m["per_tensor_us"] <= T5B_TENSOR_US and m["per_group_us"] <= T5B_GROUP_US)
        tag = "T5b" if workload == "SMALL" else "   "
        lines.append(
            f"{tag} {common.verdict(ok)}  {shape}, direct, both threads: {common.fmt(m and m['per_tensor_us'], '.2f')} us per tensor "
            f"(pack + unpack; need <= {T5B_TENSOR_US:g}), {common.fmt(m and m['per_group_us'], '.2f')} us per group "
            f"(entry + exit + release + reach; need <= {T5B_GROUP_US:g})"
            + ("" if workload == "SMALL" else "  [MOE: not part of T5, shown for issue 12]")
        )
        lines.append(
            f"          end to end ({workload}, process CPU offload - plain): {common.fmt(row and row.get('cpu_us_t'), '.2f')} us "
            f"per offloaded tensor, or {common.fmt(row and row.get('cpu_us_g'), '.2f')} us per group "
            f"({common.fmt(row and row.get('offloaded_tensors'))} tensors in {common.fmt(row and row.get('groups_offloaded'))} "
            "groups a step; each figure charges all of the delta to its unit)"
        )
        targets["T5b" if workload == "SMALL" else "T5b_moe_shape"] = {
            "ok": ok,
            "direct_us_per_tensor": m and m["per_tensor_us"],
            "direct_us_per_group": m and m["per_group_us"],
            "end_to_end_cpu_us_per_tensor": row and row.get("cpu_us_t"),
            "end_to_end_cpu_us_per_group": row and row.get("cpu_us_g"),
            "end_to_end_host_us_per_tensor": row and row.get("host_us_t"),
        }

    failed = [r["variant"] for w in e2e.values() for r in w["rows"] if "error" in r] + [m["variant"] for m in micro if "error" in m]
    common.write_json("cpu_overhead", env, {
        "workloads": {name: w["workload"] for name, w in e2e.items()},
        "features": features,
        "min_offload_bytes": MIN_OFFLOAD_BYTES,
        "targets": targets,
        "end_to_end": e2e,
        "direct": micro,
        "failed": failed,
    })

    # -- tables ------------------------------------------------------------------------------------
    for name, w in e2e.items():
        for r in w["rows"]:
            if "error" in r:
                r["variant"] += " (FAILED)"
        common.print_table(f"{name} end to end, per step ({common.device_name(env)}); deltas are offload - plain", w["rows"], [
            ("variant", "variant", ""),
            ("step_ms", "step ms", ".3f"),
            ("ratio", "x plain", ".2f"),
            ("host_ms", "host ms", ".3f"),
            ("cpu_ms", "cpu ms", ".3f"),
            ("offloaded_tensors", "tensors", ""),
            ("groups_offloaded", "groups", ""),
            ("cpu_us_t", "cpu us/t", ".2f"),
            ("cpu_us_g", "cpu us/g", ".1f"),
            ("host_us_t", "host us/t", ".2f"),
            ("host_us_g", "host us/g", ".1f"),
        ])
    common.print_table("direct engine parts, us of host CPU (/t: per offloaded tensor, /g: per offloaded group)", micro, [
        ("variant", "shape (options)", ""),
        ("tensors_per_step", "tensors", ""),
        ("pack_us_t", "pack/t", ".2f"),
        ("unpack_us_t", "unpack/t", ".2f"),
        ("entry_us_g", "entry/g", ".2f"),
        ("exit_us_g", "exit/g", ".2f"),
        ("release_us_g", "release/g", ".2f"),
        ("reach_us_g", "reach/g", ".2f"),
        ("per_tensor_us", "sum/t", ".2f"),
        ("per_group_us", "sum/g", ".2f"),
        ("forward_us_step", "fwd us/step", ".1f"),
        ("backward_us_step", "bwd us/step", ".1f"),
        ("total_us_t", "all/t", ".2f"),
    ])
    print("\ntargets (measured in this run):")
    for line in lines:
        print("  " + line)
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
