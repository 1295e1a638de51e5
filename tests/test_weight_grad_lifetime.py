"""Weight gradients held past their backward node (issue 33, item 1).

The compiled step runs a layer's optimizer update after the layer's last statement, so a
schedule that recomputes a forward node after its backward node (to recompute a later
backward node it kept neither) keeps that layer's weight gradients alive until then. The
test FFN at 60% of activations requested 64 KiB (a Dense kernel's gradient) more than
predicted: the graph counted weight gradients only in the backward node's workspace.
``DFGraph.weight_grad_bytes`` carries them; the simulator holds them until the layer's
last run, and the MILP does not plan such recomputations (tfremat/ilp/formulation.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from graph_factories import random_training_graph, training_graph, with_alternatives
from milp_agreement import assert_milp_memory_is_simulated

from tfremat.errors import GraphError, InfeasibleBudgetError
from tfremat.graph import DFGraph, load_graph
from tfremat.ilp.formulation import build_milp, memory_lower_bound
from tfremat.ilp.solvers import solve_model
from tfremat.plan.execution import Op, build_plan
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix, validate_schedule
from tfremat.plan.simulator import checkpoint_all_peak, held_weight_gradients, simulate
from tfremat.strategies import get_strategy


def _with_weight_grads(graph: DFGraph, grads: dict[int, int]) -> DFGraph:
    """``graph`` with ``grads[f]`` weight-gradient bytes for forward node f, added to the
    workspace of each of its backward nodes (where extraction counts them)."""
    work = list(graph.workspace_bytes)
    per_node = [0] * graph.size
    for f, size in grads.items():
        per_node[f] = size
        for b in graph.backward_nodes_of.get(f, ()):
            work[b] += size
    return graph.replaced(workspace_bytes=work, weight_grad_bytes=per_node)


def _without_weight_grads(graph: DFGraph) -> DFGraph:
    """The same graph (workspaces included) as the memory model saw it before."""
    return graph.replaced(weight_grad_bytes=None)


def _computes(plan) -> list[tuple[int, int, int]]:
    return [(index, s.stage, s.node) for index, s in enumerate(plan.statements) if s.op is Op.COMPUTE]


def _forward_after_backward(graph: DFGraph, schedule: Schedule) -> list[int]:
    """Forward nodes with weight gradients that the schedule computes after the stage of
    their weight-gradient node."""
    return [f for f, size in enumerate(graph.weight_grad_bytes)
            if size and schedule.R[graph.backward_nodes_of[f][0] + 1:, f].any()]


def _residual_chain():
    """f0 -> f1 -> f2 with a skip f0 -> f2: nodes f0 0, f1 1, f2 2, loss 3, and the backward
    nodes of f2 (4), f1 (5), f0 (6); f0's backward reads f2's backward through the skip."""
    return training_graph([(0, 1), (1, 2), (0, 2)], sizes=[10, 20, 30], costs=[1.0, 1.0, 1.0])


def test_weight_gradients_are_held_until_the_layer_runs_again():
    """Stage 6 recomputes f2's backward (not kept) for f0's backward, and with it f1 and f2:
    f1's gradients, taken by its backward node in stage 5, are held until f1 runs again in
    stage 6; f2's are taken again by its backward node's last run, after f2's, so none are
    held for it."""
    graph = _with_weight_grads(_residual_chain(), {0: 7, 1: 100, 2: 1000})
    keep = checkpoint_all_s(graph)
    keep[6, 1:5] = False
    schedule = schedule_from_keep_matrix(graph, keep, "by hand")
    validate_schedule(graph, schedule)
    assert _forward_after_backward(graph, schedule) == [1, 2]
    plan = build_plan(graph, schedule)
    held = held_weight_gradients(graph, plan)
    computes = _computes(plan)
    taken = [index for index, stage, node in computes if node == 5][-1]
    rerun = [index for index, stage, node in computes if node == 1][-1]
    assert rerun > taken
    expected = np.zeros(len(plan.statements), dtype=np.int64)
    expected[taken + 1:rerun + 1] = 100
    np.testing.assert_array_equal(held, expected)
    with_grads = simulate(graph, schedule)
    before = simulate(_without_weight_grads(graph), schedule)
    np.testing.assert_array_equal(with_grads.trace_bytes - before.trace_bytes, expected)
    assert with_grads.peak_bytes >= before.peak_bytes
    # Without the recomputation nothing is held: the simulation is the workspace model's.
    everything = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    assert not held_weight_gradients(graph, build_plan(graph, everything)).any()
    assert simulate(graph, everything).peak_bytes == simulate(_without_weight_grads(graph), everything).peak_bytes


def _split_chain(grads: int) -> DFGraph:
    """f0 -> f1 with f1's backward split (MONeT appendix D): its weight-gradient node w (3)
    reads f0, its input-gradient node (4) the upstream gradient only; f0's backward (5)
    reads f0. Both of f1's backward nodes count ``grads`` in their workspace."""
    return DFGraph(
        names=["f0", "f1", "loss", "f1_weight_backward", "f1_backward", "f0_backward"],
        edges=[(0, 1), (1, 2), (0, 3), (2, 3), (2, 4), (3, 4), (4, 5), (0, 5)],
        cost=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], output_bytes=[50, 5, 1, 0, 5, 5],
        workspace_bytes=[0, 0, 0, grads, grads, 0], is_backward=[False, False, True, True, True, True],
        loss_node=2, forward_of={3: 1, 4: 1, 5: 0}, weight_grad_bytes=[0, grads, 0, 0, 0, 0],
    )


def test_a_split_backward_holds_its_weight_gradients_between_its_two_nodes():
    """Stage 4 recomputes f0 (freed after the weight-gradient node read it) before f1's
    input-gradient node: f1's weight gradients, taken in stage 3, are held there, and not
    counted twice while the input-gradient node runs (its workspace holds them)."""
    graph = _split_chain(40)
    keep = checkpoint_all_s(graph)
    keep[4, 0] = False
    keep[5, 0] = True
    schedule = schedule_from_keep_matrix(graph, keep, "by hand")
    validate_schedule(graph, schedule)
    assert schedule.R[4, 0]
    plan = build_plan(graph, schedule)
    held = held_weight_gradients(graph, plan)
    statements = plan.statements
    for index, statement in enumerate(statements):
        if statement.op is Op.COMPUTE:
            assert held[index] == (40 if statement.node == 0 and statement.stage == 4 else 0), statement
    # The MILP never separates the two nodes so: no node runs while its plans hold any.
    for budget in range(memory_lower_bound(graph), checkpoint_all_peak(graph) + 1, 5):
        try:
            planned = get_strategy("optimal")(graph, budget, time_limit=60)
        except InfeasibleBudgetError:
            continue
        plan = build_plan(graph, planned)
        held = held_weight_gradients(graph, plan)
        assert not any(held[index] for index, _, _ in _computes(plan)), budget
        assert simulate(graph, planned).peak_bytes <= budget


def test_weight_gradient_bytes_must_be_in_the_backward_workspace():
    graph = _residual_chain()
    with pytest.raises(GraphError, match="workspace_bytes"):
        DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes, graph.is_backward,
                graph.loss_node, dict(graph.forward_of), weight_grad_bytes=[0, 8, 0, 0, 0, 0, 0])
    with pytest.raises(GraphError, match="not a forward node with a backward node"):
        _with_weight_grads(graph, {3: 8})
    graph = _with_weight_grads(graph, {1: 8})
    ids = [f"n{i}" for i in range(graph.size)]
    renumbered = DFGraph.from_unordered(
        ids[::-1], [(ids[u], ids[v]) for u, v in graph.edges], order=ids, names=graph.names[::-1],
        cost=graph.cost[::-1], output_bytes=graph.output_bytes[::-1], workspace_bytes=graph.workspace_bytes[::-1],
        is_backward=graph.is_backward[::-1], loss_node=graph.size - 1 - graph.loss_node,
        forward_of={graph.size - 1 - b: graph.size - 1 - f for b, f in graph.forward_of.items()},
        weight_grad_bytes=graph.weight_grad_bytes[::-1], name=graph.name)
    assert renumbered == graph
    assert load_graph(graph.to_dict()).weight_grad_bytes == graph.weight_grad_bytes


@pytest.mark.parametrize("seed", [5, 7, 35])
def test_milp_plans_hold_no_weight_gradients_and_fit(seed):
    """On these random graphs (3 bytes of weight gradients per layer) the MILP that did not
    know the gradients' lifetime recomputed forward nodes after their backward nodes near
    the least budget, and its plans then overflowed the budget. The MILP's plans now never
    do, fit the budget in the simulator, and its memory is the simulator's exactly."""
    graph = _with_weight_grads(random_training_graph(seed, 8), {f: 3 for f in range(8)})
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    overflowed = 0
    for share in (0.0, 0.1, 0.2, 0.3):
        budget = int(low + share * (high - low))
        try:
            before = get_strategy("optimal")(_without_weight_grads(graph), budget, time_limit=60)
        except InfeasibleBudgetError:
            continue
        overflowed += simulate(graph, before).peak_bytes > budget
        model = build_milp(graph, budget)
        result = solve_model(model, threads=1)
        if result.x is None:
            continue
        R, S = model.decode(result.x)
        schedule = Schedule(R, S, "optimal")
        validate_schedule(graph, schedule)
        assert not _forward_after_backward(graph, schedule)
        simulation = simulate(graph, schedule)
        held = held_weight_gradients(graph, simulation.plan)
        assert not any(held[index] for index, _, _ in _computes(simulation.plan))
        assert_milp_memory_is_simulated(model, result.x, simulation)
        assert simulation.peak_bytes <= budget
    assert overflowed, "the weight-gradient-blind MILP no longer overflows here: pick another seed"


# ----- the compiled step (TensorFlow) -----

TOKENS, WIDTH, HIDDEN, BATCH = 64, 64, 256, 2


def _gelu(x):
    import keras

    return keras.activations.gelu(x, approximate=True)


def _feed_forward_net():
    """Two GPT-2-style feed-forward blocks (pre-norm, residual) and a token classifier:
    the test FFN of tests/test_requested_bytes.py, with names to find the nodes by."""
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS, WIDTH))
    x = inputs
    for block in range(2):
        h = keras.layers.LayerNormalization(name=f"norm{block}")(x)
        h = keras.layers.Dense(HIDDEN, activation=_gelu, name=f"up{block}")(h)
        x = keras.layers.Add(name=f"add{block}")([x, keras.layers.Dense(WIDTH, name=f"down{block}")(h)])
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax", name="head")(x))


def _with_weight_gradients(extraction):
    """The extraction with each forward node's weight-gradient bytes in its graph, from
    the side table, as ``tfremat.extract.assembly`` fills them (``weight_grads="transient"``,
    the case of this model)."""
    tf = pytest.importorskip("tensorflow")
    assert extraction.side_table.weight_grads == "transient"
    grads = [0] * extraction.graph.size
    for entry in extraction.side_table.entries:
        if entry.kind == "forward" and entry.backward_node is not None:
            grads[entry.node] = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                                    for v in entry.trainable_variables)
    graph = extraction.graph
    graph = DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes, graph.is_backward,
                    graph.loss_node, dict(graph.forward_of), graph.fixed_bytes, graph.name,
                    residual_bytes=graph.residual_bytes, weight_grad_bytes=grads)
    return dataclasses.replace(extraction, graph=graph)


def test_requested_bytes_stay_within_the_prediction_when_a_layer_runs_after_its_backward():
    """A schedule that keeps nothing but the first norm's output into the stage of the
    second norm's backward recomputes the gradient of the second ``Add`` there (the first
    ``Add``'s backward reads it through the residual), and with it the second block's
    forward, after that block's ``Dense`` backward nodes: their weight gradients are held
    until then (as in ``optimal``'s plan of this model at 60% of activations with profiled
    costs, which requested 64 KiB over the prediction without them). The prediction counts
    them, and the step requests no more. Whether the step holds them depends on the order the
    executor picks (one CI process requested 1.55 MB, under the 1.65 MB predicted without
    them; here 1.68 MB, over it), so only the promise is asserted."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from tfremat.extract import extract
    from tfremat.static_graph import compile_step, measure_step_peak

    model = _feed_forward_net()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, TOKENS, WIDTH)).astype("float32"))
    y = tf.constant(np.eye(4, dtype="float32")[rng.integers(0, 4, (BATCH, TOKENS))])
    optimizer = keras.optimizers.SGD(0.01)
    extraction = _with_weight_gradients(extract(model, (x, y), optimizer=optimizer, loss="categorical_crossentropy",
                                                cost_model="profile", use_cache=False))
    graph = extraction.graph
    node = {name: i for i, name in enumerate(graph.names)}
    kernel = WIDTH * HIDDEN * 4
    assert graph.weight_grad_bytes[node["up1"]] >= kernel
    keep = checkpoint_all_s(graph)
    stage = node["norm1_backward"]
    keep[stage:, node["norm0"] + 1:stage] = False
    schedule = schedule_from_keep_matrix(graph, keep, "by hand")
    validate_schedule(graph, schedule)
    assert {node["up1"], node["down1"]} <= set(_forward_after_backward(graph, schedule))
    simulated, blind = simulate(graph, schedule), simulate(_without_weight_grads(graph), schedule)
    predicted = simulated.peak_bytes
    # The prediction counts the held weight gradients where they are held (whether they set
    # the peak depends on the measured backward workspaces).
    assert np.max(np.asarray(simulated.trace_bytes) - np.asarray(blind.trace_bytes)) >= kernel
    blind = blind.peak_bytes
    step = compile_step(extraction, schedule, optimizer=optimizer)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    # A few hundred bytes of scalars and shapes are not modelled (tests/test_requested_bytes.py).
    assert requested <= predicted + 4096, (requested, predicted, blind)


# ----- weight gradients held to the end of the step (weight_grads="fixed") -----


def _to_end(graph: DFGraph, grads: dict[int, int]) -> DFGraph:
    return _with_weight_grads(graph, grads).replaced(weight_grads_to_end=True)


def test_weight_gradients_to_the_end_appear_at_their_backward_node_and_stay():
    """With the updates after the backward pass, a layer's weight gradients are counted in
    its backward node's workspace while it first runs, then held at every later statement;
    a recomputed backward node (f2's, node 4, in stage 6) counts them once, in its workspace."""
    graph = _to_end(_residual_chain(), {0: 7, 1: 100, 2: 1000})
    keep = checkpoint_all_s(graph)
    keep[6, 1:5] = False
    schedule = schedule_from_keep_matrix(graph, keep, "by hand")
    plan = build_plan(graph, schedule)
    computes = _computes(plan)
    first = {node: min(index for index, _, n in computes if n == node) for node in (4, 5, 6)}
    grads = {4: 1000, 5: 100, 6: 7}
    expected = np.zeros(len(plan.statements), dtype=np.int64)
    for node, index in first.items():
        expected[index + 1:] += grads[node]
    recomputed = [index for index, stage, node in computes if node == 4 and stage == 6]
    assert recomputed
    expected[recomputed] -= 1000
    np.testing.assert_array_equal(held_weight_gradients(graph, plan), expected)
    trace = simulate(graph, schedule).trace_bytes - simulate(_without_weight_grads(graph), schedule).trace_bytes
    np.testing.assert_array_equal(trace, expected)
    # The end of the step holds them all; counting them as fixed instead holds them throughout.
    everything = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    assert simulate(graph, everything).trace_bytes[-1] - simulate(_without_weight_grads(graph), everything).trace_bytes[-1] == 1107
    as_fixed = _without_weight_grads(graph).replaced(fixed_bytes=1107, weight_grads_to_end=False)
    assert simulate(graph, everything).peak_bytes < simulate(as_fixed, everything).peak_bytes


def test_weight_grads_to_end_round_trips_and_is_checked():
    graph = _to_end(_residual_chain(), {1: 100})
    loaded = load_graph(graph.to_dict())
    assert loaded.weight_grads_to_end and loaded == graph and loaded.weight_grads_to_end_bytes == 100
    plain = graph.to_dict()
    del plain["weight_grads_to_end"]
    assert not load_graph(plain).weight_grads_to_end
    assert graph.fingerprint != load_graph(plain).fingerprint
    with pytest.raises(GraphError, match="weight_grads_to_end"):
        graph.replaced(weight_grads_to_end="yes")


@pytest.mark.parametrize("seed", [5, 7, 35])
def test_milp_counts_weight_gradients_to_the_end_as_the_simulator(seed):
    """The MILP's memory is the simulator's at every compute of its plans and of a MIP
    start, with gradients held to the end; its plans fit; recomputing a forward node after
    its backward is allowed (nothing more is held by it)."""
    graph = _to_end(random_training_graph(seed, 8), {f: 1 + f % 3 for f in range(8)})
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    solved = 0
    for share in (0.0, 0.15, 0.3, 0.6, 1.0):
        budget = int(low + share * (high - low))
        model = build_milp(graph, budget)
        result = solve_model(model, threads=1)
        if result.x is None:
            continue
        solved += 1
        schedule = model.schedule(result.x, "optimal")
        validate_schedule(graph, schedule)
        simulation = simulate(graph, schedule)
        assert_milp_memory_is_simulated(model, result.x, simulation)
        assert simulation.peak_bytes <= budget
    assert solved >= 2
    everything = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    model = build_milp(graph, high)
    x = model.encode(everything)
    assert x is not None
    assert_milp_memory_is_simulated(model, x, simulate(graph, everything))
    assert build_milp(graph, high - 1).encode(everything) is None


def test_milp_with_a_split_backward_and_gradients_to_the_end_agrees():
    graph = _split_chain(40).replaced(weight_grads_to_end=True)
    for budget in range(memory_lower_bound(graph), checkpoint_all_peak(graph) + 1, 5):
        model = build_milp(graph, budget)
        result = solve_model(model, threads=1)
        if result.x is None:
            continue
        simulation = simulate(graph, model.schedule(result.x, "optimal"))
        assert_milp_memory_is_simulated(model, result.x, simulation, budget)
        assert simulation.peak_bytes <= budget


def test_monet_model_counts_weight_gradients_to_the_end_as_the_simulator():
    alternatives = with_alternatives(random_training_graph(11, 7), 3, 3)
    # An implementation's backward workspace replaces the node's: the layers without any.
    graph = _to_end(alternatives, {f: 2 for f in range(7) if f not in alternatives.implementations})
    low, high = memory_lower_bound(graph, True), checkpoint_all_peak(graph)
    solved = 0
    for share in (0.3, 0.6, 1.0):
        budget = int(low + share * (high - low))
        model = build_milp(graph, budget, choose_implementations=True)
        result = solve_model(model, threads=1)
        if result.x is None:
            continue
        solved += 1
        simulation = simulate(graph, model.schedule(result.x, "monet"))
        assert_milp_memory_is_simulated(model, result.x, simulation, budget)
        assert simulation.peak_bytes <= budget
    assert solved


def _as_fixed(graph: DFGraph) -> DFGraph:
    """The graph as extraction made it before: the weight gradients in the fixed bytes for
    the whole step, not in the backward workspaces."""
    work = list(graph.workspace_bytes)
    for f, size in enumerate(graph.weight_grad_bytes):
        for b in graph.backward_nodes_of.get(f, ()):
            work[b] -= size
    return graph.replaced(fixed_bytes=graph.fixed_bytes + graph.weight_grads_to_end_bytes, workspace_bytes=work,
                          weight_grad_bytes=None, weight_grads_to_end=False)


def test_a_clipnorm_step_requests_no_more_than_its_prediction_with_gradients_held_to_the_end():
    """``clipnorm`` needs every gradient before the updates (``weight_grads="fixed"``): the
    gradients are now held from their backward nodes, not for the whole step. At this MLP's
    peak, early in the backward pass, few exist: the prediction drops towards the step's
    requested bytes and still covers them."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    from tfremat.extract import extract
    from tfremat.static_graph import compile_step, measure_step_peak

    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(hidden))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((256, 128)).astype("float32"))
    y = tf.constant(np.eye(4, dtype="float32")[rng.integers(0, 4, 256)])
    optimizer = keras.optimizers.SGD(0.01, clipnorm=1.0)
    extraction = extract(model, (x, y), optimizer=optimizer, loss="categorical_crossentropy", cost_model="profile",
                         use_cache=False)
    graph = extraction.graph
    assert extraction.side_table.weight_grads == "fixed" and graph.weight_grads_to_end
    gradients = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert graph.weight_grads_to_end_bytes == gradients
    assert extraction.side_table.fixed_bytes_breakdown["param_grads"] == 0
    schedule = schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")
    predicted = simulate(graph, schedule).peak_bytes
    before = simulate(_as_fixed(graph), schedule).peak_bytes
    assert predicted < before
    step = compile_step(extraction, schedule, optimizer=optimizer)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    # A few hundred bytes of scalars and shapes are not modelled (tests/test_requested_bytes.py).
    assert requested <= predicted + 4096, (requested, predicted, before)
    # The step's own ledger counts the held gradients as the simulator does.
    np.testing.assert_array_equal(step.ledger_bytes, simulate(graph, schedule).trace_bytes)
