"""``optimal`` where the MILP's step rules cut off every schedule that fits (issue 33,
benchmarks/results/user_check_5.md finding 2): keras.io's masked text transformer, whose
budgets just above its smallest peak are met only by recomputing layers after their backward
pass, which the model's step rules (:func:`tfremat.ilp.formulation.has_step_rules`) forbid.

The graph is the one ``tfremat.fit`` planned on (benchmarks/graphs/user_check_5_text_mask.json);
no TensorFlow is needed.
"""

import json
import os
import re

import pytest

from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import load_graph
from tfremat.ilp.formulation import build_milp, has_step_rules, memory_lower_bound
from tfremat.ilp.portfolio import best_baseline
from tfremat.plan.eviction import eviction
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.planner import plan_graph

GRAPH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "graphs", "user_check_5_text_mask.json")


@pytest.fixture(scope="module")
def text_graph():
    with open(GRAPH) as f:
        return load_graph(json.load(f)["graph"])


def _smallest_heuristic_peak(graph):
    _, smallest = best_baseline(graph, memory_lower_bound(graph), 0.0)
    return smallest


def _optimal(graph, budget):
    # A short stall rule: the searches behind the step rules' proof are what is tested, not their length.
    return plan_graph(graph, budget, "optimal", cache=False, verbose=0, stall_time=1.0).schedule


def test_the_step_rules_cut_off_the_heuristic_that_fits(text_graph):
    """The premise: just above eviction's peak, eviction recomputes layers after their backward
    pass, which the model with step rules cannot encode and the one without them can."""
    peak = _smallest_heuristic_peak(text_graph)
    schedule = eviction(text_graph, peak)
    assert simulate(text_graph, schedule).peak_bytes <= peak
    assert has_step_rules(text_graph)
    assert build_milp(text_graph, peak).encode(schedule) is None
    assert build_milp(text_graph, peak, step_rules=False).encode(schedule) is not None


def test_optimal_plans_wherever_a_heuristic_fits_and_costs_no_more(text_graph):
    low, high = memory_lower_bound(text_graph), checkpoint_all_peak(text_graph)
    fitted = 0
    for step in range(1, 6):
        budget = low + (high - low) * step // 8
        heuristic, _ = best_baseline(text_graph, budget, 0.0)
        if heuristic is None:
            continue
        fitted += 1
        schedule = _optimal(text_graph, budget)
        assert simulate(text_graph, schedule).peak_bytes <= budget
        assert schedule.cost(text_graph) <= heuristic.cost(text_graph) * (1 + 1e-9), budget
    assert fitted >= 4


def test_a_budget_only_step_rules_refuse_is_not_called_proven(text_graph):
    """Below every heuristic's peak the model with step rules is infeasible; the refusal
    names no proof about the budget, only the graph's own lower bound."""
    low = memory_lower_bound(text_graph)
    budget = (low + _smallest_heuristic_peak(text_graph)) // 2
    with pytest.raises(InfeasibleBudgetError) as refused:
        _optimal(text_graph, budget)
    assert refused.value.lower_bound_bytes <= low
    assert "proved no schedule fits" not in str(refused.value)


@pytest.mark.parametrize("budget", ["90%", "75%"])
def test_the_figures_a_refusal_names_plan_when_copied_back(text_graph, budget):
    """The share and the MiB figure of "the smallest feasible budget found is 95% (4.18 MiB)"
    both plan with ``optimal`` (the user's "90%" and "3.68MiB" were refused again)."""
    with pytest.raises(InfeasibleBudgetError) as refused:
        _optimal(text_graph, budget)
    share, size = re.search(r"the smallest feasible budget found is ([0-9]+%) \(([0-9.]+) MiB\)",
                            str(refused.value)).groups()
    for copied in (share, f"{size}MiB"):
        schedule = _optimal(text_graph, copied)
        assert simulate(text_graph, schedule).peak_bytes <= schedule.facts.budget_bytes
