"""Implementations that change rounding are named, measured and can be excluded (issue 33).

Each layer alternative declares whether its gradients are bit-exact with the layer's
default (``LayerImplementation.exact``); the declaration is checked here over a few shapes,
not assumed. A ``monet`` plan names the chosen alternatives that are not exact,
``measure_model`` measures each one's effect on the step's gradients, and
``exact_gradients=True`` keeps them out of the choice down to the MILP.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.errors import ArgumentError  # noqa: E402
from tfremat.graph import DFGraph  # noqa: E402
from tfremat.ilp.monet import without_implementations  # noqa: E402
from tfremat.measure import measure_model  # noqa: E402
from tfremat.model_planning import plan_model  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.runtime.layer_variants import layer_implementations, running  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


# Layers with alternatives, each on a feature shape (the batch varies below).
LAYERS = {
    "relu_dense": (lambda: keras.layers.Dense(16, activation="relu"), (8,)),
    "relu6": (lambda: keras.layers.ReLU(max_value=6), (6, 6, 3)),
    "leaky_relu": (lambda: keras.layers.LeakyReLU(0.3), (6, 6, 3)),
    "leaky_relu_activation": (lambda: keras.layers.Dense(16, activation="leaky_relu"), (8,)),
    "gelu": (lambda: keras.layers.Dense(32, activation="gelu"), (7, 16)),
    "mish": (lambda: keras.layers.Dense(32, activation="mish"), (7, 16)),
    "hard_silu": (lambda: keras.layers.Dense(32, activation="hard_silu"), (7, 16)),
    "layer_norm": (lambda: keras.layers.LayerNormalization(), (7, 16)),
    "pool_2x2": (lambda: keras.layers.MaxPooling2D(2), (8, 8, 3)),
    "pool_3x3_stride_1": (lambda: keras.layers.MaxPooling2D(3, strides=1, padding="same"), (8, 8, 3)),
    "dropout": (lambda: keras.layers.Dropout(0.3, seed=1), (16,)),
    "batch_norm": (lambda: keras.layers.BatchNormalization(), (6, 6, 8)),
}


def _gradients(layer, x, dy, name):
    @tf.function
    def run(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with running(layer, name):
                y = layer(x, training=True)
        return tape.gradient(y, [x] + layer.trainable_variables, output_gradients=dy)

    return [g.numpy() for g in run(x, dy)]


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_each_alternative_is_as_exact_as_it_declares(key):
    """Over three batch sizes: a declared-exact alternative's gradients equal the default's
    bit for bit; the others stay within the closeness rule."""
    build, features = LAYERS[key]
    rng = np.random.default_rng(0)
    for batch in (2, 3, 8):
        layer = build()
        layer.build((batch, *features))
        x = tf.constant(rng.standard_normal((batch, *features)).astype(np.float32))
        dy = tf.constant(rng.standard_normal(layer.compute_output_shape(x.shape)).astype(np.float32))
        weights = [v.numpy() for v in layer.variables]
        seed_state = layer.seed_generator.state.numpy() if hasattr(layer, "seed_generator") else None
        expected = _gradients(layer, x, dy, None)
        alternatives = layer_implementations(layer)
        assert alternatives, f"{key} offers no alternative"
        for alternative in alternatives:
            for variable, value in zip(layer.variables, weights):
                variable.assign(value)
            if seed_state is not None:
                layer.seed_generator.state.assign(seed_state)
            actual = _gradients(layer, x, dy, alternative.name)
            bit_equal = all(np.array_equal(a, e) for a, e in zip(actual, expected))
            if alternative.exact:
                assert bit_equal, f"{key} {alternative.name} at batch {batch} is declared exact but differs"
            else:
                assert closeness(actual, expected).equal, f"{key} {alternative.name} beyond the closeness rule"


def test_exclusions_remove_names_and_node_pairs_from_the_graph():
    from tfremat.graph import Implementation

    a, b = Implementation("mask", 1, False, False, 1.0, 1.0), Implementation("fused", 0, False, True, 1.0, 1.0)
    graph = DFGraph(["f0", "f1", "loss", "b1", "b0"], [(0, 1), (1, 2), (2, 3), (0, 3), (3, 4), (1, 3)],
                    [1, 1, 1, 1, 1], [8, 8, 4, 8, 8], is_backward=[False, False, True, True, True], loss_node=2,
                    forward_of={3: 1, 4: 0}, implementations={0: [a, b], 1: [a, b]})
    assert without_implementations(graph, ()) is graph
    by_name = without_implementations(graph, ["fused"])
    assert {n: [i.name for i in alts] for n, alts in by_name.implementations.items()} == {0: ["mask"], 1: ["mask"]}
    by_pair = without_implementations(graph, [(1, "mask"), [0, "fused"]])
    assert {n: [i.name for i in alts] for n, alts in by_pair.implementations.items()} == {0: ["mask"], 1: ["fused"]}
    assert not without_implementations(graph, ["mask", "fused"]).implementations
    with pytest.raises(ArgumentError, match="exclude_implementations"):
        without_implementations(graph, [3])
    schedule = get_strategy("monet")(graph, None, exclude_implementations=["mask", (0, "fused")])
    assert dict(schedule.implementations or {}).get(0) is None and dict(schedule.implementations or {}).get(1) in (
        None, "fused")


def _batch_norm_net():
    inputs = keras.Input((12, 12, 4))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(8, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model


def test_plans_name_inexact_choices_and_exact_gradients_excludes_them():
    """At 60% monet chooses the batch norms' output-activated and fused implementations
    (both inexact) beside ReLU masks (exact): the plan names the inexact ones; with
    exact_gradients=True none is chosen; measure_model gives each one's gradient error."""
    model = _batch_norm_net()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 12, 12, 4)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 4)]
    options = dict(batch_size=4, strategy="monet", cost_model="flops", verbose=0, time_limit=20)
    planned = plan_model(model, "60%", x, y, **options)
    chosen = dict(planned.schedule.implementations or {})
    names = planned.graph.names
    inexact = {(names[node], name) for node, name in chosen.items() if name in ("output_activated", "fused")}
    assert inexact and set(planned.inexact_implementations) == inexact
    exact = plan_model(model, "60%", x, y, exact_gradients=True, **options)
    assert not exact.inexact_implementations
    assert not {name for name in (exact.schedule.implementations or {}).values()} & {"output_activated", "fused"}
    with pytest.raises(ArgumentError, match="exact_gradients"):
        plan_model(model, "60%", x, y, exact_gradients="yes", **options)

    measured = measure_model(model, "60%", steps=1, **options)
    rows = measured["inexact_implementations"]
    assert {(node, row["implementation"]) for row in rows for node in row["nodes"]} == inexact
    for row in rows:
        assert 0 <= row["grad_error"] < 1e-3


def test_fit_and_the_callback_take_exact_gradients():
    """The callback plans with the same exclusions as plan_model, and its plans name what
    monet chose (nothing inexact with exact_gradients=True)."""
    import tfremat
    from tfremat.keras import RematCallback

    model = _batch_norm_net()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 12, 12, 4)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 4)]
    options = dict(strategy="monet", cost_model="flops", verbose=0, time_limit=20, allocator_check=False)
    history = tfremat.fit(model, "60%", x, y, batch_size=4, epochs=1, exact_gradients=True, **options)
    (plan,) = history.plans.values()
    assert plan.inexact_implementations == ()
    assert not {name for name in (plan.schedule.implementations or {}).values()} & {"output_activated", "fused"}
    with pytest.raises(ArgumentError, match="exact_gradients"):
        RematCallback("60%", exact_gradients="yes")
