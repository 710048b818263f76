"""torchtune's form (no layers), keep_on_gpu, TransformerEngine's names and defaults, the warning
for a step that offloaded nothing, and unknown keywords at every entry point."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch

import offload
from offload.engine.schedules.auto import ScheduleAuto
from tests._util import assert_bitwise, cpu_context, make_mlp_layers, plain_reference, train_step


class Head(torch.nn.Module):
    """A body of MLP layers and an output head, called as one model."""

    def __init__(self, n: int = 6, width: int = 64) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*make_mlp_layers(n, width))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, keep_head: bool = False) -> torch.Tensor:
        h = self.body(x)
        with offload.keep_on_gpu() if keep_head else contextlib.nullcontext():
            return torch.tanh(self.head(h))


def model_step(model: Head, x: torch.Tensor, ctx: Any = None, keep_head: bool = False) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    with ctx if ctx is not None else contextlib.nullcontext():
        out = model(x * 1.0, keep_head=keep_head)
    (out ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def model_reference(model: Head, x: torch.Tensor) -> list[torch.Tensor]:
    expected = model_step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, model_step(model, x))), "the plain run does not repeat itself"
    return expected


# -- torchtune's form ------------------------------------------------------------------------------
def test_no_layers_form_offloads_groups_by_bytes_and_keeps_the_tail() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    ctx = offload.OffloadActivations(device="cpu", min_offload_bytes=0, group_bytes=1)
    for _ in range(3):  # the arena is reused step after step
        assert_bitwise(expected, model_step(model, x, ctx))
        s = ctx.stats
        assert s["finished"] and s["mode"] == "auto"
        assert s["groups_offloaded"] >= 10, "every module call should close a group at group_bytes=1"
        assert s["released_bytes"] == s["offloaded_bytes"] > 0
        assert s["reloads"] == s["groups_offloaded"]
        assert s["kept"].get("layer", 0) >= 1, "the last group of the forward must stay on the GPU"


def test_no_layers_form_reloads_ahead_from_the_boundary_markers() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    ctx = offload.OffloadActivations(device="cpu", min_offload_bytes=0, group_bytes=1)
    misses = []
    schedule = ctx.engine.schedule
    original = schedule.on_unpack_miss
    schedule.on_unpack_miss = lambda engine, group: (misses.append(group.layer), original(engine, group))
    assert_bitwise(expected, model_step(model, x, ctx))
    # The markers reload each group (and prefetch two below it) before backward unpacks it.
    assert ctx.stats["reloads"] > 0 and misses == []


def test_no_layers_group_bytes_threshold_decides_the_group_count() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    small = offload.OffloadActivations(device="cpu", min_offload_bytes=0, group_bytes=1)
    large = offload.OffloadActivations(device="cpu", min_offload_bytes=0, group_bytes=40 * 1024)
    assert_bitwise(expected, model_step(model, x, small))
    assert_bitwise(expected, model_step(model, x, large))
    assert 0 < large.stats["groups_offloaded"] < small.stats["groups_offloaded"]


def test_no_layers_release_lag_follows_max_fwd_stash_size() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    ctx = offload.OffloadActivations(device="cpu", min_offload_size=0, group_bytes=1, max_fwd_stash_size=3)
    assert isinstance(ctx.engine.schedule, ScheduleAuto) and ctx.engine.schedule.stash == 3
    assert ctx.engine.policy.min_offload_bytes == 0
    in_flight = []
    engine = ctx.engine
    release = engine.release

    def counting_release(group: Any) -> None:
        in_flight.append(sum(g.state is offload.engine.group.GroupState.OFFLOADING for g in engine.step.groups.values()))
        release(group)

    engine.release = counting_release
    assert_bitwise(expected, model_step(model, x, ctx))
    # During the forward a release happens once stash + 1 copies are in flight, never sooner.
    assert in_flight and max(in_flight) == 4 and in_flight[0] == 4


def test_keep_on_gpu_keeps_the_head_in_every_form() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    # No layers.
    ctx = offload.OffloadActivations(device="cpu", min_offload_bytes=0, group_bytes=1)
    assert_bitwise(expected, model_step(model, x, ctx, keep_head=True))
    assert ctx.stats["kept"]["keep_on_gpu"] == 3  # the head's input and weight, tanh's output
    # With layers: the head runs after the last layer, between-layers tensors would join nothing.
    layered = offload.OffloadActivations(list(model.body) + [model.head], device="cpu", min_offload_bytes=0,
                                         num_offload_layers=len(model.body) + 1 - 1)
    assert_bitwise(expected, model_step(model, x, layered, keep_head=True))
    assert layered.stats["kept"].get("keep_on_gpu", 0) >= 1


def test_keep_on_gpu_inside_a_te_layer_context() -> None:
    layers = make_mlp_layers(3)
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)
    ctx, sync = cpu_context(2, 3)

    class Kept(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            with offload.keep_on_gpu():
                return self.layer(h)

    wrapped = torch.nn.ModuleList([Kept(layers[0]), layers[1], layers[2]])
    got = train_step(wrapped, x, ctx, sync)
    assert_bitwise(expected, got)
    assert ctx.stats["kept"]["keep_on_gpu"] >= 1
    assert ctx.stats["groups_offloaded"] == 1  # layer 1 only: layer 0 was kept whole


def test_keep_on_gpu_outside_offloading_does_nothing() -> None:
    with offload.keep_on_gpu():
        y = torch.randn(4, requires_grad=True).exp()
    y.sum().backward()
    assert not offload.is_cpu_offload_enabled()


def test_torchtune_options_are_checked_with_their_meanings() -> None:
    offload.OffloadActivations(device="cpu", use_pin_memory=True, use_streams=True, max_fwd_stash_size=5, min_offload_size=1024)
    with pytest.raises(ValueError, match="use_pin_memory=False is not supported.*host_budget_bytes"):
        offload.OffloadActivations(device="cpu", use_pin_memory=False)
    with pytest.raises(ValueError, match="use_streams=False is not supported"):
        offload.OffloadActivations(device="cpu", use_streams=False)
    with pytest.raises(ValueError, match="max_fwd_stash_size must be at least 1"):
        offload.OffloadActivations(device="cpu", max_fwd_stash_size=0)
    with pytest.raises(ValueError, match="min_offload_size .*or min_offload_bytes, not both"):
        offload.OffloadActivations(device="cpu", min_offload_size=0, min_offload_bytes=0)
    with pytest.raises(ValueError, match="max_fwd_stash_size applies to the form without layers"):
        offload.OffloadActivations(make_mlp_layers(2), device="cpu", max_fwd_stash_size=2)
    with pytest.raises(ValueError, match="without layers finds group boundaries by bytes, so num_offload_layers, plan"):
        offload.OffloadActivations(num_offload_layers=1, plan=object(), device="cpu")
    with pytest.raises(TypeError, match="use_streams must be True or False"):
        offload.OffloadActivations(device="cpu", use_streams="yes")


def test_no_layers_form_under_v1_selects_marked_tensors_and_warns_when_none() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(32, 64)
    expected = model_reference(model, x)
    ctx = offload.OffloadActivations(device="cpu", mode="v1", min_offload_bytes=0, group_bytes=1)
    with pytest.warns(UserWarning, match="not selected.*mark_activation_offload.*selection='auto'"):
        assert_bitwise(expected, model_step(model, x, ctx))
    assert ctx.stats["offloaded_tensors"] == 0 and ctx.stats["kept"]["not_selected"] > 0


# -- warnings: a step that offloaded nothing -----------------------------------------------------------
def test_warns_once_when_every_tensor_is_under_the_size_floor() -> None:
    layers = make_mlp_layers(3, width=16)
    x = torch.randn(4, 16)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=2, model_layers=3, device="cpu")
    with pytest.warns(UserWarning, match=r"offloaded nothing.*smaller than min_offload_bytes=65536 \(the largest of them had 256 bytes"):
        train_step(layers, x, ctx, sync)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(layers, x, ctx, sync)  # once per context


def test_warns_when_v1_selects_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    layers = make_mlp_layers(3)
    ctx, sync = cpu_context(2, 3)
    with pytest.warns(UserWarning, match="not selected: selection is 'marked'.*mark_activation_offload.*selection='auto'"):
        train_step(layers, torch.randn(8, 64), ctx, sync)


def test_warns_when_every_tensor_is_a_parameter() -> None:
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.w.exp()  # saves exp's output, a view-free non-leaf... and the parameter

    class ParamOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h * 2.0 + torch.sin(self.w)  # sin saves its input: the parameter only

    layers = torch.nn.ModuleList([ParamOnly(), ParamOnly()])
    ctx, sync = cpu_context(1, 2)
    with pytest.warns(UserWarning, match="offloaded nothing; of the 1 saved tensors it saw, 1 were parameters"):
        train_step(layers, torch.randn(8, 64), ctx, sync)


def test_no_warning_when_something_is_offloaded() -> None:
    layers = make_mlp_layers(3)
    ctx, sync = cpu_context(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(layers, torch.randn(8, 64), ctx, sync)
    assert ctx.stats["offloaded_tensors"] > 0


def test_tiny_model_in_the_no_layers_form_warns_about_the_tail() -> None:
    model = torch.nn.Sequential(*make_mlp_layers(2))
    ctx = offload.OffloadActivations(device="cpu", min_offload_bytes=0)  # default 32 MiB groups
    with pytest.warns(UserWarning, match="last group of the forward.*group_bytes"):
        x = torch.randn(8, 64, requires_grad=True)
        with ctx:
            y = model(x * 1.0)
        y.sum().backward()


# -- TransformerEngine's names ---------------------------------------------------------------------
def test_te_default_arguments_behave_as_in_te(monkeypatch: pytest.MonkeyPatch) -> None:
    # v2: TransformerEngine asserts num_layers <= model_layers - 1; so do we, saying why.
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    with pytest.raises(ValueError, match=r"defaults num_layers=1, model_layers=1 describes a one-layer model"):
        offload.get_cpu_offload_context(True, device="cpu")
    # Manual synchronization: TE does not use num_layers; every layer collects its tensors.
    ctx, sync, control = offload.get_cpu_offload_context(True, device="cpu", manual_synchronization=True, min_offload_bytes=0)
    assert ctx.engine.schedule.offloads(0)
    offload.get_cpu_offload_context(True, None, 3, device="cpu", manual_synchronization=True)
    # v1: TE v1 offloads the single layer (its window is the layer itself).
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    layers = make_mlp_layers(1)
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x, scale_input=True)
    ctx, sync = offload.get_cpu_offload_context(True, device="cpu", selection="auto", min_offload_bytes=0)
    assert_bitwise(expected, train_step(layers, x, ctx, sync, scale_input=True))
    assert ctx.stats["groups_offloaded"] == 1 and ctx.stats["reloads"] == 1
    with pytest.raises(ValueError, match="num_layers=3 is more than model_layers=2"):
        offload.get_cpu_offload_context(True, 3, 2, device="cpu")


def test_te_manual_example_offloads_every_layer() -> None:
    # TransformerEngine's documented manual example passes model_layers only.
    layers = make_mlp_layers(3)
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x, scale_input=True)
    ctx, sync, control = offload.get_cpu_offload_context(True, model_layers=3, manual_synchronization=True,
                                                         device="cpu", min_offload_bytes=0)
    for p in layers.parameters():
        p.grad = None
    xin = x.clone().requires_grad_(True)
    h = xin * 1.0
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        control.start_offload_layer(i)
    for i in range(3):
        control.release_activation_forward_gpu_memory(i)
    for i in (2, 1, 0):
        control.start_reload_layer(i)
    (h.float() ** 2).mean().backward()
    got = [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]
    assert_bitwise(expected, got)
    assert ctx.stats["groups_offloaded"] == 3


def test_is_cpu_offload_enabled_and_layer_follow_the_innermost_hooks() -> None:
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            seen.append((offload.is_cpu_offload_enabled(), offload.is_cpu_offload_layer(), offload.CPUOffloadEnabled))
            with offload.keep_on_gpu():
                seen.append((offload.is_cpu_offload_enabled(), offload.is_cpu_offload_layer(), offload.CPUOffloadEnabled))
            return self.layer(h)

    layers = torch.nn.ModuleList(Probe(layer) for layer in make_mlp_layers(3))
    ctx, sync = cpu_context(2, 3)
    assert not offload.is_cpu_offload_enabled() and not offload.CPUOffloadEnabled
    train_step(layers, torch.randn(8, 64), ctx, sync)
    # Offloaded layers 0 and 1: enabled; inside keep_on_gpu: not; layer 2 is not offloaded.
    assert seen == [(True, True, True), (False, False, False)] * 2 + [(False, False, False)] * 2
    seen.clear()
    whole = offload.OffloadActivations(list(layers), device="cpu", min_offload_bytes=0)
    with whole:
        layers[2](layers[1](layers[0](torch.randn(8, 64, requires_grad=True))))
    # The hooks cover the whole forward; the last layer is not offloaded.
    assert [s[:2] for s in seen[::2]] == [(True, True), (True, True), (True, False)]
    assert offload.CPUOffloadedLayer is False


def test_start_offload_is_accepted_and_checked() -> None:
    layers = make_mlp_layers(3)
    x = torch.randn(8, 64)
    expected = plain_reference(layers, x)

    class Started(torch.nn.Module):
        def __init__(self, layer: torch.nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            out = self.layer(h)
            offload.start_offload(out, None, [out.view(-1)], offload_base_tensor=True)
            return out

    ctx, sync = cpu_context(2, 3)
    assert_bitwise(expected, train_step(torch.nn.ModuleList(Started(m) for m in layers), x, ctx, sync))
    with pytest.raises(TypeError, match=r"offload: start_offload\(\) cannot mark an object of type str"):
        offload.start_offload("x")
    with pytest.raises(TypeError, match="offload_base_tensor must be True or False"):
        offload.start_offload(torch.ones(1), offload_base_tensor=1)


def test_te_public_names_are_exported() -> None:
    for name in ("get_cpu_offload_context", "mark_not_offload", "start_offload", "is_cpu_offload_enabled",
                 "mark_activation_offload", "is_cpu_offload_layer", "keep_on_gpu"):
        assert name in offload.__all__ and callable(getattr(offload, name)), name
    with pytest.raises(AttributeError, match="no attribute 'CPUOffloadEnable'"):
        offload.CPUOffloadEnable  # noqa: B018


# -- unknown keywords ------------------------------------------------------------------------------
def test_unknown_keywords_name_the_public_function_everywhere() -> None:
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations\(\) got unexpected keyword argument 'use_pinned_memory' \(did you mean 'use_pin_memory'\?\); it accepts: .*max_fwd_stash_size"):
        offload.OffloadActivations(use_pinned_memory=True)
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations\(\) got unexpected keyword argument 'min_offload_sise'"):
        offload.OffloadActivations(enabled=False, min_offload_sise=1)  # disabled: checked all the same
    with pytest.raises(TypeError, match=r"^offload: plan\(\) got unexpected keyword argument 'budget'; it accepts: layers, step_fn, memory_budget_bytes"):
        offload.plan(make_mlp_layers(2), lambda: None, budget=1)
    with pytest.raises(TypeError, match=r"^offload: make_graphed_callables\(\) got unexpected keyword argument 'num_warmup_iter' \(did you mean 'num_warmup_iters'\?\)"):
        offload.graphs.make_graphed_callables(torch.nn.Linear(2, 2), (torch.ones(2),), num_warmup_iter=1)
    with pytest.raises(TypeError, match=r"^offload: StepGraph\(\) got unexpected keyword argument 'warmup'"):
        offload.graphs.StepGraph(lambda x: x, (torch.ones(1),), warmup=1)


def test_a_host_budget_of_zero_is_named_as_the_reason_nothing_was_offloaded() -> None:
    # host_cost.py's "offload (nothing fits)" variant asks for this on purpose: the warning must
    # say that the context's own budget of 0 refused every tensor, not list bounds that could
    # as well mean a node out of memory.
    layers = make_mlp_layers(3)
    x = torch.randn(8, 64)
    expected = train_step(layers, x)
    ctx, sync = cpu_context(2, 3, host_budget_bytes=0)
    with pytest.warns(UserWarning, match=r"did not fit in the host budget: this context was given "
                                         r"host_budget_bytes=0, so it may hold no host memory.*as that budget asks"):
        assert_bitwise(expected, train_step(layers, x, ctx, sync))
    assert ctx.stats["offloaded_tensors"] == 0 and ctx.stats["kept"]["budget"] > 0


def test_a_host_budget_refusal_gives_the_bound_that_binds_and_its_figures() -> None:
    layers = make_mlp_layers(3)
    ctx, sync = cpu_context(2, 3, host_budget_bytes=4096)
    with pytest.warns(UserWarning, match=r"did not fit in the host budget.*this context may hold 4096 bytes at most "
                                         r"now, set by host_budget_bytes \(node "):
        train_step(layers, torch.randn(64, 64), ctx, sync)


def test_first_steps_offload_all_the_budget_allows_beside_other_contexts() -> None:
    # host_cost.py --interleave holds several contexts in one process, sharing its host ledger,
    # and steps them in turn: no context's first step may be refused what its budget allows
    # (a ledger read as empty before any block is pinned would refuse it).
    layers = make_mlp_layers(3)
    x = torch.randn(64, 64)
    probe, probe_sync = cpu_context(2, 3)
    train_step(layers, x, probe, probe_sync)
    wanted, need = probe.stats["offloaded_tensors"], probe.stats["host_peak_bytes"]
    assert wanted > 0 and need > 0
    contexts = [cpu_context(2, 3, host_budget_bytes=need), cpu_context(2, 3), cpu_context(2, 3, host_budget_bytes=0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*host_budget_bytes=0")  # the third one's, by design
        for step in range(3):
            for i, (ctx, sync) in enumerate(contexts):
                train_step(layers, x, ctx, sync)
                expected = 0 if i == 2 else wanted
                assert ctx.stats["offloaded_tensors"] == expected, (
                    f"context {i}, step {step + 1}: offloaded {ctx.stats['offloaded_tensors']} of {wanted} "
                    f"tensors (kept {ctx.stats['kept']})")
