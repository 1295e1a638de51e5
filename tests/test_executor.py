"""The compiled step runs on TensorFlow's single-threaded executor (issue 33).

The memory model counts one operation at a time; TensorFlow's default executor runs a
statement's independent operations together on its inter-op threads. The tests check the
mechanism (:mod:`tfremat.runtime.executor`) by its effect, two sleeping operations that
overlap or not, in a subprocess with four inter-op threads and two logical CPUs (the
test process has one inter-op thread, :mod:`conftest`), and each way a step is called by
its structure: the executor type the call is made with, and the call kept out of its
caller's graph.
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
from tfremat.errors import CompileError
from tfremat.extract import extract
from tfremat.runtime import executor
from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR
from tfremat.static_graph import compile_step
from tfremat.strategies import get_strategy

from subprocess_result import run_script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys, threading, time
    os.environ["TF_NUM_INTEROP_THREADS"] = "4"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.path[:0] = [{tests!r}, {root!r}]
    import numpy as np, tensorflow as tf, keras
    from tensorflow.python.eager import context
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from tfremat.runtime.executor import NOT_INLINED, sequential

    spans = []

    def nap(device):
        def run(x):
            start = time.perf_counter()
            time.sleep(0.5)
            spans.append((device, start, time.perf_counter()))
            return x
        return run

    def overlaps():
        # Per device: whether two of its operations ran at the same time.
        found = {{}}
        for device in sorted({{d for d, _, _ in spans}}):
            mine = sorted((s, e) for d, s, e in spans if d == device)
            found[device] = any(b[0] < a[1] for a, b in zip(mine, mine[1:]))
        spans.clear()
        return found

    def two_naps(x, devices=("/cpu:0",)):
        # Stateless, so that no automatic control dependency orders them.
        outputs = []
        for device in devices:
            with tf.device(device):
                outputs.append(tf.numpy_function(nap(device), [x], tf.float32, stateful=False)
                               + tf.numpy_function(nap(device), [x + 1.0], tf.float32, stateful=False))
        return tf.add_n(outputs)

    inlined = tf.function(two_naps, autograph=False)
    kept = tf.function(two_naps, autograph=False, experimental_attributes=NOT_INLINED)

    def caller(inner):
        @tf.function(autograph=False)
        def outer(x):
            with sequential():
                result = inner(x)
            return result + 1.0
        return outer

    both = tf.function(lambda x: two_naps(x, ("/cpu:0", "/cpu:1")), autograph=False)
    x = tf.ones(())
    found = {{}}
    inlined(x)
    found["default"] = overlaps()
    with sequential():
        inlined(x)
    found["sequential"] = overlaps()
    caller(inlined)(x)
    found["nested_inlined"] = overlaps()
    caller(kept)(x)
    found["nested_kept"] = overlaps()
    with sequential():
        both(x)
    found["two_devices"] = overlaps()

    # A step under MirroredStrategy on the two devices, run by DistributedTrainStep.
    from models import small_convnet
    from tfremat.extract import extract
    from tfremat.static_graph import compile_step
    from tfremat.static_graph.train_step import DistributedTrainStep
    from tfremat.strategies import get_strategy
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("tfremat").addHandler(handler)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = small_convnet(input_shape=(16, 16, 3), channels=8)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy")
        model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((8, 16, 16, 3)).astype("float32")
    ys = np.eye(10, dtype="float32")[rng.integers(0, 10, 8)]
    ex = extract(model, (xs[:4], ys[:4]), optimizer=model.optimizer, cost_model="flops", use_cache=False,
                 weight_grads="fixed")
    step = compile_step(ex, get_strategy("chen_sqrtn")(ex.graph), strategy=strategy, return_outputs=True)
    train = DistributedTrainStep(model, step)
    executors = []
    function = train.function
    def recorded(*args):
        executors.append(context.context().function_call_options.executor_type)
        return function(*args)
    train.function = recorded
    batch = next(iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((xs, ys)))))
    logs = train(*batch)
    kept_out = function.get_concrete_function(*batch).function_def.attr["_noinline"].b
    found["distributed"] = dict(executors=executors, kept_out=kept_out, loss=float(logs["loss"]),
                                warned=[w for w in warnings if "default executor" in w])
    print("RESULT", json.dumps(found))
    """
)


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    """What :data:`_SCRIPT` found with four inter-op threads on two logical CPUs."""
    folder = tmp_path_factory.mktemp("executor")
    return run_script(folder / "executor.py", _SCRIPT.format(tests=HERE, root=ROOT), timeout=300,
                      default_threads=False, TFREMAT_CACHE_DIR=str(folder / "cache"))


def test_sequential_runs_one_operation_at_a_time(found):
    # The control: TensorFlow's default executor runs the two operations together.
    assert found["default"] == {"/cpu:0": True}
    assert found["sequential"] == {"/cpu:0": False}


def test_a_traced_call_keeps_to_the_executor_only_when_not_inlined(found):
    """TensorFlow inlines a called function into its caller, whose executor then runs it:
    the executor type of the call op alone does nothing, hence ``NOT_INLINED``."""
    assert found["nested_inlined"] == {"/cpu:0": True}
    assert found["nested_kept"] == {"/cpu:0": False}


def test_each_device_of_a_multi_device_function_runs_one_operation_at_a_time(found):
    assert found["two_devices"] == {"/cpu:0": False, "/cpu:1": False}


def test_replicas_that_exchange_values_keep_the_default_executor_and_say_so(found):
    """On the single-threaded executor a MirroredStrategy train step on two CPUs hung (each
    device's part waits in its own order for what the other sends): the step keeps the
    default executor and a warning names why."""
    distributed = found["distributed"]
    assert distributed["executors"] in ([""], [None])
    assert not distributed["kept_out"]
    assert np.isfinite(distributed["loss"])
    [warning] = distributed["warned"]
    assert "2 replicas exchange values" in warning and "predicted peak" in warning


def _small_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    hidden = inputs
    for _ in range(4):
        hidden = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(hidden)))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _batch():
    rng = np.random.default_rng(0)
    return tf.constant(rng.standard_normal((4, 8, 8, 3)), tf.float32), tf.constant(rng.standard_normal((4, 2)),
                                                                                 tf.float32)


def _step(model, x, y, **options):
    extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
    return compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph), **options)


def _recording(step):
    """Replaces ``step.function`` by one that records the executor type it is called with."""
    executors = []
    function = step.function

    def recorded(*args):
        executors.append(context.context().function_call_options.executor_type)
        return function(*args)

    step.function = recorded
    return executors, function


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_called_step_runs_on_the_sequential_executor(jit_compile, parallel):
    model = _small_model()
    x, y = _batch()
    step = _step(model, x, y, jit_compile=jit_compile)
    step(x, y)  # checks, once, that the step calls no function (executor.calls_functions)
    executors, function = _recording(step)
    assert np.isfinite(float(step(x, y)))
    assert executors == [SEQUENTIAL_EXECUTOR]
    assert function.get_concrete_function(x, y).function_def.attr["_noinline"].b


def test_sequential_false_runs_on_the_default_executor(parallel, caplog):
    model = _small_model()
    x, y = _batch()
    with caplog.at_level(logging.WARNING, logger="tfremat.static_graph.compile"):
        step = _step(model, x, y, sequential=False)
    assert any("sequential=False" in r.message for r in caplog.records)
    executors, function = _recording(step)
    step(x, y)
    assert executors in ([""], [None])
    assert not function.get_concrete_function(x, y).function_def.attr["_noinline"].b
    with pytest.raises(CompileError, match="sequential must be True or False"):
        _step(model, x, y, sequential="yes")


def test_one_inter_op_thread_keeps_the_default_executor():
    model = _small_model()
    x, y = _batch()
    step = _step(model, x, y)
    executors, _ = _recording(step)
    step(x, y)
    assert not step.sequential and executors in ([""], [None])


def test_a_refusal_of_the_executor_says_what_to_do(parallel):
    model = _small_model()
    x, y = _batch()
    step = _step(model, x, y)
    step(x, y)

    def refused(*args):
        raise tf.errors.FailedPreconditionError(None, None, "Single-threaded executor does not support switch op, "
                                                "but saw node cond/Switch")

    step.function = refused
    with pytest.raises(CompileError, match=r"refused the compiled step .*switch op.*sequential=False"):
        step(x, y)


def _call_ops(graph):
    """``(executor type, whether the callee is kept out of its caller)`` of every function
    call in ``graph`` and the functions it calls."""
    definition = graph.as_graph_def()
    functions = {f.signature.name: f for f in definition.library.function}
    nodes = [*definition.node, *(node for f in definition.library.function for node in f.node_def)]
    return sorted((node.attr["executor_type"].s.decode(), functions[node.attr["f"].func.name].attr["_noinline"].b)
                  for node in nodes if node.op in ("PartitionedCall", "StatefulPartitionedCall"))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_value_and_grad_traced_into_a_loop_and_a_train_step_stays_a_sequential_call(jit_compile, parallel):
    """``g`` called in a ``tf.function`` and in a model's ``train_step`` (traced by Keras's
    train function, with XLA when the model compiles with it) is one call on the
    single-threaded executor, kept out of its caller."""
    model = _small_model()
    x, y = _batch()
    mse = keras.losses.MeanSquaredError()
    g = tfremat.value_and_grad(lambda a, b: mse(b, model(a, training=True)), "80%", x, y, cost_model="flops",
                               cache=False, verbose=0, jit_compile=jit_compile, allocator_check=False)

    @tf.function(autograph=False, jit_compile=jit_compile)
    def loop(a, b):
        return g(a, b)[0]

    assert np.isfinite(float(loop(x, y)))
    assert _call_ops(loop.get_concrete_function(x, y).graph) == [(SEQUENTIAL_EXECUTOR, True)]

    graphs = []

    class Trained(keras.Model):
        def train_step(self, data):
            a, b = data
            loss, gradients = g(a, b)
            graphs.append(tf.compat.v1.get_default_graph())
            self.optimizer.apply_gradients(zip(gradients, g.trainable_variables))
            return {"loss": loss}

    trained = Trained(model.inputs, model.outputs)
    trained.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=jit_compile)
    history = trained.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert graphs and all(_call_ops(graph) == [(SEQUENTIAL_EXECUTOR, True)] for graph in graphs)


def test_functions_that_call_functions_are_found():
    """The single-threaded executor waits on its own thread for a function an operation
    calls; with one inter-op thread nothing runs the callee (a tf.cond, a call kept out of
    its caller, a loop whose body calls one hung), so those keep the default executor. A
    loop alone runs on it."""
    assert executor.sequential_ops()
    x = tf.constant(1.0)
    kept = tf.function(lambda a: a * 2.0, autograph=False, experimental_attributes=executor.NOT_INLINED)
    functions = {
        "cond": lambda a: tf.cond(a > 0, lambda: a * 2.0, lambda: a * 3.0),
        "call": lambda a: kept(a) + 1.0,
        "loop_of_cond": lambda a: tf.while_loop(
            lambda i, b: i < 3, lambda i, b: (i + 1, tf.cond(b > 0, lambda: b * 2.0, lambda: b)), (0, a))[1],
        "loop": lambda a: tf.while_loop(lambda i, b: i < 3, lambda i, b: (i + 1, b * 2.0), (0, a))[1],
        "plain": lambda a: a * 2.0 + 1.0,
    }
    blocking = {}
    for name, body in functions.items():
        function = tf.function(body, autograph=False)
        with executor.sequential():
            graph = function.get_concrete_function(x).graph
        blocking[name] = executor.calls_functions(graph)
        if not blocking[name]:
            with executor.sequential():
                assert np.isfinite(float(function(x)))
    assert blocking == {"cond": True, "call": True, "loop_of_cond": True, "loop": False, "plain": False}


def test_a_loss_scaled_step_runs_on_the_default_executor(parallel):
    """A LossScaleOptimizer's update holds a tf.cond: its probe and the step run on the
    default executor (on the single-threaded one they hung, with one inter-op thread and
    with two on two cores)."""
    model = _small_model()
    x, y = _batch()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph), optimizer=optimizer)
    assert np.isfinite(float(step(x, y)))
    assert step._calls_functions and not step.sequential  # traced again, for the default executor
