"""Forward stand-ins set on a module instance (``module.forward = wrapper``): how the tools that do
it (selective recompute, tiling, the model form) take their modules and refuse a forward someone
else already set there.

Why an instance attribute: ``nn.Module.__call__`` reads ``self.forward``, so hooks and the class
stay as they are, and deleting the attribute gives the class's forward back. Why refuse another
tool's: wrapping it would hide it, and removing ours would then drop theirs.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from torch import nn


def module_list(modules: Union[nn.Module, Any], where: str) -> list[nn.Module]:
    """``modules`` (a module or an iterable of them) as a list; ``TypeError`` naming ``where``
    for anything else."""
    if isinstance(modules, nn.Module):
        return [modules]
    try:
        chosen = list(modules)
    except TypeError:
        raise TypeError(f"{where} takes a module or an iterable of modules, got {type(modules).__name__}") from None
    for i, module in enumerate(chosen):
        if not isinstance(module, nn.Module):
            raise TypeError(f"{where}: item {i} is a {type(module).__name__}, not a torch.nn.Module")
    return chosen


def check_own_forward(module: nn.Module, ours: type, who: str, already: str, advice: str) -> None:
    """Raise ``ValueError`` if ``module`` has a forward set on the instance: ``f"{who} {already}"``
    when it is one of ``ours``, else that another tool set it, with ``advice``.

    A stand-in that knows its holder (a ``holder`` attribute, as the model form's has) is named
    with it: ``holder`` is None once the holder is gone, and the stand-in is then taken off here
    and not refused: it only calls the module's own forward. (Here, when a tool asks, rather than
    from the holder's finalizer, which could run while other code iterates the module's
    ``__dict__``: a ``copy.deepcopy`` of it, say.)"""
    own = module.__dict__.get("forward")
    if own is not None and hasattr(own, "holder") and own.holder is None:
        del module.forward
        own = None
    if isinstance(own, ours):
        raise ValueError(f"{who} {already}")
    if own is not None:
        holder = getattr(own, "holder", None)
        if holder is not None:
            raise ValueError(f"{who} has its forward held by {holder}")
        raise ValueError(f"{who} has a forward set on the instance by other code; {advice}")


class InstalledForwards:
    """The handle a tool returns for the stand-ins it put on modules (``wrapper``: their type):
    :meth:`remove` gives each module its own ``forward`` back; usable as a context manager."""

    wrapper: ClassVar[type] = object

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        # The stand-ins themselves: another tool (a plan's wrappers) may wrap them later, and
        # remove() must find them there.
        self.installed = [module.__dict__.get("forward") for module in modules]

    def remove(self) -> None:
        """Take every stand-in off its module (idempotent): the module gets its own ``forward``
        back, or, where another tool wrapped the stand-in since (a plan's wrappers), that tool's
        wrapper now calls what the stand-in called, so removing it later does not put the
        stand-in back."""
        for module, installed in zip(self.modules, self.installed):
            if isinstance(installed, self.wrapper):
                splice_out(module, installed)
        self.modules, self.installed = [], []

    def __enter__(self) -> "InstalledForwards":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def splice_out(module: nn.Module, wrapper: Any) -> bool:
    """Take ``wrapper`` out of ``module``'s chain of forward stand-ins (each calls the next
    through its ``fn``): whoever called it now calls its ``fn``. Whether it was found."""
    holder, current = None, module.__dict__.get("forward")
    while current is not None:
        if current is wrapper:
            inner = wrapper.fn
            if holder is not None:
                holder.fn = inner
            elif getattr(inner, "__self__", None) is module:
                del module.forward  # it wrapped the class's forward: deleting gives it back
            else:
                module.forward = inner
            return True
        holder, current = current, getattr(current, "fn", None)
    return False
