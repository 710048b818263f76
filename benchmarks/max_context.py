"""The longest context one GPU trains (batch 1, bf16, SDPA), method by method (T20, T21, T27).

Methods (``--methods``, comma-separated):

  hf_ckpt       HF's own activation checkpointing, non-reentrant (``workloads.hf_checkpointing``)
  hf_offload    the same with HF's ``offload=True`` (the checkpoints' saved inputs in pinned host
                memory through ``save_on_cpu``), where the installed transformers has it
                (``activation_checkpointing_enable(..., offload=True)``); otherwise recorded as
                "unsupported by transformers X.Y", not run
  ours          ``with offload.OffloadActivations(model.model.layers, model=model):`` around the
                forward (the default budget: "device" on CUDA); where this offload takes no
                ``model=`` (a TypeError naming it), the same without, and the run says so
  ours_lowest   the same with ``memory_budget_bytes="lowest"``

Models (``--models``): ``llama_1b`` (LLAMA-1B's shape, every weight trains) and ``llama_8b_shape``
(Llama-3-8B's shape, vocab 128256, base frozen: only the RMSNorm weights train). Both are built on
the GPU in bf16 directly (``init_in_dtype=True``), batch 1. One training step as in
``device_everywhere.py``: loss, backward, gradients to None; no optimizer (activations are what
the length is limited by).

One process per (model, method, length) (``workers.py``: an out-of-memory error inside HF code
can leave memory behind). A worker runs ``--steps`` (2) steps and stops at the first failure (a
planned context goes on until a step ran under its plan, 8 steps at most: one whose plan never
came did not train). Per step: wall time (synchronised), peak ``max_memory_allocated`` (reset at
the step's start), host RSS peak (psutil, sampled), the plan in force, the failure (out of memory,
``BudgetError``, another error). Per run: for ours the plan (``describe()``), its table
(``plan_report()``), the engine's report and the planning seconds; T27 = (first step - second) /
second, in steps; which SDPA backend this torch picks for the model's q, k, v at that length
(``torch._fused_sdp_choice``; on CUDA also ``torch.backends.cuda.can_use_*``): the math backend,
O(T^2) in memory, must not be the one.

``--lengths L1,L2`` runs those lengths. Otherwise (``--search``, the default) per model and method:
double from ``--start`` until a length fails (or ``--max-length`` fits), then bisect between the
last success and the first failure to within 1/8 of the length (multiples of ``--multiple``, 1024);
if ``--start`` fails, halve first. ``--out`` is written after each run, and ``--reuse`` takes the
runs in it (a search over several commands). ``--timeout S`` kills a worker after S seconds (a
"timeout": that length did not train). ``--warmup`` is not used.

Prints a table (status, step s, peak GiB, host GiB, µs per token where >= 2 methods fit that
length), the longest length per model and method, and README rows; writes ``--out`` (default
benchmarks/results/max_context.json) and, with matplotlib, the .png beside it (length, log2).

    python benchmarks/max_context.py --models llama_1b --methods ours --lengths 524288 --timeout 560  # T20
    python benchmarks/max_context.py --models llama_8b_shape --methods ours --lengths 262144 --timeout 560  # T21
    python benchmarks/max_context.py --models llama_1b --methods hf_ckpt --reuse   # the search
    python benchmarks/max_context.py --smoke      # tiny models (on the CPU without CUDA)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import resource
import sys
import threading
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT_OF_MEMORY, RESULTS_DIR, Env, apply_defaults, exit_status, fmt, free_memory, gib, make_parser, print_table, setup,
    write_json,
)
from device_everywhere import after_failure, offload_options  # noqa: E402
from step_records import PlanWatch, make_train_step, measure_step, plan_fields  # noqa: E402
from workers import (  # noqa: E402
    add_worker_options, check_cuda_or_exit, parent_env, parent_meta, spawn, strip_parent_options, worker_env,
    worker_info, write_worker_result,
)
from workloads import LlamaSpec, hf_checkpointing, llama_1b, llama_8b_shape, scale_for, train_norms_only  # noqa: E402

SCRIPT = Path(__file__).resolve()
METHODS = ("hf_ckpt", "hf_offload", "ours", "ours_lowest")
MODELS: dict[str, tuple[Callable[[float], LlamaSpec], bool]] = {  # name: (spec, base frozen: norms train only)
    "llama_1b": (llama_1b, False), "llama_8b_shape": (llama_8b_shape, True)}
MAX_PLANNING_STEPS = 8  # a context with no plan in force after this many steps is a failure
PRECISION = 1 / 8  # the search stops when the failure is within this fraction of the success
# (start, max length, multiple): on the GPU, and for tiny models (--smoke / --cpu-smoke)
SEARCH_DEFAULTS = {False: (65536, 4 << 20, 1024), True: (32, 256, 16)}
OK, OOM, BUDGET, ERROR, TIMEOUT, UNSUPPORTED = "ok", "OOM", "BudgetError", "error", "timeout", "unsupported"
NOT_TRAINED = (OOM, BUDGET, ERROR, TIMEOUT)  # statuses of a length that did not train


# -- the search (pure) ------------------------------------------------------------------------------
@dataclasses.dataclass
class Search:
    """A search's outcome: the longest length that fit, the shortest tried above it that did not
    (None: ``limit`` fit, or nothing did), every ``(length, fit)`` in the order tried."""

    longest: Optional[int]
    first_failure: Optional[int]
    tried: list[tuple[int, bool]]


def search_longest(fits: Callable[[int], bool], start: int, *, limit: int, multiple: int = 1024,
                   precision: float = PRECISION) -> Search:
    """The longest length ``fits`` accepts: double from ``start`` until one fails (or ``limit``
    fits), halve instead when ``start`` fails, then bisect until the failure is within
    ``precision`` of the success (or one ``multiple`` above it). Lengths are multiples of
    ``multiple`` and each is asked once; ``fits`` is assumed monotone (what fits at L fits below)."""
    def snap(n: int) -> int:
        return max(multiple, n // multiple * multiple)

    tried: list[tuple[int, bool]] = []

    def ask(n: int) -> bool:
        ok = bool(fits(n))
        tried.append((n, ok))
        return ok

    top = snap(limit)
    lo: Optional[int] = None
    hi: Optional[int] = None
    n = min(snap(start), top)
    if ask(n):
        lo = n
        while lo < top:
            n = min(2 * lo, top)
            if not ask(n):
                hi = n
                break
            lo = n
    else:
        hi = n
        while hi > multiple:
            n = snap(hi // 2)
            if ask(n):
                lo = n
                break
            hi = n
    if lo is None or hi is None:
        return Search(lo, hi, tried)
    while hi - lo > max(multiple, lo * precision):
        mid = snap((lo + hi) // 2)
        if mid <= lo:
            break
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return Search(lo, hi, tried)


class Unsupported(Exception):
    """A method this environment cannot run (its note is the message): ends its search."""


# -- the worker --------------------------------------------------------------------------------------
def transformers_version() -> str:
    return importlib.import_module("transformers").__version__


def hf_offload_support() -> Optional[str]:
    """None where this transformers checkpoints with ``offload=True``; else why not."""
    from transformers import PreTrainedModel

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(PreTrainedModel, name, None)
        if enable is not None and "offload" in inspect.signature(enable).parameters:
            return None
    major_minor = ".".join(transformers_version().split(".")[:2])
    return f"unsupported by transformers {major_minor} (its checkpointing enable takes no offload=)"


@contextlib.contextmanager
def hf_offload_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """HF's checkpointing with ``offload=True`` (non-reentrant) inside the ``with``, through the
    enable that takes it (:func:`hf_offload_support`); only the checkpointing is undone after."""
    name = "gradient_checkpointing"
    if "offload" in inspect.signature(getattr(model, "activation_checkpointing_enable", lambda: None)).parameters:
        name = "activation_checkpointing"
    getattr(model, f"{name}_enable")(**{f"{name}_kwargs": {"use_reentrant": False}}, offload=True)
    try:
        yield
    finally:
        getattr(model, f"{name}_disable")()


class HostPeak:
    """The process's peak resident set inside the ``with`` (pinned host blocks count once touched),
    sampled every ``interval_s`` by a thread with psutil; without psutil, the lifetime peak."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s, self.peak_bytes, self._stop = interval_s, 0, threading.Event()
        try:
            import psutil

            self._rss: Optional[Callable[[], int]] = lambda proc=psutil.Process(): proc.memory_info().rss
        except ImportError:
            self._rss = None
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self._rss())

    def __enter__(self) -> "HostPeak":
        if self._rss is not None:
            self.peak_bytes = self._rss()
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rss is None:
            self.peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            return
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._rss())


def sdpa_backend(spec: LlamaSpec, device: torch.device) -> dict[str, Any]:
    """Which SDPA backend this torch picks for the model's attention at ``spec.seq``: q, k, v of
    its head count and head dimension, causal, no mask (batch 1, no padding: HF passes none),
    grouped-query where HF's ``use_gqa_in_sdpa`` says so (else k and v repeated, as HF does).
    The tensors are one element expanded (no memory): shapes and dtype as the model's, strides not."""
    head_dim = spec.hidden // spec.heads
    out: dict[str, Any] = {"head_dim": head_dim, "chosen": "unknown"}

    def expanded(heads: int) -> torch.Tensor:
        one = torch.zeros(1, 1, 1, head_dim, device=device, dtype=spec.dtype, requires_grad=True)
        return one.expand(spec.batch, heads, spec.seq, head_dim)

    q, kv = expanded(spec.heads), expanded(spec.kv_heads)
    try:  # (attention_mask, key, value) in transformers 5.24, (attention_mask, key) before
        from transformers.integrations.sdpa_attention import use_gqa_in_sdpa
        tensors = (kv, kv)[:len(inspect.signature(use_gqa_in_sdpa).parameters) - 1]
        gqa = spec.kv_heads != spec.heads and bool(use_gqa_in_sdpa(None, *tensors))
    except (ImportError, TypeError, ValueError):
        gqa = False
    if not gqa:
        kv = expanded(spec.heads)
    out["enable_gqa"] = gqa
    try:
        index = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=gqa)
        out["chosen"] = torch.nn.attention.SDPBackend(index).name
    except (AttributeError, TypeError, RuntimeError, ValueError) as exc:
        out["chosen_error"] = f"{type(exc).__name__}: {exc}"
    if device.type == "cuda":
        cuda = torch.backends.cuda
        try:
            params = cuda.SDPAParams(q, kv, kv, None, 0.0, True, gqa)
            for name in ("flash", "efficient", "cudnn"):
                check = getattr(cuda, f"can_use_{name}_attention", None)
                out[name] = "unknown" if check is None else bool(check(params, False))
        except (AttributeError, TypeError, RuntimeError) as exc:
            out["can_use_error"] = f"{type(exc).__name__}: {exc}"
    out["math"] = None if out["chosen"] == "unknown" else out["chosen"] == "MATH"
    return out


def status_of(error: Optional[str]) -> str:
    """A step's failure as a status: OOM, BudgetError or error (None: ok). cuBLAS's and cuDNN's
    allocation failures are out of memory too."""
    if error is None:
        return OK
    if error.startswith(OUT_OF_MEMORY) or "out of memory" in error.lower() or "ALLOC_FAILED" in error:
        return OOM
    return BUDGET if error.startswith("BudgetError") else ERROR


def make_context(env: Env, method: str, model: torch.nn.Module) -> tuple[Any, str]:
    """Ours' ``OffloadActivations`` with ``model=``, or without where this offload lacks it; and
    what was passed."""
    import offload

    kw = offload_options(env)
    if method == "ours_lowest":
        kw["memory_budget_bytes"] = "lowest"
    try:
        return offload.OffloadActivations(model.model.layers, model=model, **kw), "passed"
    except TypeError as exc:
        if "'model'" not in str(exc):
            raise
        first = str(exc).split(";")[0]
        return offload.OffloadActivations(model.model.layers, **kw), f"not taken by this offload, run without ({first})"


def run_worker(env: Env, model_name: str, method: str, length: int, steps: int, tiny: bool) -> dict[str, Any]:
    """One (model, method, length) in this process: its steps and what they showed."""
    make, frozen = MODELS[model_name]
    spec = dataclasses.replace(make(scale_for(tiny)), batch=1, seq=length)
    result: dict[str, Any] = {"model": model_name, "method": method, "length": length, "info": worker_info(env),
                              "workload": spec.describe(), "frozen_base": frozen, "torch": torch.__version__,
                              "transformers": transformers_version(), "steps": []}
    if method == "hf_offload":
        note = hf_offload_support()
        if note is None and not env.cuda:
            note = "not run on the CPU: HF's offload pins host memory, which needs an accelerator"
        if note is not None:
            return {**result, "status": UNSUPPORTED, "note": note}
    result["sdpa"] = sdpa_backend(spec, env.device)
    ctx, planned = None, False
    try:
        model, ids = spec.build(env.device, init_in_dtype=True)
        result["trainable_params"] = train_norms_only(model) if frozen else sum(p.numel() for p in model.parameters())
        free_memory(env)
        if method.startswith("ours"):
            ctx, result["model_option"] = make_context(env, method, model)
        watch = PlanWatch(ctx)
        train = make_train_step(model, watch, None)
        on_failure = after_failure(env, model, None)
        wrap = {"hf_ckpt": hf_checkpointing, "hf_offload": hf_offload_checkpointing}.get(method)
        # A planned context (a budget given or defaulted) must show its plan: steps go on past
        # --steps until one ran under it (its probe steps may take more than the first).
        planned = ctx is not None and getattr(ctx, "budget", None) is not None
        with wrap(model) if wrap is not None else contextlib.nullcontext():
            for i in range(max(steps, MAX_PLANNING_STEPS)):
                if i >= steps and not (planned and not result["steps"][-1].get("plan")):
                    break
                with HostPeak() as host:
                    rec = measure_step(env, lambda: train(ids), on_failure=on_failure)
                rec = {"step": i, **rec, "host_rss_peak_bytes": host.peak_bytes, **watch.at_entry}
                result["steps"].append(rec)
                shown = rec.get("error") or f"{rec['ms'] / 1e3:.2f} s, peak {fmt(gib(rec['peak_bytes']), '.2f')} GiB"
                print(f"  step {i}: {shown}, host {gib(host.peak_bytes):.2f} GiB  {rec.get('plan', '')}", flush=True)
                if "error" in rec:
                    break
    except Exception as exc:  # noqa: BLE001 - a failure outside a step (build, context) is this length's result
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"[:600]
    errors = [r["error"] + (f" ({r['detail']})" if r.get("detail") else "") for r in result["steps"] if "error" in r]
    if errors and "error" not in result:
        result["error"] = errors[0][:600]
    result["status"] = status_of(result.get("error"))
    if result["status"] == OK and planned and not result["steps"][-1].get("plan"):
        result.update(status=ERROR, error=f"no plan in force after {len(result['steps'])} steps")
    times = [r["ms"] for r in result["steps"] if "error" not in r]
    if len(times) >= 2:
        result["t27_steps"] = (times[0] - times[1]) / times[1]
    if ctx is not None:
        plan = getattr(ctx, "plan", None)
        report, table = getattr(ctx, "report", None), getattr(ctx, "plan_report", None)
        result.update(plan_fields(plan), plan_in_force=plan is not None, report=report() if report else None)
        if plan is not None and table is not None:
            result["plan_table"] = table()
            print(result["plan_table"], flush=True)
        planning = [r["planning_s"] for r in result["steps"] if r.get("planning_s") is not None]
        result["planning_s"] = planning[-1] if planning else None
        ctx.close()
    return result


# -- the parent: rows, table, README rows, plot ------------------------------------------------------------
def run_row(res: dict[str, Any]) -> dict[str, Any]:
    """A worker's result as a table row."""
    steps = [s for s in res.get("steps", []) if "error" not in s]
    peaks = [s["peak_bytes"] for s in res.get("steps", []) if s.get("peak_bytes") is not None]
    hosts = [s["host_rss_peak_bytes"] for s in res.get("steps", []) if s.get("host_rss_peak_bytes")]
    status = res.get("status") or (TIMEOUT if "killed after" in " ".join(res.get("output_tail", [])) else ERROR)
    return {"model": res["model"], "method": res["method"], "length": res["length"], "status": status,
            "step_s": steps[-1]["ms"] / 1e3 if steps else None, "first_step_s": steps[0]["ms"] / 1e3 if steps else None,
            "t27_steps": res.get("t27_steps"), "peak_gib": gib(max(peaks)) if peaks else None,
            "host_gib": gib(max(hosts)) if hosts else None, "planning_s": res.get("planning_s"), "plan": res.get("plan"),
            "sdpa": (res.get("sdpa") or {}).get("chosen"), "detail": res.get("note") or res.get("error")}


def add_time_per_token(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``us_per_token`` (the steady step over the length) at the (model, length)s where at least
    two methods fit; None elsewhere (one method alone has nothing to be compared with)."""
    fits = Counter((r["model"], r["length"]) for r in rows if r["status"] == OK)
    for r in rows:
        shared = r["status"] == OK and r.get("step_s") is not None and fits[(r["model"], r["length"])] >= 2
        r["us_per_token"] = r["step_s"] * 1e6 / r["length"] if shared else None
    return rows


def longest_per_method(rows: list[dict[str, Any]], limit: Optional[int] = None) -> list[dict[str, Any]]:
    """Per (model, method): the longest length that trained (with its step and peak), the shortest
    failure above it, whether it is ``limit`` (the search's cap: longer may fit), or its note."""
    out = []
    for key in dict.fromkeys((r["model"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["method"]) == key]
        ok = [r for r in mine if r["status"] == OK]
        best = max(ok, key=lambda r: r["length"]) if ok else None
        above = [r["length"] for r in mine if r["status"] in NOT_TRAINED and (best is None or r["length"] > best["length"])]
        unsupported = next((r["detail"] for r in mine if r["status"] == UNSUPPORTED), None)
        out.append({"model": key[0], "method": key[1], "longest": best and best["length"],
                    "step_s": best and best["step_s"], "peak_gib": best and best["peak_gib"],
                    "first_failure": min(above, default=None), "shortest_tried": min(r["length"] for r in mine),
                    "capped": best is not None and best["length"] == limit and not above, "unsupported": unsupported})
    return out


def tokens(n: int) -> str:
    """A length as the README writes it: 512K, 1M, 448K (exact below 1024)."""
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def longest_cell(entry: Optional[dict[str, Any]]) -> str:
    if entry is None:
        return ""
    if entry["unsupported"]:
        return entry["unsupported"].split(" (")[0]
    if entry["longest"] is None:
        return f"did not train at {tokens(entry['shortest_tried'])}"
    figures = ", ".join(x for x in (entry["step_s"] is not None and f"{entry['step_s']:.1f} s/step",
                                    entry["peak_gib"] is not None and f"{entry['peak_gib']:.1f} GiB") if x)
    bound = " (the cap; longer not tried)" if entry["capped"] else (
        f" ({tokens(entry['first_failure'])} did not)" if entry["first_failure"] else "")
    return f"{'>= ' if entry['capped'] else ''}{tokens(entry['longest'])} tokens{bound}" + (f", {figures}" if figures else "")


MODEL_LABELS = {"llama_1b": "HF Llama 1B (every weight trains)", "llama_8b_shape": "HF Llama-3-8B shape (base frozen)"}


def readme_rows(longest: list[dict[str, Any]]) -> list[str]:
    """The README results table's rows (workload | plain | HF checkpointing | torch selective |
    ``save_on_cpu`` | offload), one per model: the longest context each method trains."""
    rows = []
    for model in dict.fromkeys(e["model"] for e in longest):
        by = {e["method"]: e for e in longest if e["model"] == model}
        hf = longest_cell(by.get("hf_offload"))
        ours = "; ".join(f"{name}: {longest_cell(by[m])}" for m, name in (("ours", '@ `"device"`'), ("ours_lowest", "lowest"))
                         if m in by)
        rows.append(f"| {MODEL_LABELS.get(model, model)}, longest context, batch 1 | | {longest_cell(by.get('hf_ckpt'))} | | "
                    f"{'HF `offload=True`: ' + hf if hf else ''} | {ours} |")
    return rows


def plot(rows: list[dict[str, Any]], longest: list[dict[str, Any]], path: Path) -> Optional[Path]:
    """Length (x, log2) against method, one panel per model: trained (o), not (x), the longest
    trained per method (a star, labelled)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no plot: {exc}")
        return None
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 1.2 + 0.7 * len(METHODS) * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        methods = list(dict.fromkeys(r["method"] for r in rows if r["model"] == model))
        for y, method in enumerate(methods):
            mine = [r for r in rows if (r["model"], r["method"]) == (model, method) and r["status"] != UNSUPPORTED]
            for ok, marker, color in ((True, "o", "tab:green"), (False, "x", "tab:red")):
                xs = [r["length"] for r in mine if (r["status"] == OK) == ok]
                ax.scatter(xs, [y] * len(xs), marker=marker, color=color, zorder=2)
            best = next((e for e in longest if (e["model"], e["method"]) == (model, method)), None)
            if best and best["longest"]:
                ax.scatter([best["longest"]], [y], marker="*", s=220, color="tab:blue", zorder=3)
                ax.annotate(tokens(best["longest"]), (best["longest"], y), textcoords="offset points", xytext=(8, 6))
            elif best and best["unsupported"]:
                ax.annotate("unsupported", (0.02, y), xycoords=("axes fraction", "data"), va="center")
        ax.set_xscale("log", base=2)
        ax.set_yticks(range(len(methods)), methods)
        ax.set_ylim(-0.6, len(methods) - 0.4)
        ax.set_title(f"{model}: longest context trained (o trained, x not)")
        ax.set_xlabel("context length (tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def host_meta() -> dict[str, Any]:
    """The host's RAM and the transformers version (the GPU's name comes from the workers)."""
    try:
        import psutil

        ram = psutil.virtual_memory().total
    except ImportError:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"host_ram_gib": gib(ram), "transformers": transformers_version()}


def parse(argv: list[str]) -> tuple[Any, Any]:
    parser = make_parser(__doc__, warmup=0, steps=2, smoke_warmup=0, smoke_steps=2)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lengths", default=None, help="comma-separated lengths to run (instead of the search)")
    mode.add_argument("--search", action="store_true", help="search the longest length (the default)")
    parser.add_argument("--start", type=int, default=None, help="the search's first length (65536; 32 tiny)")
    parser.add_argument("--max-length", type=int, default=None, help="the search's cap (4194304; 256 tiny)")
    parser.add_argument("--multiple", type=int, default=None, help="searched lengths are multiples of it (1024; 16 tiny)")
    parser.add_argument("--smoke", action="store_true", help="tiny models (on the GPU, or the CPU without CUDA)")
    parser.add_argument("--timeout", dest="worker_timeout", type=float, default=None, help="per worker, seconds")
    parser.add_argument("--reuse", action="store_true", help="take lengths already in --out's JSON from it")
    parser.add_argument("--out", default=None, help="results file (default benchmarks/results/max_context.json)")
    add_worker_options(parser)
    return parser, parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, args = parse(argv)
    if args.smoke and not args.cpu_smoke and not torch.cuda.is_available():
        args.cpu_smoke = True
        argv.append("--cpu-smoke")
    tiny = args.smoke or args.cpu_smoke
    if args.worker is not None:  # a worker: "<model>:<method>:<length>"
        env = setup(parser, argv)
        model, method, length = args.worker.split(":")
        write_worker_result(args.worker_out, run_worker(env, model, method, int(length), env.args.steps, tiny))
        return 0
    check_cuda_or_exit(args, SCRIPT.name)
    apply_defaults(parser, args)
    env = parent_env(args)
    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in models if m not in MODELS] + [m for m in methods if m not in METHODS]
    if bad:
        parser.error(f"unknown models or methods: {bad}")
    start, limit, multiple = (a if a is not None else d for a, d in zip((args.start, args.max_length, args.multiple),
                                                                        SEARCH_DEFAULTS[tiny]))
    out = Path(args.out) if args.out else (RESULTS_DIR / "smoke" if tiny else RESULTS_DIR) / f"{args.name or 'max_context'}.json"
    # The parent's own options, flags first (strip_parent_options takes every name to have a value).
    base = strip_parent_options([a for a in argv if a not in ("--search", "--reuse")], (
        "--methods", "--models", "--lengths", "--start", "--max-length", "--multiple", "--out", "--jobs", "--timeout",
        "--worker-timeout"))
    extra_env = worker_env(env)
    runs: dict[str, dict[str, Any]] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.reuse and out.exists():
        runs.update(json.loads(out.read_text()).get("runs", {}))
    lock = threading.Lock()
    hf_note = hf_offload_support()

    def result(model: str, method: str, length: int) -> dict[str, Any]:
        label = f"{model}:{method}:{length}"
        with lock:
            if label in runs:
                return runs[label]
        if method == "hf_offload" and hf_note is not None:  # not worth a process
            res = {"model": model, "method": method, "length": length, "status": UNSUPPORTED, "note": hf_note}
        else:
            res = spawn(SCRIPT, [*base, "--worker", label], label, timeout=args.worker_timeout, extra_env=extra_env)
            res.update(model=model, method=method, length=length)
        with lock:
            runs[label] = res
            if not args.no_json:  # after each run: a command cut short leaves its runs for --reuse
                write_worker_result(str(out), {"runs": runs, "partial": "the runs so far; the summary is written last"})
        return res

    pairs = [(model, method) for model in models for method in methods]
    searches: dict[str, dict[str, Any]] = {}

    def one(pair: tuple[str, str]) -> None:
        model, method = pair
        if args.lengths:
            for length in (int(n) for n in args.lengths.split(",") if n):
                result(model, method, length)
            return

        def fits(n: int) -> bool:
            status = run_row(result(model, method, n))["status"]
            if status == UNSUPPORTED:  # no length will do: the search stops
                raise Unsupported(runs[f"{model}:{method}:{n}"].get("note", ""))
            return status == OK

        try:
            found = dataclasses.asdict(search_longest(fits, start, limit=limit, multiple=multiple))
        except Unsupported as exc:
            found = {"unsupported": str(exc)}
        searches.setdefault(model, {})[method] = found

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, pairs))
    order = {p: i for i, p in enumerate(pairs)}
    chosen = [r for r in runs.values() if (r["model"], r["method"]) in order]
    rows = add_time_per_token(sorted((run_row(r) for r in chosen), key=lambda r: (order[(r["model"], r["method"])], r["length"])))
    print_table("Longest context: each (model, method, length) in its own process", rows, [
        ("method", "method", ""), ("model", "model", ""), ("length", "length", ""), ("status", "status", ""),
        ("step_s", "step s", ".2f"), ("t27_steps", "T27 steps", ".2f"), ("peak_gib", "peak GiB", ".2f"),
        ("host_gib", "host GiB", ".2f"), ("us_per_token", "us/token", ".2f"), ("sdpa", "SDPA", ""), ("plan", "plan", "")])
    longest = longest_per_method(rows, None if args.lengths else limit)
    print_table("Longest trained per model and method", longest, [
        ("model", "model", ""), ("method", "method", ""), ("longest", "longest", ""), ("first_failure", "first failure", ""),
        ("step_s", "step s", ".2f"), ("peak_gib", "peak GiB", ".2f"), ("capped", "at the cap", ""), ("unsupported", "note", "")])
    md = readme_rows(longest)
    meta = {**parent_meta(env, chosen), **host_meta()}
    payload = {"mode": "lengths" if args.lengths else "search", "models": models, "methods": methods,
               "search": {"start": start, "max_length": limit, "multiple": multiple, "precision": PRECISION, "results": searches},
               "hf_offload": hf_note or "supported: activation_checkpointing_enable(offload=True)",
               "rows": rows, "longest": longest, "readme_rows": md, "runs": runs}
    if write_json("max_context", env, payload, meta=meta, path=out) is not None:
        plot(rows, longest, out.with_suffix(".png"))
    print("\nREADME results rows (paste after the GPU run):")
    print("\n".join(md))
    # OOM, BudgetError and timeouts are where a method stops: results. A worker that crashed or a
    # step that failed otherwise is a failure.
    return exit_status([f"{r['model']}:{r['method']}:{r['length']}" for r in rows if r["status"] == ERROR])


if __name__ == "__main__":
    sys.exit(main())
