"""The multi-worker allocator check's re-plans (issue 33): the chief plans again with the
heuristic whose schedule the strategy returned unimproved, as the one-process check does
(tests/test_replan.py), and every worker's plan keeps the strategy asked for, naming the
heuristic in ``planned_with``."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
from graph_factories import random_training_graph

import tfremat.multi_worker as mw
from tfremat.errors import InfeasibleBudgetError
from tfremat.ilp import memory_lower_bound
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import plan_graph


class _OneWorker:
    """The collectives of a single worker: what it gathers or broadcasts comes back."""

    def gather(self, row):
        return np.array([row])

    def broadcast(self, data, source_replica, length):
        return data


def _case():
    graph = random_training_graph(0, 30)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    return graph, int(low + 0.6 * (high - low))


def _first_plan(graph, budget):
    """``optimal``'s plan that returned eviction's schedule unimproved."""
    evicted = plan_graph(graph, budget, "eviction", cache=False, verbose=0)
    facts = types.SimpleNamespace(status="feasible", warm_start="eviction")
    fields = {f.name: getattr(evicted, f.name) for f in dataclasses.fields(evicted)}
    return types.SimpleNamespace(**{**fields, "strategy": "optimal"}, facts=facts)


def _replan(monkeypatch, graph, budget, planning_budget):
    planned = []

    def spy(g, b, strategy, **options):
        planned.append(strategy)
        if strategy == "eviction" and b < budget // 2:
            raise InfeasibleBudgetError(b, strategy=strategy)
        return dataclasses.replace(plan_graph(g, budget, "eviction", cache=False, verbose=0), strategy=strategy)

    monkeypatch.setattr(mw, "plan_graph", spy)
    settings = mw._Settings(budget, "optimal", {"time_limit": 60}, "flops", "layer", False)
    data = mw._chief_plan(_OneWorker(), graph, planning_budget, settings, True, 0, verbose=0,
                          replanning=_first_plan(graph, budget))
    return planned, mw._plan_result(types.SimpleNamespace(graph=graph), data, settings.strategy)


def test_the_chief_replans_with_the_heuristic_and_every_worker_names_the_strategy(monkeypatch):
    graph, budget = _case()
    planned, plan = _replan(monkeypatch, graph, budget, budget - 1)
    assert planned == ["eviction"]
    assert plan.strategy == "optimal" and plan.planned_with == "eviction"
    assert mw.replan_strategy(plan, "optimal") == "eviction"  # the next round too


def test_the_chief_falls_back_to_the_strategy_when_the_heuristic_finds_nothing(monkeypatch):
    graph, budget = _case()
    planned, plan = _replan(monkeypatch, graph, budget, budget // 4)
    assert planned == ["eviction", "optimal"]
    assert plan.strategy == "optimal" and plan.planned_with is None
