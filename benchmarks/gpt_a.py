"""GPT-A: the core offload benchmark (targets T1, T2, T3 of docs/benchmarks.md).

One process, one model (8 x GPTBlock, hidden 4096, 32 heads, batch 2, seq 4096, bf16; default
SDPA backend), one training step = forward in TransformerEngine's call shape + backward + grads
set to None (what ``zero_grad()`` does). Variants, timed side by side:

* ``plain`` (run first and again last, to show drift; the reference is the mean of both),
* offload (``--mode v2`` default, ``--selection auto``) with ``num_layers`` swept 1..7,
* ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the whole forward.

Per variant: median step ms (CUDA events; min..max shown), ratio to plain, peak GiB (max allocated
over the timed steps), peak drop vs plain, GiB offloaded (stats ``offloaded_bytes``), drop /
offloaded, achieved GB/s each way (stats, from the engine's copy events), compute-stream wait ms,
and the copy floor: ``bytes_d2h / D2H GB/s + bytes_h2d / H2D GB/s`` with the per-direction
bandwidth MEASURED at start by one large pinned copy each way (``floor1`` is the slower direction
alone, the floor if both directions overlapped completely).

Targets, evaluated on this run:

* T1: the largest ``num_layers`` whose step <= 1.05 x plain, with its peak drop >= 0.95 x its
  offloaded bytes (the fraction of those layers' activation memory that is gone, from a
  ``memory_allocated`` probe of each layer in a plain forward, is printed alongside).
* T2: ``num_layers = 7``: step <= 1.10 x copy floor, and >= 2x faster than ``save_on_cpu``.
* T3: for every ``num_layers``: peak <= plain peak - 0.95 x offloaded bytes.

``drop layers`` is the peak drop in units of one layer's activation memory (from the probe), so a
schedule that keeps one reloaded layer more than plain at the peak shows it directly.

Usage: ``python benchmarks/gpt_a.py [--mode v1|v2] [--layers 1,3,7] [--steps N] [--warmup N]``;
``--cpu-smoke`` for a tiny CPU check of the script. Writes ``benchmarks/results/gpt_a.json``
(``gpt_a_v1.json`` with ``--mode v1``).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Any, Optional

import torch

import common
import measure
import workloads


def parse_layers(text: Optional[str], model_layers: int) -> list[int]:
    if not text:
        return list(range(1, model_layers))
    out = sorted({int(v) for v in text.split(",") if v.strip()})
    bad = [v for v in out if not 1 <= v <= model_layers - 1]
    if bad:
        raise SystemExit(f"--layers: {bad} out of range 1..{model_layers - 1}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = common.make_parser(__doc__, warmup=3, steps=8)
    parser.add_argument("--mode", choices=["v1", "v2"], default="v2", help="offload schedule (default v2)")
    parser.add_argument("--layers", default=None, help="comma-separated num_layers to sweep (default 1..7)")
    parser.add_argument("--selection", choices=["auto", "marked"], default="auto",
                        help="offload selection (default auto: every eligible tensor; v1 alone would default to marked)")
    parser.add_argument("--no-save-on-cpu", action="store_true", help="skip the save_on_cpu variant (T2 then n/a)")
    parser.add_argument("--workload", choices=["gpt_a", "gpt_b"], default="gpt_a",
                        help="gpt_b runs the same sweep on GPT-B (4 layers; results in gpt_b.json; the targets are GPT-A's)")
    env = common.setup(parser, argv)
    args = env.args

    spec = workloads.WORKLOADS[args.workload](workloads.scale_for(env.smoke))
    sweep = parse_layers(args.layers, spec.layers)
    print(spec.describe())
    print(f"device: {common.device_name(env)}; torch {torch.__version__}; mode {args.mode}, selection {args.selection}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per variant")

    bw = measure.pinned_bandwidth(env)
    if bw is not None:
        print(f"pinned copy bandwidth ({bw['copy_bytes'] >> 20} MiB, events): D2H {bw['d2h_gbps']:.1f} GB/s, "
              f"H2D {bw['h2d_gbps']:.1f} GB/s, both at once {bw['both_gbps']:.1f} GB/s")

    layers, make_input = spec.build(env.device)
    x = make_input()
    act = measure.layer_activation_bytes(layers, x, env)
    if act is not None:
        print("activation bytes per layer (plain forward, memory_allocated): "
              + ", ".join(f"{a / common.GiB:.2f}" for a in act) + " GiB")

    rows: list[dict[str, Any]] = []
    print("variants:")
    rows.append(measure.run_variant(env, "plain", layers, x))
    last_k = spec.layers - 1
    for k in sweep:
        rows.append(measure.run_variant(
            env, f"offload {args.mode} k={k}", layers, x,
            offload={"num_layers": k, "mode": args.mode, "selection": args.selection},
            want_report=(k == max(sweep)),
        ))
    if not args.no_save_on_cpu:
        rows.append(measure.run_variant(env, "save_on_cpu", layers, x, forward_wrapper=measure.save_on_cpu_wrapper()))
    rows.append(measure.run_variant(env, "plain (again)", layers, x))

    plains = [r for r in rows if r["variant"].startswith("plain") and "error" not in r]
    plain_ms = statistics.fmean(r["step_ms"] for r in plains) if plains else None
    drift = (plains[-1]["step_ms"] / plains[0]["step_ms"] - 1) if len(plains) == 2 else None
    plain_peak = plains[0]["peak_bytes"] if plains else None
    save_row = next((r for r in rows if r["variant"] == "save_on_cpu" and "error" not in r), None)

    for r in rows:
        if "error" in r:
            continue
        r["ratio"] = r["step_ms"] / plain_ms if plain_ms else None
        if plain_peak is not None and r.get("peak_bytes") is not None:
            r["drop_bytes"] = plain_peak - r["peak_bytes"]
            r["drop_gib"] = common.gib(r["drop_bytes"])
        st = r.get("stats")
        if st:
            floor, floor1 = measure.copy_floor_ms(st["bytes_d2h"], st["bytes_h2d"], bw)
            r["floor_ms"], r["floor1_ms"] = floor, floor1
            r["step_over_floor"] = r["step_ms"] / floor if floor else None
            if r.get("drop_bytes") is not None and st["offloaded_bytes"]:
                r["drop_over_offloaded"] = r["drop_bytes"] / st["offloaded_bytes"]
            k = r["num_layers"]
            if act is not None and r.get("drop_bytes") is not None:
                r["act_bytes_of_layers"] = sum(act[:k])
                r["act_gone_frac"] = r["drop_bytes"] / sum(act[:k])
                r["drop_in_layers"] = r["drop_bytes"] / statistics.fmean(act)

    offl = [r for r in rows if r.get("stats") and "error" not in r]

    # -- targets --------------------------------------------------------------------------------
    targets: dict[str, Any] = {}
    lines: list[str] = []
    # T1
    fits = [r for r in offl if r["ratio"] is not None and r["ratio"] <= 1.05]
    if not offl or plain_ms is None:
        targets["T1"] = {"ok": None, "why": "no offload or plain run"}
        lines.append(f"T1 {common.verdict(None)}  no offload or plain run completed")
    elif not fits:
        best = min(offl, key=lambda r: r["ratio"])
        targets["T1"] = {"ok": False, "num_layers": None, "best_ratio": best["ratio"]}
        lines.append(f"T1 MISS  no num_layers within 1.05x plain (best: k={best['num_layers']} at {best['ratio']:.3f}x)")
    else:
        r = max(fits, key=lambda r: r["num_layers"])
        frac = r.get("drop_over_offloaded")
        mem_ok = None if frac is None else frac >= 0.95
        ok = None if mem_ok is None else mem_ok
        targets["T1"] = {"ok": ok, "num_layers": r["num_layers"], "ratio": r["ratio"], "drop_over_offloaded": frac,
                         "act_gone_frac": r.get("act_gone_frac")}
        gone = r.get("act_gone_frac")
        lines.append(
            f"T1 {common.verdict(ok)}  largest num_layers within 1.05x plain: k={r['num_layers']} "
            f"({r['ratio']:.3f}x); peak drop {common.fmt(r.get('drop_gib'), '.2f')} GiB = "
            f"{common.fmt(frac, '.1%')} of {r['offloaded_gib']:.2f} GiB offloaded (need >= 95%); "
            f"= {common.fmt(gone, '.1%')} of those layers' activation memory"
        )
    # T2
    r7 = next((r for r in offl if r["num_layers"] == last_k), None)
    if r7 is None:
        targets["T2"] = {"ok": None, "why": f"num_layers={last_k} not run"}
        lines.append(f"T2 {common.verdict(None)}  num_layers={last_k} not run or failed")
    else:
        floor_ok = None if r7.get("floor_ms") is None else r7["step_ms"] <= 1.10 * r7["floor_ms"]
        speedup = save_row["step_ms"] / r7["step_ms"] if save_row else None
        soc_ok = None if speedup is None else speedup >= 2.0
        ok = None if floor_ok is None or soc_ok is None else (floor_ok and soc_ok)
        targets["T2"] = {"ok": ok, "step_ms": r7["step_ms"], "floor_ms": r7.get("floor_ms"), "floor1_ms": r7.get("floor1_ms"),
                         "step_over_floor": r7.get("step_over_floor"), "speedup_vs_save_on_cpu": speedup,
                         "floor_ok": floor_ok, "save_on_cpu_ok": soc_ok}
        lines.append(
            f"T2 {common.verdict(ok)}  k={last_k}: step {r7['step_ms']:.1f} ms = {common.fmt(r7.get('step_over_floor'), '.2f')}x "
            f"copy floor {common.fmt(r7.get('floor_ms'), '.1f')} ms (need <= 1.10x) [{common.verdict(floor_ok)}]; "
            f"one-direction floor {common.fmt(r7.get('floor1_ms'), '.1f')} ms; "
            f"{common.fmt(speedup, '.2f')}x faster than save_on_cpu (need >= 2x) [{common.verdict(soc_ok)}]"
        )
    # T3
    t3 = []
    for r in offl:
        if r.get("peak_bytes") is None or plain_peak is None:
            t3.append({"num_layers": r["num_layers"], "ok": None})
            continue
        limit = plain_peak - 0.95 * r["offloaded_bytes"]
        t3.append({"num_layers": r["num_layers"], "ok": r["peak_bytes"] <= limit, "peak_gib": r["peak_gib"],
                   "limit_gib": common.gib(limit), "drop_over_offloaded": r.get("drop_over_offloaded")})
    oks = [t["ok"] for t in t3]
    t3_ok = None if not oks or None in oks else all(oks)
    targets["T3"] = {"ok": t3_ok, "per_num_layers": t3}
    detail = "; ".join(
        f"k={t['num_layers']} {common.verdict(t['ok'])} {common.fmt(t.get('peak_gib'), '.2f')}<={common.fmt(t.get('limit_gib'), '.2f')}"
        for t in t3
    )
    lines.append(f"T3 {common.verdict(t3_ok)}  peak <= plain - 0.95 x offloaded (GiB): {detail or 'no offload run'}")

    # -- output ---------------------------------------------------------------------------------
    report = next((r.get("report") for r in reversed(offl) if r.get("report")), None)
    if report:
        k_rep = next(r["num_layers"] for r in reversed(offl) if r.get("report"))
        print(f"\nstats report of the num_layers={k_rep} run:")
        print(report)

    summary = {
        "plain_ms": plain_ms,
        "plain_drift": drift,
        "plain_peak_gib": common.gib(plain_peak),
        "save_on_cpu_ms": save_row["step_ms"] if save_row else None,
        "save_on_cpu_ratio": save_row.get("ratio") if save_row else None,
    }
    failed = [r["variant"] for r in rows if "error" in r]
    common.write_json(
        args.name or (args.workload if args.mode == "v2" else f"{args.workload}_{args.mode}"),
        env,
        {
            "workload": spec.describe(),
            "spec": {k: str(v) if k == "dtype" else v for k, v in dataclasses.asdict(spec).items()},
            "bandwidth": bw,
            "layer_activation_bytes": act,
            "summary": summary,
            "targets": targets,
            "rows": rows,
            "failed": failed,
        },
    )

    print("\ntargets (measured in this run):")
    for line in lines:
        print("  " + line)
    if drift is not None:
        print(f"  plain drift first->last run: {drift:+.1%}")
    columns = [
        ("variant", "variant", ""),
        ("step_ms", "step ms", ".1f"),
        ("step_min_ms", "min", ".1f"),
        ("step_max_ms", "max", ".1f"),
        ("ratio", "x plain", ".3f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("drop_gib", "drop GiB", ".2f"),
        ("offloaded_gib", "offl GiB", ".2f"),
        ("drop_over_offloaded", "drop/offl", ".2f"),
        ("drop_in_layers", "drop layers", ".2f"),
        ("d2h_gbps", "D2H GB/s", ".1f"),
        ("h2d_gbps", "H2D GB/s", ".1f"),
        ("wait_ms", "wait ms", ".1f"),
        ("floor_ms", "floor ms", ".1f"),
        ("floor1_ms", "floor1 ms", ".1f"),
        ("step_over_floor", "x floor", ".2f"),
    ]
    for r in rows:
        if "error" in r:
            r["step_ms"] = None
            r["variant"] = r["variant"] + " (FAILED)"
    common.print_table(f"{spec.name} ({common.device_name(env)})", rows, columns)
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
