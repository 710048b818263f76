"""Issue 48's stream under DDP on two gloo ranks, each rank at its own lengths: a tiny HF Llama
(hidden 64, SDPA) under a 3 MiB byte budget with the engine's default size floor (64 KiB), whose
(2, T, 64) float32 tensors cross it between the stream's lengths. The ranks follow the plan for
the larger shape of the two; each rank's layers must copy what that plan says at its own shape:
no "layer N saved ... bytes to offload, but the plan was made for ..." warning."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, run_ranks

import offload

WORLD = 2
DEADLINE_S = 120.0  # a hang fails the test; a loaded 2-core box needs a minute for both ranks
STREAM = [96, 40, 200, 64, 160, 72, 128, 48, 240]
LENGTHS = {0: STREAM, 1: STREAM[3:] + STREAM[:3]}  # each rank its own length at each step

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _scenario(rank: int) -> dict:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    oa = offload.OffloadActivations(model.model.layers, memory_budget_bytes=3 << 20, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, length in enumerate(LENGTHS[rank]):
            ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(10 * step + rank))
            ddp.zero_grad(set_to_none=True)
            with oa:
                loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
    planned = oa.plan is not None
    oa.close()
    del ddp
    return {"planned": planned, "warnings": sorted({str(w.message)[:400] for w in caught})}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = _scenario(rank)
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc(limit=8)}
    dist.barrier()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)  # as test_varlen_ranks_cpu: skip gloo's teardown


def test_ranks_at_their_own_lengths_copy_what_their_plan_says(tmp_path: Path) -> None:
    run_ranks(_worker, (WORLD, free_port(), str(tmp_path)), WORLD, DEADLINE_S)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    errors = [f"rank {r} raised:\n{res['error']}" for r, res in enumerate(ranks) if "error" in res]
    assert not errors, "\n".join(errors)
    assert all(res["planned"] for res in ranks)
    spurious = [w for res in ranks for w in res["warnings"] if "the plan was made for" in w]
    assert not spurious, f"a rank's layers copied other bytes than their plan says: {spurious}"
