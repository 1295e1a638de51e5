"""The compiled training step (tfremat.static_graph): exact training, plan-following memory.

Correctness runs every registered strategy on the shared small residual conv net (batch
norm, dropout, residual Add, Concatenate) and U-Net: gradients equal a plain
``tf.GradientTape`` step, five optimizer steps leave the same weights and batch-norm
statistics, the traced function contains as many layer calls as the schedule evaluates,
and its live-bytes ledger equals the simulator's trace. Memory runs a deeper residual net
whose activations dominate and checks the allocator peak against the prediction.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from models import residual_chain, small_convnet, unet  # noqa: E402
from training_case import TrainingCase, training_batch  # noqa: E402

from tfremat.errors import CompileError, InfeasibleBudgetError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.baselines import schedule_for_checkpoints  # noqa: E402
from tfremat.plan.execution import Op  # noqa: E402
from tfremat.runtime import executor  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.static_graph.compile import check_acyclic  # noqa: E402
from tfremat.static_graph.interpreter import interpret_plan  # noqa: E402
from tfremat.strategies import get_strategy, solver_strategy_names, strategy_names  # noqa: E402

MILP = set(solver_strategy_names())
# Budgets tried in order for a strategy that needs one: the first feasible one is used,
# so that the schedule recomputes something where the strategy can.
BUDGET_FRACTIONS = (0.6, 0.8, None)
# Bytes the simulator does not model (small allocations such as shapes and scalars).
MEASURE_SLACK_BYTES = 2 * 2**20


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _strategy_options(name):
    return {"time_limit": 30} if name in MILP else {}


def _available_strategies():
    return [name for name in strategy_names() if name not in MILP or _has_ilp()]


def _has_ilp():
    try:
        import tfremat.ilp  # noqa: F401
    except ImportError:
        return False
    return True


def _schedule(name, graph):
    """The strategy's schedule at the first feasible budget of ``BUDGET_FRACTIONS``."""
    reference = simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes
    for fraction in BUDGET_FRACTIONS:
        budget = None if fraction is None else int(fraction * reference)
        try:
            return get_strategy(name)(graph, budget, **_strategy_options(name))
        except InfeasibleBudgetError:
            continue
    pytest.fail(f"strategy {name} found no schedule even without a budget")


@pytest.fixture(scope="module")
def cases():
    return {
        "small_convnet": TrainingCase(lambda: small_convnet(input_shape=(16, 16, 3), channels=8), batch=8),
        "unet": TrainingCase(lambda: unet(input_shape=(16, 16, 3), base=4), batch=4),
    }


@pytest.mark.parametrize("model_name", ["small_convnet", "unet"])
@pytest.mark.parametrize("strategy", _available_strategies())
def test_every_strategy_trains_exactly_like_plain_keras(cases, model_name, strategy):
    case = cases[model_name]
    graph = case.extraction.graph
    schedule = _schedule(strategy, graph)
    step = case.assert_trains_like_plain(schedule, strategy)

    # The trace: one layer call per evaluation the schedule makes, the simulator's ledger.
    report = step.report
    forward = list(graph.forward_nodes)
    evaluations = int(schedule.R[:, forward].sum())
    assert report.layer_calls == evaluations
    assert report.recomputed_layer_calls == evaluations - len(forward)
    assert report.recompute_statements == schedule.recompute_count == step.plan.recompute_count
    np.testing.assert_array_equal(step.ledger_bytes, simulate(graph, schedule).trace_bytes)


@pytest.fixture
def no_grappler_rewrites():
    """Turns off Grappler's fusing rewrites for the test, restoring the options after.

    The plain step and the compiled one are the same math, but Grappler fuses different
    op groups in the two graphs (the compiled one has control dependencies between layers),
    which changes float rounding; MobileNetV2's batch norms over a few values per channel
    amplify that to ~1e-3. Without the rewrites both are bit-identical.
    """
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(
        {"remapping": False, "arithmetic_optimization": False, "layout_optimizer": False, "constant_folding": False}
    )
    yield
    tf.config.optimizer.set_experimental_options(saved)


def test_keras_applications_model_gradients_match_plain(no_grappler_rewrites):
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(alpha=0.35, weights=None, input_shape=(32, 32, 3), classes=10)
    case_x, case_y = training_batch(model, 4)
    extraction = extract(model, (case_x, case_y), cost_model="flops", use_cache=False)
    graph, side_table = extraction.graph, extraction.side_table
    initial = [v.numpy() for v in model.variables]

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            loss = side_table.loss_fn([y], [model(x, training=True)])
        return tape.gradient(loss, model.trainable_variables)

    expected = [g.numpy() for g in plain(case_x, case_y)]
    plain_state = [v.numpy() for v in model.non_trainable_variables]
    for variable, value in zip(model.variables, initial):
        variable.assign(value)
    schedule = _schedule("chen_sqrtn", graph)
    plan = compile_step(extraction, schedule, optimizer=keras.optimizers.SGD()).plan

    @tf.function(autograph=False)
    def compiled(x, y):
        _, _, weight_grads, _ = interpret_plan(graph, side_table, plan, x, y)
        return [weight_grads[id(v)][1] for v in model.trainable_variables]

    for variable, g, e in zip(model.trainable_variables, compiled(case_x, case_y), expected):
        scale = np.abs(e).max()
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6 * scale, err_msg=variable.path)
    assert schedule.recompute_count > 0
    # Batch-norm moving statistics moved exactly once, as in the plain step.
    for variable, value in zip(model.non_trainable_variables, plain_state):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5, atol=1e-7, err_msg=variable.path)


def test_recomputed_layers_are_separate_ops_in_the_traced_graph(cases):
    case = cases["small_convnet"]
    graph = case.extraction.graph
    relus = [i for i in graph.forward_nodes if graph.names[i].startswith("relu")]
    for schedule in (get_strategy("checkpoint_all")(graph), _schedule("chen_sqrtn", graph)):
        case.reset()
        step = compile_step(case.extraction, schedule, optimizer=case.optimizer())
        concrete = step.function.get_concrete_function(case.x, case.y)
        relu_ops = [op for op in concrete.graph.get_operations() if op.type == "Relu"]
        # A ReLU's gradient reads only its output, so no VJP is ever rebuilt for it.
        assert len(relu_ops) == int(schedule.R[:, relus].sum())
    assert int(schedule.R[:, relus].sum()) > len(relus), "chen_sqrtn should recompute a ReLU here"


def test_the_ledger_counts_the_traced_tensors_not_the_graph(cases):
    """The ledger sizes each value from the tensors the step holds, so a graph that claims
    other bytes for a value (here one ReLU output said to be twice its size) disagrees with
    it from that value's allocation on, while the simulator follows the graph."""
    import dataclasses

    case = cases["small_convnet"]
    graph = case.extraction.graph
    relu = next(i for i in graph.forward_nodes if graph.names[i].startswith("relu"))
    doubled = list(graph.output_bytes)
    doubled[relu] *= 2
    wrong = graph.replaced(output_bytes=doubled)
    schedule = get_strategy("checkpoint_all")(graph)
    case.reset()
    right = compile_step(case.extraction, schedule, optimizer=case.optimizer()).ledger_bytes
    case.reset()
    misled = compile_step(dataclasses.replace(case.extraction, graph=wrong), schedule, optimizer=case.optimizer())
    np.testing.assert_array_equal(misled.ledger_bytes, right)
    predicted = simulate(wrong, schedule).trace_bytes
    assert np.all(predicted >= right) and np.any(predicted - right == graph.output_bytes[relu])


def test_return_outputs_gives_predictions(cases):
    case = cases["small_convnet"]
    case.reset()
    step = compile_step(case.extraction, _schedule("chen_greedy", case.extraction.graph), optimizer=case.optimizer(),
                        return_outputs=True)
    loss, predictions = step(case.x, case.y)
    assert predictions.shape == case.y.shape
    np.testing.assert_allclose(float(tf.reduce_mean(keras.losses.categorical_crossentropy(case.y, predictions))), float(loss), rtol=1e-5)


def test_a_plan_that_reads_a_freed_value_is_refused(cases):
    case = cases["small_convnet"]
    graph = case.extraction.graph
    step = compile_step(case.extraction, get_strategy("checkpoint_all")(graph), optimizer=case.optimizer())
    broken = type(step.plan)(tuple(s for s in step.plan.statements if not (s.node == 0 and s.op.value == "compute")), step.plan.num_nodes)

    @tf.function(autograph=False)
    def run(x, y):
        return interpret_plan(graph, case.extraction.side_table, broken, x, y)[0]

    with pytest.raises(CompileError):
        run.get_concrete_function(case.x, case.y)


class _GlobalNoise(keras.layers.Layer):
    """Adds noise from TensorFlow's stateful global generator (no Keras SeedGenerator)."""

    def call(self, inputs):
        return inputs + tf.random.uniform(tf.shape(inputs))


def test_recomputing_a_layer_with_unreplayable_randomness_is_refused():
    keras.utils.set_random_seed(0)
    x = keras.Input((16,))
    h = x
    for i in range(6):
        h = keras.layers.Dense(16, activation="relu", name=f"dense{i}")(h)
        if i == 1:
            h = _GlobalNoise(name="noise")(h)
    model = keras.Model(x, keras.layers.Dense(4, activation="softmax", name="head")(h))
    data = training_batch(model, 4)
    extraction = extract(model, data, cost_model="flops", use_cache=False)
    graph = extraction.graph
    noise = graph.names.index("noise")
    # Keep every forward value but the noise output, which the next Dense's gradient reads.
    schedule = schedule_for_checkpoints(graph, [i for i in graph.forward_nodes if i != noise], "test")
    assert schedule.R[:, noise].sum() > 1, "the schedule should recompute the noise layer"
    with pytest.raises(CompileError, match="noise"):
        compile_step(extraction, schedule, optimizer=keras.optimizers.SGD()).trace()
    compile_step(extraction, get_strategy("checkpoint_all")(graph), optimizer=keras.optimizers.SGD()).trace()


# ----- memory, measured by the allocator -----


# The memory test's 10% tolerance was validated on schedules of Checkmate's baselines.
# Schedules of the later eviction/repair strategies measured 0.95x to 1.12x their
# prediction on this model at 60% in different processes (the same schedule), so they
# would make the test flaky; the spread is an open question of the executor. intervals
# came later still and was not measured here.
_NOT_VALIDATED_FOR_MEMORY = ("eviction", "repair", "intervals")


def _checkpoint_all_peaks(model, x, y, optimizer):
    """Predicted and requested peak bytes of ``model``'s compiled checkpoint-all step, and the step."""
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1)
    schedule = get_strategy("checkpoint_all")(extraction.graph)
    predicted = simulate(extraction.graph, schedule).peak_bytes
    step = compile_step(extraction, schedule, optimizer=optimizer)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    return predicted, requested, step


def _cheapest_fitting(graph, budget):
    """The cheapest schedule any Checkmate baseline finds within ``budget`` (LP rounding as fallback)."""
    found = []
    for name in strategy_names():
        if name in MILP or name in _NOT_VALIDATED_FOR_MEMORY:
            continue
        try:
            schedule = get_strategy(name)(graph, budget)
        except InfeasibleBudgetError:
            continue
        if simulate(graph, schedule).peak_bytes <= budget:
            found.append(schedule)
    if not found and _has_ilp():
        found.append(get_strategy("approx_lp")(graph, budget))
    if not found:
        pytest.skip(f"no strategy fits {budget} bytes")
    return min(found, key=lambda s: s.cost(graph))


def test_measured_peak_follows_the_prediction_and_the_budget():
    model = residual_chain()
    x, y = training_batch(model, 32)
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1)
    graph = extraction.graph
    reference = simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes
    measured = []
    for fraction in (None, 0.8, 0.6, 0.4):
        schedule = (
            get_strategy("checkpoint_all")(graph) if fraction is None else _cheapest_fitting(graph, int(fraction * reference))
        )
        predicted = simulate(graph, schedule).peak_bytes
        step = compile_step(extraction, schedule)
        resident = list(model.variables) + list(optimizer.variables)
        # The bytes the step's operations request: the allocator's own peak counts whole BFC
        # chunks, and BFC hands out a free chunk up to twice a request unsplit, so on the same
        # schedule it reads 100-105 MB or 123-129 MB (a 28.5 MB convolution scratch in a 50-55
        # MB chunk) depending on what the process allocated before (memory module docstring).
        peak = measure_step_peak(step, x, y, resident=resident, count="requested")
        allocator_peak = measure_step_peak(step, x, y, resident=resident)
        assert peak <= predicted * 1.10 + MEASURE_SLACK_BYTES, (fraction, peak, predicted)
        # Every chunk is at least its request: the profiler saw the step's allocations.
        assert allocator_peak >= peak - MEASURE_SLACK_BYTES, (fraction, allocator_peak, peak)
        print(f"budget {fraction}: strategy {schedule.strategy}, predicted {predicted}, requested {peak}, "
              f"allocator {allocator_peak}")
        measured.append(peak)
        if fraction is not None:
            assert peak <= fraction * reference * 1.10 + MEASURE_SLACK_BYTES, (fraction, peak, reference)
    # Each step within its budget (above); the cheapest schedule fitting 80% may already fit
    # 60% (profiled costs vary between runs), so only the ends are compared.
    assert measured[-1] < measured[0], measured


# compile_step(strategy=...) on two logical CPU devices: tests/test_mirrored.py


@pytest.mark.parametrize("optimizer, strategy", [
    (lambda: keras.optimizers.SGD(0.01, momentum=0.9), "checkpoint_all"),
    (lambda: keras.optimizers.Adam(0.001), "chen_sqrtn"),
])
def test_optimizer_updates_follow_their_own_gradient(optimizer, strategy):
    """Keras's TensorFlow optimizer passed all gradients through one all-reduce IdentityN,
    so every update waited for the last gradient and all weight gradients stayed alive
    to the end of the backward pass; momentum's gradient-free half ran at the start of
    the step. On this weight-heavy MLP that measured 1.22x (momentum) and 1.11x (Adam)
    the predicted peak; each update now waits for its own gradient only (1.04x)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = inputs
    for _ in range(5):
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((512, 256)).astype("float32"))
    y = tf.constant(np.eye(10, dtype="float32")[rng.integers(0, 10, 512)])
    opt = optimizer()
    extraction = extract(model, (x, y), optimizer=opt, cost_model="flops")
    schedule = get_strategy(strategy)(extraction.graph)
    predicted = simulate(extraction.graph, schedule).peak_bytes
    step = compile_step(extraction, schedule, optimizer=opt)
    peak = measure_step_peak(step, x, y, resident=list(model.variables) + list(opt.variables), count="requested")
    assert peak <= 1.06 * predicted, (peak, predicted)


def test_weight_gradients_die_with_their_backward_node():
    """The graph frees a layer's weight gradients right after its backward node, but the
    optimizer updates hung off the statement chain and TensorFlow's executor ran them
    after the whole backward pass, so every weight gradient stayed alive: ResNet50's
    checkpoint-all step (64x64, batch 2) requested 207.6 MiB against 119.8 MiB predicted,
    and this weight-heavy MLP 3.0 MiB (0.58x its weight gradients) over its prediction.
    The statement after a layer's last use now waits for its update."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = inputs
    for _ in range(6):
        hidden = keras.layers.Dense(512)(hidden)
        hidden = keras.layers.ReLU()(keras.layers.BatchNormalization()(hidden))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2, 64)).astype("float32"))
    y = tf.constant(np.eye(10, dtype="float32")[rng.integers(0, 10, 2)])
    optimizer = keras.optimizers.SGD(0.01)
    predicted, requested, step = _checkpoint_all_peaks(model, x, y, optimizer)
    weight_grads = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert requested <= predicted + 0.1 * weight_grads, (requested, predicted, weight_grads)
    assert step.report.ordered_updates == len(step.report.update_points) > 0


def test_update_after_an_add_is_ordered():
    """The backward node of an ``Add`` creates no operation (its gradient is the upstream
    gradient, passed through), so a convolution reading an ``Add`` had its update point
    on an empty statement, which nothing can wait on: the update was left unordered, the
    filter gradient ran at the end of the backward pass and the upstream gradient it
    reads stayed alive (EfficientNetB0's block3a-7a expand convolutions: 1.24 MiB, its
    step 2.3% over the prediction). The update point is now the next statement that
    created an operation."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((32, 32, 8))
    stem = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    hidden = stem
    expands = []
    for _ in range(2):
        residual = layers.Conv2D(8, 3, padding="same", use_bias=False)(hidden)
        hidden = layers.Add()([hidden, residual])
        expand = layers.Conv2D(64, 1, use_bias=False)
        expands.append(expand)
        hidden = layers.Conv2D(8, 1, use_bias=False)(layers.ReLU()(expand(hidden)))
    outputs = layers.Dense(10, activation="softmax")(layers.GlobalAveragePooling2D()(hidden))
    model = keras.Model(inputs, outputs)
    x, y = training_batch(model, 8)
    optimizer = keras.optimizers.SGD(0.01)
    predicted, requested, step = _checkpoint_all_peaks(model, x, y, optimizer)
    assert all(id(layer.kernel) in step.report.update_points for layer in expands)
    assert step.report.ordered_updates == len(step.report.update_points) > 0
    upstream_gradient = 8 * 32 * 32 * 64 * 4  # one expand convolution's, 2 MiB
    assert requested <= predicted + upstream_gradient // 4, (requested, predicted)


def test_a_backward_node_computed_twice_gives_its_weight_gradients_once():
    """A schedule may compute a backward node more than once (``eviction`` and ``optimal``
    did so 131 times at MobileNetV2's smallest feasible budget). Each computation added its
    weight gradients to the variable's sum, so those layers trained on twice their gradient,
    and the first computation's weight gradients lived until the update after the second,
    which the graph does not count: that MobileNetV2 step requested 44.0 MiB against a
    35.7 MiB budget and prediction. The weight gradients are now taken at the node's last
    computation only."""
    from tfremat.plan.schedule import Schedule

    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = inputs
    for k in range(3):
        hidden = keras.layers.Dense(512, activation="relu", name=f"d{k}")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="head")(hidden))
    x, y = training_batch(model, 2)
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    graph = extraction.graph
    # Every node once in its own stage, every value kept, and d2's backward (a 1 MiB
    # kernel gradient) computed once more in the last stage (so not kept into it).
    stages, again = graph.size, graph.names.index("d2_backward")
    assert again < stages - 2
    R = np.eye(stages, dtype=bool)
    R[stages - 1, again] = True
    S = np.tril(np.ones((stages, stages), dtype=bool), k=-1)
    S[stages - 1, again] = False
    schedule = Schedule(R, S, "test")

    plan = compile_step(extraction, schedule, optimizer=optimizer).plan

    @tf.function
    def compiled_gradients(a, b):
        _, _, weight_grads, _ = interpret_plan(graph, extraction.side_table, plan, a, b)
        return [weight_grads[id(v)][1] for v in model.trainable_variables]

    @tf.function
    def plain_gradients(a, b):
        with tf.GradientTape() as tape:
            loss = extraction.side_table.loss_fn([b], [model(a, training=True)])
        return tape.gradient(loss, model.trainable_variables)

    for variable, got, expected in zip(model.trainable_variables, compiled_gradients(x, y), plain_gradients(x, y)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-7, err_msg=variable.path)

    predicted = simulate(graph, schedule).peak_bytes
    step = compile_step(extraction, schedule, optimizer=optimizer)
    requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                  count="requested")
    assert requested <= predicted + 2**18, (requested, predicted)


def _padded_chain(blocks=4, seed=0):
    """[ZeroPadding2D, Conv2D(valid), ReLU] blocks, the stem of ResNet50 and DenseNet121."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input((16, 16, 3))
    h = x
    for k in range(blocks):
        h = layers.ZeroPadding2D(1, name=f"pad{k}")(h)
        h = layers.Conv2D(8, 3, name=f"conv{k}")(h)
        h = layers.ReLU(name=f"relu{k}")(h)
    out = layers.Dense(4, activation="softmax", name="head")(layers.GlobalAveragePooling2D()(h))
    return keras.Model(x, out)


@pytest.mark.parametrize("strategy", ["eviction", "chen_sqrtn"])
def test_recomputed_padding_before_a_convolution_compiles_and_trains(strategy):
    """Every statement waited on the previous one's outputs through control edges; with
    oneDNN on, its layout pass merged a recomputed ``Pad`` into the next ``Conv2D``, whose
    kernel read waited on the ``Pad``: "nodes in a cycle" at the first step, at every
    recomputing budget (ResNet50, DenseNet121, EfficientNetB0)."""
    model = _padded_chain()
    x, y = training_batch(model, 4)
    extraction = extract(model, (x, y), cost_model="flops", use_cache=False)
    graph, side_table = extraction.graph, extraction.side_table
    schedule = _schedule(strategy, graph)
    assert schedule.recompute_count > 0
    initial = [v.numpy() for v in model.variables]

    @tf.function
    def plain(inputs, labels):
        with tf.GradientTape() as tape:
            loss = side_table.loss_fn([labels], [model(inputs, training=True)])
        return tape.gradient(loss, model.trainable_variables)

    expected = [g.numpy() for g in plain(x, y)]
    step = compile_step(extraction, schedule, optimizer=keras.optimizers.SGD(0.0))
    loss = float(step(x, y))
    assert np.isfinite(loss)
    for variable, value in zip(model.variables, initial):
        variable.assign(value)

    @tf.function(autograph=False)
    def compiled(inputs, labels):
        _, _, weight_grads, _ = interpret_plan(graph, side_table, step.plan, inputs, labels)
        return [weight_grads[id(v)][1] for v in model.trainable_variables]

    gradients = closeness([g.numpy() for g in compiled(x, y)], expected)
    assert gradients.equal, gradients


def test_a_cycle_in_the_traced_step_names_its_statements():
    func_graph = tf.Graph()
    with func_graph.as_default():
        with tf.name_scope("forward_1"):
            a = tf.constant(1.0)
            b = tf.identity(a)
        with tf.name_scope("backward_5"):
            c = tf.identity(b)
    a.op._add_control_input(c.op)  # pylint: disable=protected-access
    extraction = extract(_padded_chain(blocks=1), training_batch(_padded_chain(blocks=1), 2), cost_model="flops", use_cache=False)
    with pytest.raises(CompileError, match=r"cycle through 3 operations of the statements backward_5 \(.*\), forward_1 \(conv0\)"):
        check_acyclic(func_graph, extraction.graph)


def test_a_grouped_convolution_runs_its_backward_function_once():
    """Keras runs a grouped Conv2D on TensorFlow as a nested function call, whose gradient is
    one call of a backward function computing every gradient: asked for input and weight
    gradients separately, the step ran that whole backward twice (1.5x plain Keras's step
    time on a ConvMixer-style net)."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    x = keras.Input((8, 8, 8))
    h = layers.Conv2D(8, 3, padding="same", groups=8, name="grouped")(x)
    h = layers.Conv2D(8, 3, padding="same", groups=4, name="grouped2")(layers.ReLU()(h))
    model = keras.Model(x, layers.Dense(3, activation="softmax")(layers.GlobalAveragePooling2D()(h)))
    batch = training_batch(model, 2)
    extraction = extract(model, batch, cost_model="flops", use_cache=False)
    grouped = [k for k in extraction.graph.forward_nodes if extraction.graph.names[k].startswith("grouped")]
    assert len(grouped) == 2 and all(extraction.side_table[k].one_gradient_call for k in grouped)
    step = compile_step(extraction, get_strategy("checkpoint_all")(extraction.graph), optimizer=keras.optimizers.SGD())
    concrete = step.function.get_concrete_function(*batch)
    backward_calls = [op for op in concrete.graph.get_operations()
                      if op.type in ("PartitionedCall", "StatefulPartitionedCall") and op.name.startswith("backward_")]
    assert len(backward_calls) == len(grouped)


def _offloading_schedule(name, graph):
    """``name``'s schedule over a link fast enough that offloading pays, at the first budget
    of 90%..60% of the checkpoint-all peak where it offloads something."""
    reference = simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes
    bandwidth = 1e6 * max(graph.output_bytes) / min(c for c in graph.cost if c > 0)
    for fraction in (0.9, 0.8, 0.7, 0.6):
        try:
            schedule = get_strategy(name)(graph, int(fraction * reference), bandwidth=bandwidth)
        except InfeasibleBudgetError:
            continue
        if schedule.offloads:
            return schedule
    pytest.fail(f"{name} offloaded nothing at 90%..60% of the checkpoint-all peak")


@pytest.mark.parametrize("model_name", ["small_convnet", "unet"])
@pytest.mark.parametrize("strategy", ["pofo", "autocapper", "opportunist"])
def test_a_step_with_offloads_trains_exactly_like_plain_keras(cases, model_name, strategy):
    """Offloads and prefetches are host copies in the step: the same gradients, losses and
    weights as plain training, and the ledger the simulator predicts (on a CPU the copies
    save nothing; what they would save on a GPU is the simulator's to say)."""
    case = cases[model_name]
    graph = case.extraction.graph
    schedule = _offloading_schedule(strategy, graph)
    step = case.assert_trains_like_plain(schedule, strategy)
    assert any(s.op is Op.OFFLOAD for s in step.plan) and any(s.op is Op.PREFETCH for s in step.plan)
    np.testing.assert_array_equal(step.ledger_bytes, simulate(graph, schedule).trace_bytes)


def test_a_step_off_the_sequential_executor_is_warned_about_once_per_cause(monkeypatch, caplog):
    """Off TensorFlow's single-threaded executor (compile_step(..., sequential=False), or
    replica_step in a loop of the user's own) and with several inter-op threads, a
    statement's operations run together and the peak can exceed the prediction: the step
    says why, once per process and cause."""
    import logging

    import tfremat.static_graph.compile as compile_module

    monkeypatch.setattr(compile_module, "_warned_parallel", set())
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
    assert executor.sequential_ops()
    with caplog.at_level(logging.WARNING, logger="tfremat.static_graph.compile"):
        compile_module._warn_parallel_ops("cause one")
    assert not caplog.records
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "4")
    if tf.config.threading.get_inter_op_parallelism_threads() == 1:
        pytest.skip("this process set one inter-op thread through tf.config")
    assert not executor.sequential_ops()
    with caplog.at_level(logging.WARNING, logger="tfremat.static_graph.compile"):
        compile_module._warn_parallel_ops("cause one")
        compile_module._warn_parallel_ops("cause one")
        compile_module._warn_parallel_ops("cause two")
    assert [r.message.split(";")[0] for r in caplog.records] == ["cause one", "cause two"]
    assert all("TF_NUM_INTEROP_THREADS=1" in r.message for r in caplog.records)
