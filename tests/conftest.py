"""Shared test setup: tests marked ``cuda`` skip cleanly where CUDA is absent."""

import gc

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repeatable_attention():
    """SDPA on the efficient/math backends (the FLASH backward is not repeatable on our H100);
    GPU memory handed back after the test."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
