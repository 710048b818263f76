"""The model matrix (issue 48): HF causal-LM families x attention x ``use_cache`` x how the context
is made, each cell bitwise against the plain run on the CPU.

Why. Nearly every pretrained HF config sets ``use_cache=True``, and a layer recomputed against the
KV cache it was given (the probe's checkpointed layers, a plan's RECOMPUTE layers, selective
recompute) appended its keys a second time: eager attention raised on the doubled keys, SDPA
survived by luck, and the user's cache kept the doubled keys. A cell passes when, over 5 steps
(the probe steps included), the loss and every gradient equal plain's bit for bit, the cache the
model returns holds what plain's holds, a cache the caller passes comes back as the same object,
and the mask and ids the caller passed are left untouched.

The cells: every family in :data:`FAMILIES` (the issue's list), attention ``eager`` and ``sdpa``
(where the family has SDPA), ``use_cache`` True and False, and four ways to make the context
(:data:`MODES`); and the families of :data:`MORE_FAMILIES` (their layers reach the cache in their
own ways) in the cells the bug was in. A test id reads ``family-attention-cache-mode``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Optional

import pytest
import torch

import offload
from offload.forwards.stateful import StatefulArgumentError
from offload.layers import model_form

transformers = pytest.importorskip("transformers")

BATCH, LENGTH, VOCAB, STEPS = 2, 20, 96, 5
PAD = 3  # the second row's first tokens are padding: the mask matters

# A tiny decoder: 2 layers, hidden 32, GQA where the family has it.
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
_NO_GQA = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}


def _config(name: str, **extra: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, name)(**extra)


# family -> (config factory, has SDPA). Each family's own quirks in its config: Gemma 2's
# softcapping and sliding window (shorter than the sequence, so the sliding layers' caches trim),
# Mistral's sliding window, the MoEs' routers.
FAMILIES: dict[str, tuple[Callable[[], Any], bool]] = {
    "llama": (_config("LlamaConfig", **_COMMON), True),
    "mistral": (_config("MistralConfig", **_COMMON, sliding_window=8), True),
    "qwen2": (_config("Qwen2Config", **_COMMON), True),
    "gemma2": (_config("Gemma2Config", **_COMMON, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0), False),
    "phi3": (_config("Phi3Config", **_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2), True),
    "gpt_neox": (_config("GPTNeoXConfig", **_NO_GQA), True),
    "gpt2": (_config("GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                     bos_token_id=1, eos_token_id=2), True),
    "mixtral": (_config("MixtralConfig", **_COMMON, num_local_experts=4, num_experts_per_tok=2), True),
    "qwen2_moe": (_config("Qwen2MoeConfig", **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32), True),
}
# More families whose layers reach the cache in their own ways (a hybrid sliding/global cache,
# ALiBi, multi-query with fused keys and values, learned positions, q/k norms): the cells the bug
# was in (a cache, eager attention) only, to keep the matrix fast.
MORE_FAMILIES: dict[str, tuple[Callable[[], Any], bool]] = {
    "gemma3": (_config("Gemma3TextConfig", **_COMMON, head_dim=16, sliding_window=8), True),
    "qwen3": (_config("Qwen3Config", **_COMMON, head_dim=16), True),
    "falcon": (_config("FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       alibi=True, multi_query=True, parallel_attn=False), True),
    "gpt_bigcode": (_config("GPTBigCodeConfig", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                            multi_query=True, bos_token_id=1, eos_token_id=2), True),
    "bloom": (_config("BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2, bos_token_id=1,
                      eos_token_id=2), False),
    "opt": (_config("OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                    max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2), True),
}
ATTENTIONS = ("eager", "sdpa")
CACHES = (True, False)
# fixed: the fixed schedule (nothing recomputed); lowest: the probe steps (the calibration step
# recomputes a layer), then the lowest plan; budget: a byte budget of 60% of the plain step's saved
# bytes and little host room (a mix: recompute and keep); model: the model form (a short probe
# first, each step planned at the model's entry).
MODES = ("fixed", "lowest", "budget", "model")


def _cells() -> list[Any]:
    out = []
    for family, (_, sdpa) in {**FAMILIES, **MORE_FAMILIES}.items():
        more = family in MORE_FAMILIES
        for attention in ATTENTIONS[:1] if more else ATTENTIONS:
            if attention == "sdpa" and not sdpa:
                continue  # transformers itself refuses it
            for cache in CACHES[:1] if more else CACHES:
                for mode in MODES:
                    out.append(pytest.param(family, attention, cache, mode,
                                            id=f"{family}-{attention}-{'cache' if cache else 'nocache'}-{mode}"))
    return out


def layers_of(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder layers of a HF causal LM, wherever its family keeps them."""
    base = getattr(model, model.base_model_prefix)
    for owner in (base, getattr(base, "decoder", None)):  # (OPT: model.decoder.layers)
        for name in ("layers", "h", "blocks"):
            found = getattr(owner, name, None)
            if isinstance(found, torch.nn.ModuleList):
                return found
    raise AssertionError(f"{type(model).__name__}: no decoder layers found")


def _cache_name(model: torch.nn.Module) -> str:
    # transformers 5.x renames past_key_values to cache (the old name deprecated).
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The cache a model output carries (None without one)."""
    for name in ("cache", "past_key_values"):
        value = out.get(name) if hasattr(out, "get") else None
        if value is not None:
            return value
    return None


def cache_contents(cache: Any) -> list[tuple[str, Any]]:
    """What a cache holds, as (path, value) pairs: tensors (cloned) and plain values, read
    through its attributes, lists and per-layer objects (the form of it does not matter)."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            out.append((path, value.detach().clone()))
        elif isinstance(value, (bool, int, float, str, type(None))):
            out.append((path, value))
        elif depth < 6 and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, (list, tuple)):
                out.append((path + ".len", len(value)))
                for i, item in enumerate(value):
                    walk(item, f"{path}[{i}]", depth + 1)
            elif isinstance(value, dict):
                for key in sorted(value, key=str):
                    walk(value[key], f"{path}[{key!r}]", depth + 1)
            elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.device)):
                for key in sorted(vars(value)):
                    if key not in ("prefetch_stream",):
                        walk(vars(value)[key], f"{path}.{key}", depth + 1)

    walk(cache, "cache", 0)
    return out


def assert_same_contents(expected: list[tuple[str, Any]], got: list[tuple[str, Any]], what: str) -> None:
    """Two :func:`cache_contents` equal: the same paths, tensors bitwise, values equal."""
    assert [p for p, _ in expected] == [p for p, _ in got], f"{what}: the cache's layout differs from plain's"
    for (path, a), (_, b) in zip(expected, got):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape, f"{what}: {path} has shape {tuple(b.shape)}, plain's {tuple(a.shape)}"
            assert torch.equal(a, b), f"{what}: {path} differs from plain's"
        else:
            assert a == b, f"{what}: {path} is {b!r}, plain's {a!r}"


@dataclasses.dataclass
class Step:
    """One step's result: the loss, every gradient (by parameter name), the returned cache."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    cache: Optional[list[tuple[str, Any]]]


def batch(step: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s ids, mask (left padding in the second row) and labels, on ``device``."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def run_step(model: torch.nn.Module, step: int, context: Any = None) -> Step:
    """A training step (forward in ``context``, backward outside), checking on the way that the
    caller's ids, mask and labels are left untouched and a cache the caller passes (even steps of
    a cache model: the first, probe steps included) comes back as the same object."""
    ids, mask, labels = batch(step, model.device)
    given = [(t, t.clone(), t._version) for t in (ids, mask, labels)]
    kwargs: dict[str, Any] = {}
    passed = None
    if model.config.use_cache and step % 2 == 0:
        passed = transformers.DynamicCache(config=model.config)
        kwargs[_cache_name(model)] = passed
    model.zero_grad(set_to_none=True)
    torch.manual_seed(step)  # the same dropout, router noise, ... in every run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with context if context is not None else torch.enable_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
        out.loss.backward()
    for i, (t, copy_, version) in enumerate(given):
        what = ("input_ids", "attention_mask", "labels")[i]
        assert t._version == version and torch.equal(t, copy_), f"the caller's {what} was changed"
    cache = returned_cache(out)
    if passed is not None:
        assert cache is passed, "the model returned another cache object than the one passed in"
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return Step(out.loss.detach().clone(), grads, cache_contents(cache) if cache is not None else None)


def assert_step_equal(expected: Step, got: Step, what: str) -> None:
    """Loss, gradients and returned cache bitwise equal."""
    assert torch.equal(expected.loss, got.loss), f"{what}: loss {got.loss.item()!r}, plain's {expected.loss.item()!r}"
    assert expected.grads.keys() == got.grads.keys(), f"{what}: other parameters got gradients than in plain"
    for name, grad in expected.grads.items():
        if not torch.equal(grad, got.grads[name]):
            diff = (grad - got.grads[name]).abs().max().item()
            raise AssertionError(f"{what}: the gradient of {name} differs from plain's (max abs diff {diff})")
    assert (expected.cache is None) == (got.cache is None), f"{what}: a cache returned in one run only"
    if expected.cache is not None:
        assert_same_contents(expected.cache, got.cache, what)


@dataclasses.dataclass
class Reference:
    """A family's model (weights fixed) and its plain steps, shared by its cells."""

    model: torch.nn.Module
    steps: list[Step]
    saved_bytes: int


def _saved_bytes(model: torch.nn.Module) -> int:
    # What the plain step's layers save for backward (each storage once, parameters left out):
    # what a byte budget is a fraction of.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    layers = layers_of(model)
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params and ptr not in seen:
            seen.add(ptr)
            counted.append(t.untyped_storage().nbytes())
        return t

    counted: list[int] = []
    handles = [layers[0].register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
               layers[-1].register_forward_hook(lambda *a: inside.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ids, mask, labels = batch(0, model.device)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return sum(counted)


@functools.lru_cache(maxsize=None)
def reference(family: str, attention: str, use_cache: bool, device: str = "cpu") -> Reference:
    """The plain run of a family on ``device`` (weights made on the CPU), once its first step is
    seen to repeat bit for bit."""
    config = {**FAMILIES, **MORE_FAMILIES}[family][0]()
    config.use_cache = use_cache
    config._attn_implementation = attention
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.to(device).train()
    steps = [run_step(model, i) for i in range(STEPS)]
    assert_step_equal(steps[0], run_step(model, 0), "the plain run against itself")
    return Reference(model, steps, _saved_bytes(model))


def make_context(mode: str, model: torch.nn.Module, saved_bytes: int, device: str = "cpu") -> offload.OffloadActivations:
    """The context of one mode (see :data:`MODES`); every tensor is offloadable (the default's
    64 KiB floor would leave a tiny model's plans nothing to offload or recompute for)."""
    layers = layers_of(model)
    options: dict[str, Any] = dict(device=device, min_offload_bytes=0)
    if mode == "fixed":
        return offload.OffloadActivations(layers, num_offload_layers=1, **options)
    if mode == "lowest":
        return offload.OffloadActivations(layers, memory_budget_bytes="lowest", **options)
    if mode == "budget":
        # With room on the host for a few layer inputs only, the plan recomputes layer 0 (its
        # planned steps run it checkpointed against the cache) and keeps layer 1.
        return offload.OffloadActivations(layers, memory_budget_bytes=saved_bytes * 6 // 10, host_budget_bytes=16 << 10,
                                          **options)
    return offload.OffloadActivations(layers, model=model, memory_budget_bytes="lowest", **options)


@pytest.fixture(autouse=True, scope="module")
def _deterministic_one_thread() -> Any:
    # One intra-op thread: a tiny model's ops gain nothing from two, and on a busy 2-core box
    # the second thread's spinning made the matrix 10x slower (460 s against 45 s).
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("family,attention,use_cache,mode", _cells())
def test_cell_is_plain_bit_for_bit(family: str, attention: str, use_cache: bool, mode: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The model form probes a first batch of more than twice this many tokens at this many first
    # (a whole step run on a cut call, the caller's cache included): 40 tokens, probed at 16.
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", BATCH * LENGTH // 2 - 4)
    ref = reference(family, attention, use_cache)
    model = copy.deepcopy(ref.model)
    context = make_context(mode, model, ref.saved_bytes)
    try:
        for i, expected in enumerate(ref.steps):
            assert_step_equal(expected, run_step(model, i, context), f"step {i}")
        if mode == "budget":  # the planned steps ran a layer recomputed, beside a kept one
            actions = {lp.action.value for lp in context.plan.layers}
            assert "recompute" in actions and len(actions) > 1, context.plan.describe()
    finally:
        context.close()


@pytest.mark.parametrize("mode", ["lowest", "budget", "model"])
def test_a_cache_written_in_place_is_refused_at_the_first_step_that_recomputes(mode: str) -> None:
    # transformers' StaticCache writes into preallocated tensors: a recomputed layer cannot run
    # again against it without copying it whole. A planned mode refuses it in the forward of the
    # first step that checkpoints a layer, before the second run: on CUDA the first step (the
    # low-memory sizing probe), on the CPU the second (its first is a plain warm-up, run as plain
    # runs it). The error names the layer, the argument and the fix.
    ref = reference("llama", "eager", True)
    model = copy.deepcopy(ref.model)
    context = make_context(mode, model, ref.saved_bytes)
    raised: Optional[tuple[int, StatefulArgumentError]] = None
    try:
        for i in range(2):
            ids, mask, labels = batch(i)
            cache = transformers.StaticCache(config=model.config, max_cache_len=LENGTH)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with context:
                        out = model(input_ids=ids, attention_mask=mask, labels=labels, **{_cache_name(model): cache})
                    out.loss.backward()
            except StatefulArgumentError as exc:
                raised = (i, exc)
                break
        assert raised is not None, "a cache written in place was not refused"
        assert raised[0] == 1, f"refused at step {raised[0]}, not at the first that recomputes"
        message = str(raised[1])
        assert "LlamaDecoderLayer" in message and "StaticCache" in message and "use_cache=False" in message, message
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "hooks left behind"
        # The same context then runs the user's next steps without a cache, bitwise.
        model.config.use_cache = False
        for i in (2, 3):
            expected = reference("llama", "eager", False).steps[i]
            assert_step_equal(expected, run_step(model, i, context), f"step {i}, after the refusal")
    finally:
        context.close()


def test_selective_recompute_of_an_attention_that_reads_the_cache_is_plain_bit_for_bit() -> None:
    # A user's selective recompute around the attention (the module that updates the cache):
    # its recompute too runs against the cache as the forward found it.
    ref = reference("llama", "eager", True)
    model = copy.deepcopy(ref.model)
    with offload.selective_recompute([layer.self_attn for layer in layers_of(model)]):
        for i in range(2):
            assert_step_equal(ref.steps[i], run_step(model, i), f"step {i}")
