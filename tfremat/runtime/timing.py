"""A step timed against a reference step in turns, so that a changing load reads as neither's.

After both have run (tracing and first-call allocations untimed), each round times the step
and the reference back to back, the order alternating, and the ratio is the median of the
per-round ratios, with its quartiles as the spread. A change of load on a shared machine then
slows both runs of a round alike instead of reading as overhead (timed as all plain steps,
then all planned ones, a busy 2-core machine turned a +47% plan into 3.28x plain).

Both the user-facing measurement (:func:`tfremat.measure.measure_model`) and extraction's
plain overlap (:func:`tfremat.extract.overlap.measure_plain_overlap`) time this way.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import tensorflow as tf

from tfremat.errors import ArgumentError, is_int

__all__ = ["TurnTiming", "time_in_turns"]


@dataclasses.dataclass(frozen=True)
class TurnTiming:
    """Seconds of a step and of a reference step timed in turns (:func:`time_in_turns`).

    Attributes:
        seconds: the median of the step's runs.
        reference_seconds: the median of the reference's runs.
        ratio: the median over rounds of step / reference seconds.
        ratio_quartiles: the first and third quartile of the per-round ratios: the spread
            the load left in the ratio.
        rounds: the rounds timed.
        least_seconds: the step's least run: what it costs on a quiet machine (load only
            adds time), as the profiled costs are each call's least run.
        reference_least_seconds: the reference's least run.
    """

    seconds: float
    reference_seconds: float
    ratio: float
    ratio_quartiles: tuple[float, float]
    rounds: int
    least_seconds: float = 0.0
    reference_least_seconds: float = 0.0


def time_in_turns(step: Callable[[], object], reference: Callable[[], object], rounds: int,
                  warmup: int = 1, enough: Callable[[list[float]], bool] | None = None) -> TurnTiming:
    """Times ``step()`` against ``reference()`` in ``rounds`` rounds of one run each.

    Both run ``warmup`` times first (tracing and first-call allocations are not timed).
    The order within a round alternates (step first in even rounds), so a load that
    grows or shrinks during a round does not always fall on the same one. Each result's
    first output is read back before the clock stops. ``enough``, called after each round
    with the per-round ratios so far, stops the timing when it returns True (``rounds`` is
    then the most timed; :attr:`TurnTiming.rounds` says how many were).

    Raises:
        ArgumentError: ``rounds`` is not an int >= 1 or ``warmup`` not an int >= 0.
    """
    if not is_int(rounds) or rounds < 1:
        raise ArgumentError(f"rounds={rounds!r} must be an int >= 1")
    if not is_int(warmup) or warmup < 0:
        raise ArgumentError(f"warmup={warmup!r} must be an int >= 0")

    def timed(fn) -> float:
        began = time.perf_counter()
        tf.nest.flatten(fn())[0].numpy()
        return time.perf_counter() - began

    for _ in range(warmup):
        timed(step)
        timed(reference)
    mine, theirs = [], []
    for round_ in range(rounds):
        if round_ % 2 == 0:
            mine.append(timed(step))
            theirs.append(timed(reference))
        else:
            theirs.append(timed(reference))
            mine.append(timed(step))
        if enough is not None and enough([a / b for a, b in zip(mine, theirs)]):
            break
    ratios = [a / b for a, b in zip(mine, theirs)]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    low, high = quartiles[0], quartiles[2]
    return TurnTiming(seconds=float(statistics.median(mine)), reference_seconds=float(statistics.median(theirs)),
                      ratio=float(statistics.median(ratios)), ratio_quartiles=(float(low), float(high)),
                      rounds=len(ratios), least_seconds=float(min(mine)),
                      reference_least_seconds=float(min(theirs)))
