"""Subclassed top-level models (layers in ``__init__``, logic in ``call``) are planned and
trained without a wrapper of the user's making (issue 36, item 3): the extraction calls the
model on symbolic inputs shaped like the batch and opens that call into its layer calls
(:func:`tfremat.extract.layer_graph.functional_model`)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.keras import RematCallback  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

QUICK = {"cost_model": "flops", "cache": False, "verbose": 0}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


class ConvBlock(keras.layers.Layer):
    """conv -> batch norm -> relu -> conv -> batch norm, added to the block's input."""

    def __init__(self, filters, seed, **kwargs):
        super().__init__(**kwargs)
        init = lambda k: keras.initializers.GlorotUniform(seed + k)  # noqa: E731
        self.conv1 = keras.layers.Conv2D(filters, 3, padding="same", kernel_initializer=init(0))
        self.bn1 = keras.layers.BatchNormalization()
        self.conv2 = keras.layers.Conv2D(filters, 3, padding="same", kernel_initializer=init(1))
        self.bn2 = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        h = keras.ops.relu(self.bn1(self.conv1(x), training=training))
        return keras.ops.relu(x + self.bn2(self.conv2(h), training=training))


class SmallResNet(keras.Model):
    """A subclassed ResNet as tutorials write one: a stem, two residual blocks, dropout, a head."""

    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(4, 3, padding="same", kernel_initializer=keras.initializers.GlorotUniform(0))
        self.block1 = ConvBlock(4, 10)
        self.block2 = ConvBlock(4, 20)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.dropout = keras.layers.Dropout(0.25, seed=7)
        self.head = keras.layers.Dense(classes, activation="softmax",
                                       kernel_initializer=keras.initializers.GlorotUniform(30))

    def call(self, x, training=None):
        h = self.block2(self.block1(self.stem(x), training=training), training=training)
        return self.head(self.dropout(self.pool(h), training=training))


def _images(count=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 8, 8, 3)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, count)]
    return x, y


def _compiled_resnet():
    model = SmallResNet()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def test_a_subclassed_resnet_trains_with_tfremat_fit_and_the_callback_to_model_fit_weights():
    """Under a budget that recomputes (70% of the activations), tfremat.fit and model.fit with
    the callback end with model.fit's weights, batch-norm statistics included, and the plan's
    nodes are the model's layer calls, not one opaque call of the model."""
    x, y = _images()
    plain = _compiled_resnet()
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    remat = _compiled_resnet()
    history = tfremat.fit(remat, "70%", x, y, batch_size=8, epochs=2, shuffle=False, allocator_check=False, **QUICK)
    (plan,) = history.plans.values()
    assert plan.schedule.recompute_count > 0
    forward = [name for name in plan.extraction.graph.names if not name.endswith("_backward")]
    assert f"{remat.name}/{remat.head.name}" in forward and len(forward) > 10, forward
    assert closeness(remat.get_weights(), plain.get_weights()).equal

    called = _compiled_resnet()
    callback = RematCallback("70%", allocator_check=False, **QUICK)
    called.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    assert list(callback.plans)
    assert closeness(called.get_weights(), plain.get_weights()).equal
