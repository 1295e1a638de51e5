"""Memory budgets as users write them: bytes, "3.5GiB"/"800MB" strings, or a share of a reference peak."""

from __future__ import annotations

import math
import numbers
import re

from tfremat.errors import BudgetFormatError
from tfremat.units import format_bytes

__all__ = ["parse_budget", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")
_ACCEPTED = 'bytes as an int (12_000_000_000), a string with a unit ("3.5GiB", "800MB"), or a share of the checkpoint-all peak ("50%" or 0.5)'


def parse_budget(budget, reference_bytes: float | None = None) -> int:
    """Turns a user budget into bytes.

    Args:
        budget: an int number of bytes; a float in (0, 1] or a string ending in ``%``,
            meaning that share of ``reference_bytes``; or a string with a unit
            (B, KB, MB, GB, TB in powers of 10; KiB, MiB, GiB, TiB or K, M, G, T in powers of 2).
        reference_bytes: the peak a relative budget refers to (the checkpoint-all peak).

    Raises:
        BudgetFormatError: the budget is unparsable, non-positive, or relative without a
            reference; the message names the accepted forms.
    """
    if isinstance(budget, bool) or budget is None:
        raise BudgetFormatError(f"budget={budget!r} is not a budget; use {_ACCEPTED}")
    fraction = None
    if isinstance(budget, numbers.Integral):
        value = int(budget)
    elif isinstance(budget, numbers.Real):
        budget = float(budget)
        if not math.isfinite(budget) or budget <= 0:
            raise BudgetFormatError(f"budget={budget!r} must be positive; use {_ACCEPTED}")
        if budget <= 1:
            fraction = budget
            value = 0
        elif budget.is_integer():
            value = int(budget)
        else:
            raise BudgetFormatError(f"budget={budget!r}: a float budget is a fraction in (0, 1]; use {_ACCEPTED}")
    elif isinstance(budget, str):
        match = _PATTERN.match(budget)
        if not match or match.group(2).lower() not in {**_UNITS, "%": 1}:
            raise BudgetFormatError(f"budget={budget!r} is unparsable; use {_ACCEPTED}")
        number, unit = float(match.group(1)), match.group(2).lower()
        if not math.isfinite(number):
            raise BudgetFormatError(f"budget={budget!r} is not a finite number; use {_ACCEPTED}")
        if unit in ("", "b") and not number.is_integer():
            raise BudgetFormatError(
                f"budget={budget!r}: a string without a unit counts bytes, which are whole; write "
                f"'{number * 100:g}%' (or the number {number:g}) for a share of the checkpoint-all peak"
                if number <= 1 else f"budget={budget!r}: bytes are whole; use {_ACCEPTED}"
            )
        if unit == "%":
            fraction = number / 100
            value = 0
        else:
            value = int(number * _UNITS[unit])
    else:
        raise BudgetFormatError(f"budget={budget!r} has type {type(budget).__name__}; use {_ACCEPTED}")
    if fraction is not None:
        if fraction <= 0:
            raise BudgetFormatError(f"budget={budget!r} must be positive")
        if reference_bytes is None:
            raise BudgetFormatError(f"budget={budget!r} is relative, but no reference peak is known here; give bytes instead")
        value = int(fraction * reference_bytes)
    if value <= 0:
        raise BudgetFormatError(f"budget={budget!r} must be positive; use {_ACCEPTED}")
    return value
