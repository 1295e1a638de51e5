"""Batch-size maximization (Checkmate, Jain et al. 2020, sec. 6.3).

Activation memory and compute grow with the batch, so a larger batch fits a fixed memory
budget only by rematerializing more. Checkmate asks for the largest batch whose training
step fits the budget at the cost of at most one extra forward pass; :func:`max_batch_size`
answers that in one of these ways:

* ``method="search"`` (default): over batch sizes, asking a strategy for the cheapest
  schedule that fits at each size. Works for any ``batch -> graph`` function (profiled
  costs and CPU convolution scratch do not scale linearly) and any strategy.
* ``method="scaled"`` / ``"quick"``: the search on graphs scaled from few built ones
  (:func:`_scaled`), for when building a graph (profiling it) is what costs.
* ``method="direct"``: Checkmate's formulation. When every output and workspace size is
  proportional to the batch, the fixed bytes are affine in it and the costs scale
  together, the largest batch follows from one MILP, the smallest peak among schedules
  within the cost cap (:func:`min_peak_within_cost`). The solver's bound on that peak
  also bounds the batch from above. Graphs that do not scale so are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from tfremat.budget import parse_budget
from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverTimeLimitError,
    is_int,
    is_number,
)
from tfremat.graph import DFGraph
from tfremat.ilp.formulation import build_milp, memory_lower_bound
from tfremat.ilp.solvers import (
    DEFAULT_SOLVER,
    ProgressFn,
    check_solver_options,
    solve_model,
)
from tfremat.plan.offload import check_bandwidth
from tfremat.plan.registry import check_options
from tfremat.plan.schedule import (
    Schedule,
    SolverFacts,
    checkpoint_all_s,
    schedule_from_keep_matrix,
)
from tfremat.plan.simulator import simulate
from tfremat.strategies import get_strategy

__all__ = ["MaxBatchResult", "max_batch_size", "min_peak_within_cost", "one_extra_forward_cap", "affine_graphs"]

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
        tried: every batch size evaluated on its built graph, mapped to whether it fit
            (``search``, ``scaled``), or the batches whose graphs were built (``direct``).
        method: ``"search"``, ``"scaled"``, ``"quick"`` or ``"direct"``.
        upper_bound: a proven upper bound on the largest batch (``direct`` only; equal
            to ``batch_size`` when the peak MILP was solved to optimality).
        reached_max_batch: ``batch_size`` is the ``max_batch`` the search was capped at,
            and fits: the largest batch may be larger (raise ``max_batch``; a warning is
            logged too). ``upper_bound`` is then that cap, not a bound.
    """

    batch_size: int
    schedule: Schedule
    graph: DFGraph
    cost: float
    cost_cap: float
    tried: Mapping[int, bool]
    method: str = "search"
    upper_bound: int | None = None
    reached_max_batch: bool = False


def one_extra_forward_cap(graph: DFGraph) -> float:
    """Checkmate's overhead limit: the no-remat cost plus one more forward pass."""
    return graph.total_cost + sum(graph.cost[i] for i in graph.forward_nodes)


def max_batch_size(
    graph_for_batch: Callable[[int], DFGraph],
    budget: int | str,
    *,
    strategy: str = "optimal",
    max_overhead: float | None = None,
    min_batch: int = 1,
    max_batch: int = 1 << 16,
    method: str = "search",
    batch_progress: Callable[[int, bool], object] | None = None,
    **strategy_options,
) -> MaxBatchResult:
    """The largest batch whose schedule fits ``budget`` within the compute overhead limit.

    ``search`` doubles the batch from ``min_batch`` until a size does not fit, then
    bisects. This assumes feasibility is monotone in the batch (true when bytes and costs
    grow with it). ``direct`` solves one MILP (module docstring).

    Args:
        graph_for_batch: builds the training graph at a batch size.
        budget: peak bytes allowed, fixed bytes included: an int, or a string with a unit
            such as ``"12GiB"`` (not a share of a peak: the peak changes with the batch).
        strategy: registered strategy that finds the cheapest schedule within a budget
            (``"optimal"`` gives exact answers; a baseline name is faster; an offloading
            strategy needs ``bandwidth=``, the host link, among the options).
        max_overhead: allowed extra cost as a fraction of the no-remat cost (0.3 = 30%);
            None uses Checkmate's criterion, one extra forward pass.
        min_batch: the smallest batch to consider.
        max_batch: the largest batch to consider.
        method: ``"search"``, ``"scaled"`` (the search on graphs scaled from two built ones,
            checked on built graphs around the answer: few calls of ``graph_for_batch``,
            see :func:`_scaled`), ``"quick"`` (``scaled`` with the batch above the answer
            judged on a graph scaled through the answer's, not built: one large graph fewer)
            or ``"direct"``.
        batch_progress: called as ``batch_progress(batch, fits)`` after each batch size
            the search evaluates (``direct`` evaluates none), e.g. to show progress;
            each is also logged at INFO.
        **strategy_options: passed to the strategy (for example ``time_limit``); with
            ``direct``, to :func:`min_peak_within_cost` (``strategy`` must stay
            ``"optimal"``).

    Returns:
        A :class:`MaxBatchResult`.

    Raises:
        InfeasibleBudgetError: even ``min_batch`` does not fit.
        ArgumentError: search bounds that are no ints with 1 <= min_batch <= max_batch,
            a bad overhead or method; with ``direct``, a graph that does not scale
            linearly with the batch, or a strategy other than ``optimal``.
        BudgetFormatError: ``budget`` is not an absolute number of bytes.
    """
    budget = parse_budget(budget)
    # Checked here, before any graph is built: a string compared with an int raised a bare
    # TypeError, and 1.5 reached TensorFlow as a tensor shape.
    for name, value in (("min_batch", min_batch), ("max_batch", max_batch)):
        if not is_int(value) or value < 1:
            raise ArgumentError(f"{name} must be an int >= 1, got {value!r}")
    if min_batch > max_batch:
        raise ArgumentError(f"need min_batch <= max_batch, got min_batch={min_batch}, max_batch={max_batch}")
    if max_overhead is not None and not (is_number(max_overhead) and max_overhead >= 0):
        raise ArgumentError(f"max_overhead must be a number >= 0 (a fraction of the no-remat cost) or None, got "
                            f"{max_overhead!r}")
    if method == "direct":
        if strategy != "optimal":
            raise ArgumentError(f"method='direct' solves Checkmate's MILP; strategy={strategy!r} needs method='search'")
        if max_batch == min_batch:
            raise ArgumentError("method='direct' extrapolates from two batch sizes; it needs max_batch > min_batch")
        check_options(min_peak_within_cost, strategy_options, "method='direct' (min_peak_within_cost)")
        return _direct(graph_for_batch, budget, max_overhead, min_batch, max_batch, strategy_options)
    if method not in ("search", "scaled", "quick"):
        raise ArgumentError(f"method must be 'search', 'scaled', 'quick' or 'direct', got {method!r}")
    solve = get_strategy(strategy)
    check_options(solve, strategy_options, f"strategy {strategy!r}")
    if solve.offloads:
        check_bandwidth(strategy_options.get("bandwidth"), strategy)  # before any graph is built
    if get_strategy(strategy).takes_solver_options:
        # Checked here, not by the first solve: a batch whose memory lower bound exceeds
        # the budget is refused without solving, so a bad option would go unnoticed.
        check_solver_options(
            strategy_options.get("solver", DEFAULT_SOLVER), time_limit=strategy_options.get("time_limit"),
            mip_gap=strategy_options.get("mip_gap"), threads=strategy_options.get("threads"),
            seed=strategy_options.get("seed"),
        )
    evaluate = _Evaluator(budget, solve, strategy, max_overhead, strategy_options)

    def fits(batch: int) -> bool:
        ok = evaluate(batch, graph_for_batch(batch))
        if batch_progress is not None:
            batch_progress(batch, ok)
        return ok

    if method in ("scaled", "quick"):
        evaluate.keep_all_certifies = strategy == "optimal"
        return _scaled(graph_for_batch, evaluate, min_batch, max_batch, batch_progress, quick=method == "quick")
    if not fits(min_batch):
        raise evaluate.refused(min_batch, graph_for_batch(min_batch))
    good = _largest(fits, min_batch, max_batch)
    return evaluate.result(good, max_batch, method="search")


class _Evaluator:
    """Whether a batch's graph fits: the strategy's cheapest schedule within the budget,
    costing at most the overhead cap. Remembers each batch's outcome, the schedule of those
    that fit, and why the others did not."""

    def __init__(self, budget: int, solve, strategy: str, max_overhead: float | None, options: Mapping):
        self.budget, self.solve, self.strategy = budget, solve, strategy
        self.max_overhead, self.options = max_overhead, options
        self.tried: dict[int, bool] = {}
        self.found: dict[int, tuple[Schedule, DFGraph, float, float]] = {}
        # Why a batch was refused: "memory" (proven: no schedule fits), "schedule" (the
        # strategy found none), or "overhead" (its schedule costs more than the cap).
        self.refusal: dict[int, str] = {}
        # ``optimal`` without offloading: a batch whose keep-everything schedule fits is
        # judged without the solver (set by the scaled search).
        self.keep_all_certifies = False

    def __call__(self, batch: int, graph: DFGraph, record: bool = True, time_limit: float | None = None) -> bool:
        """Whether ``graph`` (at ``batch``) fits; ``record=False`` for an estimate, which is
        not remembered; ``time_limit`` caps a solver strategy's own limit."""
        ok, refusal, found = self.judge(batch, graph, record, time_limit)
        if record:
            self.tried[batch], self.refusal[batch] = ok, refusal
            if ok:
                self.found[batch] = found
            logger.info("batch %d: %s", batch, "fits" if ok else "does not fit")
        return ok

    def judge(self, batch: int, graph: DFGraph, record: bool = False, time_limit: float | None = None):
        """``(fits, refusal, found)`` for ``graph``: ``found`` is ``(schedule, graph, cost,
        cap)`` when the strategy returned a schedule, else None."""
        cap = _cost_cap(graph, self.max_overhead)
        if self.keep_all_certifies:
            # The keep-everything schedule runs every node once, the least cost there is, so
            # when it fits it is what ``optimal`` returns (at once, or after its portfolio
            # and LP when round-off puts its cost a hair above the floor: 18 s on ResNet50).
            keep_all = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
            if simulate(graph, keep_all).peak_bytes <= self.budget and keep_all.cost(graph) <= cap * (1 + 1e-12):
                return True, "overhead", (keep_all, graph, keep_all.cost(graph), cap)
        ok, refusal, found = False, "memory", None
        if memory_lower_bound(graph) <= self.budget:
            refusal = "schedule"
            try:
                options = dict(self.options)
                if time_limit is not None and self.solve.takes_solver_options:
                    given = options.get("time_limit")
                    options["time_limit"] = time_limit if given is None else min(given, time_limit)
                schedule = self.solve(graph, self.budget, **options)
            except InfeasibleBudgetError as exc:
                refusal = "memory" if exc.proven else "schedule"
                schedule = None
            except SolverTimeLimitError as exc:
                # Counted as not fitting, though nothing proved it: say so where it shows (an
                # estimate only guides the search, so it is not shown).
                logger.log(logging.WARNING if record else logging.DEBUG,
                           "batch %d counts as not fitting: %s found no schedule (%s)", batch, self.strategy, exc)
                schedule = None
            if schedule is not None:
                # With offloading, the step's time includes its waits for host copies.
                cost = simulate(graph, schedule).makespan if schedule.offloads else schedule.cost(graph)
                ok = cost <= cap * (1 + 1e-12)
                refusal = "overhead"
                found = (schedule, graph, cost, cap)
        return ok, refusal, found

    def fits_as_is(self, schedule: Schedule, graph: DFGraph) -> bool:
        """Whether ``schedule`` run on ``graph`` peaks within the budget and costs at most
        the cap (a schedule of another batch of the same structure, no solver)."""
        return (simulate(graph, schedule).peak_bytes <= self.budget
                and schedule.cost(graph) <= _cost_cap(graph, self.max_overhead) * (1 + 1e-12))

    def refused(self, batch: int, graph: DFGraph) -> InfeasibleBudgetError:
        """The error for a smallest batch that does not fit."""
        detail = {
            "memory": f"no schedule of batch size {batch} fits",
            "schedule": f"{self.strategy} found no schedule of batch size {batch} that fits",
            "overhead": f"batch size {batch}'s schedule costs more than the overhead limit (raise max_overhead)",
        }[self.refusal[batch]]
        return InfeasibleBudgetError(self.budget, strategy=self.strategy, lower_bound_bytes=memory_lower_bound(graph),
                                     proven=self.refusal[batch] == "memory", detail=detail)

    def result(self, batch: int, max_batch: int, method: str) -> MaxBatchResult:
        schedule, graph, cost, cap = self.found[batch]
        reached = batch == max_batch
        if reached:
            _warn_capped(max_batch)
        return MaxBatchResult(batch, schedule, graph, cost, cap, MappingProxyType(dict(sorted(self.tried.items()))),
                              method=method, reached_max_batch=reached)


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest batch in [low, high] that ``fits``, given that ``low`` does: doubling
    from ``low`` until a size does not fit, then bisecting (feasibility is taken to be
    monotone in the batch)."""
    good, bad = low, None
    while bad is None and good < high:
        candidate = min(2 * good, high)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    return good if bad is None else _bisect(fits, good, bad)


def _bisect(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """The largest batch that ``fits`` between ``good`` (fits) and ``bad`` (does not)."""
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


# A solver strategy's time limit on a scaled graph: an estimate only guides which batches
# are extracted, and each of the several estimates a search makes would otherwise take as
# long as a real solve.
_ESTIMATE_SECONDS = 10.0
# Estimates the scaled search makes (each refitted through the previous, too optimistic
# one) before it gallops from what is known to fit.
_SCALED_ROUNDS = 4


def _scaled(graph_for_batch, evaluate: _Evaluator, min_batch: int, max_batch: int, batch_progress,
            quick: bool = False) -> MaxBatchResult:
    """``method="scaled"``: the search on graphs scaled from two extracted ones, checked by
    extracting the graphs on either side of the answer.

    Extraction (profiling every layer) is what makes a search slow, and a graph's sizes
    and costs are nearly affine in the batch; so graphs are extracted at ``min_batch`` and
    twice it, the search runs on their affine extension (:func:`affine_graphs`), and the
    answer ``B`` is checked by extracting it: when it does not fit, the line is refitted
    through it and the search repeats below it; from the largest extracted batch that fits,
    extracted batches above it are tried in doubling steps and the gap bisected
    (:func:`_gallop`), so an estimate a few batches off costs a few extractions.

    ``quick``: the line starts from twice and four times ``min_batch`` (``min_batch``
    itself is built only when twice it does not fit: at batch 1 a batch-norm gradient can
    differ, so batch 1 was built in vain), and once ``B`` fits the batches above it are
    judged at the strategy's full time limit on the graphs scaled through ``B``'s and an
    anchor (:func:`_anchor_for`), galloping up from ``B``, not built; only the largest that
    fits there is built and checked (when it does not fit, the gallop between it and ``B``
    builds graphs).
    A graph built per answer, not per batch tried near it; profiling noise between two
    adjacent batches can make the answer one batch off what ``scaled`` finds. A solver
    strategy gets at most ``_ESTIMATE_SECONDS`` per estimate, where it often finds only a
    heuristic's schedule: estimates tend to be low, and the gallop corrects them. With
    ``optimal`` a batch whose keep-everything schedule fits is judged without a solve, and
    the estimates search only between the bounds of :func:`_bracketed_estimate`. Only
    extracted graphs decide: the result is the same as ``method="search"`` wherever
    feasibility is monotone in the batch.
    """
    extracted: dict[int, DFGraph] = {}

    def exact(batch: int) -> bool:
        if batch in extracted:
            return evaluate.tried[batch]
        extracted[batch] = graph_for_batch(batch)
        ok = evaluate(batch, extracted[batch])
        if batch_progress is not None:
            batch_progress(batch, ok)
        return ok

    low, high = min_batch, max_batch + 1  # low fits; high does not (max_batch + 1: not searched)
    if quick and 2 * min_batch <= max_batch:
        # Whether min_batch fits is judged only when twice it does not (monotone feasibility).
        if exact(2 * min_batch):
            low = 2 * min_batch
            if 4 * min_batch <= max_batch:
                if exact(4 * min_batch):
                    low = 4 * min_batch
                else:
                    high = 4 * min_batch
        else:
            high = 2 * min_batch
            if not exact(min_batch):
                raise evaluate.refused(min_batch, extracted[min_batch])
    else:
        if not exact(min_batch):
            raise evaluate.refused(min_batch, extracted[min_batch])
        second = min(2 * min_batch, max_batch)
        if second > low:
            if exact(second):
                low = second
            else:
                high = second
    for _ in range(_SCALED_ROUNDS):
        if high - low <= 1:
            break
        pair = _anchors(extracted)
        if pair is None:
            # No two extracted graphs share their structure (batch 1 can differ: a batch-norm
            # gradient that reads its output at batch 1 only): extract the next doubling.
            candidate = 2 * max(extracted)
            if candidate >= high:
                break
            if exact(candidate):
                low = candidate
            else:
                high = candidate
            continue
        near, far = pair
        scaled = affine_graphs(extracted[near], near, extracted[far], far)
        if evaluate.strategy == "optimal":
            estimate = _bracketed_estimate(scaled, evaluate, low, high)
        else:
            estimate = _largest(lambda b: evaluate(b, scaled(b), record=False, time_limit=_ESTIMATE_SECONDS),
                                low, high - 1)
        logger.info("batch %d fits on graphs scaled from batches %d and %d", estimate, near, far)
        if estimate == low:
            break
        if exact(estimate):
            low = estimate
            break
        high = estimate  # too optimistic: estimate again, through this batch too
    anchor = _anchor_for(extracted, low)
    if quick and low + 1 < high and low == max(extracted) and anchor is not None:
        # The line through the answer's own graph, solved at the strategy's full time limit:
        # the short estimates undershoot by a few batches near the boundary.
        line = affine_graphs(extracted[anchor], anchor, extracted[low], low)
        top = _gallop(lambda batch: evaluate(batch, line(batch), record=False), low, high)
        logger.info("batch %d fits and %d does not on graphs scaled through batches %d and %d", top, top + 1,
                    anchor, low)
        if top == low or exact(top):
            return evaluate.result(top, max_batch, method="quick")
        high = top
    low = _gallop(exact, low, high)
    return evaluate.result(low, max_batch, method="quick" if quick else "scaled")


def _anchor_for(extracted: Mapping[int, DFGraph], batch: int) -> int | None:
    """The other end of the line through ``batch``'s graph: the largest extracted batch of
    its structure at most half of it (far enough that profiling noise barely tilts the
    line, near enough that the smallest batches' noise does not), else the smallest; or None."""
    same = sorted(b for b in extracted if b < batch and _same_structure(extracted[b], extracted[batch]))
    if not same:
        return None
    halves = [b for b in same if 2 * b <= batch]
    return halves[-1] if halves else same[0]


def _bracketed_estimate(scaled: Callable[[int], DFGraph], evaluate: "_Evaluator", low: int, high: int) -> int:
    """The largest batch in ``[low, high)`` that fits on the scaled graphs, solving only
    between two bounds that cost no solve: the keep-everything schedule's peak grows with
    the batch, so the batches it fits fit (:func:`_reach`, simulations only; its cost is
    the least there is); above the largest batch whose :func:`memory_lower_bound` is
    within the budget none does. Each probe between them solves for at most
    ``_ESTIMATE_SECONDS``."""
    keep_all = schedule_from_keep_matrix(scaled(low), checkpoint_all_s(scaled(low)), "checkpoint_all")
    if evaluate.fits_as_is(keep_all, scaled(low)):
        low = _reach(keep_all, scaled, evaluate, low, high)
    high = min(high, _gallop(lambda b: memory_lower_bound(scaled(b)) <= evaluate.budget, low, high) + 1)
    return _bisect(lambda b: evaluate(b, scaled(b), record=False, time_limit=_ESTIMATE_SECONDS), low, high)


def _reach(schedule: Schedule, scaled: Callable[[int], DFGraph], evaluate: "_Evaluator", low: int, high: int) -> int:
    """The largest batch below ``high`` at which ``schedule`` fits the scaled graph, given
    that it fits at ``low``. Its peak is a maximum of affine functions of the batch (convex),
    so the batches it fits form an interval; simulations only, no solver."""
    return _gallop(lambda batch: evaluate.fits_as_is(schedule, scaled(batch)), low, high)


def _gallop(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest batch below ``high`` that ``fits``, given that ``low`` does, searched
    upwards from ``low`` in doubling steps (1, 2, 4, ...) and then bisected: few checks when
    the answer is near ``low``."""
    step = 1
    while low + step < high:
        if not fits(low + step):
            high = low + step
            break
        low += step
        step *= 2
    return _bisect(fits, low, high)


def _same_structure(a: DFGraph, b: DFGraph) -> bool:
    return (a.names, a.edges, a.is_backward) == (b.names, b.edges, b.is_backward)


def _anchors(extracted: Mapping[int, DFGraph]) -> tuple[int, int] | None:
    """The two extracted batches farthest apart whose graphs share nodes and edges (the
    line through them is the best estimate), or None."""
    batches = sorted(extracted)
    pairs = [(near, far) for far in batches for near in batches
             if near < far and _same_structure(extracted[near], extracted[far])]
    return max(pairs, key=lambda pair: pair[1] - pair[0]) if pairs else None


def affine_graphs(graph_a: DFGraph, batch_a: int, graph_b: DFGraph, batch_b: int) -> Callable[[int], DFGraph]:
    """The graph at any batch, each node's output and workspace bytes and cost, and the
    fixed bytes, on the line through their values in ``graph_a`` (at ``batch_a``) and
    ``graph_b`` (at ``batch_b``), rounded to whole bytes and never below zero.

    Raises:
        ArgumentError: the two graphs differ in nodes or edges (a model whose structure
            depends on the batch cannot be scaled).
    """
    if not _same_structure(graph_a, graph_b):
        raise ArgumentError(f"graphs at batch {batch_a} and {batch_b} differ in nodes or edges; they cannot be "
                            "scaled to other batch sizes (use method='search')")
    if batch_a == batch_b:
        raise ArgumentError("affine_graphs needs two different batch sizes")

    def line(a, b, batch, whole: bool):
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        value = np.maximum(a + (b - a) * (batch - batch_a) / (batch_b - batch_a), 0.0)
        return np.rint(value).astype(np.int64).tolist() if whole else value.tolist()

    # A backward node's workspace counts its forward node's weight gradients, which do not
    # scale with the batch: a line through two noisy profiles must not fall below them.
    floor = np.zeros(graph_a.size, dtype=np.int64)
    for node, grads in enumerate(graph_a.weight_grad_bytes):
        for backward in graph_a.backward_nodes_of.get(node, ()) if grads else ():
            floor[backward] = max(floor[backward], grads)

    def at(batch: int) -> DFGraph:
        workspace = np.maximum(line(graph_a.workspace_bytes, graph_b.workspace_bytes, batch, whole=True), floor)
        return DFGraph(
            graph_a.names, graph_a.edges, line(graph_a.cost, graph_b.cost, batch, whole=False),
            line(graph_a.output_bytes, graph_b.output_bytes, batch, whole=True), workspace.tolist(),
            graph_a.is_backward, graph_a.loss_node, dict(graph_a.forward_of),
            int(line([graph_a.fixed_bytes], [graph_b.fixed_bytes], batch, whole=True)[0]),
            name=f"{graph_a.name} (batch {batch}, scaled)",
            residual_bytes=np.minimum(line(graph_a.residual_bytes, graph_b.residual_bytes, batch, whole=True),
                                      line(graph_a.output_bytes, graph_b.output_bytes, batch, whole=True)).tolist(),
            weight_grad_bytes=graph_a.weight_grad_bytes,
        ).with_views(graph_a.view_of)

    return at


def _warn_capped(max_batch: int) -> None:
    logger.warning("batch %d, the max_batch the search was capped at, fits: the largest batch may be larger; "
                   "raise max_batch", max_batch)


def _cost_cap(graph: DFGraph, max_overhead: float | None) -> float:
    return one_extra_forward_cap(graph) if max_overhead is None else (1 + max_overhead) * graph.total_cost


def min_peak_within_cost(
    graph: DFGraph,
    max_cost: float,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = None,
    mip_gap: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    progress: ProgressFn | None = None,
) -> Schedule:
    """The schedule with the smallest peak among those costing at most ``max_cost``.

    Checkmate's batch-size MILP (sec. 6.3): the objective is the peak, the compute cost
    a constraint. The MILP starts from the checkpoint-all schedule (the cheapest there
    is), so a time limit still returns a schedule.

    Returns:
        The schedule; its :class:`~tfremat.plan.schedule.SolverFacts` hold ``status`` (the
        solver's), ``objective`` (its compute cost), ``peak_bytes``, ``peak_bound_bytes``
        (a proven lower bound on the smallest peak), ``cost_cap`` and ``seconds``.

    Raises:
        ValueError: ``max_cost`` is below the cost of running every node once.
    """
    began = time.perf_counter()
    time_limit = check_solver_options(solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed)
    if max_cost < graph.total_cost * (1 - 1e-12):
        raise ArgumentError(f"max_cost={max_cost} is below the no-remat cost {graph.total_cost}: no schedule is that cheap")
    keep_all = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "min_peak")
    reference = simulate(graph, keep_all).peak_bytes
    model = build_milp(graph, reference, peak_within_cost=max_cost)
    result = solve_model(
        model, solver=solver, time_limit=time_limit, mip_gap=mip_gap, threads=threads, seed=seed,
        start=model.encode(keep_all), progress=progress, started=began,
    )
    best, best_peak = keep_all, reference
    if result.x is not None:
        candidate = model.schedule(result.x, "min_peak")
        peak = simulate(graph, candidate).peak_bytes
        if peak < best_peak and candidate.cost(graph) <= max_cost * (1 + 1e-9):
            best, best_peak = candidate, peak
    bound = memory_lower_bound(graph)
    if result.best_bound is not None:
        bound = max(bound, int(np.ceil(graph.fixed_bytes + result.best_bound - 1e-6 * model.scale)))
    return best.with_facts(SolverFacts(
        status=result.status, objective=best.cost(graph), peak_bytes=best_peak, peak_bound_bytes=min(bound, best_peak),
        cost_cap=max_cost, seconds=time.perf_counter() - began, solver=result.solver,
    ))


def _direct(graph_for_batch, budget, max_overhead, min_batch, max_batch, options) -> MaxBatchResult:
    """Checkmate's direct batch maximization for graphs that scale linearly (module docstring)."""
    small, large = min_batch, min(2 * min_batch, max_batch)
    graph_small, graph_large = graph_for_batch(small), graph_for_batch(large)
    _check_linear(graph_small, graph_large, small, large)
    # fixed(b) = fixed_base + b * fixed_per_sample; activations scale as b / small.
    fixed_per_sample = (graph_large.fixed_bytes - graph_small.fixed_bytes) / (large - small)
    fixed_base = graph_small.fixed_bytes - small * fixed_per_sample
    schedule = min_peak_within_cost(graph_small, _cost_cap(graph_small, max_overhead), **options)
    facts = schedule.facts

    def largest(peak_bytes: float) -> float:
        """The largest batch within the budget at this peak; unbounded when memory does not grow."""
        per_sample = fixed_per_sample + (peak_bytes - graph_small.fixed_bytes) / small
        return np.floor((budget - fixed_base) / per_sample + 1e-9) if per_sample > 0 else np.inf

    uncapped = largest(facts.peak_bytes)
    batch = int(min(uncapped, max_batch))
    upper = int(min(largest(facts.peak_bound_bytes), max_batch))
    if batch < min_batch:
        # ``small`` is min_batch: the schedule's peak is the least any schedule within the
        # overhead limit reaches at that batch, up to the solver's gap.
        raise InfeasibleBudgetError(
            budget, min_feasible_bytes=facts.peak_bytes, strategy="optimal",
            detail=f"batch size {min_batch} does not fit within the overhead limit (direct formulation)",
        )
    graph = graph_for_batch(batch)
    cost, cap = schedule.cost(graph), _cost_cap(graph, max_overhead)
    if simulate(graph, schedule).peak_bytes > budget or cost > cap * (1 + 1e-9):
        raise ArgumentError(
            f"graph_for_batch({batch}) does not scale like graph_for_batch({small}) and ({large}); "
            "use method='search'"
        )
    tried = {small: True, large: large <= batch, batch: True}
    reached = bool(uncapped > max_batch)
    if reached:
        _warn_capped(max_batch)
    return MaxBatchResult(batch, schedule, graph, cost, cap, MappingProxyType(dict(sorted(tried.items()))),
                          method="direct", upper_bound=max(upper, batch), reached_max_batch=reached)


def _check_linear(a: DFGraph, b: DFGraph, batch_a: int, batch_b: int) -> None:
    """Raises ValueError unless ``b`` is ``a`` with every size scaled by ``batch_b / batch_a``
    and every cost by one common factor."""
    same = a.size == b.size and a.edges == b.edges
    ratio = batch_b / batch_a
    sizes = all(
        np.array_equal(np.asarray(x, dtype=float) * ratio, np.asarray(y, dtype=float))
        for x, y in ((a.output_bytes, b.output_bytes), (a.workspace_bytes, b.workspace_bytes))
    )
    cost_a, cost_b = np.asarray(a.cost, dtype=float), np.asarray(b.cost, dtype=float)
    factor = cost_b.sum() / cost_a.sum() if cost_a.sum() else 1.0
    costs = np.allclose(cost_a * factor, cost_b, rtol=1e-9, atol=0.0)
    if not (same and sizes and costs):
        raise ArgumentError(
            f"method='direct' needs graphs whose sizes scale linearly with the batch and whose costs scale "
            f"together; graph_for_batch({batch_a}) and ({batch_b}) do not; use method='search'"
        )
