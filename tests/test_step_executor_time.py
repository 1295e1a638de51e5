"""The planned time follows the executor the compiled step runs on, and the warning that
moves a step to TensorFlow's default executor names what it found (user_check_2.md findings 2
and 6).

A step that calls functions (Keras's ``jit_compile=True`` ``_conv_xla`` that runs a grouped
``Conv2D`` on CPU, a ``tf.cond``) runs on the default executor, where it overlaps operations
as plain training does: the plain overlap, measured against one operation at a time, does not
apply to it. The test process has one inter-op thread (:mod:`conftest`); the ``parallel``
fixture makes the library act as with several.
"""

import dataclasses
import logging
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat.extract.overlap as overlap_module
from tfremat.extract import extract
from tfremat.extract.overlap import PlainOverlap, measure_plain_overlap
from tfremat.planner import plan_graph, plan_summary
from tfremat.runtime import executor
from tfremat.static_graph import compile_step
from tfremat.strategies import get_strategy


@keras.saving.register_keras_serializable(package="tfremat_tests")
class Gated(keras.layers.Layer):
    """A tf.cond on the batch's mean: doubles the input when it is positive."""

    def call(self, x):
        return tf.cond(tf.reduce_mean(x) > 0, lambda: x * 2.0, lambda: x)


def _model(kind: str):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 4))
    if kind == "grouped":
        hidden = keras.layers.Conv2D(4, 3, padding="same", groups=4, name="grouped_conv")(inputs)
    elif kind == "cond":
        hidden = Gated(name="gated")(keras.layers.Conv2D(4, 3, padding="same")(inputs))
    else:
        hidden = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    for _ in range(3):  # enough nodes for a schedule that recomputes
        hidden = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(hidden)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(hidden))
    model = keras.Model(inputs, outputs, name=f"small_{kind}")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.standard_normal((4, 8, 8, 4)), tf.float32),
            tf.constant(rng.standard_normal((4, 2)), tf.float32))


def _traced(model, x, y):
    @tf.function(autograph=False)
    def forward(a):
        return model(a, training=True)

    with executor.sequential():
        return forward.get_concrete_function(x).graph


def test_the_blocking_call_names_keras_s_xla_grouped_convolution():
    model = _model("grouped")
    x, y = _batch()
    found = executor.blocking_call(_traced(model, x, y))
    assert found is not None and found.xla and found.op_type == "StatefulPartitionedCall"
    assert "grouped_conv" in found.op and any("_conv_xla" in name for name in found.functions)
    text = found.describe()
    assert text.startswith("Keras compiles grouped convolutions")
    assert found.op in text and found.functions[0] in text
    assert executor.calls_functions(_traced(model, x, y))


def test_the_blocking_call_names_a_conditional_and_its_branches():
    model = _model("cond")
    x, y = _batch()
    found = executor.blocking_call(_traced(model, x, y))
    assert found is not None and found.op_type in ("If", "StatelessIf") and not found.xla
    assert "gated" in found.op and len(found.functions) == 2 and "true" in found.functions[0]
    assert "conditional" in found.describe() and found.op in found.describe()
    assert executor.blocking_call(_traced(_model("plain"), x, y)) is None


@pytest.mark.parametrize("kind", ["grouped", "cond"])
def test_the_step_s_warning_names_what_it_calls(kind, parallel, caplog):
    model = _model(kind)
    x, y = _batch()
    extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
    step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph))
    with caplog.at_level(logging.WARNING, logger="tfremat.static_graph.compile"):
        assert np.isfinite(float(step(x, y)))
    assert not step.sequential
    messages = [r.getMessage() for r in caplog.records if "default executor" in r.getMessage()]
    assert len(messages) == 1
    expected = ("Keras compiles grouped convolutions" if kind == "grouped" else "it holds a conditional")
    assert expected in messages[0] and ("grouped_conv" if kind == "grouped" else "gated") in messages[0]
    assert "a tf.cond, a loss scale's update), for which" not in messages[0]  # the old, generic cause


def test_a_plain_step_that_calls_functions_measures_no_overlap(parallel, monkeypatch, caplog):
    def refused(*args, **kwargs):
        raise AssertionError("nothing is timed for a step on the default executor")

    monkeypatch.setattr(overlap_module, "time_in_turns", refused)
    model = _model("grouped")
    x, y = _batch()
    loss = lambda labels, preds: tf.reduce_mean(tf.square(labels[0] - preds[0]))  # noqa: E731
    with caplog.at_level(logging.INFO, logger="tfremat.extract.overlap"):
        factor = measure_plain_overlap(model, x, [y], loss, keras.optimizers.SGD(0.01))
    assert factor == PlainOverlap()
    assert any("not measured" in r.getMessage() and "grouped convolutions" in r.getMessage()
               for r in caplog.records)


def test_the_predicted_time_leaves_the_overlap_out_on_the_default_executor():
    model = _model("plain")
    x, y = _batch()
    extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
    result = plan_graph(extraction.graph, "90% of activations", "chen_sqrtn", cache=False)
    result = dataclasses.replace(result, extraction=types.SimpleNamespace(plain_overlap=1.25))
    assert result.overhead > 0
    assert result.step_sequential and result.predicted_time_over_plain == pytest.approx(1.25 * (1 + result.overhead))
    assert "step_sequential" not in result.summary()
    on_default = dataclasses.replace(result, step_sequential=False)
    assert on_default.plain_overlap == 1.0
    assert on_default.predicted_time_over_plain == pytest.approx(1 + result.overhead)
    row = on_default.summary()
    assert row["step_sequential"] is False and row["plain_overlap"] == 1.0
    assert "plain training's time" not in plan_summary(on_default)
    assert "plain training's time" in plan_summary(result)


def test_measure_model_predicts_the_time_on_the_executor_its_step_ran_on(parallel, monkeypatch):
    from tfremat.measure import measure_model

    monkeypatch.setattr("tfremat.extract.extractor.measure_plain_overlap", lambda *args: 1.25)
    sequential = measure_model(_model("plain"), None, strategy="chen_sqrtn", batch_size=4, steps=2,
                               cache=False, verbose=0)
    assert sequential["step_executor"] == "single-threaded" and sequential["plain_overlap"] == 1.25
    assert sequential["predicted_time_over_plain"] == pytest.approx(1.25 * (1 + sequential["predicted_step_overhead"]),
                                                                    abs=1e-3)
    low, high = sequential["predicted_time_over_plain_range"]
    assert low <= sequential["predicted_time_over_plain"] <= high
    on_default = measure_model(_model("grouped"), None, strategy="chen_sqrtn", batch_size=4, steps=2,
                               cost_model="flops", cache=False, verbose=0)
    assert on_default["step_executor"] == "default" and on_default["plain_overlap"] == 1.0
    assert on_default["predicted_time_over_plain"] == pytest.approx(1 + on_default["predicted_step_overhead"], abs=1e-3)


@pytest.mark.parametrize("kind, sequential", [("plain", True), ("cond", False)])
def test_fit_s_plan_records_the_executor_its_step_ran_on(parallel, kind, sequential):
    import tfremat

    x, y = _batch()
    history = tfremat.fit(_model(kind), "100%", x, y, batch_size=4, epochs=1, verbose=0, cache=False,
                          cost_model="flops", allocator_check=False)
    (plan,) = history.plans.values()
    assert plan.step_sequential is sequential
