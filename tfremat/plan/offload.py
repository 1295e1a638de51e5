"""Offloading activations to host memory: the heuristics of Beaumont et al. (2021, sec. 5.1)
on training graphs, and the move they share.

Beaumont, Eyraud-Dubois and Shilova, "Efficient Combination of Rematerialization and
Offloading for Training DNNs" (NeurIPS 2021, ``shared/papers/004_970af3ac90aaba55.txt``).
A schedule offloads through its host matrix ``H`` (:mod:`tfremat.plan.schedule`); the plan
times the copies over a link of ``bandwidth`` bytes per unit of the graph's cost
(:mod:`tfremat.plan.execution`) and the simulator replays both timelines, so every schedule
here is judged, and chosen, by its simulated peak and makespan.

The move (:func:`offload_gap`): a value kept on the device across stages where nothing
reads it goes to the host right after it is computed and comes back for its next reader.

* ``autocapper`` (sec. 5.1): *capper* takes a recompute-only schedule planned for a larger
  limit M', finds the stage of its simulated peak and offloads the lowest-indexed value
  resident and unread there, until the schedule fits; *autocapper* runs capper for limits
  evenly spaced between the budget and the checkpoint-all peak and keeps the fastest. With
  rotor as the base, every limit's sequence comes from one DP table, beside the rotor
  strategy's own schedules (its search on the graph) at the budget and a few limits, and a
  start that computes more than the fastest fitting schedule found is skipped (capper adds
  no compute).
* ``opportunist`` (sec. 5.1): keeps the link busy in the forward pass. The first forward
  node's value is offloaded, the following nodes are dropped (recomputed in the backward
  pass) until the copy is predicted to end, then the next node is offloaded, and so on; once
  the rest of the pass fits in memory kept whole, the remaining nodes are kept. Each group
  between two offloaded values is recomputed once when the backward pass reaches it.

* ``pofo`` / ``pofo_ap`` (sec. 4, appendix B): the DP of :mod:`tfremat.plan.pofo` on the
  chain :func:`~tfremat.plan.rotor.graph_chain` reads off the graph (every forward node a
  stage, or the blocks between forward articulation points). Its compute sequence becomes a
  keep matrix as rotor's does; each stage input it offloads moves to the host across the loss
  (:func:`offload_gap`), and the plan places the prefetches. The chain model misses DAG edges,
  so a few memory limits around the budget are read from one DP table
  (:func:`~tfremat.plan.pofo.solve_pofo_limits`; the two above the budget also from tables
  of their own, :data:`POFO_OWN_TABLE_LIMITS`), a schedule that overflows the budget
  gets capper's further offloads, and the fastest simulated schedule that fits is returned
  (rotor's own schedule among the candidates, so pofo is never slower than rotor).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, is_int, is_number
from tfremat.graph import DFGraph
from tfremat.plan import baselines, hong, rotor
from tfremat.plan.baselines import (
    _forward_order,
    _forward_phase_end,
    cheapest_fitting,
    keep_matrix,
    known_peak,
    known_simulation,
    time_is_up,
)
from tfremat.plan.pofo import MAX_POFO_CELLS, solve_pofo, solve_pofo_limits
from tfremat.plan.registry import Strategy, as_strategy
from tfremat.plan.schedule import Schedule, offloadable, schedule_from_keep_matrix, with_fresh_gradient_reads
from tfremat.plan.simulator import checkpoint_all_peak

__all__ = ["check_bandwidth", "offload_gap", "capper", "autocapper", "opportunist", "pofo", "pofo_ap",
           "AUTOCAPPER_LIMITS", "POFO_SLOTS", "POFO_LIMITS", "POFO_OWN_TABLE_LIMITS",
           "AUTOCAPPER_SEARCHED_LIMITS"]

# Sec. 5.1: "autocapper calls capper with 40 values of M', evenly spaced between the target
# M_GPU and M^high".
AUTOCAPPER_LIMITS = 40
# Of those, the limits where capper also starts from the rotor strategy's own schedule (its
# search on the graph fits each limit, where the DP's sequence may overflow it): those starts
# reach the budget faster on residual_chain at 80% and ResNet50 at 30% (slow link,
# benchmarks/chains.py; tests/test_offload.py).
AUTOCAPPER_SEARCHED_LIMITS = 8

# Sec. 4: "we systematically use 50 discretization steps"; fewer on chains too long for
# MAX_POFO_CELLS. The memory limits pofo reads from its table (in slots of the budget's
# activation bytes), as shares of them (the chain model over- or under-counts what the
# simulator holds).
POFO_SLOTS = 50
POFO_LIMITS = (1.0, 0.9, 1.1, 0.8, 1.25, 0.65)
# The limits above the budget are solved once more, each in a table of its own (memory_slots
# slots of that limit): the coarser slots round sizes and transfers otherwise and give the
# sequences from which capper reaches the budget fastest on VGG16 at 95% and vgg_chain at 60%
# (fast link), residual_chain at 80% and 50% (slow link), which the shared table alone loses;
# the shared table's own reading of them wins elsewhere (residual_chain at 95% and 90%, slow
# link; vgg_chain at 70%, fast link), so both are kept (benchmarks/offload_cells.py).
POFO_OWN_TABLE_LIMITS = (1.1, 1.25)

# The recompute-only strategies capper may start from (the planning core's chain and
# checkpoint heuristics; the catalogue in tfremat.strategies sits above this module).
_BASES: dict[str, Strategy] = {s.name: s for s in (
    rotor.rotor, rotor.rotor_ap, hong.hong, hong.hong_ap, baselines.chen_sqrtn, baselines.chen_sqrtn_ap,
    baselines.chen_greedy, baselines.chen_greedy_ap, baselines.griewank_logn, baselines.griewank_logn_ap,
    baselines.checkpoint_all)}


def check_bandwidth(bandwidth, strategy: str) -> float:
    """``bandwidth`` as a float, or ArgumentError naming the argument and what it means."""
    if bandwidth is None:
        raise ArgumentError(
            f"{strategy} offloads activations over a host link: pass bandwidth= its speed in bytes per unit of the "
            "graph's cost (bytes per second for profiled graphs, e.g. 12e9 for a PCIe 3.0 x16 GPU)")
    if not is_number(bandwidth) or not math.isfinite(bandwidth) or bandwidth <= 0:
        raise ArgumentError(f"bandwidth must be a finite number of bytes per unit of cost > 0, got {bandwidth!r}")
    return float(bandwidth)


def _read_stages(graph: DFGraph, R: np.ndarray, node: int) -> np.ndarray:
    """Stages in which a node computed there reads ``node``'s value."""
    readers = list(graph.successors[node])
    return np.flatnonzero(R[:, readers].any(axis=1)) if readers else np.zeros(0, dtype=int)


def offload_gap(graph: DFGraph, schedule: Schedule, node: int, stage: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The keep and host matrices that move ``node``'s value to the host across ``stage``.

    The value must be kept on the device into ``stage`` without being read there. Its copy
    was computed in stage c; the last stage before ``stage`` that reads it is r0 (c when
    none) and the next one that reads this copy is r1. The host copy is made right after
    c and held through r1 - 1, the device copy is dropped after r0 and prefetched for r1.

    Returns:
        ``(S, H)``, or None when the move does not apply: the value is not
        :func:`offloadable`, not kept into ``stage``, read there, already on the host
        there, or not read again on the device.
    """
    R, S = schedule.R, schedule.S
    H = schedule.H if schedule.H is not None else np.zeros_like(S)
    if not offloadable(graph, node) or not S[stage, node] or R[stage, node] or H[stage, node]:
        return None
    reads = _read_stages(graph, R, node)
    if stage in reads:
        return None
    computed = np.flatnonzero(R[: stage, node])
    if not len(computed):
        return None
    made = int(computed[-1])
    earlier = reads[(reads >= made) & (reads < stage)]
    last_read = int(earlier[-1]) if len(earlier) else made
    later = reads[reads > stage]
    if not len(later) or not S[later[0], node] or R[later[0], node] or H[made + 1 : later[0], node].any():
        return None
    next_read = int(later[0])
    S, H = S.copy(), H.copy()
    S[last_read + 1 : next_read, node] = False
    H[made + 1 : next_read, node] = True
    return S, H


def _offloaded(graph: DFGraph, schedule: Schedule, gap: tuple[np.ndarray, np.ndarray], strategy: str,
               bandwidth: float, settled: bool) -> Schedule:
    """``schedule`` with :func:`offload_gap`'s move ``gap = (S, H)`` applied, completed as
    :func:`schedule_from_keep_matrix` completes it.

    ``settled``: ``schedule`` is its own completion (it came from ``schedule_from_keep_matrix``
    or from this function). Then the completion keeps ``schedule.R`` and the moved S and H:
    the move clears the value's keeps only over stages where nothing reads it, so
    ``solve_r_given_s`` adds no computation, ``prune_s`` drops no keep (the last read before
    the gap and the stages from the next read on keep theirs) and ``prune_h`` keeps the host
    run, which ends with the prefetch for the next read. That skips the completion's
    O(n^2 + edges) passes, most of capper's time on ResNet50 (benchmarks/offload_speed.py);
    tests/test_offload.py checks it against the full completion move by move."""
    S, H = gap
    if settled:
        # A prefetch is a new copy of the value: a gradient that reads it with its forward
        # value kept needs that forward node recomputed, as the full completion does.
        return with_fresh_gradient_reads(graph, Schedule(schedule.R, S, strategy, None, H, bandwidth))
    return schedule_from_keep_matrix(graph, S, strategy, H, bandwidth)


def capper(graph: DFGraph, schedule: Schedule, budget: int | None, bandwidth: float, strategy: str = "capper",
           most: int | None = None, settled: bool = False) -> Iterator[Schedule]:
    """Beaumont et al.'s capper (sec. 5.1) on a training graph: yields ``schedule`` and then
    schedules made by offloading, at the stage of the simulated peak, the lowest-indexed
    value kept there unread (:func:`offload_gap`), until one fits ``budget`` (None: until no
    value can be offloaded at the peak), at most ``most`` moves (default: one per forward
    node).

    With a budget, the moves at one peak go on without simulating the schedules between
    them until the bytes moved reach the peak's excess over the budget: a move lowers the
    peak by at most its value's bytes, so none of those schedules fits, and simulating each
    (most of capper's time) would only pick the next value, usually at the same stage.
    Those schedules are not yielded. ``settled``: ``schedule`` came from
    :func:`~tfremat.plan.schedule.schedule_from_keep_matrix` (see :func:`_offloaded`);
    otherwise the first move completes the schedule in full."""
    most = len(graph.forward_nodes) if most is None else most
    yield schedule
    moves = 0
    while moves < most:
        result = known_simulation(graph, schedule)
        if budget is not None and result.peak_bytes <= budget:
            return
        stage = result.plan.statements[result.peak_statement].stage
        excess = 0 if budget is None else result.peak_bytes - budget
        moved = 0
        while moves < most:
            for node in np.flatnonzero(schedule.S[stage]):
                gap = offload_gap(graph, schedule, int(node), stage)
                if gap is not None:
                    break
            else:
                break
            schedule = _offloaded(graph, schedule, gap, strategy, bandwidth, settled)
            settled = True
            moves += 1
            moved += graph.output_bytes[int(node)]
            if moved >= excess:
                break
        if not moved:
            return
        yield schedule


# Base schedules by (graph fingerprint, base strategy, limit): they do not depend on the
# link, so autocapper over several links (a benchmark, max_batch_size's search) plans each once.
_BASE_CACHE: dict[tuple[str, str, int], Schedule | None] = {}
_BASE_CACHE_SIZE = 512


def _base_schedule(graph: DFGraph, base: Strategy, limit: int) -> Schedule | None:
    """``base``'s schedule of ``graph`` at ``limit`` bytes (None: it has none), cached."""
    key = (graph.fingerprint, base.name, limit)
    if key not in _BASE_CACHE:
        try:
            schedule = base(graph, limit)
        except InfeasibleBudgetError:
            schedule = None
        if len(_BASE_CACHE) >= _BASE_CACHE_SIZE:
            _BASE_CACHE.pop(next(iter(_BASE_CACHE)))
        _BASE_CACHE[key] = schedule
    return _BASE_CACHE[key]


def _rotor_starts(graph: DFGraph, articulation: bool, limits: np.ndarray, high: int) -> Iterator[Schedule]:
    """Capper's starts at each limit: "a pure rematerialization sequence with the limit M'"
    (sec. 5.1), rotor's DP sequence at the limit's activation bytes, every limit read from
    one table (:func:`~tfremat.plan.rotor.sequences_at_limits`) rather than one rotor
    search per limit; at ``high`` (the checkpoint-all peak) and above, keeping everything,
    as the rotor strategy does (the table's sizes are rounded up to slots). A limit where
    none fits, or that repeats a sequence, yields none."""
    mapped = rotor.graph_chain(graph, articulation)
    activations = [int(limit) - graph.fixed_bytes for limit in limits]
    if max(activations) <= 0:
        return
    try:
        sequences = rotor.sequences_at_limits(mapped.chain, activations)
    except baselines._OutOfTime:
        return
    everything = rotor.keep_everything_sequence(mapped.chain.length)
    seen = set()
    for limit, ops in zip(limits, sequences):
        ops = everything if limit >= high else ops
        if ops is not None and tuple(ops) not in seen:
            seen.add(tuple(ops))
            yield schedule_from_keep_matrix(graph, rotor.sequence_keep_matrix(graph, mapped, ops), "autocapper")


@as_strategy("autocapper", offloads=True)
def autocapper(graph: DFGraph, budget: int | None = None, bandwidth: float | None = None, base: str = "rotor",
               limits: int = AUTOCAPPER_LIMITS) -> Schedule:
    """Beaumont et al.'s autocapper (sec. 5.1): :func:`capper` on the ``base`` strategy's
    recompute-only schedule for each of ``limits`` memory limits evenly spaced from the
    budget to the checkpoint-all peak; the fastest schedule (simulated makespan) that fits
    the budget. With ``rotor``/``rotor_ap`` the starts are the rotor strategy's schedule at
    the budget (first: under a deadline a fitting schedule comes early), rotor's DP sequences
    at each limit read from one table, and the rotor strategy's schedules at
    :data:`AUTOCAPPER_SEARCHED_LIMITS` of the limits. Without a
    budget, capper runs from ``base``'s least-peak schedule and the lowest peak is returned.

    Args:
        bandwidth: the host link, in bytes per unit of the graph's cost (bytes per second
            for profiled graphs).
        base: the recompute-only strategy capper starts from (Beaumont et al. use rotor).
        limits: how many limits M' to try (an int >= 1; the paper's 40 by default).

    Raises:
        ArgumentError: a missing or bad ``bandwidth``, an unknown ``base``, bad ``limits``.
        InfeasibleBudgetError: no tried schedule fits (with the smallest simulated peak).
    """
    bandwidth = check_bandwidth(bandwidth, "autocapper")
    if not is_int(limits) or limits < 1:
        raise ArgumentError(f"limits must be an int >= 1 (how many memory limits capper tries), got {limits!r}")
    base_strategy = _BASES.get(base) if isinstance(base, str) else None
    if base_strategy is None:
        raise ArgumentError(f"base must name a recompute-only heuristic, one of {', '.join(_BASES)}; got {base!r}")

    def candidates() -> Iterator[Schedule]:
        if budget is None:
            yield from capper(graph, base_strategy(graph), None, bandwidth, "autocapper")
            return
        high = checkpoint_all_peak(graph)
        # From the highest limit down: offloading-only schedules first, whose makespans let
        # the recompute-heavy starts below be skipped.
        tried = np.unique(np.linspace(budget, max(high, budget), limits).astype(np.int64))[::-1]
        if base in ("rotor", "rotor_ap") and graph.loss_node is not None and graph.forward_nodes:
            # The rotor strategy's own schedule at the budget (its DP and its search on the
            # graph) first, so that autocapper is never slower than it and a deadline finds a
            # fitting schedule; rotor's DP sequence at every limit, from one table; the rotor
            # strategy's schedules at a few limits, highest first.
            # The DP's starts come from schedule_from_keep_matrix (capper's moves skip its passes).
            dp_starts = _rotor_starts(graph, base == "rotor_ap", tried, high)
            searched = np.unique(np.linspace(budget, max(high, budget), AUTOCAPPER_SEARCHED_LIMITS).astype(np.int64))
            starts = itertools.chain([(_base_schedule(graph, base_strategy, int(budget)), False)],
                                     ((start, True) for start in dp_starts),
                                     ((_base_schedule(graph, base_strategy, int(limit)), False)
                                      for limit in searched[1:][::-1]))
        else:
            starts = ((_base_schedule(graph, base_strategy, int(limit)), False) for limit in tried)
        started = set()
        fastest = math.inf  # the least makespan among the schedules found that fit
        for start, settled in starts:
            if time_is_up():
                return
            # Neighbouring limits often give the base's same schedule: capper would repeat itself.
            if start is None or start.S.tobytes() in started:
                continue
            started.add(start.S.tobytes())
            # Capper only adds offloads: from a start that computes more than the fastest
            # fitting schedule takes, nothing it makes can be faster.
            if start.cost(graph) > fastest:
                continue
            for schedule in capper(graph, start.with_facts(None, "autocapper"), budget, bandwidth, "autocapper",
                                   settled=settled):
                yield schedule
                result = known_simulation(graph, schedule)
                if result.peak_bytes <= budget:
                    fastest = min(fastest, result.makespan)

    return cheapest_fitting(graph, candidates(), budget, "autocapper")


@as_strategy("opportunist", offloads=True)
def opportunist(graph: DFGraph, budget: int | None = None, bandwidth: float | None = None) -> Schedule:
    """Beaumont et al.'s opportunist (sec. 5.1, module docstring): offloaded values spaced
    by the link's speed through the forward pass, the nodes between them recomputed once in
    the backward pass, the rest kept once it fits: the shortest prefix of the offloaded
    values whose schedule fits ``budget`` (without a budget, the lowest peak of all prefixes).

    Args:
        bandwidth: the host link, in bytes per unit of the graph's cost.

    Raises:
        ArgumentError: a missing or bad ``bandwidth``.
        InfeasibleBudgetError: no candidate fits (with the smallest simulated peak).
    """
    bandwidth = check_bandwidth(bandwidth, "opportunist")
    order = _forward_order(graph)
    offloaded: list[int] = []
    clock, link_free = 0.0, 0.0
    for node in order:
        clock += graph.cost[node]
        if offloadable(graph, node) and clock >= link_free:
            offloaded.append(node)
            link_free = clock + graph.output_bytes[node] / bandwidth
    loss_stage = _forward_phase_end(graph)

    def candidates() -> Iterator[Schedule]:
        # "until the end of the sequence can be entirely performed in memory": with a
        # budget, the first prefix that fits ends the search.
        for count in range(1, len(offloaded) + 1):
            if time_is_up():
                return
            chosen = offloaded[:count]
            last = order.index(chosen[-1])
            kept = set(chosen) | set(order[last + 1 :])
            units, unit = [], []
            for node in order[: last + 1]:
                if node in kept:
                    units.append(unit)
                    unit = []
                else:
                    unit.append(node)
            schedule = schedule_from_keep_matrix(graph, keep_matrix(graph, kept, [u for u in units if u]),
                                                 "opportunist")
            for node in chosen:
                moved = offload_gap(graph, schedule, node, loss_stage)
                if moved is not None:
                    schedule = _offloaded(graph, schedule, moved, "opportunist", bandwidth, settled=True)
            yield schedule
            if budget is not None and known_peak(graph, schedule) <= budget:
                return

    return cheapest_fitting(graph, candidates(), budget, "opportunist")


def _pofo(graph: DFGraph, budget: int | None, bandwidth, memory_slots: int | None, articulation: bool) -> Schedule:
    name = "pofo_ap" if articulation else "pofo"
    bandwidth = check_bandwidth(bandwidth, name)
    if graph.loss_node is None or not graph.forward_nodes:
        raise ArgumentError(f"{name} plans a training step: graph {graph.name!r} has no loss node or forward nodes")
    mapped = rotor.graph_chain(graph, articulation)
    length = mapped.chain.length
    shares = POFO_LIMITS if budget is not None else (1.0, 0.75, 0.5, 0.35, 0.25)

    def counts(slots: int) -> list[int]:
        return [max(1, math.floor(share * slots)) for share in shares]

    if memory_slots is None:
        memory_slots = POFO_SLOTS
        while memory_slots > 1 and length * 2 * (max(counts(memory_slots)) + 2) ** 3 > MAX_POFO_CELLS:
            memory_slots -= 1
    elif not is_int(memory_slots) or memory_slots < 1:
        raise ArgumentError(f"memory_slots must be None or an int >= 1, got {memory_slots!r}")
    loss_stage = _forward_phase_end(graph)
    activations = (budget if budget is not None else checkpoint_all_peak(graph)) - graph.fixed_bytes

    def schedule_of(ops) -> Schedule:
        compute = [op for op in ops if op.kind not in ("O", "P")]
        S = rotor.sequence_keep_matrix(graph, mapped, compute)
        schedule = schedule_from_keep_matrix(graph, S, name)
        for op in ops:
            if op.kind != "O" or op.stage < 2:
                continue
            for node in mapped.forward_units[op.stage - 2]:
                moved = offload_gap(graph, schedule, node, loss_stage)
                if moved is not None:
                    schedule = _offloaded(graph, schedule, moved, name, bandwidth, settled=True)
        return schedule

    def candidates() -> Iterator[Schedule]:
        if time_is_up() or activations <= 0:
            return
        if budget is not None and checkpoint_all_peak(graph) <= budget:
            # Keeping everything fits, and no schedule is faster.
            yield baselines.checkpoint_all(graph).with_facts(None, name)
            return
        try:
            # One DP in slots of the budget's activation bytes / memory_slots answers every limit.
            solutions = solve_pofo_limits(mapped.chain, activations, bandwidth, counts(memory_slots), memory_slots)
            if budget is not None:
                solutions += [solve_pofo(mapped.chain, share * activations, bandwidth, memory_slots)
                              for share in POFO_OWN_TABLE_LIMITS]
        except baselines._OutOfTime:
            return
        for solution in solutions:
            if time_is_up():
                return
            if solution is not None:
                # Where the graph holds more than the chain model sees, capper offloads
                # further values at the simulated peak until it fits.
                yield from capper(graph, schedule_of(solution.ops), budget, bandwidth, name, settled=True)
        # The DP contains the recompute-only sequences; on the graph, rotor's own search
        # around the budget keeps pofo at least as good as rotor.
        if budget is not None:
            recompute_only = _base_schedule(graph, rotor.rotor_ap if articulation else rotor.rotor, budget)
            if recompute_only is not None:
                yield recompute_only.with_facts(None, name)

    return cheapest_fitting(graph, candidates(), budget, name)


@as_strategy("pofo", offloads=True)
def pofo(graph: DFGraph, budget: int | None = None, bandwidth: float | None = None,
         memory_slots: int | None = None) -> Schedule:
    """Beaumont et al.'s pofo (sec. 4, appendix B) over the linearized forward order, every
    forward node a stage (module docstring): the fastest simulated schedule that fits
    ``budget`` among pofo's sequences at memory limits around it; without a budget, the
    lowest peak among its sequences at falling limits.

    Args:
        bandwidth: the host link, in bytes per unit of the graph's cost.
        memory_slots: the DP's memory steps (None: the paper's 50, fewer on a chain too long
            for :data:`~tfremat.plan.pofo.MAX_POFO_CELLS`). O(N^2 S^3 + N^3 S^2) for N
            stages and S slots: use ``pofo_ap`` on long chains.

    Raises:
        ArgumentError: a missing or bad ``bandwidth`` or ``memory_slots``, a graph without
            a loss.
        InfeasibleBudgetError: no sequence fits (with the smallest simulated peak).
    """
    return _pofo(graph, budget, bandwidth, memory_slots, articulation=False)


@as_strategy("pofo_ap", offloads=True)
def pofo_ap(graph: DFGraph, budget: int | None = None, bandwidth: float | None = None,
            memory_slots: int | None = None) -> Schedule:
    """:func:`pofo` whose stages are the blocks between forward articulation points."""
    return _pofo(graph, budget, bandwidth, memory_slots, articulation=True)
