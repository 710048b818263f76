"""offload: activation CPU offloading for PyTorch training.

Public API: :func:`get_cpu_offload_context` (TransformerEngine's call shape),
:class:`OffloadActivations` (one ``with`` around the forward), :func:`mark_not_offload`,
:func:`mark_activation_offload` and :func:`native_available`; the keys of ``ctx.stats``:
:class:`StepStats`. CUDA graphs: ``offload.graphs`` (:func:`offload.graphs.make_graphed_callables`,
:class:`offload.graphs.StepGraph`). Plots (matplotlib optional): ``offload.plot``.
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
from .marks import mark_activation_offload, mark_not_offload
from .native import native_available
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
    "mark_activation_offload",
    "mark_not_offload",
    "native_available",
    "plan",
    "planner",
    "resolve_mode",
]
__version__ = "0.1.0"
