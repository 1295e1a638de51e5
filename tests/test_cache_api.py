"""Schedule cache and the graph-level API (no TensorFlow); at the end, the argument checks
of the Keras API (skipped without TensorFlow)."""

import json
import logging

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
    """A miss, left in place (a reader never deletes: another process may have just
    written a good entry), and overwritten by the next store."""
    g = random_training_graph(3, 10)
    full = plan_graph(g, None, "checkpoint_all", cache=False)
    cache = ScheduleCache(tmp_path)
    budget = int(full.predicted_peak_bytes * 0.85)
    cache.store(g, budget, "chen_greedy", full.schedule)  # a schedule that does not fit that budget
    assert cache.load(g, budget, "chen_greedy") is None
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert not plan_graph(g, budget, "chen_greedy", cache=cache).from_cache
    assert plan_graph(g, budget, "chen_greedy", cache=cache).from_cache


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


# ----- safe caches (issue 21): unwritable directories, concurrent writers, lying entries -----


def _under_a_file(tmp_path):
    """A cache directory that can be neither created nor written, even by root (these tests
    run as root, where a chmod'ed read-only directory is still writable): its parent is a
    regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    return blocker / "cache"


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_unwritable_schedule_cache_directory_is_one_warning_not_an_error(tmp_path, caplog):
    """store raised NotADirectoryError (PermissionError for a read-only directory) and
    planning failed; now every plan succeeds, without a cache, and the directory is
    warned about once. (Simulated with a directory under a regular file: tests run as root.)"""
    caplog.set_level(logging.DEBUG, logger="tfremat")
    g = random_training_graph(3, 10)
    directory = _under_a_file(tmp_path)
    for budget in ("85%", "90%", "85%"):
        result = plan_graph(g, budget, "chen_greedy", cache=directory)
        assert not result.from_cache and result.predicted_peak_bytes <= result.budget_bytes
    assert len(_warnings(caplog, "cannot be written")) == 1
    assert ScheduleCache(directory).store(g, None, "chen_greedy", result.schedule) is None


def test_a_denied_write_or_read_is_a_warning_and_a_miss(tmp_path, caplog, monkeypatch):
    """PermissionError from the rename of a store and from reading an entry (simulated by
    patching os.replace and the cache module's open, as root ignores file modes): both are
    warned about once per directory; a read that fails is a miss; no temporary file is
    left behind."""
    import tfremat.cache as cache_module

    caplog.set_level(logging.DEBUG, logger="tfremat")
    g = random_training_graph(3, 10)
    assert not plan_graph(g, "85%", "chen_greedy", cache=tmp_path).from_cache
    assert plan_graph(g, "85%", "chen_greedy", cache=tmp_path).from_cache

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr(cache_module.os, "replace", denied)
    for budget in ("90%", "95%"):
        assert not plan_graph(g, budget, "chen_greedy", cache=tmp_path).from_cache
    assert len(_warnings(caplog, "cannot be written")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [_only_entry(tmp_path).name]  # no temporary left

    monkeypatch.setattr(cache_module, "open", denied, raising=False)
    for _ in range(2):
        assert not plan_graph(g, "85%", "chen_greedy", cache=tmp_path).from_cache
    assert len(_warnings(caplog, "cannot be read")) == 1


_HAMMER = r"""
import json, sys
from tfremat.cache import ScheduleCache
from tfremat.graph import load_graph
from tfremat.plan.schedule import Schedule

graph = load_graph(sys.argv[1])
cache = ScheduleCache(sys.argv[2])
schedules = [Schedule.from_dict(d, graph) for d in json.load(open(sys.argv[3]))]
misses = 0
for i in range(int(sys.argv[4])):
    cache.store(graph, None, "hammer", schedules[i % len(schedules)])
    misses += cache.load(graph, None, "hammer") is None
print(misses)
"""


def test_processes_writing_one_key_neither_crash_nor_lose_the_entry(tmp_path):
    """Writers shared one fixed <key>.tmp: one renamed the other's half-written file
    (FileNotFoundError for the other, a corrupt entry that readers then deleted). With a
    unique temporary name per write and readers that never delete, every load after a
    store is a hit. Four processes store and load one key 300 times each, alternating
    schedules of different lengths."""
    import subprocess
    import sys

    from tfremat.strategies import get_strategy

    g = random_training_graph(7, 40)
    graph_file = tmp_path / "graph.json"
    g.to_json(graph_file)
    documents = [get_strategy(name)(g).to_dict(g) for name in ("checkpoint_all", "chen_sqrtn", "griewank_logn")]
    assert len({len(json.dumps(d)) for d in documents}) == 3
    schedules_file = tmp_path / "schedules.json"
    schedules_file.write_text(json.dumps(documents))
    directory = tmp_path / "cache"
    processes = [
        subprocess.Popen([sys.executable, "-c", _HAMMER, str(graph_file), str(directory), str(schedules_file), "300"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outcomes = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, outcomes):
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == "0", err[-2000:]  # no load missed: no entry was corrupt or deleted
    assert ScheduleCache(directory).load(g, None, "hammer") is not None
    assert [p.name for p in directory.iterdir()] == [ScheduleCache(directory).path(ScheduleCache.key(g, None, "hammer")).name]


def _planned_entry(tmp_path, strategy="optimal", budget="85%"):
    g = random_training_graph(3, 10)
    assert not plan_graph(g, budget, strategy, cache=tmp_path, verbose=0, threads=1).from_cache
    return g, _only_entry(tmp_path)


@pytest.mark.parametrize("strategy, budget", [("optimal", "85%"), ("approx_lp", "85%"), ("optimal", None)])
def test_entries_with_solver_facts_are_trusted(tmp_path, strategy, budget):
    """The checks of the facts refuse no entry a strategy writes."""
    g, _ = _planned_entry(tmp_path, strategy, budget)
    again = plan_graph(g, budget, strategy, cache=tmp_path, verbose=0, threads=1)
    assert again.from_cache and again.schedule.facts is not None


def _set(**values):
    return lambda document: document.update(values)


def _set_facts(**values):
    return lambda document: document["facts"].update(values)


def _exact_facts(document):
    facts = document["facts"]
    facts.update(objective=facts["objective"] + 1, best_bound=facts["objective"] + 1, gap=0.0)


LIES = {
    "ten million nodes": _set(num_nodes=10_000_000),
    "num_nodes as text": lambda d: d.update(num_nodes=str(d["num_nodes"])),
    "one node more than the graph": lambda d: d.update(num_nodes=d["num_nodes"] + 1),
    "another graph's fingerprint": _set(graph_fingerprint="0" * 16),
    "no fingerprint": _set(graph_fingerprint=None),
    "a stage out of range": lambda d: d["R"].append([d["num_nodes"], 0]),
    "R as text": _set(R="[[0, 0]]"),
    "a short order": _set(order=[0]),
    "strategy not a name": _set(strategy=["optimal"]),
    "facts as a list": _set(facts=[1]),
    "an unknown fact": _set_facts(proof="trust me"),
    "unknown status": _set_facts(status="unknown"),
    "status as a number": _set_facts(status=3),
    "negative gap": _set_facts(gap=-3),
    "gap above 1": _set_facts(gap=7.0),
    "gap that is not the objective's": _set_facts(gap=0.5),
    "objective below the bound": lambda d: d["facts"].update(best_bound=2 * d["facts"]["objective"], gap=0.0),
    "objective that is not the cost": _exact_facts,
    "peak that is not the simulated one": lambda d: d["facts"].update(peak_bytes=d["facts"]["peak_bytes"] - 1),
    "another budget": lambda d: d["facts"].update(budget_bytes=d["facts"]["budget_bytes"] + 1),
    "negative seconds": _set_facts(seconds=-1.0),
    "num_vars as a float": _set_facts(num_vars=1.5),
    "solver as a number": _set_facts(solver=7),
}


@pytest.mark.parametrize("lie", LIES, ids=list(LIES))
def test_an_entry_whose_document_or_facts_lie_is_a_logged_miss_then_overwritten(tmp_path, caplog, lie):
    """num_nodes=10000000 made from_dict allocate 2 x 10^14 bytes (MemoryError on every
    later run); facts with a negative gap, an unknown status or a bound above the
    objective were shown as proven. Each is now a miss, logged, left in place (readers
    never delete) and overwritten by the next plan's store."""
    g, entry = _planned_entry(tmp_path)
    document = json.loads(entry.read_text())
    LIES[lie](document["schedule"])
    entry.write_text(json.dumps(document))
    caplog.set_level(logging.WARNING, logger="tfremat")
    again = plan_graph(g, "85%", "optimal", cache=tmp_path, verbose=0, threads=1)
    assert not again.from_cache
    assert _warnings(caplog, "not trusted"), lie
    assert again.schedule.facts.gap is not None and 0 <= again.schedule.facts.gap <= 1
    assert plan_graph(g, "85%", "optimal", cache=tmp_path, verbose=0, threads=1).from_cache


def test_schedule_document_size_is_checked_before_allocating():
    """Without a graph, num_nodes is bounded by the pairs listed in R (every stage computes
    its own node): 10^7 nodes with ten pairs is refused at once, not allocated."""
    from tfremat.errors import ScheduleError
    from tfremat.plan.schedule import Schedule
    from tfremat.strategies import get_strategy

    g = random_training_graph(3, 10)
    document = get_strategy("checkpoint_all")(g).to_dict(g)
    for graph in (None, g):
        with pytest.raises(ScheduleError, match="num_nodes 10000000|10000000 nodes"):
            Schedule.from_dict({**document, "num_nodes": 10_000_000}, graph)


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


# ----- safe caches with TensorFlow: the profile cache, cache=False, --nocache -----


def _dense_data():
    return np.zeros((8, 8), "float32"), np.eye(4, dtype="float32")[np.arange(8) % 4]


def test_unwritable_cache_directory_plans_and_trains_with_one_warning_per_directory(tmp_path, monkeypatch, caplog):
    """$TFREMAT_CACHE_DIR that cannot be written made plan_model and fit fail (the profile
    cache's makedirs, then the schedule cache's store). Now both run, and each directory
    (the profile cache's, the schedule cache's and the optimizer update count's) is warned
    about once. Simulated with a path under a regular file: tests run as root, where a
    read-only mode stops no write."""
    import tfremat
    import tfremat.extract.optimizer_update as optimizer_update

    directory = _under_a_file(tmp_path)
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(directory))
    # The optimizer's update count is kept in memory too: an earlier test of this process
    # would spare its store, and its directory's warning, depending on the test order.
    monkeypatch.setattr(optimizer_update, "_cache", {})
    caplog.set_level(logging.DEBUG, logger="tfremat")
    x, y = _dense_data()
    for _ in range(2):
        result = tfremat.plan_model(dense_classifier(), "100%", x, y, batch_size=4, strategy="chen_greedy",
                                    cost_model="flops", verbose=0)
        assert not result.from_cache and not result.extraction.cache_hit
    history = tfremat.fit(dense_classifier(), "100%", x, y, batch_size=4, strategy="chen_greedy",
                          cost_model="flops", verbose=0)
    assert len(history.history["loss"]) == 1
    written = _warnings(caplog, "cannot be written")
    assert sorted(r.getMessage().split()[2] for r in written) == sorted(
        [str(directory), str(directory / "schedules"), str(directory / "optimizer_update")])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r not in written
                and "cache" in r.getMessage()]


def test_unreadable_profile_cache_is_a_miss(tmp_path, monkeypatch, caplog):
    """A PermissionError reading the profile cache's entry (simulated by patching the cache
    module's open, as root reads any file) is one warning and a miss, not an error."""
    import tfremat.cache as cache_module
    from tfremat.extract import extract

    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.DEBUG, logger="tfremat")
    batch = _dense_data()
    assert not extract(dense_classifier(), batch, cost_model="flops").cache_hit
    assert extract(dense_classifier(), batch, cost_model="flops").cache_hit

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr(cache_module, "open", denied, raising=False)
    for _ in range(2):
        assert not extract(dense_classifier(), batch, cost_model="flops").cache_hit
    assert len(_warnings(caplog, "cannot be read")) == 1


def test_cache_false_turns_the_profile_cache_off_too(tmp_path, monkeypatch):
    """cache=False turned off the schedule cache only: extraction still read and wrote its
    profile cache. Now plan_model, compare and fit (through RematCallback) read nothing
    from the cache directory and write nothing to it."""
    import tfremat

    directory = tmp_path / "cache"
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(directory))
    x, y = _dense_data()
    common = {"batch_size": 4, "cost_model": "flops", "verbose": 0}
    result = tfremat.plan_model(dense_classifier(), "100%", x, y, strategy="chen_greedy", cache=False, **common)
    tfremat.compare(dense_classifier(), "100%", x, y, strategies=["chen_greedy"], cache=False, **common)
    tfremat.fit(dense_classifier(), "100%", x, y, batch_size=4, strategy="chen_greedy", cost_model="flops",
                cache=False, verbose=0)
    assert not result.extraction.cache_hit and not directory.exists()
    # With entries there, cache=False still profiles and solves anew.
    tfremat.plan_model(dense_classifier(), "100%", x, y, strategy="chen_greedy", **common)
    entries = sorted(p for p in directory.rglob("*") if p.is_file())
    assert len(entries) == 2
    again = tfremat.plan_model(dense_classifier(), "100%", x, y, strategy="chen_greedy", cache=False, **common)
    assert not again.extraction.cache_hit and not again.from_cache
    assert tfremat.plan_model(dense_classifier(), "100%", x, y, strategy="chen_greedy", **common).extraction.cache_hit
    assert sorted(p for p in directory.rglob("*") if p.is_file()) == entries


_PROFILE_HAMMER = r"""
import json, sys
from tfremat.extract.analysis import CallAnalysis
from tfremat.extract.profile_cache import load_cache, store_cache

key, data = sys.argv[1], json.load(open(sys.argv[2]))
calls = [CallAnalysis.from_dict(d) for d in data["calls"]]
loss = CallAnalysis.from_dict(data["loss"])
misses = 0
for i in range(int(sys.argv[3])):
    store_cache(key, calls, loss, [{} for _ in calls])
    misses += load_cache(key, len(calls)) is None
print(misses)
"""


def test_processes_writing_one_profile_entry_neither_crash_nor_lose_it(tmp_path, monkeypatch):
    """The profile cache writes through the same unique temporary file and rename, and
    its readers never delete: three processes storing and loading one key all hit."""
    import os
    import subprocess
    import sys

    from tfremat.extract import extract

    directory = tmp_path / "cache"
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(directory))
    extract(dense_classifier(), _dense_data(), cost_model="flops")
    (entry,) = directory.glob("*.json")
    copy = tmp_path / "entry.json"
    copy.write_text(entry.read_text())
    processes = [
        subprocess.Popen([sys.executable, "-c", _PROFILE_HAMMER, entry.stem, str(copy), "200"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "TFREMAT_CACHE_DIR": str(directory), "TF_CPP_MIN_LOG_LEVEL": "3"})
        for _ in range(3)
    ]
    outcomes = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, outcomes):
        assert process.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "0", err[-2000:]
    assert [p.name for p in directory.iterdir()] == [entry.name]
    assert extract(dense_classifier(), _dense_data(), cost_model="flops").cache_hit


def test_command_line_nocache_reads_and_writes_no_cache(tmp_path):
    """The command line could not turn the caches off. --nocache (absl's negation of
    --cache, default on) is a flag of every command that plans; solve, which has no cache,
    refuses it."""
    import os
    import subprocess
    import sys

    keras = pytest.importorskip("keras")
    model_file = tmp_path / "dense.keras"
    dense_classifier().save(model_file)
    directory = tmp_path / "cache"
    env = {**os.environ, "TFREMAT_CACHE_DIR": str(directory), "TF_CPP_MIN_LOG_LEVEL": "3"}
    del keras

    def run(*args):
        return subprocess.run([sys.executable, "-m", "tfremat.cli", *args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)

    plan = ["plan", f"--model={model_file}", "--batch=4", "--budget=100%", "--strategy=chen_greedy",
            "--cost_model=flops", f"--schedule_out={tmp_path / 's.json'}", "--json"]
    done = run(*plan, "--nocache")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not json.loads(done.stdout.splitlines()[-1])["from_cache"] and not directory.exists()
    done = run(*plan)
    assert done.returncode == 0 and directory.exists(), done.stderr[-2000:]
    assert json.loads(run(*plan).stdout.splitlines()[-1])["from_cache"]
    refused = run("solve", "--graph=g.json", "--strategy=chen_greedy", "--nocache")
    assert refused.returncode == 2 and "--cache is not a flag of `tfremat solve`" in refused.stderr
    from tfremat.cli import COMMAND_FLAGS

    assert [c for c, names in COMMAND_FLAGS.items() if "cache" in names] == ["graph", "plan", "compare", "maxbatch",
                                                                              "plot", "measure"]
