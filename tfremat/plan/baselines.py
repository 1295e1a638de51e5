"""Baseline rematerialization strategies, as generalized to DAGs by Checkmate.

Every strategy is a function ``(graph, budget=None, **options) -> Schedule``, its budget
any form the registry parses (bytes, "3.5GiB", "80%" or 0.8 of the checkpoint-all peak;
see :mod:`tfremat.plan.registry`). The chain heuristics work on a sequence of *units*:
contiguous runs of forward nodes in the topological order. Checkmate (Jain et al. 2020,
sec. 6.1) generalizes them to DAGs in two ways, both available here:

* ``*_ap``: checkpoint candidates are the articulation points of the forward graph, so a
  unit is the block of nodes between two of them;
* plain names: the linearized topological order, every forward node a candidate.

A set of checkpoints becomes a keep matrix by :func:`keep_matrix`: checkpoints (and all
gradient values) are kept from their computation until their last reader; every other
forward value is kept during the forward pass until its last forward reader, then
recomputed once, when the backward pass first reaches its unit, and kept until its last
reader (Chen et al. 2016's segment recomputation). ``solve R given S`` then adds the
recomputations.

Given a budget, a family (Chen greedy over its segment budget, Griewank over its slot
count) returns its cheapest candidate whose *simulated* peak fits, or raises
:class:`InfeasibleBudgetError` with the smallest peak it reached. Hong et al.'s DPs are in
:mod:`tfremat.plan.hong`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import math
import time
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, is_int
from tfremat.graph import DFGraph
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix
from tfremat.plan.simulator import SimulationResult, simulate

__all__ = [
    "HeuristicDeadline",
    "heuristic_deadline",
    "current_deadline",
    "time_is_up",
    "known_peak",
    "recorded_candidates",
    "keep_matrix",
    "schedule_for_checkpoints",
    "checkpoint_all",
    "checkpoint_all_ap",
    "chen_sqrtn",
    "chen_sqrtn_ap",
    "chen_greedy",
    "chen_greedy_ap",
    "griewank_logn",
    "griewank_logn_ap",
    "revolve_advances",
]

logger = logging.getLogger(__name__)


# ----- deadlines -----


@dataclasses.dataclass
class HeuristicDeadline:
    """A ``time.perf_counter()`` time the heuristics stop at (:func:`heuristic_deadline`).

    Attributes:
        at: the deadline.
        step: the longest single step seen under it (one candidate built and simulated,
            or one eviction run): a heuristic does not start a step it predictably cannot
            finish before ``at``.
    """

    at: float
    step: float = 0.0

    def left(self) -> float:
        return self.at - time.perf_counter()

    def record(self, seconds: float) -> None:
        self.step = max(self.step, seconds)

    def no_time_for_a_step(self) -> bool:
        """The deadline has passed, or the time left is less than the longest step seen."""
        return self.left() <= self.step


_DEADLINE: contextvars.ContextVar[HeuristicDeadline | None] = contextvars.ContextVar("tfremat_heuristic_deadline",
                                                                                     default=None)


@contextlib.contextmanager
def heuristic_deadline(at: float | None):
    """Within the block, the heuristics (every family of this module, ``eviction`` and
    ``repair``) stop at ``at`` (a ``time.perf_counter()`` time; None: no deadline, or the
    enclosing block's): they try no further candidate once the time left is less than
    the longest candidate took, and return the cheapest that fits so far, or raise
    :class:`InfeasibleBudgetError` saying the time ran out. A nested block's deadline is
    the earlier of the two. Yields the :class:`HeuristicDeadline` (None without one).
    """
    outer = _DEADLINE.get()
    if at is None:
        yield outer
        return
    scope = HeuristicDeadline(min(at, outer.at) if outer is not None else at, outer.step if outer is not None else 0.0)
    token = _DEADLINE.set(scope)
    try:
        yield scope
    finally:
        _DEADLINE.reset(token)
        if outer is not None:
            outer.record(scope.step)


def current_deadline() -> HeuristicDeadline | None:
    """The deadline of the innermost :func:`heuristic_deadline` block, or None."""
    return _DEADLINE.get()


def time_is_up(allow_step: bool = True) -> bool:
    """Whether a heuristic should stop: past the current deadline, or (``allow_step``)
    with less time left than the longest step seen. False without a deadline."""
    scope = _DEADLINE.get()
    if scope is None:
        return False
    return scope.no_time_for_a_step() if allow_step else scope.left() <= 0


def out_of_time_error(budget, smallest_peak, strategy: str) -> InfeasibleBudgetError:
    """The error of a heuristic stopped by the deadline before any candidate fitted."""
    return InfeasibleBudgetError(budget, min_feasible_bytes=smallest_peak, strategy=strategy,
                                 detail="the time limit ran out")


class _OutOfTime(Exception):
    """A heuristic's inner loop passed the current deadline."""


# Simulations of live schedules, so that nothing simulates a schedule twice (the portfolio
# a returned one, capper the candidate cheapest_fitting just judged): on a 10,000-node graph
# a simulation takes seconds. Weak keys: a dropped candidate takes its result with it.
_SIMULATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def known_simulation(graph: DFGraph, schedule: Schedule) -> SimulationResult:
    """``simulate(graph, schedule)``, remembered while the schedule lives."""
    known = _SIMULATIONS.get(schedule)
    if known is not None and known[0] is graph:
        return known[1]
    result = simulate(graph, schedule)
    _SIMULATIONS[schedule] = (graph, result)
    return result


def known_peak(graph: DFGraph, schedule: Schedule) -> int:
    """``simulate(graph, schedule).peak_bytes``, remembered while the schedule lives."""
    return known_simulation(graph, schedule).peak_bytes


# Where cheapest_fitting notes every candidate it judges (recorded_candidates), or None.
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("tfremat_recorded_candidates", default=None)


@contextlib.contextmanager
def recorded_candidates():
    """Within the block, :func:`cheapest_fitting` appends ``(peak bytes, cost)`` of every
    candidate it simulates to the list it yields (the cost as
    :meth:`~tfremat.plan.schedule.Schedule.cost` counts it).

    For a family whose candidates do not depend on the budget
    (:attr:`~tfremat.plan.registry.Strategy.fixed_candidates`), one call records what a
    call at any budget would choose among: ``least_budget_within`` asks the same families
    at dozens of budgets of a 1,541-node graph, where each call built and simulated up to
    50 candidates again (benchmarks/results/min_large_graph.md).
    """
    seen: list[tuple[int, float]] = []
    token = _RECORD.set(seen)
    try:
        yield seen
    finally:
        _RECORD.reset(token)


# ----- turning checkpoints into schedules -----


def _forward_order(graph: DFGraph) -> list[int]:
    return list(graph.forward_nodes)


def _forward_phase_end(graph: DFGraph) -> int:
    """The last stage of the forward pass: the loss node's (or the last node without a loss)."""
    return graph.loss_node if graph.loss_node is not None else graph.size - 1


def _units_between(graph: DFGraph, boundaries: Iterable[int]) -> list[list[int]]:
    """Splits the forward order into units, each ending at a boundary node (the last may not)."""
    boundaries = set(boundaries)
    units: list[list[int]] = [[]]
    for node in _forward_order(graph):
        units[-1].append(node)
        if node in boundaries:
            units.append([])
    return [u for u in units if u]


def keep_matrix(
    graph: DFGraph,
    static_keeps: Iterable[int],
    units: Sequence[Sequence[int]],
    dynamic_keeps: Iterable[tuple[int, int]] = (),
) -> np.ndarray:
    """The keep matrix S of a checkpointing heuristic.

    Args:
        graph: the graph.
        static_keeps: forward nodes kept from their computation until their last reader.
            Backward nodes (gradients) are always kept that way.
        units: contiguous runs of forward nodes. A non-kept value is recomputed once
            when the backward pass first reads any member of its unit, then kept until
            its last reader.
        dynamic_keeps: ``(node, stage)`` pairs: the value is (re)computed in ``stage``
            and kept from then until its last reader (Griewank's snapshots taken during
            the backward pass).
    """
    n = graph.size
    forward_phase_end = _forward_phase_end(graph)
    S = np.zeros((n, n), dtype=bool)
    last_reader = [max(s) if s else -1 for s in graph.successors]
    forward_keep_end = {}
    for i in graph.forward_nodes:
        forward_readers = [k for k in graph.successors[i] if k <= forward_phase_end]
        forward_keep_end[i] = max(forward_readers, default=i)
        S[i + 1 : forward_keep_end[i] + 1, i] = True
    for i in list(static_keeps) + list(graph.backward_nodes):
        S[i + 1 : last_reader[i] + 1, i] = True
    for unit in units:
        backward_readers = [k for i in unit for k in graph.successors[i] if k > forward_phase_end]
        if not backward_readers:
            continue
        entry = min(backward_readers)
        for i in unit:
            # A value still resident when the backward pass enters its unit (the last
            # segment before the loss) is kept on rather than freed and recomputed.
            start = i + 1 if entry <= forward_keep_end[i] + 1 else entry + 1
            S[start : last_reader[i] + 1, i] = True
    for node, stage in dynamic_keeps:
        S[stage + 1 : last_reader[node] + 1, node] = True
    return S


def schedule_for_checkpoints(graph: DFGraph, checkpoints: Iterable[int], strategy: str) -> Schedule:
    """The schedule that keeps ``checkpoints`` (forward nodes) as :func:`keep_matrix` describes."""
    checkpoints = sorted(set(checkpoints))
    kept = set(checkpoints)
    units = [[i for i in u if i not in kept] for u in _units_between(graph, checkpoints)]
    S = keep_matrix(graph, checkpoints, units)
    return schedule_from_keep_matrix(graph, S, strategy)


def _candidates(graph: DFGraph, articulation: bool) -> list[int]:
    return list(graph.forward_articulation_points) if articulation else _forward_order(graph)


def cheapest_fitting(graph: DFGraph, candidates: Iterable[Schedule], budget: int | None, strategy: str) -> Schedule:
    """The cheapest candidate whose simulated peak fits ``budget`` (or the lowest-peak one);
    cheapest by simulated makespan, which is the compute cost unless a schedule offloads.

    Without a budget the family's lowest-peak member is returned (ties: cheapest),
    which is what these heuristics were designed to find. Under a
    :func:`heuristic_deadline`, no further candidate is built once the time left is less
    than the longest one took; the best so far is returned, or InfeasibleBudgetError
    saying the time ran out.
    """
    best, best_key, smallest_peak = None, None, None
    seen = set()
    stopped = False
    iterator = iter(candidates)
    while True:
        scope = _DEADLINE.get()
        if scope is not None and scope.no_time_for_a_step():
            stopped = True
            break
        started = time.perf_counter()
        schedule = next(iterator, None)
        if schedule is None:
            break
        # A digest, not the bytes: 48 keep matrices of a 10,000-node graph are 4.8 GB.
        signature = hashlib.blake2b(np.packbits(schedule.S).tobytes(), digest_size=16).digest()
        if signature in seen:
            continue
        seen.add(signature)
        result = known_simulation(graph, schedule)
        if scope is not None:
            scope.record(time.perf_counter() - started)
        record = _RECORD.get()
        if record is not None:
            record.append((result.peak_bytes, schedule.cost(graph)))
        smallest_peak = result.peak_bytes if smallest_peak is None else min(smallest_peak, result.peak_bytes)
        if budget is not None and result.peak_bytes > budget:
            continue
        # The step's time: its compute cost, plus any wait for host copies (offloading).
        key = (result.makespan, result.peak_bytes) if budget is not None else (result.peak_bytes, result.makespan)
        if best_key is None or key < best_key:
            best, best_key = schedule, key
    scope = _DEADLINE.get()
    stopped = stopped or (scope is not None and scope.left() <= 0)
    if best is None:
        if stopped:
            raise out_of_time_error(budget, smallest_peak, strategy)
        raise InfeasibleBudgetError(budget, min_feasible_bytes=smallest_peak, strategy=strategy)
    if stopped:
        logger.info("%s: the time limit ran out after %d candidates", strategy, len(seen))
    logger.debug("%s: chose a schedule of %d candidates", strategy, len(seen))
    return best


# ----- checkpoint all -----


@as_strategy("checkpoint_all", fixed_candidates=True)
def checkpoint_all(graph: DFGraph, budget: int | None = None) -> Schedule:
    """Keep every value until its last reader: what frameworks do by default (no recomputation)."""
    schedule = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    return cheapest_fitting(graph, [schedule], budget, "checkpoint_all")


@as_strategy("checkpoint_all_ap", fixed_candidates=True)
def checkpoint_all_ap(graph: DFGraph, budget: int | None = None) -> Schedule:
    """Keep only the forward articulation points; recompute each block between them once.

    Checkmate's "checkpoint all (AP)" baseline: the smallest structural change that lets
    a DAG trade compute for memory.
    """
    schedule = schedule_for_checkpoints(graph, graph.forward_articulation_points, "checkpoint_all_ap")
    return cheapest_fitting(graph, [schedule], budget, "checkpoint_all_ap")


# ----- Chen et al. 2016 -----


def _sqrtn_checkpoints(candidates: Sequence[int]) -> list[int]:
    if not candidates:
        return []
    step = max(1, math.ceil(math.sqrt(len(candidates))))
    return list(candidates[step - 1 :: step])


def _chen_sqrtn(graph: DFGraph, budget: int | None, articulation: bool) -> Schedule:
    name = "chen_sqrtn_ap" if articulation else "chen_sqrtn"
    checkpoints = _sqrtn_checkpoints(_candidates(graph, articulation))
    return cheapest_fitting(graph, [schedule_for_checkpoints(graph, checkpoints, name)], budget, name)


@as_strategy("chen_sqrtn", fixed_candidates=True)
def chen_sqrtn(graph: DFGraph, budget: int | None = None) -> Schedule:
    """Chen et al. 2016: checkpoint every ceil(sqrt(k))-th of the k forward nodes (linearized)."""
    return _chen_sqrtn(graph, budget, articulation=False)


@as_strategy("chen_sqrtn_ap", fixed_candidates=True)
def chen_sqrtn_ap(graph: DFGraph, budget: int | None = None) -> Schedule:
    """Chen et al. 2016 sqrt(n) over the forward articulation points."""
    return _chen_sqrtn(graph, budget, articulation=True)


def _greedy_checkpoints(graph: DFGraph, candidates: set[int], segment_budget: float) -> list[int]:
    """Chen's greedy planner (Alg. 2): close a segment at the first candidate past ``segment_budget`` bytes."""
    checkpoints, accumulated = [], 0
    for node in _forward_order(graph):
        accumulated += graph.output_bytes[node]
        if accumulated > segment_budget and node in candidates:
            checkpoints.append(node)
            accumulated = 0
    return checkpoints


def _check_count(value, argument: str) -> None:
    """Raises ArgumentError unless ``value`` is an int >= 1 (how many candidates a family tries)."""
    if not is_int(value) or value < 1:
        raise ArgumentError(f"{argument} must be an int >= 1, got {value!r}")


def _chen_greedy(graph: DFGraph, budget: int | None, articulation: bool, num_segment_budgets: int) -> Schedule:
    name = "chen_greedy_ap" if articulation else "chen_greedy"
    _check_count(num_segment_budgets, "num_segment_budgets")
    candidates = set(_candidates(graph, articulation))
    sizes = [graph.output_bytes[i] for i in graph.forward_nodes if graph.output_bytes[i] > 0]
    if not sizes:
        # Nothing to trade: every segment budget closes a segment at every candidate, and
        # keeping everything is the family's only member. It is still this strategy's
        # schedule, under its name, and so is its error.
        schedule = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), name)
        return cheapest_fitting(graph, [schedule], budget, name)
    low, high = min(sizes), sum(sizes)
    # B = 0 closes a segment at every candidate: the keep-everything end of the family.
    segment_budgets = np.concatenate([[0.0], np.geomspace(low, high, num=num_segment_budgets - 1)])
    schedules = (
        schedule_for_checkpoints(graph, _greedy_checkpoints(graph, candidates, b), name)
        for b in segment_budgets
    )
    return cheapest_fitting(graph, schedules, budget, name)


@as_strategy("chen_greedy", fixed_candidates=True)
def chen_greedy(graph: DFGraph, budget: int | None = None, num_segment_budgets: int = 48) -> Schedule:
    """Chen et al. 2016 greedy planner, searched over the segment budget B (linearized order).

    Args:
        num_segment_budgets: how many values of B are tried (an int >= 1): B = 0 (a
            checkpoint at every candidate), then values spaced geometrically between
            the smallest activation and the sum of all activations.

    Raises:
        ArgumentError: ``num_segment_budgets`` is not an int >= 1.
    """
    return _chen_greedy(graph, budget, False, num_segment_budgets)


@as_strategy("chen_greedy_ap", fixed_candidates=True)
def chen_greedy_ap(graph: DFGraph, budget: int | None = None, num_segment_budgets: int = 48) -> Schedule:
    """Chen's greedy planner with checkpoints restricted to forward articulation points."""
    return _chen_greedy(graph, budget, True, num_segment_budgets)


# ----- Griewank & Walther: binomial checkpointing (revolve) -----


def revolve_advances(num_steps: int, max_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Optimal forward advances for reversing a chain with a limited number of snapshots.

    Griewank & Walther's binomial checkpointing, computed by dynamic programming with
    unit step costs instead of looked up in a table: ``cost[l, s]`` is the fewest forward
    steps needed to reverse ``l`` steps holding the input of the first one plus ``s``
    free snapshot slots, and ``advance[l, s]`` the optimal first advance before the
    next snapshot is stored.

        cost[1, s] = 0;  cost[l, 0] = l (l - 1) / 2;
        cost[l, s] = min_{1 <= k < l} k + cost[l - k, s - 1] + cost[k, s].

    Returns:
        ``(cost, advance)``, both of shape ``(num_steps + 1, max_slots + 1)``.

    It takes O(num_steps^2 max_slots) time (minutes for 2500 steps); under a
    :func:`heuristic_deadline` it stops at the deadline.
    """
    L, s_max = num_steps, max_slots
    cost = np.zeros((L + 1, s_max + 1))
    advance = np.ones((L + 1, s_max + 1), dtype=int)
    lengths = np.arange(L + 1)
    cost[:, 0] = lengths * (lengths - 1) / 2
    for length in range(2, L + 1):
        if length % 64 == 0 and time_is_up(allow_step=False):
            raise _OutOfTime
        # Every slot count at once (a Python loop per slot count is far slower). With
        # s >= length - 1 slots the recurrence no longer depends on s (by induction on
        # length), so those columns repeat the column s = length - 1.
        top = min(s_max, length - 1)
        if top < 1:
            continue
        k = np.arange(1, length)
        slots = np.arange(1, top + 1)[:, None]
        totals = k + cost[length - k, slots - 1] + cost[k, slots]
        best = np.argmin(totals, axis=1)
        cost[length, 1 : top + 1] = totals[np.arange(top), best]
        advance[length, 1 : top + 1] = k[best]
        cost[length, top + 1 :] = cost[length, top]
        advance[length, top + 1 :] = advance[length, top]
    return cost, advance


def _revolve_snapshots(units: Sequence[Sequence[int]], slots: int, advance: np.ndarray, entry_stage: Sequence[int | None]):
    """Static and dynamic snapshots of revolve over ``units`` with ``slots`` free slots.

    A snapshot at position m (1 <= m < len(units)) keeps the last value of unit m-1,
    the input of unit m. Snapshots taken while the first forward sweep passes are static;
    the others are taken when the backward pass enters the segment being reversed.
    """
    static, dynamic = [], []
    stack = [(0, len(units), slots, None)]
    while stack:
        p, q, s, stage = stack.pop()
        if q - p <= 1 or s == 0:
            continue
        m = p + int(advance[q - p, s])
        node = units[m - 1][-1]
        if stage is None:
            static.append(node)
        else:
            dynamic.append((node, stage))
        stack.append((m, q, s - 1, stage))
        left_entry = entry_stage[m - 1]
        if left_entry is not None:
            stack.append((p, m, s, left_entry))
    return static, dynamic


def _griewank(graph: DFGraph, budget: int | None, articulation: bool, slots: int | None, max_slot_counts: int) -> Schedule:
    name = "griewank_logn_ap" if articulation else "griewank_logn"
    # A negative count would index the revolve table from its end (-1: the most slots).
    if slots is not None and (not is_int(slots) or slots < 0):
        raise ArgumentError(f"slots must be None or an int >= 0 (free snapshot slots), got {slots!r}")
    _check_count(max_slot_counts, "max_slot_counts")
    boundaries = _candidates(graph, articulation)
    units = _units_between(graph, boundaries)
    if len(units) <= 1:
        return cheapest_fitting(graph, [schedule_for_checkpoints(graph, [], name)], budget, name)
    forward_phase_end = _forward_phase_end(graph)
    entry_stage = []
    for unit in units:
        readers = [k for i in unit for k in graph.successors[i] if k > forward_phase_end]
        entry_stage.append(min(readers) if readers else None)
    max_slots = len(units) - 1
    try:
        _, advance = revolve_advances(len(units), max_slots)
    except _OutOfTime:
        raise out_of_time_error(budget, None, name) from None
    if slots is not None:
        slot_counts = [min(slots, max_slots)]
    elif budget is None:
        slot_counts = [min(max_slots, max(1, math.ceil(math.log2(len(units)))))]
    else:
        # Cost falls and peak rises with the slot count; a geometric sample of counts
        # (always including 0 and the keep-all count) keeps large graphs fast.
        slot_counts = sorted({0, max_slots, *np.unique(np.geomspace(1, max_slots, num=max_slot_counts).astype(int))})

    def candidates():
        for s in slot_counts:
            static, dynamic = _revolve_snapshots(units, s, advance, entry_stage)
            S = keep_matrix(graph, static, units, dynamic)
            yield schedule_from_keep_matrix(graph, S, name)

    return cheapest_fitting(graph, candidates(), budget, name)


@as_strategy("griewank_logn", fixed_candidates=True)
def griewank_logn(graph: DFGraph, budget: int | None = None, slots: int | None = None, max_slot_counts: int = 32) -> Schedule:
    """Griewank & Walther's revolve over the linearized forward order.

    Without a budget, uses ceil(log2(k)) snapshot slots for k forward nodes (the log(n)
    point of Checkmate's comparison); with a budget, every slot count is tried and the
    cheapest fitting schedule is returned.

    Args:
        slots: force this number of free snapshot slots (an int >= 0; more than the
            chain can use act as that many).
        max_slot_counts: with a budget, how many slot counts (geometrically spaced) are
            tried (an int >= 1; no slots and the keep-all count are always among them).

    Raises:
        ArgumentError: ``slots`` or ``max_slot_counts`` out of range.
    """
    return _griewank(graph, budget, False, slots, max_slot_counts)


@as_strategy("griewank_logn_ap", fixed_candidates=True)
def griewank_logn_ap(graph: DFGraph, budget: int | None = None, slots: int | None = None, max_slot_counts: int = 32) -> Schedule:
    """Revolve over the blocks between forward articulation points."""
    return _griewank(graph, budget, True, slots, max_slot_counts)
