"""``memory_budget_bytes="device"``: the budget is what the device can give the step.

The planner's budget is a peak of the bytes this process's caching allocator has allocated
(``torch.cuda.memory_allocated``), weights and optimizer state included: ``StepProfile.base_bytes``
is that count at the first layer's entry and every predicted peak is ``base_bytes`` plus what the
step adds. So "device" counts the bytes already allocated as inside the budget, not against it:

    held by others = capacity - free - reserved
                     (other processes, the CUDA context, NCCL and other non-torch allocations)
    available      = capacity - held by others = free + reserved
                     (reserved = allocated now, weights included, + cached blocks torch can reuse)
    budget         = available - max(available x headroom, MIN_HEADROOM_BYTES)
                     (headroom: DEVICE_HEADROOM, 15%, or 5% with expandable segments;
                     the floor, 256 MiB, at most a quarter of what is available)

measured when the plan is made (after the probe steps, whose activations are freed by then).
Pure: the figures are passed in, so this is tested without a GPU; ``make.read_device_budget``
reads them from CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..engine.stats import format_bytes

DEVICE = "device"

# Headroom left for the allocator, as a fraction of what is available. The budget bounds
# *allocated* bytes, but the device must hold *reserved* ones: the caching allocator rounds
# blocks up and cannot always reuse a freed block for a larger request, so reserved runs above
# allocated at the peak. Measured on the H100, LONG-1B planned at "device" with the default
# allocator: at 5% headroom reserved ran 6.3 GiB above allocated, at 10% 9.95 GiB (12.6% of the
# device; the offloaded groups' reload buffers come and go in 1.9 GiB blocks), and both times a
# 5.9 GiB request for the head's logits found no cached block large enough and no free memory.
# Hence 15%. With expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) the
# allocator maps memory into a growing segment instead of needing a free block of the request's
# size: the same plan at 5% ran, reserved within a few percent of allocated. 5% then.
DEVICE_HEADROOM = 0.15
DEVICE_HEADROOM_EXPANDABLE = 0.05
# And at least this many bytes: under a small cap (set_per_process_memory_fraction, a small GPU)
# a fraction leaves less than the allocator keeps anyway. Measured on the H200 with expandable
# segments: under a 1.31 GiB cap, 95 MiB reserved but unallocated when a 128 MiB request failed.
MIN_HEADROOM_BYTES = 256 << 20


def default_headroom(alloc_conf: Optional[str] = None) -> float:
    """The headroom for the allocator configured by ``alloc_conf`` (default: the process's
    ``PYTORCH_CUDA_ALLOC_CONF``): :data:`DEVICE_HEADROOM_EXPANDABLE` with expandable segments on,
    :data:`DEVICE_HEADROOM` otherwise."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
    options = {k.strip(): v.strip() for k, _, v in (item.partition(":") for item in conf.split(","))}
    return DEVICE_HEADROOM_EXPANDABLE if options.get("expandable_segments", "").lower() == "true" else DEVICE_HEADROOM


@dataclass(frozen=True)
class DeviceBudget:
    """How a "device" budget was worked out, for the plan's report."""

    capacity_bytes: int          # the device's total memory
    held_by_others_bytes: int    # capacity - free - reserved, when planning
    headroom: float              # fraction of what is available left for the allocator
    budget_bytes: int
    cap_bytes: Optional[int] = None  # torch.cuda.set_per_process_memory_fraction's cap, if any

    def describe(self) -> str:
        """E.g. ``device (79.1 GiB capacity - 2.3 GiB held by others - 5% headroom = 72.9 GiB)``."""
        capped = f", capped at {format_bytes(self.cap_bytes)} for this process" if self.cap_bytes is not None else ""
        return (
            f"device ({format_bytes(self.capacity_bytes)} capacity - "
            f"{format_bytes(self.held_by_others_bytes)} held by others{capped} - {self.headroom:.0%} "
            f"headroom = {format_bytes(self.budget_bytes)})"
        )


def device_budget(capacity_bytes: int, free_bytes: int, reserved_bytes: int,
                  headroom: Optional[float] = None, cap_bytes: Optional[int] = None,
                  allocated_bytes: Optional[int] = None) -> DeviceBudget:
    """The "device" budget from the device's figures (see the module docstring).

    ``capacity_bytes`` and ``free_bytes``: ``torch.cuda.mem_get_info`` (total, free), device-wide;
    ``reserved_bytes``: ``torch.cuda.memory_reserved``, this process's caching allocator (its
    allocated bytes and the cached blocks it can reuse). ``allocated_bytes``
    (``torch.cuda.memory_allocated``), read right after ``torch.cuda.empty_cache()``: then what
    stays reserved beyond it cannot be handed out (CUDA graphs' private pools, segments split
    with live blocks, other streams' segments) and is not counted as available. Raises
    ValueError on figures that cannot come from one device, or when nothing is left.
    """
    for name, value in (("capacity_bytes", capacity_bytes), ("free_bytes", free_bytes),
                        ("reserved_bytes", reserved_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"device_budget: {name} must be an int >= 0, got {value!r}")
    if headroom is None:
        headroom = default_headroom()
    if not 0 <= headroom < 1:
        raise ValueError(f"device_budget: headroom must be a fraction in [0, 1), got {headroom!r}")
    if free_bytes + reserved_bytes > capacity_bytes:
        raise ValueError(
            f"device_budget: free ({free_bytes}) + reserved ({reserved_bytes}) bytes exceed the "
            f"capacity ({capacity_bytes}); read all three from the same device at the same time"
        )
    available = free_bytes + reserved_bytes
    if cap_bytes is not None:
        available = min(available, cap_bytes)
    if allocated_bytes is not None:
        stuck = max(0, reserved_bytes - allocated_bytes)
        available = max(0, available - stuck)
    budget = int(available * (1 - headroom))
    if headroom:
        budget = min(budget, available - min(MIN_HEADROOM_BYTES, available // 4))
    if budget <= 0:
        raise ValueError(
            f"offload: memory_budget_bytes='device': the device has nothing left for the step "
            f"({format_bytes(capacity_bytes)} capacity, all held by others); free the device or "
            "pass a budget in bytes"
        )
    return DeviceBudget(capacity_bytes, capacity_bytes - free_bytes - reserved_bytes, headroom, budget, cap_bytes)
