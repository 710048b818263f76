"""Attention whose backward repeats itself bit for bit: what a bitwise comparison needs.

A bitwise check of offloaded gradients against a plain run proves something only if the plain
run repeats itself. On our H100 and H200 it does not with the defaults:

- the FLASH SDPA backward is not bit-for-bit repeatable;
- the memory-efficient one is only in deterministic mode *without* ``warn_only`` (with it, it
  keeps its default algorithm and torch just warns). Without deterministic mode, at seq 4096,
  the plain run did not repeat itself on the H100; on an H200 the GPT tests' plain run failed to
  repeat in 3 of 40 runs of one test file (0 of 40 in deterministic mode).

The efficient backend also keeps a long sequence's attention small, unlike the math one.
Deterministic mode needs ``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS starts (``:4096:8``), which
callers set at their start.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


@contextlib.contextmanager
def repeatable_attention(device: Optional[torch.device] = None) -> Iterator[None]:
    """SDPA on the efficient and math backends, with deterministic algorithms on, for the
    duration; the previous deterministic setting afterwards.

    ``device``: where the run happens; on any but a CUDA device this does nothing (the CPU
    kernels repeat themselves already, and deterministic mode would only refuse some of them).
    """
    if device is not None and torch.device(device).type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
