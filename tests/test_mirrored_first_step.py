"""tfremat.fit's first step under tf.distribute with an empty cache (user_check_3 finding 1).

On a cache miss the extraction measures the optimizer's update on probe variables
(:mod:`tfremat.extract.optimizer_update`); ``fit`` extracts inside the model's strategy
scope, where the probe's variables were once made by the strategy: under MirroredStrategy
the first step failed (Adam: a ``ValueError`` about ``probe_0``; SGD: an ``AssertionError``
in ``apply_gated``), under OneDeviceStrategy Adam's count of concurrent updates came out 0
where it is 1 (TensorFlow's default threads) and AdamW's raised an ``AttributeError``.
"""

import os
import textwrap

import keras
import numpy as np
import tensorflow as tf

from subprocess_result import run_script
from tfremat.extract import optimizer_update

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.path[:0] = [{tests!r}, {root!r}]
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import tfremat
    from tfremat.extract.profile_cache import cache_dir
    from tfremat.numerics import closeness

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 16, 16, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 16)]
    optimizers = {{"adam": lambda: keras.optimizers.Adam(1e-3),
                   "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}}

    def build(name):
        # Per-pixel Dense layers, no convolution: with oneDNN off a convolution's backward holds
        # Eigen's scratch, which leaves no share of activations to save on so small a net; no
        # batch norm after a biased layer (that bias's gradient is rounding noise, which Adam
        # scales to steps of its learning rate, so no two computations of it agree).
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16, 16, 3))]
                                     + [keras.layers.Dense(32, activation="relu") for _ in range(4)]
                                     + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, activation="softmax")])
            model.compile(optimizer=optimizers[name](), loss="categorical_crossentropy", metrics=["accuracy"])
        return model

    found = {{}}
    for name in optimizers:
        plain = build(name)
        expected = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
        model = build(name)
        # As a user calls it: outside the scope (Keras's fit enters it), the default planner.
        history = tfremat.fit(model, "80% of activations", x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        close = closeness([v.numpy() for v in model.variables], [v.numpy() for v in plain.variables])
        (plan,) = history.plans.values()
        found[name] = dict(expected=expected, history=history.history,
                           close=[close.max_tensor_error, close.global_error, close.equal],
                           recomputations=plan.schedule.recompute_count,
                           temporaries=plan.extraction.side_table.fixed_bytes_breakdown["update_temporaries"])
    stored = sorted(os.listdir(os.path.join(cache_dir(), "optimizer_update")))
    print("RESULT", json.dumps(dict(found=found, stored=len(stored), replicas=strategy.num_replicas_in_sync)))
    """
)


def test_fit_under_mirrored_strategy_with_an_empty_cache_trains_as_model_fit(tmp_path):
    cache = tmp_path / "cache"
    result = run_script(tmp_path / "first_step.py", _SCRIPT.format(tests=HERE, root=ROOT), timeout=600,
                        TFREMAT_CACHE_DIR=str(cache))
    assert result["replicas"] == 2
    # Both optimizers' updates were measured in this process (the cache was empty) and stored.
    assert result["stored"] == 2, result["stored"]
    for name, found in result["found"].items():
        max_tensor_error, global_error, equal = found["close"]
        assert equal, (name, max_tensor_error, global_error)
        assert found["history"].keys() == found["expected"].keys(), name
        for key, values in found["expected"].items():
            np.testing.assert_allclose(found["history"][key], values, rtol=1e-4, err_msg=f"{name} {key}")
        assert found["recomputations"] > 0, (name, found)
        # Adam and SGD with momentum hold a weight-sized buffer while a variable updates.
        assert found["temporaries"] > 0, (name, found)


def test_the_update_probe_counts_the_same_inside_a_strategy(monkeypatch):
    """Measured inside OneDeviceStrategy's scope and replica context (where fit extracts), the
    update temporaries are those measured without a strategy (AdamW's probe raised an
    AttributeError there), and the caller's context is left as it was."""
    monkeypatch.setattr(optimizer_update, "_cache", {})
    alone = optimizer_update.update_temporaries(keras.optimizers.AdamW(1e-3), use_cache=False)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    monkeypatch.setattr(optimizer_update, "_cache", {})
    with strategy.scope(), tf.distribute.ReplicaContext(strategy, 0):
        assert optimizer_update._outside_strategy(tf.distribute.has_strategy) is False
        inside = optimizer_update.update_temporaries(keras.optimizers.AdamW(1e-3), use_cache=False)
        assert tf.distribute.get_strategy() is strategy
    assert inside == alone and alone.first > 0, (inside, alone)
