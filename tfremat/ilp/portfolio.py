"""The portfolio of heuristics: every heuristic strategy at one budget, the cheapest that fits.

The MILP strategies start from it (a warm start and, when nothing fits, the smallest peak
any heuristic reached, for the infeasible-budget error).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable

from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import DFGraph
from tfremat.ilp.intervals import intervals
from tfremat.ilp.solvers import ProgressFn, report_incumbent
from tfremat.plan import baselines, hong
from tfremat.plan.baselines import heuristic_deadline, known_peak
from tfremat.plan.eviction import eviction
from tfremat.plan.repair import repair
from tfremat.plan.schedule import Schedule

__all__ = ["HEURISTICS", "best_baseline", "run_order", "FALLBACK_TIME_SHARE"]

logger = logging.getLogger(__name__)

# Every heuristic strategy, in the order users see them listed.
HEURISTICS = (
    baselines.checkpoint_all, baselines.checkpoint_all_ap, baselines.chen_sqrtn, baselines.chen_sqrtn_ap,
    baselines.chen_greedy, baselines.chen_greedy_ap, baselines.griewank_logn, baselines.griewank_logn_ap,
    hong.hong, eviction, repair, intervals,
)
# Seconds the heuristics after the first that fits share (repair's minutes on large random
# graphs, benchmarks/solvers.py; chen/griewank's 5.7 CPU s on EfficientNetV2B0's 543 nodes,
# where eviction, run first, wins: benchmarks/latency.py).
_COMPETING_SECONDS = 6.0
# Share of a MILP strategy's time_limit the heuristics may use when none of the fast ones fits.
FALLBACK_TIME_SHARE = 0.5


def best_baseline(
    graph: DFGraph,
    budget_bytes: int,
    fallback_seconds: float = 60.0,
    deadline: float | None = None,
    threads: int | None = None,
    progress: ProgressFn | None = None,
    *,
    offer: Callable[[Schedule, int], None] | None = None,
    quiet: bool = False,
) -> tuple[Schedule | None, int | None]:
    """The cheapest heuristic schedule that fits, and the smallest peak any reached.

    The strategies of :data:`HEURISTICS` run at the budget in :func:`run_order`:
    ``eviction`` first, the one that wins on training graphs (every model of
    ``benchmarks/latency.py`` but the ConvMixer, where ``repair`` does); one that raises
    :class:`InfeasibleBudgetError` contributes the smallest peak it reached. Once one
    fits, the ones after it share 6 s (:data:`_COMPETING_SECONDS`, a nested
    :func:`~tfremat.plan.baselines.heuristic_deadline`): on small graphs all of them run
    within it, on large ones the slow searches no longer run for many seconds behind the
    schedule that usually wins (chen/griewank and ``repair`` on EfficientNetV2B0). While none
    fits, they all run, as before. Heuristics that take a ``time_limit`` (``intervals``, a
    small MILP, also takes ``threads``) get at most ``fallback_seconds`` (0: they do not
    run).

    With a ``deadline`` (a ``time.perf_counter()`` time) every heuristic stops by it
    (:func:`~tfremat.plan.baselines.heuristic_deadline`): none starts once the time left is
    less than the longest step any took (one candidate schedule built and simulated:
    seconds on a 10,000-node graph), and each stops trying candidates the same way, so
    the call overruns the deadline by less than one such step. Heuristics skipped or cut
    short are logged at INFO.

    Each new cheapest schedule is reported to ``progress`` (incumbent and the no-remat
    bound; logged at INFO too, unless ``quiet``: a sub-problem's), so minutes of
    heuristics on a large graph are not silent, and passed to ``offer`` with its simulated
    peak. Returns ``(None, smallest_peak)`` when none fits.
    """
    began = time.perf_counter()
    best, best_cost, smallest_peak = None, None, None
    skipped = []
    with contextlib.ExitStack() as scopes:
        scope = scopes.enter_context(heuristic_deadline(deadline))
        competing = False
        for strategy in run_order(HEURISTICS):
            if best is not None and best_cost <= graph.total_cost:
                break  # nothing recomputed: no schedule is cheaper
            if best is not None and not competing:
                # The ones after the first fitting schedule share _COMPETING_SECONDS.
                scope = scopes.enter_context(heuristic_deadline(time.perf_counter() + _COMPETING_SECONDS))
                competing = True
            if scope is not None and scope.no_time_for_a_step():
                skipped.append(strategy.name)
                continue
            accepts = inspect.signature(strategy.function).parameters
            options = {"threads": threads} if "threads" in accepts else {}
            if "time_limit" in accepts:
                seconds = fallback_seconds
                if scope is not None:
                    seconds = min(seconds, scope.left())
                if seconds <= 0:
                    continue
                options["time_limit"] = seconds
            try:
                schedule = strategy(graph, budget_bytes, **options)
            except InfeasibleBudgetError as exc:
                if exc.min_feasible_bytes is not None:
                    smallest_peak = min(smallest_peak or exc.min_feasible_bytes, exc.min_feasible_bytes)
                continue
            peak = known_peak(graph, schedule)
            smallest_peak = min(smallest_peak or peak, peak)
            if peak > budget_bytes:
                continue
            cost = schedule.cost(graph)
            if best is None or cost < best_cost:
                best, best_cost = schedule, cost
                # Offered before it is reported: a Ctrl-C while the report is written
                # must find the schedule the user has just been told about.
                if offer is not None:
                    offer(schedule, peak)
                if not quiet:
                    report_incumbent(progress, began, cost, graph.total_cost)
    if skipped and not quiet:
        why = f"the {_COMPETING_SECONDS:g}s after the first fitting schedule" if competing else "the deadline"
        logger.info("heuristics: %s left no time for %s (after %.1fs)", why, ", ".join(skipped),
                    time.perf_counter() - began)
    return best, smallest_peak


def run_order(heuristics) -> list:
    """The order :func:`best_baseline` runs ``heuristics`` in: ``eviction`` first (it wins
    on training graphs, in about a second on 543 nodes), then the others as listed, those
    that run last (``repair``) at the end."""
    return sorted(heuristics, key=lambda s: (s is not eviction, s.runs_last))
