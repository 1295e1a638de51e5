"""measure_model's gradient check tells rounding from a wrong schedule.

A MobileNetV2 schedule's gradients were reported 3.9e-3 from plain training's after the
model had trained (benchmarks/results/user_check.md, finding 1): there the traced and the
eager plain tape differ by as much, and every schedule equals the eager one
(benchmarks/results/mnv2_gradient_check.md). The layers below stand in for that rounding
without training a MobileNetV2: they change their output by 1e-3 only where a graph pass
could fuse them across layers, in the plain traced step (neither eager nor under the
interpreter's ``forward_<node>`` statement scopes), or, as a wrong schedule would, only
under the interpreter.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat import measure


class _Rounding(keras.layers.Layer):
    """Scales by 1 + 1e-3 in the plain traced step (``where="plain"``) or only under the
    interpreter's statement scopes (``where="planned"``), by 1 elsewhere."""

    def __init__(self, where, **kwargs):
        super().__init__(**kwargs)
        self.where = where

    def call(self, inputs):
        planned = "forward_" in tf.get_current_name_scope()
        traced_plain = not tf.executing_eagerly() and not planned
        return inputs * (1.0 + 1e-3) if (planned if self.where == "planned" else traced_plain) else inputs


def _judge(where):
    from tfremat.extract.extractor import extract
    from tfremat.strategies import get_strategy

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = _Rounding(where)(keras.layers.Dense(16, activation="tanh")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(16, activation="tanh")(hidden)))
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 8)), tf.float32)
    y = tf.constant([0, 1, 2, 0])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    extraction = extract(model, sample_batch=(x, y), loss=loss, optimizer=keras.optimizers.SGD(),
                         cost_model="flops", use_cache=False)
    graph = extraction.graph
    recomputing = get_strategy("chen_sqrtn")(graph, None)
    saved = [v.numpy() for v in model.variables]
    tolerances = measure.gradient_tolerances(model)
    return [measure._judge_gradients(model, extraction, schedule, x, y, saved, tolerances)
            for schedule in (get_strategy("checkpoint_all")(graph, None), recomputing)]


def test_a_schedule_that_rounds_like_the_eager_plain_tape_matches():
    for gradients, matches, to_eager, spread in _judge("plain"):
        assert not gradients.equal  # the traced plain tape alone would call it a mismatch
        assert matches and to_eager.equal
        assert spread.max_tensor_error == pytest.approx(gradients.max_tensor_error, rel=1e-3)


def test_a_schedule_that_differs_from_both_plain_tapes_still_mismatches():
    for gradients, matches, to_eager, spread in _judge("planned"):
        assert matches is False and not gradients.equal and not to_eager.equal
        assert spread.equal  # the plain tapes agree: the difference is the step's
