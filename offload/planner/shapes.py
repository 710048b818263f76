"""Batch shapes: what a step's shape is, how a saved tensor's size and a layer's transient peak
grow with it (:func:`transient_at`), and the buckets plans are cached by. Pure Python (no torch):
the probe and the runtime pass plain tuples.

A step's shape is read off the first layer's input, the hidden states, batch first:
``(B, T, H)`` gives batch ``B`` and length ``T``; ``(T, H)`` (tokens flattened, or one sequence)
gives ``B = 1``. ``tokens = B * T``. Sequence-first models (``(T, B, H)``, Megatron) swap ``B``
and ``T``: their linear terms still scale right (``B * T`` is the same), attention's quadratic
term does not.

A saved tensor grows as ``B ** a * T ** b``; :func:`size_exponents` reads ``(a, b)`` from its
shape at the probe's ``(B0, T0)``:

- two trailing dims equal to ``T0``: attention scores ``(B, heads, T, T)`` (eager attention,
  SDPA's math backend), or ``(B x heads, T, T)`` as eager attention's bmm saves them, ``b = 2``;
- otherwise one dim equal to ``T0``, ``b = 1``; a dim equal to ``B0 * T0`` (tokens flattened)
  gives ``a = b = 1``;
- ``a = 1`` where another dim equals ``B0``, or is a multiple of it (the batch merged with the
  heads, ``(B x heads, T, head_dim)``), unless the first dim is 1 (broadcast over the batch,
  ``(1, T, head_dim)`` rotary tables). At ``B0 = 1`` no dim can tell, and a tensor that grows
  with ``T`` is taken to grow with ``B`` too (per-sample activations): at worst it is
  over-counted, never under-counted.
- no such dim: a constant (a weight's FP8 copy, a scale).

Where ``T0`` equals another size of the tensor (``T0 == hidden``) the rules above still read a
3-dim ``(B, T, H)`` as linear, and heads ``(B, h, T, head_dim)`` with ``head_dim == T0`` are
told from scores by ``h * head_dim == hidden``. The one ambiguity left: grouped-query heads
(fewer key/value heads) whose ``head_dim`` equals ``T0``, read as quadratic: over-counted again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

# Plans are cached per bucket of the length, this many buckets per doubling, and made for the
# bucket's top: a plan for a length 9% longer than the batch's at most (its bytes over-counted
# by as much, never under-counted), and at most 8 plans per doubling of lengths seen.
BUCKETS_PER_OCTAVE = 8


@dataclass(frozen=True, order=True)
class StepShape:
    """A step's batch size and sequence length (the first layer's input, batch first)."""

    batch: int
    length: int

    def __post_init__(self) -> None:
        for name in ("batch", "length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepShape.{name} must be an int >= 1, got {value!r}")

    @property
    def tokens(self) -> int:
        """``batch * length``."""
        return self.batch * self.length

    def scale(self, exponents: Sequence[int], probe: "StepShape") -> float:
        """How much a size with ``(a, b)`` exponents measured at ``probe`` grows at this shape."""
        a, b = exponents
        return (self.batch / probe.batch) ** a * (self.length / probe.length) ** b

    def bucket(self) -> "StepShape":
        """The shape plans for this one are made and cached at: the batch, and the length
        rounded up to the next of :data:`BUCKETS_PER_OCTAVE` steps per doubling."""
        if self.length <= 8:
            return self
        k = math.ceil(math.log2(self.length) * BUCKETS_PER_OCTAVE - 1e-9)
        if math.ceil(2 ** ((k - 1) / BUCKETS_PER_OCTAVE)) >= self.length:
            k -= 1  # a top itself (rounded up to a whole length): its own bucket
        top = max(self.length, math.ceil(2 ** (k / BUCKETS_PER_OCTAVE)))
        return StepShape(self.batch, top)

    def __str__(self) -> str:
        return f"batch {self.batch} x length {self.length}"


def shape_of(sizes: Sequence[int]) -> StepShape:
    """The step shape of a first-layer input of these sizes (see the module notes)."""
    sizes = [int(s) for s in sizes]
    if len(sizes) < 2 or any(s < 1 for s in sizes):
        raise ValueError(
            f"offload: cannot read a batch shape from a first-layer input of shape {tuple(sizes)}; "
            "the first layer's first tensor argument must be the hidden states, (batch, length, "
            "hidden) or (length, hidden)"
        )
    length = sizes[-2]
    return StepShape(math.prod(sizes[:-2]) if len(sizes) > 2 else 1, length)


def _scores(dims: list[int], probe: StepShape, hidden: Optional[int]) -> bool:
    # Attention scores, (..., T, T): (B, heads, T, T), or (B x heads, T, T) as eager attention's
    # bmm saves them (matmul of 4-d tensors runs on 3-d views). Not heads whose head_dim equals
    # T0 (heads x head_dim == hidden), nor (B, T, features) whose features equal T0 (an MLP as
    # wide as the probe is long): the batch there stands alone in the first dim.
    b0, t0 = probe.batch, probe.length
    if len(dims) < 3 or dims[-1] != t0 or dims[-2] != t0:
        return False
    if len(dims) >= 4:
        return dims[-3] * dims[-1] != hidden
    merged = dims[0]
    return merged != b0 and merged % b0 == 0 and (merged // b0) * dims[-1] != hidden


def size_exponents(sizes: Sequence[int], probe: StepShape, hidden: Optional[int] = None) -> tuple[int, int]:
    """``(a, b)``: a tensor of these sizes at ``probe`` grows as ``batch ** a * length ** b``.
    ``hidden``: the hidden size (the first layer input's last dim), which tells heads
    ``(B, heads, T, head_dim)`` whose ``head_dim`` equals ``T0`` (``heads * head_dim == hidden``)
    from attention scores."""
    dims = [int(s) for s in sizes]
    b0, t0 = probe.batch, probe.length
    if _scores(dims, probe, hidden):
        b = 2
        rest = dims[:-2]
    elif t0 in dims:
        b = 1
        rest = list(dims)
        rest.remove(t0)
    elif b0 * t0 in dims and b0 > 1:
        return 1, 1
    else:
        return 0, 0
    if b0 == 1 or b0 in rest:
        return 1, b
    if rest and rest[0] == 1:
        return 0, b  # a leading 1: broadcast over the batch (rotary tables)
    # The batch merged with another dim ((batch x heads, ...), eager attention's bmm).
    return (1 if any(d % b0 == 0 for d in rest) else 0), b


Slot = tuple[int, int, tuple[int, int]]  # a saved slot: (bytes, its largest tensor's bytes, (a, b))


def grown(slots: Iterable[Slot], shape: StepShape, probe: StepShape) -> list[Slot]:
    """``slots`` measured at ``probe``, each grown to ``shape`` by its own exponents. The engine
    offloads a slot there when its largest tensor reaches the size floor in force, so a slot
    is compared with a floor by its grown largest tensor, never by the layer's total."""
    out = []
    for n, k, g in slots:
        f = shape.scale(g, probe)
        out.append((int(round(n * f)), int(round(k * f)), g))
    return out


def transient_at(peak: int, slots: list[Slot], freed: list[tuple[int, tuple[int, int]]], shape: StepShape,
                 probe: StepShape, grew: Optional[float] = None) -> int:
    """A transient ``peak`` (bytes above where it began) measured at ``probe``, at ``shape``.

    ``slots``: what the layer saves; ``freed``: what may be freed between the peak's start and
    its top, as (bytes, exponents): a backward frees the layer's saved tensors and its incoming
    gradient, a forward nothing it counted. One probe cannot tell which part of a peak is of
    which kind. Where the slots grow alike, the peak grows with them. Where they do not, the
    temporaries lean to the fastest-growing kind at least as much as the saved bytes do: eager
    attention (or SDPA's math backend) builds several score-sized tensors around the one it
    saves (docs/benchmarks.md: a layer's forward peak there is 2.5 times its saved scores and
    half its other saved bytes). So the peak is read both ways, as the saved bytes grow and as
    if all of it were of the fastest-growing kind (length first), and the larger is taken; in
    the second, what the slower kinds freed lowered the peak less at ``shape`` and is added back
    at the difference. Growing the length, the second reading rules; shrinking it, the first.
    ``grew``: how much the saved bytes grew, where they were measured at both shapes (default: as
    the slots' exponents say)."""
    before = sum(n for n, _, _ in slots)
    if grew is not None:
        as_saved = grew
    else:
        as_saved = sum(n * shape.scale(g, probe) for n, _, g in slots) / before if before else shape.tokens / probe.tokens
    kinds = {g for _, _, g in slots}
    if not peak or len(kinds) <= 1:  # (a peak of 0 was not measured, as on the CPU)
        return int(round(peak * as_saved))
    top = shape.scale(functools.reduce(widest, kinds), probe)
    lowered = sum(n * max(0.0, top - shape.scale(g, probe)) for n, g in freed)
    return int(round(max(peak * as_saved, peak * top + lowered)))


def widest(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The faster-growing of two exponent pairs (length first): a slot shared by several
    tensors grows as its fastest one."""
    return max(a, b, key=lambda e: (e[1], e[0]))
