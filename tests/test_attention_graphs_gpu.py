"""A new length's cuDNN attention backward built ahead, on cuDNN itself
(``offload.layers.attention_graphs``): the copy's backward node runs on the very thread that runs
the real backward's nodes (autograd's device thread, where torch caches cuDNN's backward plans
per thread); the copy changes no result, with its stream held back by ``torch.cuda._sleep`` so
that a missing order would show; and its bytes are gone by the last layer.

    python -m pytest -q tests/test_attention_graphs_gpu.py
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch

import offload
from offload.layers import attention_graphs
from offload.layers.attention_graphs import AttentionGraphs

from _util import assert_bitwise

pytestmark = pytest.mark.cuda

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def llama(layers: int = 3) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=HEADS * HEAD_DIM, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=1000,
        max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def ids(length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 1000, (2, length), device="cuda", generator=g)


def need_cudnn(length: int) -> None:
    q = torch.empty(2, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, scale=None, enable_gqa=True)
    if int(choice) != int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION.value):
        pytest.skip(f"SDPA chooses backend {int(choice)} here, not cuDNN: no plan is built per shape")


def step(model: Any, tokens: torch.Tensor, ctx: Any, delay: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """One training step under ``ctx``; the loss, the gradients and the loss's grad_fn."""
    model.zero_grad(set_to_none=True)
    if delay:
        torch.cuda._sleep(delay)  # the stream held back: the CPU runs far ahead of it
    with ctx:
        loss = model(input_ids=tokens, labels=tokens).loss
    node = loss.grad_fn
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], node


def context(model: Any, enabled: bool, offloaded: int = 2) -> Any:
    ctx = offload.OffloadActivations(model.model.layers, num_offload_layers=offloaded)
    assert ctx._attention.enabled  # on CUDA by default
    ctx._attention.enabled = enabled
    return ctx


def test_the_copy_backward_runs_where_the_real_backward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    need_cudnn(512)
    copy_threads: list[int] = []
    original = attention_graphs._run_backward

    def recording(output: torch.Tensor, failures: list) -> None:
        output.grad_fn.register_prehook(lambda grads: copy_threads.append(threading.get_ident()))
        original(output, failures)

    monkeypatch.setattr(attention_graphs, "_run_backward", recording)
    model = llama()
    ctx = context(model, True)
    real_threads: list[int] = []
    model.zero_grad(set_to_none=True)
    tokens = ids(512)
    with ctx:
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.grad_fn.register_prehook(lambda grads: real_threads.append(threading.get_ident()))
    loss.backward()
    torch.cuda.synchronize()
    assert ctx._attention.built == [(2, HEADS, 512, HEAD_DIM)]
    assert len(copy_threads) == 1 and len(real_threads) == 1
    # cuDNN's backward plans are cached per thread: the copy's must be built on the real backward's.
    assert copy_threads[0] == real_threads[0] != threading.get_ident()


def test_the_copy_changes_no_result_with_the_stream_held_back() -> None:
    need_cudnn(768)
    model = llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = ids(768)
    plain = []
    for _ in range(2):
        model.load_state_dict(state)
        plain.append(step(model, tokens, context(model, False), delay=200_000_000))
    model.load_state_dict(state)
    ctx = context(model, True)
    loss, grads, _ = step(model, tokens, ctx, delay=200_000_000)
    assert ctx._attention.built, "no copy ran"
    assert torch.equal(plain[0][0], loss)  # the forward: bit for bit
    repeats = all(torch.equal(a, b) for a, b in zip(plain[0][1], plain[1][1]))
    if repeats:
        assert_bitwise(plain[0][1], grads)
    else:
        # cuDNN's attention backward does not repeat itself bit for bit here; what lies after the
        # last attention in the backward (the head, the last layer's MLP and norms) does, and the
        # rest stays within what the plain step's own repeats differ by.
        names = [n for n, _ in model.named_parameters()]
        last = f"model.layers.{len(model.model.layers) - 1}."
        after = [i for i, n in enumerate(names) if n == "lm_head.weight" or n == "model.norm.weight" or
                 (n.startswith(last) and ("mlp" in n or "post_attention" in n))]
        assert after
        assert_bitwise([plain[0][1][i] for i in after], [grads[i] for i in after])
        for a, b, c in zip(plain[0][1], plain[1][1], grads):
            spread = (a.float() - b.float()).abs().max().item()
            assert (a.float() - c.float()).abs().max().item() <= 4 * spread + 1e-2 * a.float().abs().max().item()


def test_the_copy_bytes_are_gone_by_the_last_layer() -> None:
    need_cudnn(1024)
    model = llama()
    held: dict[bool, list[int]] = {True: [], False: []}
    after: dict[bool, int] = {}
    last = model.model.layers[-1]
    for enabled in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        ctx = context(model, enabled, offloaded=0)  # no copy in flight: the bytes held repeat exactly
        step(model, ids(256), ctx)  # every context sees 256 first, so 1024 is new to each
        handle = last.register_forward_pre_hook(lambda m, a: held[enabled].append(torch.cuda.memory_allocated()))
        try:
            step(model, ids(1024), ctx)
        finally:
            handle.remove()
        model.zero_grad(set_to_none=True)
        gc.collect()
        after[enabled] = torch.cuda.memory_allocated()
        assert ctx._attention.thread is None
        assert (len(ctx._attention.built) == 2) == enabled
    # Nothing of the copy outlives its step.
    assert after[True] == after[False]
    # The test's pre-hook runs after the context's (registered later), where it waits for the copy:
    # of the copy's inputs, output and gradients (over 4 query sizes) nothing is left there but a
    # few KiB (64.5 KiB on the H200, a statistics tensor's size: not explained).
    query_bytes = 2 * HEADS * 1024 * HEAD_DIM * 2
    extra = held[True][0] - held[False][0]
    assert 0 <= extra < query_bytes // 4, f"{extra} bytes more at the last layer with the copy"
