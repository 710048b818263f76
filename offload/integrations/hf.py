"""HF ``transformers.Trainer`` (and TRL's trainers, its subclasses) with activation offload.

One line after the trainer is built::

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    oa = offload.integrations.hf.offload_trainer(trainer)    # on CUDA: a plan that fits the GPU
    trainer.train()
    print(oa.report())

How. An :class:`~offload.OffloadActivations` on the model's repeated layers (found by
:func:`offload.layers.find.find_layers`: ``model.model.layers`` for Llama, ``transformer.h`` for
GPT-2, through PEFT wrappers too) is entered around every forward of the trainer's model that
records a graph, by a forward pre-hook and an always-called forward hook on the model, and left
when that forward returns. Hooks on the model, rather than a wrapped ``compute_loss`` or
``training_step``, because what needs offloading is exactly the model's training forwards:

- a ``compute_loss`` may run several forwards (TRL's metrics forward under ``no_grad``, DPO's
  reference model); forwards under ``no_grad`` and evaluation save nothing and are skipped, and
  each training forward is one step of the context (several before their backwards are fine);
- ``training_step`` also runs the backward, which must not run inside the context;
- a wrapper around the model (DDP, accelerate's autocast forward) calls the model, so the hooks
  fire whatever the Trainer wraps it in.

TRL's trainers enter their own offload context (``activation_offloading=True``: TRL's copy of
torchtune's ``OffloadActivations``) around each ``training_step``; ``offload_trainer`` replaces
it by a no-op, so that only this engine offloads. Gradients are bitwise those of the same
trainer without offload (``tests/test_integrations_hf_cpu.py``, three optimizer steps).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Optional

import torch

from ..activations import OffloadActivations
from ..api import ACCEPTED_OPTIONS, check_unknown_options
from ..engine.eager import run_eagerly
from ..layers.find import find_layers
from ..layers.args import layer_list

API = "offload_trainer"


class _TrainingForward:
    """The model's hooks: enter ``offload`` before a forward that records a graph, leave it when
    that forward returns or raises (the forward hook is registered with ``always_call``).

    Per thread, so that a forward entered in one thread is left in that thread. A forward that
    never reached its post hook (a ``KeyboardInterrupt``, which ``always_call`` hooks do not see)
    is aborted by the next one. Whether the forward raised is read from ``sys.exc_info()`` in
    the post hook (torch calls it from its ``except`` block); an exception that was already
    being handled when the forward began (a forward run inside an ``except``, as a retry after
    an out-of-memory error) is the caller's, not the forward's.
    """

    def __init__(self, offload: OffloadActivations) -> None:
        self.offload = offload
        self._local = threading.local()

    @run_eagerly  # host-side bookkeeping: a graph break in a compiled model, never traced
    def before(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: enter the context for a forward that records a graph."""
        if not torch.is_grad_enabled():
            # Evaluation, or a metrics forward under no_grad: nothing is saved (the context
            # would track nothing either; this spares it the entry).
            return
        if getattr(self._local, "open", False):
            self._leave((RuntimeError, RuntimeError("offload: the previous forward did not finish"), None))
        self.offload.__enter__()
        self._local.open = True
        self._local.outer = sys.exc_info()[1]

    @run_eagerly
    def after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook (always called): leave the context, aborting its step if forward raised."""
        if not getattr(self._local, "open", False):
            return
        exc_info = sys.exc_info()
        raised = exc_info[1] is not None and exc_info[1] is not self._local.outer
        self._leave(exc_info if raised else (None, None, None))

    def _leave(self, exc_info: tuple[Any, Any, Any]) -> None:
        self._local.open = False
        self._local.outer = None  # holds a traceback, and with it the frames of the failed step
        self.offload.__exit__(*exc_info)


def _causal_lm(model: torch.nn.Module, layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    # The innermost module with an LM head that runs the layers: the *ForCausalLM under PEFT's
    # and DDP's wrappers.
    found = None
    for module in model.modules():
        if isinstance(getattr(module, "lm_head", None), torch.nn.Linear) and any(m is layer for m in module.modules()):
            found = module
    return found


def offload_trainer(trainer: Any, layers: Optional[Any] = None, **options: Any) -> OffloadActivations:
    """Offload the activations of every training forward ``trainer`` runs; returns the context.

    ``trainer``: a ``transformers.Trainer`` or a subclass (TRL's ``SFTTrainer``, ``DPOTrainer``,
    ...), built and not yet trained. ``layers``: the model's repeated layers; by default the
    module list found in ``trainer.model`` (``model.model.layers`` for HF Llama, also under PEFT).
    ``options``: those of :class:`offload.OffloadActivations` (``num_offload_layers``,
    ``memory_budget_bytes``, ``plan``, ``min_offload_bytes``, ``enabled``, ...); ``device``
    defaults to the device the trainer trains on (``trainer.args.device``).

    What it does by default (no count, plan or budget) is ``OffloadActivations``' default: on
    CUDA, a plan for ``memory_budget_bytes="device"`` (keep, offload or recompute per layer, the
    fastest that fits what the GPU can give; the first training forwards are its probe steps); on
    the CPU, all layers but the last offloaded. With the Trainer's own activation checkpointing
    on (TRL's ``SFTConfig`` turns it on by default) the default is all layers but the last, each
    offloading its checkpoint inputs: a plan would recompute the checkpointed layers again.
    ``num_offload_layers=N`` gives that fixed count in every case.

    The returned :class:`~offload.OffloadActivations` has the figures: ``.stats`` and
    ``.report()`` of the last training forward and its backward, and ``.plan_report()`` with a
    memory budget. For TRL's trainers it replaces ``activation_offloading=True`` (leave that
    flag off). With a plan (``memory_budget_bytes`` / ``plan``), turn the Trainer's own
    activation checkpointing off (``activation_checkpointing=False``; TRL's ``SFTConfig`` turns
    it on by default): the plan recomputes layers itself. Without a plan, offload composes with
    checkpointing (each checkpointed layer offloads its inputs).

    Raises ``TypeError`` for something other than a Trainer or an unknown option (naming this
    function), ``ValueError`` where the trainer cannot be offloaded as set up (no repeated layers
    found, ``torch.nn.DataParallel``, a device that is neither CUDA nor the CPU, checkpointing
    with a plan) and ``RuntimeError`` when the trainer is offloaded already.
    """
    accepted = ACCEPTED_OPTIONS["OffloadActivations"]
    check_unknown_options(API, [name for name in options if name not in accepted], accepted)
    _check_trainer(trainer)
    model = trainer.model
    for hook in model._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), _TrainingForward):
            raise RuntimeError(
                f"offload: {API}: this trainer's model is offloaded already; the first call's "
                "options are in force (its return value has the figures)"
            )
    if layers is None:
        layers = _model_layers(model)
    args = trainer.args
    _check_setup(args, options)
    _check_context_parallel(trainer, model)
    options.setdefault("device", _trainer_device(args))
    if _checkpointing(args) and all(options.get(name) is None for name in (
            "num_offload_layers", "num_layers", "plan", "memory_budget_bytes")):
        # The Trainer turns checkpointing on in train(), after this call, so OffloadActivations
        # cannot see it on the layers yet: the fixed count (which composes with it) is asked for
        # here, not the default plan.
        layers = layer_list(layers)
        options["num_offload_layers"] = len(layers) - 1
    if "model" not in options and "num_offload_layers" not in options:
        # The causal-LM module (under PEFT too): plans may then tile its head and loss, and a
        # long first batch is probed at a short length (offload.layers.model_form).
        layers = layer_list(layers)
        options["model"] = _causal_lm(model, layers[0]) if layers else None
    offload = OffloadActivations(layers, **options)
    entry = _TrainingForward(offload)
    model.register_forward_pre_hook(entry.before)
    model.register_forward_hook(entry.after, always_call=True)
    if hasattr(trainer, "maybe_activation_offload_context"):
        # TRL enters this around each training_step (forward and backward); with its flag on it
        # is TRL's torchtune copy, which would offload the same tensors a second way.
        trainer.maybe_activation_offload_context = contextlib.nullcontext()
    return offload


def _check_trainer(trainer: Any) -> None:
    try:
        from transformers import Trainer
    except ImportError as exc:  # without transformers, nothing can be a Trainer
        raise TypeError(f"offload: {API} needs a transformers.Trainer, and transformers is not installed") from exc
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"offload: {API} takes a transformers.Trainer (or a subclass such as trl.SFTTrainer), "
            f"got {type(trainer).__name__}; for a training loop of your own, use "
            "offload.OffloadActivations(model.layers) around the forward"
        )


def _model_layers(model: torch.nn.Module) -> torch.nn.Module:
    found = find_layers(model)
    if found is None:
        raise ValueError(
            f"offload: {API}: no module list of repeated layers was found in the trainer's "
            f"{type(model).__name__}; pass them: {API}(trainer, layers=model.<the list of blocks>)"
        )
    return found[1]


def _check_setup(args: Any, options: dict[str, Any]) -> None:
    if getattr(args, "n_gpu", 1) > 1:
        raise ValueError(
            f"offload: {API}: this Trainer runs torch.nn.DataParallel (n_gpu={args.n_gpu} in one "
            "process), whose replicas run in threads on copies of the model; launch one process "
            "per GPU instead (torchrun or accelerate launch)"
        )
    planned = options.get("plan") is not None or options.get("memory_budget_bytes") is not None
    checkpointing = _checkpointing(args)
    if planned and checkpointing:
        raise ValueError(
            f"offload: {API}: a plan (plan / memory_budget_bytes) recomputes layers itself; turn "
            f"the Trainer's {checkpointing} off, or offload without a plan "
            "(num_offload_layers) on top of checkpointing"
        )


def _check_context_parallel(trainer: Any, model: torch.nn.Module) -> None:
    # With accelerate's ParallelismConfig(cp_size=...) the Trainer runs torch's context
    # parallelism itself (docs/usage.md); what does not compose with it yet is refused here, as
    # offload.parallel.context_parallel refuses it in a loop of one's own.
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if getattr(config, "cp_enabled", False):
        from ..parallel.refuse import check_composes

        check_composes(model, ())


def _checkpointing(args: Any) -> Optional[str]:
    # transformers 5.24 names it activation_checkpointing, earlier versions gradient_checkpointing.
    return next((name for name in ("activation_checkpointing", "gradient_checkpointing")
                 if getattr(args, name, None)), None)


def _trainer_device(args: Any) -> torch.device:
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"offload: {API}: the trainer trains on {device}; offload moves activations from a "
            "CUDA device to pinned host memory (or between host buffers on the CPU)"
        )
    return device
