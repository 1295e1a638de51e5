"""``optimal``'s start before its MILP: the relaxation's LP, its rounding, and RINS.

HiGHS can spend a whole time limit without improving a poor incumbent, so the MILP starts
from the cheapest of the baselines, the rounding of the stage-end relaxation's LP, and
RINS (relaxation-induced neighbourhood search) around the better of those. The results
are in benchmarks/results/solvers.md (``benchmarks/solvers.py``); docs/solver.md says
what they show.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from tfremat.ilp.deadlines import MIN_SOLVE_SECONDS, seconds_left, share_of_time_left
from tfremat.ilp.formulation import CheckmateModel, build_milp, overflowing_stages
from tfremat.ilp.rounding import cheaper_rounding
from tfremat.ilp.solvers import SolveResult, solve_model
from tfremat.plan.schedule import Schedule, SolveStatus
from tfremat.plan.simulator import simulate

__all__ = ["relaxed_lp_start", "rins"]

logger = logging.getLogger(__name__)


def relaxed_lp_start(model: CheckmateModel, baseline: Schedule | None, *, began: float, time_limit: float | None,
                     solver: str, threads: int | None, seed: int) -> tuple[Schedule | None, SolveResult | None]:
    """The LP of the stage-end relaxation ``model``: its bound, and the cheaper of ``baseline``
    and the LP's rounding as the MILP's start.

    The relaxation's LP is fast and as tight as the exact one on the benchmark graphs. It
    gets a quarter of the time left.

    Returns:
        ``(start, lp)``: the schedule to start from and the LP's
        :class:`~tfremat.ilp.solvers.SolveResult`, None when the LP did not finish.
    """
    lp_time = share_of_time_left(0.25, began, time_limit)
    lp = solve_model(model, solver=solver, relax=True, time_limit=lp_time, threads=threads, seed=seed)
    if lp.x is None or lp.status != SolveStatus.OPTIMAL:
        logger.info("optimal: the relaxation's LP did not finish in %s s (%s)", lp_time, lp.status)
        return baseline, None
    deadline = None if time_limit is None else began + time_limit
    return cheaper_rounding(model, lp.x, baseline, seed=seed, strategy="approx_lp", deadline=deadline), lp


def rins(model: CheckmateModel, start: Schedule, lp_x: np.ndarray, *, began: float, time_limit: float | None,
         solver: str, threads: int | None, seed: int, stall_time: float | None = None) -> Schedule:
    """RINS: the MILP with every R and S column on which ``start`` and the LP point of the
    stage-end relaxation ``model`` agree fixed to that value, for half the time left; its
    schedule when it fits the budget and is cheaper, else ``start``.

    It finds what HiGHS alone does not from eviction's start on ResNet50 at tight budgets,
    and proves in seconds where the neighbourhood holds nothing better.

    The neighbourhood's optimum may overflow the budget inside a stage, where the
    relaxation does not look. Those stages are then accounted exactly and the same
    neighbourhood is solved again, until its optimum fits or the time share is spent.
    The MILP after it starts from the relaxation again, not from these exact stages: a
    larger model lowered its bound within the time limit. ``stall_time`` stops each
    neighbourhood's solve early (:func:`~tfremat.ilp.solvers.solve_model`).
    """
    graph = model.graph
    budget_bytes = int(model.budget_bytes)
    x0 = model.encode(start)
    if x0 is None:
        return start
    # The relaxation's integer columns are its R and S columns, which build_milp numbers
    # first and alike whatever stages are exact: the same column numbers fix the same
    # variables in the models with exact stages below.
    fixed = np.flatnonzero(model.integer & (np.abs(lp_x - x0) < 1e-6))
    deadline = None if time_limit is None else time.perf_counter() + share_of_time_left(0.5, began, time_limit)
    exact_stages: set[int] = set()
    current = model
    while True:
        x0 = current.encode(start)
        if x0 is None:
            return start
        lower, upper = current.lower.copy(), current.upper.copy()
        lower[fixed] = upper[fixed] = x0[fixed]
        neighbourhood = dataclasses.replace(current, lower=lower, upper=upper)
        result = solve_model(neighbourhood, solver=solver, time_limit=seconds_left(deadline), threads=threads,
                             seed=seed, start=x0, quiet=True, stall_time=stall_time)
        if result.x is None:
            return start
        candidate = current.schedule(result.x, "rins")
        outcome = simulate(graph, candidate)
        fits = outcome.peak_bytes <= budget_bytes
        logger.info("optimal: RINS with %d of %d integer columns fixed, %d stages exact: %s, %.6g (start %.6g)%s",
                    len(fixed), int(model.integer.sum()), len(exact_stages), result.status,
                    candidate.cost(graph), start.cost(graph), "" if fits else ", overflows the budget")
        if fits:
            return candidate if candidate.cost(graph) < start.cost(graph) else start
        overflowing = overflowing_stages(graph, outcome, budget_bytes) - exact_stages
        if not overflowing or model.chooses_implementations:
            # A model that chooses implementations comes exact in every stage
            # (milp._rins): an overflow is the solver's tolerance, and Checkmate's model
            # rebuilt here would lack its implementation columns.
            return start
        exact_stages |= overflowing
        current = build_milp(graph, budget_bytes, exact_stages=exact_stages)
        if deadline is not None and time.perf_counter() >= deadline - MIN_SOLVE_SECONDS:
            return start
