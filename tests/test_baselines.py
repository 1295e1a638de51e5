"""Baseline strategies: exact revolve costs, budget families, shared benchmark graphs."""

import json
import math

import networkx as nx
import numpy as np
import pytest
from graph_factories import SHARED_GRAPHS, random_training_graph, training_graph

from tfremat.budget import parse_budget
from tfremat.errors import ArgumentError, BudgetFormatError, InfeasibleBudgetError
from tfremat.graph import load_graph
from tfremat.plan import simulate, validate_schedule
from tfremat.plan.baselines import revolve_advances
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.strategies import get_strategy, solver_strategy_names, strategy_names

HEURISTICS = [n for n in strategy_names() if n not in solver_strategy_names()]


def test_registry_has_every_baseline():
    expected = {"checkpoint_all", "checkpoint_all_ap", "chen_sqrtn", "chen_sqrtn_ap", "chen_greedy",
                "chen_greedy_ap", "griewank_logn", "griewank_logn_ap", "hong", "hong_ap", "eviction", "repair"}
    assert expected <= set(strategy_names())


def test_get_strategy_names_its_argument():
    """An unknown name was a bare TfrematError and a list "unhashable type"; both are
    ArgumentErrors (TfrematErrors and ValueErrors) that list the names."""
    with pytest.raises(ArgumentError, match="unknown strategy 'nope'; choose one of: .*eviction") as info:
        get_strategy("nope")
    assert isinstance(info.value, ValueError)
    for bad in (["eviction"], None, 3):
        with pytest.raises(ArgumentError, match=r"strategy must be one strategy name \(a str\), got .*choose one of"):
            get_strategy(bad)


def test_revolve_matches_griewank_closed_form():
    """Griewank & Walther: with c snapshots (ours: s = c - 1 besides the input) and r repetitions,
    reversing l <= C(c + r, c) steps costs r*l - C(c + r, c - 1) forward steps (unit costs)."""
    for steps, max_slots in ((40, 6), (12, 30)):  # the second has more slots than steps
        cost, _ = revolve_advances(steps, max_slots)
        for s in range(1, max_slots + 1):
            c = s + 1
            for length in range(2, steps + 1):
                r = next(r for r in range(1, 100) if math.comb(c + r, c) >= length)
                assert cost[length, s] == r * length - math.comb(c + r, r - 1)


def test_chain_strategies_trade_memory_for_compute():
    g = training_graph([(j, j + 1) for j in range(15)], sizes=[10] * 16, reads_output=set(range(16)))
    full = simulate(g, get_strategy("checkpoint_all")(g))
    for name in ("chen_sqrtn", "chen_greedy", "griewank_logn", "hong"):
        result = simulate(g, get_strategy(name)(g))
        assert result.peak_bytes < full.peak_bytes, name
        assert result.cost > full.cost, name


@pytest.mark.parametrize("name", HEURISTICS)
def test_family_respects_budget_or_raises_with_smallest_peak(name):
    g = random_training_graph(11, 12)
    strategy = get_strategy(name)
    unconstrained = simulate(g, strategy(g))
    schedule = strategy(g, budget=unconstrained.peak_bytes)
    assert simulate(g, schedule).peak_bytes <= unconstrained.peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        strategy(g, budget=g.fixed_bytes + 1)
    assert info.value.budget_bytes == g.fixed_bytes + 1
    assert info.value.min_feasible_bytes is not None and info.value.min_feasible_bytes > g.fixed_bytes + 1


def test_every_registered_strategy_reads_a_budget_the_same_way():
    """One budget, written five ways, means the same bytes to every strategy (the
    heuristics refused "80%" with a TypeError and took 0.8 as 0.8 bytes, where optimal
    took it as 80%), and a budget below one byte is a format error for all of them (the
    heuristics called it infeasible)."""
    g = random_training_graph(11, 6)
    expected = parse_budget("80%", checkpoint_all_peak(g))
    for name in strategy_names():
        # A limit no solve reaches: one cut short by a loaded machine could return another
        # schedule for one of the five forms.
        options = {"time_limit": 600, "threads": 1} if name in solver_strategy_names() else {}
        outcomes = []
        for budget in ("80%", 0.8, expected, np.int64(expected), f"{expected}B"):
            try:
                schedule = get_strategy(name)(g, budget, **options)
            except InfeasibleBudgetError as exc:
                assert exc.budget_bytes == expected, (name, budget)
                outcomes.append(None)
                continue
            assert simulate(g, schedule).peak_bytes <= expected, (name, budget)
            outcomes.append((schedule.R.tobytes(), schedule.S.tobytes()))
        assert outcomes == outcomes[:1] * len(outcomes), name
        for bad in (0, -5, "0%", 1e-12, "lots"):
            with pytest.raises(BudgetFormatError):
                get_strategy(name)(g, bad, **options)


@pytest.mark.parametrize("name, options", [
    ("griewank_logn", {"slots": -1}), ("griewank_logn", {"slots": -3}), ("griewank_logn_ap", {"slots": 2.5}),
    ("griewank_logn", {"max_slot_counts": 0}), ("chen_greedy", {"num_segment_budgets": 0}),
    ("chen_greedy_ap", {"num_segment_budgets": -2}), ("hong", {"memory_model": "lazy"}),
    ("hong_ap", {"memory_model": None}),
    ("repair", {"time_limit": 0}), ("repair", {"time_limit": -1.0}), ("intervals", {"time_limit": 0}),
    ("intervals", {"time_limit": "5"}),
])
def test_options_out_of_range_raise_argument_errors_naming_them(name, options):
    """slots=-1 silently indexed revolve's table from its end and -3 raised IndexError;
    counts below one a bare numpy ValueError; a time limit of 0 an InfeasibleBudgetError."""
    g = random_training_graph(11, 12)
    budget = int(0.8 * checkpoint_all_peak(g))
    with pytest.raises(ArgumentError, match=f"{next(iter(options))} must be"):
        get_strategy(name)(g, budget, **options)


@pytest.mark.parametrize("name", ["chen_greedy", "chen_greedy_ap"])
def test_chen_greedy_without_forward_activations_keeps_its_own_name(name):
    """With no forward bytes the family is keep-everything alone; its schedule and its
    error were labelled 'checkpoint_all'."""
    g = training_graph([(0, 1), (1, 2)], sizes=[0, 0, 0], fixed_bytes=10)
    schedule = get_strategy(name)(g)
    assert schedule.strategy == name and schedule.cost(g) == g.total_cost
    with pytest.raises(InfeasibleBudgetError, match=f"strategy '{name}'") as info:
        get_strategy(name)(g, 5)
    assert info.value.strategy == name


def test_budget_family_returns_cheapest_fitting_griewank():
    g = training_graph([(j, j + 1) for j in range(11)], sizes=[10] * 12, reads_output=set(range(12)))
    full = simulate(g, get_strategy("checkpoint_all")(g))
    loose = simulate(g, get_strategy("griewank_logn")(g, budget=full.peak_bytes))
    assert loose.cost == full.cost  # enough slots for everything: no recomputation
    tight = simulate(g, get_strategy("griewank_logn")(g, budget=int(full.peak_bytes * 0.6)))
    assert tight.peak_bytes <= full.peak_bytes * 0.6
    assert tight.cost > full.cost


shared = pytest.mark.skipif(not SHARED_GRAPHS.is_dir(), reason=f"benchmark graphs not found at {SHARED_GRAPHS}")


@shared
@pytest.mark.parametrize("path", sorted(SHARED_GRAPHS.glob("*_train.json")) if SHARED_GRAPHS.is_dir() else [], ids=lambda p: p.stem)
def test_every_baseline_runs_on_shared_training_graphs(path):
    g = load_graph(path)
    full = simulate(g, get_strategy("checkpoint_all")(g))
    assert full.cost == pytest.approx(g.total_cost)
    for name in HEURISTICS:
        schedule = get_strategy(name)(g)
        validate_schedule(g, schedule)
        assert simulate(g, schedule).cost >= full.cost - 1e-6


@shared
def test_vgg16_sqrtn_and_greedy_lower_the_peak():
    g = load_graph(SHARED_GRAPHS / "VGG16_256_224_224_3_train.json")
    full = simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes
    for name in ("chen_sqrtn", "chen_greedy"):
        assert simulate(g, get_strategy(name)(g)).peak_bytes < full, name


@shared
def test_moccasin_graph_loads_in_its_stored_order():
    document = json.loads((SHARED_GRAPHS / "random_layered_n100.json").read_text())
    g = load_graph(document)
    assert g.size == 100
    assert g.names == tuple(str(v) for v in document["graph"]["order"])
    assert not g.backward_nodes
    renumbered = load_graph(document, order="topological")
    digraph = nx.DiGraph([(link["0"], link["1"]) for link in document["links"]])
    digraph.add_nodes_from(node["name"] for node in document["nodes"])
    assert renumbered.names == tuple(str(v) for v in nx.topological_sort(digraph)) != g.names
    # Another order is another instance: its checkpoint-all peak differs (9.2% at 100 nodes).
    assert simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes < simulate(
        renumbered, get_strategy("checkpoint_all")(renumbered)).peak_bytes


@pytest.mark.parametrize("seed", range(4))
def test_eviction_recomputes_nothing_when_everything_fits(seed):
    g = random_training_graph(seed, 10)
    everything = simulate(g, get_strategy("checkpoint_all")(g))
    schedule = get_strategy("eviction")(g, budget=everything.peak_bytes)
    validate_schedule(g, schedule)
    assert schedule.cost(g) == pytest.approx(g.total_cost)
    assert simulate(g, schedule).peak_bytes <= everything.peak_bytes


@pytest.mark.parametrize("seed", range(4))
def test_eviction_trades_compute_for_memory_on_random_training_graphs(seed):
    g = random_training_graph(20 + seed, 14)
    everything = simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes
    lowest = simulate(g, get_strategy("eviction")(g)).peak_bytes
    assert lowest < everything
    budget = (lowest + everything) // 2
    schedule = get_strategy("eviction")(g, budget=budget)
    validate_schedule(g, schedule)
    assert simulate(g, schedule).peak_bytes <= budget
    assert schedule.cost(g) >= g.total_cost


@pytest.mark.skipif(not (SHARED_GRAPHS / "ResNet50_256_224_224_3_train.json").exists(), reason="shared graphs absent")
def test_eviction_is_near_the_no_remat_cost_on_resnet50_at_80_percent():
    """Measured 1.0031x (the LP bound is 1.0027x); the best Checkmate baseline costs 1.154x."""
    g = load_graph(SHARED_GRAPHS / "ResNet50_256_224_224_3_train.json")
    budget = int(0.8 * simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes)
    schedule = get_strategy("eviction")(g, budget=budget)
    assert simulate(g, schedule).peak_bytes <= budget
    assert schedule.cost(g) <= 1.01 * g.total_cost


def _random_layered(seed: int, n: int = 40):
    """A layered random DAG whose last node reads many values from all over the graph, like
    the random layered benchmark graphs (eviction fails on those)."""
    import numpy as np

    from tfremat.graph import DFGraph

    rng = np.random.default_rng(seed)
    edges = set()
    for v in range(1, n - 1):
        for u in rng.choice(v, size=min(v, int(rng.integers(1, 4))), replace=False):
            edges.add((int(u), v))
    for u in rng.choice(n - 1, size=n // 3, replace=False):
        edges.add((int(u), n - 1))
    edges.add((n - 2, n - 1))
    return DFGraph(names=[f"v{i}" for i in range(n)], edges=sorted(edges), cost=rng.integers(1, 100, n).astype(float),
                   output_bytes=rng.integers(1, 200, n) * 8, name=f"layered{seed}")


@pytest.mark.parametrize("seed", range(4))
def test_repair_fits_budgets_below_checkpoint_all_on_random_dags(seed):
    g = _random_layered(seed)
    everything = simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes
    assert get_strategy("repair")(g).cost(g) == pytest.approx(g.total_cost)
    for share in (0.95, 0.85):
        budget = int(share * everything)
        try:
            schedule = get_strategy("repair")(g, budget=budget)
        except InfeasibleBudgetError as exc:
            assert exc.min_feasible_bytes is not None and exc.min_feasible_bytes > budget
            continue
        validate_schedule(g, schedule)
        assert simulate(g, schedule).peak_bytes <= budget
        assert g.total_cost <= schedule.cost(g)


def test_repair_gives_up_at_its_time_limit():
    g = _random_layered(5, 60)
    budget = int(0.6 * simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes)
    with pytest.raises(InfeasibleBudgetError, match="time_limit"):
        get_strategy("repair")(g, budget=budget, time_limit=1e-9)


@pytest.mark.skipif(not (SHARED_GRAPHS / "random_layered_n250.json").exists(), reason="shared graphs absent")
def test_repair_fits_the_250_node_random_graph_where_eviction_fails():
    """Measured 1.024x the no-remat cost at 90% (in networkx order; Moccasin's instance, in
    the file's order, has another budget)."""
    g = load_graph(SHARED_GRAPHS / "random_layered_n250.json", order="topological")
    budget = int(0.9 * simulate(g, get_strategy("checkpoint_all")(g)).peak_bytes)
    with pytest.raises(InfeasibleBudgetError):
        get_strategy("eviction")(g, budget=budget)
    schedule = get_strategy("repair")(g, budget=budget)
    assert simulate(g, schedule).peak_bytes <= budget
    assert schedule.cost(g) <= 1.05 * g.total_cost


# ----- deadlines (issue 21) -----


def test_portfolio_skips_heuristics_after_its_deadline(monkeypatch):
    """Issue 21: the heuristics seeding `optimal` took no deadline (minutes on a 5000-node
    chain). best_baseline starts none once its deadline has passed, and none whose
    predictable cost (the longest step seen) exceeds the time left."""
    from fake_heuristics import fake_clock, timed_heuristic

    from tfremat.ilp import portfolio

    # A clock that only the strategies advance: a loaded machine that stalls the test
    # between setting the deadline and the first check cannot skip "first".
    now = fake_clock(monkeypatch)
    graph = training_graph([(0, 1), (1, 2)], [4, 4, 4])
    calls = []
    monkeypatch.setattr(portfolio, "HEURISTICS", (timed_heuristic("first", now, calls, 0.3),
                                                  timed_heuristic("second", now, calls, 0.0),
                                                  timed_heuristic("third", now, calls, 0.0)))
    budget = checkpoint_all_peak(graph)
    graph_total = graph.total_cost
    monkeypatch.setattr(type(graph), "total_cost", property(lambda self: graph_total / 2))  # none is "optimal"
    best, _ = portfolio.best_baseline(graph, budget, deadline=now[0] + 0.2)
    assert calls == ["first"] and best is not None and best.strategy == "first"
    calls.clear()
    best, _ = portfolio.best_baseline(graph, budget, deadline=now[0] - 1)
    assert calls == [] and best is None
    calls.clear()
    # No deadline: all run.
    portfolio.best_baseline(graph, budget)
    assert calls == ["first", "second", "third"]


def test_heuristics_stop_at_the_deadline_with_their_best_so_far():
    """chen_greedy's 48 candidates take half a minute on a 5000-node chain; under a
    deadline it returns the best candidate so far, or says the time ran out."""
    import time

    from tfremat.plan.baselines import heuristic_deadline

    graph = random_training_graph(3, 60)
    with heuristic_deadline(time.perf_counter() - 1):
        for name in ("chen_greedy", "griewank_logn", "hong", "eviction", "repair"):
            with pytest.raises(InfeasibleBudgetError, match="time limit ran out"):
                get_strategy(name)(graph, checkpoint_all_peak(graph) // 2)
    free = get_strategy("chen_greedy")(graph, checkpoint_all_peak(graph))
    with heuristic_deadline(time.perf_counter() + 60) as scope:
        assert get_strategy("chen_greedy")(graph, checkpoint_all_peak(graph)).cost(graph) == free.cost(graph)
        assert scope.step > 0  # the longest candidate is recorded for the portfolio's predictions


def test_griewank_revolve_table_stops_at_the_deadline():
    """revolve_advances is O(L^2 s): 89 s for a 5000-node chain; it stops at the deadline."""
    import time

    from tfremat.plan.baselines import _OutOfTime, heuristic_deadline

    with heuristic_deadline(time.perf_counter() - 1), pytest.raises(_OutOfTime):
        revolve_advances(200, 199)
