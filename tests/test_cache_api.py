"""Schedule cache and the graph-level API (no TensorFlow)."""

import json

import numpy as np

from tfremat.api import compare_graph, plan_graph
from tfremat.cache import ScheduleCache
from tfremat.errors import InfeasibleBudgetError

from graph_factories import random_training_graph


def test_cache_miss_then_hit(tmp_path):
    g = random_training_graph(1, 10)
    first = plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    assert not first.from_cache
    second = plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    assert second.from_cache and second.solve_seconds == 0.0
    assert np.array_equal(first.schedule.R, second.schedule.R) and np.array_equal(first.schedule.S, second.schedule.S)
    assert second.predicted_peak_bytes == first.predicted_peak_bytes <= first.budget_bytes


def test_cache_key_separates_budget_strategy_and_graph(tmp_path):
    g = random_training_graph(1, 10)
    plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    assert not plan_graph(g, "95%", "chen_greedy", cache=tmp_path).from_cache
    assert not plan_graph(g, "85%", "chen_sqrtn", cache=tmp_path).from_cache
    assert not plan_graph(random_training_graph(2, 10), "100%", "chen_greedy", cache=tmp_path).from_cache


def _only_entry(directory):
    entries = list(directory.glob("*.json"))
    assert len(entries) == 1
    return entries[0]


def test_corrupt_entry_is_resolved_not_trusted(tmp_path):
    g = random_training_graph(3, 10)
    plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    entry = _only_entry(tmp_path)
    entry.write_text("{ not json")
    again = plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    assert not again.from_cache
    assert json.loads(_only_entry(tmp_path).read_text())["schedule"]["R"]


def test_entry_that_is_json_but_no_object_is_resolved(tmp_path):
    """null, a list or a string parse as JSON; reading them as an entry raised
    AttributeError instead of solving again."""
    g = random_training_graph(3, 10)
    plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    entry = _only_entry(tmp_path)
    for text in ("null", "[]", '"x"', "5", '{"key": null, "schedule": 5}'):
        entry.write_text(text)
        again = plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
        assert not again.from_cache, text
        assert json.loads(_only_entry(tmp_path).read_text())["schedule"]["R"]


def test_stale_entry_that_breaks_the_schedule_rules_is_resolved(tmp_path):
    g = random_training_graph(3, 10)
    plan_graph(g, "85%", "chen_greedy", cache=tmp_path)
    entry = _only_entry(tmp_path)
    document = json.loads(entry.read_text())
    document["schedule"]["R"] = [pair for pair in document["schedule"]["R"] if pair[0] != pair[1] or pair[0] != 3]
    entry.write_text(json.dumps(document))
    assert not plan_graph(g, "85%", "chen_greedy", cache=tmp_path).from_cache


def test_entry_over_budget_is_resolved(tmp_path):
    g = random_training_graph(3, 10)
    full = plan_graph(g, None, "checkpoint_all", cache=False)
    cache = ScheduleCache(tmp_path)
    budget = int(full.predicted_peak_bytes * 0.85)
    cache.store(g, budget, "chen_greedy", full.schedule)  # a schedule that does not fit that budget
    assert cache.load(g, budget, "chen_greedy") is None
    assert not list(tmp_path.glob("*.json"))


def test_compare_graph_reports_infeasible_strategies_with_smallest_peak():
    g = random_training_graph(4, 10)
    rows = compare_graph(g, g.fixed_bytes + 1, ["checkpoint_all", "chen_greedy"], cache=False)
    assert all(isinstance(r, InfeasibleBudgetError) for r in rows)
    assert all(r.min_feasible_bytes > g.fixed_bytes + 1 for r in rows)
    rows = compare_graph(g, "90%", ["checkpoint_all", "chen_greedy"], cache=False)
    assert isinstance(rows[0], InfeasibleBudgetError)
    assert rows[1].predicted_peak_bytes <= rows[1].budget_bytes


def test_milp_strategies_get_a_default_time_limit_from_the_api(monkeypatch):
    """plan_graph (and so plan, fit, compare and the command line) gives the MILP
    strategies 60 s unless told otherwise; math.inf asks for no limit; the heuristics get
    only what the caller passed."""
    import math

    import tfremat.api as api
    from tfremat.plan.registry import get_strategy

    seen = {}

    def recording(name):
        real = get_strategy(name)

        def strategy(graph, budget=None, **options):
            seen[name] = options
            return real(graph, budget, **options)

        return strategy

    monkeypatch.setattr(api, "get_strategy", recording)
    g = random_training_graph(4, 8)
    api.plan_graph(g, "90%", "optimal", cache=False, verbose=0)
    assert seen["optimal"]["time_limit"] == api.DEFAULT_TIME_LIMIT == 60.0
    api.plan_graph(g, "90%", "optimal", cache=False, verbose=0, time_limit=5, solver=None)
    assert seen["optimal"] == {"time_limit": 5}
    result = api.plan_graph(g, "90%", "approx_lp", cache=False, verbose=0, time_limit=math.inf)
    assert seen["approx_lp"] == {"time_limit": math.inf} and result.schedule.facts["status"] in ("optimal", "feasible")
    api.plan_graph(g, "90%", "chen_greedy", cache=False, verbose=0)
    assert seen["chen_greedy"] == {}
    # The command line applies it before plan_graph does: twice must not undo math.inf.
    twice = api.strategy_options("optimal", **api.strategy_options("optimal", time_limit=math.inf))
    assert twice == {"time_limit": math.inf}


def test_plan_graph_runs_the_lp_strategy_with_its_progress_line(capsys):
    """approx_lp gets the progress line like optimal (it once had no progress option, and
    plan_graph, fit and the callback failed with a TypeError)."""
    g = random_training_graph(3, 10)
    result = plan_graph(g, "85%", "approx_lp", cache=False, threads=1)
    assert result.predicted_peak_bytes <= result.budget_bytes
    assert "tfremat approx_lp" in capsys.readouterr().err


def test_plan_graph_names_an_option_the_strategy_does_not_take():
    g = random_training_graph(3, 10)
    try:
        plan_graph(g, "85%", "chen_greedy", cache=False, time_limit=5)
    except ValueError as exc:
        assert "strategy 'chen_greedy' takes no option 'time_limit'" in str(exc)
        assert "num_segment_budgets" in str(exc)
    else:
        raise AssertionError("an unknown option was accepted")


def test_compare_graph_checks_its_strategies_and_options_before_running_any():
    import pytest

    g = random_training_graph(3, 10)
    with pytest.raises(ValueError, match=r"write \['eviction'\]"):
        compare_graph(g, "85%", "eviction", cache=False)
    with pytest.raises(ValueError, match="'foo' is taken by no MILP strategy"):
        compare_graph(g, "85%", ["eviction"], cache=False, foo=5)
    with pytest.raises(ValueError, match="'time_limit' is taken by no MILP strategy"):
        compare_graph(g, "85%", ["eviction", "chen_greedy"], cache=False, time_limit=5)
    # mip_gap is optimal's alone: approx_lp runs without it.
    results = compare_graph(g, "85%", ["optimal", "approx_lp"], cache=False, verbose=0, mip_gap=0.01, threads=1)
    assert [r.strategy for r in results] == ["optimal", "approx_lp"]
    with pytest.raises(TypeError, match="cache must be"):
        plan_graph(g, "85%", "eviction", cache=5)
