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
  runs planned. The probe steps change nothing the user can observe (their inputs are detached
  copies, their gradients are never accumulated, gradient hooks are hidden, the random number
  generators and buffers are given back: :mod:`offload.layers.short_probe`), so the run goes on as
  if they had not happened; where that cannot be promised (forward hooks on the model's modules,
  an input it cannot cut, a cache), or with ``short_probe=False``, the batch is probed at its full
  length, with a warning saying why. **An FSDP2 root** (``fully_shard(model)``) is probed ahead of
  its hooks: its pre-forward hook all-gathers the root's parameters for this call, and a probe step
  run after it would end in FSDP2's post-backward callback, which reshards every parameter group,
  the root's included, and resets the iteration's state, under the call in progress (its embedding
  would then meet a sharded DTensor weight). So the stand-in also puts a forward pre-hook ahead of
  FSDP2's on such a model, and the probe steps run there as whole calls of the model through its
  hooks (:class:`~offload.layers.short_probe.ShortStep`'s ``through_module``): each is a whole
  FSDP2 iteration, which leaves FSDP2 as between steps, and then the call itself begins;
- **the head's figures** (:class:`~offload.planner.tiling.HeadInfo`): its vocabulary and width,
  and whether it can be tiled at all (``head_support``'s reason goes into the plan table).

The forward stand-in holds its context weakly and acts only while that context is entered in
this thread: elsewhere (evaluation, a copy of the model) it calls the model's own forward.
Several contexts may be given one model (a notebook cell run again makes a new one before the old
is dropped): the stand-in serves each of them, so none loses sight of its model's calls, and it
comes off when the last is closed or collected. The tools that set a forward of their own
(``tile_head``) take off a stand-in whose contexts are all gone, and name a live one in their
refusal, with how to release it (:attr:`ModelForward.holder`).
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from ..forwards.instance import check_own_forward
from ..planner.shapes import StepShape
from ..planner.tiling import LOGIT_BYTES, HeadInfo
from ..tiling.causal_lm import TiledCausalLMForward, final_norm_support, head_support
from ..tiling.exact_loss import exact_causal_lm_loss, hf_causal_lm_loss
from .short_probe import ShortStep, is_fsdp2_root

# A probe of a long first batch runs at most this many tokens ...
SHORT_PROBE_TOKENS = 32768
# ... and fewer where the untiled head's logits there would take more than this share of the GPU
# (the probe runs the head untiled: that is what it measures).
PROBE_HEAD_SHARE = 0.25
# A model whose ``_loss_function`` HF had not set (with_exact_loss puts it back so).
_UNSET = object()


class ModelCaller(Protocol):
    """What the forward stand-in asks of its context (``OffloadActivations``)."""

    def _model_call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    entered: bool = False) -> Any: ...

    def _model_entry(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                     through_module: bool) -> Any: ...

    def _entered_here(self) -> bool: ...


def head_info(model: torch.nn.Module) -> HeadInfo:
    """The LM head of ``model`` as the planner sees it."""
    ok, why = head_support(model)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        return HeadInfo(vocab_size=0, hidden_size=0, weight_trains=False, tileable=False, reason=why)
    return HeadInfo(vocab_size=head.out_features, hidden_size=head.in_features,
                    weight_trains=head.weight.requires_grad, tileable=ok, reason=why,
                    norm=final_norm_support(model)[0] if ok else "")


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
               shape: StepShape, through_module: bool = False, head: Optional[HeadInfo] = None) -> Optional[ShortStep]:
    """A whole training step of this call cut to ``length`` tokens per sequence (``step(length)``),
    invisible to the user (:mod:`offload.layers.short_probe`; ``step.refused`` says why it cannot
    be, where it cannot); None without ``labels`` (no loss to run a backward from).
    ``through_module``: the step calls the model itself, hooks and all (an FSDP2 root, probed
    ahead of its hooks), rather than its forward ``fn``. ``head``: its loss runs as the planned
    steps' does (:func:`with_exact_loss`)."""
    arguments = _bound(fn, args, kwargs)
    if not isinstance(arguments.get("labels"), torch.Tensor):
        return None
    return ShortStep(model, with_exact_loss(model, fn, head), arguments, shape, through_module)


def run_call(model: torch.nn.Module, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             head_tokens: int, head: Optional[HeadInfo] = None) -> Any:
    """The call itself: through the tiled head and loss over ``head_tokens`` tokens (the final
    norm inside its chunks where ``head`` says so), or as the model runs it (0), its loss then
    HF's over chunks of rows (:func:`with_exact_loss`)."""
    if head_tokens:
        return TiledCausalLMForward(model, fn, head_tokens, head.norm if head is not None else "")(*args, **kwargs)
    return with_exact_loss(model, fn, head)(*args, **kwargs)


def with_exact_loss(model: torch.nn.Module, fn: Callable[..., Any], head: Optional[HeadInfo]) -> Callable[..., Any]:
    """``fn`` (the model's forward) with its loss HF's bit for bit, its float32 working set one
    chunk of rows at a time (``exact_causal_lm_loss``), where ``head`` found transformers'
    template and ``ForCausalLMLoss`` (what ``head_support`` checks) and the model still has it:
    every untiled call of a planning context, probe steps included, so that the head the probe
    measures is the head the plans run."""
    if head is None or not head.tileable:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        if model.loss_function is not hf_causal_lm_loss():  # (set by the user since)
            return fn(*args, **kwargs)
        # HF's setter keeps a loss function on the instance (``_loss_function``): set for this call only.
        before = model.__dict__.get("_loss_function", _UNSET)
        model.loss_function = exact_causal_lm_loss
        try:
            return fn(*args, **kwargs)
        finally:
            if before is _UNSET:
                model.__dict__.pop("_loss_function", None)
            else:
                model._loss_function = before

    return call


class ModelForward:
    """Stands in for the model's ``forward`` (an instance attribute) for the contexts given the
    model (held weakly): while one of them is entered in this thread, the call goes through it
    (:meth:`ModelCaller._model_call`); otherwise the model's own forward runs."""

    __slots__ = ("owners", "fn", "hook", "seen")

    def __init__(self, owner: Optional[ModelCaller], fn: Callable[..., Any]) -> None:
        self.owners: list[weakref.ref] = [weakref.ref(owner)] if owner is not None else []
        self.fn = fn
        self.hook: Any = None  # the handle of the pre-hook ahead of an FSDP2 root's (see the module notes)
        self.seen = False      # that pre-hook saw this call's entry: the forward need not look again

    @property
    def __signature__(self) -> inspect.Signature:
        # The model's own: the Trainer keeps only the dataset columns its forward names.
        return inspect.signature(self.fn)

    def attach(self, owner: ModelCaller) -> None:
        """Serve ``owner`` too (once), forgetting contexts that were garbage collected."""
        self.owners = [r for r in self.owners if r() is not None and r() is not owner] + [weakref.ref(owner)]

    def detach(self, owner: ModelCaller) -> bool:
        """Stop serving ``owner``; whether a live context is still served."""
        self.owners = [r for r in self.owners if r() is not None and r() is not owner]
        return bool(self.owners)

    @property
    def holder(self) -> Optional[str]:
        """Who holds the model through this stand-in and how to release it, for the tools that
        refuse a model whose forward is taken (``tile_head``); None once every context it served
        is gone (collected without ``close()``, or this is a copy's stand-in): the stand-in then
        only calls the model's own forward, and those tools take it off
        (:func:`offload.forwards.instance.check_own_forward`)."""
        live = [owner for owner in (ref() for ref in self.owners) if owner is not None]
        if not live:
            return None
        return (f"the {' and the '.join(repr(owner) for owner in live)} it was given to as model= (whose "
                "plans tile the head themselves where they need to): call that context's close() "
                "(oa.close()) first, which gives the model its own forward back")

    def _owner_here(self) -> Optional[ModelCaller]:
        # Every context given the model keeps seeing its calls (several may exist, e.g. a cell
        # run again makes a new one before the old is dropped): the one entered here acts.
        for ref in self.owners:
            owner = ref()
            if owner is not None and owner._entered_here():
                return owner
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        seen, self.seen = self.seen, False
        owner = self._owner_here()
        if owner is not None:
            return owner._model_call(self.fn, args, kwargs, seen)
        return self.fn(*args, **kwargs)

    def ahead_of_fsdp(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The forward pre-hook ahead of an FSDP2 root's own: the call's entry (its short probe
        steps, each a whole call of the model) before FSDP2 all-gathers the root for it."""
        owner = self._owner_here()
        if owner is None or not is_fsdp2_root(module):
            return
        owner._model_entry(self.fn, args, kwargs, True)
        self.seen = True  # (after: the probe's own calls of the model set and clear it inside)

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModelForward":
        return ModelForward(None, copy.deepcopy(self.fn, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelForward, (None, self.fn))


def install(owner: ModelCaller, model: torch.nn.Module) -> None:
    """Make ``model``'s :class:`ModelForward` serve ``owner``: put one on, or attach ``owner`` to
    the one there (other contexts' stay served)."""
    current = model.__dict__.get("forward")
    if isinstance(current, ModelForward):
        current.attach(owner)
        return
    check_own_forward(model, (), f"offload: model= ({type(model).__name__})", "",
                      "(tile_head, or another tool): remove it first, or leave model= out")
    stand_in = ModelForward(owner, model.forward)
    model.forward = stand_in
    if is_fsdp2_root(model):
        stand_in.hook = model.register_forward_pre_hook(stand_in.ahead_of_fsdp, prepend=True, with_kwargs=True)


def uninstall(owner: ModelCaller, model: torch.nn.Module) -> None:
    """Stop serving ``owner``; :class:`ModelForward` comes off ``model`` when no live context is
    served (idempotent)."""
    current = model.__dict__.get("forward")
    if isinstance(current, ModelForward) and not current.detach(owner):
        del model.forward
        if current.hook is not None:
            current.hook.remove()
            current.hook = None


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
