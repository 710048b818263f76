"""torch.compile with offloading (see offload/engine/eager.py): the context inside the compiled region
(both call shapes), the context around a compiled model, per-layer compile, and failures.

A context inside a compiled region splits the graph at every layer boundary, and inductor may
round a split graph differently from a whole one (a fusion across the boundary is gone). Two
compilations of the same code can differ too: on the H100 a layer compiled for a static length
and then recompiled with a dynamic one (automatic dynamic shapes) gives other bits than the
dynamic kernel alone, with or without offload (``.scratch`` probe of this session: hooks-only
against hooks-only differed in 135235 elements, hooks-only against offload through the same
compiled modules in none). So the reference of an offloaded run is the *same* compiled code, run
once already over every input length, with the same context offloading nothing (its size floor
raised above every tensor); the offloaded run then only lowers the floor. Any difference is the
offload's. With ``aot_eager``, which does not fuse, it is also the whole model compiled plainly.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch

import offload
from offload.models import MLPBlock, run_layers

from _util import assert_bitwise, hooks_installed, make_gpt_layers, make_mlp_layers

SHAPES = ("te", "te_step", "oa", "oa_outside")
NOTHING = 1 << 62  # a size floor no tensor reaches: the hooks run, nothing is offloaded


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, and any exception Python could only print (an
    ``Exception ignored in ...`` from a finalizer) fails it."""
    torch._dynamo.reset()
    ignored: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = ignored.append
    try:
        yield
    finally:
        sys.unraisablehook = previous
        torch._dynamo.reset()
    assert not ignored, "exceptions were ignored (printed as 'Exception ignored in'): " + "; ".join(
        f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}" for u in ignored
    )


def layernorm_layers(n: int = 3, width: int = 32, device: str = "cpu") -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(MLPBlock(width, device=device) for _ in range(n))


def grads_of(layers: torch.nn.ModuleList, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    (out.float() ** 2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def compiled_step(shape: str, layers: torch.nn.ModuleList, backend: str, offloaded: int, device: str) -> tuple[Callable[[torch.Tensor], list[torch.Tensor]], Any]:
    """A training step that compiles the forward with the offload context in ``shape``, and the
    context (whose ``stats`` say what was offloaded), which offloads every tensor until its
    policy's ``min_offload_bytes`` is raised (the reference: the same hooks, nothing offloaded).

    te: ``with ctx`` per layer inside the compiled function; te_step: the same with the backward
    inside too; oa: ``with OffloadActivations`` inside the compiled function; oa_outside: it
    around the call of a compiled model.
    """
    n = len(layers)
    options = dict(device=device, min_offload_bytes=0, group_bytes=0)  # a group per layer, counted below
    if shape.startswith("te"):
        ctx, sync = offload.get_cpu_offload_context(True, num_layers=offloaded, model_layers=n, **options)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return run_layers(layers, x, ctx, sync)

        if shape == "te_step":
            def whole_step(x: torch.Tensor) -> list[torch.Tensor]:
                return grads_of(layers, x, forward(x))

            compiled = torch.compile(whole_step, backend=backend)
            return (lambda x: compiled(x)), ctx
        compiled = torch.compile(forward, backend=backend)
        return (lambda x: grads_of(layers, x, compiled(x))), ctx
    oa = offload.OffloadActivations(layers, num_offload_layers=offloaded, **options)
    if shape == "oa":
        def forward_oa(x: torch.Tensor) -> torch.Tensor:
            with oa:
                return run_layers(layers, x)

        compiled = torch.compile(forward_oa, backend=backend)
        return (lambda x: grads_of(layers, x, compiled(x))), oa
    model = torch.compile(lambda x: run_layers(layers, x), backend=backend)

    def around(x: torch.Tensor) -> list[torch.Tensor]:
        with oa:
            out = model(x)
        return grads_of(layers, x, out)

    return around, oa


def inputs(device: str, width: int) -> list[torch.Tensor]:
    # Two steps of different lengths: the second recompiles with a dynamic sequence dimension.
    torch.manual_seed(1)
    return [torch.randn(2, t, width, device=device) for t in (8, 12)]


def run_steps(step: Callable[[torch.Tensor], list[torch.Tensor]], layers: torch.nn.ModuleList, xs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    results = []
    for x in xs:
        for p in layers.parameters():
            p.grad = None
        results.append(step(x.clone().requires_grad_(True)))
    return results


def check_compiled_offload(shape: str, layers: torch.nn.ModuleList, backend: str, device: str, width: int) -> None:
    xs = inputs(device, width)
    n = len(layers)
    step, context = compiled_step(shape, layers, backend, n - 1, device)
    policy = context.engine.policy
    policy.min_offload_bytes = NOTHING  # the reference: the same hooks, nothing offloaded
    run_steps(step, layers, xs)  # compiles for every length (the second recompiles dynamic)
    expected = run_steps(step, layers, xs)
    for a, b in zip(expected, run_steps(step, layers, xs)):  # the reference repeats itself
        assert_bitwise(a, b)
    assert context.stats["offloaded_tensors"] == 0
    if backend == "aot_eager":
        plain = torch.compile(lambda x: run_layers(layers, x), backend=backend)
        for a, b in zip(expected, run_steps(lambda x: grads_of(layers, x, plain(x)), layers, xs)):
            assert_bitwise(b, a)
    policy.min_offload_bytes = 0
    for x, want in zip(xs, expected):
        got = run_steps(step, layers, [x])[0]
        assert_bitwise(want, got)
        stats = context.stats
        assert stats["offloaded_tensors"] > 0 and stats["reloads"] == n - 1, stats
        assert not hooks_installed()


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_forward_with_context_offloads_and_is_bitwise(shape: str) -> None:
    check_compiled_offload(shape, make_mlp_layers(3, 32), "aot_eager", "cpu", 32)


@pytest.mark.parametrize("shape", ["te", "oa_outside"])
def test_inductor_with_layernorm_and_dynamic_shapes(shape: str) -> None:
    # The report's second case: a LayerNorm (the policy once failed on t.nbytes with symbolic
    # shapes, traced by Dynamo).
    check_compiled_offload(shape, layernorm_layers(3, 32), "inductor", "cpu", 32)


@pytest.mark.parametrize("api", ["te", "oa"])
def test_per_layer_compile_with_context_outside(api: str) -> None:
    layers = make_mlp_layers(3, 32)
    compiled = torch.nn.ModuleList(torch.compile(layer, backend="aot_eager") for layer in layers)
    xs = inputs("cpu", 32)
    plain = run_steps(lambda x: grads_of(layers, x, run_layers(compiled, x)), layers, xs)
    assert all(torch.equal(a, b) for g, h in zip(plain, run_steps(lambda x: grads_of(layers, x, run_layers(compiled, x)), layers, xs)) for a, b in zip(g, h))
    if api == "te":
        ctx, sync = offload.get_cpu_offload_context(True, num_layers=2, model_layers=3, device="cpu", min_offload_bytes=0, group_bytes=0)
        step = lambda x: grads_of(layers, x, run_layers(compiled, x, ctx, sync))  # noqa: E731
        context: Any = ctx
    else:
        # The compiled wrappers are the layers the model calls; their hooks fire around them.
        oa = offload.OffloadActivations(compiled, device="cpu", min_offload_bytes=0, group_bytes=0)

        def step(x: torch.Tensor) -> list[torch.Tensor]:
            with oa:
                out = run_layers(compiled, x)
            return grads_of(layers, x, out)

        context = oa
    for x, want in zip(xs, plain):
        assert_bitwise(want, run_steps(step, layers, [x])[0])
        assert context.stats["offloaded_tensors"] > 0 and context.stats["reloads"] == 2, context.stats
    assert not hooks_installed()


def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("backend refused the graph")


@pytest.mark.parametrize("shape", SHAPES)
def test_failed_compile_leaves_no_hooks_and_the_context_usable(shape: str) -> None:
    layers = make_mlp_layers(3, 32)
    x = inputs("cpu", 32)[0]
    step, context = compiled_step(shape, layers, failing_backend, 2, "cpu")
    with pytest.raises(Exception, match="backend refused the graph"):
        run_steps(step, layers, [x])
    assert not hooks_installed(), "a failed compiled run left saved-tensor hooks installed"
    # The same context, eagerly, is exact and offloads.
    expected = run_steps(lambda z: grads_of(layers, z, run_layers(layers, z)), layers, [x])[0]
    if shape.startswith("te"):
        eager_step = lambda z: grads_of(layers, z, run_layers(layers, z, context))  # noqa: E731 (reloads on demand)
    else:
        def eager_step(z: torch.Tensor) -> list[torch.Tensor]:
            with context:
                out = run_layers(layers, z)
            return grads_of(layers, z, out)
    assert_bitwise(expected, run_steps(eager_step, layers, [x])[0])
    assert context.stats["offloaded_tensors"] > 0 and not hooks_installed()


def test_fullgraph_compile_around_a_layer_boundary_says_to_compile_per_layer() -> None:
    layers = make_mlp_layers(3, 32)
    oa = offload.OffloadActivations(layers, device="cpu", min_offload_bytes=0)
    model = torch.compile(lambda x: run_layers(layers, x), backend="aot_eager", fullgraph=True)
    x = inputs("cpu", 32)[0].requires_grad_(True)
    with pytest.raises(Exception, match=r"compile each layer \(torch.compile\(layer\)\)"):
        with oa:
            model(x)
    assert not hooks_installed()


# -- GPU -------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("shape", ["te", "oa", "oa_outside"])
def test_gpu_compiled_forward_with_context_offloads_and_is_bitwise(repeatable_attention, backend: str, shape: str) -> None:
    check_compiled_offload(shape, make_gpt_layers(3, 64, device="cuda"), backend, "cuda", 64)


@pytest.mark.cuda
def test_gpu_per_layer_inductor_with_context_outside(repeatable_attention) -> None:
    layers = make_gpt_layers(3, 64, device="cuda")
    compiled = torch.nn.ModuleList(torch.compile(layer) for layer in layers)
    xs = inputs("cuda", 64)
    ctx, sync = offload.get_cpu_offload_context(True, num_layers=2, model_layers=3, min_offload_bytes=NOTHING, group_bytes=0)

    def step(z: torch.Tensor) -> list[torch.Tensor]:
        return grads_of(layers, z, run_layers(compiled, z, ctx, sync))

    run_steps(step, layers, xs)  # compiles for both lengths (see the module notes)
    plain = run_steps(step, layers, xs)
    for a, b in zip(plain, run_steps(step, layers, xs)):
        assert_bitwise(a, b)
    assert ctx.stats["offloaded_tensors"] == 0
    ctx.engine.policy.min_offload_bytes = 0
    for x, want in zip(xs, plain):
        assert_bitwise(want, run_steps(step, layers, [x])[0])
        assert ctx.stats["offloaded_tensors"] > 0 and ctx.stats["reloads"] == 2, ctx.stats
