"""Memory budgets as users write them: bytes, "3.5GiB"/"800MB" strings, or a share of a reference peak.

Budgets are floored to whole bytes, so a budget never exceeds what was written, and are
read so that the floor does not lose a byte to binary rounding either:

* a string is the decimal it spells, exactly ("2.01MB" is 2,010,000 bytes, "57%" of
  100 bytes is 57; float arithmetic made them 2,009,999 and 56);
* a float share (0.57) is a binary fraction that carries its own rounding, up to one
  part in 2**53 of it, so its product with the reference is taken as the integer just
  above it when within one part in 2**52 of it: 0.57 of 100 bytes is 57 (the float
  product is 56.99999999999999) and 1/3 of 300 is 100. A product further from an
  integer than a float's rounding can explain is floored as it is.

Every registered strategy reads its budget through
:func:`tfremat.plan.registry.parse_graph_budget`, so a budget means the same to all of them.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from tfremat.errors import BudgetFormatError, is_int, is_number
from tfremat.units import format_bytes

__all__ = ["parse_budget", "check_budget", "is_share", "budget_kind", "is_absolute_min", "format_bytes", "MIN_BUDGET",
           "ABSOLUTE_MIN_BUDGET", "larger_shapes", "share_floor"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")
# The forms a strategy called directly takes; the planner takes the two "min" budgets too.
_AMOUNTS = ('bytes as an int (12_000_000_000), a string with a unit ("3.5GiB", "800MB"), a share of the '
            'checkpoint-all peak ("50%" or 0.5), a share of its activation memory ("50% of activations")')
_ACCEPTED = (f'{_AMOUNTS}, "min" (the least memory a schedule reaches within one extra forward pass), or '
             '"absolute min" (at any cost)')
# The budgets that ask for the least memory: "min" within one extra forward pass of compute
# (tfremat.strategies.least_budget_within), "absolute min" at any cost (least_peak, which
# may recompute many forward passes). Both are of the kind "min".
MIN_BUDGET = "min"
ABSOLUTE_MIN_BUDGET = "absolute min"
# "50% of activations" (or "50% activations"): a share of the memory planning can move.
_ACTIVATIONS = re.compile(r"^\s*(\S+?)\s*(?:of\s+)?activations\s*$", re.IGNORECASE)
# The rounding a float share may carry, relative to the product (module docstring): one
# part in 2**52, twice the half unit in the last place of a float.
_FLOAT_SLACK = Fraction(1, 2**52)
# A command line passes strings only: no ints with underscores, no float shares.
_ACCEPTED_ON_COMMAND_LINE = (
    "bytes (12000000000), a size with a unit (3.5GiB, 800MB), a share of the checkpoint-all peak (50%), a share "
    "of its activation memory ('50% of activations'), min (the least memory a schedule reaches within one extra "
    "forward pass), or 'absolute min' (at any cost)"
)


def parse_budget(budget, reference_bytes: float | None = None, *, fixed_bytes: int | None = None,
                 flag: str | None = None) -> int:
    """Turns a user budget into bytes.

    Args:
        budget: an int number of bytes; a float in (0, 1] or a string ending in ``%``,
            meaning that share of ``reference_bytes``; a share followed by "of activations"
            ("50% of activations"), meaning ``fixed_bytes`` plus that share of the rest of
            ``reference_bytes`` (the memory planning can move); or a string with a unit
            (B, KB, MB, GB, TB in powers of 10; KiB, MiB, GiB, TiB or K, M, G, T in powers of 2).
            Read exactly and floored to whole bytes (see the module docstring). ``"min"``
            and ``"absolute min"`` are refused here: they take a search over schedules,
            which the planner runs (:func:`tfremat.planner.resolve_min_budget`).
        reference_bytes: the peak a relative budget refers to (the checkpoint-all peak).
        fixed_bytes: the memory no schedule moves (weights, gradients, optimizer state, the
            batch), for a share of activations.
        flag: the command-line flag the budget came from (``"--budget"``), when it came
            from one: messages then name the flag and suggest only forms a command line
            can express.

    Raises:
        BudgetFormatError: the budget is unparsable, less than one byte, or relative
            without a reference; the message names the accepted forms.
    """
    kind = budget_kind(budget, flag=flag)
    if kind == MIN_BUDGET:
        raise BudgetFormatError(
            f"{_shown(budget, flag)} asks for the least memory a schedule reaches, which the planner finds "
            "(tfremat.plan_model, fit, compare, the command line); a strategy called directly takes "
            f"{_AMOUNTS}"
        )
    if kind == "activations":
        if reference_bytes is None or fixed_bytes is None:
            raise BudgetFormatError(f"{_shown(budget, flag)} is a share of activation memory, but no graph is "
                                    "known here to say how much that is; give bytes instead")
        moving = parse_budget(_ACTIVATIONS.match(budget).group(1), max(int(reference_bytes) - fixed_bytes, 0),
                              flag=flag) if reference_bytes > fixed_bytes else 0
        return fixed_bytes + moving
    share, value = _read(budget, flag)
    if share is not None:
        if reference_bytes is None:
            raise BudgetFormatError(
                f"{_shown(budget, flag)} is relative, but no reference peak is known here; give bytes instead"
            )
        reference = int(reference_bytes) if is_int(reference_bytes) else float(reference_bytes)
        product = Fraction(share) * Fraction(reference)
        if isinstance(share, float):
            product *= 1 + _FLOAT_SLACK  # the float's own rounding (module docstring)
        value = math.floor(product)
        if value <= 0:
            raise BudgetFormatError(f"{_shown(budget, flag)} is less than one byte of the reference peak "
                                    f"({format_bytes(reference)}); use {_accepted(flag)}")
    return value


def check_budget(budget, *, flag: str | None = None) -> None:
    """Raises :class:`BudgetFormatError` unless ``budget`` has a form :func:`parse_budget`
    accepts (and, unless relative, is at least a byte). Needs no reference peak, so a
    command line can refuse a malformed ``--budget`` before it spends minutes extracting
    the model a share would refer to."""
    budget_kind(budget, flag=flag)


def budget_kind(budget, *, flag: str | None = None) -> str:
    """``"bytes"`` (an amount of memory), ``"share"`` (of the checkpoint-all peak),
    ``"activations"`` (a share of the activation memory) or ``"min"`` (``"min"`` or
    ``"absolute min"``, any case and spacing: :func:`is_absolute_min` tells them apart).

    Raises:
        BudgetFormatError: ``budget`` has none of these forms.
    """
    if isinstance(budget, str) and _words(budget) in (MIN_BUDGET, ABSOLUTE_MIN_BUDGET):
        return MIN_BUDGET
    if isinstance(budget, str):
        match = _ACTIVATIONS.match(budget)
        if match:
            if not match.group(1).endswith("%") or _read(match.group(1), flag)[0] is None:
                raise BudgetFormatError(f"{_shown(budget, flag)}: a share of activations is a percentage, "
                                        "e.g. '50% of activations'")
            return "activations"
    return "bytes" if _read(budget, flag)[0] is None else "share"


def is_absolute_min(budget) -> bool:
    """Whether ``budget`` is ``"absolute min"``: the least peak at any compute cost, where
    ``"min"`` keeps to one extra forward pass."""
    return isinstance(budget, str) and _words(budget) == ABSOLUTE_MIN_BUDGET


def larger_shapes(shapes: tuple, other: tuple) -> bool:
    """Whether the tensor shapes ``shapes`` (a tuple of shape tuples) are larger than ``other``:
    the same tensors and ranks, no dimension smaller and one larger (a full batch against a
    smaller last one)."""
    return (shapes != other and len(shapes) == len(other)
            and all(len(a) == len(b) and all(m is not None and n is not None and m >= n for m, n in zip(a, b))
                    for a, b in zip(shapes, other)))


def share_floor(budget, planned, shapes: tuple) -> tuple[int, tuple] | None:
    """The bytes a share ``budget`` holds the tensor shapes ``shapes`` to at least, and the
    larger shapes it came from: the most it resolved to for a larger shape planned before
    (``planned``: ``(shapes, budget bytes)`` pairs). None for an amount, ``"min"``, or where
    no larger shape was planned.

    A share ("70%", "70% of activations") is resolved against each batch shape's own step,
    but never to fewer bytes than for a larger shape planned by the same fit or
    ``value_and_grad``: a smaller last batch, whose fixed memory and allocator margin weigh
    more against its own share, is then not refused mid-epoch (it usually recomputes
    nothing), and the peak stays within the share of the largest batch
    (benchmarks/results/user_check_3.md finding 2: 200 samples in batches of 32 at
    "70% of activations" trained six batches, then refused the batch of 8)."""
    if budget_kind(budget) not in ("share", "activations"):
        return None
    larger = [(bytes_, other) for other, bytes_ in planned if bytes_ is not None and larger_shapes(other, shapes)]
    return max(larger) if larger else None


def _words(text: str) -> str:
    """``text`` in lower case with its words one space apart: " Absolute  MIN" -> "absolute min"."""
    return " ".join(text.lower().split())


def is_share(budget) -> bool:
    """Whether ``budget`` (already checked, :func:`check_budget`) is relative to the model's
    memory ("50%", 0.5, "50% of activations", "min", "absolute min") rather than an amount of memory."""
    return budget_kind(budget) != "bytes"


def _read(budget, flag: str | None) -> tuple[Fraction | float | None, int]:
    """``(share, 0)`` for a relative budget, ``(None, bytes)`` for an absolute one. The
    share is a Fraction when written as a decimal string (exact), a float when given as one."""
    shown, accepted = _shown(budget, flag), _accepted(flag)
    if budget is None or isinstance(budget, bool):
        raise BudgetFormatError(f"{shown} is not a budget; use {accepted}")
    if is_int(budget):
        if budget <= 0:
            raise BudgetFormatError(f"{shown} must be positive; use {accepted}")
        return None, int(budget)
    if is_number(budget):
        number = float(budget)
        if not math.isfinite(number) or number <= 0:
            raise BudgetFormatError(f"{shown} must be positive; use {accepted}")
        if number <= 1:
            return number, 0
        if number.is_integer():
            return None, int(number)
        raise BudgetFormatError(f"{shown}: a float budget is a fraction in (0, 1]; use {accepted}")
    if not isinstance(budget, str):
        raise BudgetFormatError(f"{shown} has type {type(budget).__name__}; use {accepted}")
    match = _PATTERN.match(budget)
    if not match or match.group(2).lower() not in {**_UNITS, "%": 1}:
        raise BudgetFormatError(f"{shown} is unparsable; use {accepted}")
    if not math.isfinite(float(match.group(1))):
        raise BudgetFormatError(f"{shown} is not a finite number; use {accepted}")
    number, unit = Fraction(match.group(1)), match.group(2).lower()
    if unit == "%":
        if number <= 0:
            raise BudgetFormatError(f"{shown} must be positive; use {accepted}")
        return number / 100, 0
    if unit in ("", "b") and number.denominator != 1:
        if number > 1:
            raise BudgetFormatError(f"{shown}: bytes are whole; use {accepted}")
        percent = f"{float(number * 100):g}%"
        # A share as a number (0.5) exists in Python only: a command line passes a string.
        alternative = "" if flag else f" (or the number {float(number):g})"
        raise BudgetFormatError(
            f"{shown}: a number without a unit counts bytes, which are whole; write "
            f"'{percent}'{alternative} for a share of the checkpoint-all peak"
        )
    value = math.floor(number * _UNITS[unit])
    if value <= 0:
        raise BudgetFormatError(f"{shown} must be at least one byte; use {accepted}")
    return None, value


def _shown(budget, flag: str | None) -> str:
    """The budget as the caller wrote it: ``--budget=0.5`` on a command line, else ``budget='0.5'``."""
    return f"{flag}={budget}" if flag else f"budget={budget!r}"


def _accepted(flag: str | None) -> str:
    return _ACCEPTED_ON_COMMAND_LINE if flag else _ACCEPTED
