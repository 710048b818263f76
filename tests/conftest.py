"""Shared test setup: tests marked ``cuda`` skip cleanly where CUDA is absent."""

import gc
import os

import pytest

# cuBLAS picks a split-K reduction whose order may change between runs unless its workspace is
# pinned to a fixed configuration; deterministic mode (below) refuses to run without this, and it
# must be set before cuBLAS is first initialised, hence at import.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from offload.repeatable import repeatable_attention as repeatable_attention_context  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repeatable_attention():
    """SDPA run bit-for-bit repeatably (``offload.repeatable``: efficient/math backends,
    deterministic algorithms on); GPU memory handed back after the test."""
    with repeatable_attention_context():
        yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture
def deterministic():
    """Deterministic algorithms on for the test (bitwise comparisons), put back after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture(params=["native", "python"])
def entry_table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test over both entry tables: offload._entries (skipped where it is not built) and
    its Python reference, which groups then use."""
    from offload.engine import group
    from offload.engine.entry_table import EntryTable
    from offload.host import native

    if request.param == "python":
        monkeypatch.setattr(group, "new_entry_table", EntryTable)
    elif native.entries_extension() is None:
        pytest.skip(f"offload._entries not live: {native.entries_reason()}")
    return request.param


@pytest.fixture
def node_ledger():
    """The process's host ledger, its node source and budget restored after the test."""
    from offload.host.ledger import process_ledger

    gc.collect()
    ledger = process_ledger()
    yield ledger
    ledger.set_node_source(None)
    ledger.set_budget(None)
