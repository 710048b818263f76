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

    Deterministic mode matters: without it, on an H200, the *plain* run of the GPT tests in
    test_native_events_gpu.py did not repeat itself in 3 of 40 runs of the file, and an offloaded
    run differed from plain in 16 elements of the QKV weight gradient (1.5e-8) in a fourth; with
    it, 0 of 40 (and 0 of 20 more for the two tests concerned). The likely source is the
    efficient SDPA backward, whose split-key accumulation of the K/V gradients is only forced to
    one split in deterministic mode without warn_only (PyTorch's attention_backward.cu)."""
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
