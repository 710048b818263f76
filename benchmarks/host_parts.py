"""What each of the engine's calls costs the host, per offloaded tensor and per group (issue 12;
T5 of docs/benchmarks.md). (``cpu_overhead.py`` until issue 50; its runs are the
``cpu_overhead*.json`` that docs/benchmarks.md quotes.)

In the spirit of TransformerEngine's ``benchmark_linear_cpu_overhead``: host-bound workloads where
every microsecond the engine spends shows in the step.

Workloads (TransformerEngine's call shape, ``get_cpu_offload_context`` + sync function, all
layers but the last offloaded, ``min_offload_bytes=0``):

* SMALL: 16 x (Linear 1024->1024 + GELU), 256 tokens, bf16: 2 tensors of 512 KiB per group;
* MOE: 8 MoE layers of 64 expert MLPs on fixed token slices (``workloads.MoESpec``): ~257 small
  tensors per group.

1. End to end, one process, the contenders side by side (``measure.run_variant``): per step the
   step time (CUDA events), host wall time of the Python call, and process CPU time
   (``time.process_time``: all threads, autograd's backward device thread included); the
   deltas offload minus plain per offloaded tensor and per offloaded group (counts from
   ``ctx.stats``: ``offloaded_tensors``, ``groups_offloaded``). Each delta charges *all* the
   engine's cost to that unit. Variants: plain, offload with the default options, and, where the
   engine takes ``timing=`` (issue 12), ``timing=False`` and ``timing=True``, and where it takes
   ``group_bytes`` (issue 35), 4 and 16 MiB (small layers sharing one copy); on SMALL also
   ``save_on_cpu(pin_memory=True)``; the *hooks floor* (``measure.HooksFloor``: every layer's
   ``with`` pushes saved-tensor hooks that hand each tensor back, and the sync function puts a
   no-op gradient pre-hook on its output: what Python hooks alone add, under any engine); plain
   again last (plain figures are the mean of both).
2. Per part, direct (``engine_parts.measure_parts``: the engine's own methods called by hand, no
   autograd, perf_counter): forward pack (per tensor), layer entry, layer exit (group close +
   layout + D2H submission), release; backward: the marker's reload submission
   (``on_backward_reach``), unpack (per tensor, the compute stream's wait and the typed view). Two
   shapes: SMALL's (16 layers, 15 offloaded, 2 x 512 KiB) and MOE's (8 layers, 7 offloaded, 300
   tensors of 64 KiB), with the same option variants.
3. Per part, inside real steps (``engine_parts.measure_in_step``): each entry point of the engine
   wrapped in place and timed inclusive during SMALL's and MOE's training steps (default options):
   layer entry and exit, pack and ``sync_function`` on the main thread; the marker's reach,
   unpack and a group's freeing on autograd's thread; their sum against the time a step adds.
   The direct loop runs the engine alone, hot in the caches, and counts well under this.
4. The host cost of one CUDA driver call (an event record or a stream wait, what copy submissions
   and waits are made of) inside SMALL's plain step and alone: forward hooks making 8 such calls
   a layer, against the same hooks making none, in alternating rounds.

Targets (T5 as raised by issue 35, docs/benchmarks.md): T5a SMALL offload (default options)
step <= 1.5x plain. T5b <= 60 us per group (entry + exit + sync + reach + freed), judged inside real
SMALL steps with the default options (both threads' parts summed); the per-tensor figure (pack +
unpack), the direct figures and the end-to-end process-CPU deltas are printed next to it. T5c MOE
offload (default options) step <= 1.05x plain.

The script runs on the engine before issue 12 too (for before/after tables): options it lacks
are skipped, and the JSON's ``features`` says which were there.

Usage: ``python benchmarks/host_parts.py [--steps N] [--moe-steps N] [--micro-reps N]``;
``--cpu-smoke`` for a tiny CPU check. Writes ``benchmarks/results/host_parts.json``.
"""

from __future__ import annotations

import statistics
import sys
import traceback
from time import perf_counter as time_now
from typing import Any, Optional

import torch

import common
import engine_parts
import measure
import workloads

MOE_TENSORS_PER_GROUP = 300  # the direct MOE shape; a MOE workload layer saves 4 * 64 + 1 = 257
MIN_OFFLOAD_BYTES = 0        # every saved activation is offloaded, however small: the worst case
T5A_RATIO, T5B_GROUP_US, T5C_RATIO = 1.5, 60.0, 1.05
GROUP_MIB = (4, 16)  # group_bytes measured end to end: SMALL's layers save 1 MiB, MOE's about 10


def group_variants() -> list[tuple[str, dict[str, Any]]]:
    """End-to-end only: small layers sharing one copy (``group_bytes``, issue 35), if taken."""
    if not engine_parts.supports_option("group_bytes"):
        return []
    return [(f"group_bytes={n} MiB", {"group_bytes": n << 20}) for n in GROUP_MIB]


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
    rows = [measure.run_variant(env, "plain", layers, x, steps=steps)]
    for label, extra in variants:
        options = {"num_layers": k, "min_offload_bytes": MIN_OFFLOAD_BYTES, **extra}
        row = measure.run_variant(env, f"offload k={k} ({label})", layers, x, offload=options, steps=steps)
        row["options"] = label
        rows.append(row)
    floor = measure.HooksFloor()
    rows.append(measure.run_variant(env, "hooks floor", layers, x, layer_calls=(floor, floor.sync), steps=steps))
    if save_on_cpu:
        rows.append(measure.run_variant(env, "save_on_cpu", layers, x, forward_wrapper=measure.save_on_cpu_wrapper(), steps=steps))
    rows.append(measure.run_variant(env, "plain (again)", layers, x, steps=steps))
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


def in_step(env: common.Env, spec: Any, steps: int, plain_step_ms: Optional[float]) -> dict[str, Any]:
    """``engine_parts.measure_in_step`` on ``spec`` (default options, all layers but the last);
    ``inside_share``: the parts' sum over (instrumented step - plain step)."""
    try:
        layers, make_input = spec.build(env.device)
        row = engine_parts.measure_in_step(
            env, layers, make_input(), num_layers=spec.layers - 1, steps=steps, warmup=max(3, steps // 10),
            options={"min_offload_bytes": MIN_OFFLOAD_BYTES},
        )
    except Exception as exc:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        common.free_memory(env)
        return {"workload": spec.describe(), "error": f"{type(exc).__name__}: {exc}"}
    row["workload"] = spec.describe()
    added = None if plain_step_ms is None else (row["instrumented_step_ms"] - plain_step_ms) * 1e3
    row["added_us_step"] = added
    row["inside_share"] = None if not added or row["parts_us_step"] is None else row["parts_us_step"] / added
    print(f"  {spec.name}: {common.fmt(row['per_tensor_us'], '.2f')} us per tensor (pack + unpack), "
          f"{common.fmt(row['per_group_us'], '.1f')} us per group; the entry points hold "
          f"{common.fmt(row['parts_us_step'], '.0f')} of the {common.fmt(added, '.0f')} us a step offloading adds", flush=True)
    return row


def driver_calls_in_step(env: common.Env, spec: Any, *, pairs: int, rounds: int, steps: int) -> Optional[dict[str, Any]]:
    """What one CUDA driver call costs the host inside ``spec``'s plain step, against alone.

    A forward hook on every layer records a pooled event on the current stream and makes a side
    stream wait on it, ``pairs`` times (two driver calls a pair, each a command for the GPU: what
    the engine's copy submissions and waits are made of); the same hook making none is the
    baseline. Rounds alternate the two; medians. None without the extension or a GPU."""
    from offload.host import native

    ext = native.extension()
    if ext is None or not env.cuda:
        return None
    layers, make_input = spec.build(env.device)
    side = torch.cuda.Stream(env.device).cuda_stream
    raw_current = torch._C._cuda_getCurrentRawStream
    index = env.device.index if env.device.index is not None else torch.cuda.current_device()
    per_layer = {"pairs": 0}

    def record_and_wait() -> None:
        ext.record_event(raw_current(index), False).wait(side)

    def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
        for _ in range(per_layer["pairs"]):
            record_and_wait()

    def timed(n: int, count: int) -> float:
        per_layer["pairs"] = n
        env.sync()
        start = time_now()
        for _ in range(count):
            step()
        env.sync()
        return (time_now() - start) / count * 1e6

    handles = [layer.register_forward_hook(hook) for layer in layers]
    step = measure.make_step(layers, make_input())
    try:
        timed(0, 10), timed(pairs, 10)  # warm-up
        base, loaded = [], []
        for _ in range(rounds):  # alternating, so that the host's drift lands on both
            base.append(timed(0, steps))
            loaded.append(timed(pairs, steps))
        alone = []
        for _ in range(5):
            start = time_now()
            for _ in range(200):
                record_and_wait()
            alone.append((time_now() - start) / 400 * 1e6)
            env.sync()
    finally:
        for h in handles:
            h.remove()
    per_call = (statistics.median(loaded) - statistics.median(base)) / (spec.layers * 2 * pairs)
    row = {"calls_per_layer": 2 * pairs, "step_us_without": statistics.median(base),
           "step_us_with": statistics.median(loaded), "us_per_call_in_step": per_call,
           "us_per_call_alone": min(alone), "rounds": rounds, "steps_per_round": steps}
    print(f"  one driver call (event record or stream wait): {per_call:.2f} us inside {spec.name}'s step, "
          f"{min(alone):.2f} us alone", flush=True)
    common.free_memory(env)
    return row


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
        "SMALL": end_to_end(env, small, args.steps, variants + group_variants(), save_on_cpu=True),
        "MOE": end_to_end(env, moe, moe_steps, variants + group_variants(), save_on_cpu=False),
    }

    print("\ndirect engine parts (no autograd):", flush=True)
    shapes = [
        engine_parts.PartsShape("SMALL shape", small.layers, small.layers - 1, 2, small.tokens * small.width * 2),
        engine_parts.PartsShape("MOE shape", moe.layers, moe.layers - 1, MOE_TENSORS_PER_GROUP, moe.expert_tokens * moe.ffn * 2),
    ]
    micro = direct(env, shapes, variants, micro_reps)
    features["on_backward_reach"] = next((m["reach_available"] for m in micro if "error" not in m), None)

    print("\nengine parts inside real steps (default options):", flush=True)
    steps_in = {"SMALL": args.steps, "MOE": max(3, moe_steps // 2)}
    inside = {name: in_step(env, spec, steps_in[name], e2e[name]["plain"]["step_ms"])
              for name, spec in (("SMALL", small), ("MOE", moe))}
    print("\nthe host cost of a driver call:", flush=True)
    driver = driver_calls_in_step(env, small, pairs=4, rounds=3 if env.smoke else 8, steps=3 if env.smoke else 50)

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
        # Judged inside real steps: the direct loop runs the engine alone, hot in the caches, and
        # counts well under what a step pays (see engine_parts.measure_in_step).
        i = inside[workload] if "error" not in inside[workload] else None
        ok = None if i is None or i["per_group_us"] is None else i["per_group_us"] <= T5B_GROUP_US
        tag = "T5b" if workload == "SMALL" else "   "
        lines.append(
            f"{tag} {common.verdict(ok)}  {workload}, inside real steps, both threads: {common.fmt(i and i['per_tensor_us'], '.2f')} us "
            f"per tensor (pack + unpack), {common.fmt(i and i['per_group_us'], '.1f')} us per group "
            f"(entry + exit + sync + reach + freed; need <= {T5B_GROUP_US:g})"
            + ("" if workload == "SMALL" else "  [the MOE shape's group bound is not part of T5: shown for scale]")
        )
        lines.append(
            f"          direct ({shape}, the engine alone): {common.fmt(m and m['per_tensor_us'], '.2f')} us per tensor, "
            f"{common.fmt(m and m['per_group_us'], '.2f')} us per group (entry + exit + release + reach)"
        )
        lines.append(
            f"          end to end ({workload}, process CPU offload - plain): {common.fmt(row and row.get('cpu_us_t'), '.2f')} us "
            f"per offloaded tensor, or {common.fmt(row and row.get('cpu_us_g'), '.2f')} us per group "
            f"({common.fmt(row and row.get('offloaded_tensors'))} tensors in {common.fmt(row and row.get('groups_offloaded'))} "
            "groups a step; each figure charges all of the delta to its unit)"
        )
        targets["T5b" if workload == "SMALL" else "T5b_moe_shape"] = {
            "ok": ok,
            "in_step_us_per_tensor": i and i["per_tensor_us"],
            "in_step_us_per_group": i and i["per_group_us"],
            "in_step_share_of_added_time": i and i["inside_share"],
            "direct_us_per_tensor": m and m["per_tensor_us"],
            "direct_us_per_group": m and m["per_group_us"],
            "end_to_end_cpu_us_per_tensor": row and row.get("cpu_us_t"),
            "end_to_end_cpu_us_per_group": row and row.get("cpu_us_g"),
            "end_to_end_host_us_per_tensor": row and row.get("host_us_t"),
        }

    moe_row = find(e2e["MOE"]["rows"], f"offload k={moe.layers - 1} (default)")
    t5c = None if moe_row is None or moe_row.get("ratio") is None else moe_row["ratio"] <= T5C_RATIO
    lines.append(
        f"T5c {common.verdict(t5c)}  MOE offload k={moe.layers - 1} (default) step {common.fmt(moe_row and moe_row['step_ms'], '.3f')} ms = "
        f"{common.fmt(moe_row and moe_row.get('ratio'), '.2f')}x plain {common.fmt(e2e['MOE']['plain']['step_ms'], '.3f')} ms "
        f"(need <= {T5C_RATIO}x)"
    )
    targets["T5c"] = {"ok": t5c, "ratio": moe_row and moe_row.get("ratio")}

    failed = [r["variant"] for w in e2e.values() for r in w["rows"] if "error" in r] + [m["variant"] for m in micro if "error" in m]
    failed += [f"in-step {name}" for name, row in inside.items() if "error" in row]
    common.write_json("host_parts", env, {
        "workloads": {name: w["workload"] for name, w in e2e.items()},
        "features": features,
        "min_offload_bytes": MIN_OFFLOAD_BYTES,
        "targets": targets,
        "end_to_end": e2e,
        "direct": micro,
        "in_step": inside,
        "driver_call": driver,
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
    common.print_table("engine parts inside real steps, us a step (inclusive; main thread: entry, pack, exit, sync; "
                       "autograd's: reach, unpack, freed)",
                       [dict(row, name=name) for name, row in inside.items() if "error" not in row], [
        ("name", "workload", ""),
        ("entry_us_step", "entry", ".0f"),
        ("pack_us_step", "pack", ".0f"),
        ("exit_us_step", "exit", ".0f"),
        ("sync_us_step", "sync", ".0f"),
        ("reach_us_step", "reach", ".0f"),
        ("unpack_us_step", "unpack", ".0f"),
        ("freed_us_step", "freed", ".0f"),
        ("parts_us_step", "sum", ".0f"),
        ("added_us_step", "added a step", ".0f"),
        ("inside_share", "share", ".2f"),
        ("per_tensor_us", "us/t", ".2f"),
        ("per_group_us", "us/g", ".1f"),
    ])
    if driver is not None:
        print(f"\ndriver call (event record or stream wait): {driver['us_per_call_in_step']:.2f} us inside SMALL's plain step, "
              f"{driver['us_per_call_alone']:.2f} us alone ({driver['calls_per_layer']} a layer, {driver['rounds']} rounds)")
    print("\ntargets (measured in this run):")
    for line in lines:
        print("  " + line)
    return common.exit_status(failed)


if __name__ == "__main__":
    sys.exit(main())
