"""FP8 copies of a weight, made once per weight version, in one layout or two.

A weight does not change between micro-batches, nor between forward and backward, so quantizing
it on every call (as TransformerEngine does unless told ``is_first_microbatch``) wastes a read of
the weight and two kernels per GEMM.

The cache key is the weight tensor itself (a weak reference: the cache does not keep it alive),
its version counter, its storage address, dtype and shape, and the scaling and layouts.

* The tensor object: an address is not an identity. ``torch.func.functional_call`` passes a
  fresh tensor per call, and a fresh tensor often lands where the previous one was freed, with the
  same version (0): keyed on the address alone, it got the dead weight's FP8 copy (issue 32). A
  dead or different tensor object is a miss, whatever its address.
* The version counter: every in-place update through autograd-visible ops bumps it (optimizer
  steps, ``copy_`` under ``no_grad``, ``load_state_dict``).
* The address: ``param.data = other`` keeps the Parameter object and its version but swaps its
  memory.

Writes through ``.data`` (``param.data.mul_(2)``) bypass the version counter and keep the address:
after one, call :meth:`WeightCache.clear`.

While a CUDA graph is being captured the cache is neither read nor written: the captured kernels
must quantize the weight on every replay, since the optimizer changes it between replays.

Layouts (``weight_layouts``). The forward GEMM takes the weight ``(N, K)`` rowwise and dgrad takes
its transpose ``(K, N)``; each is one byte per parameter.

* ``"one"`` (default): only the forward's layout is cached (one byte per parameter); dgrad's is
  made in backward, per weight and backward, and dropped after its GEMM. The forward's is the one
  to keep: it is used by every forward (each micro-batch, and eval forwards that have no
  backward), dgrad's once per backward. With ``"tensorwise"`` scaling both layouts share one
  scale and the columnwise data is the exact transpose of the rowwise data, so dgrad's operand is
  an FP8 transpose of the copy the forward used (one read and one write of a byte per parameter,
  no requantization) and results are bitwise those of ``"both"``. With ``"rowwise"`` scaling the
  columnwise copy has its own per-column scales, which no transpose gives: dgrad's operand is
  requantized from the weight in backward (one read of the high-precision weight), bitwise what
  ``"both"`` caches, since autograd's version check guarantees the weight forward saw.
* ``"both"``: both layouts are cached (two bytes per parameter), as before: no work in backward.

Why ``"one"`` is the default: LLAMA-2B's decoder (1.75 G parameters) held 3.5 GB of FP8 copies
with ``"both"``, which put the FP8 step's peak 15% above bf16's (measured on an H200, issue 27);
``"one"`` saves 1.75 GB of that. Its price is a transpose per weight and backward: 3.5 GB moved
per step in all, about 1 ms at an H100's 3.35 TB/s against a 157 ms step (an estimate from
bandwidth; ``benchmarks/fp8_llama.py`` measures both settings in one process).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..engine.stats import weight_cache_bytes as _cache_bytes
from .cast import quantize, transpose

__all__ = [
    "GemmWeight", "WeightCache", "WEIGHT_LAYOUTS", "DEFAULT_WEIGHT_LAYOUTS", "dgrad_operand", "quantize_weight",
    "weight_cache_bytes",
]

# Weights are always e4m3fn: cuBLASLt has no e5m2 x e5m2 FP8 GEMM, and the rowwise kernels take
# e4m3fn only.
WEIGHT_FP8 = torch.float8_e4m3fn
WEIGHT_LAYOUTS = ("one", "both")
DEFAULT_WEIGHT_LAYOUTS = "one"


class GemmWeight(NamedTuple):
    """A weight ``W`` ``(N, K)`` as ready-made ``_scaled_mm`` ``mat2`` operands: ``fprop``
    ``(K, N)`` column-major for ``X @ W^T`` and ``dgrad`` ``(N, K)`` column-major for ``dY @ W``,
    with their scales shaped as ``_scaled_mm`` wants them (``(1,)``, or ``(1, N)`` / ``(1, K)``).

    ``dgrad`` and ``dgrad_scale`` are None when one layout is cached (see the module docstring);
    :func:`dgrad_operand` then makes them. ``source`` is the weight (detached, its memory is the
    parameter's) when dgrad's operand must be requantized from it (rowwise scaling), else None."""

    fprop: torch.Tensor
    fprop_scale: torch.Tensor
    dgrad: Optional[torch.Tensor] = None
    dgrad_scale: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        """Bytes of the FP8 copies and their scales (``source`` is the parameter's memory)."""
        return sum(t.nbytes for t in (self.fprop, self.fprop_scale, self.dgrad, self.dgrad_scale) if t is not None)


def check_weight_layouts(owner: str, weight_layouts: object) -> None:
    """Raise a ValueError naming ``owner`` unless ``weight_layouts`` is one of :data:`WEIGHT_LAYOUTS`."""
    if weight_layouts not in WEIGHT_LAYOUTS:
        raise ValueError(
            f"{owner}: weight_layouts must be 'one' (cache the forward's FP8 weight, make dgrad's in "
            f"backward) or 'both' (cache both), got {weight_layouts!r}"
        )


def quantize_weight(weight: torch.Tensor, scaling: str, weight_layouts: str = DEFAULT_WEIGHT_LAYOUTS) -> GemmWeight:
    """The forward's FP8 layout of ``weight``, and dgrad's too with ``weight_layouts="both"``,
    from one read of it."""
    both = weight_layouts == "both"
    w = weight.detach()
    op = quantize(w, WEIGHT_FP8, scaling, rowwise=True, columnwise=both)
    assert op.row is not None and op.row_scale_inv is not None
    if scaling == "tensorwise":
        if both:
            return GemmWeight(op.row.t(), op.row_scale_inv, op.col.t(), op.col_scale_inv)
        return GemmWeight(op.row.t(), op.row_scale_inv)
    if both:
        return GemmWeight(op.row.t(), op.row_scale_inv.view(1, -1), op.col.t(), op.col_scale_inv.view(1, -1))
    return GemmWeight(op.row.t(), op.row_scale_inv.view(1, -1), source=w)


def dgrad_operand(w: GemmWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """dgrad's ``mat2`` ``(N, K)`` column-major and its scale: the cached ones, or made now from
    ``w`` when one layout is cached (a transpose of ``w.fprop``, or a requantization of
    ``w.source`` for rowwise scaling). What is made here lives until dgrad's GEMM is done."""
    if w.dgrad is not None and w.dgrad_scale is not None:
        return w.dgrad, w.dgrad_scale
    if w.source is None:
        # Tensorwise: fprop is row.t(), a (K, N) view of the rowwise (N, K) data; its transpose
        # is the columnwise (K, N) data, bit for bit what the quantizer writes, and it shares
        # the one scale.
        return transpose(w.fprop.t()).t(), w.fprop_scale
    op = quantize(w.source, WEIGHT_FP8, "rowwise", rowwise=False, columnwise=True)
    assert op.col is not None and op.col_scale_inv is not None
    return op.col.t(), op.col_scale_inv.view(1, -1)


class WeightCache:
    """The FP8 operands of one weight, remade when the weight tensor, its version or its storage
    changes (see the module docstring). ``weight_layouts`` (``"one"`` or ``"both"``) says which
    are kept; :attr:`nbytes` is what they hold."""

    __slots__ = ("_ref", "_key", "_value", "weight_layouts")

    def __init__(self, weight_layouts: str = DEFAULT_WEIGHT_LAYOUTS) -> None:
        check_weight_layouts("fp8.WeightCache", weight_layouts)
        self.weight_layouts = weight_layouts
        self.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of the cached FP8 copies (0 when empty)."""
        return 0 if self._value is None else self._value.nbytes

    def clear(self) -> None:
        """Forget the cached copy (the next call quantizes again)."""
        self._ref: Optional[weakref.ref[torch.Tensor]] = None  # the weight the copy was made of
        self._key: Optional[tuple[object, ...]] = None
        self._value: Optional[GemmWeight] = None

    def __getstate__(self) -> str:
        # A weak reference cannot be pickled, and an unpickled (or deep-copied) weight is a new
        # tensor anyway: a copy of the cache starts empty.
        return self.weight_layouts

    def __setstate__(self, weight_layouts: str) -> None:
        self.weight_layouts = weight_layouts
        self.clear()

    def get(self, weight: torch.Tensor, scaling: str, refresh: bool = False) -> GemmWeight:
        """The FP8 operands of ``weight``, from the cache when it is current. ``refresh`` forces a
        new quantization (TransformerEngine's ``is_first_microbatch=True``)."""
        # (torch._C's query directly: torch.cuda's wrapper adds a Python frame to every call.)
        if weight.is_cuda and torch._C._cuda_isCurrentStreamCapturing():
            return quantize_weight(weight, scaling, self.weight_layouts)
        key = (weight._version, weight.data_ptr(), weight.dtype, weight.shape, scaling, self.weight_layouts)
        ref = self._ref
        # The same tensor object, alive, first: an address is no identity (the module docstring).
        if not refresh and ref is not None and ref() is weight and key == self._key and self._value is not None:
            return self._value
        # Drop the old copy before making the new one: the two never coexist in the cache
        # (a forward still waiting for its backward keeps its own through ctx.gemm_weight).
        self.clear()
        self._value = quantize_weight(weight, scaling, self.weight_layouts)
        self._ref, self._key = weakref.ref(weight), key
        return self._value


def weight_cache_bytes(module: torch.nn.Module) -> int:
    """Bytes of FP8 weight copies cached now by ``module`` and its submodules (each FP8 layer's
    ``weight_cache.nbytes``): one byte per parameter of the converted weights with
    ``weight_layouts="one"``, two with ``"both"``, 0 before the first forward. The same figure
    as an offload context's ``stats["weight_cache_bytes"]`` for the modules it was given."""
    return _cache_bytes([module])
