"""GPT-A with the v1 and v2 schedules at the same num_layers (issue 4).

One process, one model (GPT-A: 8 x GPTBlock, hidden 4096, 32 heads, batch 2, seq 4096, bf16).
Variants: ``plain``, then for each ``num_layers`` (default 4 and 7) offload with ``mode="v1"`` and
``mode="v2"``, both with ``selection="auto"`` so that they move the same tensors (v1 alone would
default to opt-in selection, which offloads nothing in an unmarked model), then ``plain`` again.

Per variant: step ms (CUDA events, median), ratio to plain, peak GiB and its drop vs plain, GiB
offloaded, achieved GB/s each way, compute-stream wait ms; and per num_layers the v1/v2 step ratio.
The v2 schedule starts every layer's D2H at once and releases as late as the memory bound allows;
v1 keeps one group in flight and releases at window layers, so it is expected to stall more.

Usage: ``python benchmarks/v1_vs_v2.py [--layers 4,7] [--steps N]``; ``--cpu-smoke`` for a tiny
CPU check. Writes ``benchmarks/results/v1_vs_v2.json``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Optional

import torch

import common
import workloads


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=3, steps=8)
    parser.add_argument("--layers", default="4,7", help="comma-separated num_layers (default 4,7)")
    env = common.setup(parser, argv)
    args = env.args

    spec = workloads.gpt_a(workloads.scale_for(env.smoke))
    sweep = sorted({int(v) for v in args.layers.split(",") if v.strip()})
    bad = [v for v in sweep if not 1 <= v <= spec.layers - 1]
    if bad:
        parser.error(f"--layers: {bad} out of range 1..{spec.layers - 1}")
    print(spec.describe())
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; selection auto; "
          f"{args.warmup} warm-up + {args.steps} timed steps per variant")

    layers, make_input = spec.build(env.device)
    x = make_input()
    print("variants:")
    rows: list[dict[str, Any]] = [common.run_variant(env, "plain", layers, x)]
    for k in sweep:
        for mode in ("v1", "v2"):
            row = common.run_variant(env, f"{mode} k={k}", layers, x, offload={"num_layers": k, "mode": mode, "selection": "auto"})
            row["mode"] = mode
            rows.append(row)
    rows.append(common.run_variant(env, "plain (again)", layers, x))

    plains = [r for r in rows if r["variant"].startswith("plain") and "error" not in r]
    plain_ms = statistics.fmean(r["step_ms"] for r in plains) if plains else None
    plain_peak = plains[0].get("peak_bytes") if plains else None
    for r in rows:
        if "error" in r:
            continue
        r["ratio"] = r["step_ms"] / plain_ms if plain_ms else None
        if plain_peak is not None and r.get("peak_bytes") is not None:
            r["drop_gib"] = common.gib(plain_peak - r["peak_bytes"])

    comparison = []
    for k in sweep:
        v1 = next((r for r in rows if r.get("mode") == "v1" and r.get("num_layers") == k and "error" not in r), None)
        v2 = next((r for r in rows if r.get("mode") == "v2" and r.get("num_layers") == k and "error" not in r), None)
        c: dict[str, Any] = {"num_layers": k}
        if v1 and v2:
            c["v1_over_v2_step"] = v1["step_ms"] / v2["step_ms"]
            if v1.get("peak_gib") is not None and v2.get("peak_gib") is not None:
                c["v1_minus_v2_peak_gib"] = v1["peak_gib"] - v2["peak_gib"]
            c["same_bytes"] = v1.get("offloaded_bytes") == v2.get("offloaded_bytes")
        comparison.append(c)

    failed = [r["variant"] for r in rows if "error" in r]
    common.write_json("v1_vs_v2", env, {
        "workload": spec.describe(),
        "summary": {"plain_ms": plain_ms, "plain_peak_gib": common.gib(plain_peak)},
        "comparison": comparison,
        "rows": rows,
        "failed": failed,
    })

    print("\nv1 vs v2 at the same num_layers:")
    for c in comparison:
        if "v1_over_v2_step" not in c:
            print(f"  k={c['num_layers']}: a run failed")
            continue
        print(f"  k={c['num_layers']}: v1 step = {c['v1_over_v2_step']:.3f}x v2; v1 peak - v2 peak = "
              f"{common.fmt(c.get('v1_minus_v2_peak_gib'), '+.2f')} GiB; same bytes offloaded: {common.fmt(c['same_bytes'])}")
    for r in rows:
        if "error" in r:
            r["variant"] += " (FAILED)"
    common.print_table(f"{spec.name}: v1 vs v2 ({common.device_name(env)})", rows, [
        ("variant", "variant", ""),
        ("step_ms", "step ms", ".1f"),
        ("step_min_ms", "min", ".1f"),
        ("step_max_ms", "max", ".1f"),
        ("ratio", "x plain", ".3f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("drop_gib", "drop GiB", ".2f"),
        ("offloaded_gib", "offl GiB", ".2f"),
        ("d2h_gbps", "D2H GB/s", ".1f"),
        ("h2d_gbps", "H2D GB/s", ".1f"),
        ("wait_ms", "wait ms", ".1f"),
    ])
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
