"""Byte counts as people read them."""

import math

__all__ = ["format_bytes", "format_bytes_apart", "format_bytes_up"]


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_bytes_up(n: float) -> str:
    """``n`` bytes as :func:`~tfremat.units.format_bytes` writes them, rounded up at the
    precision shown rather than to nearest: 26469652 bytes is "25.25 MiB", which parsed back
    is at least ``n`` ("25.24 MiB" is 26466058, a smallest feasible budget refused when copied;
    benchmarks/results/user_check_3.md finding 3)."""
    text = format_bytes(n)
    _, unit = text.split()
    if unit == "B":
        return f"{math.ceil(n)} B"
    scale = 1024 ** ("KiB", "MiB", "GiB", "TiB").index(unit) * 1024
    return f"{math.ceil(n * 100 / scale) / 100:.2f} {unit}"


def format_bytes_apart(*sizes: float | None) -> list[str | None]:
    """:func:`format_bytes` of each size, for sizes shown side by side (one message, one
    table row), with the exact byte count added to any that would read the same as a
    different size: "budget of 1.50 MiB is infeasible; the smallest peak reached is
    1.50 MiB" hid that the two differ by a few bytes, which is what the reader needs.
    None stays None (a size that is not known).

    Example:
        >>> format_bytes_apart(1572864, 1572870, 1024)
        ['1.50 MiB (1572864 bytes)', '1.50 MiB (1572870 bytes)', '1.00 KiB']
    """
    shown = [None if n is None else format_bytes(n) for n in sizes]
    return [
        text if text is None or all(other == n or other_text != text for other, other_text in zip(sizes, shown))
        else f"{text} ({n:.0f} bytes)"
        for n, text in zip(sizes, shown)
    ]
