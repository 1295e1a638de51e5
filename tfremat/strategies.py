"""The catalogue of strategies: every :class:`~tfremat.plan.registry.Strategy` users can name.

Each strategy module is imported here explicitly; the heuristics come from the portfolio
that warm-starts the MILP (:data:`tfremat.ilp.portfolio.HEURISTICS`), plus ``hong_ap``,
``rotor`` and ``rotor_ap`` (listed after ``hong``, not run by the portfolio), the
strategies that offload to host memory (``pofo[_ap]``, ``autocapper``, ``opportunist``: they need a host
link's ``bandwidth``), the solver-based strategies after them: ``optimal``, ``monet`` (which also
chooses every node's operator implementation) and ``approx_lp``.
Nothing here imports TensorFlow.
"""

from __future__ import annotations

from tfremat.errors import ArgumentError, InfeasibleBudgetError
from tfremat.graph import DFGraph
from tfremat.ilp.approx_lp import solve_approx_lp
from tfremat.ilp.formulation import memory_lower_bound
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.monet import solve_monet
from tfremat.ilp.portfolio import HEURISTICS, best_baseline
from tfremat.plan.eviction import eviction
from tfremat.plan.hong import hong, hong_ap
from tfremat.plan.offload import autocapper, opportunist, pofo, pofo_ap
from tfremat.plan.registry import Strategy
from tfremat.plan.rotor import rotor, rotor_ap
from tfremat.plan.simulator import checkpoint_all_peak

__all__ = ["STRATEGIES", "get_strategy", "strategy_names", "offloading_strategy_names", "solver_strategy_names",
           "least_peak", "least_budget_within", "forward_share", "min_overhead", "MIN_OVERHEAD_CAP"]

# least_budget_within probes budgets on a grid of this many steps of the activation memory
# (0.5% each): the same shares in every run, whatever the proven lower bound. Eight
# bisection probes.
_GRID_STEPS = 200
# least_budget_within keeps this share of the bound below it: the overhead curve is flat
# where a schedule recomputes about one forward pass, so a bound met exactly there moved
# "min" by 5 points between two profiles of one model (benchmarks/min_budget.py).
_MIN_MARGIN = 0.1
# The most "min" recomputes, as a share of one plain step, when one forward pass costs more:
# the classic bound assumes a backward pass twice the forward's cost (a third of the step),
# while profiles of small layers, where each op's fixed time dominates, put the forward
# pass at half the step or more.
MIN_OVERHEAD_CAP = 0.5

_AFTER_HONG = HEURISTICS.index(hong) + 1
STRATEGIES: tuple[Strategy, ...] = (*HEURISTICS[:_AFTER_HONG], hong_ap, rotor, rotor_ap, *HEURISTICS[_AFTER_HONG:],
                                    pofo, pofo_ap, autocapper, opportunist, solve_optimal, solve_monet,
                                    solve_approx_lp)
_BY_NAME = {s.name: s for s in STRATEGIES}


def strategy_names(offloading: bool = False) -> list[str]:
    """The strategy names, in the catalogue's order: those that run with a budget alone, and
    with ``offloading`` those that move activations to host memory too (they need the host
    link's ``bandwidth``)."""
    return [s.name for s in STRATEGIES if offloading or not s.offloads]


def offloading_strategy_names() -> list[str]:
    """The strategies that offload to host memory (they take ``bandwidth``)."""
    return [s.name for s in STRATEGIES if s.offloads]


def get_strategy(name: str) -> Strategy:
    """The strategy named ``name``.

    Callers pass it the user's ``strategy`` argument unchecked, so its errors name that
    argument (a list given for one name was a bare "unhashable type" ``TypeError``).

    Raises:
        ArgumentError: ``name`` is not a string, or no strategy has that name; the
            message lists the known ones.
    """
    if not isinstance(name, str):
        raise ArgumentError(f"strategy must be one strategy name (a str), got {name!r}; "
                            f"choose one of: {', '.join(_BY_NAME)}")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ArgumentError(f"unknown strategy {name!r}; choose one of: {', '.join(_BY_NAME)}") from None


def solver_strategy_names() -> list[str]:
    """The strategies that take solver options (``solver``, ``time_limit``, ...)."""
    return [s.name for s in STRATEGIES if s.takes_solver_options]


def least_peak(graph: DFGraph) -> int:
    """The least peak a heuristic reaches on ``graph``: what the budget ``"min"`` means.

    The portfolio runs at the proven lower bound (:func:`memory_lower_bound`); a schedule
    that fits there is as low as any can be, and otherwise each heuristic reports the
    smallest peak it reached. The slow heuristics that take a time limit do not run. Not
    proven minimal: the MILP may find lower (ask ``optimal`` for a byte budget below it).
    """
    bound = memory_lower_bound(graph)
    schedule, smallest_peak = best_baseline(graph, bound, fallback_seconds=0.0)
    return bound if schedule is not None else smallest_peak


def forward_share(graph: DFGraph) -> float:
    """The cost of one forward pass over the cost of the whole step (forward nodes' costs
    over :attr:`~tfremat.graph.DFGraph.total_cost`): the overhead of recomputing every
    forward node once, the bound of Chen et al. 2016 (sec. 4.1) and of Checkmate's maximum
    batch sizes (Jain et al. 2020, sec. 5.3, Figure 6) that ``"min"`` keeps to."""
    return sum(graph.cost[i] for i in graph.forward_nodes) / graph.total_cost if graph.total_cost else 0.0


def min_overhead(graph: DFGraph) -> float:
    """The overhead the budget ``"min"`` keeps to: one forward pass (:func:`forward_share`),
    at most :data:`MIN_OVERHEAD_CAP` of a plain step."""
    return min(forward_share(graph), MIN_OVERHEAD_CAP)


def _cost_proxies(graph: DFGraph) -> tuple[DFGraph, ...]:
    """``graph`` under costs that no profile moves: one per node, and the node's output
    bytes plus their mean (memory-bound operators take time in proportion to their bytes)."""
    mean_bytes = sum(graph.output_bytes) / graph.size
    return (graph.replaced(cost=[1.0] * graph.size),
            graph.replaced(cost=[float(b) + mean_bytes for b in graph.output_bytes]))


def _eviction_cost(planned: DFGraph, graph: DFGraph, budget: int) -> float:
    """The cost, under ``graph``'s costs, of ``eviction``'s schedule at ``budget`` planned
    under ``planned``'s costs; infinity where it finds none."""
    try:
        return eviction(planned, budget).cost(graph)
    except InfeasibleBudgetError:
        return float("inf")


def least_budget_within(graph: DFGraph, max_overhead: float) -> int:
    """The least budget on a grid of 0.5% of the activation memory at which a schedule runs
    at most ``max_overhead`` (a share of one plain step) over the plain step's cost, with a
    tenth of it to spare: what the budget ``"min"`` means, with ``max_overhead`` =
    :func:`min_overhead`.

    A bisection on the grid between the proven lower bound (:func:`memory_lower_bound`)
    and the checkpoint-all peak, judging each budget by the cheapest of three ``eviction``
    schedules there (the heuristic whose cost falls nearly monotonically as the budget
    grows): planned under the graph's costs and under two cost proxies that no profile
    moves (:func:`_cost_proxies`), all costed under the graph's costs. The cheapest of the
    three, the grid shared by every run and the margin keep "min" in place under per-node
    cost noise, where eviction alone against the bound met it anywhere on a flat stretch of
    the overhead curve (benchmarks/min_budget.py). Then, if ``eviction``'s own schedule is over
    ``max_overhead`` there, the budget rises until it is not, so ``optimal`` (which starts
    from the portfolio) is within too. At most eight bisection probes, deterministic for a
    graph. The least peak at any cost (:func:`least_peak`) may recompute many forward
    passes. Where eviction finds no schedule (graphs whose values must be kept only for
    later recomputations), the search ends at the checkpoint-all peak: nothing recomputed.

    Raises:
        ArgumentError: ``max_overhead`` is negative or not a number.
    """
    if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not max_overhead >= 0:
        raise ArgumentError(f"max_overhead must be a share of one plain step's cost (0 or more, e.g. 0.3), "
                            f"got {max_overhead!r}")
    # Round-off: a schedule that recomputes nothing sums the same costs in another order.
    slack = 1e-9 * graph.total_cost
    target = graph.total_cost * (1 + (1 - _MIN_MARGIN) * max_overhead) + slack
    cap = graph.total_cost * (1 + max_overhead) + slack
    activation = checkpoint_all_peak(graph) - graph.fixed_bytes
    if activation <= 0:
        return checkpoint_all_peak(graph)
    steps = min(_GRID_STEPS, activation)

    def budget_at(step: int) -> int:
        return graph.fixed_bytes + -(-activation * step // steps)

    proxies, own = _cost_proxies(graph), {}

    def own_cost(step: int) -> float:
        if step not in own:
            own[step] = _eviction_cost(graph, graph, budget_at(step))
        return own[step]

    def within(step: int) -> bool:
        # The proxies run only where eviction's own schedule is over the target.
        return own_cost(step) <= target or any(_eviction_cost(proxy, graph, budget_at(step)) <= target
                                               for proxy in proxies)

    below = memory_lower_bound(graph) - 1 - graph.fixed_bytes
    low, high = (below * steps // activation if below >= 0 else -1), steps  # low fails, high fits
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if within(middle) else (middle, high)
    rise = 1
    while high < steps and own_cost(high) > cap:
        high, rise = min(steps, high + rise), 2 * rise
    return budget_at(high)
