"""The budgets "min" (least memory within one extra forward pass) and "absolute min", and the
warning for budgets that recompute nothing (no TensorFlow)."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest

from graph_factories import random_training_graph, repeated_blocks, training_graph
from tfremat.budget import budget_kind, check_budget, is_absolute_min, is_share, parse_budget
from tfremat.errors import ArgumentError, BudgetFormatError
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import compare_graph, plan_graph


def _chain(length: int = 12):
    return training_graph([(j - 1, j) for j in range(1, length)], [4] * length, fixed_bytes=2)


_GRAPHS = [_chain(), repeated_blocks(4), random_training_graph(3, 10), random_training_graph(7, 14)]


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


def test_forward_share_is_one_forward_pass_over_the_step():
    from tfremat.strategies import MIN_OVERHEAD_CAP, forward_share

    graph = training_graph([(0, 1), (1, 2)], [4, 4, 4], costs=[1.0, 2.0, 3.0])
    # forward 1 + 2 + 3; loss 1; backward 2 * (1 + 2 + 3)
    assert forward_share(graph) == pytest.approx(6 / 19)
    assert MIN_OVERHEAD_CAP == 0.5


def _counted(graph, budget: int) -> bool:
    """Whether eviction, planned and costed under one of the cost proxies, recomputes at most
    nine tenths of one forward pass under that proxy at ``budget``."""
    import tfremat.strategies as strategies

    return any(strategies._eviction_cost(proxy, proxy, budget)
               <= proxy.total_cost * (1 + (1 - strategies._MIN_MARGIN) * strategies.forward_share(proxy)) * (1 + 1e-9)
               for proxy in strategies._cost_proxies(graph))


def _own_overhead(graph, budget: int) -> float:
    """The overhead of eviction's own schedule (planned under ``graph``'s costs) at ``budget``."""
    import tfremat.strategies as strategies

    return strategies._eviction_cost(graph, graph, budget) / graph.total_cost - 1


@pytest.mark.parametrize("graph", _GRAPHS, ids=lambda g: g.name)
def test_min_is_the_least_budget_counted_within_one_pass_and_half_a_step(graph):
    from tfremat.strategies import MIN_OVERHEAD_CAP, _cheapest_within, least_budget_within

    least = least_budget_within(graph)
    result = plan_graph(graph, "min", "eviction", cache=False, verbose=0)
    assert result.budget_bytes == least and result.predicted_peak_bytes <= least
    if least < checkpoint_all_peak(graph):
        assert _counted(graph, least) and _cheapest_within(graph, least, MIN_OVERHEAD_CAP)
        # Graphs this small have fewer activation bytes than grid steps: the search works to
        # the byte. A byte less, no proxy counts one pass or no heuristic's schedule is within half a step.
        assert not _counted(graph, least - 1) or not _cheapest_within(graph, least - 1, MIN_OVERHEAD_CAP)


def test_the_half_step_cap_raises_min_where_the_profile_makes_the_forward_pass_dear():
    """Forward nodes a hundred times the backward's cost: one pass counted in nodes is most
    of the step as profiled, so the budget rises until a heuristic of the portfolio finds a
    schedule of at most half a step (and optimal, which starts from the portfolio)."""
    from tfremat.strategies import MIN_OVERHEAD_CAP, _cheapest_within, least_budget_within

    plain = _chain(16)
    dear = plain.replaced(cost=[1.0 if backward else 100.0 for backward in plain.is_backward])
    uncapped = least_budget_within(dear, cap=float("inf"))
    assert uncapped == least_budget_within(plain, cap=float("inf"))  # the count ignores the profile
    assert not _cheapest_within(dear, uncapped, MIN_OVERHEAD_CAP)
    capped = least_budget_within(dear)
    assert capped > uncapped and _cheapest_within(dear, capped, MIN_OVERHEAD_CAP)


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
    checkpoint-all peak apart when each budget was judged by eviction's profiled cost
    against one profiled forward pass."""
    from tfremat.strategies import least_budget_within

    shares = [least_budget_within(graph) / checkpoint_all_peak(graph) for graph in
              (_profiled(model, 1), _profiled(model, 2))]
    assert abs(shares[0] - shares[1]) <= 0.02, shares


@pytest.mark.parametrize("model", ["vit", "residual_chain"])
def test_twenty_percent_cost_noise_does_not_move_min(model):
    from tfremat.strategies import least_budget_within

    graph = _profiled(model, 1)
    shares = {least_budget_within(graph)}
    for seed in range(3):
        noise = random.Random(seed)
        shares.add(least_budget_within(graph.replaced(cost=[c * noise.uniform(0.8, 1.2) for c in graph.cost])))
    assert len(shares) == 1, sorted(shares)


_GRAPHS_DIR = Path(__file__).parent.parent / "benchmarks" / "graphs"


def _transformer_encoder(run: int):
    """benchmarks/conformance.py's transformer_encoder (batch 2), profiled twice in one
    process (benchmarks/graphs/README.md): its attention backward's workspace differs
    between the two, so the tests below put both on the first one's memory figures."""
    from tfremat.graph import load_graph

    return load_graph(_GRAPHS_DIR / f"min_transformer_encoder_profile{run}.json")


def _with_profile_noise(graph, seed: int):
    """``graph`` with each node's cost scaled as two profiles of one model differed: the
    nodes making half the step by 0.9-1.1x, the others by 0.5-2x (seeded)."""
    noise = random.Random(seed)
    large, summed = set(), 0.0
    for node in sorted(range(graph.size), key=lambda i: -graph.cost[i]):
        if summed >= graph.total_cost / 2:
            break
        large.add(node)
        summed += graph.cost[node]
    return graph.replaced(cost=[cost * (noise.uniform(0.9, 1.1) if node in large else 2 ** noise.uniform(-1, 1))
                                for node, cost in enumerate(graph.cost)])


def test_profile_noise_does_not_move_min_where_eviction_alone_is_near_the_cap():
    """transformer_encoder at its "min": eviction, planned under the first profile, picked a
    schedule over half a step (+52%) where under the second it picked +38%, and "min" rose
    a grid step on the first only; the cap now holds to the cheapest of the portfolio's
    heuristics (chen_greedy_ap's +42% under either)."""
    from tfremat.strategies import MIN_OVERHEAD_CAP, _cheapest_within, least_budget_within

    first = _transformer_encoder(1)
    second = _transformer_encoder(2).replaced(workspace_bytes=list(first.workspace_bytes))
    graphs = [first, second] + [_with_profile_noise(first, seed) for seed in range(3)]
    budgets = {least_budget_within(graph) for graph in graphs}
    assert len(budgets) == 1, sorted(budgets)
    least = budgets.pop()
    assert least < checkpoint_all_peak(first) / 2
    assert _own_overhead(first, least) > MIN_OVERHEAD_CAP  # eviction's own schedule alone is over the cap
    assert all(_cheapest_within(graph, least, MIN_OVERHEAD_CAP) for graph in graphs)


def test_min_keeps_to_the_bound_where_absolute_min_does_not():
    from tfremat.strategies import forward_share, least_peak

    graph = _chain(16)  # one cost per node: the proxy's count is the graph's own
    absolute = plan_graph(graph, "absolute min", "eviction", cache=False, verbose=0)
    assert absolute.budget_bytes == least_peak(graph)
    assert absolute.overhead > forward_share(graph)  # recomputing to the least peak costs more than a pass
    bounded = plan_graph(graph, "min", "eviction", cache=False, verbose=0)
    assert absolute.budget_bytes <= bounded.budget_bytes < checkpoint_all_peak(graph)
    assert bounded.overhead <= forward_share(graph)


def test_min_is_the_same_from_run_to_run():
    from tfremat.strategies import least_budget_within

    graph = random_training_graph(11, 16)
    bounds = (0.0, 0.2, 0.5, 1.0)
    assert [least_budget_within(graph, b) for b in bounds] == [least_budget_within(graph, b) for b in bounds]


@pytest.mark.parametrize("bad", [-0.1, "30%", None, True, float("nan")])
@pytest.mark.parametrize("argument", ["passes", "cap"])
def test_least_budget_within_refuses_a_bad_bound(argument, bad):
    from tfremat.strategies import least_budget_within

    with pytest.raises(ArgumentError, match=f"{argument} must be a number, 0 or more"):
        least_budget_within(_chain(), **{argument: bad})


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
