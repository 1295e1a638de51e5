"""The stall rule on models too large for the whole MILP (issue 33/34 follow-up): the LP
relaxation, their only search after the heuristics, stops once ``stall_time`` CPU seconds pass
without a cheaper schedule."""

from __future__ import annotations

from graph_factories import random_training_graph, repeated_blocks

from tfremat.ilp import build_milp, memory_lower_bound, solve_model
from tfremat.ilp.milp import _units_repeat, solve_optimal
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
    heuristic: the LP gets what the stall rule has left since the last cheaper schedule,
    none left skips it; the result is the best schedule, status ``feasible`` unless proven,
    never worse than the best heuristic."""
    import tfremat.ilp.milp as milp

    monkeypatch.setattr(milp, "_FULL_MILP_COLUMNS", 0)
    lps = []
    solve = milp.solve_model
    monkeypatch.setattr(milp, "solve_model", lambda *a, **k: lps.append(k) or solve(*a, **k))
    graph, budget = mid_case()
    best, _ = best_baseline(graph, budget, 0.0)
    stalled = solve_optimal(graph, budget, threads=1, time_limit=600, stall_time=1e-6)
    assert lps == []  # the heuristics took longer than the rule's 1e-6 CPU seconds
    assert stalled.facts.status in ("feasible", "optimal")
    assert stalled.cost(graph) <= best.cost(graph) * (1 + 1e-9)
    assert stalled.facts.best_bound == min(graph.total_cost, stalled.cost(graph))
    patient = solve_optimal(graph, budget, threads=1, time_limit=600, stall_time=3600.0)
    assert [k["relax"] for k in lps] == [True]
    assert 0 < lps[0]["stall_time"] <= 3600.0
    assert patient.cost(graph) <= best.cost(graph) * (1 + 1e-9)
    unstalled = solve_optimal(graph, budget, threads=1, time_limit=600)
    assert lps[1]["stall_time"] is None
    assert unstalled.facts.best_bound >= stalled.facts.best_bound * (1 - 1e-9)


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


def test_units_repeat_in_repeated_blocks_not_in_a_random_chain():
    assert _units_repeat(repeated_blocks(6, residual=True))
    assert not _units_repeat(random_training_graph(0, 40))
