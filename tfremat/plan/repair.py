"""``repair``: start from checkpoint all and repair the stages over the budget, one value at a time.

Eviction (:mod:`tfremat.plan.eviction`) fails on graphs where a value is worth keeping
only because it makes a later recomputation cheap: the random layered benchmark graphs,
whose last node reads 44 values from all over the graph. Repair works the other way
round. It starts from the schedule that keeps every value until its last reader, and
while some stage peaks above the budget it takes a value resident through the worst
stage and unread there, and instead recomputes it at its next reader: either from its
inputs, which are then kept until that reader (a good trade when the value is larger
than its inputs), or from whatever the recomputation needs. Of the candidate moves
ranked by estimated bytes saved per cost, the few best are simulated, and the one that
removes the most bytes above the budget per unit of added cost is applied.

It is made for graphs eviction handles badly (the random layered graphs of
benchmarks/solvers.py); on training graphs eviction is far better and faster, so the
portfolio (:mod:`tfremat.ilp.portfolio`) gives repair its time only when no other
heuristic fits, and a few seconds otherwise.
"""

from __future__ import annotations

import time

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, is_number
from tfremat.graph import DFGraph
from tfremat.plan.baselines import time_is_up
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix
from tfremat.plan.simulator import SimulationResult, simulate, stage_peaks

__all__ = ["repair"]

# Candidate moves simulated per step, and the number of worst stages searched for them.
# Few moves: the best-ranked ones are the ones that matter, and more time per step leaves
# fewer steps (12 moves gave costlier schedules, slower, on the 1000-node random graph).
_SIMULATED_MOVES = 6
_SEARCHED_STAGES = 4


def _excess(graph: DFGraph, result: SimulationResult, budget: int) -> float:
    """Bytes above the budget, summed over the stages' peaks."""
    return float(np.maximum(stage_peaks(result, graph.size) - budget, 0).sum())


def _read_matrix(graph: DFGraph, R: np.ndarray) -> np.ndarray:
    """``read[t, i]``: some node computed in stage t reads value i."""
    n = graph.size
    read = np.zeros((n, n), dtype=bool)
    for t in range(n):
        for k in np.flatnonzero(R[t]):
            read[t, graph.predecessors[k]] = True
    return read


def _moves(graph: DFGraph, schedule: Schedule, stage: int, read: np.ndarray):
    """Candidate moves at ``stage``: (estimated worth, value, first and last stage it is no
    longer kept into, inputs to keep as ``(input, first stage)``)."""
    R, S = schedule.R, schedule.S
    out, cost, pred = graph.output_bytes, graph.cost, graph.predecessors
    tiny = 1e-9 * max(graph.total_cost, 1e-300)
    resident = S | R
    for value in np.flatnonzero(S[stage]):
        if read[stage, value] or out[value] == 0:
            continue
        later = np.flatnonzero(read[stage + 1 :, value])
        if not len(later):
            continue
        reader_stage = stage + 1 + later[0]
        earlier = np.flatnonzero(read[:stage, value] | R[:stage, value])
        drop_from = earlier[-1] + 1 if len(earlier) else stage
        missing = [p for p in pred[value] if not resident[reader_stage, p]]
        kept_inputs = []
        for p in missing:
            held = np.flatnonzero(resident[:reader_stage, p])
            kept_inputs.append((p, (held[-1] if len(held) else p) + 1))
        saved = out[value] - sum(out[p] for p in missing)
        yield saved / max(cost[value], tiny), value, drop_from, reader_stage, kept_inputs
        if missing:
            # Recompute whatever the value needs instead; ranked below keeping its inputs.
            chain = cost[value] + sum(cost[p] for p in missing)
            yield 0.5 * out[value] / max(chain, tiny), value, drop_from, reader_stage, []


def _apply(S: np.ndarray, value: int, drop_from: int, reader_stage: int, kept_inputs) -> np.ndarray:
    S = S.copy()
    S[drop_from : reader_stage + 1, value] = False
    for p, first in kept_inputs:
        S[first : reader_stage + 1, p] = True
    return S


@as_strategy("repair", runs_last=True)
def repair(graph: DFGraph, budget: int | None = None, *, time_limit: float = 60.0) -> Schedule:
    """Checkpoint all, repaired stage by stage until it fits ``budget`` (module docstring).

    Without a budget there is nothing to repair: the checkpoint-all schedule is returned.

    Args:
        graph: the graph.
        budget: peak bytes allowed.
        time_limit: seconds before giving up (a positive number; ``math.inf``: never); it
            also stops at the deadline of a :func:`~tfremat.plan.baselines.heuristic_deadline`
            block.

    Raises:
        ArgumentError: ``time_limit`` is not a positive number (checked before any work,
            rather than reported as a budget it had no time to fit).
        InfeasibleBudgetError: no move lowers the stages above the budget any more, or
            ``time_limit`` ran out; carries the smallest peak reached.
    """
    if not is_number(time_limit) or not time_limit > 0:
        raise ArgumentError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    began = time.perf_counter()
    schedule = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "repair")
    result = simulate(graph, schedule)
    smallest_peak = result.peak_bytes
    while budget is not None and result.peak_bytes > budget:
        if time.perf_counter() - began > time_limit or time_is_up(allow_step=False):
            raise InfeasibleBudgetError(budget, min_feasible_bytes=smallest_peak, strategy="repair",
                                        detail=f"time_limit={time_limit}s ran out" if time.perf_counter() - began
                                        > time_limit else "the time limit ran out")
        peaks = stage_peaks(result, graph.size)
        excess = float(np.maximum(peaks - budget, 0).sum())
        read = _read_matrix(graph, schedule.R)
        best = None
        for stage in np.argsort(-peaks)[:_SEARCHED_STAGES]:
            if peaks[stage] <= budget or best is not None:
                break
            ranked = sorted(_moves(graph, schedule, int(stage), read), key=lambda move: -move[0])
            for _, *move in ranked[:_SIMULATED_MOVES]:
                if time_is_up(allow_step=False):
                    break
                candidate = schedule_from_keep_matrix(graph, _apply(schedule.S, *move), "repair")
                outcome = simulate(graph, candidate)
                removed = excess - _excess(graph, outcome, budget)
                if removed <= 0:
                    continue
                added = max(outcome.cost - result.cost, 1e-9 * graph.total_cost)
                if best is None or removed / added > best[0]:
                    best = (removed / added, candidate, outcome)
        if best is None and time_is_up(allow_step=False):
            raise InfeasibleBudgetError(budget, min_feasible_bytes=smallest_peak, strategy="repair",
                                        detail="the time limit ran out")
        if best is None:
            raise InfeasibleBudgetError(budget, min_feasible_bytes=smallest_peak, strategy="repair",
                                        detail="no single move lowers the stages above the budget")
        _, schedule, result = best
        smallest_peak = min(smallest_peak, result.peak_bytes)
    return schedule
