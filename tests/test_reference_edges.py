"""Wide sums on the single-threaded executor (issue 33: InceptionV3 crashed tfremat.fit).

Grappler's memory optimizer rewrites a sum of more than two inputs (an ``AddN``, or adds the
arithmetic optimizer gathered into one) into a ``TemporaryVariable`` and ``AssignAdd``s when its
static estimate of the function's peak exceeds 80% of the device's memory, 256 MiB for
TensorFlow's CPU device; the single-threaded executor refuses that variable's reference-typed
edge. :func:`tfremat.runtime.executor.sequential` instantiates its functions without the memory
optimizer (``benchmarks/results/reference_edges.md``). The sizes here are just over that line:
about 230 MiB live at once.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

import tfremat
from tfremat.errors import CompileError
from tfremat.numerics import closeness
from tfremat.runtime import executor

# A float32 tensor of 56 MiB: four of them live (the input and a sum's three terms) are 224 MiB,
# over 80% of the CPU device's 256 MiB.
ELEMENTS = 56 * 2**20 // 4


def _wide_sum():
    @tf.function(autograph=False)
    def total(x):
        return tf.reduce_max(tf.add_n([x * float(term) for term in (1, 2, 3)]))

    return total


def _call_config() -> bytes:
    return context.context().function_call_options.config_proto_serialized


def test_a_wide_sum_runs_on_the_single_threaded_executor():
    x = tf.ones([ELEMENTS])
    with pytest.raises(tf.errors.UnimplementedError, match="reference-typed edges"):
        with tf.experimental.function_executor_type(executor.SEQUENTIAL_EXECUTOR):  # the memory optimizer on
            _wide_sum()(x)
    with executor.sequential():
        assert float(_wide_sum()(x)) == 6.0


def test_sequential_turns_off_the_memory_optimizer_only_inside():
    outer = _call_config()
    with executor.sequential():
        inside = config_pb2.ConfigProto.FromString(_call_config())
        with executor.default_executor():
            assert _call_config() == outer
            with executor.sequential():
                assert config_pb2.ConfigProto.FromString(_call_config()) == inside
        assert config_pb2.ConfigProto.FromString(_call_config()) == inside
    assert _call_config() == outer
    expected = config_pb2.ConfigProto.FromString(outer)
    expected.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    assert inside == expected
    with executor.sequential():  # the same attribute on every call: one instantiation per function
        assert config_pb2.ConfigProto.FromString(_call_config()).SerializeToString(deterministic=True) == \
            _call_config()


def _branches_model():
    """Three activations of one 36 MiB tensor added: the forward's sum and the gradient's
    sum at the fan-out have three inputs each."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((96, 96, 8))
    stem = keras.layers.Conv2D(8, 1)(inputs)
    added = keras.layers.Add()([keras.layers.Activation(name)(stem) for name in ("relu", "tanh", "sigmoid")])
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 1)(added)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_compiled_step_with_wide_sums_trains_as_plain(parallel, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.random((128, 96, 96, 8), dtype=np.float32)
    y = rng.random((128, 10), dtype=np.float32)
    options = {"batch_size": 128, "epochs": 1, "shuffle": False, "verbose": 0}
    planning = {"cost_model": "flops", "cache": False, "allocator_check": False}
    plain = _branches_model()
    plain.fit(x, y, **options)
    model = _branches_model()
    tfremat.fit(model, "90%", x, y, **planning, **options)
    assert closeness(model.get_weights(), plain.get_weights()).equal
    with monkeypatch.context() as patched:  # as before: the memory optimizer on, the step refused
        patched.setattr(executor, "_without_memory_optimizer", config_pb2.ConfigProto.FromString)
        with pytest.raises(CompileError, match="reference-typed edges"):
            tfremat.fit(_branches_model(), "90%", x, y, **planning, **options)
