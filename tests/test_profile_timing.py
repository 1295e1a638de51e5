"""The profiler traces, times and measures calls on the executor the step runs on (issue 33)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from tfremat.extract import analysis, extract
from tfremat.extract import profile_cache
from tfremat.extract.profile_cache import cache_key
from tfremat.runtime import executor
from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR


@pytest.mark.parametrize("several_threads", [True, False])
def test_profiled_calls_are_traced_and_run_on_the_steps_executor(monkeypatch, several_threads):
    """The step runs on TensorFlow's single-threaded executor whatever the inter-op thread
    count, so every timed or measured run of the profile does too, and a while loop is
    traced as a While operation it can run (lowered to control-flow primitives, the
    executor refuses it)."""
    monkeypatch.setattr(executor, "sequential_ops", lambda: not several_threads)
    executors = []
    synchronize = analysis.synchronize

    def recording(value):
        executors.append(context.context().function_call_options.executor_type)
        return synchronize(value)

    monkeypatch.setattr(analysis, "synchronize", recording)
    monkeypatch.setattr(analysis, "_MIN_TIMING_SECONDS", 0.0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    hidden = keras.layers.LSTM(5, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(hidden))
    batch = (np.ones((2, 6, 4), np.float32), np.eye(3, dtype=np.float32)[[0, 1]])
    graph = extract(model, batch, cost_model="profile", repeats=1, use_cache=False).graph
    assert len(executors) > 10 and set(executors) == {SEQUENTIAL_EXECUTOR}
    assert context.context().function_call_options.executor_type in (None, "")
    assert graph.cost[graph.names.index("lstm")] > 0


def test_the_cache_key_follows_the_cache_version(monkeypatch):
    """Profiles measured before the profiler ran on the single-threaded executor are not
    read back: the version is part of the key."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    specs = [tf.TensorSpec([2, 4], tf.float32)], [tf.TensorSpec([2, 2], tf.float32)]
    key = cache_key(model, [], *specs, "mse", "profile", "/cpu:0")
    monkeypatch.setattr(profile_cache, "_CACHE_VERSION", profile_cache._CACHE_VERSION - 1)
    assert cache_key(model, [], *specs, "mse", "profile", "/cpu:0") != key
