"""solve_r_given_s and prune_s, computed over every stage at once, against Checkmate's
stage-by-stage loops (the form they had before: benchmarks/results/planning_time.md), on
random training graphs with random keep and host matrices."""

import numpy as np
import pytest

from graph_factories import random_training_graph, with_residuals
from tfremat.plan.schedule import prune_s, solve_r_given_s


def checkmate_r_given_s(graph, S, H):
    """Checkmate's ``solve_r_opt`` with host copies: each stage walked backwards, node by node."""
    n = graph.size
    R = np.eye(n, dtype=bool)
    for t in range(n):
        if t + 1 < n:
            R[t, :t] |= (S[t + 1, :t] & ~S[t, :t] & ~H[t, :t]) | (H[t + 1, :t] & ~H[t, :t])
        for k in range(t, -1, -1):
            if R[t, k]:
                for i in graph.predecessors[k]:
                    if not S[t, i]:
                        R[t, i] = True
    return R


def looped_prune_s(graph, R, S):
    """prune_s with the reads of each stage collected node by node."""
    n = graph.size
    read = np.zeros((n, n), dtype=bool)
    for t in range(n):
        for k in np.flatnonzero(R[t]):
            for i in graph.predecessors[k]:
                read[t, i] = True
    read &= ~R
    pruned = np.zeros((n, n), dtype=bool)
    needed_next = np.zeros(n, dtype=bool)
    for t in range(n - 1, -1, -1):
        pruned[t] = S[t] & (read[t] | needed_next)
        needed_next = pruned[t]
    return pruned


@pytest.mark.parametrize("seed", range(12))
def test_completion_matches_the_stage_loops(seed):
    graph = random_training_graph(seed, num_forward=6 + seed % 5)
    if seed % 2:
        graph = with_residuals(graph, seed)
    rng = np.random.default_rng(seed)
    n = graph.size
    strictly_lower = np.tril(np.ones((n, n), dtype=bool), -1)
    for density in (0.1, 0.4, 0.8):
        S = (rng.random((n, n)) < density) & strictly_lower
        H = (rng.random((n, n)) < density / 4) & strictly_lower if seed % 3 == 0 else None
        expected = checkmate_r_given_s(graph, S, np.zeros((n, n), dtype=bool) if H is None else H)
        R = solve_r_given_s(graph, S, H)
        assert np.array_equal(R, expected)
        assert np.array_equal(prune_s(graph, R, S), looped_prune_s(graph, R, S))
