"""The budgets "min" (least memory within one extra forward pass) and "absolute min", and the
warning for budgets that recompute nothing (no TensorFlow)."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

from graph_factories import random_training_graph, repeated_blocks, training_graph
from tfremat.budget import budget_kind, check_budget, is_absolute_min, is_share, parse_budget
from tfremat.errors import ArgumentError, BudgetFormatError, InfeasibleBudgetError
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.planner import compare_graph, plan_graph


def _chain(length: int = 12):
    return training_graph([(j - 1, j) for j in range(1, length)], [4] * length, fixed_bytes=2)


_GRAPHS = [_chain(), repeated_blocks(4), random_training_graph(3, 10), random_training_graph(7, 14)]


def _overhead(graph, schedule) -> float:
    return schedule.cost(graph) / graph.total_cost - 1


def test_min_spellings():
    for spelling in ("min", " MIN ", "absolute min", "Absolute  MIN"):
        check_budget(spelling)
        assert budget_kind(spelling) == "min" and is_share(spelling)
        with pytest.raises(BudgetFormatError, match="which the planner finds"):
            parse_budget(spelling, 1000)
    assert is_absolute_min(" absolute   Min") and not is_absolute_min("min") and not is_absolute_min(0.5)
    for wrong in ("min!", "absolutemin", "minimum", "absolute"):
        with pytest.raises(BudgetFormatError, match='or "absolute min" \(at any cost\)'):
            check_budget(wrong)


def test_min_keeps_to_one_forward_pass_and_at_most_half_a_step():
    from tfremat.graph import DFGraph
    from tfremat.strategies import MIN_OVERHEAD_CAP, forward_share, min_overhead

    graph = training_graph([(0, 1), (1, 2)], [4, 4, 4], costs=[1.0, 2.0, 3.0])
    # forward 1 + 2 + 3; loss 1; backward 2 * (1 + 2 + 3)
    assert forward_share(graph) == min_overhead(graph) == pytest.approx(6 / 19)
    # A profile where the backward costs less than the forward (small ops' fixed time).
    cheap_backward = [cost if not backward else 0.5 for cost, backward in zip(graph.cost, graph.is_backward)]
    lopsided = DFGraph(graph.names, graph.edges, cheap_backward, graph.output_bytes, graph.workspace_bytes,
                       graph.is_backward, graph.loss_node, dict(graph.forward_of), graph.fixed_bytes, "lopsided")
    assert forward_share(lopsided) == pytest.approx(6 / 8) and min_overhead(lopsided) == MIN_OVERHEAD_CAP == 0.5


@pytest.mark.parametrize("graph", _GRAPHS, ids=lambda g: g.name)
def test_min_is_the_least_budget_the_search_finds_within_its_overhead(graph, monkeypatch):
    import tfremat.strategies as strategies

    bound = strategies.min_overhead(graph)
    target = graph.total_cost * (1 + (1 - strategies._MIN_MARGIN) * bound)
    eviction, probes = strategies.eviction, {}

    def recording(g, budget):
        try:
            schedule = eviction(g, budget)
        except InfeasibleBudgetError:
            probes.setdefault(budget, float("inf"))
            raise
        probes[budget] = min(probes.get(budget, float("inf")), schedule.cost(graph))
        return schedule

    monkeypatch.setattr(strategies, "eviction", recording)
    least = strategies.least_budget_within(graph, bound)
    monkeypatch.undo()
    # No probed budget below "min" had a schedule within the bound less its margin.
    assert all(cost > target * (1 + 1e-9) for budget, cost in probes.items() if budget < least)
    result = plan_graph(graph, "min", "eviction", cache=False, verbose=0)
    assert result.budget_bytes == least
    assert result.predicted_peak_bytes <= least and result.overhead <= bound + 1e-12
    # Graphs this small have fewer activation bytes than grid steps: the search works to
    # the byte. A byte less, none of the three schedules is within the bound less its
    # margin, or eviction's own is over the bound.
    if least < checkpoint_all_peak(graph):
        own, *proxies = (strategies._eviction_cost(planned, graph, least - 1)
                         for planned in (graph, *strategies._cost_proxies(graph)))
        assert min(own, *proxies) > target or own > graph.total_cost * (1 + bound)


_DATA = Path(__file__).parent / "data"


def _profiled(model: str, run: int):
    """A training graph extracted with fresh profiles (benchmarks/min_budget.py's ViT, or
    tests/models.py's residual_chain, batch 32, Adam), from two runs whose per-node costs
    differ by up to 2-4x."""
    from tfremat.graph import load_graph

    return load_graph(_DATA / f"min_budget_{model}_profile{run}.json")


@pytest.mark.parametrize("model", ["vit", "residual_chain"])
def test_min_from_two_profiles_agrees_within_two_points(model):
    """Two profiles of one model: "min" was 2.9 (ViT) and 5 (residual chain) points of the
    checkpoint-all peak apart when each budget was judged by eviction alone against the
    bound itself."""
    from tfremat.strategies import least_budget_within, min_overhead

    shares = []
    for run in (1, 2):
        graph = _profiled(model, run)
        shares.append(least_budget_within(graph, min_overhead(graph)) / checkpoint_all_peak(graph))
    assert abs(shares[0] - shares[1]) <= 0.02, shares


def test_min_moves_little_when_costs_move_a_few_percent():
    from tfremat.strategies import least_budget_within, min_overhead

    graph = _profiled("vit", 1)
    shares = set()
    for seed in range(3):
        noise = random.Random(seed)
        noisy = graph.replaced(cost=[c * noise.uniform(0.95, 1.05) for c in graph.cost])
        shares.add(least_budget_within(noisy, min_overhead(noisy)) / checkpoint_all_peak(graph))
    assert max(shares) - min(shares) <= 0.01, sorted(shares)


def test_min_keeps_to_the_bound_where_absolute_min_does_not():
    from tfremat.strategies import least_peak, min_overhead

    graph = _chain(16)
    absolute = plan_graph(graph, "absolute min", "eviction", cache=False, verbose=0)
    assert absolute.budget_bytes == least_peak(graph)
    assert absolute.overhead > min_overhead(graph)  # recomputing to the least peak costs more than a pass
    bounded = plan_graph(graph, "min", "eviction", cache=False, verbose=0)
    assert absolute.budget_bytes <= bounded.budget_bytes < checkpoint_all_peak(graph)
    assert bounded.overhead <= min_overhead(graph)


def test_min_is_the_same_from_run_to_run():
    from tfremat.strategies import least_budget_within

    graph = random_training_graph(11, 16)
    bounds = (0.0, 0.2, 0.5, 1.0)
    assert [least_budget_within(graph, b) for b in bounds] == [least_budget_within(graph, b) for b in bounds]


@pytest.mark.parametrize("bad", [-0.1, "30%", None, True, float("nan")])
def test_least_budget_within_refuses_a_bad_bound(bad):
    from tfremat.strategies import least_budget_within

    with pytest.raises(ArgumentError, match="max_overhead must be"):
        least_budget_within(_chain(), bad)


@pytest.mark.parametrize("budget", ["200%", "1TB", "100%", 10**12])
def test_a_budget_at_or_above_the_checkpoint_all_peak_warns_and_is_planned(budget):
    graph = random_training_graph(4, 8)
    with pytest.warns(UserWarning, match=r"at or above the checkpoint-all peak .*: nothing will be recomputed"):
        result = plan_graph(graph, budget, "chen_sqrtn", cache=False, verbose=0)
    assert result.budget_bytes >= checkpoint_all_peak(graph)
    assert result.predicted_peak_bytes <= result.budget_bytes


@pytest.mark.parametrize("budget", ["99%", "min", None])
def test_a_budget_below_the_peak_does_not_warn(budget):
    graph = random_training_graph(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_graph(graph, budget, "eviction", cache=False, verbose=0)


def test_compare_warns_once_for_all_strategies():
    graph = random_training_graph(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        rows = compare_graph(graph, "150%", ["chen_sqrtn", "eviction", "hong"], cache=False, verbose=0)
    assert len(rows) == 3
    assert [str(w.message) for w in caught if "nothing will be recomputed" in str(w.message)] == \
        [str(caught[0].message)]
