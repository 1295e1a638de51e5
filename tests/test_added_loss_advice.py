"""A layer that adds a loss in ``call`` is refused (the step has one loss node), and the
refusal names the route that keeps the term (issue 33, finding 9): an activity penalty
cannot move into a Keras loss, which sees only ``y_true`` and ``y_pred``, but it can move
into the loss function of ``tfremat.value_and_grad`` once the model returns the activation;
that route is checked here against the plain tape on the regularized model."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import ExtractionError  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

QUICK = {"cost_model": "flops", "cache": False, "verbose": 0, "allocator_check": False}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _conv_net(activity_regularizer):
    """Four convolutions, the first with ``activity_regularizer`` (None: it returns the
    first convolution's output as a second output instead)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    first = keras.layers.Conv2D(4, 3, padding="same", activation="relu", activity_regularizer=activity_regularizer,
                                name="penalized")(inputs)
    h = first
    for _ in range(3):
        h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(h)
    prediction = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, prediction if activity_regularizer is not None else [prediction, first])


def _batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 8).astype("int32")


def test_an_activity_regularizer_is_refused_naming_the_argument_and_value_and_grad():
    model = _conv_net(keras.regularizers.L2(0.01))
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    x, y = _batch()
    with pytest.raises(ExtractionError) as refusal:
        tfremat.fit(model, "min", x, y, batch_size=8, **QUICK)
    message = str(refusal.value)
    assert "'penalized'" in message and "activity_regularizer=" in message and "tfremat.value_and_grad" in message


def test_the_advised_route_trains_the_activity_penalty_as_keras_does():
    """The penalty in value_and_grad's loss function, regularizer(h) / batch size, gives
    the loss of the tape on the regularized model and its gradients, with recomputation."""
    x, y = _batch()
    cross_entropy = keras.losses.SparseCategoricalCrossentropy()
    regularized = _conv_net(keras.regularizers.L2(0.01))
    with tf.GradientTape() as tape:
        expected_loss = cross_entropy(y, regularized(x, training=True)) + keras.ops.sum(regularized.losses)
    expected = tape.gradient(expected_loss, regularized.trainable_variables)

    model = _conv_net(None)
    penalty = keras.regularizers.L2(0.01)

    def loss_fn(images, labels):
        prediction, activation = model(images, training=True)
        batch_size = keras.ops.cast(keras.ops.shape(activation)[0], "float32")
        return cross_entropy(labels, prediction) + penalty(activation) / batch_size

    g = tfremat.value_and_grad(loss_fn, "min", x, y, **QUICK)
    loss, grads = g(tf.constant(x), tf.constant(y))
    assert g.plan.schedule.recompute_count > 0
    assert [v.path for v in g.trainable_variables] == [v.path for v in model.trainable_variables]
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert closeness([v.numpy() for v in grads], [v.numpy() for v in expected]).equal
