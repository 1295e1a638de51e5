"""The search for the budget "min" on a large graph (issue 33): NASNetMobile's 1,541-node graph
(64x64, batch 4, Adam; tests/data/nasnet_mobile_64x64_batch4.json) ran past 20 minutes in it,
silently (benchmarks/results/min_large_graph.md). No TensorFlow."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import tfremat.strategies as strategies
from graph_factories import random_training_graph, repeated_blocks
from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import load_graph
from tfremat.plan import eviction as eviction_module
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import plan_graph

NASNET = Path(__file__).parent / "data" / "nasnet_mobile_64x64_batch4.json"


class _TooManySteps(Exception):
    pass


def test_a_thrashing_eviction_run_stops_within_its_stage(monkeypatch):
    """The run that took minutes: eviction's bytes-proportional cost proxy at the limit of a
    56.41 MB budget, where one node's recursive recomputations evicted what the next needed.
    It must give up once its compute passes the thrashing bound, not at the end of the
    stage: every computation makes room once, so the count of those is bounded by the
    bound over the cheapest node's cost."""
    graph = strategies._cost_proxies(load_graph(NASNET))[1]
    bound = math.ceil(eviction_module._THRASHING * graph.total_cost / min(graph.cost)) + 1
    steps = 0
    make_room = eviction_module._EvictionRun._make_room

    def counted(run, nbytes):
        nonlocal steps
        steps += 1
        if steps > bound:
            raise _TooManySteps  # the old behaviour: fail now rather than run for minutes
        return make_room(run, nbytes)

    monkeypatch.setattr(eviction_module._EvictionRun, "_make_room", counted)
    assert eviction_module.eviction_keep_matrix(graph, 56_410_000 - graph.fixed_bytes) is None
    assert steps <= bound


def _each_budget(graph, cap: float, budget: int) -> bool:
    """The cap check as it ran before: every heuristic planned at the budget, in order."""
    limit = graph.total_cost * (1 + cap + 1e-9)
    for strategy in strategies._CAP_HEURISTICS:
        try:
            if strategy.function(graph, budget).cost(graph) <= limit:
                return True
        except InfeasibleBudgetError:
            continue
    return False


@pytest.mark.parametrize("graph", [repeated_blocks(6, residual=True), random_training_graph(5, 40)],
                         ids=lambda g: g.name)
@pytest.mark.parametrize("cap", [0.05, 0.2, 0.5])
def test_the_cap_check_runs_each_fixed_family_once_and_answers_as_each_budget_did(monkeypatch, graph, cap):
    calls: dict[str, int] = {}

    def counting(strategy):
        def function(*args, **kwargs):
            calls[strategy.name] = calls.get(strategy.name, 0) + 1
            return strategy.function(*args, **kwargs)
        return dataclasses.replace(strategy, function=function)

    peak = checkpoint_all_peak(graph)
    budgets = [graph.fixed_bytes + (peak - graph.fixed_bytes) * k // 20 for k in range(1, 21)]
    expected = [_each_budget(graph, cap, budget) for budget in budgets]
    monkeypatch.setattr(strategies, "_CAP_HEURISTICS", tuple(counting(s) for s in strategies._CAP_HEURISTICS))
    check = strategies._CapCheck(graph, cap)
    assert [check(budget) for budget in budgets] == expected
    fixed = {s.name for s in strategies._CAP_HEURISTICS if s.fixed_candidates}
    assert fixed and all(calls.get(name, 0) <= 1 for name in fixed)
    assert calls.get("eviction", 0) <= len(budgets)


def test_the_min_search_tells_its_progress_and_verbose_0_silences_it(capsys):
    graph = repeated_blocks(4)
    plan_graph(graph, "min", "eviction", cache=False, verbose=1)
    shown = capsys.readouterr().err
    assert 'finding "min"' in shown and "forward pass (budget 1 judged)" in shown
    plan_graph(graph, "min", "eviction", cache=False, verbose=0)
    assert capsys.readouterr().err == ""
    reports = []
    plan_graph(graph, "min", "optimal", cache=False, verbose=0, progress=reports.append, time_limit=20)
    notes = [r.note for r in reports if r.note is not None]
    assert notes and all(note.startswith('finding "min"') for note in notes)
    assert capsys.readouterr().err == ""
