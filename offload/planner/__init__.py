"""The planner: per layer keep / offload / recompute, chosen for a memory budget.

- ``types``: profiles (what a probe measured), plans, predictions; ``model``: the cost model that
  predicts a plan's step time and peak (its docstring is the runtime's spec); ``search``: the
  fastest plan under a budget, or the lowest-memory one; ``budget``: what "device" means;
  ``table``: the readable per-layer table; ``shapes``: a step's batch shape, how a saved tensor
  grows with it, the buckets plans are cached by; ``scaling``: a profile predicted at another
  shape. These seven are pure Python (no torch).
- ``probe``: the probe step that measures a model (plainly, or with every layer checkpointed),
  with ``instrument`` (what it wraps around modules to see inside a layer), ``timeline`` (where
  it reads time and memory), ``tally`` (each slot's largest tensor and growth, attention's time)
  and ``link`` (the host link's speed); ``agree``: ranks agree on every decision that changes
  the collectives they issue (probe steps, short probe, shape, out of memory, ``BudgetError``);
  ``sequence``: which probe each planning step runs, so that planning fits
  wherever checkpointing fits; ``make``: ``offload.plan(...)`` and the helpers
  ``OffloadActivations`` uses to plan on its first steps.
"""

from .budget import DEVICE, DEVICE_HEADROOM, DeviceBudget, device_budget
from .make import LOWEST, check_budget, choose, plan, profile_step
from .model import PREFETCH_DEPTH, held_bytes, offloaded_bytes, resident_bytes, simulate
from .search import PEAK_MODEL_ERROR, BudgetError, best_plan, layer_candidates, lowest_peak, plan_for
from .table import format_plan
from .types import Action, LayerPlan, LayerProfile, LinkProfile, Plan, Prediction, StepProfile

__all__ = [
    "Action", "BudgetError", "DEVICE", "DEVICE_HEADROOM", "DeviceBudget", "LOWEST", "LayerPlan",
    "LayerProfile", "LinkProfile", "PEAK_MODEL_ERROR", "PREFETCH_DEPTH",
    "Plan", "Prediction", "StepProfile", "best_plan", "check_budget", "choose", "device_budget", "format_plan",
    "held_bytes", "layer_candidates", "lowest_peak", "offloaded_bytes", "plan", "plan_for",
    "profile_step", "resident_bytes", "simulate",
]
