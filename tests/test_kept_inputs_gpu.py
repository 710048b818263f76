"""RECOMPUTE with the checkpoint's inputs kept on the GPU (``LayerPlan.keep_inputs``) on a CUDA
GPU: a plan mixing it with host-bound recompute, offload and keep gives the plain gradients bit
for bit, copies only the host-bound layers' groups, and peaks within the cost model's figure; the
lowest plan under a host room of nothing is made of kept inputs and copies nothing.

    python -m pytest -q tests/test_kept_inputs_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

import offload
from offload.planner import Action, LayerPlan, lowest_peak, plan_for, profile_step

from _util import assert_bitwise, llama_grads
from test_low_memory_probe_gpu import llama

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("repeatable_attention")]

KEPT = LayerPlan(Action.RECOMPUTE, keep_inputs=True)


def _measured_peak(oa: offload.OffloadActivations, model: torch.nn.Module, ids: torch.Tensor,
                   expected: list[torch.Tensor]) -> int:
    """Bitwise steps under ``oa`` (the first warms the allocator and the pinned blocks); the
    allocator's peak in the last one."""
    for _ in range(2):
        assert_bitwise(expected, llama_grads(model, ids, oa))
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    assert_bitwise(expected, llama_grads(model, ids, oa))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_kept_inputs_are_bitwise_copy_nothing_and_peak_as_predicted() -> None:
    model, ids = llama(layers=6, seq=2048)
    layers = model.model.layers
    expected = llama_grads(model, ids)
    assert_bitwise(expected, llama_grads(model, ids))
    profile = profile_step(layers, lambda: llama_grads(model, ids))
    actions = [LayerPlan(Action.RECOMPUTE), KEPT, KEPT, LayerPlan(Action.OFFLOAD), KEPT, LayerPlan(Action.KEEP)]
    made = plan_for(profile, actions, budget_bytes=profile.base_bytes + 1)  # every release forced: no race
    oa = offload.OffloadActivations(layers, plan=made)
    measured = _measured_peak(oa, model, ids, expected)
    assert oa.stats["groups_offloaded"] == 2  # layer 0's inputs and layer 3's activations
    base, predicted = profile.base_bytes, made.prediction.peak_bytes
    assert abs((measured - base) - (predicted - base)) <= 0.10 * (predicted - base), (measured, predicted, made.table())
    oa.close()

    # No host room at all: the lowest plan keeps its boundaries, as gradient checkpointing does.
    low = lowest_peak(profile, host_budget=0)
    assert low.prediction.d2h_bytes == 0 and any(lp.keep_inputs for lp in low.layers), low.table()
    assert low.prediction.peak_bytes < profile.plain_peak_bytes
    oa = offload.OffloadActivations(layers, plan=low)
    measured = _measured_peak(oa, model, ids, expected)
    assert oa.stats["offloaded_bytes"] == 0
    predicted = low.prediction.peak_bytes
    assert abs((measured - base) - (predicted - base)) <= 0.10 * (predicted - base), (measured, predicted, low.table())
    oa.close()
