"""Helpers for the FP8 Llama-ops tests: the decoder's Linears made FP8, saved bytes counted per
module, and HF decoder layers callable in TransformerEngine's call shape."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from offload import fp8


def fp8_linears(model: nn.Module, scaling: str = "tensorwise") -> nn.Module:
    """``offload.fp8.convert`` on every Linear but the LM head, the Linears only (the norms and
    MLPs are swapped by the tests that ask for them); its warning that the CPU is slow is
    expected in these tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fp8.convert(model, module_filter_fn=lambda _m, name: name != "lm_head", scaling=scaling, llama_ops=False)
    return model


def saved_bytes_by_module(module: nn.Module, run: Callable[[], Any]) -> dict[str, int]:
    """Bytes of the activations autograd saves while ``run()`` runs, by the innermost submodule of
    ``module`` that saved them: each storage counted once (a tensor saved again, or a view of a
    saved one, holds nothing new), parameters' storages not at all."""
    stack = ["<outside>"]
    handles = []
    for name, m in module.named_modules():
        handles.append(m.register_forward_pre_hook(lambda _m, _a, name=name: stack.append(name)))
        handles.append(m.register_forward_hook(lambda _m, _a, _o: (stack.pop(), None)[1], always_call=True))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    out: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            out[stack[-1]] = out.get(stack[-1], 0) + t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return out


class RopeLayer(nn.Module):
    """An HF decoder layer called as ``layer(hidden_states)``: the rotary embeddings made here
    from the model's rotary module (held unregistered: no parameters of its own)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "rotary", rotary)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        out = self.layer(h, position_embeddings=self.rotary(h, positions))
        return out[0] if isinstance(out, tuple) else out


def decoder_stack(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF Llama as a ModuleList of :class:`RopeLayer`."""
    return nn.ModuleList(RopeLayer(layer, model.model.rotary_emb) for layer in model.model.layers)
