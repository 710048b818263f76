"""The short probe is invisible (issue 49, items 2, 3, 5 and 6): under
``OffloadActivations(layers, model=model)`` a long first batch is probed on the same call cut
short, two or three whole steps inside the user's own call. Nothing the user can observe may
change: every hook count, every weight an optimizer-in-backward updates, the ``.grad`` of a leaf
``inputs_embeds`` and of a trainable tensor outside the model, the random state and the buffers
are bit for bit the plain step's. Where that cannot be promised (forward hooks, an argument it
cannot cut) the batch is probed at its full length, with a warning; every input layout HF passes
is cut; and a short probe that fails says so, with the option that turns it off."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch

import offload
from offload.layers import model_form, short_probe
from offload.planner.shapes import StepShape

transformers = pytest.importorskip("transformers")

BATCH, LENGTH, HIDDEN, VOCAB = 2, 48, 64, 128
CUT = (BATCH, 8)  # the profile's shape: SHORT_PROBE_TOKENS (16) over the batch


@pytest.fixture(autouse=True)
def short_probe_at_16_tokens(monkeypatch):
    # 96 tokens a batch is "long": more than twice 16.
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", 16)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def tiny_llama(seed: int = 0, device: str = "cpu"):
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def context(model, **kw: Any) -> offload.OffloadActivations:
    device = next(model.parameters()).device
    budget = {"memory_budget_bytes": 1 << 40} if device.type == "cpu" else {}  # "device" on CUDA
    return offload.OffloadActivations(model.model.layers, model=model, device=device, min_offload_bytes=0,
                                      **budget, **kw)


def ids(seed: int = 1, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed)).to(device)


# --- every observable, against the plain step -----------------------------------------------------

class Watched:
    """A model with everything a user may watch: an optimizer in backward (SGD in each
    parameter's post-accumulate-grad hook), parameter tensor hooks, hooks on the parameters'
    gradient accumulators (DDP's and DeepSpeed's kind), module backward hooks, a
    trainable scale outside the model (its graph built by the caller), a leaf ``inputs_embeds``,
    and optionally a forward hook. Two instances with the same seed start the same."""

    def __init__(self, forward_hook: bool = False, device: str = "cpu") -> None:
        self.device = device
        self.model = tiny_llama(device=device)
        self.calls = {"post_accumulate": 0, "tensor": 0, "accumulator": 0, "backward": 0, "backward_pre": 0,
                      "forward": 0}
        # Hooks on the gradient accumulators (as DDP's reducer and DeepSpeed set them): held here,
        # since a parameter holds its accumulator weakly.
        self.accumulators = []
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._sgd)
            p.register_hook(self._count("tensor"))
            self.accumulators.append(p.view_as(p).grad_fn.next_functions[0][0])
            self.accumulators[-1].register_hook(self._count("accumulator"))
        self.model.model.layers[0].register_full_backward_hook(self._count("backward"))
        self.model.model.layers[1].mlp.register_full_backward_pre_hook(self._count("backward_pre"))
        if forward_hook:
            self.model.model.layers[1].register_forward_hook(self._count("forward"))
        torch.manual_seed(2)
        self.scale = torch.randn(HIDDEN).to(device).requires_grad_(True)
        self.leaf = torch.randn(BATCH, LENGTH, HIDDEN).to(device).requires_grad_(True)

    def _sgd(self, p: torch.Tensor) -> None:
        self.calls["post_accumulate"] += 1
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    def _count(self, name: str):
        def hook(*args: Any) -> None:
            self.calls[name] += 1
        return hook

    def step(self, how: str, ctx: Optional[offload.OffloadActivations]) -> torch.Tensor:
        tokens = ids(device=self.device)
        with ctx if ctx is not None else _nothing():
            if how == "caller_graph":
                embeds = self.model.model.embed_tokens(tokens) * self.scale
                loss = self.model(inputs_embeds=embeds, labels=tokens).loss
            elif how == "leaf":
                loss = self.model(inputs_embeds=self.leaf, labels=tokens).loss
            else:
                loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss.detach()

    def observed(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "weights": [p.detach().clone() for p in self.model.parameters()],
            "grads": [p.grad for p in self.model.parameters()],
            "scale.grad": self.scale.grad, "leaf.grad": self.leaf.grad,
            "buffers": [b.clone() for b in self.model.buffers()],
            "rng": torch.get_rng_state(),
            "cuda rng": torch.cuda.get_rng_state() if self.device != "cpu" else None,
        }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def assert_same(plain: dict[str, Any], got: dict[str, Any], when: str) -> None:
    assert got["calls"] == plain["calls"], f"{when}: hook calls {got['calls']}, plain {plain['calls']}"
    for key in ("weights", "grads", "buffers"):
        for i, (a, b) in enumerate(zip(plain[key], got[key])):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{when}: {key}[{i}] differs"
    for key in ("scale.grad", "leaf.grad", "rng", "cuda rng"):
        a, b = plain[key], got[key]
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{when}: {key} differs"


def run_watched(how: str, forward_hook: bool, steps: int = 2, device: str = "cpu"):
    plain, again, probed = (Watched(forward_hook, device) for _ in range(3))
    ctx = context(probed.model)
    out = []
    for i in range(steps):
        a, b = plain.step(how, None), again.step(how, None)
        assert torch.equal(a, b), "the plain step does not repeat itself"
        assert_same(plain.observed(), again.observed(), f"plain step {i}")
        got = probed.step(how, ctx)
        out.append((a, got, plain.observed(), probed.observed()))
    return ctx, out


@pytest.mark.parametrize("how", ["ids", "caller_graph", "leaf"])
def test_the_short_probe_changes_nothing_the_user_can_observe(how: str) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*probed at its full length")  # probed short
        ctx, steps = run_watched(how, forward_hook=False)
    assert ctx._planned.profile.shape == CUT, "the first batch was not probed short"
    for i, (want, got, plain, probed) in enumerate(steps):
        assert torch.equal(want, got), f"step {i}: loss {got} against plain {want}"
        assert_same(plain, probed, f"step {i}")
    # The hooks were really there, each fired in the plain steps.
    calls = steps[-1][2]["calls"]
    assert all(calls[name] > 0 for name in ("post_accumulate", "tensor", "accumulator", "backward", "backward_pre")), \
        calls


def test_forward_hooks_send_the_first_batch_to_a_full_length_probe_unchanged() -> None:
    with pytest.warns(UserWarning, match=r"probed at its full length.*forward hook"):
        ctx, steps = run_watched("caller_graph", forward_hook=True)
    assert ctx._planned.profile is None or ctx._planned.profile.shape != CUT
    for i, (want, got, plain, probed) in enumerate(steps):
        assert torch.equal(want, got)
        assert_same(plain, probed, f"step {i}")
    assert steps[-1][3]["calls"]["forward"] == 2


def test_an_observer_hook_is_run_by_the_short_probe_and_sees_its_calls() -> None:
    # A hook marked offload_probe_observer computes nothing (a progress line, a timer): the batch
    # is probed short, the hook sees the probe steps' layer calls too, the step is exact.
    model, plain = tiny_llama(), tiny_llama()
    calls: list[int] = []

    def observer(module: torch.nn.Module, args: Any) -> None:
        calls.append(args[0].shape[1])

    observer.offload_probe_observer = True  # type: ignore[attr-defined]
    model.model.layers[0].register_forward_pre_hook(observer)
    ctx = context(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*probed at its full length")
        with ctx:
            loss = model(input_ids=ids(), labels=ids()).loss
        loss.backward()
    plain(input_ids=ids(), labels=ids()).loss.backward()
    assert ctx._planned.profile.shape == CUT, "the first batch was not probed short"
    assert calls[-1] == LENGTH and CUT[1] in calls[:-1], f"the observer saw lengths {calls}"
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_short_probe_false_probes_at_full_length_without_a_warning() -> None:
    model = tiny_llama()
    ctx = context(model, short_probe=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*probed at its full length")
        with ctx:
            model(input_ids=ids(), labels=ids()).loss.backward()
    assert ctx._planned.profile is None or ctx._planned.profile.shape != CUT
    with pytest.raises(TypeError, match="short_probe"):
        context(model, short_probe="no")


# --- the inputs HF passes are cut ------------------------------------------------------------------

def _layouts() -> dict[str, dict[str, torch.Tensor]]:
    causal = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool))
    padded = torch.ones(BATCH, LENGTH, dtype=torch.long)
    padded[1, :5] = 0  # left padding
    labels = ids().clone()
    labels[:, :3] = -100
    return {
        "position_ids (1, T)": {"position_ids": torch.arange(LENGTH)[None]},
        "position_ids (B, T)": {"position_ids": torch.arange(LENGTH)[None].expand(BATCH, LENGTH)},
        "attention_mask (B, T)": {"attention_mask": padded},
        "attention_mask (B, 1, T, T) bool": {"attention_mask": causal[None, None].expand(BATCH, 1, LENGTH, LENGTH)},
        "attention_mask (B, 1, T, T) additive": {
            "attention_mask": torch.zeros(BATCH, 1, LENGTH, LENGTH).masked_fill(~causal, float("-inf"))},
        "cache_position (T,)": {"cache_position": torch.arange(LENGTH)},
        "labels with ignored tokens": {"labels": labels},
        "all at once": {"position_ids": torch.arange(LENGTH)[None], "attention_mask": padded,
                        "cache_position": torch.arange(LENGTH), "labels": labels},
    }


def _step(model, ctx, extra: dict[str, torch.Tensor]):
    model.zero_grad(set_to_none=True)
    call = {"input_ids": ids(), "labels": ids(), **extra}
    with ctx if ctx is not None else _nothing():
        loss = model(**call).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layout", list(_layouts()))
def test_every_input_layout_is_cut(layout: str) -> None:
    extra = _layouts()[layout]
    model = tiny_llama()
    want = _step(model, None, extra)
    ctx = context(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*probed at its full length")
        got = _step(model, ctx, extra)
    assert ctx._planned.profile.shape == CUT, f"{layout}: not probed short"
    assert torch.equal(want[0], got[0]) and all(torch.equal(a, b) for a, b in zip(want[1], got[1])), layout


def test_cut_dims_knows_each_layout_and_refuses_the_rest() -> None:
    shape = StepShape(BATCH, LENGTH)
    cases = {
        (BATCH, LENGTH): (1,), (1, LENGTH): (1,), (BATCH, LENGTH, HIDDEN): (1,), (LENGTH,): (0,),
        (BATCH, 1, LENGTH, LENGTH): (2, 3), (1, 1, LENGTH, LENGTH): (2, 3), (3, BATCH, LENGTH): (2,),
        (BATCH, LENGTH, LENGTH): (1,),  # inputs_embeds whose width is the length: its features stay
        (BATCH, 7): (), (): (), (LENGTH, 3): None, (BATCH, 1, LENGTH, 5): None,
    }
    for dims, want in cases.items():
        assert short_probe.cut_dims(torch.empty(dims), shape) == want, dims


def test_an_argument_the_probe_cannot_leave_unchanged_gets_a_full_length_probe() -> None:
    model = tiny_llama()
    cache = transformers.DynamicCache()
    ctx = context(model)
    with pytest.warns(UserWarning, match=r"probed at its full length.*DynamicCache"):
        with ctx:
            model(input_ids=ids(), labels=ids(), cache=cache, use_cache=True).loss.backward()


def test_a_failing_short_probe_says_so_and_how_to_turn_it_off(monkeypatch) -> None:
    # As before this fix: position_ids (1, T) left uncut, so the cut call fails in its rotary.
    cut = short_probe.cut_dims
    monkeypatch.setattr(short_probe, "cut_dims", lambda v, s: () if tuple(v.shape) == (1, s.length) else cut(v, s))
    extra = {"position_ids": torch.arange(LENGTH)[None]}
    model = tiny_llama()
    want = _step(model, None, extra)
    with pytest.raises(RuntimeError) as caught:
        _step(model, context(model), extra)
    text = str(caught.value)
    assert "short probe" in text and "short_probe=False" in text, text
    assert "runs on its own" not in text, text
    got = _step(model, context(model, short_probe=False), extra)
    assert torch.equal(want[0], got[0]) and all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
