"""Issue 33 (benchmarks/results/user_check_4.md finding 1): MobileNetV3Small's checkpoint-all
step is not bitwise equal to plain Keras's, already on its first gradients.

Grappler rewrites arithmetic across layer boundaries in the plain step and cannot in the
compiled one (benchmarks/results/mobilenetv3_exact.md): the arithmetic optimizer folds a
batch norm's final add into the residual ``Add`` that reads it (``AddOpsRewrite``), and
constant folding moves the dropout scale into the hard-swish product before it, with operands
ordered by op name. The per-statement tokens and control inputs, and the ``forward_<n>``
scopes, block or reorder both. These tests hold the two smallest structures that showed it.
The first is bitwise since a statement that the next one reads has no token
(``tfremat.static_graph.interpreter._chained_computes``); the second since a first forward
computation's scope starts with its layer's path (``step/<layer>/forward_<n>/``), so the step's
op names order commutative operands by layer as plain training's (``functional_1/<layer>/...``)
do, not by node number (``_Interpreter._statement_scope``).
"""

import functools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from keras import layers  # noqa: E402

from tfremat.extract import extract  # noqa: E402
from tfremat.extract.layer_graph import model_output_names  # noqa: E402
from tfremat.extract.side_table import flatten_by_name  # noqa: E402
from tfremat.runtime.state import state_restored  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

BATCH = 8


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _residual_batch_norm():
    """A MobileNetV3 block's tail: a projection's batch norm read by a residual ``Add``."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    h = layers.Conv2D(8, 1, use_bias=False)(x)
    h = layers.BatchNormalization()(h)
    x = layers.Add()([x, h])
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))


def _hard_swish_dropout_head():
    """MobileNetV3's classifier: hard-swish, dropout, a 1x1 convolution, flatten, softmax."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2, 2, 8))
    x = layers.GlobalAveragePooling2D(keepdims=True)(inputs)
    x = layers.Conv2D(32, 1)(x)
    x = layers.Activation("hard_swish")(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Conv2D(10, 1)(x)
    x = layers.Flatten()(x)
    return keras.Model(inputs, layers.Activation("softmax")(x))


def _gradients_against_plain(model):
    """The checkpoint-all step's first gradients and plain training's, from the same state."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((BATCH, *model.input_shape[1:]), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, BATCH))
    extraction = extract(model, (x, y), optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy",
                         cost_model="flops", use_cache=False, weight_grads="fixed")
    step = compile_step(extraction, get_strategy("checkpoint_all")(extraction.graph), apply_gradients=False)
    with state_restored(list(model.variables)):
        _, gradients = step(x, y)
    loss_fn = extraction.side_table.loss_fn

    @functools.partial(tf.function, autograph=False)
    def plain(inputs, labels):
        with tf.GradientTape() as tape:
            predictions = model(inputs, training=True)
            loss = loss_fn(flatten_by_name(labels, model_output_names(model), "outputs"), tf.nest.flatten(predictions))
        return tape.gradient(loss, model.trainable_variables)

    return [np.asarray(g) for g in gradients], [np.asarray(g) for g in plain(x, y)]


@pytest.mark.parametrize("make", [
    pytest.param(_residual_batch_norm, id="bn_add"),
    pytest.param(_hard_swish_dropout_head, id="hswish_dropout"),
])
def test_checkpoint_all_gradients_are_bitwise_plain(make):
    model = make()
    ours, plain = _gradients_against_plain(model)
    differing = [v.path for v, a, b in zip(model.trainable_variables, ours, plain) if not np.array_equal(a, b)]
    assert not differing, differing
