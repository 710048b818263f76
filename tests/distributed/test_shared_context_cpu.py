"""One offload context serves one forward at a time. What it cannot serve raises, saying what was
wrong and what to do: two threads running forwards through it at once, a second forward started
inside the first's ``with``, two micro-batch streams interleaved layer by layer inside one
``with``, and the ``with`` entered inside itself. What it can serve works bitwise: forwards one
after another with their backwards later (micro-batches of a pipeline, or two models)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

import offload
from offload.models import run_layers

from _util import assert_bitwise, cpu_context, hooks_installed, make_mlp_layers, oa_step


@pytest.fixture
def mlp() -> tuple[torch.nn.ModuleList, torch.Tensor, torch.Tensor]:
    layers = make_mlp_layers(4, width=64)
    torch.manual_seed(1)
    return layers, torch.randn(16, 64), torch.randn(16, 64)


def oa_for(layers: torch.nn.ModuleList) -> offload.OffloadActivations:
    return offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)


def in_thread(fn: Any) -> BaseException:
    """Run ``fn`` in a new thread; the exception it raised (the test expects one)."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the second thread hung"
    assert raised, "the second thread's forward through the busy context did not raise"
    return raised[0]


def test_offload_activations_refuses_a_forward_from_another_thread_while_busy(mlp) -> None:
    layers, x, y = mlp
    expected = oa_step(layers, x, contextlib.nullcontext())
    oa = oa_for(layers)
    layers.zero_grad(set_to_none=True)
    xin = x.detach().requires_grad_(True)
    with oa:
        h = run_layers(layers[:2], xin)
        error = in_thread(lambda: oa.__enter__())
        assert "another thread" in str(error) and "its own OffloadActivations" in str(error), error
        out = run_layers(layers[2:], h)
    (out.float() ** 2).mean().backward()
    assert_bitwise(expected, [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()])
    assert not hooks_installed()


def test_a_layer_context_entered_from_another_thread_mid_forward_raises(mlp) -> None:
    layers, x, y = mlp
    ctx, sync = cpu_context(3, 4)
    xin = x.detach().requires_grad_(True)
    h = run_layers(layers[:2], xin, ctx, sync)

    def other() -> None:
        with ctx:
            layers[0](y)

    error = in_thread(other)
    assert "another thread" in str(error) and "get_cpu_offload_context" in str(error), error
    out = run_layers(layers[2:], h, ctx, sync)  # the first thread's forward goes on unharmed
    (out ** 2).mean().backward()
    assert ctx.stats["finished"] and ctx.stats["offloaded_tensors"] > 0


@pytest.mark.parametrize("how", ["second forward", "interleaved streams"])
def test_a_second_forward_inside_one_with_raises_and_leaves_nothing_behind(mlp, how: str) -> None:
    layers, x, y = mlp
    oa = oa_for(layers)
    a, b = x.detach().requires_grad_(True), y.detach().requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"called again as layer \d+.*once per forward.*its own OffloadActivations"):
        with oa:
            if how == "second forward":
                run_layers(layers, a)
                run_layers(layers, b)
            else:
                for layer in layers:
                    a, b = layer(a), layer(b)
    assert not hooks_installed() and not oa.active
    # The context is usable again: the next step is the plain one, bit for bit.
    expected = oa_step(layers, x, contextlib.nullcontext())
    assert_bitwise(expected, oa_step(layers, x, oa))


def test_entering_the_same_with_inside_itself_says_to_enter_once_per_forward(mlp) -> None:
    layers, x, _ = mlp
    oa = oa_for(layers)
    with pytest.raises(RuntimeError, match="does not nest.*once per forward"):
        with oa:
            with oa:
                pass
    assert not hooks_installed()


def test_weight_shared_layers_listed_once_per_call_are_not_a_second_forward(mlp) -> None:
    layers, x, _ = mlp
    shared = torch.nn.ModuleList([layers[0], layers[1], layers[0], layers[1]])
    expected = oa_step(shared, x, contextlib.nullcontext())
    oa = oa_for(list(shared))
    for _ in range(2):
        assert_bitwise(expected, oa_step(shared, x, oa))
    assert oa.stats["offloaded_tensors"] > 0


def test_two_models_sharing_one_layer_context_one_forward_after_the_other_are_bitwise() -> None:
    """Supported: TransformerEngine's context over two models whose forwards run one after the
    other (two steps in flight), with their backwards later."""
    first, second = make_mlp_layers(4, width=64, seed=1), make_mlp_layers(4, width=64, seed=2)
    params = list(first.parameters()) + list(second.parameters())
    torch.manual_seed(5)
    xa, xb = torch.randn(8, 64), torch.randn(8, 64)

    def run(ctx: Any = None, sync: Any = None) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        a, b = xa.detach().requires_grad_(True), xb.detach().requires_grad_(True)
        la = (run_layers(first, a, ctx, sync) ** 2).mean()
        lb = (run_layers(second, b, ctx, sync) ** 2).mean()
        la.backward()
        lb.backward()
        return [p.grad.clone() for p in params] + [a.grad, b.grad]

    expected = run()
    assert_bitwise(expected, run())
    ctx, sync = cpu_context(3, 4)
    for _ in range(2):
        assert_bitwise(expected, run(ctx, sync))
    assert ctx.stats["offloaded_tensors"] > 0 and ctx.stats["reloads_on_demand"] == 0
