"""``offload.fp8.convert``: one call that turns a model's ``nn.Linear`` modules into :class:`offload.fp8.Linear`, in place,
and one that turns them back.

``convert(model)`` changes each chosen ``nn.Linear``'s class to ``fp8.Linear`` and adds the FP8
state (scaling, input format, weight cache): the module object, its Parameters, its buffers,
hooks, ``training`` flag and its place in the model all stay what they were. So an optimizer or
FSDP built before the call sees no change, ``state_dict`` keys do not move, a module list that
names the Linear (``OffloadActivations``' layers, a hook handle) still names it, and the call
allocates nothing. Building a new ``fp8.Linear`` and moving the Parameters over, as torchao's
``convert_to_float8_training`` does, would give the same Parameters but new module objects, and
would have to copy every hook and attribute by hand.

``unconvert(model)`` is the exact inverse for ``fp8.Linear`` itself: the FP8 state is removed
(the weight caches' memory goes with it) and the class is ``nn.Linear`` again. Subclasses with
parameters of their own (``fp8.LayerNormLinear``) have no ``nn.Linear`` form and are left as they
are, with the reason in the summary.

Only modules whose type is exactly ``nn.Linear`` are converted: a subclass may have its own
forward (LoRA, quantized or parametrized Linears, ``nn.MultiheadAttention``'s ``out_proj``,
whose weight the attention reads directly), which FP8's forward would silently replace. Shapes
FP8 GEMMs cannot take (a feature count that is not a multiple of 16) and weights of other dtypes
than float32/bfloat16/float16 are skipped, each with its reason in the summary. So is a Linear
that already holds something (an attribute, Parameter, buffer or submodule) under a name of
``fp8.Linear.FP8_STATE`` (``scaling``, ...): convert would overwrite it and unconvert delete it,
and the user's code would read FP8's setting in its place (issue 32); it is left as it is, with a
warning. Convert before ``torch.compile`` and ``fully_shard`` (both act on the module classes
they find).

(This module is ``conversion``, not ``convert``: ``offload.fp8.convert`` is the function, and a
submodule of that name would be shadowed by it.)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..quantized import HIGH_PRECISION
from .gemm import features_reason, rowwise_supported, unsupported_reason
from .linear import Linear, check_fp8_options
from .llama_ops import LlamaOpsSummary, convert_llama_ops, restore_llama_ops
from .weights import DEFAULT_WEIGHT_LAYOUTS

__all__ = ["ConvertSummary", "ModuleFilter", "convert", "unconvert", "CPU_SLOW_WARNING"]

ModuleFilter = Callable[[nn.Module, str], bool]

# Measured on a CPU-only machine (fp8.Linear against nn.Linear in bfloat16, forward and backward
# at M, K, N = 16, 1024, 1024): torch's CPU _scaled_mm has no fast kernel.
CPU_SLOW_WARNING = (
    "offload.fp8.convert: {count} Linear module(s) converted on the CPU. torch's CPU _scaled_mm is "
    "slow (measured: about 1,250x bfloat16's time at 16x1024x1024 on a CPU-only machine): use it "
    "on the CPU to check code and numerics, and train on a GPU of compute capability 8.9 or newer"
)


@dataclass(frozen=True)
class ConvertSummary:
    """What :func:`convert` or :func:`unconvert` did, by module name (the ``named_modules`` name,
    which is the ``state_dict`` prefix; ``""`` is the module passed in).

    - ``converted``: modules whose class was changed (to ``fp8.Linear``, or back).
    - ``already``: modules already in the target form, left alone (a second call lists them all).
    - ``filtered``: ``nn.Linear`` modules that ``module_filter_fn`` left out.
    - ``skipped``: modules that could not be converted, each with the reason.
    - ``llama_ops``: what ``convert(..., llama_ops=True)`` did to Llama-style layers' norms and
      MLPs (:func:`offload.fp8.convert_llama_ops`), None when not asked; ``restored_ops``: how
      many of them :func:`unconvert` put back.
    """

    action: str
    converted: tuple[str, ...] = ()
    already: tuple[str, ...] = ()
    filtered: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    settings: str = ""
    llama_ops: Optional[LlamaOpsSummary] = None
    restored_ops: int = 0

    @property
    def changed(self) -> bool:
        """Whether any module's class was changed."""
        return bool(self.converted)

    def __str__(self) -> str:
        target = "fp8.Linear" if self.action == "convert" else "torch.nn.Linear"
        head = f"offload.fp8.{self.action}: "
        head += f"{len(self.converted)} module(s) to {target}" if self.converted else "nothing changed"
        if self.converted and self.settings:
            head += f" ({self.settings})"
        parts = [f"{len(self.already)} already {target}"]
        if self.filtered:
            parts.append(f"{len(self.filtered)} left out by module_filter_fn")
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped")
        lines = [f"{head}; {', '.join(parts)}"]
        lines += [f"  skipped {name or '<root>'}: {reason}" for name, reason in self.skipped.items()]
        if self.llama_ops is not None and self.llama_ops.layers:
            lines.append(f"  {self.llama_ops}")
        if self.restored_ops:
            lines.append(f"  {self.restored_ops} Llama norm/MLP module(s) restored")
        return "\n".join(lines)


def _no_linear_error(action: str, module: nn.Module) -> ValueError:
    return ValueError(
        f"offload.fp8.{action}: {type(module).__name__} contains no torch.nn.Linear module (nor an "
        f"fp8.Linear), so there is nothing to {action}; pass the model, or the part of it, that "
        "holds the Linear layers"
    )


def _weight_reason(linear: nn.Linear) -> Optional[str]:
    """Why this ``nn.Linear``'s shape or dtype cannot run FP8 GEMMs, or None."""
    reason = features_reason(linear.in_features, linear.out_features)
    if reason is not None:
        return reason
    if linear.weight.dtype not in HIGH_PRECISION:
        return f"weight dtype {linear.weight.dtype}: fp8.Linear takes float32, bfloat16 or float16"
    return None


def _held_names(module: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` that ``module`` itself holds: a plain attribute, Parameter, buffer or
    submodule (``nn.Module`` keeps the last three outside ``__dict__``)."""
    stores = (vars(module), module._parameters, module._buffers, module._modules)
    return [n for n in names if any(n in store for store in stores)]


def _state_clash_reason(linear: nn.Linear) -> Optional[str]:
    """Why converting this ``nn.Linear`` would overwrite something of its own, or None. The FP8
    state is set on the module object (:attr:`fp8.Linear.FP8_STATE`) and deleted by
    :func:`unconvert`; a value the user keeps under one of those names would be replaced while
    converted and lost after."""
    held = _held_names(linear, Linear.FP8_STATE)
    if not held:
        return None
    return (
        f"it already has {', '.join(repr(n) for n in held)} of its own, a name fp8.Linear uses for "
        f"its FP8 state ({', '.join(Linear.FP8_STATE)}): converting would overwrite it and unconvert "
        "would delete it. Rename that attribute to convert this Linear, or leave it out with "
        "module_filter_fn to keep it as it is"
    )


def _device_reason(device: torch.device, scaling: str) -> Optional[str]:
    """Why FP8 GEMMs of this scaling cannot run on ``device``, or None. A meta model (not yet
    materialized) can be converted: the check happens at its first call."""
    if device.type == "meta":
        return None
    reason = unsupported_reason(device)
    if reason is None and scaling == "rowwise" and not rowwise_supported(device.type):
        reason = f"torch._scaled_mm takes no rowwise scales on {device.type} in PyTorch {torch.__version__}"
    return reason


def convert(
    module: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    scaling: str = "tensorwise",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    weight_layouts: str = DEFAULT_WEIGHT_LAYOUTS,
    allow_fallback: bool = False,
    llama_ops: bool = True,
) -> ConvertSummary:
    """Turn the ``torch.nn.Linear`` modules of ``module`` (itself included) into
    :class:`offload.fp8.Linear`, in place, keeping the module objects and their Parameters.

    Args:
        module: the model or any part of it.
        module_filter_fn: ``fn(linear, name) -> bool``, as torchao's: only modules it returns
            True for are converted (``name`` as ``named_modules`` gives it). For example
            ``lambda m, name: name != "lm_head"``.
        scaling, fp8_dtype, weight_layouts: as for :class:`offload.fp8.Linear`.
        allow_fallback: on a device where FP8 GEMMs cannot run (a GPU of compute capability
            below 8.9, or rowwise scaling where ``_scaled_mm`` has none), leave its Linears as
            ``nn.Linear`` with a warning (they are listed in ``skipped``) instead of raising.
        llama_ops: also swap the RMSNorms and SwiGLU MLPs of Llama-style decoder layers for
            FP8-saving ones (:func:`offload.fp8.convert_llama_ops`: the norm saves its input and
            per-row rstd, the Linears it feeds share one quantization and save nothing of their
            own, the MLP saves FP8 copies of gate and up). Without them an FP8 Llama layer
            saves about as much as bf16. Models without such layers are left as they are.

    Returns a :class:`ConvertSummary`: converted, already FP8, filtered out, and skipped with the
    reason (a feature count that is not a multiple of 16, a weight dtype FP8 Linear does not
    take, a subclass of ``nn.Linear``, a device without FP8 GEMMs, an attribute of the module's
    own under a name of ``fp8.Linear.FP8_STATE``, which also warns). Calling it again converts
    nothing and lists every converted module as ``already``; those keep their own settings.

    Raises ``ValueError`` when ``module`` holds no Linear at all, for options ``fp8.Linear`` does
    not take, and, unless ``allow_fallback``, when a chosen Linear sits on a device without FP8
    GEMMs (nothing is converted then). On the CPU it converts and warns that torch's CPU
    ``_scaled_mm`` is slow.

    The reverse is :func:`unconvert` (back to ``nn.Linear``, the same modules and Parameters).
    """
    api = "offload.fp8.convert"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{api}: expected a torch.nn.Module, got {type(module).__name__}")
    check_fp8_options(api, scaling, fp8_dtype, weight_layouts)
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"{api}: module_filter_fn must be a callable (module, name) -> bool, got {type(module_filter_fn).__name__}")
    chosen: list[tuple[str, nn.Linear]] = []
    already: list[str] = []
    filtered: list[str] = []
    skipped: dict[str, str] = {}
    clashes: list[str] = []  # skipped because they hold a name of FP8_STATE: warned about below
    for name, m in module.named_modules():
        if isinstance(m, Linear):
            already.append(name)
        elif type(m) is nn.Linear:
            if module_filter_fn is not None and not module_filter_fn(m, name):
                filtered.append(name)
                continue
            reason = _weight_reason(m)
            clash = None if reason is not None else _state_clash_reason(m)
            if clash is not None:
                skipped[name] = clash
                clashes.append(name)
            elif reason is not None:
                skipped[name] = reason
            else:
                chosen.append((name, m))
        elif isinstance(m, nn.Linear):
            skipped[name] = (
                f"{type(m).__name__} is a subclass of torch.nn.Linear, whose forward may differ from "
                "nn.Linear's; only nn.Linear itself is converted"
            )
    if not (chosen or already or filtered or skipped):
        raise _no_linear_error("convert", module)
    if clashes:
        # Once per call, not per module: a model may hold many such Linears.
        warnings.warn(
            f"{api}: {len(clashes)} Linear module(s) left as torch.nn.Linear because they hold an "
            f"attribute named like fp8.Linear's state ({', '.join(Linear.FP8_STATE)}), which "
            f"converting would overwrite: {', '.join(n or '<root>' for n in clashes)}; the "
            "summary's 'skipped' says which name, and what to do",
            stacklevel=2,
        )

    # Every device is judged before any module changes: an error leaves the model as it was.
    verdicts = {dev: _device_reason(dev, scaling) for dev in {m.weight.device for _, m in chosen}}
    refused = {dev: reason for dev, reason in verdicts.items() if reason is not None}
    if refused and not allow_fallback:
        where = "; ".join(f"{dev}: {reason}" for dev, reason in refused.items())
        raise ValueError(
            f"{api}: FP8 GEMMs cannot run where these Linear modules are ({where}). Nothing was "
            "converted; pass allow_fallback=True to leave them as torch.nn.Linear (in their own "
            "precision) and convert the rest"
        )
    converted: list[str] = []
    cpu = 0
    for name, m in chosen:
        reason = refused.get(m.weight.device)
        if reason is not None:
            skipped[name] = f"left as torch.nn.Linear (allow_fallback=True): {reason}"
            continue
        m.__class__ = Linear
        Linear._init_fp8_state(m, scaling, fp8_dtype, weight_layouts)  # type: ignore[arg-type]
        converted.append(name)
        cpu += m.weight.device.type == "cpu"
    if refused:
        warnings.warn(
            f"{api}: allow_fallback=True: {len(chosen) - len(converted)} Linear module(s) stay "
            f"torch.nn.Linear, in their own precision, because FP8 GEMMs cannot run there "
            f"({'; '.join(f'{d}: {r}' for d, r in refused.items())}); the summary's 'skipped' lists them",
            stacklevel=2,
        )
    if cpu:
        warnings.warn(CPU_SLOW_WARNING.format(count=cpu), stacklevel=2)
    return ConvertSummary(
        "convert", tuple(converted), tuple(already), tuple(filtered), skipped,
        settings=f"scaling={scaling!r}, fp8_dtype={fp8_dtype}, weight_layouts={weight_layouts!r}",
        llama_ops=convert_llama_ops(module, missing_ok=True) if llama_ops else None,
    )


def unconvert(module: nn.Module) -> ConvertSummary:
    """Turn every :class:`offload.fp8.Linear` of ``module`` (itself included) back into a
    ``torch.nn.Linear``, in place: the same module objects and Parameters, their FP8 state (and
    the memory of their weight caches) dropped. The inverse of :func:`convert`.

    ``fp8.Linear`` subclasses with parameters of their own (``fp8.LayerNormLinear``) have no
    ``nn.Linear`` form: they are left as they are and listed in ``skipped``. Llama norms and
    MLPs that ``convert`` swapped get their original modules back. ``nn.Linear``
    modules are listed as ``already``. Raises ``ValueError`` when ``module`` holds no Linear.
    Call it between steps (not between a forward and its backward, which still needs the FP8
    copies the forward made: those stay alive with the graph, not with the module).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"offload.fp8.unconvert: expected a torch.nn.Module, got {type(module).__name__}")
    restored = restore_llama_ops(module)
    converted: list[str] = []
    already: list[str] = []
    skipped: dict[str, str] = {}
    for name, m in module.named_modules():
        if type(m) is Linear:
            for attr in Linear.FP8_STATE:
                delattr(m, attr)
            m.__class__ = nn.Linear
            converted.append(name)
        elif isinstance(m, Linear):
            skipped[name] = (
                f"fp8.{type(m).__name__} computes more than a Linear (LayerNormLinear: its norm, with "
                "parameters of its own); it has no torch.nn.Linear form"
            )
        elif isinstance(m, nn.Linear):
            already.append(name)
    if not (converted or already or skipped):
        raise _no_linear_error("unconvert", module)
    return ConvertSummary("unconvert", tuple(converted), tuple(already), (), skipped, restored_ops=restored)
