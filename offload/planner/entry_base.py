"""What a step's entry holds that the plans count as their base, and when it has grown past them.

A plan's predicted peak is its profile's base, what the allocator held at the measured step's
first layer (weights, optimizer state, the step's inputs), plus what the step adds. The base can
grow once the profile is made: AdamW makes its state at its first ``step()``, which comes after
the measured step when that step is the process's first (the low-memory probe, measured) or under
gradient accumulation; a loop may build an EMA copy, or keep an evaluation's outputs. Every plan
would then overrun its budget by that much (T22: 4.1 GiB of AdamW's state, plans at 1.17x the
budget). So:

- the profile, made at the next step's entry, takes in what the loop holds then and did not at
  the measured step's entry (:meth:`offload.planner.probe.ProbeStep.profile`);
- each planned step's entry compares what it holds with the reading the base stands for; past
  the cost model's own error (``PEAK_MODEL_ERROR`` of the budget), every bucket is planned again
  on the grown base (:class:`offload.planner.replan_steps.ReplanSteps`), on every rank.

The readings are the allocator's whole count, gradients included. Under gradient accumulation
the layers' gradients are held from the first micro-batch's backward on, through every later
micro-batch's forward: a profile rebased on a reading that holds them, where the reading its base
stood for held none, has them in its base, and its layers' ``grad_bytes`` (the gradients the
measured backward made) go to 0, or they would be counted twice. A first micro-batch, whose entry
holds none, then peaks below its prediction, never above. (Gradients held at both readings were
at neither's first layer when a loop clears them inside its step: the base has none of them, and
the layers' ``grad_bytes`` stay.) One ``torch.cuda.memory_allocated`` call and the layers' ``.grad`` attributes: tens of
microseconds, once a step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from .search import PEAK_MODEL_ERROR
from .types import StepProfile

__all__ = ["held_at_entry", "grads_held", "base_drift", "rebased"]


def held_at_entry(device: torch.device) -> int:
    """The bytes allocated on ``device`` now; 0 off CUDA, which has no allocator to read."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def grads_held(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether the ``layers``' parameters hold gradients now (a micro-batch's entry after the
    first of an accumulation)."""
    return any(p.grad is not None for layer in layers for p in layer.parameters())


def base_drift(then: int, now: int, budget_bytes: Optional[int]) -> int:
    """How far the base grew from the reading ``then`` to ``now``, when that is past the cost
    model's own error (``PEAK_MODEL_ERROR`` of ``budget_bytes``); else 0, and always 0 without a
    budget in bytes (nothing to overrun). A base that shrank is not planned for again: what a loop
    held once, it may hold again."""
    if budget_bytes is None:
        return 0
    grown = now - then
    return grown if grown > PEAK_MODEL_ERROR * budget_bytes else 0


def rebased(profile: StepProfile, grown: int, grads_in_base: bool = False) -> StepProfile:
    """``profile`` with ``grown`` more bytes held from the forward's start on: its base and its
    plain step's peak (the other figures are above the base). ``grads_in_base``: the layers'
    gradients came into the base with ``grown``, so the backward makes none (see the module notes)."""
    if grads_in_base and any(layer.grad_bytes for layer in profile.layers):
        profile = replace(profile, layers=tuple(replace(layer, grad_bytes=0) for layer in profile.layers))
    if grown <= 0:
        return profile
    return replace(profile, base_bytes=profile.base_bytes + grown, plain_peak_bytes=profile.plain_peak_bytes + grown)
