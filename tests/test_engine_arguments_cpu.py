"""The public entry points refuse bad arguments clearly (on CPU). Split from
``test_engine_cpu.py``."""

from __future__ import annotations

import pytest
import torch

import offload

from _util import assert_bitwise, cpu_context, make_mlp_layers

# -- argument validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_layers=4, model_layers=4), "at most model_layers - 1"),
        (dict(num_layers=-1, model_layers=4), "num_layers must be an integer >= 0"),
        (dict(num_layers=1, model_layers=0), "model_layers must be an integer >= 1"),
        (dict(num_layers=1, model_layers=4, offload_activations=False), "nothing to offload"),
        (dict(num_layers=1, model_layers=4, mode="v3"), "mode must be one of 'v1', 'v2' or None .*got 'v3'"),
        (dict(num_layers=1, model_layers=4, device="xla"), "CUDA device or 'cpu'"),
        (dict(num_layers=1, model_layers=4, selection="all"), "selection must be one of 'auto', 'marked'"),
        (dict(num_layers=1, model_layers=4, min_offload_bytes=-5), r"min_offload_bytes must be a number of bytes from 0 to 2\*\*63 - 1 .*, got -5"),
        (dict(num_layers=1, model_layers=4, host_budget_bytes=-1), r"host_budget_bytes must be a number of bytes from 0 .* or None \(the default\), got -1"),
        # A size string is read (offload.sizes), but a bare "k" could mean 1000 or 1024.
        (dict(num_layers=1, model_layers=4, min_offload_bytes="64k"), "'64k' has the unit 'k', which could mean powers of 1000 or of 1024: write KB or KiB"),
        (dict(num_layers=1, model_layers=4, min_offload_bytes=1.5), r"min_offload_bytes .* got 1.5: not a whole number of bytes"),
    ],
)
def test_bad_arguments_are_refused_clearly(kwargs, message) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=message):
        offload.get_cpu_offload_context(True, **kwargs)


WRONG_TYPES = [
    (dict(min_offload_bytes=None), r"min_offload_bytes must be a number of bytes from 0 to 2\*\*63 - 1 \(an int such as 20 << 30, a float such as 20e9, or a string such as '20GB' or '20 GiB'\), got None \(NoneType\)"),
    (dict(min_offload_bytes=b"64"), r"min_offload_bytes must be a number of bytes .* got b'64' \(bytes\)"),
    (dict(host_budget_bytes=[1 << 30]), r"host_budget_bytes must be a number of bytes .* or None \(the default\), got \[1073741824\] \(list\)"),
    (dict(num_layers=True), r"num_layers must be an integer >= 0, got True \(bool\)"),
    (dict(model_layers="4"), r"model_layers must be an integer >= 1, got '4' \(str\)"),
    (dict(double_buffering="yes"), r"double_buffering must be True or False, got 'yes' \(str\)"),
    (dict(retain_pinned_cpu_buffers=1), r"retain_pinned_cpu_buffers must be True or False, got 1 \(int\)"),
    (dict(manual_synchronization=None), r"manual_synchronization must be True or False"),
    (dict(offload_activations="no"), r"offload_activations must be True or False"),
    (dict(offload_weights=0), r"offload_weights must be True or False"),
    (dict(mode=1), r"mode must be one of 'v1', 'v2' or None .* got 1 \(int\)"),
    (dict(selection=["auto"]), r"selection must be one of 'auto', 'marked'"),
    (dict(offload_stream="side"), r"offload_stream must be a torch.cuda.Stream or None"),
    (dict(device=["cpu"]), r"device must be None, a torch.device, a string or an index"),
    (dict(params_from=[torch.randn(3)]), r"params_from must be an nn.Module or an iterable of nn.Module"),
]


@pytest.mark.parametrize("kwargs, message", WRONG_TYPES)
def test_wrong_option_types_name_the_public_call(kwargs, message) -> None:
    options = {"num_layers": 1, "model_layers": 4, "device": "cpu", **kwargs}
    with pytest.raises(TypeError, match=r"^offload: get_cpu_offload_context: " + message):
        offload.get_cpu_offload_context(True, **options)
    if "num_layers" in kwargs or "model_layers" in kwargs:
        return  # OffloadActivations derives them from its layers
    del options["num_layers"], options["model_layers"]
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations: " + message):
        offload.OffloadActivations(make_mlp_layers(4), **options)


def test_enabled_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"get_cpu_offload_context: enabled must be True or False, got 'yes'"):
        offload.get_cpu_offload_context("yes")


def test_unknown_keywords_list_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"^offload: get_cpu_offload_context\(\) got unexpected keyword argument 'num_layer' \(did you mean 'num_layers'\?\); it accepts: enabled, num_layers, model_layers, .*min_offload_bytes"):
        offload.get_cpu_offload_context(True, num_layer=1, model_layers=2, device="cpu")
    # Even when disabled: a misspelt option would otherwise go unnoticed until it is enabled.
    with pytest.raises(TypeError, match=r"get_cpu_offload_context\(\) got unexpected keyword argument 'min_offload_byte' \(did you mean 'min_offload_bytes'\?\)"):
        offload.get_cpu_offload_context(False, min_offload_byte=0)
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations\(\) got unexpected keyword arguments 'prefetch', 'num_offload_layer' \(did you mean 'num_offload_layers'\?\); it accepts: layers, num_offload_layers, enabled, plan, memory_budget_bytes, measure_peak, .*num_layers"):
        offload.OffloadActivations(make_mlp_layers(3), device="cpu", prefetch=2, num_offload_layer=1)


def test_offload_weights_warns() -> None:
    with pytest.warns(UserWarning, match="weights are not offloaded"):
        offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, offload_weights=True, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        offload.get_cpu_offload_context(True, num_layers=1, model_layers=2, device="cuda")
    # device=None is the CPU there (tests/test_entry_points_cpu.py); only an explicit CUDA device is refused.


def test_sync_function_needs_a_tensor() -> None:
    ctx, sync = cpu_context(1, 2)
    with pytest.raises(ValueError, match="sync_function got list; pass the layer's output tensor"):
        sync([torch.randn(3)])
    with torch.no_grad():
        t = torch.randn(3)
        assert sync(t) is t


def test_sync_function_passes_a_frozen_layer_output_through() -> None:
    # A frozen first layer: its output does not require grad; TransformerEngine returns it as is.
    layers = make_mlp_layers(4)
    layers[0].requires_grad_(False)
    x = torch.randn(8, 64)

    def step(ctx=None, sync=None) -> list[torch.Tensor]:
        for p in layers.parameters():
            p.grad = None
        h = x
        for layer in layers:
            if ctx is None:
                h = layer(h)
                continue
            with ctx:
                h = layer(h)
            if not h.requires_grad:
                assert sync(h) is h and not h._backward_hooks
            h = sync(h)
        (h ** 2).mean().backward()
        return [p.grad for p in layers.parameters() if p.requires_grad]

    expected = step()
    assert_bitwise(expected, step())
    ctx, sync = cpu_context(3, 4)
    assert_bitwise(expected, step(ctx, sync))


def test_offload_activations_arguments() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        offload.OffloadActivations([], device="cpu")
    layers = make_mlp_layers(3)
    oa = offload.OffloadActivations(layers, device="cpu")
    assert oa.engine.schedule.num_layers == 2
    with pytest.raises(ValueError, match="num_offload_layers=3 is more than 2: of the 3 layers given"):
        offload.OffloadActivations(layers, num_offload_layers=3, device="cpu")
