"""How the profiler times and measures calls: on the step's executor, small calls repeated
within one function call, more passes for the calls that decide the plans (issue 33 item 3)."""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from tfremat.extract import analysis, extract
from tfremat.extract import profile_cache
from tfremat.extract.profile_cache import cache_key
from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR


def test_profiled_calls_are_traced_and_run_on_the_single_threaded_executor(monkeypatch):
    """The step runs on TensorFlow's single-threaded executor, so every timed or measured
    run of the profile does too, and a while loop is traced as a While operation it can
    run (lowered to control-flow primitives, the executor refuses it)."""
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


class _Passes:
    """A stand-in for a call's timing: ``seconds()`` is all :func:`analysis._largest` reads."""

    def __init__(self, seconds):
        self._seconds = seconds

    def seconds(self):
        return self._seconds


def test_the_largest_calls_are_the_fewest_making_the_large_share():
    timings = [_Passes(s) for s in (1.0, 40.0, 5.0, 30.0, 24.0)]  # 100 in all
    large = analysis._largest(timings)
    assert analysis._LARGE_SHARE == 0.7
    assert [t.seconds() for t in large] == [40.0, 30.0]
    assert analysis._largest([_Passes(2.0)])[0].seconds() == 2.0


def test_a_small_call_is_timed_repeated_within_one_function_call():
    """After the first pass, a call of microseconds is timed as one function running it on
    several sets of inputs, its seconds divided by their number: the cost of calling a
    function from Python, hundreds of microseconds, is paid once for all of them."""
    layer = keras.layers.Dense(4)
    layer.build((2, 3))
    spec = tf.TensorSpec([2, 3], tf.float32)
    with analysis.timing_passes(2) as passes:
        first = analysis.analyze_call(lambda xs: layer(xs[0]), "dense", [spec], [True], layer.trainable_variables,
                                      2, profile=True, repeats=2, warmup=1)
        passes.final(first)
    (timing,) = {id(t): t for _, t, _ in passes._timings.values()}.values()
    runs = [count for count, _ in timing.passes]
    assert runs[0] == 1 and len(runs) == 2 + analysis._LARGE_EXTRA_PASSES
    assert 2 <= runs[1] <= analysis._MAX_REPEATED and set(runs[1:]) == {runs[1]}
    # Each repeated function runs the call on every set of inputs and returns every result.
    dispatch, forward, step = timing._repeated
    graph_calls = [op for op in forward.graph.get_operations() if op.type in ("PartitionedCall",
                                                                              "StatefulPartitionedCall")]
    assert len(graph_calls) == runs[1] and len(forward.outputs) == runs[1]
    arguments = [t.name for t in forward.inputs if t.name.startswith("sets_")]  # the others: the layer's variables
    assert len(set(arguments)) == len(arguments) == runs[1]
    # The chosen seconds are those of the repeated passes, per run.
    assert timing.chosen() == [min(column) for column in zip(*(least for _, least in timing.passes[1:]))]


def test_the_cache_key_follows_the_cache_version(monkeypatch):
    """Profiles measured before the profiler ran on the single-threaded executor and timed
    small calls repeated are not read back: the version is part of the key."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    specs = [tf.TensorSpec([2, 4], tf.float32)], [tf.TensorSpec([2, 2], tf.float32)]
    key = cache_key(model, [], *specs, "mse", "profile", "/cpu:0")
    monkeypatch.setattr(profile_cache, "_CACHE_VERSION", profile_cache._CACHE_VERSION - 1)
    assert cache_key(model, [], *specs, "mse", "profile", "/cpu:0") != key
