"""Layer implementations in the extraction and the compiled step (MONeT, issue 23): the
alternatives a Keras model's layers offer, what each keeps, and steps that run them and
train exactly like plain Keras."""

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from models import token_mlp_net, vgg_block_net  # noqa: E402
from training_case import TrainingCase, training_batch  # noqa: E402

from tfremat.errors import ArgumentError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.graph import load_graph  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.runtime.layer_variants import layer_implementations, running  # noqa: E402
from tfremat.runtime.variants import kept_bytes  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

# Bytes the simulator does not model (small allocations such as shapes and scalars).
MEASURE_SLACK_BYTES = 2 * 2**20
BATCH = 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def case():
    return TrainingCase(vgg_block_net, batch=BATCH, implementations=True)


def _by_name(graph):
    return {graph.names[node]: {i.name: i for i in alternatives} for node, alternatives in graph.implementations.items()}


def test_the_extraction_measures_every_alternative(case):
    graph = case.extraction.graph
    offered = _by_name(graph)
    assert {name: sorted(alternatives) for name, alternatives in offered.items()} == {
        "conv1": ["relu_bits", "relu_bool"], "pool1": ["window_index"], "bn2": ["fused", "output_activated"],
        "relu2": ["relu_bits", "relu_bool"], "pool2": ["window_index"], "fc": ["relu_bits", "relu_bool"],
        "dropout": ["regenerated"],
    }
    model = case.model
    conv1, relu2 = model.get_layer("conv1").output.shape, model.get_layer("relu2").output.shape
    batch_shape = (BATCH, *conv1[1:])
    # What each keeps, as the variants' own byte counts say (the extraction measured them).
    assert offered["conv1"]["relu_bool"].residual_bytes == kept_bytes("relu_bool", batch_shape)
    assert offered["conv1"]["relu_bits"].residual_bytes == kept_bytes("relu_bits", batch_shape)
    assert offered["relu2"]["relu_bits"].residual_bytes == kept_bytes("relu_bits", (BATCH, *relu2[1:]))
    pool2 = model.get_layer("pool2")
    assert offered["pool2"]["window_index"].residual_bytes == kept_bytes(
        "max_pool_index", (BATCH, *relu2[1:]), pool_size=pool2.pool_size, strides=pool2.strides, padding="SAME")
    # Which values each backward reads: a mask and an index read neither the output nor the
    # pooling's input; a Conv2D(relu)'s gradient still reads the convolution's input; the
    # output-activated batch norm reads its output, not its input; regenerated dropout nothing.
    assert not offered["conv1"]["relu_bool"].reads_output and offered["conv1"]["relu_bool"].reads_inputs
    assert not offered["relu2"]["relu_bool"].reads_inputs
    window = offered["pool1"]["window_index"]
    assert (window.reads_output, window.reads_inputs) == (False, False)
    batch_norm = offered["bn2"]["output_activated"]
    assert (batch_norm.reads_output, batch_norm.reads_inputs, batch_norm.residual_bytes) == (True, False, 0)
    assert offered["dropout"]["regenerated"].residual_bytes == 0
    # The default dropout keeps its 1-byte mask; regenerated keeps none.
    dropout = graph.names.index("dropout")
    assert graph.residual_bytes[dropout] == math.prod((BATCH, *model.get_layer("dropout").output.shape[1:]))
    assert load_graph(graph.to_dict()) == graph


def test_without_asking_the_extraction_offers_none():
    model = vgg_block_net()
    assert not extract(model, training_batch(model, BATCH), cost_model="flops", use_cache=False).graph.implementations


def _choice(graph, pick):
    return {node: pick(sorted(i.name for i in alternatives)) for node, alternatives in graph.implementations.items()}


@pytest.mark.parametrize("pick, strategy", [(lambda names: names[-1], "checkpoint_all"),
                                            (lambda names: names[0], "chen_sqrtn")],
                         ids=["bool-masks-checkpoint-all", "bit-masks-chen"])
def test_steps_running_the_alternatives_train_like_plain_keras(case, pick, strategy):
    """Gradients, five steps' losses and weights, batch-norm statistics and dropout seeds
    equal plain training's with every alternative chosen (dropout masks regenerated from
    the same seeds, moving statistics moved as Keras moves them); with recomputation too."""
    graph = case.extraction.graph
    choice = _choice(graph, pick)
    schedule = get_strategy(strategy)(graph, implementations=choice)
    assert dict(schedule.implementations) == choice
    step = case.assert_trains_like_plain(schedule, strategy)
    if strategy == "checkpoint_all":
        assert step.trace().vjp_rebuilds == 0  # each backward reads the tape its forward call recorded


@pytest.mark.parametrize("build", [lambda: vgg_block_net(input_shape=(32, 32, 3), channels=16),
                                   lambda: token_mlp_net(tokens=128, width=64)], ids=["vgg", "token_mlp"])
def test_the_choice_lowers_the_measured_peak_as_predicted(build):
    """The allocator's requested peak of a checkpoint-all step follows the prediction under
    every choice, and the leanest choice lowers both."""
    model = build()
    x, y = training_batch(model, 16)
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1, implementations=True)
    graph = extraction.graph
    lean = {node: min(alternatives, key=lambda i: i.residual_bytes).name
            for node, alternatives in graph.implementations.items()}
    resident = list(model.variables) + list(optimizer.variables)
    peaks = {}
    for label, choice in (("default", None), ("lean", lean)):
        schedule = get_strategy("checkpoint_all")(graph, implementations=choice)
        predicted = simulate(graph, schedule).peak_bytes
        step = compile_step(extraction, schedule, optimizer=optimizer)
        requested = measure_step_peak(step, x, y, resident=resident, count="requested")
        assert requested <= predicted * 1.10 + MEASURE_SLACK_BYTES, (label, requested, predicted)
        peaks[label] = (predicted, requested)
    assert peaks["lean"][0] < peaks["default"][0] and peaks["lean"][1] < peaks["default"][1], peaks


def test_running_an_alternative_restores_the_layer():
    model = vgg_block_net()
    conv, pool = model.get_layer("conv1"), model.get_layer("pool1")
    activation = conv.activation
    x = tf.random.stateless_normal((2, 16, 16, 3), seed=[1, 2])
    with running(conv, "relu_bits"):
        masked = conv(x)
    assert conv.activation is activation and "call" not in vars(pool)
    with running(pool, "window_index"):
        pooled = pool(masked)
    assert "call" not in vars(pool)
    np.testing.assert_array_equal(masked.numpy(), conv(x).numpy())
    np.testing.assert_array_equal(pooled.numpy(), pool(conv(x)).numpy())
    with pytest.raises(ArgumentError, match="no implementation 'window_index'"):
        with running(conv, "window_index"):
            pass
    assert [i.name for i in layer_implementations(model.get_layer("head"))] == []


def test_fit_with_monet_runs_its_implementations_and_trains_like_model_fit():
    """The callback extracts the alternatives for ``monet``, the plan chooses some, and
    two epochs reach model.fit's losses and weights (dropout masks and batch-norm statistics
    included)."""
    from tfremat.keras import RematCallback
    from tfremat.numerics import closeness

    def compiled():
        model = vgg_block_net()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16, 16, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 16)]
    plain = compiled()
    keras.utils.set_random_seed(3)
    expected = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    remat = compiled()
    keras.utils.set_random_seed(3)
    # A model of a few hundred KiB: the allocator's 256-byte chunks add a third to its
    # prediction, so the share is held for the requested bytes (what this test compares).
    callback = RematCallback("70%", strategy="monet", time_limit=30, cost_model="flops", allocator_check=False,
                             verbose=0)
    history = remat.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    (result,) = callback.plans.values()
    assert result.schedule.implementations, "at 70% monet needs an alternative"
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert closeness(remat.get_weights(), plain.get_weights()).equal


def _relu6_net():
    """MobileNet's activations: Conv2D(activation="relu6") and ReLU(6.0) after batch norm."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    x = keras.Input((12, 12, 3))
    h = layers.Conv2D(8, 3, padding="same", activation="relu6", name="conv")(x)
    h = layers.BatchNormalization(name="bn")(layers.Conv2D(8, 3, name="conv2")(h))
    h = layers.ReLU(6.0, name="relu6")(h)
    out = layers.Dense(10, activation="softmax", name="head")(layers.Flatten()(h))
    return keras.Model(x, out)


def test_relu6_masks_train_like_plain_keras():
    case = TrainingCase(_relu6_net, batch=BATCH, implementations=True)
    graph = case.extraction.graph
    offered = _by_name(graph)
    assert sorted(offered["conv"]) == sorted(offered["relu6"]) == ["relu_bits", "relu_bool"]
    assert not offered["relu6"]["relu_bits"].reads_output and not offered["conv"]["relu_bool"].reads_output
    choice = _choice(graph, lambda names: names[0])
    case.assert_trains_like_plain(get_strategy("checkpoint_all")(graph, implementations=choice), "relu6 bits")


@pytest.fixture(scope="module")
def token_case():
    return TrainingCase(token_mlp_net, batch=BATCH, implementations=True)


def test_transformer_layers_recompute_inside_their_backward(token_case):
    """Layer norms and gelu/mish activations keep their input only, a leaky ReLU its sign
    bits; each keeps fewer bytes than its default, and steps with them train like plain
    Keras. A Dense(silu) has nothing to gain: TensorFlow's silu gradient reads the input
    only."""
    graph = token_case.extraction.graph
    offered = _by_name(graph)
    assert {name: sorted(alternatives) for name, alternatives in offered.items()} == {
        "norm1": ["recomputed"], "up": ["recomputed"], "norm2": ["recomputed"], "leaky": ["relu_bits"],
        "mish": ["recomputed"],
    }
    def forward_bytes_read(graph, node):
        backward = graph.backward_of[node]
        return sum(graph.part_bytes(p, graph.part_read_by(p, backward))
                   for p in graph.predecessors[backward] if not graph.is_backward[p])

    for name, alternatives in offered.items():
        node = graph.names.index(name)
        under_it = graph.with_implementations({node: next(iter(alternatives))})
        assert forward_bytes_read(under_it, node) < forward_bytes_read(graph, node), name
    # A layer norm and a Dense(gelu) keep no normalized value nor gelu intermediate: the
    # Dense keeps its pre-activation (the gelu's input), the norm nothing besides its input.
    up = token_case.model.get_layer("up").output.shape
    assert offered["up"]["recomputed"].residual_bytes == kept_bytes("recomputed", (BATCH, *up[1:]))
    assert offered["norm1"]["recomputed"].residual_bytes == 0 and offered["norm1"]["recomputed"].reads_inputs
    assert offered["leaky"]["relu_bits"].residual_bytes == kept_bytes(
        "leaky_relu_bits", (BATCH, *token_case.model.get_layer("leaky").output.shape[1:]))
    choice = _choice(graph, lambda names: names[0])
    for strategy in ("checkpoint_all", "chen_sqrtn"):
        token_case.assert_trains_like_plain(get_strategy(strategy)(graph, implementations=choice), strategy)


def test_a_convolution_without_activation_splits_its_backward(case):
    """conv2 (no activation) gets a weight-gradient node that reads its input and an
    input-gradient node that reads no forward value; together they cost what the one
    backward node of the plain extraction costs. Layers whose gradient reads the output
    (conv1, fc: ReLU activations) or whose input needs no gradient keep one node."""
    graph = case.extraction.graph
    names = graph.names
    weights, inputs = graph.backward_nodes_of[names.index("conv2")]
    assert (names[weights], names[inputs]) == ("conv2_weight_backward", "conv2_backward")

    def forward_reads(node):
        return {names[p] for p in graph.predecessors[node] if not graph.is_backward[p]}

    assert forward_reads(weights) == {"pool1"} and forward_reads(inputs) == set()
    assert (weights, inputs) in graph.edges and graph.output_bytes[weights] == 0
    assert all(len(graph.backward_nodes_of[names.index(n)]) == 1 for n in ("conv1", "fc", "bn2", "head"))
    plain = extract(case.model, (case.x, case.y), cost_model="flops", use_cache=False).graph
    unsplit = plain.names.index("conv2_backward")
    assert graph.cost[weights] + graph.cost[inputs] == pytest.approx(plain.cost[unsplit], rel=1e-12)
    assert graph.output_bytes[inputs] == plain.output_bytes[unsplit]
    assert graph.size == plain.size + 1
