"""Batch-size maximization (Checkmate, Jain et al. 2020, sec. 6.3).

Activation memory and compute grow with the batch, so a larger batch fits a fixed memory
budget only by rematerializing more. Checkmate asks for the largest batch whose training
step fits the budget at the cost of at most one extra forward pass; :func:`max_batch_size`
answers that in one of these ways:

* ``method="search"`` (default): over batch sizes, asking a strategy for the cheapest
  schedule that fits at each size. Works for any ``batch -> graph`` function (profiled
  costs and CPU convolution scratch do not scale linearly) and any strategy.
* ``method="scaled"``: two graphs built, every larger batch judged on their affine
  extension (:func:`_scaled`), for when building a graph (profiling it) is what costs.
  With ``optimal`` a batch is settled by certificates where they reach (a heuristic's
  schedule that fits, the memory lower bound) and the MILP is asked only in the gap
  between them, for any schedule within the overhead cap (:func:`_climb`). The line's
  answer is then certified on a graph built at it, or the search steps down
  (:func:`_certify_built`); that graph may be built measuring memory only, its costs
  then taken from the line (:func:`_certifying_graph`).
* ``method="direct"``: Checkmate's formulation. When every output and workspace size is
  proportional to the batch, the fixed bytes are affine in it and the costs scale
  together, the largest batch follows from one MILP, the smallest peak among schedules
  within the cost cap (:func:`min_peak_within_cost`). The solver's bound on that peak
  also bounds the batch from above. Graphs that do not scale so are refused.

Each answers for the bytes a schedule is predicted to request. :func:`hold_on_allocator`
then holds an answer for the device allocator's peak, which BFC's whole chunks put above
those bytes: the answer's step is run and held to the budget as ``tfremat.fit`` holds it,
and smaller batches are tried until one holds (the caller runs the steps:
:mod:`tfremat.api` for Keras models).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from tfremat.budget import format_bytes, parse_budget
from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverTimeLimitError,
    TfrematError,
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
from tfremat.plan.eviction import eviction
from tfremat.plan.simulator import simulate
from tfremat.strategies import get_strategy

__all__ = ["AllocatorVerdict", "MaxBatchResult", "hold_on_allocator", "max_batch_size", "min_peak_within_cost",
           "one_extra_forward_cap", "affine_graphs"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MaxBatchResult:
    """The largest batch found and its schedule.

    Every method checks its answer on a graph built (extracted) at ``batch_size``:
    ``schedule`` fits ``graph``, that built graph, within the budget and ``cost_cap``.

    Attributes:
        batch_size: the largest batch that fits.
        schedule: its schedule.
        graph: its graph, built at ``batch_size`` (never a scaled one); ``scaled`` with
            ``memory_graph_for_batch``: its bytes built there, its costs the profiled line's
            at ``batch_size`` (:func:`_certifying_graph`).
        cost: the schedule's total cost.
        cost_cap: the largest cost allowed at that batch.
        tried: every batch size judged, mapped to whether it fit (``scaled``: its last
            verdict, on its built graph or a scaled one), or the batches whose graphs were
            built (``direct``).
        method: ``"search"``, ``"scaled"`` or ``"direct"``.
        upper_bound: a proven upper bound on the largest batch (``direct`` only; equal
            to ``batch_size`` when the peak MILP was solved to optimality).
        reached_max_batch: ``batch_size`` is the ``max_batch`` the search was capped at,
            and fits: the largest batch may be larger (raise ``max_batch``; a warning is
            logged too). ``upper_bound`` is then that cap, not a bound.
        built: the batches whose graphs were built, in the order built (building a graph,
            profiling it, is what a search spends its time on).
        allocator_peak: the device allocator's peak that the answer's step was held to
            (:func:`hold_on_allocator`: the largest of its reads plus a slack, as ``fit``
            holds it), within the budget; ``schedule`` is then the plan that held it. None
            where the answer was not held so (``allocator_check=False``, a search on
            graphs alone) or the allocator keeps no statistics.
        allocator_tried: every batch whose step was held to the budget on the allocator, in
            the order tried, mapped to whether it held (the first is the search's own
            answer); empty where none was.
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
    built: tuple[int, ...] = ()
    allocator_peak: int | None = None
    allocator_tried: Mapping[int, bool] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


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
    probe_seconds: float | None = None,
    memory_graph_for_batch: Callable[[int], DFGraph] | None = None,
    **strategy_options,
) -> MaxBatchResult:
    """The largest batch whose schedule fits ``budget`` within the compute overhead limit.

    The answer holds ``budget`` for the bytes the schedule is predicted to request. The
    device allocator's peak is not judged here (it needs the step compiled and run): BFC's
    whole chunks can put it well above the prediction (an 8-conv net at "32MiB": batch 48,
    predicted within, then refused by ``fit``'s check; benchmarks/results/user_check_4.md).
    :func:`hold_on_allocator` holds an answer for that peak, stepping down to a batch whose
    step ``fit`` holds; :func:`tfremat.max_batch_size` does so by default.

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
        method: ``"search"``, ``"scaled"`` (two graphs built, the other batches judged on
            graphs scaled from them, the answer then certified on a graph built at it, see
            :func:`_scaled`) or ``"direct"``.
        batch_progress: called as ``batch_progress(batch, fits)`` after each batch whose
            graph is built (``direct`` reports none), e.g. to show progress; each batch
            judged is also logged at INFO.
        probe_seconds: ``scaled`` with ``optimal``: the most seconds a MILP probe above
            the heuristics' reach gets (None: 20 s, and never more than ``time_limit``).
        memory_graph_for_batch: ``scaled``: builds the graph at a batch measuring its bytes
            only (``extract(..., timing=False)``, about half a profile's time), for the
            certifying builds; their costs are then the line's through the two profiled
            graphs, so the overhead cap stays on profiled costs (:func:`_certifying_graph`).
            None: ``graph_for_batch`` builds those too.
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
    if probe_seconds is not None and not (is_number(probe_seconds) and probe_seconds > 0):
        raise ArgumentError(f"probe_seconds must be a number of seconds > 0 or None, got {probe_seconds!r}")
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
    built: list[int] = []

    def fits(batch: int) -> bool:
        if batch not in built:
            built.append(batch)
        ok = evaluate(batch, graph_for_batch(batch))
        if batch_progress is not None:
            batch_progress(batch, ok)
        return ok

    if method == "scaled":
        evaluate.keep_all_certifies = strategy == "optimal"
        return _scaled(graph_for_batch, evaluate, min_batch, max_batch, batch_progress,
                       _PROBE_SECONDS if probe_seconds is None else probe_seconds, memory_graph_for_batch)
    if not fits(min_batch):
        raise evaluate.refused(min_batch, graph_for_batch(min_batch))
    good = _largest(fits, min_batch, max_batch)
    return evaluate.result(good, max_batch, method="search", built=tuple(built))


@dataclasses.dataclass(frozen=True)
class AllocatorVerdict:
    """What running one batch's training step and holding it to the budget on the device
    allocator found, as ``fit``'s ``allocator_check`` holds it (the callable that
    :func:`hold_on_allocator` takes returns one per batch).

    Attributes:
        held: the allocator's peak of a plan's step was held within the budget.
        held_peak: that plan's held peak (the largest read plus a slack); where not
            ``held``, the smallest of the plans read, or None where none was read. None
            with ``held``: the allocator keeps no statistics, so nothing was judged.
        schedule: the plan that held (``held`` only), planned on ``graph``.
        graph: the graph built at the batch (``held`` only).
        planning_budget: the budget ``schedule`` was planned under, below the budget
            where a plan under the budget itself peaked over it (``held`` only).
        needed_bytes: where not ``held``: about the fewest bytes the batch's step needs on
            the allocator, as far as the check tells (the smallest held peak of a plan read),
            or None.
        error: where not ``held``: why (the check's refusal, or the planner's at the batch).
    """

    held: bool
    held_peak: int | None = None
    schedule: Schedule | None = None
    graph: DFGraph | None = None
    planning_budget: int | None = None
    needed_bytes: int | None = None
    error: TfrematError | None = None


def hold_on_allocator(answer: MaxBatchResult, hold: Callable[[int], AllocatorVerdict], budget: int | str, *,
                      max_overhead: float | None = None, min_batch: int = 1,
                      batch_progress: Callable[[int, bool], object] | None = None) -> MaxBatchResult:
    """``answer`` (a search's, for the bytes its schedules request) held for the device
    allocator's peak: the largest batch, at most ``answer.batch_size``, whose training step
    ``hold(batch)`` holds within ``budget`` on the allocator with a plan that costs at most
    the overhead cap (``max_overhead`` as :func:`max_batch_size` takes it).

    A plan that holds the allocator's peak only by recomputing more than the cap does not
    count: the batch is Checkmate's "fits at one extra forward pass" (sec. 6.3), on the
    device. ``hold`` is expensive (a build, a plan and runs of the step), so after the answer
    fails the next batch tried is the one where the bytes over the graph's fixed bytes,
    taken as proportional to the batch, meet the budget at what the failed batch needed
    (:attr:`AllocatorVerdict.needed_bytes`; one batch less where it is not known), and once a
    batch holds, the rest is found between it and the smallest that failed
    (:func:`_largest_held`; holding is taken to be monotone in the batch, as fitting is).

    Returns:
        ``answer`` at the batch that holds: its ``schedule``, ``graph`` and ``cost`` those
        of the plan that held, ``allocator_peak`` its held peak, ``allocator_tried`` every
        batch tried; ``built`` with the batches ``hold`` built.

    Raises:
        InfeasibleBudgetError: even ``min_batch`` does not hold (the allocator check's
            refusal there, naming the smallest budget it found).
        SolverTimeLimitError: no plan of ``min_batch`` was found within the time limit.
    """
    budget = parse_budget(budget)
    tried: dict[int, bool] = {}
    verdicts: dict[int, AllocatorVerdict] = {}

    def holds(batch: int) -> bool:
        verdict = hold(batch)
        within = verdict.held
        if within:
            cost, cap = _step_cost(verdict.graph, verdict.schedule), _cost_cap(verdict.graph, max_overhead)
            within = cost <= cap * (1 + 1e-12)
            if not within:
                logger.info("batch %d: the allocator's peak held only by a plan costing %.3fx, over the cap %.3fx",
                            batch, cost / verdict.graph.total_cost, cap / verdict.graph.total_cost)
                # A plan within the cap would be planned under the budget less the margin the
                # allocator asked for: the batch needs about that margin more.
                margin = None if verdict.planning_budget is None else budget - verdict.planning_budget
                verdict = dataclasses.replace(verdict, held=False,
                                              needed_bytes=budget + margin if margin else None)
        verdicts[batch], tried[batch] = verdict, within
        peak = "no statistics" if verdict.held_peak is None else format_bytes(verdict.held_peak)
        logger.info("batch %d: %s on the allocator (%s held)", batch, "holds" if within else "does not hold", peak)
        if batch_progress is not None:
            batch_progress(batch, within)
        return within

    batch, refused = answer.batch_size, None
    while not holds(batch):
        if batch == min_batch:
            raise _not_held(verdicts[batch], budget, batch)
        refused = batch
        batch = _batch_within(refused, verdicts[refused].needed_bytes, budget, answer.graph.fixed_bytes, min_batch)
    good = batch if refused is None else _largest_held(holds, batch, refused, verdicts, budget)
    verdict = verdicts[good]
    schedule, graph = verdict.schedule, verdict.graph
    logger.info("answer: batch %d held on the allocator (batches tried: %s)", good,
                ", ".join(f"{b} {'holds' if ok else 'does not hold'}" for b, ok in tried.items()))
    return dataclasses.replace(
        answer, batch_size=good, schedule=schedule, graph=graph, cost=_step_cost(graph, schedule),
        cost_cap=_cost_cap(graph, max_overhead), allocator_peak=verdict.held_peak,
        allocator_tried=MappingProxyType(dict(tried)),
        reached_max_batch=answer.reached_max_batch and good == answer.batch_size,
        built=tuple(dict.fromkeys((*answer.built, *tried))))


def _largest_held(holds: Callable[[int], bool], good: int, refused: int, verdicts: Mapping[int, AllocatorVerdict],
                  budget: int) -> int:
    """The largest batch that ``holds`` between ``good`` (holds) and ``refused`` (does not):
    each batch tried where the line through the two bracketing batches' bytes
    (``verdicts``: the held peak where a batch held, the bytes needed where not) meets the
    budget, and halfway between them after a try that did not halve the bracket (regula
    falsi kept from creeping up on one side by bisection)."""
    halved = True
    while refused - good > 1:
        width = refused - good
        low, high = verdicts[good].held_peak, verdicts[refused].needed_bytes
        if halved and low is not None and high is not None and high > low:
            batch = good + int(width * (budget - low) // (high - low))
        else:
            batch = (good + refused) // 2
        batch = min(max(batch, good + 1), refused - 1)
        if holds(batch):
            good = batch
        else:
            refused = batch
        halved = 2 * (refused - good) <= width
    return good


def _batch_within(refused: int, needed: int | None, budget: int, fixed: int, min_batch: int) -> int:
    """The next batch to hold below ``refused``, which needed ``needed`` bytes (None: not
    known): where the bytes over ``fixed``, proportional to the batch, meet ``budget``;
    within ``[min_batch, refused - 1]``."""
    guess = refused - 1
    if needed is not None and needed > budget > fixed:
        guess = int(refused * (budget - fixed) // (needed - fixed))
    return max(min_batch, min(guess, refused - 1))


def _not_held(verdict: AllocatorVerdict, budget: int, batch: int) -> TfrematError:
    """The refusal of a smallest batch whose step no plan held within ``budget``."""
    if isinstance(verdict.error, InfeasibleBudgetError):
        return verdict.error.for_batch(f"batch {batch}")
    if verdict.error is not None:
        return verdict.error
    return InfeasibleBudgetError(
        budget, min_feasible_bytes=verdict.needed_bytes,
        detail=f"batch size {batch}'s step was held within the budget on the allocator only by a plan costing more "
               "than the overhead limit (raise max_overhead, or pass allocator_check=False to hold the budget for "
               "the bytes the step requests)", batch=f"batch {batch}")


def _step_cost(graph: DFGraph, schedule: Schedule) -> float:
    """What the overhead cap is held against: the schedule's compute cost, and with
    offloading the step's time with its waits for host copies."""
    return simulate(graph, schedule).makespan if schedule.offloads else schedule.cost(graph)


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

    def __call__(self, batch: int, graph: DFGraph, *, heuristic: Callable | None = None,
                 time_limit: float | None = None, first_within_cap: bool = False) -> bool:
        """Whether ``graph`` (at ``batch``) fits, remembered. ``heuristic``: judged by that
        strategy (called with the graph and budget alone) instead; ``time_limit`` caps a
        solver strategy's own limit; ``first_within_cap``: unless a ``mip_gap`` was given, the
        solver may stop at the first schedule within the overhead cap (its gap is the cap's)."""
        ok, refusal, found = self.judge(batch, graph, heuristic, time_limit, first_within_cap)
        self.tried[batch], self.refusal[batch] = ok, refusal
        if ok:
            self.found[batch] = found
        logger.info("batch %d: %s", batch, "fits" if ok else "does not fit")
        return ok

    def certify(self, batch: int, schedule: Schedule, graph: DFGraph) -> None:
        """Records that ``schedule`` fits ``graph`` at ``batch`` (checked by the caller)."""
        cap = _cost_cap(graph, self.max_overhead)
        self.tried[batch], self.refusal[batch] = True, "overhead"
        self.found[batch] = (schedule, graph, schedule.cost(graph), cap)

    def judge(self, batch: int, graph: DFGraph, heuristic: Callable | None = None, time_limit: float | None = None,
              first_within_cap: bool = False):
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
                options = {} if heuristic is not None else dict(self.options)
                if heuristic is None and self.solve.takes_solver_options:
                    if time_limit is not None:
                        given = options.get("time_limit")
                        options["time_limit"] = time_limit if given is None else min(given, time_limit)
                    if first_within_cap and options.get("mip_gap") is None and graph.total_cost > 0:
                        # HiGHS stops at a gap g once cost <= bound / (1 - g); the bound is at
                        # least the no-remat cost, so this g stops no later than the cap.
                        extra = max(cap / graph.total_cost - 1, 0.0)
                        options["mip_gap"] = extra / (1 + extra)
                schedule = (heuristic or self.solve)(graph, self.budget, **options)
            except InfeasibleBudgetError as exc:
                refusal = "memory" if exc.proven else "schedule"
                schedule = None
            except SolverTimeLimitError as exc:
                # Counted as not fitting, though nothing proved it: say so where it shows (an
                # estimate only guides the search, so it is not shown).
                logger.warning("batch %d counts as not fitting: %s found no schedule (%s)", batch, self.strategy, exc)
                schedule = None
            if schedule is not None:
                cost = _step_cost(graph, schedule)
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

    def result(self, batch: int, max_batch: int, method: str, built: tuple[int, ...]) -> MaxBatchResult:
        schedule, graph, cost, cap = self.found[batch]
        reached = batch == max_batch
        if reached:
            _warn_capped(max_batch)
        logger.info("answer: batch %d, certified on a graph built at batch %d (graphs built at batches %s)", batch,
                    batch, ", ".join(map(str, built)))
        return MaxBatchResult(batch, schedule, graph, cost, cap, MappingProxyType(dict(sorted(self.tried.items()))),
                              method=method, reached_max_batch=reached, built=built)


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


# Seconds an ``optimal`` probe of the scaled search gets above the heuristics' reach (at most
# the strategy's own time_limit). On ResNet50 at 64x64 and 400 MB the same search with 600 s
# probes answered as with these (benchmarks/results/maxbatch.md).
_PROBE_SECONDS = 20.0


def _scaled(graph_for_batch, evaluate: _Evaluator, min_batch: int, max_batch: int, batch_progress,
            probe_seconds: float, memory_graph_for_batch: Callable[[int], DFGraph] | None = None) -> MaxBatchResult:
    """``method="scaled"``: the search on graphs scaled from two built ones.

    Building a graph (profiling every layer) is what makes a search slow, and a graph's
    bytes are affine in the batch wherever its shapes are (CPU convolution scratch can
    step), its profiled costs nearly so (their drift moves only the overhead cap's
    verdict). So graphs are built at twice and four times
    ``min_batch`` (``min_batch`` itself only when twice it does not fit: at batch 1 a
    batch-norm gradient can differ) and every larger batch is judged on their affine
    extension (:func:`affine_graphs`), by :func:`_climb` for ``optimal`` and by the
    strategy itself otherwise. The line's answer is then built and certified there, or
    a smaller batch is (:func:`_certify_built`): the answer ``B`` has a schedule that fits
    the graph built at ``B`` within the budget and the overhead cap; ``B + 1`` was refused
    on a line (for ``optimal``: proven by the memory lower bound, or no schedule within the
    cap found by the heuristics nor by a probe of ``probe_seconds``) or on its built graph.
    With ``memory_graph_for_batch`` the certifying builds measure bytes only
    (:func:`_certifying_graph`).
    """
    extracted: dict[int, DFGraph] = {}

    def exact(batch: int) -> bool:
        if batch not in extracted:
            extracted[batch] = graph_for_batch(batch)
            ok = evaluate(batch, extracted[batch])
            if batch_progress is not None:
                batch_progress(batch, ok)
        return evaluate.tried[batch]

    low, high = min_batch, max_batch + 1  # low fits; high does not (max_batch + 1: not searched)
    for batch in (2 * min_batch, 4 * min_batch):
        if batch > max_batch:
            break
        if not exact(batch):
            high = batch
            break
        low = batch
    if low == min_batch and not exact(min_batch):
        raise evaluate.refused(min_batch, extracted[min_batch])
    while high - low > 1 and _anchors(extracted) is None:
        # No two built graphs share their structure (batch 1 can differ): build the next doubling.
        candidate = 2 * max(extracted)
        if candidate >= high:
            break
        if exact(candidate):
            low = candidate
        else:
            high = candidate
    pair = _anchors(extracted)
    if high - low > 1 and pair is not None:
        near, far = pair
        line = affine_graphs(extracted[near], near, extracted[far], far)
        low = _search_line(line, evaluate, low, high, probe_seconds)
        logger.info("batch %d fits on graphs scaled from batches %d and %d", low, near, far)
        if low not in extracted:
            def build(batch: int) -> DFGraph:
                return _certifying_graph(graph_for_batch, memory_graph_for_batch, line, batch)

            low = _certify_built(build, extracted, evaluate, low, probe_seconds, batch_progress)
    return evaluate.result(low, max_batch, method="scaled", built=tuple(extracted))


def _search_line(scaled: Callable[[int], DFGraph], evaluate: "_Evaluator", low: int, high: int,
                 probe_seconds: float) -> int:
    """The largest batch in ``[low, high)`` that fits on the scaled graphs, given that ``low``
    fits: :func:`_climb` for ``optimal``, the strategy itself at each batch otherwise."""
    if evaluate.strategy == "optimal":
        return _climb(scaled, evaluate, low, high, probe_seconds)
    return _largest(lambda batch: evaluate(batch, scaled(batch)), low, high - 1)


# Graphs the scaled search builds at and below the line's answer to certify it. Each is a
# profile at a large batch, the dearest step of the search (ResNet50 at 64x64: 2-5 times a
# tiny batch's build, benchmarks/maxbatch.py).
_CERTIFY_BUILDS = 3


def _certify_built(graph_for_batch: Callable[[int], DFGraph], extracted: dict[int, DFGraph],
                   evaluate: "_Evaluator", candidate: int, probe_seconds: float,
                   batch_progress: Callable[[int, bool], object] | None) -> int:
    """The line's answer ``candidate``, or a smaller batch, certified on a graph built at it.

    A line through tiny-batch profiles can be off at the answer (CPU convolution scratch
    that is not affine in the batch, a forward share of the cost that shrinks as the batch
    grows, so a looser overhead cap), and a schedule tight on the line can then overshoot
    the built graph. So the answer's graph is built and a schedule that fits it within the
    overhead cap sought there (:func:`_certify_graph`); when none is found, the next
    candidate is the line's answer on the line through the two built graphs that bracket
    it (the largest that fits below, the one that did not), which the built graph corrects
    where the search is; where those two graphs differ in nodes, the batch halfway between
    them (the answer may then be below the largest that fits). At most ``_CERTIFY_BUILDS``
    graphs are built; past that, the answer is the largest built batch that fits, with a
    warning.
    """
    for _ in range(_CERTIFY_BUILDS):
        extracted[candidate] = graph_for_batch(candidate)
        ok = _certify_graph(candidate, extracted[candidate], evaluate, probe_seconds)
        if batch_progress is not None:
            batch_progress(candidate, ok)
        if ok:
            return candidate
        below = max(b for b in extracted if b < candidate and evaluate.tried[b])
        if candidate - below <= 1:
            return below
        if _same_structure(extracted[below], extracted[candidate]):
            line = affine_graphs(extracted[below], below, extracted[candidate], candidate)
            next_candidate = _search_line(line, evaluate, below, candidate, probe_seconds)
            how = f"the line through the graphs built at batches {below} and {candidate}"
        else:
            next_candidate, how = (below + candidate) // 2, "bisection (the built graphs differ in nodes)"
        logger.info("batch %d does not fit on the graph built at it; next candidate %d, from %s",
                    candidate, next_candidate, how)
        if next_candidate == below:
            return below
        candidate = next_candidate
    best = max(b for b in extracted if evaluate.tried[b])
    logger.warning("no batch the line proposed was certified on its built graph within %d builds; answering "
                   "batch %d, the largest built batch that fits (method='search' judges built graphs only)",
                   _CERTIFY_BUILDS, best)
    return best


def _certifying_graph(graph_for_batch: Callable[[int], DFGraph],
                      memory_graph_for_batch: Callable[[int], DFGraph] | None,
                      line: Callable[[int], DFGraph], batch: int) -> DFGraph:
    """The graph a scaled search certifies ``batch`` on: built at ``batch`` by
    ``graph_for_batch``, or with ``memory_graph_for_batch`` its bytes built there (no timing:
    ResNet50 at 64x64, batch 142: 54.8 s -> 27.1 s, benchmarks/results/maxbatch_quick.md)
    and its costs those of ``line``, the profiled graphs' line, at ``batch``: a memory-only
    build has FLOP costs, and the overhead cap must stay on profiled ones.

    Where the memory-only graph differs in nodes from the line's, or carries
    implementations (their costs are FLOPs, and the line has none), no profiled cost fits
    it: the graph is then built by ``graph_for_batch`` as well, and that one is certified."""
    if memory_graph_for_batch is None:
        return graph_for_batch(batch)
    graph, scaled = memory_graph_for_batch(batch), line(batch)
    if _same_structure(graph, scaled) and not graph.implementations:
        return graph.replaced(cost=scaled.cost, name=f"{graph.name} (costs scaled)")
    logger.info("batch %d: the memory-only graph %s; building the profiled graph to certify on", batch,
                "carries implementations" if graph.implementations else "differs in nodes from the profiled line's")
    return graph_for_batch(batch)


def _certify_graph(batch: int, graph: DFGraph, evaluate: "_Evaluator", probe_seconds: float) -> bool:
    """Whether a schedule fits ``graph``, built at ``batch``, within the budget and the
    overhead cap, recorded: the schedule the line found at ``batch`` run as it is, then (for
    ``optimal``) the keep-everything and eviction schedules and an ``optimal`` probe of at
    most ``probe_seconds`` stopped at the first schedule within the cap, or (another
    strategy) the strategy itself on the graph."""
    line_schedule, line_graph = evaluate.found[batch][:2] if batch in evaluate.found else (None, None)
    # The line's schedule runs on the built graph when it has the same nodes and reads no
    # value the line's graph does not (the line keeps the edges its two graphs share).
    runs = (line_schedule is not None and not line_schedule.offloads and _same_structure(line_graph, graph)
            and set(graph.edges) <= set(line_graph.edges))
    if runs and evaluate.fits_as_is(line_schedule, graph):
        evaluate.certify(batch, line_schedule, graph)
        logger.info("batch %d: %s", batch, "fits (the line's schedule, on the graph built at it)")
        return True
    if evaluate.strategy != "optimal":
        return evaluate(batch, graph)
    return (evaluate(batch, graph, heuristic=eviction)
            or evaluate(batch, graph, time_limit=probe_seconds, first_within_cap=True))


def _climb(scaled: Callable[[int], DFGraph], evaluate: "_Evaluator", low: int, high: int,
           probe_seconds: float) -> int:
    """The largest batch in ``[low, high)`` that ``optimal`` fits on the scaled graphs, given
    that ``low`` fits, found from certificates and solving only where they leave a gap.

    From below: the keep-everything schedule (the least cost there is) and then
    ``eviction``'s schedule (the portfolio's best on training graphs, and ``optimal``
    starts from it) certify the batches they fit, each carried up as far as it fits
    (:func:`_reach`: a fixed schedule's peak is convex in the batch); from above, no batch
    whose :func:`memory_lower_bound` exceeds the budget fits. In the gap, the batch above
    the best certificate gets one ``optimal`` probe of at most ``probe_seconds``, stopped at
    the first schedule within the overhead cap (Checkmate sec. 6.3 asks only for a schedule
    that fits, not the cheapest); each schedule found is carried up and the next batch
    probed, until a probe finds none. Every batch judged is recorded.
    """
    def carry(schedule: Schedule, start: int) -> int:
        top = _reach(schedule, scaled, evaluate, start, high)
        if top > start:
            evaluate.certify(top, schedule, scaled(top))
        return top

    keep_all = schedule_from_keep_matrix(scaled(low), checkpoint_all_s(scaled(low)), "checkpoint_all")
    if evaluate.fits_as_is(keep_all, scaled(low)):
        low = carry(keep_all, low)
    high = min(high, _gallop(lambda b: memory_lower_bound(scaled(b)) <= evaluate.budget, low, high) + 1)
    if low in evaluate.found:
        low = carry(evaluate.found[low][0], low)  # a built batch's schedule, carried up the line
    low = _bisect(lambda b: evaluate(b, scaled(b), heuristic=eviction), low, high)
    low = carry(evaluate.found[low][0], low)
    while low + 1 < high and evaluate(low + 1, scaled(low + 1), time_limit=probe_seconds, first_within_cap=True):
        low = carry(evaluate.found[low + 1][0], low + 1)
    return low


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
    """Same nodes in the same order (the edges may differ: see :func:`affine_graphs`)."""
    return (a.names, a.is_backward) == (b.names, b.is_backward)


def _anchors(extracted: Mapping[int, DFGraph]) -> tuple[int, int] | None:
    """The two extracted batches farthest apart whose graphs share their nodes (the line
    through them is the best estimate), or None."""
    batches = sorted(extracted)
    pairs = [(near, far) for far in batches for near in batches
             if near < far and _same_structure(extracted[near], extracted[far])]
    return max(pairs, key=lambda pair: pair[1] - pair[0]) if pairs else None


def affine_graphs(graph_a: DFGraph, batch_a: int, graph_b: DFGraph, batch_b: int) -> Callable[[int], DFGraph]:
    """The graph at any batch, each node's output and workspace bytes and cost, and the
    fixed bytes, on the line through their values in ``graph_a`` (at ``batch_a``) and
    ``graph_b`` (at ``batch_b``), rounded to whole bytes and never below zero.

    Its edges are those both graphs have: a read one graph alone shows is taken for an
    artifact of its small batch (ResNet50 at 64x64 sizes some batch-norm residuals from
    one run on a sample batch: its gradients read their forward outputs in 569 edges at
    batch 2, 565 at batch 4 and 552 at both, while the graph at batch 142 has 542, all
    among those 552; :mod:`tfremat.extract.analysis`).

    Raises:
        ArgumentError: the two graphs differ in nodes (a model whose structure depends on
            the batch cannot be scaled).
    """
    if not _same_structure(graph_a, graph_b):
        raise ArgumentError(f"graphs at batch {batch_a} and {batch_b} differ in nodes; they cannot be "
                            "scaled to other batch sizes (use method='search')")
    shared = set(graph_a.edges) & set(graph_b.edges)
    edges = sorted(shared)
    # A residual is the part of an output that only its backward node reads: none where
    # that read is dropped.
    unread = np.array([(i, graph_a.backward_of.get(i)) not in shared for i in range(graph_a.size)])
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
            graph_a.names, edges, line(graph_a.cost, graph_b.cost, batch, whole=False),
            line(graph_a.output_bytes, graph_b.output_bytes, batch, whole=True), workspace.tolist(),
            graph_a.is_backward, graph_a.loss_node, dict(graph_a.forward_of),
            int(line([graph_a.fixed_bytes], [graph_b.fixed_bytes], batch, whole=True)[0]),
            name=f"{graph_a.name} (batch {batch}, scaled)",
            residual_bytes=np.where(unread, 0, np.minimum(
                line(graph_a.residual_bytes, graph_b.residual_bytes, batch, whole=True),
                line(graph_a.output_bytes, graph_b.output_bytes, batch, whole=True))).tolist(),
            weight_grad_bytes=graph_a.weight_grad_bytes, weight_grads_to_end=graph_a.weight_grads_to_end,
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
                          method="direct", upper_bound=max(upper, batch), reached_max_batch=reached,
                          built=tuple(dict.fromkeys((small, large, batch))))


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
