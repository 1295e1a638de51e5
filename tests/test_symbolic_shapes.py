"""Shapes read while a layer's call is recorded (``tfremat.extract.opening``, "Shapes").

An opened layer's operations are replayed with the arguments recorded on symbolic tensors,
so ``ops.reshape(y, ops.shape(x))`` replays the tuple ``ops.shape(x)`` gave then. keras-hub's
Gemma attention does that on its query, which ``EinsumDense(output_shape=(None, ...))``
leaves with an unknown sequence axis: the step replayed ``(8, None, 4, 16)`` and crashed
(user_check_7.md, finding 2). These tests hold the three parts of the fix on small layers of
the same kind: the sublayer's open dimension is filled in, so the layer opens and its step
trains as plain Keras does; a dimension no trace can fill in keeps the layer whole with the
reason logged; a tensor times a number, which Keras marks sparse, opens the layer after it.
A call that still fails to trace is refused naming itself, not with the bare Keras error.
"""

import logging
import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from keras import layers, ops  # noqa: E402

from test_opening import _recomputing_step_matches_plain  # noqa: E402
from tfremat.extract import opening  # noqa: E402
from tfremat.extract.layer_graph import walk_model  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(opening, "_reasons_logged", set())


class RotatedHeads(layers.Layer):
    """Gemma's rotary reshape on heads an ``EinsumDense`` makes with the time axis left open:
    ``ops.reshape(ops.stack(ops.split(q, 2, -1), -1), ops.shape(q))``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = layers.EinsumDense("btd,dhk->bthk", output_shape=(None, 2, 8), name="query")
        self.output_dense = layers.EinsumDense("bthk,hkd->btd", output_shape=(None, 16), name="output_dense")

    def call(self, x):
        heads = self.query(x)
        interleaved = ops.reshape(ops.stack(ops.split(heads, 2, axis=-1), axis=-1), ops.shape(heads))
        return x + self.output_dense(ops.tanh(interleaved) * heads)


class FirstHalf(layers.Layer):
    """Keeps the time steps up to a length its call computes from the input's values, so no
    trace knows the output's time axis."""

    def call(self, x):
        length = ops.cast(ops.sum(ops.cast(x[0, :, 0] > -1e9, "float32")) / 2.0, "int32")
        return x[:, :length]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], None, input_shape[2])


class HalfRotated(layers.Layer):
    """The rotary reshape on a tensor whose time axis stays unknown at any known input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.half = FirstHalf(name="first_half")

    def call(self, x):
        kept = self.half(x)
        return ops.reshape(ops.stack(ops.split(kept, 2, axis=-1), axis=-1), ops.shape(kept))


class RootMeanSquareNorm(layers.Layer):
    """A norm without ``compute_output_shape``: Keras traces its call for its output spec,
    on a sparse placeholder where its input is marked sparse (keras-hub's RMSNormalization)."""

    def call(self, x):
        return x * ops.rsqrt(ops.mean(ops.power(x, 2), axis=-1, keepdims=True) + 1e-6)


class ScaledNormBlock(layers.Layer):
    """Norms a tensor scaled by a number inside its call, as a pre-norm block after
    ``GemmaBackbone``'s embedding scale does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = RootMeanSquareNorm(name="norm")
        self.dense = layers.Dense(16, name="dense")

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, x):
        return x + self.dense(self.norm(x * 0.5))

    def compute_output_shape(self, input_shape):
        return input_shape


def _classifier(block_factory, blocks=2):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 16))
    hidden = inputs
    for index in range(blocks):
        hidden = block_factory(name=f"block_{index}")(hidden)
    pooled = layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, layers.Dense(4, activation="softmax")(pooled))


def _names(model, shape=(4, 12, 16)):
    calls, _ = walk_model(model, "sublayer", [shape])
    return [call.name for call in calls]


def test_a_shape_read_from_an_open_axis_is_replayed_at_the_batch_and_the_step_matches_plain_training():
    model = _classifier(RotatedHeads)
    names = _names(model)
    # keras.ops.reshape's node is named as Keras numbered the operation in the process ("reshape_2").
    assert any(re.fullmatch("block_0/reshape(_[0-9]+)?", name) for name in names) and "block_1/query" in names, names
    x = np.random.default_rng(0).standard_normal((4, 12, 16)).astype("float32")
    graph = _recomputing_step_matches_plain(model, x, "sublayer", 0.8, "chen_sqrtn_ap")
    assert any(name.startswith("block_1/") for name in graph.names)


def test_a_shape_no_trace_knows_keeps_the_layer_whole_with_the_reason_logged(caplog):
    model = _classifier(HalfRotated, blocks=1)
    with caplog.at_level(logging.INFO, logger="tfremat.extract.opening"):
        names = _names(model)
    assert "block_0" in names, names
    assert not any(name.startswith("block_0/") for name in names), names
    assert "fails at the batch's shapes" in caplog.text and "first_half" in caplog.text, caplog.text


def test_a_tensor_scaled_by_a_number_is_dense_to_the_layer_after_it():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 16))
    scaled = layers.Dense(16)(inputs) * 2.0  # Keras 3.15 marks it sparse; the walk must not hand that on
    hidden = ScaledNormBlock(name="block_1")(ScaledNormBlock(name="block_0")(scaled))
    model = keras.Model(inputs, layers.Dense(4, activation="softmax")(layers.GlobalAveragePooling1D()(hidden)))
    names = _names(model)
    assert "block_0/norm" in names and "block_1/dense" in names, names
    x = np.random.default_rng(1).standard_normal((4, 12, 16)).astype("float32")
    _recomputing_step_matches_plain(model, x, "sublayer", 0.8, "chen_sqrtn_ap")


def test_keras_hub_gemma_opens_its_decoder_blocks_and_plans():
    keras_hub = pytest.importorskip("keras_hub")
    import tfremat

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32, head_dim=8,
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile()
    x = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    result = tfremat.plan_model(model, "85%", x, np.ones((2, 8), "int32"), batch_size=2, cost_model="flops",
                                strategy="chen_sqrtn_ap", cache=False, verbose=0)
    assert result.schedule.recompute_count > 0
    names = result.extraction.graph.names
    for block in ("decoder_block_0", "decoder_block_1"):
        assert any(name.startswith(f"gemma_backbone/{block}/attention/reshape") for name in names), names


class RefusesTensors(layers.Layer):
    """Builds symbolically (its output shape is declared) but its call refuses every tensor,
    as a replayed argument TensorFlow cannot convert does."""

    def call(self, x):
        raise TypeError("Failed to convert elements of (4, None) to Tensor")

    def compute_output_shape(self, input_shape):
        return input_shape


def test_a_call_that_fails_to_trace_is_refused_naming_it_and_the_granularity():
    from tfremat.errors import ExtractionError
    from tfremat.extract import extract

    inputs = keras.Input((8,))
    model = keras.Model(inputs, layers.Dense(4, activation="softmax")(RefusesTensors(name="refuses")(inputs)))
    x = np.zeros((4, 8), "float32")
    with pytest.raises(ExtractionError, match=r"'refuses' fails when traced on tensors of shapes \(4, 8\).*"
                                              r"Failed to convert.*granularity=\"layer\"") as raised:
        extract(model, (x, np.eye(4, dtype="float32")), loss="categorical_crossentropy", cost_model="flops",
                use_cache=False)
    assert raised.value.layer == "refuses"
