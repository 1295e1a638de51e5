"""The ``optimal`` (Checkmate MILP) and ``approx_lp`` (LP rounding) strategies.

Both take ``(graph, budget=None, **options)``, the budget in any form the registry parses
(:mod:`tfremat.plan.registry`), and return a :class:`~tfremat.plan.schedule.Schedule`
whose ``facts`` carry what the solver proved: ``status`` (``optimal``: proven within the
requested gap; ``time_limit``: stopped by the time limit, the best schedule so far;
``feasible``: a schedule without proof of optimality), ``objective`` (the schedule's
total cost), ``best_bound`` (a proven lower bound on the optimal cost), ``gap``,
``seconds`` (total wall time), ``solve_seconds``, ``num_vars``, ``num_constraints``,
``solver``, ``warm_start`` (the baseline the MILP started from), ``peak_bytes`` and
``budget_bytes``.

The cost of running every node once (``graph.total_cost``) is always a valid lower
bound, and any schedule reaching it is optimal; ``optimal`` uses that to skip the
solver when a baseline already reaches it (always the case when the checkpoint-all
schedule fits). A proven-infeasible budget raises
:class:`~tfremat.errors.InfeasibleBudgetError` rather than returning a status.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverError,
    SolverTimeLimitError,
    is_int,
)
from tfremat.graph import DFGraph
from tfremat.ilp.formulation import (
    CheckmateModel,
    build_model,
    memory_lower_bound,
    r_column_count,
)
from tfremat.ilp.portfolio import FALLBACK_TIME_SHARE, best_baseline
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    FEASIBLE,
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    ProgressFn,
    check_solver_options,
    report_incumbent,
    solve_model,
)
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix
from tfremat.plan.simulator import simulate, stage_peaks

__all__ = ["solve_optimal", "solve_approx_lp"]

logger = logging.getLogger(__name__)

# Least time given to the solver when the baselines and the model build used up time_limit.
_MIN_SOLVE_SECONDS = 1.0
# Seconds kept after the MILP for simulating its solution (0.3 s on the 250-node graph).
_FINISH_SECONDS = 0.5
# Stage-end relaxations with more columns get a bound from their LP plus LP rounding
# instead of the MILP when a time limit is set. ResNet50's (125k columns; the exact model
# has 287k) has its LP in about 20 s and its MILP then matches that bound and schedule at
# 1.1x its smallest feasible budget; the 500-node random graph's (250k) LP takes 42 s to
# minutes with the dual simplex.
_FULL_MILP_COLUMNS = 150_000
# Graphs with more R columns are not modelled at all when a time limit is set: the
# 1000-node random graph (500k R columns, 4.1M columns) takes minutes and gigabytes to
# build, and its LP gets nowhere in minutes; the best heuristic is returned with the
# no-remat cost as its bound.
_MAX_R_COLUMNS = 250_000
# Models up to this many columns are presolved before the MILP (see _solve_with_stage_rows).
_PRESOLVE_MAX_COLUMNS = 20_000
# Seconds kept from an LP under a time limit for rounding its solution.
_ROUNDING_RESERVE_SECONDS = 3.0
# The gap at which a large model's schedule counts as optimal when mip_gap is None
# (HiGHS's MILP default).
_DEFAULT_MIP_GAP = 1e-4
_LARGE_ROUNDING_SAMPLES = 16
# Largest overflow, relative to the budget, that counts as the solver's tolerance when
# memory is in units of the budget: 1e-7 on rows plus 1e-6 on the integrality of binaries
# whose bytes sum to a few budgets.
_TOLERANCE_OVERFLOW = 1e-5


def _checkpoint_all(graph: DFGraph, strategy: str) -> Schedule:
    return schedule_from_keep_matrix(graph, checkpoint_all_s(graph), strategy)


def _infeasible(graph, budget_bytes, smallest_peak, strategy, detail, proven=True,
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


def _no_budget(graph: DFGraph, strategy: str, began: float) -> Schedule:
    schedule = _checkpoint_all(graph, strategy)
    cost = schedule.cost(graph)
    return schedule.with_facts(
        status=OPTIMAL, objective=cost, best_bound=graph.total_cost, gap=0.0, seconds=time.perf_counter() - began,
        peak_bytes=simulate(graph, schedule).peak_bytes, budget_bytes=None,
    )


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

    The solver works on the stage-end relaxation of the MILP (``build_model(...,
    exact_stages=())``: one memory row per stage, at its last node), which is a third to a
    half of the exact model's size and whose LP is as tight on the benchmark graphs; a
    solution that overflows the budget in the simulator gets its overflowing stages
    accounted exactly and the model is solved again, so a returned "optimal" is optimal
    for the exact model. The MILP starts from the cheapest schedule that fits among the
    baselines (``eviction`` among them) and the rounding of the relaxation's LP, improved
    by RINS (the MILP over the columns on which that start and the LP disagree; see
    ``_rins``), so the result is never worse than any of them, even when the time limit
    stops the solver early.
    When a baseline is within ``mip_gap`` of the no-remat cost (a lower bound), it is
    returned as optimal at once.

    Relaxed models of more than 150k columns (the 500-node random graph has 250k) are not
    solved as MILPs when a ``time_limit`` is set: the time goes to their LP by the dual
    simplex without presolve, whose row duals give a proven bound whenever it stops, and
    to rounding its solution; the best schedule comes with that bound and status
    ``time_limit`` unless it is within ``mip_gap`` of it. Graphs whose model would exceed
    250k R columns (the 1000-node random graph) are not modelled with a time limit: the
    best heuristic is returned, bounded by the no-remat cost. Without a time limit the MILP is solved, however long it
    takes.

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
        The schedule, with solver facts (see the module docstring).

    Raises:
        InfeasibleBudgetError: no schedule fits (proven by the solver, or the budget is
            below :func:`~tfremat.ilp.formulation.memory_lower_bound`).
        SolverTimeLimitError: the time limit ran out without any schedule and no
            baseline fits.
        ArgumentError: an option is out of range (raised before anything runs).
        SolverUnavailableError, SolverLicenseError: see :func:`~tfremat.ilp.solvers.solve_model`.
    """
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed)
    if budget is None:
        return _no_budget(graph, "optimal", began)
    budget_bytes = budget  # whole bytes: the registry parsed it
    lower_bound = memory_lower_bound(graph)
    if budget_bytes < lower_bound:
        _, smallest_peak = best_baseline(graph, budget_bytes, fallback_seconds=0.0) if warm_start else (None, None)
        raise _infeasible(graph, budget_bytes, smallest_peak, "optimal", "some node alone needs more while it runs")
    # Without a model to solve, the fallback heuristic may use the whole time limit.
    too_large = time_limit is not None and r_column_count(graph) > _MAX_R_COLUMNS
    fallback_seconds = 60.0 if time_limit is None else time_limit if too_large else FALLBACK_TIME_SHARE * time_limit
    deadline = None if time_limit is None else began + time_limit
    baseline, smallest_peak = (None, None)
    if warm_start:
        baseline, smallest_peak = best_baseline(graph, budget_bytes, fallback_seconds, deadline, threads, progress)
    # The no-remat cost bounds every schedule's cost from below.
    if baseline is not None and baseline.cost(graph) * (1 - (mip_gap or 0.0)) <= graph.total_cost:
        return _baseline_result(graph, baseline, OPTIMAL, began, budget_bytes)
    if too_large:
        if baseline is None:
            raise SolverTimeLimitError(
                f"no heuristic fits {budget_bytes} bytes{_smallest_peak_note(smallest_peak)} and the MILP of this "
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
        return _baseline_result(graph, baseline, TIME_LIMIT, began, budget_bytes)
    model = build_model(graph, budget_bytes, exact_stages=())
    if time_limit is not None and model.num_vars > _FULL_MILP_COLUMNS:
        return _solve_large(
            graph, model, baseline, smallest_peak, began=began, solver=solver, time_limit=time_limit,
            mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap, threads=threads, seed=seed, progress=progress,
        )
    lp = None
    if warm_start:
        baseline, lp = _relaxed_lp_start(
            model, baseline, began=began, time_limit=time_limit, solver=solver, threads=threads, seed=seed,
        )
    if lp is not None:
        lp_bound = max(graph.total_cost, lp.best_bound or 0.0)
        report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, lp_bound)
        if baseline is not None:
            baseline = _rins(model, baseline, lp.x, began=began, time_limit=time_limit, solver=solver,
                             threads=threads, seed=seed)
            report_incumbent(progress, began, baseline.cost(graph), lp_bound)
    return _solve_with_stage_rows(
        graph, model, baseline, smallest_peak, lp.best_bound if lp is not None else None, began=began, solver=solver,
        time_limit=time_limit, mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap, threads=threads, seed=seed,
        progress=progress,
    )


def _solve_with_stage_rows(graph, model, baseline, smallest_peak, lp_bound, *, began, solver, time_limit, mip_gap,
                           threads, seed, progress):
    """``optimal`` by the stage-end relaxation, made exact where its solutions overflow.

    ``model`` starts with every stage relaxed to its stage-end row. Each round solves it
    (from the cheapest schedule known), simulates the solution, and where it overflows
    the budget accounts those stages exactly and solves again; the rounds stop when the
    solution fits (then it is optimal for the exact model, being optimal for a
    relaxation of it) or the time is up. Every round's bound before any lowering (below)
    holds for the exact model. A solution that overflows only in exact stages, by no more
    than the solver's tolerance (memory in units of the budget), lowers the model's budget
    by the overflow and is solved again; bounds and infeasibility proofs of a lowered
    model are not used. Measured (1 thread): on the 100-node random graph (networkx
    order) at 80% the relaxation's optimum fits at once, proven in 9 s (the exact model
    took 59 s on 2 threads).

    Models above 20k columns run without presolve: on ResNet50's relaxed model (125k)
    HiGHS presolved for 9-11 s (removing 4% of the columns) before its root LP and
    overran the call's time limit by 7-12 s at 1.1x the smallest feasible budget; without
    it the root bound comes 8 s sooner and the call ends on time (61 s for a 60 s limit).
    There it is otherwise neutral within noise (``benchmarks/solvers.py``, 60 s: ResNet50
    at 90% / 80% proven in 27 / 49 s, was 29-32 / 40-57 s; the 250-node random graph's
    gaps, networkx order, 0.87% / 3.39%, were 0.86% / 3.47%). Smaller models presolve in
    well under a second, and HiGHS's seed decides more than presolve does (seeds 0 / 1 /
    2, 2 threads, seconds to the proof without / with presolve): vgg_unet at 1.1x its
    smallest budget (5k columns) 23.1 / 6.0 / 6.4 against 5.1 / 5.6 / 7.2; the 100-node
    random graph (10k) at 90% 7.9 / 5.0 / 4.6 against 3.9 / 3.9 / 3.3, at 80% 5.3 / 7.5 /
    7.5 against 7.7 / 7.3 / 7.6; the demo's 55-node graph at 50% (3k, not proven in 60 s)
    gaps 12.0 / 7.7 / 7.8% against 9.9 / 8.2 / 7.3%.
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
        remaining = None if deadline is None else max(deadline - time.perf_counter() - _FINISH_SECONDS, _MIN_SOLVE_SECONDS)
        result = solve_model(
            model, solver=solver, time_limit=remaining, mip_gap=mip_gap, threads=threads, seed=seed, start=start,
            progress=progress, presolve=model.num_vars <= _PRESOLVE_MAX_COLUMNS, started=began,
        )
        solve_seconds += result.seconds
        if result.status == INFEASIBLE and not lowered:
            raise _infeasible(graph, budget_bytes, smallest_peak, "optimal", f"{result.solver} proved no schedule fits",
                              lower_bound_bytes=budget_bytes + 1)
        if result.best_bound is not None and not lowered:
            bound = max(bound, result.best_bound)
        if result.x is None:
            break
        candidate = model.schedule(result.x, "optimal")
        outcome = simulate(graph, candidate)
        if outcome.peak_bytes <= budget_bytes:
            if incumbent is None or candidate.cost(graph) <= incumbent.cost(graph):
                incumbent = candidate
                proven = result.status == OPTIMAL and not lowered
            break
        if deadline is not None and time.perf_counter() >= deadline - _FINISH_SECONDS - _MIN_SOLVE_SECONDS:
            break
        overflowing = _overflowing_stages(graph, outcome, budget_bytes) - exact_stages
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
        model = build_model(graph, budget_bytes - lowered, exact_stages=exact_stages)
    if incumbent is None and lowered:
        raise _infeasible(graph, budget_bytes, smallest_peak, "optimal",
                          f"{result.solver}'s solutions exceed the budget by up to its tolerance "
                          f"({lowered:.0f} bytes) and none fits; a budget that much larger fits", proven=False)
    if incumbent is None:
        raise SolverTimeLimitError(
            f"{result.solver} found no schedule within time_limit={time_limit}s and no baseline fits "
            f"{budget_bytes} bytes{_smallest_peak_note(smallest_peak)}; raise time_limit or the budget",
            budget_bytes, smallest_peak, time_limit,
        )
    cost = incumbent.cost(graph)
    peak = simulate(graph, incumbent).peak_bytes
    if peak > budget_bytes:
        raise SolverError(f"internal error: the solver's schedule peaks at {peak} bytes, above the budget {budget_bytes}")
    gap = max(0.0, (cost - bound) / cost) if cost else 0.0
    status = OPTIMAL if proven or gap <= mip_gap else TIME_LIMIT if time_limit is not None else FEASIBLE
    return Schedule(incumbent.R, incumbent.S, "optimal").with_facts(
        status=status, objective=cost, best_bound=min(bound, cost), gap=gap, seconds=time.perf_counter() - began,
        solve_seconds=solve_seconds, num_vars=model.num_vars, num_constraints=model.num_constraints,
        solver=result.solver, warm_start=baseline.strategy if baseline is not None else None, peak_bytes=peak,
        budget_bytes=budget_bytes, exact_stages=len(exact_stages),
    )


def _smallest_peak_note(smallest_peak: int | None) -> str:
    """`` (the smallest peak any heuristic reached is ...)`` for an unproven failure's message."""
    return "" if smallest_peak is None else f" (the smallest peak any heuristic reached is {smallest_peak} bytes)"


def _overflowing_stages(graph: DFGraph, outcome, budget_bytes: int) -> set[int]:
    """The stages of a simulated schedule (``outcome``) whose memory exceeds the budget."""
    return set(map(int, np.flatnonzero(stage_peaks(outcome, graph.size) > budget_bytes)))


def _baseline_result(graph, baseline, status, began, budget_bytes) -> Schedule:
    """A baseline returned without a solver, bounded by the no-remat cost."""
    cost = baseline.cost(graph)
    return Schedule(baseline.R, baseline.S, "optimal", {
        "status": status, "objective": cost, "best_bound": min(graph.total_cost, cost),
        "gap": max(0.0, (cost - graph.total_cost) / cost) if cost else 0.0, "seconds": time.perf_counter() - began,
        "solve_seconds": 0.0, "num_vars": 0, "num_constraints": 0, "solver": None, "warm_start": baseline.strategy,
        "peak_bytes": simulate(graph, baseline).peak_bytes, "budget_bytes": budget_bytes, "exact_stages": 0,
    })


def _solve_large(graph, model, baseline, smallest_peak, *, began, solver, time_limit, mip_gap, threads, seed, progress):
    """``optimal`` on models too large for the whole MILP within ``time_limit``.

    The time goes to the LP relaxation: HiGHS's dual simplex without presolve, whose row
    duals are the model's own, so they give a proven bound whenever it stops (Gurobi's LP
    otherwise), and the LP's rounding may improve the warm start. The reported bound is
    the larger of that bound and the no-remat cost, so the gap is honest, if loose where
    the LP did not converge. The dual simplex replaced PDLP here: on the 500-node random
    graph (networkx order) at 90% / 80% (2 threads) it solves the LP in 42 s (1.0030x the
    no-remat cost) / bounds it at 1.0107x in 55 s, where PDLP's duals gave 1.0006x / 1.0072x.

    Window MILPs (large-neighbourhood search over a dozen stages with the keeps at their
    edges fixed) were tried here and dropped: on ResNet50 at 1.1x its smallest feasible
    budget, the four windows with the most recomputation were already optimal for their
    edges, and the time they took was worth more to the bound.
    """
    budget_bytes = int(model.budget_bytes)
    deadline = began + time_limit
    lp_seconds = max(deadline - time.perf_counter() - _ROUNDING_RESERVE_SECONDS, _MIN_SOLVE_SECONDS)
    report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, graph.total_cost)
    lp = solve_model(
        model, solver=solver, relax=True, time_limit=lp_seconds, threads=threads, seed=seed,
        lp_method=_lp_method(model, solver),
    )
    if lp.status == INFEASIBLE:
        raise _infeasible(graph, budget_bytes, smallest_peak, "optimal", f"{lp.solver} proved the LP relaxation infeasible",
                          lower_bound_bytes=budget_bytes + 1)
    bound = max(graph.total_cost, lp.best_bound or 0.0)
    incumbent = baseline
    if lp.x is not None:
        incumbent = _cheaper_rounding(model, lp.x, incumbent, seed=seed, strategy="optimal", deadline=deadline)
    if incumbent is None:
        raise SolverTimeLimitError(
            f"no schedule fits {budget_bytes} bytes{_smallest_peak_note(smallest_peak)}: no baseline does, and the "
            f"LP rounding found none within time_limit={time_limit}s; raise time_limit (the whole MILP runs without "
            "one) or the budget",
            budget_bytes, smallest_peak, time_limit,
        )
    cost = incumbent.cost(graph)
    gap = max(0.0, (cost - bound) / cost) if cost else 0.0
    report_incumbent(progress, began, cost, bound)
    return Schedule(incumbent.R, incumbent.S, "optimal").with_facts(
        status=OPTIMAL if gap <= mip_gap else TIME_LIMIT, objective=cost, best_bound=min(bound, cost), gap=gap,
        seconds=time.perf_counter() - began, solve_seconds=lp.seconds, num_vars=model.num_vars,
        num_constraints=model.num_constraints, solver=lp.solver, warm_start=incumbent.strategy,
        peak_bytes=simulate(graph, incumbent).peak_bytes, budget_bytes=budget_bytes, exact_stages=0,
    )


def _lp_method(model: CheckmateModel, solver: str) -> str:
    """For large models on HiGHS, the dual simplex without presolve (stopped at the time
    limit, its duals still bound the LP); else the solver's default simplex."""
    return "dual_simplex" if solver == "highs" and model.num_vars > _FULL_MILP_COLUMNS else "simplex"


def _share_of_time_left(fraction: float, began: float, time_limit: float | None) -> float | None:
    """``fraction`` of what is left of ``time_limit`` (at least ``_MIN_SOLVE_SECONDS``), or
    None without a limit."""
    if time_limit is None:
        return None
    return max(fraction * (time_limit - (time.perf_counter() - began)), _MIN_SOLVE_SECONDS)


def _relaxed_lp_start(model, baseline, *, began, time_limit, solver, threads, seed):
    """The LP of the stage-end relaxation ``model``: its bound, and the cheaper of ``baseline``
    and the LP's rounding as the MILP's start.

    HiGHS can spend a whole time limit without improving a poor incumbent (measured: a
    55-node graph at 50% budget kept Griewank's 2.74x cost for 60 s while the LP rounding
    found 1.87x in 1 s), so the MILP starts from the better of the two. The relaxation's
    LP is fast (the 250-node random graph, networkx order: 4-6 s, where the exact model's
    LP took 32-45 s) and as tight as the exact one on the benchmark graphs. Gets a quarter
    of the time left.

    Returns:
        ``(start, lp)``: the schedule to start from and the LP's
        :class:`~tfremat.ilp.solvers.SolveResult`, None when the LP did not finish.
    """
    lp_time = _share_of_time_left(0.25, began, time_limit)
    lp = solve_model(model, solver=solver, relax=True, time_limit=lp_time, threads=threads, seed=seed)
    if lp.x is None or lp.status != OPTIMAL:
        logger.info("optimal: the relaxation's LP did not finish in %s s (%s)", lp_time, lp.status)
        return baseline, None
    deadline = None if time_limit is None else began + time_limit
    return _cheaper_rounding(model, lp.x, baseline, seed=seed, strategy="approx_lp", deadline=deadline), lp


def _cheaper_rounding(model, lp_x, incumbent, *, seed, strategy, deadline):
    """The cheaper of ``incumbent`` (or None) and the cheapest rounding of the LP point
    ``lp_x`` that fits the model's budget."""
    rng = np.random.default_rng(seed)
    rounded, _ = _cheapest_rounding(
        model, lp_x, int(model.budget_bytes), _LARGE_ROUNDING_SAMPLES, rng, strategy, deadline,
    )
    if rounded is not None and (incumbent is None or rounded.cost(model.graph) < incumbent.cost(model.graph)):
        return rounded
    return incumbent


def _rins(model, start, lp_x, *, began, time_limit, solver, threads, seed):
    """RINS (relaxation-induced neighbourhood search): the MILP with every R and S column
    on which ``start`` and the LP point of the stage-end relaxation ``model`` agree fixed
    to that value, for half the time left; its schedule when it fits the budget and is
    cheaper, else ``start``.

    HiGHS alone never improved eviction's 1.0608x on ResNet50 at 1.1x its smallest
    feasible budget, even in 600 s; with the 93% of the integer columns on which the two
    agree fixed, it finds 1.0564x in 20 s (1.0557x in 60 s). Where the neighbourhood holds
    nothing better (the 250-node random graph at 80%, networkx order) it proves that in
    under a second.

    The neighbourhood's optimum may overflow the budget inside a stage, where the
    relaxation does not look. Those stages are then accounted exactly and the same
    neighbourhood is solved again, until its optimum fits or the time share is spent. On
    the 250-node random graph at 80% (its file's order) the first optimum, 1.0467x,
    overflows by 2% in one stage; with that stage exact RINS finds 1.0496x, where the
    start was ``intervals``' 1.0539x (gap at 60 s: 2.19-2.21% instead of 2.69%). The
    MILP after it starts from the relaxation again: handing it the stages RINS made exact
    lowered its bound at 60 s there (1.0247-1.0252x against 1.0263-1.0266x; a larger
    model, fewer root cut rounds).

    Other neighbourhoods measured on that ResNet50 case (2 threads) and not used: RINS
    repeated from its own result (1.0561x after 45 s); RINS around eviction runs whose
    limit is above the budget (cheaper, overflowing references: 1.0545x-1.0594x, most
    results overflowing the budget inside a stage, where the relaxation does not look);
    crossovers of those results; windows of 20 stages or of 30 values with everything
    else fixed (nothing, and 1.0594x from eviction's 1.0608x in 90 s); HiGHS's
    ``mip_heuristic_effort`` at 0.3 (nothing in 60 s).
    """
    graph = model.graph
    budget_bytes = int(model.budget_bytes)
    x0 = model.encode(start)
    if x0 is None:
        return start
    # The relaxation's integer columns are its R and S columns, which build_model numbers
    # first and alike whatever stages are exact: the same column numbers fix the same
    # variables in the models with exact stages below.
    fixed = np.flatnonzero(model.integer & (np.abs(lp_x - x0) < 1e-6))
    deadline = None if time_limit is None else time.perf_counter() + _share_of_time_left(0.5, began, time_limit)
    exact_stages: set[int] = set()
    current = model
    while True:
        x0 = current.encode(start)
        if x0 is None:
            return start
        lower, upper = current.lower.copy(), current.upper.copy()
        lower[fixed] = upper[fixed] = x0[fixed]
        seconds = None if deadline is None else max(deadline - time.perf_counter(), _MIN_SOLVE_SECONDS)
        neighbourhood = dataclasses.replace(current, lower=lower, upper=upper)
        result = solve_model(neighbourhood, solver=solver, time_limit=seconds, threads=threads, seed=seed, start=x0,
                             quiet=True)
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
        overflowing = _overflowing_stages(graph, outcome, budget_bytes) - exact_stages
        if not overflowing:
            return start
        exact_stages |= overflowing
        current = build_model(graph, budget_bytes, exact_stages=exact_stages)
        if deadline is not None and time.perf_counter() >= deadline - _MIN_SOLVE_SECONDS:
            return start


def _cheapest_rounding(
    model: CheckmateModel, x: np.ndarray, budget_bytes: int, num_samples: int, rng: np.random.Generator,
    strategy: str, deadline: float | None = None,
) -> tuple[Schedule | None, int]:
    """The cheapest rounding of the LP point ``x`` (completed by solve R given S) whose
    simulated peak fits ``budget_bytes`` (the user's budget: approx_lp builds its model for
    a smaller allowance), or None, and the smallest peak of any rounding. Stops at
    ``deadline`` (a ``time.perf_counter()`` time) after the first rounding."""
    graph = model.graph
    best, best_cost, smallest_peak = None, None, None
    for S in _round_candidates(model, x, num_samples, rng):
        schedule = schedule_from_keep_matrix(graph, S, strategy)
        peak = simulate(graph, schedule).peak_bytes
        smallest_peak = peak if smallest_peak is None else min(smallest_peak, peak)
        cost = schedule.cost(graph)
        if peak <= budget_bytes and (best is None or cost < best_cost):
            best, best_cost = schedule, cost
        if deadline is not None and time.perf_counter() > deadline:
            break
    return best, smallest_peak


def _round_candidates(model: CheckmateModel, x: np.ndarray, num_samples: int, rng: np.random.Generator):
    """Checkmate's rounding of the fractional keep matrix S*: a deterministic threshold
    sweep, then randomized rounding (keep i with probability S*[t, i])."""
    fractional = np.zeros(model.s_index.shape)
    mask = model.s_index >= 0
    fractional[mask] = np.clip(x[model.s_index[mask]], 0.0, 1.0)
    seen = set()
    thresholds = np.linspace(0.05, 0.95, 19)
    draws = (rng.random(fractional.shape) < fractional for _ in range(num_samples))
    for S in (*(fractional >= threshold for threshold in thresholds), *draws):
        key = np.packbits(S).tobytes()
        if key not in seen:
            seen.add(key)
            yield S


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
    (``solve R given S``). The cheapest candidate whose simulated peak fits is returned.
    The LP is that of the stage-end relaxation (:func:`~tfremat.ilp.formulation.build_model`
    with ``exact_stages=()``): as tight as the exact model's on the benchmark graphs, and
    several times faster.
    Rounding can overshoot the budget, so when no candidate fits the LP is solved again
    under a smaller memory allowance (Checkmate sec. 5), down the ``allowances`` list.

    Args:
        graph: the graph.
        budget: peak bytes allowed (see :func:`solve_optimal`); None returns the
            checkpoint-all schedule, optimal without a solver.
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
        The schedule; ``facts["best_bound"]`` is the larger of the no-remat cost and the
        LP bound at the full budget (allowance 1.0). An LP under a smaller allowance
        bounds only that smaller budget, so it never counts as the bound.

    Raises:
        InfeasibleBudgetError: the LP relaxation at the full budget is infeasible (so is
            every schedule), or no rounded schedule fits; carries the smallest peak
            reached.
        ArgumentError: an option is out of range (raised before anything runs).
        SolverTimeLimitError: no LP relaxation was solved within ``time_limit``, or with a
            ``time_limit`` the model would exceed 250k R columns.
    """
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, threads=threads, seed=seed)
    if not is_int(num_samples) or num_samples < 0:
        raise ArgumentError(f"num_samples must be an int >= 0, got {num_samples!r}")
    if not allowances or not all(0 < a <= 1 for a in allowances):
        raise ArgumentError(f"allowances must be fractions in (0, 1], got {allowances!r}")
    if budget is None:
        return _no_budget(graph, "approx_lp", began)
    budget_bytes = budget  # whole bytes: the registry parsed it
    lower_bound = memory_lower_bound(graph)
    if budget_bytes < lower_bound:
        _, smallest_peak = best_baseline(graph, budget_bytes, fallback_seconds=0.0)
        raise _infeasible(graph, budget_bytes, smallest_peak, "approx_lp", "some node alone needs more while it runs")
    if time_limit is not None and r_column_count(graph) > _MAX_R_COLUMNS:
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
        model = build_model(graph, max(lower_bound, allowance * budget_bytes), exact_stages=())
        remaining = None if deadline is None else max(
            deadline - time.perf_counter() - _ROUNDING_RESERVE_SECONDS, _MIN_SOLVE_SECONDS,
        )
        result = solve_model(
            model, solver=solver, relax=True, time_limit=remaining, threads=threads, seed=seed,
            lp_method=_lp_method(model, solver),
        )
        lp_seconds += result.seconds
        if not num_vars:
            num_vars, num_constraints = model.num_vars, model.num_constraints
        if allowance == 1.0:
            if result.status == INFEASIBLE:
                _, heuristic_peak = best_baseline(graph, budget_bytes, fallback_seconds=0.0)
                raise _infeasible(graph, budget_bytes, heuristic_peak, "approx_lp", "the LP relaxation is infeasible",
                                  lower_bound_bytes=budget_bytes + 1)
            lp_bound = max(lp_bound, result.best_bound or 0.0)
            report_incumbent(progress, began, None, lp_bound)
        if result.x is None:
            continue
        best, peak = _cheapest_rounding(model, result.x, budget_bytes, num_samples, rng, "approx_lp", deadline)
        smallest_peak = peak if smallest_peak is None else min(smallest_peak, peak)
        if best is not None:
            best_cost = best.cost(graph)
            report_incumbent(progress, began, best_cost, lp_bound)
            break
    if best is None and smallest_peak is None:
        raise SolverTimeLimitError(f"{solver} solved no LP relaxation within time_limit={time_limit}s; raise time_limit",
                                   budget_bytes, None, time_limit)
    if best is None:
        raise _infeasible(graph, budget_bytes, smallest_peak, "approx_lp", "no rounding of the LP solution fits",
                          proven=False)
    return best.with_facts(
        status=FEASIBLE if best_cost > lp_bound else OPTIMAL, objective=best_cost, best_bound=lp_bound,
        gap=max(0.0, (best_cost - lp_bound) / best_cost) if best_cost else 0.0, seconds=time.perf_counter() - began,
        solve_seconds=lp_seconds, num_vars=num_vars, num_constraints=num_constraints, solver=solver,
        peak_bytes=simulate(graph, best).peak_bytes, budget_bytes=budget_bytes,
    )
