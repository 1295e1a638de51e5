"""The portfolio of heuristics: every heuristic strategy at one budget, the cheapest that fits.

The MILP strategies start from it (a warm start and, when nothing fits, the smallest peak
any heuristic reached, for the infeasible-budget error).
"""

from __future__ import annotations

import inspect
import time

from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import DFGraph
from tfremat.ilp.intervals import intervals
from tfremat.ilp.solvers import ProgressFn, report_incumbent
from tfremat.plan import baselines
from tfremat.plan.eviction import eviction
from tfremat.plan.repair import repair
from tfremat.plan.schedule import Schedule
from tfremat.plan.simulator import simulate

__all__ = ["HEURISTICS", "best_baseline", "FALLBACK_TIME_SHARE"]

# Every heuristic strategy, in the order users see them listed.
HEURISTICS = (
    baselines.checkpoint_all, baselines.checkpoint_all_ap, baselines.chen_sqrtn, baselines.chen_sqrtn_ap,
    baselines.chen_greedy, baselines.chen_greedy_ap, baselines.griewank_logn, baselines.griewank_logn_ap,
    baselines.hong, eviction, repair, intervals,
)
# Seconds a strategy that runs last (repair) gets when another heuristic already fits;
# far less than the minutes it spends, and loses, on large random graphs
# (benchmarks/solvers.py).
_COMPETING_SECONDS = 6.0
# Share of a MILP strategy's time_limit the heuristics may use when none of the fast ones fits.
FALLBACK_TIME_SHARE = 0.5


def best_baseline(
    graph: DFGraph,
    budget_bytes: int,
    fallback_seconds: float = 60.0,
    fallback_deadline: float | None = None,
    threads: int | None = None,
    progress: ProgressFn | None = None,
) -> tuple[Schedule | None, int | None]:
    """The cheapest heuristic schedule that fits, and the smallest peak any reached.

    Every strategy of :data:`HEURISTICS` runs at the budget; one
    that raises :class:`InfeasibleBudgetError` contributes the smallest peak it reached.
    Heuristics that take a ``time_limit`` (``intervals``, a small MILP, also takes
    ``threads``) get at most ``fallback_seconds`` (0: they do not run). ``repair``, slow
    on large graphs and beaten by ``eviction`` on training graphs, runs last: for at most
    ``fallback_seconds`` when nothing else fits, for at most 6 s otherwise. Neither runs past ``fallback_deadline`` (a
    ``time.perf_counter()`` time) when one is given. Each new cheapest schedule is
    reported to ``progress`` (incumbent and the no-remat bound; logged at INFO too), so
    minutes of heuristics on a large graph are not silent. Returns ``(None,
    smallest_peak)`` when none fits.
    """
    began = time.perf_counter()
    best, best_cost, smallest_peak = None, None, None
    for strategy in sorted(HEURISTICS, key=lambda s: s.runs_last):
        if best is not None and best_cost <= graph.total_cost:
            break  # nothing recomputed: no schedule is cheaper
        accepts = inspect.signature(strategy.function).parameters
        options = {"threads": threads} if "threads" in accepts else {}
        if "time_limit" in accepts:
            seconds = fallback_seconds
            if strategy.runs_last and best is not None:
                seconds = min(seconds, _COMPETING_SECONDS)
            if fallback_deadline is not None:
                seconds = min(seconds, fallback_deadline - time.perf_counter())
            if seconds <= 0:
                continue
            options["time_limit"] = seconds
        try:
            schedule = strategy(graph, budget_bytes, **options)
        except InfeasibleBudgetError as exc:
            if exc.min_feasible_bytes is not None:
                smallest_peak = min(smallest_peak or exc.min_feasible_bytes, exc.min_feasible_bytes)
            continue
        peak = simulate(graph, schedule).peak_bytes
        smallest_peak = min(smallest_peak or peak, peak)
        if peak > budget_bytes:
            continue
        cost = schedule.cost(graph)
        if best is None or cost < best_cost:
            best, best_cost = schedule, cost
            report_incumbent(progress, began, cost, graph.total_cost)
    return best, smallest_peak
