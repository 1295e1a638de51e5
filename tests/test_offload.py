"""Offloading to host memory: the host matrix of a schedule, the plan's copies, the
simulator's two timelines, and the autocapper and opportunist strategies (no TensorFlow)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from graph_factories import random_training_graph, training_graph

from tfremat.errors import ArgumentError, InfeasibleBudgetError, ScheduleError
from tfremat.plan.execution import Op, build_plan
from tfremat.plan.offload import offload_gap
from tfremat.plan.schedule import (
    Schedule,
    checkpoint_all_s,
    schedule_from_keep_matrix,
    validate_schedule,
)
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.planner import compare_graph
from tfremat.strategies import get_strategy, offloading_strategy_names, strategy_names

# A chain of six forward nodes of 10 bytes (cost 1 each), the loss (cost 1) and six
# backward nodes (cost 2 each): value 1 is read by node 2 and by node 2's backward (id 10).
CHAIN = training_graph([(j, j + 1) for j in range(5)], [10] * 6)


def _offload_value_1(bandwidth: float) -> Schedule:
    """Checkpoint-all, except that value 1 goes to the host after node 2 has read it and
    comes back for its backward reader."""
    S = checkpoint_all_s(CHAIN)
    H = np.zeros_like(S)
    H[2:10, 1] = True
    S[3:10, 1] = False
    return schedule_from_keep_matrix(CHAIN, S, "by hand", H, bandwidth)


def test_a_fast_link_hides_the_copies_and_lowers_the_peak():
    everything = simulate(CHAIN, schedule_from_keep_matrix(CHAIN, checkpoint_all_s(CHAIN), "all"))
    result = simulate(CHAIN, _offload_value_1(bandwidth=10.0))
    assert everything.makespan == everything.cost == 19 and everything.idle == 0
    # The copy takes 1: it ends at 3, when node 3 starts, and the prefetch issued before
    # node 9 (starts at 11) lands at 12, before node 10 starts at 13.
    assert result.peak_bytes == everything.peak_bytes - 10
    assert (result.makespan, result.idle, result.cost) == (19, 0, 19)
    assert result.transfer_bytes == 20 and result.host_peak_bytes == 10
    ops = [(s.op, s.stage) for s in result.plan if s.node == 1]
    assert ops == [(Op.ALLOCATE, 1), (Op.COMPUTE, 1), (Op.OFFLOAD, 1), (Op.DEALLOCATE, 3), (Op.PREFETCH, 9),
                   (Op.DEALLOCATE, 10)]


def test_a_slow_link_makes_the_step_wait():
    """At 1 byte per unit the copy to the host ends at 12; the device copy is held until the
    value's backward stage, then the prefetch starts at 13 and its reader waits until 23."""
    everything = simulate(CHAIN, schedule_from_keep_matrix(CHAIN, checkpoint_all_s(CHAIN), "all"))
    result = simulate(CHAIN, _offload_value_1(bandwidth=1.0))
    assert (result.makespan, result.idle) == (29, 10)
    assert result.peak_bytes == everything.peak_bytes


@pytest.mark.parametrize("seed", range(6))
def test_without_offloads_the_makespan_is_the_compute_cost(seed):
    graph = random_training_graph(seed, 12)
    for name in ("checkpoint_all", "chen_sqrtn", "rotor"):
        result = simulate(graph, get_strategy(name)(graph))
        assert result.makespan == pytest.approx(result.cost) and result.idle == 0 and result.transfer_bytes == 0


def test_a_schedule_with_host_copies_round_trips_through_json():
    schedule = _offload_value_1(bandwidth=10.0)
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict(CHAIN))), CHAIN)
    assert np.array_equal(again.H, schedule.H) and again.host_bandwidth == 10.0
    old = schedule_from_keep_matrix(CHAIN, checkpoint_all_s(CHAIN), "all").to_dict(CHAIN)
    old["format"] = "tfremat.schedule/2"
    del old["H"], old["host_bandwidth"]
    assert Schedule.from_dict(old, CHAIN).H is None


def test_validation_names_the_host_rules():
    good = _offload_value_1(bandwidth=10.0)
    validate_schedule(CHAIN, good)
    with pytest.raises(ScheduleError) as error:
        validate_schedule(CHAIN, Schedule(good.R, good.S, H=good.H))
    assert error.value.rule == "host-link"
    late = good.H.copy()
    late[2, 1] = False  # the copy would start in stage 3, which does not compute value 1
    with pytest.raises(ScheduleError) as error:
        validate_schedule(CHAIN, Schedule(good.R, good.S, H=late, host_bandwidth=10.0))
    assert error.value.rule == "offload-source"
    gradient = np.zeros_like(good.S)
    gradient[9, 8] = True  # node 8 is a gradient
    with pytest.raises(ScheduleError) as error:
        validate_schedule(CHAIN, Schedule(good.R, good.S, H=gradient, host_bandwidth=10.0))
    assert error.value.rule == "offload-kind"
    gone = good.H.copy()
    gone[9, 1] = False  # nothing to prefetch from in stage 9
    with pytest.raises(ScheduleError) as error:
        validate_schedule(CHAIN, Schedule(good.R, good.S, H=gone, host_bandwidth=10.0))
    assert error.value.rule == "keep-source"
    with pytest.raises(ScheduleError) as error:
        build_plan(CHAIN, Schedule(good.R, good.S, H=good.H))
    assert error.value.rule == "host-link"


def test_offload_gap_moves_an_unread_stretch_to_the_host():
    schedule = schedule_from_keep_matrix(CHAIN, checkpoint_all_s(CHAIN), "all")
    S, H = offload_gap(CHAIN, schedule, 1, 6)
    assert np.flatnonzero(H[:, 1]).tolist() == list(range(2, 10))
    assert np.flatnonzero(S[:, 1]).tolist() == [2, 10]
    assert offload_gap(CHAIN, schedule, 1, 2) is None  # node 2 reads it in stage 2
    assert offload_gap(CHAIN, schedule, 8, 9) is None  # a gradient stays on the device


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("fraction", [0.9, 0.7, 0.5])
def test_autocapper_fits_and_is_never_slower_than_its_base(seed, fraction):
    graph = random_training_graph(seed, 10)
    budget = int(fraction * checkpoint_all_peak(graph))
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    try:
        base = simulate(graph, get_strategy("rotor")(graph, budget)).makespan
    except InfeasibleBudgetError:
        base = np.inf
    try:
        schedule = get_strategy("autocapper")(graph, budget, bandwidth=bandwidth, limits=8)
    except InfeasibleBudgetError:
        assert base == np.inf
        return
    validate_schedule(graph, schedule)
    result = simulate(graph, schedule)
    assert result.peak_bytes <= budget
    assert result.makespan <= base + 1e-9


@pytest.mark.parametrize("seed", range(8))
def test_opportunist_offloads_and_fits_or_says_it_cannot(seed):
    graph = random_training_graph(seed, 10)
    budget = int(0.7 * checkpoint_all_peak(graph))
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    try:
        schedule = get_strategy("opportunist")(graph, budget, bandwidth=bandwidth)
    except InfeasibleBudgetError as error:
        assert error.min_feasible_bytes > budget
        return
    validate_schedule(graph, schedule)
    assert schedule.offloads and simulate(graph, schedule).peak_bytes <= budget


def test_offloading_strategies_need_a_bandwidth_and_compare_runs_them_only_with_one():
    with pytest.raises(ArgumentError, match="bandwidth"):
        get_strategy("autocapper")(CHAIN, 0.8)
    with pytest.raises(ArgumentError, match="bandwidth"):
        get_strategy("opportunist")(CHAIN, 0.8, bandwidth=-1)
    assert set(offloading_strategy_names()) == {"pofo", "pofo_ap", "autocapper", "opportunist"}
    assert not set(offloading_strategy_names()) & set(strategy_names())
    names = ["checkpoint_all", "chen_sqrtn"]
    plain = compare_graph(CHAIN, 0.8, names, cache=False, verbose=0)
    assert len(plain) == 2
    both = compare_graph(CHAIN, 0.8, [*names, "autocapper"], cache=False, verbose=0, bandwidth=10.0)
    assert [getattr(r, "strategy", None) for r in both][-1] == "autocapper"
    with pytest.raises(ArgumentError, match="bandwidth"):
        compare_graph(CHAIN, 0.8, [*names, "autocapper"], cache=False, verbose=0)
    with pytest.raises(ArgumentError, match="offloading strategies"):
        compare_graph(CHAIN, 0.8, names, cache=False, verbose=0, bandwidth=10.0)


LONG_CHAIN = training_graph([(j, j + 1) for j in range(11)], [10] * 12)


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.5, 0.4])
def test_pofo_on_a_chain_hides_recomputation_behind_a_fast_link(fraction):
    """Twelve 10-byte layers of cost 1 (backward 2): at 10 bytes per unit a value moves in the
    time of one forward, and pofo's schedule runs at the no-recomputation time (37) where
    rotor recomputes; at 2 bytes per unit it is between the two."""
    rotor_time = simulate(LONG_CHAIN, get_strategy("rotor")(LONG_CHAIN, fraction)).makespan
    fast = get_strategy("pofo")(LONG_CHAIN, fraction, bandwidth=10.0)
    validate_schedule(LONG_CHAIN, fast)
    result = simulate(LONG_CHAIN, fast)
    assert fast.offloads and result.makespan == LONG_CHAIN.total_cost == 37 < rotor_time
    assert result.peak_bytes <= int(fraction * checkpoint_all_peak(LONG_CHAIN))
    slow = simulate(LONG_CHAIN, get_strategy("pofo")(LONG_CHAIN, fraction, bandwidth=2.0)).makespan
    assert 37 <= slow <= rotor_time


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["pofo", "pofo_ap"])
def test_pofo_fits_and_is_never_slower_than_rotor(seed, name):
    graph = random_training_graph(seed, 10)
    budget = int(0.6 * checkpoint_all_peak(graph))
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    base = "rotor_ap" if name == "pofo_ap" else "rotor"
    try:
        rotor_time = simulate(graph, get_strategy(base)(graph, budget)).makespan
    except InfeasibleBudgetError:
        rotor_time = np.inf
    try:
        schedule = get_strategy(name)(graph, budget, bandwidth=bandwidth)
    except InfeasibleBudgetError:
        assert rotor_time == np.inf
        return
    validate_schedule(graph, schedule)
    result = simulate(graph, schedule)
    assert result.peak_bytes <= budget and result.makespan <= rotor_time + 1e-9


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_autocapper_skipping_slow_starts_finds_the_fastest_of_all_starts(seed, fraction):
    """autocapper skips a start that computes more than the fastest fitting schedule found;
    the answer is the fastest of capper run from every start (rotor's DP sequences at the 40
    limits, the rotor strategy's schedules at AUTOCAPPER_SEARCHED_LIMITS of them), as sec.
    5.1 describes."""
    from tfremat.plan import offload, rotor

    graph = random_training_graph(seed, 12)
    budget = int(fraction * checkpoint_all_peak(graph))
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    tried = np.unique(np.linspace(budget, checkpoint_all_peak(graph), 40).astype(np.int64))
    starts = list(offload._rotor_starts(graph, False, tried, checkpoint_all_peak(graph)))
    searched = np.linspace(budget, checkpoint_all_peak(graph), offload.AUTOCAPPER_SEARCHED_LIMITS).astype(np.int64)
    for limit in searched:
        try:
            starts.append(rotor.rotor(graph, int(limit)))
        except InfeasibleBudgetError:
            pass
    makespans = [simulate(graph, schedule).makespan for start in starts
                 for schedule in offload.capper(graph, start, budget, bandwidth)
                 if simulate(graph, schedule).peak_bytes <= budget]
    try:
        found = simulate(graph, get_strategy("autocapper")(graph, budget, bandwidth=bandwidth)).makespan
    except InfeasibleBudgetError:
        assert not makespans
        return
    assert found == pytest.approx(min(makespans), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_capper_yields_the_start_then_schedules_that_fit_only_at_the_end(seed):
    """capper simulates only where a schedule may fit: with a budget every schedule it
    yields after the start overflows but the last, which fits when any move is left; each
    one offloads more than the one before, and stays valid."""
    from tfremat.plan import offload, rotor

    graph = random_training_graph(seed, 12)
    budget = int(0.45 * checkpoint_all_peak(graph))
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    start = rotor.rotor(graph, checkpoint_all_peak(graph))
    schedules = list(offload.capper(graph, start, budget, bandwidth))
    assert schedules[0] is start
    peaks = [simulate(graph, schedule).peak_bytes for schedule in schedules]
    assert all(peak > budget for peak in peaks[:-1])
    offloaded = [0 if s.H is None else int(s.H.sum()) for s in schedules]
    assert offloaded == sorted(offloaded) and len(set(offloaded)) == len(offloaded)
    for schedule in schedules[1:]:
        validate_schedule(graph, schedule)


@pytest.mark.parametrize("seed", range(6))
def test_a_move_on_a_settled_schedule_equals_its_full_completion(seed):
    """capper's moves skip schedule_from_keep_matrix's passes on a schedule that is its own
    completion (offload._offloaded): every move, chained as capper chains them, gives the
    R, S and H the full completion gives."""
    from tfremat.plan import offload, rotor

    graph = random_training_graph(seed, 14)
    bandwidth = float(np.mean(graph.output_bytes) / np.mean(graph.cost))
    starts = [rotor.rotor(graph, int(share * checkpoint_all_peak(graph))) for share in (1.0, 0.8)]
    starts.append(schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "all"))
    compared = 0
    for start in starts:
        start = schedule_from_keep_matrix(graph, start.S, "start", start.H, bandwidth)
        schedule = start
        for stage in range(graph.size):
            for node in range(graph.size):
                gap = offload_gap(graph, schedule, node, stage)
                if gap is None:
                    continue
                fast = offload._offloaded(graph, schedule, gap, "x", bandwidth, settled=True)
                full = offload._offloaded(graph, schedule, gap, "x", bandwidth, settled=False)
                assert np.array_equal(fast.R, full.R) and np.array_equal(fast.S, full.S)
                assert np.array_equal(fast.H, full.H)
                validate_schedule(graph, fast)
                compared += 1
                if (stage + node) % 3 == 0:  # chain some moves, as capper does
                    schedule = fast
    assert compared >= 10


@pytest.mark.parametrize("graph_name, fraction, ratio", [("vgg_chain", 0.6, 2.0), ("residual_chain", 0.5, 10.0)])
def test_pofo_ap_is_no_slower_than_with_a_table_per_limit(monkeypatch, graph_name, fraction, ratio):
    """pofo_ap reads its limits from one shared table plus tables of their own for the limits
    above the budget (offload.POFO_OWN_TABLE_LIMITS): on benchmarks/chains.py's chains (where
    the shared table alone lost 5 and 3 points) it is as fast as with one table per limit,
    each in POFO_SLOTS slots of that limit, as pofo_ap planned before the shared table."""
    import os
    import sys

    from tfremat.plan import offload, pofo

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import chains

    graph = getattr(chains, graph_name)()
    budget = int(fraction * checkpoint_all_peak(graph))
    bandwidth = chains.link_bandwidth(graph, ratio)
    found = simulate(graph, get_strategy("pofo_ap")(graph, budget, bandwidth=bandwidth))

    def per_limit(chain, memory_limit, bandwidth, slot_counts, memory_slots):
        return [pofo.solve_pofo(chain, memory_limit * count / memory_slots, bandwidth, memory_slots)
                for count in slot_counts]

    monkeypatch.setattr(offload, "POFO_OWN_TABLE_LIMITS", ())
    monkeypatch.setattr(offload, "solve_pofo_limits", per_limit)
    alone = simulate(graph, get_strategy("pofo_ap")(graph, budget, bandwidth=bandwidth))
    assert found.peak_bytes <= budget
    assert found.makespan <= alone.makespan * (1 + 1e-12)


def test_autocapper_is_no_slower_than_from_the_rotor_strategy_at_eight_limits():
    """autocapper's starts include the rotor strategy's own schedules at
    AUTOCAPPER_SEARCHED_LIMITS limits (autocapper before rotor's one table): on
    benchmarks/chains.py's residual_chain at 80%, slow link, where the DP's starts alone
    lost 3 points, it is no slower than capper from those schedules."""
    import os
    import sys

    from tfremat.plan import offload, rotor

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import chains

    graph = chains.residual_chain()
    budget = int(0.8 * checkpoint_all_peak(graph))
    bandwidth = chains.link_bandwidth(graph, 10.0)
    makespans = []
    for limit in np.linspace(budget, checkpoint_all_peak(graph), 8).astype(np.int64):
        for schedule in offload.capper(graph, rotor.rotor(graph, int(limit)), budget, bandwidth):
            result = simulate(graph, schedule)
            if result.peak_bytes <= budget:
                makespans.append(result.makespan)
    found = simulate(graph, get_strategy("autocapper")(graph, budget, bandwidth=bandwidth))
    assert found.peak_bytes <= budget
    assert found.makespan <= min(makespans) * (1 + 1e-12)
