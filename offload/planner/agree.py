"""Ranks agree on the shape they plan for, and on whether a plan fits at all.

Under DDP or FSDP2 each rank reads its own step's shape (:func:`~offload.planner.shapes.shape_of`)
and ranks may see batches of different lengths in the same step. If each planned for its own
shape, one rank could raise ``BudgetError`` alone while the others wait in their next collective
until the group's timeout, and ranks would follow plans made for different shapes.
:func:`agree_shape` makes every rank plan for the largest batch and the largest length any rank
saw: a plan made for a larger shape holds for a smaller one (the bytes a layer saves only shrink
with the batch and the length, so its peak does too), so the agreed shape is conservative on
memory for every rank. :func:`agree_flag` lets the ranks raise together: any rank that finds no
plan for the agreed shape makes all of them raise.

Cost: one all-reduce of a few int64s and one host read of its result per call, and only under a
process group of more than one rank; without one, nothing (no collective, no tensor). Under
NCCL the host read waits for the compute stream's work queued so far, so a group that also has a
CPU backend (``init_process_group("cpu:gloo,cuda:nccl")``) reduces on the host instead.

Like any collective, each call must be made by every rank of the group, at the same point and in
the same order: the first layer's entry of each forward (every micro-batch's, if each builds its
own graph), never inside a CUDA graph's capture. Under pipeline parallelism the stages enter
their first layers at different times, waiting on each other's sends, so a collective over the
whole world there deadlocks: pass the data-parallel ``group`` (the ranks holding the same layers).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .shapes import StepShape

__all__ = ["agree_flag", "agree_shape", "ranks_agree_enabled"]


def ranks_agree_enabled(group: Optional["dist.ProcessGroup"] = None) -> bool:
    """Whether agreeing means a collective: ``torch.distributed`` is built in, a process group
    is initialized and ``group`` (the default one if None) has more than one rank. Cheap (no
    communication); safe to call every step."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _reduce_device(device: torch.device, group: Optional["dist.ProcessGroup"]) -> torch.device:
    """Where the group's backend can all-reduce a small tensor, preferring the host (no wait on
    the GPU): gloo reduces on the host anyway; NCCL needs a CUDA tensor (``device`` if it is
    one, else the current CUDA device); another backend gets ``device``."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # one backend per device type: "cpu:gloo,cuda:nccl"
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        if "cpu" in per_device:
            return torch.device("cpu")
        return device if device.type in per_device else _cuda(device)
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return _cuda(device)
    return device  # ucc, mpi and others that take both: the caller's device


def _cuda(device: torch.device) -> torch.device:
    """``device`` if it is a CUDA device, else the current one (asked only here: a CPU-only
    process never calls into CUDA)."""
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def _all_max(values: list[int], device: torch.device, group: Optional["dist.ProcessGroup"]) -> list[int]:
    """The element-wise maximum of ``values`` over the group's ranks (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.int64, device=_reduce_device(torch.device(device), group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()  # the host read: the plan is chosen on the host


def agree_shape(shape: StepShape, device: torch.device, group: Optional["dist.ProcessGroup"] = None) -> StepShape:
    """The shape every rank of ``group`` (the default group if None) plans for this step: the
    largest batch and the largest length among the ranks' shapes, each taken separately, so it
    is at least this rank's shape in both. ``shape`` itself, with no collective, where
    :func:`ranks_agree_enabled` is false. Every rank must call it at the same point (see the
    module notes); ``device`` is this rank's compute device."""
    if not ranks_agree_enabled(group):
        return shape
    batch, length = _all_max([shape.batch, shape.length], device, group)
    return StepShape(int(batch), int(length))


def agree_flag(flag: bool, device: torch.device, group: Optional["dist.ProcessGroup"] = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (a logical OR, one all-reduce):
    a rank that found no plan fitting the agreed shape makes every rank raise ``BudgetError``
    at the same point, so none waits for it in a later collective. ``flag`` itself, with no
    collective, where :func:`ranks_agree_enabled` is false."""
    if not ranks_agree_enabled(group):
        return bool(flag)
    return bool(_all_max([int(bool(flag))], device, group)[0])
