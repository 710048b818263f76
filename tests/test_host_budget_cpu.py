"""The default host budget: the node's total less the floor left for others, shared among the
node's processes (``LOCAL_WORLD_SIZE``), an explicit ``host_budget_bytes`` winning, and the report
saying which."""

from __future__ import annotations

import pytest

from offload.host.arena import default_host_budget
from offload.host.node import NodeMemory, SystemNode, node_floor

from _util import cpu_context

GIB = 1 << 30


def test_default_budget_is_the_node_less_its_floor_shared_by_local_ranks() -> None:
    node = NodeMemory(total_bytes=256 * GIB, available_bytes=100 * GIB, source="test")
    budget, source = default_host_budget({"LOCAL_WORLD_SIZE": "4"}, node=node)
    assert node.floor_bytes == int(0.10 * 256 * GIB)  # 10% of a large node
    assert budget == (256 * GIB - node.floor_bytes) // 4
    assert "less" in source and "LOCAL_WORLD_SIZE=4" in source and "available" in source
    alone, alone_source = default_host_budget({}, node=node)
    assert alone == 256 * GIB - node.floor_bytes and "LOCAL_WORLD_SIZE=1" in alone_source


def test_the_floor_is_a_tenth_of_the_node_and_at_least_8_gib_unless_that_is_over_a_quarter() -> None:
    assert node_floor(512 * GIB) == int(51.2 * GIB)
    assert node_floor(64 * GIB) == 8 * GIB
    assert node_floor(16 * GIB) == 4 * GIB  # a small node: a quarter of it
    assert node_floor(64 << 20) == 16 << 20


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_a_bad_local_world_size_is_a_clear_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=.*host_budget_bytes"):
        cpu_context(1, 2)


def test_context_reports_the_budget_and_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    ctx, _ = cpu_context(1, 2)
    stats = ctx.stats
    node = SystemNode().read()
    assert stats["host_budget_bytes"] == (node.total_bytes - node.floor_bytes) // 8
    assert "LOCAL_WORLD_SIZE=8" in stats["host_budget_source"]
    assert "host budget" in ctx.report() and "LOCAL_WORLD_SIZE=8" in ctx.report()
    given, _ = cpu_context(1, 2, host_budget_bytes=12345)
    assert given.stats["host_budget_bytes"] == 12345 and given.stats["host_budget_source"] == "host_budget_bytes"
