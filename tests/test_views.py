"""Views share their source's buffer (``DFGraph.view_of``; issue 33 item 1, part 2).

A ``Flatten`` or ``Reshape`` allocates nothing in TensorFlow, but the memory model counted
its output as a second buffer: small_convnet's checkpoint-all prediction was 12.7% high
(benchmarks/README.md, "Extraction"). The simulator counts a shared buffer once while any
value holding it is resident, and the MILP agrees with it exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from graph_factories import random_training_graph, training_graph
from milp_agreement import assert_milp_memory_is_simulated

from tfremat.errors import GraphError, InfeasibleBudgetError
from tfremat.graph import DFGraph, load_graph
from tfremat.ilp.formulation import build_milp, memory_lower_bound
from tfremat.ilp.solvers import solve_model
from tfremat.plan.execution import Op
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix, validate_schedule
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import get_strategy


def _with_views(graph: DFGraph, views: dict[int, int]) -> DFGraph:
    """``graph`` with node v a view of node ``views[v]`` (v's output bytes set to the source's)."""
    output = list(graph.output_bytes)
    for view, source in sorted(views.items()):
        output[view] = output[source] - graph.residual_bytes[source]
    return graph.replaced(output_bytes=output, view_of=views)


def _without_views(graph: DFGraph) -> DFGraph:
    return graph.replaced(view_of=None)


def _chain():
    """conv (0) -> flatten (1, a view of 0) -> dense (2), the loss (3), then the backward
    nodes of dense (4), flatten (5) and conv (6)."""
    return _with_views(training_graph([(0, 1), (1, 2)], sizes=[100, 0, 10], costs=[5.0, 0.0, 1.0]), {1: 0})


def test_a_view_and_its_source_count_once():
    graph = _chain()
    keep_all = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    shared, separate = simulate(graph, keep_all), simulate(_without_views(graph), keep_all)
    difference = separate.trace_bytes - shared.trace_bytes
    # Counted twice from the view's allocation until the conv's output or the view is freed.
    statements = shared.plan.statements
    allocated = next(j for j, s in enumerate(statements) if s.op is Op.ALLOCATE and s.node == 1)
    first_free = next(j for j, s in enumerate(statements) if s.op is Op.DEALLOCATE and s.node in (0, 1))
    assert set(difference[allocated:first_free]) == {100}
    assert not difference[:allocated].any() and not difference[first_free:].any()
    assert shared.peak_bytes < separate.peak_bytes


def test_a_view_kept_past_a_recomputation_of_its_source_holds_the_old_buffer():
    """Stage 4 (the dense's backward, which reads the flatten) recomputes the conv while
    the flatten kept from the first forward pass is resident: two buffers, as in
    TensorFlow, where the old one lives on through the view."""
    graph = _chain()
    keep = checkpoint_all_s(graph)
    keep[4, 0] = False
    recompute = np.eye(graph.size, dtype=bool)
    recompute[4, 0] = True
    schedule = Schedule(recompute, keep, "by hand")
    validate_schedule(graph, schedule)
    result = simulate(graph, schedule)
    statements = result.plan.statements
    again = next(j for j, s in enumerate(statements) if s.op is Op.COMPUTE and s.node == 0 and s.recompute)
    freed = next(j for j, s in enumerate(statements) if s.op is Op.DEALLOCATE and s.node == 1)
    assert again < freed
    np.testing.assert_array_equal(result.trace_bytes[again:freed],
                                  simulate(_without_views(graph), schedule).trace_bytes[again:freed])


def test_views_are_checked_and_round_trip():
    graph = training_graph([(0, 1), (1, 2)], sizes=[100, 50, 10])
    with pytest.raises(GraphError, match="buffer of node 0"):
        DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, view_of={1: 0})
    with pytest.raises(GraphError, match="must read the node"):
        _with_views(graph, {2: 0})
    viewed = _with_views(graph, {1: 0})
    assert load_graph(viewed.to_dict()) == viewed and load_graph(viewed.to_dict()).view_of == {1: 0}
    assert viewed.fingerprint != _without_views(viewed).fingerprint


def _random_views(seed: int) -> DFGraph:
    """A random training graph with each forward node that reads exactly one forward
    node (with no residual bytes) made a view of it, one in three."""
    graph = random_training_graph(seed, 10)
    rng = np.random.default_rng(seed)
    views = {}
    for node in graph.forward_nodes:
        inputs = [p for p in graph.predecessors[node] if not graph.is_backward[p]]
        if len(inputs) == 1 and inputs[0] not in views and rng.random() < 0.34:
            views[node] = inputs[0]
    assert views
    return _with_views(graph, views)


@pytest.mark.parametrize("seed", range(5))
def test_milp_memory_agrees_with_the_simulator_on_views(seed):
    graph = _random_views(seed)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    assert high < checkpoint_all_peak(_without_views(graph))
    for budget in (low + (high - low) // 3, high):
        model = build_milp(graph, budget)
        result = solve_model(model, threads=1)
        assert result.x is not None, budget  # checkpoint-all fits its own peak; the other nearly always
        R, S = model.decode(result.x)
        schedule = Schedule(R, S, "optimal")
        validate_schedule(graph, schedule)
        simulation = simulate(graph, schedule)
        assert_milp_memory_is_simulated(model, result.x, simulation)
        assert simulation.peak_bytes <= budget


@pytest.mark.parametrize("strategy", ["optimal", "approx_lp", "chen_sqrtn", "rotor"])
def test_strategies_fit_their_budget_on_views(strategy):
    graph = _random_views(3)
    budget = (memory_lower_bound(graph) + checkpoint_all_peak(graph)) // 2
    try:
        schedule = get_strategy(strategy)(graph, budget)
    except InfeasibleBudgetError:
        pytest.skip(f"{strategy} finds no schedule within {budget}")
    assert simulate(graph, schedule).peak_bytes <= budget


def test_with_views_keeps_the_candidates_the_graph_allows():
    graph = training_graph([(0, 1), (1, 2)], sizes=[100, 100, 10])
    viewed = graph.with_views({1: 0, 2: 1, 3: 0})  # 2 has other bytes; 3 (the loss) does not read 0
    assert dict(viewed.view_of) == {1: 0}
    assert viewed.with_views({}) is viewed


def test_view_input_finds_reshapes_and_nothing_else():
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from tfremat.extract.views import view_input

    spec = [tf.TensorSpec([2, 8, 8, 3], tf.float32)]
    views = {"flatten": keras.layers.Flatten(), "reshape": keras.layers.Reshape((64, 3)),
             "identity": keras.layers.Identity()}
    others = {"relu": keras.layers.ReLU(), "permute": keras.layers.Permute((2, 1, 3)),
              "dropout": keras.layers.Dropout(0.5), "dense": keras.layers.Dense(4)}
    for name, layer in views.items():
        assert view_input(lambda xs, layer=layer: layer(xs[0], training=True), spec) == 0, name
    for name, layer in others.items():
        assert view_input(lambda xs, layer=layer: layer(xs[0], training=True), spec) is None, name
    add = keras.layers.Add()
    assert view_input(lambda xs: add(list(xs)), spec * 2) is None
