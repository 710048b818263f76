"""LONG-1B: LLAMA-1B's HF model at sequence 49152, batch 1, where the plain step does not fit an
80 GB H100 and HF checkpointing does (issue 25): what offload and its planner give there.

Contenders, one after the other in one process, each timed as the median step and the peak of
``max_memory_allocated`` over its timed steps (reset per contender); an out-of-memory error is
caught and recorded as "out of memory", and memory is freed before the next contender:

  plain                          expected: out of memory on an 80 GB H100
  HF checkpointing               ``workloads.hf_checkpointing`` (non-reentrant): the baseline
  offload all but the last       ``OffloadActivations(layers)``
  MLP selective + offload k=...  by hand: ``offload.selective_recompute([l.mlp for l in layers])``
                                 with ``OffloadActivations(layers, num_offload_layers=k)`` (``--ks``)
  plan @ device                  ``OffloadActivations(layers, memory_budget_bytes="device")``
  plan @ lowest                  ``OffloadActivations(layers, memory_budget_bytes="lowest")``

The two plans are made on the context's own first steps (its probe steps): planning is timed from
the context's construction to the entry of the first step that follows the plan (the GPU
synchronised there, so the probe steps' GPU work is in), then the planned steps are timed as the
other contenders are. ``--no-selective`` passes ``selective=False`` to the plans where
``OffloadActivations`` takes that argument (then no layer's MLP is a candidate for selective
recompute); without it the default candidates apply.

Targets (docs/benchmarks.md): T15 plan @ device -> step <= 0.82x HF checkpointing's, peak within
the device; T16 planning never runs out of memory, and the probe steps together take <= 4x a
checkpointed step. Steps run the model's own SDPA (the fastest): nothing here is compared bit for
bit; the planner's CPU and GPU tests check gradients at sizes where plain fits.

Writes benchmarks/results/long_context.json and, with matplotlib, the .png beside it, and prints
last a row for the README's results table.

    python benchmarks/long_context.py                 # on the H100 (a few minutes)
    python benchmarks/long_context.py --ks 8 --no-selective
    python benchmarks/long_context.py --allocator expandable   # expandable segments for all
    python benchmarks/long_context.py --cpu-smoke     # tiny check of the script, no GPU
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT_OF_MEMORY, RESULTS_DIR, Env, exit_status, fmt_gib, free_memory, gib, make_parser, plot_rows, print_table,
    setup, verdict, write_json,
)
from measure import timed_row  # noqa: E402
from workloads import LlamaSpec, hf_checkpointing, llama_step, long_1b, scale_for  # noqa: E402

import offload  # noqa: E402

SMOKE_SEQ = 64
# A planner that has not planned after this many steps is reported as a failure, not waited for.
MAX_PLANNING_STEPS = 8
PLANS = (("plan @ device", "device"), ("plan @ lowest", "lowest"))
CKPT = "HF checkpointing"
T15_STEP = 0.82  # plan @ device's step / checkpointing's
T16_PLANNING = 4.0  # planning time / checkpointing's step


class ContenderContext:
    """The wrapper ``llama_step`` enters around each forward: an offload context made by ``make``
    inside the contender's error handling (:meth:`open`), and a clock that notes when a plan is
    first in force.

    ``OffloadActivations`` makes its plan between steps or at a step's entry, after its probe
    steps, so ``ctx.plan`` is read before and after each entry; the GPU is synchronised once, at
    that moment, so that the probe steps' queued GPU work counts in the planning time.
    """

    def __init__(self, env: Env, make: Callable[[], Any]) -> None:
        self.env, self.make = env, make
        self.ctx: Any = None
        self.started = 0.0
        self.entries = 0
        self.planned_at: Optional[float] = None
        self.planned_entry: Optional[int] = None  # the entry (from 1) of the first planned step
        self.planning_peak: Optional[int] = None

    def open(self) -> None:
        """Make the context; the planning clock and peak count start just before."""
        if self.env.cuda:
            torch.cuda.reset_peak_memory_stats(self.env.device)
        self.started = time.perf_counter()
        self.ctx = self.make()

    def close(self) -> None:
        """Close the context (its hooks, recompute wrappers and idle pinned blocks go)."""
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None

    def _note_plan(self) -> None:
        if self.planned_at is None and self.ctx.plan is not None:
            self.env.sync()
            self.planned_at = time.perf_counter()
            self.planned_entry = self.entries

    def _note_peak(self) -> None:
        # Read before the context's entry: with measure_peak it resets the counter there, so each
        # reading covers the step before it.
        if self.env.cuda:
            self.planning_peak = max(self.planning_peak or 0, torch.cuda.max_memory_allocated(self.env.device))

    def __call__(self) -> "ContenderContext":
        return self

    def __enter__(self) -> Any:
        self.entries += 1
        if self.planned_at is None:
            self._note_peak()
        self._note_plan()  # made between steps
        self.ctx.__enter__()
        self._note_plan()  # made at this step's entry
        return self.ctx

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)


def plan_first(wrapper: ContenderContext, step: Callable[[], None], row: dict[str, Any]) -> None:
    """Make the context and run steps until its plan is in force; planning figures into ``row``.

    The step during which the plan came into force ran planned: it is a warm-up step of the
    planned phase, not a probe step.
    """
    wrapper.open()
    for _ in range(MAX_PLANNING_STEPS):
        if wrapper.planned_at is not None:
            break
        step()
    if wrapper.planned_at is None:
        raise RuntimeError(f"no plan after {MAX_PLANNING_STEPS} steps (ctx.plan is still None)")
    row.update(planning_s=wrapper.planned_at - wrapper.started, probe_steps=wrapper.planned_entry - 1,
               planning_peak_bytes=wrapper.planning_peak, planning_peak_gib=gib(wrapper.planning_peak))
    print(f"  {row['variant']}: planned after {row['probe_steps']} probe steps, {row['planning_s']:.1f} s, "
          f"peak while planning {fmt_gib(row['planning_peak_gib'])}", flush=True)


def offload_row(env: Env, model: Any, ids: torch.Tensor, label: str, make: Callable[[], Any], *,
                planned: bool = False, **extra: Any) -> dict[str, Any]:
    """One offload contender: the context ``make`` returns, around each forward (planning first
    when ``planned``); the plan's description and table go into the row; the context is closed."""
    wrapper = ContenderContext(env, make)
    step = llama_step(model, ids, wrapper)

    def before(row: dict[str, Any]) -> None:
        if planned:
            plan_first(wrapper, step, row)
        else:
            wrapper.open()

    try:
        row = timed_row(env, label, step, before=before, **extra)
        if planned and "error" in row:
            row["failed_in"] = "planned steps" if "planning_s" in row else "planning"
        plan = getattr(wrapper.ctx, "plan", None)
        if plan is not None:
            row.update(plan=plan.describe(), budget_reason=plan.budget_reason,
                       predicted_step_ms=plan.prediction.step_ms, predicted_peak_bytes=plan.prediction.peak_bytes,
                       plan_report=wrapper.ctx.plan_report())
            print(row["plan_report"], flush=True)
    finally:
        wrapper.close()
        free_memory(env)
    return row


def model_state(model: torch.nn.Module) -> set[str]:
    """What a contender may leave on the model: instance ``forward`` wrappers, module hooks, HF
    checkpointing. Compared before and after each contender (they must all be undone)."""
    state = {f"{name or 'model'}.forward replaced" for name, m in model.named_modules() if "forward" in m.__dict__}
    state |= {f"{name or 'model'} hooks" for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks}
    # transformers 5.24 renamed is_gradient_checkpointing (deprecated there) is_activation_checkpointing.
    name = "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(model, name, False):
        state.add("HF checkpointing on")
    return state


def selective_option(no_selective: bool) -> tuple[dict[str, Any], str]:
    """The plans' ``selective=`` keyword (only where ``OffloadActivations`` takes it) and a note."""
    if "selective" not in inspect.signature(offload.OffloadActivations).parameters:
        note = "this offload's OffloadActivations takes no selective= (the planner chooses no selective recompute)"
        return {}, note + ("; --no-selective has no effect" if no_selective else "")
    if no_selective:
        return {"selective": False}, "selective=False (--no-selective)"
    return {}, "selective= not passed (the default candidates)"


def run_contenders(env: Env, spec: LlamaSpec, ks: list[int], plan_kw: dict[str, Any]) -> list[dict[str, Any]]:
    """Every contender on one model, in one process; their rows."""
    print(f"\n{spec.describe()}", flush=True)
    model, ids = spec.build(env.device)
    layers = model.model.layers
    options: dict[str, Any] = {"device": env.offload_device}
    if env.smoke:
        options["min_offload_bytes"] = 0  # the tiny tensors would all stay on the device
    rows: list[dict[str, Any]] = []
    clean = model_state(model)

    def add(row: dict[str, Any], expected: Optional[set[str]] = None) -> None:
        left = sorted(model_state(model) - (clean if expected is None else expected))
        if left:  # the next contender would run on a changed model: say so in the results
            row["left_on_model"] = left
            print(f"  !! {row['variant']} left on the model: {', '.join(left)}", flush=True)
        rows.append(row)

    add(timed_row(env, "plain", llama_step(model, ids), kind="baseline"))
    with hf_checkpointing(model):
        row = timed_row(env, CKPT, llama_step(model, ids), kind="baseline")
    add(row)
    add(offload_row(env, model, ids, "offload all but the last", lambda: offload.OffloadActivations(layers, num_offload_layers=len(layers) - 1, **options),
                    kind="offload", k=len(layers) - 1))
    with offload.selective_recompute([layer.mlp for layer in layers]):
        wrapped = model_state(model)  # the MLPs' wrappers stay until the last mix
        for k in ks:
            add(offload_row(env, model, ids, f"MLP selective + offload k={k}",
                            lambda k=k: offload.OffloadActivations(layers, num_offload_layers=k, **options),
                            kind="offload", k=k), wrapped)
    for label, budget in PLANS:
        if budget == "device" and not env.cuda:
            note = "skipped: memory_budget_bytes='device' needs a CUDA device"
            print(f"  {label:<34} {note}", flush=True)
            rows.append({"variant": label, "kind": "plan", "budget": budget, "skipped": note})
            continue
        add(offload_row(env, model, ids, label,
                        lambda budget=budget: offload.OffloadActivations(
                            layers, memory_budget_bytes=budget, measure_peak=True, **plan_kw, **options),
                        planned=True, kind="plan", budget=budget))
    del model, ids, layers
    free_memory(env)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Step and peak as multiples of HF checkpointing's, and planning in checkpointed steps."""
    ckpt = next((r for r in rows if r["variant"] == CKPT and r.get("step_ms")), None)
    if ckpt is None:
        return None
    for r in rows:
        if r.get("step_ms"):
            r["x_ckpt"] = r["step_ms"] / ckpt["step_ms"]
        if r.get("peak_bytes") and ckpt.get("peak_bytes"):
            r["peak_x_ckpt"] = r["peak_bytes"] / ckpt["peak_bytes"]
        if r.get("planning_s") is not None:
            r["planning_x_ckpt_step"] = r["planning_s"] * 1e3 / ckpt["step_ms"]
    return ckpt


def check_targets(rows: list[dict[str, Any]], ckpt: Optional[dict[str, Any]], capacity: Optional[int]) -> list[dict[str, Any]]:
    """T15 on the plan at "device", T16 on both plans; printed as PASS / MISS / n/a with the figures."""
    by = {r["variant"]: r for r in rows}
    out: list[dict[str, Any]] = []
    dev = by.get("plan @ device")
    if dev is not None and not dev.get("skipped"):
        if "error" in dev:
            out.append({"target": "T15", "figure": f"plan @ device: {status(dev)}", "ok": False})
        elif ckpt is None:
            out.append({"target": "T15", "figure": "HF checkpointing not measured", "ok": None})
        else:
            within = capacity is None or dev["peak_bytes"] is None or dev["peak_bytes"] <= capacity
            shown_cap = "-" if capacity is None else f"{gib(capacity):.1f} GiB"
            out.append({"target": "T15", "ok": dev["x_ckpt"] <= T15_STEP and within,
                        "figure": f"step {dev['x_ckpt']:.3f}x HF checkpointing's (<= {T15_STEP}), peak "
                                  f"{fmt_gib(dev.get('peak_gib'))} of the device's {shown_cap}"})
    for label, _ in PLANS:
        r = by.get(label)
        if r is None or r.get("skipped"):
            continue
        name = f"T16 ({label})"
        if "planning_s" not in r:
            out.append({"target": name, "figure": status(r), "ok": False})
        elif ckpt is None:
            out.append({"target": name, "figure": f"planning {r['planning_s']:.1f} s; HF checkpointing not measured", "ok": None})
        else:
            out.append({"target": name, "ok": r["planning_x_ckpt_step"] <= T16_PLANNING,
                        "figure": f"planning {r['planning_s']:.1f} s = {r['planning_x_ckpt_step']:.2f}x a checkpointed "
                                  f"step (<= {T16_PLANNING:g}), {r['probe_steps']} probe steps, peak while planning "
                                  f"{fmt_gib(r.get('planning_peak_gib'))}"})
    print()
    for t in out:
        print(f"  {t['target']:<24} {verdict(t['ok'])}  {t['figure']}")
    return out


def status(row: dict[str, Any]) -> str:
    """A row's failure (and when a plan failed: while planning or in its planned steps), or why
    it was skipped; empty when measured."""
    if "error" in row:
        return row["error"] + (f" (in {row['failed_in']})" if row.get("failed_in") else "")
    return row.get("skipped", "")


def readme_row(spec: LlamaSpec, rows: list[dict[str, Any]]) -> str:
    """The README results table's row for this run (plain does not fit: seconds, and offload as
    multiples of HF checkpointing's step)."""
    by = {r["variant"]: r for r in rows}

    def absolute(r: Optional[dict[str, Any]]) -> str:
        if r is None or "error" in r:
            return "does not fit" if r is not None and r["error"] == OUT_OF_MEMORY else ""
        return f"{r['step_ms'] / 1e3:.2f} s, {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else f"{r['step_ms'] / 1e3:.2f} s"

    def relative(r: dict[str, Any]) -> str:
        if "error" in r:
            return status(r)
        peak = f", {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
        return f"{r['x_ckpt']:.2f}x{peak}" if r.get("x_ckpt") is not None else f"{r['step_ms'] / 1e3:.2f} s{peak}"

    parts = []
    for label, name in (("plan @ device", "@ device"), ("plan @ lowest", "lowest")):
        r = by.get(label)
        if r is not None and not r.get("skipped"):
            planning = f" (planning {r['planning_s']:.1f} s)" if r.get("planning_s") is not None and "error" not in r else ""
            parts.append(f"{name}: {relative(r)}{planning}")
    mixes = [r for r in rows if r["variant"].startswith("MLP selective + offload") and r.get("x_ckpt") is not None]
    if mixes:
        xs, peaks = [r["x_ckpt"] for r in mixes], [r["peak_gib"] for r in mixes if r.get("peak_gib") is not None]
        shown = f", {min(peaks):.0f}-{max(peaks):.0f} GiB" if peaks else ""
        parts.append(f"MLP selective + offload, by hand: {min(xs):.2f}-{max(xs):.2f}x{shown}")
    r = by.get("offload all but the last")
    if r is not None:
        parts.append(f"all but the last layer offloaded: {relative(r)}")
    cell = "; ".join(parts) + (" (x HF checkpointing's step)" if parts else "")
    return f"| HF Llama 1B, seq {spec.seq}, batch {spec.batch} | {absolute(by.get('plain'))} | {absolute(by.get(CKPT))} | | | {cell} |"


def plot(spec: LlamaSpec, rows: list[dict[str, Any]], path: Path) -> Optional[Path]:
    """Step time (as a multiple of HF checkpointing's: plain does not fit) against peak."""
    return plot_rows({f"{spec.name}, seq {spec.seq}": rows}, path, ratio="x_ckpt", baseline="HF checkpointing")


def main() -> int:
    parser = make_parser(__doc__, warmup=1, steps=3, smoke_warmup=1, smoke_steps=1)
    parser.add_argument("--seq", type=int, default=None, help=f"sequence length (default 49152; {SMOKE_SEQ} with --cpu-smoke)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ks", default="4,8,15", help="layers offloaded with every MLP under selective recompute")
    parser.add_argument("--no-selective", action="store_true",
                        help="pass selective=False to the plans (where OffloadActivations takes it)")
    parser.add_argument("--allocator", choices=("default", "expandable"), default="default",
                        help="'expandable': PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every "
                             "contender (set before CUDA starts; the 'device' budget then leaves 5%%, not 15%%)")
    early, _ = parser.parse_known_args()
    if early.allocator == "expandable":
        # Read by the caching allocator when CUDA first allocates, which has not happened yet.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env = setup(parser)
    args = env.args
    spec = long_1b(scale_for(env.smoke))
    spec = dataclasses.replace(spec, seq=args.seq or (SMOKE_SEQ if env.smoke else spec.seq), batch=args.batch)
    ks = [k for k in (int(k) for k in args.ks.split(",") if k) if 0 < k < spec.layers]
    plan_kw, selective_note = selective_option(args.no_selective)
    print(f"plans: {selective_note}", flush=True)
    capacity = torch.cuda.get_device_properties(env.device).total_memory if env.cuda else None

    rows = run_contenders(env, spec, ks, plan_kw)
    ckpt = add_ratios(rows)
    shown = [{**r, "status": status(r)} for r in rows]
    print_table(f"{spec.name}: step and peak (ratios to HF checkpointing, one process)", shown, [
        ("variant", "contender", ""), ("step_ms", "step ms", ".1f"), ("x_ckpt", "x ckpt", ".3f"),
        ("peak_gib", "peak GiB", ".2f"), ("peak_x_ckpt", "peak x ckpt", ".2f"), ("planning_s", "planning s", ".1f"),
        ("status", "status", ""), ("plan", "plan", ""),
    ])
    targets = check_targets(rows, ckpt, capacity)
    row_md = readme_row(spec, rows)
    write_json("long_context", env, {"workload": spec.describe(), "selective": selective_note,
                                     "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
                                     "device_capacity_bytes": capacity, "rows": rows, "targets": targets,
                                     "readme_row": row_md})
    if not args.no_json:
        folder = RESULTS_DIR / "smoke" if env.smoke else RESULTS_DIR
        plot(spec, rows, folder / f"{args.name or 'long_context'}.png")
    print("\nREADME results row (paste after the GPU run):")
    print(row_md)
    # Out of memory is a result here (plain is expected not to fit); anything else is a failure.
    return exit_status([r["variant"] for r in rows if r.get("error") not in (None, OUT_OF_MEMORY)])


if __name__ == "__main__":
    sys.exit(main())
