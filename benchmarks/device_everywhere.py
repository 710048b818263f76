"""``memory_budget_bytes="device"`` wherever HF checkpointing fits (T23), and a planned step that
runs out of memory (T24, ``--recovery``); issue 33.

T23: one process per (case, contender) (``workers.py``: an out-of-memory error can leave memory
behind, and "device" reads the GPU's free memory). Cases (``--cases``, comma-separated):

  8b-16384    LLAMA-8B-SHAPE (Llama-3-8B's shape, vocab 128256), T=16384, batch 1, base frozen
              (every parameter but the RMSNorm weights has requires_grad=False)
  8b-24576    the same at T=24576
  1b-131072   LLAMA-1B's shape at T=131072, batch 1, every parameter training

Contenders (``--contenders``, default ``ckpt,device``):

  ckpt        HF gradient checkpointing (non-reentrant): the baseline
  device      ``OffloadActivations(model.model.layers, memory_budget_bytes="device")``
  lowest      the same with ``"lowest"``                      (not in the default set)
  default     ``OffloadActivations(model.model.layers)``, the one-line default (T25's; not default)
  plain       no memory tool                                   (not in the default set)

Each process builds its model on the GPU in bf16 (no float32 copy: it would fragment the caching
allocator before the first step), then runs: for a planned contender its probe steps until a
plan is in force (the step that brought the plan counts as a warm-up), ``--warmup`` warm-up steps
in all, then ``--steps`` (5) timed steps. Every step is recorded: wall time (synchronised
``perf_counter``), peak allocated and reserved (reset at the step's start), the plan at its
forward's entry, and an out-of-memory error, after which the loop sets gradients to None, empties
the cache and goes on. No optimizer by default (the step of docs/benchmarks.md's figures);
``--optimizer adamw`` adds one. Target T23: no step out of memory (probe steps included) and each
timed step of "device" <= 0.95x checkpointing's median step.

T24 (``--recovery``): LLAMA-1B's shape at ``--recovery-seq`` x ``--recovery-batch`` (8192 x 4),
AdamW, ``OffloadActivations(layers, memory_budget_bytes="device")``. Once the plan is in force and
``--warmup`` planned steps ran, the harness lowers the allocator's cap with
``torch.cuda.set_per_process_memory_fraction`` to ``--recovery-cap-fraction`` (0.6) of the planned
steps' peak and empties the cache (cached segments would otherwise serve the step above the cap);
then ``--recovery-steps`` (3) steps of the same loop, which only catches
``torch.cuda.OutOfMemoryError`` and sets gradients to None (``--recovery-empty-cache`` adds
``torch.cuda.empty_cache()``). Target T24: the step after the one that ran out of memory fits,
with no change to the loop. Reported: each step's peak, the plan before and after
(``describe()``, ``budget_reason``, ``plan_report()``). With ``--cpu-smoke`` the out-of-memory
error is simulated (a forward hook raises it once) and ``"lowest"`` stands in for ``"device"``.

    python benchmarks/device_everywhere.py --cases 8b-16384               # ~2 min on the H100
    python benchmarks/device_everywhere.py --cases 1b-131072 --contenders device
    python benchmarks/device_everywhere.py --recovery                     # T24, ~1 min
    python benchmarks/device_everywhere.py --cpu-smoke --cases 8b-16384   # tiny check, no GPU

T14 (issue 50 s1), the first steps, from the same runs of each planned contender: no step over
1.5x the steady step (the timed steps' median, all on the own plan) and the first 5 steps (probe and stand-in steps included)
together at most 6 steady steps. Each such run also records ``OffloadActivations.first_steps``
(what each probe step and the first planned steps spent on the probe's end of step, the plan
search, the link, empty_cache and waiting for host blocks) in its JSON (``first_steps``) and
prints it. ``--cap-gib`` caps every worker's allocator (``set_per_process_memory_fraction``)
before its model is built, as issue 50 measured it under an 80 GB cap:

    python benchmarks/device_everywhere.py --cases 8b-16384,1b-131072 --contenders device --cap-gib 80
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Env, apply_defaults, exit_status, fmt, free_memory, gib, make_parser, print_table, setup, verdict, write_json,
)
from step_profile import Profiling  # noqa: E402
from step_records import PlanWatch, clear_grads, first_steps_table, make_train_step, measure_step, plan_fields, with_probe_peaks  # noqa: E402
from workers import (  # noqa: E402
    add_worker_options, check_cuda_or_exit, parent_env, parent_meta, spawn_all, strip_parent_options, worker_env,
    worker_info, write_worker_result,
)
from workloads import LlamaSpec, hf_checkpointing, llama_1b, llama_8b_shape, scale_for, train_norms_only  # noqa: E402

SCRIPT = Path(__file__).resolve()
CASES: dict[str, tuple[Callable[[float], LlamaSpec], int, bool]] = {  # name: (spec, seq, base frozen)
    "8b-16384": (llama_8b_shape, 16384, True),
    "8b-24576": (llama_8b_shape, 24576, True),
    "1b-131072": (llama_1b, 131072, False),
}
CONTENDERS = ("ckpt", "device", "lowest", "default", "plain")
DEFAULT_CONTENDERS = ("ckpt", "device")
SMOKE_SEQ = 64
MAX_PLANNING_STEPS = 8  # a planner that has not planned after this many steps is reported, not waited for
T23_STEP = 0.95  # each timed "device" step / checkpointing's median step
T14_STEP = 1.5   # no step over this many steady steps ...
T14_FIRST = 5    # ... and the first this many steps together ...
T14_SUM = 6.0    # ... at most this many steady steps
PLANNED = ("device", "lowest", "default")


def case_spec(case: str, smoke: bool) -> tuple[LlamaSpec, bool]:
    """(the model spec at the case's length and batch 1, whether its base is frozen)."""
    make, seq, frozen = CASES[case]
    spec = dataclasses.replace(make(scale_for(smoke)), batch=1, seq=SMOKE_SEQ if smoke else seq)
    return spec, frozen


def offload_options(env: Env) -> dict[str, Any]:
    options: dict[str, Any] = {"device": env.offload_device}
    if env.smoke:
        options["min_offload_bytes"] = 0  # the tiny tensors would all stay on the device
    return options


def budget_for(env: Env, contender: str) -> str:
    """The budget a planned contender passes: "device" needs CUDA, so the CPU runs "lowest"."""
    return "lowest" if contender == "device" and not env.cuda else contender


def after_failure(env: Env, model: torch.nn.Module, optimizer: Any, empty_cache: bool = True) -> Callable[[], None]:
    """What the loop does after a failed step: gradients to None (and the cache emptied)."""
    def run() -> None:
        clear_grads(model, optimizer)
        gc.collect()
        if empty_cache and env.cuda:
            torch.cuda.empty_cache()

    return run


def run_steps(env: Env, step: Callable[[], Any], watch: PlanWatch, phase: str, count: int,
              on_failure: Callable[[], None], records: list[dict[str, Any]], profile: Optional[Profiling] = None) -> None:
    """``count`` steps of ``phase``, each recorded into ``records`` (and printed); the steps
    ``profile`` names (``--profile-step``) run under :func:`step_profile.profiled`."""
    for _ in range(count):
        extra: dict[str, Any] = {}
        fn = profile.wrap(step, len(records), extra) if profile is not None else step
        rec = {"step": len(records), "phase": phase, **measure_step(env, fn, on_failure=on_failure), **watch.at_entry,
               **extra}
        if phase == "probe" and watch.at_entry:  # the plan came at this step's entry: it ran planned
            # (A stand-in while the own plan is made and pinned is not yet the plan's step.)
            rec["phase"] = "stand-in" if rec.get("plan_kind") == "stand-in" else "warmup"
        records.append(rec)
        shown = rec.get("error") or f"{rec['ms']:.1f} ms, peak {fmt(gib(rec['peak_bytes']), '.2f')} GiB"
        print(f"  {rec['phase']:<7} step {rec['step']:>2}: {shown}  {rec.get('plan', '')}", flush=True)


def plan_until_in_force(env: Env, step: Callable[[], Any], watch: PlanWatch, on_failure: Callable[[], None],
                        records: list[dict[str, Any]], profile: Optional[Profiling] = None) -> int:
    """Steps until one runs under its own plan (the ones before are probe steps and stand-ins,
    that one a warm-up), so that the timed steps, the steady step T14 and T23 judge by, are
    the plan's. Returns the warm-up steps it ran (1, or 0 when no plan came)."""
    for _ in range(MAX_PLANNING_STEPS):
        run_steps(env, step, watch, "probe", 1, on_failure, records, profile)
        if records[-1]["phase"] == "warmup":
            return 1
    print(f"  no plan after {MAX_PLANNING_STEPS} steps", flush=True)
    return 0


# -- T23: one (case, contender) -------------------------------------------------------------------
def run_case(env: Env, case: str, contender: str, args: Any) -> dict[str, Any]:
    """One contender on one case, in this process: its steps and their summary."""
    if args.cap_gib and env.cuda:  # before the model: the cap binds every allocation
        capacity = torch.cuda.get_device_properties(env.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * (1 << 30) / capacity), env.device)
    spec, frozen = case_spec(case, env.smoke)
    model, ids = spec.build(env.device, init_in_dtype=True)
    trainable = train_norms_only(model) if frozen else sum(p.numel() for p in model.parameters())
    free_memory(env)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5) if args.optimizer == "adamw" else None
    layers = model.model.layers
    import offload

    ctx = None
    result: dict[str, Any] = {"case": case, "contender": contender, "info": worker_info(env), "workload": spec.describe(),
                              "frozen_base": frozen, "trainable_params": trainable}
    if args.pinner_workers:  # the arena's background pinner, for an A/B of its threads (first_step.py --registration)
        offload.host.pinning.PINNER_WORKERS = args.pinner_workers
    result["pinner_workers"] = offload.host.pinning.PINNER_WORKERS
    if contender in ("device", "lowest"):
        result["budget"] = budget_for(env, contender)
        ctx = offload.OffloadActivations(layers, memory_budget_bytes=result["budget"], measure_peak=True, **offload_options(env))
    elif contender == "default":
        ctx = offload.OffloadActivations(layers, **offload_options(env))
    watch = PlanWatch(ctx)
    train = make_train_step(model, watch, optimizer)
    on_failure = after_failure(env, model, optimizer)
    records: list[dict[str, Any]] = []
    profile = Profiling.from_args(args, f"{case}_{contender}")
    with hf_checkpointing(model) if contender == "ckpt" else contextlib.nullcontext():
        warmed = 0
        if ctx is not None and contender != "default":
            warmed = plan_until_in_force(env, lambda: train(ids), watch, on_failure, records, profile)
        run_steps(env, lambda: train(ids), watch, "warmup", max(0, args.warmup - warmed), on_failure, records,
                  profile)
        run_steps(env, lambda: train(ids), watch, "timed", args.steps, on_failure, records, profile)
    if ctx is not None:
        result["first_steps"] = list(getattr(ctx, "first_steps", []))
        with_probe_peaks(records, result["first_steps"])
        if result["first_steps"]:
            print(first_steps_table(result["first_steps"]), flush=True)
    result["steps"] = records
    result["summary"] = summarize(records)
    if ctx is not None and getattr(ctx, "plan", None) is not None:
        result.update(plan_fields(ctx.plan), plan_report=ctx.plan_report())
        print(result["plan_report"], flush=True)
    if ctx is not None:
        ctx.close()
    return result


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The timed steps' median / min / max time (those that fit), every step's failures, the
    largest peaks, and the probe steps' count and time."""
    timed = [r for r in records if r["phase"] == "timed" and "error" not in r]
    probes = [r for r in records if r["phase"] == "probe"]
    peaks = [r["peak_bytes"] for r in records if r.get("peak_bytes") is not None and "error" not in r]
    reserved = [r["reserved_peak_bytes"] for r in records if r.get("reserved_peak_bytes") is not None]
    ms = [r["ms"] for r in timed]
    return {
        "median_ms": statistics.median(ms) if ms else None, "min_ms": min(ms, default=None), "max_ms": max(ms, default=None),
        "timed_ok": len(timed), "failed": sum(1 for r in records if "error" in r),
        "failed_phases": sorted({r["phase"] for r in records if "error" in r}),
        "max_peak_bytes": max(peaks, default=None), "max_reserved_bytes": max(reserved, default=None),
        "probe_steps": len(probes), "probe_ms": sum(r["ms"] for r in probes),
    }


def t23_rows(cases: list[str], contenders: list[str], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (case, contender): status, median step, ratios to checkpointing, peaks."""
    rows = []
    for case in cases:
        ckpt = results.get(f"{case}:ckpt", {}).get("summary", {})
        for contender in contenders:
            res = results.get(f"{case}:{contender}", {})
            s = res.get("summary", {})
            row: dict[str, Any] = {"case": case, "contender": contender, "median_ms": s.get("median_ms"),
                                   "peak_gib": gib(s.get("max_peak_bytes")), "reserved_gib": gib(s.get("max_reserved_bytes")),
                                   "failed": s.get("failed"), "probe_steps": s.get("probe_steps"), "plan": res.get("plan"),
                                   "budget_reason": res.get("budget_reason")}
            row["status"] = res.get("error") or (f"{s['failed']} steps out of memory or failed ({', '.join(s['failed_phases'])})"
                                                 if s.get("failed") else "ok")
            if ckpt.get("median_ms") and s.get("median_ms"):
                row["x_ckpt"] = s["median_ms"] / ckpt["median_ms"]
                row["worst_x_ckpt"] = s["max_ms"] / ckpt["median_ms"]
            if ckpt.get("max_peak_bytes") and s.get("max_peak_bytes"):
                row["peak_x_ckpt"] = s["max_peak_bytes"] / ckpt["max_peak_bytes"]
            rows.append(row)
    return rows


def t23_targets(cases: list[str], rows: list[dict[str, Any]], smoke: bool) -> list[dict[str, Any]]:
    """T23 per case: "device" never out of memory, each timed step <= 0.95x checkpointing's median."""
    out = []
    by = {(r["case"], r["contender"]): r for r in rows}
    for case in cases:
        dev, ckpt = by.get((case, "device")), by.get((case, "ckpt"))
        name = f"T23 {case}"
        if dev is None:
            continue
        if dev["status"] != "ok":
            out.append({"target": name, "ok": False, "figure": f"device: {dev['status']}"})
        elif ckpt is None or ckpt.get("median_ms") is None:
            out.append({"target": name, "ok": None, "figure": "device fit; checkpointing " + ("not run" if ckpt is None else ckpt["status"])})
        else:
            ok = dev["worst_x_ckpt"] <= T23_STEP
            out.append({"target": name, "ok": None if smoke else ok,
                        "figure": f"device {dev['median_ms']:.0f} ms = {dev['x_ckpt']:.3f}x checkpointing's {ckpt['median_ms']:.0f} ms "
                                  f"(worst step {dev['worst_x_ckpt']:.3f}x; <= {T23_STEP}), peak {fmt(dev['peak_gib'], '.1f')} GiB "
                                  f"against {fmt(ckpt['peak_gib'], '.1f')}"})
    return out


def t14_targets(cases: list[str], contenders: list[str], results: dict[str, dict[str, Any]],
                smoke: bool) -> list[dict[str, Any]]:
    """T14 per (case, planned contender): every step (probe steps included) <= 1.5x the steady
    step (the timed steps' median), and the first 5 steps together <= 6 steady steps. Contenders
    that plan nothing (``ckpt``, ``plain``) get the same figures as a reference (``ok`` None):
    their first step pays the process's warm-up (CUDA context, kernels loaded, the allocator's
    first segments), a share of T14 that no planner can remove."""
    out = []
    for case in cases:
        for contender in contenders:
            res = results.get(f"{case}:{contender}", {})
            steps, steady = res.get("steps", []), res.get("summary", {}).get("median_ms")
            reference = contender not in PLANNED
            name = f"T14 {case} {contender}" + (" (reference: plans nothing)" if reference else "")
            if not steady or len(steps) < T14_FIRST or any("error" in r for r in steps[:T14_FIRST]):
                out.append({"target": name, "ok": False if not smoke else None,
                            "figure": res.get("error") or f"not measured ({len(steps)} steps, steady {steady})"})
                continue
            worst = max(steps, key=lambda r: r.get("ms") or 0.0)
            first = sum(r["ms"] for r in steps[:T14_FIRST]) / steady
            ok = worst["ms"] / steady <= T14_STEP and first <= T14_SUM
            shown = ", ".join(f"{r['ms'] / 1e3:.2f}" for r in steps[:T14_FIRST])
            out.append({"target": name, "ok": None if smoke or reference else ok, "max_x_steady": worst["ms"] / steady,
                        "first_x_steady": first,
                        "figure": f"steps {shown} s, steady {steady / 1e3:.2f} s: the worst (step {worst['step'] + 1}) "
                                  f"{worst['ms'] / steady:.2f}x (<= {T14_STEP}), the first {T14_FIRST} {first:.2f} steady "
                                  f"steps (<= {T14_SUM:g})"})
    return out


# -- T24: recovery ----------------------------------------------------------------------------------
class FakeOOM:
    """A forward hook that raises ``torch.cuda.OutOfMemoryError`` once when armed (the CPU has no
    allocator cap to lower: the smoke run simulates the failure where a layer would allocate)."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, module: Any, args: Any) -> None:
        if self.armed:
            self.armed = False
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated on the CPU by device_everywhere.py --cpu-smoke)")


def run_recovery(env: Env, args: Any) -> dict[str, Any]:
    """T24 in this process: plan at "device", lower the cap, run the loop on."""
    import offload

    seq, batch = (SMOKE_SEQ, 2) if env.smoke else (args.recovery_seq, args.recovery_batch)
    spec = dataclasses.replace(llama_1b(scale_for(env.smoke)), batch=batch, seq=seq)
    model, ids = spec.build(env.device, init_in_dtype=True)
    free_memory(env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    budget = budget_for(env, "device")
    ctx = offload.OffloadActivations(model.model.layers, memory_budget_bytes=budget, measure_peak=True, **offload_options(env))
    watch = PlanWatch(ctx)
    train = make_train_step(model, watch, optimizer)
    records: list[dict[str, Any]] = []
    loop_failure = after_failure(env, model, optimizer, empty_cache=args.recovery_empty_cache)
    plan_until_in_force(env, lambda: train(ids), watch, loop_failure, records)
    # At least one planned step after the first (which may still pin host memory): its peak sets the cap.
    run_steps(env, lambda: train(ids), watch, "warmup", max(1, args.warmup), loop_failure, records)
    planned = [r for r in records if r["phase"] == "warmup" and "error" not in r and r.get("plan")]
    result: dict[str, Any] = {"info": worker_info(env), "workload": spec.describe(), "budget": budget,
                              "plan_before": {**plan_fields(ctx.plan), "plan_report": ctx.plan_report()}}
    hook = FakeOOM()
    if env.cuda:
        planned_peak = max((r["peak_bytes"] for r in planned), default=None)
        if planned_peak is None:
            result["error"] = "no planned step fit before the cap was lowered"
            return {**result, "steps": records}
        capacity = torch.cuda.get_device_properties(env.device).total_memory
        cap = int(args.recovery_cap_gib * (1 << 30)) if args.recovery_cap_gib else int(planned_peak * args.recovery_cap_fraction)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / capacity), env.device)
        torch.cuda.empty_cache()  # the harness's doing: cached segments above the cap would serve the step
        result.update(planned_peak_bytes=planned_peak, cap_bytes=cap, cap_fraction=cap / capacity)
        print(f"  cap lowered to {gib(cap):.2f} GiB ({cap / capacity:.3f} of the device; planned peak {gib(planned_peak):.2f} GiB)", flush=True)
    else:
        handle = model.model.layers[len(model.model.layers) // 2].register_forward_pre_hook(hook)
        hook.armed = True
        result["cap_bytes"] = None
        result["simulated"] = "a forward hook raised torch.cuda.OutOfMemoryError once (no cap on the CPU)"
    for _ in range(args.recovery_steps):
        run_steps(env, lambda: train(ids), watch, "capped", 1, loop_failure, records)
        records[-1]["plan_after"] = plan_fields(ctx.plan).get("plan")
    if not env.cuda:
        handle.remove()
    result.update(steps=records, plan_after={**plan_fields(ctx.plan), "plan_report": ctx.plan_report()})
    print(result["plan_after"]["plan_report"], flush=True)
    ctx.close()
    return result


def t24_target(res: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """T24: the step after the first one that ran out of memory under the cap fits (and the rest)."""
    if "error" in res and not res.get("steps"):
        return {"target": "T24", "ok": False, "figure": res["error"]}
    capped = [r for r in res.get("steps", []) if r["phase"] == "capped"]
    failed = [i for i, r in enumerate(capped) if "error" in r]
    cap = f"the cap of {gib(res['cap_bytes']):.2f} GiB" if res.get("cap_bytes") else "no cap (the CPU)"
    if not failed:
        return {"target": "T24", "ok": None,
                "figure": f"no step ran out of memory under {cap}: the case was not produced "
                          "(the plan fit the cap, or was changed before the step); lower --recovery-cap-fraction"}
    first = failed[0]
    after = capped[first + 1:]
    if not after:
        return {"target": "T24", "ok": False, "figure": "the last capped step ran out of memory; run more --recovery-steps"}
    nxt = after[0]
    ok = not any("error" in r for r in after)
    peak = f"peak {fmt(gib(nxt.get('peak_bytes')), '.2f')} GiB under {cap}" if "error" not in nxt else nxt["error"]
    figure = (f"capped step {first} ran out of memory ({capped[first].get('plan') or 'no plan'}); the next: "
              f"{'fit' if 'error' not in nxt else 'FAILED'}, {peak}, plan {nxt.get('plan') or '-'}; "
              f"{sum(1 for r in after if 'error' in r)} of the {len(after)} steps after it failed")
    if smoke:  # the out-of-memory error was simulated: the loop's logic is checked, not the engine
        return {"target": "T24", "ok": None, "logic_ok": ok, "figure": figure + " (simulated)"}
    return {"target": "T24", "ok": ok, "figure": figure}


# -- the parent ---------------------------------------------------------------------------------------
def parse(argv: list[str]) -> tuple[Any, Any]:
    parser = make_parser(__doc__, warmup=1, steps=5, smoke_warmup=1, smoke_steps=2)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS), help=f"comma-separated, from {', '.join(CONTENDERS)}")
    parser.add_argument("--optimizer", choices=("none", "adamw"), default="none", help="T23's steps (T24 always uses AdamW)")
    parser.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF for the workers (default: as inherited)")
    parser.add_argument("--cap-gib", type=float, default=None,
                        help="cap each worker's allocator at this many GiB (set_per_process_memory_fraction), e.g. 80")
    parser.add_argument("--recovery", action="store_true", help="run T24 (only) instead of T23")
    parser.add_argument("--recovery-seq", type=int, default=8192)
    parser.add_argument("--recovery-batch", type=int, default=4)
    parser.add_argument("--recovery-cap-fraction", type=float, default=0.6, help="the cap, as a fraction of the planned steps' peak")
    parser.add_argument("--recovery-cap-gib", type=float, default=None, help="the cap in GiB (instead of the fraction)")
    parser.add_argument("--recovery-steps", type=int, default=3, help="steps under the lowered cap")
    parser.add_argument("--recovery-empty-cache", action="store_true", help="the loop also empties the cache after an OOM")
    parser.add_argument("--pinner-workers", type=int, default=0,
                        help="threads of the arena's background pinner (default: offload.host.pinning.PINNER_WORKERS)")
    parser.add_argument("--profile-step", default="", metavar="K[,K]",
                        help="run steps K (0-based: with plans, 2 is the first plan's stand-in) under torch.profiler "
                             "and a stack sampler: the host calls and lines that took longest, printed and in the "
                             "step's record")
    parser.add_argument("--trace-dir", default=None,
                        help="with --profile-step: also write each profiled step's Chrome trace (gzipped) here")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/<name>.json)")
    add_worker_options(parser)
    return parser, parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, args = parse(argv)
    if args.worker is not None:  # a worker: "recovery" or "<case>:<contender>"
        env = setup(parser, argv)
        if args.worker == "recovery":
            result = run_recovery(env, env.args)
        else:
            case, contender = args.worker.split(":")
            result = run_case(env, case, contender, env.args)
        write_worker_result(args.worker_out, result)
        return 0
    check_cuda_or_exit(args, SCRIPT.name)
    apply_defaults(parser, args)
    env = parent_env(args)
    cases = [c for c in args.cases.split(",") if c]
    contenders = [c for c in args.contenders.split(",") if c]
    bad = [c for c in cases if c not in CASES] + [c for c in contenders if c not in CONTENDERS]
    if bad:
        parser.error(f"unknown cases or contenders: {bad}")
    base = strip_parent_options(argv, ("--cases", "--contenders", "--out", "--jobs", "--alloc-conf"))
    extra_env = worker_env(env)
    if args.alloc_conf is not None:
        extra_env["PYTORCH_CUDA_ALLOC_CONF"] = args.alloc_conf
    out = Path(args.out) if args.out else None
    if args.recovery:
        res = spawn_all(SCRIPT, [("recovery", [*base, "--worker", "recovery"])], timeout=args.worker_timeout,
                        extra_env=extra_env)["recovery"]
        rows = [{"step": r["step"], "phase": r["phase"], "ms": r["ms"], "error": r.get("error"),
                 "peak_gib": gib(r.get("peak_bytes")), "plan": r.get("plan"), "plan_after": r.get("plan_after")}
                for r in res.get("steps", [])]
        print_table("T24: a planned step out of memory, then the loop goes on", rows, [
            ("step", "step", ""), ("phase", "phase", ""), ("ms", "ms", ".0f"), ("peak_gib", "peak GiB", ".2f"),
            ("error", "error", ""), ("plan", "plan at entry", ""), ("plan_after", "plan after", "")])
        for when in ("plan_before", "plan_after"):
            if res.get(when):
                print(f"\n{when}: {res[when].get('plan')} ({res[when].get('budget_reason')})")
        target = t24_target(res, env.smoke)
        print(f"\n  T24  {verdict(target['ok'])}  {target['figure']}")
        write_json("device_recovery", env, {"result": res, "targets": [target]}, meta=parent_meta(env, [res]), path=out)
        return exit_status(["recovery"] if "error" in res else [])
    jobs = [(f"{case}:{c}", [*base, "--worker", f"{case}:{c}"]) for case in cases for c in contenders]
    results = spawn_all(SCRIPT, jobs, parallel=args.jobs, timeout=args.worker_timeout, extra_env=extra_env)
    rows = t23_rows(cases, contenders, results)
    print_table("T23: each (case, contender) in its own process; ratios to HF checkpointing", rows, [
        ("case", "case", ""), ("contender", "contender", ""), ("status", "status", ""), ("median_ms", "step ms", ".0f"),
        ("x_ckpt", "x ckpt", ".3f"), ("worst_x_ckpt", "worst x ckpt", ".3f"), ("peak_gib", "peak GiB", ".2f"),
        ("reserved_gib", "reserved GiB", ".2f"), ("probe_steps", "probes", ""), ("plan", "plan", "")])
    targets = t23_targets(cases, rows, env.smoke)
    t14 = t14_targets(cases, contenders, results, env.smoke)
    print()
    for t in targets + t14:
        print(f"  {t['target']:<16} {verdict(t['ok'])}  {t['figure']}")
    name = "device_everywhere"
    if cases != list(CASES):
        name += "_" + "+".join(cases)
    if contenders != list(DEFAULT_CONTENDERS):
        name += "_" + "+".join(contenders)
    if args.cap_gib:
        name += f"_cap{args.cap_gib:g}"
    write_json(name, env, {"cases": cases, "contenders": contenders, "cap_gib": args.cap_gib, "rows": rows,
                           "targets": targets, "t14": t14, "runs": results},
               meta=parent_meta(env, list(results.values())), path=out)
    return exit_status([label for label, r in results.items() if "error" in r])


if __name__ == "__main__":
    sys.exit(main())
