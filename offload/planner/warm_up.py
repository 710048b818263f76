"""A probe step's layer times without the process's warm-up in them.

Where the plain step does not fit, the sizing step (every layer recomputed) is also the measured
step (:mod:`offload.planner.sequence`): one probe step, not two. It is usually the process's first
step, and a first step pays one-off costs inside its layers: CUDA loads a kernel's module on its
first launch (lazy loading, the default), cuBLAS and the attention backends choose and cache their
algorithms, the allocator maps its first segments. They land in the first layer of each kind to
run forward and the first to run backward; a plan made from them would take that layer for a slow
one (on the H200, LLAMA-8B's shape at 16384: the process's first step 4.9 s, the next 2.3 s).

Layers alike (:func:`layer_kind`: the same class, parameter shapes and input bytes) run the same
kernels, so the first-run layer of a kind is compared with the others of its kind: slower than
every one of them by more than :data:`WARM_UP_SPREAD`, it gets the times of their median layer
(its selective candidates' times with them: they were measured in that same forward). Layers alike that
legitimately differ (sliding-window and global attention, a router's imbalance) have a slow one
among the others too, so their first is left as measured. What runs once a step (the embedding
before the layers, the head and the loss after them) has nothing to compare with and keeps its
time: it is the same in every plan, so it moves the predicted step, not the choice of plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Optional, Sequence

import torch

from .types import LayerProfile, StepProfile

WARM_UP_SPREAD = 1.5
MIN_ALIKE = 3  # the first-run layer and at least two to compare it with

# A direction's timing fields, as the probe measured them (the first is the one compared).
_FIELDS = {
    "forward": ("forward_ms", "attention_forward_ms"),
    "backward": ("backward_ms", "attention_backward_ms"),
}
_SELECTIVE_FIELDS = ("forward_ms", "extra_backward_ms")  # measured in the layer's forward


def _steady(layers: Sequence[LayerProfile], first: int, others: Sequence[int], direction: str) -> LayerProfile:
    """Layer ``first`` with its ``direction`` times from the median of ``others``, where it was a
    warm-up outlier; else as it was."""
    fields = _FIELDS[direction]
    ranked = sorted(others, key=lambda j: getattr(layers[j], fields[0]))
    cold = layers[first]
    if getattr(cold, fields[0]) <= WARM_UP_SPREAD * getattr(layers[ranked[-1]], fields[0]):
        return cold
    median = layers[ranked[len(ranked) // 2]]
    steady = {name: getattr(median, name) for name in fields}
    if direction == "forward" and cold.selective is not None and median.selective is not None:
        steady["selective"] = replace(cold.selective, **{name: getattr(median.selective, name)
                                                         for name in _SELECTIVE_FIELDS})
    return replace(cold, **steady)


def layer_kind(module: Optional[torch.nn.Module], layer: LayerProfile) -> Hashable:
    """What makes two layers run the same kernels: their class, their parameters' names, shapes
    and dtypes, and the bytes of their inputs. Not what they save: the first layer's input is
    often a leaf (token embeddings), so it saves a slot fewer than the layers after it, and is
    the very layer a warm-up lands in. Without the module, the saved slots' signature."""
    if module is None:
        return layer.signature
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())
    return type(module).__qualname__, params, layer.input_bytes


def without_warm_up(profile: StepProfile, kinds: Optional[Sequence[Hashable]] = None) -> tuple[StepProfile, list[int]]:
    """``profile`` with each kind's first-run layers' warm-up outliers replaced (see the module
    notes), and the indices of the layers changed. ``kinds``: each layer's :func:`layer_kind`
    (None: the layers' signatures). The layers run forward in index order and backward in
    reverse, so a kind's first forward is its lowest index, its first backward its highest."""
    if kinds is None:
        kinds = [layer.signature for layer in profile.layers]
    alike: dict[Hashable, list[int]] = {}
    for i, kind in enumerate(kinds):
        alike.setdefault(kind, []).append(i)
    layers = list(profile.layers)
    for members in alike.values():
        if len(members) < MIN_ALIKE:
            continue
        layers[members[0]] = _steady(layers, members[0], members[1:], "forward")
        layers[members[-1]] = _steady(layers, members[-1], members[:-1], "backward")
    changed = [i for i, (was, now) in enumerate(zip(profile.layers, layers)) if was is not now]
    if not changed:
        return profile, []
    return replace(profile, layers=tuple(layers)), changed
