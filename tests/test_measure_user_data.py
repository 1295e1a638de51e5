"""``measure_model`` on the user's own batches (user_check_6): a model whose made-up batch is
impossible (a time axis of unknown length, string inputs looked up inside the model) is
measured on its data, as ``tfremat.plan_model`` and ``tfremat.fit`` plan on it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat.errors import ArgumentError
from tfremat.measure import measure_model

FAST = {"strategy": "checkpoint_all", "cost_model": "flops", "steps": 1, "verbose": 0}


def _sequence_model():
    """keras.io's sequence models write the time axis as None."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 6))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def _data(samples=8, steps=5):
    rng = np.random.default_rng(0)
    return rng.standard_normal((samples, steps, 6)).astype("float32"), rng.integers(0, 3, samples)


def test_unknown_time_axis_needs_data_and_is_measured_on_it():
    model = _sequence_model()
    with pytest.raises(ArgumentError, match="axis 1 is unknown"):
        measure_model(model, "100%", batch_size=4, **FAST)
    x, y = _data()
    before = [v.numpy() for v in model.variables]
    record = measure_model(model, "100%", x, y, batch_size=4, **FAST)
    assert record["batch_size"] == 4
    assert record["gradients_match"] is True, record
    assert record["predicted_peak_bytes"] > x[:4].nbytes
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))


def test_dataset_fixes_the_batch_size():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(2)
    record = measure_model(_sequence_model(), "100%", dataset, **FAST)
    assert record["batch_size"] == 2 and record["gradients_match"] is True, record


def test_string_inputs_are_measured_on_the_data():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"], mask_token=None, num_oov_indices=1)(inputs)
    h = keras.layers.Flatten()(keras.layers.Embedding(4, 4)(ids))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse")
    x = tf.constant(np.array([["a"], ["b"], ["c"], ["a"]], dtype=object))
    record = measure_model(model, "100%", x, tf.ones((4, 1)), batch_size=4, **FAST)
    assert record["batch_size"] == 4 and record["gradients_match"] is True, record


def test_half_the_data_is_refused_naming_the_missing_argument():
    x, _ = _data()
    with pytest.raises(ArgumentError, match="y=None"):
        measure_model(_sequence_model(), "100%", x, batch_size=4, **FAST)
