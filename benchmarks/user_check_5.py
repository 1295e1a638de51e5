"""A fifth new user (session 29's task U): keras.io-style models tfremat's authors did not write.

The earlier checks (:mod:`user_check`, :mod:`user_check_3`, :mod:`user_check_4`) trained
keras.applications' EfficientNetB0, ConvNeXtTiny and MobileNetV3Small, keras-hub's GPT-2, BERT and
DistilBERT, a VAE, a GAN and MirroredStrategy over two logical CPUs. Each check here is a model
written as keras.io or keras.applications users write it, trained through the entry point such a
user picks:

- ``cct_stochastic_depth``: keras.io's Compact Convolutional Transformer (a convolutional
  tokenizer, transformer blocks with a ``StochasticDepth`` layer drawing from a seed generator,
  sequence pooling), ``tfremat.fit`` at ``"60% of activations"``;
- ``perceiver_latents``: a Perceiver-style model (a learned latent array in a custom layer,
  cross-attention to the inputs, latent self-attention), ``model.fit`` with ``RematCallback("min")``;
- ``text_mask_tfdata``: keras.io's text classifier (``TokenAndPositionEmbedding`` with
  ``mask_zero=True``, a transformer block) on a ``tf.data.Dataset`` of ``(x, y, sample_weight)``,
  ``tfremat.fit`` at ``"75%"``;
- ``text_mask_copy_back``: the same model's refusals at ``"75%"``: seconds to the refusal with the
  allocator check (the planner's smallest plan read from the allocator) and with
  ``allocator_check=False`` (the planner's figure), in turns; then every figure named (by the
  planner's refusal, and by the check's refusal of the planner's own figure) copied back verbatim;
- ``class_weight_cnn``: a small CNN with ``class_weight``, ``tfremat.fit`` at a size in MiB
  picked from ``tfremat.plan_model``'s checkpoint-all peak;
- ``mirrored_one_device``: a CNN built and compiled under ``tf.distribute.MirroredStrategy`` on
  the one CPU, ``tfremat.fit`` at ``"70% of activations"``;
- ``jit_transformer``: a transformer classifier compiled with ``jit_compile=True``, at ``"70%"``;
- ``efficientnetv2b0``: ``keras.applications.EfficientNetV2B0(weights=None)`` at 64x64, batch 8, ``"80%"``;
- ``vae_fit_refused``: keras.io's VAE (a ``train_step`` override) given to ``tfremat.fit``: the
  refusal's text, and how long it took;
- ``cli_measure``: ``tfremat measure --model FILE.keras --batch 8 --budget 60% --steps 5 --json`` on
  a saved model of built-in layers only.

Per training check, as :mod:`user_check_4` does (``run_pair``, ``step_measures``, ``child_row``,
``listed_row`` of :mod:`user_check_3` and ``step_peaks_callback`` of :mod:`user_check_4` reused):
plain ``model.fit`` and ``tfremat.fit`` from the same seeds; the weights after step 1, step 5 and
the last step against plain's, bitwise or within :func:`tfremat.numerics.closeness`; the
allocator's peak of every step after the first inside both fits; three allocator reads and the
requested bytes of the step afterwards; its time against a plain tape step in turns over the
plan's ``predicted_time_over_plain``; every TensorFlow E-level line and every tfremat warning on
stderr.

Run: ``python benchmarks/user_check_5.py`` (writes the rows to ``benchmarks/results/user_check_5.json``
after each check and prints the table); ``--only`` check names (substrings), ``--list``,
``--timeout`` seconds per check, ``--from_json`` to print the table of saved rows (comma separated
files; a later row of a check replaces an earlier one).
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat

from user_check import _mib  # noqa: E402
import user_check_3  # noqa: E402
from user_check_3 import _images, _training, child_row, json_rows_main, run_pair  # noqa: E402
from user_check_4 import _nbytes, _peaks_cell, step_peaks_callback, time_cells  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "user_check_5.json")
TRAIN_STEPS = 9  # the first step plans; the 8 after it are read
COMPARED_STEPS = (1, 5)  # weights compared after these steps, and after the last

# name: (budget, what the check exercises)
CHECKS = {
    "cct_stochastic_depth": ("60% of activations", "keras.io CCT: conv tokenizer, StochasticDepth, sequence pooling"),
    "perceiver_latents": ("min", "Perceiver-style latents + cross-attention; model.fit(callbacks=[RematCallback])"),
    "text_mask_tfdata": ("75%", "TokenAndPositionEmbedding(mask_zero), transformer; tf.data (x, y, sample_weight)"),
    "text_mask_copy_back": ("75%", "text_mask's refusals: seconds to refuse with and without the allocator read, "
                                   "every figure named copied back"),
    "class_weight_cnn": ("70% of plan_model's checkpoint-all peak, in MiB", "CNN, class_weight"),
    "mirrored_one_device": ("70% of activations", "MirroredStrategy on the one CPU"),
    "jit_transformer": ("70%", "transformer classifier, compile(jit_compile=True)"),
    "efficientnetv2b0": ("80%", "keras.applications.EfficientNetV2B0(weights=None), 64x64"),
    "vae_fit_refused": ("70%", "keras.io VAE (train_step override) given to tfremat.fit"),
    "cli_measure": ("60%", "tfremat measure --json on a saved built-in-layers model"),
}


# ---------------------------------------------------------------- weights at given steps (child)

def weights_at_callback(steps=COMPARED_STEPS):
    """A Keras callback keeping the model's weights after each of ``steps`` (1-based)."""
    import keras

    class WeightsAt(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.weights = {}

        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 in steps:
                self.weights[batch + 1] = self.model.get_weights()

    return WeightsAt()


def _weights_cell(actual, expected) -> dict:
    from tfremat.numerics import closeness

    close = closeness(actual, expected)
    return {"bitwise": all((a == b).all() for a, b in zip(actual, expected)), "close": close.equal,
            "error": close.max_tensor_error}


def fit_compared(make, fit_kwargs, budget, timing_batch, batch_bytes, extra=None) -> dict:
    """:func:`user_check_3.run_pair` (``extra`` passed on) with the weights after steps 1 and 5
    and the allocator's peak of every step read in both fits (:func:`user_check_4.step_peaks_callback`)."""
    plain_peaks, remat_peaks = step_peaks_callback(batch_bytes), step_peaks_callback(batch_bytes)
    plain_weights, remat_weights = weights_at_callback(), weights_at_callback()
    row, _, _, remat = run_pair(make, fit_kwargs, budget, timing_batch, extra=extra,
                                plain_callbacks=[plain_peaks, plain_weights], remat_callbacks=[remat_peaks, remat_weights])
    row["plain_step_peaks"] = plain_peaks.peaks[1:]
    row["step_peaks"] = remat_peaks.peaks[1:] if "error" not in row else []
    row["budget_as_written"] = budget
    if "error" not in row:
        row["weights_at"] = {str(step): _weights_cell(remat_weights.weights[step], plain_weights.weights[step])
                             for step in COMPARED_STEPS if step in plain_weights.weights}
    if remat is not None:
        row["step_sequential"] = [bool(getattr(p, "step_sequential", False)) for p in remat.plans.values()]
    return row


# ---------------------------------------------------------------- models (child)

def _compiled(model, loss="sparse_categorical_crossentropy", **kwargs):
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"], **kwargs)
    return model


def _cct(image=32, dim=64, blocks=2, heads=2):
    """keras.io's "Compact Convolutional Transformers" example, at a small size."""
    import keras
    from keras import layers, ops

    class StochasticDepth(layers.Layer):
        def __init__(self, drop_prob, **kwargs):
            super().__init__(**kwargs)
            self.drop_prob = drop_prob
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, x, training=None):
            if training:
                keep_prob = 1 - self.drop_prob
                shape = (ops.shape(x)[0],) + (1,) * (len(x.shape) - 1)
                random_tensor = keep_prob + keras.random.uniform(shape, 0, 1, seed=self.seed_generator)
                return (x / keep_prob) * ops.floor(random_tensor)
            return x

    inputs = keras.Input((image, image, 3))
    h = inputs
    for filters in (dim // 2, dim):  # the convolutional tokenizer
        h = layers.Conv2D(filters, 3, padding="same", use_bias=False, activation="relu")(h)
        h = layers.MaxPooling2D(3, 2, padding="same")(h)
    h = layers.Reshape((-1, dim))(h)
    rates = [0.1 * i / blocks for i in range(blocks)]
    for rate in rates:
        x1 = layers.LayerNormalization(epsilon=1e-5)(h)
        attended = layers.MultiHeadAttention(num_heads=heads, key_dim=dim, dropout=0.1)(x1, x1)
        h = layers.Add()([StochasticDepth(rate)(attended), h])
        x3 = layers.LayerNormalization(epsilon=1e-5)(h)
        x3 = layers.Dense(dim, activation="gelu")(x3)
        x3 = layers.Dropout(0.1)(x3)
        h = layers.Add()([StochasticDepth(rate)(x3), h])
    h = layers.LayerNormalization(epsilon=1e-5)(h)
    weights = ops.softmax(layers.Dense(1)(h), axis=1)  # sequence pooling
    pooled = ops.squeeze(ops.matmul(ops.transpose(weights, (0, 2, 1)), h), -2)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(pooled), name="cct")


def _perceiver(length=64, features=16, latents=16, dim=64):
    """A Perceiver-style classifier: a learned latent array cross-attends to the inputs,
    then attends to itself (keras.io's Perceiver example, without the image patches)."""
    import keras
    from keras import layers, ops

    class Latents(layers.Layer):
        """The learned latent array, repeated over the batch."""

        def build(self, shape):
            self.latents = self.add_weight(shape=(latents, dim), initializer="random_normal", name="latents")

        def call(self, x):
            return ops.broadcast_to(self.latents[None], (ops.shape(x)[0], latents, dim))

    inputs = keras.Input((length, features))
    data = layers.Dense(dim)(inputs)
    queries = Latents()(inputs)
    h = layers.LayerNormalization()(queries)
    cross = layers.MultiHeadAttention(num_heads=1, key_dim=dim)(h, layers.LayerNormalization()(data))
    h = layers.Add()([cross, queries])
    for _ in range(2):
        x1 = layers.LayerNormalization()(h)
        h = layers.Add()([layers.MultiHeadAttention(num_heads=4, key_dim=dim // 4)(x1, x1), h])
        x2 = layers.LayerNormalization()(h)
        h = layers.Add()([layers.Dense(dim)(layers.Dense(2 * dim, activation="gelu")(x2)), h])
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, layers.Dense(5, activation="softmax")(h), name="perceiver")


def _text_transformer(length=64, vocabulary=2000, dim=32):
    """keras.io's "Text classification with Transformer", with ``mask_zero=True``."""
    import keras
    from keras import layers, ops

    class TokenAndPositionEmbedding(layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_emb = layers.Embedding(vocab_size, embed_dim, mask_zero=True)
            self.pos_emb = layers.Embedding(maxlen, embed_dim)

        def call(self, x):
            positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1], 1))
            return self.token_emb(x) + positions

        def compute_mask(self, x, mask=None):
            return self.token_emb.compute_mask(x)

    inputs = keras.Input((length,), dtype="int32")
    h = TokenAndPositionEmbedding(length, vocabulary, dim)(inputs)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=dim)(h, h)
    h = layers.LayerNormalization(epsilon=1e-6)(h + layers.Dropout(0.1)(attended))
    ff = layers.Dense(dim)(layers.Dense(64, activation="relu")(h))
    h = layers.LayerNormalization(epsilon=1e-6)(h + layers.Dropout(0.1)(ff))
    h = layers.GlobalAveragePooling1D()(h)
    h = layers.Dense(20, activation="relu")(layers.Dropout(0.1)(h))
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(layers.Dropout(0.1)(h)), name="text_transformer")


def _cnn(name="cnn"):
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (32, 32, 64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = layers.BatchNormalization()(h)
    h = layers.GlobalAveragePooling2D()(layers.MaxPooling2D()(h))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(layers.Dropout(0.2)(h)), name=name)


def _builtin_transformer(length=32, features=16, dim=64):
    """A transformer classifier of built-in layers only (it saves and loads without custom objects)."""
    import keras
    from keras import layers

    inputs = keras.Input((length, features))
    h = layers.Dense(dim)(inputs)
    for _ in range(2):
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=dim // 4)(h, h)
        h = layers.LayerNormalization()(layers.Add()([h, attended]))
        ff = layers.Dense(dim)(layers.Dense(2 * dim, activation="gelu")(h))
        h = layers.LayerNormalization()(layers.Add()([h, ff]))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, layers.Dense(4, activation="softmax")(h), name="builtin_transformer")


def _sequences(n, length=32, features=16, classes=4, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, length, features)).astype("float32"), rng.integers(0, classes, n)


# ---------------------------------------------------------------- checks (child)

def _arrays_fit(make, budget, x, y, batch, **fit_extra):
    import tensorflow as tf

    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False, **fit_extra}
    return fit_compared(make, fit_kwargs, budget, (tf.constant(x[:batch]), tf.constant(y[:batch])),
                        _nbytes(x[:batch], y[:batch]))


def check_cct_stochastic_depth(budget, work):
    x, y = _images(16 * TRAIN_STEPS)
    return _arrays_fit(lambda: _compiled(_cct()), budget, x, y, 16)


def check_perceiver_latents(budget, work):
    import keras
    import tensorflow as tf

    from tfremat.keras import RematCallback

    x, y = _sequences(16 * TRAIN_STEPS, length=64, classes=5)
    batch = 16
    timing = (tf.constant(x[:batch]), tf.constant(y[:batch]))
    # The user passes the callback to model.fit; run_pair calls tfremat.fit, which is
    # model.fit with it, so the fit is written out here.
    plain_peaks, remat_peaks = step_peaks_callback(_nbytes(*timing)), step_peaks_callback(_nbytes(*timing))
    plain_weights, remat_weights = weights_at_callback(), weights_at_callback()
    keras.utils.set_random_seed(0)
    plain = _compiled(_perceiver())
    plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[plain_peaks, plain_weights])
    keras.utils.set_random_seed(0)
    model = _compiled(_perceiver())
    callback = RematCallback(budget)
    row = {"budget_as_written": budget}
    try:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[callback, remat_peaks, remat_weights])
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"
        return row
    row["plain_step_peaks"], row["step_peaks"] = plain_peaks.peaks[1:], remat_peaks.peaks[1:]
    row["weights_at"] = {str(s): _weights_cell(remat_weights.weights[s], plain_weights.weights[s])
                         for s in COMPARED_STEPS}
    row["weights_at"]["last"] = _weights_cell(model.get_weights(), plain.get_weights())
    row.update(user_check_3.step_measures(callback, model, timing))
    row["allocator_peaks_attr"] = {str(k): v for k, v in getattr(callback, "allocator_peaks", {}).items()}
    row["graph_nodes"] = [len(p.extraction.graph.names) for p in callback.plans.values()]
    return row


def _text_mask_data(batch=16, length=64):
    """The text checks' data: token rows padded with zeros, labels, and the dataset of
    ``(x, y, sample_weight)`` batches."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = batch * TRAIN_STEPS
    x = rng.integers(1, 2000, (n, length)).astype("int32")
    for row_, keep in enumerate(rng.integers(8, length, n)):
        x[row_, keep:] = 0
    y = rng.integers(0, 2, n)
    sample_weight = rng.uniform(0.5, 2.0, n).astype("float32")
    return x, y, tf.data.Dataset.from_tensor_slices((x, y, sample_weight)).batch(batch).prefetch(2)


def check_text_mask_tfdata(budget, work):
    import tensorflow as tf

    batch = 16
    x, y, dataset = _text_mask_data(batch)
    fit_kwargs = {"x": dataset, "epochs": 1}
    return fit_compared(lambda: _compiled(_text_transformer(x.shape[1])), fit_kwargs, budget,
                        (tf.constant(x[:batch]), tf.constant(y[:batch])), _nbytes(x[:batch], y[:batch]))


def check_text_mask_copy_back(budget, work, rounds=3):
    """Seconds to ``budget``'s refusal with the check's read and without (``allocator_check=False``),
    in turns, the load before each; then each figure named fitted at verbatim, refusals followed
    once more (a second copy-back is what the fix removes)."""
    import re

    import keras

    import tfremat

    _, _, dataset = _text_mask_data()

    def refusal(at, **options):
        keras.utils.set_random_seed(0)
        model = _compiled(_text_transformer(64))
        began = time.perf_counter()
        try:
            tfremat.fit(model, at, dataset, epochs=1, verbose=0, **options)
            return time.perf_counter() - began, None, "trained"
        except Exception as error:
            seconds, text = time.perf_counter() - began, f"{type(error).__name__}: {error}"
            named = re.search(r'smallest feasible budget found is "?([\d.]+(?: ?[KMG]i?B|%)(?: of activations)?)', text)
            return seconds, named.group(1) if named else None, text

    row = {"refusal_seconds": {"checked": [], "unchecked": []}, "loads": [], "named": {}, "copy_backs": []}
    refusal(budget, allocator_check=False)  # the profile and the schedules cached first: not timed
    for _ in range(rounds):
        for mode, options in (("checked", {}), ("unchecked", {"allocator_check": False})):
            row["loads"].append(os.getloadavg()[0])
            seconds, named, text = refusal(budget, **options)
            row["refusal_seconds"][mode].append(seconds)
            row["named"][mode] = named
            row.setdefault("texts", {})[mode] = text
    for source in ("checked", "unchecked"):  # the planner's figure read, and the planner's own
        at, chain = row["named"][source], []
        while at is not None and len(chain) < 3:
            _, named, text = refusal(at)
            chain.append({"budget": at, "outcome": "trained" if named is None and text == "trained" else text})
            at = named
        row["copy_backs"].append({"from": source, "chain": chain})
    checked, unchecked = (sorted(row["refusal_seconds"][m]) for m in ("checked", "unchecked"))
    row["outcome"] = (f"refusal of {budget}: {checked[len(checked) // 2]:.2f} s with the read, "
                      f"{unchecked[len(unchecked) // 2]:.2f} s without (medians); " +
                      "; ".join(" -> ".join([budget] + [c["budget"] for c in chain["chain"]]) +
                                (" trains" if chain["chain"] and chain["chain"][-1]["outcome"] == "trained" else " refused")
                                for chain in row["copy_backs"]))
    return row


def check_class_weight_cnn(budget, work):
    import keras

    import tfremat

    batch = 16
    x, y = _images(batch * TRAIN_STEPS)
    class_weight = {k: 1.0 + 0.25 * k for k in range(10)}
    keras.utils.set_random_seed(0)
    probe = tfremat.plan_model(_compiled(_cnn()), "80%", x[:batch], y[:batch], batch_size=batch, verbose=0)
    budget = f"{int(0.7 * probe.checkpoint_all_peak_bytes / 2**20)}MiB"
    row = _arrays_fit(lambda: _compiled(_cnn()), budget, x, y, batch, class_weight=class_weight)
    row["checkpoint_all_from_plan_model"] = probe.checkpoint_all_peak_bytes
    return row


def check_mirrored_one_device(budget, work):
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["CPU:0"])

    def make():
        with strategy.scope():
            return _compiled(_cnn())

    x, y = _images(16 * TRAIN_STEPS)
    row = _arrays_fit(make, budget, x, y, 16)
    row["replicas"] = strategy.num_replicas_in_sync
    return row


def check_jit_transformer(budget, work):
    x, y = _sequences(16 * TRAIN_STEPS)
    return _arrays_fit(lambda: _compiled(_builtin_transformer(), jit_compile=True), budget, x, y, 16)


def check_efficientnetv2b0(budget, work):
    import keras

    def make():
        return _compiled(keras.applications.EfficientNetV2B0(input_shape=(64, 64, 3), weights=None, classes=10))

    x, y = _images(8 * TRAIN_STEPS, (64, 64, 3))
    return _arrays_fit(make, budget, x, y, 8)


def check_vae_fit_refused(budget, work):
    import keras
    import tensorflow as tf
    from keras import layers, ops

    import tfremat

    class Sampling(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    class VAE(keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(data, reconstruction),
                                                       axis=(1, 2)))
                kl_loss = ops.mean(ops.sum(-0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var)), axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return {"loss": total_loss}

    latent = 2
    image = keras.Input((28, 28, 1))
    h = layers.Flatten()(layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(image))
    h = layers.Dense(16, activation="relu")(h)
    z_mean, z_log_var = layers.Dense(latent)(h), layers.Dense(latent)(h)
    encoder = keras.Model(image, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    code = keras.Input((latent,))
    h = layers.Reshape((14, 14, 32))(layers.Dense(14 * 14 * 32, activation="relu")(code))
    decoder = keras.Model(code, layers.Conv2DTranspose(1, 3, strides=2, padding="same", activation="sigmoid")(h))
    vae = VAE(encoder, decoder)
    vae.compile(optimizer="adam")
    x = _images(64, (28, 28, 1))[0]
    began = time.perf_counter()
    try:
        tfremat.fit(vae, budget, x, batch_size=16, epochs=1, verbose=0)
        return {"outcome": "trained"}
    except Exception as error:
        return {"outcome": f"{type(error).__name__}: {error}", "seconds_to_refusal": time.perf_counter() - began}


def check_cli_measure(budget, work):
    import keras

    path = os.path.join(work, "builtin_transformer.keras")
    keras.utils.set_random_seed(0)
    _compiled(_builtin_transformer()).save(path)
    done = subprocess.run([sys.executable, "-m", "tfremat", "measure", "--model", path, "--batch", "8", "--budget",
                           budget, "--steps", "5", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    row = {"rc": done.returncode, "stderr_tail": done.stderr[-2500:]}
    try:
        row["measure"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        row["stdout_tail"] = done.stdout[-2500:]
    return row


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "user_check_5_")


# ---------------------------------------------------------------- parent: run, collect, render

def _exactness(row) -> str:
    cells = []
    for step, cell in (row.get("weights_at") or {}).items():
        cells.append(f"{step}: " + ("bitwise" if cell["bitwise"] else
                                    f"close {cell['error']:.1e}" if cell["close"] else f"**DIFFER {cell['error']:.1e}**"))
    training = _training(row) if row.get("history_diff") is not None else ""
    return "; ".join(cells + ([f"last: {training}"] if training else []))


def _messages(row) -> str:
    sample = row.get("stderr_sample", [])
    errors = [line for line in sample if line.startswith("E0000") or line[:1] == "E" and line[1:5].isdigit()]
    warnings = [line for line in sample if "tfremat" in line.lower() and "warn" in line.lower()]
    return f"{row.get('stderr_lines', 0)} lines, {len(errors)} E-level, {len(warnings)} tfremat warnings"


def _measure_columns(row) -> dict:
    """A ``cli_measure`` row with ``tfremat measure --json``'s report in the table's columns
    (its allocator read is the step's measured peak; gradients after one step)."""
    report = row["measure"]
    return {**row, "budget_bytes": report["budget_bytes"], "fit_predicted": report["predicted_peak_bytes"],
            "fit_requested": report["requested_peak_bytes"], "fit_allocator": [report["measured_peak_bytes"]],
            "fit_planned_time": report["predicted_time_over_plain"], "fit_time": report["time_over_plain"],
            "fit_time_quartiles": report["time_over_plain_quartiles"],
            "outcome": f"gradients_match {report['gradients_match']} (error {report['grad_error']:.1e})"}


def render(rows) -> str:
    out = ["| check | budget | exactness (step: weights) | predicted MiB | requested MiB | alloc MiB (3 reads, max) | "
           "budget MiB | in-fit step peaks MiB (steps) | plain in-fit MiB | planned | time/plain | time ratio | "
           "first s (plain) | stderr |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        row = _measure_columns(row) if row.get("measure") else row
        budget = row.get("budget_bytes")
        alloc = max(row["fit_allocator"]) if row.get("fit_allocator") else None
        alloc_cell = _mib(alloc) + (f" **{alloc / budget:.3f}x**" if alloc and budget and alloc > budget else "")
        planned = row.get("fit_planned_time")
        written = row.get("budget_as_written", row["budget"])
        if row.get("retried_at"):
            written = " -> ".join(str(tried) for tried in [written, *row["retried_at"]])  # a float budget too
        exact = _exactness(row) or (row.get("error") or row.get("outcome") or "")[:200]
        cells = [row["check"], written, exact, _mib(row.get("fit_predicted")), _mib(row.get("fit_requested")),
                 alloc_cell, _mib(budget), _peaks_cell(row.get("step_peaks"), budget),
                 _peaks_cell(row.get("plain_step_peaks"), None), "" if planned is None else f"{planned:.3f}"]
        cells += time_cells(row)
        cells.append(_messages(row))
        out.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    return json_rows_main(argv, __doc__, __file__, CHECKS, child, render, DEFAULT_JSON, "tfremat_user_check_5_")


if __name__ == "__main__":
    sys.exit(main())
