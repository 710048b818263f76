"""The tiled LM head and cross-entropy (offload.tiling.loss, offload.tiling.causal_lm) on CPU:
the loss and gradients agree with the untiled ``F.cross_entropy(F.linear(h, W, b).float(), y)``
and with HF's own causal-LM loss within the tolerances below, repeat bit for bit, and the
installer refuses what it cannot tile with a reason a user can act on.

Tolerances (also in offload/tiling/loss.py's notes). Tiling changes only the order of sums:
- float32: rtol 1e-5, atol 1e-6 (measured: at most 4e-7 of the largest entry);
- bfloat16: the loss rtol 1e-5 (summed in float32 either way; measured 9e-8); each gradient
  within 2**-6 of its largest entry. HF's own bf16 gradients are off from a float64 computation by
  up to 8e-3 of their largest entry (measured on these shapes), and tiling adds one bf16 rounding of
  a partial weight-gradient per chunk (measured differences up to 4.4e-3): 2**-6 = 1.6e-2 is about
  twice HF's own error. A separate test holds the tiled error against float64 to at most twice HF's.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from offload.tiling.causal_lm import TiledCausalLMForward, head_support, tile_head, tiled_head_installed
from offload.tiling.loss import causal_lm_loss, default_head_chunk, head_chunk_bytes, linear_cross_entropy

transformers = pytest.importorskip("transformers")

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
BF16_LOSS_RTOL = 1e-5
BF16_GRAD_OF_MAX = 2.0 ** -6  # a bf16 gradient's tolerance, as a fraction of its largest entry
VOCAB, HIDDEN = 1000, 64


# --- linear_cross_entropy against the untiled computation ----------------------------------------

def head_inputs(dtype: torch.dtype, n: int, *, bias: bool = True, seed: int = 0, ignore_every: int = 7,
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g).to(dtype)
    # Scaled so the logits spread over a few units, as a trained head's do.
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 3 * HIDDEN ** -0.5).to(dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, b, labels


def loss_and_grads(fn: Callable[..., torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor], labels: torch.Tensor, *, autocast: bool = False,
                   **kw: Any) -> list[Optional[torch.Tensor]]:
    """The loss, then the gradients of hidden, weight, bias (None where not asked for).
    ``autocast``: the forward under bf16 CPU autocast, the backward outside it (as Trainer does)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    h, w, b = leaves
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels, bias=b, **kw)
    loss.backward()
    return [loss.detach()] + [t.grad if t is not None else None for t in leaves]


def untiled(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
            ignore_index: int = -100, num_items: Any = None, **_: Any) -> torch.Tensor:
    """HF's ForCausalLMLoss on already-shifted labels: logits in the input dtype, float32 loss."""
    logits = F.linear(hidden, weight, bias).float()
    if num_items is None:
        return F.cross_entropy(logits, labels, ignore_index=ignore_index)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / num_items


def assert_agree(expected: list, got: list, dtype: torch.dtype, what: str = "") -> None:
    names = ["loss", "hidden grad", "weight grad", "bias grad"]
    for name, e, g in zip(names, expected, got):
        assert (e is None) == (g is None), f"{what}{name}: one side has no gradient"
        if e is None:
            continue
        assert g.dtype == e.dtype, f"{what}{name}: dtype {g.dtype}, untiled {e.dtype}"
        if dtype == torch.float32:
            torch.testing.assert_close(g, e, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"{what}{name}: {m}")
        elif name == "loss":
            torch.testing.assert_close(g, e, rtol=BF16_LOSS_RTOL, atol=0, msg=lambda m: f"{what}{name}: {m}")
        else:
            atol = BF16_GRAD_OF_MAX * e.float().abs().max().item()
            torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=atol, msg=lambda m: f"{what}{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, chunk", [(96, 32), (100, 33), (100, 100), (100, 512), (1000, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_untiled_cross_entropy(dtype: torch.dtype, n: int, chunk: int, bias: bool) -> None:
    inputs = head_inputs(dtype, n, bias=bias)
    expected = loss_and_grads(untiled, *inputs)
    got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=chunk)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    assert_agree(expected, got, dtype, f"{dtype} n={n} chunk={chunk}: ")


def test_bf16_is_as_accurate_as_untiled() -> None:
    """Against a float64 computation from the same bf16 inputs, the tiled gradients are off by at
    most twice what HF's untiled ones are: tiling costs no accuracy that matters."""
    inputs = head_inputs(torch.bfloat16, 1000)
    exact = loss_and_grads(untiled, *[t.double() if t is not None and t.is_floating_point() else t for t in inputs])
    hf = loss_and_grads(untiled, *inputs)
    tiled = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=64)
    for name, x, h, t in zip(["loss", "hidden", "weight", "bias"], exact, hf, tiled):
        scale = x.abs().max().item()
        err_hf = (h.double() - x).abs().max().item() / scale
        err_tiled = (t.double() - x).abs().max().item() / scale
        assert err_tiled <= 2 * err_hf + 1e-6, f"{name}: tiled error {err_tiled:.2e} vs untiled {err_hf:.2e} of the largest entry"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_repeatable(dtype: torch.dtype) -> None:
    inputs = head_inputs(dtype, 300)
    first = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=64)
    second = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=64)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {i} (loss, hidden, weight, bias grads) differs between two identical runs"


@pytest.mark.parametrize("num_items", [37, torch.tensor(37), torch.tensor(37.0)])
def test_num_items_divides_the_sum(num_items: Any) -> None:
    inputs = head_inputs(torch.float32, 100, ignore_every=3)
    expected = loss_and_grads(untiled, *inputs, num_items=num_items)
    got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=16, num_items=num_items)
    assert_agree(expected, got, torch.float32)
    mean = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=16)
    assert not torch.allclose(mean[0], got[0]), "num_items was not used: the loss is the mean"


def test_ignored_rows_count_for_nothing() -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 64, ignore_every=2)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=10)
    assert torch.all(got[1][::2] == 0), "ignored rows got a hidden gradient"
    kept = loss_and_grads(linear_cross_entropy, hidden[1::2], weight, bias, labels[1::2], chunk_tokens=10)
    torch.testing.assert_close(got[0], kept[0], rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(got[2], kept[2], rtol=FP32_RTOL, atol=FP32_ATOL)
    # Another ignore_index, a valid class: its rows are ignored, the others count.
    labels7 = torch.where(labels == -100, 7, labels)
    expected = loss_and_grads(untiled, hidden, weight, bias, labels7, ignore_index=7)
    assert_agree(expected, loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels7, chunk_tokens=10,
                                          ignore_index=7), torch.float32, "ignore_index=7: ")


def test_all_ignored_is_nan_with_zero_gradients_like_hf() -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 20)
    labels[:] = -100
    expected = loss_and_grads(untiled, hidden, weight, bias, labels)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, bias, labels, chunk_tokens=8)
    assert torch.isnan(expected[0]) and torch.isnan(got[0]), f"loss {got[0]}, HF's {expected[0]}"
    for name, e, g in zip(["hidden", "weight", "bias"], expected[1:], got[1:]):
        assert torch.equal(e, g), f"{name} gradient with every row ignored: HF's is all zeros, ours is not"


class RecordAllocations(TorchDispatchMode):
    """The shapes and dtypes of every tensor the ops under it return."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append((tuple(t.shape), t.dtype))
        return out


def test_frozen_head_computes_no_weight_gradient() -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 100)
    expected = loss_and_grads(untiled, hidden, weight, bias, labels)
    h = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, weight, labels, bias=bias, chunk_tokens=32)  # weight, bias frozen
    with RecordAllocations() as record:
        loss.backward()
    assert weight.grad is None and bias.grad is None
    torch.testing.assert_close(h.grad, expected[1], rtol=FP32_RTOL, atol=FP32_ATOL)
    assert (tuple(weight.shape), torch.float32) not in record.made, "a frozen head still built a (V, H) float32 buffer"


def test_hidden_without_grad_still_trains_the_head() -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 100)
    expected = loss_and_grads(untiled, hidden, weight, bias, labels)
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    linear_cross_entropy(hidden, w, labels, bias=b, chunk_tokens=32).backward()
    torch.testing.assert_close(w.grad, expected[2], rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(b.grad, expected[3], rtol=FP32_RTOL, atol=FP32_ATOL)


def test_saved_tensors_pass_through_the_hooks() -> None:
    """An offload context sees the hidden states (and may move them): packed as a copy here, the
    gradients are bitwise those without hooks."""
    inputs = head_inputs(torch.bfloat16, 200)
    plain = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=64)
    packed: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hooked = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=64)
    assert (200, HIDDEN) in packed, f"the hidden states did not reach the saved-tensor hooks (saw {packed})"
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked))


@pytest.mark.parametrize("chunk", [64, 200])
def test_autocast_matches_untiled(chunk: int) -> None:
    """Under CPU autocast (float32 weights, bf16 GEMMs: HF Trainer's bf16=True) with backward run
    outside it, backward recomputes the logits as the forward made them (in bf16), and the
    gradients keep the inputs' dtype. One chunk makes the same GEMMs as the untiled head: its
    gradients then agree within one bf16 rounding, 2**-8 of the largest entry (measured: 2.4e-3
    at most, the bias gradient, which we sum in float32); logits recomputed in float32 instead of
    bf16 would be off by 6e-3 or more."""
    inputs = head_inputs(torch.float32, 200)
    expected = loss_and_grads(untiled, *inputs, autocast=True)
    got = loss_and_grads(linear_cross_entropy, *inputs, autocast=True, chunk_tokens=chunk)
    assert_agree(expected, got, torch.bfloat16, "autocast: ")
    if chunk >= 200:
        for name, e, g in zip(["hidden", "weight", "bias"], expected[1:], got[1:]):
            off = ((g - e).abs().max() / e.abs().max()).item()
            assert off <= 2.0 ** -8, f"{name} gradient off by {off:.1e} of its largest entry from autocast's untiled one"


def test_chunk_sizes() -> None:
    assert head_chunk_bytes(1024, 32000) == 12 * 1024 * 32000
    assert default_head_chunk(32000) == 2048  # 12 * 2048 * 32000 = 0.73 GiB; 4096 would be 1.46
    assert default_head_chunk(128256) == 1024  # the floor: 512 would already fit
    assert default_head_chunk(1000) == 65536
    assert head_chunk_bytes(default_head_chunk(1000), 1000) <= 1 << 30 < head_chunk_bytes(2 * default_head_chunk(1000), 1000)


@pytest.mark.parametrize("chunk", [0, -3, "x", 2.0, True, None])
def test_bad_chunk_tokens(chunk: Any) -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)


@pytest.mark.parametrize("case, match", [
    ("hidden 3-D", "hidden must be 2-D"),
    ("labels short", "one target per row"),
    ("weight width", "weight must be"),
    ("labels float", "int64"),
    ("bias shape", "bias must have shape"),
])
def test_mismatched_shapes(case: str, match: str) -> None:
    hidden, weight, bias, labels = head_inputs(torch.float32, 8)
    if case == "hidden 3-D":
        hidden = hidden.reshape(2, 4, HIDDEN)
    elif case == "labels short":
        labels = labels[:5]
    elif case == "weight width":
        weight = weight[:, :32]
    elif case == "labels float":
        labels = labels.float()
    else:
        bias = bias[:10]
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=4)


def test_causal_lm_loss_shifts_like_hf() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, HIDDEN, generator=g)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    labels = torch.randint(0, VOCAB, (2, 9), generator=g)
    labels[0, :3] = -100
    expected = ForCausalLMLoss(head(hidden), labels, VOCAB)
    got = causal_lm_loss(hidden, head, labels, chunk_tokens=4)
    torch.testing.assert_close(got, expected, rtol=FP32_RTOL, atol=FP32_ATOL)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(causal_lm_loss(hidden, head, None, chunk_tokens=4, shift_labels=shifted), expected,
                               rtol=FP32_RTOL, atol=FP32_ATOL)
    expected_n = ForCausalLMLoss(head(hidden), labels, VOCAB, num_items_in_batch=torch.tensor(5))
    torch.testing.assert_close(causal_lm_loss(hidden, head, labels, chunk_tokens=4, num_items_in_batch=torch.tensor(5)),
                               expected_n, rtol=FP32_RTOL, atol=FP32_ATOL)


# --- the HF model with tile_head ------------------------------------------------------------------

def tiny_llama(seed: int = 0) -> Any:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    assert model.config._attn_implementation == "sdpa"
    return model


def token_ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def model_step(model: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss and every parameter's gradient of one call with labels."""
    model.zero_grad(set_to_none=True)
    out = model(*args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out.loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_model_agrees(expected: tuple, got: tuple, what: str) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"{what} loss: {m}")
    assert len(got[1]) == len(expected[1])
    for i, (e, g) in enumerate(zip(expected[1], got[1])):
        torch.testing.assert_close(g, e, rtol=FP32_RTOL, atol=FP32_ATOL, msg=lambda m: f"{what} parameter {i}: {m}")


def assert_bitwise_outputs(a: Any, b: Any) -> None:
    assert torch.equal(a.logits, b.logits), "the logits differ from the plain model's"
    if a.loss is not None:
        assert torch.equal(a.loss, b.loss)


def test_tile_head_matches_the_untiled_model() -> None:
    model, ids = tiny_llama(), token_ids()
    plain = model_step(model, input_ids=ids, labels=ids)
    again = model_step(model, input_ids=ids, labels=ids)
    assert torch.equal(plain[0], again[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], again[1]))
    with tile_head(model, 16) as tiled:
        assert tiled_head_installed(model) is tiled.wrapper
        out = model(input_ids=ids, labels=ids)
        assert out.logits is None and out.loss is not None, "the tiled path should leave the logits out"
        assert_model_agrees(plain, model_step(model, input_ids=ids, labels=ids), "tiled")
        first = model_step(model, input_ids=ids, labels=ids)
        second = model_step(model, input_ids=ids, labels=ids)
        assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1])), \
            "the tiled model does not repeat itself bit for bit"
    assert tiled_head_installed(model) is None and "forward" not in model.__dict__
    back = model_step(model, input_ids=ids, labels=ids)
    assert torch.equal(back[0], plain[0]) and all(torch.equal(a, b) for a, b in zip(back[1], plain[1])), \
        "after remove() the model is not bitwise the plain one"


def test_padding_and_ignored_labels() -> None:
    model, ids = tiny_llama(), token_ids()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on the second row
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 10:15] = -100
    plain = model_step(model, input_ids=ids, attention_mask=mask, labels=labels)
    with tile_head(model, 24):
        assert_model_agrees(plain, model_step(model, input_ids=ids, attention_mask=mask, labels=labels), "padded")
    n = torch.tensor(50)
    plain_n = model_step(model, input_ids=ids, labels=labels, num_items_in_batch=n)
    with tile_head(model, 24):
        assert_model_agrees(plain_n, model_step(model, input_ids=ids, labels=labels, num_items_in_batch=n),
                            "num_items_in_batch")


def test_positional_call_and_tuple_output() -> None:
    model, ids = tiny_llama(), token_ids()
    params = list(inspect.signature(model.forward).parameters)
    assert params[5] == "labels", f"this transformers' forward takes {params[:6]} first"
    plain = model_step(model, ids, None, None, None, None, ids)
    with tile_head(model, 16):
        assert_model_agrees(plain, model_step(model, ids, None, None, None, None, ids), "positional")
        out = model(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
        assert isinstance(out, tuple) and len(out) == 1, f"tuple output: {[type(o).__name__ for o in out]}"
        torch.testing.assert_close(out[0].detach(), plain[0], rtol=FP32_RTOL, atol=FP32_ATOL)


def test_calls_without_labels_or_with_chunk_zero_are_bitwise_plain() -> None:
    model, ids = tiny_llama(), token_ids()
    model.eval()
    plain = model(input_ids=ids)
    plain_loss = model(input_ids=ids, labels=ids)
    asked: list[tuple[int, int]] = []

    def chunk(batch: int, length: int) -> int:
        asked.append((batch, length))
        return 0

    with tile_head(model, 16):
        assert_bitwise_outputs(plain, model(input_ids=ids))
        assert_bitwise_outputs(plain, model(ids))
    with tile_head(model, chunk):
        assert_bitwise_outputs(plain_loss, model(input_ids=ids, labels=ids))
        assert asked == [(2, 40)], f"the chunk callable was asked {asked}"
    short = ids[:, :16]
    plain_short = model(input_ids=short, labels=short)
    with tile_head(model, lambda batch, length: 8 if length > 16 else 0):
        assert model(input_ids=ids, labels=ids).logits is None
        assert_bitwise_outputs(plain_short, model(input_ids=short, labels=short))


def test_inputs_embeds_and_generate_still_work() -> None:
    model, ids = tiny_llama(), token_ids()
    embeds = model.get_input_embeddings()(ids).detach()
    plain = model_step(model, inputs_embeds=embeds, labels=ids)
    with tile_head(model, 16):
        assert_model_agrees(plain, model_step(model, inputs_embeds=embeds, labels=ids), "inputs_embeds")
        model.eval()
        generated = model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False)
    model.eval()
    assert torch.equal(generated, model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False))


def test_copies_keep_a_working_tiled_head() -> None:
    model, ids = tiny_llama(), token_ids()
    plain = model_step(model, input_ids=ids, labels=ids)
    tile_head(model, 16)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        wrapper = tiled_head_installed(copied)
        assert wrapper is not None and wrapper.model is copied, "the copy's stand-in is not bound to the copy"
        assert copied(input_ids=ids, labels=ids).logits is None
        assert_model_agrees(plain, model_step(copied, input_ids=ids, labels=ids), "copy")


# --- what cannot be tiled, and bad calls ----------------------------------------------------------

class ScaledLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class SoftcapLlama(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[override]
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0  # a softcap, as Gemma 2 applies
        return out


def test_head_support_refuses_with_reasons() -> None:
    model = tiny_llama()
    assert head_support(model) == (True, "")
    model.lm_head = ScaledLinear(HIDDEN, VOCAB, bias=False)
    ok, reason = head_support(model)
    assert not ok and "not an nn.Linear" in reason and "ScaledLinear" in reason, reason

    ok, reason = head_support(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert not ok and "not a HuggingFace transformers model" in reason, reason

    ok, reason = head_support(SoftcapLlama(tiny_llama().config))
    assert not ok and "softcap" in reason, reason

    model = tiny_llama()
    model.lm_head.register_forward_hook(lambda *a: None)
    ok, reason = head_support(model)
    assert not ok and "hooks" in reason, reason


def test_gemma2_softcapping_is_refused() -> None:
    config = transformers.Gemma2Config(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
    )
    assert config.final_logit_softcapping is not None
    ok, reason = head_support(transformers.Gemma2ForCausalLM(config))
    assert not ok and "softcapping" in reason, reason
    with pytest.raises(ValueError, match="softcapping"):
        tile_head(transformers.Gemma2ForCausalLM(config))


def test_tile_head_errors() -> None:
    model = tiny_llama()
    for bad in (0, "x", -1):
        with pytest.raises(ValueError, match="chunk_tokens"):
            tile_head(model, bad)  # type: ignore[arg-type]
    assert "forward" not in model.__dict__
    tiled = tile_head(model)
    assert tiled.wrapper.chunk == default_head_chunk(VOCAB)
    with pytest.raises(ValueError, match="tiled head already"):
        tile_head(model, 16)
    tiled.remove()
    tiled.remove()  # idempotent
    model.forward = lambda *a, **k: None
    with pytest.raises(ValueError, match="set on the instance by other code"):
        tile_head(model, 16)
    del model.forward
    with pytest.raises(ValueError, match="cannot tile"):
        tile_head(torch.nn.Linear(3, 3))


def test_bad_chunk_callable_and_a_head_changed_after_install() -> None:
    model, ids = tiny_llama(), token_ids()
    with tile_head(model, lambda b, t: -5):
        with pytest.raises(ValueError, match="chunk callable"):
            model(input_ids=ids, labels=ids)
    with tile_head(model, 16):
        model.lm_head = ScaledLinear(HIDDEN, VOCAB, bias=False)
        with pytest.raises(RuntimeError, match="changed after tile_head"):
            model(input_ids=ids, labels=ids)


def test_signature_is_the_original() -> None:
    model = tiny_llama()
    before = inspect.signature(model.forward)
    with tile_head(model, 16):
        assert isinstance(model.forward, TiledCausalLMForward)
        assert inspect.signature(model.forward) == before, "Trainer and generate read this signature"
