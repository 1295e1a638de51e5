"""The allocator check's re-plans (issue 33/34 follow-up): where the first plan's MILP
strategy returned a heuristic's schedule unimproved, the re-plan runs that heuristic rather
than a second full solve."""

from __future__ import annotations

import dataclasses
import types

from graph_factories import random_training_graph

import tfremat.keras as tk
from tfremat.allocator_check import replan_strategy
from tfremat.ilp import memory_lower_bound
from tfremat.plan.eviction import eviction
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import plan_graph


def case():
    graph = random_training_graph(0, 30)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    return graph, int(low + 0.6 * (high - low))


def first_plan(graph, budget, schedule, status="feasible", warm_start="eviction", strategy="optimal"):
    facts = types.SimpleNamespace(status=status, warm_start=warm_start)
    return types.SimpleNamespace(strategy=strategy, graph=graph, budget_bytes=budget, facts=facts,
                                 schedule=types.SimpleNamespace(cost=schedule.cost))


def test_a_heuristics_unimproved_schedule_is_replanned_with_that_heuristic():
    graph, budget = case()
    own = eviction(graph, budget)
    assert replan_strategy(first_plan(graph, budget, own), "optimal") == "eviction"
    # Proven optimal, improved by the search, or from a heuristic with a time limit: the strategy again.
    assert replan_strategy(first_plan(graph, budget, own, status="optimal"), "optimal") == "optimal"
    cheaper = types.SimpleNamespace(cost=lambda g: own.cost(g) * 0.99)
    assert replan_strategy(first_plan(graph, budget, cheaper), "optimal") == "optimal"
    assert replan_strategy(first_plan(graph, budget, own, warm_start="intervals"), "optimal") == "optimal"
    # A re-plan made with the heuristic keeps it for the next round.
    again = first_plan(graph, budget, own, strategy="eviction", warm_start=None)
    assert replan_strategy(again, "optimal") == "eviction"


def test_the_check_replans_with_the_heuristic_and_falls_back_to_the_strategy(monkeypatch):
    graph, budget = case()
    planned = []

    def fake_plan_graph(g, b, strategy, **options):
        planned.append(strategy)
        if strategy == "eviction" and b < budget // 2:
            raise tk.InfeasibleBudgetError(b, strategy=strategy)
        return dataclasses.replace(plan_graph(g, budget, "eviction", cache=False, verbose=0), strategy=strategy)

    import tfremat.static_graph.compile as compile_module

    monkeypatch.setattr(tk, "plan_graph", fake_plan_graph)
    monkeypatch.setattr(tk, "with_rounding", lambda result: result)
    monkeypatch.setattr(compile_module, "compile_step", lambda *a, **k: "step")
    callback = types.SimpleNamespace(strategy="optimal", cache=False, verbose=0, _jit_compile=False,
                                     _tracing=None, _replanning=None, model=types.SimpleNamespace(optimizer=None))
    first = dataclasses.replace(plan_graph(graph, budget, "eviction", cache=False, verbose=0), strategy="optimal")
    first = types.SimpleNamespace(**{f.name: getattr(first, f.name) for f in dataclasses.fields(first)
                                     if f.name != "extraction"},
                                  facts=types.SimpleNamespace(status="feasible", warm_start="eviction"))
    first.extraction = types.SimpleNamespace(graph=graph)
    replanned, step = tk.RematCallback._replanned(callback, first, budget - 1, {"time_limit": 60})
    assert planned == ["eviction"] and step == "step"
    # Named as asked for, with the heuristic that planned it; a later round plans with it again.
    assert replanned.strategy == "optimal" and replanned.planned_with == "eviction"
    assert replanned.summary()["planned_with"] == "eviction"
    assert replan_strategy(replanned, "optimal") == "eviction"
    planned.clear()
    tk.RematCallback._replanned(callback, first, budget // 4, {"time_limit": 60})
    assert planned == ["eviction", "optimal"]
