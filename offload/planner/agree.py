"""Ranks agree on every decision that changes the collectives they issue.

Under DDP or FSDP2 each rank reads its own batch, and ranks may see batches of different lengths
in the same step. A decision a rank took from its own batch alone could send it down another
path than the others: one rank past its probe agrees on its plan's shape at its first layer
while another still runs a probe step's all-gathers, or one rank raises ``BudgetError`` while
the others wait in their next collective until the group's timeout. So each such decision is
taken by all ranks of the plan group together, at a point every rank reaches in the same step:

- **How a probe step went, so which probe step comes next** (the low-memory probe after the
  sizing step, every rank measuring again at low memory after an out-of-memory step, the same
  step again after an error, ``BudgetError`` when the low-memory step ran out of memory): the
  worst outcome of any rank (:class:`~offload.planner.sequence.StepOutcome`, :func:`agree_max`),
  at the ``with``'s entry of the step after each probe step, and after each step of a short probe.
  So every rank leaves the probe at the same step.
- **Whether the model form probes its first batch at a short length**: decided on the largest
  batch and length of any rank (and not at all if any rank's call has no labels), at the model's
  entry of each probe step; each rank then cuts its own batch, never longer than it is.
- **Which layers recompute, and which keep attention while they do** (:func:`agree_layers`), when a
  bucket's own plan is put in force (made at a step new to the group, or switched to from its
  stand-in at an agreed step): under context parallelism a recompute runs the ring again, with its
  collectives, and one keeping attention's outputs does not. Each rank's plan then recomputes
  every layer any rank recomputes and keeps attention only where every rank does
  (:func:`follow_layers`: never more memory than its own plan).
- **Which lengths the probe steps saw** (plans ahead): each rank's probe step shapes, the largest
  batch and length of any rank for each, at the first plan's step, so every rank queues the same
  buckets ahead in the same order (:class:`~offload.planner.ahead_steps.AheadSteps`).
- **The plan of each planned step**: the largest batch and length of any rank
  (:func:`agree_step`), with any rank's "ran out of memory since the last planned step" (every
  rank then plans again, the one that ran out at a lowered budget), at the first layer's entry
  (or the model's entry) of every planned step; there too, where the agreed bucket has no plan
  yet on the ranks, whether any rank found none fits (:func:`agree_flag`; with plans ahead, in
  the same all-reduce, which stand-in every rank can follow): then every rank raises ``BudgetError``.

The plans themselves may differ between ranks (each is made from its own rank's measured
figures) in everything that issues no collective: what each layer keeps, offloads or copies (a
layer recomputed in backward under FSDP2 runs without an all-gather of its own, but under context
parallelism its ring does, hence the agreed layers above). :func:`agree_shape` makes every rank plan for the largest batch and the
largest length any rank saw: a plan made for a larger shape holds for a smaller one (the bytes a
layer saves only shrink with the batch and the length, so its peak does too), so the agreed
shape is conservative on memory for every rank.

Cost: one all-reduce of a few int64s and one host read of its result per call, and only under a
process group of more than one rank; without one, nothing (no collective, no tensor). Under
NCCL the host read waits for the compute stream's work queued so far, so a group that also has a
CPU backend (``init_process_group("cpu:gloo,cuda:nccl")``) reduces on the host instead. Planned
steps make one call each (two for a bucket new to the ranks); probe steps one or two; nothing
runs per layer or per tensor.

Like any collective, each call must be made by every rank of the group, at the same point and in
the same order: the points above, in every forward (every micro-batch's, if each builds its own
graph), never inside a CUDA graph's capture. Under pipeline parallelism the stages enter
their first layers at different times, waiting on each other's sends, so a collective over the
whole world there deadlocks: pass the data-parallel ``group`` (the ranks holding the same layers).
Every call reduces as many values, led by the name of its point (and its negation): ranks that
reach different points of this module (a rank that skipped a step, or raised where the others
did not) all raise one clear error there instead of pairing one point's values with another's.
A step that fails on one rank must still reach the next agreement point on every rank: a loop that
retries out-of-memory steps goes on with the next step (with DDP or FSDP2, whose own collectives
cannot survive a rank's failure in the middle of a forward, the ranks must agree to skip the
backward of a step that failed on any of them).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .actions import Action
from .model import simulate
from .shapes import StepShape
from .types import LayerPlan, Plan

__all__ = ["Group", "agree_flag", "agree_layers", "agree_max", "agree_planned_step", "agree_shape", "agree_step",
           "follow_layers", "ranks_agree_enabled"]

# The ranks that agree: a process group, None for the default one, False for none (no collective).
Group = Union[None, Literal[False], "dist.ProcessGroup"]

# Where the ranks agree (the module notes), each with its number in the reduced tensor.
POINTS = ("probe step", "short probe", "planned step", "plan fits", "values", "plan layers", "probe shapes")
_MOST_LAYERS = 1 << 30  # agree_layers checks the ranks' layer counts as (n, _MOST_LAYERS - n)
_WIDTH = 6  # values per call, at most: every call reduces as many (its point's two, then these)


def ranks_agree_enabled(group: Group = None) -> bool:
    """Whether agreeing means a collective: ``group`` is not False, ``torch.distributed`` is
    built in, a process group is initialized and ``group`` (the default one if None) has more
    than one rank. Cheap (no communication); safe to call every step."""
    return group is not False and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


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


def agree_max(values: Sequence[int], device: torch.device, group: Group = None, point: str = "values") -> list[int]:
    """The element-wise maximum of ``values`` (at most six non-negative ints) over the ranks
    of ``group`` (the default group if None), in one all-reduce: the largest size, the worst
    outcome, any rank's flag (as 0 or 1). ``values`` itself, with no collective, where
    :func:`ranks_agree_enabled` is false. Every rank must call it at the same ``point`` (one of
    :data:`POINTS`; see the module notes), or all raise RuntimeError; ``device`` is this rank's
    compute device."""
    values = [int(v) for v in values]
    if not ranks_agree_enabled(group):
        return values
    if len(values) > _WIDTH or min(values, default=0) < 0:
        raise ValueError(f"offload: agree_max takes at most {_WIDTH} non-negative ints, got {values}")
    tag = POINTS.index(point) + 1
    row = [tag, -tag, *values, *[0] * (_WIDTH - len(values))]
    t = torch.tensor(row, dtype=torch.int64, device=_reduce_device(torch.device(device), group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()  # the host read: the plan is chosen on the host
    if got[0] != -got[1]:  # the largest and the smallest point differ
        raise RuntimeError(
            f"offload: the ranks of the plan group reached different agreement points ({POINTS[-got[1] - 1]!r} and "
            f"{POINTS[got[0] - 1]!r}): a rank skipped a step, or went on past an error the others did not have. "
            "Every rank must run the same steps; a step that fails on one rank must still be entered by all "
            "(see offload.planner.agree)"
        )
    return got[2:2 + len(values)]


def agree_step(shape: StepShape, flag: bool, device: torch.device,
               group: Group = None) -> tuple[StepShape, bool]:
    """:func:`agree_shape` and :func:`agree_flag` in one all-reduce: the shape every rank plans
    for this step, and whether ``flag`` is true on any rank (a planned step: whether any rank ran
    out of memory since its last one)."""
    return agree_planned_step(shape, flag, 0, 0, device, group)[:2]


def agree_planned_step(shape: StepShape, flag: bool, behind: int, failed: int, device: torch.device,
                       group: Group = None) -> tuple[StepShape, bool, int, int]:
    """:func:`agree_step`, and the plans made ahead (:class:`offload.planner.ahead.PlansAhead`)
    in the same all-reduce: the largest ``behind`` (how many of the buckets planned ahead, the
    same list on every rank, are not ready on this rank counting back from the last: the group's
    ready ones are the first ``len - max``) and the largest ``failed`` (``len - i`` for the first
    ready bucket ``i`` whose making failed on this rank, 0 if none: the first that failed on any)."""
    if not ranks_agree_enabled(group):
        return shape, bool(flag), int(behind), int(failed)
    batch, length, any_flag, most_behind, first_failed = agree_max(
        [shape.batch, shape.length, int(bool(flag)), behind, failed], device, group, "planned step")
    return StepShape(int(batch), int(length)), bool(any_flag), int(most_behind), int(first_failed)


def agree_shape(shape: StepShape, device: torch.device, group: Group = None) -> StepShape:
    """The shape every rank of ``group`` (the default group if None) plans for this step: the
    largest batch and the largest length among the ranks' shapes, each taken separately, so it
    is at least this rank's shape in both. ``shape`` itself, with no collective, where
    :func:`ranks_agree_enabled` is false. Every rank must call it at the same point (see the
    module notes); ``device`` is this rank's compute device."""
    if not ranks_agree_enabled(group):
        return shape
    batch, length = agree_max([shape.batch, shape.length], device, group, "planned step")
    return StepShape(int(batch), int(length))


def agree_flag(flag: bool, device: torch.device, group: Group = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (a logical OR, one all-reduce):
    a rank that found no plan fitting the agreed shape makes every rank raise ``BudgetError``
    at the same point, so none waits for it in a later collective. ``flag`` itself, with no
    collective, where :func:`ranks_agree_enabled` is false."""
    return bool(agree_max([int(bool(flag))], device, group, "plan fits")[0])


def agree_layers(recomputed: Sequence[bool], keeping: Sequence[bool], device: torch.device,
                 group: Group = None) -> tuple[list[bool], list[bool]]:
    """Per layer, whether any rank of ``group`` recomputes it, and whether every rank recomputes it
    keeping attention's outputs (``keeping``: this rank's ``LayerPlan.keep_attention``). Two
    all-reduces: the point and the layer count (as :func:`agree_max`, so that ranks at different
    points raise rather than pair tensors of other sizes), then two values per layer. The
    arguments themselves, with no collective, where :func:`ranks_agree_enabled` is false."""
    recomputed, keeping = [bool(v) for v in recomputed], [bool(v) for v in keeping]
    if not ranks_agree_enabled(group):
        return recomputed, keeping
    n = len(recomputed)
    most, fewest = agree_max([n, _MOST_LAYERS - n], device, group, "plan layers")
    if most != n or _MOST_LAYERS - fewest != n:
        raise RuntimeError(f"offload: the ranks of the plan group plan models of different depths (this rank {n} "
                           "layers): every rank must pass the same layers")
    flags = [*map(int, recomputed), *(int(not k) for k in keeping)]
    t = torch.tensor(flags, dtype=torch.int64, device=_reduce_device(torch.device(device), group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    got = t.tolist()
    return [bool(v) for v in got[:n]], [not v for v in got[n:]]


def follow_layers(plan: Plan, recomputed: Sequence[bool], keeping: Sequence[bool]) -> Plan:
    """``plan`` recomputing every layer in ``recomputed`` and keeping attention only where
    ``keeping`` says, with its prediction simulated again (``plan`` itself when nothing changes).
    Never more memory than ``plan``, on the GPU or the host: a layer it keeps is recomputed with
    its inputs kept, one it offloads with its inputs offloaded, and attention's outputs are only
    ever dropped."""
    layers = []
    for lp, recompute, keep in zip(plan.layers, recomputed, keeping):
        if recompute and lp.action is not Action.RECOMPUTE:
            lp = LayerPlan(Action.RECOMPUTE, keep_inputs=lp.action is Action.KEEP, tile_tokens=lp.tile_tokens)
        if lp.keep_attention and not keep:
            lp = dataclasses.replace(lp, keep_attention=False)
        layers.append(lp)
    if tuple(layers) == plan.layers:
        return plan
    prediction = simulate(plan.profile, layers, plan.budget_bytes) if plan.profile is not None else plan.prediction
    return dataclasses.replace(plan, layers=tuple(layers), prediction=prediction)
