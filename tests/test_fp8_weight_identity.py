"""The FP8 weight cache is keyed on the weight tensor itself (issue 32, defect 1): a fresh weight
at a freed weight's address, with the same version, is a miss (``torch.func.functional_call``),
as are an optimizer step and a ``.data`` swap; the same Parameter unchanged is a hit (the cached
object itself). CPU tests on torch's CPU ``_scaled_mm``; the ``cuda`` variant, where the caching
allocator hands freed addresses straight back, skips cleanly without an FP8 GPU."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from offload import fp8

CUDA_FP8 = torch.cuda.is_available() and fp8.scaled_mm_supported("cuda")
CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_FP8, reason="needs a CUDA GPU with FP8 (sm_89+)")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]
WIDTH, ROWS = 32, 16


def fp8_linear(device: str = "cpu", weight: torch.Tensor | None = None) -> fp8.Linear:
    """A bias-free fp8.Linear, with ``weight`` copied in when given."""
    lin = fp8.Linear(WIDTH, WIDTH, bias=False, device=device)
    if weight is not None:
        with torch.no_grad():
            lin.weight.copy_(weight)
    return lin


def cached(lin: fp8.Linear) -> fp8.weights.GemmWeight:
    """What the cache gives for the layer's own weight now (from the cache when current)."""
    return lin.weight_cache.get(lin.weight, lin.scaling)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_call_with_fresh_weights_never_uses_a_freed_weights_copy(device: str) -> None:
    torch.manual_seed(0)
    lin = fp8_linear(device)
    x = torch.randn(ROWS, WIDTH, device=device)
    calls, wrong, addresses = 32, [], set()
    for i in range(calls):
        w = torch.empty(WIDTH, WIDTH, device=device).normal_()
        fresh = fp8_linear(device, w)
        want = fresh(x)
        assert torch.equal(want, fresh(x)), "the plain FP8 layer does not repeat itself"
        got = torch.func.functional_call(lin, {"weight": w}, (x,))
        addresses.add(w.data_ptr())
        if not torch.equal(got, want):
            wrong.append(i)
        del w, got, want, fresh
    # A fresh weight that lands where a freed one was, with the same version (0), is the case the
    # cache used to get wrong: without such reuse the test proves nothing.
    assert len(addresses) < calls, "no fresh weight reused a freed weight's address: the test proves nothing"
    assert not wrong, (
        f"functional_call with a fresh weight computed with another weight's FP8 copy in calls {wrong} "
        f"of {calls} (a freed weight had the same address and version)"
    )


def test_the_same_parameter_unchanged_is_a_hit() -> None:
    lin = fp8_linear()
    x = torch.randn(ROWS, WIDTH)
    lin(x)
    first = cached(lin)
    lin(x)
    lin(x)
    assert cached(lin) is first, "the unchanged weight was quantized again: the cache missed"


def test_an_optimizer_step_is_a_miss() -> None:
    torch.manual_seed(0)
    lin = fp8_linear()
    x = torch.randn(ROWS, WIDTH)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).square().sum().backward()
    first = cached(lin)
    opt.step()  # in place: the version counter moves, the address does not
    got = lin(x)
    assert cached(lin) is not first, "the FP8 copy of the weight before the step was used after it"
    assert torch.equal(got, fp8_linear(weight=lin.weight.detach())(x))


def test_a_data_swap_is_a_miss() -> None:
    torch.manual_seed(0)
    lin = fp8_linear()
    x = torch.randn(ROWS, WIDTH)
    lin(x)
    first, version = cached(lin), lin.weight._version
    new = torch.randn(WIDTH, WIDTH)
    lin.weight.data = new  # the same Parameter object and version, other memory
    assert lin.weight._version == version, "the version moved: the swap would not test the address"
    got = lin(x)
    assert cached(lin) is not first, "the FP8 copy of the weight swapped out through .data was used"
    assert torch.equal(got, fp8_linear(weight=new)(x))


def test_a_layer_with_a_filled_cache_pickles_and_copies_with_an_empty_one() -> None:
    # The key holds a weak reference, which pickle refuses: a copy starts empty instead, as its
    # weight is another tensor anyway.
    lin = fp8_linear()
    x = torch.randn(ROWS, WIDTH)
    want = lin(x)
    for copied in (pickle.loads(pickle.dumps(lin)), copy.deepcopy(lin)):
        assert copied.weight_cache.nbytes == 0 and copied.weight_cache.weight_layouts == "one"
        assert torch.equal(copied(x), want)
    assert cached(lin) is cached(lin)
