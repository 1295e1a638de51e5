"""The ``approx_lp`` strategy: Checkmate's LP relaxation and two-phase rounding (MLSys 2020, sec. 5)."""

from __future__ import annotations

import time

import numpy as np

from tfremat.errors import ArgumentError, SolverTimeLimitError, is_int
from tfremat.graph import DFGraph
from tfremat.ilp.deadlines import seconds_left
from tfremat.ilp.formulation import (
    build_milp,
    has_step_rules,
    lower_bound_reason,
    memory_lower_bound,
    r_column_count,
)
from tfremat.ilp.interrupts import Incumbent
from tfremat.ilp.milp import (
    MAX_R_COLUMNS,
    ROUNDING_RESERVE_SECONDS,
    infeasible_error,
    lp_method,
    no_budget_schedule,
    portfolio_deadline,
)
from tfremat.ilp.portfolio import best_baseline
from tfremat.ilp.rounding import cheapest_rounding
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    ProgressFn,
    check_solver_options,
    report_incumbent,
    solve_model,
)
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, SolverFacts, SolveStatus
from tfremat.plan.simulator import simulate

__all__ = ["solve_approx_lp"]


@as_strategy("approx_lp", takes_solver_options=True)
def solve_approx_lp(
    graph: DFGraph,
    budget=None,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    num_samples: int = 32,
    allowances: tuple[float, ...] = (1.0, 0.9, 0.75, 0.5),
    progress: ProgressFn | None = None,
) -> Schedule:
    """A fast feasible schedule plus a lower bound: Checkmate's LP relaxation and two-phase rounding.

    Phase one rounds the LP's fractional keep matrix S* (threshold sweep and randomized
    rounding); phase two completes each rounded S with the cheapest R
    (``solve R given S``). The cheapest candidate whose simulated peak fits is returned
    (:mod:`tfremat.ilp.rounding`). The LP is that of the stage-end relaxation
    (:func:`~tfremat.ilp.formulation.build_milp` with ``exact_stages=()``): as tight as
    the exact model's on the benchmark graphs, and several times faster.
    Rounding can overshoot the budget, so when no candidate fits the LP is solved again
    under a smaller memory allowance (Checkmate sec. 5), down the ``allowances`` list.

    Args:
        graph: the graph.
        budget: peak bytes allowed (see :func:`~tfremat.ilp.milp.solve_optimal`); None
            returns the checkpoint-all schedule, optimal without a solver.
        solver: LP backend, ``"highs"`` (default) or ``"gurobi"``.
        time_limit: seconds for the whole call (None: no limit). Each LP gets what is
            left after its model is built, less a few seconds for rounding, and the
            rounding stops at the limit once it has tried one candidate.
        threads: solver threads.
        seed: seed of the randomized rounding and of the solver.
        num_samples: randomized roundings per LP solution.
        allowances: fractions of the budget given to the LP, tried in order until a
            rounded schedule fits the full budget.
        progress: called with a :class:`~tfremat.ilp.solvers.Progress` report after each
            LP (its bound) and each rounding that fits (the incumbent); reports are also
            logged at INFO on ``tfremat.ilp.solvers``.

    Returns:
        The schedule, with :class:`~tfremat.plan.schedule.SolverFacts`; ``best_bound`` is
        the larger of the no-remat cost and the LP bound at the full budget (allowance
        1.0). An LP under a smaller allowance bounds only that smaller budget, so it
        never counts as the bound.

    Raises:
        InfeasibleBudgetError: the LP relaxation at the full budget is infeasible (so is
            every schedule), or no rounded schedule fits; carries the smallest peak
            reached.
        ArgumentError: an option is out of range (raised before anything runs).
        SolverTimeLimitError: no LP relaxation was solved within ``time_limit``, or with a
            ``time_limit`` the model would exceed 250k R columns.
        SolveInterrupted: Ctrl-C stopped it before a rounding fitted (a ``KeyboardInterrupt``;
            after one, that schedule is returned with status ``interrupted``).
    """
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, threads=threads, seed=seed)
    if not is_int(num_samples) or num_samples < 0:
        raise ArgumentError(f"num_samples must be an int >= 0, got {num_samples!r}")
    if not allowances or not all(0 < a <= 1 for a in allowances):
        raise ArgumentError(f"allowances must be fractions in (0, 1], got {allowances!r}")
    if budget is None:
        return no_budget_schedule(graph, "approx_lp", began)
    incumbent = Incumbent(graph, budget)
    try:
        return _solve_approx_lp(graph, budget, incumbent, began=began, solver=solver, time_limit=time_limit,
                                threads=threads, seed=seed, num_samples=num_samples, allowances=allowances,
                                progress=progress)
    except KeyboardInterrupt as interrupt:
        return incumbent.result("approx_lp", began, interrupt)


def _solve_approx_lp(graph, budget_bytes, incumbent, *, began, solver, time_limit, threads, seed, num_samples,
                     allowances, progress) -> Schedule:
    """:func:`solve_approx_lp` with a budget, keeping ``incumbent`` up to date for Ctrl-C."""
    lower_bound = memory_lower_bound(graph)
    heuristics_until = portfolio_deadline(began, time_limit)
    if budget_bytes < lower_bound:
        _, smallest_peak = best_baseline(graph, budget_bytes, 0.0, heuristics_until)
        raise infeasible_error(graph, budget_bytes, smallest_peak, "approx_lp",
                               lower_bound_reason(graph))
    if time_limit is not None and r_column_count(graph) > MAX_R_COLUMNS:
        raise SolverTimeLimitError(
            f"the LP of this {graph.size}-node graph ({r_column_count(graph)} R columns) is too large to build "
            f"within time_limit={time_limit}s; use strategy 'optimal' (it returns the best heuristic) or "
            "time_limit=None (math.inf through tfremat.plan_model, fit and max_batch_size)",
            budget_bytes, None, time_limit,
        )
    rng = np.random.default_rng(seed)
    best, best_cost, smallest_peak = None, None, None
    lp_bound = graph.total_cost
    lp_seconds, num_vars, num_constraints = 0.0, 0, 0
    deadline = None if time_limit is None else began + time_limit
    for allowance in allowances:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        model = build_milp(graph, max(lower_bound, allowance * budget_bytes), exact_stages=())
        result = solve_model(
            model, solver=solver, relax=True, time_limit=seconds_left(deadline, ROUNDING_RESERVE_SECONDS),
            threads=threads, seed=seed, lp_method=lp_method(model, solver),
        )
        lp_seconds += result.seconds
        if not num_vars:
            num_vars, num_constraints = model.num_vars, model.num_constraints
        if allowance == 1.0:
            if result.status == SolveStatus.INFEASIBLE:
                _, heuristic_peak = best_baseline(graph, budget_bytes, 0.0, portfolio_deadline(began, time_limit))
                # The model's step rules may cut off every schedule that fits (has_step_rules).
                if has_step_rules(graph):
                    raise infeasible_error(graph, budget_bytes, heuristic_peak, "approx_lp",
                                           "the LP relaxation within the MILP's step rules is infeasible",
                                           proven=False)
                raise infeasible_error(graph, budget_bytes, heuristic_peak, "approx_lp",
                                       "the LP relaxation is infeasible", lower_bound_bytes=budget_bytes + 1)
            lp_bound = max(lp_bound, result.best_bound or 0.0)
            incumbent.raise_bound(lp_bound)
            incumbent.num_vars, incumbent.num_constraints, incumbent.solver = num_vars, num_constraints, solver
            report_incumbent(progress, began, None, lp_bound)
        if result.x is None:
            continue
        best, peak = cheapest_rounding(model, result.x, budget_bytes, num_samples, rng, "approx_lp", deadline)
        smallest_peak = peak if smallest_peak is None else min(smallest_peak, peak)
        if best is not None:
            incumbent.offer(best)
            best_cost = best.cost(graph)
            report_incumbent(progress, began, best_cost, lp_bound)
            break
    if best is None and smallest_peak is None:
        raise SolverTimeLimitError(f"{solver} solved no LP relaxation within time_limit={time_limit}s; raise time_limit",
                                   budget_bytes, None, time_limit)
    if best is None:
        raise infeasible_error(graph, budget_bytes, smallest_peak, "approx_lp", "no rounding of the LP solution fits",
                               proven=False)
    return best.with_facts(SolverFacts(
        status=SolveStatus.FEASIBLE if best_cost > lp_bound else SolveStatus.OPTIMAL, objective=best_cost,
        best_bound=lp_bound, seconds=time.perf_counter() - began, solve_seconds=lp_seconds, num_vars=num_vars,
        num_constraints=num_constraints, solver=solver, peak_bytes=simulate(graph, best).peak_bytes,
        budget_bytes=budget_bytes,
    ))
