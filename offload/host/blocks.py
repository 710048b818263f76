"""The arena's bookkeeping types: a lent block (:class:`Region`), the arena's counters, the error
a CUDA-graph capture gets, and how blocks are sized (granule, reuse slack, headroom of a guess)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layout import align_up

__all__ = ["BLOCK_GRANULE", "REUSE_SLACK", "GUESS_HEADROOM", "with_headroom", "repeat_sizes", "CaptureError", "Region", "ArenaCounters"]

BLOCK_GRANULE = 64 * 1024  # whole 64 KiB pages: regions of nearly equal size share blocks
# A free block is reused for a request only if it is at most this much larger than the request,
# so one huge idle block doesn't get tied up by a small group. A little over 2: a bucket's plan
# half as long as another's (4096 and 8192) predicts regions half the size of the other's blocks,
# and predicted regions over-count what the step then asks by up to ~9% (the bucket's top, the
# byte model): at exactly 2, T22's 4096 plan was ready on its predicted regions, then its first
# step missed every 64 and 640 MiB request against 128 and 1280 MiB blocks and pinned 2.5 GB on
# its own thread (+0.2-0.5 s). 2.25 serves requests down to 44% of a block.
REUSE_SLACK = 2.25
# A block pinned for a size only guessed (the growth forecast, a reserve cut into equal blocks)
# gets this fraction of headroom: layers' groups differ a little (the first layer's input is a
# leaf, for one), and a block serves requests of 1/REUSE_SLACK to all of its size, never more.
GUESS_HEADROOM = 1 / 8


def with_headroom(nbytes: int) -> int:
    """``nbytes`` plus the headroom of a guessed block, in whole granules."""
    return align_up(nbytes + int(nbytes * GUESS_HEADROOM), BLOCK_GRANULE)


def repeat_sizes(pattern: list[int], nbytes: int, blocks_if_unknown: int) -> list[int]:
    """Block sizes that add up to at least ``nbytes``: ``pattern`` repeated, or (empty)
    ``blocks_if_unknown`` equal blocks with headroom."""
    if not pattern:
        pattern = [with_headroom(-(-nbytes // max(1, blocks_if_unknown)))]
    sizes: list[int] = []
    total = 0
    while total < nbytes:
        size = pattern[len(sizes) % len(pattern)]
        sizes.append(size)
        total += size
    return sizes


class CaptureError(RuntimeError):
    """Offloading cannot proceed under the CUDA-graph capture in progress (the message says why)."""


@dataclass(eq=False)
class Region:
    """A host block lent to one group. ``ready`` is the event the next writer must wait on."""

    block: torch.Tensor
    pinned_bytes: int  # what the block really holds (page rounding included)
    ready: Any = None
    used_in_step: int = -1
    graph_owned: bool = False  # acquired under CUDA-graph capture: replays keep using it


@dataclass
class ArenaCounters:
    pinned_allocations: int = 0   # blocks allocated (pinned on CUDA) since creation
    bytes_held: int = 0           # bytes really held by all blocks, in use or idle
    bytes_in_use: int = 0
    bytes_pending: int = 0        # bytes of blocks queued or being pinned in the background
    waited_for_pinning: int = 0   # acquires that waited for a background block
    kept_while_pinning: int = 0   # acquires answered None so as not to wait (keep_while_pinning)
    failures: int = 0             # requests refused (budget or allocation failure)
    freed_blocks: int = 0
    graph_owned_blocks: int = 0   # blocks kept for captured CUDA graphs (never reused eagerly)
    process_refusals: int = 0     # claims and requests refused by the process's ledger
    node_refusals: int = 0        # of those, refused for the node's room (not the budget)
    peak_bytes_held: int = 0      # the most bytes_held + bytes_pending ever were
    trimmed_for_plan: int = 0     # idle blocks dropped to stay within the plans' bound
    acquire_s: float = 0.0        # host seconds the engine spent in acquire (pinning on the spot, waiting)
