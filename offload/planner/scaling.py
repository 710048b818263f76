"""A profile at another batch shape: what one probe predicts for any (batch, length) of the model.

The probe measures one shape (``StepProfile.shape``). At another shape, with ``r`` the ratio of
tokens (batch x length) and ``q`` the ratio of lengths:

- **bytes saved**, slot by slot, grow as that slot's tensors do: ``batch ** a * length ** b``,
  read off their shapes by the probe (``LayerProfile.slot_growth``,
  :func:`offload.planner.shapes.size_exponents`): activations linear in tokens, rotary tables in
  length alone, eager attention's scores in batch x length squared, FP8 weight copies not at
  all. Each slot is then above or under the engine's size floor (``offload_floor_bytes``, the
  policy's ``min_offload_bytes``) by its largest tensor at that shape, as the engine's policy
  puts it: the probe keeps the slots under it apart (``small_slots``), so a slot the engine
  kept at the probe's length is offloaded at a longer one, and one it offloaded is kept at a
  shorter one (issue 48: a hidden-64 Llama whose (2, T, 64) float32 tensors cross the 64 KiB
  floor between lengths 96 and 200 warned "layer 0 saved 1572864 bytes ... the plan was made
  for 1048576"). A checkpoint's inputs (``input_terms``) grow likewise;
- a layer's **transient peaks** (forward and backward) grow as its saved bytes do, or, where
  its slots grow at different rates, as if all of it were of the fastest-growing kind
  (eager attention's scores), whichever is more
  (:func:`offload.planner.shapes.transient_at`); the selective caches
  (GEMM outputs) and attention's outputs (``attention_bytes``) as tokens;
- **time**: attention's measured share (``attention_forward_ms`` / ``attention_backward_ms``,
  the ``scaled_dot_product_attention`` kernels) grows as ``r * q`` (causal attention's FLOPs,
  batch x length squared), the rest of the layer as ``r``; the embedding, the head and the
  tail of backward as ``r``;
- **the head's peak** (``head_bytes``: logits, their float32 copy and gradient) as ``r``;
  what it leaves for backward (``head_residual_bytes``: the head's weight gradients, a constant,
  and the gradient into the last layer, linear) as ``max(1, r)``: never below what was
  measured, and at least linear above it;
- **base bytes** (weights, optimizer state: constant) plus the first layer's inputs, alive at its
  entry, scaled as inputs;
- weight gradients, the link and the recompute factors do not change.

The plain step's time and peak are then the cost model's prediction at that shape, as after a
low-memory probe. How well this holds is measured in ``docs/design.md`` (the LLAMA-1B shape
probed at one length and predicted at others).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .model import simulate
from .layer_costs import all_slots
from .shapes import StepShape, grown, transient_at
from .types import Action, LayerPlan, LayerProfile, SelectiveProfile, StepProfile

_LINEAR = (1, 1)


def predict_plain(profile: StepProfile) -> StepProfile:
    """``profile`` with its plain step's time and peak as the cost model predicts them (a
    low-memory probe, or another shape, did not run the plain step)."""
    keep = [LayerPlan(Action.KEEP)] * len(profile.layers)
    plain = simulate(profile, keep)
    return replace(profile, plain_step_ms=max(plain.step_ms, 1e-6), plain_peak_bytes=max(1, plain.peak_bytes))


def profile_shape(profile: StepProfile) -> Optional[StepShape]:
    """The shape ``profile`` was measured (or predicted) at, if known."""
    return StepShape(*profile.shape) if profile.shape is not None else None


def _slots_at(source: LayerProfile | SelectiveProfile, shape: StepShape, probe: StepShape,
              floor: int) -> dict[str, tuple]:
    """``source``'s slot fields at ``shape``: each slot grown by its own exponents and put above
    or under the engine's size ``floor`` by its largest tensor there, as the engine's policy
    will put it."""
    now = grown(all_slots(source), shape, probe)
    above = [s for s in now if s[1] >= floor]
    under = [s for s in now if s[1] < floor]
    fields = {
        "slot_bytes": tuple(n for n, _, _ in above),
        "slot_keys": tuple(k for _, k, _ in above),
        "slot_growth": tuple(g for _, _, g in above),
        "small_slots": tuple((n, k, *g) for n, k, g in under),
    }
    return fields


def _input_bytes(layer: LayerProfile, shape: StepShape, probe: StepShape) -> int:
    if not layer.input_terms:
        return int(round(layer.input_bytes * shape.scale(_LINEAR, probe)))
    return sum(int(round(n * shape.scale((a, b), probe))) for n, a, b in layer.input_terms)


def _layer_at(layer: LayerProfile, shape: StepShape, probe: StepShape, floor: int) -> LayerProfile:
    r = shape.tokens / probe.tokens
    rq = r * shape.length / probe.length
    fields = _slots_at(layer, shape, probe, floor)
    saved = all_slots(layer)
    # A backward frees the layer's saved tensors and its incoming gradient, shaped as its inputs.
    freed = [(n, g) for n, _, g in saved] + \
        ([(n, (a, b)) for n, a, b in layer.input_terms] or [(layer.input_bytes, _LINEAR)])
    slots = fields["slot_bytes"]
    inputs = _input_bytes(layer, shape, probe)
    terms = tuple((int(round(n * shape.scale((a, b), probe))), a, b) for n, a, b in layer.input_terms)
    selective = layer.selective
    if selective is not None:
        selective = SelectiveProfile(
            **_slots_at(selective, shape, probe, floor),
            cached_bytes=int(round(selective.cached_bytes * r)),
            extra_backward_ms=selective.extra_backward_ms * r,
            forward_ms=selective.forward_ms * r,
        )
    fwd_attn, bwd_attn = layer.attention_forward_ms, layer.attention_backward_ms
    return replace(
        layer,
        **fields,
        input_bytes=inputs,
        input_terms=terms,
        forward_ms=max(0.0, layer.forward_ms - fwd_attn) * r + fwd_attn * rq,
        backward_ms=max(0.0, layer.backward_ms - bwd_attn) * r + bwd_attn * rq,
        attention_forward_ms=fwd_attn * rq,
        attention_backward_ms=bwd_attn * rq,
        attention_bytes=int(round(layer.attention_bytes * r)),
        # The signature names the slots' count and bytes: a plan made at this shape matches it.
        signature=f"{len(slots)}:{sum(slots)}:{inputs}",
        forward_peak_bytes=transient_at(layer.forward_peak_bytes, saved, [], shape, probe),
        backward_peak_bytes=transient_at(layer.backward_peak_bytes, saved, freed, shape, probe),
        cached_bytes=int(round(layer.cached_bytes * r)),
        selective=selective,
    )


def profile_at(profile: StepProfile, shape: StepShape) -> StepProfile:
    """``profile``'s figures predicted at ``shape`` (see the module notes).

    Raises ValueError for a profile that does not say its shape (made by an older version): it
    can only plan its own shape.
    """
    probe = profile_shape(profile)
    if probe is None:
        raise ValueError(
            "offload: this profile does not say which batch shape it was measured at (made by an "
            "older version); it plans for its own shape only: make it again with offload.plan(...)"
        )
    if shape == probe:
        return profile
    r = shape.tokens / probe.tokens
    layers = tuple(_layer_at(layer, shape, probe, profile.offload_floor_bytes) for layer in profile.layers)
    first, first_at = profile.layers[0], layers[0]
    # The first layer's inputs (the embedding's output, masks, rotary tables) are alive at its
    # entry, where base_bytes was read: they are the part of the base that grows.
    base = max(0, profile.base_bytes + first_at.input_bytes - first.input_bytes)
    scaled = replace(
        profile,
        layers=layers,
        base_bytes=base,
        head_bytes=int(round(profile.head_bytes * r)),
        head_residual_bytes=int(round(profile.head_residual_bytes * max(1.0, r))),
        pre_ms=profile.pre_ms * r,
        head_ms=profile.head_ms * r,
        post_ms=profile.post_ms * r,
        shape=(shape.batch, shape.length),
    )
    return predict_plain(scaled)
