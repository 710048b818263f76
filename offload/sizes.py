"""Byte counts as users write them: ``20 << 30``, ``20e9``, ``"20GB"``, ``"20 GiB"``. Bottom
floor: imports nothing of ours.

One reader for every option that counts bytes (``memory_budget_bytes``, ``host_budget_bytes``,
``min_offload_bytes``, ``group_bytes``), so each takes the same forms and refuses the same
mistakes: a wrong type is a ``TypeError``, a value the grammar or the range refuses a
``ValueError``, and both name the option and show the forms it takes.

The grammar of a string: a decimal number (``20``, ``1.5``, ``1.5e9``), optional spaces, and an
optional unit, case-insensitive: ``B``; ``kB``, ``MB``, ``GB``, ``TB`` (powers of 1000); ``KiB``,
``MiB``, ``GiB``, ``TiB`` (powers of 1024). A bare ``K``/``M``/``G``/``T`` is refused: it is read
as 1000 by some tools and 1024 by others. A count of bytes (an int, a float, a string without a
unit or in ``B``) must be whole: ``1.5e9`` is, ``0.9 * capacity`` mostly is not, and
``int(0.9 * capacity)`` says which way to round; a size in a larger unit is rounded down to whole
bytes (``"1.3 GiB"``). Every count lies in ``[minimum, MAX_BYTES]``: the native hooks and torch
read sizes as signed 64-bit integers.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from typing import Any

# The largest byte count an option takes: what a signed 64-bit integer holds.
MAX_BYTES = 2**63 - 1

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)
# Exponents beyond this are no byte count (and would make Decimal work for nothing).
_MAX_EXPONENT = 30

FORMS = "an int such as 20 << 30, a float such as 20e9, or a string such as '20GB' or '20 GiB'"


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def parse_size(text: str) -> int:
    """The bytes ``text`` names (see the module notes for the grammar), rounded down to whole
    bytes; ``ValueError`` saying what is wrong with it otherwise (the caller adds the option)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        why = "is negative" if text.strip().startswith("-") else "is not a size"
        raise ValueError(f"{text!r} {why}: write a number and an optional unit, such as '20GB', '20 GiB' or '1.5e9'")
    number, exponent, unit = match.groups()
    scale = UNITS.get(unit.lower())
    if scale is None:  # ("" is a count of bytes)
        bare = unit.lower() in ("k", "m", "g", "t")
        units = "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        raise ValueError(
            f"{text!r} has the unit {unit!r}, which " + (
                f"could mean powers of 1000 or of 1024: write {unit.upper()}B or {unit.upper()}iB"
                if bare else f"is not one of {units}")
        )
    if exponent is not None and abs(int(exponent)) > _MAX_EXPONENT:
        raise ValueError(f"{text!r} is out of range: sizes go up to {MAX_BYTES} bytes (8 EiB)")
    value = Decimal(number) * (Decimal(10) ** int(exponent or 0)) * scale
    if scale == 1 and value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)  # towards zero: down, for a size that cannot be negative


def byte_count(where: str, name: str, value: Any, minimum: int = 0, *, extra: str = "") -> int:
    """``value`` (an int, a float or a size string, as the module notes say) as whole bytes in
    ``[minimum, MAX_BYTES]``. ``TypeError`` for any other type, ``ValueError`` for a string the
    grammar refuses, a float that is not finite, or a count out of range; messages begin with
    ``f"offload: {where}: {name}"`` and show the forms taken. ``extra``: the option's other
    values, to name in the messages (e.g. ``", 'device' or 'lowest'"``)."""
    what = f"offload: {where}: {name} must be a number of bytes from {minimum} to 2**63 - 1 ({FORMS}){extra}"
    if isinstance(value, bool):
        raise TypeError(f"{what}, got {_got(value)}")
    if isinstance(value, numbers.Integral):
        count = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"{what}, got {value!r}")
        if value != math.floor(value):
            raise ValueError(f"{what}, got {value!r}: not a whole number of bytes (int() rounds it down)")
        count = math.floor(value)
    elif isinstance(value, str):
        try:
            count = parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
    else:
        raise TypeError(f"{what}, got {_got(value)}")
    if not minimum <= count <= MAX_BYTES:
        shown = value if isinstance(value, numbers.Integral) else f"{value!r} = {count} bytes"
        raise ValueError(f"{what}, got {shown}")
    return count


# The engine options that count bytes, and whether None is one of their values (the default:
# 32 MiB groups, the host's budget). memory_budget_bytes has values of its own ("device",
# "lowest"): offload.planner.make.check_budget reads it.
BYTE_OPTIONS = {"min_offload_bytes": False, "group_bytes": True, "host_budget_bytes": True}


def byte_options(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (an entry point's, by name) with those of :data:`BYTE_OPTIONS` given read as
    whole bytes by :func:`byte_count`; the others as given. Errors name ``where`` and the option."""
    read = dict(options)
    for name, none_ok in BYTE_OPTIONS.items():
        if name in read and not (none_ok and read[name] is None):
            read[name] = byte_count(where, name, read[name], 0, extra=" or None (the default)" if none_ok else "")
    return read
