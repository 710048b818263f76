"""A plan as a readable table: what each layer does, and what the model predicts for the step.

Given a measured step next to it, the footer shows the model's error, which is how a user (and
T11) tells whether the prediction can be trusted.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..engine.stats import format_bytes
from .actions import Action
from .layer_costs import ChoiceLike, backward_cost_ms, offloaded_bytes, resident_bytes

_MIB = 1 << 20
_MEASURED_KEYS = ("step_ms", "peak_bytes")


def _action_text(lp: ChoiceLike) -> str:
    text = lp.action.value
    if lp.action is Action.OFFLOAD and lp.min_offload_bytes:
        text = f"offload >= {format_bytes(lp.min_offload_bytes)}"
    if lp.keep_inputs:
        text = f"{text}, inputs kept"
    if lp.keep_attention:
        text = f"{text}, attention kept"
    if lp.tile_tokens:
        return f"{text}, MLP tiled /{lp.tile_tokens}"
    return f"{text} selective" if lp.selective else text


def _error(predicted: float, measured: float) -> str:
    if measured == 0:
        return "n/a"
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def _figure(value: float, plain: float, show: Any) -> str:
    """``value`` as ``show`` writes it, and its ratio to the plain step's."""
    return f"{show(value)} ({value / plain:.3f}x plain)"


def format_plan(plan: Any, profile: Any, measured: Optional[Mapping[str, Any]] = None) -> str:
    """Render ``plan`` (a :class:`~offload.planner.types.Plan`) for ``profile`` (its
    :class:`~offload.planner.types.StepProfile`; both read by their fields, so that ``types``
    can print its plans without an import cycle) as a per-layer table plus a footer of predicted
    figures.

    ``measured`` (optional) holds ``step_ms`` and/or ``peak_bytes`` from a real step; they are
    shown next to the prediction with the prediction's error in percent.
    """
    plan.check_matches(profile.signature(), len(profile.layers))
    if measured is not None:
        unknown = sorted(set(measured) - set(_MEASURED_KEYS))
        if unknown or not measured:
            raise ValueError(f"measured takes {list(_MEASURED_KEYS)}, got {sorted(measured)}")

    header = f"{'layer':>5}  {'action':<30} {'offloaded MiB':>13} {'resident MiB':>12} {'fwd ms':>7} {'bwd ms':>7}"
    lines = [header, "-" * len(header)]
    for i, (layer, lp) in enumerate(zip(profile.layers, plan.layers)):
        # Resident: what stays on the GPU from release to reload (all of it when kept).
        lines.append(
            f"{i:>5}  {_action_text(lp):<30} {offloaded_bytes(layer, lp) / _MIB:>13.1f} "
            f"{resident_bytes(layer, lp) / _MIB:>12.1f} {layer.forward_ms:>7.2f} "
            f"{backward_cost_ms(layer, lp, profile.recompute_time_factor):>7.2f}"
        )
    lines.append("-" * len(header))

    p = plan.prediction
    budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    lines.append(f"plan: {plan.describe()}; budget {budget}")
    if plan.budget_reason:
        lines.append(f"budget: {plan.budget_reason}")
    if plan.head_note:
        lines.append(plan.head_note)
    if profile.probe_reason or profile.probe != "plain":
        lines.append(f"probe: {profile.probe_reason or profile.probe}"
                     + ("; the 'plain' figures are predicted" if profile.probe != "plain" else ""))
    def ms(v: float) -> str:
        return f"{v:.1f} ms"

    step = (p.step_ms, profile.plain_step_ms, ms, measured and measured.get("step_ms"))
    peak = (p.peak_bytes, profile.plain_peak_bytes, format_bytes, measured and measured.get("peak_bytes"))
    if measured is None:
        lines.append(f"predicted step {_figure(*step[:3])}")
        lines.append(f"predicted peak {_figure(*peak[:3])}, at {p.peak_at}")
    else:
        lines.append(f"{'':<6}{'predicted':<30}{'measured':<30}error")
        for label, (predicted, plain, show, got) in (("step", step), ("peak", peak)):
            if got is None:
                lines.append(f"{label:<6}{_figure(predicted, plain, show):<30}{'-':<30}-")
            else:
                lines.append(f"{label:<6}{_figure(predicted, plain, show):<30}"
                             f"{_figure(got, plain, show):<30}{_error(predicted, got)}")
        lines.append(f"predicted peak at {p.peak_at}")
    lines.append(
        f"stalls: forward {p.forward_stall_ms:.1f} ms, backward {p.backward_stall_ms:.1f} ms; "
        f"copies: {format_bytes(p.d2h_bytes)} out, {format_bytes(p.h2d_bytes)} back"
        + (f", {format_bytes(p.wasted_d2h_bytes)} out never used" if p.wasted_d2h_bytes else "")
    )
    return "\n".join(lines)
