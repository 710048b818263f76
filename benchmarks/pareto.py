"""Step time against peak memory on real model code: LLAMA-1B and LLAMA-2B (HF transformers).

Contenders, side by side in one process per model:
  plain; HF checkpointing (``workloads.hf_checkpointing``: non-reentrant);
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``; ``OffloadActivations`` with a fixed
  number of offloaded layers (``--ks``); the planner (``offload.planner``) at the budgets
  75% of plain's peak, checkpointing's peak, and the lowest reachable peak; selective recompute
  (``offload.selective_recompute``) of every layer's MLP, alone and with ``--selective-ks``
  layers offloaded; and the same policy around whole layers (torch's selective activation
  checkpointing as a user would apply it to each decoder layer).

Targets (docs/benchmarks.md): T8 budget = checkpointing's peak -> step <= 1.20x plain; T9 lowest plan ->
peak <= 0.97x checkpointing's at <= 1.03x its step; T10 budget = 75% of plain -> step <= 1.05x
plain; T11 predicted step and peak within 10% of measured; T17 lowest plan -> peak <= 1.00x
checkpointing's. Gradients are checked bit for bit against plain on a small Llama with a
repeatable SDPA backend (efficient / math).

Writes benchmarks/results/pareto.json (or ``--name``'s) and, with matplotlib, the .png beside it.

    python benchmarks/pareto.py                       # both models on the GPU (over 10 minutes)
    python benchmarks/pareto.py --models llama_1b --skip-save-on-cpu --name pareto_llama_1b
                                                      # the committed results: one model per process
    python benchmarks/pareto.py --models llama_2b --ks 2,4,7
    python benchmarks/pareto.py --cpu-smoke           # tiny check of the script, no GPU
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS_DIR, Env, free_memory, make_parser, plot_rows, print_table, setup, verdict, write_json,
)
from measure import timed_row  # noqa: E402
from workloads import WORKLOADS, LlamaSpec, hf_checkpointing, llama_step, scale_for  # noqa: E402

import offload  # noqa: E402
from offload.planner import Action, LayerPlan, plan_for  # noqa: E402


def run_model(env: Env, spec: LlamaSpec, ks: list[int], selective_ks: list[int]) -> dict[str, Any]:
    print(f"\n{spec.describe()}", flush=True)
    model, ids = spec.build(env.device)
    layers = model.model.layers
    dev = env.offload_device
    rows: list[dict[str, Any]] = []

    rows.append(timed_row(env, "plain", llama_step(model, ids)))
    plain = rows[-1]
    with hf_checkpointing(model):
        rows.append(timed_row(env, "HF checkpointing", llama_step(model, ids)))
    ckpt = rows[-1]
    if not env.args.skip_save_on_cpu:
        rows.append(timed_row(env, "save_on_cpu", llama_step(model, ids, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))))
    for k in ks:
        oa = offload.OffloadActivations(layers, num_offload_layers=k, device=dev)
        rows.append(timed_row(env, f"offload k={k}", llama_step(model, ids, lambda oa=oa: oa), k=k))
        oa.close()
        del oa
    with offload.selective_recompute(list(layers)):
        rows.append(timed_row(env, "torch SAC, whole layers", llama_step(model, ids)))
    with offload.selective_recompute([layer.mlp for layer in layers]):
        for k in selective_ks:
            if k == 0:
                rows.append(timed_row(env, "MLP selective", llama_step(model, ids)))
                continue
            oa = offload.OffloadActivations(layers, num_offload_layers=k, device=dev)
            rows.append(timed_row(env, f"MLP selective + offload k={k}", llama_step(model, ids, lambda oa=oa: oa), k=k))
            oa.close()
            del oa

    # The planner: one probe, then a plan per budget; then the same with every MLP under
    # selective recompute (the probe measures its caches, the plans count them).
    budgets: list[tuple[str, Any]] = []
    if plain.get("peak_bytes"):
        budgets.append(("75% of plain", int(0.75 * plain["peak_bytes"])))
    if ckpt.get("peak_bytes"):
        budgets.append(("checkpointing's peak", int(ckpt["peak_bytes"])))
    budgets.append(("lowest", "lowest"))
    profile = offload.planner.profile_step(layers, llama_step(model, ids), device=dev)
    free_memory(env)
    if env.smoke:  # no peak on the host: plan at fractions of the activations instead
        budgets = [("half", profile.plain_peak_bytes // 2), ("lowest", "lowest")]
    plans = plan_rows(env, model, ids, layers, profile, budgets, rows, "")
    with offload.selective_recompute([layer.mlp for layer in layers]):
        sel_profile = offload.planner.profile_step(layers, llama_step(model, ids), device=dev)
        free_memory(env)
        sel_plans = plan_rows(env, model, ids, layers, sel_profile, budgets, rows, " (MLP selective)")

    base = plain.get("step_ms")
    for r in rows:
        if base and r.get("step_ms"):
            r["x_plain"] = r["step_ms"] / base
    print_table(f"{spec.name}: step and peak (ratios to plain, one process)", rows, [
        ("variant", "contender", ""), ("step_ms", "step ms", ".1f"), ("x_plain", "x plain", ".2f"),
        ("peak_gib", "peak GiB", ".2f"), ("plan", "plan", ""),
    ])
    targets = check_targets(plain, ckpt, plans)
    print("  with every MLP under selective recompute:")
    sel_targets = check_targets(plain, ckpt, sel_plans)
    del model
    free_memory(env)
    return {"workload": spec.describe(), "rows": rows, "profile": profile_summary(profile), "targets": targets,
            "selective_profile": profile_summary(sel_profile), "selective_targets": sel_targets}


def plan_rows(env: Env, model: Any, ids: Any, layers: Any, profile: Any, budgets: list[tuple[str, Any]],
              rows: list[dict[str, Any]], suffix: str) -> list[tuple[str, dict[str, Any]]]:
    """A plan per budget from ``profile``, each run and timed; rows appended to ``rows``."""
    plans = []
    for label, budget in budgets:
        name = f"plan @ {label}{suffix}"
        try:
            plan = offload.planner.choose(profile, budget)
        except ValueError as exc:
            rows.append({"variant": name, "error": str(exc)})
            print(f"  {name}: {exc}")
            continue
        oa = offload.OffloadActivations(layers, plan=plan, device=env.offload_device, measure_peak=True)
        row = timed_row(env, name, llama_step(model, ids, lambda oa=oa: oa), budget=budget,
                        plan=plan.describe(), predicted_step_ms=plan.prediction.step_ms,
                        predicted_peak_bytes=plan.prediction.peak_bytes)
        if "error" not in row:
            row["table"] = plan.table(measured={"step_ms": row["step_ms"], "peak_bytes": row["peak_bytes"]})
            print(row["table"])
        rows.append(row)
        plans.append((label, row))
        oa.close()
        del oa
    return plans


def profile_summary(profile: Any) -> dict[str, Any]:
    return {
        "layers": [{"saved_bytes": l.saved_bytes, "input_bytes": l.input_bytes, "forward_ms": l.forward_ms,
                    "backward_ms": l.backward_ms, "slots": len(l.slot_bytes), "forward_peak_bytes": l.forward_peak_bytes,
                    "backward_peak_bytes": l.backward_peak_bytes, "grad_bytes": l.grad_bytes} for l in profile.layers],
        "head_residual_bytes": profile.head_residual_bytes,
        "recompute_factor": profile.recompute_factor, "recompute_time_factor": profile.recompute_time_factor,
        "link": vars(profile.link) if hasattr(profile.link, "__dict__") else repr(profile.link),
        "base_bytes": profile.base_bytes, "head_bytes": profile.head_bytes, "pre_ms": profile.pre_ms,
        "head_ms": profile.head_ms, "post_ms": profile.post_ms, "plain_step_ms": profile.plain_step_ms,
        "plain_peak_bytes": profile.plain_peak_bytes,
    }


def check_targets(plain: dict[str, Any], ckpt: dict[str, Any], plans: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    by = dict(plans)

    def ok(v: Optional[bool]) -> Optional[bool]:
        return v

    p_ms, c_ms, c_peak = plain.get("step_ms"), ckpt.get("step_ms"), ckpt.get("peak_bytes")
    r = by.get("checkpointing's peak")
    if r and p_ms and r.get("step_ms"):
        out.append({"target": "T8", "figure": f"{r['step_ms'] / p_ms:.3f}x plain (ckpt {c_ms / p_ms:.3f}x)", "ok": ok(r["step_ms"] <= 1.20 * p_ms)})
    r = by.get("lowest")
    if r and c_peak and c_ms and r.get("peak_bytes"):
        out.append({"target": "T9", "figure": f"peak {r['peak_bytes'] / c_peak:.3f}x ckpt, step {r['step_ms'] / c_ms:.3f}x ckpt",
                    "ok": ok(r["peak_bytes"] <= 0.97 * c_peak and r["step_ms"] <= 1.03 * c_ms)})
        out.append({"target": "T17", "figure": f"lowest plan's peak {r['peak_bytes'] / c_peak:.3f}x ckpt's (<= 1.00)",
                    "ok": ok(r["peak_bytes"] <= c_peak)})
    r = by.get("75% of plain")
    if r and p_ms and r.get("step_ms"):
        out.append({"target": "T10", "figure": f"{r['step_ms'] / p_ms:.3f}x plain", "ok": ok(r["step_ms"] <= 1.05 * p_ms)})
    for label, r in plans:
        if r.get("step_ms") and r.get("peak_bytes"):
            e_t = r["predicted_step_ms"] / r["step_ms"] - 1
            e_p = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
            out.append({"target": f"T11 ({label})", "figure": f"step {e_t:+.1%}, peak {e_p:+.1%}", "ok": abs(e_t) <= 0.10 and abs(e_p) <= 0.10})
    for t in out:
        print(f"  {t['target']:<28} {verdict(t['ok'])}  {t['figure']}")
    return out


def check_gradients(env: Env) -> dict[str, Any]:
    """Plain twice (repeatable?), then fixed k, the lowest plan and a mixed plan, bit for bit."""
    spec = LlamaSpec("LLAMA-small", hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, batch=2, seq=256, vocab=1024, dtype=torch.float32 if env.smoke else torch.bfloat16)
    model, ids = spec.build(env.device)
    layers = model.model.layers
    ctx = contextlib.nullcontext()
    if env.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def grads(wrapper: Any = None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with wrapper if wrapper is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    result: dict[str, Any] = {}
    with ctx:
        expected = grads()
        result["plain repeats"] = same(expected, grads())
        kw = {"device": env.offload_device, "min_offload_bytes": 0}
        oa = offload.OffloadActivations(layers, num_offload_layers=3, **kw)
        result["fixed k=3"] = all(same(expected, grads(oa)) for _ in range(2))
        profile = offload.planner.profile_step(layers, lambda: grads(), device=env.offload_device, min_offload_bytes=0)
        for name, made in (
            ("plan lowest", offload.planner.choose(profile, "lowest")),
            ("plan mixed", plan_for(profile, [LayerPlan(Action.RECOMPUTE), LayerPlan(Action.OFFLOAD),
                                              LayerPlan(Action.OFFLOAD, max(profile.layers[2].slot_bytes)), LayerPlan(Action.KEEP)])),
        ):
            oa = offload.OffloadActivations(layers, plan=made, **kw)
            result[name] = all(same(expected, grads(oa)) for _ in range(2))
            oa.close()
        with offload.selective_recompute([layer.mlp for layer in layers]):
            result["MLP selective"] = same(expected, grads())
            oa = offload.OffloadActivations(layers, num_offload_layers=3, **kw)
            result["MLP sel. + k=3"] = all(same(expected, grads(oa)) for _ in range(2))
            oa.close()
            sel = offload.planner.profile_step(layers, lambda: grads(), device=env.offload_device, min_offload_bytes=0)
            oa = offload.OffloadActivations(layers, plan=offload.planner.choose(sel, "lowest"), **kw)
            result["MLP sel. + plan"] = all(same(expected, grads(oa)) for _ in range(2))
            oa.close()
    print("\nGradients bit for bit against plain (small Llama, repeatable SDPA):")
    for k, v in result.items():
        print(f"  {k:<16} {'equal' if v else 'DIFFERENT'}")
    del model
    free_memory(env)
    return result


def plot(results: dict[str, Any], path: Path) -> Optional[Path]:
    """Step time against peak per model (``common.plot_rows``)."""
    return plot_rows({name: result["rows"] for name, result in results.items()
                      if isinstance(result, dict) and result.get("rows")}, path)


def main() -> None:
    parser = make_parser(__doc__, warmup=2, steps=3, smoke_warmup=1, smoke_steps=1)
    parser.add_argument("--models", default="llama_1b,llama_2b")
    parser.add_argument("--ks", default=None, help="fixed offload counts (default: 4,8,12,15 for 1B; 2,4,6,7 for 2B)")
    parser.add_argument("--selective-ks", default=None,
                        help="offload counts run with every MLP under selective recompute (0: none offloaded; "
                             "default: 0,4,8,12 for 1B; 0,2,4,6 for 2B)")
    parser.add_argument("--skip-save-on-cpu", action="store_true", help="leave out save_on_cpu (slow: 5-7x)")
    parser.add_argument("--no-grad-check", action="store_true")
    env = setup(parser)
    results: dict[str, Any] = {}
    if not env.args.no_grad_check:
        results["gradients"] = check_gradients(env)
    defaults = {"llama_1b": [4, 8, 12, 15], "llama_2b": [2, 4, 6, 7]}
    selective_defaults = {"llama_1b": [0, 4, 8, 12], "llama_2b": [0, 2, 4, 6]}
    for name in env.args.models.split(","):
        spec = WORKLOADS[name](scale_for(env.smoke))
        ks = [int(k) for k in env.args.ks.split(",")] if env.args.ks else defaults.get(name, [spec.layers - 1])
        ks = [k for k in ks if 0 < k < spec.layers]
        sel = ([int(k) for k in env.args.selective_ks.split(",")] if env.args.selective_ks
               else selective_defaults.get(name, [0, spec.layers // 2]))
        sel = [k for k in sel if 0 <= k < spec.layers]
        results[name] = run_model(env, spec, ks, sel)
    write_json(env.args.name or "pareto", env, {"results": results})
    if not env.args.no_json:
        plot(results, (RESULTS_DIR / "smoke" if env.smoke else RESULTS_DIR) / f"{env.args.name or 'pareto'}.png")


if __name__ == "__main__":
    main()
