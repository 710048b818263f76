"""What does not compose with context parallelism yet, refused before anything is sharded.

- **Pipeline stages** (``torch.distributed.pipelining``): a stage's micro-batches would each need
  their own ring over the stage's CP group, and the plan group would have to be the stage's.
- **CUDA graphs** (``offload.graphs``): the ring's sends and receives are NCCL calls issued from
  Python per step, and torch's context_parallel patches SDPA at the ``with``'s entry, which a
  replayed graph never sees.
- **FP8** (``offload.fp8``): its layers' saved FP8 activations and scales are not yet checked
  against the ring's sharded layout (nor its GEMMs against the ring's shapes).

Each check reads module types by name (their home module), so neither ``offload.fp8`` (which
loads triton where present) nor ``offload.graphs``' capture machinery is imported to test for it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["check_attention", "check_composes"]

WHERE = "offload.parallel.context_parallel"
_NOT_YET = "does not compose with context parallelism yet"


def _home(module: torch.nn.Module) -> str:
    return type(module).__module__ or ""


def _first(model: torch.nn.Module, prefix: str) -> Optional[str]:
    for name, module in model.named_modules():
        if _home(module).startswith(prefix):
            return f"{name or '<the model>'} ({type(module).__name__})"
    return None


def check_composes(model: Optional[Any], mesh_dim_names: tuple[str, ...]) -> None:
    """Raise ``RuntimeError`` (saying what to do) if ``model`` or the mesh holds something
    context parallelism does not compose with yet: a pipeline stage or a mesh with a ``pp``
    dimension, a CUDA graph being captured or ``offload.graphs`` layers, ``offload.fp8`` layers.
    ``model`` None checks the mesh and the capture only."""
    if any(name in ("pp", "pipeline") for name in mesh_dim_names) or _is_pipeline_stage(model):
        raise RuntimeError(
            f"{WHERE}: pipeline stages {_NOT_YET}; train with FSDP2 over the (dp, cp) mesh "
            "(offload.parallel.make_mesh) instead of pipelining, or pipeline without context parallelism"
        )
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{WHERE}: a CUDA graph is being captured; CUDA graphs (offload.graphs) {_NOT_YET}: "
            "enter context_parallel outside the capture and run the step eagerly"
        )
    if model is None:
        return
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WHERE}: model must be a torch.nn.Module (the model the step runs), got {type(model).__name__}")
    graphed = _first(model, "offload.graphs")
    if graphed:
        raise RuntimeError(
            f"{WHERE}: the model holds CUDA-graphed layers ({graphed}); CUDA graphs (offload.graphs) {_NOT_YET}: "
            "use the layers themselves (eager), with OffloadActivations for the memory"
        )
    fp8 = _first(model, "offload.fp8")
    if fp8:
        raise RuntimeError(
            f"{WHERE}: the model holds FP8 layers ({fp8}); FP8 (offload.fp8) {_NOT_YET}: "
            "build the model without offload.fp8.convert, and train in bf16"
        )


def _is_pipeline_stage(model: Optional[Any]) -> bool:
    # A stage object (not a Module) wraps its submodule; its class lives in torch's pipelining.
    return model is not None and (type(model).__module__ or "").startswith("torch.distributed.pipelining")


def check_attention(model: Optional[torch.nn.Module]) -> None:
    """Raise ``ValueError`` if ``model`` is an HF model whose attention is not SDPA: torch's
    context parallelism patches SDPA only, so any other attention would attend within each
    rank's shard alone, silently. (HF's Trainer refuses the same.)"""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != "sdpa":
        raise ValueError(
            f"{WHERE}: the model's attention is {implementation!r}, and ring attention replaces SDPA only (other "
            "attention would see only this rank's shard); load the model with attn_implementation=\"sdpa\""
        )
