"""A subclassed model whose ``call`` branches in Python on ``training`` (issue 33): the
extraction records the call as ``model.fit`` runs it (``training=True``), so the layers under
``if training:`` are part of the graph, the model splits into its layer calls, and the plan
can recompute; the step draws the same noise and dropout masks as plain training."""

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.extract.layer_graph import functional_model, walk_model  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

QUICK = {"cost_model": "flops", "cache": False, "verbose": 0}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


class NoisyNet(keras.Model):
    """The keras.io pattern: noise and dropout applied only ``if training:``, with the
    signature's default ``training=False`` (which Keras records on a symbolic call)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.convs = [keras.layers.Conv2D(4, 3, padding="same", activation="relu",
                                          kernel_initializer=keras.initializers.GlorotUniform(k))
                      for k in range(4)]
        self.noise = keras.layers.GaussianNoise(0.1, seed=1)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.dropout = keras.layers.Dropout(0.3, seed=2)
        self.head = keras.layers.Dense(3, activation="softmax", kernel_initializer=keras.initializers.GlorotUniform(9))

    def call(self, x, training=False):
        if training:
            x = self.noise(x, training=training)
        for conv in self.convs:
            x = conv(x)
        x = self.pool(x)
        if training:
            x = self.dropout(x, training=training)
        return self.head(x)


def _images(count=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 12, 12, 3)).astype("float32")
    y = rng.integers(0, 3, count).astype("int32")
    return x, y


def _compiled():
    model = NoisyNet()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def test_the_training_branch_is_recorded_so_the_model_splits_into_its_layer_calls():
    x, _ = _images(4)
    model = NoisyNet()
    called = [call.layer for call in walk_model(functional_model(model, x))[0]]
    assert called == [model.noise, *model.convs, model.pool, model.dropout, model.head]


def test_min_recomputes_below_checkpoint_all_and_trains_like_model_fit(caplog):
    """At "min" the plan recomputes and predicts less than checkpoint-all; three steps of
    tfremat.fit end with model.fit's weights and the same noise and dropout seed states."""
    x, y = _images()
    plain = _compiled()
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    remat = _compiled()
    with caplog.at_level(logging.WARNING, logger="tfremat"):
        history = tfremat.fit(remat, "min", x, y, batch_size=8, epochs=1, shuffle=False, allocator_check=False,
                              **QUICK)
    (plan,) = history.plans.values()
    assert plan.schedule.recompute_count > 0
    assert plan.predicted_peak_bytes < plan.checkpoint_all_peak_bytes
    assert "stays one node" not in caplog.text
    assert closeness(remat.get_weights(), plain.get_weights()).equal
    for remat_state, plain_state in zip(remat.non_trainable_variables, plain.non_trainable_variables):
        np.testing.assert_array_equal(remat_state.numpy(), plain_state.numpy(), err_msg=plain_state.path)


class ScaledNet(keras.Model):
    """Reads a weight of its own in ``call``, outside any sublayer call: it cannot be
    opened, so the whole model stays one node."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.convs = [keras.layers.Conv2D(4, 3, padding="same", activation="relu") for _ in range(3)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(3)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        x = x * self.scale
        for conv in self.convs:
            x = conv(x)
        return self.head(self.pool(x))


def test_a_model_that_stays_one_node_is_warned_about_once_with_the_reason_and_the_remedy(caplog, monkeypatch):
    from tfremat.extract import opening

    monkeypatch.setattr(opening, "_reasons_logged", set())
    x, _ = _images(4)
    with caplog.at_level(logging.WARNING, logger="tfremat"):
        for _ in range(2):
            names = [call.name for call in walk_model(functional_model(ScaledNet(name="scaled"), x))[0]]
    assert names == ["scaled"]
    (record,) = [r for r in caplog.records if "stays one node" in r.getMessage()]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "'scaled'" in message and "100%" in message and "scale" in message and "move each such variable" in message
