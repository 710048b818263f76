"""A step that takes minutes (issue 51's T29: the LLAMA-8B shape at 1,048,576 tokens on 2 GPUs,
~20 min a step): a clock on its layers and the extrapolation from a preflight of a few layers.

- :class:`LayerClock` marks each layer's forward (entry, exit) and the start of its backward (its
  output's gradient is computed then) on the compute stream, and prints a line every ``every``
  layers, flushed, so a log file shows the step alive. The marks wait for the compute stream only
  (not the offload copies' side streams, whose overlap they would otherwise undo): a layer of a
  long step runs for tens of seconds, the wait costs nothing beside it. Its hooks are marked
  ``offload_probe_observer`` (they compute nothing), so the planner's short probe still runs with
  them on (``offload.layers.short_probe``); the probe's calls, cut to a few tokens, are not marked.
- :func:`per_layer_ms` turns the marks into one decoder layer's forward + backward time.
- :func:`stop_when_planned` (``--plan-only``): the whole model's first full-length call is probed
  short and planned, and stopped as its first layer begins (:class:`PlanMade`): its own plan, with
  every layer and the head as they are (a preflight's few layers extrapolate; they missed the
  tiled head's residual, docs/benchmarks.md T29), in the time of the model's build and the probe.
- :func:`extrapolate` answers for the whole model what a preflight of ``N`` layers measured: the
  planner's own profile of the step (measured at a short length and scaled to this one, see
  ``offload.planner.scaling``) is given the model's depth (its last layer repeated, the other
  layers' weights added to the base bytes) and planned under the same device budget and host
  room, so the prediction is the plan the full run will make (the GPU keeps what it can, the
  rest goes to the host, and the host room bounds that), not N layers' figures times 32/N.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from offload.planner.make import choose
from offload.planner.scaling import predict_plain
from offload.planner.search import BudgetError
from offload.planner.tiling import longest_fitting

__all__ = ["LayerClock", "per_layer_ms", "layer_weight_bytes", "with_layers", "extrapolate",
           "preflight_report", "PlanMade", "stop_when_planned", "planned_figures", "plan_only_report"]


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    """The hidden states a decoder layer returns (a tensor, or the first of a tuple)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class LayerClock:
    """Marks on ``layers`` for one step at a time (:meth:`start`), printed every ``every`` layers
    (0: never) through ``say``. ``marks``: (phase, layer, seconds since :meth:`start`) with phase
    ``"fwd"``, ``"fwd_end"`` or ``"bwd"``; :meth:`finish` adds ``("end", -1, s)``."""

    def __init__(self, layers: list[torch.nn.Module], device: torch.device, every: int,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.device, self.every, self.say, self.count = device, every, say, len(layers)
        self.marks: list[tuple[str, int, float]] = []
        self.label = ""
        self.tokens = 0  # the step's tokens a sequence on this rank: other calls are the probe's
        self._t0: Optional[float] = None
        self._handles = []
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._entry(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._exit(index)))

    def start(self, label: str, tokens: int) -> None:
        """A step of ``tokens`` tokens a sequence (this rank's) begins (``label`` heads its lines)."""
        self.label, self.marks, self.tokens = label, [], tokens
        self._t0 = self._now()

    def finish(self) -> float:
        """The step's backward is over; its seconds since :meth:`start`."""
        elapsed = self._mark("end", -1)
        self._t0 = None
        return elapsed

    def remove(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _mark(self, phase: str, index: int) -> float:
        elapsed = self._now() - (self._t0 or 0.0)
        self.marks.append((phase, index, elapsed))
        shown = phase in ("fwd", "bwd") and self.every and (index % self.every == 0 or index == self.count - 1)
        if shown:
            word = "forward" if phase == "fwd" else "backward"
            self.say(f"{self.label}: {word} layer {index}/{self.count}, {elapsed:.1f} s")
        return elapsed

    def _timing(self, hidden: Optional[torch.Tensor]) -> bool:
        # Not a checkpoint's recompute in backward (the layer's forward runs again there), not
        # outside a step started here, not the short probe's calls (cut to fewer tokens).
        return (self._t0 is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
                and hidden is not None and hidden.dim() >= 2 and hidden.shape[1] == self.tokens)

    def _entry(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if self._timing(_first_tensor(args) if args else kwargs.get("hidden_states")):
                self._mark("fwd", index)
        hook.offload_probe_observer = True  # type: ignore[attr-defined]
        return hook

    def _exit(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self._timing(_first_tensor(output)) or ("fwd", index) not in {(p, i) for p, i, _ in self.marks}:
                return
            self._mark("fwd_end", index)
            hidden = _first_tensor(output)
            if hidden is not None and hidden.requires_grad:
                # Its gradient is computed when backward reaches this layer: the layer's backward starts.
                hidden.register_hook(self._backward(index))
        hook.offload_probe_observer = True  # type: ignore[attr-defined]
        return hook

    def _backward(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:  # returns None: the gradient is left as it is
            self._mark("bwd", index)
        return hook


class PlanMade(Exception):
    """Raised by :func:`stop_when_planned`: the step's plan is made, and the step is not run."""


def stop_when_planned(layer: torch.nn.Module, oa: Any, tokens: int) -> Any:
    """A forward pre-hook on ``layer`` (the first decoder layer) that raises :class:`PlanMade` at
    the first call of ``tokens`` tokens a sequence (this rank's) once ``oa`` has a plan: the short
    probe's calls (fewer tokens) run on. The same on every rank: each stops at the same point,
    ahead of the layer's other hooks (FSDP2's all-gather, a :class:`LayerClock`). Returns the
    hook's handle."""
    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        hidden = _first_tensor(args) if args else kwargs.get("hidden_states")
        if oa.plan is not None and hidden is not None and hidden.dim() >= 2 and hidden.shape[1] == tokens:
            raise PlanMade()
    hook.offload_probe_observer = True  # type: ignore[attr-defined]  # (the probe's calls pass through)
    return layer.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def planned_figures(plan: Any) -> dict[str, Any]:
    """What a plan predicts for its step: the plan, step (ms), GPU peak and host bytes, and why
    this budget."""
    p = plan.prediction
    return {"plan": plan.describe(), "step_ms": p.step_ms, "peak_bytes": p.peak_bytes, "host_bytes": p.d2h_bytes,
            "budget_bytes": plan.budget_bytes, "budget_reason": plan.budget_reason}


def plan_only_report(row: dict[str, Any], length: int, ranks: int, node_total: int, node_available: int,
                     time_left_s: Optional[float] = None) -> list[str]:
    """``--plan-only``'s lines: each rank's own plan at ``length`` tokens (the slowest shown),
    the node's host bytes for its ``ranks`` against its RAM, and ``verdict: GO`` or ``NO-GO (why)``."""
    found = [p for p in row.get("planned") or [] if p]
    if not found:
        return [f"plan only: no plan at {length} tokens: {row.get('errors')}",
                f"verdict: NO-GO (no plan at {length} tokens; see the error)"]
    worst = max(found, key=lambda p: p["step_ms"])
    host = sum(p["host_bytes"] for p in found) * (ranks // len(found))
    step_s = worst["step_ms"] / 1e3
    lines = [f"plan only, {length} tokens on {ranks} ranks (the whole model, probed short): plan {worst['plan']}; "
             f"predicted step ~{step_s:.3g} s ({step_s / 60:.1f} min), GPU peak {_gib(max(p['peak_bytes'] for p in found))} "
             f"a rank, host {_gib(max(p['host_bytes'] for p in found))} a rank; budget {worst['budget_reason']}",
             f"host on the node: {_gib(host)} for {ranks} ranks, of {_gib(node_total)} RAM ({_gib(node_available)} "
             "available now)"]
    problems = [lines[-1] + ": DOES NOT FIT"] if host > node_available else []
    if time_left_s is not None and step_s > time_left_s:
        problems.append(f"a step of ~{step_s / 60:.1f} min is past the {time_left_s / 60:.1f} min left")
    return lines + ["verdict: GO" if not problems else f"verdict: NO-GO ({'; '.join(p[:200] for p in problems)})"]


def per_layer_ms(marks: list[tuple[str, int, float]], count: int) -> Optional[float]:
    """One decoder layer's forward + backward (ms) from a step's :class:`LayerClock` marks: the
    mean over layers 1.. (layer 0, whose input needs no gradient under a frozen embedding, only
    where it is the one layer). Layer ``i``'s backward runs from its mark to layer ``i-1``'s (layer
    0's: to the step's end). None where a mark is missing (the step failed)."""
    at = {(phase, index): s for phase, index, s in marks}
    end = at.get(("end", -1))
    times = []
    for i in range(count):
        keys = [("fwd", i), ("fwd_end", i), ("bwd", i)]
        if any(k not in at for k in keys):
            return None
        after = at.get(("bwd", i - 1)) if i else end
        if after is None:
            return None
        times.append((at[("fwd_end", i)] - at[("fwd", i)]) + (after - at[("bwd", i)]))
    typical = times[1:] or times
    return 1e3 * sum(typical) / len(typical) if typical else None


def with_layers(profile: Any, layers: int, layer_weight_bytes: int) -> Any:
    """``profile`` for a model of ``layers`` decoder layers: its last layer repeated (or cut),
    each added layer's weights (``layer_weight_bytes``, this rank's share) in the base bytes, and
    the plain step predicted again."""
    have = len(profile.layers)
    grown = tuple(profile.layers[:layers]) + (profile.layers[-1],) * max(0, layers - have)
    base = profile.base_bytes + (layers - have) * layer_weight_bytes
    return predict_plain(dataclasses.replace(profile, layers=grown, base_bytes=max(0, base)))


def layer_weight_bytes(layer: torch.nn.Module) -> int:
    """Bytes of ``layer``'s parameters this rank holds (its FSDP2 shard, or all of them)."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in layer.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def extrapolate(plan: Any, layers: int, layer_weight_bytes: int, host_budget: Optional[int],
                head: Any = None) -> dict[str, Any]:
    """What the plan in force (made for the preflight's few layers at the full length) predicts
    for ``layers`` layers under the same device budget and ``host_budget`` host bytes: its step
    (ms), device peak and host bytes, the actions; or ``error`` (no plan fits) and the longest
    length that does (``fits_length``, per rank)."""
    profile = with_layers(plan.profile, layers, layer_weight_bytes)
    out: dict[str, Any] = {"layers": layers, "budget_bytes": plan.budget_bytes, "host_budget_bytes": host_budget,
                           "preflight_predicted_ms": plan.prediction.step_ms,
                           "preflight_predicted_peak_bytes": plan.prediction.peak_bytes}
    if profile.shape is not None and plan.budget_bytes is not None:
        out["fits_length"] = longest_fitting(profile, profile.shape[0], plan.budget_bytes, head, host_budget)
    try:
        made = choose(profile, plan.budget_bytes, torch.device(profile.device), head=head, host_budget=host_budget,
                      note_host=False)
    except BudgetError as exc:
        out["error"] = str(exc)[:400]
        return out
    p = made.prediction
    out.update(step_ms=p.step_ms, peak_bytes=p.peak_bytes, host_bytes=p.d2h_bytes, plan=made.describe(),
               head_tokens=made.head_tokens)
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def preflight_report(row: dict[str, Any], layers: int, full_layers: int, length: int, ranks: int,
                     node_total: int, node_available: int, time_left_s: Optional[float] = None) -> list[str]:
    """The preflight's lines: what its full-length step measured, and the whole model's step
    (from the measured layer, and the planner's plan), GPU peak and host bytes a rank against
    the node's memory (its ``ranks`` share it), with what to change where it does not fit; the
    last line ``verdict: GO`` or ``verdict: NO-GO (why)``, the step within ``time_left_s`` if given."""
    lines: list[str] = []
    problems: list[str] = []
    step_s = _preflight_lines(row, layers, full_layers, length, ranks, node_total, node_available, lines, problems)
    if time_left_s is not None and step_s > time_left_s:
        problems.append(f"a step of ~{step_s / 60:.1f} min is past the {time_left_s / 60:.1f} min left")
    return lines + ["verdict: GO" if not problems else f"verdict: NO-GO ({'; '.join(p[:200] for p in problems)})"]


def _preflight_lines(row: dict[str, Any], layers: int, full_layers: int, length: int, ranks: int,
                     node_total: int, node_available: int, lines: list[str], problems: list[str]) -> float:
    # Appends the lines and what stands in the way; returns the longest estimate of a whole step (s).
    if not row.get("full_ms"):
        problems.append(f"no step at {length} tokens finished: {row.get('errors')}")
        lines.append(f"preflight: {problems[-1]}")
        return 0.0
    step, layer, host = row["full_ms"][-1], row["layer_ms"][-1], row["host_bytes"][-1]
    # From the first layer on where the clock ran: a first call probed short inside is not counted.
    step = (row.get("clock_ms") or [None])[-1] or step
    lines += [f"preflight, {layers} of {full_layers} layers, {length} tokens on {ranks} ranks (measured): step "
             f"{step / 1e3:.3g} s from the first layer on, a layer "
             f"{layer / 1e3 if layer else float('nan'):.3g} s (forward + backward), "
             f"GPU peak {_gib(row['peak_bytes'])} a rank, host {_gib(host)} a rank; first full-length step: "
             f"{row.get('first_full_phase')}"]
    est = 0.0
    if layer:
        est = step + (full_layers - layers) * layer
        lines.append(f"{full_layers} layers from the measured layer: a step of ~{est / 1e3:.3g} s ({est / 6e4:.1f} min)"
                     + (", past one 10-min command: run it detached" if est > 6e5 else ""))
    found = [p for p in row.get("preflight") or [] if p]
    if not found:
        problems.append("no plan to extrapolate from: see the errors")
        return est / 1e3
    fits = min((p.get("fits_length") or 0) for p in found)
    if any("error" in p for p in found):
        error = next(p["error"] for p in found if "error" in p)
        shorter = f"it fits at --length {fits * ranks // (2 * ranks) * 2 * ranks}" if fits else "nor at any length"
        problems.append(f"{full_layers} layers, the planner: NO PLAN FITS ({error}); {shorter}")
        lines.append(problems[-1])
        return est / 1e3
    worst = max(found, key=lambda p: p["step_ms"])
    peak = max(p["peak_bytes"] for p in found)
    node = sum(p["host_bytes"] for p in found) * (ranks // len(found))
    first = found[0]
    lines.append(f"{full_layers} layers, the planner (this length, budget {_gib(first['budget_bytes'])} and host room "
                 f"{_gib(first['host_budget_bytes'] or 0)} a rank): step ~{worst['step_ms'] / 1e3:.3g} s, GPU peak "
                 f"{_gib(peak)} a rank, host {_gib(max(p['host_bytes'] for p in found))} a rank, plan {worst['plan']}; "
                 f"(its preflight plan predicted {first['preflight_predicted_ms'] / 1e3:.3g} s, "
                 f"measured {step / 1e3:.3g})")
    verdict = "fits" if node <= node_available else "DOES NOT FIT"
    lines.append(f"host on the node: {_gib(node)} for {ranks} ranks, of {_gib(node_total)} RAM ({_gib(node_available)} "
                 f"available now): {verdict}" + ("" if node <= node_available else
                 f"; free host memory, or shorten to --length {fits * ranks} (the longest that fits a rank: {fits})"))
    if node > node_available:
        problems.append(lines[-1])
    return max(est, worst["step_ms"]) / 1e3
