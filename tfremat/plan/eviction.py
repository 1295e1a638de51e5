"""``eviction``: a fast schedule for any DAG by on-demand eviction with look-ahead.

Checkmate's baselines need a forward/backward split or articulation points; this
strategy needs neither, and it gives the MILP a warm start close to optimal on the
training graphs in well under a second (benchmarks/solvers.py). It runs the nodes in order like an
eager framework under a memory limit: before a node runs, its missing inputs are
recomputed (recursively); when the node's output and workspace do not fit, resident
values that the running computation does not read are evicted, least valuable first.
A value's worth is its recompute cost (itself plus every non-resident ancestor it would
need) per byte and per stage until its next reader (the look-ahead that dynamic
rematerialization, Kirisame et al. 2021, has to guess), with a few exponents on bytes
and distance tried in turn. After each node, values that
no later node reads are freed, and what remains resident becomes the keep matrix row
of the next stage; :func:`~tfremat.plan.schedule.schedule_from_keep_matrix` completes
it with the cheapest recomputation.

The eviction run orders recomputations depth-first while a stage computes in node
order, so its memory is an estimate; the strategy runs it under several limits around
the budget and keeps the cheapest schedule whose simulated peak fits. The simulator is
the only judge of memory.

It does poorly on graphs where a value must be kept only to make a later recomputation
cheap (the random layered graphs, with a sink that reads 44 values): eviction cannot
see that, and the run may find no schedule at all there; ``optimal`` does.
"""

from __future__ import annotations

import bisect

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.baselines import cheapest_fitting, known_peak, time_is_up
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, schedule_from_keep_matrix
from tfremat.plan.simulator import checkpoint_all_peak

__all__ = ["eviction", "eviction_keep_matrix"]

# Memory limits of the eviction run, as fractions of the budget less the fixed bytes.
_LIMITS = (1.1, 1.05, 1.0, 0.97, 0.94, 0.9, 0.85, 0.8, 0.7, 0.6)
# Exponents (bytes, distance to the next reader) of a value's worth. No one pair wins
# everywhere on the training graphs of benchmarks/solvers.py (each is best on one of
# ResNet50, MobileNet and U-Net), so the strategy tries all and keeps the cheapest.
_WORTH_EXPONENTS = ((1.0, 1.0), (1.0, 0.5), (1.5, 1.0))
# A run that recomputes this many times the cost of one pass is abandoned.
_THRASHING = 4.0


class _Thrashing(Exception):
    """An eviction run's compute cost passed ``_THRASHING`` passes."""


class _EvictionRun:
    """State of one eviction run: which values are resident and what they occupy."""

    def __init__(self, graph: DFGraph, limit_bytes: float, exponents: tuple[float, float]):
        self.graph = graph
        self.give_up = _THRASHING * graph.total_cost
        self.limit = limit_bytes
        self.size_exponent, self.distance_exponent = exponents
        self.readers = [sorted(s) for s in graph.successors]
        self.resident: set[int] = set()
        self.used = 0
        self.pinned = [0] * graph.size
        self.now = 0
        self.cost = 0.0
        # Recompute costs (_recompute_costs) still true of the resident set: kept from one
        # eviction to the next, since most of them do not change between two.
        self.known: dict[int, float] = {}

    def _add(self, node: int) -> None:
        self.resident.add(node)
        self._forget_readers_of(node)

    def _drop(self, node: int) -> None:
        self.resident.discard(node)
        self._forget_readers_of(node)

    def _forget_readers_of(self, node: int) -> None:
        """Forgets the known recompute costs that ``node``'s residency entered: its
        readers', and onward through readers that are not resident (a resident one's own
        cost does not count in its readers')."""
        successors, known, resident = self.graph.successors, self.known, self.resident
        stack = [s for s in successors[node] if s in known]
        while stack:
            reader = stack.pop()
            if known.pop(reader, None) is not None and reader not in resident:
                stack.extend(s for s in successors[reader] if s in known)

    def _recompute_costs(self, values) -> dict[int, float]:
        """Cost of recomputing each value from what is resident, shared ancestors counted
        once per path (an overestimate that grows with the depth of the recomputation).
        A node's cost reads only the residency of its non-resident ancestors' inputs, so
        the costs known from earlier calls stay (:meth:`_forget_readers_of` drops the rest):
        recomputing them all at every eviction was most of a 1,541-node graph's eviction
        runs (benchmarks/results/min_large_graph.md)."""
        pred, cost, resident = self.graph.predecessors, self.graph.cost, self.resident
        memo = self.known
        for value in values:
            stack = [value]
            while stack:
                node = stack[-1]
                if node in memo:
                    # Reached again by another path of a dense block: known, not scanned again.
                    stack.pop()
                    continue
                missing = [p for p in pred[node] if p not in resident and p not in memo]
                if missing:
                    stack.extend(missing)
                    continue
                stack.pop()
                memo[node] = cost[node] + sum(memo[p] for p in pred[node] if p not in resident)
        return memo

    def _worth(self, value: int, recompute: dict[int, float]) -> float:
        size = self.graph.output_bytes[value]
        if size == 0:
            return np.inf
        readers = self.readers[value]
        position = bisect.bisect_left(readers, self.now)
        next_reader = readers[position] if position < len(readers) else self.graph.size
        distance = next_reader - self.now + 1
        return recompute[value] / (size**self.size_exponent * distance**self.distance_exponent)

    def _make_room(self, nbytes: int) -> None:
        if self.used + nbytes <= self.limit:
            return
        candidates = [v for v in self.resident if not self.pinned[v]]
        recompute = self._recompute_costs(candidates)
        for value in sorted(candidates, key=lambda v: self._worth(v, recompute)):
            if self.used + nbytes <= self.limit:
                return
            self._drop(value)
            self.used -= self.graph.output_bytes[value]

    def materialize(self, target: int) -> None:
        """Makes ``target`` resident, recomputing missing ancestors first; the inputs of a
        node are pinned from the moment its computation is planned until it runs."""
        pred, out, work = self.graph.predecessors, self.graph.output_bytes, self.graph.workspace_bytes
        stack = [(target, False)]
        while stack:
            node, inputs_ready = stack.pop()
            if node in self.resident:
                continue
            if not inputs_ready:
                stack.append((node, True))
                for p in pred[node]:
                    self.pinned[p] += 1
                stack.extend((p, False) for p in pred[node] if p not in self.resident)
                continue
            self._make_room(out[node] + work[node])
            self._add(node)
            self.used += out[node]
            self.cost += self.graph.cost[node]
            if self.cost > self.give_up:
                # Inside the stage, not after it: one node's recursive recomputations, each
                # evicting what the next needs, ran for minutes on a 1,541-node graph
                # (benchmarks/results/min_large_graph.md).
                raise _Thrashing
            for p in pred[node]:
                self.pinned[p] -= 1

    def free_dead(self) -> None:
        dead = [v for v in self.resident if not self.readers[v] or self.readers[v][-1] <= self.now]
        for value in dead:
            self._drop(value)
            self.used -= self.graph.output_bytes[value]


def eviction_keep_matrix(
    graph: DFGraph, limit_bytes: float, exponents: tuple[float, float] = (1.0, 1.0)
) -> np.ndarray | None:
    """The keep matrix of an eviction run under ``limit_bytes`` (besides the fixed bytes),
    or None when the run thrashes: its compute cost passes ``_THRASHING`` times the
    cost of running every node once (or it passes the deadline of a
    :func:`~tfremat.plan.baselines.heuristic_deadline` block).

    A value's worth is ``recompute cost / (bytes ** a * (stages to next reader + 1) ** b)``
    with ``(a, b) = exponents``.
    """
    n = graph.size
    run = _EvictionRun(graph, limit_bytes, exponents)
    S = np.zeros((n, n), dtype=bool)
    for t in range(n):
        if t % 128 == 127 and time_is_up(allow_step=False):
            return None  # past the deadline of tfremat.plan.baselines.heuristic_deadline
        run.now = t
        try:
            run.materialize(t)
        except _Thrashing:
            return None
        run.free_dead()
        if t + 1 < n:
            S[t + 1, list(run.resident)] = True
    return S


@as_strategy("eviction")
def eviction(graph: DFGraph, budget: int | None = None) -> Schedule:
    """The cheapest eviction schedule that fits ``budget`` (see the module docstring).

    Without a budget, the lowest-peak schedule found is returned.

    Raises:
        InfeasibleBudgetError: no schedule tried fits; carries the smallest peak reached.
    """
    if budget is None:
        reference = checkpoint_all_peak(graph)
    capacity = (reference if budget is None else budget) - graph.fixed_bytes
    return cheapest_fitting(graph, _all_candidates(graph, capacity, budget), budget, "eviction")


def _all_candidates(graph: DFGraph, capacity: int, budget: int | None):
    """Every exponent pair's schedules; when the first pair finds none that fits, the
    others are not tried: they refine a schedule, they have not rescued a graph (on the
    random layered graphs all three thrash)."""
    first, *others = _WORTH_EXPONENTS
    if (yield from _candidates(graph, capacity, budget, first)):
        for exponents in others:
            yield from _candidates(graph, capacity, budget, exponents)


def _candidates(graph: DFGraph, capacity: int, budget: int | None, exponents: tuple[float, float]):
    """Schedules under tighter and tighter limits; a tighter limit costs more, so the
    sweep ends one limit after the first schedule that fits, or when a run thrashes.
    Returns (to ``yield from``) whether some schedule fits the budget."""
    fitted = 0
    for fraction in _LIMITS:
        S = eviction_keep_matrix(graph, fraction * capacity, exponents)
        if S is None:
            break
        schedule = schedule_from_keep_matrix(graph, S, "eviction")
        yield schedule
        if budget is None:
            fitted = 1
        else:
            # cheapest_fitting has just simulated it (known_peak remembers): not a second time.
            fitted += bool(fitted) or known_peak(graph, schedule) <= budget
            if fitted >= 2:
                break
    return fitted > 0
