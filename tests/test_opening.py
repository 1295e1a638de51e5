"""Opening layers into their sublayer calls and operations (``tfremat.extract.opening``).

The walk is checked on layers written as Keras users write them: a post-norm transformer
block holding MultiHeadAttention, LayerNormalization, Dropout and a Sequential feed-forward
(keras.io's text transformer); layers that must stay whole, each for its own reason; and,
end to end, a compiled step at sublayer granularity whose gradients equal plain training's
with dropout on and recomputation in the schedule.
"""

import logging
import os
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from keras import layers, ops  # noqa: E402

from tfremat.errors import ExtractionError  # noqa: E402
from tfremat.extract import extract, opening  # noqa: E402
from tfremat.extract.layer_graph import walk_model  # noqa: E402

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))
    # Each reason is logged once per process; a test asserting on the log needs a fresh record.
    monkeypatch.setattr(opening, "_reasons_logged", set())


class TransformerBlock(layers.Layer):
    """Post-norm encoder block as keras.io's text-classification example writes it."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads, dropout=rate)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


class ScaledByOwnWeight(layers.Layer):
    """A sublayer plus a weight read by an op in ``call``: its gradient lives outside the
    sublayer calls, so the layer must stay whole."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.scale = self.add_weight(shape=(8,), initializer="ones", name="scale")

    def call(self, x):
        return self.dense(x) * self.scale


class FrozenNormBlock(layers.Layer):
    """Calls its batch norm in inference mode while training (a frozen backbone part)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(8)
        self.norm = layers.BatchNormalization()

    def call(self, x, training=None):
        return self.norm(self.dense(x), training=False)


def _encoder(blocks=2, seq=16, dim=16, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((seq, dim))
    x = inputs
    for _ in range(blocks):
        x = TransformerBlock(dim, 2, 32)(x)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(4, activation="softmax")(x))


def _wrapped(layer, shape=(8,)):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    return keras.Model(inputs, layers.Dense(4)(layer(inputs)))


def _names(model, granularity):
    calls, _ = walk_model(model, granularity, [(2, *t.shape[1:]) for t in model.inputs])
    return [call.name for call in calls]


def test_layer_granularity_keeps_a_block_whole_and_sublayer_opens_it_and_its_attention():
    model = _encoder(blocks=1)
    block = model.layers[1].name
    assert _names(model, "layer") == [layer.name for layer in model.layers[1:]]
    names = _names(model, "sublayer")
    inside = [n[len(block) + 1:] for n in names if n.startswith(block + "/")]
    attention = model.layers[1].att.name
    # MultiHeadAttention opened: projections, the score product, softmax, dropout, the
    # weighted sum and the output projection are calls of their own.
    assert [f"{attention}/query", f"{attention}/key", f"{attention}/attention_output"] == [
        n for n in inside if n.split("/")[-1] in ("query", "key", "attention_output")]
    assert any("softmax" in n for n in inside) and any("einsum" in n for n in inside)
    # The nested Sequential is flattened into its two Dense calls, the residual adds are calls.
    assert sum(1 for n in inside if n.startswith(model.layers[1].ffn.name + "/")) == 2
    assert sum(1 for n in inside if n.split("/")[-1].startswith("add")) == 2
    assert len(names) > 3 * 5


def test_unknown_granularity_is_refused_with_the_choices():
    with pytest.raises(ExtractionError, match="granularity must be one of"):
        walk_model(_encoder(blocks=1), "tensor")


def test_walking_leaves_the_sublayers_node_lists_as_found():
    model = _encoder(blocks=1)
    block = model.layers[1]
    before = {id(layer): (len(layer._inbound_nodes), len(layer._outbound_nodes)) for layer in block._flatten_layers()}
    _names(model, "sublayer")
    after = {id(layer): (len(layer._inbound_nodes), len(layer._outbound_nodes)) for layer in block._flatten_layers()}
    assert after == before


@pytest.mark.parametrize("layer, reason", [
    (ScaledByOwnWeight(), "variable"),
    (FrozenNormBlock(), "training=False"),
    (layers.Bidirectional(layers.LSTM(4, return_sequences=True)), None),
])
def test_layers_that_cannot_be_opened_exactly_stay_one_node_with_the_reason_logged(layer, reason, caplog):
    shape = (6, 8) if isinstance(layer, layers.Bidirectional) else (8,)
    model = _wrapped(layer, shape)
    with caplog.at_level(logging.INFO, logger="tfremat.extract.opening"):
        names = _names(model, "sublayer")
    if reason is None:
        # A Bidirectional RNN opens into its two RNN calls; each RNN stays whole (one loop).
        assert sum(1 for n in names if n.startswith(layer.name + "/")) >= 2
        assert "while loop" in caplog.text
        return
    assert names[0] == layer.name
    assert reason in caplog.text


def test_a_sublayer_run_on_a_constant_keeps_its_parent_whole():
    class TokenAndPosition(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.tokens = layers.Embedding(50, 8)
            self.positions = layers.Embedding(6, 8)

        def call(self, x):
            return self.tokens(x) + self.positions(ops.arange(6))

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    embedded = TokenAndPosition()(inputs)
    model = keras.Model(inputs, layers.Dense(4)(layers.Flatten()(embedded)))
    # Keras runs the position embedding at once on the constant, so its weights would get
    # no gradient in an opened graph.
    assert _names(model, "sublayer")[0] == model.layers[1].name


def _plain_step(model, x, y, loss_fn):
    """Loss, gradients and the non-trainable state (dropout seeds) one plain step leaves."""
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [g.numpy() for g in grads], [v.numpy() for v in model.non_trainable_variables]


def _recomputing_step_matches_plain(model, x, granularity, share, strategy):
    """Plans ``model`` at ``share`` of its checkpoint-all peak, asserts the schedule
    recomputes, trains one compiled step and asserts its loss, gradients and non-trainable
    state (dropout seeds) equal one plain step's. Returns the graph."""
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.planner import plan_graph
    from tfremat.static_graph import compile_step

    sys.path.insert(0, BENCHMARKS)
    from conformance import _recording_sgd

    rng = np.random.default_rng(0)
    y = np.eye(4, dtype="float32")[rng.integers(0, 4, len(x))]
    loss_fn = keras.losses.CategoricalCrossentropy()
    initial = [v.numpy() for v in model.variables]
    plain_loss, expected, plain_state = _plain_step(model, x, y, loss_fn)
    for variable, value in zip(model.variables, initial):
        variable.assign(value)

    extraction = extract(model, (x, y), loss=loss_fn, cost_model="flops", use_cache=False, granularity=granularity)
    graph = extraction.graph
    result = plan_graph(graph, int(share * checkpoint_all_peak(graph)), strategy, cache=False, verbose=0)
    assert result.schedule.recompute_count > 0

    optimizer = _recording_sgd(learning_rate=0.0)
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, result.schedule, optimizer=optimizer)
    loss = float(step(tf.constant(x), tf.constant(y)))
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    for got, want, variable in zip(optimizer.recorded, expected, model.trainable_variables):
        scale = max(float(np.linalg.norm(want)), 1e-3)
        assert float(np.linalg.norm(got.numpy() - want)) / scale < 1e-4, variable.path
    # Dropout seeds advance once per call, as in the plain step, recomputations included.
    for variable, want in zip(model.non_trainable_variables, plain_state):
        np.testing.assert_array_equal(variable.numpy(), want, err_msg=variable.path)
    return graph


def test_compiled_step_at_sublayer_granularity_recomputes_inside_blocks_and_matches_plain_training():
    x = np.random.default_rng(1).standard_normal((4, 16, 16)).astype("float32")
    graph = _recomputing_step_matches_plain(_encoder(blocks=2), x, "sublayer", 0.75, "chen_sqrtn_ap")
    assert any("multi_head_attention" in name and "softmax" in name for name in graph.names)


class Swish(layers.Layer):
    """A variable-free layer composing several operations."""

    def call(self, x):
        return x * ops.sigmoid(x) + 1.0


def test_op_granularity_opens_a_variable_free_multi_op_layer_and_the_step_matches_plain_training():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = Swish(name="swish")(layers.Dense(16)(inputs))
    model = keras.Model(inputs, layers.Dense(4, activation="softmax")(Swish(name="swish2")(layers.Dense(16)(hidden))))
    assert "swish" in _names(model, "sublayer")
    opened = [n for n in _names(model, "op") if n.startswith("swish/")]
    assert len(opened) == 3, opened  # sigmoid, multiply, add

    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    _recomputing_step_matches_plain(model, x, "op", 0.9, "optimal")
