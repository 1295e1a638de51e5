"""A step whose optimizer update calls functions runs its plan on the single-threaded
executor and the update apart (user_check_3 finding 5, issue 33).

Under ``mixed_float16`` Keras wraps the optimizer in a ``LossScaleOptimizer``, whose update
holds a ``tf.cond`` on finite gradients, which TensorFlow's single-threaded executor can wait
on for ever (:mod:`tfremat.runtime.executor`). The whole step then ran on the default
executor, where a statement's operations overlapped with several inter-op threads and the
step requested more than its prediction. Now the plan's forward and backward pass is one
call on the single-threaded executor returning the gradients, and the update a second call
on the default one (:attr:`tfremat.static_graph.CompiledStep.update_apart`).

The test process has one inter-op thread (:mod:`conftest`); the ``parallel`` fixture makes
the library act as with several. The memory test runs in a subprocess with TensorFlow's
default threads.
"""

import logging
import os
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfremat
from subprocess_result import run_script
from tfremat.extract import extract
from tfremat.runtime import executor
from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR
from tfremat.static_graph import compile_step
from tfremat.strategies import get_strategy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Dense(32, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax", dtype="float32")(hidden))


@pytest.fixture
def mixed_float16():
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy(previous)


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.random((n, 16)).astype("float32")
    return x, np.eye(3, dtype="float32")[rng.integers(0, 3, n)]


def test_a_loss_scaled_step_runs_its_plan_sequentially_and_its_update_apart(parallel, mixed_float16):
    model = _mlp()
    x, y = (tf.constant(a[:8]) for a in _data())
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    assert extraction.side_table.weight_grads == "fixed"
    step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph), optimizer=optimizer)
    assert np.isfinite(float(step(x, y)))
    assert step.sequential and step.update_apart
    planned = step.function.get_concrete_function(x, y)
    assert planned.function_def.attr["_noinline"].b and not executor.calls_functions(planned.graph)

    executors, function = [], step.function

    def recorded(*args):
        executors.append(context.context().function_call_options.executor_type)
        return function(*args)

    step.function = recorded
    iterations = int(optimizer.iterations)
    assert np.isfinite(float(step(x, y)))
    assert executors == [SEQUENTIAL_EXECUTOR]
    assert int(optimizer.iterations) == iterations + 1  # the update ran, apart


def test_an_optimizer_without_function_calls_keeps_one_call(parallel, mixed_float16):
    """float32 weights with a plain optimizer: one call, as before."""
    keras.mixed_precision.set_global_policy("float32")
    model = _mlp()
    x, y = (tf.constant(a[:8]) for a in _data())
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph), optimizer=optimizer)
    assert np.isfinite(float(step(x, y)))
    assert step.sequential and not step.update_apart


def test_fit_under_mixed_float16_trains_bitwise_like_keras_and_skips_overflowing_steps(parallel, mixed_float16,
                                                                                       caplog):
    """Weights, losses, the loss scale and the iteration count equal plain Keras's, over a
    batch whose float16 activations overflow (Keras skips that update and halves the scale)."""
    x, y = _data()
    x[8:16] = 1e5  # over float16's largest value: infinite activations, non-finite gradients

    def train(fit):
        model = _mlp()
        model.compile(keras.optimizers.SGD(0.1), "categorical_crossentropy")
        keras.utils.set_random_seed(1)
        history = fit(model)
        return model, history.history

    plain, expected = train(lambda m: m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0))
    with caplog.at_level(logging.INFO, logger="tfremat.static_graph.compile"):
        remat, history = train(lambda m: tfremat.fit(m, "100%", x, y, batch_size=8, epochs=2, shuffle=False,
                                                     strategy="chen_sqrtn", cost_model="flops", verbose=0,
                                                     allocator_check=False))
    assert any("optimizer update as a call of its own" in r.getMessage() for r in caplog.records)
    assert all((a == b).all() for a, b in zip(remat.get_weights(), plain.get_weights()))
    np.testing.assert_equal(history, expected)
    for name in ("dynamic_scale", "step_counter", "iterations"):
        assert float(getattr(remat.optimizer, name)) == float(getattr(plain.optimizer, name)), name
    # Two overflowing batches of eight: two skipped updates, each halving the scale.
    assert float(plain.optimizer.dynamic_scale) == 2.0**15 / 4
    assert int(plain.optimizer.iterations) == 8 - 2


_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_NUM_INTEROP_THREADS"] = "0"  # TensorFlow's default: one per core
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.path[:0] = [{tests!r}, {root!r}]
    import keras, tensorflow as tf
    from models import small_convnet
    from training_case import training_batch
    from tfremat.extract import extract
    from tfremat.plan.simulator import simulate
    from tfremat.runtime.memory import measure_step_peak
    from tfremat.static_graph import compile_step
    from tfremat.strategies import get_strategy

    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = small_convnet(input_shape=(32, 32, 3), channels=16)
    x, y = training_batch(model, 8)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1)
    found = {{"inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads()}}
    for strategy in ("checkpoint_all", "chen_sqrtn"):
        schedule = get_strategy(strategy)(extraction.graph)
        step = compile_step(extraction, schedule, optimizer=optimizer)
        requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                      count="requested")
        found[strategy] = dict(predicted=simulate(extraction.graph, schedule).peak_bytes, requested=requested,
                               sequential=step.sequential, apart=step.update_apart)
    print("RESULT", json.dumps(found))
    """
)


def test_a_mixed_float16_step_requests_no_more_than_its_prediction_with_default_threads(tmp_path):
    found = run_script(tmp_path / "mixed_step.py", _SCRIPT.format(tests=HERE, root=ROOT), timeout=900)
    assert found.pop("inter_op_threads") != 1
    for strategy, row in found.items():
        assert row["sequential"] and row["apart"], (strategy, row)
        # A few KiB for the update's scalars (the loss scale, the finite check).
        assert row["requested"] <= row["predicted"] + 8 * 1024, (strategy, row)
