"""The ``optimal`` strategy: the minimum-cost schedule within a budget, by Checkmate's MILP.

``solve_optimal`` runs the baselines, builds the stage-end relaxation
(:func:`~tfremat.ilp.formulation.build_milp` with ``exact_stages=()``), starts it from
the relaxed LP's rounding and RINS (:mod:`tfremat.ilp.rins`) and solves it, accounting
exactly the stages where a solution overflows (``_solve_with_stage_rows``). Models too
large for a time limit get only their LP bound and its rounding (``_solve_large``), or no
model at all. Every outcome reports :class:`~tfremat.plan.schedule.SolverFacts`.

The cost of running every node once (``graph.total_cost``) is always a valid lower
bound, and any schedule reaching it is optimal; ``optimal`` uses that to skip the
solver when a baseline already reaches it (always the case when the checkpoint-all
schedule fits). A proven-infeasible budget raises
:class:`~tfremat.errors.InfeasibleBudgetError` rather than returning a status.

The size thresholds below come from ``benchmarks/solvers.py`` (results in
benchmarks/results/solvers*.md; docs/solver.md explains them).
"""

from __future__ import annotations

import logging
import time

from tfremat.errors import InfeasibleBudgetError, SolverError, SolverTimeLimitError
from tfremat.graph import DFGraph
from tfremat.ilp.blocks import plan_by_units
from tfremat.ilp.deadlines import MIN_SOLVE_SECONDS, seconds_left
from tfremat.ilp.formulation import (
    CheckmateModel,
    build_milp,
    lower_bound_reason,
    memory_lower_bound,
    overflowing_stages,
    r_column_count,
)
from tfremat.ilp.interrupts import Incumbent
from tfremat.ilp.portfolio import FALLBACK_TIME_SHARE, best_baseline
from tfremat.ilp.rins import relaxed_lp_start, rins
from tfremat.ilp.rounding import cheaper_rounding
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    ProgressFn,
    check_solver_options,
    report_incumbent,
    solve_model,
)
from tfremat.plan.baselines import known_peak
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import (
    Schedule,
    SolverFacts,
    SolveStatus,
    checkpoint_all_s,
    relative_gap,
    schedule_from_keep_matrix,
)
from tfremat.plan.simulator import simulate

__all__ = ["solve_optimal"]

logger = logging.getLogger(__name__)

# Graphs with more R columns are not modelled at all when a time limit is set (the
# 1000-node random graph: 500k R columns, 4.1M columns, minutes and gigabytes to build);
# the best heuristic is returned with the no-remat cost as its bound. approx_lp refuses them.
MAX_R_COLUMNS = 250_000
# Stage-end relaxations with more columns get their LP bound plus LP rounding instead of
# the MILP when a time limit is set (ResNet50's has 125k and its MILP pays off; the
# 500-node random graph's 250k LP alone takes about a minute).
_FULL_MILP_COLUMNS = 150_000
# Models up to this many columns are presolved before the MILP. Above it HiGHS's presolve
# (a few percent of the columns removed) delayed the root bound by ~10 s on ResNet50's
# relaxation and overran the time limit; below it presolve takes well under a second.
_PRESOLVE_MAX_COLUMNS = 20_000
# Share of the time limit the unit decomposition (:mod:`tfremat.ilp.blocks`) may take on
# models too large for the MILP; the LP bound gets the rest. On the 12-block GPT-2 graph
# it needs about 25 s the first time and well under a second for further budgets.
UNITS_TIME_SHARE = 0.6
# Seconds kept after the MILP for simulating its solution.
_FINISH_SECONDS = 0.5
# Seconds kept after the heuristics for returning the best of them.
PORTFOLIO_RESERVE_SECONDS = 0.5
# Seconds kept from an LP under a time limit for rounding its solution.
ROUNDING_RESERVE_SECONDS = 3.0
# The gap at which a schedule counts as optimal when mip_gap is None (HiGHS's MILP default).
_DEFAULT_MIP_GAP = 1e-4
# Largest overflow, relative to the budget, that counts as the solver's tolerance when
# memory is in units of the budget: 1e-7 on rows plus 1e-6 on the integrality of binaries
# whose bytes sum to a few budgets.
_TOLERANCE_OVERFLOW = 1e-5


def infeasible_error(graph, budget_bytes, smallest_peak, strategy, detail, proven=True,
                     lower_bound_bytes=None) -> InfeasibleBudgetError:
    """The infeasible-budget error; ``lower_bound_bytes`` defaults to
    :func:`memory_lower_bound`, and is ``budget_bytes + 1`` where a solver proved the
    budget infeasible (every feasible budget is above it)."""
    return InfeasibleBudgetError(
        budget_bytes,
        min_feasible_bytes=smallest_peak,
        lower_bound_bytes=max(memory_lower_bound(graph), lower_bound_bytes or 0),
        strategy=strategy,
        detail=detail,
        proven=proven,
    )


def no_budget_schedule(graph: DFGraph, strategy: str, began: float) -> Schedule:
    """Without a budget: the checkpoint-all schedule, optimal without a solver (it runs
    every node once)."""
    schedule = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), strategy)
    return schedule.with_facts(SolverFacts(
        status=SolveStatus.OPTIMAL, objective=schedule.cost(graph), best_bound=graph.total_cost,
        seconds=time.perf_counter() - began, peak_bytes=simulate(graph, schedule).peak_bytes, budget_bytes=None,
    ))


def smallest_peak_note(smallest_peak: int | None) -> str:
    """`` (the smallest peak any heuristic reached is ...)`` for an unproven failure's message."""
    return "" if smallest_peak is None else f" (the smallest peak any heuristic reached is {smallest_peak} bytes)"


def lp_method(model: CheckmateModel, solver: str) -> str:
    """For large models on HiGHS, the dual simplex without presolve (stopped at the time
    limit, its duals still bound the LP); else the solver's default simplex."""
    return "dual_simplex" if solver == "highs" and model.num_vars > _FULL_MILP_COLUMNS else "simplex"


@as_strategy("optimal", takes_solver_options=True)
def solve_optimal(
    graph: DFGraph,
    budget=None,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = None,
    mip_gap: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    warm_start: bool = True,
    progress: ProgressFn | None = None,
) -> Schedule:
    """The minimum-cost schedule within a memory budget: Checkmate's MILP (Jain et al. 2020).

    The solver works on the stage-end relaxation of the MILP (``build_milp(...,
    exact_stages=())``: one memory row per stage, at its last node), which is a third to a
    half of the exact model's size and whose LP is as tight on the benchmark graphs; a
    solution that overflows the budget in the simulator gets its overflowing stages
    accounted exactly and the model is solved again, so a returned "optimal" is optimal
    for the exact model. The MILP starts from the cheapest schedule that fits among the
    baselines (``eviction`` among them) and the rounding of the relaxation's LP, improved
    by RINS (:func:`~tfremat.ilp.rins.rins`), so the result is never worse than any of
    them, even when the time limit stops the solver early.
    When a baseline is within ``mip_gap`` of the no-remat cost (a lower bound), it is
    returned as optimal at once.

    With a ``time_limit``, relaxed models of more than 150k columns are not solved as
    MILPs: the time goes to their LP by the dual simplex without presolve, whose row
    duals give a proven bound whenever it stops, and to rounding its solution; the best
    schedule comes with that bound and status ``time_limit`` unless it is within
    ``mip_gap`` of it. Graphs whose model would exceed 250k R columns are not modelled:
    the best heuristic is returned, bounded by the no-remat cost. Without a time limit
    the MILP is solved, however long it takes.

    Args:
        graph: the graph.
        budget: peak bytes allowed (any form :func:`tfremat.budget.parse_graph_budget`
            takes: relative budgets refer to the checkpoint-all peak). None means no memory limit:
            the checkpoint-all schedule runs every node once, which is the least cost any
            schedule can have, so it is returned as optimal without a solver.
        solver: ``"highs"`` (default, no license needed) or ``"gurobi"``.
        time_limit: wall-clock seconds for the whole call, baselines and model build
            included (None: until proven optimal); the solver gets at least 1 s.
        mip_gap: relative gap at which to stop (None: the solver's default, HiGHS 1e-4).
        threads: solver threads (None: solver default).
        seed: solver random seed.
        warm_start: start from the cheapest of the baselines and the rounding of the
            relaxation's LP (given a quarter of the time left), and return it if the
            solver does worse.
        progress: called with :class:`~tfremat.ilp.solvers.Progress` reports while the
            solver runs; reports are also logged at INFO on ``tfremat.ilp.solvers``.

    Returns:
        The schedule, with :class:`~tfremat.plan.schedule.SolverFacts`.

    Interrupted by Ctrl-C (SIGINT, ``KeyboardInterrupt``) it stops within a second or two,
    the solver included, and returns the cheapest schedule found so far with status
    ``interrupted`` (:mod:`tfremat.ilp.interrupts`).

    Raises:
        InfeasibleBudgetError: no schedule fits (proven by the solver, or the budget is
            below :func:`~tfremat.ilp.formulation.memory_lower_bound`).
        SolverTimeLimitError: the time limit ran out without any schedule and no
            baseline fits.
        SolveInterrupted: Ctrl-C stopped it before any schedule was found (a
            ``KeyboardInterrupt``).
        ArgumentError: an option is out of range (raised before anything runs).
        SolverUnavailableError, SolverLicenseError: see :func:`~tfremat.ilp.solvers.solve_model`.
    """
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed)
    if budget is None:
        return no_budget_schedule(graph, "optimal", began)
    incumbent = Incumbent(graph, budget)
    try:
        return _solve_optimal(graph, budget, incumbent, began=began, solver=solver, time_limit=time_limit,
                              mip_gap=mip_gap, threads=threads, seed=seed, warm_start=warm_start, progress=progress)
    except KeyboardInterrupt as interrupt:
        return incumbent.result("optimal", began, interrupt)


def portfolio_deadline(began: float, time_limit: float | None) -> float | None:
    """When a MILP strategy's heuristics must stop (a ``time.perf_counter()`` time): a
    little before its time limit, yet at least :data:`MIN_SOLVE_SECONDS` after ``began``
    (as a solver, they get that much however short the limit)."""
    if time_limit is None:
        return None
    return began + max(time_limit - min(PORTFOLIO_RESERVE_SECONDS, 0.1 * time_limit), MIN_SOLVE_SECONDS)


def _solve_optimal(graph, budget_bytes, incumbent, *, began, solver, time_limit, mip_gap, threads, seed, warm_start,
                   progress) -> Schedule:
    """:func:`solve_optimal` with a budget, keeping ``incumbent`` up to date for Ctrl-C."""
    lower_bound = memory_lower_bound(graph)
    heuristics_until = portfolio_deadline(began, time_limit)
    if budget_bytes < lower_bound:
        _, smallest_peak = (best_baseline(graph, budget_bytes, 0.0, heuristics_until) if warm_start
                            else (None, None))
        raise infeasible_error(graph, budget_bytes, smallest_peak, "optimal", lower_bound_reason(graph))
    # Without a model to solve, the fallback heuristic may use the whole time limit.
    too_large = time_limit is not None and r_column_count(graph) > MAX_R_COLUMNS
    fallback_seconds = 60.0 if time_limit is None else time_limit if too_large else FALLBACK_TIME_SHARE * time_limit
    baseline, smallest_peak = (None, None)
    if warm_start:
        baseline, smallest_peak = best_baseline(graph, budget_bytes, fallback_seconds, heuristics_until, threads,
                                                progress, offer=incumbent.offer)
    # The no-remat cost bounds every schedule's cost from below.
    if baseline is not None and baseline.cost(graph) * (1 - (mip_gap or 0.0)) <= graph.total_cost:
        return _baseline_result(graph, baseline, SolveStatus.OPTIMAL, began, budget_bytes)
    if too_large:
        if baseline is None:
            raise SolverTimeLimitError(
                f"no heuristic fits {budget_bytes} bytes{smallest_peak_note(smallest_peak)} and the MILP of this "
                f"{graph.size}-node graph ({r_column_count(graph)} R columns) is too large to build within "
                f"time_limit={time_limit}s; "
                "raise the budget, or pass time_limit=None (math.inf through tfremat.plan_model, fit and max_batch_size) "
                "to build and solve it however long it takes",
                budget_bytes, smallest_peak, time_limit,
            )
        logger.warning(
            "optimal: the MILP of this %d-node graph (%d R columns) is too large to build within time_limit=%ss; "
            "returning the best heuristic (%s), bounded only by the no-remat cost; time_limit=None (math.inf "
            "through tfremat.plan_model, fit and max_batch_size) builds and solves it however long it takes",
            graph.size, r_column_count(graph), time_limit, baseline.strategy,
        )
        return _baseline_result(graph, baseline, SolveStatus.TIME_LIMIT, began, budget_bytes)
    model = build_milp(graph, budget_bytes, exact_stages=())
    incumbent.num_vars, incumbent.num_constraints, incumbent.solver = model.num_vars, model.num_constraints, solver
    if time_limit is not None and model.num_vars > _FULL_MILP_COLUMNS:
        if warm_start:
            by_units = plan_by_units(graph, budget_bytes, solver=solver,
                                     deadline=began + UNITS_TIME_SHARE * time_limit)
            if by_units is not None and (baseline is None or by_units.cost(graph) < baseline.cost(graph)):
                baseline = by_units
                incumbent.offer(baseline)
        return _solve_large(
            graph, model, baseline, smallest_peak, began=began, solver=solver, time_limit=time_limit,
            mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap, threads=threads, seed=seed, progress=progress,
            incumbent=incumbent,
        )
    lp = None
    if warm_start:
        baseline, lp = relaxed_lp_start(
            model, baseline, began=began, time_limit=time_limit, solver=solver, threads=threads, seed=seed,
        )
    incumbent.offer(baseline)
    if lp is not None:
        lp_bound = max(graph.total_cost, lp.best_bound or 0.0)
        incumbent.raise_bound(lp_bound)
        report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, lp_bound)
        if baseline is not None:
            baseline = rins(model, baseline, lp.x, began=began, time_limit=time_limit, solver=solver,
                            threads=threads, seed=seed)
            incumbent.offer(baseline)
            report_incumbent(progress, began, baseline.cost(graph), lp_bound)
    return _solve_with_stage_rows(
        graph, model, baseline, smallest_peak, lp.best_bound if lp is not None else None, began=began, solver=solver,
        time_limit=time_limit, mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap, threads=threads, seed=seed,
        progress=progress, tracker=incumbent,
    )


def _solve_with_stage_rows(graph, model, baseline, smallest_peak, lp_bound, *, began, solver, time_limit, mip_gap,
                           threads, seed, progress, tracker):
    """``optimal`` by the stage-end relaxation, made exact where its solutions overflow.

    ``model`` starts with every stage relaxed to its stage-end row. Each round solves it
    (from the cheapest schedule known), simulates the solution, and where it overflows
    the budget accounts those stages exactly and solves again; the rounds stop when the
    solution fits (then it is optimal for the exact model, being optimal for a
    relaxation of it) or the time is up. Every round's bound before any lowering (below)
    holds for the exact model. A solution that overflows only in exact stages, by no more
    than the solver's tolerance (memory in units of the budget), lowers the model's budget
    by the overflow and is solved again; bounds and infeasibility proofs of a lowered
    model are not used.

    Models above ``_PRESOLVE_MAX_COLUMNS`` run without presolve (see the constant).
    """
    budget_bytes = int(model.budget_bytes)
    deadline = None if time_limit is None else began + time_limit
    incumbent = baseline
    bound = max(graph.total_cost, lp_bound or 0.0)
    exact_stages: set[int] = set()
    # Bytes the model's budget is lowered by after a solution overflowed within the
    # solver's tolerance; bounds and infeasibility proofs of a lowered model do not hold
    # for the true budget.
    lowered = 0.0
    solve_seconds = 0.0
    proven = False
    while True:
        start = model.encode(incumbent) if incumbent is not None else None
        if incumbent is not None and start is None:
            # Expected after lowering the budget (the incumbent may peak above it); else a defect.
            logger.log(logging.INFO if lowered else logging.WARNING,
                       "schedule %s is not a solution of this model (it uses a variable the model prunes, or peaks "
                       "above its lowered budget); solving without a MIP start", incumbent.strategy)
        logger.info("optimal: %d variables, %d constraints, %d of %d stages exact, start %s", model.num_vars,
                    model.num_constraints, len(exact_stages), graph.size, incumbent.strategy if incumbent else None)
        result = solve_model(
            model, solver=solver, time_limit=seconds_left(deadline, _FINISH_SECONDS), mip_gap=mip_gap,
            threads=threads, seed=seed, start=start, progress=progress,
            presolve=model.num_vars <= _PRESOLVE_MAX_COLUMNS, started=began,
        )
        solve_seconds += result.seconds
        if result.status == SolveStatus.INFEASIBLE and not lowered:
            raise infeasible_error(graph, budget_bytes, smallest_peak, "optimal",
                                   f"{result.solver} proved no schedule fits", lower_bound_bytes=budget_bytes + 1)
        if result.best_bound is not None and not lowered:
            bound = max(bound, result.best_bound)
            tracker.raise_bound(bound)
        if result.x is None:
            break
        candidate = model.schedule(result.x, "optimal")
        outcome = simulate(graph, candidate)
        if outcome.peak_bytes <= budget_bytes:
            tracker.offer(candidate, outcome.peak_bytes)
            if incumbent is None or candidate.cost(graph) <= incumbent.cost(graph):
                incumbent = candidate
                proven = result.status == SolveStatus.OPTIMAL and not lowered
            break
        if deadline is not None and time.perf_counter() >= deadline - _FINISH_SECONDS - MIN_SOLVE_SECONDS:
            break
        overflowing = overflowing_stages(graph, outcome, budget_bytes) - exact_stages
        if overflowing:
            exact_stages |= overflowing
        elif outcome.peak_bytes - budget_bytes <= _TOLERANCE_OVERFLOW * budget_bytes:
            # Doubling: a solver that keeps returning solutions at its tolerance above the
            # lowered budget needs a few rounds, not one per overflow.
            lowered = max(2 * lowered, lowered + outcome.peak_bytes - budget_bytes)
            logger.info("optimal: the solution overflows by %d bytes, within the solver's tolerance; "
                        "the model's budget is lowered by %d bytes", outcome.peak_bytes - budget_bytes, lowered)
        else:
            raise SolverError("internal error: a schedule overflows the budget in stages the MILP accounts exactly")
        model = build_milp(graph, budget_bytes - lowered, exact_stages=exact_stages)
        tracker.num_vars, tracker.num_constraints = model.num_vars, model.num_constraints
    if incumbent is None and lowered:
        raise infeasible_error(graph, budget_bytes, smallest_peak, "optimal",
                               f"{result.solver}'s solutions exceed the budget by up to its tolerance "
                               f"({lowered:.0f} bytes) and none fits; a budget that much larger fits", proven=False)
    if incumbent is None:
        raise SolverTimeLimitError(
            f"{result.solver} found no schedule within time_limit={time_limit}s and no baseline fits "
            f"{budget_bytes} bytes{smallest_peak_note(smallest_peak)}; raise time_limit or the budget",
            budget_bytes, smallest_peak, time_limit,
        )
    cost = incumbent.cost(graph)
    peak = simulate(graph, incumbent).peak_bytes
    if peak > budget_bytes:
        raise SolverError(f"internal error: the solver's schedule peaks at {peak} bytes, above the budget {budget_bytes}")
    if proven or relative_gap(cost, bound) <= mip_gap:
        status = SolveStatus.OPTIMAL
    else:
        status = SolveStatus.TIME_LIMIT if time_limit is not None else SolveStatus.FEASIBLE
    return incumbent.with_facts(SolverFacts(
        status=status, objective=cost, best_bound=min(bound, cost), seconds=time.perf_counter() - began,
        solve_seconds=solve_seconds, num_vars=model.num_vars, num_constraints=model.num_constraints,
        solver=result.solver, warm_start=baseline.strategy if baseline is not None else None, peak_bytes=peak,
        budget_bytes=budget_bytes, exact_stages=len(exact_stages),
    ), strategy="optimal")


def _baseline_result(graph, baseline, status, began, budget_bytes) -> Schedule:
    """A baseline returned without a solver, bounded by the no-remat cost."""
    cost = baseline.cost(graph)
    return baseline.with_facts(SolverFacts(
        status=status, objective=cost, best_bound=min(graph.total_cost, cost), seconds=time.perf_counter() - began,
        solve_seconds=0.0, num_vars=0, num_constraints=0, solver=None, warm_start=baseline.strategy,
        peak_bytes=known_peak(graph, baseline), budget_bytes=budget_bytes, exact_stages=0,
    ), strategy="optimal")


def _solve_large(graph, model, baseline, smallest_peak, *, began, solver, time_limit, mip_gap, threads, seed, progress,
                 incumbent):
    """``optimal`` on models too large for the whole MILP within ``time_limit``.

    The time goes to the LP relaxation: HiGHS's dual simplex without presolve, whose row
    duals are the model's own, so they give a proven bound whenever it stops (Gurobi's LP
    otherwise), and the LP's rounding may improve the warm start. The reported bound is
    the larger of that bound and the no-remat cost, so the gap is honest, if loose where
    the LP did not converge. (The dual simplex gave tighter bounds than PDLP in the same
    time; docs/solver.md.)
    """
    budget_bytes = int(model.budget_bytes)
    deadline = began + time_limit
    report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, graph.total_cost)
    lp = solve_model(
        model, solver=solver, relax=True, time_limit=seconds_left(deadline, ROUNDING_RESERVE_SECONDS),
        threads=threads, seed=seed, lp_method=lp_method(model, solver),
    )
    if lp.status == SolveStatus.INFEASIBLE:
        raise infeasible_error(graph, budget_bytes, smallest_peak, "optimal",
                               f"{lp.solver} proved the LP relaxation infeasible", lower_bound_bytes=budget_bytes + 1)
    bound = max(graph.total_cost, lp.best_bound or 0.0)
    tracker, incumbent = incumbent, baseline
    tracker.raise_bound(bound)
    if lp.x is not None:
        incumbent = cheaper_rounding(model, lp.x, incumbent, seed=seed, strategy="optimal", deadline=deadline)
    if incumbent is None:
        raise SolverTimeLimitError(
            f"no schedule fits {budget_bytes} bytes{smallest_peak_note(smallest_peak)}: no baseline does, and the "
            f"LP rounding found none within time_limit={time_limit}s; raise time_limit (the whole MILP runs without "
            "one) or the budget",
            budget_bytes, smallest_peak, time_limit,
        )
    cost = incumbent.cost(graph)
    report_incumbent(progress, began, cost, bound)
    return incumbent.with_facts(SolverFacts(
        status=SolveStatus.OPTIMAL if relative_gap(cost, bound) <= mip_gap else SolveStatus.TIME_LIMIT,
        objective=cost, best_bound=min(bound, cost), seconds=time.perf_counter() - began, solve_seconds=lp.seconds,
        num_vars=model.num_vars, num_constraints=model.num_constraints, solver=lp.solver,
        warm_start=incumbent.strategy, peak_bytes=simulate(graph, incumbent).peak_bytes, budget_bytes=budget_bytes,
        exact_stages=0,
    ), strategy="optimal")
