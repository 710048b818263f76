"""Shared test setup: tests marked ``cuda`` skip cleanly where CUDA is absent."""

import gc
import os

import pytest

# cuBLAS picks a split-K reduction whose order may change between runs unless its workspace is
# pinned to a fixed configuration; deterministic mode (below) refuses to run without this, and it
# must be set before cuBLAS is first initialised, hence at import.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repeatable_attention():
    """SDPA on the efficient/math backends (the FLASH backward is not repeatable on our H100),
    with deterministic algorithms on; GPU memory handed back after the test.

    Deterministic mode matters for the efficient backward: when it splits the keys
    (``num_splits_key > 1``) it sums the K/V gradients of the splits in an order that can change
    with timing, e.g. while our copy engines run beside it, giving 1-ulp differences in the K/V
    projection's weight gradient (seen on an H200). Only deterministic mode *without* warn_only
    forces a single split."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
