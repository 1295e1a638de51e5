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

import inspect
from collections.abc import Callable

from tfremat.budget import format_bytes
from tfremat.errors import ArgumentError, InfeasibleBudgetError
from tfremat.graph import DFGraph
from tfremat.ilp.approx_lp import solve_approx_lp
from tfremat.ilp.formulation import memory_lower_bound
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.monet import solve_monet
from tfremat.ilp.portfolio import HEURISTICS, best_baseline, run_order
from tfremat.plan.baselines import recorded_candidates
from tfremat.plan.eviction import eviction
from tfremat.plan.hong import hong, hong_ap
from tfremat.plan.offload import autocapper, opportunist, pofo, pofo_ap
from tfremat.plan.registry import Strategy
from tfremat.plan.rotor import rotor, rotor_ap
from tfremat.plan.simulator import checkpoint_all_peak

__all__ = ["STRATEGIES", "get_strategy", "strategy_names", "offloading_strategy_names", "solver_strategy_names",
           "least_peak", "least_budget_within", "forward_share", "MIN_OVERHEAD_CAP"]

# least_budget_within probes budgets on a grid of this many steps of the activation memory
# (0.5% each): the same shares in every run, whatever the proven lower bound. Eight
# bisection probes.
_GRID_STEPS = 200
# least_budget_within keeps this share of the forward pass below it: at one pass exactly
# "min" moved 3 points of the residual chain's peak over nine profiles, with the half-step
# cap binding in some; 0.1 moved it 1 point, 0.2 half a point but 2 points higher
# (benchmarks/min_budget.py).
_MIN_MARGIN = 0.1
# least_budget_within raises a budget over the cap by one grid step this many times, then by
# doubling steps: the cap binds on the residual chain, where one forward pass is about half
# the step, and rises of 1, 2, 4 steps moved "min" by 3.5 points between profiles where
# single steps moved it by 1 (benchmarks/min_budget.py).
_LINEAR_RISES = 8
# The heuristics whose cheapest schedule least_budget_within holds to the cap, in the
# portfolio's order (eviction first): those the portfolio runs without a time limit and not
# last, so deterministic and in optimal's warm start. Eviction alone, planned under two
# profiles of transformer_encoder, picked schedules of +52% and +38% at one budget, where
# chen_greedy_ap's cost +42% under both (benchmarks/min_budget.py, "Session 30 (G)").
_CAP_HEURISTICS = tuple(s for s in run_order(HEURISTICS)
                        if not s.runs_last and "time_limit" not in inspect.signature(s.function).parameters)
# The most "min" recomputes, as a share of one plain step under the profiled costs: the
# classic bound assumes a backward pass twice the forward's cost (a third of the step),
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
    batch sizes (Jain et al. 2020, sec. 5.3, Figure 6) that ``"min"`` keeps to, under cost
    proxies that no profile moves (:func:`least_budget_within`)."""
    return sum(graph.cost[i] for i in graph.forward_nodes) / graph.total_cost if graph.total_cost else 0.0


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


class _CapCheck:
    """Whether one of :data:`_CAP_HEURISTICS`, planned and costed under ``graph``'s costs,
    finds a schedule at a budget that recomputes at most ``cap`` of a plain step: the
    portfolio that ``optimal`` starts from has one as cheap (its cheapest), tried in its
    order until one is.

    A heuristic whose candidates do not depend on the budget
    (:attr:`~tfremat.plan.registry.Strategy.fixed_candidates`) runs once: its cheapest
    fitting candidate is within the cap exactly when the least peak of its candidates
    within the cap fits, a number kept for the later budgets. Eviction's candidates follow
    the budget and run at each.
    """

    def __init__(self, graph: DFGraph, cap: float):
        self.graph = graph
        self.limit = graph.total_cost * (1 + cap + 1e-9)
        self.least_peaks: dict[str, float] = {}  # fixed-candidate heuristic -> least peak within the cap

    def _least_peak_within(self, strategy) -> float:
        if strategy.name not in self.least_peaks:
            with recorded_candidates() as seen:
                try:
                    # A budget nothing fits: every candidate is judged (and recorded), none chosen.
                    strategy.function(self.graph, 0)
                except InfeasibleBudgetError:
                    pass
            self.least_peaks[strategy.name] = min((peak for peak, cost in seen if cost <= self.limit),
                                                  default=float("inf"))
        return self.least_peaks[strategy.name]

    def __call__(self, budget: int) -> bool:
        for strategy in _CAP_HEURISTICS:
            if strategy.fixed_candidates:
                if self._least_peak_within(strategy) <= budget:
                    return True
                continue
            try:
                if strategy.function(self.graph, budget).cost(self.graph) <= self.limit:
                    return True
            except InfeasibleBudgetError:
                continue
        return False


def _cheapest_within(graph: DFGraph, budget: int, cap: float) -> bool:
    """Whether one of :data:`_CAP_HEURISTICS` finds a schedule at ``budget`` within ``cap``
    of a plain step (:class:`_CapCheck`, for one budget)."""
    return _CapCheck(graph, cap)(budget)


def least_budget_within(graph: DFGraph, passes: float = 1.0, cap: float = MIN_OVERHEAD_CAP,
                        progress: Callable[[str], None] | None = None) -> int:
    """The least budget on a grid of 0.5% of the activation memory at which a schedule
    recomputes at most ``passes`` forward passes, counted under costs no profile moves,
    and at most ``cap`` of a plain step under the graph's own costs: what the budget
    ``"min"`` means (one pass, at most half a step).

    The count: ``eviction``'s schedule planned and costed under each cost proxy
    (:func:`_cost_proxies`: one per node, bytes-proportional) recomputes at most nine
    tenths of ``passes`` times the proxy's forward cost (:func:`forward_share`; the
    Chen et al. 2016 sec. 4.1 bound) for one of them. A bisection on the grid between the
    proven lower bound (:func:`memory_lower_bound`) and the checkpoint-all peak finds the
    least such budget. Profiled costs, whose forward pass moved from 26% to 50% of one
    model's step between fresh profiles, moved "min" by 3-5 points; the proxies leave only
    the profiled workspaces and the cap to move it (benchmarks/min_budget.py). Then, while
    no heuristic of the portfolio that ``optimal`` starts from (:data:`_CAP_HEURISTICS`,
    planned under the graph's costs) finds a schedule within ``cap`` under them, the budget
    rises a grid step at a time (doubling after eight), so that ``optimal`` is within the
    cap too. The cheapest of them, not ``eviction``'s alone: eviction's choice follows the
    profile's noise, and the cap bound on it where another heuristic's schedule was well
    within the cap under either profile. Deterministic for a graph. The least peak at
    any cost (:func:`least_peak`) may recompute many forward passes. Where eviction finds
    no schedule (graphs whose values must be kept only for later recomputations), the
    search ends at the checkpoint-all peak: nothing recomputed.

    Each budget judged is told to ``progress`` (a line of text) as it is: on a 1,541-node
    graph a judgement takes seconds (benchmarks/results/min_large_graph.md).

    Raises:
        ArgumentError: ``passes`` or ``cap`` is negative or not a number.
    """
    for name, value, example in (("passes", passes, "1.0"), ("cap", cap, "0.5")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ArgumentError(f"{name} must be a number, 0 or more (e.g. {example}), got {value!r}")
    activation = checkpoint_all_peak(graph) - graph.fixed_bytes
    if activation <= 0:
        return checkpoint_all_peak(graph)
    steps = min(_GRID_STEPS, activation)

    def budget_at(step: int) -> int:
        return graph.fixed_bytes + -(-activation * step // steps)

    proxies = _cost_proxies(graph)

    probes = 0

    def tell(step: int, verdict: str) -> None:
        nonlocal probes
        probes += 1
        if progress is not None:
            progress(f'finding "min": {format_bytes(budget_at(step))} is {verdict} (budget {probes} judged)')

    def counted_within(step: int) -> bool:
        # Round-off: a schedule that recomputes nothing sums the same costs in another order.
        within = any(_eviction_cost(proxy, proxy, budget_at(step))
                     <= proxy.total_cost * (1 + (1 - _MIN_MARGIN) * passes * forward_share(proxy) + 1e-9)
                     for proxy in proxies)
        tell(step, f"{'within' if within else 'over'} {passes:g} forward pass")
        return within

    within_cap = _CapCheck(graph, cap)

    def capped(step: int) -> bool:
        within = within_cap(budget_at(step))
        tell(step, f"{'within' if within else 'over'} {100 * cap:.0f}% of a step")
        return within

    below = memory_lower_bound(graph) - 1 - graph.fixed_bytes
    low, high = (below * steps // activation if below >= 0 else -1), steps  # low fails, high fits
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if counted_within(middle) else (middle, high)
    rises = 0
    while high < steps and not capped(high):
        rises += 1
        high = min(steps, high + (1 if rises <= _LINEAR_RISES else 2 ** (rises - _LINEAR_RISES)))
    return budget_at(high)
