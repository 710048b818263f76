"""convert / unconvert never lose what the user keeps on a module (issue 32, defect 12): a Linear
holding an attribute, Parameter, buffer or submodule under a name of ``fp8.Linear.FP8_STATE`` is
skipped (reason in the summary, one warning) and keeps it, while the model's other Linears
convert; the Llama ops swap keeps the user's attributes on layers, norms and MLPs, and leaves
alone a norm or MLP whose Parameters the replacement would drop. CPU only."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload import fp8

WIDTH = 32


def convert_recording(model: nn.Module, **kw: Any) -> tuple[fp8.ConvertSummary, list[str]]:
    """``fp8.convert`` and the warnings it gave, but the CPU slowness one (tested elsewhere)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        summary = fp8.convert(model, **kw)
    return summary, [str(w.message) for w in record if "converted on the CPU" not in str(w.message)]


def own(kind: str) -> Any:
    """Something of the user's of each kind a module can hold under a name."""
    return {
        "attribute": 0.5,
        "parameter": nn.Parameter(torch.ones(1)),
        "buffer": torch.ones(1),
        "submodule": nn.Identity(),
    }[kind]


def hold(module: nn.Module, name: str, value: Any, kind: str) -> None:
    if kind == "buffer":
        module.register_buffer(name, value)
    else:
        setattr(module, name, value)


def test_a_user_scaling_attribute_survives_convert_and_unconvert() -> None:
    lin = nn.Linear(WIDTH, WIDTH)
    lin.scaling = 0.5
    summary, warned = convert_recording(lin)
    assert type(lin) is nn.Linear and lin.scaling == 0.5, "convert replaced the user's lin.scaling"
    assert summary.converted == () and "scaling" in summary.skipped[""]
    assert "skipped <root>: it already has 'scaling'" in str(summary)
    fp8.unconvert(lin)
    assert lin.scaling == 0.5, "convert + unconvert lost the user's lin.scaling"
    assert len(warned) == 1


@pytest.mark.parametrize("kind", ["attribute", "parameter", "buffer", "submodule"])
@pytest.mark.parametrize("name", fp8.Linear.FP8_STATE)
def test_a_linear_holding_an_fp8_state_name_is_skipped_and_the_others_convert(kind: str, name: str) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    mine = own(kind)
    hold(model[0], name, mine, kind)
    keys = list(model.state_dict())

    summary, warned = convert_recording(model)
    assert summary.converted == ("2",) and isinstance(model[2], fp8.Linear)
    assert type(model[0]) is nn.Linear, f"a Linear holding {name!r} was converted"
    assert getattr(model[0], name) is mine, f"convert replaced the user's {kind} {name!r}"
    reason = summary.skipped["0"]
    assert f"'{name}'" in reason and "Rename" in reason and "module_filter_fn" in reason
    assert len(warned) == 1 and "0" in warned[0] and "overwrite" in warned[0]
    model(torch.randn(16, WIDTH))  # both still run

    fp8.unconvert(model)
    assert getattr(model[0], name) is mine, f"convert + unconvert lost the user's {kind} {name!r}"
    assert list(model.state_dict()) == keys


def test_many_clashes_warn_once() -> None:
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(3)))
    model[0].weight_cache = "mine"
    model[1].fp8_dtype = "mine"
    summary, warned = convert_recording(model)
    assert set(summary.skipped) == {"0", "1"} and summary.converted == ("2",)
    assert len(warned) == 1 and "2 Linear module(s)" in warned[0] and "0, 1" in warned[0]


def test_llama_ops_keep_user_attributes_and_leave_an_mlp_whose_parameters_they_would_drop() -> None:
    pytest.importorskip("transformers")
    from _util import tiny_llama

    model, _ = tiny_llama(2)
    first, second = model.model.layers
    tagged = {first: "layer", first.input_layernorm: "norm", first.mlp: "mlp"}
    for module, tag in tagged.items():
        module.user_tag = tag
    norm, mlp, other_mlp = first.input_layernorm, first.mlp, second.mlp
    adapter = nn.Parameter(torch.ones(1))
    other_mlp.adapter_scale = adapter  # state fp8.SwiGLUMLP would not hold
    keys = list(model.state_dict())

    summary, _ = convert_recording(model, module_filter_fn=lambda _m, name: name != "lm_head")
    ops = summary.llama_ops
    assert ops is not None and (ops.norms, ops.mlps) == (4, 1)
    assert isinstance(first.mlp, fp8.SwiGLUMLP) and second.mlp is other_mlp
    assert any(s.startswith("model.layers.1.mlp: it holds adapter_scale") for s in ops.skipped), ops.skipped
    assert list(model.state_dict()) == keys, "a user Parameter left the state dict while converted"
    assert any(p is adapter for p in model.parameters())

    fp8.unconvert(model)
    assert first.input_layernorm is norm and first.mlp is mlp
    lost = [tag for module, tag in tagged.items() if getattr(module, "user_tag", None) != tag]
    assert not lost, f"convert + unconvert lost the user's attribute on the {lost}"
    assert list(model.state_dict()) == keys
