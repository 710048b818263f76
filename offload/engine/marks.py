"""Tags that users (and our FP8 layers) put on tensors to steer offloading.

A mark is a plain attribute on the tensor's Python object. PyTorch keeps one Python object per
TensorImpl, so the object the pack hook receives for a saved tensor is the object that was marked
and the attribute survives ``ctx.save_for_backward``. Reading an attribute costs ~70 ns, which is
what lets the pack hook's keep-path stay cheap.

Quantized storages (anything with ``prepare_for_saving`` / ``restore_from_saved``) are marked by
marking each component tensor, so the pack hook, which only ever sees component tensors, honors
the mark without knowing about storages.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

import torch

KEEP_ATTR = "_offload_keep_on_gpu"
OFFLOAD_ATTR = "_offload_activation"
# TransformerEngine tags its do-not-offload tensors with this attribute; honoring it lets tensors
# marked by TE code stay put under our engine too.
TE_KEEP_ATTR = "_TE_do_not_offload"


def storage_components(obj: Any) -> list[torch.Tensor]:
    """Return the component tensors of a quantized storage without disturbing it.

    ``prepare_for_saving`` detaches the components from the storage (TransformerEngine's contract),
    so the storage is restored right away with the same list.
    """
    tensors, restorable = obj.prepare_for_saving()
    restorable.restore_from_saved(list(tensors))
    return [t for t in tensors if t is not None]


def emptied_copy(obj: Any) -> Optional[tuple[Any, list[Optional[torch.Tensor]]]]:
    """A new object like the quantized storage ``obj``, emptied by its own ``prepare_for_saving``.

    Returns ``(restorable, components)``: what that ``prepare_for_saving`` returned, so that
    ``restorable.restore_from_saved(components)`` rebuilds an object equal to ``obj``. ``obj``
    itself is left exactly as it was (the caller may still use it, or save it again), and the
    copy holds no component until it is restored. None when no faithful copy can be made.

    The copy is ``obj.detach()`` (what TransformerEngine's tensor subclasses implement as a
    shallow copy of their internals) or else ``copy.copy(obj)``; it is faithful when its
    ``prepare_for_saving`` hands over the very component tensors ``obj`` holds.
    """
    tensors, restorable = obj.prepare_for_saving()
    restorable.restore_from_saved(list(tensors))
    for make in (_detached, copy.copy):
        try:
            shell = make(obj)
            if shell is obj or type(shell) is not type(obj):
                continue
            parts, shell_restorable = shell.prepare_for_saving()
        except Exception:  # a subclass that supports neither copy: keep it whole instead
            continue
        parts = list(parts)
        if len(parts) == len(tensors) and all(a is b for a, b in zip(parts, tensors)):
            # The copy must not share the containers it just emptied with ``obj``.
            again, restorable = obj.prepare_for_saving()
            restorable.restore_from_saved(list(again))
            if all(a is b for a, b in zip(again, tensors)):
                return shell_restorable, parts
        shell_restorable.restore_from_saved(parts)
    return None


def _detached(obj: Any) -> Any:
    return obj.detach()


def _leaves(objs: tuple[Any, ...], api: str = "mark") -> Iterator[Any]:
    for obj in objs:
        if obj is None:
            continue
        if type(obj) is torch.Tensor:
            # The common case, first: a plain tensor is no storage, and asking it for
            # prepare_for_saving would cost a failed attribute lookup (an exception) per tensor.
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from _leaves(tuple(obj), api)
        elif isinstance(obj, torch.Tensor) and not hasattr(obj, "prepare_for_saving"):
            yield obj
        elif hasattr(obj, "prepare_for_saving"):
            yield obj
            yield from storage_components(obj)
        else:
            raise TypeError(
                f"offload: {api}() cannot mark an object of type {type(obj).__name__}: pass tensors "
                "or quantized storages (objects with prepare_for_saving/restore_from_saved)"
            )


def mark_not_offload(*tensors: Any) -> None:
    """Keep these tensors (or every component of these quantized storages) on the GPU.

    Honored by the one selection policy, so it holds in every schedule (v1 and v2) and wins over
    :func:`mark_activation_offload` when a tensor carries both marks.
    """
    for obj in _leaves(tensors, "mark_not_offload"):
        setattr(obj, KEEP_ATTR, True)


def mark_activation_offload(*tensors: Any) -> None:
    """Opt these tensors (or storage components) in for offloading.

    The v1 schedule offloads only tensors carrying this mark (unless ``selection="auto"``); in
    every schedule a marked tensor is offloaded whatever its size, so that small FP8 scale tensors
    travel in their group's region next to their data.
    """
    for obj in _leaves(tensors, "mark_activation_offload"):
        setattr(obj, OFFLOAD_ATTR, True)


def start_offload(*tensors: Any, offload_base_tensor: bool = False) -> None:
    """TransformerEngine's ``start_offload``: accepted, checked, and nothing more is needed.

    In TransformerEngine it records an event so that a tensor's copy may start before its layer
    ends, and with ``offload_base_tensor=True`` offloads a view's base instead of the view. Here
    a layer's group is copied in one batch as soon as the layer ends (a finer start would cost a
    CUDA event per tensor on the hot path), and every saved view is always resolved to its base
    storage and restored as a view of it. So the call only checks its arguments (tensors,
    quantized storages, None, or lists of them), and code written for TransformerEngine runs
    unchanged.
    """
    if not isinstance(offload_base_tensor, bool):
        raise TypeError(
            f"offload: start_offload(): offload_base_tensor must be True or False, got {offload_base_tensor!r}"
        )
    for _ in _leaves(tensors, "start_offload"):
        pass


def is_marked_keep(t: torch.Tensor) -> bool:
    """True when ``t`` or the tensor it is a view of carries a do-not-offload mark."""
    if getattr(t, KEEP_ATTR, False) or getattr(t, TE_KEEP_ATTR, False):
        return True
    base = t._base
    return base is not None and (getattr(base, KEEP_ATTR, False) or getattr(base, TE_KEEP_ATTR, False))


def is_marked_offload(t: torch.Tensor) -> bool:
    """True when ``t`` or the tensor it is a view of was opted in for offloading."""
    if getattr(t, OFFLOAD_ATTR, False):
        return True
    base = t._base
    return base is not None and getattr(base, OFFLOAD_ATTR, False)
