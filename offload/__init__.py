"""offload: activation CPU offloading for PyTorch training, gradients bitwise equal to the run
without it. Which entry point to start with: the README's table. Every public name, one line each:

Offload (wrap the forward; each runs on a GPU, or on the CPU where CUDA is absent):
    OffloadActivations(layers)      one ``with`` around the forward; layers: e.g. model.model.layers
    OffloadActivations()            the same without layers: groups cut by bytes (torchtune's form)
    get_cpu_offload_context(...)    TransformerEngine's call shape: (ctx, sync) for a loop of layers
    integrations                    HF Trainer and TRL: integrations.hf.offload_trainer(trainer)
Plan (per layer keep, offload or recompute, for a memory budget):
    plan(layers, step_fn, budget)   a plan made beforehand; or OffloadActivations(memory_budget_bytes=)
    BudgetError                     a budget below the lowest peak any plan reaches
    selective_recompute(modules)    keep GEMM outputs, recompute the cheap ops (e.g. every MLP)
    planner                         the planner's parts: profiles, cost model, search, tables
    tiling                          the LM head and loss, MLPs, run over chunks of tokens (long context)
    parallel                        longer than one GPU: context parallelism (ring attention), FSDP2
Choose tensors:
    mark_not_offload(*tensors)      these stay on the GPU, in every mode
    mark_activation_offload(*ts)    opt these in (the v1 schedule's selection)
    keep_on_gpu()                   a region whose saved tensors stay put (torchtune's NoOpManager)
    DEFAULT_MIN_OFFLOAD_BYTES       smaller tensors stay put unless marked (64 KiB)
What happened:
    StepStats                       the keys of ctx.stats: help(offload.StepStats) has each unit
    plot                            timeline and memory curve of one step (matplotlib optional)
More:
    fp8                             FP8 layers that save FP8 activations; fp8.convert(model) swaps nn.Linear
    graphs                          CUDA graphs of a step or of layers; CaptureError: captured before one eager step
    OffloadContext, ManualController   what get_cpu_offload_context returns
    resolve_mode(mode), MODE_ENV_VAR   the schedule: v2 (default) or v1 (NVTE_CPU_OFFLOAD_V1=1)
    native_available()              whether the native copy path (offload._C) is built
TE's other names: start_offload, is_cpu_offload_enabled, is_cpu_offload_layer, CPUOffloadEnabled/-Layer (live).
"""

from __future__ import annotations

import importlib
from typing import Any

from .api import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    MODE_ENV_VAR,
    ManualController,
    OffloadContext,
    get_cpu_offload_context,
    resolve_mode,
)
from .activations import OffloadActivations
from . import graphs, planner, tiling
from .planner import BudgetError, plan
from .host.arena import CaptureError
from .engine.marks import mark_activation_offload, mark_not_offload, start_offload
from .host.native import native_available
from .scope import is_cpu_offload_enabled, is_cpu_offload_layer, keep_on_gpu
from .forwards.selective import selective_recompute
from .engine.stats import StepStats

__all__ = [
    "BudgetError",
    "CaptureError",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "MODE_ENV_VAR",
    "ManualController",
    "StepStats",
    "OffloadActivations",
    "OffloadContext",
    "fp8",
    "get_cpu_offload_context",
    "graphs",
    "integrations",
    "is_cpu_offload_enabled",
    "is_cpu_offload_layer",
    "keep_on_gpu",
    "mark_activation_offload",
    "mark_not_offload",
    "native_available",
    "parallel",
    "plan",
    "planner",
    "plot",
    "resolve_mode",
    "selective_recompute",
    "start_offload",
    "tiling",
]

# Subpackages imported on first use: ``import offload`` stays cheap (no profiler, FP8 layers or
# integrations loaded) and needs neither matplotlib nor triton nor transformers.
_LAZY_SUBPACKAGES = ("fp8", "plot", "integrations", "parallel")
# Documented by name in the docstring above; their help is mostly inherited dict or Exception
# methods (about 200 lines for StepStats alone), which pydoc would print into help(offload).
_HELP_BY_NAME = ("StepStats", "CaptureError", "BudgetError")


def __getattr__(name: str) -> Any:
    """The lazily imported subpackages (``offload.fp8``, ``offload.plot``,
    ``offload.integrations``) and TransformerEngine v1's flags ``CPUOffloadEnabled`` and
    ``CPUOffloadedLayer``, read live from the saved-tensor hooks (``offload.scope``) rather than
    kept in a mutable global."""
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "CPUOffloadEnabled":
        return is_cpu_offload_enabled()
    if name == "CPUOffloadedLayer":
        return is_cpu_offload_layer()
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The package's names, with the lazy subpackages and without the classes documented by name
    in the docstring (pydoc renders every class ``dir`` lists; attribute access, ``__all__`` and
    ``from offload import *`` still have them)."""
    return sorted((set(globals()) | set(_LAZY_SUBPACKAGES)) - set(_HELP_BY_NAME))


__version__ = "0.1.0"
