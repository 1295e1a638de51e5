"""Batch-size maximization (Checkmate, Jain et al. 2020, sec. 6.3).

Activation memory and compute grow with the batch, so a larger batch fits a fixed memory
budget only by rematerializing more. Checkmate asks for the largest batch whose training
step fits the budget at the cost of at most one extra forward pass; :func:`max_batch_size`
answers that by searching over batch sizes, asking a strategy for the cheapest schedule
that fits at each size. Checkmate's direct formulation (the batch size as a variable of
the MILP) is not used: it is only exact for graphs whose sizes scale linearly, and the
search works for any ``batch -> graph`` function and any strategy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

from tfremat.errors import InfeasibleBudgetError, SolverError, SolverLicenseError, SolverUnavailableError
from tfremat.graph import DFGraph
from tfremat.ilp.formulation import memory_lower_bound
from tfremat.plan.registry import get_strategy
from tfremat.plan.schedule import Schedule

__all__ = ["MaxBatchResult", "max_batch_size", "one_extra_forward_cap"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MaxBatchResult:
    """The largest batch found and its schedule.

    Attributes:
        batch_size: the largest batch that fits.
        schedule: its schedule.
        graph: its graph.
        cost: the schedule's total cost.
        cost_cap: the largest cost allowed at that batch.
        tried: every batch size evaluated, mapped to whether it fit.
    """

    batch_size: int
    schedule: Schedule
    graph: DFGraph
    cost: float
    cost_cap: float
    tried: Mapping[int, bool]


def one_extra_forward_cap(graph: DFGraph) -> float:
    """Checkmate's overhead limit: the no-remat cost plus one more forward pass."""
    return graph.total_cost + sum(graph.cost[i] for i in graph.forward_nodes)


def max_batch_size(
    graph_for_batch: Callable[[int], DFGraph],
    budget: int,
    *,
    strategy: str = "optimal",
    max_overhead: float | None = None,
    min_batch: int = 1,
    max_batch: int = 1 << 16,
    **strategy_options,
) -> MaxBatchResult:
    """The largest batch whose schedule fits ``budget`` within the compute overhead limit.

    Doubles the batch from ``min_batch`` until a size does not fit, then bisects. This
    assumes feasibility is monotone in the batch (true when bytes and costs grow with it).

    Args:
        graph_for_batch: builds the training graph at a batch size.
        budget: peak bytes allowed, fixed bytes included.
        strategy: registered strategy that finds the cheapest schedule within a budget
            (``"optimal"`` gives exact answers; a baseline name is faster).
        max_overhead: allowed extra cost as a fraction of the no-remat cost (0.3 = 30%);
            None uses Checkmate's criterion, one extra forward pass.
        min_batch: the smallest batch to consider.
        max_batch: the largest batch to consider.
        **strategy_options: passed to the strategy (for example ``time_limit``).

    Returns:
        A :class:`MaxBatchResult`.

    Raises:
        InfeasibleBudgetError: even ``min_batch`` does not fit.
        ValueError: bad search bounds or overhead.
    """
    if not 1 <= min_batch <= max_batch:
        raise ValueError(f"need 1 <= min_batch <= max_batch, got min_batch={min_batch}, max_batch={max_batch}")
    if max_overhead is not None and max_overhead < 0:
        raise ValueError(f"max_overhead must be >= 0 (a fraction of the no-remat cost), got {max_overhead}")
    solve = get_strategy(strategy)
    tried: dict[int, bool] = {}
    found: dict[int, tuple[Schedule, DFGraph, float, float]] = {}

    def fits(batch: int) -> bool:
        graph = graph_for_batch(batch)
        cap = one_extra_forward_cap(graph) if max_overhead is None else (1 + max_overhead) * graph.total_cost
        ok = False
        if memory_lower_bound(graph) <= budget:
            try:
                schedule = solve(graph, budget, **strategy_options)
            except InfeasibleBudgetError:
                schedule = None
            except (SolverUnavailableError, SolverLicenseError):
                raise
            except SolverError as exc:
                logger.info("batch %d: %s", batch, exc)
                schedule = None
            if schedule is not None:
                cost = schedule.cost(graph)
                ok = cost <= cap * (1 + 1e-12)
                if ok:
                    found[batch] = (schedule, graph, cost, cap)
        tried[batch] = ok
        logger.info("batch %d: %s", batch, "fits" if ok else "does not fit")
        return ok

    if not fits(min_batch):
        raise InfeasibleBudgetError(
            budget, strategy=strategy,
            detail=f"batch size {min_batch} does not fit within the overhead limit",
        )
    good, bad = min_batch, None
    while bad is None and good < max_batch:
        candidate = min(2 * good, max_batch)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    schedule, graph, cost, cap = found[good]
    return MaxBatchResult(good, schedule, graph, cost, cap, MappingProxyType(dict(sorted(tried.items()))))
