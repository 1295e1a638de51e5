"""The stall rule on models too large for the whole MILP (issue 33/34 follow-up): the LP
relaxation, their only search after the heuristics, stops after ``stall_time`` CPU seconds."""

from __future__ import annotations

from graph_factories import random_training_graph

from tfremat.ilp import build_milp, memory_lower_bound, solve_model
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.portfolio import best_baseline
from tfremat.plan.simulator import checkpoint_all_peak


def mid_case(layers=40):
    graph = random_training_graph(0, layers)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    return graph, int(low + 0.3 * (high - low))


def test_a_stoppable_lp_stops_after_stall_time_cpu_seconds_with_its_dual_bound():
    graph, budget = mid_case()
    model = build_milp(graph, budget, exact_stages=())
    stopped = solve_model(model, relax=True, lp_method="dual_simplex", threads=1, stall_time=1e-6, time_limit=600)
    full = solve_model(model, relax=True, lp_method="dual_simplex", threads=1, time_limit=600)
    assert stopped.stalled and not full.stalled
    assert full.status == "optimal"
    # Weak duality: a stopped dual simplex's bound never exceeds the LP optimum.
    assert stopped.best_bound is None or stopped.best_bound <= full.best_bound * (1 + 1e-6)


def test_large_models_stop_their_lp_by_the_stall_rule(monkeypatch):
    """A graph sent down the large-model path (its MILP deemed too large) with a fitting
    heuristic: the LP gets the stall rule, the result is the best schedule with status
    ``feasible`` (stopped by the rule), never worse than the best heuristic."""
    import tfremat.ilp.milp as milp

    monkeypatch.setattr(milp, "_FULL_MILP_COLUMNS", 0)
    lps = []
    solve = milp.solve_model
    monkeypatch.setattr(milp, "solve_model", lambda *a, **k: lps.append(k) or solve(*a, **k))
    graph, budget = mid_case()
    schedule = solve_optimal(graph, budget, threads=1, time_limit=600, stall_time=1e-6)
    assert [k["relax"] for k in lps] == [True]
    assert lps[0]["stall_time"] == 1e-6
    assert schedule.facts.status in ("feasible", "optimal")
    best, _ = best_baseline(graph, budget, 0.0)
    assert schedule.cost(graph) <= best.cost(graph) * (1 + 1e-9)
    unstalled = solve_optimal(graph, budget, threads=1, time_limit=600)
    assert lps[1]["stall_time"] is None
    assert unstalled.facts.best_bound >= schedule.facts.best_bound * (1 - 1e-9)


def test_units_are_tried_under_the_stall_rule_only_where_they_repeat(monkeypatch):
    import tfremat.ilp.milp as milp

    monkeypatch.setattr(milp, "_FULL_MILP_COLUMNS", 0)
    monkeypatch.setattr(milp, "_units_repeat", lambda graph: False)
    tried = []
    monkeypatch.setattr(milp, "plan_by_units", lambda *a, **k: tried.append(1))
    graph, budget = mid_case()
    solve_optimal(graph, budget, threads=1, time_limit=600, stall_time=1e-6)
    assert not tried
    solve_optimal(graph, budget, threads=1, time_limit=600)
    assert tried
