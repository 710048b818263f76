"""Swap the ops around the GEMMs of Llama-style decoder layers for the FP8-saving ones.

:func:`convert_llama_ops` finds every Llama-style decoder layer (duck-typed: a module with
``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v}_proj`` and
``mlp.{gate,up,down}_proj``: HF's Llama, Mistral, Qwen2 and their kind) and replaces, in place:

* each RMSNorm by :class:`~offload.fp8.RMSNorm` around the same ``weight`` Parameter (checked
  first: the norm's output on a probe input must equal ``LlamaRMSNorm``'s ops bit for bit, so
  Gemma's ``1 + weight`` norms and hub kernels are left alone);
* the MLP by :class:`~offload.fp8.SwiGLUMLP` holding the same three projection modules (when its
  ``act_fn`` is SiLU, checked on a probe input).

The attention forward is untouched: ``q_proj``, ``k_proj`` and ``v_proj`` are called on the norm's
output as before, and being ``fp8.Linear``s they find its input source. Parameter objects and
state dict keys do not change. The order with :func:`offload.fp8.convert` (``nn.Linear`` to
``fp8.Linear``) does not matter: the Linears recognise the sources when they run. Until they are
``fp8.Linear``s they save the norm output (bf16) as before; the summary counts them.

:func:`restore_llama_ops` puts the original modules back (with the current Parameters and
projection modules).

Nothing of the user's is written over or deleted. The swap adds and removes no attribute on a
model's own modules: it replaces the layer's norm and MLP entries, keeping the originals
unregistered and untouched, and puts them back with their attributes, setting only the names they
already hold (``weight``; the projections) to the objects the model holds by then. While
converted, code that reads ``layer.mlp`` sees the replacement, and hooks on the originals do not
run. A norm or MLP holding Parameters or buffers that the replacement would not hold (anything
beyond the norm's ``weight`` or the three projections: an adapter, a scale) is left alone, with
the reason in the summary: swapped, they would drop out of the model's parameters and state dict
while converted, and the replacement's forward would ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .rmsnorm import RMSNorm, rms_norm_torch
from .swiglu import SwiGLUMLP

__all__ = ["LlamaOpsSummary", "convert_llama_ops", "restore_llama_ops", "llama_layers"]

_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_PROBE_ROWS = 4


@dataclass
class LlamaOpsSummary:
    """What :func:`convert_llama_ops` did.

    ``layers``: Llama-style decoder layers found. ``norms``, ``mlps``: ops swapped now.
    ``already``: ops found converted by an earlier call. ``skipped``: ``"name: reason"`` for
    each op left as it was. ``fp8_linears`` of ``consumer_linears``: the Linears fed by a
    converted op that are ``fp8.Linear`` now (q, k, v, gate, up and down projections); the others
    save their bf16 input until :func:`offload.fp8.convert` swaps them.
    """

    layers: int = 0
    norms: int = 0
    mlps: int = 0
    already: int = 0
    skipped: list[str] = field(default_factory=list)
    fp8_linears: int = 0
    consumer_linears: int = 0

    def __str__(self) -> str:
        text = (
            f"convert_llama_ops: {self.layers} Llama-style layers; swapped {self.norms} RMSNorms and "
            f"{self.mlps} MLPs ({self.already} already converted, {len(self.skipped)} skipped); "
            f"{self.fp8_linears} of {self.consumer_linears} projections they feed are fp8.Linear"
        )
        return "\n  ".join([text, *self.skipped])


def _has(module: nn.Module, parent: str, names: tuple[str, ...]) -> bool:
    child = getattr(module, parent, None)
    return isinstance(child, nn.Module) and all(isinstance(getattr(child, n, None), nn.Module) for n in names)


def llama_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` for every Llama-style decoder layer in ``model``."""
    for name, module in model.named_modules():
        if (
            all(isinstance(getattr(module, n, None), nn.Module) for n in _NORMS)
            and _has(module, "self_attn", _ATTN)
            and _has(module, "mlp", _MLP)
        ):
            yield name, module


def _probe(like: torch.Tensor, width: int) -> torch.Tensor:
    """A small input on ``like``'s device and dtype, different in every row (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(_PROBE_ROWS, width, generator=g).to(device=like.device, dtype=like.dtype)


def _unkept_state(module: nn.Module, kept: tuple[str, ...], replacement: str) -> Optional[str]:
    """Why swapping ``module`` for ``replacement``, which holds only its entries ``kept``, would
    drop Parameters or buffers of it (the names, and what that would do), or None."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    dropped = [name for name, _ in tensors if name.split(".", 1)[0] not in kept]
    if not dropped:
        return None
    return (
        f"it holds {', '.join(dropped)}, which {replacement} would not: swapped, they would leave the "
        "model's parameters and state dict, and its forward would not use them"
    )


def _norm_mismatch(norm: nn.Module) -> Optional[str]:
    """Why ``norm`` cannot become an :class:`RMSNorm`, or None."""
    reason = _unkept_state(norm, ("weight",), "fp8.RMSNorm")
    if reason is not None:
        return reason
    try:
        ours = RMSNorm.from_module(norm)
    except ValueError as e:
        return str(e)
    weight = norm.weight
    if weight.is_meta:
        return None  # nothing to compare on the meta device; the attributes matched
    with torch.no_grad():
        x = _probe(weight, weight.shape[0])
        # Against LlamaRMSNorm's own ops: the fused kernels that ours runs on CUDA may differ in
        # the last bit, which says nothing about what ``norm`` computes.
        if not torch.equal(norm(x), rms_norm_torch(x, ours.weight, ours.variance_epsilon)[0]):
            return f"{type(norm).__name__}'s output differs from LlamaRMSNorm's (weight * normalized x)"
    return None


def _mlp_mismatch(mlp: nn.Module) -> Optional[str]:
    """Why ``mlp`` cannot become a :class:`SwiGLUMLP`, or None."""
    reason = _unkept_state(mlp, _MLP, "fp8.SwiGLUMLP")
    if reason is not None:
        return reason
    act = getattr(mlp, "act_fn", None)
    if not callable(act):
        return "it has no act_fn"
    x = torch.linspace(-6, 6, 64)
    with torch.no_grad():
        try:
            same = torch.equal(act(x), F.silu(x))
        except Exception as e:  # noqa: BLE001 - an activation that refuses a probe is not SiLU
            return f"its act_fn failed on a probe input ({e})"
    return None if same else f"its act_fn ({type(act).__name__}) is not SiLU"


def _count_consumers(layer: nn.Module, summary: LlamaOpsSummary) -> None:
    for parent, names in (("self_attn", _ATTN), ("mlp", _MLP)):
        for n in names:
            summary.consumer_linears += 1
            summary.fp8_linears += isinstance(getattr(getattr(layer, parent), n), Linear)


def convert_llama_ops(model: nn.Module, *, missing_ok: bool = False) -> LlamaOpsSummary:
    """Swap, in place, the RMSNorms and SwiGLU MLPs of every Llama-style decoder layer in
    ``model`` for :class:`~offload.fp8.RMSNorm` and :class:`~offload.fp8.SwiGLUMLP` (module
    docstring); idempotent. Returns a :class:`LlamaOpsSummary`.

    Raises ValueError when ``model`` has no Llama-style layer, unless ``missing_ok``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"convert_llama_ops expects an nn.Module, got {type(model).__name__}")
    summary = LlamaOpsSummary()
    for name, layer in list(llama_layers(model)):
        summary.layers += 1
        prefix = f"{name}." if name else ""
        for attr in _NORMS:
            norm = getattr(layer, attr)
            if isinstance(norm, RMSNorm):
                summary.already += 1
                continue
            reason = _norm_mismatch(norm)
            if reason is not None:
                summary.skipped.append(f"{prefix}{attr}: {reason}")
                continue
            setattr(layer, attr, RMSNorm.from_module(norm))
            summary.norms += 1
        mlp = layer.mlp
        if isinstance(mlp, SwiGLUMLP):
            summary.already += 1
        else:
            reason = _mlp_mismatch(mlp)
            if reason is None:
                layer.mlp = SwiGLUMLP.from_module(mlp)
                summary.mlps += 1
            else:
                summary.skipped.append(f"{prefix}mlp: {reason}")
        _count_consumers(layer, summary)
    if summary.layers == 0 and not missing_ok:
        raise ValueError(
            f"convert_llama_ops: found no Llama-style decoder layer in {type(model).__name__} (a module "
            "with input_layernorm, post_attention_layernorm, self_attn.q_proj/k_proj/v_proj and "
            "mlp.gate_proj/up_proj/down_proj); pass missing_ok=True to accept that"
        )
    return summary


def restore_llama_ops(model: nn.Module) -> int:
    """Undo :func:`convert_llama_ops`: put each converted op's original module back, holding the
    converted one's current Parameter (norms) or projection modules (MLPs). Returns how many
    modules were restored."""
    restored = 0
    for _, layer in list(llama_layers(model)):
        for attr in _NORMS:
            norm = getattr(layer, attr)
            if isinstance(norm, RMSNorm) and getattr(norm, "original", None) is not None:
                norm.original.weight = norm.weight
                setattr(layer, attr, norm.original)
                restored += 1
        mlp = layer.mlp
        if isinstance(mlp, SwiGLUMLP) and getattr(mlp, "original", None) is not None:
            for n in _MLP:
                setattr(mlp.original, n, getattr(mlp, n))
            layer.mlp = mlp.original
            restored += 1
    return restored
