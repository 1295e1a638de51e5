"""A third new user (session 27's task E): the ways people call ``fit``, on models nobody here wrote.

:mod:`user_check` trained mostly with plain ``fit(x, y)``. Each check here trains one model
twice from the same seeds and data, once with plain Keras ``model.fit`` and once with
:func:`tfremat.fit` (the :class:`tfremat.keras.RematCallback` inside), called the way the check
names:

- ``dataset_callbacks``: a ``tf.data.Dataset`` (batched, prefetched, a smaller last batch)
  with ``validation_data`` and EarlyStopping / ModelCheckpoint (``.keras``), the saved model
  reloaded and predicting;
- ``multi_io``: two inputs, two outputs, a loss dict, ``loss_weights`` and metrics per output;
- ``sample_class_weight``: ``sample_weight`` then ``class_weight``;
- ``lstm_mask_lambda``: ``Embedding(mask_zero=True)`` + LSTM over padded sequences, a custom
  ``keras.ops``-only layer and a ``Lambda``;
- ``mirrored_2cpu``: ``tf.distribute.MirroredStrategy`` over two logical CPU devices;
- ``accum_lr_schedule``: the optimizer's ``gradient_accumulation_steps`` with a LearningRateSchedule;
- ``mixed_cnn``: ``mixed_float16`` on a small CNN (Keras wraps the optimizer in a LossScaleOptimizer);
- ``distilbert_hub``: keras-hub's DistilBertBackbone at a tiny config;
- ``xla_share``: ``model.compile(jit_compile=True)`` at a share of the peak.

Per check: whether both ran (a refusal's text kept whole), the per-epoch logs of both (largest
difference per key), the weights after (:func:`tfremat.numerics.closeness` over all of
``get_weights``, batch-norm statistics included), the plans (one per
batch shape), and on the step of the first batch shape: the allocator's peak (three reads of
:func:`tfremat.allocator_check.allocator_peak`), the bytes it requests, its time against a plain
tape step in turns over the plan's ``predicted_time_over_plain``, and the seconds from ``fit``
starting to the first batch ending (plain Keras's too).

Every check runs in its own process with TensorFlow's default threads, oneDNN on, the BFC
allocator on CPU and an empty tfremat cache, as :mod:`user_check` does (its helpers are reused).

Run: ``python benchmarks/user_check_3.py`` (writes ``benchmarks/results/user_check_3.md`` and
``.json``); ``--only`` check names (substrings), ``--list``, ``--timeout`` seconds per check,
``--from_json`` to render saved rows.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat

from user_check import TIME_BAND, _fresh, _mib, chosen_checks, run_child, run_rows, saved_rows  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "user_check_3.md")
MiB = 2**20
TIMED_ROUNDS = 5

# name: (budget, what the check exercises)
CHECKS = {
    "dataset_callbacks": ("70% of activations", "tf.data (batch 32, last 8, prefetch), validation_data, "
                                                "EarlyStopping, ModelCheckpoint .keras, reload + predict"),
    "multi_io": ("60% of activations", "2 inputs / 2 outputs, loss dict, loss_weights, metrics per output"),
    "sample_class_weight": ("70% of activations", "sample_weight, then class_weight (two fits)"),
    "lstm_mask_lambda": ("85%", "Embedding(mask_zero=True) + LSTM, ops-only custom layer, Lambda"),
    "mirrored_2cpu": ("70% of activations", "MirroredStrategy over 2 logical CPUs"),
    "accum_lr_schedule": ("70% of activations", "Adam(gradient_accumulation_steps=2, ExponentialDecay)"),
    "mixed_cnn": ("70% of activations", "mixed_float16 small CNN (LossScaleOptimizer)"),
    "distilbert_hub": ("60% of activations", "keras-hub DistilBertBackbone, tiny config"),
    "xla_share": ("70%", "compile(jit_compile=True)"),
}


# ---------------------------------------------------------------- models and data (child process)

def _cnn(inputs_shape=(32, 32, 3), classes=10, dropout=True, name="cnn"):
    import keras
    from keras import layers

    inputs = keras.Input(inputs_shape)
    h = inputs
    for filters in (32, 32, 32):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = layers.BatchNormalization()(h)
    h = layers.MaxPooling2D()(h)
    for filters in (64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    h = layers.Dropout(0.3)(h) if dropout else h
    # float32 output under mixed_float16, as Keras's mixed precision guide writes it
    return keras.Model(inputs, layers.Dense(classes, activation="softmax", dtype="float32")(h), name=name)


def _images(n, shape=(32, 32, 3), classes=10, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.random((n, *shape), dtype=np.float32), rng.integers(0, classes, n)


def _multi_io():
    import keras
    from keras import layers

    image = keras.Input((32, 32, 3), name="image")
    meta = keras.Input((8,), name="meta")
    h = image
    for filters in (16, 16, 32, 32, 32, 32):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    m = layers.Dense(16, activation="relu")(meta)
    joined = layers.Concatenate()([h, m])
    joined = layers.Dense(32, activation="relu")(joined)
    out_class = layers.Dense(5, activation="softmax", name="class")(joined)
    out_score = layers.Dense(1, name="score")(joined)
    return keras.Model({"image": image, "meta": meta}, {"class": out_class, "score": out_score}, name="multi_io")


def _lstm_mask_lambda():
    import keras
    from keras import layers, ops

    class GatedScale(layers.Layer):
        """An ops-only custom layer (no sublayers): x * sigmoid(x * w) per feature, mask passed on."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True

        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

        def call(self, x):
            return x * ops.sigmoid(x * self.w)

    tokens = keras.Input((100,), dtype="int32")
    h = layers.Embedding(1000, 64, mask_zero=True)(tokens)
    h = layers.LSTM(64, return_sequences=True)(h)
    h = GatedScale()(h)
    h = layers.LSTM(64, return_sequences=True)(h)
    h = GatedScale()(h)
    h = layers.GlobalAveragePooling1D()(h)  # masked mean
    h = layers.Lambda(lambda t: ops.tanh(t) * 2.0)(h)
    return keras.Model(tokens, layers.Dense(1, activation="sigmoid")(h), name="lstm_mask_lambda")


def _padded_tokens(n, length=100, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(1, 1000, (n, length)).astype("int32")
    for row, keep in enumerate(rng.integers(5, length, n)):
        x[row, keep:] = 0
    return x, rng.integers(0, 2, n).astype("float32")


def _distilbert():
    import keras
    import keras_hub

    backbone = keras_hub.models.DistilBertBackbone(vocabulary_size=500, num_layers=2, num_heads=2, hidden_dim=64,
                                                   intermediate_dim=128, max_sequence_length=64)
    inputs = {n: keras.Input((64,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    hidden = backbone(inputs)
    first = keras.layers.Lambda(lambda t: t[:, 0, :])(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(first), name="distilbert_hub")


# ---------------------------------------------------------------- one check (child process)

def _grab_remat():
    """A callback put after tfremat.fit's RematCallback: the callback itself, read from the
    train function it installed, and the seconds to the first batch's end."""
    import keras

    class Grab(keras.callbacks.Callback):
        remat = None
        first_step_s = None

        def on_train_begin(self, logs=None):
            self.began = time.perf_counter()
            owner = getattr(self.model.train_function, "__self__", None)
            if owner is not None and type(owner).__name__ == "RematCallback":
                self.remat = owner

        def on_train_batch_end(self, index, logs=None):
            if self.first_step_s is None:
                self.first_step_s = time.perf_counter() - self.began

    return Grab()


def _history_differences(plain: dict, remat: dict) -> dict:
    keys = sorted(set(plain) | set(remat))
    out = {}
    for key in keys:
        if key not in plain or key not in remat or len(plain[key]) != len(remat[key]):
            out[key] = None  # missing on one side, or a different number of epochs
        else:
            out[key] = max(abs(float(a) - float(b)) for a, b in zip(plain[key], remat[key]))
    return out


def run_pair(make, fit_kwargs, budget, timing_batch, *, extra=None, plain_callbacks=None, remat_callbacks=None):
    """Trains ``make()`` with plain ``model.fit(**fit_kwargs)`` then a fresh ``make()`` with
    ``tfremat.fit(model, budget, **fit_kwargs)``, retrying a refused budget at the one the refusal
    names; ``extra(plain_model, model)`` adds columns before the step is read and timed.

    Returns ``(row, plain model, model, RematCallback or None)``."""
    import keras

    import tfremat
    from tfremat.numerics import closeness

    row = {}
    keras.utils.set_random_seed(0)
    plain_model = make()
    grab_plain = _grab_remat()
    try:
        plain_history = plain_model.fit(**fit_kwargs, callbacks=[*(plain_callbacks or []), grab_plain], verbose=0)
        row["plain_first_step_s"] = grab_plain.first_step_s
    except Exception as error:
        row["plain_error"] = f"{type(error).__name__}: {error}"
        plain_history = None
    history = None
    for attempt in range(3):  # a refused budget is retried (twice) at the smallest budget the refusal names
        keras.utils.set_random_seed(0)
        model = make()
        grab = _grab_remat()
        try:
            history = tfremat.fit(model, budget, **fit_kwargs, callbacks=[*(remat_callbacks or []), grab], verbose=1)
            break
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            suggested = re.search(r'smallest feasible budget found is "?([\d.]+(?: ?[KMG]i?B|%)(?: of activations)?)',
                                  text)
            if attempt < 2 and suggested:
                budget = suggested.group(1)
                row.setdefault("refused", []).append(text)
                row.setdefault("retried_at", []).append(budget)
                continue
            row["error"] = text
            return row, plain_model, model, None
    row["first_step_s"] = grab.first_step_s
    row["epochs"] = len(history.history.get("loss", []))
    if plain_history is not None:
        row["history_diff"] = _history_differences(plain_history.history, history.history)
        row["plain_epochs"] = len(plain_history.history.get("loss", []))
        weights = closeness(model.get_weights(), plain_model.get_weights())
        row["weights_error"], row["weights_global_error"] = weights.max_tensor_error, weights.global_error
        row["weights_equal"] = weights.equal
        row["weights_bitwise"] = all((a == b).all() for a, b in zip(model.get_weights(), plain_model.get_weights()))
        row["history_final"] = {k: float(v[-1]) for k, v in history.history.items()}
    if extra is not None:  # before the step's reads and timing, which run it
        row.update(extra(plain_model, model))
    remat = grab.remat
    row["plans"] = [{"shape": str(key), "budget": p.budget_bytes, "predicted": p.predicted_peak_bytes,
                     "checkpoint_all": p.checkpoint_all_peak_bytes, "overhead": p.overhead,
                     "planned_time": p.predicted_time_over_plain, "planned_with": getattr(p, "planned_with", None)}
                    for key, p in history.plans.items()]
    if remat is not None:
        row.update(step_measures(remat, model, timing_batch))
    return row, plain_model, model, remat


def raw_allocator_reads(remat, model, batch, reads: int = 3) -> list[int]:
    """Allocator reads of the first batch shape's step, each as it is, without the margin
    :func:`tfremat.allocator_check.held_peak` adds; the state the runs change is put back."""
    from tfremat.runtime.memory import measure_step_peak
    from tfremat.runtime.state import state_restored

    step = remat._steps[next(iter(remat.plans))]
    xb, yb = batch
    variables = list(model.variables) + list(model.optimizer.variables)
    with state_restored(variables):
        return [measure_step_peak(lambda a, b: step(a, b, None), xb, yb, resident=variables, warmup=1 if i == 0 else 0)
                for i in range(reads)]


def step_measures(remat, model, batch) -> dict:
    """The first batch shape's step: three allocator reads and the peak the check holds it to,
    requested bytes, time against plain."""
    import tensorflow as tf

    from tfremat.allocator_check import allocator_peak
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.runtime.timing import time_in_turns

    out = {}
    key = next(iter(remat.plans))
    result, step = remat.plans[key], remat._steps[key]
    xb, yb = batch
    out.update({"budget_bytes": result.budget_bytes, "fit_predicted": result.predicted_peak_bytes,
                "fit_planned_time": result.predicted_time_over_plain, "fit_overhead": result.overhead,
                "checkpoint_all_peak": result.checkpoint_all_peak_bytes})
    if remat._strategy is not None:
        # Both replicas run on one allocator (logical CPUs): no per-replica read, and the
        # plain tape step is no distributed one.
        out["memory_error"] = "not read: the replicas (logical CPUs) share one allocator"
        return out
    try:
        out["fit_allocator"] = raw_allocator_reads(remat, model, batch)
        out["fit_allocator_held"] = allocator_peak(step, model, xb, yb)
        out["fit_requested"] = allocator_peak(step, model, xb, yb, count="requested")
    except Exception as error:
        out["memory_error"] = f"{type(error).__name__}: {error}"[:400]
    try:
        loss_fn = result.extraction.side_table.loss_fn
        plain = plain_train_step(model, loss_fn, _fresh(model.optimizer))
        if remat._jit_compile:
            plain = tf.function(plain.python_function, jit_compile=True)
        timing = time_in_turns(lambda: step(xb, yb, None), lambda: plain(xb, yb), TIMED_ROUNDS)
        out["fit_time"], out["fit_time_quartiles"] = timing.ratio, list(timing.ratio_quartiles)
    except Exception as error:
        out["timing_error"] = f"{type(error).__name__}: {error}"[:400]
    return out


def check_dataset_callbacks(budget, work):
    import keras
    import numpy as np
    import tensorflow as tf

    x, y = _images(200)  # batches of 32: six, then one of 8
    xv, yv = _images(64, seed=1)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).prefetch(tf.data.AUTOTUNE)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(32).prefetch(tf.data.AUTOTUNE)

    def make():
        model = _cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def callbacks(tag):
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
                keras.callbacks.ModelCheckpoint(os.path.join(work, f"{tag}.keras"), monitor="val_loss",
                                                save_best_only=True)]

    def reload(plain_model, model):
        loaded = {tag: keras.models.load_model(os.path.join(work, f"{tag}.keras")) for tag in ("plain", "remat")}
        p = {tag: m.predict(xv[:16], verbose=0) for tag, m in loaded.items()}
        return {"reload_predict_max_diff": float(np.abs(p["plain"] - p["remat"]).max()),
                "reload_predict_shape": list(p["remat"].shape),
                "reloaded_compiled": loaded["remat"].optimizer is not None}

    row, *_ = run_pair(make, {"x": train, "validation_data": val, "epochs": 3}, budget,
                       (tf.constant(x[:32]), tf.constant(y[:32])), extra=reload,
                       plain_callbacks=callbacks("plain"), remat_callbacks=callbacks("remat"))
    return row


def check_multi_io(budget, work):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = 48
    x = {"image": rng.random((n, 32, 32, 3), dtype=np.float32), "meta": rng.random((n, 8), dtype=np.float32)}
    y = {"class": rng.integers(0, 5, n), "score": rng.random((n, 1), dtype=np.float32)}

    def make():
        model = _multi_io()
        model.compile(optimizer="adam", loss={"class": "sparse_categorical_crossentropy", "score": "mse"},
                      loss_weights={"class": 1.0, "score": 0.5},
                      metrics={"class": ["accuracy"], "score": ["mae"]})
        return model

    batch = tf.nest.map_structure(lambda a: tf.constant(a[:16]), (x, y))
    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 16, "epochs": 1, "shuffle": False}, budget, batch)
    return row


def check_sample_class_weight(budget, work):
    import numpy as np
    import tensorflow as tf

    x, y = _images(96)
    sample_weight = np.random.default_rng(2).random(96).astype("float32") * 2

    def make():
        model = _cnn(dropout=False)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    batch = (tf.constant(x[:32]), tf.constant(y[:32]))
    common = {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}
    row, *_ = run_pair(make, {**common, "sample_weight": sample_weight}, budget, batch)
    second, *_ = run_pair(make, {**common, "class_weight": {c: 1.0 + c / 5 for c in range(10)}}, budget, batch)
    row["class_weight"] = {k: second.get(k) for k in ("error", "plain_error", "history_diff", "weights_error",
                                                      "weights_global_error", "weights_equal", "weights_bitwise",
                                                      "first_step_s")}
    return row


def check_lstm_mask_lambda(budget, work):
    import tensorflow as tf

    x, y = _padded_tokens(96)

    def make():
        model = _lstm_mask_lambda()
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
        return model

    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}, budget,
                       (tf.constant(x[:32]), tf.constant(y[:32])))
    return row


def check_mirrored_2cpu(budget, work):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = _images(96)

    def make():
        with strategy.scope():
            model = _cnn()
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    # The step is planned for one replica's half of the batch of 32.
    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}, budget,
                       (tf.constant(x[:16]), tf.constant(y[:16])))
    row["replicas"] = strategy.num_replicas_in_sync
    return row


def check_accum_lr_schedule(budget, work):
    import keras
    import tensorflow as tf

    x, y = _images(128)

    def make():
        model = _cnn()
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=1, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=schedule, gradient_accumulation_steps=2),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def iterations(plain_model, model):
        return {"iterations": [int(plain_model.optimizer.iterations.numpy()), int(model.optimizer.iterations.numpy())]}

    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}, budget,
                       (tf.constant(x[:32]), tf.constant(y[:32])), extra=iterations)
    return row


def check_mixed_cnn(budget, work):
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _images(96)

    def make():
        model = _cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def optimizer(plain_model, model):
        return {"optimizer": type(model.optimizer).__name__}

    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}, budget,
                       (tf.constant(x[:32]), tf.constant(y[:32])), extra=optimizer)
    return row


def check_distilbert_hub(budget, work):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = 24
    tokens = rng.integers(1, 500, (n, 64)).astype("int32")
    mask = np.ones((n, 64), dtype="int32")
    for row_, keep in enumerate(rng.integers(16, 64, n)):
        tokens[row_, keep:], mask[row_, keep:] = 0, 0
    x = {"token_ids": tokens, "padding_mask": mask}
    y = rng.integers(0, 3, n)

    def make():
        model = _distilbert()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    batch = tf.nest.map_structure(lambda a: tf.constant(a[:8]), (x, y))
    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 8, "epochs": 1, "shuffle": False}, budget, batch)
    return row


def check_xla_share(budget, work):
    import tensorflow as tf

    x, y = _images(96)

    def make():
        model = _cnn(dropout=False)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      jit_compile=True)
        return model

    row, *_ = run_pair(make, {"x": x, "y": y, "batch_size": 32, "epochs": 1, "shuffle": False}, budget,
                       (tf.constant(x[:32]), tf.constant(y[:32])))
    return row


def child_row(check_fn: Callable[[str, str], dict], budget: str, prefix: str) -> None:
    """The child process's part: ``check_fn(budget, work folder)``'s row printed for
    :func:`user_check.run_child` (an error of the check's own setup as the row)."""
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as work:
            row = check_fn(budget, work)
    except Exception as error:  # outside the fits: the check's own setup
        row = {"error": f"check setup: {type(error).__name__}: {error}"}
    print("USER_CHECK_ROW " + json.dumps(row, default=float), flush=True)


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "user_check_3_")


# ---------------------------------------------------------------- parent: run, collect, render

def listed_row(script: str, checks: dict, check: str, timeout: float, cache_dir: str) -> dict:
    """``check`` of ``checks`` (name -> (budget, what)) run by ``script`` in a fresh process."""
    row = run_child(script, [check], timeout, cache_dir, sample=80)
    row.update({"check": check, "budget": checks[check][0], "what": checks[check][1]})
    return row


def run_check(check: str, timeout: float, cache_dir: str) -> dict:
    return listed_row(__file__, CHECKS, check, timeout, cache_dir)


def json_rows_main(argv, doc: str, script: str, checks: dict, child_fn: Callable[[str], None],
                   render_fn: Callable[[list], str], default_json: str, prefix: str) -> int:
    """The command line of a user check whose rows are kept as JSON (user_check_4, _5):
    ``--only``/``--list`` choose checks of ``checks`` (name -> (budget, what)), each run by
    ``script`` in a fresh process (``--child``: ``child_fn``), the rows saved after each
    check and rendered by ``render_fn``; ``--from_json`` renders saved rows. ``doc``: the
    script's docstring, whose first paragraph describes it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--only", help="check names or substrings, comma separated")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per check (default 400)")
    parser.add_argument("--json", default=default_json, help="the rows as JSON (default %(default)s)")
    parser.add_argument("--from_json", help="render saved rows (comma separated files; later rows replace earlier)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_fn(args.child)
        return 0
    if args.from_json:
        rows = saved_rows(args.from_json)
        print(render_fn([rows[n] for n in checks if n in rows]))
        return 0
    names = chosen_checks(checks, args.only)
    if args.list or not names:
        print("\n".join(f"{n}: {checks[n][1]} at {checks[n][0]}" for n in checks))
        return 0 if args.list else 2
    done = []

    def run_and_save(name, cache):  # the rows so far are saved after each check
        done.append(listed_row(script, checks, name, args.timeout, cache))
        with open(args.json, "w") as handle:
            json.dump(done, handle, indent=1, default=float)
        return done[-1]

    rows = run_rows(names, run_and_save, prefix)
    with open(args.json, "w") as handle:  # with the last row's load, which run_rows adds
        json.dump(rows, handle, indent=1, default=float)
    print(render_fn(rows))
    return 0


def _training(row) -> str:
    if row.get("plain_error"):
        return "plain Keras failed"
    if row.get("weights_error") is None:
        return ""
    worst = max((v for v in row["history_diff"].values() if v is not None), default=0.0)
    missing = [k for k, v in row["history_diff"].items() if v is None]
    text = "bitwise" if row["weights_bitwise"] else ("close" if row["weights_equal"] else "**DIFFER**")
    text += f" (w {row['weights_error']:.1e}, logs {worst:.1e})"
    if missing:
        text += f" **logs differ in {', '.join(missing)}**"
    return text


def _notes(row) -> str:
    notes = []
    if row.get("error"):
        notes.append(row["error"][:400].replace("|", "/").replace("\n", " "))
    for budget, refusal in zip([row["budget"], *row.get("retried_at", [])], row.get("refused", [])):
        notes.append(f"refused at {budget} (\"{refusal[:170]}...\")")
    if row.get("retried_at") and not row.get("error"):
        notes.append(f"ran at the budget the refusal named, {row['retried_at'][-1]}")
    if row.get("plain_error"):
        notes.append("plain: " + row["plain_error"][:200].replace("|", "/").replace("\n", " "))
    if len(row.get("plans", [])) > 1:
        notes.append(f"{len(row['plans'])} batch shapes planned")
    if row.get("epochs") is not None and row.get("plain_epochs") is not None:
        notes.append(f"{row['epochs']} epochs (plain {row['plain_epochs']})")
    for key in ("reload_predict_max_diff", "iterations", "optimizer", "replicas"):
        if key in row:
            notes.append(f"{key} {row[key]}")
    if row.get("class_weight"):
        notes.append("class_weight: " + (row["class_weight"].get("error") or _training(row["class_weight"])))
    for key in ("memory_error", "timing_error"):
        if row.get(key):
            notes.append(f"{key}: {row[key][:200]}")
    if row.get("plain_first_step_s") is not None:
        notes.append(f"plain first step {row['plain_first_step_s']:.1f} s")
    notes.append(f"{row['stderr_lines']} stderr lines")
    return "; ".join(notes)


def render(rows, argv, header) -> str:
    out = ["# A third new user: the ways people call fit, on models nobody here wrote", "",
           f"Command: `python benchmarks/user_check_3.py {' '.join(argv)}`. {header}", "",
           "Each row trains one model twice from the same seeds and data: plain `model.fit` and `tfremat.fit` "
           "called the same way (one process per row, TensorFlow's default threads, oneDNN on, BFC allocator, "
           "empty tfremat cache). `training`: the weights after (all of `get_weights`) against plain Keras's, "
           "bitwise or within `tfremat.numerics.closeness` (w: largest per-tensor error), and the largest "
           "difference of any per-epoch log (loss, metrics, val_*). Memory and time are of the step of the first "
           "batch shape: `alloc` the largest of three allocator reads as they are (the check's margin not added), "
           "`requested` the profiler's bytes; "
           f"`time ratio` is measured time/plain (median of {TIMED_ROUNDS} rounds in turns) over the plan's "
           f"predicted time/plain (band {TIME_BAND[0]}-{TIME_BAND[1]}). `first s`: `fit` start to the first "
           "batch's end.", "",
           "| check | calls fit with | budget | training | predicted MiB | requested MiB | alloc MiB | budget MiB | "
           "planned | time/plain | time ratio | first s | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        alloc = max(row["fit_allocator"]) if row.get("fit_allocator") and None not in row["fit_allocator"] else None
        cells = [row["check"], row["what"], row["budget"], _training(row), _mib(row.get("fit_predicted")),
                 _mib(row.get("fit_requested")), _mib(alloc), _mib(row.get("budget_bytes"))]
        if alloc is not None and row.get("budget_bytes") and alloc > row["budget_bytes"]:
            cells[6] += f" **{alloc / row['budget_bytes']:.3f}x**"
        if row.get("fit_requested") and row.get("fit_predicted") and row["fit_requested"] > row["fit_predicted"]:
            cells[5] += f" **{row['fit_requested'] / row['fit_predicted']:.3f}x pred**"
        planned = row.get("fit_planned_time")
        measured = row.get("fit_time")
        cells.append("" if planned is None else f"{planned:.3f}")
        if measured is not None:
            q = row["fit_time_quartiles"]
            ratio = measured / planned
            cells += [f"{measured:.3f} ({q[0]:.2f}-{q[1]:.2f})",
                      f"{ratio:.3f}" + ("" if TIME_BAND[0] <= ratio <= TIME_BAND[1] else " **out**")]
        else:
            cells += ["", ""]
        cells.append("" if row.get("first_step_s") is None else f"{row['first_step_s']:.1f}")
        cells.append(_notes(row))
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="check names or substrings, comma separated")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per check (default 240)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the markdown table (default %(default)s)")
    parser.add_argument("--json", help="the rows as JSON (default: --out with .json)")
    parser.add_argument("--from_json", help="render saved rows (comma separated files; later rows replace earlier)")
    parser.add_argument("--measured_at", help="the tree the rows were measured at, for the header (default: this "
                                              "checkout's git log -1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    json_out = args.json or os.path.splitext(args.out)[0] + ".json"
    if args.from_json:
        rows = saved_rows(args.from_json)
        rows = [rows[n] for n in CHECKS if n in rows]
    else:
        names = chosen_checks(CHECKS, args.only)
        if args.list or not names:
            print("\n".join(f"{n}: {CHECKS[n][1]} at {CHECKS[n][0]}" for n in CHECKS))
            return 0 if args.list else 2
        rows = run_rows(names, lambda name, cache: run_check(name, args.timeout, cache), "tfremat_user_check_3_")
    commit = subprocess.run(["git", "log", "-1", "--oneline"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    loads = [r["load"] for r in rows if "load" in r]
    at = args.measured_at or f"`{commit}`"
    header = (f"At {at}; 1-minute load average {min(loads):.1f}-{max(loads):.1f} at the rows' starts "
              "(2 shared cores).") if loads else ""
    with open(args.out, "w") as handle:
        handle.write(render(rows, sys.argv[1:] if argv is None else argv, header))
    with open(json_out, "w") as handle:
        json.dump(rows, handle, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
