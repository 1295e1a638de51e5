"""The compiled step under XLA (``compile_step(..., jit_compile=True)``, issue 37).

An XLA-compiled schedule trains like plain Keras training compiled with XLA (the closeness
rule of :mod:`tfremat.numerics`, on every variable: weights, batch-norm statistics and
dropout seed states) on a conv net with batch norm and dropout and on a small transformer;
its recomputations survive XLA's common-subexpression elimination (the optimized HLO holds
more convolutions than checkpoint-all's) and lower the peak XLA's buffers reach (measured by
the allocator, which serves XLA's buffers on CPU).
"""

import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from models import residual_chain, small_convnet  # noqa: E402
from training_case import training_batch  # noqa: E402

from tfremat.errors import ArgumentError, CompileError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.registry import parse_graph_budget  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

STEPS = 3
# Bytes the simulator does not model (small allocations: shapes, scalars, XLA's tuples).
SLACK_BYTES = 2 * 2**20


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def small_transformer(tokens=16, width=32, heads=2, vocab=64, classes=10, blocks=2, seed=0):
    """Token embedding, post-norm attention blocks with attention and residual dropout, a
    GELU feed-forward, average pooling and a softmax head."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    ids = keras.Input((tokens,), dtype="int32", name="ids")
    h = layers.Embedding(vocab, width, name="embed")(ids)
    for b in range(blocks):
        attended = layers.MultiHeadAttention(heads, width // heads, dropout=0.1, seed=b, name=f"b{b}_mha")(h, h)
        attended = layers.Dropout(0.1, seed=10 + b, name=f"b{b}_drop")(attended)
        h = layers.LayerNormalization(name=f"b{b}_norm1")(layers.Add(name=f"b{b}_add1")([h, attended]))
        f = layers.Dense(2 * width, activation="gelu", name=f"b{b}_up")(h)
        f = layers.Dense(width, name=f"b{b}_down")(f)
        h = layers.LayerNormalization(name=f"b{b}_norm2")(layers.Add(name=f"b{b}_add2")([h, f]))
    pooled = layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, layers.Dense(classes, activation="softmax", name="head")(pooled), name="small_transformer")


def _token_batches(model, batch, count):
    tokens = model.input.shape[1]
    batches = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, 64, size=(batch, tokens)).astype("int32")
        y = np.eye(10, dtype="float32")[rng.integers(0, 10, batch)]
        batches.append((tf.constant(ids), tf.constant(y)))
    return batches


def _case(name):
    if name == "convnet":
        model = small_convnet(input_shape=(16, 16, 3), channels=8)
        batches = [training_batch(model, 8, seed) for seed in range(STEPS)]
    else:
        model = small_transformer(blocks=1)
        batches = _token_batches(model, 8, STEPS)
    return model, batches


def _optimizer(model):
    optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)
    optimizer.build(model.trainable_variables)
    return optimizer


def _plain_xla_step(model, loss_fn, optimizer):
    """Keras's train step as ``model.fit`` runs it with ``jit_compile=True``."""

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn([y], [model(x, training=True)])
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return step


def _recomputing_schedule(graph):
    schedule = get_strategy("chen_sqrtn")(graph)
    assert schedule.recompute_count > 0
    return schedule


@pytest.mark.parametrize("name", ["convnet", "transformer"])
def test_xla_step_trains_like_plain_xla_training(name):
    model, batches = _case(name)
    extraction = extract(model, batches[0], cost_model="flops", use_cache=False)
    schedule = _recomputing_schedule(extraction.graph)
    graph = extraction.graph
    recomputed = {graph.names[i] for i in graph.forward_nodes if schedule.R[:, i].sum() > 1}
    initial = [v.numpy() for v in model.variables]

    plain = _plain_xla_step(model, extraction.side_table.loss_fn, _optimizer(model))
    plain_losses = [float(plain(x, y)) for x, y in batches]
    plain_state = [v.numpy() for v in model.variables]
    for variable, value in zip(model.variables, initial):
        variable.assign(value)

    step = compile_step(extraction, schedule, optimizer=_optimizer(model), jit_compile=True)
    losses = [float(step(x, y)) for x, y in batches]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-4)
    close = closeness([v.numpy() for v in model.variables], plain_state)
    assert close.equal, (name, model.variables[close.worst_tensor].path, close, sorted(recomputed))
    assert step.report.recomputed_layer_calls > 0


def _recomputed_convolutions(step, x, y) -> int:
    """Convolutions of the optimized HLO that come from a recompute statement (its name
    scope is ``step/reforward_N``): XLA's CSE keeps the first computation's name when it merges."""
    hlo = step.function.experimental_get_compiler_ir(x, y, None)(stage="optimized_hlo")
    return len(re.findall(r"\bconvolution\(.*op_name=\"step/reforward_", hlo))


def test_recomputations_survive_xla_and_lower_its_peak():
    model = residual_chain(input_shape=(32, 32, 3), blocks=6)
    x, y = training_batch(model, 16)
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    graph = extraction.graph
    resident = list(model.variables) + list(optimizer.variables)
    checkpoint_all = get_strategy("checkpoint_all")(graph)
    half = get_strategy("chen_greedy")(graph, parse_graph_budget(graph, "50% of activations"))
    assert half.recompute_count > 0
    all_step = compile_step(extraction, checkpoint_all, optimizer=optimizer, jit_compile=True)
    half_step = compile_step(extraction, half, optimizer=optimizer, jit_compile=True)
    # Without the runtime zero XLA merged every recomputed convolution into its first one.
    assert _recomputed_convolutions(half_step, x, y) > 0
    # The bytes requested: XLA's buffers are one preallocated block per run, which BFC may
    # serve from a free chunk up to twice its size (tfremat.runtime.memory).
    all_peak = measure_step_peak(all_step, x, y, resident=resident, count="requested")
    half_peak = measure_step_peak(half_step, x, y, resident=resident, count="requested")
    predicted = simulate(graph, half).peak_bytes
    # Merged, the recomputing step's peak equalled checkpoint-all's to the byte.
    assert half_peak < 0.75 * all_peak, (half_peak, all_peak)
    assert half_peak <= 1.2 * predicted + SLACK_BYTES, (half_peak, predicted)


def test_xla_memory_counts_the_copies_xla_makes_and_holds_the_prediction():
    """``extract(..., xla="memory")``: a convolution's gradient reads XLA's transposed copy
    of its input (a residual of the input's size) instead of the input, and the variables'
    copies are fixed bytes; planned on that graph, the XLA step requests within 10% of the
    prediction (1.45x on the graph of TensorFlow's kernels)."""
    model = small_convnet(input_shape=(16, 16, 3), channels=8)
    x, y = training_batch(model, 8)
    optimizer = keras.optimizers.SGD(0.05)
    optimizer.build(model.trainable_variables)
    plain = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False, xla="memory")
    graph, before = extraction.graph, plain.graph
    conv2, relu1 = graph.names.index("conv2"), graph.names.index("relu1")
    input_bytes = before.output_bytes[relu1]
    assert graph.residual_bytes[conv2] == before.residual_bytes[conv2] + input_bytes
    backward = graph.backward_of[conv2]
    assert relu1 in before.predecessors[before.backward_of[conv2]]
    assert relu1 not in graph.predecessors[backward]
    weights = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.trainable_variables)
    assert graph.fixed_bytes - before.fixed_bytes == weights
    schedule = get_strategy("rotor")(graph, parse_graph_budget(graph, "80% of activations"))
    assert schedule.recompute_count > 0
    step = compile_step(extraction, schedule, optimizer=optimizer, jit_compile=True)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    predicted = simulate(graph, schedule).peak_bytes
    assert 0.8 * predicted <= requested <= 1.1 * predicted, (requested, predicted)


def test_layout_copies_are_read_from_the_hlo():
    """A copy of a whole input that the step's HLO makes and the forward's does not is the
    gradient's; a copy of part of it, or one the forward makes too, is not."""
    from tfremat.extract.xla_layouts import backward_layout_copies

    def module(*body):
        return "\n".join([
            "%fused_computation.1 (param_0: f32[2,3]) -> f32[3,2] {",
            "  %param_0 = f32[2,3]{1,0} parameter(0)",
            "  %transpose.1 = f32[3,2]{0,1} transpose(%param_0), dimensions={1,0}",
            "  ROOT %copy.1 = f32[3,2]{1,0} copy(%transpose.1)",
            "}",
            "",
            "ENTRY %main (arg0.1: f32[2,3], arg1.1: f32[4], arg2.1: f32[]) -> f32[3,2] {",
            "  %arg0.1 = f32[2,3]{1,0} parameter(0), metadata={op_name=\"XLA_Args\"}",
            "  %arg1.1 = f32[4]{0} parameter(1)",
            "  %arg2.1 = f32[] parameter(2)",
            *body,
            "}",
        ])

    copy0 = "  %transpose_copy_fusion = f32[3,2]{1,0} fusion(%arg0.1), kind=kLoop, calls=%fused_computation.1"
    part1 = "  %slice.1 = f32[2]{0} slice(%arg1.1), slice={[0:2]}"
    copy1 = "  %copy.2 = f32[4]{0} copy(%arg1.1)"
    step = module(copy0, part1, copy1, "  ROOT %t = (f32[3,2]) tuple(%transpose_copy_fusion)")
    assert backward_layout_copies(step, module(part1), 2) == {0: 6, 1: 4}
    assert backward_layout_copies(step, module(copy1), 2) == {0: 6}
    assert backward_layout_copies(step, module(), 1) == {0: 6}


def test_jit_compile_is_refused_with_a_distribution_strategy():
    model = small_convnet(input_shape=(8, 8, 3), channels=4)
    extraction = extract(model, training_batch(model, 2), optimizer=keras.optimizers.SGD(), cost_model="flops",
                         use_cache=False)
    schedule = get_strategy("checkpoint_all")(extraction.graph)
    with pytest.raises(CompileError, match="jit_compile=True with a distribution strategy"):
        compile_step(extraction, schedule, strategy=tf.distribute.get_strategy(), jit_compile=True)


def test_value_and_grad_under_xla_gives_the_tapes_gradients():
    import tfremat

    model = small_convnet(input_shape=(16, 16, 3), channels=8)
    loss_object = keras.losses.MeanSquaredError()
    x, y = training_batch(model, 8)

    def loss_fn(a, b):
        return loss_object(b, model(a, training=True))

    with pytest.raises(ArgumentError, match="jit_compile"):
        tfremat.value_and_grad(loss_fn, "80%", x, y, strategy="chen_sqrtn", cost_model="flops", jit_compile="yes")
    g = tfremat.value_and_grad(loss_fn, "80%", x, y, strategy="chen_sqrtn", cost_model="flops", verbose=0,
                               jit_compile=True)
    assert g.plan.schedule.recompute_count > 0
    states = [v.numpy() for v in model.non_trainable_variables]
    loss, gradients = g(x, y)
    for variable, value in zip(model.non_trainable_variables, states):
        variable.assign(value)

    # XLA draws other dropout masks than TensorFlow's kernels: the reference runs under XLA too.
    @tf.function(jit_compile=True)
    def tape_gradients(a, b):
        with tf.GradientTape() as tape:
            value = loss_fn(a, b)
        return value, tape.gradient(value, g.trainable_variables)

    expected_loss, expected = tape_gradients(x, y)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    close = closeness([np.asarray(a) for a in gradients], [np.asarray(e) for e in expected])
    assert close.equal, close


def test_fit_on_a_model_compiled_with_jit_compile_trains_like_keras_with_xla():
    """``model.compile(jit_compile=True)``: tfremat.fit (RematCallback) compiles the planned
    step with XLA, as Keras compiles its own, and trains to Keras's weights. The plan counts
    the copies XLA makes (``extract(xla="memory")``), so the allocator check (on by default)
    holds the bytes the XLA step requests to the budget."""
    import tfremat

    def trained(remat):
        model = small_convnet(input_shape=(16, 16, 3), channels=8)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy", jit_compile=True)
        x, y = training_batch(model, 16, 0)
        if remat:
            history = tfremat.fit(model, "80% of activations", x, y, batch_size=8, epochs=1, shuffle=False,
                                  strategy="rotor", cost_model="flops", cache=False, verbose=0)
            (plan,) = history.plans.values()
            assert plan.schedule.recompute_count > 0
        else:
            history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return history.history["loss"], [v.numpy() for v in model.variables]

    plain_loss, plain_state = trained(False)
    remat_loss, remat_state = trained(True)
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-4)
    assert closeness(remat_state, plain_state).equal


def _pointwise_chain(features=64, seed=0):
    """A Dense layer and pointwise layers after it (GELU, layer norm, a sigmoid-gated
    product): each is several TensorFlow kernels and one fused XLA loop."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input((features,), name="x")
    h = layers.Dense(features, name="dense")(x)
    h = layers.Activation("gelu", name="gelu")(h)
    h = layers.LayerNormalization(name="norm")(h)
    h = layers.Multiply(name="gate")([h, layers.Activation("sigmoid", name="sigmoid")(h)])
    return keras.Model(x, layers.Dense(4, activation="softmax", name="head")(h), name="pointwise_chain")


def test_xla_costs_are_timed_on_functions_compiled_by_xla(monkeypatch):
    """``extract(..., xla=True)`` times every layer call, its gradient and the loss as
    functions compiled by XLA (``_XlaMustCompile``), and without it none; the workspaces
    are measured on TensorFlow's kernels either way, and the two profiles are cached apart.
    The mechanism is checked, not a timing: which is cheaper depends on the machine."""
    from tfremat.extract import analysis, call_timing

    timed, measured = [], []
    least_seconds, requested_peak = call_timing._least_seconds, analysis._requested_peak
    requested_peaks = analysis._requested_peaks

    def recording(calls, repeats, warmup):
        timed.extend(fn for fn, _ in calls)
        return least_seconds(calls, repeats, warmup)

    def recording_peak(fn, args, warmup):
        measured.append(fn)
        return requested_peak(fn, args, warmup)

    def recording_peaks(runs, warmup, **options):
        measured.extend(fn for fn, _ in runs)
        return requested_peaks(runs, warmup, **options)

    def recording_kernels(trace, calls, repeats, warmup, done, traced_pass=call_timing._traced_pass):
        timed.extend(fn for fn, _ in calls)
        return traced_pass(trace, calls, repeats, warmup, done)

    monkeypatch.setattr(call_timing, "_least_seconds", recording)
    monkeypatch.setattr(call_timing, "_traced_pass", recording_kernels)
    monkeypatch.setattr(analysis, "_requested_peak", recording_peak)
    monkeypatch.setattr(analysis, "_requested_peaks", recording_peaks)
    monkeypatch.setattr(call_timing, "_MIN_TIMING_SECONDS", 0.0)

    def compiled_by_xla(fn) -> bool:
        attr = fn.function_def.attr.get("_XlaMustCompile")
        return attr is not None and attr.b

    model = _pointwise_chain()
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    y = np.eye(4, dtype=np.float32)[np.arange(32) % 4]
    profiles = {}
    for xla in (False, True, True):
        timed.clear()
        measured.clear()
        extraction = extract(model, (x, y), cost_model="profile", repeats=1, xla=xla)
        assert extraction.cache_hit == (xla and xla in profiles), xla
        if not extraction.cache_hit:
            # six layer calls (four kinds of pointwise layer, two Dense of their own
            # shapes) and the loss: a dispatch-only function with each
            assert len(timed) >= 2 * 7
            assert all(compiled_by_xla(fn) == xla for fn in timed), xla
            assert measured and not any(compiled_by_xla(fn) for fn in measured)
        profiles[xla] = extraction.graph
    plain, compiled = profiles[False], profiles[True]
    assert plain.size == compiled.size
    assert all(c > 0 for c in compiled.cost)
