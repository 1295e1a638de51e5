"""How the MILP strategies share their ``time_limit`` between steps.

Every step gets at least :data:`MIN_SOLVE_SECONDS`, so a call may overrun a time limit
that the baselines and model builds used up by about that much.
"""

from __future__ import annotations

import time

__all__ = ["MIN_SOLVE_SECONDS", "seconds_left", "share_of_time_left"]

# Least time given to a solver call when the earlier steps used up the time limit.
MIN_SOLVE_SECONDS = 1.0


def seconds_left(deadline: float | None, reserve: float = 0.0) -> float | None:
    """Seconds until ``deadline`` (a ``time.perf_counter()`` time) less ``reserve``, at least
    :data:`MIN_SOLVE_SECONDS`; None without a deadline."""
    if deadline is None:
        return None
    return max(deadline - time.perf_counter() - reserve, MIN_SOLVE_SECONDS)


def share_of_time_left(fraction: float, began: float, time_limit: float | None) -> float | None:
    """``fraction`` of what is left of ``time_limit`` since ``began`` (at least
    :data:`MIN_SOLVE_SECONDS`); None without a limit."""
    if time_limit is None:
        return None
    return max(fraction * (time_limit - (time.perf_counter() - began)), MIN_SOLVE_SECONDS)
