"""Data types of the planner: what a probe step measured, what a plan says, what the model predicts.

Everything here is a frozen dataclass checked in ``__post_init__``: a profile with a NaN time or a
negative size would make the cost model answer nonsense quietly, so it is refused where it is
built, with the field named. Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .actions import Action, slot_keys


# How a probe step ran the layers (StepProfile.probe).
PLAIN_PROBE = "plain"          # as the model runs: the most exact
RECOMPUTE_PROBE = "recompute"  # every layer checkpointed: fits wherever checkpointing fits
PROBES = (PLAIN_PROBE, RECOMPUTE_PROBE)


# ---------------------------------------------------------------------------------------- checks

def _check_int(owner: str, name: str, value: Any) -> None:
    # bool is an int subclass; a True where a byte count belongs is a caller's bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name} must be an int number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{owner}.{name} must be >= 0 bytes, got {value}")


def _check_ms(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name} must be a number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}.{name} must be a finite time >= 0 ms, got {value!r}")


def _check_positive(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be finite and > 0, got {value!r}")


def _check_exponents(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or any(
            isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= 2 for e in value):
        raise ValueError(f"{owner}.{name} must be a pair of exponents in 0..2, got {value!r}")


def _check_slots(owner: str, profile: Any) -> None:
    # slot_bytes, and beside them slot_keys and slot_growth (each empty, or one per slot).
    for name in ("slot_bytes", "slot_keys", "slot_growth"):
        value = getattr(profile, name)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{owner}.{name} must be a tuple, got {value!r}")
    object.__setattr__(profile, "slot_bytes", tuple(profile.slot_bytes))
    object.__setattr__(profile, "slot_keys", tuple(profile.slot_keys))
    object.__setattr__(profile, "slot_growth", tuple(tuple(g) if isinstance(g, list) else g
                                                     for g in profile.slot_growth))
    for s in profile.slot_bytes:
        _check_int(owner, "slot_bytes[]", s)
    for s in profile.slot_keys:
        _check_int(owner, "slot_keys[]", s)
    for g in profile.slot_growth:
        _check_exponents(owner, "slot_growth[]", g)
    n = len(profile.slot_bytes)
    for name in ("slot_keys", "slot_growth"):
        if len(getattr(profile, name)) not in (0, n):
            raise ValueError(f"{owner}.{name} has {len(getattr(profile, name))} entries for {n} slots")
    small = profile.small_slots
    if not isinstance(small, (list, tuple)) or any(not isinstance(t, (list, tuple)) or len(t) != 4 for t in small):
        raise ValueError(f"{owner}.small_slots must be (bytes, largest tensor's bytes, a, b) quadruples, got {small!r}")
    object.__setattr__(profile, "small_slots", tuple(tuple(t) for t in small))
    for nbytes, key, a, b in profile.small_slots:
        _check_int(owner, "small_slots[].bytes", nbytes)
        _check_int(owner, "small_slots[].key", key)
        _check_exponents(owner, "small_slots[]", (a, b))


def _layer_hash(signature: str) -> str:
    # Short and stable across processes (str hash() is salted per process).
    return hashlib.blake2b(signature.encode("utf-8"), digest_size=6).hexdigest()


def parse_signature(signature: str) -> tuple[int, tuple[str, ...]]:
    """Split a :meth:`StepProfile.signature` into (layer count, per-layer hashes).

    Raises ValueError if the string was not made by :meth:`StepProfile.signature`.
    """
    count, sep, rest = signature.partition(":")
    if not sep or not count.isdigit():
        raise ValueError(f"not a planner signature: {signature[:60]!r}")
    hashes = tuple(rest.split(".")) if rest else ()
    if len(hashes) != int(count):
        raise ValueError(f"malformed planner signature: says {count} layers, lists {len(hashes)}")
    return int(count), hashes


# -------------------------------------------------------------------------------------- profiles

@dataclass(frozen=True)
class SelectiveProfile:
    """A layer with its selective-recompute candidates (e.g. its MLP) run under selective
    recompute (:mod:`offload.forwards.selective`): what it then saves through the hooks, what the
    candidates' caches hold outside them, and the backward time the recompute of their cheap
    ops adds."""

    slot_bytes: tuple[int, ...]  # as LayerProfile.slot_bytes: the candidates' inputs replace their insides
    cached_bytes: int            # the candidates' kept GEMM outputs (never offloaded)
    extra_backward_ms: float     # the candidates' forward time less their GEMMs' time
    slot_keys: tuple[int, ...] = ()                 # as LayerProfile's
    slot_growth: tuple[tuple[int, int], ...] = ()   # as LayerProfile's
    small_slots: tuple[tuple[int, int, int, int], ...] = ()  # as LayerProfile's
    # The candidates' whole forward time (GEMMs included): what a tiled candidate's backward
    # recomputes (offload.tiling). 0: not measured (profiles of older versions).
    forward_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_slots("SelectiveProfile", self)
        _check_int("SelectiveProfile", "cached_bytes", self.cached_bytes)
        _check_ms("SelectiveProfile", "extra_backward_ms", self.extra_backward_ms)
        _check_ms("SelectiveProfile", "forward_ms", self.forward_ms)

    @property
    def saved_bytes(self) -> int:
        """Bytes the layer holds for its backward through the hooks when kept selectively."""
        return sum(self.slot_bytes)


@dataclass(frozen=True)
class LayerProfile:
    """What one layer saves and how long it takes, from the probe step."""

    slot_bytes: tuple[int, ...]  # byte size of each saved storage slot (after dedup), any order
    input_bytes: int             # what a checkpoint of the layer saves: its tensor inputs (and
                                 # what was saved since the layer before: it joins the layer's group)
    forward_ms: float
    backward_ms: float           # without recompute
    signature: str               # fingerprint of the shapes/dtypes saved
    # Memory, measured in the plain probe step (0: not measured, the model then uses saved_bytes):
    forward_peak_bytes: int = 0   # peak above the layer's start during its forward
    backward_peak_bytes: int = 0  # peak above the start of its backward (its weight gradients,
                                  # the activation gradients, workspace) without recompute
    grad_bytes: int = 0           # weight gradients its backward allocates that stay to step end
    # Held from its forward to its backward outside the saved-tensor hooks, so never offloaded:
    # the caches of its selectively recomputed modules (offload.forwards.selective). A recomputed layer
    # holds none (inside a whole-layer checkpoint they run plainly).
    cached_bytes: int = 0
    # The layer with its selective-recompute candidates selective (None: it has none).
    selective: Optional[SelectiveProfile] = None
    # Per slot, the bytes of the largest tensor saved into it: a plan that offloads only a
    # layer's large tensors compares each *tensor* with its floor, as the engine's policy does
    # (views of one storage, q, k and v split from one projection, each fall under a floor that
    # their shared slot is above). Empty: each slot's own size (profiles of older versions).
    slot_keys: tuple[int, ...] = ()
    # Per slot, how it grows with the batch shape: (a, b) for batch ** a * length ** b
    # (:func:`offload.planner.shapes.size_exponents`). Empty: linear in tokens, (1, 1).
    slot_growth: tuple[tuple[int, int], ...] = ()
    # The slots the engine keeps at this shape because their largest tensor is under its size
    # floor (StepProfile.offload_floor_bytes), outside the figures above; one may pass the floor
    # at a longer length (offload.planner.scaling moves it in then), or a slot above fall under
    # it at a shorter one. (bytes, largest tensor's bytes, a, b) each, a and b as slot_growth's.
    small_slots: tuple[tuple[int, int, int, int], ...] = ()
    # The inputs a checkpoint saves, one (bytes, a, b) per storage; empty: input_bytes, (1, 1).
    input_terms: tuple[tuple[int, int, int], ...] = ()
    # Attention's share of forward_ms and backward_ms (scaled_dot_product_attention's kernels):
    # the part that grows with batch x length squared, the rest with tokens.
    attention_forward_ms: float = 0.0
    attention_backward_ms: float = 0.0
    # The bytes those kernels output (attention's output and logsumexp): what a recompute that
    # keeps attention holds from the layer's forward to its backward. 0 where attention runs as
    # torch's context-parallel ring (planner.tally.runs_a_ring): plans then never keep it.
    attention_bytes: int = 0

    def __post_init__(self) -> None:
        if self.selective is not None and not isinstance(self.selective, SelectiveProfile):
            raise ValueError(f"LayerProfile.selective must be a SelectiveProfile or None, got {self.selective!r}")
        _check_slots("LayerProfile", self)
        terms = self.input_terms
        if not isinstance(terms, (list, tuple)) or any(
                not isinstance(t, (list, tuple)) or len(t) != 3 for t in terms):
            raise ValueError(f"LayerProfile.input_terms must be (bytes, a, b) triples, got {terms!r}")
        object.__setattr__(self, "input_terms", tuple(tuple(t) for t in terms))
        for nbytes, a, b in self.input_terms:
            _check_int("LayerProfile", "input_terms[].bytes", nbytes)
            _check_exponents("LayerProfile", "input_terms[]", (a, b))
        for name in ("attention_forward_ms", "attention_backward_ms"):
            _check_ms("LayerProfile", name, getattr(self, name))
        _check_int("LayerProfile", "input_bytes", self.input_bytes)
        _check_ms("LayerProfile", "forward_ms", self.forward_ms)
        _check_ms("LayerProfile", "backward_ms", self.backward_ms)
        for name in ("forward_peak_bytes", "backward_peak_bytes", "grad_bytes", "cached_bytes", "attention_bytes"):
            _check_int("LayerProfile", name, getattr(self, name))
        if not isinstance(self.signature, str):
            raise ValueError(f"LayerProfile.signature must be a str, got {self.signature!r}")

    @property
    def saved_bytes(self) -> int:
        """Bytes the layer holds for its backward when kept."""
        return sum(self.slot_bytes)


@dataclass(frozen=True)
class LinkProfile:
    """The host link, measured on pinned memory (GB/s are 1e9 bytes per second)."""

    d2h_gbps: float
    h2d_gbps: float
    duplex_gbps: float            # both directions together, when both run
    slowdown_one_way: float = 0.09  # compute runs this much slower while one direction copies
    slowdown_duplex: float = 0.19   # ... while both do
    latency_ms: float = 0.01      # fixed cost of each copy submission

    def __post_init__(self) -> None:
        for name in ("d2h_gbps", "h2d_gbps", "duplex_gbps"):
            _check_positive("LinkProfile", name, getattr(self, name))
        for name in ("slowdown_one_way", "slowdown_duplex", "latency_ms"):
            _check_ms("LinkProfile", name, getattr(self, name))


@dataclass(frozen=True)
class StepProfile:
    """One measured training step: its layers, the link, and what surrounds the layers."""

    layers: tuple[LayerProfile, ...]
    link: LinkProfile
    base_bytes: int       # allocated at forward start (weights, grads, optimizer state, inputs)
    head_bytes: int       # extra at the peak after the last layer: plain_peak - base - sum(saved)
    pre_ms: float         # forward before the first layer (embedding)
    head_ms: float        # forward + backward of what follows the last layer
    post_ms: float        # backward after layer 0's backward
    plain_step_ms: float
    plain_peak_bytes: int
    device: str           # "cuda" or "cpu"
    # What the head leaves allocated when backward reaches the last layer (its weight gradients,
    # the gradient flowing into the last layer), held to the end of the step.
    head_residual_bytes: int = 0
    # A recomputed layer's backward peak over (saved_bytes + backward_peak_bytes), measured on
    # one layer in a calibration step: the rebuilt activations are freed while the backward
    # allocates its gradients, so the two do not simply add up.
    recompute_factor: float = 1.0
    # A recomputed layer's extra backward time over its forward_ms, measured on the same layer
    # (checkpoint's recompute stops early, at the last tensor backward needs).
    recompute_time_factor: float = 1.0
    # How the probe ran the layers (PROBES). After a "recompute" probe the plain step was not
    # run: plain_step_ms and plain_peak_bytes are the cost model's prediction of it.
    probe: str = PLAIN_PROBE
    probe_reason: str = field(default="", compare=False)  # why that probe, for the report
    # The batch shape (batch, length) these figures are for (offload.planner.shapes): the
    # probe's, or the one offload.planner.scaling predicted them at. None: not known (a profile
    # of an older version), it then plans for its own shape only.
    shape: Optional[tuple[int, int]] = None
    # The engine's size floor the probe applied (its policy's min_offload_bytes): a saved tensor
    # under it stays on the device, in any plan that does not set a floor of its own. 0: none,
    # or not known (profiles of older versions).
    offload_floor_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (list, tuple)):
            raise ValueError(f"StepProfile.layers must be a tuple of LayerProfile, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            # A plan for no layers could only ever "keep nothing"; a budget on it means the probe
            # did not see the layers the forward runs, which the caller must hear about now.
            raise ValueError(
                "StepProfile has no layers: the probe saw no layer run. Pass the modules the "
                "forward actually calls (e.g. model.model.layers) to the probe."
            )
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerProfile):
                raise ValueError(f"StepProfile.layers[{i}] must be a LayerProfile, got {type(layer).__name__}")
        if not isinstance(self.link, LinkProfile):
            raise ValueError(f"StepProfile.link must be a LinkProfile, got {type(self.link).__name__}")
        for name in ("base_bytes", "head_bytes", "plain_peak_bytes", "head_residual_bytes", "offload_floor_bytes"):
            _check_int("StepProfile", name, getattr(self, name))
        for name in ("pre_ms", "head_ms", "post_ms"):
            _check_ms("StepProfile", name, getattr(self, name))
        _check_positive("StepProfile", "recompute_factor", self.recompute_factor)
        _check_positive("StepProfile", "recompute_time_factor", self.recompute_time_factor)
        _check_positive("StepProfile", "plain_step_ms", self.plain_step_ms)
        _check_positive("StepProfile", "plain_peak_bytes", self.plain_peak_bytes)
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"StepProfile.device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.probe not in PROBES:
            raise ValueError(f"StepProfile.probe must be one of {PROBES}, got {self.probe!r}")
        if self.shape is not None:
            if not isinstance(self.shape, (list, tuple)) or len(self.shape) != 2 or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.shape):
                raise ValueError(f"StepProfile.shape must be (batch, length), ints >= 1, got {self.shape!r}")
            object.__setattr__(self, "shape", tuple(self.shape))

    def signature(self) -> str:
        """Fingerprint of the model: layer count and a short hash of each layer's signature."""
        return f"{len(self.layers)}:" + ".".join(_layer_hash(l.signature) for l in self.layers)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready); :meth:`from_dict` is its inverse."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepProfile":
        """Inverse of :meth:`to_dict` (every field checked again, as when measured)."""
        fields = dict(data)

        def layer(d: dict[str, Any]) -> LayerProfile:
            d = dict(d)
            if d.get("selective") is not None:
                d["selective"] = SelectiveProfile(**d["selective"])
            return LayerProfile(**d)

        fields["layers"] = tuple(layer(d) for d in fields["layers"])
        fields["link"] = LinkProfile(**fields["link"])
        return cls(**fields)


# ------------------------------------------------------------------------------------------ plans

@dataclass(frozen=True)
class LayerPlan:
    """The action for one layer."""

    action: Action
    min_offload_bytes: int = 0  # OFFLOAD only: offload slots >= this size, keep the rest resident
    selective: bool = False     # KEEP / OFFLOAD only: the layer's candidates run selectively
    # Any action: the layer's candidates (its MLP) run tiled over chunks of this many tokens
    # (offload.tiling.tokenwise); 0: untiled.
    tile_tokens: int = 0
    # RECOMPUTE only: the checkpoint's inputs stay on the GPU (copied nothing), as gradient
    # checkpointing keeps them, for a step whose host room cannot take every layer's inputs.
    keep_inputs: bool = False
    # RECOMPUTE only: the checkpoint keeps the fused attention kernels' outputs on the GPU
    # (offload.forwards.selective.ATTENTION_OPS), so the recompute skips attention.
    keep_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("selective", "keep_inputs", "keep_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LayerPlan.{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("LayerPlan", "tile_tokens", self.tile_tokens)
        if self.tile_tokens and self.selective:
            raise ValueError("LayerPlan: a layer's candidates run tiled or selectively, not both")
        try:
            object.__setattr__(self, "action", Action(self.action))
        except ValueError:
            raise ValueError(
                f"LayerPlan.action must be one of {[a.value for a in Action]}, got {self.action!r}"
            ) from None
        _check_int("LayerPlan", "min_offload_bytes", self.min_offload_bytes)
        if self.min_offload_bytes and self.action is not Action.OFFLOAD:
            raise ValueError(
                f"LayerPlan.min_offload_bytes applies to OFFLOAD only, got {self.min_offload_bytes} "
                f"with {self.action.value}"
            )
        if self.selective and self.action is Action.RECOMPUTE:
            # Inside a whole-layer checkpoint the candidates run plainly (offload.forwards.selective).
            raise ValueError("LayerPlan.selective applies to KEEP and OFFLOAD; a recomputed layer recomputes everything")
        for name in ("keep_inputs", "keep_attention"):
            if getattr(self, name) and self.action is not Action.RECOMPUTE:
                raise ValueError(
                    f"LayerPlan.{name} applies to RECOMPUTE only (what a checkpoint keeps), got it with "
                    f"{self.action.value}: use Action.RECOMPUTE, or leave {name} False")
        if self.keep_attention and self.tile_tokens:
            # A tiled MLP is an autograd function that recomputes itself: not under the policy.
            raise ValueError("LayerPlan: a recompute keeping attention runs untiled (tile_tokens=0)")

    @property
    def offloads(self) -> bool:
        """Whether the layer's group is copied to the host at all (OFFLOAD, or RECOMPUTE with its
        inputs on the host); a KEEP layer and a recompute keeping its inputs stay on the GPU."""
        return self.action is Action.OFFLOAD or (self.action is Action.RECOMPUTE and not self.keep_inputs)


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one plan."""

    step_ms: float
    peak_bytes: int
    forward_stall_ms: float   # compute waiting on the link during forward (forced releases)
    backward_stall_ms: float  # ... during backward (reloads late), and trailing copies
    d2h_bytes: int
    h2d_bytes: int
    peak_at: str              # e.g. "end of forward", "backward layer 3"
    wasted_d2h_bytes: int = 0  # copied out but never reloaded (D2H unfinished at the layer's backward)

    def __post_init__(self) -> None:
        for name in ("step_ms", "forward_stall_ms", "backward_stall_ms"):
            _check_ms("Prediction", name, getattr(self, name))
        for name in ("peak_bytes", "d2h_bytes", "h2d_bytes", "wasted_d2h_bytes"):
            _check_int("Prediction", name, getattr(self, name))


@dataclass(frozen=True)
class Plan:
    """Per-layer actions, the budget they were chosen for, and the model's prediction."""

    layers: tuple[LayerPlan, ...]
    budget_bytes: Optional[int]
    prediction: Prediction
    signature: str  # StepProfile.signature() of the model it was made for
    # The probe's figures the plan was made from: the runtime follows the plan with them
    # (budget accounting). Not part of a plan's identity.
    profile: Optional["StepProfile"] = field(default=None, compare=False, repr=False)
    # Which budget was used and why, for the report (e.g. how "device" was worked out).
    budget_reason: str = field(default="", compare=False)
    # The LM head and its loss run over chunks of this many tokens (offload.tiling); 0: untiled.
    head_tokens: int = 0
    # Why the head is not tiled or why it is, for the table ("" when nothing needed saying).
    head_note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (list, tuple)) or not self.layers:
            raise ValueError("Plan.layers must be a non-empty tuple of LayerPlan")
        object.__setattr__(self, "layers", tuple(self.layers))
        for i, lp in enumerate(self.layers):
            if not isinstance(lp, LayerPlan):
                raise ValueError(f"Plan.layers[{i}] must be a LayerPlan, got {type(lp).__name__}")
        if self.budget_bytes is not None:
            _check_int("Plan", "budget_bytes", self.budget_bytes)
        if not isinstance(self.prediction, Prediction):
            raise ValueError("Plan.prediction must be a Prediction")
        count, _ = parse_signature(self.signature)
        if count != len(self.layers):
            raise ValueError(f"Plan has {len(self.layers)} layer actions but its signature is for {count} layers")
        _check_int("Plan", "head_tokens", self.head_tokens)

    def check_matches(self, signature: str, num_layers: int) -> None:
        """Raise ValueError naming what differs if this plan was not made for that model."""
        if num_layers != len(self.layers):
            raise ValueError(
                f"plan made for {len(self.layers)} layers, model has {num_layers}: make a new plan"
            )
        count, theirs = parse_signature(signature)
        if count != num_layers:
            raise ValueError(f"model signature is for {count} layers but the model has {num_layers}")
        _, ours = parse_signature(self.signature)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                raise ValueError(
                    f"layer {i}'s saved tensors differ from those the plan was made for "
                    f"(shapes or dtypes changed): make a new plan"
                )

    def recomputes(self) -> bool:
        """Whether any layer is recomputed (run under checkpointing)."""
        return any(lp.action is Action.RECOMPUTE for lp in self.layers)

    def table(self, measured: Optional[dict[str, Any]] = None) -> str:
        """The per-layer table (see :func:`offload.planner.table.format_plan`)."""
        if self.profile is None:
            raise ValueError("this plan carries no profile to print a table from; make it with offload.plan(...)")
        from .table import format_plan  # (lazily: printing is not what loading a plan needs)

        return format_plan(self, self.profile, measured)

    def selects(self) -> bool:
        """Whether any layer runs its candidates under selective recompute."""
        return any(lp.selective for lp in self.layers)

    def tiles(self) -> bool:
        """Whether any layer's candidates, or the head, run tiled (offload.tiling)."""
        return self.head_tokens > 0 or any(lp.tile_tokens for lp in self.layers)

    def describe(self) -> str:
        """Counts of each action, e.g. ``keep 2, offload 3 (1 partial, 3 selective), recompute 11
        (3 inputs kept)``."""
        keep = [lp for lp in self.layers if lp.action is Action.KEEP]
        off = [lp for lp in self.layers if lp.action is Action.OFFLOAD]
        rec = sum(lp.action is Action.RECOMPUTE for lp in self.layers)
        kept = [f"{n} {what} kept" for n, what in ((sum(lp.keep_inputs for lp in self.layers), "inputs"),
                                                  (sum(lp.keep_attention for lp in self.layers), "attention")) if n]
        parts = []
        for name, group in (("keep", keep), ("offload", off)):
            if not group:
                continue
            notes = []
            partial = sum(lp.min_offload_bytes > 0 for lp in group)
            selective = sum(lp.selective for lp in group)
            if partial:
                notes.append(f"{partial} partial")
            if selective:
                notes.append(f"{selective} selective")
            parts.append(f"{name} {len(group)}" + (f" ({', '.join(notes)})" if notes else ""))
        if rec:
            parts.append(f"recompute {rec}" + (f" ({', '.join(kept)})" if kept else ""))
        tiled = sum(lp.tile_tokens > 0 for lp in self.layers)
        if tiled:
            parts.append(f"{tiled} MLPs tiled")
        if self.head_tokens:
            parts.append("head tiled")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), for saving a plan next to a checkpoint: with the profile it
        was made from, which following it needs (the runtime's budget accounting, the table)."""
        p = self.prediction
        return {
            "layers": [[lp.action.value, lp.min_offload_bytes, lp.selective, lp.tile_tokens, lp.keep_inputs,
                        lp.keep_attention] for lp in self.layers],
            "budget_bytes": self.budget_bytes,
            "head_tokens": self.head_tokens,
            "head_note": self.head_note,
            "signature": self.signature,
            "prediction": {k: getattr(p, k) for k in p.__dataclass_fields__},
            "budget_reason": self.budget_reason,
            "profile": self.profile.to_dict() if self.profile is not None else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`. A plan saved without its profile (by an older version)
        loads, but cannot be followed: make it again with ``offload.plan``."""
        profile = data.get("profile")
        return cls(
            # Plans saved before selective (tiled, kept-input, kept-attention) actions existed
            # list two (three, four, five) fields per layer.
            layers=tuple(LayerPlan(Action(a), int(m), *(kind(v) for kind, v in zip((bool, int, bool, bool), more)))
                         for a, m, *more in data["layers"]),
            budget_bytes=data["budget_bytes"],
            prediction=Prediction(**data["prediction"]),
            signature=data["signature"],
            profile=StepProfile.from_dict(profile) if profile is not None else None,
            budget_reason=data.get("budget_reason", ""),
            head_tokens=int(data.get("head_tokens", 0)),
            head_note=data.get("head_note", ""),
        )
