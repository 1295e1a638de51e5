"""The memory simulator: the only code in tfremat that computes memory and cost of a plan.

Convention (Checkmate's memory accounting plus per-node workspace):

* ``fixed_bytes`` (parameters, their gradients, optimizer state, the input batch) are
  resident throughout.
* While node k runs in stage t, memory = fixed bytes + every value resident at that
  moment (kept into stage t, or computed earlier in stage t and not yet freed) + k's
  output + k's workspace.
* After k runs its workspace is released, and each value whose last use in stage t was
  k and that is not kept into stage t+1 is freed (see :mod:`tfremat.plan.execution`);
  a node's output and its residuals are freed each on its own.

The peak is the largest memory during any node's run. The MILP (``tfremat.ilp``) encodes
the same convention, and a test holds the two together. Solvers, tests, reports and plots
all call :func:`simulate`; there is no switch that changes what it counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.execution import ExecutionPlan, Op, build_plan
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix

__all__ = ["SimulationResult", "simulate", "stage_peaks", "checkpoint_all_peak"]


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What one training step under a plan costs.

    Attributes:
        peak_bytes: the largest memory during any node's run (including fixed bytes).
        cost: total compute cost of every compute statement.
        recompute_count: compute statements that re-run a node.
        trace_bytes: memory at every statement (after allocate/deallocate; during compute,
            including the node's workspace), for plots.
        peak_statement: index of the statement where the peak occurs.
        plan: the simulated plan.
    """

    peak_bytes: int
    cost: float
    recompute_count: int
    trace_bytes: np.ndarray
    peak_statement: int
    plan: ExecutionPlan


def simulate(graph: DFGraph, plan: ExecutionPlan | Schedule) -> SimulationResult:
    """Replays a plan (or a schedule, whose plan is built first) and counts bytes and cost.

    Args:
        graph: the graph the plan was made for.
        plan: an :class:`ExecutionPlan`, or a :class:`Schedule` to build one from.

    Returns:
        A :class:`SimulationResult`.
    """
    if isinstance(plan, Schedule):
        plan = build_plan(graph, plan)
    out = graph.output_bytes
    work = graph.workspace_bytes
    costs = graph.cost
    live = graph.fixed_bytes
    total_cost = 0.0
    trace = np.empty(len(plan.statements), dtype=np.int64)
    peak = live
    peak_at = 0
    recomputes = 0
    for index, statement in enumerate(plan.statements):
        node = statement.node
        if statement.op is Op.ALLOCATE:
            live += out[node]
            current = live
        elif statement.op is Op.COMPUTE:
            current = live + work[node]
            total_cost += costs[node]
            recomputes += statement.recompute
            if current > peak:
                peak, peak_at = current, index
        else:
            live -= out[node] if statement.part is None else graph.part_bytes(node, statement.part)
            current = live
        trace[index] = current
    trace.setflags(write=False)
    return SimulationResult(int(peak), total_cost, recomputes, trace, peak_at, plan)


def stage_peaks(result: SimulationResult, num_stages: int) -> np.ndarray:
    """The largest memory during each stage of a simulated plan (0 for a stage without
    statements)."""
    statements = result.plan.statements
    stages = np.fromiter((s.stage for s in statements), dtype=np.int64, count=len(statements))
    peaks = np.zeros(num_stages)
    np.maximum.at(peaks, stages, result.trace_bytes)
    return peaks


def checkpoint_all_peak(graph: DFGraph) -> int:
    """The peak of the schedule that keeps every value (no recomputation): what relative
    budgets ("50%", 0.5) are a share of."""
    return simulate(graph, schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")).peak_bytes
