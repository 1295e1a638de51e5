"""A warning TensorFlow logs per trace is shown once per extraction, not once per profiling
trace (keras.io's FNet casts complex64 to float32; benchmarks/results/user_check_6.md)."""

import logging

import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.extract import extract  # noqa: E402


class RealPartOfFFT(keras.layers.Layer):
    def call(self, x):
        return tf.cast(tf.signal.fft(tf.cast(x, tf.complex64)), tf.float32)


def test_a_tensorflow_warning_logged_per_trace_is_shown_once_per_extraction(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(2)(RealPartOfFFT()(keras.layers.Dense(8)(inputs))))
    x, y = tf.zeros((4, 8)), tf.zeros((4, 2))
    caplog.clear()  # building the model traced the cast once
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        extract(model, (x, y), loss="mse", cost_model="flops", use_cache=False)
    casts = [r for r in caplog.records if "incompatible dtype float32" in r.getMessage()]
    assert len(casts) == 1, [r.getMessage() for r in casts]
    assert not logging.getLogger("tensorflow").filters  # the filter ends with the extraction
