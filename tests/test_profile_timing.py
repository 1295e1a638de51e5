"""The profiler traces, times and measures calls on the executor the step runs on (issue 33),
and reads their seconds off TensorFlow's trace (issue 33 item 3)."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from tfremat.extract import analysis, call_timing, extract
from tfremat.extract import profile_cache, timing
from tfremat.extract.profile_cache import cache_key
from tfremat.runtime import executor
from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR


@pytest.mark.parametrize("several_threads", [True, False])
def test_profiled_calls_are_traced_and_run_on_the_steps_executor(monkeypatch, several_threads):
    """With several inter-op threads the step runs on TensorFlow's single-threaded executor,
    so every timed or measured run of the profile does too, and a while loop is traced as a
    While operation it can run (lowered to control-flow primitives, the executor refuses
    it); with one the step, and the profile, keep the default executor."""
    monkeypatch.setattr(executor, "sequential_ops", lambda: not several_threads)
    executors = []
    synchronize = analysis.synchronize

    def recording(value):
        executors.append(context.context().function_call_options.executor_type)
        return synchronize(value)

    monkeypatch.setattr(analysis, "synchronize", recording)
    monkeypatch.setattr(call_timing, "synchronize", recording)
    monkeypatch.setattr(call_timing, "_MIN_TIMING_SECONDS", 0.0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    hidden = keras.layers.LSTM(5, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(hidden))
    batch = (np.ones((2, 6, 4), np.float32), np.eye(3, dtype=np.float32)[[0, 1]])
    graph = extract(model, batch, cost_model="profile", repeats=1, use_cache=False).graph
    assert len(executors) > 10 and set(executors) == ({SEQUENTIAL_EXECUTOR} if several_threads else {None})
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


def _functions():
    """A function of milliseconds of kernels and one that computes nothing, on the step's executor."""
    weights = tf.random.stateless_normal((384, 384), seed=(0, 1))
    heavy = tf.function(lambda x: tf.matmul(tf.matmul(x, weights), weights), autograph=False)
    empty = tf.function(lambda x: tf.identity(x), autograph=False)
    x = tf.random.stateless_normal((384, 384), seed=(2, 3))
    return [(heavy.get_concrete_function(x), (x,)), (empty.get_concrete_function(x), (x,))]


def test_the_trace_times_each_call_without_calling_it_from_python():
    """Each call's seconds come from its run in TensorFlow's trace: the rounds attribute
    milliseconds of matmul to the heavy call, and the call that computes nothing costs
    less than its least wall time from Python (which adds the ~100s of us of dispatch)."""
    calls = _functions()
    names = [fn.function_def.signature.name for fn, _ in calls]
    wall = [float("inf")] * len(calls)

    def rounds():
        for _ in range(20):
            for position, (fn, args) in enumerate(calls):
                start = time.perf_counter()
                analysis.synchronize(fn(*args))
                wall[position] = min(wall[position], time.perf_counter() - start)
        return 20

    with executor.step_executor():
        for fn, args in calls:
            analysis.synchronize(fn(*args))
        traced = []
        with timing.TracedRounds() as trace:
            trace.run(names, rounds, 0, traced.append)
        (seconds,) = traced
    # The last round may miss the end of a run (timing._settle), no other.
    assert [len(s) in (19, 20) for s in seconds] == [True, True]
    heavy, empty = (min(s) for s in seconds)
    assert heavy > 10 * empty
    assert empty < wall[1]


def test_the_trace_refuses_calls_out_of_the_order_given():
    calls = _functions()
    names = [fn.function_def.signature.name for fn, _ in calls]
    def one_round_reversed():
        for fn, args in reversed(calls):
            analysis.synchronize(fn(*args))
        return 1

    with executor.step_executor(), pytest.raises(RuntimeError, match="in rounds of 2"):
        with timing.TracedRounds() as trace:
            trace.run(names, one_round_reversed, 0, lambda seconds: None)


def test_a_profile_on_cpu_reads_its_seconds_off_the_trace(monkeypatch):
    """extract() times every call on CPU from the trace (_traced_pass), never from Python."""
    traced = []
    traced_pass = call_timing._traced_pass

    def recording(trace, calls, repeats, warmup, done):
        traced.extend(fn for fn, _ in calls)
        return traced_pass(trace, calls, repeats, warmup, done)

    def refuse(*args, **kwargs):
        raise AssertionError("a call was timed from Python on CPU")

    monkeypatch.setattr(call_timing, "_traced_pass", recording)
    monkeypatch.setattr(call_timing, "_least_seconds", refuse)
    monkeypatch.setattr(call_timing, "_MIN_TIMING_SECONDS", 0.0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(inputs))
    batch = (np.ones((4, 6), np.float32), np.eye(3, dtype=np.float32)[[0, 1, 2, 0]])
    graph = extract(model, batch, cost_model="profile", repeats=2, use_cache=False).graph
    assert traced and all(c > 0 for c in graph.cost)


def test_batch_norm_residuals_are_the_same_in_every_extraction():
    """The backward waits for batch norm's moving-average updates: run before or after its
    first operations as the trace happened to order them, their 32-byte temporaries counted
    as hidden residuals in some extractions (0, 32 or 64 B over 8 channels at batch 8),
    which added or dropped a graph edge between two profiles."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.BatchNormalization(name="bn")
    layer.build((8, 4, 4, 8))
    spec = tf.TensorSpec([8, 4, 4, 8], tf.float32)
    analyses = []
    for _ in range(5):
        with analysis.memory_only():
            analyses.append(analysis.analyze_call(lambda xs: layer(xs[0], training=True), "bn", [spec], [True],
                                                  layer.trainable_variables, 8, profile=True))
    assert {(a.residual_bytes, a.small_residual_bytes) for a in analyses} == {(0, analyses[0].small_residual_bytes)}
    assert analyses[0].small_residual_bytes > 0


def test_a_call_the_trace_missed_is_timed_by_its_other_rounds():
    """A mid-round call whose region TensorFlow's trace missed leaves that round out of the
    function's seconds instead of failing the extraction; a function no round timed is an
    error (the trace's events are not the ones this TensorFlow version writes)."""
    names = ["f", "g"]
    calls = [(0, "f", 1.0), (1, "g", 2.0), (2, "f", None), (3, "g", 2.5), (4, "f", 1.5), (5, "g", 3.0)]
    assert timing._attributed(calls, names) == [[1.0, 1.5], [2.0, 2.5, 3.0]]
    with pytest.raises(RuntimeError, match="no execution of 'f'"):
        timing._attributed([(0, "f", None), (1, "g", 2.0)], names)


def test_calls_with_like_inputs_share_one_dispatch_function():
    """The function that computes nothing (subtracted from every profiled call's seconds) is
    traced once per structure of input specs: two calls with like inputs time the same
    function, a call with other inputs its own, and it still returns its inputs unchanged."""
    first = (tf.ones([2, 3]), tf.constant(1.0))
    like = (tf.zeros([2, 3]), tf.constant(2.0))
    other = ([tf.ones([2, 3])], tf.constant(1.0))
    shared = call_timing.dispatch_only(first)
    assert call_timing.dispatch_only(like) is shared
    assert call_timing.dispatch_only(other) is not shared
    assert call_timing.dispatch_only((tf.ones([4, 3]), tf.constant(1.0))) is not shared
    returned = shared(*like)
    np.testing.assert_array_equal(returned[0].numpy(), like[0].numpy())
    assert float(returned[1]) == 2.0
