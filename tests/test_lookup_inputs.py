"""Profiling runs a layer's integer and string inputs on the sample batch's values
(tfremat/extract/extractor.py ``_BatchValues``, analysis ``call_values``): a lookup layer
without an OOV index asserts that every input is in its vocabulary, and the zeros and empty
strings profiling once made up crashed ``tfremat.fit`` where ``model.fit`` trained
(benchmarks/results/user_check_6.md, finding 2; keras.io's TabTransformer). Where no value
is known (an input signature) the failure is an ``ExtractionError`` naming the layer."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import ExtractionError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

# The profile cost model: the "flops" one runs no layer on values, so it never met the failure.
PROFILED = {"cost_model": "profile", "cache": False, "verbose": 0, "allocator_check": False}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _lookup_net(lookup, dtype):
    """``lookup`` (3 vocabulary entries, no OOV index) into an embedding and two Dense layers."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2,), dtype=dtype)
    h = keras.layers.Flatten()(keras.layers.Embedding(3, 4)(lookup(inputs)))
    h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _string_lookup():
    return keras.layers.StringLookup(vocabulary=["a", "b", "c"], mask_token=None, num_oov_indices=0,
                                     name="lookup")


def _integer_lookup():
    return keras.layers.IntegerLookup(vocabulary=[5, 7, 9], num_oov_indices=0, name="lookup")


def _words():
    # A tensor: Keras's fit refuses a NumPy array of Python strings (dtype object).
    return tf.constant([["a", "b"], ["c", "a"], ["b", "b"], ["c", "c"], ["a", "c"], ["b", "a"], ["c", "b"], ["a", "a"]])


def _numbers():
    return np.array([[5, 7], [9, 5], [7, 7], [9, 9], [5, 9], [7, 5], [9, 7], [5, 5]], dtype="int64")


@pytest.mark.parametrize("lookup, dtype, inputs", [(_string_lookup, "string", _words),
                                                   (_integer_lookup, "int64", _numbers)])
def test_a_lookup_without_oov_index_trains_as_model_fit_does(lookup, dtype, inputs):
    x = inputs()
    y = np.arange(8, dtype="float32").reshape(8, 1) / 8
    plain, remat = _lookup_net(lookup(), dtype), _lookup_net(lookup(), dtype)
    remat.set_weights(plain.get_weights())
    for model in (plain, remat):
        model.compile(keras.optimizers.SGD(0.1), "mse")
    plain.fit(x, y, batch_size=4, shuffle=False, epochs=1, verbose=0)
    history = tfremat.fit(remat, "min", x=x, y=y, batch_size=4, shuffle=False, epochs=1, **PROFILED)
    (plan,) = history.plans.values()
    assert plan.schedule.recompute_count > 0  # "min" recomputes: the lookups run again in the step
    difference = closeness(remat.get_weights(), plain.get_weights())
    assert difference.equal, difference
    # Two steps moved the weights: the comparison is not of untouched models.
    assert not closeness(remat.get_weights(), _lookup_net(lookup(), dtype).get_weights()).equal


def test_a_lookup_fed_zeros_is_refused_naming_the_layer_and_what_to_pass():
    model = _lookup_net(_integer_lookup(), "int64")
    with pytest.raises(ExtractionError) as refusal:
        extract(model, input_signature=[tf.TensorSpec((4, 2), tf.int64)], loss="mse", use_cache=False)
    message = str(refusal.value)
    assert refusal.value.layer == "lookup"
    assert "'lookup'" in message and "zeros" in message and "sample_batch=(x, y)" in message


def test_a_value_is_cut_or_repeated_to_the_spec_and_floats_stay_made_up():
    from tfremat.extract.analysis import _samples

    words = tf.constant([["a"], ["b"], ["c"], ["d"]])
    longer, shorter, floats = _samples([tf.TensorSpec((6, 1), tf.string), tf.TensorSpec((2, 1), tf.string),
                                        tf.TensorSpec((4, 1), tf.float32)], [words, words, tf.ones((4, 1))])
    assert longer.numpy().ravel().tolist() == [b"a", b"b", b"c", b"d", b"a", b"b"]
    assert shorter.numpy().ravel().tolist() == [b"a", b"b"]
    assert not np.any(floats.numpy() == 1.0)
