"""Why a step offloaded nothing, read from its counters at the step's end.

A context that is enabled but moves no bytes is almost always a configuration mistake (a size
floor above every tensor, opt-in selection with no marks, a model too small for its groups), and
it fails silently: gradients stay exact and only the memory does not drop. The engine asks
:func:`nothing_offloaded` once per step, from ``StepCounters.kept``, never per tensor, and warns
once per context with the answer.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..host.room import HostRoom
from .policy import (
    KEEP_BUDGET,
    KEEP_LAYER,
    KEEP_MARKED,
    KEEP_NOT_SELECTED,
    KEEP_OTHER_DEVICE,
    KEEP_PARAMETER,
    KEEP_REGION,
    KEEP_SMALL,
    KEEP_UNSUPPORTED,
)
from .stats import StepCounters, format_bytes


def _explain_budget(count: int, room: Optional[HostRoom]) -> str:
    # Name the bound that binds now, with its figures: the same words for a context given a
    # budget of 0 on purpose (a benchmark's "nothing fits" variant) and for a node out of room
    # would leave a reader unable to tell an intended refusal from a failing machine.
    if room is not None and room.held_bytes == 0 and room.binding == "host_budget_bytes":
        return (
            f"{count} did not fit in the host budget: this context was given host_budget_bytes=0, "
            "so it may hold no host memory and keeps every tensor on the GPU, as that budget asks "
            "(pass a budget above 0 to offload)"
        )
    where = "" if room is None else (
        f"; this context may hold {room.held_bytes} bytes at most now, set by {room.binding} "
        f"({room.node.describe()})"
    )
    return (
        f"{count} did not fit in the host budget (host_budget_bytes, or the process's, shared "
        "by all its offload contexts: offload.host.ledger), the node's room (what it has "
        f"available less the floor left for others: offload.host.node) or pinned memory{where}"
    )


def _explain(reason: str, count: int, min_offload_bytes: int, largest_small: int) -> str:
    if reason == KEEP_SMALL:
        return (
            f"{count} were smaller than min_offload_bytes={min_offload_bytes} (the largest of them "
            f"had {largest_small} bytes, {format_bytes(largest_small)}): pass a smaller "
            "min_offload_bytes (min_offload_size in torchtune's form) to offload them"
        )
    if reason == KEEP_NOT_SELECTED:
        return (
            f"{count} were not selected: selection is 'marked' (the v1 schedule's default, "
            "NVTE_CPU_OFFLOAD_V1=1), which offloads only tensors marked with "
            "offload.mark_activation_offload; mark them, or pass selection='auto'"
        )
    if reason == KEEP_PARAMETER:
        return f"{count} were parameters or views of them, whose memory stays on the GPU anyway"
    if reason == KEEP_LAYER:
        return (
            f"{count} were in the last group of the forward, which stays on the GPU because "
            "backward needs it first; OffloadActivations() without layers closes a group at the "
            "end of a module call once it holds group_bytes, so pass a smaller group_bytes"
        )
    if reason == KEEP_MARKED:
        return f"{count} were marked with offload.mark_not_offload"
    if reason == KEEP_REGION:
        return f"{count} were saved inside offload.keep_on_gpu()"
    if reason == KEEP_OTHER_DEVICE:
        return f"{count} were not on the context's device (see its device= option)"
    if reason == KEEP_UNSUPPORTED:
        return f"{count} cannot be offloaded (meta or fake tensors, sparse or nested layouts, subclasses)"
    return f"{count} were kept ({reason})"


def nothing_offloaded(counters: StepCounters, *, min_offload_bytes: int, largest_small: int,
                      host_room: Optional[Callable[[], HostRoom]] = None) -> Optional[str]:
    """The warning for a step that offloaded nothing, saying why; None if it offloaded anything.

    ``largest_small``: the largest tensor kept as too small in the step (the policy tallies it).
    ``host_room()``: what the context's arena may hold now and which bound sets it
    (``HostArena.host_room``), asked only when tensors were kept for the host budget: it reads
    the node.
    """
    if counters.offloaded_tensors > 0 or counters.groups_offloaded > 0:
        return None
    kept = counters.kept
    seen = sum(kept.values())
    if seen == 0:
        return (
            f"offload: step {counters.step} offloaded nothing: no saved tensor reached the "
            "offloaded layers. Either the step ran no forward (a `with` around the backward: put "
            "it around the forward only), or the layers saved nothing for backward (frozen, run "
            "under no_grad, or checkpointed as a whole), or another offload context entered inside this one "
            "(nested on the same layers, or torch's save_on_cpu) took them: its saved-tensor "
            "hooks are the innermost, so only it sees the tensors. Use one context per forward"
        )
    room = host_room() if host_room is not None and kept.get(KEEP_BUDGET) else None
    parts = [
        _explain_budget(count, room) if reason == KEEP_BUDGET else
        _explain(reason, count, min_offload_bytes, largest_small)
        for reason, count in sorted(kept.items(), key=lambda item: -item[1])
    ]
    return f"offload: step {counters.step} offloaded nothing; of the {seen} saved tensors it saw, " + "; ".join(parts)
