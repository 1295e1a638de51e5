"""Schedule cache and the graph-level API (no TensorFlow); at the end, the argument checks
of the Keras API (skipped without TensorFlow)."""

import json

import numpy as np
import pytest
from graph_factories import random_training_graph

from tfremat.cache import ScheduleCache
from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverError,
    SolverLicenseError,
    SolverTimeLimitError,
    SolverUnavailableError,
    TfrematError,
    failure_status,
)
from tfremat.planner import check_cache_argument, compare_graph, plan_graph, summary_row


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
    import dataclasses
    import math

    import tfremat.planner as planner
    from tfremat.strategies import get_strategy

    seen = {}

    def recording(name):
        real = get_strategy(name)

        def function(graph, budget=None, **options):
            seen[name] = options
            return real.function(graph, budget, **options)

        return dataclasses.replace(real, function=function)

    monkeypatch.setattr(planner, "get_strategy", recording)
    g = random_training_graph(4, 8)
    planner.plan_graph(g, "90%", "optimal", cache=False, verbose=0)
    assert seen["optimal"]["time_limit"] == planner.DEFAULT_TIME_LIMIT == 60.0
    planner.plan_graph(g, "90%", "optimal", cache=False, verbose=0, time_limit=5, solver=None)
    assert seen["optimal"] == {"time_limit": 5}
    result = planner.plan_graph(g, "90%", "approx_lp", cache=False, verbose=0, time_limit=math.inf)
    assert seen["approx_lp"] == {"time_limit": math.inf} and result.schedule.facts.status in ("optimal", "feasible")
    planner.plan_graph(g, "90%", "chen_greedy", cache=False, verbose=0)
    assert seen["chen_greedy"] == {}
    # The command line applies it before plan_graph does: twice must not undo math.inf.
    twice = planner.strategy_options("optimal", **planner.strategy_options("optimal", time_limit=math.inf))
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
    with pytest.raises(ArgumentError, match="unknown strategy 'nope'"):
        compare_graph(g, "85%", ["eviction", "nope"], cache=False)  # before eviction runs


def test_compare_graph_keeps_every_row_when_a_milp_stops_without_a_schedule():
    """optimal's SolverTimeLimitError (no heuristic fitting) ended the whole comparison;
    it is now optimal's entry, "no schedule" in its row, with the message and the
    smallest peak a heuristic reached. An option error is raised, not a row."""
    g = random_training_graph(3, 10)
    names = ["optimal", "eviction", "checkpoint_all"]
    entries = compare_graph(g, "60%", names, cache=False, verbose=0, time_limit=1e-9)
    assert len(entries) == 3 and isinstance(entries[0], SolverTimeLimitError)
    assert [failure_status(e) for e in entries] == ["no schedule", "infeasible", "infeasible"]
    rows = [summary_row(name, entry, 58) for name, entry in zip(names, entries)]
    assert [row["strategy"] for row in rows] == names
    assert rows[0]["status"] == "no schedule" and "time_limit" in rows[0]["error"] and rows[0]["budget_bytes"] == 58
    assert rows[1]["min_feasible_bytes"] > 58 and "infeasible" in rows[1]["error"]
    assert rows[0]["min_feasible_bytes"] == entries[0].min_feasible_bytes > 58
    with pytest.raises(ArgumentError, match="threads must be a positive int"):
        compare_graph(g, "60%", names, cache=False, verbose=0, threads=0)
    assert failure_status(SolverError("HiGHS failed")) is None
    fitting = compare_graph(g, "100%", ["checkpoint_all"], cache=False)
    assert summary_row("checkpoint_all", fitting[0], None) == fitting[0].summary()


def test_an_unusable_solver_is_raised_not_recorded():
    """A missing or unlicensed solver is the caller's to fix: no row could say anything."""
    assert failure_status(SolverUnavailableError("no gurobipy")) is None
    assert failure_status(SolverLicenseError("size-limited license")) is None
    assert failure_status(ArgumentError("bad")) is None


def test_plan_graph_names_bad_arguments():
    """A list for strategy was "unhashable type", None for graph an AttributeError, and
    cache=5 a bare TypeError; an unknown strategy is an ArgumentError (and TfrematError)."""
    g = random_training_graph(3, 10)
    with pytest.raises(ArgumentError, match=r"graph must be a DFGraph \(.*\), got NoneType"):
        plan_graph(None, "85%", "eviction")
    with pytest.raises(ArgumentError, match=r"strategy must be one strategy name \(a str\), got \['eviction'\]"):
        plan_graph(g, "85%", ["eviction"], cache=False)
    with pytest.raises(ArgumentError, match="unknown strategy 'nope'") as info:
        plan_graph(g, "85%", "nope", cache=False)
    assert isinstance(info.value, TfrematError)
    for bad in (5, "", 1.0, [str(g)]):
        with pytest.raises(ArgumentError, match="cache must be True .*False or None .*a directory path"):
            plan_graph(g, "85%", "eviction", cache=bad)
    with pytest.raises(ArgumentError, match="graph must be a DFGraph"):
        compare_graph("g.json", "85%", ["eviction"], cache=False)


def test_check_cache_argument_takes_every_documented_form(tmp_path):
    for good in (True, False, None, str(tmp_path), tmp_path, ScheduleCache(tmp_path)):
        check_cache_argument(good)
    with pytest.raises(ArgumentError, match="got 5"):
        check_cache_argument(5)


def test_an_empty_strategy_list_is_refused():
    """compare_graph([]) ran every strategy while max_batch_size([]) ran none; both refuse
    it now, and None still means every strategy here."""
    g = random_training_graph(3, 10)
    with pytest.raises(ArgumentError, match="strategies is empty"):
        compare_graph(g, "85%", [], cache=False)
    with pytest.raises(ArgumentError, match="strategies must be a list"):
        compare_graph(g, "85%", 5, cache=False)


# ----- the Keras API's argument checks (before any extraction) -----


def dense_classifier(classes=4, loss="categorical_crossentropy"):
    """A two-layer Dense classifier on 8 features, compiled: a model extracted in a second."""
    keras = pytest.importorskip("keras")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(classes, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss=loss)
    return model


def test_plan_names_a_model_or_data_that_cannot_be_planned():
    """plan(None) said "no loss: compile the model", a list for x raised AttributeError, and
    labels shorter than the batch reached Keras as a shape error."""
    import tfremat

    model = dense_classifier()
    x, y = np.zeros((8, 8), "float32"), np.eye(4, dtype="float32")[np.zeros(8, int)]
    with pytest.raises(ArgumentError, match="model must be a keras.Model .*got NoneType"):
        tfremat.plan_model(None, "100%", x, y, batch_size=4)
    with pytest.raises(ArgumentError, match="model must be a keras.Model .*got DFGraph; a DFGraph is planned by"):
        tfremat.compare(random_training_graph(3, 10), "100%", x, y, batch_size=4)
    with pytest.raises(ArgumentError, match=r"x must be arrays .*np.asarray\(x\)"):
        tfremat.plan_model(model, "100%", x.tolist(), y, batch_size=4, verbose=0)
    with pytest.raises(ArgumentError, match=r"y has 2 samples \(an array of shape \(2, 4\)\), fewer than batch_size=4"):
        tfremat.plan_model(model, "100%", x, y[:2], batch_size=4, verbose=0)
    for call in (tfremat.plan_model, tfremat.compare):
        with pytest.raises(ArgumentError, match="cache must be"):
            call(model, "100%", x, y, batch_size=4, cache=5)
    with pytest.raises(ArgumentError, match="strategy must be one strategy name"):
        tfremat.plan_model(model, "100%", x, y, batch_size=4, strategy=["eviction"])
    with pytest.raises(ArgumentError, match="strategies is empty"):
        tfremat.compare(model, "100%", x, y, batch_size=4, strategies=[])


def test_fit_refuses_no_budget_and_says_why():
    """plan reads budget=None as no limit; fit has nothing to do without one."""
    import tfremat

    x, y = np.zeros((8, 8), "float32"), np.eye(4, dtype="float32")[np.zeros(8, int)]
    with pytest.raises(ArgumentError, match="budget=None: tfremat.fit needs a budget.*call model.fit"):
        tfremat.fit(dense_classifier(), None, x, y, batch_size=4)
    with pytest.raises(ArgumentError, match="model must be a keras.Model"):
        tfremat.fit(None, "50%", x, y, batch_size=4)


def test_tfremat_measure_is_an_attribute_of_the_package(monkeypatch):
    """``import tfremat; tfremat.measure`` raised AttributeError unless something had
    imported the submodule before."""
    pytest.importorskip("tensorflow")
    import tfremat

    monkeypatch.delattr(tfremat, "measure", raising=False)
    assert tfremat.measure.measure_model.__module__ == "tfremat.measure"
