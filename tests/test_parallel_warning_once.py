"""The warning that a step runs on TensorFlow's default executor is printed once per model
and kind of call, not once per compiled step (user_check_3 finding 7b: three times in one
``fit``, whose steps' warnings differed only in the traced functions' names).

The test process has one inter-op thread (:mod:`conftest`); the ``parallel`` fixture makes
the library act as with several, where the warning is given.
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from tfremat.extract import extract
from tfremat.runtime import executor
from tfremat.static_graph import compile_step
from tfremat.strategies import get_strategy


@keras.saving.register_keras_serializable(package="tfremat_tests")
class HalvedWhenNegative(keras.layers.Layer):
    """A tf.cond on the batch's mean: halves the input when it is negative."""

    def call(self, x):
        return tf.cond(tf.reduce_mean(x) < 0, lambda: x * 0.5, lambda: x)


def _model(name: str):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    hidden = HalvedWhenNegative(name="halved")(keras.layers.Conv2D(4, 3, padding="same")(inputs))
    for _ in range(3):
        hidden = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(hidden)), name=name)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if "default executor" in r.getMessage()]


def test_steps_of_one_model_warn_once_and_another_model_warns_again(parallel, caplog):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((4, 8, 8, 4)), tf.float32)
    y = tf.constant(rng.standard_normal((4, 2)), tf.float32)
    with caplog.at_level(logging.WARNING, logger="tfremat.static_graph.compile"):
        model = _model("gated_a")
        extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
        steps = [compile_step(extraction, get_strategy(name)(extraction.graph))
                 for name in ("chen_sqrtn", "checkpoint_all", "chen_sqrtn")]
        blocking = []
        for step in steps:
            assert np.isfinite(float(step(x, y)))
            assert not step.sequential  # each step moved to the default executor
            blocking.append(executor.blocking_call(step.function.get_concrete_function(x, y).graph).describe())
        # Each trace names its own conditional's functions: one text per step.
        assert len(set(blocking)) == len(steps), blocking
        (message,) = _warnings(caplog)
        assert "the step of gated_a" in message and "conditional" in message

        other = _model("gated_b")
        extraction = extract(other, (x, y), cost_model="flops", use_cache=False)
        step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph))
        assert np.isfinite(float(step(x, y)))
    messages = _warnings(caplog)
    assert len(messages) == 2 and "the step of gated_b" in messages[1], messages
