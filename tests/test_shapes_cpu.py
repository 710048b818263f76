"""Plans per batch shape (issue 33), on the CPU: how a saved tensor grows with the shape, a
profile predicted at another shape against one measured there, each step of a stream of lengths
following its own bucket's plan bit for bit, a shape no plan fits refused before any layer runs,
and the partial-offload floor compared tensor by tensor as the engine's policy does."""

from __future__ import annotations

import warnings

import pytest
import torch

import offload
from offload.planner import Action, BudgetError, LayerPlan, plan_for
from offload.planner.scaling import profile_at
from offload.planner.shapes import StepShape, shape_of, size_exponents

from _util import assert_bitwise, llama_grads, make_gpt_layers, oa_step, train_step

P = StepShape(2, 512)


@pytest.mark.parametrize("sizes, hidden, expected", [
    ((2, 512, 64), 64, (1, 1)),          # activations
    ((1024, 64), 64, (1, 1)),            # tokens flattened
    ((2, 4, 512, 16), 64, (1, 1)),       # heads
    ((2, 4, 512, 512), 64, (1, 2)),      # attention scores
    ((2, 4, 512, 512), 4096, (1, 2)),
    ((1, 512, 16), 64, (0, 1)),          # rotary tables: the length alone
    ((64, 64), 64, (0, 0)),              # a weight's copy
    ((2, 8, 512, 128), 1024, (1, 1)),    # heads whose head_dim is not the length
    ((8, 16, 512), 64, (1, 1)),          # the batch merged with the heads
    ((1, 1, 512, 16), 64, (0, 1)),       # broadcast over the batch
    ((8, 512, 512), 64, (1, 2)),         # scores with the batch merged into the heads (eager's bmm)
    ((8, 512, 512), 2048, (1, 1)),       # ... not heads whose head_dim is the length (4 x 512)
    ((2, 512, 512), 64, (1, 1)),         # an MLP as wide as the probe is long: (B, T, features)
])
def test_size_exponents(sizes, hidden, expected) -> None:
    assert size_exponents(sizes, P, hidden) == expected


def test_size_exponents_heads_as_wide_as_the_length() -> None:
    # head_dim == T0: the hidden size tells heads from scores.
    assert size_exponents((2, 4, 16, 16), StepShape(2, 16), hidden=64) == (1, 1)
    assert size_exponents((2, 4, 16, 16), StepShape(2, 16), hidden=None) == (1, 2)
    # At batch 1 a per-sample tensor cannot be told by its dims: it grows with the batch too.
    assert size_exponents((1, 300, 64), StepShape(1, 300)) == (1, 1)
    # At batch 1, eager attention's bmm saves its scores as (heads, T, T).
    assert size_exponents((4, 300, 300), StepShape(1, 300), hidden=64) == (1, 2)


def test_shapes_and_buckets() -> None:
    assert shape_of((4, 1000, 64)) == StepShape(4, 1000) and shape_of((7, 64)) == StepShape(1, 7)
    assert StepShape(4, 1000).tokens == 4000
    for length in (9, 100, 1000, 1024, 6144, 131072):
        top = StepShape(2, length).bucket()
        assert top.batch == 2 and length <= top.length <= length * 2 ** (1 / 8) + 1
    assert StepShape(2, 1024).bucket() == StepShape(2, 1024)  # a power of two is its own top
    assert StepShape(2, 1000).bucket() == StepShape(2, 1000).bucket().bucket()
    with pytest.raises(ValueError, match="batch shape"):
        shape_of((64,))


def _llama_profile(model, ids):
    return offload.planner.profile_step(
        model.model.layers, lambda: llama_grads(model, ids), device="cpu", min_offload_bytes=0, warmup_steps=0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_profile_predicted_at_another_shape_matches_one_measured_there(attention) -> None:
    # Bytes saved and a checkpoint's inputs, per layer, predicted from a probe at length 24 for
    # a step at batch 3 x length 40 (eager attention: its scores grow with the length squared),
    # against a probe run there. Slots are 256-byte aligned spans: equal up to that. (A probe
    # as long as a head is wide, 16 here, could not tell grouped key/value heads from scores.)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
        attn_implementation=attention)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    short = _llama_profile(model, torch.randint(0, 128, (2, 24)))
    long = _llama_profile(model, torch.randint(0, 128, (3, 40)))
    assert short.shape == (2, 24) and long.shape == (3, 40)
    predicted = profile_at(short, StepShape(3, 40))
    for got, want in zip(predicted.layers, long.layers):
        assert got.input_bytes == want.input_bytes
        assert len(got.slot_bytes) == len(want.slot_bytes)
        for a, b in zip(sorted(got.slot_bytes), sorted(want.slot_bytes)):
            assert abs(a - b) <= 256, (sorted(got.slot_bytes), sorted(want.slot_bytes))
    if attention == "eager":  # the scores (2 x 4 x 24 x 24 floats at the probe) grew squared
        assert max(long.layers[0].slot_bytes) == 3 * 4 * 40 * 40 * 4


@pytest.mark.parametrize("short, long", [((1, 24), (1, 96)), ((2, 24), (3, 40))])
def test_eager_bf16_scores_saved_by_bmm_grow_squared(short, long) -> None:
    # In bf16, eager attention casts the softmax's float32 output to bf16 and its second matmul
    # saves that as a (batch x heads, T, T) view, which nothing else holds: read as activations,
    # a 4x longer step was predicted to save 4x those scores where it saves 16x (on the H200, 2 GB
    # a layer short at 16384 tokens).
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, use_cache=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    measured_short = _llama_profile(model, torch.randint(0, 128, short))
    measured_long = _llama_profile(model, torch.randint(0, 128, long))
    predicted = profile_at(measured_short, StepShape(*long))
    for got, want in zip(predicted.layers, measured_long.layers):
        assert sorted(got.slot_growth).count((1, 2)) == 2, got.slot_growth  # float32 and bf16 scores
        assert len(got.slot_bytes) == len(want.slot_bytes)
        for a, b in zip(sorted(got.slot_bytes), sorted(want.slot_bytes)):
            assert abs(a - b) <= 256, (sorted(got.slot_bytes), sorted(want.slot_bytes))


def test_a_transient_peak_is_never_predicted_below_its_worst_split_between_kinds() -> None:
    # A layer saving activations (1, 1) and scores (1, 2) at length 1024: a peak made of any
    # mix of temporaries of those two kinds (and, in backward, less what its saved bytes free)
    # is predicted at or above what that mix reaches at 4x and 16x the length; where every slot
    # grows alike, exactly as they do; and shrinking, as the saved bytes shrink.
    from offload.planner.scaling import transient_at

    probe = StepShape(1, 1024)
    lin, quad = 16_500_000, 16_800_000
    slots = [(lin, lin, (1, 1)), (quad, quad, (1, 2))]
    freed = [(lin, (1, 1)), (quad, (1, 2))]
    for length in (4096, 16384):
        shape = StepShape(1, length)
        q = length / 1024
        for alpha, beta in ((2.5, 0.57), (1.0, 2.0), (3.0, 0.0), (0.0, 3.0)):  # forward: temporaries
            peak = alpha * quad + beta * lin
            assert transient_at(int(peak), slots, [], shape, probe) >= alpha * quad * q * q + beta * lin * q - 1
        for alpha, beta in ((2.96, -0.5), (3.0, -1.0), (1.0, 0.5)):  # backward: frees saved bytes
            peak = alpha * quad + beta * lin
            assert transient_at(int(peak), slots, freed, shape, probe) >= alpha * quad * q * q + beta * lin * q - 1
    # (The measured SDPA-math layer: forward 51.4 MB at 1024, 10.89 GB at 16384.)
    assert 10.89e9 <= transient_at(51_388_928, slots, [], StepShape(1, 16384), probe) <= 1.25 * 10.89e9
    assert transient_at(0, slots, freed, StepShape(1, 16384), probe) == 0  # not measured (the CPU)
    alike = [(lin, lin, (1, 1)), (quad, quad, (1, 1))]
    assert transient_at(1000, alike, [(lin, (1, 1))], StepShape(2, 2048), probe) == 4000
    shorter = StepShape(1, 256)
    as_saved = (lin / 4 + quad / 16) / (lin + quad)
    assert transient_at(10_000_000, slots, freed, shorter, probe) == round(10_000_000 * as_saved)


def _stream_budget(layers, x) -> int:
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    return offload.planner.lowest_peak(profile).prediction.peak_bytes


def test_a_stream_of_lengths_follows_a_plan_per_bucket_bit_for_bit() -> None:
    layers = make_gpt_layers(4)
    lengths = [16, 16, 16, 32, 8, 32, 24, 16, 8]  # the first three are the probe's
    # A budget between the lowest and the plain peak at the longest length: plans differ.
    budget = _stream_budget(layers, torch.randn(2, 32, 64)) * 3 // 2
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0)
    shapes = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "the plan was made for ..." at any length
        for step, length in enumerate(lengths):
            x = torch.randn(2, length, 64, generator=torch.Generator().manual_seed(step))
            assert_bitwise(train_step(layers, x), oa_step(layers, x, oa))
            if oa.plan is not None:
                shapes.append(oa.plan.profile.shape)
                top = StepShape(2, length).bucket()
                assert oa.plan.profile.shape == (top.batch, top.length)
    assert len(set(shapes)) == 4  # 32, 8, 24 and 16 each have their own plan
    assert set(oa._planned._plans) == {StepShape(2, n).bucket() for n in (8, 16, 24, 32)}


def test_a_shape_no_plan_fits_is_refused_before_its_first_layer() -> None:
    layers = make_gpt_layers(4)
    x = torch.randn(2, 16, 64)
    budget = _stream_budget(layers, x) * 11 // 10  # fits length 16, not 64
    oa = offload.OffloadActivations(layers, memory_budget_bytes=budget, device="cpu", min_offload_bytes=0)
    for _ in range(3):  # the probe steps
        oa_step(layers, x, oa)
    ran = []
    handle = layers[0].register_forward_hook(lambda *a: ran.append(1))
    with pytest.raises(BudgetError, match=r"a step of batch 2 x length 64.*lowest peak"):
        oa_step(layers, torch.randn(2, 64, 64), oa)
    handle.remove()
    assert not ran  # before layer 0's forward
    assert_bitwise(train_step(layers, x), oa_step(layers, x, oa))  # the context goes on


def test_partial_offload_floor_is_compared_tensor_by_tensor() -> None:
    # The GPT block splits q, k and v out of one projection: three views of one storage, one
    # slot. A plan offloading each layer's tensors of at least the largest *tensor* size must
    # copy what the planner predicted, slot for slot (the runtime compares tensors with the
    # floor; a floor compared with slot sizes kept q, k and v on the GPU but counted them).
    layers = make_gpt_layers(3)
    x = torch.randn(2, 16, 64)
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    layer = profile.layers[0]
    qkv = [(s, k) for s, k in zip(layer.slot_bytes, layer.slot_keys) if s > k]
    assert qkv, "the qkv slot is larger than each of its tensors"
    # Above each of q, k and v, below their slot: compared with slots, the slot would be counted
    # as offloaded while the engine keeps its three tensors.
    floor = qkv[0][1] + 1
    assert floor <= qkv[0][0]
    made = plan_for(profile, [LayerPlan(Action.OFFLOAD, floor)] * 2 + [LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made, device="cpu", min_offload_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise(train_step(layers, x), oa_step(layers, x, oa))
    assert oa.stats["offloaded_bytes"] == 2 * offload.planner.offloaded_bytes(layer, made.layers[0])


def test_arena_pins_only_what_no_idle_block_serves_and_holds_blocks_across_shapes() -> None:
    # A new shape's plan pins ahead only the regions that the blocks of other shapes' plans do
    # not serve (within the reuse slack), and with plans per shape idle blocks are not trimmed
    # after a step that did not use them.
    from offload.host.arena import HostArena

    mib = 1 << 20
    arena = HostArena(pinned=False, budget_bytes=1 << 30, retain=False)
    arena.preallocate([1 * mib, 4 * mib])
    assert arena.unserved([1 * mib, 3 * mib, 8 * mib]) == [8 * mib]
    assert arena.unserved([1 * mib, 1 * mib]) == [1 * mib]  # each block serves one region
    # Only idle blocks, not those being pinned (a plan made ahead is ready once its blocks are idle).
    assert arena.unserved([8 * mib], pending=False) == [8 * mib]
    arena.preallocate([8 * mib], background=True)
    arena.settle(wait=True)
    assert arena.unserved([8 * mib], pending=False) == []
    region = arena.acquire(1 * mib, step=1)
    arena.release(region, None)
    arena._last_acquiring_step = 2
    arena.hold_idle = True
    arena.end_step(2)
    assert arena.counters.bytes_held >= 5 * mib  # the 4 MiB block no step 2 region used stays
    arena.hold_idle = False
    arena.end_step(2)
    assert arena.counters.bytes_held < 5 * mib


def test_plan_group_is_a_planner_option() -> None:
    # The ranks that agree on a step's shape: accepted with layers (False: none agree), refused
    # by the form without layers, which does not plan.
    layers = make_gpt_layers(2)
    oa = offload.OffloadActivations(layers, memory_budget_bytes=1 << 30, device="cpu", plan_group=False)
    assert oa._planned._group is False
    with pytest.raises(ValueError, match="plan_group"):
        offload.OffloadActivations(plan_group=False)
