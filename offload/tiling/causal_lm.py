"""The tiled LM head for a HuggingFace ``*ForCausalLM``: :func:`tile_head` puts a stand-in on
``model.forward`` that, when the call has labels, runs the base model, then the head and the
loss over chunks of tokens (:func:`offload.tiling.loss.causal_lm_loss`): the ``tokens x vocab``
logits never exist whole.

Which models. Those whose class ``forward`` follows transformers' causal-LM template: the base
model's last hidden state goes through ``self.lm_head`` (exactly an ``nn.Linear``) and then
``self.loss_function`` (``ForCausalLMLoss``), with nothing in between (no logit softcapping or
scaling, no auxiliary loss). :func:`head_support` reads the class's source once and says what is
missing otherwise.

Shown exact, not read. Source text cannot prove a head plain: FalconH1 writes
``logits = self.lm_head(hidden_states) * self.model.lm_head_multiplier`` on the template's line,
and a subclass may scale ``self.loss_function(...)`` on it. So :func:`head_support` also runs the
class's own forward and the tiled one once, on a few tokens, with the base model stood in by its
last hidden state (:func:`_exactness_problem`): each token's hidden state is a power of two on one
coordinate, so every logit is one weight times that power (plus the bias): exact in any dtype and
any GEMM, and the two paths' logits are the same bits. The model's logits must then equal
``lm_head(h)`` bit for bit, and its loss the tiled loss within what float32 sums in another order
allow (:data:`_EXACT_RTOL`). A scale of the logits or of the loss moves the loss by tenths at
least (the logits spread over a few units), 10^4 times that tolerance. A head sharded by FSDP2
(a DTensor weight outside the forward) is checked through a narrow plain head of its vocabulary;
in the forward, FSDP2 has gathered the real one, which the tiled head then reads.

The final norm too. Where the base model's forward ends with ``hidden_states =
self.<norm>(hidden_states)`` and returns them as its last hidden state (transformers' template),
and that norm works token by token (checked on a few tokens: the rows normed whole and in two
parts are the same bits), the tiled head runs the norm inside its chunks (``tile_norm``): the base
model runs with the norm stood in for by an identity, and each chunk is normed, projected and
scored (:func:`offload.tiling.loss.linear_cross_entropy`). Untiled, the norm's float32 upcast and
saved tensors are held for the whole step: on the H200 the head's peak was 6.75 bytes a hidden
element lower with the norm inside (bf16, HF's ``LlamaRMSNorm``; 13.5 GiB at 524,288 tokens of a
4096-wide model). A call that asks for the hidden states (``output_hidden_states``) runs the norm
whole, as HF does.

What changes. On the tiled path the output's ``logits`` are None (as liger-kernel's fused loss
does in training): the point is never to build them. The loss, the cache, the hidden states and
the attentions are those HF returns; with ``return_dict=False`` the tuple is
``output.to_tuple()`` as HF builds it, so it lacks the logits (``out[0]`` is still the loss).
Calls without labels, with ``logits_to_keep``, or for which the chunk is 0 run the original
forward unchanged (bitwise HF's). A call with only ``shift_labels`` has no loss in HF either, so
it runs the original forward too.

Copies. The stand-in is an instance attribute bound to its model (through the bound method it
wraps: a cycle the garbage collector handles, as for any bound forward kept on an instance).
``copy.deepcopy(model)`` gives the copy a stand-in of its own, bound to the copy, with the same
chunk; pickling rebuilds it on the unpickled model (a chunk callable must then pickle too).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import re
import types
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..forwards.instance import check_own_forward
from .loss import causal_lm_loss, check_chunk_tokens, default_head_chunk

__all__ = ["final_norm_support", "head_support", "tile_head", "tiled_head_installed", "TiledCausalLMForward", "TiledHead"]

# tokens per chunk, or ``chunk(batch, length) -> tokens`` asked once per call (0: untiled).
Chunk = Union[int, Callable[[int, int], int]]

_NOT_TILEABLE = "the head is not an nn.Linear followed by cross-entropy: "

# The lines of transformers' causal-LM template, compared with all whitespace removed. Up to 5.17
# the head reads ``hidden_states[:, slice_indices, :]``; later ``slice_logits_to_keep`` slices
# the hidden states first.
_HEAD_CALLS = (
    "logits=self.lm_head(hidden_states[:,slice_indices,:])",
    "hidden_states=slice_logits_to_keep(hidden_states,logits_to_keep)logits=self.lm_head(hidden_states)",
)
_LOSS_CALL = "loss=self.loss_function(logits=logits,labels=labels,vocab_size=self.config.vocab_size,**kwargs)"
_BASE_CALL = re.compile(r"^\s*outputs\s*(?::[^=\n]+)?=\s*self\.(\w+)\(", re.MULTILINE)
# An assignment statement (``x = ``, ``x *= ``): black puts spaces around it, never around a
# keyword argument (``logits=logits``).
_ASSIGN = r"^\s*{}\s*(?:[-+*/@%]|//|\*\*)?=\s"
# What a head that does more than the linear and the cross-entropy mentions.
_EXTRAS = ("softcap", "logit_scale", "logits_scaling", "aux_loss")

# The exactness check (module notes): tokens of its input, tokens per chunk of its tiled path (so
# that chunks are summed), the largest logit it aims at, and the loss's tolerance: the two losses
# are float32 sums of the same per-token terms in another order (measured: 1e-7).
_EXACT_TOKENS = 8
_EXACT_CHUNK = 3
_EXACT_LOGIT = 4.0
_EXACT_RTOL = 1e-5

# Arguments of the standard forward that the base model does not take (the rest go to it).
_HEAD_ARGS = ("labels", "logits_to_keep")
_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index", "return_dict")


@dataclasses.dataclass(frozen=True)
class _Template:
    """What :func:`_read_template` found in a class's forward: ``reason`` if it is not the
    template, else the attribute holding the base model."""

    base: str = ""
    reason: str = ""


def _forward_source(cls: type) -> tuple[str, Optional[str]]:
    """``Class.forward`` as a name, and its source (None where it cannot be read)."""
    name = f"{cls.__name__}.forward"
    try:
        return name, inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return name, None


@functools.lru_cache(maxsize=None)
def _read_template(cls: type) -> _Template:
    # Once per class: reading and scanning a forward's source takes a millisecond or so.
    name, source = _forward_source(cls)
    if source is None:
        return _Template(reason=_NOT_TILEABLE + f"the source of {name} cannot be read, so it cannot be checked")
    flat = re.sub(r"\s+", "", source)
    for word in _EXTRAS:
        if word in source:
            return _Template(reason=_NOT_TILEABLE + f"{name} mentions {word!r}: it changes the logits or the loss "
                                                    "beyond the linear and the cross-entropy")
    if not any(call in flat for call in _HEAD_CALLS):
        return _Template(reason=_NOT_TILEABLE + f"{name} does not call self.lm_head(hidden_states...) as "
                                                "transformers' causal-LM forward does")
    if _LOSS_CALL not in flat:
        return _Template(reason=_NOT_TILEABLE + f"{name} does not compute its loss with "
                                                "self.loss_function(logits=logits, labels=labels, ...)")
    if len(re.findall(_ASSIGN.format("logits"), source, re.MULTILINE)) != 1 or re.search(r"\blogits\.\w+_\(", source):
        return _Template(reason=_NOT_TILEABLE + f"{name} changes the logits after self.lm_head")
    if len(re.findall(_ASSIGN.format("loss"), source, re.MULTILINE)) != 2:
        return _Template(reason=_NOT_TILEABLE + f"{name} changes the loss after self.loss_function")
    if "@can_return_tuple" not in source or "returnCausalLMOutputWithPast(" not in flat:
        return _Template(reason=_NOT_TILEABLE + f"{name} does not return a CausalLMOutputWithPast through "
                                                "@can_return_tuple as transformers' causal-LM forward does")
    found = _BASE_CALL.search(source)
    if found is None:
        return _Template(reason=f"the base model is not reachable: {name} does not call it as outputs = self.<name>(...)")
    return _Template(base=found.group(1))


_NORM_CALL = re.compile(r"^\s*hidden_states\s*=\s*self\.(\w+)\(hidden_states\)\s*$")


@functools.lru_cache(maxsize=None)
def _read_final_norm(cls: type) -> _Template:
    # Once per base-model class: the attribute of the norm its forward ends with (``base``), or why
    # the norm cannot run inside the head's chunks (``reason``).
    name, source = _forward_source(cls)
    if source is None:
        return _Template(reason=f"the source of {name} cannot be read")
    assigns = list(re.finditer(_ASSIGN.format("hidden_states"), source, re.MULTILINE))
    if not assigns:
        return _Template(reason=f"{name} assigns no hidden_states")
    start = source.rfind("\n", 0, assigns[-1].end()) + 1  # the line itself (the match may begin on blank ones)
    end = source.find("\n", start)
    found = _NORM_CALL.match(source[start:end if end >= 0 else len(source)])
    if found is None:
        return _Template(reason=f"{name} does not end with hidden_states = self.<norm>(hidden_states)")
    rest = re.sub(r"\s+", "", source[end:]).replace("last_hidden_state=hidden_states", "")
    if "hidden_states" in rest:
        return _Template(reason=f"{name} uses the normed hidden states otherwise than as its last hidden state")
    return _Template(base=found.group(1))


def _rows_problem(norm: nn.Module, width: int, like: torch.Tensor) -> str:
    # Token-wise, shown on a few rows: normed whole and in two parts, the same bits. A norm sharded
    # by FSDP2 (DTensor parameters outside the forward) is checked as a copy with plain ones.
    if any(type(p.data) is not torch.Tensor for p in norm.parameters()):
        norm = _with_plain_parameters(norm, like)
    generator = torch.Generator(device=like.device).manual_seed(1)
    rows = torch.randn(5, width, generator=generator, device=like.device).to(like.dtype)
    try:
        with torch.no_grad():
            whole, parts = norm(rows), torch.cat([norm(rows[:2]), norm(rows[2:])])
    except Exception as exc:  # noqa: BLE001 - any failure means: not shown token-wise
        return f"running it on a few rows raised {type(exc).__name__}: {exc}"
    if not isinstance(whole, torch.Tensor) or whole.shape != rows.shape or not torch.equal(whole, parts):
        return "it does not work token by token (a few rows normed whole and in two parts differ)"
    return ""


def _with_plain_parameters(norm: nn.Module, like: torch.Tensor) -> nn.Module:
    # A copy of ``norm`` whose own parameters are plain tensors of their (global) shapes, seeded,
    # in ``like``'s dtype and device. Not a deepcopy: an FSDP2-managed module's sharded parameters
    # may not copy (their storage can be freed between steps); its dicts are copied one level, so
    # that the original keeps its parameters.
    clone = object.__new__(type(norm))
    clone.__dict__.update({k: type(v)(v) if isinstance(v, dict) else v for k, v in norm.__dict__.items()})
    generator = torch.Generator(device=like.device).manual_seed(0)
    for name, p in norm._parameters.items():
        if p is not None:
            plain = torch.randn(tuple(p.shape), generator=generator, device=like.device).to(like.dtype)
            clone._parameters[name] = nn.Parameter(plain, requires_grad=False)
    return clone


def final_norm_support(model: nn.Module) -> tuple[str, str]:
    """The attribute of ``model``'s base model holding the final norm the tiled head may run
    inside its chunks, and '' with the reason where it cannot (see the module notes)."""
    base = _read_template(type(model)).base
    module = getattr(model, base, None) if base else None
    if not isinstance(module, nn.Module):
        return "", "the base model is not reachable"
    template = _read_final_norm(type(module))
    if template.reason:
        return "", template.reason
    norm = module._modules.get(template.base)
    if not isinstance(norm, nn.Module):
        return "", f"{type(module).__name__}.{template.base} is not a module"
    if norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__:
        return "", f"{type(module).__name__}.{template.base} has forward hooks or an instance forward"
    head = model.lm_head
    like = head.weight.to_local() if hasattr(head.weight, "to_local") else head.weight
    problem = _rows_problem(norm, head.in_features, like.detach())
    if problem:
        return "", f"{type(module).__name__}.{template.base}: {problem}"
    return template.base, ""


def _head_module_problem(model: nn.Module) -> str:
    # Instance checks, cheap enough for every call: the head must be what the template calls.
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        kind = "missing" if head is None else f"a {type(head).__name__}, not exactly torch.nn.Linear"
        return _NOT_TILEABLE + f"model.lm_head is {kind} (another module may compute something else)"
    if head._forward_hooks or head._forward_pre_hooks or "forward" in head.__dict__:
        return _NOT_TILEABLE + "model.lm_head has forward hooks or an instance forward, which the tiled head would skip"
    return ""


def head_support(model: nn.Module) -> tuple[bool, str]:
    """Whether :func:`tile_head` can tile ``model``'s head, and if not, why (in words for the
    user; empty when it can).

    It can for a HuggingFace ``*ForCausalLM`` whose ``lm_head`` is exactly an ``nn.Linear``, whose
    loss is transformers' ``ForCausalLMLoss``, whose config has no ``final_logit_softcapping``, and
    whose class ``forward`` follows transformers' causal-LM template (see the module notes), and
    whose own forward, run once on a few tokens, gives the logits of ``lm_head`` bit for bit and
    the tiled loss (the check in the module notes: a head whose logits or loss are scaled, even
    by an attribute of the model, is refused).
    """
    try:
        from transformers import PreTrainedModel
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False, "transformers is not installed, and only its *ForCausalLM models can be tiled"
    if not isinstance(model, PreTrainedModel):
        return False, f"a {type(model).__name__} is not a HuggingFace transformers model (PreTrainedModel)"
    problem = _head_module_problem(model)
    if problem:
        return False, problem
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None:
        return False, _NOT_TILEABLE + "the config's final_logit_softcapping caps the logits before the loss"
    template = _read_template(type(model))
    if template.reason:
        return False, template.reason
    if not isinstance(getattr(model, template.base, None), nn.Module):
        return False, f"the base model is not reachable: model.{template.base} is not a module"
    if model.loss_function is not ForCausalLMLoss:
        return False, _NOT_TILEABLE + f"model.loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}, not transformers' ForCausalLMLoss"
    if model.lm_head.out_features != getattr(config, "vocab_size", None):
        return False, _NOT_TILEABLE + (f"model.lm_head has {model.lm_head.out_features} outputs but config.vocab_size "
                                       f"is {getattr(config, 'vocab_size', None)}")
    problem = _exactness_problem(model, template.base)
    if problem:
        return False, problem
    return True, ""


class _BaseStandIn(nn.Module):
    """Stands in for the base model during the exactness check: returns the check's hidden
    states, and reads every other attribute (``lm_head_multiplier``...) off the real one."""

    def __init__(self, real: nn.Module, output: Any) -> None:
        super().__init__()
        self.__dict__["_real"], self.__dict__["_output"] = real, output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_output"]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


def _exact_inputs(head: nn.Linear) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    # Token t's hidden state is 2**e on coordinate k_t alone, so its logits are the exact
    # products 2**e * W[:, k_t] (+ bias); its label (the next token's, as HF shifts them) is
    # the word of that column's largest weight, so the logits spread over a few units around it.
    # None where the columns are zero (nothing to tell a scale by).
    weight = head.weight.detach()
    n, width = _EXACT_TOKENS, weight.shape[1]
    columns = [(t * width) // n for t in range(n)]
    hidden = torch.zeros(1, n, width, dtype=weight.dtype, device=weight.device)
    labels = torch.zeros(1, n, dtype=torch.long, device=weight.device)
    for t, k in enumerate(columns):
        column = weight[:, k].float()
        top = float(column.abs().max())
        if not math.isfinite(top) or top == 0.0:
            return None
        hidden[0, t, k] = 2.0 ** round(math.log2(_EXACT_LOGIT / top))
        if t + 1 < n:
            labels[0, t + 1] = int(column.argmax())
    return hidden, labels


def _plain_head(head: nn.Linear, width: int = 64) -> nn.Linear:
    """A plain ``nn.Linear`` with ``head``'s vocabulary, dtype and device (its local shard's) and
    ``width`` inputs, its weights the same on every rank (a seeded generator; the global RNG is
    left alone): the exactness check of a sharded head. Narrow, so that it costs a few MiB."""
    local = head.weight.to_local()  # type: ignore[attr-defined]
    plain = nn.Linear(width, head.out_features, bias=head.bias is not None, device=local.device, dtype=local.dtype)
    generator = torch.Generator(device=local.device).manual_seed(0)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(plain.weight.shape, generator=generator, device=local.device))
        if plain.bias is not None:
            plain.bias.zero_()
    return plain


def _largest(logits: Any) -> str:
    return f"{float(logits.float().abs().max()):.4g}" if isinstance(logits, torch.Tensor) and logits.numel() else "none"


def _exactness_problem(model: nn.Module, base: str) -> str:
    """Why the tiled loss of ``model`` is not shown to be its own (see the module notes); empty
    when it is. Runs the class's forward and the tiled one once, on a few tokens, without grad,
    with the base model stood in for; hooks on the base model do not fire."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    real_head = model.lm_head
    name = f"{type(model).__name__}.forward"
    sharded = type(real_head.weight.data) is not torch.Tensor and hasattr(real_head.weight, "to_local")
    if real_head.weight.is_meta or (type(real_head.weight.data) is not torch.Tensor and not sharded):
        what = "on the meta device" if real_head.weight.is_meta else f"a {type(real_head.weight.data).__name__}"
        return (_NOT_TILEABLE + f"model.lm_head's weight is {what}, so the tiled loss cannot be checked against "
                "the model's own; tile the head once its weights are loaded as plain tensors")
    # A sharded head (FSDP2's DTensor outside the forward) is checked through a plain one of its
    # vocabulary: what is checked is the class's forward, not the weights.
    head = _plain_head(real_head) if sharded else real_head
    made = _exact_inputs(head)
    if made is None:
        return _NOT_TILEABLE + ("model.lm_head's weight has a column of zeros (or not finite), so the tiled loss "
                                "cannot be checked against the model's own; tile the head once its weights are loaded")
    hidden, labels = made
    real = model._modules[base]
    own = types.MethodType(type(model).forward, model)
    ids = torch.zeros_like(labels)
    model._modules[base] = _BaseStandIn(real, BaseModelOutputWithPast(last_hidden_state=hidden))
    model._modules["lm_head"] = head
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[hidden.device] if hidden.device.type == "cuda" else []):
            out = own(input_ids=ids, labels=labels)
            tiled = TiledCausalLMForward(model, own, _EXACT_CHUNK)(input_ids=ids, labels=labels)
            want = F.linear(hidden, head.weight, head.bias)
    except Exception as exc:  # noqa: BLE001 - any failure means: not shown exact
        return _NOT_TILEABLE + f"checking {name} on a few tokens raised {type(exc).__name__}: {exc}"
    finally:
        model._modules[base], model._modules["lm_head"] = real, real_head
    loss, logits = (out.loss, out.logits) if not isinstance(out, tuple) else (out[0], out[1])
    tiled_loss = tiled.loss if not isinstance(tiled, tuple) else tiled[0]
    if not isinstance(logits, torch.Tensor) or logits.shape != want.shape or not torch.equal(logits.float(), want.float()):
        return _NOT_TILEABLE + (f"{name} returns other logits than self.lm_head's (on a few tokens, the largest is "
                                f"{_largest(logits)} where lm_head's is {_largest(want)}): it scales or changes them "
                                "after the head, and the tiled loss would be that of the unchanged ones")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return _NOT_TILEABLE + f"{name} returns no loss for labels, so the tiled loss cannot be checked against it"
    a, b = float(loss), float(tiled_loss)
    if not (abs(a - b) <= _EXACT_RTOL * max(1.0, abs(a))):
        return _NOT_TILEABLE + (f"{name}'s loss is not the cross-entropy of self.lm_head's logits (on a few tokens: "
                                f"{a:.6g}, tiled {b:.6g}): it scales or changes the loss")
    return ""


def _chunk_for(chunk: Chunk, batch: int, length: int) -> int:
    if not callable(chunk):
        return chunk
    tokens = chunk(batch, length)
    if tokens == 0 and isinstance(tokens, int) and not isinstance(tokens, bool):
        return 0
    return check_chunk_tokens(tokens, f"offload.tile_head: the chunk callable (for batch {batch}, length {length})")


def _batch_shape(arguments: dict[str, Any]) -> Optional[tuple[int, int]]:
    ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
    source = ids if ids is not None else embeds
    if not isinstance(source, torch.Tensor) or source.dim() < 2:
        return None
    return int(source.shape[0]), int(source.shape[1])


def _keeps_all_logits(arguments: dict[str, Any]) -> bool:
    keep = arguments.get("logits_to_keep", 0)
    return isinstance(keep, int) and not isinstance(keep, bool) and keep == 0


class TiledCausalLMForward:
    """Stands in for a causal LM's ``forward`` (an instance attribute, like
    :class:`offload.forwards.selective.SelectiveForward`): with labels, the head and loss run tiled over
    ``chunk`` tokens; otherwise, or when the chunk is 0, the original ``fn`` runs unchanged.

    ``model``: the model; ``fn``: its original bound forward (``fn.__self__`` is the model);
    ``chunk``: tokens per chunk, or ``chunk(batch, length) -> tokens`` asked once per call;
    ``norm``: the attribute of the base model's final norm to run inside the chunks
    (:func:`final_norm_support`), '' to run it whole.
    ``inspect.signature`` of the stand-in is the original's (Trainer and ``generate`` read it).
    """

    __slots__ = ("fn", "chunk", "base", "norm", "_identity", "_signature", "_var_keyword")

    def __init__(self, model: nn.Module, fn: Callable[..., Any], chunk: Chunk, norm: str = "") -> None:
        if getattr(fn, "__self__", None) is not model:
            raise ValueError("offload.TiledCausalLMForward: fn must be the model's own bound forward")
        template = _read_template(type(model))
        if template.reason:
            raise ValueError(f"offload.TiledCausalLMForward: {template.reason}")
        self.fn = fn
        self.chunk = chunk
        self.base = template.base
        self.norm = norm
        # One stand-in for the norm for all calls (a new module each call would make a compiled
        # base model recompile).
        self._identity = nn.Identity()
        self._signature = inspect.signature(fn)
        self._var_keyword = next(
            (p.name for p in self._signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @property
    def __signature__(self) -> inspect.Signature:
        return self._signature

    @property
    def model(self) -> nn.Module:
        """The model whose forward this stands in for."""
        return self.fn.__self__  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return self.fn(*args, **kwargs)  # HF's own error for a call that does not fit
        arguments = dict(bound.arguments)
        extra = dict(arguments.pop(self._var_keyword, {})) if self._var_keyword else {}
        shape = _batch_shape(arguments)
        if arguments.get("labels") is None or shape is None or not _keeps_all_logits(arguments):
            return self.fn(*args, **kwargs)
        chunk = _chunk_for(self.chunk, *shape)
        if chunk == 0:
            return self.fn(*args, **kwargs)
        return self._tiled(arguments, extra, chunk)

    def _tiled(self, arguments: dict[str, Any], extra: dict[str, Any], chunk: int) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model = self.model
        problem = _head_module_problem(model)
        if problem:
            raise RuntimeError(f"offload.tile_head: {problem}; it changed after tile_head, so remove the tiling first")
        # As transformers' can_return_tuple decides it: the call's return_dict, else the config's.
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        num_items = extra.pop("num_items_in_batch", None)
        shift_labels = extra.pop("shift_labels", None)
        ignore_index = extra.pop("ignore_index", -100)
        labels = arguments.pop("labels")
        arguments.pop("logits_to_keep", None)
        # The base model gets what the template passes it: the named arguments and the rest of
        # the keyword arguments (attention kwargs, output_hidden_states, ...).
        base = getattr(model, self.base)
        wants_states = arguments.get("output_hidden_states", extra.get("output_hidden_states"))
        if wants_states is None:
            wants_states = getattr(model.config, "output_hidden_states", False)
        norm = base._modules.get(self.norm) if self.norm and not wants_states else None
        if norm is not None:
            # The norm runs inside the chunks: the base model's own call of it passes its input on.
            base._modules[self.norm] = self._identity
        try:
            outputs = base(**arguments, **extra)
        finally:
            if norm is not None:
                base._modules[self.norm] = norm
        loss = causal_lm_loss(
            outputs[0], model.lm_head, labels, chunk_tokens=chunk, ignore_index=ignore_index,
            num_items_in_batch=num_items, shift_labels=shift_labels, norm=norm,
        )
        # The cache field is ``past_key_values`` up to 5.17, ``cache`` later: carry what exists.
        carried = {f.name: getattr(outputs, f.name, None)
                   for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits")}
        output = CausalLMOutputWithPast(loss=loss, logits=None, **carried)
        return output if return_dict else output.to_tuple()

    def __deepcopy__(self, memo: dict[int, Any]) -> "TiledCausalLMForward":
        fn = copy.deepcopy(self.fn, memo)  # a bound method: bound to the copied model
        return TiledCausalLMForward(fn.__self__, fn, copy.deepcopy(self.chunk, memo), self.norm)

    def __reduce__(self) -> tuple[Any, ...]:
        # Not the bound method itself: unpickling it reads model.forward, which may be this.
        return (_rebuild, (self.model, self.chunk, self.norm))


def _rebuild(model: nn.Module, chunk: Chunk, norm: str = "") -> TiledCausalLMForward:
    return TiledCausalLMForward(model, types.MethodType(type(model).forward, model), chunk, norm)


def tiled_head_installed(model: nn.Module) -> Optional[TiledCausalLMForward]:
    """The tiled-head stand-in on ``model``'s ``forward``, if :func:`tile_head` put one there."""
    wrapper = model.__dict__.get("forward")
    return wrapper if isinstance(wrapper, TiledCausalLMForward) else None


class TiledHead:
    """What :func:`tile_head` returns: :meth:`remove` gives the model its own forward back.
    Usable as a context manager."""

    def __init__(self, model: nn.Module, wrapper: TiledCausalLMForward) -> None:
        self.model: Optional[nn.Module] = model
        self.wrapper = wrapper

    def remove(self) -> None:
        """Take the stand-in off the model (idempotent; a stand-in put there since by someone
        else is left alone)."""
        if self.model is not None and self.model.__dict__.get("forward") is self.wrapper:
            del self.model.forward
        self.model = None

    def __enter__(self) -> "TiledHead":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def tile_head(model: nn.Module, chunk_tokens: Optional[Chunk] = None, tile_norm: bool = True) -> TiledHead:
    """Run ``model``'s LM head and loss over chunks of ``chunk_tokens`` tokens whenever it is
    called with labels, until ``remove()`` (see the module notes for what the output holds).

    ``chunk_tokens``: an int >= 1; a callable ``(batch, length) -> tokens`` asked once per call
    (0: that call runs untiled); None: :func:`offload.tiling.loss.default_head_chunk` of the
    vocabulary (about 1 GiB of working set). ``tile_norm``: run the base model's final norm
    inside the chunks too, where :func:`final_norm_support` shows it can (else it runs whole,
    silently). Raises ``ValueError`` for a model
    :func:`head_support` refuses (with its reason), one tiled already, one whose ``forward`` was
    replaced on the instance by other code (an ``OffloadActivations(..., model=model)`` holding it
    is named, with how to release it; the inert stand-in of one collected without ``close()`` is
    taken off), or a bad ``chunk_tokens``.
    """
    ok, reason = head_support(model)
    if not ok:
        raise ValueError(f"offload.tile_head: cannot tile {type(model).__name__}'s head: {reason}")
    check_own_forward(model, TiledCausalLMForward, f"offload.tile_head: {type(model).__name__}",
                      "has a tiled head already; remove() that one first",
                      "remove that override first (tiling would hide it)")
    if chunk_tokens is None:
        chunk: Chunk = default_head_chunk(model.lm_head.out_features)
    elif callable(chunk_tokens):
        chunk = chunk_tokens
    else:
        chunk = check_chunk_tokens(chunk_tokens, "offload.tile_head")
    # An instance attribute: nn.Module.__call__ reads self.forward, so hooks and the class stay
    # as they are, and deleting it restores the class's forward.
    norm = final_norm_support(model)[0] if tile_norm else ""
    wrapper = TiledCausalLMForward(model, model.forward, chunk, norm)
    model.forward = wrapper
    return TiledHead(model, wrapper)
