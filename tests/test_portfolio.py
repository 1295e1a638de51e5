"""The portfolio's order and gate (issue 33): eviction, the heuristic that wins on training
graphs, runs first, and once a schedule fits the heuristics after it share
``_COMPETING_SECONDS`` instead of each running to its end (chen/griewank and repair took
12 CPU s behind eviction's 1 s on EfficientNetV2B0, benchmarks/latency.py)."""

from fake_heuristics import fake_clock, timed_heuristic
from graph_factories import training_graph

from tfremat.ilp import portfolio
from tfremat.plan.eviction import eviction
from tfremat.plan.repair import repair
from tfremat.plan.simulator import checkpoint_all_peak


def test_eviction_runs_first_and_repair_last():
    order = portfolio.run_order(portfolio.HEURISTICS)
    assert order[0] is eviction and order[-1] is repair
    assert sorted(s.name for s in order) == sorted(s.name for s in portfolio.HEURISTICS)


def test_heuristics_after_the_first_fit_share_the_competing_seconds(monkeypatch):
    now = fake_clock(monkeypatch)
    graph = training_graph([(0, 1), (1, 2)], [4, 4, 4])
    graph_total = graph.total_cost
    monkeypatch.setattr(type(graph), "total_cost", property(lambda self: graph_total / 2))  # none is "optimal"
    calls = []
    first = timed_heuristic("first", now, calls, 1.0)
    monkeypatch.setattr(portfolio, "eviction", first)
    # Listed last, run first; "slow" then uses 5 of the 6 shared seconds, leaving less
    # than its step for "late".
    monkeypatch.setattr(portfolio, "HEURISTICS", (timed_heuristic("slow", now, calls, 5.0),
                                                  timed_heuristic("late", now, calls, 0.5), first))
    best, _ = portfolio.best_baseline(graph, checkpoint_all_peak(graph))
    assert calls == ["first", "slow"] and best is not None and best.strategy == "first"


def test_without_a_fitting_schedule_every_heuristic_runs(monkeypatch):
    now = fake_clock(monkeypatch)
    graph = training_graph([(0, 1), (1, 2)], [4, 4, 4])
    calls = []
    first = timed_heuristic("first", now, calls, 1.0)
    monkeypatch.setattr(portfolio, "eviction", first)
    monkeypatch.setattr(portfolio, "HEURISTICS", (timed_heuristic("slow", now, calls, 5.0),
                                                  timed_heuristic("late", now, calls, 5.0), first))
    best, _ = portfolio.best_baseline(graph, 1)  # one byte: nothing fits
    assert best is None and calls == ["first", "slow", "late"]
