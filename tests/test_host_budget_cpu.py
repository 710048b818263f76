"""The default host budget: 75% of the host's total RAM shared among the node's processes
(``LOCAL_WORLD_SIZE``), an explicit ``host_budget_bytes`` winning, and the report saying which."""

from __future__ import annotations

import psutil
import pytest

from offload.host.arena import default_host_budget

from _util import cpu_context


def test_default_budget_is_three_quarters_of_total_ram_shared_by_local_ranks() -> None:
    total = psutil.virtual_memory().total
    budget, source = default_host_budget({"LOCAL_WORLD_SIZE": "4"})
    assert budget == int(total * 0.75) // 4
    assert "total RAM" in source and "LOCAL_WORLD_SIZE=4" in source
    alone, alone_source = default_host_budget({})
    assert alone == int(total * 0.75) and "LOCAL_WORLD_SIZE=1" in alone_source


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_bad_local_world_size_is_a_clear_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=.*host_budget_bytes"):
        cpu_context(1, 2)


def test_context_reports_the_budget_and_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ctx, _ = cpu_context(1, 2)
    stats = ctx.stats
    assert stats["host_budget_bytes"] == int(psutil.virtual_memory().total * 0.75) // 8
    assert "LOCAL_WORLD_SIZE=8" in stats["host_budget_source"]
    assert "host budget" in ctx.report() and "LOCAL_WORLD_SIZE=8" in ctx.report()
    given, _ = cpu_context(1, 2, host_budget_bytes=12345)
    assert given.stats["host_budget_bytes"] == 12345 and given.stats["host_budget_source"] == "host_budget_bytes"
