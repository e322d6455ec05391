"""How a budget is written (``budget``, ``disk.host_cache``): a fraction of each
layer's experts, a count per layer, a size in bytes (:func:`parse_size`), or ``"auto"``
(:func:`budget_value`). What a budget buys is :mod:`.sizing`'s."""

from __future__ import annotations

import math
import re
from typing import Any

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
MAX_SIZE = 2**60
"""The largest size a budget may give (an exbibyte)."""
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*$", re.ASCII)
"""ASCII only: ``\\d`` would take other scripts' digits (``"٤٨MiB"``), which no one
reading the config would see as a number."""


def parse_size(text: str) -> int:
    """Bytes of a size such as ``"12GiB"``, ``"800MB"`` or ``"1.5 TiB"`` (units: B, KB,
    MB, GB, TB in powers of 10; KiB, MiB, GiB, TiB in powers of 2; any case). Raises
    ``ValueError`` for anything else, and for a size that is not positive."""
    match = _SIZE.match(text)
    unit = match and UNITS.get(match.group(2).lower())
    if match is None or unit is None:
        raise ValueError(
            f"{_brief(text)} is not a size: give a number and a unit, e.g. '12GiB' or '800MB' "
            "(units: B, KB, MB, GB, TB; KiB, MiB, GiB, TiB)"
        )
    number = float(match.group(1))
    if not number * unit < MAX_SIZE:  # (also inf, from a number too long for a float)
        raise ValueError(f"{_brief(text)} is larger than any memory (at most 1 EiB)")
    size = int(number * unit)
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return size


MAX_EXPERTS = 65536
"""The most routed experts per layer a count may give."""


def budget_value(value: Any) -> float | int | str:
    """A budget as written in its one form: ``"auto"``, a size, a count in
    ``[2, MAX_EXPERTS]`` or a fraction in ``(0, 1]`` (``1`` reads as 1.0: JSON cannot
    tell them apart). ``ValueError`` says what is wrong."""
    if isinstance(value, str):
        if value != value.strip():  # (as a number in a string is: read as written)
            raise ValueError(f"{_brief(value)} has spaces around it: write it without them")
        if value.lower() == "auto":
            return "auto"
        parse_size(value)  # (a ValueError says what a size looks like)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"must be a fraction, a count, a size such as '12GiB', or 'auto', got {value!r}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be finite, got {value}")
    if isinstance(value, float) and value.is_integer() and value > 1:
        value = int(value)
    if isinstance(value, int):
        if value == 1:
            return 1.0
        if not 2 <= value <= MAX_EXPERTS:
            try:
                shown = f"{value:.6g}"
            except OverflowError:  # (past a float's range)
                shown = f"an integer of {len(str(abs(value)))} digits"
            raise ValueError(f"count must be in [2, {MAX_EXPERTS}], got {shown}")
        return value
    if not 0.0 < value <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {value:.6g}")
    return float(value)


def _brief(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
