"""What the probe counts beside each layer's slots: the largest tensor of each slot, how each slot
grows with the batch shape, and the time attention's kernels take.

:class:`SlotTally` lays a layer's saved tensors out with the engine's own ``Group`` (views of one
storage share a slot, spans aligned), so the bytes are what an offloading step would copy, and
keeps per slot the sizes needed to predict other shapes (:mod:`offload.planner.scaling`).

:class:`AttentionTimer` times ``torch.nn.functional.scaled_dot_product_attention`` inside the
probe's layers, forward and backward: the part of a layer's time that grows with the square of
the length. It replaces the module attribute for the probe's recording forward only (HF's
attention and ``F.scaled_dot_product_attention`` look it up at each call); code that bound the
function at import, or attention that is not SDPA, goes untimed and is predicted as linear in
tokens (``docs/design.md`` says what that costs).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..engine.eager import run_eagerly
from ..engine.group import Group
from ..engine.policy import KEEP_SMALL, SelectionPolicy
from .shapes import StepShape, size_exponents, widest


def under_floor(policy: SelectionPolicy, t: torch.Tensor) -> Optional[bool]:
    """How the engine's ``policy`` takes a saved tensor: False, it offloads ``t``; True, it keeps
    ``t`` for its size alone (under the floor here, perhaps not at a longer length); None, it
    keeps ``t`` whatever its size (a parameter, a marked tensor, ...)."""
    reason = policy.decide(t)
    if reason is None:
        return False
    return True if reason == KEEP_SMALL and t.nbytes > 0 else None


class SlotTally:
    """One layer's saved tensors, laid out into slots (``retain``: see ``Group``).

    The tensors under the engine's size floor go to :attr:`small`, a tally of their own: the
    engine keeps them at this shape, but one may pass the floor at a longer length (and the
    slots above it stay laid out exactly as the engine lays them out)."""

    __slots__ = ("group", "sizes", "keys", "shapes", "small")

    def __init__(self, layer: int, retain: bool, *, small: bool = True) -> None:
        self.group: Optional[Group] = Group(layer, step=0, retain=retain)
        self.sizes: tuple[int, ...] = ()
        self.keys: list[int] = []                  # per slot, its largest tensor's bytes
        self.shapes: list[list[tuple[int, ...]]] = []  # per slot, the shapes saved into it
        self.small: Optional[SlotTally] = SlotTally(layer, retain, small=False) if small else None

    def add(self, t: torch.Tensor, small: bool = False) -> None:
        """Count ``t`` (a tensor the engine would offload; ``small``: one it keeps for its size
        alone)."""
        if small:
            if self.small is not None:
                self.small.add(t)
            return
        group = self.group
        if group is None:
            return
        slot = group.table.slot_of(group.add(t))
        if slot == len(self.keys):
            self.keys.append(0)
            self.shapes.append([])
        if t.nbytes > self.keys[slot]:
            self.keys[slot] = t.nbytes
        size = tuple(t.shape)
        if size not in self.shapes[slot]:
            self.shapes[slot].append(size)

    def close(self) -> None:
        """Keep the slot sizes; let the group (and what a retaining one holds) go."""
        if self.group is not None:
            self.sizes = tuple(self.group.slot_sizes())
            self.group = None
        if self.small is not None:
            self.small.close()

    def growth(self, shape: Optional[StepShape], hidden: Optional[int] = None) -> tuple[tuple[int, int], ...]:
        """Per slot, its exponents at the probe's ``shape`` and ``hidden`` size (its
        fastest-growing tensor's); empty when the shape is not known."""
        if shape is None:
            return ()
        out = []
        for sizes in self.shapes:
            grows = (0, 0)
            for size in sizes:
                grows = widest(grows, size_exponents(size, shape, hidden))
            out.append(grows)
        return tuple(out)

    def fields(self, shape: Optional[StepShape], hidden: Optional[int] = None) -> dict[str, Any]:
        """The profile's slot fields (``slot_bytes``, ``slot_keys``, ``slot_growth``,
        ``small_slots``) at the probe's ``shape`` and ``hidden`` size."""
        return {"slot_bytes": self.sizes, "slot_keys": tuple(self.keys), "slot_growth": self.growth(shape, hidden),
                "small_slots": self.small_slots(shape, hidden)}

    def small_slots(self, shape: Optional[StepShape], hidden: Optional[int] = None) -> tuple[tuple[int, int, int, int], ...]:
        """The slots under the size floor, ``(bytes, largest tensor's bytes, a, b)`` each (see
        ``LayerProfile.small_slots``); empty when the shape is not known."""
        small = self.small
        if small is None or shape is None:
            return ()
        return tuple((n, k, a, b) for n, k, (a, b) in zip(small.sizes, small.keys, small.growth(shape, hidden)))


# (start, end) marks of one attention call's forward, or of its backward (end None until the
# gradient of its inputs is ready). A forward span has a third item: the bytes its kernel output.
Span = list[Any]


def runs_a_ring(original: Callable[..., Any], args: Sequence[Any]) -> bool:
    """Whether an SDPA call runs torch's context-parallel ring: SDPA patched by
    ``torch.distributed`` (its monkey-patching mode) or called on DTensors. Its recompute is not
    offered to keep attention: that path is not yet run on GPUs (the ring's collectives in a
    selective checkpoint), so the probe records no attention bytes for it."""
    return getattr(original, "__module__", "").startswith("torch.distributed") or \
        any(type(a).__name__ == "DTensor" for a in args[:3])


def attention_output_bytes(out: Any) -> int:
    """Bytes a fused attention kernel outputs for an SDPA result ``out`` of ``(..., L, Ev)``:
    ``out`` and the float32 logsumexp its backward needs, one per query row and head (what a
    recompute keeping attention holds; the kernels' few scalars aside)."""
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[-1] == 0:
        return 0
    return out.nbytes + out.numel() // out.shape[-1] * 4


class AttentionTimer:
    """Times SDPA calls while installed (:meth:`install` / :meth:`remove`).

    ``record_of()`` returns the list to append this call's spans to, or None to run the call
    untimed (outside the probe's recorded layers, or a checkpoint recomputing in backward).
    Marks come from ``mark()`` (the probe's clock: CUDA events on the current stream).
    """

    def __init__(self, record_of: Callable[[], Optional[tuple[list[Span], list[Span]]]],
                 mark: Callable[[], Any]) -> None:
        self.record_of, self.mark = record_of, mark
        self._original: Optional[Callable[..., Any]] = None

    def install(self) -> None:
        """Put the timed SDPA in ``torch.nn.functional`` (once)."""
        if self._original is None:
            self._original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _TimedAttention(self, self._original)  # type: ignore[assignment]

    def remove(self) -> None:
        """Put the original back (unless someone replaced ours since: theirs stays)."""
        original, self._original = self._original, None
        if original is not None and isinstance(F.scaled_dot_product_attention, _TimedAttention):
            F.scaled_dot_product_attention = original  # type: ignore[assignment]


class _TimedAttention:
    # Holds the timer weakly: a reference left in torch.nn.functional by a probe that died
    # without remove() then simply calls the original.
    __slots__ = ("timer", "original", "__name__", "__qualname__")

    def __init__(self, timer: AttentionTimer, original: Callable[..., Any]) -> None:
        self.timer, self.original = weakref.ref(timer), original
        # Dynamo and torch.overrides read a function's names off what stands in its place.
        self.__name__ = getattr(original, "__name__", "scaled_dot_product_attention")
        self.__qualname__ = getattr(original, "__qualname__", self.__name__)

    @run_eagerly  # as the probe's other hooks: in a compiled layer, a graph break
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        timer = self.timer()
        spans = timer.record_of() if timer is not None else None
        if spans is None:
            return self.original(*args, **kwargs)
        forward, backward = spans
        start = timer.mark()  # type: ignore[union-attr]
        out = self.original(*args, **kwargs)
        nbytes = 0 if runs_a_ring(self.original, args) else attention_output_bytes(out)
        forward.append([start, timer.mark(), nbytes])  # type: ignore[union-attr]
        inputs = [a for a in list(args[:3]) + [kwargs.get(k) for k in ("query", "key", "value")]
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        if isinstance(out, torch.Tensor) and out.requires_grad and inputs:
            # Backward: from the gradient of the output (SDPA's backward starts) to the last
            # gradient of its inputs (it is over).
            span: Span = [None, None]
            backward.append(span)
            out.register_hook(_Stamp(timer, span, 0))
            for a in inputs:
                a.register_hook(_Stamp(timer, span, 1))
        return out


class _Stamp:
    __slots__ = ("timer", "span", "index")

    def __init__(self, timer: AttentionTimer, span: Span, index: int) -> None:
        self.timer, self.span, self.index = weakref.ref(timer), span, index

    @run_eagerly
    def __call__(self, grad: torch.Tensor) -> None:
        timer = self.timer()
        if timer is not None and (self.index == 1 or self.span[0] is None):
            self.span[self.index] = timer.mark()


def spans_ms(spans: list[Span], ms: Callable[[Any, Any], float]) -> float:
    """Total milliseconds of the complete spans."""
    return sum(ms(s[0], s[1]) for s in spans if s[0] is not None and s[1] is not None)
