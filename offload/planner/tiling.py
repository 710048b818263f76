"""Tiling as a planner action: the profile of a step whose MLPs and LM head run tiled over chunks
of tokens (:mod:`offload.tiling`), derived from the untiled profile, and the plans made from it.

No probe step runs tiled: tiling only changes what a layer's candidates (its MLP) and the head hold,
which the untiled probe already measured. Per layer with candidates (``LayerProfile.selective``):

- **saved slots** are the selective profile's: a tiled candidate saves its input only, as a
  selective one does through its checkpoint, and keeps no cache;
- **transient peaks** (forward and backward) shrink with the saved bytes, plus one chunk's working
  set: the candidates' insides for ``tile_tokens`` tokens, twice (the recomputed chunk and its
  gradients);
- **backward time** grows by the candidates' whole forward (recomputed chunk by chunk).

The head: its peak is counted afresh, ``HIDDEN_BYTES`` per hidden element (the final norm's
output and the hidden states' gradients; ``NORMED_HIDDEN_BYTES`` where the norm runs inside the
chunks, plus the norm's working set for one chunk) plus one chunk's working set
(:func:`offload.tiling.loss.head_chunk_bytes`) and the float32 weight gradient it sums into when
the head trains (tiled only where that is less than the untiled head measured); what it leaves
for backward (``head_residual_bytes``) is at most that: the untiled head's residual, measured when backward
reaches the last layer, holds logit-sized buffers (about 5 bytes a logit on the H200: 157 GiB at
262,144 tokens a rank of a 128256-word vocabulary, T29 at cp=4), which no chunked head keeps; its
time grows by one of its three GEMMs (backward recomputes the logits).

Tiling changes the order of sums, so plans tile only where no untiled plan fits: the untiled
profile first, then the head tiled, then the head and every MLP (:func:`choose_tiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..tiling.loss import default_head_chunk, head_chunk_bytes
from .scaling import profile_at
from .search import BudgetError, lowest_recompute
from .shapes import StepShape
from .types import LayerProfile, Plan, StepProfile

# Bytes per logit an untiled head holds at its peak (HF's: the logits in bf16, their float32
# copy, the loss's float32 log-softmax and gradient, the gradient in bf16): what a short probe's
# untiled head may take (offload.layers.model_form).
LOGIT_BYTES = 16
# Bytes per hidden element a tiled head holds besides its chunk: the final norm's output, its
# float32 upcast, the hidden states' gradient in float32 and in the model's dtype.
HIDDEN_BYTES = 16
# The same with the final norm inside the chunks (offload.tiling.causal_lm, ``tile_norm``): the
# norm's input, kept for backward, and its gradient, both in the model's dtype; and per element of
# one chunk, the norm's own working set (its float32 upcast and normed rows, their gradients).
NORMED_HIDDEN_BYTES = 4
NORM_CHUNK_BYTES = 16
# An MLP tiled over chunks of 1/MLP_CHUNKS of the step's tokens, never fewer than MIN_MLP_CHUNK
# (smaller GEMMs lose speed), rounded up to a multiple of 1024 tokens.
MLP_CHUNKS = 32
MIN_MLP_CHUNK = 4096
# The tiled figures are derived, not measured: their chunk working sets are counted this much
# larger. Measured without it, a tiled plan peaked 4% over its budget on the H100 (LLAMA-8B-SHAPE
# at 262144) and 21% over on a toy model after other tests (allocator blocks of the chunks).
DERIVED_MARGIN = 1.25


@dataclass(frozen=True)
class HeadInfo:
    """The LM head a plan may tile: its vocabulary and width, whether its weight trains, and
    whether it can be tiled at all (``reason`` says why not)."""

    vocab_size: int
    hidden_size: int
    weight_trains: bool
    tileable: bool
    reason: str = ""
    norm: str = ""  # the base model's final norm the tiled head runs inside its chunks ('': whole)


def mlp_chunk_tokens(tokens: int) -> int:
    """Tokens per chunk of a tiled MLP in a step of ``tokens``."""
    chunk = max(MIN_MLP_CHUNK, -(-tokens // MLP_CHUNKS))
    step = min(1024, MIN_MLP_CHUNK)
    return min(tokens, -(-chunk // step) * step)


def _tokens(profile: StepProfile) -> int:
    if profile.shape is None:
        raise ValueError("offload: tiling needs a profile that says its batch shape; make it again with offload.plan(...)")
    return profile.shape[0] * profile.shape[1]


def _tiled_layer(layer: LayerProfile, chunk: int, tokens: int) -> LayerProfile:
    sel = layer.selective
    assert sel is not None
    saved, tiled = layer.saved_bytes, sel.saved_bytes
    ratio = tiled / saved if saved else 1.0
    insides = max(0, saved - tiled)  # the candidates' saved insides, for all the tokens
    working = int(DERIVED_MARGIN * 2 * insides * min(1.0, chunk / tokens))
    return replace(
        layer,
        slot_bytes=sel.slot_bytes,
        slot_keys=sel.slot_keys,
        slot_growth=sel.slot_growth,
        small_slots=sel.small_slots,
        cached_bytes=0,
        selective=None,
        forward_peak_bytes=int(layer.forward_peak_bytes * ratio * DERIVED_MARGIN) + working,
        backward_peak_bytes=int(layer.backward_peak_bytes * ratio * DERIVED_MARGIN) + working,
        backward_ms=layer.backward_ms + max(sel.forward_ms, sel.extra_backward_ms),
    )


def tiled_profile(profile: StepProfile, tile_tokens: int, head: Optional[HeadInfo], head_tokens: int) -> StepProfile:
    """``profile`` (at its own shape) with its candidates tiled over ``tile_tokens`` (0: not) and
    its head over ``head_tokens`` (0: not). The plain step's figures stay the untiled ones: the
    plan table's ratios compare with the step as the model runs."""
    tokens = _tokens(profile)
    layers = profile.layers
    if tile_tokens:
        layers = tuple(_tiled_layer(l, tile_tokens, tokens) if l.selective is not None else l for l in layers)
    head_bytes, head_ms, residual = profile.head_bytes, profile.head_ms, profile.head_residual_bytes
    if head_tokens and head is not None:
        # As counted, not capped by the untiled head's: where that holds less, the head is not
        # tiled at all (_variants), and a cap would count a tiled head smaller than it runs.
        head_bytes = tiled_head_bytes(tokens, head, head_tokens)
        residual = min(residual, head_bytes)
        head_ms *= 4 / 3
    return replace(profile, layers=layers, head_bytes=head_bytes, head_ms=head_ms, head_residual_bytes=residual)


def tiled_head_bytes(tokens: int, head: HeadInfo, head_tokens: int) -> int:
    """The tiled head's peak in a step of ``tokens``, counted afresh rather than by subtracting
    the logits from the measured peak (how many bytes a logit costs there depends on the loss's
    code): the final norm's output, its float32 upcast and the gradients of the hidden states,
    one chunk's logits, and the float32 sum of the weight's gradient when it trains."""
    rows = min(head_tokens, tokens)
    chunk = int(DERIVED_MARGIN * head_chunk_bytes(rows, head.vocab_size))
    if head.norm:
        chunk += int(DERIVED_MARGIN * rows * head.hidden_size * NORM_CHUNK_BYTES)
    tiled = tokens * head.hidden_size * (NORMED_HIDDEN_BYTES if head.norm else HIDDEN_BYTES) + chunk
    if head.weight_trains:
        tiled += head.vocab_size * head.hidden_size * 4
    return tiled


def _variants(profile: StepProfile, head: Optional[HeadInfo]) -> list[tuple[int, int]]:
    """(tile_tokens, head_tokens) to try, least tiling first."""
    tokens = _tokens(profile)
    out = [(0, 0)]
    head_tokens = default_head_chunk(head.vocab_size) if head is not None and head.tileable else 0
    # Where the untiled head holds less than the tiled one would (its loss runs over chunks of
    # rows, offload.tiling.exact_loss: 5 bytes a logit), tiling it gains nothing.
    if head_tokens >= tokens or (head is not None and tiled_head_bytes(tokens, head, head_tokens) >= profile.head_bytes):
        head_tokens = 0
    if head_tokens:
        out.append((0, head_tokens))
    chunk = mlp_chunk_tokens(tokens)
    if chunk < tokens and any(l.selective is not None for l in profile.layers):
        out.append((chunk, head_tokens))
    return out


def _mark(plan: Plan, profile: StepProfile, tile_tokens: int, head_tokens: int, note: str) -> Plan:
    layers = tuple(replace(lp, tile_tokens=tile_tokens) if tile_tokens and l.selective is not None else lp
                   for lp, l in zip(plan.layers, profile.layers))
    return replace(plan, layers=layers, head_tokens=head_tokens, head_note=note)


def head_note(head: Optional[HeadInfo], head_tokens: int) -> str:
    """What the plan table says about the head ("" when there is nothing to say)."""
    if head is not None and not head.tileable:
        return f"head untiled: {head.reason}"
    if head is not None and head_tokens:
        return f"head and loss tiled over {head_tokens} tokens (vocab {head.vocab_size})"
    return ""


def _untiled_why(head: Optional[HeadInfo]) -> str:
    if head is None:
        return ("; the LM head was not tiled: pass the model (OffloadActivations(layers, model=model)) "
                "so that plans can tile its head and loss")
    return f"; {head_note(head, 0)}" if not head.tileable else ""


def choose_tiled(profile: StepProfile, make: Callable[[StepProfile], Plan], head: Optional[HeadInfo]) -> Plan:
    """``make(profile)`` (a plan search at a budget, raising :class:`BudgetError`), tried on the
    untiled profile, then with the head tiled, then with the head and the MLPs tiled: the first
    that fits. The last variant's ``BudgetError`` when none does."""
    if profile.shape is None:
        return make(profile)
    error: Optional[BudgetError] = None
    for tile_tokens, head_tokens in _variants(profile, head):
        variant = tiled_profile(profile, tile_tokens, head, head_tokens) if (tile_tokens or head_tokens) else profile
        try:
            made = make(variant)
        except BudgetError as exc:
            error = exc
            continue
        return _mark(made, profile, tile_tokens, head_tokens, head_note(head, head_tokens))
    assert error is not None
    tiled = [v for v in _variants(profile, head) if any(v)]
    what = " and ".join(name for name, on in (("the MLPs", tiled and tiled[-1][0]),
                                              ("the head", tiled and tiled[-1][1])) if on)
    raise BudgetError(f"{error}" + (f" (with {what} tiled)" if what else "") + _untiled_why(head)) from None


def lowest_tiled(profile: StepProfile, head: Optional[HeadInfo]) -> tuple[StepProfile, int, int]:
    """The most tiled variant of ``profile`` and its (tile_tokens, head_tokens): what the
    lowest-memory plan is made from."""
    tile_tokens, head_tokens = _variants(profile, head)[-1]
    variant = tiled_profile(profile, tile_tokens, head, head_tokens) if (tile_tokens or head_tokens) else profile
    return variant, tile_tokens, head_tokens


def mark_lowest(plan: Plan, profile: StepProfile, head: Optional[HeadInfo], tile_tokens: int, head_tokens: int) -> Plan:
    """``plan`` (made from :func:`lowest_tiled`'s variant) with its tiling written in."""
    return _mark(plan, profile, tile_tokens, head_tokens, head_note(head, head_tokens))


def lowest_at(profile: StepProfile, shape: StepShape, head: Optional[HeadInfo],
              host_budget: Optional[int] = None) -> tuple[int, int]:
    """(device peak, host bytes) of the lowest-memory plan at ``shape``: every layer recomputed
    (the last ones keeping their inputs on the device where sending them all would pass
    ``host_budget``: :func:`~offload.planner.search.lowest_recompute`), the MLPs and the head
    tiled where they can be."""
    variant, _, _ = lowest_tiled(profile_at(profile, shape), head)
    pred = lowest_recompute(variant, host_budget).prediction
    return pred.peak_bytes, pred.d2h_bytes


def longest_fitting(profile: StepProfile, batch: int, budget: int, head: Optional[HeadInfo],
                    host_budget: Optional[int]) -> Optional[int]:
    """The longest length (to within 1/16; a multiple of 256 from 4096 up) at which a step of ``batch``
    sequences fits ``budget`` device bytes and ``host_budget`` host bytes with the lowest plan
    (:func:`lowest_at`); None if none does."""

    def fits(length: int) -> bool:
        device, host = lowest_at(profile, StepShape(batch, length), head, host_budget)
        return device <= budget and (host_budget is None or host <= host_budget)

    if not fits(16):
        return None
    low, high = 16, 32
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 26:
            return low
    step = 256 if low >= 4096 else 16
    while high - low > max(step, low // 16):
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
