"""``OffloadActivations(layers, model=model)``: the context also sees the model's forward, where a
HuggingFace ``*ForCausalLM`` step begins (its ``input_ids`` and ``labels``) and ends (its LM head
and loss). Three things need that place:

- **the head's tiling**: a plan that tiles the head (:mod:`offload.planner.tiling`) must say so
  before the head runs, so each planned step is planned for its shape at the model's entry
  (rather than at its first layer), and the call then goes through
  :class:`~offload.tiling.causal_lm.TiledCausalLMForward` with the plan's chunk, or unchanged;
- **a short probe**: the first batch of a long-context run may take minutes a step. A probe step
  of more than twice :func:`probe_tokens` tokens is not probed at its own length: the probe
  steps run first on the same call cut to that many tokens (``labels`` included), the plan for
  the long shape is made from that profile (:mod:`offload.planner.scaling`), and the step itself
  runs planned. The probe steps' gradients are thrown away (the parameters' ``.grad`` are put
  back as they were), the random number generators are restored and a KV cache passed in is put
  back (:mod:`offload.forwards.stateful`), so the run goes on as if they had not happened;
- **the head's figures** (:class:`~offload.planner.tiling.HeadInfo`): its vocabulary and width,
  and whether it can be tiled at all (``head_support``'s reason goes into the plan table).

The forward stand-in holds its context weakly and acts only while that context is entered in
this thread: elsewhere (evaluation, another context, a copy of the model) it calls the model's
own forward. ``close()`` takes it off; one whose context was collected without ``close()`` is
inert, and the tools that set a forward of their own (``tile_head``) take it off themselves, while
a live context's is named in their refusal, with how to release it (:attr:`ModelForward.holder`).
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from ..forwards.instance import check_own_forward
from ..forwards.stateful import StateSnapshot, check_unchanged, stateful_arguments
from ..planner.shapes import StepShape
from ..planner.tiling import LOGIT_BYTES, HeadInfo
from ..tiling.causal_lm import TiledCausalLMForward, head_support

# A probe of a long first batch runs at most this many tokens ...
SHORT_PROBE_TOKENS = 32768
# ... and fewer where the untiled head's logits there would take more than this share of the GPU
# (the probe runs the head untiled: that is what it measures).
PROBE_HEAD_SHARE = 0.25


class ModelCaller(Protocol):
    """What the forward stand-in asks of its context (``OffloadActivations``)."""

    def _model_call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def _entered_here(self) -> bool: ...


def head_info(model: torch.nn.Module) -> HeadInfo:
    """The LM head of ``model`` as the planner sees it."""
    ok, why = head_support(model)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return HeadInfo(vocab_size=0, hidden_size=0, weight_trains=False, tileable=False, reason=why)
    return HeadInfo(vocab_size=head.out_features, hidden_size=head.in_features,
                    weight_trains=head.weight.requires_grad, tileable=ok, reason=why)


def probe_tokens(head: HeadInfo, device: torch.device) -> int:
    """Tokens of a short probe step: :data:`SHORT_PROBE_TOKENS`, fewer (a power of two, at least
    1024) where the untiled head's logits would take more than :data:`PROBE_HEAD_SHARE` of the GPU."""
    tokens = SHORT_PROBE_TOKENS
    if device.type == "cuda" and head.vocab_size:
        room = torch.cuda.get_device_properties(device).total_memory * PROBE_HEAD_SHARE
        while tokens > 1024 and tokens * head.vocab_size * LOGIT_BYTES > room:
            tokens //= 2
    return tokens


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    arguments = dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
    # A forward's **kwargs arrive as one entry: spread them back.
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


def call_shape(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[StepShape]:
    """(batch, length) of a causal-LM call, from its ``input_ids`` or ``inputs_embeds``."""
    arguments = _bound(fn, args, kwargs)
    for name in ("input_ids", "inputs_embeds"):
        value = arguments.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return StepShape(int(value.shape[0]), int(value.shape[1]))
    return None


def short_step(model: torch.nn.Module, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               shape: StepShape) -> Optional[Callable[[int], None]]:
    """A whole training step of this call cut to ``length`` tokens per sequence, whose gradients
    are thrown away and whose random numbers are given back; None without ``labels`` (no loss
    to run a backward from)."""
    arguments = _bound(fn, args, kwargs)
    if not isinstance(arguments.get("labels"), torch.Tensor):
        return None

    def cut(value: Any, length: int) -> Any:
        # Tensors laid out (batch, length, ...): ids, labels, masks, positions, embeddings.
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (shape.batch, shape.length):
            return value[:, :length]
        return value

    def run(length: int) -> None:
        call = {name: cut(value, length) for name, value in arguments.items()}
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        devices = [p.device for p in params[:1] if p.device.type == "cuda"]
        # A KV cache the caller passed: the probe steps must leave it as they found it (the call
        # itself runs after them against it). Put back after each, or refused if written in place.
        states = stateful_arguments((), call)
        before = StateSnapshot(states)
        try:
            with torch.random.fork_rng(devices=devices):
                out = fn(**call)
                loss = out.loss if hasattr(out, "loss") else out[0]
                # The logits must not outlive the forward (as in a loop that keeps the loss
                # only): held through backward, the probe would count them as the head's.
                del out
                loss.backward()
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            before.restore()
        check_unchanged(before, states, "the model form's probe step at a short length, run on the call's own "
                        "arguments before it,")

    return run


def run_call(model: torch.nn.Module, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             head_tokens: int) -> Any:
    """The call itself: through the tiled head and loss over ``head_tokens`` tokens, or as the
    model runs it (0)."""
    if head_tokens:
        return TiledCausalLMForward(model, fn, head_tokens)(*args, **kwargs)
    return fn(*args, **kwargs)


class ModelForward:
    """Stands in for the model's ``forward`` (an instance attribute): while its context is
    entered in this thread, the call goes through the context (:meth:`ModelCaller._model_call`);
    otherwise the model's own forward runs."""

    __slots__ = ("owner", "fn")

    def __init__(self, owner: Optional[ModelCaller], fn: Callable[..., Any]) -> None:
        self.owner = weakref.ref(owner) if owner is not None else None
        self.fn = fn

    @property
    def __signature__(self) -> inspect.Signature:
        # The model's own: the Trainer keeps only the dataset columns its forward names.
        return inspect.signature(self.fn)

    @property
    def holder(self) -> Optional[str]:
        """Who holds the model through this stand-in and how to release it, for the tools that
        refuse a model whose forward is taken (``tile_head``); None once its context is gone
        (collected without ``close()``, or this is a copy's stand-in): the stand-in then only
        calls the model's own forward, and those tools take it off
        (:func:`offload.forwards.instance.check_own_forward`)."""
        owner = self.owner() if self.owner is not None else None
        if owner is None:
            return None
        return (f"the {owner!r} it was given to as model= (whose plans tile the head themselves "
                "where they need to): call that context's close() (oa.close()) first, which gives the "
                "model its own forward back")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner() if self.owner is not None else None
        if owner is None or not owner._entered_here():
            return self.fn(*args, **kwargs)
        return owner._model_call(self.fn, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModelForward":
        return ModelForward(None, copy.deepcopy(self.fn, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelForward, (None, self.fn))


def install(owner: ModelCaller, model: torch.nn.Module) -> None:
    """Put :class:`ModelForward` on ``model`` for ``owner`` (once; a stand-in of a dead context is
    replaced)."""
    current = model.__dict__.get("forward")
    if isinstance(current, ModelForward):
        current.owner = weakref.ref(owner)
        return
    check_own_forward(model, (), f"offload: model= ({type(model).__name__})", "",
                      "(tile_head, or another tool): remove it first, or leave model= out")
    model.forward = ModelForward(owner, model.forward)


def uninstall(model: torch.nn.Module) -> None:
    """Take :class:`ModelForward` off ``model`` (idempotent)."""
    if isinstance(model.__dict__.get("forward"), ModelForward):
        del model.forward


def check_model(model: Any, layers: list[torch.nn.Module]) -> torch.nn.Module:
    """Validate ``model=``: a module that contains the layers."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload: model= takes the torch.nn.Module whose forward runs the layers, got {type(model).__name__}")
    inside = {id(m) for m in model.modules()}
    if layers and id(layers[0]) not in inside:
        raise ValueError(
            f"offload: model= ({type(model).__name__}) does not contain the layers given; pass the model "
            "whose forward runs them (e.g. model for model.model.layers)"
        )
    return model
