"""Options checked up front, in the user's terms (issue 49, items 9, 11 and 12): a wrong type is a
``TypeError``, a bad value a ``ValueError``, each naming the option and what it takes.

- Byte counts take the forms users write (``20 << 30``, ``20e9``, ``"20GB"``, ``"20 GiB"``:
  ``offload/sizes.py``), the same for every byte option and entry point, up to ``2**63 - 1``: a
  larger ``min_offload_bytes`` was accepted and overflowed in the native hooks mid-forward.
- ``plan=`` of another type names ``Plan.from_dict``; ``probe=`` of another type is a TypeError.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import offload
from offload.planner import Plan
from offload.sizes import MAX_BYTES, parse_size

from _util import assert_bitwise, make_mlp_layers, oa_step, train_step

HUGE = [2**63, 2**64, 10**30]


# -- item 9: byte counts beyond a signed 64-bit integer ------------------------------------------------------
@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("name", ["min_offload_bytes", "min_offload_size", "host_budget_bytes", "group_bytes"])
def test_a_byte_count_past_int64_is_refused_by_offload_activations(name: str, value: int) -> None:
    # At construction, before any forward (the native hooks read the floor as a C long long).
    with pytest.raises(ValueError, match=rf"^offload: OffloadActivations: {name} must be a number of bytes "
                                         rf"from 0 to 2\*\*63 - 1 .*got {value}$"):
        offload.OffloadActivations(make_mlp_layers(3), device="cpu", **{name: value})


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("name", ["min_offload_bytes", "host_budget_bytes", "group_bytes"])
def test_a_byte_count_past_int64_is_refused_by_get_cpu_offload_context(name: str, enabled: bool) -> None:
    with pytest.raises(ValueError, match=rf"^offload: get_cpu_offload_context: {name} must be a number of bytes "
                                         r"from 0 to 2\*\*63 - 1"):
        offload.get_cpu_offload_context(enabled, 1, 2, device="cpu", **{name: 2**63})


def test_a_min_offload_bytes_past_int64_is_refused_by_offload_plan() -> None:
    layers, x = make_mlp_layers(2), torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"^offload: offload.plan: min_offload_bytes must be .*2\*\*63 - 1"):
        offload.plan(layers, lambda: train_step(layers, x), "lowest", device="cpu", min_offload_bytes=2**63)


def test_the_largest_byte_count_is_taken_and_runs() -> None:
    layers, x = make_mlp_layers(3), torch.randn(4, 64)
    expected = train_step(layers, x)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=MAX_BYTES)
    with pytest.warns(UserWarning, match="smaller than min_offload_bytes=9223372036854775807"):
        assert_bitwise(expected, oa_step(layers, x, oa))  # every tensor is under the floor: kept
    assert oa.stats["offloaded_bytes"] == 0


# -- item 12: byte counts as users write them ----------------------------------------------------------------
@pytest.mark.parametrize("text, count", [
    ("20GB", 20 * 10**9), ("20 GiB", 20 << 30), ("20gib", 20 << 30), ("20 gB", 20 * 10**9), ("1.5e9", 1_500_000_000),
    ("512 kB", 512_000), ("64KiB", 64 << 10), ("1e3 B", 1000), (" 7 ", 7), ("1.5 MiB", 3 << 19), ("2TB", 2 * 10**12),
    ("1.3 GiB", 1395864371),  # a fraction of a byte in a larger unit: rounded down
])
def test_size_strings_are_read_in_decimal_or_binary_units(text: str, count: int) -> None:
    assert parse_size(text) == count


@pytest.mark.parametrize("value, count", [
    (1.5e9, 1_500_000_000), (20e9, 20 * 10**9), ("20GB", 20 * 10**9), ("20 GiB", 20 << 30), (20 << 30, 20 << 30),
])
def test_memory_budget_bytes_takes_floats_and_size_strings(value: Any, count: int) -> None:
    layers = make_mlp_layers(3)
    assert offload.OffloadActivations(layers, memory_budget_bytes=value, device="cpu").budget == count
    oa = offload.OffloadActivations(layers, memory_budget_bytes="lowest", device="cpu")
    oa.set_budget(value)
    assert oa.budget == count


def test_host_budget_given_as_a_size_string_caps_the_host() -> None:
    ctx, _ = offload.get_cpu_offload_context(True, 1, 2, device="cpu", host_budget_bytes="2 MiB")
    assert ctx.stats["host_budget_bytes"] == 2 << 20


@pytest.mark.parametrize("value", [[20], {"bytes": 20}, True, b"20GB", torch.tensor(20)])
def test_a_budget_of_a_wrong_type_is_a_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations: memory_budget_bytes must be a number of "
                                        r"bytes from 1 to 2\*\*63 - 1 \(an int such as 20 << 30, a float such as "
                                        r"20e9, or a string such as '20GB' or '20 GiB'\), 'device' \(what this GPU "
                                        r"can give\) or 'lowest', got .* \((list|dict|bool|bytes|Tensor)\)$"):
        offload.OffloadActivations(make_mlp_layers(3), memory_budget_bytes=value, device="cpu")


@pytest.mark.parametrize("value, why", [
    ("20G", "'20G' has the unit 'G', which could mean powers of 1000 or of 1024: write GB or GiB"),
    ("twenty GB", "'twenty GB' is not a size"),
    ("20 GB/s", "'20 GB/s' is not a size"),
    ("20 gigs", "'20 gigs' has the unit 'gigs', which is not one of B, kB, MB, GB, TB"),
    ("-5GB", "'-5GB' is negative"),
    ("1.5", "'1.5' is not a whole number of bytes"),
    (1.5, "got 1.5: not a whole number of bytes"),
    (float("inf"), "got inf$"),
    (0, "got 0$"),
    ("0 GB", "got '0 GB' = 0 bytes$"),
    ("1e40", "out of range"),
    ("Device", "'Device' is not a size"),  # the choices are spelt as documented
])
def test_a_bad_budget_value_is_a_value_error_that_says_what_is_wrong(value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=r"^offload: OffloadActivations: memory_budget_bytes must be a number of "
                                         r"bytes from 1 .*" + why):
        offload.OffloadActivations(make_mlp_layers(3), memory_budget_bytes=value, device="cpu")
    with pytest.raises(ValueError, match=r"^offload: plan\(\): memory_budget_bytes .*" + why):
        offload.plan(make_mlp_layers(2), lambda: None, value, device="cpu")


def test_probe_of_a_wrong_type_is_a_type_error_and_a_wrong_name_a_value_error() -> None:
    layers = make_mlp_layers(3)
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations: probe must be one of 'auto', 'plain', "
                                        r"'recompute' .*got 1 \(int\)$"):
        offload.OffloadActivations(layers, memory_budget_bytes="lowest", probe=1, device="cpu")
    with pytest.raises(ValueError, match=r"probe must be one of 'auto', 'plain', 'recompute' .*got 'fast'$"):
        offload.OffloadActivations(layers, memory_budget_bytes="lowest", probe="fast", device="cpu")


# -- item 11: plan= of another type ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def made() -> tuple[torch.nn.ModuleList, torch.Tensor, Plan]:
    layers, x = make_mlp_layers(3), torch.randn(4, 64)
    return layers, x, offload.plan(layers, lambda: train_step(layers, x), "lowest", device="cpu", min_offload_bytes=0)


def test_a_saved_plan_passed_as_data_names_plan_from_dict(made) -> None:
    layers, x, plan = made
    saved = json.loads(json.dumps(plan.to_dict()))
    with pytest.raises(TypeError, match=r"^offload: OffloadActivations: plan must be an offload.planner.Plan or "
                                        r"None, got dict; .*pass offload.planner.Plan.from_dict\(d\)$"):
        offload.OffloadActivations(layers, plan=saved, device="cpu")
    # What the message says works, and follows the plan bit for bit.
    oa = offload.OffloadActivations(layers, plan=Plan.from_dict(saved), device="cpu", min_offload_bytes=0)
    assert_bitwise(train_step(layers, x), oa_step(layers, x, oa))


@pytest.mark.parametrize("value, hint", [
    ("lowest", r"got 'lowest' \(str\); .*Plan.from_dict\(json.load\(f\)\); for a budget, use memory_budget_bytes$"),
    ("plan.json", r"got 'plan.json' \(str\); .*Plan.from_dict\(json.load\(f\)\)"),
    (3, r"got 3 \(int\); pass offload.plan\(layers, train_step, ...\)'s result or offload.planner.Plan.from_dict"),
])
def test_plan_of_another_type_is_a_type_error_naming_plan(made, value: Any, hint: str) -> None:
    layers, _, _ = made
    for enabled in (True, False):
        with pytest.raises(TypeError, match=r"^offload: OffloadActivations: plan must be an offload.planner.Plan "
                                            r"or None, " + hint):
            offload.OffloadActivations(layers, plan=value, device="cpu", enabled=enabled)
