"""Context parallelism (``offload.parallel``, issue 51) on two gloo processes: everything the CPU
can run, which is all but the ring itself (torch's ring attention needs the CUDA SDPA kernels;
``tests/distributed/cp_scenarios.py`` runs it on two GPUs).

One spawn of 2 ranks (a CP mesh of 2) runs every check and writes what it saw; the tests read it:

* the sharding is torch's head-tail layout (rank r: chunks r and 3-r of 4), the shards put back
  together give the batch, and the caller's batch is unchanged;
* labels are shifted over the whole sequence: each token's target is the next global token, the
  last global token's is -100 (rank 1's first token is mid-sequence);
* the per-rank losses (tiled head, and HF's ``ForCausalLMLoss`` with the shard's kwargs) add up
  to the one-process loss, and FSDP2 over both ranks with ``loss_scale`` gives the one-process
  gradient;
* the HF mask trap: with the shard's inputs, HF builds no mask (``is_causal``); without the
  all-ones attention_mask it builds one (the check can fail);
* no collective in the CP path: rank 0 enters the context alone, three times;
* plans on CP shards: a planned ``OffloadActivations`` over a stream of lengths, each rank
  planning for its local shape, the ranks' plans made for the same shape, gradients bitwise
  those of the plain run (itself repeatable);
* a CP mesh cut from a mesh with a ``pp`` dimension is refused.

The other refusals (lengths, masks, positions, attention, FP8, CUDA graphs, and FP8 under the HF
Trainer's own context parallelism) need no second process and run in this one.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from spawn import free_port, rank_results, run_ranks

import offload
from offload.parallel.batch import padded_length, prepare_batch
from offload.parallel.refuse import check_composes

WORLD = 2
GROUP_TIMEOUT_S = 10.0
DEADLINE_S = 120.0
B, T, H, V = 2, 16, 16, 50
PLAN_LENGTHS = [32, 64, 32, 48, 64]  # global; every CP rank of a batch shares it

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed"),
]


def _llama(attn: str, layers: int = 2) -> Any:
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                      max_position_embeddings=128, use_cache=False, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    ids = (torch.arange(B * T).reshape(B, T) * 7) % V
    labels = ids.clone()
    labels[0, 3] = labels[1, 10] = -100  # a few ignored targets: the global count matters
    return {"input_ids": ids, "labels": labels}


# -- the checks, one rank each ---------------------------------------------------------------------
def _sharding(meshes: Any) -> dict[str, Any]:
    batch = _batch()
    before = {k: v.clone() for k, v in batch.items()}
    with offload.parallel.context_parallel(meshes.cp, batch) as shard:
        local = {k: shard.inputs[k].tolist() for k in ("input_ids", "labels", "shift_labels", "position_ids")}
        mask = shard.inputs["attention_mask"].tolist()
        num_items = int(shard.num_items_in_batch)
        kernels = {"efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                   "math": torch.backends.cuda.math_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled()}
    unchanged = all(torch.equal(before[k], batch[k]) for k in batch)
    return {"local": local, "mask": mask, "num_items": num_items, "unchanged": unchanged, "kernels": kernels}


class _HeadLoss(torch.nn.Module):
    """The tiled head and loss as a module: FSDP2 unshards its weight for its forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.head = torch.nn.Linear(H, V, bias=False)

    def forward(self, hidden: torch.Tensor, labels: Any, **shard: Any) -> torch.Tensor:
        return offload.tiling.causal_lm_loss(hidden, self.head, labels, chunk_tokens=5, **shard)


def _loss(meshes: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, H, generator=g)
    labels = _batch()["labels"]
    model, one_model = _HeadLoss(), _HeadLoss()
    one = one_model(hidden, labels)  # the one-process mean
    one.backward()
    one_head = one_model.head
    fully_shard(model, mesh=meshes.fsdp)  # averages the gradients over the dp x cp ranks
    with offload.parallel.context_parallel(meshes.cp, {"inputs_embeds": hidden, "labels": labels}) as shard:
        local = shard.inputs["inputs_embeds"]
        tiled = model(local, None, shift_labels=shard.shift_labels, num_items_in_batch=shard.num_items_in_batch)
        logits = local @ one_head.weight.detach().t()
        hf = ForCausalLMLoss(logits, None, V, num_items_in_batch=shard.num_items_in_batch,
                             shift_labels=shard.shift_labels)
        (tiled * shard.loss_scale).backward()
    grad = model.head.weight.grad.full_tensor()
    return {"one": one.item(), "tiled_sum": offload.parallel.global_loss(tiled, meshes.cp, meshes.dp).item(),
            "hf_sum": offload.parallel.global_loss(hf, meshes.cp).item(),
            "grad_equal": bool(torch.allclose(grad, one_head.weight.grad, rtol=1e-5, atol=1e-7)),
            "grad_ratio": (grad.norm() / one_head.weight.grad.norm()).item()}


def _head_under_fsdp(meshes: Any) -> dict[str, Any]:
    # A Llama sharded by FSDP2 (its head's weight a DTensor outside the forward), untiled, then
    # its head tiled (twice: repeatable): the check passes, the tiled path runs, and the loss and
    # gradients are the untiled ones but for the sum order.
    from torch.distributed.fsdp import fully_shard

    def run(tiled: bool) -> tuple[Any, ...]:
        model = _llama("sdpa")
        for module in [*model.model.layers, model]:
            fully_shard(module, mesh=meshes.fsdp)
        support = offload.tiling.head_support(model)
        head = offload.tiling.tile_head(model, 5) if tiled else None
        out = model(**_batch())
        out.loss.backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        norm = head.wrapper.norm if head is not None else ""
        if head is not None:
            head.remove()
        return support, out.loss.detach(), out.logits is None, grads, norm

    (ok, why), plain, _, plain_grads, _ = run(False)
    _, tiled, logits_skipped, tiled_grads, norm = run(True)
    _, again, _, again_grads, _ = run(True)
    return {"supported": ok, "why": why, "logits_skipped": logits_skipped, "norm_inside": norm == "norm",
            "loss_close": bool(torch.allclose(tiled, plain, rtol=1e-5)),
            "grads_close": all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(tiled_grads, plain_grads)),
            "repeatable": bool(torch.equal(tiled, again)) and all(torch.equal(a, b) for a, b in zip(tiled_grads, again_grads))}


class _Stop(Exception):
    """Raised by the hook once the mask is seen: no attention runs (the CPU has no ring)."""


def _mask_built(meshes: Any, with_ones: bool) -> Any:
    model = _llama("sdpa", layers=1)
    seen: list[Any] = []

    def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen.append(kwargs.get("attention_mask"))
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    with offload.parallel.context_parallel(meshes.cp, _batch(), model=model) as shard:
        inputs = dict(shard.inputs)
        if not with_ones:
            inputs.pop("attention_mask")
        try:
            model(**inputs)
        except _Stop:
            pass
    handle.remove()
    return None if seen[0] is None else list(seen[0].shape)


def _alone(meshes: Any, rank: int) -> bool:
    # Rank 0 goes through the CP path three times while rank 1 waits: a collective there would
    # time out (GROUP_TIMEOUT_S) or pair with the barrier below.
    if rank == 0:
        for _ in range(3):
            with offload.parallel.context_parallel(meshes.cp, _batch()) as shard:
                assert shard.local_length == T // 2
    dist.barrier()
    return True


def _pipeline_mesh_refused() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("pp", "cp"))
    try:
        with offload.parallel.context_parallel(mesh["cp"], _batch()):
            return "entered"
    except RuntimeError as exc:
        return str(exc)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _plans(meshes: Any) -> dict[str, Any]:
    # Eager attention: no SDPA call, which the CPU's ring cannot run; so the model is not given
    # to context_parallel, which would refuse it (each rank attends within its shard: plans only).
    model = _llama("eager")

    def batch(i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, V, (1, PLAN_LENGTHS[i]), generator=torch.Generator().manual_seed(10 + i))
        return {"input_ids": ids, "labels": ids}

    def step(i: int, oa: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with offload.parallel.context_parallel(meshes.cp, batch(i)) as shard:
            if oa is None:
                loss = model(**shard.inputs).loss
            else:
                with oa:
                    loss = model(**shard.inputs).loss
            loss.backward()
        return _grads(model)

    plain = [step(i, None) for i in range(len(PLAN_LENGTHS))]
    again = [step(i, None) for i in range(len(PLAN_LENGTHS))]
    repeats = all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(plain, again))
    saved = _saved_bytes(lambda: step(1, None))
    oa = offload.OffloadActivations(model.model.layers, memory_budget_bytes=int(0.6 * saved), device="cpu",
                                    min_offload_bytes=0)
    bitwise, shapes = [], []
    for i in range(len(PLAN_LENGTHS)):
        got = step(i, oa)
        bitwise.append(len(got) == len(plain[i]) and all(torch.equal(a, b) for a, b in zip(got, plain[i])))
        shape = getattr(getattr(oa.plan, "profile", None), "shape", None)
        shapes.append(None if shape is None else [int(v) for v in shape])
    oa.close()
    return {"repeats": repeats, "bitwise": bitwise, "shapes": shapes}


def _saved_bytes(run: Callable[[], Any]) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world),
                      GLOO_SOCKET_IFNAME="lo")  # loopback: the host name may resolve to an unreachable interface
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the ranks share the host's cores
    meshes = offload.parallel.make_mesh(cp=world, device_type="cpu")
    checks: dict[str, Callable[[], Any]] = {
        "sharding": lambda: _sharding(meshes), "loss": lambda: _loss(meshes),
        "mask_with_ones": lambda: _mask_built(meshes, True), "mask_without": lambda: _mask_built(meshes, False),
        "alone": lambda: _alone(meshes, rank), "plans": lambda: _plans(meshes),
        "pipeline": _pipeline_mesh_refused, "head_fsdp": lambda: _head_under_fsdp(meshes),
    }
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"error": traceback.format_exc(limit=6)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads meet static destructors at exit once in a while (dist_scenarios.gloo_worker)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 2 ranks saw, one dict per rank."""
    out = tmp_path_factory.mktemp("cp")
    run_ranks(_worker, (WORLD, free_port(), str(out)), WORLD, DEADLINE_S)
    return rank_results(out, WORLD)


def _get(ranks: list[dict[str, Any]], name: str) -> list[Any]:
    for r, res in enumerate(ranks):
        assert not (isinstance(res[name], dict) and "error" in res[name]), f"rank {r}, {name}:\n{res[name]['error']}"
    return [res[name] for res in ranks]


# -- the tests -----------------------------------------------------------------------------------
def test_each_rank_holds_torchs_head_tail_shard_and_they_make_the_batch(ranks: list[dict[str, Any]]) -> None:
    got = _get(ranks, "sharding")
    ids = _batch()["input_ids"]
    k = T // (2 * WORLD)
    for r, res in enumerate(got):
        chunks = [r, 2 * WORLD - 1 - r]
        expected = torch.cat([ids[:, c * k:(c + 1) * k] for c in chunks], dim=1)
        assert res["local"]["input_ids"] == expected.tolist(), f"rank {r} does not hold chunks {chunks}"
        positions = torch.cat([torch.arange(c * k, (c + 1) * k) for c in chunks]).expand(B, -1)
        assert res["local"]["position_ids"] == positions.tolist(), f"rank {r}: positions are not the global ones"
        assert res["mask"] == [[1] * (T // WORLD)] * B
        assert res["unchanged"], f"rank {r}: the caller's batch changed"
    whole = torch.zeros(B, T, dtype=torch.long)
    for res in got:
        pos = torch.tensor(res["local"]["position_ids"])
        whole.scatter_(1, pos, torch.tensor(res["local"]["input_ids"]))
    assert torch.equal(whole, ids), "the shards put back at their positions are not the batch"


def test_labels_are_shifted_over_the_whole_sequence(ranks: list[dict[str, Any]]) -> None:
    labels = _batch()["labels"]
    target = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF's shift, globally
    for r, res in enumerate(_get(ranks, "sharding")):
        pos = torch.tensor(res["local"]["position_ids"])
        assert res["local"]["shift_labels"] == target.gather(1, pos).tolist(), f"rank {r}: wrong targets"
        assert res["num_items"] == int((target != -100).sum()), "num_items_in_batch is not the global count"
    first = ranks[1]["sharding"]["local"]
    assert first["shift_labels"][0][0] == labels[0, first["position_ids"][0][0] + 1].item()
    assert any(-100 == row[-1] for row in ranks[0]["sharding"]["local"]["shift_labels"]), \
        "the last global token (on rank 0, the tail chunk) must predict nothing"


def test_losses_add_up_to_the_one_process_loss_and_fsdp_gives_its_gradient(ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(_get(ranks, "loss")):
        assert res["tiled_sum"] == pytest.approx(res["one"], rel=1e-6), f"rank {r}: the tiled head's losses"
        assert res["hf_sum"] == pytest.approx(res["one"], rel=1e-6), f"rank {r}: HF's loss with the shard's kwargs"
        assert res["grad_equal"], f"rank {r}: FSDP2's gradient is {res['grad_ratio']:.3f}x the one-process one"


def test_hf_builds_no_mask_for_the_shard(ranks: list[dict[str, Any]]) -> None:
    for r, (with_ones, without) in enumerate(zip(_get(ranks, "mask_with_ones"), _get(ranks, "mask_without"))):
        assert with_ones is None, f"rank {r}: HF built a mask {with_ones} for the shard: ring attention takes none"
        if r == 0:  # rank 0's positions jump from the head chunk to the tail: HF sees packed documents
            assert without is not None, "without the all-ones mask HF should take the shard for packed documents"


def test_the_cp_path_issues_no_collective(ranks: list[dict[str, Any]]) -> None:
    assert _get(ranks, "alone") == [True, True]


def test_a_cp_mesh_cut_from_a_pipeline_mesh_is_refused(ranks: list[dict[str, Any]]) -> None:
    for message in _get(ranks, "pipeline"):
        assert "pipeline stages does not compose with context parallelism yet" in message, message


def test_ranks_plan_their_shards_alike_and_bitwise(ranks: list[dict[str, Any]]) -> None:
    got = _get(ranks, "plans")
    for r, res in enumerate(got):
        assert res["repeats"], f"rank {r}: the plain CP run does not repeat itself"
        assert all(res["bitwise"]), f"rank {r}: gradients differ from the plain run at steps {res['bitwise']}"
    assert got[0]["shapes"] == got[1]["shapes"], "the ranks follow plans made for different shapes"
    planned = [(i, s) for i, s in enumerate(got[0]["shapes"]) if s is not None]
    assert planned, f"no plan came into force: {got[0]['shapes']}"
    for i, shape in planned:
        local = PLAN_LENGTHS[i] // WORLD
        assert local <= shape[1] < PLAN_LENGTHS[i], \
            f"step {i}: a plan for {shape}, not for this rank's shard of {local} tokens (of {PLAN_LENGTHS[i]})"


# -- refusals (one process) ------------------------------------------------------------------------
def test_a_head_sharded_by_fsdp2_is_checked_and_tiled(ranks: list[dict[str, Any]]) -> None:
    # T29 met "head untiled: model.lm_head's weight is a DTensor" on the GPU: the untiled head of
    # the LLAMA-8B shape at 524,288 tokens a rank needs 774 GiB.
    for seen in _get(ranks, "head_fsdp"):
        assert seen["supported"] and not seen["why"], seen["why"]
        assert seen["logits_skipped"], "the tiled path builds no logits"
        # The final norm (its weight sharded too) runs inside the chunks, its gradient reduced by FSDP2.
        assert seen["norm_inside"], seen
        assert seen["loss_close"] and seen["grads_close"] and seen["repeatable"], seen


def test_a_length_the_load_balancer_cannot_shard_names_the_length_to_pad_to() -> None:
    ids = torch.zeros(1, 30, dtype=torch.long)
    with pytest.raises(ValueError, match="pad the batch to 32 tokens"):
        prepare_batch({"input_ids": ids, "labels": ids}, 4)
    assert padded_length(30, 4) == 32 and padded_length(32, 4) == 32


def test_padding_masks_packed_positions_and_missing_labels_are_refused() -> None:
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    prepare_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, 2)  # all ones: fine
    mask[1, 6:] = 0
    with pytest.raises(ValueError, match="padding"):
        prepare_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, 2)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    with pytest.raises(ValueError, match="packed sequences"):
        prepare_batch({"input_ids": ids, "labels": ids, "position_ids": packed}, 2)
    with pytest.raises(ValueError, match="no labels"):
        prepare_batch({"input_ids": ids}, 2)


def test_attention_other_than_sdpa_is_refused() -> None:
    from offload.parallel.refuse import check_attention

    with pytest.raises(ValueError, match="attention is 'eager'.*SDPA only"):
        check_attention(_llama("eager", layers=1))
    check_attention(_llama("sdpa", layers=1))
    check_attention(torch.nn.Linear(2, 2))  # no HF config: nothing to check


def test_pipeline_stages_cuda_graphs_and_fp8_are_refused() -> None:
    with pytest.raises(RuntimeError, match="pipeline stages does not compose"):
        check_composes(None, ("pp", "cp"))
    fake_fp8 = type("Linear", (torch.nn.Linear,), {"__module__": "offload.fp8.linear"})
    with pytest.raises(RuntimeError, match=r"FP8 layers \(0 \(Linear\)\).*not compose"):
        check_composes(torch.nn.Sequential(fake_fp8(2, 2)), ("cp",))
    from offload.graphs import GraphedLayer

    graphed = GraphedLayer.__new__(GraphedLayer)
    torch.nn.Module.__init__(graphed)
    with pytest.raises(RuntimeError, match="CUDA graphs .*not compose"):
        check_composes(torch.nn.Sequential(graphed), ("cp",))
    check_composes(torch.nn.Linear(2, 2), ("cp",))  # a plain model passes


def test_offload_trainer_refuses_fp8_layers_under_the_trainers_context_parallelism(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import transformers

    model = _llama("sdpa")
    fake_fp8 = type("Linear", (torch.nn.Linear,), {"__module__": "offload.fp8.linear"})
    model.model.layers[0].mlp.down_proj = fake_fp8(64, 32, bias=False)
    args = transformers.TrainingArguments(str(tmp_path), max_steps=1, report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[])
    # accelerate's ParallelismConfig(cp_size=2) needs two ranks: its one flag is stood in for.
    config = types.SimpleNamespace(cp_enabled=True)
    monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self: config))
    with pytest.raises(RuntimeError, match="FP8 .*not compose with context parallelism"):
        offload.integrations.hf.offload_trainer(trainer)
    config.cp_enabled = False
    offload.integrations.hf.offload_trainer(trainer).close()  # without context parallelism: offloaded


def test_inside_the_cp_context_sdpa_may_not_take_the_efficient_or_math_kernel(ranks: list[dict[str, Any]]) -> None:
    for kernels in (r["kernels"] for r in _get(ranks, "sharding")):
        assert kernels == {"efficient": False, "math": False, "flash": True}, kernels


def test_the_ring_runs_only_on_the_kernels_it_is_sound_on() -> None:
    """Inside the CP ``with`` (more than one rank) SDPA may take flash or cuDNN, never the
    memory-efficient kernel (its ring backward gives NaN gradients) or math (no ring); with both
    sound kernels disabled the error says so; a mesh of one leaves the flags alone."""
    from torch.backends import cuda as flags
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from offload.parallel.context import ring_kernels

    with ring_kernels(2):
        assert flags.flash_sdp_enabled() and flags.cudnn_sdp_enabled()
        assert not flags.mem_efficient_sdp_enabled() and not flags.math_sdp_enabled()
    assert flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()  # given back
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        with ring_kernels(2):  # of the caller's choice, only what is sound
            assert flags.flash_sdp_enabled() and not flags.cudnn_sdp_enabled()
            assert not flags.mem_efficient_sdp_enabled()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        with pytest.raises(ValueError, match="flash or cuDNN"):
            ring_kernels(2)
        with ring_kernels(1):
            assert flags.mem_efficient_sdp_enabled() and not flags.flash_sdp_enabled()
