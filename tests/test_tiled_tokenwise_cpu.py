"""Tiled token-wise modules (offload.tiling.tokenwise): an MLP run over chunks of tokens, forward
and backward. One chunk is bitwise the plain module; several are bitwise repeatable, within a
measured tolerance of the plain module, and bitwise equal with and without a checkpoint or an
offload context around them. Errors are clear; copies of a wrapped model work."""

from __future__ import annotations

import copy
import pickle
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload.tiling.tokenwise import TiledForward, tile_tokenwise, tiled_tokenwise, tokenwise_support

from _util import hooks_installed, rel_err

HIDDEN, INTER = 64, 160
SHAPE = (2, 37, HIDDEN)  # 74 tokens: chunks of 16 leave a last chunk of 10

# Relative L2 error allowed against the plain module with several chunks. On CPU a GEMM's kernel
# (and its order of summation over the hidden dim) depends on how many rows it gets, so even
# outputs and input gradients are not bitwise; weight gradients are also summed chunk by chunk.
# Measured (torch 2.13, x86 CPU): float32 <= 3.7e-7 (about 3 ulp-relative), bfloat16 <= 3.6e-3
# (about one bf16 rounding, 2^-8, on part of the elements). The bounds leave headroom for other
# CPUs' kernels.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def llama_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu")
    torch.manual_seed(0)
    return transformers.models.llama.modeling_llama.LlamaMLP(config).to(dtype)


def gelu_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)).to(dtype)


MODELS = {"llama": llama_mlp, "gelu": gelu_mlp}


def inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the gradient fed to the output (random, so every row's gradient differs)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)


Run = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, run: Optional[Run] = None,
         x_grad: bool = True) -> list[Optional[torch.Tensor]]:
    """Output, x's gradient, then every parameter's gradient (None where it has none)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x_grad)
    y = run(module, x) if run is not None else module(x)
    y.backward(grad)
    return [y.detach(), x.grad] + [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def tiled(chunk: int) -> Run:
    """Run a module through tiled_tokenwise with all its parameters."""
    return lambda m, x: tiled_tokenwise(m, x, list(m.parameters()), chunk)


def assert_same(expected: list, got: list) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert (a is None) == (b is None), f"item {i}: expected {'None' if a is None else 'a tensor'}, got {b!r:.40}"
        if a is not None and not torch.equal(a, b):
            raise AssertionError(f"item {i} (shape {tuple(a.shape)}) differs in {int((a != b).sum())} elements; "
                                 f"max abs diff {(a.float() - b.float()).abs().max().item()}")


def assert_close(expected: list, got: list, tol: float) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert (a is None) == (b is None), f"item {i}: expected {'None' if a is None else 'a tensor'}, got {b!r:.40}"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, \
                f"item {i}: got {b.dtype} {tuple(b.shape)}, expected {a.dtype} {tuple(a.shape)}"
            err = rel_err(b, a)
            assert err <= tol, f"item {i} (shape {tuple(a.shape)}): relative error {err:.3g} above {tol:g}"


def repeated(fn: Callable[[], list]) -> list:
    """fn's result, once it is seen to repeat itself bit for bit."""
    first = fn()
    assert_same(first, fn())
    return first


# -- the function ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("chunk", [16, 5])
def test_several_chunks_repeat_bitwise_and_match_the_plain_module(model: str, dtype: torch.dtype, chunk: int) -> None:
    module, (x, grad) = MODELS[model](dtype), inputs(dtype)
    expected = repeated(lambda: step(module, x, grad))
    got = repeated(lambda: step(module, x, grad, tiled(chunk)))
    assert_close(expected, got, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("chunk", [74, 1000])
def test_one_chunk_is_bitwise_the_plain_module(model: str, dtype: torch.dtype, chunk: int) -> None:
    module, (x, grad) = MODELS[model](dtype), inputs(dtype)
    expected = repeated(lambda: step(module, x, grad))
    assert_same(expected, step(module, x, grad, tiled(chunk)))
    # x without a gradient: the output and every parameter's gradient as before, x's None.
    no_x = step(module, x, grad, tiled(chunk), x_grad=False)
    assert no_x[1] is None
    assert_same(expected[:1] + expected[2:], no_x[:1] + no_x[2:])


def test_each_chunk_lands_on_its_own_rows_when_the_chunk_does_not_divide_the_tokens() -> None:
    # 74 tokens in chunks of 16: the last has 10. Each chunk's output and input gradient are
    # the module's on those rows alone, bit for bit.
    module, (x, grad) = llama_mlp(), inputs()
    x_rows, g_rows = x.reshape(-1, HIDDEN), grad.reshape(-1, HIDDEN)
    out, x_grad = step(module, x, grad, tiled(16))[:2]
    for start in range(0, 74, 16):
        rows = slice(start, min(start + 16, 74))
        xc = x_rows[rows].clone().view(1, -1, HIDDEN).requires_grad_(True)
        yc = module(xc)
        yc.backward(g_rows[rows].view(yc.shape))
        assert torch.equal(out.reshape(-1, HIDDEN)[rows], yc.detach().reshape(-1, HIDDEN)), f"rows {rows} of the output"
        assert torch.equal(x_grad.reshape(-1, HIDDEN)[rows], xc.grad.reshape(-1, HIDDEN)), f"rows {rows} of x's gradient"


def test_a_non_contiguous_input_and_output_gradient() -> None:
    module, (x, grad) = gelu_mlp(), inputs()
    x, grad = x.transpose(0, 1), grad.transpose(0, 1)  # (37, 2, 64), rows interleaved in memory
    assert not x.is_contiguous()
    expected = step(module, x, grad)
    assert_close(expected, step(module, x, grad, tiled(16)), TOLERANCE[torch.float32])


def test_frozen_parameters_get_no_gradient_and_the_others_theirs() -> None:
    module, (x, grad) = llama_mlp(), inputs()
    module.gate_proj.weight.requires_grad_(False)
    expected = step(module, x, grad)
    with tile_tokenwise(module, 16):  # the parameters are read at each call: frozen after wrapping too
        got = step(module, x, grad)
    assert got[2] is None
    assert_close(expected, got, TOLERANCE[torch.float32])


def test_x_without_grad_gives_parameter_gradients_only() -> None:
    module, (x, grad) = gelu_mlp(), inputs()
    expected = step(module, x, grad, x_grad=False)
    got = step(module, x, grad, tiled(16), x_grad=False)
    assert got[1] is None and all(g is not None for g in got[2:])
    assert_close(expected, got, TOLERANCE[torch.float32])


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def test_only_the_middle_of_three_layers_tiled() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Residual(llama_mlp()) for _ in range(3)))
    for i, layer in enumerate(model):  # three different MLPs
        with torch.no_grad():
            for p in layer.parameters():
                p.mul_(1 + i / 4)
    x, grad = inputs()
    expected = repeated(lambda: step(model, x, grad))
    with tile_tokenwise(model[1].inner, 16):
        got = repeated(lambda: step(model, x, grad))
        assert [type(layer.inner.__dict__.get("forward")).__name__ for layer in model] == ["NoneType", "TiledForward", "NoneType"]
    assert_close(expected, got, TOLERANCE[torch.float32])


# -- the installed wrapper ------------------------------------------------------------------

def test_wrapper_tiles_only_grad_calls_of_one_tensor_with_more_rows_than_the_chunk() -> None:
    module, (x, _) = llama_mlp(), inputs()
    plain = module(x)
    with tile_tokenwise(module, 16):
        wrapper = module.__dict__["forward"]
        assert wrapper.module is module and wrapper.chunk == 16 and wrapper.fn.__func__ is type(module).forward
        assert type(module(x).grad_fn).__name__ == "_TiledTokenwiseBackward"
        with torch.no_grad():
            assert torch.equal(module(x), plain.detach())  # no grad: the plain forward
        assert torch.equal(module(x[:, :8]), module.__class__.forward(module, x[:, :8]))  # 16 rows fit one chunk
        assert module(x[:, :8]).grad_fn is not None and "Tiled" not in type(module(x[:, :8]).grad_fn).__name__
        assert "Tiled" not in type(module(x[0, 0]).grad_fn).__name__  # one dim: not tokens
        wrapper.chunk = lambda: 0  # a plan's "not this call"
        assert torch.equal(module(x), plain) and "Tiled" not in type(module(x).grad_fn).__name__
        wrapper.chunk = lambda: 20
        assert type(module(x).grad_fn).__name__ == "_TiledTokenwiseBackward"


def test_non_tensor_keyword_arguments_pass_through_and_tensor_ones_run_plainly() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x: torch.Tensor, scale: object = 1.0) -> torch.Tensor:
            return self.fc(x) * scale

    module, (x, _) = Scaled(), inputs()
    with tile_tokenwise(module, 16):
        y = module(x, scale=2.0)
        assert type(y.grad_fn).__name__ == "_TiledTokenwiseBackward"
        assert rel_err(y, Scaled.forward(module, x, 2.0)) < TOLERANCE[torch.float32]
        s = torch.tensor(3.0)
        assert "Tiled" not in type(module(x, scale=s).grad_fn).__name__


def test_parameter_gradients_accumulate_once_per_backward() -> None:
    # DDP/FSDP reduce on these hooks: once per chunk would reduce a partial gradient.
    module, (x, grad) = llama_mlp(), inputs()
    fired = {name: 0 for name, _ in module.named_parameters()}
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.__setitem__(name, fired[name] + 1))
    with tile_tokenwise(module, 5):  # 15 chunks
        step(module, x, grad)
        assert set(fired.values()) == {1}, fired
        module(x).backward(grad)
    assert set(fired.values()) == {2}, fired


class Block(nn.Module):
    """A small pre-norm decoder block: causal attention, then the MLP, each with a residual."""

    def __init__(self, mlp: nn.Module, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm2 = nn.RMSNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.norm2(x))


def blocks(n: int) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(llama_mlp()) for _ in range(n))
    with torch.no_grad():
        for i, p in enumerate(layers.parameters()):
            p.add_(torch.randn(p.shape) * 0.01 * i)  # no two layers alike
    return layers


def rows_seen(module: nn.Linear) -> list[int]:
    """Row counts of every input ``module`` gets from now on."""
    seen: list[int] = []
    module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel() // args[0].shape[-1]))
    return seen


def test_inside_a_whole_layer_checkpoint() -> None:
    layers, (x, grad) = blocks(1), inputs()
    block = layers[0]
    untiled = repeated(lambda: step(block, x, grad))
    with tile_tokenwise(block.mlp, 16):
        direct = repeated(lambda: step(block, x, grad))
        seen = rows_seen(block.mlp.down_proj)
        in_checkpoint = repeated(lambda: step(block, x, grad, lambda m, z: checkpoint(m, z, use_reentrant=False)))
    # The checkpoint's forward, its recompute and the tiled backward all ran chunks, never 74 rows.
    assert seen and max(seen) <= 16, f"the MLP saw inputs of {sorted(set(seen))} rows under the checkpoint"
    assert_same(direct, in_checkpoint)
    assert_close(untiled, in_checkpoint, TOLERANCE[torch.float32])


def test_with_the_offload_engine_bitwise_as_without() -> None:
    layers, (x, grad) = blocks(2), inputs()

    def run(context: Optional[offload.OffloadActivations]) -> list[Optional[torch.Tensor]]:
        def forward(model: nn.Module, z: torch.Tensor) -> torch.Tensor:
            if context is None:
                return layers[1](layers[0](z))
            with context:
                return layers[1](layers[0](z))
        return step(layers, x, grad, forward)

    with tile_tokenwise([layer.mlp for layer in layers], 16):
        expected = repeated(lambda: run(None))
        oa = offload.OffloadActivations(layers, num_offload_layers=1, device="cpu", min_offload_bytes=0)
        try:
            got = run(oa)
            stats = oa.stats
        finally:
            oa.close()
    assert_same(expected, got)
    # Layer 0's saved tensors (the tiled MLP's input among them) went to host and came back.
    assert stats["offloaded_tensors"] >= 1 and stats["reloads"] >= 1, stats
    assert not hooks_installed()


def test_the_mlp_input_is_the_one_tensor_saved_through_the_hooks() -> None:
    module, (x, _) = llama_mlp(), inputs()
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    xin = x.clone().requires_grad_(True)
    with tile_tokenwise(module, 16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(xin)
    assert len(seen) == 1 and seen[0] is xin


def test_under_autocast() -> None:
    module, (x, grad) = llama_mlp(), inputs()

    def cast(run: Optional[Run]) -> Run:
        def go(m: nn.Module, z: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(m, z) if run is not None else m(z)
        return go

    expected = repeated(lambda: step(module, x, grad.bfloat16(), cast(None)))
    assert expected[0].dtype == torch.bfloat16
    # One chunk: bitwise, which needs backward's recompute under the forward's autocast (a
    # float32 recompute would give other gradients).
    assert_same(expected, step(module, x, grad.bfloat16(), cast(tiled(74))))
    got = repeated(lambda: step(module, x, grad.bfloat16(), cast(tiled(16))))
    assert_close(expected, got, TOLERANCE[torch.bfloat16])


def test_a_parameter_changed_between_forward_and_backward_is_refused() -> None:
    module, (x, grad) = llama_mlp(), inputs()
    with tile_tokenwise(module, 16):
        y = module(x.requires_grad_(True))
        with torch.no_grad():
            module.up_proj.weight.mul_(2)
        with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
            y.backward(grad)


# -- refusals, removal, copies ----------------------------------------------------------------

def test_dropout_is_refused_while_it_drops() -> None:
    module = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Dropout(0.1), nn.Linear(HIDDEN, HIDDEN))
    ok, why = tokenwise_support(module)
    assert not ok and "'1'" in why and "Dropout" in why
    with pytest.raises(ValueError, match="cannot be tiled: .*drops out in training mode"):
        tile_tokenwise(module, 16)
    assert "forward" not in module.__dict__
    module.eval()
    ok, why = tokenwise_support(module)
    assert ok and "caller's promise" in why
    with tile_tokenwise(module, 16):
        module.train()  # trained after wrapping: the call refuses
        with pytest.raises(RuntimeError, match="drops out"):
            module(inputs()[0])
    assert tokenwise_support(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)))[0]


def test_bad_arguments_are_refused_clearly() -> None:
    a, b = llama_mlp(), gelu_mlp()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        tile_tokenwise(a, 0)
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        tile_tokenwise(a, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        tile_tokenwise(a, True)
    with pytest.raises(TypeError, match="item 1 is a str, not a torch.nn.Module"):
        tile_tokenwise([a, "mlp"], 16)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="takes a module or an iterable of modules"):
        tile_tokenwise(3, 16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="listed twice"):
        tile_tokenwise([a, b, a], 16)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        tiled_tokenwise(a, inputs()[0], list(a.parameters()), 0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        tiled_tokenwise(a, torch.randn(HIDDEN), list(a.parameters()), 4)
    assert all("forward" not in m.__dict__ for m in (a, b))  # nothing half-installed
    with tile_tokenwise(a, 16):
        with pytest.raises(ValueError, match="item 0 .* is tiled already"):
            tile_tokenwise(a, 8)
    b.forward = lambda x: x  # someone else's override
    with pytest.raises(ValueError, match="forward set on the instance by other code"):
        tile_tokenwise(b, 16)


def test_remove_restores_the_class_forward_and_is_idempotent() -> None:
    module, (x, grad) = gelu_mlp(), inputs()
    expected = step(module, x, grad)
    wrapped = tile_tokenwise([module], 16)
    assert isinstance(module.__dict__["forward"], TiledForward)
    wrapped.remove()
    wrapped.remove()
    assert "forward" not in module.__dict__
    assert_same(expected, step(module, x, grad))
    with tile_tokenwise(module, 16):
        pass
    assert "forward" not in module.__dict__


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_model_carries_a_working_wrapper(how: str) -> None:
    layers, (x, grad) = blocks(1), inputs()
    with tile_tokenwise(layers[0].mlp, 16):
        expected = step(layers, x, grad, lambda m, z: m[0](z))
        layers[0].mlp.__dict__["forward"].chunk = 16
        twin = copy.deepcopy(layers) if how == "deepcopy" else pickle.loads(pickle.dumps(layers))
    wrapper = twin[0].mlp.__dict__["forward"]
    assert isinstance(wrapper, TiledForward) and wrapper.chunk == 16
    assert wrapper.module is twin[0].mlp and wrapper.fn.__self__ is twin[0].mlp
    assert type(twin[0](x.requires_grad_(True)).grad_fn).__name__ == "AddBackward0"
    assert type(twin[0].mlp(x).grad_fn).__name__ == "_TiledTokenwiseBackward"
    assert_same(expected, step(twin, x, grad, lambda m, z: m[0](z)))
    for p in twin.parameters():  # the copy's weights are its own
        assert all(p is not q for q in layers.parameters())


def test_a_callable_chunk_becomes_plain_in_a_copy() -> None:
    module, (x, _) = llama_mlp(), inputs()
    with tile_tokenwise(module, 16):
        module.__dict__["forward"].chunk = lambda: 16
        twin = copy.deepcopy(module)
        assert type(module(x).grad_fn).__name__ == "_TiledTokenwiseBackward"
    assert twin.__dict__["forward"].chunk == 0
    assert "Tiled" not in type(twin(x.requires_grad_(True)).grad_fn).__name__
