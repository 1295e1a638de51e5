"""``intervals``: drop values between their reads and recompute them later, chosen by a small MILP.

Start from the checkpoint-all schedule (stage t computes node t; every value is kept
from its computation to its last reader). Between two consecutive stages a < b at which
value v is computed or read (an *interval* of at least one stage without a read), v may
be dropped after stage a and recomputed in a later stage c <= b, then kept until b. It
is then absent from stages a+1 .. c-1, which lowers each of those stages' memory by its
bytes, at the price of one more run of v. Its inputs must be resident in stage c: either
c is no later than the last stage that reads every input anyway (the candidate
``c = min(b, last read of any input)``), or c = b with the inputs that would be gone by
then kept until b (their bytes count against those stages). An input may also be
recomputed in the same stage c, but not be dropped across it.

The MILP chooses the drops of least total cost whose savings cover every stage's excess
over the budget in the checkpoint-all schedule. Its columns are one or two binaries per
interval, a "still absent" column per dropped stage and the kept-input columns; its rows
are one coverage row per stage plus the chain and conflict rows: about a tenth of
Checkmate's MILP (430k columns against 4.1M on the 1000-node random graph), solved to
optimality in well under a minute there.

The memory it counts is conservative (a drop lowers every moment of the stages it spans
by exactly the value's bytes; a recomputation happens while the value would have been
resident anyway), except for a recomputed node's workspace; the schedule is simulated
and, where a stage still exceeds the budget, that stage's requirement is raised by the
excess and the model solved again.

It serves the large random graphs at moderate budgets, where it beats ``repair``
(``benchmarks/solvers.py``, results in benchmarks/results/solvers_n1000.md and
solvers_random.md). Chains of recomputation (a value and its dropped inputs recomputed
together at a later reader) are outside the model, so it finds nothing at the tight
budgets of training graphs, where ``eviction`` and the Checkmate baselines work.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, is_number
from tfremat.graph import DFGraph
from tfremat.ilp.formulation import SparseBuilder, SparseMILP
from tfremat.ilp.solvers import DEFAULT_SOLVER, solve_model
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import (
    Schedule,
    SolveStatus,
    checkpoint_all_s,
    schedule_from_keep_matrix,
)
from tfremat.plan.simulator import simulate, stage_peaks

__all__ = ["intervals", "IntervalModel", "build_interval_model"]

# Rounds of "raise the requirement of the stages still over the budget and solve again".
_ROUNDS = 3
# Columns build_interval_model makes per second (about 500k measured, halved for a loaded
# machine), and the share of time_limit the build may predictably take: a chain of 2500
# layers has 6M columns, which neither build nor solve within a minute.
_COLUMNS_PER_SECOND = 250_000
_BUILD_SHARE = 0.25


@dataclasses.dataclass(frozen=True, eq=False)
class IntervalModel(SparseMILP):
    """The interval MILP (a :class:`~tfremat.ilp.formulation.SparseMILP`) plus the maps
    back to the keep matrix.

    Attributes:
        drops: ``(value, a, c, column)`` for every drop column: value dropped after
            stage a and recomputed in stage c.
        kept_inputs: ``(value, stage, column)`` for every column keeping a value into a
            stage after its last reader.
    """

    drops: tuple
    kept_inputs: tuple

    def keep_matrix(self, x: np.ndarray) -> np.ndarray:
        """The checkpoint-all keep matrix with the chosen drops and kept inputs applied."""
        S = checkpoint_all_s(self.graph)
        for value, a, c, column in self.drops:
            if x[column] > 0.5:
                S[a + 1 : c + 1, value] = False
        for value, stage, column in self.kept_inputs:
            if x[column] > 0.5:
                S[stage, value] = True
        return S


def build_interval_model(graph: DFGraph, excess_bytes: np.ndarray) -> IntervalModel:
    """The MILP of the module docstring: cover ``excess_bytes[t]`` (bytes to remove from
    stage t; negative where the stage has room) at least cost."""
    n = graph.size
    out, pred, succ = graph.output_bytes, graph.predecessors, graph.successors
    last_read = np.array([max(s) if s else -1 for s in succ])
    unit = float(max(max(out), 1))
    cost_scale = max(graph.cost) or 1.0
    b = SparseBuilder()
    drops = []
    absent: dict[tuple[int, int], int] = {}  # (value, stage) -> "still absent" column
    for v in range(n):
        if not succ[v] or out[v] == 0:
            continue
        inputs_last = min((last_read[p] for p in pred[v]), default=n)
        reads = [v, *sorted(set(succ[v]))]
        for a, end in zip(reads, reads[1:]):
            stages = sorted({c for c in (min(end, inputs_last), end) if c >= a + 2})
            if not stages:
                continue
            chosen = {c: b.column(graph.cost[v] / cost_scale, 0.0, 1.0, True) for c in stages}
            drops += [(v, a, c, col) for c, col in chosen.items()]
            # absent[t] = absent[t-1] - (recomputed in stage t); absent[a+1] = dropped.
            previous = None
            for t in range(a + 1, end):
                col = b.column(0.0, 0.0, 1.0, False)
                absent[(v, t)] = col
                if previous is None:
                    b.row([(col, 1.0), *((c, -1.0) for c in chosen.values())], 0.0, 0.0)
                else:
                    b.row([(col, 1.0), (previous, -1.0), *([(chosen[t], 1.0)] if t in chosen else [])], 0.0, 0.0)
                previous = col
    kept: dict[tuple[int, int], int] = {}
    for v, a, c, col in drops:
        for p in pred[v]:
            if last_read[p] < c:
                for t in range(last_read[p] + 1, c + 1):
                    if (p, t) not in kept:
                        kept[(p, t)] = b.column(0.0, 0.0, 1.0, False)
                b.row([(kept[(p, c)], 1.0), (col, -1.0)], 0.0, math.inf)
            elif (p, c) in absent:
                b.row([(col, 1.0), (absent[(p, c)], 1.0)], -math.inf, 1.0)
    for (p, t), col in kept.items():
        if (p, t + 1) in kept:
            b.row([(col, 1.0), (kept[(p, t + 1)], -1.0)], 0.0, math.inf)
    cover: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for (v, t), col in absent.items():
        cover[t].append((col, out[v] / unit))
    for (p, t), col in kept.items():
        cover[t].append((col, -out[p] / unit))
    for t in range(n):
        need = excess_bytes[t] / unit
        if need > 0 or any(coefficient < 0 for _, coefficient in cover[t]):
            b.row(cover[t], need, math.inf)
    start, rows, vals = b.csc()
    return IntervalModel(
        graph=graph, cost_scale=cost_scale, cost=np.asarray(b.cost), lower=np.asarray(b.lower),
        upper=np.asarray(b.upper), integer=np.asarray(b.integer, dtype=bool), col_start=start, row_index=rows,
        value=vals, row_lower=np.asarray(b.row_lower), row_upper=np.asarray(b.row_upper), drops=tuple(drops),
        kept_inputs=tuple((p, t, col) for (p, t), col in kept.items()),
    )


def absent_column_count(graph: DFGraph) -> int:
    """The number of "still absent" columns of :func:`build_interval_model` (most of its
    columns), counted without building it."""
    out, succ = graph.output_bytes, graph.successors
    count = 0
    for v in range(graph.size):
        if succ[v] and out[v] != 0:
            reads = [v, *sorted(set(succ[v]))]
            count += sum(end - a - 1 for a, end in zip(reads, reads[1:]) if end >= a + 2)
    return count


@as_strategy("intervals")
def intervals(
    graph: DFGraph, budget: int | None = None, *, time_limit: float = 60.0, threads: int | None = None,
    solver: str = DEFAULT_SOLVER,
) -> Schedule:
    """The cheapest checkpoint-all schedule with values dropped between reads (module docstring).

    Without a budget the checkpoint-all schedule is returned.

    Args:
        graph: the graph.
        budget: peak bytes allowed.
        time_limit: seconds for the whole call (every solve of the interval MILP; a
            positive number).
        threads: solver threads (None: solver default).
        solver: MILP backend (see :func:`~tfremat.ilp.solvers.solve_model`).

    Raises:
        ArgumentError: ``time_limit`` is not a positive number (checked before any work,
            rather than reported as a budget it had no time to fit).
        InfeasibleBudgetError: no choice of drops fits the budget (the model is
            infeasible, or the solver found none within ``time_limit``, or the simulated
            schedule still exceeds the budget after a few rounds), or the model is
            predictably too large to build within a quarter of ``time_limit``; carries
            the smallest peak of the schedules simulated (checkpoint all's at least).
    """
    if not is_number(time_limit) or not time_limit > 0:
        raise ArgumentError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    began = time.perf_counter()
    base = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "intervals")
    result = simulate(graph, base)
    if budget is None or result.peak_bytes <= budget:
        return base
    excess = stage_peaks(result, graph.size) - budget
    smallest_peak = result.peak_bytes
    columns = absent_column_count(graph)
    if columns > _COLUMNS_PER_SECOND * _BUILD_SHARE * time_limit:
        raise InfeasibleBudgetError(budget, smallest_peak, strategy="intervals",
                                    detail=f"its model (over {columns} columns) is too large to build and solve within "
                                    f"time_limit={time_limit:.3g}s")
    for _ in range(_ROUNDS):
        model = build_interval_model(graph, excess)
        remaining = time_limit - (time.perf_counter() - began)
        if remaining <= 0:
            break
        solved = solve_model(model, solver=solver, time_limit=remaining, threads=threads, quiet=True)
        if solved.x is None:
            detail = "no drops between reads cover the excess" if solved.status == SolveStatus.INFEASIBLE else (
                f"the solver found no schedule within time_limit={time_limit}s")
            raise InfeasibleBudgetError(budget, smallest_peak, strategy="intervals", detail=detail)
        schedule = schedule_from_keep_matrix(graph, model.keep_matrix(solved.x), "intervals")
        outcome = simulate(graph, schedule)
        if outcome.peak_bytes <= budget:
            return schedule
        smallest_peak = min(smallest_peak, outcome.peak_bytes)
        excess += np.maximum(stage_peaks(outcome, graph.size) - budget, 0)
    raise InfeasibleBudgetError(budget, smallest_peak, strategy="intervals",
                                detail=f"the schedule still exceeds the budget after {_ROUNDS} rounds or "
                                f"time_limit={time_limit}s")
