"""Finding a model's repeated layers: the module list that ``OffloadActivations`` wants.

Transformers keep their blocks in one ``nn.ModuleList`` (HF Llama ``model.model.layers``, GPT-2
``transformer.h``, GPT-NeoX ``gpt_neox.layers``, ...), but the attribute path differs from family
to family and wrappers (PEFT, DDP's ``.module``) add levels. Rather than keep a table of names
that is never complete, :func:`find_layers` looks for what those paths have in common: a module
list of at least two modules of one class, and, of those, the one holding the most parameters
(the decoder stack, not a list of experts inside one layer or a pair of norms). The core uses it
to name the right attribute when a whole model is passed where its layers were expected; the
integrations (``offload.integrations``) use it to find the layers of a Trainer's model.
Bottom floor: imports nothing of ours.
"""

from __future__ import annotations

from typing import Optional

import torch


def find_layers(model: torch.nn.Module) -> Optional[tuple[str, torch.nn.Module]]:
    """The repeated layers of ``model``: ``(path, module_list)``, or None when it has none.

    ``path`` is the attribute path from ``model`` (``"model.layers"`` for an HF
    ``LlamaForCausalLM``, ``"transformer.h"`` for GPT-2, ``""`` when ``model`` itself is the
    list). Candidates are ``nn.ModuleList`` / ``nn.Sequential`` modules with at least two
    children, all of one class; the one with the most parameters wins, the first registered on a
    tie. A model with two stacks (an encoder and a decoder) gets the larger one: pass both lists,
    concatenated in call order, to offload both.
    """
    best: Optional[tuple[str, torch.nn.Module, int]] = None
    for path, module in model.named_modules(remove_duplicate=True):
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[2]:
            best = (path, module, size)
    return None if best is None else (best[0], best[1])


def describe_layers(model: torch.nn.Module) -> str:
    """A phrase naming ``model``'s repeated layers for an error message: ``"model.model.layers
    (a ModuleList of 4 LlamaDecoderLayer)"``, or an empty string when there are none. The model
    is called ``model`` here, as users usually name it."""
    found = find_layers(model)
    if found is None:
        return ""
    path, layers = found
    kinds = {type(child).__name__ for child in layers}
    return f"model.{path} (a {type(layers).__name__} of {len(layers)} {kinds.pop()})" if path else ""
