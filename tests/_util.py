"""Helpers shared by the engine tests: models, one training step, bitwise gradient checks."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

import offload
from offload.models import GPTBlock, LinearGELU, run_layers


def make_gpt_layers(n: int = 4, hidden: int = 64, heads: int = 4, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.ModuleList:
    """A stack of small GPT blocks with fixed weights."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList(GPTBlock(hidden, heads, device=device, dtype=dtype) for _ in range(n))


def make_mlp_layers(n: int = 4, width: int = 64, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.ModuleList:
    """A stack of Linear+GELU layers with fixed weights."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList(LinearGELU(width, device=device, dtype=dtype) for _ in range(n))


def train_step(layers: torch.nn.ModuleList, x: torch.Tensor, context: Any = None, sync: Optional[Callable] = None, *, retain_graph: bool = False, scale_input: bool = False) -> list[torch.Tensor]:
    """Forward in TransformerEngine's call shape, backward, and the gradients (input grad last).

    ``scale_input``: multiply the input by 1.0 before the first layer, so that layer 0 saves an
    activation like every other layer (not the leaf input, which is kept): all groups then have
    the same size, which v1's double buffering needs.
    """
    for p in layers.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    out = run_layers(layers, x * 1.0 if scale_input else x, context, sync)
    loss = (out.float() ** 2).mean()
    loss.backward(retain_graph=retain_graph)
    return [p.grad.clone() for p in layers.parameters() if p.requires_grad] + [x.grad.clone()]


def plain_reference(layers: torch.nn.ModuleList, x: torch.Tensor, **kw: Any) -> list[torch.Tensor]:
    """The gradients without offload, once the plain run is seen to repeat itself bit for bit
    (otherwise a bitwise comparison with an offloaded run would prove nothing)."""
    expected = train_step(layers, x, **kw)
    again = train_step(layers, x, **kw)
    assert all(torch.equal(a, b) for a, b in zip(expected, again)), "the plain run does not repeat itself"
    return expected


def hooks_installed() -> bool:
    """Whether any saved-tensor hooks are pushed on this thread (none may be left behind)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def assert_bitwise(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    """Every gradient equal bit for bit."""
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        if not torch.equal(a, b):
            diff = (a.float() - b.float()).abs()
            raise AssertionError(
                f"gradient {i} of {len(expected)} (shape {tuple(a.shape)}) differs in "
                f"{int((diff != 0).sum())} of {diff.numel()} elements (max abs diff {diff.max().item()}, "
                f"max abs value {a.float().abs().max().item()})"
            )


class Delayed(torch.nn.Module):
    """Puts a ``torch.cuda._sleep`` on the compute stream before the wrapped layer's kernels."""

    def __init__(self, layer: torch.nn.Module, cycles: int) -> None:
        super().__init__()
        self.layer, self.cycles = layer, cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.layer(x)


def cpu_context(num_layers: int, model_layers: int, **kw: Any) -> tuple[Any, ...]:
    """A host-transport context that offloads every eligible tensor, however small.

    Its tiny layers stand in for real ones, which save more than ``group_bytes`` each: so every
    layer is a group of its own (``group_bytes=0``) unless a test asks for sharing.
    """
    kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("group_bytes", 0)
    return offload.get_cpu_offload_context(True, num_layers=num_layers, model_layers=model_layers, device="cpu", **kw)


def sleepy(ctx: Any, cycles: int) -> None:
    """Delay the D2H and H2D streams of ``ctx``'s engine before every copy they run."""
    engine = ctx.engine
    transport = engine.transport
    offload_copy, reload_copy = transport.offload, transport.reload

    def slow_offload(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.stream(transport.d2h_stream):
            torch.cuda._sleep(cycles)
        return offload_copy(*args, **kwargs)

    def slow_reload(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.stream(transport.h2d_stream):
            torch.cuda._sleep(cycles)
        return reload_copy(*args, **kwargs)

    transport.offload, transport.reload = slow_offload, slow_reload


def oa_step(layers: torch.nn.Module, x: torch.Tensor, wrapper: Any, *, run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list[torch.Tensor]:
    """One training step with ``wrapper`` (an ``OffloadActivations``) around the forward; the
    gradients as :func:`train_step` returns them. ``run``: the forward (default: the layers in
    order), e.g. a compiled one."""
    for p in layers.parameters():
        p.grad = None
    xin = x.detach().requires_grad_(True)
    with wrapper:
        out = run(xin) if run is not None else run_layers(layers, xin)
    (out.float() ** 2).mean().backward()
    return [p.grad.clone() for p in layers.parameters()] + [xin.grad.clone()]


def tiny_llama(layers: int = 3, device: str = "cpu") -> tuple[Any, torch.Tensor]:
    """A HuggingFace Llama with random weights (no download) and its token ids."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    return model, torch.randint(0, 128, (2, 32), device=device)


def llama_grads(model: Any, ids: torch.Tensor, wrapper: Any = None) -> list[torch.Tensor]:
    """One step of ``model`` on ``ids`` (loss on the ids), ``wrapper`` around the forward."""
    model.zero_grad(set_to_none=True)
    with wrapper if wrapper is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``ref``, in float64."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm())


def record_saved(fn: Callable[[], Any]) -> tuple[list[torch.Tensor], Any]:
    """Run ``fn`` under a pack hook; the tensors autograd saved, and fn's result."""
    seen: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


class Boom(torch.nn.Module):
    """A layer that raises while ``armed``: a forward that fails inside an offload context."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        if self.armed:
            raise RuntimeError("boom")
        return y


def peak_of(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result and the CUDA allocator's peak while it ran (synchronised around it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated()


def recompute_plan_peak(layers: torch.nn.ModuleList, x: torch.Tensor) -> tuple[int, int, str]:
    """A plan recomputing every layer but the last, made from ``profile_step`` of ``layers`` at
    ``x``: its measured peak above the base, its predicted one, and its description (one warm step
    first: allocator and pinned blocks)."""
    import gc

    from offload.planner import Action, LayerPlan, plan_for

    profile = offload.planner.profile_step(layers, lambda: train_step(layers, x))
    made = plan_for(profile, [LayerPlan(Action.RECOMPUTE)] * (len(layers) - 1) + [LayerPlan(Action.KEEP)])
    oa = offload.OffloadActivations(layers, plan=made)
    oa_step(layers, x, oa)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    oa_step(layers, x, oa)
    torch.cuda.synchronize()
    base, measured = made.profile.base_bytes, torch.cuda.max_memory_allocated()
    oa.close()
    return measured - base, made.prediction.peak_bytes - base, made.describe()


def probe_with_device_limit(monkeypatch: Any, limit: int = 1 << 50) -> None:
    """Give the auto probe a device limit, as a GPU gives one (the CPU has no device memory to
    size against, so without one it never runs the sizing step)."""
    from offload import plan_steps

    real = plan_steps.ProbeSequence
    monkeypatch.setattr(plan_steps, "ProbeSequence",
                        lambda *a, **kw: real(*a, **{**kw, "device_limit": lambda: limit}))


def slow_pinning(arena: Any, seconds: float) -> None:
    """Make ``arena`` pin each block ``seconds`` late, as a host slower to pin than a step does
    (a fresh VM's first touch of its memory): what happens meanwhile is then the same on any host."""
    import time

    pin = arena.allocate

    def slow_pin(nbytes: int) -> Any:
        time.sleep(seconds)
        return pin(nbytes)

    arena.allocate = slow_pin


def attention_kernels_in_backward(layers: torch.nn.ModuleList, x: torch.Tensor, wrapper: Any) -> int:
    """How many fused attention kernels (``ATTENTION_OPS``) really run in the backward of one
    step of ``layers`` on ``x`` with ``wrapper`` around the forward: a recompute that keeps
    attention answers its kernel from the selective checkpoint's cache, by that checkpoint's own
    dispatch mode (pushed after the counting one, so it answers first)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from offload.forwards.selective import ATTENTION_OPS

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.calls += func in ATTENTION_OPS
            return func(*args, **(kwargs or {}))

    xin = x.detach().requires_grad_(True)
    with wrapper:
        out = run_layers(layers, xin)
    counter = Count()
    with counter:
        (out.float() ** 2).mean().backward()
    return counter.calls


def wait_ready(oa: Any, timeout_s: float = 60.0) -> None:
    """Until every bucket a context plans ahead is made and its blocks pinned (what a step's
    entry polls; the ranks switch in queue order). The making and pinning run beside the steps,
    which a test's millisecond steps outrun."""
    import time

    ahead = oa._planned._ahead
    deadline = time.monotonic() + timeout_s
    while not all(entry.ready for entry in ahead.started):
        assert time.monotonic() < deadline, "the plan made ahead was not ready in time"
        ahead.poll()
        time.sleep(0.01)
