"""Ctrl-C (SIGINT) during a MILP strategy: stop the solver at once and keep what was found.

:func:`~tfremat.ilp.solvers.solve_model` runs HiGHS in its own thread and waits for it in
the main one, where Python delivers signals, so Ctrl-C reaches the wait at once; the
solve is then cancelled through HiGHS's interrupt callbacks (checked between simplex
iterations and MIP nodes) and :class:`SolveInterrupted` raised with the solver's best
solution. Gurobi is stopped by ``Model.terminate()``. A strategy keeps the cheapest schedule
that fits as it goes (:class:`Incumbent`) and, stopped by Ctrl-C anywhere (its heuristics,
its model build, a solve), returns it with status ``interrupted``, or raises
:class:`SolveInterrupted` when it had none.
"""

from __future__ import annotations

import time

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.baselines import known_peak
from tfremat.plan.schedule import Schedule, SolverFacts, SolveStatus

__all__ = ["SolveInterrupted", "Incumbent"]


class SolveInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped a solve or a strategy.

    A ``KeyboardInterrupt``, so that code that does not know it still stops as on Ctrl-C.
    Raised by :func:`~tfremat.ilp.solvers.solve_model` with the solver's best solution,
    and by a strategy that had found no schedule when it was stopped.

    Attributes:
        message: what was stopped and what was found.
        x: the solver's best solution vector (None without one, and from a strategy).
        model: the model solved (None from a strategy).
        solver: the backend's name (None from a strategy).
    """

    def __init__(self, message: str, *, x: np.ndarray | None = None, model=None, solver: str | None = None):
        super().__init__(message)
        self.message = message
        self.x = x
        self.model = model
        self.solver = solver

    def __str__(self) -> str:
        return self.message


class Incumbent:
    """The cheapest schedule known to fit, kept by a strategy as it runs, for its result
    when Ctrl-C stops it."""

    def __init__(self, graph: DFGraph, budget_bytes: int):
        self.graph = graph
        self.budget_bytes = budget_bytes
        self.schedule: Schedule | None = None
        self.cost: float | None = None
        self.bound = graph.total_cost
        self.num_vars = 0
        self.num_constraints = 0
        self.solver: str | None = None

    def offer(self, schedule: Schedule | None, peak_bytes: int | None = None) -> None:
        """Keeps ``schedule`` when it fits and is the cheapest so far (``peak_bytes``: its
        simulated peak, when known)."""
        if schedule is None:
            return
        cost = schedule.cost(self.graph)
        if self.cost is not None and cost >= self.cost:
            return
        peak = known_peak(self.graph, schedule) if peak_bytes is None else peak_bytes
        if peak <= self.budget_bytes:
            self.schedule, self.cost = schedule, cost

    def raise_bound(self, bound: float | None) -> None:
        """A proven lower bound on the cost at the budget."""
        if bound is not None:
            self.bound = max(self.bound, bound)

    def offer_interrupted_solution(self, interrupt: KeyboardInterrupt, strategy: str) -> None:
        """The solution an interrupted solve of Checkmate's model (or a RINS neighbourhood of
        it) had, when it fits."""
        from tfremat.ilp.formulation import CheckmateModel

        x, model = getattr(interrupt, "x", None), getattr(interrupt, "model", None)
        if x is not None and isinstance(model, CheckmateModel) and model.graph is self.graph:
            self.offer(model.schedule(x, strategy))

    def result(self, strategy: str, began: float, interrupt: KeyboardInterrupt) -> Schedule:
        """The schedule kept, with status ``interrupted``; raises :class:`SolveInterrupted`
        when there is none."""
        self.offer_interrupted_solution(interrupt, strategy)
        if self.schedule is None:
            raise SolveInterrupted(
                f"{strategy} was interrupted (Ctrl-C) after {time.perf_counter() - began:.1f}s, before any "
                f"schedule fitting {self.budget_bytes} bytes was found"
            ) from None
        cost = self.cost
        return self.schedule.with_facts(SolverFacts(
            status=SolveStatus.INTERRUPTED, objective=cost, best_bound=min(self.bound, cost),
            seconds=time.perf_counter() - began, solve_seconds=None, num_vars=self.num_vars,
            num_constraints=self.num_constraints, solver=self.solver, warm_start=self.schedule.strategy,
            peak_bytes=known_peak(self.graph, self.schedule), budget_bytes=self.budget_bytes,
        ), strategy=strategy)
