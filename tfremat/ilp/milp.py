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

The steps are shared, through :class:`MilpProblem`, with ``monet``
(:mod:`tfremat.ilp.monet`), whose model also chooses every node's implementation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from tfremat.errors import InfeasibleBudgetError, SolverError, SolverTimeLimitError
from tfremat.graph import DFGraph
from tfremat.ilp.blocks import chain_units, plan_by_units, unit_graph
from tfremat.ilp.deadlines import MIN_SOLVE_SECONDS, seconds_left
from tfremat.ilp.formulation import (
    CheckmateModel,
    build_milp,
    cheapest_implementations,
    has_step_rules,
    lower_bound_reason,
    memory_lower_bound,
    no_remat_cost,
    overflowing_stages,
    r_column_count,
)
from tfremat.ilp.interrupts import Incumbent
from tfremat.ilp.portfolio import FALLBACK_TIME_SHARE, best_baseline
from tfremat.ilp.rins import relaxed_lp_start, rins
from tfremat.ilp.rounding import cheaper_rounding
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    Progress,
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

__all__ = ["solve_optimal", "MilpProblem", "solve_milp"]

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
# Share of monet's time_limit for optimal's schedules that start its MILP (_optimal_starts).
STARTS_TIME_SHARE = 0.5
# With stall_time, the MILP is skipped when the relaxation's LP took at least this share of
# it in CPU seconds: the MILP's root LP, which the stall rule cannot interrupt, takes about
# as long, and the rule stops the search right after it (benchmarks/latency.py).
ROOT_STALL_SHARE = 0.5
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
                     lower_bound_bytes=None, choose_implementations=False) -> InfeasibleBudgetError:
    """The infeasible-budget error; ``lower_bound_bytes`` defaults to
    :func:`memory_lower_bound` (over every implementation with ``choose_implementations``),
    and is ``budget_bytes + 1`` where a solver proved the budget infeasible (every feasible
    budget is above it)."""
    return InfeasibleBudgetError(
        budget_bytes,
        min_feasible_bytes=smallest_peak,
        lower_bound_bytes=max(memory_lower_bound(graph, choose_implementations), lower_bound_bytes or 0),
        strategy=strategy,
        detail=detail,
        proven=proven,
    )


def no_budget_schedule(graph: DFGraph, strategy: str, began: float,
                       implementations: dict[int, str] | None = None) -> Schedule:
    """Without a budget: the checkpoint-all schedule (on the graph under ``implementations``),
    optimal without a solver (it runs every node once, under the cheapest implementations
    when those are chosen)."""
    under = graph.with_implementations(implementations)
    schedule = schedule_from_keep_matrix(under, checkpoint_all_s(under), strategy).with_implementations(implementations)
    cost = schedule.cost(graph)
    return schedule.with_facts(SolverFacts(
        status=SolveStatus.OPTIMAL, objective=cost, best_bound=cost, seconds=time.perf_counter() - began,
        peak_bytes=simulate(graph, schedule).peak_bytes, budget_bytes=None,
    ))


def smallest_peak_note(smallest_peak: int | None) -> str:
    """`` (the smallest peak any heuristic reached is ...)`` for an unproven failure's message."""
    return "" if smallest_peak is None else f" (the smallest peak any heuristic reached is {smallest_peak} bytes)"


def lp_method(model: CheckmateModel, solver: str) -> str:
    """For large models on HiGHS, the dual simplex without presolve (stopped at the time
    limit, its duals still bound the LP); else the solver's default simplex."""
    return "dual_simplex" if solver == "highs" and model.num_vars > _FULL_MILP_COLUMNS else "simplex"


@dataclasses.dataclass(frozen=True)
class MilpProblem:
    """What a strategy built on Checkmate's MILP solves, for the steps they share
    (:func:`solve_milp`).

    Attributes:
        strategy: its name (``optimal``, ``monet``), in schedules, facts and errors.
        choose_implementations: its model chooses every node's implementation too
            (:func:`~tfremat.ilp.formulation.build_milp`); the cost and memory lower bounds
            are then over every choice.
        starts: on a graph with alternatives, the implementation choices under which
            ``optimal``'s schedules start the MILP (:func:`_optimal_starts`); None: the
            heuristics' best (:func:`~tfremat.ilp.portfolio.best_baseline`) does.
    """

    strategy: str
    choose_implementations: bool = False
    starts: Callable[[DFGraph], list[dict[int, str]]] | None = None

    def cost_floor(self, graph: DFGraph) -> float:
        """The no-remat cost, a lower bound on every schedule's cost (:func:`no_remat_cost`)."""
        return no_remat_cost(graph, self.choose_implementations)

    def infeasible(self, graph: DFGraph, budget_bytes, smallest_peak, detail: str, **options) -> InfeasibleBudgetError:
        """:func:`infeasible_error` of this strategy, its memory lower bound over every choice
        of implementations when it chooses them."""
        return infeasible_error(graph, budget_bytes, smallest_peak, self.strategy, detail,
                                choose_implementations=self.choose_implementations, **options)


_OPTIMAL = MilpProblem("optimal")


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
    stall_time: float | None = None,
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
        stall_time: stop RINS and the MILP once this many seconds of CPU time pass without
            a better solution (:func:`~tfremat.ilp.solvers.solve_model`), skip the MILP when the
            relaxation's LP did not finish in its share of the time (the MILP's root LP would
            not either) or took half of ``stall_time`` in CPU seconds (the rule would stop
            the MILP right after its root LP), and return the best schedule that fits,
            status ``feasible`` with its gap (``optimal`` when within ``mip_gap`` of the
            bound). None or ``math.inf``: run to the time limit.

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
    return solve_milp(graph, budget, _OPTIMAL, solver=solver, time_limit=time_limit, mip_gap=mip_gap,
                      threads=threads, seed=seed, warm_start=warm_start, progress=progress, stall_time=stall_time)


def solve_milp(graph: DFGraph, budget: int | None, problem: MilpProblem, *, solver: str,
               time_limit: float | None, mip_gap: float | None, threads: int | None, seed: int, warm_start: bool,
               progress: ProgressFn | None, stall_time: float | None = None) -> Schedule:
    """The body of :func:`solve_optimal` (options and outcomes as documented there), for
    ``problem``: ``optimal``'s or ``monet``'s."""
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed,
                                      stall_time=stall_time)
    # math.inf turns the rule off here too: its MILP skips read it as a rule (the latency
    # benchmark's "no stall" plan of gpt2_hub_6 skipped the MILP as the stalled one did).
    stall_time = None if stall_time == math.inf else stall_time
    if budget is None:
        implementations = cheapest_implementations(graph) if problem.choose_implementations else None
        return no_budget_schedule(graph, problem.strategy, began, implementations)
    incumbent = Incumbent(graph, budget)
    incumbent.bound = problem.cost_floor(graph)
    try:
        return _solve_optimal(graph, budget, incumbent, problem, began=began, solver=solver, time_limit=time_limit,
                              mip_gap=mip_gap, threads=threads, seed=seed, warm_start=warm_start, progress=progress,
                              stall_time=stall_time)
    except KeyboardInterrupt as interrupt:
        return incumbent.result(problem.strategy, began, interrupt)


def portfolio_deadline(began: float, time_limit: float | None) -> float | None:
    """When a MILP strategy's heuristics must stop (a ``time.perf_counter()`` time): a
    little before its time limit, yet at least :data:`MIN_SOLVE_SECONDS` after ``began``
    (as a solver, they get that much however short the limit)."""
    if time_limit is None:
        return None
    return began + max(time_limit - min(PORTFOLIO_RESERVE_SECONDS, 0.1 * time_limit), MIN_SOLVE_SECONDS)


def _solve_optimal(graph, budget_bytes, incumbent, problem, *, began, solver, time_limit, mip_gap, threads, seed,
                   warm_start, progress, stall_time=None) -> Schedule:
    """:func:`solve_milp` with a budget, keeping ``incumbent`` up to date for Ctrl-C."""
    choose = problem.choose_implementations
    lower_bound = memory_lower_bound(graph, choose)
    heuristics_until = portfolio_deadline(began, time_limit)
    options = dict(solver=solver, mip_gap=mip_gap, threads=threads, seed=seed, stall_time=stall_time)
    starts = problem.starts(graph) if problem.starts is not None and graph.implementations else None
    if budget_bytes < lower_bound:
        smallest_peak = None
        if warm_start and starts is None:
            _, smallest_peak = best_baseline(graph, budget_bytes, 0.0, heuristics_until)
        elif warm_start:
            _, smallest_peak = _optimal_starts(graph, budget_bytes, starts, incumbent, problem, began=began,
                                               time_limit=time_limit, progress=None, **options)
        raise problem.infeasible(graph, budget_bytes, smallest_peak, lower_bound_reason(graph, choose))
    # Without a model to solve, the fallback heuristic may use the whole time limit.
    r_columns = r_column_count(graph, choose)
    too_large = time_limit is not None and r_columns > MAX_R_COLUMNS
    fallback_seconds = 60.0 if time_limit is None else time_limit if too_large else FALLBACK_TIME_SHARE * time_limit
    baseline, smallest_peak = (None, None)
    # CPU time of the last cheaper heuristic schedule: the large-model path's stall clock.
    improved = [time.process_time()]

    def offer(schedule: Schedule, peak: int | None = None) -> None:
        incumbent.offer(schedule, peak)
        improved[0] = time.process_time()

    if warm_start and starts is None:
        baseline, smallest_peak = best_baseline(graph, budget_bytes, fallback_seconds, heuristics_until, threads,
                                                progress, offer=offer)
    elif warm_start:
        baseline, smallest_peak = _optimal_starts(graph, budget_bytes, starts, incumbent, problem, began=began,
                                                  time_limit=time_limit, progress=progress, **options)
        improved[0] = time.process_time()
    # The no-remat cost bounds every schedule's cost from below; the two sums add the same
    # costs in other orders (a keep-everything baseline read 6e-17 above the floor).
    floor = problem.cost_floor(graph) * (1 + 1e-12)
    if baseline is not None and baseline.cost(graph) * (1 - (mip_gap or 0.0)) <= floor:
        return _baseline_result(graph, baseline, SolveStatus.OPTIMAL, began, budget_bytes, problem)
    if too_large:
        if baseline is None:
            raise SolverTimeLimitError(
                f"no heuristic fits {budget_bytes} bytes{smallest_peak_note(smallest_peak)} and the MILP of this "
                f"{graph.size}-node graph ({r_columns} R columns) is too large to build within "
                f"time_limit={time_limit}s; "
                "raise the budget, or pass time_limit=None (math.inf through tfremat.plan_model, fit and max_batch_size) "
                "to build and solve it however long it takes",
                budget_bytes, smallest_peak, time_limit,
            )
        logger.warning(
            "%s: the MILP of this %d-node graph (%d R columns) is too large to build within time_limit=%ss; "
            "returning the best heuristic (%s), bounded only by the no-remat cost; time_limit=None (math.inf "
            "through tfremat.plan_model, fit and max_batch_size) builds and solves it however long it takes",
            problem.strategy, graph.size, r_columns, time_limit, baseline.strategy,
        )
        return _baseline_result(graph, baseline, SolveStatus.TIME_LIMIT, began, budget_bytes, problem)
    model = build_milp(graph, budget_bytes, exact_stages=(), choose_implementations=choose)
    incumbent.num_vars, incumbent.num_constraints, incumbent.solver = model.num_vars, model.num_constraints, solver
    if time_limit is not None and model.num_vars > _FULL_MILP_COLUMNS:
        # With the stall rule and a schedule that fits, units that do not repeat are not tried.
        if warm_start and (stall_time is None or baseline is None or _units_repeat(graph)):
            by_units = plan_by_units(graph, budget_bytes, solver=solver,
                                     deadline=began + UNITS_TIME_SHARE * time_limit)
            if by_units is not None and (baseline is None or by_units.cost(graph) < baseline.cost(graph)):
                baseline = by_units
                offer(baseline)
        return _solve_large(
            graph, model, baseline, smallest_peak, problem, began=began, solver=solver, time_limit=time_limit,
            mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap, threads=threads, seed=seed, progress=progress,
            incumbent=incumbent,
            stall_time=None if stall_time is None else stall_time - (time.process_time() - improved[0]),
        )
    lp = None
    if warm_start:
        baseline, lp = relaxed_lp_start(
            model, baseline, began=began, time_limit=time_limit, solver=solver, threads=threads, seed=seed,
        )
    incumbent.offer(baseline)
    if lp is None and warm_start and stall_time is not None and baseline is not None:
        # The MILP's root is this LP, which HiGHS does not interrupt: it would not finish either.
        logger.info("%s: the relaxation's LP did not finish in its share of the time; with stall_time the MILP is "
                    "skipped and the best start returned", problem.strategy)
        return _baseline_result(graph, baseline, SolveStatus.FEASIBLE, began, budget_bytes, problem)
    if lp is not None:
        lp_bound = max(problem.cost_floor(graph), lp.best_bound or 0.0)
        incumbent.raise_bound(lp_bound)
        report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, lp_bound)
        if baseline is not None:
            baseline = _rins(model, baseline, lp.x, began=began, time_limit=time_limit, solver=solver,
                             threads=threads, seed=seed, stall_time=stall_time)
            incumbent.offer(baseline)
            report_incumbent(progress, began, baseline.cost(graph), lp_bound)
        if baseline is not None and stall_time is not None and lp.cpu_seconds >= ROOT_STALL_SHARE * stall_time:
            # HiGHS solves the root LP again, without the stall rule's check, and the rule
            # stops the MILP soon after: it searched for nothing (gpt2_hub_6 at 30%,
            # benchmarks/latency.py: 8 of 23 CPU seconds, no better schedule).
            logger.info("%s: the relaxation's LP took %.1f CPU s, at least %.0f%% of stall_time=%ss; the MILP is "
                        "skipped and the best start returned", problem.strategy, lp.cpu_seconds,
                        100 * ROOT_STALL_SHARE, stall_time)
            return _baseline_result(graph, baseline, SolveStatus.FEASIBLE, began, budget_bytes, problem,
                                    bound=lp_bound, mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap,
                                    model=model, solver=solver)
    return _solve_with_stage_rows(
        graph, model, baseline, smallest_peak, lp.best_bound if lp is not None else None, problem, began=began,
        solver=solver, time_limit=time_limit, mip_gap=_DEFAULT_MIP_GAP if mip_gap is None else mip_gap,
        threads=threads, seed=seed, progress=progress, tracker=incumbent, stall_time=stall_time,
    )


def _optimal_starts(graph, budget_bytes, starts, incumbent, problem, *, began, time_limit, progress,
                    **options) -> tuple[Schedule | None, int | None]:
    """``optimal`` on the graph under each implementation choice of ``starts`` (monet's warm
    start: the graph's own numbers and its leanest implementations), each for an equal
    share of :data:`STARTS_TIME_SHARE` of ``time_limit`` (no limit without one).

    Returns:
        The cheapest of their schedules (under its choice; each offered to ``incumbent``),
        or None when none fits, and the smallest peak any reached (their heuristics' when
        they raise).
    """
    best, smallest_peak = None, None
    floor = problem.cost_floor(graph)

    def relay(report: Progress) -> None:
        # A start's bound holds for its choice only: the reports carry this problem's own.
        progress(Progress(time.perf_counter() - began, report.incumbent, floor,
                          relative_gap(report.incumbent, floor)))

    for position, choice in enumerate(starts):
        under = graph.with_implementations(choice)
        share = None
        if time_limit is not None:
            share = max(STARTS_TIME_SHARE * time_limit - (time.perf_counter() - began), 0.0) / (len(starts) - position)
            share = max(share, MIN_SOLVE_SECONDS)
        try:
            schedule = _solve_optimal(under, budget_bytes, Incumbent(under, budget_bytes), _OPTIMAL,
                                      began=time.perf_counter(), time_limit=share, warm_start=True,
                                      progress=None if progress is None else relay, **options)
            schedule = schedule.with_implementations(choice)
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            peak = error.min_feasible_bytes
        else:
            peak = schedule.facts.peak_bytes
            incumbent.offer(schedule, peak)
            if best is None or schedule.cost(graph) < best.cost(graph):
                best = schedule
                report_incumbent(progress, began, best.cost(graph), floor)
        if peak is not None:
            smallest_peak = peak if smallest_peak is None else min(smallest_peak, peak)
    return best, smallest_peak


def _rins(model: CheckmateModel, start: Schedule, lp_x, **options) -> Schedule:
    """:func:`~tfremat.ilp.rins.rins` around ``start`` and the relaxation's LP point ``lp_x``.

    A model that chooses implementations goes to it exact in every stage, with the LP
    point's integer columns (numbered alike whatever stages are exact): RINS accounts
    the stages where its neighbourhood overflows by building Checkmate's model, which
    has no implementation columns, and an exact model never overflows.
    """
    if not model.chooses_implementations:
        return rins(model, start, lp_x, **options)
    exact = build_milp(model.graph, model.budget_bytes, choose_implementations=True)
    point = np.zeros(exact.num_vars)
    point[:model.free_start] = lp_x[:model.free_start]
    return rins(exact, start, point, **options)


def _solve_with_stage_rows(graph, model, baseline, smallest_peak, lp_bound, problem, *, began, solver, time_limit,
                           mip_gap, threads, seed, progress, tracker, stall_time=None):
    """``optimal`` (or ``problem``'s strategy) by the stage-end relaxation, made exact where
    its solutions overflow.

    ``model`` starts with every stage relaxed to its stage-end row. Each round solves it
    (from the cheapest schedule known), simulates the solution, and where it overflows
    the budget accounts those stages exactly and solves again; the rounds stop when the
    solution fits (then it is optimal for the exact model, being optimal for a
    relaxation of it) or the time is up. Every round's bound before any lowering (below)
    holds for the exact model. A solution that overflows only in exact stages, by no more
    than the solver's tolerance (memory in units of the budget), lowers the model's budget
    by the overflow and is solved again; bounds and infeasibility proofs of a lowered
    model are not used. An infeasibility proof of the model holds within its step rules
    only: the model without them decides (:func:`_without_step_rules`), and a schedule that
    fits (the heuristic's, or that model's when cheaper) is returned as ``feasible``.

    Once a schedule fits, ``stall_time`` ends the rounds too: a solve stopped by it, or a
    round that ends with an overflowing solution once ``stall_time`` seconds of CPU time
    have passed since the first round began (no cheaper schedule that fits was found in that time),
    leaves the incumbent.

    Models above ``_PRESOLVE_MAX_COLUMNS`` run without presolve (see the constant).
    """
    budget_bytes = int(model.budget_bytes)
    deadline = None if time_limit is None else began + time_limit
    incumbent = baseline
    bound = max(problem.cost_floor(graph), lp_bound or 0.0)
    exact_stages: set[int] = set()
    # Bytes the model's budget is lowered by after a solution overflowed within the
    # solver's tolerance; bounds and infeasibility proofs of a lowered model do not hold
    # for the true budget.
    lowered = 0.0
    solve_seconds = 0.0
    proven = False
    # The model was proven infeasible: the search ended, not the time.
    model_infeasible = False
    rounds_began = time.process_time()  # CPU time, as the stall rule counts it
    while True:
        start = model.encode(incumbent) if incumbent is not None else None
        if incumbent is not None and start is None:
            # Expected after lowering the budget (the incumbent may peak above it) and from a
            # heuristic that breaks the step rules (recomputes a layer after its backward); else a defect.
            expected = lowered or has_step_rules(graph, problem.choose_implementations)
            logger.log(logging.INFO if expected else logging.WARNING,
                       "schedule %s is not a solution of this model (it breaks the model's step rules, or peaks "
                       "above its lowered budget); solving without a MIP start", incumbent.strategy)
        logger.info("%s: %d variables, %d constraints, %d of %d stages exact, start %s", problem.strategy,
                    model.num_vars, model.num_constraints, len(exact_stages), graph.size,
                    incumbent.strategy if incumbent else None)
        # Without a schedule that fits, nothing stops the search before the time limit.
        stall = stall_time if incumbent is not None else None
        result = solve_model(
            model, solver=solver, time_limit=seconds_left(deadline, _FINISH_SECONDS), mip_gap=mip_gap,
            threads=threads, seed=seed, start=start, progress=progress,
            presolve=model.num_vars <= _PRESOLVE_MAX_COLUMNS, started=began, stall_time=stall,
        )
        solve_seconds += result.seconds
        stalled = result.stalled
        if result.status == SolveStatus.INFEASIBLE and not lowered:
            # A proof about the model, whose step rules may cut off every schedule that fits.
            none_fits, relaxed = _without_step_rules(graph, budget_bytes, problem, solver=solver, deadline=deadline,
                                                     threads=threads, seed=seed, start=incumbent, mip_gap=mip_gap,
                                                     stall_time=stall_time)
            if incumbent is None and relaxed is None:
                raise _infeasible_beyond_step_rules(problem, graph, budget_bytes, smallest_peak, result.solver,
                                                    none_fits)
            if relaxed is not None and (incumbent is None or relaxed.cost(graph) < incumbent.cost(graph)):
                incumbent = relaxed
                tracker.offer(incumbent)
            logger.info("%s: %s proved that no schedule within the model's step rules fits; returning %s, which "
                        "breaks them", problem.strategy, result.solver, incumbent.strategy)
            bound, model_infeasible = problem.cost_floor(graph), True
            break
        if result.best_bound is not None and not lowered:
            bound = max(bound, result.best_bound)
            tracker.raise_bound(bound)
        if result.x is None:
            break
        candidate = model.schedule(result.x, problem.strategy)
        outcome = simulate(graph, candidate)
        if outcome.peak_bytes <= budget_bytes:
            tracker.offer(candidate, outcome.peak_bytes)
            if incumbent is None or candidate.cost(graph) <= incumbent.cost(graph):
                incumbent = candidate
                proven = result.status == SolveStatus.OPTIMAL and not lowered
            break
        now = time.perf_counter()
        stalled = stalled or (stall is not None and time.process_time() - rounds_began >= stall)
        if stalled or (deadline is not None and now >= deadline - _FINISH_SECONDS - MIN_SOLVE_SECONDS):
            break
        overflowing = overflowing_stages(graph, outcome, budget_bytes) - exact_stages
        if overflowing:
            exact_stages |= overflowing
        elif outcome.peak_bytes - budget_bytes <= _TOLERANCE_OVERFLOW * budget_bytes:
            # Doubling: a solver that keeps returning solutions at its tolerance above the
            # lowered budget needs a few rounds, not one per overflow.
            lowered = max(2 * lowered, lowered + outcome.peak_bytes - budget_bytes)
            logger.info("%s: the solution overflows by %d bytes, within the solver's tolerance; "
                        "the model's budget is lowered by %d bytes", problem.strategy,
                        outcome.peak_bytes - budget_bytes, lowered)
        else:
            raise SolverError("internal error: a schedule overflows the budget in stages the MILP accounts exactly")
        model = build_milp(graph, budget_bytes - lowered, exact_stages=exact_stages,
                           choose_implementations=problem.choose_implementations)
        tracker.num_vars, tracker.num_constraints = model.num_vars, model.num_constraints
    if incumbent is None and lowered:
        raise problem.infeasible(graph, budget_bytes, smallest_peak,
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
        status = (SolveStatus.TIME_LIMIT if time_limit is not None and not stalled and not model_infeasible
                  else SolveStatus.FEASIBLE)
    return incumbent.with_facts(SolverFacts(
        status=status, objective=cost, best_bound=min(bound, cost), seconds=time.perf_counter() - began,
        solve_seconds=solve_seconds, num_vars=model.num_vars, num_constraints=model.num_constraints,
        solver=result.solver, warm_start=baseline.strategy if baseline is not None else None, peak_bytes=peak,
        budget_bytes=budget_bytes, exact_stages=len(exact_stages),
    ), strategy=problem.strategy)


def _without_step_rules(graph, budget_bytes, problem, *, solver, deadline, threads, seed, relax=False,
                        start: Schedule | None = None, mip_gap=None, stall_time=None) -> tuple[bool, Schedule | None]:
    """After the model was proven infeasible at ``budget_bytes``: whether no schedule at all
    fits, and a schedule that does, by the model without its step rules
    (``build_milp(..., step_rules=False)``, a relaxation of every schedule).

    Only that relaxation's infeasibility proves that no schedule fits: the step rules cut
    off schedules that recompute a layer after its backward pass, which a budget may need
    (issue 33: on a masked text transformer ``eviction`` fitted budgets the model was
    "proven" infeasible at, so the figure the refusal named was refused again). Its
    solution counts no more memory than the simulator, so it is returned only when it
    simulates within the budget, and is searched from ``start`` (a schedule that fits),
    with ``mip_gap`` and ``stall_time`` as the model's own search. ``relax``: solve its LP
    only (a large model's); no schedule comes back then.

    Returns:
        ``(proven, schedule)``: proven True when no schedule fits (always, on a graph
        without step rules); the relaxation's schedule when it fits, else None.
    """
    choose = problem.choose_implementations
    if not has_step_rules(graph, choose):
        return True, None
    # Exact in every stage unless only its LP is solved: its solutions then overflow only
    # where they break the rules, and its proofs are as tight as it allows.
    model = build_milp(graph, budget_bytes, exact_stages=() if relax else None, choose_implementations=choose,
                       step_rules=False)
    encoded = None if start is None or relax else model.encode(start)
    result = solve_model(model, solver=solver, relax=relax, time_limit=seconds_left(deadline, _FINISH_SECONDS),
                         mip_gap=None if relax else mip_gap, threads=threads, seed=seed, start=encoded,
                         presolve=model.num_vars <= _PRESOLVE_MAX_COLUMNS, quiet=True,
                         lp_method=lp_method(model, solver) if relax else "simplex",
                         stall_time=None if encoded is None else stall_time)
    if result.status == SolveStatus.INFEASIBLE:
        return True, None
    if relax or result.x is None:
        return False, None
    schedule = model.schedule(result.x, problem.strategy)
    return False, schedule if simulate(graph, schedule).peak_bytes <= budget_bytes else None


def _infeasible_beyond_step_rules(problem, graph, budget_bytes, smallest_peak, solver, proven):
    """The infeasible-budget error after the model with step rules was proven infeasible
    and nothing fits: proven (``budget_bytes + 1`` as the lower bound, a fact about this
    budget) only when the model without them is infeasible too (:func:`_without_step_rules`)."""
    if proven:
        return problem.infeasible(graph, budget_bytes, smallest_peak, f"{solver} proved no schedule fits",
                                  lower_bound_bytes=budget_bytes + 1)
    return problem.infeasible(
        graph, budget_bytes, smallest_peak,
        f"{solver} proved that no schedule within the MILP's step rules fits (a layer is not recomputed after its "
        "backward pass), and no heuristic fits", proven=False)


def _baseline_result(graph, baseline, status, began, budget_bytes, problem, bound=None, mip_gap=None, model=None,
                     solver=None) -> Schedule:
    """A baseline returned without the MILP, bounded by ``bound`` (default: the no-remat
    cost); optimal when within ``mip_gap`` of it. ``model``: the relaxation whose LP gave
    ``bound``, for its size in the facts."""
    cost = baseline.cost(graph)
    bound = problem.cost_floor(graph) if bound is None else bound
    if mip_gap is not None and relative_gap(cost, bound) <= mip_gap:
        status = SolveStatus.OPTIMAL
    return baseline.with_facts(SolverFacts(
        status=status, objective=cost, best_bound=min(bound, cost),
        seconds=time.perf_counter() - began, solve_seconds=0.0, num_vars=model.num_vars if model else 0,
        num_constraints=model.num_constraints if model else 0, solver=solver, warm_start=baseline.strategy,
        peak_bytes=known_peak(graph, baseline), budget_bytes=budget_bytes, exact_stages=0,
    ), strategy=problem.strategy)


def _units_repeat(graph: DFGraph) -> bool:
    """Whether ``graph`` splits into a chain of units at most half of them distinct (repeated
    blocks), where the unit decomposition pays. Without repeats it solves one MILP per unit:
    EfficientNetV2B0 64x64 at 50% of activations (40 distinct units) took 18 s for a +119%
    plan where eviction's was +6% (docs/solver.md, "The stall rule")."""
    units = chain_units(graph)
    if units is None:
        return False
    last = len(units) - 1
    distinct = {unit_graph(graph, unit, index == last, 0).graph.fingerprint for index, unit in enumerate(units)}
    return 2 * len(distinct) <= len(units)


def _solve_large(graph, model, baseline, smallest_peak, problem, *, began, solver, time_limit, mip_gap, threads, seed,
                 progress, incumbent, stall_time=None):
    """``optimal`` (or ``problem``'s strategy) on models too large for the whole MILP within ``time_limit``.

    The time goes to the LP relaxation: HiGHS's dual simplex without presolve, whose row
    duals are the model's own, so they give a proven bound whenever it stops (Gurobi's LP
    otherwise), and the LP's rounding may improve the warm start. The reported bound is
    the larger of that bound and the no-remat cost, so the gap is honest, if loose where
    the LP did not converge. (The dual simplex gave tighter bounds than PDLP in the same
    time; docs/solver.md.) With ``stall_time`` (the CPU seconds the stall rule has left
    since the last cheaper schedule) and a schedule that fits, the LP stops after them, or
    does not run when none are left (status ``feasible``): its rounding is the only search left.
    """
    budget_bytes = int(model.budget_bytes)
    deadline = began + time_limit
    floor = problem.cost_floor(graph)
    report_incumbent(progress, began, baseline.cost(graph) if baseline is not None else None, floor)
    if baseline is not None and stall_time is not None and stall_time <= 0:
        logger.info("%s: the stall rule's time passed in the heuristics; the LP is skipped and the best "
                    "heuristic returned, bounded by the no-remat cost", problem.strategy)
        return _baseline_result(graph, baseline, SolveStatus.FEASIBLE, began, budget_bytes, problem,
                                bound=floor, mip_gap=mip_gap, model=model, solver=solver)
    lp = solve_model(
        model, solver=solver, relax=True, time_limit=seconds_left(deadline, ROUNDING_RESERVE_SECONDS),
        threads=threads, seed=seed, lp_method=lp_method(model, solver),
        stall_time=stall_time if baseline is not None else None,
    )
    if lp.status == SolveStatus.INFEASIBLE:
        # A proof about the model, whose step rules may cut off every schedule that fits.
        if baseline is None:
            none_fits, _ = _without_step_rules(graph, budget_bytes, problem, solver=solver, deadline=deadline,
                                               threads=threads, seed=seed, relax=True)
            raise _infeasible_beyond_step_rules(problem, graph, budget_bytes, smallest_peak, lp.solver, none_fits)
        return _baseline_result(graph, baseline, SolveStatus.FEASIBLE, began, budget_bytes, problem, bound=floor,
                                mip_gap=mip_gap, model=model, solver=lp.solver)
    bound = max(floor, lp.best_bound or 0.0)
    tracker, incumbent = incumbent, baseline
    tracker.raise_bound(bound)
    if lp.x is not None:
        incumbent = cheaper_rounding(model, lp.x, incumbent, seed=seed, strategy=problem.strategy, deadline=deadline)
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
        status=(SolveStatus.OPTIMAL if relative_gap(cost, bound) <= mip_gap
                else SolveStatus.FEASIBLE if lp.stalled else SolveStatus.TIME_LIMIT),
        objective=cost, best_bound=min(bound, cost), seconds=time.perf_counter() - began, solve_seconds=lp.seconds,
        num_vars=model.num_vars, num_constraints=model.num_constraints, solver=lp.solver,
        warm_start=incumbent.strategy, peak_bytes=simulate(graph, incumbent).peak_bytes, budget_bytes=budget_bytes,
        exact_stages=0,
    ), strategy=problem.strategy)
