"""offload: activation CPU offloading for PyTorch training.

Public API: :func:`get_cpu_offload_context` (TransformerEngine's call shape),
:class:`OffloadActivations` (one ``with`` around the forward), :func:`mark_not_offload`,
:func:`mark_activation_offload` and :func:`native_available`. TransformerEngine's other names:
:func:`start_offload`, :func:`is_cpu_offload_enabled`, :func:`is_cpu_offload_layer` and the flags
``CPUOffloadEnabled`` / ``CPUOffloadedLayer`` (read live). torchtune's ``NoOpManager``:
:class:`keep_on_gpu`. CUDA graphs: ``offload.graphs``
(:func:`offload.graphs.make_graphed_callables`, :class:`offload.graphs.StepGraph`). The keys of
``ctx.stats``: :class:`StepStats`. Plots (matplotlib optional): ``offload.plot``.
"""

from .api import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    MODE_ENV_VAR,
    ManualController,
    OffloadContext,
    get_cpu_offload_context,
    resolve_mode,
)
from .activations import OffloadActivations
from . import graphs, planner
from .planner import plan
from .arena import CaptureError
from .marks import mark_activation_offload, mark_not_offload, start_offload
from .native import native_available
from .scope import is_cpu_offload_enabled, is_cpu_offload_layer, keep_on_gpu
from .selective import selective_recompute
from .stats import StepStats

__all__ = [
    "CaptureError",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "MODE_ENV_VAR",
    "ManualController",
    "StepStats",
    "OffloadActivations",
    "OffloadContext",
    "get_cpu_offload_context",
    "graphs",
    "is_cpu_offload_enabled",
    "is_cpu_offload_layer",
    "keep_on_gpu",
    "mark_activation_offload",
    "mark_not_offload",
    "native_available",
    "plan",
    "planner",
    "resolve_mode",
    "selective_recompute",
    "start_offload",
]


def __getattr__(name: str) -> bool:
    # TransformerEngine v1's module flags, read live from the saved-tensor hooks (see
    # offload.scope) rather than kept in a mutable global: ``offload.CPUOffloadEnabled``.
    if name == "CPUOffloadEnabled":
        return is_cpu_offload_enabled()
    if name == "CPUOffloadedLayer":
        return is_cpu_offload_layer()
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
__version__ = "0.1.0"
