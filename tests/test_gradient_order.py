"""One gradient call for a layer's input and weight gradients (tfremat.runtime.gradient_order):
the work the two share is built once, and the weight gradients' own operations still wait
for the input gradients."""

import collections

import keras
import numpy as np
import tensorflow as tf

from tfremat.runtime.gradient_order import input_then_weight_gradients

BATCH, TOKENS, WIDTH = 2, 8, 16


def _ancestors(op) -> set:
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return seen


def _gelu_dense():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(32, activation="gelu")
    layer.build((BATCH, TOKENS, WIDTH))
    return layer


def test_shared_gradient_work_is_built_once_and_weight_gradients_wait():
    layer = _gelu_dense()
    variables = list(layer.trainable_variables)
    spec = tf.TensorSpec((BATCH, TOKENS, WIDTH), tf.float32)
    found = {}

    @tf.function(autograph=False)
    def ordered(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        inputs, weights = input_then_weight_gradients(lambda xs: tape.gradient(y, xs), [x], variables)
        found["inputs"], found["weights"] = inputs, weights
        return inputs + weights

    @tf.function(autograph=False)
    def once(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x] + variables)

    def computing(function):
        ops = function.get_concrete_function(spec).graph.get_operations()
        return collections.Counter(op.type for op in ops if op.type not in ("Const", "NoOp", "Identity"))

    # The GELU's gradient (Erf, Exp, Mul...) appears once, as in a single gradient call.
    assert computing(ordered) == computing(once)
    graph = ordered.get_concrete_function(spec).graph
    input_grad = found["inputs"][0].op
    kernel_grad = found["weights"][0].op
    assert input_grad in _ancestors(kernel_grad)  # the kernel's gradient waits for the input's
    assert kernel_grad not in _ancestors(input_grad)
    assert graph is input_grad.graph
    x = tf.constant(np.random.default_rng(0).standard_normal((BATCH, TOKENS, WIDTH)).astype("float32"))
    for a, b in zip(ordered(x), once(x)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_no_sources_or_no_variables_take_one_plain_call():
    layer = _gelu_dense()
    x = tf.ones((BATCH, TOKENS, WIDTH))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = layer(x)
    inputs, weights = input_then_weight_gradients(lambda xs: tape.gradient(y, xs), [], list(layer.trainable_variables))
    assert inputs == [] and len(weights) == 2
    inputs, weights = input_then_weight_gradients(lambda xs: tape.gradient(y, xs), [x], [])
    assert len(inputs) == 1 and weights == []


def test_the_compiled_step_builds_as_many_matmuls_as_plain_training():
    """A pre-norm GELU feed-forward block: the checkpoint-all step's graph holds the plain
    step's matrix products, no rebuilt copies of the shared gradient work."""
    from tfremat.extract import extract
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.static_graph import compile_step
    from tfremat.strategies import get_strategy

    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS, WIDTH))
    h = keras.layers.LayerNormalization()(inputs)
    h = keras.layers.Dense(64, activation="gelu")(h)
    h = keras.layers.Add()([inputs, keras.layers.Dense(WIDTH)(h)])
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(h))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, TOKENS, WIDTH)).astype("float32"))
    y = tf.constant(np.eye(4, dtype="float32")[rng.integers(0, 4, (BATCH, TOKENS))])
    extraction = extract(model, (x, y), optimizer=keras.optimizers.SGD(), loss="categorical_crossentropy",
                         cost_model="flops", use_cache=False)
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, get_strategy("checkpoint_all")(extraction.graph), optimizer=optimizer)
    plain = plain_train_step(model, extraction.side_table.loss_fn, keras.optimizers.SGD())

    def products(function) -> int:
        ops = function.get_concrete_function(x, y).graph.get_operations()
        return sum(op.type in ("MatMul", "BatchMatMulV2", "Erf", "Erfc") for op in ops)

    assert products(step.function) == products(plain)


# Operations that order statements or copy handles, and do no arithmetic on a tensor: the
# per-statement tokens (IdentityN), the gated weight gradients (Identity), the gates
# (NoOp), the dropout seed snapshots (ReadVariableOp).
ORDERING_OPS = {"IdentityN", "Identity", "NoOp", "ReadVariableOp", "Const"}


def test_the_compiled_step_does_the_arithmetic_of_plain_training():
    """The keras.io ViT (Patches, a position Embedding, attention with dropout, a GELU MLP)
    with Adam: the checkpoint-all step's graph holds the plain step's operations, type by
    type, apart from the ordering ones and the gradient sums (AddN: the step sums a
    tensor's gradients per consumer statement), so with ops run one at a time it runs
    as fast as plain training (benchmarks/step_overhead.py)."""
    from models import keras_io_vit

    from tfremat.extract import extract
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.static_graph import compile_step
    from tfremat.strategies import get_strategy

    model = keras_io_vit(image_size=8, patch_size=4, dim=8, heads=2, blocks=1, block_units=(8,), head=(16,))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, 8, 8, 3)).astype("float32"))
    y = tf.constant(np.eye(10, dtype="float32")[rng.integers(0, 10, BATCH)])
    extraction = extract(model, (x, y), optimizer=keras.optimizers.Adam(), loss="categorical_crossentropy",
                         cost_model="flops", use_cache=False)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, get_strategy("checkpoint_all")(extraction.graph), optimizer=optimizer)
    plain = plain_train_step(model, extraction.side_table.loss_fn, keras.optimizers.Adam())

    def arithmetic(function) -> collections.Counter:
        ops = function.get_concrete_function(x, y).graph.get_operations()
        return collections.Counter(op.type for op in ops if op.type not in ORDERING_OPS | {"AddN"})

    found, expected = arithmetic(step.function), arithmetic(plain)
    assert found == expected, {k: (found[k], expected[k]) for k in found | expected if found[k] != expected[k]}
    # The patches (a convolution), dropout masks and attention are in both.
    assert expected["Conv2D"] == 1 and expected["StatelessRandomUniformV2"] > 0 and expected["BatchMatMulV2"] > 0
