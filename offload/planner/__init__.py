"""The planner: per layer keep / offload / recompute, chosen for a memory budget.

- ``types``: profiles (what a probe measured), plans, predictions; ``model``: the cost model that
  predicts a plan's step time and peak (its docstring is the runtime's spec); ``search``: the
  fastest plan under a budget, or the lowest-memory one; ``table``: the readable per-layer table.
  These four are pure Python (no torch).
- ``probe``: the probe step that measures a model; ``make``: ``offload.plan(...)`` and the
  helpers ``OffloadActivations`` uses to plan on its first step.
"""

from .make import LOWEST, check_budget, choose, plan, profile_step
from .model import PREFETCH_DEPTH, held_bytes, offloaded_bytes, resident_bytes, simulate
from .search import BudgetError, best_plan, layer_candidates, lowest_peak, plan_for
from .table import format_plan
from .types import Action, LayerPlan, LayerProfile, LinkProfile, Plan, Prediction, StepProfile

__all__ = [
    "Action", "BudgetError", "LOWEST", "LayerPlan", "LayerProfile", "LinkProfile", "PREFETCH_DEPTH",
    "Plan", "Prediction", "StepProfile", "best_plan", "check_budget", "choose", "format_plan",
    "held_bytes", "layer_candidates", "lowest_peak", "offloaded_bytes", "plan", "plan_for",
    "profile_step", "resident_bytes", "simulate",
]
