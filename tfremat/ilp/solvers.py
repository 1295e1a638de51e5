"""MILP/LP solver backends, selected by name: HiGHS (default, open source) and Gurobi.

HiGHS (through ``highspy``) needs no license and is installed with tfremat; it solved
Checkmate's MILP fastest among the open-source solvers measured for this project.
Gurobi (through ``gurobipy``) is used only when asked for: a missing ``gurobipy`` or a
license that does not cover the model raises an error that names the fix and the
default solver. There is no silent fallback from one backend to another.

Each backend reports status, objective, best bound and gap from the solver itself.
``highspy`` is imported lazily, and ``ortools`` never: the two ship clashing native
HiGHS libraries.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from tfremat.errors import (
    ArgumentError,
    SolverError,
    SolverLicenseError,
    SolverUnavailableError,
    is_int,
    is_number,
)
from tfremat.ilp.formulation import CheckmateModel, SparseMILP
from tfremat.ilp.interrupts import SolveInterrupted
from tfremat.plan.schedule import SolveStatus

__all__ = ["SOLVERS", "DEFAULT_SOLVER", "SolveResult", "Progress", "solve_model", "check_solver_options"]

logger = logging.getLogger(__name__)

SOLVERS = ("highs", "gurobi")
DEFAULT_SOLVER = "highs"

_LP_METHODS = ("simplex", "dual_simplex", "pdlp")
# The LP methods whose stopped runs still give a proven bound (from their row duals).
_STOPPABLE_LP_METHODS = ("dual_simplex", "pdlp")
# HiGHS's simplex_strategy value for the serial dual simplex.
_HIGHS_DUAL_SIMPLEX = 1
_GUROBI_SIZE_LIMIT_ERRNO = 10010
_GUROBI_NO_LICENSE_ERRNOS = (10009, 10010)
# Seconds between Gurobi's periodic progress reports (HiGHS logs every 5 s by default).
_GUROBI_REPORT_SECONDS = 5.0
# Seconds HiGHS gets to stop after Ctrl-C (it checks between simplex iterations and MIP
# nodes, far more often) before the solve is left behind in its thread.
_INTERRUPT_GRACE_SECONDS = 2.0
# Seconds past its stall rule (CPU seconds) or time limit (wall seconds) that a MILP is
# waited for before it is left to stop in its thread with the best solution it reported.
# HiGHS 1.15 calls the interrupt callback and checks its time limit every ~0.1 s of the
# search, but not while its root waits for the analytic centre (an interior-point solve of
# the whole model, started at the root with neither callbacks nor a time limit): 4.5 CPU s
# on the saved first-step transformer's model (benchmarks/results/planning_time.md).
_OVERRUN_GRACE_SECONDS = 1.0
# The thread count HiGHS's process-wide scheduler was last started with ("unset" before
# the first run).
_highs_scheduler_threads: int | None | str = "unset"
# A HiGHS solve that Ctrl-C left running in its thread (see _run_highs).
_abandoned_solve: threading.Thread | None = None


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress report while a MILP runs.

    Attributes:
        seconds: wall time since the solve started (or since ``solve_model``'s ``started``).
        incumbent: objective of the best schedule found so far (None before the first).
        bound: best proven lower bound on the objective.
        gap: relative gap ``(incumbent - bound) / incumbent`` (None without incumbent).
        note: what a search that is no solve is doing, in words (the search for the budget
            ``"min"``, :func:`tfremat.strategies.least_budget_within`); None for a solve.
    """

    seconds: float
    incumbent: float | None
    bound: float | None
    gap: float | None
    note: str | None = None


ProgressFn = Callable[[Progress], None]


@dataclasses.dataclass(frozen=True)
class SolveResult:
    """What a backend returns.

    Attributes:
        x: the best solution vector, or None when there is none.
        status: ``optimal`` (proven within the requested gap), ``time_limit`` (stopped by
            the time limit with a solution), ``feasible`` (stopped otherwise with a
            solution), ``infeasible`` (proven), or ``no_solution`` (stopped without one).
        objective: objective of ``x``.
        best_bound: the solver's proven lower bound on the objective.
        gap: relative gap between ``objective`` and ``best_bound``.
        seconds: solve wall time.
        solver: backend name.
        stalled: the MILP was stopped by its ``stall_time`` (status ``feasible``, or
            ``no_solution`` without one).
        cpu_seconds: the process's CPU seconds during the solve (the stall rule's clock;
            set by :func:`solve_model`, None from a backend alone).
    """

    x: np.ndarray | None
    status: SolveStatus
    objective: float | None
    best_bound: float | None
    gap: float | None
    seconds: float
    solver: str
    stalled: bool = False
    cpu_seconds: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "status", SolveStatus(self.status))


def _relative_gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None or not math.isfinite(bound):
        return None
    return max(0.0, (objective - bound) / max(abs(objective), 1e-12))


def solve_model(
    model: SparseMILP,
    *,
    solver: str = DEFAULT_SOLVER,
    relax: bool = False,
    time_limit: float | None = None,
    mip_gap: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    start: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    lp_method: str = "simplex",
    presolve: bool = True,
    started: float | None = None,
    quiet: bool = False,
    stall_time: float | None = None,
) -> SolveResult:
    """Solves ``model`` (or its LP relaxation) with the named backend.

    Args:
        model: the built MILP (Checkmate's, or another in the same sparse form).
        solver: ``"highs"`` (default) or ``"gurobi"``.
        relax: solve the LP relaxation (every binary in [0, 1]) instead of the MILP.
        time_limit: wall-clock seconds, or None for no limit.
        mip_gap: relative gap at which the MILP stops as optimal (solver default if None).
        threads: solver threads (solver default if None).
        seed: the solver's random seed, for reproducible runs.
        start: a feasible solution vector to start from (a MIP start).
        progress: called with a :class:`Progress` on every new incumbent and periodically.
        lp_method: with ``relax``, ``"simplex"`` (the solver's default LP method; the
            bound is the LP optimum, none when stopped early), ``"dual_simplex"`` (HiGHS's
            dual simplex without presolve: its row duals belong to the model's own rows,
            so stopped at any time they give a proven bound through
            :meth:`~tfremat.ilp.formulation.CheckmateModel.dual_bound`; its ``x`` is the
            current basic point, feasible only at the optimum) or ``"pdlp"`` (HiGHS's
            first-order method, without presolve, bounded the same way; its ``x`` is an
            approximate LP solution). The dual simplex gave tighter bounds than PDLP in
            the same time on the large random graphs (docs/solver.md).
        presolve: let the solver presolve the model. Off, the MILP of a large relaxation
            reaches its root bound sooner: HiGHS's presolve of ResNet50's relaxed model
            takes about 10 s, removes few columns, and ignores the time limit.
        started: the ``time.perf_counter()`` time that progress reports count seconds
            from (a strategy passes its own start, so its heuristics' reports and the
            solver's share one clock); None: the solve's start.
        quiet: no progress reports at all, neither to ``progress`` nor to the log: for
            sub-solves whose objective is not the caller's schedule cost (a RINS
            neighbourhood, the ``intervals`` heuristic's own model), which would
            otherwise interleave their figures and clocks with the main solve's.
        stall_time: for a MILP, stop once this many seconds of CPU time pass without a better
            solution (counted from the solve's start when ``start`` is given, else from the
            first solution, and from each improving one), with status ``feasible`` and
            ``stalled`` set; None or ``math.inf``: never. A search that found nothing better for a while
            rarely does later (docs/solver.md). A MILP that HiGHS has not stopped a second
            (``_OVERRUN_GRACE_SECONDS``) after the rule, or after ``time_limit``, is returned
            with the best solution it reported (else ``start``) and left to stop in its thread:
            HiGHS's root waits for its analytic centre without calling back. For the relaxation with a stoppable
            ``lp_method``, which finds no solutions, stop after this many CPU seconds (checked
            between simplex iterations), its bound from the duals so far; other LPs ignore it.

    Raises:
        SolverUnavailableError: the backend is not installed.
        SolverLicenseError: the backend's license does not cover the model.
        ArgumentError: an unknown backend name, an option out of range, or an
            ``lp_method`` this model or backend does not take.
        SolverError: the backend failed.
        SolveInterrupted: Ctrl-C (SIGINT) stopped the solve, within a second or two: HiGHS
            runs in its own thread while the calling (main) thread waits, so the signal
            is seen at once and the solve cancelled; the exception carries the solver's
            best solution (``x``, None without one) and the ``model``.
    """
    if lp_method not in _LP_METHODS:
        raise ArgumentError(f"lp_method must be one of {', '.join(_LP_METHODS)}, got {lp_method!r}")
    if lp_method in _STOPPABLE_LP_METHODS and not isinstance(model, CheckmateModel):
        raise ArgumentError(f"lp_method={lp_method!r} bounds only Checkmate's model (CheckmateModel.dual_bound)")
    if lp_method in _STOPPABLE_LP_METHODS and solver != "highs":
        raise ArgumentError(f"lp_method={lp_method!r} needs solver='highs' (got {solver!r}); use lp_method='simplex'")
    check_solver_options(solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed,
                         stall_time=stall_time)
    stall_time = None if stall_time == math.inf else stall_time
    backend = _solve_highs if solver == "highs" else _solve_gurobi
    unit = model.cost_scale

    def in_cost_unit(report: Progress) -> None:
        if quiet:
            return
        scaled = Progress(
            report.seconds if started is None else time.perf_counter() - started,
            None if report.incumbent is None else report.incumbent * unit,
            None if report.bound is None else report.bound * unit,
            report.gap,
        )
        report_progress(progress, scaled)

    cpu_began = time.process_time()
    if lp_method in _STOPPABLE_LP_METHODS and relax:
        result = _solve_highs(model, relax, time_limit, mip_gap, threads, seed, start, in_cost_unit, presolve,
                              stall_time, lp_method)
    else:
        result = backend(model, relax, time_limit, mip_gap, threads, seed, start, in_cost_unit, presolve,
                         None if relax else stall_time)
    return dataclasses.replace(
        result,
        objective=None if result.objective is None else result.objective * unit,
        best_bound=None if result.best_bound is None else result.best_bound * unit,
        cpu_seconds=time.process_time() - cpu_began,
    )


def check_solver_options(
    solver: str, *, time_limit: float | None = None, mip_gap: float | None = None, threads: int | None = None,
    seed: int | None = None, stall_time: float | None = None,
) -> float | None:
    """Raises for a solver option no backend accepts, or a backend that is not installed.

    Strategies call it before their heuristics run, so a typo or a missing ``gurobipy``
    is reported at once rather than after minutes of baselines, and not at all when a
    baseline happens to be optimal.

    Returns:
        ``time_limit`` as the strategies use it: ``math.inf`` (the high-level API's "no
        limit", see :func:`tfremat.planner.strategy_options`) becomes None.

    Raises:
        ArgumentError: an unknown solver name or an option out of range (the message
            names the argument and what it accepts).
        SolverError: ``ortools`` is imported in this process and HiGHS is asked for.
        SolverUnavailableError: the backend's Python package is not installed.
    """
    if solver not in SOLVERS:
        raise ArgumentError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)} (default {DEFAULT_SOLVER!r})")
    if time_limit is not None and not (is_number(time_limit) and time_limit > 0):
        raise ArgumentError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
    if stall_time is not None and not (is_number(stall_time) and stall_time > 0):
        raise ArgumentError(f"stall_time must be a positive number of seconds or None (never stop early), "
                            f"got {stall_time!r}")
    if mip_gap is not None and not (is_number(mip_gap) and 0 <= mip_gap < 1):
        raise ArgumentError(f"mip_gap must be a number in [0, 1) or None, got {mip_gap!r}")
    if threads is not None and not (is_int(threads) and threads >= 1):
        raise ArgumentError(f"threads must be a positive int or None, got {threads!r}")
    if seed is not None and not (is_int(seed) and seed >= 0):
        raise ArgumentError(f"seed must be a non-negative int, got {seed!r}")
    _backend_module(solver)
    return None if time_limit == math.inf else time_limit


def _backend_module(solver: str):
    """The backend's Python module, imported (highspy lazily: see the module docstring)."""
    if solver == "highs":
        if "ortools" in sys.modules:
            raise SolverError(
                "ortools is imported in this process, and its native HiGHS library clashes with highspy's; "
                "run the solver in a process that does not import ortools"
            )
        try:
            import highspy
        except ImportError as exc:
            raise SolverUnavailableError(
                "solver='highs' needs highspy, which tfremat installs: `pip install 'highspy>=1.15,<1.16'`"
            ) from exc
        return highspy
    try:
        import gurobipy
    except ImportError as exc:
        raise SolverUnavailableError(
            "solver='gurobi' needs gurobipy: `pip install gurobipy` (plus a Gurobi license for "
            "models above 2000 variables or constraints), or use the default solver='highs', "
            "which needs no license"
        ) from exc
    return gurobipy


_highs_banner_shown = False


def _new_highs(highspy):
    """A ``highspy.Highs`` object, its banner sent to standard error.

    HiGHS 1.16 writes a banner to the process's standard output (file descriptor 1, from
    C) when the first ``Highs`` object of a process is created, before any option can
    silence it; on standard output it corrupted ``tfremat solve --json`` and any program
    whose output is data. The first construction runs with descriptor 1 pointed at
    standard error; later ones print nothing. (setup.py asks for 1.15, whose schedules the
    README's tables report, but a later ``pip install -U highspy`` brings 1.16 back.)
    """
    global _highs_banner_shown
    if _highs_banner_shown:
        return highspy.Highs()
    _highs_banner_shown = True
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output: nowhere for the banner to go wrong
        return highspy.Highs()
    try:
        os.dup2(2, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def report_progress(progress: ProgressFn | None, report: Progress) -> None:
    """Logs ``report`` at INFO and passes it to ``progress`` (when not None)."""
    logger.info(
        "%.1fs: incumbent %s, bound %s, gap %s",
        report.seconds,
        "-" if report.incumbent is None else f"{report.incumbent:.6g}",
        "-" if report.bound is None else f"{report.bound:.6g}",
        "-" if report.gap is None else f"{100 * report.gap:.2f}%",
    )
    if progress is not None:
        progress(report)


def report_incumbent(progress: ProgressFn | None, began: float, incumbent: float | None, bound: float) -> None:
    """Reports a strategy's own incumbent and bound (``began``: its ``time.perf_counter()``
    start) in the backends' form, the gap computed here as for a solver's reports."""
    gap = None if not incumbent else max(0.0, (incumbent - bound) / incumbent)
    report_progress(progress, Progress(time.perf_counter() - began, incumbent, bound, gap))


class _StallClock:
    """When a MILP last found a better solution, for ``solve_model``'s ``stall_time`` rule:
    :meth:`stalled` is true (and :attr:`stopped` set) once ``stall_time`` seconds of the
    process's CPU time pass without one, counted from the solve's start when it has a MIP
    start (``started``), else from its first solution: a search that has none yet is not
    stopped. CPU time, not wall time, so that on a machine shared with other work the rule
    still gives the search the same effort."""

    def __init__(self, stall_time: float | None, started: bool):
        self.stall_time = stall_time
        self.since = time.process_time() if started else None
        self.best = math.inf
        self.stopped = False

    def improved(self, objective: float) -> None:
        """A solution of ``objective`` was found; a better one restarts the clock."""
        if objective < self.best:
            self.best = objective
            self.since = time.process_time()

    def stalled(self) -> bool:
        if (self.stall_time is not None and self.since is not None
                and time.process_time() - self.since >= self.stall_time):
            self.stopped = True
        return self.stopped

    def overrun(self) -> float:
        """CPU seconds since the rule's time ran out (0 while it has not, or never can)."""
        if self.stall_time is None or self.since is None:
            return 0.0
        return max(time.process_time() - self.since - self.stall_time, 0.0)


def _highs_lp(highspy, model, relax: bool):
    """``model`` as a HiGHS LP (column-wise matrix, infinite bounds as HiGHS's infinity),
    with integrality unless ``relax``."""
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_vars
    lp.num_row_ = model.num_constraints
    lp.col_cost_ = model.cost
    lp.col_lower_ = model.lower
    lp.col_upper_ = np.where(np.isinf(model.upper), inf, model.upper)
    lp.row_lower_ = np.where(np.isinf(model.row_lower), -inf, model.row_lower)
    lp.row_upper_ = np.where(np.isinf(model.row_upper), inf, model.row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_ = model.num_vars
    lp.a_matrix_.num_row_ = model.num_constraints
    lp.a_matrix_.start_ = model.col_start
    lp.a_matrix_.index_ = model.row_index
    lp.a_matrix_.value_ = model.value
    if not relax:
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[int(flag)] for flag in model.integer]
    return lp


def _solve_highs(model, relax, time_limit, mip_gap, threads, seed, start, progress, presolve, stall_time=None,
                 lp_method="simplex") -> SolveResult:
    highspy = _backend_module("highs")
    h = _new_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", int(seed))
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if mip_gap is not None:
        h.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    if not presolve:
        h.setOptionValue("presolve", "off")
    stoppable = lp_method in _STOPPABLE_LP_METHODS
    if stoppable:
        # Without presolve the row duals belong to the model's own rows, which the
        # proven bound needs.
        h.setOptionValue("presolve", "off")
        if lp_method == "pdlp":
            h.setOptionValue("solver", "pdlp")
        else:
            h.setOptionValue("solver", "simplex")
            h.setOptionValue("simplex_strategy", _HIGHS_DUAL_SIMPLEX)

    inf = highspy.kHighsInf
    if h.passModel(_highs_lp(highspy, model, relax)) == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model")

    began = time.perf_counter()
    found: list[np.ndarray] = []
    # The MILP's last reported bound, for a solve left behind (_run_highs's give_up).
    last_bound: list[float] = []
    # A stoppable LP has no solutions to restart the clock: it runs from the start.
    stall = _StallClock(stall_time, started=start is not None or relax)
    if relax and stall_time is not None:
        def stop_lp_when_stalled(event) -> None:
            if stall.stalled():
                event.interrupt()

        h.cbSimplexInterrupt.subscribe(stop_lp_when_stalled)
        h.cbIpmInterrupt.subscribe(stop_lp_when_stalled)
    if not relax:
        def on_event(event) -> None:
            data = event.data_out
            incumbent = data.mip_primal_bound if abs(data.mip_primal_bound) < inf else None
            bound = data.mip_dual_bound if abs(data.mip_dual_bound) < inf else None
            if bound is not None:
                last_bound[:] = [bound]
            progress(Progress(data.running_time, incumbent, bound, _relative_gap(incumbent, bound)))

        def on_solution(event) -> None:
            # Kept for Ctrl-C during the root LP, when HiGHS cannot be stopped (_run_highs).
            solution = np.array(event.data_out.mip_solution, dtype=float)
            if len(solution) == model.num_vars:
                found[:] = [solution]
            stall.improved(event.data_out.mip_primal_bound)
            on_event(event)

        def stop_when_stalled(event) -> None:
            bound = event.data_out.mip_dual_bound
            if abs(bound) < inf:
                last_bound[:] = [bound]
            if stall.stalled():
                event.interrupt()

        h.cbMipImprovingSolution.subscribe(on_solution)
        h.cbMipLogging.subscribe(on_event)
        if stall_time is not None:
            h.cbMipInterrupt.subscribe(stop_when_stalled)
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(map(float, start))
            solution.value_valid = True
            h.setSolution(solution)
    global _highs_scheduler_threads
    _wait_for_abandoned_solve()
    if threads != _highs_scheduler_threads:
        # HiGHS sizes a process-wide task scheduler on its first run and refuses (without a
        # solution) a later run asking for another thread count unless it is reset.
        highspy.Highs.resetGlobalScheduler(True)
        _highs_scheduler_threads = threads
    def give_up() -> bool:
        # Only a MILP is left behind: an LP has no solution to return.
        if relax:
            return False
        if stall.stalled() and stall.overrun() >= _OVERRUN_GRACE_SECONDS:
            return True
        return time_limit is not None and time.perf_counter() - began >= time_limit + _OVERRUN_GRACE_SECONDS

    run_status, interrupted = _run_highs(h, found, give_up)
    # A solve left behind (by Ctrl-C or give_up): the best solution it reported, or the start.
    best_reported = found[-1] if found else None if start is None or relax else np.asarray(start, dtype=float)
    if run_status is None and not interrupted:
        x = best_reported
        objective = None if x is None else float(np.dot(model.cost, x))
        bound = last_bound[0] if last_bound else None
        name = (SolveStatus.NO_SOLUTION if x is None else SolveStatus.FEASIBLE if stall.stopped
                else SolveStatus.TIME_LIMIT)
        logger.info("HiGHS did not stop within %ss of its %s; its solve is left to stop in its thread",
                    _OVERRUN_GRACE_SECONDS, "stall rule" if stall.stopped else "time limit")
        return SolveResult(x, name, objective, bound, _relative_gap(objective, bound),
                           time.perf_counter() - began, "highs", stalled=stall.stopped)
    if interrupted and run_status is None:
        raise SolveInterrupted(f"HiGHS was interrupted (Ctrl-C) after {time.perf_counter() - began:.1f}s",
                               x=best_reported, model=model, solver="highs")
    if run_status == highspy.HighsStatus.kError:
        raise SolverError(f"HiGHS could not run the model: {h.modelStatusToString(h.getModelStatus())}")
    seconds = time.perf_counter() - began

    status = h.getModelStatus()
    info = h.getInfo()
    # A stopped run's point is feasible only within tolerances (PDLP) or not at all (the
    # dual simplex before its optimum), yet worth rounding.
    has_solution = info.primal_solution_status == 2 or (stoppable and h.getSolution().value_valid)
    x = np.asarray(h.getSolution().col_value, dtype=float) if has_solution else None
    objective = info.objective_function_value if has_solution else None
    if stoppable:
        solution = h.getSolution()
        bound = model.dual_bound(np.asarray(solution.row_dual)) / model.cost_scale if solution.dual_valid else None
    elif relax:
        bound = objective if status == highspy.HighsModelStatus.kOptimal else None
    else:
        bound = info.mip_dual_bound if abs(info.mip_dual_bound) < inf else None
    if status == highspy.HighsModelStatus.kOptimal:
        name = SolveStatus.OPTIMAL
    elif status == highspy.HighsModelStatus.kInfeasible:
        name = SolveStatus.INFEASIBLE
    elif not has_solution:
        name = SolveStatus.NO_SOLUTION
    elif status == highspy.HighsModelStatus.kTimeLimit:
        name = SolveStatus.TIME_LIMIT
    else:
        name = SolveStatus.FEASIBLE
    if status == highspy.HighsModelStatus.kInterrupt and stall.stopped and not interrupted:
        name = SolveStatus.FEASIBLE if has_solution else SolveStatus.NO_SOLUTION
    elif interrupted or status == highspy.HighsModelStatus.kInterrupt:
        # A stopped dual simplex's point is not feasible; a MIP's incumbent is.
        raise SolveInterrupted(f"HiGHS was interrupted (Ctrl-C) after {seconds:.1f}s",
                               x=x if info.primal_solution_status == 2 else None, model=model, solver="highs")
    if status in (highspy.HighsModelStatus.kModelError, highspy.HighsModelStatus.kSolveError):
        raise SolverError(f"HiGHS failed: {h.modelStatusToString(status)}")
    return SolveResult(x, name, objective, bound, _relative_gap(objective, bound), seconds, "highs",
                       stalled=stall.stopped)


def _run_highs(h, found: list, give_up: Callable[[], bool] | None = None):
    """``h.run()``, stoppable by Ctrl-C within a second or two: ``(run status, interrupted)``.

    In the main thread (where Python runs signal handlers) HiGHS runs in a thread of its
    own while this one waits in short steps, so a KeyboardInterrupt arrives at once, not
    when HiGHS next calls back into Python. The solve is then cancelled through HiGHS's
    interrupt callbacks, and waited for up to ``_INTERRUPT_GRACE_SECONDS`` (a second
    Ctrl-C: not at all). HiGHS 1.15 checks them between simplex iterations of an LP and
    between the steps of a MIP, but not inside a MIP's root LP, which can take minutes:
    then the status is None and the solve is left to stop in its thread at its next
    check (the next solve waits for it: ``_wait_for_abandoned_solve``), and ``found``
    holds the solutions HiGHS reported. ``give_up`` (checked every 0.1 s) leaves the solve
    the same way without Ctrl-C: status None, not interrupted; it is cancelled through the
    callbacks too. Elsewhere ``h.run()`` runs in place (no signal reaches that thread, and
    ``give_up`` is not read).
    """
    global _abandoned_solve
    if threading.current_thread() is not threading.main_thread():
        return h.run(), False
    stop = threading.Event()

    def check_interrupt(event) -> None:
        if stop.is_set():
            event.interrupt()

    for callback in (h.cbSimplexInterrupt, h.cbIpmInterrupt, h.cbMipInterrupt):
        callback.subscribe(check_interrupt)
    outcome: dict = {}

    def solve() -> None:
        try:
            outcome["status"] = h.run()
            # HiGHS's scheduler threads belong to the thread that ran first; left alive past
            # it they abort the process at exit ("terminate called without an active
            # exception"). highspy's own threaded solve resets it the same way.
            type(h).resetGlobalScheduler(False)
        except BaseException as exc:  # re-raised in the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=solve, name="tfremat-highs", daemon=True)
    thread.start()
    interrupted = False
    try:
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and give_up is not None and give_up():
                stop.set()
                _abandoned_solve = thread
                return None, False
    except KeyboardInterrupt:
        interrupted = True
        stop.set()
        stop_by = time.perf_counter() + _INTERRUPT_GRACE_SECONDS
        try:
            while thread.is_alive() and time.perf_counter() < stop_by:
                thread.join(0.05)
        except KeyboardInterrupt:
            pass
    if thread.is_alive():
        logger.warning("HiGHS did not stop within %ss of Ctrl-C (it does not check for interrupts inside a MIP's "
                       "root LP); it stops in the background at its next check", _INTERRUPT_GRACE_SECONDS)
        _abandoned_solve = thread
        return None, True
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("status"), interrupted


def _wait_for_abandoned_solve() -> None:
    """Waits for a solve that Ctrl-C or ``give_up`` left running (HiGHS's scheduler is
    process-wide, and HiGHS threads alive at exit abort the process)."""
    global _abandoned_solve
    if _abandoned_solve is not None and _abandoned_solve.is_alive():
        logger.info("waiting for the HiGHS solve left running earlier to stop")
        _abandoned_solve.join()
    _abandoned_solve = None


atexit.register(_wait_for_abandoned_solve)


def _solve_gurobi(model, relax, time_limit, mip_gap, threads, seed, start, progress, presolve,
                  stall_time=None) -> SolveResult:
    gp = _backend_module("gurobi")
    GRB = gp.GRB

    size = f"{model.num_vars} variables and {model.num_constraints} constraints"
    try:
        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        m = gp.Model(env=env)
        m.Params.Seed = int(seed)
        if not presolve:
            m.Params.Presolve = 0
        if time_limit is not None:
            m.Params.TimeLimit = float(time_limit)
        if mip_gap is not None:
            m.Params.MIPGap = float(mip_gap)
        if threads is not None:
            m.Params.Threads = int(threads)
        vtype = [GRB.CONTINUOUS if relax or not flag else GRB.BINARY for flag in model.integer]
        upper = [GRB.INFINITY if math.isinf(u) else u for u in model.upper]
        variables = m.addVars(model.num_vars, lb=model.lower.tolist(), ub=upper, obj=model.cost.tolist(), vtype=vtype)
        rows: list[list[tuple[int, float]]] = [[] for _ in range(model.num_constraints)]
        for col in range(model.num_vars):
            for entry in range(model.col_start[col], model.col_start[col + 1]):
                rows[model.row_index[entry]].append((col, model.value[entry]))
        for r, terms in enumerate(rows):
            expr = gp.LinExpr([v for _, v in terms], [variables[c] for c, _ in terms])
            lo, hi = model.row_lower[r], model.row_upper[r]
            if lo == hi:
                m.addLConstr(expr, GRB.EQUAL, lo)
            elif math.isinf(lo):
                m.addLConstr(expr, GRB.LESS_EQUAL, hi)
            elif math.isinf(hi):
                m.addLConstr(expr, GRB.GREATER_EQUAL, lo)
            else:
                m.addRange(expr, lo, hi)
        if start is not None and not relax:
            for c, value in enumerate(start):
                variables[c].Start = float(value)
        began = time.perf_counter()
        last_report = -math.inf
        interrupted = False
        stall = _StallClock(stall_time, started=start is not None and not relax)

        def on_event(solver_model, where) -> None:
            # Ctrl-C while Gurobi runs reaches Python here (signals are handled between
            # bytecodes): terminate() stops the solve, keeping its best solution.
            nonlocal interrupted
            try:
                report(solver_model, where)
            except KeyboardInterrupt:
                interrupted = True
                solver_model.terminate()

        def report(solver_model, where) -> None:
            # Every new incumbent, and the bound at least every _GUROBI_REPORT_SECONDS (as
            # HiGHS's logging callback does), so a long search is not silent.
            nonlocal last_report
            if relax:
                return
            now = time.perf_counter()
            if where == GRB.Callback.MIP and stall.stalled():
                solver_model.terminate()
            if where == GRB.Callback.MIPSOL:
                incumbent = solver_model.cbGet(GRB.Callback.MIPSOL_OBJBST)
                bound = solver_model.cbGet(GRB.Callback.MIPSOL_OBJBND)
                stall.improved(solver_model.cbGet(GRB.Callback.MIPSOL_OBJ))
            elif where == GRB.Callback.MIP and now - last_report >= _GUROBI_REPORT_SECONDS:
                incumbent = solver_model.cbGet(GRB.Callback.MIP_OBJBST)
                bound = solver_model.cbGet(GRB.Callback.MIP_OBJBND)
            else:
                return
            last_report = now
            incumbent = incumbent if abs(incumbent) < GRB.INFINITY else None
            bound = bound if abs(bound) < GRB.INFINITY else None
            progress(Progress(now - began, incumbent, bound, _relative_gap(incumbent, bound)))

        try:
            m.optimize(on_event)
        except KeyboardInterrupt:
            interrupted = True
        seconds = time.perf_counter() - began
    except gp.GurobiError as exc:
        if exc.errno == _GUROBI_SIZE_LIMIT_ERRNO:
            raise SolverLicenseError(
                f"Gurobi's license is size-limited (the free pip license allows at most 2000 variables "
                f"and 2000 constraints) and this model has {size}; install a full Gurobi license or use "
                f"the default solver='highs', which needs no license"
            ) from exc
        if exc.errno in _GUROBI_NO_LICENSE_ERRNOS:
            raise SolverLicenseError(f"no valid Gurobi license ({exc}); use the default solver='highs'") from exc
        raise SolverError(f"Gurobi failed: {exc}") from exc

    has_solution = m.SolCount > 0
    x = np.array([variables[c].X for c in range(model.num_vars)]) if has_solution else None
    if interrupted or (m.Status == GRB.INTERRUPTED and not stall.stopped):
        raise SolveInterrupted(f"Gurobi was interrupted (Ctrl-C) after {seconds:.1f}s",
                               x=None if relax else x, model=model, solver="gurobi")
    objective = m.ObjVal if has_solution else None
    if relax:
        bound = objective if m.Status == GRB.OPTIMAL else None
    else:
        bound = m.ObjBound if has_solution or m.Status == GRB.OPTIMAL else None
    if m.Status == GRB.OPTIMAL:
        name = SolveStatus.OPTIMAL
    elif m.Status in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
        name = SolveStatus.INFEASIBLE
    elif not has_solution:
        name = SolveStatus.NO_SOLUTION
    elif m.Status == GRB.TIME_LIMIT:
        name = SolveStatus.TIME_LIMIT
    else:
        name = SolveStatus.FEASIBLE
    return SolveResult(x, name, objective, bound, _relative_gap(objective, bound), seconds, "gurobi",
                       stalled=stall.stopped)
