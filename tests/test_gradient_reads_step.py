"""The compiled step of a schedule that recomputes a layer norm while the dense layer after
it is kept: the plan recomputes the dense layer for its gradient, so the step rebuilds no
gradient by repeating forward work (issue #33), holds what the simulator counts, and
trains like plain Keras."""

import keras
import numpy as np
import pytest

from tfremat.plan.schedule import Schedule, checkpoint_all_s, solve_r_given_s, stale_gradient_reads
from tfremat.plan.simulator import simulate

from training_case import TrainingCase


def norm_then_gelu_dense():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    # Named: Keras numbers unnamed layers per process, and other tests share it.
    hidden = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(16, name="first")(inputs))
    hidden = keras.layers.Dense(16, activation="gelu", name="gelu_dense")(hidden)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax", name="head")(hidden))


@pytest.fixture(scope="module")
def case():
    return TrainingCase(norm_then_gelu_dense, batch=4)


def test_a_recomputed_input_of_a_kept_dense_is_planned_not_rebuilt(case):
    graph = case.extraction.graph
    dense = next(i for i in graph.forward_nodes if graph.names[i] == "gelu_dense")
    norm = next(i for i in graph.forward_nodes if graph.names[i] == "norm")
    gradient = graph.backward_of[dense]
    assert graph.inputs_read_with_forward[gradient] == (norm,)
    # Keep the gelu dense until its gradient, but free the layer norm after the dense read it.
    S = checkpoint_all_s(graph)
    S[dense + 1:gradient + 1, norm] = False
    raw = Schedule(solve_r_given_s(graph, S), S, "hand")
    assert stale_gradient_reads(graph, raw.R, raw.S) == [(gradient, gradient, dense)]

    case.reset()
    step = case.assert_trains_like_plain(raw, "norm recomputed, dense kept", steps=2)
    assert step.report.costly_vjp_rebuilds == 0
    # The layer norm and the dense run again, as the plan says (the step once ran only the
    # norm and then the dense under a new tape to rebuild the gradient).
    assert step.report.recomputed_layer_calls == 2
    assert step.plan.recompute_count == 2
    np.testing.assert_array_equal(step.report.ledger_bytes, simulate(graph, raw).trace_bytes)
