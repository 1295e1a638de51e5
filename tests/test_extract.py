"""Extraction of Keras models into the planning graph (needs TensorFlow)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from models import small_convnet, unet  # noqa: E402

from tfremat.applications import build_application, graph_command  # noqa: E402
from tfremat.errors import ExtractionError  # noqa: E402
from tfremat.extract import GradRef, extract  # noqa: E402
from tfremat.graph import load_graph  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _batch(model, batch=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *model.input.shape[1:])).astype("float32")
    y = np.zeros((batch, *model.output.shape[1:]), "float32")
    y[..., 0] = 1
    return x, y


def _by_name(extraction):
    return {entry.name: entry for entry in extraction.side_table.entries}


@pytest.fixture(scope="module")
def convnet_extraction():
    model = small_convnet()
    return extract(model, _batch(model), cost_model="flops", use_cache=False)


def test_small_convnet_node_and_edge_counts(convnet_extraction):
    g = convnet_extraction.graph
    # 12 forward calls, the loss, 12 backward nodes (conv1 owns weights, so all need one).
    assert g.size == 25
    assert len(g.forward_nodes) == 12 and len(g.backward_nodes) == 13
    assert g.loss_node == 12 and g.names[12] == "loss"
    assert len(g.edges) == 37
    assert all(g.forward_of[g.backward_of[f]] == f for f in g.forward_nodes)


def test_backward_dependencies_are_measured_per_layer_type(convnet_extraction):
    e = _by_name(convnet_extraction)
    reads = {name[: -len("_backward")]: (ent.reads_inputs, ent.reads_output) for name, ent in e.items() if ent.kind == "backward"}
    assert reads["conv1"] == ((0,), False)  # a convolution's gradient reads its input
    assert reads["relu1"] == ((), True)  # a ReLU's reads its output
    assert reads["bn1"] == ((0,), False)  # batch norm reads its input ...
    assert e["bn1"].small_residual_bytes > 0 and e["bn1"].residual_bytes == 0  # ... plus per-channel stats
    assert reads["add"] == ((), False) and reads["concat"] == ((), False) and reads["flatten"] == ((), False)
    assert reads["dropout"] == ((), False) and e["dropout"].residual_bytes > 0  # its mask is a residual
    assert reads["head"] == ((0,), True)  # Dense+softmax: input for the kernel, output for softmax
    g = convnet_extraction.graph
    ids = {name: ent.node for name, ent in e.items()}
    assert (ids["conv1"], ids["bn1_backward"]) in g.edges
    assert (ids["relu1"], ids["relu1_backward"]) in g.edges
    assert (ids["dropout"], ids["dropout_backward"]) in g.edges  # residual mask pins the node
    assert (ids["add"], ids["add_backward"]) not in g.edges
    assert (ids["bn1"], ids["bn1_backward"]) not in g.edges  # small stats do not pin the output
    # The forward node's value holds its residuals: output bytes + batch-sized residual bytes.
    assert g.output_bytes[ids["dropout"]] == e["dropout"].output_bytes + e["dropout"].residual_bytes


def test_a_view_of_an_input_that_the_gradient_reads_is_the_input_not_a_residual():
    # Dense on a 3-D input multiplies a Reshape of it; the Reshape shares the input's buffer,
    # so the gradient reads the input and the node keeps no residual of the input's size.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 8))
    hidden = keras.layers.Dense(32, name="dense3d")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(hidden)))
    x = np.zeros((2, 16, 8), "float32")
    y = np.zeros((2, 4), "float32")
    e = _by_name(extract(model, (x, y), cost_model="flops", use_cache=False))
    assert e["dense3d_backward"].reads_inputs == (0,)
    assert e["dense3d"].residual_bytes == 0


def test_side_table_wiring(convnet_extraction):
    e = _by_name(convnet_extraction)
    table = convnet_extraction.side_table
    relu1_grads = e["relu1_backward"].output_grads
    assert set(relu1_grads[0]) == {GradRef(e["conv2_backward"].node, 0), GradRef(e["add_backward"].node, 0)}
    assert e["head_backward"].output_grads == ((GradRef(table.loss_node, 0),),)
    # Every Keras layer gets training=True, as model.fit gives it (a custom block hands it on).
    assert e["bn1"].takes_training and e["conv1"].takes_training and e["dropout"].takes_training
    assert e["conv1"].inputs[0].source == "model_input"
    assert e["conv1_backward"].input_needs_grad == (False,) and e["conv1_backward"].output_bytes == 0
    assert [v.path for v in e["conv1"].trainable_variables] == ["conv1/kernel", "conv1/bias"]
    breakdown = table.fixed_bytes_breakdown
    assert convnet_extraction.graph.fixed_bytes == sum(breakdown.values())
    assert breakdown["params"] > 0 and breakdown["param_grads"] == 0  # transient: in backward workspace
    head = e["head_backward"]
    assert head.workspace_bytes >= sum(int(np.prod(v.shape)) * 4 for v in head.trainable_variables)


def test_extraction_is_deterministic():
    model = small_convnet()
    first = extract(model, _batch(model), cost_model="flops", use_cache=False)
    second = extract(model, _batch(model), cost_model="flops", use_cache=False)
    assert first.graph == second.graph
    assert first.graph.fingerprint == extract(small_convnet(), _batch(model), cost_model="flops", use_cache=False).graph.fingerprint


def test_profile_is_cached_and_leaves_model_state_alone():
    model = small_convnet()
    before = [v.numpy().copy() for v in model.variables]
    first = extract(model, _batch(model), cost_model="profile", repeats=2)
    assert not first.cache_hit and first.profile_seconds > 0
    for old, var in zip(before, model.variables):
        np.testing.assert_array_equal(old, var.numpy())
    second = extract(model, _batch(model), cost_model="profile", repeats=2)
    assert second.cache_hit and second.profile_seconds == 0
    assert second.graph == first.graph
    assert all(c > 0 for c in first.graph.cost)


_MEASURE = r"""
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
import tensorflow as tf
import models
from tfremat.extract import extract
from tfremat.plan import checkpoint_all_s, schedule_from_keep_matrix, simulate
from tfremat.static_graph import compile_step, measure_step_peak
model = getattr(models, {name!r})()
rng = np.random.default_rng(0)
x = rng.standard_normal((8, *model.input.shape[1:])).astype("float32")
y = np.zeros((8, *model.output.shape[1:]), "float32"); y[..., 0] = 1
ex = extract(model, (x, y), cost_model="profile", repeats=2, use_cache=False)
g = ex.graph
schedule = schedule_from_keep_matrix(g, checkpoint_all_s(g), "checkpoint_all")
pred = simulate(g, schedule).peak_bytes
step = compile_step(ex, schedule)
resident = list(model.variables) + list(ex.side_table.optimizer.variables)
meas = measure_step_peak(step, tf.constant(x), tf.constant(y), resident, count="requested")
print(json.dumps({{"predicted": int(pred), "measured": int(meas)}}))
"""


@pytest.mark.parametrize("name", ["small_convnet", "unet"])
def test_checkpoint_all_prediction_matches_measured_peak(name):
    """The prediction describes tfremat's compiled step (what a budget governs), under
    whatever kernels this machine's TensorFlow runs (oneDNN on or off)."""
    # A fresh process: the allocator must be BFC and ops must run one at a time
    # (TF_NUM_INTEROP_THREADS=1), the sequential execution the simulator models. The step
    # is measured as the bytes its operations request, what the workspace is measured as
    # (the allocator's peak adds chunk rounding that depends on the process's history).
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(here=HERE, name=name)], env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Never above the prediction (2% for allocations the graph does not model: shapes,
    # scalars, oneDNN's max-pooling workspace), and not far below it (a conservative
    # prediction wastes the user's budget). The known conservatism: a layer whose output
    # is a view of its input (Flatten's Reshape shares Dropout's buffer) is counted as a
    # second buffer, 1 MiB of small_convnet's peak under oneDNN (0.873x).
    assert result["measured"] <= 1.02 * result["predicted"], result
    assert result["measured"] >= 0.85 * result["predicted"], result


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "vgg16", "unet"])
def test_large_models_extract_with_profiled_costs(name, tmp_path):
    """Every layer of the applications gets a backward node and profiled costs. How long
    that takes is measured in benchmarks/extraction.py ("extract s"): a wall-time bound
    here (30 s, 7.5 s quiet for ResNet50) failed at 78 s and 92 s on a loaded 2-core machine."""
    model = unet(input_shape=(64, 64, 3), depth=4) if name == "unet" else build_application(name, (64, 64, 3), num_classes=10)
    spec = [tf.TensorSpec((2, *model.input.shape[1:]), "float32")]
    extraction = extract(model, input_signature=spec, cost_model="profile", repeats=2)
    g = extraction.graph
    assert all(cost >= 0 for cost in g.cost) and sum(g.cost) > 0
    table = extraction.side_table
    for f in g.forward_nodes:  # every layer with weights, and everything after the first, has a VJP
        assert table[f].backward_node is not None or not table[f].trainable_variables
    assert len(g.backward_nodes) >= len(g.forward_nodes) - 1
    assert g.names[g.loss_node] == "loss"


def test_nested_models_are_flattened_and_shared_layers_supported():
    inner = keras.Sequential([keras.layers.Dense(8, activation="relu", name="inner_a"), keras.layers.Dense(8, name="inner_b")], name="inner")
    shared = keras.layers.Dense(8, name="shared")
    x = keras.Input((4,))
    h = shared(keras.layers.Dense(8, name="first")(x))
    h = shared(inner(h))
    model = keras.Model(x, keras.layers.Dense(3, name="out")(h))
    x_batch = np.ones((2, 4), "float32")
    ex = extract(model, (x_batch, np.ones((2, 3), "float32")), cost_model="flops", use_cache=False)
    names = [ex.graph.names[i] for i in ex.graph.forward_nodes]
    assert names == ["first", "shared", "inner/inner_a", "inner/inner_b", "shared#1", "out"]
    e = _by_name(ex)
    assert e["shared"].layer is e["shared#1"].layer


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


class _Counting(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return x * 2.0


def test_errors_name_the_layer_and_the_fix():
    sub = _Subclassed()
    sub(np.ones((1, 3), "float32"))
    # Wrapped from a sample batch (tests/test_subclassed.py); without one there are no shapes.
    with pytest.raises(ExtractionError, match="subclassed model without a functional graph.*plan it on your data"):
        extract(sub, batch_size=2)

    x = keras.Input((None, None, 3))
    dynamic = keras.Model(x, keras.layers.Conv2D(2, 3, name="conv")(x))
    with pytest.raises(ExtractionError, match="static shapes"):
        extract(dynamic, batch_size=2)

    x = keras.Input((5, 3), batch_size=2)
    rnn = keras.Model(x, keras.layers.LSTM(4, stateful=True, name="lstm")(x))
    with pytest.raises(ExtractionError, match="stateful") as info:
        extract(rnn, (np.ones((2, 5, 3), "float32"), np.ones((2, 4), "float32")), cost_model="flops")
    assert info.value.layer == "lstm"

    x = keras.Input((3,))
    counting = keras.Model(x, keras.layers.Dense(2)(_Counting(name="counter")(x)))
    with pytest.raises(ExtractionError, match="side effect") as info:
        extract(counting, (np.ones((2, 3), "float32"), np.ones((2, 2), "float32")), cost_model="flops", use_cache=False)
    assert info.value.layer == "counter"

    with pytest.raises(ExtractionError, match="Keras Applications name"):
        build_application("resnet_9000", (32, 32, 3))
    model = small_convnet()
    with pytest.raises(ExtractionError, match="cost_model"):
        extract(model, _batch(model), cost_model="guess")


def test_graph_command_writes_planning_json(tmp_path):
    out = tmp_path / "g.json"
    summary = graph_command(unet(), (32, 32, 3), 2, "flops", str(out))
    graph = load_graph(str(out))
    assert summary["nodes"] == graph.size == 25
    assert summary["checkpoint_all_peak_bytes"] > graph.fixed_bytes
    json.dumps(summary)

    # Labels were shaped like the outputs, which a sparse loss refuses with a rank error.
    sparse = graph_command(unet(), (32, 32, 3), 2, "flops", str(tmp_path / "s.json"), loss="sparse_categorical_crossentropy")
    assert sparse["nodes"] == graph.size


@pytest.mark.parametrize("optimizer, shared, lifetime", [
    (lambda: keras.optimizers.SGD(0.01), False, "transient"),
    (lambda: keras.optimizers.Adam(0.01), False, "transient"),
    (lambda: keras.optimizers.SGD(0.01, clipnorm=1.0), False, "fixed"),
    (lambda: keras.optimizers.SGD(0.01, global_clipnorm=1.0), False, "fixed"),
    (lambda: keras.optimizers.SGD(0.01, clipvalue=1.0), False, "fixed"),
    (lambda: keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), False, "fixed"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), False, "fixed"),
    (lambda: keras.optimizers.SGD(0.01), True, "fixed"),
])
def test_weight_gradients_are_resident_when_the_optimizer_or_a_shared_layer_needs_them(optimizer, shared, lifetime):
    """With clipping, accumulation or a loss scale a step planned on transient weight
    gradients overruns its budget (tfremat.extract.assembly.weight_gradient_lifetime)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    dense = keras.layers.Dense(8, activation="relu")
    hidden = dense(dense(inputs)) if shared else keras.layers.Dense(8, activation="relu")(dense(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    x = np.zeros((4, 8), "float32")
    extraction = extract(model, (x, np.zeros((4, 2), "float32")), loss="mse", optimizer=optimizer(), cost_model="flops")
    assert extraction.side_table.weight_grads == lifetime
    # Held from their backward nodes to the end of the step (DFGraph.weight_grads_to_end).
    assert extraction.graph.weight_grads_to_end == (lifetime == "fixed")
    assert (extraction.graph.weight_grads_to_end_bytes > 0) == (lifetime == "fixed")


def _scaling_model(layer_class):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(2)(layer_class()(keras.layers.Dense(8)(inputs))))


def test_profile_cache_sees_edits_of_user_code_and_survives_damage():
    """The cache key held a user layer's class name and config and a loss function's name
    only: an edited call() or loss reused the old measurements (15x too small in the audit's
    case). A damaged entry crashed the extraction instead of being measured again."""
    class Scale(keras.layers.Layer):
        def call(self, x):
            return x * 2.0

    first_scale = Scale

    class Scale(keras.layers.Layer):  # noqa: F811 -- the same name, edited
        def call(self, x):
            return x * 3.0

    batch = (np.zeros((4, 8), "float32"), np.zeros((4, 2), "float32"))
    mse = lambda y_true, y_pred: keras.ops.mean((y_true - y_pred) ** 2)  # noqa: E731
    mae = lambda y_true, y_pred: keras.ops.mean(abs(y_true - y_pred))  # noqa: E731
    assert not extract(_scaling_model(first_scale), batch, loss=mse, cost_model="flops").cache_hit
    assert extract(_scaling_model(first_scale), batch, loss=mse, cost_model="flops").cache_hit
    assert not extract(_scaling_model(Scale), batch, loss=mse, cost_model="flops").cache_hit
    assert not extract(_scaling_model(Scale), batch, loss=mae, cost_model="flops").cache_hit
    entries = [os.path.join(os.environ["TFREMAT_CACHE_DIR"], name) for name in os.listdir(os.environ["TFREMAT_CACHE_DIR"])]
    for garbage in ("{not json", "[]", '{"calls": [], "loss": {}}'):
        for path in entries:
            with open(path, "w") as f:
                f.write(garbage)
        assert not extract(_scaling_model(Scale), batch, loss=mae, cost_model="flops").cache_hit
    assert extract(_scaling_model(Scale), batch, loss=mae, cost_model="flops").cache_hit


def _checkpoint_all_peaks(model, x, y):
    """Predicted and requested peak bytes of ``model``'s compiled checkpoint-all step (SGD,
    freshly profiled)."""
    from tfremat.plan.simulator import simulate
    from tfremat.static_graph import compile_step, measure_step_peak
    from tfremat.strategies import get_strategy

    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1, use_cache=False)
    schedule = get_strategy("checkpoint_all")(extraction.graph)
    predicted = simulate(extraction.graph, schedule).peak_bytes
    step = compile_step(extraction, schedule)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    return predicted, requested


def _stacked_lstm(seq=32, features=8, units=32):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, features))
    hidden = keras.layers.LSTM(units, return_sequences=True, name="lstm_a")(inputs)
    hidden = keras.layers.LSTM(units, name="lstm_b")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="head")(hidden))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, seq, features)).astype("float32"))
    y = tf.constant(np.eye(3, dtype="float32")[rng.integers(0, 3, 8)])
    return model, x, y


def test_while_loop_accumulators_are_the_forward_nodes_residuals():
    """An RNN with unroll=False keeps its per-step intermediates in TensorList (variant,
    shape ()) accumulators, which were counted as 0 bytes: no forward -> backward edge, so
    the planner freed the LSTM's activations long before the tape did, and the flops cost
    model counted the loop body once (0.83 Mflop of ~42 for four LSTM(64))."""
    seq, units, batch = 32, 32, 8
    model, x, y = _stacked_lstm(seq=seq, units=units)
    extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
    graph, entries = extraction.graph, _by_name(extraction)
    for name in ("lstm_a", "lstm_b"):
        forward = entries[name]
        # At least the new cell state and hidden output of every step (batch x units floats each).
        assert forward.residual_bytes >= 2 * seq * batch * units * 4, (name, forward.residual_bytes)
        assert (forward.node, forward.backward_node) in set(graph.edges)
        assert graph.output_bytes[forward.node] == forward.output_bytes + forward.residual_bytes
    # lstm_b's recurrent matmul alone is 2 * batch * units * 4 units flops per step.
    assert graph.cost[entries["lstm_b"].node] >= seq * 2 * batch * units * 4 * units
    assert graph.cost[entries["lstm_b_backward"].node] >= graph.cost[entries["lstm_b"].node]


def test_while_loop_step_requests_what_the_graph_predicts():
    """Four stacked LSTM(64) requested 2.25x their checkpoint-all prediction: the
    accumulators were counted as 0 bytes, and the step recorded each loop on a persistent
    tape and asked it for gradients twice (two backward loops, each keeping every
    iteration's intermediates for higher-order gradients). On this small model the
    workspace measured that way also swamped the missing residuals, and the step requested
    0.64x or 1.29x the prediction depending on the process."""
    model, x, y = _stacked_lstm()
    predicted, requested = _checkpoint_all_peaks(model, x, y)
    assert requested <= 1.06 * predicted, (requested, predicted)
    assert requested >= 0.85 * predicted, (requested, predicted)


def test_an_add_backward_value_is_one_gradient_buffer():
    """An Add's input gradients are one tensor, its upstream gradient: the graph counted
    one buffer per input, so a schedule that freed the add's backward value (keeping the
    upstream gradient) was credited memory TensorFlow never freed, and the repair
    strategy's step on a ResNet-style net requested 3 MiB more than its budget."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    left, right = keras.layers.Dense(64)(inputs), keras.layers.Dense(64)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(keras.layers.Add(name="add")([left, right])))
    x = np.zeros((32, 64), "float32")
    y = np.eye(4, dtype="float32")[np.zeros(32, int)]
    graph = extract(model, (x, y), cost_model="flops", use_cache=False).graph
    add_backward = graph.names.index("add_backward")
    assert graph.output_bytes[add_backward] == 32 * 64 * 4


def test_workspace_is_requested_bytes_not_allocator_chunks():
    """A convolution's gradient requests a scratch buffer of about 32 MiB on CPU, and the
    BFC allocator hands out a free chunk whole when it is under twice the request: with a
    60 MiB chunk free (what the profiling process's earlier allocations had left), the
    allocator's peak counted it whole, the workspace came out about 28 MiB too large and a
    U-Net's step (64x64, batch 4) requested 0.59x its checkpoint-all prediction (47.3
    against 79.6 MiB; no budget under 74.3 MiB was accepted). The workspace is now the
    peak of the bytes the operations request."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64, 64, 48))
    hidden = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv")(inputs)
    model = keras.Model(inputs, keras.layers.Conv2D(2, 1, activation="softmax", name="head")(hidden))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((4, 64, 64, 48)).astype("float32"))
    y = tf.constant(np.eye(2, dtype="float32")[rng.integers(0, 2, (4, 64, 64))])
    # A free 60 MiB chunk: what earlier allocations of a process leave behind.
    free_chunk = tf.zeros((60 * 2**20 // 4,), "float32") + 1.0
    del free_chunk
    predicted, requested = _checkpoint_all_peaks(model, x, y)
    assert requested <= 1.05 * predicted, (requested, predicted)
    # 0.59 with the bug; 0.85-0.86 since (the conv scratch varies with the kernel chosen), so
    # the floor sits between them.
    assert requested >= 0.75 * predicted, (requested, predicted)


class _NoConfigBlock(keras.layers.Layer):
    """A residual Dense block whose ``get_config`` raises, as a keras-hub decoder block's did."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x):
        return x + self.dense(x)

    def get_config(self):
        raise AttributeError("'_NoConfigBlock' object has no attribute '_config'")


def test_a_layer_whose_get_config_raises_is_fingerprinted_by_its_state(tmp_path, monkeypatch):
    """The profile cache's key read ``get_config`` and caught only NotImplementedError:
    extraction crashed with the layer's AttributeError."""
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))

    def build(units):
        keras.utils.set_random_seed(0)
        x = keras.Input((units,))
        return keras.Model(x, keras.layers.Dense(3, activation="softmax")(_NoConfigBlock(units)(x)))

    batch = (np.ones((4, 8), "float32"), np.eye(3, dtype="float32")[[0, 1, 2, 0]])
    first = extract(build(8), batch, cost_model="profile", repeats=1)
    again = extract(build(8), batch, cost_model="profile", repeats=1)
    assert not first.cache_hit and again.cache_hit
    wider = extract(build(16), (np.ones((4, 16), "float32"), batch[1]), cost_model="profile", repeats=1)
    assert not wider.cache_hit
