"""Host memory on a GPU is bounded by the node and by the plans (issue 48 §3, issue 49 item 8).

The CPU tests (test_host_node_cpu.py) check the bounds on the host transport; here the same on
pinned memory: a plan's pinned blocks stay within its need plus the slack, the planner plans for
the node's room (a simulated node with little room: it keeps or recomputes, and nothing it
planned is refused), and a process budget of 0 plans what ``host_budget_bytes=0`` plans; the
gradients stay bitwise those of the plain run throughout.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import offload
from offload.host.ledger import HostLedger, set_process_host_budget
from offload.host.node import SimulatedNode, node_floor

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

MIB = 1 << 20



def _run(steps: int = 5, **options: object) -> tuple[offload.OffloadActivations, dict]:
    layers = make_gpt_layers(6, hidden=512, heads=8, device="cuda")
    x = torch.randn(2, 1024, 512, device="cuda")
    expected = plain_reference(layers, x)
    assert_bitwise(expected, plain_reference(layers, x))
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", **options)  # type: ignore[arg-type]
    for _ in range(steps):
        assert_bitwise(expected, oa_step(layers, x, oa))
    assert oa.plan is not None, "no plan after the probe steps"
    return oa, dict(oa.stats)


def test_pinned_blocks_stay_within_the_plans_need_plus_slack(node_ledger: HostLedger) -> None:
    oa, stats = _run()
    assert stats["host_needed_bytes"] is not None and stats["host_bound_bytes"] is not None
    assert stats["host_peak_bytes"] <= stats["host_bound_bytes"], (
        f"the arena held {stats['host_peak_bytes']} bytes at peak, over its plans' bound of "
        f"{stats['host_bound_bytes']} (need {stats['host_needed_bytes']})")
    assert "host needed" in oa.report()
    oa.close()


def test_plans_fit_the_nodes_room_on_the_gpu(node_ledger: HostLedger, tmp_path: Path) -> None:
    total = 256 * MIB
    (tmp_path / "1").write_text(str(total - node_floor(total) - 8 * MIB))  # 8 MiB left above the floor
    node_ledger.set_node_source(SimulatedNode(total, str(tmp_path)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        oa, stats = _run()
    assert "budget" not in stats["kept"], f"the plan counted on copies the node then refused: {stats['kept']}"
    assert stats["host_peak_bytes"] <= 8 * MIB, f"the arena held {stats['host_peak_bytes']} bytes, past the node's room"
    assert any("host room limits the plan" in str(w.message) for w in seen)
    oa.close()


def test_a_process_budget_of_zero_keeps_everything_on_the_gpu(node_ledger: HostLedger) -> None:
    given, _ = _run(host_budget_bytes=0)
    set_process_host_budget(0)
    process, stats = _run()
    # Nothing copied: layers kept whole, or recomputed keeping their inputs on the GPU.
    described = process.plan.describe()
    assert described == given.plan.describe() and "offload" not in described, (described, given.plan.describe())
    assert stats["offloaded_bytes"] == 0 and "budget" not in stats["kept"], stats
