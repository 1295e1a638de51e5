"""Batch-size maximization (Checkmate, Jain et al. 2020, sec. 6.3).

Activation memory and compute grow with the batch, so a larger batch fits a fixed memory
budget only by rematerializing more. Checkmate asks for the largest batch whose training
step fits the budget at the cost of at most one extra forward pass; :func:`max_batch_size`
answers that in one of two ways:

* ``method="search"`` (default): over batch sizes, asking a strategy for the cheapest
  schedule that fits at each size. Works for any ``batch -> graph`` function (profiled
  costs and CPU convolution scratch do not scale linearly) and any strategy.
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
from tfremat.ilp.portfolio import best_baseline
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
        method: ``"search"``, ``"scaled"`` or ``"direct"``.
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
    sizes_for_batch: Callable[[int], DFGraph] | None = None,
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
        method: ``"search"``, ``"scaled"`` (the search on graphs scaled from few built
            ones, its answer checked on a built graph: few calls of ``graph_for_batch``,
            see :func:`_scaled`) or ``"direct"``.
        batch_progress: called as ``batch_progress(batch, fits)`` after each batch size
            the search evaluates (``direct`` evaluates none), e.g. to show progress;
            each is also logged at INFO.
        sizes_for_batch: with ``scaled``, builds the graph at a batch size without
            measuring costs or workspaces (nodes, edges and sizes exact: an extraction with
            ``cost_model="flops"``, seconds where profiling takes a minute); the scaled
            search then measures (``graph_for_batch``) only ``min_batch`` and its answers.
            None: ``graph_for_batch`` builds those graphs too.
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
    if method not in ("search", "scaled"):
        raise ArgumentError(f"method must be 'search', 'scaled' or 'direct', got {method!r}")
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

    if method == "scaled":
        return _scaled(graph_for_batch, sizes_for_batch, evaluate, min_batch, max_batch, batch_progress)
    if not fits(min_batch):
        raise evaluate.refused(min_batch, graph_for_batch(min_batch))
    good = _largest(fits, min_batch, max_batch)
    return evaluate.result(good, max_batch, method="search")


# A solver strategy's time limit on a scaled graph: an estimate only guides which batches
# are measured, and each of the several estimates a search makes would otherwise take as
# long as a real solve.
_ESTIMATE_SECONDS = 10.0


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
        # Schedules that fitted estimates, with the structure of their graphs: a later
        # estimate on a graph of that structure tries them before solving.
        self._sketches: list[tuple[tuple, Schedule]] = []

    def __call__(self, batch: int, graph: DFGraph, record: bool = True, time_limit: float | None = None) -> bool:
        """Whether ``graph`` (at ``batch``) fits; ``record=False`` for an estimate, which is
        not remembered; ``time_limit`` caps a solver strategy's own limit."""
        cap = _cost_cap(graph, self.max_overhead)
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
                cost = self._cost(graph, schedule)
                ok = cost <= cap * (1 + 1e-12)
                refusal = "overhead"
                found = (schedule, graph, cost, cap)
        if record:
            self.tried[batch], self.refusal[batch] = ok, refusal
            if ok:
                self.found[batch] = found
            logger.info("batch %d: %s", batch, "fits" if ok else "does not fit")
        elif ok:
            self._sketches.append((_structure(graph), found[0]))
        return ok

    @staticmethod
    def _cost(graph: DFGraph, schedule: Schedule) -> float:
        # With offloading, the step's time includes its waits for host copies.
        return simulate(graph, schedule).makespan if schedule.offloads else schedule.cost(graph)

    def estimate(self, batch: int, graph: DFGraph, time_limit: float | None = _ESTIMATE_SECONDS) -> bool:
        """Whether a scaled ``graph`` (at ``batch``) fits, as an estimate: refused below the
        memory lower bound; for a solver strategy, which finds the cheapest schedule within
        the budget, accepted when a schedule fitting an earlier estimate, or the best of
        the heuristics that warm-start the solver (:func:`~tfremat.ilp.portfolio.best_baseline`),
        fits within the cap (the optimum costs no more); else the strategy, for at most
        ``time_limit`` seconds (None: its own limit)."""
        if memory_lower_bound(graph) > self.budget:
            return False
        if self.solve.takes_solver_options:
            cap = _cost_cap(graph, self.max_overhead) * (1 + 1e-12)
            structure = _structure(graph)
            for known, schedule in reversed(self._sketches):
                if known == structure and simulate(graph, schedule).peak_bytes <= self.budget \
                        and self._cost(graph, schedule) <= cap:
                    return True
            baseline, _ = best_baseline(graph, self.budget, 0.0, quiet=True)
            if baseline is not None and baseline.cost(graph) <= cap:
                self._sketches.append((structure, baseline))
                return True
        return self(batch, graph, record=False, time_limit=time_limit)

    def largest_estimate(self, at: Callable[[int], DFGraph], low: int, high: int) -> int:
        """The largest batch in [low, high] that fits on the scaled graphs ``at`` by
        :meth:`estimate`, given that ``low`` does: first the largest whose memory lower bound
        is within the budget (it grows with the batch; no solve), then doubling and bisection below it."""
        if memory_lower_bound(at(high)) > self.budget:
            high = _bisect(lambda b: memory_lower_bound(at(b)) <= self.budget, low, high)
        return _largest(lambda b: self.estimate(b, at(b)), low, high)

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


# Batches the scaled search measures at its estimates before it gallops from what is known
# to fit, measuring every batch it tries.
_SCALED_ROUNDS = 4


def _scaled(graph_for_batch, sizes_for_batch, evaluate: _Evaluator, min_batch: int, max_batch: int,
            batch_progress) -> MaxBatchResult:
    """``method="scaled"``: the search on graphs scaled from few built ones, its answer
    measured.

    Measuring a graph (profiling every node: tens of seconds, more at large batches) is what
    makes a search slow, and a graph's sizes, workspaces and costs are nearly affine in the
    batch (:func:`scaled_graphs`). So ``graph_for_batch`` builds ``min_batch`` (its refusal
    is the search's), ``sizes_for_batch`` (or ``graph_for_batch`` without it) two more
    batches to draw the size lines through, and the search runs on the scaled graphs
    (:meth:`_Evaluator.largest_estimate`). Its answer ``B`` is then measured: when it fits,
    the lines are redrawn through it, and ``B + 1`` judged on them (with the strategy's own
    time limit) decides whether the search goes on above (a graph next to a measured one,
    whose workspaces and costs it scales by ``(B + 1) / B``); when ``B`` does not fit, the
    search repeats below it. Typically
    two graphs are measured, ``min_batch`` and the answer; after ``_SCALED_ROUNDS``
    estimates without an answer, every batch tried is measured (:func:`_gallop`).

    Only measured graphs decide that a batch fits, so the result always fits; the batch
    above it is decided on scaled graphs, which is why the answer may be one batch below
    ``method="search"``'s where a measured graph would fit and its estimate does not.
    """
    measured: dict[int, DFGraph] = {}
    shapes: dict[int, DFGraph] = {}
    low, high = min_batch, max_batch + 1  # low fits; high does not (max_batch + 1: not searched)

    def exact(batch: int) -> bool:
        nonlocal low, high
        if batch not in measured:
            measured[batch] = graph_for_batch(batch)
            ok = evaluate(batch, measured[batch])
            if batch_progress is not None:
                batch_progress(batch, ok)
        if evaluate.tried[batch]:
            low = max(low, batch)
        else:
            high = min(high, batch)
        return evaluate.tried[batch]

    if not exact(min_batch):
        raise evaluate.refused(min_batch, measured[min_batch])
    batch = min_batch
    while scaled_graphs(measured, shapes) is None and 2 * batch < high:
        # A second graph of the same nodes and edges to draw the lines through (batch 1 can
        # differ: a batch-norm gradient that reads its output at batch 1 only).
        batch *= 2
        if sizes_for_batch is not None:
            shapes[batch] = sizes_for_batch(batch)
            if not _same_nodes(shapes[batch], measured[min_batch]):
                logger.warning("sizes_for_batch(%d) has other nodes than graph_for_batch(%d); measuring instead",
                               batch, min_batch)
                sizes_for_batch, shapes = None, {}
        if sizes_for_batch is None:
            exact(batch)
    settled = False
    for _ in range(_SCALED_ROUNDS):
        at = scaled_graphs(measured, shapes)
        if at is None or high - low <= 1:
            settled = high - low <= 1
            break
        estimate = evaluate.largest_estimate(at, low, high - 1)
        logger.info("batch %d fits on scaled graphs (measured: %s)", estimate, sorted(measured))
        if estimate == low:
            settled = True
            break
        if exact(estimate):
            following = estimate + 1
            settled = following >= high or not evaluate.estimate(following, scaled_graphs(measured, shapes)(following),
                                                                  time_limit=None)
            if settled:
                break
    if not settled:
        _gallop(exact, low, high)
    return evaluate.result(low, max_batch, method="scaled")


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


def _structure(graph: DFGraph) -> tuple:
    return graph.names, graph.edges, graph.is_backward


def _same_nodes(a: DFGraph, b: DFGraph) -> bool:
    return (a.names, a.is_backward) == (b.names, b.is_backward)


def _anchors(graphs: Mapping[int, DFGraph]) -> tuple[int, int] | None:
    """The two batches farthest apart whose graphs share nodes and edges (the line through
    them is the best estimate), or None."""
    batches = sorted(graphs)
    pairs = [(near, far) for far in batches for near in batches
             if near < far and _structure(graphs[near]) == _structure(graphs[far])]
    return max(pairs, key=lambda pair: pair[1] - pair[0]) if pairs else None


def _line(a, batch_a: int, b, batch_b: int) -> Callable[[int], np.ndarray]:
    """The values on the line through ``a`` (at ``batch_a``) and ``b`` (at ``batch_b``), never below zero."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return lambda batch: np.maximum(a + (b - a) * (batch - batch_a) / (batch_b - batch_a), 0.0)


def _whole(values: np.ndarray) -> list[int]:
    return np.rint(values).astype(np.int64).tolist()


def affine_graphs(graph_a: DFGraph, batch_a: int, graph_b: DFGraph, batch_b: int) -> Callable[[int], DFGraph]:
    """The graph at any batch, each node's output and workspace bytes and cost, and the
    fixed bytes, on the line through their values in ``graph_a`` (at ``batch_a``) and
    ``graph_b`` (at ``batch_b``), rounded to whole bytes and never below zero.

    Raises:
        ArgumentError: the two graphs differ in nodes or edges (a model whose structure
            depends on the batch cannot be scaled).
    """
    if _structure(graph_a) != _structure(graph_b):
        raise ArgumentError(f"graphs at batch {batch_a} and {batch_b} differ in nodes or edges; they cannot be "
                            "scaled to other batch sizes (use method='search')")
    if batch_a == batch_b:
        raise ArgumentError("affine_graphs needs two different batch sizes")
    return _scaled_at(graph_a, batch_a, graph_b, batch_b, None)


def scaled_graphs(measured: Mapping[int, DFGraph], sizes: Mapping[int, DFGraph]) -> Callable[[int], DFGraph] | None:
    """The graph at any batch from graphs built at a few: ``measured`` ones (their costs and
    workspaces measured, as profiling does) and ``sizes`` ones (exact nodes, edges and sizes,
    costs and workspaces not measured), or None when no two of them share nodes and edges
    or none measured shares their nodes.

    Sizes (outputs, residuals, fixed bytes) are on the line through the two graphs of one
    structure farthest apart, measured or not: they follow from the tensors' shapes, which
    are affine in the batch. Costs and workspaces are on the line through the two measured
    graphs farthest apart (which may differ in edges from the others); with one measured at
    ``p``, its costs and the workspace it holds beyond the unmeasured graphs' are scaled by
    ``batch / p``: kernels' time and scratch grow with the batch, and the per-node constants
    the proportion misses are small (on ResNet50 at 64x64, a workspace scaled from batch 2
    to 96 is at most 1.5 MB above the measured one, never more than 12 kB below).
    """
    everything = {**sizes, **measured}
    pair = _anchors(everything)
    if pair is None:
        return None
    near, far = pair
    reference = everything[near]
    known = sorted(b for b, graph in measured.items() if _same_nodes(graph, reference))
    if not known:
        return None
    if len(known) >= 2:
        return _scaled_at(reference, near, everything[far], far,
                          (measured[known[0]], known[0], measured[known[-1]], known[-1]))
    # The workspace the unmeasured graphs hold (none without them), which the measured one includes.
    unmeasured = sorted(b for b, graph in sizes.items() if _same_nodes(graph, reference) and b not in measured)
    if len(unmeasured) >= 2:
        base = _line(sizes[unmeasured[0]].workspace_bytes, unmeasured[0], sizes[unmeasured[-1]].workspace_bytes,
                     unmeasured[-1])
    else:
        values = np.asarray(sizes[unmeasured[0]].workspace_bytes if unmeasured else [0] * reference.size, dtype=float)
        base = lambda batch: values  # noqa: E731
    return _scaled_at(reference, near, everything[far], far, (measured[known[0]], known[0], base, None))


def _scaled_at(graph_a: DFGraph, batch_a: int, graph_b: DFGraph, batch_b: int, measured) -> Callable[[int], DFGraph]:
    """Graphs whose nodes, edges and sizes are on the line through ``graph_a`` and ``graph_b``;
    costs and workspaces on the line through the two measured graphs of ``measured``
    ``(graph, batch, graph, batch)``, or scaled from its one ``(graph, batch, base, None)``
    beyond the ``base(batch)`` workspace of the unmeasured graphs (:func:`scaled_graphs`);
    None: from ``graph_a`` and ``graph_b`` too."""
    output = _line(graph_a.output_bytes, batch_a, graph_b.output_bytes, batch_b)
    residual = _line(graph_a.residual_bytes, batch_a, graph_b.residual_bytes, batch_b)
    fixed = _line([graph_a.fixed_bytes], batch_a, [graph_b.fixed_bytes], batch_b)
    if measured is None:
        measured = (graph_a, batch_a, graph_b, batch_b)
    first, p, second, q = measured
    if q is not None:
        cost, workspace = _line(first.cost, p, second.cost, q), _line(first.workspace_bytes, p, second.workspace_bytes, q)
    else:
        base = second
        costs = np.asarray(first.cost, dtype=float)
        added = np.maximum(np.asarray(first.workspace_bytes, dtype=float) - base(p), 0.0)

        def cost(batch):
            return costs * batch / p

        def workspace(batch):
            return base(batch) + added * batch / p

    def at(batch: int) -> DFGraph:
        outputs = output(batch)
        return DFGraph(
            graph_a.names, graph_a.edges, cost(batch).tolist(), _whole(outputs), _whole(workspace(batch)),
            graph_a.is_backward, graph_a.loss_node, dict(graph_a.forward_of), _whole(fixed(batch))[0],
            name=f"{graph_a.name} (batch {batch}, scaled)",
            residual_bytes=_whole(np.minimum(residual(batch), outputs)),
        )

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
