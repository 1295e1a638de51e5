"""The bytes a compiled step requests never exceed the prediction (issue 33, item 1).

GPT-2's and BERT's feed-forward blocks (a Dense with the tanh GELU, then a Dense back)
requested up to 1.12x their prediction: the GELU gradient's temporaries were measured in
one order of its operations and the step ran another, with one more of them live. The
backward's workspace is now the largest over the orders measured, the greediest among them
(:func:`tfremat.extract.analysis._run_greediest`).

With oneDNN on, a max-pool passes a one-byte-per-output workspace from its forward to its
backward that the traced graph does not show: it is now counted as the pool's residual
(:func:`tfremat.extract.analysis._hidden_residual_bytes`; issue 33, item 1b).
"""

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.extract.analysis import analyze_call  # noqa: E402
from tfremat.measure import measure_model  # noqa: E402

TOKENS, WIDTH, HIDDEN, BATCH = 64, 64, 256, 2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _gelu(x):
    return keras.activations.gelu(x, approximate=True)


def _feed_forward_net():
    """Two GPT-2-style feed-forward blocks (pre-norm, residual) and a token classifier."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((TOKENS, WIDTH))
    x = inputs
    for _ in range(2):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(HIDDEN, activation=_gelu)(h)
        x = keras.layers.Add()([x, keras.layers.Dense(WIDTH)(h)])
    model = keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(x))
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model


def test_the_gelu_backward_keeps_its_residuals_and_runs_once():
    """The GELU gradient reads four batch-sized residuals; taken in one call with the weight
    gradients (tfremat.runtime.gradient_order) it runs once, so its temporaries take the place
    of the residuals they consume. Two calls rebuilt it, and the step held four temporaries
    at once beyond them."""
    layer = keras.layers.Dense(HIDDEN, activation=_gelu)
    layer.build((BATCH, TOKENS, WIDTH))
    spec = tf.TensorSpec([BATCH, TOKENS, WIDTH], tf.float32)
    analysis = analyze_call(lambda xs: layer(xs[0], training=True), "dense", [spec], [True],
                            layer.trainable_variables, BATCH, profile=True)
    temporary = BATCH * TOKENS * HIDDEN * 4
    assert analysis.residual_bytes >= 3 * temporary and not analysis.reads_output
    assert analysis.backward_workspace < 2 * temporary


def test_requested_bytes_stay_within_the_prediction():
    """Checkpoint-all: each GELU output is freed before its backward, whose four
    temporaries then set the step's peak."""
    budget = "100%"
    measured = measure_model(_feed_forward_net(), budget, batch_size=BATCH, steps=1, verbose=0)
    assert measured["gradients_match"]
    # Both the prediction and the requested bytes count the same fixed bytes; a few
    # hundred bytes of scalars and shapes are not modelled.
    assert measured["requested_peak_bytes"] <= measured["predicted_peak_bytes"] + 4096, (
        f"{budget}: requested {measured['requested_peak_bytes']} > predicted {measured['predicted_peak_bytes']} "
        f"(oneDNN {os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'on')})")


def _onednn_on() -> bool:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=import-outside-toplevel

    return bool(_pywrap_util_port.IsMklEnabled())


def test_a_max_pool_keeps_onednn_s_workspace_as_a_residual():
    """oneDNN's max-pool workspace (a byte per output element) lives from the forward to the
    backward; TensorFlow's own kernel keeps nothing beyond the input and output it reads."""
    layer = keras.layers.MaxPooling2D()
    shape = (BATCH, 16, 16, 8)
    layer.build(shape)
    analysis = analyze_call(lambda xs: layer(xs[0], training=True), "pool", [tf.TensorSpec(shape, tf.float32)],
                            [True], [], BATCH, profile=True)
    outputs = BATCH * 8 * 8 * 8
    assert analysis.reads_inputs == (0,) and analysis.reads_output
    assert analysis.residual_bytes == (outputs if _onednn_on() else 0)
    assert analysis.small_residual_bytes == 0


def _pooled_conv_net():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    x = inputs
    for filters in (16, 32, 32):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(x)))
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model


def test_a_max_pooling_conv_net_requests_no_more_than_predicted():
    """Before the workspace counted, this net's step requested 14 KiB over its
    prediction with oneDNN on (the pools' workspaces live across the forward)."""
    measured = measure_model(_pooled_conv_net(), "100%", batch_size=8, steps=1, verbose=0)
    assert measured["gradients_match"]
    assert measured["requested_peak_bytes"] <= measured["predicted_peak_bytes"] + 4096, (
        f"requested {measured['requested_peak_bytes']} > predicted {measured['predicted_peak_bytes']} "
        f"(oneDNN {'on' if _onednn_on() else 'off'})")
