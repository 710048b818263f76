"""Unknown keyword arguments of public functions: one error, naming the function and listing what
it accepts (with a close match when there is one). Bottom floor: imports nothing of ours."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Iterable


def parameter_names(fn: Any) -> tuple[str, ...]:
    """The keyword names ``fn`` takes, in order (its ``*args`` / ``**kwargs`` and ``self`` left out)."""
    return tuple(
        name for name, p in inspect.signature(fn).parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) and name != "self"
    )


def reject_unknown(api: str, unknown: Iterable[str], accepted: Iterable[str]) -> None:
    """Raise ``TypeError`` for keyword arguments the public function ``api`` does not take."""
    unknown = list(unknown)
    if not unknown:
        return
    accepted = tuple(accepted)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(unknown) > 1 else ""
    raise TypeError(
        f"offload: {api}() got unexpected keyword argument{plural} {', '.join(hints)}; "
        f"it accepts: {', '.join(accepted)}"
    )
