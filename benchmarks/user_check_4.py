"""A fourth new user (session 28's task E): models and calls the three earlier checks did not try.

:mod:`user_check` and :mod:`user_check_3` trained keras.applications and keras-hub models and
called ``fit`` in many ways. Each check here is keras.io-style code a user brings:

- ``shared_layers``: one ``Conv2D`` and one ``Dense`` each applied twice in a functional model,
  at a share of the step (``"80%"``);
- ``add_loss_activity``: an ``activity_regularizer`` and a layer calling ``add_loss`` (the
  README says both are refused, naming the layer and what to do);
- ``subclassed_training``: a subclassed ``Model`` whose ``call`` branches in Python on
  ``training`` (noise and dropout only when training), at ``"min"``;
- ``wavenet_bytes``: a WaveNet-like stack of causal dilated ``Conv1D`` with gated activations,
  residual and skip sums, at a size with a unit (``"NN MB"``) picked, as a user would, from
  ``tfremat.plan_model``'s checkpoint-all peak;
- ``attention_mask_groupnorm``: ``MultiHeadAttention`` with an ``attention_mask`` input,
  ``GroupNormalization`` and ``TimeDistributed(Dense)``, at ``"70% of activations"``;
- ``gan_custom_loop``: a DCGAN trained by a hand-written ``tf.function`` loop with two
  optimizers, each update's ``tf.GradientTape`` replaced by ``tfremat.value_and_grad``
  (discriminator at ``"min"``, generator at ``"absolute min"``), against the same loop with tapes;
- ``callback_direct``: ``model.fit(callbacks=[RematCallback("absolute min")])``;
- ``maxbatch_then_fit``: ``tfremat.max_batch_size(model, "NN MiB")``, then ``tfremat.fit`` at the
  batch it returns and that budget; the command-line tool (``--help``, ``plan``, ``maxbatch``) on
  the saved model;
- ``mobilenetv3small``: ``keras.applications.MobileNetV3Small(weights=None)`` at 64x64, batch 8, ``"80%"``.

Per check, as :mod:`user_check_3` does (its :func:`~user_check_3.run_pair` and
:func:`~user_check_3.step_measures` are reused): plain ``model.fit`` and ``tfremat.fit`` from the
same seeds, the weights after compared bitwise or by :func:`tfremat.numerics.closeness`, the
plan, three allocator reads and the requested bytes of the step, its time against a plain tape
step in turns, and the first step's seconds. Added here: the allocator's peak of every training
step inside ``fit`` (statistics reset at each batch's start, read at its end; at least 10
steps after the first), in the graph's convention (the rise above the bytes in use at the
batch's start, plus the model's and optimizer's variables and the batch, as
:func:`tfremat.runtime.memory.measure_step_peak` counts), for plain Keras's ``fit`` too.

Every check runs in its own process with TensorFlow's default threads, oneDNN on, the BFC
allocator and an empty tfremat cache (:func:`user_check.run_child`).

Run: ``python benchmarks/user_check_4.py`` (writes the rows to ``benchmarks/results/user_check_4.json``
after each check and prints the table, as in ``benchmarks/results/user_check_4.md``); ``--only`` check
names (substrings), ``--list``, ``--timeout`` seconds per check, ``--from_json`` to print the table of
saved rows (comma separated files; a later row of a check replaces an earlier one).
"""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat

from user_check import TIME_BAND, _mib  # noqa: E402
from user_check_3 import (_images, _training, child_row, json_rows_main, raw_allocator_reads, run_pair,  # noqa: E402
                          step_measures)

DEFAULT_JSON = os.path.join(HERE, "results", "user_check_4.json")
MiB = 2**20
TRAIN_STEPS = 13  # the first step plans; the 12 after it are read
TIMED_ROUNDS = 5

# name: (budget, what the check exercises)
CHECKS = {
    "shared_layers": ("80%", "one Conv2D and one Dense each applied twice"),
    "add_loss_activity": ("80%", "activity_regularizer; a layer calling add_loss"),
    "subclassed_training": ("min", "subclassed Model, Python branch on training (noise, dropout)"),
    "wavenet_bytes": ("75% of plan_model's checkpoint-all peak, in MB", "causal dilated Conv1D, gated, residual + skip"),
    "attention_mask_groupnorm": ("70% of activations", "MultiHeadAttention(attention_mask), GroupNormalization, "
                                                       "TimeDistributed(Dense)"),
    "gan_custom_loop": ("D: min, G: absolute min", "DCGAN, hand-written tf.function loop, two optimizers, "
                                                   "value_and_grad per update"),
    "callback_direct": ("absolute min", "model.fit(callbacks=[RematCallback(...)])"),
    "maxbatch_then_fit": ("32MiB", "tfremat.max_batch_size, then fit at its batch; the CLI on the saved model"),
    "mobilenetv3small": ("80%", "keras.applications.MobileNetV3Small(weights=None), 64x64"),
}


# ---------------------------------------------------------------- per-step allocator reads (child)

def _resident(model) -> int:
    from tfremat.runtime.memory import resident_bytes

    optimizer_variables = list(model.optimizer.variables) if model.optimizer is not None else []
    return resident_bytes(list(model.variables) + optimizer_variables)


def step_peaks_callback(batch_bytes: int):
    """A Keras callback reading the allocator's peak of each training step, in the graph's
    convention: the rise above the bytes in use at the batch's start, plus the variables and
    the batch (:func:`tfremat.runtime.memory.measure_step_peak`)."""
    import keras
    import tensorflow as tf

    class StepPeaks(keras.callbacks.Callback):
        peaks: list

        def on_train_begin(self, logs=None):
            self.peaks = []

        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")
            self.start = tf.config.experimental.get_memory_info("CPU:0")["current"]

        def on_train_batch_end(self, batch, logs=None):
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            self.peaks.append(int(peak - self.start + _resident(self.model) + batch_bytes))

    return StepPeaks()


def _nbytes(*arrays) -> int:
    import numpy as np
    import tensorflow as tf

    return int(sum(np.asarray(a).nbytes for a in tf.nest.flatten(arrays)))


def fit_with_step_peaks(make, fit_kwargs, budget, timing_batch, batch_bytes, **kwargs) -> dict:
    """:func:`user_check_3.run_pair` with the allocator's peak of every step read in both fits."""
    plain_peaks, remat_peaks = step_peaks_callback(batch_bytes), step_peaks_callback(batch_bytes)
    row, plain_model, model, remat = run_pair(make, fit_kwargs, budget, timing_batch, plain_callbacks=[plain_peaks],
                                              remat_callbacks=[remat_peaks], **kwargs)
    row["plain_step_peaks"] = plain_peaks.peaks[1:]
    row["step_peaks"] = remat_peaks.peaks[1:] if "error" not in row else []
    row["budget_as_written"] = budget
    if remat is not None and remat._strategy is None:
        row["raw_allocator"] = raw_allocator_reads(remat, model, timing_batch)
    if remat is not None and getattr(remat, "allocator_peaks", None):
        row["allocator_peaks_attr"] = {str(k): v for k, v in remat.allocator_peaks.items()}
    return row


# ---------------------------------------------------------------- models (child)

def _shared_layers():
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    stem = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    shared_conv = layers.Conv2D(32, 3, padding="same", activation="relu", name="shared_conv")
    h = shared_conv(stem)
    h = layers.BatchNormalization()(h)
    h = shared_conv(h)  # the same kernel again
    h = layers.Add()([h, stem])
    h = layers.GlobalAveragePooling2D()(h)
    shared_dense = layers.Dense(32, activation="relu", name="shared_dense")
    h = shared_dense(shared_dense(h))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="shared_layers")


def _wavenet(length=512, channels=32, dilations=(1, 2, 4, 8, 16, 32)):
    import keras
    from keras import layers

    inputs = keras.Input((length, 1))
    h = layers.Conv1D(channels, 2, padding="causal")(inputs)
    skips = []
    for rate in dilations:
        tanh = layers.Conv1D(channels, 2, dilation_rate=rate, padding="causal", activation="tanh")(h)
        gate = layers.Conv1D(channels, 2, dilation_rate=rate, padding="causal", activation="sigmoid")(h)
        z = layers.Multiply()([tanh, gate])
        skips.append(layers.Conv1D(channels, 1)(z))
        h = layers.Add()([h, layers.Conv1D(channels, 1)(z)])
    out = layers.Activation("relu")(layers.Add()(skips))
    out = layers.Conv1D(channels, 1, activation="relu")(out)
    return keras.Model(inputs, layers.Conv1D(1, 1)(out), name="wavenet")


def _attention_groupnorm(tokens=64, dim=64):
    import keras
    from keras import layers

    x_in = keras.Input((tokens, dim), name="x")
    mask_in = keras.Input((tokens, tokens), dtype="bool", name="mask")
    h = layers.TimeDistributed(layers.Dense(dim, activation="gelu"))(x_in)
    for _ in range(2):
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=dim // 4)(h, h, attention_mask=mask_in)
        h = layers.GroupNormalization(groups=8)(layers.Add()([h, attended]))
        ff = layers.TimeDistributed(layers.Dense(2 * dim, activation="relu"))(h)
        h = layers.GroupNormalization(groups=8)(layers.Add()([h, layers.Dense(dim)(ff)]))
    h = layers.GlobalAveragePooling1D()(h)
    return keras.Model({"x": x_in, "mask": mask_in}, layers.Dense(4, activation="softmax")(h), name="attn_gn")


def _subclassed():
    import keras
    from keras import layers

    class NoisyNet(keras.Model):
        """keras.io-style subclassed model: noise and dropout only when training, a Python branch."""

        def __init__(self):
            super().__init__()
            self.convs = [layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(4)]
            self.noise = layers.GaussianNoise(0.1, seed=1)
            self.pool = layers.GlobalAveragePooling2D()
            self.dropout = layers.Dropout(0.3, seed=2)
            self.head = layers.Dense(10, activation="softmax")

        def call(self, x, training=False):
            if training:
                x = self.noise(x, training=training)
            for conv in self.convs:
                x = conv(x)
            x = self.pool(x)
            if training:
                x = self.dropout(x, training=training)
            return self.head(x)

    return NoisyNet()


# ---------------------------------------------------------------- checks (child)

def _compiled(model, loss="sparse_categorical_crossentropy"):
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    return model


def _image_fit(make, budget, batch=16, shape=(32, 32, 3), **kwargs):
    import tensorflow as tf

    x, y = _images(batch * TRAIN_STEPS, shape)
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}
    return fit_with_step_peaks(make, fit_kwargs, budget, (tf.constant(x[:batch]), tf.constant(y[:batch])),
                               _nbytes(x[:batch], y[:batch]), **kwargs)


def check_shared_layers(budget, work):
    return _image_fit(lambda: _compiled(_shared_layers()), budget)


def check_add_loss_activity(budget, work):
    import keras
    from keras import layers

    import tfremat

    class PenaltyLayer(layers.Layer):
        def call(self, x):
            self.add_loss(1e-3 * keras.ops.mean(keras.ops.square(x)))
            return x

    def activity():
        inputs = keras.Input((32, 32, 3))
        h = layers.Conv2D(16, 3, padding="same", activation="relu", activity_regularizer="l2")(inputs)
        h = layers.GlobalAveragePooling2D()(h)
        return _compiled(keras.Model(inputs, layers.Dense(10, activation="softmax")(h)))

    def add_loss():
        inputs = keras.Input((32, 32, 3))
        h = PenaltyLayer(name="penalty")(layers.Conv2D(16, 3, padding="same", activation="relu")(inputs))
        h = layers.GlobalAveragePooling2D()(h)
        return _compiled(keras.Model(inputs, layers.Dense(10, activation="softmax")(h)))

    x, y = _images(32)
    row = {}
    for name, make in (("activity_regularizer", activity), ("add_loss", add_loss)):
        model = make()
        plain_loss = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"][-1]
        model = make()
        began = time.perf_counter()
        try:
            tfremat.fit(model, budget, x, y, batch_size=16, epochs=1, verbose=0)
            row[name] = {"outcome": "trained", "plain_loss": plain_loss}
        except Exception as error:
            row[name] = {"outcome": f"{type(error).__name__}: {error}", "plain_loss": plain_loss,
                         "seconds_to_refusal": time.perf_counter() - began}
    return row


def check_subclassed_training(budget, work):
    return _image_fit(lambda: _compiled(_subclassed()), budget)


def check_wavenet_bytes(budget, work):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat

    batch, length = 8, 512
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * TRAIN_STEPS, length, 1)).astype("float32")
    y = np.roll(x, -1, axis=1)

    def make():
        return _compiled(_wavenet(length), loss="mse")

    keras.utils.set_random_seed(0)
    probe = tfremat.plan_model(make(), "80%", x[:batch], y[:batch], batch_size=batch, verbose=0)
    megabytes = int(0.75 * probe.checkpoint_all_peak_bytes / 1e6)
    budget = f"{megabytes}MB"
    row = fit_with_step_peaks(make, {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}, budget,
                              (tf.constant(x[:batch]), tf.constant(y[:batch])), _nbytes(x[:batch], y[:batch]))
    row["checkpoint_all_from_plan_model"] = probe.checkpoint_all_peak_bytes
    return row


def check_attention_mask_groupnorm(budget, work):
    import numpy as np
    import tensorflow as tf

    batch, tokens = 8, 64
    rng = np.random.default_rng(0)
    n = batch * TRAIN_STEPS
    lengths = rng.integers(16, tokens + 1, n)
    valid = np.arange(tokens)[None, :] < lengths[:, None]
    mask = valid[:, None, :] & valid[:, :, None]  # (n, query, key): padding masked both ways
    x = {"x": rng.standard_normal((n, tokens, 64)).astype("float32"), "mask": mask}
    y = rng.integers(0, 4, n)
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}
    timing = tf.nest.map_structure(lambda a: tf.constant(a[:batch]), (x, y))
    return fit_with_step_peaks(lambda: _compiled(_attention_groupnorm(tokens)), fit_kwargs, budget, timing,
                               _nbytes(tf.nest.map_structure(lambda a: a[:batch], x), y[:batch]))


def _gan_models(latent=32):
    import keras
    from keras import layers

    noise = keras.Input((latent,))
    h = layers.Reshape((8, 8, 32))(layers.Dense(8 * 8 * 32)(noise))
    h = layers.LeakyReLU(0.2)(layers.Conv2DTranspose(32, 4, strides=2, padding="same")(h))
    h = layers.LeakyReLU(0.2)(layers.Conv2DTranspose(32, 4, strides=2, padding="same")(h))
    generator = keras.Model(noise, layers.Conv2D(3, 5, padding="same", activation="sigmoid")(h), name="generator")
    image = keras.Input((32, 32, 3))
    h = layers.LeakyReLU(0.2)(layers.Conv2D(32, 4, strides=2, padding="same")(image))
    h = layers.LeakyReLU(0.2)(layers.Conv2D(64, 4, strides=2, padding="same")(h))
    h = layers.Dropout(0.2, seed=3)(layers.Flatten()(h))
    discriminator = keras.Model(image, layers.Dense(1)(h), name="discriminator")
    return generator, discriminator


def check_gan_custom_loop(budget, work):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat
    from tfremat.numerics import closeness
    from tfremat.runtime.memory import resident_bytes
    from tfremat.runtime.timing import time_in_turns

    batch, latent = 16, 32
    real_all = _images(batch * TRAIN_STEPS)[0]
    noise_all = np.random.default_rng(5).standard_normal((2, batch * TRAIN_STEPS, latent)).astype("float32")
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def setup():
        keras.utils.set_random_seed(0)
        generator, discriminator = _gan_models(latent)
        d_opt, g_opt = keras.optimizers.Adam(2e-4, beta_1=0.5), keras.optimizers.Adam(2e-4, beta_1=0.5)
        d_opt.build(discriminator.trainable_variables)
        g_opt.build(generator.trainable_variables)

        def d_loss(real, noise):
            real_logits = discriminator(real, training=True)
            fake_logits = discriminator(generator(noise, training=True), training=True)
            return (bce(keras.ops.ones_like(real_logits), real_logits)
                    + bce(keras.ops.zeros_like(fake_logits), fake_logits))

        def g_loss(noise):
            fake_logits = discriminator(generator(noise, training=True), training=True)
            return bce(keras.ops.ones_like(fake_logits), fake_logits)

        return generator, discriminator, d_opt, g_opt, d_loss, g_loss

    def plain_loop():
        generator, discriminator, d_opt, g_opt, d_loss, g_loss = setup()

        @tf.function
        def step(real, noise_d, noise_g):
            with tf.GradientTape() as tape:
                dl = d_loss(real, noise_d)
            grads = tape.gradient(dl, discriminator.trainable_variables)
            d_opt.apply_gradients(zip(grads, discriminator.trainable_variables))
            with tf.GradientTape() as tape:
                gl = g_loss(noise_g)
            grads = tape.gradient(gl, generator.trainable_variables)
            g_opt.apply_gradients(zip(grads, generator.trainable_variables))
            return dl, gl

        return step, (generator, discriminator, d_opt, g_opt), None

    def remat_loop():
        generator, discriminator, d_opt, g_opt, d_loss, g_loss = setup()
        real0, noise0 = tf.constant(real_all[:batch]), tf.constant(noise_all[0, :batch])
        d_grad = tfremat.value_and_grad(d_loss, "min", real0, noise0)
        g_grad = tfremat.value_and_grad(g_loss, "absolute min", noise0)
        d_ids, g_ids = {id(v) for v in discriminator.trainable_variables}, {id(v) for v in generator.trainable_variables}

        @tf.function
        def step(real, noise_d, noise_g):
            dl, grads = d_grad(real, noise_d)
            d_opt.apply_gradients([(g, v) for g, v in zip(grads, d_grad.trainable_variables) if id(v) in d_ids])
            gl, grads = g_grad(noise_g)
            g_opt.apply_gradients([(g, v) for g, v in zip(grads, g_grad.trainable_variables) if id(v) in g_ids])
            return dl, gl

        return step, (generator, discriminator, d_opt, g_opt), (d_grad, g_grad)

    row, runs = {}, {}
    for tag, make in (("plain", plain_loop), ("remat", remat_loop)):
        began = time.perf_counter()
        try:
            step, state, grads = make()
        except Exception as error:
            row[f"{tag}_error"] = f"{type(error).__name__}: {error}"
            continue
        generator, discriminator, d_opt, g_opt = state
        resident = resident_bytes(list(generator.variables) + list(discriminator.variables)
                                  + list(d_opt.variables) + list(g_opt.variables))
        peaks, losses = [], []
        for i in range(TRAIN_STEPS):
            window = slice(i * batch, (i + 1) * batch)
            args = (tf.constant(real_all[window]), tf.constant(noise_all[0, window]), tf.constant(noise_all[1, window]))
            tf.config.experimental.reset_memory_stats("CPU:0")
            start = tf.config.experimental.get_memory_info("CPU:0")["current"]
            dl, gl = step(*args)
            losses.append([float(dl), float(gl)])
            peaks.append(int(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start + resident
                             + _nbytes(*[a.numpy() for a in args])))
            if i == 0:
                row[f"{tag}_first_step_s"] = time.perf_counter() - began
        row[f"{tag}_step_peaks"] = peaks[1:]
        row[f"{tag}_losses"] = losses
        runs[tag] = (step, generator.get_weights() + discriminator.get_weights(), grads)
    if "plain" in runs and "remat" in runs:
        a, b = runs["remat"][1], runs["plain"][1]
        weights = closeness(a, b)
        row.update({"weights_error": weights.max_tensor_error, "weights_equal": weights.equal,
                    "weights_bitwise": all((p == q).all() for p, q in zip(a, b)),
                    "history_diff": {"losses": float(np.abs(np.array(row["plain_losses"])
                                                            - np.array(row["remat_losses"])).max())}})
        d_grad, g_grad = runs["remat"][2]
        row["plans"] = [{"shape": name, "budget": g.plan.budget_bytes, "predicted": g.plan.predicted_peak_bytes,
                         "checkpoint_all": g.plan.checkpoint_all_peak_bytes, "overhead": g.plan.overhead,
                         "planned_time": g.plan.predicted_time_over_plain}
                        for name, g in (("D min", d_grad), ("G absolute min", g_grad))]
        args = (tf.constant(real_all[:batch]), tf.constant(noise_all[0, :batch]), tf.constant(noise_all[1, :batch]))
        timing = time_in_turns(lambda: runs["remat"][0](*args), lambda: runs["plain"][0](*args), TIMED_ROUNDS)
        row["fit_time"], row["fit_time_quartiles"] = timing.ratio, list(timing.ratio_quartiles)
        # Both updates in one step: the plain step's time share of each is not separated, so
        # the step is planned at the mean of the two plans' predictions (weighted equally).
        row["fit_planned_time"] = (d_grad.plan.predicted_time_over_plain + g_grad.plan.predicted_time_over_plain) / 2
        row["budget_bytes"] = max(d_grad.plan.budget_bytes or 0, g_grad.plan.budget_bytes or 0) or None
        row["fit_predicted"] = max(d_grad.plan.predicted_peak_bytes, g_grad.plan.predicted_peak_bytes)
        row["step_peaks"], row["plain_step_peaks"] = row["remat_step_peaks"], row["plain_step_peaks"]
        row["first_step_s"], row["plain_first_step_s"] = row.get("remat_first_step_s"), row.get("plain_first_step_s")
    return row


def check_callback_direct(budget, work):
    import keras
    import tensorflow as tf

    from tfremat.keras import RematCallback
    from tfremat.numerics import closeness

    batch = 16
    x, y = _images(batch * TRAIN_STEPS)
    keras.utils.set_random_seed(0)
    plain = _compiled(_shared_layers())
    plain_peaks = step_peaks_callback(_nbytes(x[:batch], y[:batch]))
    plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[plain_peaks])
    keras.utils.set_random_seed(0)
    model = _compiled(_shared_layers())
    remat = RematCallback(budget, verbose=1)
    peaks = step_peaks_callback(_nbytes(x[:batch], y[:batch]))
    began = time.perf_counter()
    row = {}
    try:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[remat, peaks])
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    weights = closeness(model.get_weights(), plain.get_weights())
    row.update({"fit_seconds": time.perf_counter() - began, "weights_error": weights.max_tensor_error,
                "weights_equal": weights.equal, "history_diff": {},
                "weights_bitwise": all((a == b).all() for a, b in zip(model.get_weights(), plain.get_weights())),
                "step_peaks": peaks.peaks[1:], "plain_step_peaks": plain_peaks.peaks[1:],
                "allocator_peaks_attr": {str(k): v for k, v in getattr(remat, "allocator_peaks", {}).items()}})
    batch_tensors = (tf.constant(x[:batch]), tf.constant(y[:batch]))
    row["raw_allocator"] = raw_allocator_reads(remat, model, batch_tensors)
    row.update(step_measures(remat, model, batch_tensors))
    return row


def check_maxbatch_then_fit(budget, work):
    import keras
    import tensorflow as tf

    import tfremat

    def make():
        model = keras.Sequential([keras.Input((32, 32, 3))]
                                 + [keras.layers.Conv2D(32, 3, padding="same", activation="relu") for _ in range(8)]
                                 + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10, activation="softmax")])
        return _compiled(model)

    keras.utils.set_random_seed(0)
    began = time.perf_counter()
    row = {}
    try:
        found = tfremat.max_batch_size(make(), budget, verbose=0)
    except Exception as error:
        return {"error": f"max_batch_size: {type(error).__name__}: {error}"}
    row["maxbatch_seconds"] = time.perf_counter() - began
    result = found["optimal"] if isinstance(found, dict) and "optimal" in found else found
    row["maxbatch_result"] = repr(result)[:600]
    batch = int(getattr(result, "batch_size", 0) or 0)
    row["maxbatch_batch"] = batch
    path = os.path.join(work, "conv8.keras")
    make().save(path)
    cli = {}
    for args in (["--help"], ["plan", "--model", path, "--batch", "8", "--budget", "80%"],
                 ["maxbatch", "--model", path, "--budget", budget]):
        done = subprocess.run([sys.executable, "-m", "tfremat", *args], capture_output=True, text=True, timeout=400,
                              cwd=ROOT)
        cli[" ".join(args[:1])] = {"rc": done.returncode, "stdout": done.stdout[-1500:], "stderr": done.stderr[-1500:]}
    row["cli"] = cli
    if batch:
        x, y = _images(batch * 11)
        row.update(fit_with_step_peaks(make, {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False},
                                       budget, (tf.constant(x[:batch]), tf.constant(y[:batch])),
                                       _nbytes(x[:batch], y[:batch])))
    return row


def check_mobilenetv3small(budget, work):
    import keras

    def make():
        return _compiled(keras.applications.MobileNetV3Small(input_shape=(64, 64, 3), weights=None, classes=10))

    return _image_fit(make, budget, batch=8, shape=(64, 64, 3))


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "user_check_4_")


# ---------------------------------------------------------------- parent: run, collect, render

def _peaks_cell(peaks, budget) -> str:
    if not peaks:
        return ""
    text = f"{_mib(min(peaks))}-{_mib(max(peaks))} ({len(peaks)})"
    if budget and max(peaks) > budget:
        text += f" **{max(peaks) / budget:.3f}x**"
    return text


def _alloc_cell(row, held) -> str:
    raw = max(row["raw_allocator"]) if row.get("raw_allocator") else None
    text = f"{_mib(raw)} ({_mib(held)})" if raw is not None else ("" if held is None else f"({_mib(held)})")
    if raw is not None and row.get("budget_bytes") and raw > row["budget_bytes"]:
        text += f" **{raw / row['budget_bytes']:.3f}x**"
    return text


def time_cells(row) -> list[str]:
    """The measured time over plain (quartiles), its ratio to the plan's (marked out of
    :data:`TIME_BAND`) and the first step's seconds (plain Keras's in brackets)."""
    planned, measured = row.get("fit_planned_time"), row.get("fit_time")
    cells = ["", ""]
    if measured is not None and planned:
        q = row["fit_time_quartiles"]
        ratio = measured / planned
        cells = [f"{measured:.3f} ({q[0]:.2f}-{q[1]:.2f})",
                 f"{ratio:.3f}" + ("" if TIME_BAND[0] <= ratio <= TIME_BAND[1] else " **out**")]
    first, plain_first = row.get("first_step_s"), row.get("plain_first_step_s")
    return cells + ["" if first is None else f"{first:.1f}" + ("" if plain_first is None else f" ({plain_first:.1f})")]


def render(rows) -> str:
    out = ["| check | budget | training | predicted MiB | requested MiB | alloc MiB raw (held) | "
           "budget MiB | in-fit step peaks MiB (steps) | plain in-fit MiB | planned | time/plain | time ratio | "
           "first s (plain) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        training = _training(row) if row.get("history_diff") is not None else ""
        # The held peak; rows written before step_measures read raw reads kept it in fit_allocator.
        alloc = row.get("fit_allocator_held") or (max(row["fit_allocator"]) if row.get("fit_allocator")
                                                  and None not in row["fit_allocator"] else None)
        budget = row.get("budget_bytes")
        planned = row.get("fit_planned_time")
        written = row.get("budget_as_written", row["budget"])
        if row.get("retried_at"):
            written = " -> ".join([written, *row["retried_at"]])
        cells = [row["check"], written, training or (row.get("error") or "")[:160],
                 _mib(row.get("fit_predicted")), _mib(row.get("fit_requested")), _alloc_cell(row, alloc), _mib(budget),
                 _peaks_cell(row.get("step_peaks"), budget), _peaks_cell(row.get("plain_step_peaks"), None),
                 "" if planned is None else f"{planned:.3f}"]
        cells += time_cells(row)
        out.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    return json_rows_main(argv, __doc__, __file__, CHECKS, child, render, DEFAULT_JSON, "tfremat_user_check_4_")


if __name__ == "__main__":
    sys.exit(main())
