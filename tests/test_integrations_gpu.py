"""TRL's own activation offloading (``SFTConfig(activation_offloading=True)``, its copy of
torchtune's context) against offload_trainer on the same tiny SFT run, on a GPU: TRL's context
cannot be built on a CPU-only machine (it asks ``torch.accelerator`` for a device and gets None),
so this comparison runs only where CUDA is."""

from __future__ import annotations

from typing import Any

import pytest

from test_integrations_hf_cpu import assert_same, run_sft

pytestmark = pytest.mark.cuda


def test_offload_trainer_matches_trl_activation_offloading_bitwise(tmp_path_factory: Any, repeatable_attention: None) -> None:
    plain = run_sft(tmp_path_factory.mktemp("plain"), use_cpu=False)
    assert_same(plain, run_sft(tmp_path_factory.mktemp("plain2"), use_cpu=False), "two plain SFTTrainer runs")
    trl_flag = run_sft(tmp_path_factory.mktemp("trl"), use_cpu=False, activation_offloading=True)
    assert_same(plain, trl_flag, "SFTTrainer(activation_offloading=True), TRL's own context")
    ours = run_sft(tmp_path_factory.mktemp("ours"), {"min_offload_bytes": 0}, use_cpu=False)
    assert_same(trl_flag, ours, "SFTTrainer + offload_trainer against TRL's own flag")
    assert ours[2].stats["groups_offloaded"] == 2 and ours[2].stats["transport"] == "cuda"
