"""One of two processes sharing a simulated node (tests/test_host_node_cpu.py).

Run as ``python tests/_shared_node_worker.py ROLE DIRECTORY OUT BUDGET``. The process's ledger
reads a simulated node in DIRECTORY/node (:class:`offload.host.node.SimulatedNode`: each process
publishes what it holds there, and sees the other's bytes through ``available``). The node's size
is the first plan's host need / 0.6, so that each process's plan asks for 60% of it: the first
process plans on a node too large to bound it, then writes that size (DIRECTORY/node/.total), which
both read from then on. ROLE ``first`` then writes DIRECTORY/first_ready and steps on (holding its
blocks) until DIRECTORY/second_done appears; ``second`` starts only after first_ready. Both plan
for BUDGET device bytes, check their gradients bitwise against the plain run, and write their
figures to OUT (JSON).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offload  # noqa: E402
from offload.host.ledger import process_ledger  # noqa: E402
from offload.host.node import NodeMemory, SimulatedNode  # noqa: E402

from _util import assert_bitwise, make_gpt_layers, oa_step, plain_reference  # noqa: E402

STEPS = 5  # the probe steps, then planned ones
DEADLINE_S = 180.0
ASK = 0.6


class SizedLater(SimulatedNode):
    """A simulated node whose size the first plan sets (DIRECTORY/.total, when written)."""

    def read(self) -> NodeMemory:
        size = self.directory / ".total"
        if size.exists():
            self.total_bytes = int(size.read_text())
        return super().read()


def workload() -> tuple[torch.nn.ModuleList, torch.Tensor]:
    """The model and batch both processes (and the test's budget) use."""
    return make_gpt_layers(4, hidden=256), torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1))


def main(role: str, directory: Path, out: Path, budget: int) -> None:
    torch.use_deterministic_algorithms(True)
    layers, x = workload()
    expected = plain_reference(layers, x)
    assert_bitwise(expected, plain_reference(layers, x))  # the plain run repeats itself
    start = time.monotonic()
    if role == "second":
        while not (directory / "first_ready").exists():
            if time.monotonic() - start > DEADLINE_S:
                raise SystemExit("the first process never became ready")
            time.sleep(0.05)
    node = SizedLater(1 << 40, str(directory / "node"))
    ledger = process_ledger()
    ledger.set_node_source(node)
    oa = offload.OffloadActivations(layers, device="cpu", memory_budget_bytes=budget)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = 0
        while True:
            assert_bitwise(expected, oa_step(layers, x, oa))
            step += 1
            if role == "first" and step == STEPS:
                (node.directory / ".total").write_text(str(int(oa.stats["host_needed_bytes"] / ASK)))
                ledger.reset_peak()
                (directory / "first_ready").write_text("1")
            if step >= STEPS and (role == "second" or (directory / "second_done").exists()):
                break
            if time.monotonic() - start > DEADLINE_S:
                raise SystemExit("the second process never finished")
    stats = oa.stats
    figures = {
        "plan": oa.plan.describe() if oa.plan is not None else None,
        "plan_d2h_bytes": oa.plan.prediction.d2h_bytes if oa.plan is not None else None,
        "budget_reason": oa.plan.budget_reason if oa.plan is not None else None,
        "kept": stats["kept"],
        "held_bytes": stats["pinned_bytes_held"],
        "needed_bytes": stats["host_needed_bytes"],
        "node_total_bytes": node.total_bytes,
        "node_available_bytes": stats["host_node_available_bytes"],
        "node_floor_bytes": stats["host_node_floor_bytes"],
        "ledger_peak_bytes": ledger.peak_bytes,
        "warnings": [str(w.message) for w in seen if "host" in str(w.message)],
        "steps": step,
    }
    out.write_text(json.dumps(figures))
    if role == "second":
        (directory / "second_done").write_text("1")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
