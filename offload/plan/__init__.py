"""The planner's pure part: profiles and plans, the cost model, the search, the readable table.

Nothing here needs torch: a probe step (elsewhere) fills a :class:`StepProfile`; :func:`best_plan`
or :func:`lowest_peak` turns it into a :class:`Plan`, which the runtime follows layer by layer.
"""

from .model import PREFETCH_DEPTH, held_bytes, offloaded_bytes, resident_bytes, simulate
from .search import BudgetError, best_plan, layer_candidates, lowest_peak, plan_for
from .table import format_plan
from .types import Action, LayerPlan, LayerProfile, LinkProfile, Plan, Prediction, StepProfile

__all__ = [
    "Action",
    "BudgetError",
    "LayerPlan",
    "LayerProfile",
    "LinkProfile",
    "PREFETCH_DEPTH",
    "Plan",
    "Prediction",
    "StepProfile",
    "best_plan",
    "format_plan",
    "held_bytes",
    "layer_candidates",
    "lowest_peak",
    "offloaded_bytes",
    "plan_for",
    "resident_bytes",
    "simulate",
]
