"""Making a plan: probe one step, then search (``offload.plan``), and measuring how it went.

``offload.plan(layers, step_fn, memory_budget_bytes=...)`` runs ``step_fn`` (one whole training
step: forward and backward) once under a :class:`~offload.planner.probe.ProbeStep`, measures the
host link, and returns the fastest plan under the budget. ``OffloadActivations(layers,
memory_budget_bytes=...)`` does the same on its own first step (see ``offload/activations.py``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..api import DEFAULT_MIN_OFFLOAD_BYTES, resolve_device
from ..keywords import parameter_names, reject_unknown
from ..sizes import byte_count
from ..engine.policy import SelectionPolicy
from ..engine.stats import format_bytes
from .budget import DEVICE, DEVICE_HEADROOM_EXPANDABLE, DeviceBudget, device_budget
from ..forwards.selective import Candidates, selective_candidates
from .link import measure_link
from .sequence import AUTO, ProbeSequence, check_probe
from .search import PEAK_MODEL_ERROR, BudgetError, best_plan, lowest_peak, most_copied_bytes
from .tiling import HeadInfo, choose_tiled, lowest_tiled, mark_lowest
from .types import Action, LinkProfile, Plan, StepProfile

Budget = Union[int, str, None]

LOWEST = "lowest"
LOWEST_TOLERANCE = 0.03
# A plan whose recomputed layers would skip less attention than this share of its step is not
# searched again with them keeping it (the second search and the policy's dispatch cost more).
KEEP_ATTENTION_MIN_SHARE = 0.01


def check_budget(memory_budget_bytes: Budget, where: str) -> Budget:
    """Validate a budget argument: ``"lowest"``, ``"device"``, None (no budget), or bytes >= 1 in
    any form :func:`offload.sizes.byte_count` reads (``20 << 30``, ``20e9``, ``"20GB"``,
    ``"20 GiB"``), returned as whole bytes. ``TypeError`` for a wrong type, ``ValueError`` for a
    bad value, each naming ``where`` and the option."""
    if memory_budget_bytes is None or isinstance(memory_budget_bytes, str) and memory_budget_bytes in (LOWEST, DEVICE):
        return memory_budget_bytes
    return byte_count(where.rstrip(":"), "memory_budget_bytes", memory_budget_bytes, 1,
                      extra=f", {DEVICE!r} (what this GPU can give) or {LOWEST!r}")


def check_device_budget(memory_budget_bytes: Budget, device: torch.device, where: str) -> None:
    """Refuse ``"device"`` where there is no GPU to measure, and warn about a budget in bytes
    larger than the GPU (the plan would be made for memory that is not there)."""
    if memory_budget_bytes == DEVICE and device.type != "cuda":
        raise ValueError(
            f"offload: {where} memory_budget_bytes='device' sizes the plan to a CUDA device's "
            f"free memory, but this run is on {device.type!r}; run on a GPU (device='cuda'), or "
            "pass a budget in bytes or 'lowest'"
        )
    if isinstance(memory_budget_bytes, int) and device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        if memory_budget_bytes > capacity:
            warnings.warn(
                f"offload: {where} memory_budget_bytes={memory_budget_bytes} "
                f"({format_bytes(memory_budget_bytes)}) is more than {device}'s capacity of "
                f"{format_bytes(capacity)} ({capacity} bytes); plans will be made as if the memory "
                "were there. Pass memory_budget_bytes='device' to fit this GPU",
                UserWarning, stacklevel=3,
            )


def read_device_budget(device: torch.device, expandable: bool = False, emptied: bool = False) -> DeviceBudget:
    """The "device" budget of ``device`` now (see :mod:`offload.planner.budget`); ``expandable``:
    :func:`use_expandable_segments` turned them on (the headroom is then theirs); ``emptied``:
    read right after ``torch.cuda.empty_cache()`` (what stays reserved is not available)."""
    free, capacity = torch.cuda.mem_get_info(device)
    # A cap set with torch.cuda.set_per_process_memory_fraction binds the allocator before the
    # device runs out (the reader exists from torch 2.8 on).
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
    cap = int(fraction * capacity) if fraction < 1.0 else None
    return device_budget(int(capacity), int(free), int(torch.cuda.memory_reserved(device)), cap_bytes=cap,
                         headroom=DEVICE_HEADROOM_EXPANDABLE if expandable else None,
                         allocated_bytes=int(torch.cuda.memory_allocated(device)) if emptied else None)


def allocator_settings_setter() -> Optional[Callable[[str], None]]:
    """Torch's setter of the caching allocator's settings at run time (its name moved in torch
    2.9: the old one warns), or None where there is none."""
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        getattr(torch.cuda.memory, "_set_allocator_settings", None)


def use_expandable_segments() -> bool:
    """Turn the caching allocator's expandable segments on for this process, unless its
    allocator configuration names them (either way): whether they are on now by our doing.

    Why: a "device" budget plans for all the GPU can give, and the default allocator cannot give
    it. Measured on the H100 (issue 33), LLAMA-3-8B's shape at 16384 tokens ran out of memory
    with 24.8 GiB reserved but unallocated: blocks cached in segments still partly in use, none
    large enough for the head's logits. Expandable segments map memory into one growing segment
    per stream instead, so a freed block's pages serve a request of any size: the same plans ran,
    reserved within a few percent of allocated. The setting applies to segments made from now
    on; it is process-wide, which is why a configuration the user wrote wins.
    """
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    if "expandable_segments" in conf:
        return False
    setter = allocator_settings_setter()
    if setter is None or not torch.cuda.is_available():
        return False
    try:
        setter("expandable_segments:True")
    except RuntimeError:  # a platform without them (some drivers, ROCm): the default headroom
        return False
    return True


def probe_policy(device: torch.device, min_offload_bytes: int, selection: str = "auto") -> SelectionPolicy:
    """The engine's selection rules with no host budget: the probe only counts."""
    return SelectionPolicy(
        device_index=-1 if device.type == "cpu" else (device.index or 0),
        min_offload_bytes=min_offload_bytes,
        selection=selection,
        reserve_host_bytes=lambda nbytes: True,
    )


def choose(profile: StepProfile, memory_budget_bytes: Budget, device: Optional[torch.device] = None, *,
           cap_bytes: Optional[int] = None, expandable: bool = False, emptied: bool = False,
           head: Optional[HeadInfo] = None, host_budget: Optional[int] = None,
           host_limited: Optional[Callable[[int, int], None]] = None, note_host: bool = True,
           pause: Optional[Callable[[], None]] = None, strict: bool = False) -> Plan:
    """The fastest plan under the budget (``"lowest"``: the fastest plan whose predicted peak
    is within 3% of the lowest; ``"device"``: what ``device``, a CUDA device, can give now, with
    ``expandable`` segments' headroom if :func:`use_expandable_segments` turned them on).
    ``cap_bytes``: a ceiling on a budget in bytes or "device" (after a step ran out of memory);
    ``emptied``: the caller emptied the allocator's cache just now (see :func:`read_device_budget`).
    ``head``: the LM head plans may tile; with a shape-aware profile, plans tile the MLPs and the
    head where no untiled plan fits (:mod:`offload.planner.tiling`). ``host_budget``: bytes a
    plan may copy to the host (a context's: ``HostArena.plan_host_bytes``, the least of its cap,
    the process's budget and the node's room). ``host_limited(wanted, planned)`` is called when
    that figure made the plan copy ``planned`` bytes where, unbounded, it would copy ``wanted``
    (``note_host=False``: not worked out, which saves the second search that takes).
    ``pause``: called before each plan the search simulates (a search on a background thread
    hands the interpreter back to the step's thread there: :class:`offload.planner.ahead.Yielding`).
    ``strict``: where no plan's predicted peak fits the budget, raise :class:`BudgetError` (for a
    plan that is optional, a stand-in) rather than follow the lowest plan when it is within the
    cost model's error above the budget (:func:`~offload.planner.search.best_plan`), with a warning.

    The plan's ``budget_reason`` says which budget was used and why, and the host figure when it
    bound the plan.
    """
    made = _choose(profile, memory_budget_bytes, device, cap_bytes=cap_bytes, expandable=expandable,
                   emptied=emptied, head=head, host_budget=host_budget, pause=pause, strict=strict)
    if not note_host or host_budget is None or host_budget >= most_copied_bytes(profile):
        return made  # the host figure cannot bind: no plan copies more
    try:
        free = _choose(profile, memory_budget_bytes, device, cap_bytes=cap_bytes, expandable=expandable,
                       emptied=emptied, head=head, host_budget=None, pause=pause, strict=strict)
    except BudgetError:
        return made
    wanted, planned = free.prediction.d2h_bytes, made.prediction.d2h_bytes
    if wanted <= host_budget:
        return made
    if host_limited is not None:
        host_limited(wanted, planned)
    return dataclasses.replace(made, budget_reason=f"{made.budget_reason}; host room {format_bytes(host_budget)} "
                                                   f"bound it (copies {format_bytes(planned)}, not {format_bytes(wanted)})")


def _choose(profile: StepProfile, memory_budget_bytes: Budget, device: Optional[torch.device], *,
            cap_bytes: Optional[int], expandable: bool, emptied: bool, head: Optional[HeadInfo],
            host_budget: Optional[int], pause: Optional[Callable[[], None]] = None, strict: bool = False) -> Plan:
    # choose(), but for the host figure's note.
    if cap_bytes is not None and memory_budget_bytes != LOWEST:
        if memory_budget_bytes == DEVICE:
            measured = read_device_budget(device, expandable, emptied) if device is not None and device.type == "cuda" else None
            if measured is not None and measured.budget_bytes <= cap_bytes:
                cap_bytes = None  # the device gives less than the ceiling: plan for the device
        elif memory_budget_bytes is not None and memory_budget_bytes <= cap_bytes:
            cap_bytes = None
        if cap_bytes is not None:
            made = _choose(profile, cap_bytes, device, cap_bytes=None, expandable=False, emptied=False, head=head,
                           host_budget=host_budget, pause=pause, strict=strict)
            return dataclasses.replace(made, budget_reason=f"{memory_budget_bytes!r}, capped at {format_bytes(cap_bytes)}")

    error = 0.0 if strict else PEAK_MODEL_ERROR  # strict: no plan over the budget

    def best(budget: int) -> Plan:
        return choose_tiled(profile, lambda p: best_recomputing(p, budget, error, host_budget, pause, p is profile), head)

    if memory_budget_bytes == LOWEST:
        # Within 3% of the lowest predicted peak, the fastest plan: the runtime then has that
        # much headroom before it must stall on forced releases. Untiled where that fits the
        # device (tiling changes the sums); the lowest tiled plan where it does not.
        made = lowest_peak(profile, tolerance=LOWEST_TOLERANCE, host_budget=host_budget, pause=pause)
        if device is not None and device.type == "cuda" and profile.device == "cuda" and profile.shape is not None \
                and made.prediction.peak_bytes > read_device_budget(device, expandable, emptied).budget_bytes:
            variant, tile_tokens, head_tokens = lowest_tiled(profile, head)
            made = mark_lowest(lowest_peak(variant, tolerance=LOWEST_TOLERANCE, host_budget=host_budget, pause=pause),
                               profile, head, tile_tokens, head_tokens)
        return dataclasses.replace(made, budget_reason=f"lowest (the lowest predicted peak, up to "
                                                       f"{LOWEST_TOLERANCE:.0%} more for speed)")
    if memory_budget_bytes == DEVICE:
        if device is None or device.type != "cuda" or profile.device != "cuda":
            # check_device_budget refuses this at the call; reaching here is a caller's bug.
            raise ValueError(f"offload: memory_budget_bytes='device' needs the CUDA device to plan "
                             f"for, got {device!r} (profile measured on {profile.device!r})")
        measured = read_device_budget(device, expandable, emptied)
        made = best(measured.budget_bytes)
        reason = measured.describe() + (" (expandable segments turned on)" if expandable else "")
        if made.budget_bytes != measured.budget_bytes:  # the lowest plan, followed with a warning
            reason += f"; no plan fits it, the lowest plan is followed at {format_bytes(made.budget_bytes)}"
        return dataclasses.replace(made, budget_reason=reason)
    if memory_budget_bytes is None:
        made = best_plan(profile, profile.plain_peak_bytes, host_budget=host_budget, pause=pause)
        return dataclasses.replace(made, budget_reason="none given (the plain step's peak)")
    made = best(int(memory_budget_bytes))
    reason = "memory_budget_bytes"
    if made.budget_bytes != memory_budget_bytes:
        reason += f"; no plan fits it, the lowest plan is followed at {format_bytes(made.budget_bytes)}"
    return dataclasses.replace(made, budget_reason=reason)


def best_recomputing(profile: StepProfile, budget: int, model_error: float, host_budget: Optional[int],
                     pause: Optional[Callable[[], None]], untiled: bool = True) -> Plan:
    """:func:`~offload.planner.search.best_plan`, or the best plan whose recomputed layers keep
    attention's outputs when that is predicted faster. It is a search of its own (every
    recompute keeps them, or none): the outputs held cost memory that the other layers' actions
    would have used. Tried only where the first plan fits, its recomputed layers would skip at
    least :data:`KEEP_ATTENTION_MIN_SHARE` of its step, and the profile is untiled."""
    made = best_plan(profile, budget, model_error, host_budget=host_budget, pause=pause)
    skipped = sum(layer.attention_forward_ms for layer, lp in zip(profile.layers, made.layers)
                  if lp.action is Action.RECOMPUTE and layer.attention_bytes)
    if not untiled or made.budget_bytes != budget or skipped < KEEP_ATTENTION_MIN_SHARE * made.prediction.step_ms:
        return made
    try:  # no tolerance: a variant over the budget is simply not taken
        kept = best_plan(profile, budget, 0.0, host_budget=host_budget, pause=pause, keep_attention=True)
    except BudgetError:
        return made
    return kept if kept.prediction.step_ms < made.prediction.step_ms else made


def profile_step(
    layers: Sequence[torch.nn.Module],
    step_fn: Callable[[], Any],
    *,
    device: Union[None, str, torch.device] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    link: Optional[LinkProfile] = None,
    warmup_steps: int = 2,
    probe: str = AUTO,
    selective: Candidates = None,
    memory_budget_bytes: Optional[int] = None,
) -> StepProfile:
    """Run ``step_fn()`` (one whole training step) a few times and measure it per layer.

    ``probe``: ``"auto"`` (a low-memory step first, the plain probe only where the plain step is
    predicted to fit the device and ``memory_budget_bytes``), ``"plain"`` or ``"recompute"``; see
    :mod:`offload.planner.sequence`. ``warmup_steps``: steps before the measured one (a cold
    step allocates library workspaces and autotunes kernels, and would charge that time and
    memory to its first layers and its head). ``selective``: which submodules a plan may run
    under selective recompute (:func:`offload.forwards.selective.selective_candidates`; default each
    layer's ``mlp``). ``link``: the host link's speed; measured (one pinned buffer, a few
    copies) if None. ``memory_budget_bytes``: a budget in bytes the probe steps stay within too
    (the plain probe runs only where its predicted peak fits it).

    Raises :class:`BudgetError` when even the low-memory probe runs out of device memory,
    RuntimeError when the step raises anything else, ValueError when it runs none of ``layers``.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("offload.plan: no layers given; pass the model's repeated layers (e.g. model.model.layers)")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"offload.plan: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    dev = resolve_device(device)
    sequence = ProbeSequence(
        layers, probe_policy(dev, byte_count("offload.plan", "min_offload_bytes", min_offload_bytes)), dev,
        probe=check_probe(probe, "plan():"), warmup_steps=warmup_steps,
        candidates=selective_candidates(layers, selective),
        link=(lambda: link) if link is not None else (lambda: measure_link(dev)),
        device_limit=(lambda: read_device_budget(dev).budget_bytes) if dev.type == "cuda" else None,
        budget_bytes=memory_budget_bytes,
    )
    return sequence.run(step_fn, "offload.plan")


def plan(
    layers: Sequence[torch.nn.Module],
    step_fn: Callable[[], Any],
    memory_budget_bytes: Budget = None,
    *,
    device: Union[None, str, torch.device] = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    link: Optional[LinkProfile] = None,
    warmup_steps: int = 2,
    probe: str = AUTO,
    selective: Candidates = None,
    **unknown: Any,
) -> Plan:
    """Probe one step of ``step_fn`` and return the fastest plan whose peak fits the budget.

    ``layers``: the repeated layer modules in call order (e.g. ``model.model.layers``).
    ``step_fn()``: one whole training step, forward and backward. The probe runs it
    ``warmup_steps`` times and once more measured; with ``probe="auto"`` the first runs every
    layer checkpointed, and the plain step runs only where it is predicted to fit (the device and
    a budget in bytes), so planning
    fits wherever checkpointing does (:mod:`offload.planner.sequence`). ``selective``: the
    submodules a plan may run under selective recompute, layer by layer (default each layer's
    ``mlp``; False for none; see :func:`offload.forwards.selective.selective_candidates`).
    ``memory_budget_bytes``: peak device bytes the
    plan may use (an int, a whole float or a size such as ``"20GB"``: :func:`check_budget`), ``"device"`` for what this GPU can give the step (its capacity less what others
    hold, less ``DEVICE_HEADROOM``; see :mod:`offload.planner.budget`), ``"lowest"`` for the
    lowest-memory plan, or None for no limit. ``link``: the
    host link's speed, measured if None. Pass the plan to ``OffloadActivations(layers,
    plan=...)``; ``print(plan.table())`` shows it layer by layer.

    Raises :class:`BudgetError` (a ValueError) when no plan fits, naming the lowest reachable
    peak, or when even the low-memory probe runs out of memory, and RuntimeError when the probe
    step itself raises anything else.
    """
    reject_unknown("plan", unknown, parameter_names(plan))
    budget = check_budget(memory_budget_bytes, "plan():")
    dev = resolve_device(device)
    check_device_budget(budget, dev, "plan():")
    profile = profile_step(layers, step_fn, device=dev, min_offload_bytes=min_offload_bytes, link=link,
                           warmup_steps=warmup_steps, probe=probe, selective=selective,
                           memory_budget_bytes=budget if isinstance(budget, int) else None)
    return choose(profile, budget, dev)


def step_figures(start: Any, end: Any, peak_bytes: Optional[int]) -> dict[str, Any]:
    """Measured figures of one step for ``Plan.table(measured=...)``."""
    if isinstance(start, float):
        ms = (end - start) * 1e3
    else:
        end.synchronize()
        ms = float(start.elapsed_time(end))
    return {"step_ms": ms, "peak_bytes": peak_bytes}


__all__ = ["BudgetError", "DEVICE", "LOWEST", "check_device_budget", "read_device_budget", "use_expandable_segments", "plan", "profile_step", "choose", "check_budget", "probe_policy", "step_figures"]
