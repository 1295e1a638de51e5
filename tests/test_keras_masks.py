"""Keras masks (``Embedding(mask_zero=True)``) in the rematerialized step train as model.fit does.

Keras hands a mask from layer to layer as an attribute of the tensors (``_keras_mask``), not
as a graph value. The masked text transformer of issue 33 trained 3% away from model.fit
with nothing recomputed: its ``MultiHeadAttention`` was opened into sublayer calls recorded
without the mask, so it attended to padding. And ``MultiHeadAttention`` clears the masks of
its inputs, so a recomputation of it on the resident embedding computed unmasked too.
benchmarks/results/masks.md has the bisection. Since then a masked attention is opened with
its masks as values of the graph (tfremat/extract/opening.py, "Keras masks");
benchmarks/results/keras_masks.md has what that changed.
"""

import dataclasses

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from keras import layers, ops  # noqa: E402

import tfremat  # noqa: E402
from tfremat.extract.checks import analyze_checked  # noqa: E402
from tfremat.extract.layer_graph import takes_training, walk_model  # noqa: E402
from tfremat.extract.opening import may_clear_masks  # noqa: E402
from tfremat.extract.side_table import TensorRef  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

LENGTH, VOCABULARY = 8, 20


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


class TokenAndPosition(layers.Layer):
    """keras.io's token and position embedding, whose ``compute_mask`` is its token embedding's."""

    def __init__(self, maxlen, vocabulary, dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocabulary, dim, mask_zero=True)
        self.pos_emb = layers.Embedding(maxlen, dim)

    def call(self, x):
        return self.token_emb(x) + self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))

    def compute_mask(self, x, mask=None):
        return self.token_emb.compute_mask(x)


def _attention_model(embedding="functional", deep=False):
    """Masked tokens -> (Dense) -> MultiHeadAttention(h, h) + h -> LayerNorm -> (two FFNs) -> pooling."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    if embedding == "functional":
        h = layers.Embedding(VOCABULARY, 8, mask_zero=True)(inputs)
    else:
        h = TokenAndPosition(LENGTH, VOCABULARY, 8)(inputs)
    if deep:
        h = layers.Dense(16)(h)
    h = layers.LayerNormalization()(h + layers.MultiHeadAttention(2, 8, name="attention")(h, h))
    for _ in range(2 if deep else 0):
        h = layers.Dense(16)(layers.Dense(64, activation="relu")(h))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(h))


def _padded_tokens(count=32, seed=0):
    """Token ids with zero padding after 2 to 7 tokens, labels and sample weights."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCABULARY, (count, LENGTH)).astype("int32")
    for row, kept in enumerate(rng.integers(2, LENGTH, count)):
        x[row, kept:] = 0
    return x, rng.integers(0, 2, count), rng.uniform(0.5, 2.0, count).astype("float32")


def _fit_both(build, budget, strategy, data="arrays", granularity="sublayer", allocator_check=None):
    """One epoch of model.fit and of tfremat.fit (SGD, 2 batches of 16) on two copies of
    ``build()``, the graph's nodes as ``granularity`` says; returns the closeness of their
    weights and tfremat's history."""
    x, y, weights = _padded_tokens()
    if data == "arrays":
        data_kwargs = {"x": x, "y": y, "batch_size": 16, "shuffle": False}
    else:
        data_kwargs = {"x": tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(16)}
    plain, remat = build(), build()
    for model in (plain, remat):
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    keras.utils.set_random_seed(1)
    plain.fit(epochs=1, verbose=0, **data_kwargs)
    keras.utils.set_random_seed(1)
    history = tfremat.fit(remat, budget, epochs=1, verbose=0, strategy=strategy, cost_model="flops",
                          granularity=granularity, allocator_check=allocator_check, **data_kwargs)
    return closeness(remat.get_weights(), plain.get_weights()), history


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("embedding, data", [
    ("functional", "arrays"),
    ("custom", "arrays"),
    ("custom", "dataset"),
], ids=["embedding", "custom-compute-mask", "custom-compute-mask-weighted-dataset"])
def test_masked_attention_trains_like_keras_with_nothing_recomputed(embedding, data):
    """With nothing recomputed the step was 3% away from model.fit: the opened attention
    computed without its query and value masks (global error 0.031 before the fix)."""
    difference, history = _fit_both(lambda: _attention_model(embedding), "100%", "checkpoint_all", data)
    assert difference.equal, difference
    (plan,) = history.plans.values()
    assert not plan.schedule.recompute_count


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_recomputed_masked_attention_reads_its_mask_as_a_value():
    """MultiHeadAttention clears the masks of its inputs; recomputing it on the resident
    input (eviction at 90% here) attended to padding (global error 2e-3 before the fix).
    Opened, its attention reads the mask as an input: recomputed, it still masks."""
    difference, history = _fit_both(lambda: _attention_model(deep=True), "90%", "eviction")
    (plan,) = history.plans.values()
    graph = plan.extraction.graph
    (attention,) = [node for node in graph.forward_nodes
                    if graph.names[node].startswith("attention/dot_product_attention")]
    (mask,) = [node for node in graph.predecessors[attention] if graph.names[node].startswith("attention/cast")]
    assert plan.schedule.R[:, attention].sum() >= 2
    assert difference.equal, difference


def test_a_masked_attention_is_opened_with_its_masks_as_graph_values():
    """The attention's query and value masks are computed by a node of their own (the
    ``not_equal`` on the token ids) that the opened attention reads, and its output carries
    the query mask as in model.fit; an unmasked attention opens as before."""
    calls, _ = walk_model(_attention_model())
    by_name = {call.name: call for call in calls}
    assert "attention" not in by_name and "attention/query" in by_name
    (mask_node,) = [call for call in calls if type(call.layer).__name__ == "NotEqual"]
    (attention,) = [call for name, call in by_name.items() if name.startswith("attention/dot_product_attention")]
    assert "mask" in attention.call_kwargs and attention.call_kwargs["mask"].source == "node"
    readers = [call.name for call in calls if any(ref.index == mask_node.position for ref in call.inputs
                                                  if ref.source == "node")]
    assert len(readers) >= 2  # the query mask and the value mask
    assert by_name["attention/attention_output"].output_masks == (TensorRef("node", mask_node.position),)
    assert calls[mask_node.position + 1].clears_masks  # MultiHeadAttention clears its inputs' masks first
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = layers.Embedding(VOCABULARY, 8)(inputs)
    unmasked = keras.Model(inputs, layers.MultiHeadAttention(2, 8, name="attention")(h, h))
    names = [call.name for call in walk_model(unmasked)[0]]
    assert "attention/query" in names and "attention" not in names


def _two_attentions():
    """Two attentions on one masked tensor: in model.fit the first clears the tensor's mask,
    so the second attends to every token."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = layers.Embedding(VOCABULARY, 8, mask_zero=True)(inputs)
    first = layers.MultiHeadAttention(2, 4, name="first")(h, h)
    second = layers.MultiHeadAttention(2, 4, name="second")(h, h)
    h = layers.GlobalAveragePooling1D()(first + second)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(h))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_attention_whose_input_mask_an_earlier_call_cleared_stays_one_node_and_trains_like_keras():
    calls, _ = walk_model(_two_attentions())
    names = [call.name for call in calls]
    assert "first/query" in names and "second" in names
    difference, _ = _fit_both(_two_attentions, "100%", "checkpoint_all")
    assert difference.equal, difference


def _dense_then_attention():
    """A Dense reads the masked embedding before the attention does: Dense leaves the
    tensor's mask as it is, so in model.fit the attention still reads it."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = layers.Embedding(VOCABULARY, 8, mask_zero=True)(inputs)
    projected = layers.Dense(8, name="after")(layers.Dense(8, name="before")(h))
    h = layers.GlobalAveragePooling1D()(projected + layers.MultiHeadAttention(2, 4, name="attention")(h, h))
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(h))


def test_only_layers_that_may_clear_masks_count_as_clearing():
    """MultiHeadAttention clears its inputs' masks (the one Keras layer that does), and so
    may a layer holding one or running code outside Keras; Keras's other layers and
    operations do not."""
    inputs = keras.Input((LENGTH, 8))
    add = keras.Model(inputs, inputs + inputs).layers[-1]
    assert not any(may_clear_masks(layer) for layer in (layers.Dense(4), layers.LayerNormalization(),
                                                        layers.Dropout(0.1), layers.GlobalAveragePooling1D(), add))
    assert may_clear_masks(layers.MultiHeadAttention(2, 4))
    assert may_clear_masks(TransformerBlock(8, 2, 16))
    assert may_clear_masks(TokenAndPosition(LENGTH, VOCABULARY, 8))  # user code: not known not to
    assert may_clear_masks(layers.Lambda(lambda x: x))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("budget, strategy", [("100%", "checkpoint_all"), ("90%", "eviction")])
def test_an_attention_after_a_reader_that_does_not_clear_masks_opens_and_trains_like_keras(budget, strategy):
    """Any earlier Keras layer reading the masked tensor kept the attention whole; a Dense
    does not clear masks, so it opens now, masked as in model.fit (at 90% the embedding and
    the Dense that reads it are recomputed)."""
    calls, _ = walk_model(_dense_then_attention())
    names = [call.name for call in calls]
    assert names.index("before") < names.index("attention/query") and "attention" not in names
    difference, history = _fit_both(_dense_then_attention, budget, strategy, allocator_check=False)
    (plan,) = history.plans.values()
    assert plan.schedule.recompute_count >= (strategy == "eviction")
    assert difference.equal, difference


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_attention_kept_whole_is_measured_and_trained_with_its_masks():
    """Kept whole (``granularity="layer"``) the attention was measured on an unmasked call;
    measured with the masks its first call reads, its residuals hold the attention mask
    (batch x heads x query x key bools) and its forward computes it, and it still trains
    like model.fit where the schedule recomputes it."""
    calls, _ = walk_model(_attention_model(), "layer", [tf.TensorShape([16, LENGTH])])
    (attention,) = [call for call in calls if call.name == "attention"]
    assert [tuple(mask.shape) for mask in attention.input_masks] == [(None, LENGTH)] * 2
    specs = [tf.TensorSpec([16, LENGTH, 8], tf.float32)] * 2
    masked, unmasked = (analyze_checked(call, takes_training(call.layer), specs, [True, True], 16, "flops", 1)
                        for call in (attention, dataclasses.replace(attention, input_masks=())))
    assert masked.residual_bytes >= unmasked.residual_bytes + 16 * LENGTH * LENGTH
    assert masked.forward_flops > unmasked.forward_flops
    assert masked.reads_inputs == unmasked.reads_inputs  # the masks are no inputs of the node
    difference, history = _fit_both(lambda: _attention_model(deep=True), "90%", "eviction", granularity="layer")
    (plan,) = history.plans.values()
    graph = plan.extraction.graph
    assert plan.schedule.R[:, graph.names.index("attention")].sum() >= 2
    assert difference.equal, difference


class TransformerBlock(layers.Layer):
    """keras.io's text classification transformer block."""

    def __init__(self, dim, heads, hidden, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=heads, key_dim=dim)
        self.ffn = keras.Sequential([layers.Dense(hidden, activation="relu"), layers.Dense(dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attention = self.dropout1(self.att(inputs, inputs))
        out1 = self.layernorm1(inputs + attention)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))


def _text_transformer():
    """keras.io's text classifier: masked token and position embedding, a transformer block,
    pooling, dropout, two dense layers."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH,), dtype="int32")
    h = TransformerBlock(16, 2, 32, name="block")(TokenAndPosition(LENGTH, VOCABULARY, 16)(inputs))
    h = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(h))
    h = layers.Dropout(0.1)(layers.Dense(20, activation="relu")(h))
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(h))


class _WeightsAt(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.weights = steps, {}

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 in self.steps:
            self.weights[batch + 1] = self.model.get_weights()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_masked_text_transformer_opened_and_recomputed_trains_like_model_fit_after_1_and_5_steps():
    """keras.io's masked text classifier, its block and attention opened, at a budget where
    the masked attention is recomputed: the weights after steps 1 and 5 equal model.fit's."""
    x, y, _ = _padded_tokens(count=80, seed=1)
    plain, remat = _text_transformer(), _text_transformer()
    for model in (plain, remat):
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    plain_at, remat_at = _WeightsAt((1, 5)), _WeightsAt((1, 5))
    keras.utils.set_random_seed(1)
    plain.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0, callbacks=[plain_at])
    keras.utils.set_random_seed(1)
    history = tfremat.fit(remat, "80%", x=x, y=y, batch_size=16, shuffle=False, epochs=1, verbose=0,
                          strategy="eviction", cost_model="flops", allocator_check=False, callbacks=[remat_at])
    (plan,) = history.plans.values()
    graph = plan.extraction.graph
    attention_calls = [name for name in graph.names if name.startswith("block/multi_head_attention")]
    assert "block" not in graph.names and any(name.endswith("/query") for name in attention_calls)
    (attention,) = [n for n in graph.forward_nodes if "/dot_product_attention" in graph.names[n]]
    assert plan.schedule.R[:, attention].sum() >= 2
    for step in (1, 5):
        difference = closeness(remat_at.weights[step], plain_at.weights[step])
        assert difference.equal, (step, difference)


class _MaskingBlock(layers.Layer):
    """Two dense layers whose ``compute_mask`` masks the all-zero time steps of its input (as ``Masking``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner, self.outer = layers.Dense(8, activation="relu"), layers.Dense(8)

    def call(self, x):
        return self.outer(self.inner(x))

    def compute_mask(self, x, mask=None):
        return ops.any(ops.not_equal(x, 0.0), axis=-1)


def _masked_tagger():
    """Per-step tags of a masked sequence: the loss skips the padded steps only through the
    mask the block's ``__call__`` sets on its output, which the last Dense hands on."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH, 4))
    return keras.Model(inputs, layers.Dense(3, activation="softmax")(_MaskingBlock(name="block")(inputs)))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("budget, strategy", [("100%", "checkpoint_all"), ("90%", "eviction")])
def test_an_opened_block_hands_the_mask_its_call_sets_to_the_layers_and_loss_after_it(budget, strategy):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, LENGTH, 4)).astype("float32")
    for row, kept in enumerate(rng.integers(2, LENGTH, 32)):
        x[row, kept:] = 0.0
    y = rng.integers(0, 3, (32, LENGTH))
    plain, remat = _masked_tagger(), _masked_tagger()
    for model in (plain, remat):
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    plain.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
    history = tfremat.fit(remat, budget, x=x, y=y, batch_size=16, shuffle=False, epochs=1, verbose=0,
                          strategy=strategy, cost_model="flops", allocator_check=False)
    (plan,) = history.plans.values()
    graph = plan.extraction.graph
    names = graph.names
    assert "block" not in names and any(name.startswith("block/") for name in names)
    # The block's compute_mask (not_equal, any) is read by the call whose output carries it:
    # it was a node no edge read, which the plan was free to leave until after that call.
    entries = plan.extraction.side_table.entries
    (mask,) = [node for node in graph.forward_nodes if names[node].startswith("any")]
    (carrier,) = [node for node in graph.forward_nodes if TensorRef("node", mask) in entries[node].output_masks]
    assert names[carrier].startswith("block/") and carrier in graph.successors[mask]
    assert not [names[node] for node in graph.forward_nodes if not graph.successors[node]]
    difference = closeness(remat.get_weights(), plain.get_weights())
    assert difference.equal, difference
