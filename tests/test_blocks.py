"""The unit decomposition (:mod:`tfremat.ilp.blocks`): units between cuts, each unit's
options, and their combination along the chain, judged by the simulator and the MILP."""

from __future__ import annotations

import numpy as np
import pytest
from graph_factories import random_training_graph, repeated_blocks, training_graph

from tfremat.ilp import milp
from tfremat.ilp.blocks import chain_units, plan_by_units, unit_options
from tfremat.ilp.formulation import memory_lower_bound
from tfremat.ilp.milp import solve_optimal
from tfremat.plan.schedule import validate_schedule
from tfremat.plan.simulator import checkpoint_all_peak, simulate


def _budgets(graph, shares=(0.8, 0.6, 0.4, 0.3)):
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    return [int(low + share * (high - low)) for share in shares]


def test_units_are_the_repeated_blocks_and_read_only_themselves_and_the_cut_before():
    graph = repeated_blocks(5)
    units = chain_units(graph)
    assert units == [[0, 1, 2, 3, 4]] + [[4 * b + 1 + k for k in range(4)] for b in range(1, 5)]
    for index, unit in enumerate(units):
        allowed = set(unit) | ({units[index - 1][-1]} if index else set())
        for node in unit:
            assert set(graph.predecessors[node]) <= allowed, node


def test_a_graph_whose_every_cut_is_jumped_has_no_units():
    # Every forward node is jumped by the edge 0 -> 4 but 0 and 4 themselves; a lone
    # first node joins the next unit, so there is one unit: nothing to decompose.
    graph = training_graph([(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)], [2, 3, 4, 5, 6])
    assert chain_units(graph) is None


@pytest.mark.parametrize("residual", [False, True])
def test_unit_plans_fit_and_are_near_the_proven_optimum(residual):
    graph = repeated_blocks(6, residual)
    for budget in _budgets(graph):
        schedule = plan_by_units(graph, budget)
        assert schedule is not None, budget
        validate_schedule(graph, schedule)
        assert simulate(graph, schedule).peak_bytes <= budget
        optimum = solve_optimal(graph, budget, threads=1)
        assert str(optimum.facts.status) == "optimal"
        assert optimum.cost(graph) - 1e-9 <= schedule.cost(graph) <= 1.05 * optimum.cost(graph)


def test_with_room_for_everything_the_unit_plan_recomputes_nothing():
    graph = repeated_blocks(4, residual=True)
    schedule = plan_by_units(graph, checkpoint_all_peak(graph))
    assert schedule.cost(graph) == pytest.approx(graph.total_cost)


def test_each_option_holds_what_it_says_on_its_unit_graph():
    """An option's kept bytes, window peaks and cost are those of its schedule simulated
    on the unit graph; the keep-everything option is always there and costs the unit's
    nodes once."""
    graph = repeated_blocks(3, residual=True)
    units = chain_units(graph)
    options = unit_options(graph, units[1], last=False)
    assert len(options) >= 2
    kept = sorted(option.kept for option in options)
    assert kept[0] < kept[-1]
    members = set(units[1]) | {b for b, f in graph.forward_of.items() if f in units[1]}
    once = sum(graph.cost[node] for node in members)
    assert min(option.cost for option in options) == pytest.approx(once)
    for option in options:
        assert option.cost >= once - 1e-9
        assert option.kept <= max(option.forward_peak, option.backward_peak)


def test_a_random_dag_is_planned_or_declined_but_never_over_budget():
    for seed in range(4):
        graph = random_training_graph(seed, 12, skip_probability=0.1)
        for budget in _budgets(graph, (0.7, 0.4)):
            schedule = plan_by_units(graph, budget)
            if schedule is not None:
                validate_schedule(graph, schedule)
                assert simulate(graph, schedule).peak_bytes <= budget


def test_optimal_starts_large_models_from_the_unit_plan(monkeypatch):
    """Where the MILP is too large for its time limit (forced here), ``optimal`` solves only
    the LP and returns the best warm start: never worse than the unit plan."""
    monkeypatch.setattr(milp, "_FULL_MILP_COLUMNS", 0)
    graph = repeated_blocks(6, residual=True)
    budget = _budgets(graph, (0.4,))[0]
    by_units = plan_by_units(graph, budget)
    schedule = solve_optimal(graph, budget, threads=1, time_limit=30)
    assert simulate(graph, schedule).peak_bytes <= budget
    assert schedule.cost(graph) <= by_units.cost(graph) + 1e-9
    assert schedule.facts.best_bound <= schedule.cost(graph)
    assert np.isfinite(schedule.facts.gap)


def test_past_its_deadline_the_plan_still_fits_with_the_levels_it_has(monkeypatch):
    """A deadline that has passed leaves each unit keeping everything or nothing between
    stages: the plan is dearer but still within the budget, and nothing partial is cached."""
    monkeypatch.setattr("tfremat.ilp.blocks._OPTIONS", {})
    graph = repeated_blocks(6)
    budget = _budgets(graph, (0.6,))[0]
    hurried = plan_by_units(graph, budget, deadline=0.0)
    assert hurried is not None
    assert simulate(graph, hurried).peak_bytes <= budget
    full = plan_by_units(graph, budget)
    assert full.cost(graph) < hurried.cost(graph)
