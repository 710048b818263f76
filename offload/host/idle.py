"""The arena's idle blocks: which one serves a request, and which goes first when the arena shrinks.

Kept sorted by size (parallel lists, for bisect). A request takes the smallest idle block that
fits it within ``REUSE_SLACK`` (so one huge block is not tied up by a small group); a shrink drops
the block used longest ago first (:meth:`IdleBlocks.least_recent`): with plans per batch shape,
that is the block of the shape not seen for longest, and the shapes seen lately keep theirs.
Not thread-safe on its own: the arena calls it under its lock.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator, Optional

from .blocks import BLOCK_GRANULE, REUSE_SLACK, Region
from .layout import align_up


class IdleBlocks:
    """Idle regions sorted by size; iterating yields them, smallest first."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._regions: list[Region] = []

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Iterator[Region]:
        return iter(list(self._regions))

    def __getitem__(self, i: int) -> Region:
        return self._regions[i]

    def add(self, region: Region) -> None:
        """Put ``region`` in the list (a new block, or one given back)."""
        i = bisect.bisect_right(self.sizes, region.block.numel())
        self.sizes.insert(i, region.block.numel())
        self._regions.insert(i, region)

    def take(self, size: int, captured: bool) -> Optional[Region]:
        """Remove and return the smallest block of at least ``size`` bytes, within the reuse slack
        (under CUDA-graph capture any that fits will do: failing the capture would be worse)."""
        i = bisect.bisect_left(self.sizes, size)
        if i == len(self.sizes) or not (captured or self.sizes[i] <= size * REUSE_SLACK):
            return None
        return self.pop(i)

    def pop(self, i: int) -> Region:
        """Remove and return the block at index ``i``."""
        self.sizes.pop(i)
        return self._regions.pop(i)

    def least_recent(self, keep: frozenset = frozenset()) -> int:
        """The index of the block used longest ago (the larger of a tie), not one of ``keep``
        (ids of regions) unless only those are left."""
        regions = self._regions
        return min(range(len(regions)),
                   key=lambda i: (id(regions[i]) in keep, regions[i].used_in_step, -self.sizes[i]))

    def pinned_bytes(self) -> int:
        """The bytes the idle blocks hold."""
        return sum(region.pinned_bytes for region in self._regions)

    def serve(self, sizes: Iterable[int], pending: Iterable[tuple[int, int]]) -> tuple[frozenset, list[int]]:
        """(ids of the idle blocks, or of the ``pending`` (size, id) blocks being pinned, that
        would serve these region sizes; the sizes none would), each block once, the largest
        request first, each taking the smallest block that fits within the slack."""
        free = [(size, id(region)) for size, region in zip(self.sizes, self._regions)] + sorted(pending)
        used, missing = [], []
        for size in sorted((align_up(max(int(n), 1), BLOCK_GRANULE) for n in sizes), reverse=True):
            fits = [entry for entry in free if size <= entry[0] <= size * REUSE_SLACK]
            if fits:
                best = min(fits)
                free.remove(best)
                used.append(best[1])
            else:
                missing.append(size)
        return frozenset(used), missing
