"""The reference workloads of docs/benchmarks.md, defined once and used by every benchmark.

Each spec is a small frozen dataclass; ``spec.build(device)`` returns ``(layers, make_input)``:
an ``nn.ModuleList`` (the layers in call order, reusing ``offload.models``) and a function that
returns a fresh random input that requires grad (no embedding: the first layer is fed directly).

``scale`` shrinks the sizes for CPU smoke runs (widths and sequence lengths are multiplied by it
and rounded; the number of layers never changes, so a num_layers sweep stays the same sweep).

* GPT-A: pre-LN GPT blocks, hidden 4096, 32 heads, 8 layers, batch 2, seq 4096, bf16.
* GPT-B: hidden 8192, 64 heads, 4 layers, batch 1, seq 4096, bf16.
* SMALL: 16 x (Linear 1024->1024 + GELU), 256 tokens, bf16 (CPU-bound).
* FP8-MLP: 8 x the GPT-A MLP block (LayerNorm, Linear 4h, GELU, Linear, residual) built from the
  FP8-saving layers (``FP8MLPBlock``: ``fp8.LayerNormLinear``, ``fp8.GELU``, ``fp8.Linear``,
  tensorwise), batch 2 x seq 4096 tokens; ``fp8=False`` gives the same stack as ``MLPBlock`` with
  ``nn.Linear`` in bf16 for comparison, and ``fp8_norm_act=False`` the earlier FP8 variant,
  ``MLPBlock`` with only its Linears FP8 (LayerNorm and GELU save bf16).
* LLAMA-1B / LLAMA-2B: real model code nobody here wrote, HuggingFace ``LlamaForCausalLM`` with
  random init (no download), bf16, SDPA attention, no KV cache, vocab 32000. ``LlamaSpec.build``
  returns ``(model, ids)``: the repeated layers are ``model.model.layers``, and the loss is
  ``model(input_ids=ids, labels=ids).loss`` (``llama_step``). Needs ``transformers``.
  ``hf_checkpointing(model)`` turns HF's own (non-reentrant) checkpointing on inside a ``with``.
* LONG-1B: LLAMA-1B's model at sequence 49152, batch 1 (plain does not fit on an 80 GB H100).
* LLAMA-8B-SHAPE: Llama-3-8B's shape (hidden 4096, 32 layers, vocab 128256), batch 1, seq 16384;
  ``train_norms_only(model)`` freezes the base (only the RMSNorm weights train).
* MOE: 8 MoE layers of 64 expert MLPs (Linear 512->1024, GELU, Linear 1024->512), 2048 tokens
  routed by a fixed random top-1 assignment (32 tokens per expert), bf16: a layer saves ~4 small
  tensors per expert (hundreds per layer), the shape where per-tensor CPU cost shows. Not in
  docs/benchmarks.md's list; ``host_parts.py`` (issue 12) uses it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from offload.models import FP8MLPBlock, GPTBlock, LinearGELU, MLPBlock

InputFactory = Callable[..., torch.Tensor]

# Smoke runs use this scale: sizes stay above the default 64 KiB offload threshold so the engine
# has real work to do.
SMOKE_SCALE = 1 / 16


def _scaled(n: int, scale: float, multiple: int = 16) -> int:
    """``n * scale`` rounded to a multiple of ``multiple`` (at least ``multiple``)."""
    return max(multiple, int(round(n * scale / multiple)) * multiple)


def _input_factory(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> InputFactory:
    def make_input(seed: int = 0) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=g, device=device, dtype=dtype).requires_grad_(True)

    return make_input


@dataclass(frozen=True)
class GPTSpec:
    """A stack of pre-LN GPT blocks fed a (batch, seq, hidden) input."""

    name: str
    hidden: int
    heads: int
    layers: int
    batch: int
    seq: int
    dtype: torch.dtype = torch.bfloat16

    def scaled(self, scale: float) -> "GPTSpec":
        if scale == 1:
            return self
        head_dim = self.hidden // self.heads
        hidden = _scaled(self.hidden, scale, multiple=64)
        heads = max(1, hidden // head_dim) if hidden >= head_dim else max(1, hidden // 64)
        return replace(self, hidden=hidden, heads=heads, seq=_scaled(self.seq, scale))

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def build(self, device: Any, seed: int = 0) -> tuple[nn.ModuleList, InputFactory]:
        dev = torch.device(device)
        torch.manual_seed(seed)
        layers = nn.ModuleList(GPTBlock(self.hidden, self.heads, device=dev, dtype=self.dtype) for _ in range(self.layers))
        return layers, _input_factory((self.batch, self.seq, self.hidden), dev, self.dtype)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} x GPTBlock(hidden {self.hidden}, {self.heads} heads), "
                f"batch {self.batch}, seq {self.seq}, {str(self.dtype).replace('torch.', '')}")


@dataclass(frozen=True)
class SmallSpec:
    """Many small layers: host (CPU) overhead dominates the step."""

    name: str
    width: int
    layers: int
    tokens: int
    dtype: torch.dtype = torch.bfloat16

    def scaled(self, scale: float) -> "SmallSpec":
        if scale == 1:
            return self
        # Keep the tokens: the per-tensor CPU cost is what SMALL is about, not the FLOPs.
        return replace(self, width=_scaled(self.width, scale * 4, multiple=64))

    def build(self, device: Any, seed: int = 0) -> tuple[nn.ModuleList, InputFactory]:
        dev = torch.device(device)
        torch.manual_seed(seed)
        layers = nn.ModuleList(LinearGELU(self.width, device=dev, dtype=self.dtype) for _ in range(self.layers))
        return layers, _input_factory((self.tokens, self.width), dev, self.dtype)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} x (Linear {self.width}->{self.width} + GELU), "
                f"{self.tokens} tokens, {str(self.dtype).replace('torch.', '')}")


def fp8_linear_factory(scaling: str = "tensorwise") -> Callable[..., nn.Module]:
    """``offload.fp8.Linear`` with the given scaling, imported lazily (it may be absent)."""
    from offload.fp8 import Linear  # noqa: PLC0415 - lazy on purpose

    return functools.partial(Linear, scaling=scaling)


@dataclass(frozen=True)
class MLPSpec:
    """A stack of the GPT-A MLP half (LayerNorm, 4h MLP with GELU, residual).

    ``fp8``: FP8 GEMMs; then ``fp8_norm_act`` picks the block: ``FP8MLPBlock`` (the LayerNorm
    fused into the first FP8 Linear, an FP8-saving GELU) or ``MLPBlock`` with ``fp8.Linear``s.
    """

    name: str
    hidden: int
    layers: int
    batch: int
    seq: int
    fp8: bool
    scaling: str = "tensorwise"
    dtype: torch.dtype = torch.bfloat16
    fp8_norm_act: bool = True

    def scaled(self, scale: float) -> "MLPSpec":
        if scale == 1:
            return self
        return replace(self, hidden=_scaled(self.hidden, scale, multiple=64), seq=_scaled(self.seq, scale))

    def build(self, device: Any, seed: int = 0) -> tuple[nn.ModuleList, InputFactory]:
        dev = torch.device(device)
        torch.manual_seed(seed)
        if self.fp8 and self.fp8_norm_act:
            layers = nn.ModuleList(
                FP8MLPBlock(self.hidden, scaling=self.scaling, device=dev, dtype=self.dtype) for _ in range(self.layers)
            )
        else:
            linear: Callable[..., nn.Module] = fp8_linear_factory(self.scaling) if self.fp8 else nn.Linear
            layers = nn.ModuleList(MLPBlock(self.hidden, linear=linear, device=dev, dtype=self.dtype) for _ in range(self.layers))
        return layers, _input_factory((self.batch, self.seq, self.hidden), dev, self.dtype)

    def describe(self) -> str:
        if not self.fp8:
            block = f"MLPBlock(hidden {self.hidden}, nn.Linear)"
        elif self.fp8_norm_act:
            block = f"FP8MLPBlock(hidden {self.hidden}, fp8.LayerNormLinear + fp8.GELU + fp8.Linear, {self.scaling})"
        else:
            block = f"MLPBlock(hidden {self.hidden}, fp8.Linear ({self.scaling}); LayerNorm and GELU save bf16)"
        return (f"{self.name}: {self.layers} x {block}, batch {self.batch}, "
                f"seq {self.seq}, {str(self.dtype).replace('torch.', '')}")


@dataclass(frozen=True)
class LlamaSpec:
    """A HuggingFace Llama causal LM with random weights, fed random token ids."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    batch: int
    seq: int
    vocab: int = 32000
    dtype: torch.dtype = torch.bfloat16

    def scaled(self, scale: float) -> "LlamaSpec":
        if scale == 1.0:
            return self
        heads = max(2, int(self.heads * scale))
        kv = max(1, min(heads, int(self.kv_heads * scale)))
        while heads % kv:
            kv -= 1
        return replace(self, hidden=_scaled(self.hidden, scale, 8 * heads), intermediate=_scaled(self.intermediate, scale),
                       heads=heads, kv_heads=kv, seq=_scaled(self.seq, scale), vocab=_scaled(self.vocab, scale))

    def config(self) -> Any:
        import transformers

        cfg = transformers.LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
            max_position_embeddings=self.seq, use_cache=False,
        )
        cfg._attn_implementation = "sdpa"
        return cfg

    def build(self, device: torch.device, seed: int = 0, *, init_in_dtype: bool = False) -> tuple[nn.Module, torch.Tensor]:
        """The model (train mode, ``dtype``) and a (batch, seq) tensor of random token ids.

        ``init_in_dtype``: create the weights in ``dtype`` directly (the default dtype set around
        the constructor) instead of float32 then cast: an 8B model's float32 copy would need 32 GB
        of the GPU for a moment and leave the caching allocator fragmented. Off by default, so
        the other benchmarks keep the weights they always had."""
        import transformers

        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        if init_in_dtype:
            torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device):  # random init on the device: seconds instead of minutes
                model = transformers.LlamaForCausalLM(self.config())
        finally:
            torch.set_default_dtype(previous)
        model.to(dtype=self.dtype).train()
        g = torch.Generator(device=device).manual_seed(seed)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g, device=device)
        return model, ids

    def describe(self) -> str:
        return (f"{self.name}: HF LlamaForCausalLM, hidden {self.hidden}, intermediate {self.intermediate}, "
                f"{self.layers} layers, {self.heads}/{self.kv_heads} heads, batch {self.batch}, seq {self.seq}, "
                f"vocab {self.vocab}, {str(self.dtype).replace('torch.', '')}, sdpa")


def llama_step(model: nn.Module, ids: torch.Tensor, wrapper: Optional[Callable[[], Any]] = None) -> Callable[[], None]:
    """One training step of a Llama built by :meth:`LlamaSpec.build`: loss, backward, gradients
    dropped (no optimizer). ``wrapper``: a context manager factory put around the forward (an
    ``OffloadActivations``, ``save_on_cpu``...)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        try:
            with wrapper() if wrapper is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        finally:
            # Also when the step fails: an out-of-memory error in backward leaves some gradients
            # set, which would count in the next contender's peak.
            for p in params:
                p.grad = None

    return step


def train_norms_only(model: nn.Module) -> int:
    """Freeze every parameter but the RMSNorm weights (the base frozen, as LoRA fine-tuning leaves
    it; LLAMA-8B-SHAPE). Returns the number of parameters that still train."""
    trainable = 0
    for module in model.modules():
        norm = type(module).__name__.endswith("RMSNorm")
        for p in module.parameters(recurse=False):
            p.requires_grad_(norm)
            trainable += p.numel() if norm else 0
    return trainable


@contextlib.contextmanager
def hf_checkpointing(model: nn.Module) -> Iterator[None]:
    """HF's own activation checkpointing (non-reentrant) on ``model`` inside the ``with``, off again
    after it (also when the body raises). transformers 5.24 names it
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is its deprecated alias);
    earlier versions have only ``gradient_checkpointing_enable``. HF's enable also hooks the input
    embeddings (their output then requires grad, for reentrant checkpointing's sake) and its disable
    leaves that hook on: it is taken off here too, unless the model had it before."""
    had_input_hook = bool(getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None))
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "activation_checkpointing_kwargs" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        disable = model.activation_checkpointing_disable
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = model.gradient_checkpointing_disable
    try:
        yield
    finally:
        disable()
        # Older versions add the hook for PEFT models only, and their disable_input_require_grads
        # fails without one: remove it only where this enable added it.
        added = getattr(model, "_require_grads_hooks", None) or getattr(model, "_require_grads_hook", None)
        if added and not had_input_hook:
            model.disable_input_require_grads()


class MoELayer(nn.Module):
    """A mixture-of-experts MLP layer with a frozen routing: each expert, a small MLP, runs on its
    own fixed slice of the tokens (a random top-1 assignment drawn once, the same count each).

    Per expert autograd saves the gathered tokens, the GELU input, the second Linear's input and
    the gather index (each its own storage), so one layer saves ``4 * experts + 1`` activations:
    many small tensors in one layer's group. No router GEMM or load balancing: the routing is not
    what is measured.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, tokens: int, *, seed: int, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if tokens < experts:
            raise ValueError(f"MoELayer: {tokens} tokens cannot feed {experts} experts")
        kw = {"device": device, "dtype": dtype}
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn, **kw), nn.GELU(), nn.Linear(ffn, hidden, **kw)) for _ in range(experts)
        )
        order = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))
        # Constants, not buffers: nothing should move or save them with the module. Cloned so that
        # each index is its own storage, as a real router's per-expert indices are.
        self.routes = [chunk.clone().to(device) for chunk in order.tensor_split(experts)]
        self.inverse = torch.argsort(order).to(device)  # concatenated expert outputs -> token order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([expert(x.index_select(0, idx)) for expert, idx in zip(self.experts, self.routes)])
        return x + y.index_select(0, self.inverse)


@dataclass(frozen=True)
class MoESpec:
    """A stack of :class:`MoELayer` fed (tokens, hidden): host-bound, hundreds of saved tensors a layer."""

    name: str
    hidden: int
    ffn: int
    experts: int
    layers: int
    tokens: int
    dtype: torch.dtype = torch.bfloat16

    def scaled(self, scale: float) -> "MoESpec":
        if scale == 1:
            return self
        # Keep the experts (the tensor count is what MOE is about); shrink the widths, and the
        # tokens down to a few per expert (64 tiny GEMMs a layer are slow on a CPU).
        tokens = max(2 * self.experts, int(self.tokens * scale))
        return replace(self, hidden=_scaled(self.hidden, scale, 16), ffn=_scaled(self.ffn, scale, 16), tokens=tokens)

    @property
    def expert_tokens(self) -> int:
        """Tokens per expert (the largest slice when they do not divide evenly)."""
        return -(-self.tokens // self.experts)

    def build(self, device: Any, seed: int = 0) -> tuple[nn.ModuleList, InputFactory]:
        dev = torch.device(device)
        torch.manual_seed(seed)
        layers = nn.ModuleList(
            MoELayer(self.hidden, self.ffn, self.experts, self.tokens, seed=seed + i, device=dev, dtype=self.dtype)
            for i in range(self.layers)
        )
        return layers, _input_factory((self.tokens, self.hidden), dev, self.dtype)

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} x MoE layer ({self.experts} experts of Linear {self.hidden}->{self.ffn} + GELU "
                f"+ Linear {self.ffn}->{self.hidden}, fixed random top-1 routing, {self.expert_tokens} tokens each), "
                f"{self.tokens} tokens, {str(self.dtype).replace('torch.', '')}")


def moe(scale: float = 1.0) -> MoESpec:
    return MoESpec("MOE", hidden=512, ffn=1024, experts=64, layers=8, tokens=2048).scaled(scale)


def llama_1b(scale: float = 1.0) -> LlamaSpec:
    return LlamaSpec("LLAMA-1B", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, batch=4, seq=4096).scaled(scale)


def long_1b(scale: float = 1.0) -> LlamaSpec:
    """LLAMA-1B's model at sequence 49152, batch 1 (``scale`` shrinks it as LLAMA-1B's)."""
    return replace(llama_1b(scale), name="LONG-1B", batch=1, seq=_scaled(49152, scale))


def llama_8b_shape(scale: float = 1.0) -> LlamaSpec:
    """LLAMA-8B-SHAPE: Llama-3-8B's shape, batch 1, seq 16384 (freeze it with
    :func:`train_norms_only`; build it with ``init_in_dtype=True``)."""
    return LlamaSpec("LLAMA-8B-SHAPE", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, batch=1,
                     seq=16384, vocab=128256).scaled(scale)


def llama_2b(scale: float = 1.0) -> LlamaSpec:
    return LlamaSpec("LLAMA-2B", hidden=4096, intermediate=14336, layers=8, heads=64, kv_heads=16, batch=2, seq=4096).scaled(scale)


def gpt_a(scale: float = 1.0) -> GPTSpec:
    return GPTSpec("GPT-A", hidden=4096, heads=32, layers=8, batch=2, seq=4096).scaled(scale)


def gpt_b(scale: float = 1.0) -> GPTSpec:
    return GPTSpec("GPT-B", hidden=8192, heads=64, layers=4, batch=1, seq=4096).scaled(scale)


def small(scale: float = 1.0) -> SmallSpec:
    return SmallSpec("SMALL", width=1024, layers=16, tokens=256).scaled(scale)


def fp8_mlp(scale: float = 1.0, *, fp8: bool = True, scaling: str = "tensorwise", fp8_norm_act: bool = True) -> MLPSpec:
    name = ("FP8-MLP" if fp8_norm_act else "FP8-LINEAR-MLP") if fp8 else "BF16-MLP"
    return MLPSpec(
        name, hidden=4096, layers=8, batch=2, seq=4096, fp8=fp8, scaling=scaling, fp8_norm_act=fp8_norm_act
    ).scaled(scale)


WORKLOADS: dict[str, Callable[..., Any]] = {
    "gpt_a": gpt_a, "gpt_b": gpt_b, "small": small, "fp8_mlp": fp8_mlp, "llama_1b": llama_1b, "llama_2b": llama_2b,
    "long_1b": long_1b, "moe": moe, "llama_8b_shape": llama_8b_shape,
}


def scale_for(smoke: bool, override: Optional[float] = None) -> float:
    """The scale a benchmark uses: 1 on the GPU, :data:`SMOKE_SCALE` for ``--cpu-smoke``."""
    if override is not None:
        return override
    return SMOKE_SCALE if smoke else 1.0
