"""The short probe under FSDP2 and context parallelism (issue 51's T29), on two gloo processes.

A first batch too long to probe at its length is probed on the same call cut short
(``offload.layers.model_form``). Under FSDP2 it was refused (FSDP2's module hooks), so a T29 step
of ~20 min was preceded by 2-3 probe steps as long. Now FSDP2's hooks run in the probe, and an
FSDP2 root is probed ahead of its own pre-forward hook, each probe step a whole FSDP2 iteration
(probed after it, the probe's post-backward callback resharded the root under the call in
progress: "aten.embedding.default got mixed torch.Tensor and DTensor").

One spawn of 2 ranks (FSDP2 over both, a CP mesh of 2, as ``benchmarks/context_parallel.py``
builds it; eager attention, as its ``--smoke``: the CPU has no ring kernel) runs the plain steps
twice (they repeat bitwise) and the same steps under ``OffloadActivations(..., model=model)``
with a budget that makes the plan move tensors. The first call is probed short, with no warning,
and runs planned; every step's gradient shards are bitwise the plain ones. A model sharded after
the context was made (FSDP2's root hook then runs first) is refused by name, probed at its full
length, and stays exact.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, rank_results, run_ranks

import offload

WORLD = 2
DEADLINE_S = 150.0
V = 64
LENGTHS = [96, 96, 64]  # global tokens: 48 a rank, more than twice the probe's 16, then another bucket

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _model(meshes: Any, shard: bool = True) -> Any:
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                      max_position_embeddings=256, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return _sharded(model, meshes) if shard else model


def _sharded(model: Any, meshes: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for module in [*model.model.layers, model]:
        fully_shard(module, mesh=meshes.fsdp)
    return model


def _run(meshes: Any, model: Any, oa: Any, seen: list[bool]) -> list[list[torch.Tensor]]:
    grads = []
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(10 + i))
        model.zero_grad(set_to_none=True)
        # The model is not given to context_parallel: it would refuse eager attention (see above).
        with offload.parallel.context_parallel(meshes.cp, {"input_ids": ids, "labels": ids}) as shard:
            if oa is None:
                loss = model(**shard.inputs).loss
            else:
                with oa:
                    loss = model(**shard.inputs).loss
                seen.append(oa.plan is not None)
            (loss * shard.loss_scale).backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters() if p.grad is not None])
    return grads


def _saved_bytes(meshes: Any, model: Any) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(meshes, model, None, [])
    return sum(seen.values())


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> list[bool]:
    return [len(x) == len(y) > 0 and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(a, b)]


def _check(rank: int) -> dict[str, Any]:
    from offload.layers import model_form

    model_form.SHORT_PROBE_TOKENS = 16  # 48 tokens a rank is "long"
    meshes = offload.parallel.make_mesh(cp=WORLD, device_type="cpu")
    model = _model(meshes)
    plain, again = _run(meshes, model, None, []), _run(meshes, model, None, [])
    budget = int(0.5 * _saved_bytes(meshes, model))
    oa = offload.OffloadActivations(model.model.layers, model=model, memory_budget_bytes=budget, device="cpu",
                                    min_offload_bytes=0)
    planned: list[bool] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(meshes, model, oa, planned)
    plan = oa.plan.describe() if oa.plan is not None else None
    oa.close()
    # fully_shard applied after the context was made: FSDP2's root hook runs ahead of the probe's,
    # which is refused (the batch probed at its full length, with the reason), not run under it.
    late = _model(meshes, shard=False)
    oa = offload.OffloadActivations(late.model.layers, model=late, memory_budget_bytes=budget, device="cpu",
                                    min_offload_bytes=0)
    with warnings.catch_warnings(record=True) as late_caught:
        warnings.simplefilter("always")
        late_got = _run(meshes, _sharded(late, meshes), oa, [])
    oa.close()
    return {"repeats": _same(plain, again), "bitwise": _same(got, plain), "planned": planned, "plan": plan,
            "probe_warnings": [str(w.message)[:300] for w in caught if "probe" in str(w.message)],
            "late_bitwise": _same(late_got, plain),
            "late_warnings": [str(w.message)[:400] for w in late_caught if "probe" in str(w.message)]}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the ranks share the host's cores
    try:
        result = _check(rank)
    except Exception:  # noqa: BLE001 - reported to the test
        result = {"error": traceback.format_exc(limit=8)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads meet static destructors at exit once in a while


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp_probe")
    run_ranks(_worker, (free_port(), str(out)), WORLD, DEADLINE_S)
    results = rank_results(out, WORLD, errors_fail=True)
    return results


def test_the_first_long_batch_under_fsdp2_and_cp_is_probed_short_and_runs_planned(ranks) -> None:
    for r, res in enumerate(ranks):
        assert not res["probe_warnings"], f"rank {r} probed at the full length: {res['probe_warnings']}"
        assert res["planned"] == [True] * len(LENGTHS), (
            f"rank {r}: steps run under a plan {res['planned']}: the first call should have been probed short "
            "and run planned (no full-length probe step)")


def test_steps_after_the_short_probe_under_fsdp2_are_bitwise_the_plain_ones(ranks) -> None:
    for r, res in enumerate(ranks):
        assert all(res["repeats"]), f"rank {r}: the plain FSDP2 steps do not repeat themselves: {res['repeats']}"
        assert all(res["bitwise"]), (f"rank {r}: gradient shards differ from the plain steps' {res['bitwise']} "
                                     f"(plan {res['plan']})")


def test_fully_shard_after_the_context_is_refused_by_name_and_the_steps_stay_exact(ranks) -> None:
    for r, res in enumerate(ranks):
        assert any("make the context after fully_shard" in w for w in res["late_warnings"]), (
            f"rank {r}: no refusal naming the order: {res['late_warnings']}")
        assert all(res["late_bitwise"]), f"rank {r}: gradient shards differ from the plain steps' {res['late_bitwise']}"
