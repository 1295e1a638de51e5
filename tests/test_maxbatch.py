"""Tests of batch-size maximization (tfremat.ilp.maxbatch)."""

from __future__ import annotations

import pytest

from tfremat.errors import InfeasibleBudgetError
from tfremat.ilp import max_batch_size
from tfremat.ilp.maxbatch import one_extra_forward_cap
from tfremat.plan.simulator import simulate

from tests.test_ilp import training_chain


def fits_by_scan(batch, budget, strategy, cap_of):
    graph = training_chain(4, batch)
    from tfremat.plan.registry import get_strategy

    try:
        schedule = get_strategy(strategy)(graph, budget, threads=1)
    except InfeasibleBudgetError:
        return False
    return schedule.cost(graph) <= cap_of(graph)


@pytest.mark.parametrize("max_overhead", [None, 0.0, 0.2])
def test_max_batch_matches_a_linear_scan(max_overhead):
    budget = 16 + 4 * 12
    def cap_of(graph):
        return one_extra_forward_cap(graph) if max_overhead is None else (1 + max_overhead) * graph.total_cost

    result = max_batch_size(
        lambda b: training_chain(4, b), budget, max_overhead=max_overhead, max_batch=64, threads=1,
    )
    scan = [b for b in range(1, 17) if fits_by_scan(b, budget, "optimal", cap_of)]
    assert result.batch_size == max(scan)
    assert simulate(result.graph, result.schedule).peak_bytes <= budget
    assert result.cost <= result.cost_cap
    assert result.tried[result.batch_size] is True


def test_max_batch_raises_when_nothing_fits():
    with pytest.raises(InfeasibleBudgetError):
        max_batch_size(lambda b: training_chain(3, b), 20, threads=1)


def test_max_batch_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_batch"):
        max_batch_size(lambda b: training_chain(3, b), 100, min_batch=0)
