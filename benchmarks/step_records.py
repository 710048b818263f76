"""One record per training step, for benchmarks that follow a stream of steps one by one
(``varlen.py``, ``device_everywhere.py``) rather than a median of identical steps.

* :func:`measure_step`: a step timed with ``synchronize`` + ``perf_counter`` (wall clock, host and
  GPU together, the optimizer included), its peak (``max_memory_allocated`` after
  ``reset_peak_memory_stats`` at the step's start) and reserved peak, the warnings it raised, and
  its failure: an out-of-memory error or a ``BudgetError`` is a result (recorded, not raised).
* :class:`PlanWatch`: the ``with`` put around each forward; enters the offload context and reads
  the plan in force just after the entry (plans are made at a step's entry), so each record says
  which plan its step ran (None: a probe step).
* :func:`plan_fields`: what a record keeps of a plan (description, budget reason, predictions).
* :func:`grad_digests`, :func:`sample_grads`, :func:`deterministic_attention`: the bitwise check.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from common import Env, failure, fmt

# The failures a step of a stream may end with and the stream goes on after: running out of
# memory (what the benchmarks measure) and the planner's refusal of a shape (``BudgetError``).
RECOVERABLE = ("out of memory", "BudgetError")
MAX_WARNINGS = 5  # distinct warning messages kept per step


def plan_fields(plan: Any) -> dict[str, Any]:
    """A plan as a record keeps it: ``plan`` (its description), ``budget_reason`` and the
    predicted step time and peak; empty for no plan. Read defensively: the planner evolves."""
    if plan is None:
        return {}
    out: dict[str, Any] = {"plan": plan.describe(), "budget_reason": getattr(plan, "budget_reason", None)}
    prediction = getattr(plan, "prediction", None)
    if prediction is not None:
        out["predicted_step_ms"] = getattr(prediction, "step_ms", None)
        out["predicted_peak_bytes"] = getattr(prediction, "peak_bytes", None)
    out["plan_budget_bytes"] = getattr(plan, "budget_bytes", None)
    return out


class PlanWatch:
    """The forward's ``with``: enters ``ctx`` (an ``OffloadActivations``, or None for no context)
    and notes ``ctx.plan`` at the forward's end (the plan for the step's shape is made at its
    first layer). ``at_entry`` holds the last step's :func:`plan_fields` (``{}``: a probe step),
    with ``planning_s``, the context's seconds spent planning so far, and ``plan_kind``."""

    def __init__(self, ctx: Any = None) -> None:
        self.ctx = ctx
        self.at_entry: dict[str, Any] = {}

    def __enter__(self) -> Any:
        self.at_entry = {}
        if self.ctx is None:
            return None
        entered = self.ctx.__enter__()
        self.at_entry = plan_fields(getattr(self.ctx, "plan", None))
        return entered

    def __exit__(self, *exc: Any) -> Any:
        if self.ctx is not None:
            # The plan this step followed: made (or taken from the cache) at its first layer's
            # entry, after the ``with``'s, so read at the forward's end.
            self.at_entry = plan_fields(getattr(self.ctx, "plan", None)) or self.at_entry
            planned = getattr(self.ctx, "_planned", None)
            if planned is not None and self.at_entry:
                self.at_entry["planning_s"] = getattr(planned, "planning_s", None)
                # "stand-in" (a new shape's, while its own plan is made and pinned) or "own".
                self.at_entry["plan_kind"] = (getattr(planned, "last_plan", None) or {}).get("plan", "own")
            return self.ctx.__exit__(*exc)
        return None


def clear_grads(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Gradients to None (also those a step left half set when it failed in backward)."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None


def make_train_step(model: torch.nn.Module, watch: PlanWatch, optimizer: Optional[torch.optim.Optimizer],
                    ) -> Callable[[torch.Tensor], Optional[float]]:
    """``step(ids)``: loss (``model(input_ids=ids, labels=ids).loss``) under ``watch``, backward,
    the optimizer's step if any, gradients to None. Returns the loss as a float (a tensor read
    after the step's timing: see :func:`measure_step`)."""

    def step(ids: torch.Tensor) -> Any:
        try:
            with watch:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            return loss.detach()
        finally:
            clear_grads(model, optimizer)

    return step


def measure_step(env: Env, fn: Callable[[], Any], *, on_failure: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Run one step and return its record: ``ms`` (synchronised wall clock), ``peak_bytes`` and
    ``reserved_peak_bytes`` (None on the CPU), ``warnings`` (messages raised in the step), and
    ``error`` when it failed (``"out of memory"``, or the exception's type and message) with the
    error's first line in ``detail``. ``fn``'s return value, when a tensor or number, is ``loss``.

    Out-of-memory and ``BudgetError`` failures are recorded and the stream goes on (a loop that
    catches them is what these benchmarks model); any other exception is re-raised after the
    record's cleanup, as a bug. ``on_failure`` runs after a failure (zero gradients, empty the
    cache), before the memory figures are read.
    """
    rec: dict[str, Any] = {}
    if env.cuda:
        env.sync()
        torch.cuda.reset_peak_memory_stats(env.device)
    out: Any = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            out = fn()
            env.sync()
        except Exception as exc:  # noqa: BLE001 - classified below
            rec["error"] = failure(exc)
            rec["detail"] = (str(exc).splitlines() or [""])[0][:400]
            if not rec["error"].startswith(RECOVERABLE):
                traceback.print_exc()
                raise
        # After the except block: the exception's traceback, whose frames hold the failed step's
        # tensors, is gone by now, so on_failure's empty_cache can give their memory back.
        if "error" in rec:
            if on_failure is not None:
                on_failure()
            env.sync()
        rec["ms"] = (time.perf_counter() - t0) * 1e3
    if isinstance(out, torch.Tensor):
        out = float(out)
    if isinstance(out, (int, float)):
        rec["loss"] = out
    rec["peak_bytes"] = torch.cuda.max_memory_allocated(env.device) if env.cuda else None
    rec["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(env.device) if env.cuda else None
    messages = list(dict.fromkeys(str(w.message)[:300] for w in caught))
    if messages:
        rec["warnings"] = messages[:MAX_WARNINGS]
    return rec


# -- the bitwise check ------------------------------------------------------------------------------
def grad_digests(model: torch.nn.Module) -> dict[str, str]:
    """A BLAKE2b digest of each parameter gradient's bytes (bit patterns, not values: -0.0 and
    NaN payloads count), by parameter name; parameters without a gradient are left out."""
    out: dict[str, str] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            data = p.grad.detach().contiguous().view(torch.uint8).cpu().numpy()  # hashed in place, no copy
            out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def sample_grads(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """CPU copies of a few named gradients, to show how far apart two runs are when their digests
    differ (the digests say only whether)."""
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().cpu().clone() for n in names if n in params and params[n].grad is not None}


@contextlib.contextmanager
def deterministic_attention(env: Env, enabled: bool = True) -> Iterator[None]:
    """SDPA pinned to the memory-efficient backend with grouped-query heads expanded by HF's
    ``repeat_kv``, inside the ``with`` (CUDA only; a no-op on the CPU, whose SDPA is repeatable).

    Why: on the H100 the FLASH backward is not repeatable run to run, so two processes cannot be
    compared bit for bit under it; the efficient backend is. HF passes ``enable_gqa=True`` where it
    can, which not every backend takes: with ``use_gqa_in_sdpa`` patched to say no, the keys and
    values are expanded first and the efficient backend runs any Llama."""
    if not (enabled and env.cuda):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from transformers.integrations import sdpa_attention as hf_sdpa
    except ImportError:  # another transformers layout: its SDPA call is left as it is
        hf_sdpa = None
    patched = hf_sdpa is not None and hasattr(hf_sdpa, "use_gqa_in_sdpa")
    original = hf_sdpa.use_gqa_in_sdpa if patched else None
    if patched:
        hf_sdpa.use_gqa_in_sdpa = lambda *args, **kwargs: False
    # The efficient backward repeats itself only in deterministic mode (offload.repeatable says
    # what the H100 and H200 showed); it needs CUBLAS_WORKSPACE_CONFIG set before cuBLAS starts.
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        if patched:
            hf_sdpa.use_gqa_in_sdpa = original


def summarize_steps(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of a list of step records: ``total_ms``, ``steps``, ``failed`` (count),
    ``max_peak_bytes``."""
    peaks = [r["peak_bytes"] for r in records if r.get("peak_bytes") is not None]
    return {
        "total_ms": sum(r["ms"] for r in records),
        "steps": len(records),
        "failed": sum(1 for r in records if "error" in r),
        "max_peak_bytes": max(peaks) if peaks else None,
    }


def with_probe_peaks(records: list[dict[str, Any]], first_steps: list[dict[str, Any]]) -> None:
    """Raise each probe step's ``peak_bytes`` to the peak its probe read (``peak_bytes`` of the
    context's ``first_steps`` row; step ``k`` is ``records[k - 1]``: every record entered the
    context once). The probe resets the device's peak counter layer by layer, so the reading
    after the step covers only its last layers; the probe's own figure covers the whole step."""
    for row in first_steps:
        index, peak = row.get("step", 0) - 1, row.get("peak_bytes")
        if peak is not None and 0 <= index < len(records) and records[index].get("peak_bytes") is not None:
            records[index]["counter_peak_bytes"] = records[index]["peak_bytes"]
            records[index]["peak_bytes"] = max(records[index]["peak_bytes"], peak)


def first_steps_table(rows: list[dict[str, Any]]) -> str:
    """The context's first steps (seconds per phase), as the report shows them."""
    phases = [k for k in rows[0] if k.endswith("_s") and k not in ("wall_s", "device_s", "other_s")]
    head = ["step", "kind", "wall_s", "device_s", *phases, "other_s"]
    lines = ["  first steps (s): " + "  ".join(h.removesuffix("_s") for h in head)]
    for r in rows:
        lines.append("  " + "  ".join(r["kind"] if h == "kind" else fmt(r.get(h), ".3f" if h != "step" else "")
                                     for h in head))
    return "\n".join(lines)
