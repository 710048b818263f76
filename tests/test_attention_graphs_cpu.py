"""A new input shape's attention backward, run once more on another thread while the forward goes
on (``offload.layers.attention_graphs``). On the CPU no backend builds per shape, so these tests
say cuDNN is chosen (``_cudnn_chosen``) and check what the context does around the copy: which
calls it copies, that the copy changes no gradient and none of the engine's figures, that its
backward runs off the forward's thread and is over before the last layer, and that nothing stays
pushed. ``test_attention_graphs_gpu.py`` checks the rest on cuDNN itself."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.layers import attention_graphs
from offload.layers.attention_graphs import AttentionGraphs, attention_graphs_wanted

from _util import assert_bitwise, oa_step


class Attention(nn.Module):
    """A pre-norm-free attention block: q, k, v from one projection, causal SDPA, a residual."""

    def __init__(self, dim: int = 16, heads: int = 2, dropout: float = 0.0, mask: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.dropout, self.mask = heads, dropout, mask
        self.seen_thread: Optional[threading.Thread] = None  # set by a test's layer: the copy's thread then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, self.mask, dropout_p=self.dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


class LastLayer(Attention):
    """Records, as its forward begins (after every pre-hook), whether a copy's backward is still running."""

    def __init__(self, context_box: list, **kw: Any) -> None:
        super().__init__(**kw)
        self.context_box = context_box
        self.running: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_box:
            self.running.append(self.context_box[0]._attention.thread is not None)
        return super().forward(x)


def layers_and_input(length: int = 8, **kw: Any) -> tuple[nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    layers = nn.ModuleList([Attention(**kw) for _ in range(3)]).double()
    return layers, torch.randn(2, length, 16, dtype=torch.float64)


def context(layers: nn.ModuleList, chosen: bool = True) -> offload.OffloadActivations:
    """A CPU context that offloads every layer but the last, with the copies turned on."""
    ctx = offload.OffloadActivations(layers, num_offload_layers=len(layers) - 1, device="cpu", min_offload_bytes=0)
    ctx._attention = AttentionGraphs(True)
    return ctx


@pytest.fixture
def cudnn(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """Say cuDNN is chosen; record the thread each copy's backward ran its attention node on
    (autograd's device thread on CUDA; on the CPU, the thread that called the backward)."""
    monkeypatch.setattr(AttentionGraphs, "_cudnn_chosen", staticmethod(lambda call: True))
    threads: list[threading.Thread] = []
    original = attention_graphs._run_backward

    def recording(output: torch.Tensor, failures: list) -> None:
        output.grad_fn.register_prehook(lambda grads: threads.append(threading.current_thread()))
        original(output, failures)

    monkeypatch.setattr(attention_graphs, "_run_backward", recording)
    return threads


def test_wanted_on_cuda_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OFFLOAD_ATTENTION_GRAPHS", raising=False)
    assert attention_graphs_wanted(torch.device("cuda", 0))
    assert not attention_graphs_wanted(torch.device("cpu"))
    monkeypatch.setenv("OFFLOAD_ATTENTION_GRAPHS", "0")
    assert not attention_graphs_wanted(torch.device("cuda", 0))
    ctx = offload.OffloadActivations(nn.ModuleList([Attention(), Attention()]), device="cpu", min_offload_bytes=0)
    assert not ctx._attention.enabled  # a CPU context never copies


def test_a_new_shape_copies_its_first_attention_once_off_the_forward_thread(cudnn: list) -> None:
    layers, x = layers_and_input()
    ctx = context(layers)
    oa_step(layers, x, ctx)
    # One copy, of layer 0's first call (query: batch, heads, length, head size), its backward on another thread.
    assert ctx._attention.built == [(2, 2, 8, 8)]
    assert len(cudnn) == 1 and cudnn[0] is not threading.main_thread()
    oa_step(layers, x, ctx)  # the same shape: nothing more
    assert ctx._attention.built == [(2, 2, 8, 8)] and len(cudnn) == 1
    oa_step(layers, torch.randn(2, 12, 16, dtype=torch.float64), ctx)  # a new length: once more
    assert ctx._attention.built == [(2, 2, 8, 8), (2, 2, 12, 8)]
    assert torch._C._len_torch_function_stack() == 0


def test_the_copy_changes_no_gradient_and_no_figure_of_the_engine(cudnn: list) -> None:
    layers, x = layers_and_input()
    plain = [oa_step(layers, x, offload.OffloadActivations(layers, enabled=False)) for _ in range(2)]
    assert_bitwise(plain[0], plain[1])  # the plain step repeats itself
    without = context(layers)
    without._attention.enabled = False
    expected = oa_step(layers, x, without)
    ctx = context(layers)
    got = oa_step(layers, x, ctx)
    assert ctx._attention.built, "the copy did not run"
    assert_bitwise(plain[0], expected)
    assert_bitwise(expected, got)
    # The copy's saved tensors bypass the engine's hooks: the same tensors saved and offloaded.
    figures = ("offloaded_tensors", "offloaded_bytes", "kept_tensors", "bytes_d2h", "bytes_h2d")
    assert [without.stats[name] for name in figures] == [ctx.stats[name] for name in figures]
    assert ctx.stats["offloaded_tensors"] > 0


def test_the_copy_is_over_before_the_last_layer(cudnn: list) -> None:
    torch.manual_seed(0)
    box: list = []
    last = LastLayer(box)
    layers = nn.ModuleList([Attention(), Attention(), last]).double()
    ctx = context(layers)
    box.append(ctx)
    oa_step(layers, torch.randn(2, 8, 16, dtype=torch.float64), ctx)
    assert ctx._attention.built and last.running == [False]


@pytest.mark.parametrize("case", ["no grad", "dropout", "mask with grad", "not cuDNN"])
def test_no_copy_where_it_cannot_help_or_would_change_a_result(cudnn: list, monkeypatch: pytest.MonkeyPatch,
                                                              case: str) -> None:
    kw: dict[str, Any] = {}
    if case == "dropout":
        kw["dropout"] = 0.5
    if case == "mask with grad":
        kw["mask"] = torch.zeros(8, 8, dtype=torch.float64, requires_grad=True)
    if case == "not cuDNN":
        monkeypatch.setattr(AttentionGraphs, "_cudnn_chosen", staticmethod(lambda call: False))
    layers, x = layers_and_input(**kw)
    ctx = context(layers)
    if case == "no grad":
        with torch.no_grad(), ctx:
            for layer in layers:
                x = layer(x)
    else:
        oa_step(layers, x, ctx)
    assert ctx._attention.built == [] and cudnn == []
    assert torch._C._len_torch_function_stack() == 0


def test_a_failed_copy_warns_once_and_is_not_tried_again(cudnn: list, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(output: torch.Tensor, failures: list) -> None:
        failures.append(RuntimeError("no plan for this shape"))

    monkeypatch.setattr(attention_graphs, "_run_backward", failing)
    layers, x = layers_and_input()
    expected = oa_step(layers, x, offload.OffloadActivations(layers, enabled=False))
    ctx = context(layers)
    with pytest.warns(RuntimeWarning, match="attention backward ahead failed .*no plan for this shape"):
        got = oa_step(layers, x, ctx)
    assert_bitwise(expected, got)
    assert not ctx._attention.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        oa_step(layers, torch.randn(2, 12, 16, dtype=torch.float64), ctx)
    assert len(ctx._attention.built) == 1


def test_a_first_layer_that_raises_leaves_nothing_pushed(cudnn: list) -> None:
    class Failing(Attention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            super().forward(x)
            raise ValueError("bad batch")

    torch.manual_seed(0)
    layers = nn.ModuleList([Failing(), Attention()]).double()
    ctx = context(layers)
    with pytest.raises(ValueError, match="bad batch"):
        oa_step(layers, torch.randn(2, 8, 16, dtype=torch.float64), ctx)
    assert torch._C._len_torch_function_stack() == 0
    assert ctx._attention.thread is None and ctx._attention.watching is None


def test_the_copy_runs_outside_a_selective_checkpoint_that_keeps_attention(cudnn: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # A recomputed layer that keeps attention runs under torch's selective checkpoint, whose
    # cache would hold a copy run inside the layer until the layer's backward (T22's 8192 step
    # peaked 132 MiB higher so): the copy runs at the layer's exit, with no dispatch mode on.
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from offload.planner import Action, LayerPlan, plan_for
    from _util import make_gpt_layers, train_step

    modes: list[list[str]] = []
    zeros = attention_graphs._Layout.zeros
    monkeypatch.setattr(attention_graphs._Layout, "zeros", lambda self: modes.append(
        [type(m).__name__ for m in _get_current_dispatch_mode_stack()]) or zeros(self))
    torch.manual_seed(0)
    layers, x = make_gpt_layers(3, 32, 4), torch.randn(2, 16, 32)
    expected = oa_step(layers, x, offload.OffloadActivations(layers, enabled=False))
    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x), device="cpu", min_offload_bytes=0)
    kept = LayerPlan(Action.RECOMPUTE, keep_attention=True)
    plan = plan_for(profile, [kept, kept, LayerPlan(Action.KEEP)])
    ctx = offload.OffloadActivations(layers, plan=plan, device="cpu", min_offload_bytes=0)
    ctx._attention = AttentionGraphs(True)
    assert_bitwise(expected, oa_step(layers, x, ctx))
    assert ctx._attention.built and len(cudnn) == 1
    assert modes == [[], [], []]  # query, key and value made with no mode on


def test_an_expanded_key_is_copied_with_its_strides(cudnn: list, monkeypatch: pytest.MonkeyPatch) -> None:
    class Expanded(Attention):
        # One key and value head expanded over every query head (stride 0), as a GQA repeat may.
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            k, v = k[:, :1].expand_as(q), v[:, :1].expand_as(q)
            return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))

    layouts: list[tuple] = []
    zeros = attention_graphs._Layout.zeros
    monkeypatch.setattr(attention_graphs._Layout, "zeros",
                        lambda self: (lambda t: layouts.append((t.shape, t.stride())) or t)(zeros(self)))
    torch.manual_seed(0)
    layers = nn.ModuleList([Expanded(), Expanded()]).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    expected = oa_step(layers, x, offload.OffloadActivations(layers, enabled=False))
    ctx = context(layers)
    assert_bitwise(expected, oa_step(layers, x, ctx))
    assert [stride for _, stride in layouts[1:]] == [(8 * 48, 0, 48, 1)] * 2 and len(cudnn) == 1  # heads expanded: stride 0
