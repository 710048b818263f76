"""The one layout function: where each entry of a group lives inside the group's byte region.

Every entry starts on an ``alignment``-byte boundary (256 by default). FP8 GEMMs (cuBLASLt behind
``torch._scaled_mm``) refuse operands that are not 16-byte aligned, and 256 also keeps each copy
on the DMA engine's preferred boundary. The total is rounded up to the alignment so that the
region can be viewed as any dtype up to 256 bytes wide.

This is the reference implementation; ``offload.host.native.plan_layout`` computes the same result in
C++ and is what the engine calls.
"""

from __future__ import annotations

from typing import Sequence

ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round ``n`` up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)


def plan_layout_py(sizes: Sequence[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Return ``(offsets, total)`` for entries of the given byte sizes.

    Raises ``ValueError`` for a negative size or an alignment that is not a positive power of two.
    Zero-size entries get an offset (the current aligned position) and take no space.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    offsets: list[int] = []
    cursor = 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"entry sizes must be >= 0, got {size}")
        offsets.append(cursor)
        cursor = align_up(cursor + size, alignment)
    return offsets, cursor
