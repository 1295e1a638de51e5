"""A layer's profile-cache signature leaves out the names Keras gives layers automatically,
also those of layers serialized inside it, so a second model of the same layers finds the
first's profiles (user_check_4 finding 5: each retry re-profiled a TimeDistributed model)."""

import keras

from tfremat.extract.profile_cache import layer_signature


def test_a_wrapped_layers_automatic_name_does_not_change_the_signature():
    first = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="gelu"))
    second = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="gelu"))
    assert first.layer.name != second.layer.name
    assert layer_signature(first) == layer_signature(second)
    pair = [keras.layers.Bidirectional(keras.layers.LSTM(4)) for _ in range(2)]
    assert layer_signature(pair[0]) == layer_signature(pair[1])


def test_what_changes_the_computation_still_changes_it():
    wide = keras.layers.TimeDistributed(keras.layers.Dense(16, activation="gelu"))
    narrow = keras.layers.TimeDistributed(keras.layers.Dense(8, activation="gelu"))
    assert layer_signature(wide) != layer_signature(narrow)
    half = keras.layers.Dense(8, dtype="mixed_float16")
    full = keras.layers.Dense(8, dtype="float32")
    assert layer_signature(half) != layer_signature(full)
