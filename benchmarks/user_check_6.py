"""A sixth new user (session 30's task F): models and training flows tfremat's authors did not try.

The earlier checks (:mod:`user_check` to :mod:`user_check_5`) trained keras.applications'
MobileNets, EfficientNets, ResNet50, DenseNet121 and ConvNeXtTiny, keras-hub's GPT-2, BERT and
DistilBERT, keras.io's ViT, CCT, Perceiver, U-Net, VAE and GAN, with validation data, callbacks,
sample and class weights, gradient accumulation, mixed_float16, MirroredStrategy and XLA. Each
check here is written as keras.io / keras.applications / keras-hub users write it, trained through
the entry point such a user picks:

- ``fnet_fft``: keras.io's FNet text classifier (``tf.signal.fft2d`` on ``complex64`` inside an
  encoder layer), ``model.fit`` with ``RematCallback("60% of activations")``;
- ``convlstm_frames``: keras.io's next-frame prediction (``ConvLSTM2D`` x3, batch norm, ``Conv3D``,
  frames of unknown count in the ``Input``), ``tfremat.fit`` at ``"min"`` (``_all``: at ``"100%"``;
  ``_executor``: a plain tape step of one ConvLSTM2D on TensorFlow's default and single-threaded
  executors, without tfremat);
- ``seq2seq_teacher``: keras.io's character-level LSTM encoder-decoder (two inputs, teacher
  forcing, ``validation_split``), ``tfremat.fit`` at ``"80%"``;
- ``tab_stringlookup``: a TabTransformer-style model on a dataset of string and numeric columns,
  the ``StringLookup`` layers inside the model, ``tfremat.fit`` at ``"70% of activations"``
  (``_oov1``: with an out-of-vocabulary index);
- ``roberta_hub``: keras-hub's ``RobertaBackbone`` at a tiny random config, ``tfremat.fit`` at ``"60%"``;
- ``adamw_ema_clip``: a CNN with ``AdamW(use_ema=True, global_clipnorm=1.0)``: the EMA weights and
  ``optimizer.iterations`` against plain training's too;
- ``steps_per_execution``: a CNN compiled with ``steps_per_execution=4``;
- ``loss_scale_clipnorm``: ``mixed_float16`` with an explicit ``LossScaleOptimizer(Adam(clipnorm=1.0))``;
- ``second_fit_reload``: ``tfremat.fit`` for one epoch, then again with ``initial_epoch=1,
  epochs=2`` on the same model (its seconds and plan against the first call's), then
  ``evaluate``/``predict`` and ``model.save`` / ``keras.models.load_model`` against plain's;
- ``xception``: ``keras.applications.Xception(weights=None)`` at 72x72, batch 4, ``"70% of activations"``.

Per training check, as :mod:`user_check_5` does (its ``fit_compared``, ``_compiled`` and
``render`` reused): plain ``model.fit`` and ``tfremat.fit`` from the same seeds; the weights after
step 1, step 5 and the last step against plain's, bitwise or within
:func:`tfremat.numerics.closeness`; the allocator's peak of every step after the first inside
both fits; three allocator reads and the requested bytes of the step afterwards; its time against a
plain tape step in turns over the plan's ``predicted_time_over_plain``; TensorFlow's E-level lines
and tfremat's warnings on stderr. A check's own facts (EMA weights, iterations, reloaded
predictions, second-call seconds) are listed under the table.

Run: ``python benchmarks/user_check_6.py`` (writes the rows to ``benchmarks/results/user_check_6.json``
after each check and prints the table); ``--only`` check names (substrings), ``--list``,
``--timeout`` seconds per check, ``--from_json`` to print the table of saved rows.
"""

import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat

import user_check_5  # noqa: E402
from user_check_3 import _cnn, _images, child_row, json_rows_main  # noqa: E402
from user_check_4 import _nbytes, step_peaks_callback  # noqa: E402
from user_check_5 import TRAIN_STEPS, _compiled, fit_compared, weights_at_callback  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "user_check_6.json")
SUGGESTED = r'smallest feasible budget found is "?([\d.]+(?: ?[KMG]i?B|%)(?: of activations)?)'  # as run_pair reads it

# name: (budget, what the check exercises)
CHECKS = {
    "fnet_fft": ("60% of activations", "keras.io FNet (tf.signal.fft2d, complex64); model.fit + RematCallback"),
    "convlstm_frames": ("min", "keras.io next-frame ConvLSTM2D x3 + Conv3D, Input((None, 16, 16, 1))"),
    "convlstm_frames_all": ("100%", "the same at 100%: nothing recomputed"),
    "convlstm_executor": ("-", "a plain tape step of one ConvLSTM2D on the default and the single-threaded executor"),
    "seq2seq_teacher": ("80%", "keras.io LSTM encoder-decoder, two inputs, teacher forcing, validation_split"),
    "tab_stringlookup": ("70% of activations", "TabTransformer-style, StringLookup inside, tf.data of string columns"),
    "tab_stringlookup_oov1": ("70% of activations", "the same with StringLookup(num_oov_indices=1)"),
    "roberta_hub": ("60%", "keras-hub RobertaBackbone, tiny random config"),
    "adamw_ema_clip": ("70%", "CNN, AdamW(use_ema=True, global_clipnorm=1.0): EMA weights, iterations"),
    "steps_per_execution": ("70%", "CNN, compile(steps_per_execution=4)"),
    "loss_scale_clipnorm": ("70% of activations", "mixed_float16, LossScaleOptimizer(Adam(clipnorm=1.0))"),
    "second_fit_reload": ("70%", "fit, fit(initial_epoch=1, epochs=2) again, evaluate/predict, save/load_model"),
    "xception": ("70% of activations", "keras.applications.Xception(weights=None), 72x72, batch 4"),
}


# ---------------------------------------------------------------- models (child)

def _fnet(length=64, vocabulary=1000, dim=64):
    """keras.io's "Text Generation using FNet" encoder as a classifier: the token mixing is the
    real part of a 2D FFT, written with ``tf.signal`` as the example does."""
    import keras
    import tensorflow as tf
    from keras import layers

    class FNetEncoder(layers.Layer):
        def __init__(self, embed_dim, dense_dim, **kwargs):
            super().__init__(**kwargs)
            self.dense_proj = keras.Sequential([layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm_1 = layers.LayerNormalization()
            self.layernorm_2 = layers.LayerNormalization()

        def call(self, inputs):
            fft = tf.math.real(tf.signal.fft2d(tf.cast(inputs, tf.complex64)))
            proj_input = self.layernorm_1(inputs + fft)
            return self.layernorm_2(proj_input + self.dense_proj(proj_input))

    inputs = keras.Input((length,), dtype="int32")
    h = layers.Embedding(vocabulary, dim)(inputs)
    for _ in range(2):
        h = FNetEncoder(dim, 2 * dim)(h)
    h = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, layers.Dense(4, activation="softmax")(h), name="fnet")


def _convlstm(size=16, filters=16):
    """keras.io's "Next-Frame Video Prediction with Convolutional LSTMs", at 16x16 and 16 filters."""
    import keras
    from keras import layers

    inputs = layers.Input(shape=(None, size, size, 1))
    h = layers.ConvLSTM2D(filters, (5, 5), padding="same", return_sequences=True, activation="relu")(inputs)
    h = layers.BatchNormalization()(h)
    h = layers.ConvLSTM2D(filters, (3, 3), padding="same", return_sequences=True, activation="relu")(h)
    h = layers.BatchNormalization()(h)
    h = layers.ConvLSTM2D(filters, (1, 1), padding="same", return_sequences=True, activation="relu")(h)
    outputs = layers.Conv3D(1, (3, 3, 3), activation="sigmoid", padding="same")(h)
    model = keras.Model(inputs, outputs, name="convlstm")
    model.compile(loss=keras.losses.binary_crossentropy, optimizer=keras.optimizers.Adam())
    return model


def _seq2seq(encoder_tokens=24, decoder_tokens=28, latent=64):
    """keras.io's "Character-level recurrent sequence-to-sequence model", as written: time steps
    of unknown count, the decoder fed the target shifted by one (teacher forcing)."""
    import keras

    encoder_inputs = keras.Input(shape=(None, encoder_tokens))
    _, state_h, state_c = keras.layers.LSTM(latent, return_state=True)(encoder_inputs)
    decoder_inputs = keras.Input(shape=(None, decoder_tokens))
    decoder_outputs, _, _ = keras.layers.LSTM(latent, return_sequences=True, return_state=True)(
        decoder_inputs, initial_state=[state_h, state_c])
    outputs = keras.layers.Dense(decoder_tokens, activation="softmax")(decoder_outputs)
    model = keras.Model([encoder_inputs, decoder_inputs], outputs, name="seq2seq")
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    return model


CATEGORIES = {"workclass": ["private", "self", "gov", "none"], "education": ["hs", "college", "bachelors", "masters",
                                                                             "doctorate"],
              "occupation": ["tech", "sales", "craft", "admin", "service", "farming"]}
NUMERIC = ("age", "hours")


def _tab_transformer(dim=16, blocks=2, heads=2, oov_indices=0):
    """A TabTransformer as keras.io's "Structured data learning with TabTransformer" writes it:
    string columns looked up and embedded inside the model (no out-of-vocabulary index unless
    ``oov_indices``), transformer blocks over the column embeddings, numeric columns
    layer-normalized, an MLP head."""
    import keras
    from keras import layers

    inputs = {name: layers.Input((1,), name=name, dtype="string") for name in CATEGORIES}
    inputs.update({name: layers.Input((1,), name=name, dtype="float32") for name in NUMERIC})
    embedded = []
    for name, vocabulary in CATEGORIES.items():
        lookup = layers.StringLookup(vocabulary=vocabulary, mask_token=None, num_oov_indices=oov_indices,
                                     output_mode="int")
        embedded.append(layers.Embedding(len(vocabulary) + oov_indices, dim)(lookup(inputs[name])))
    h = layers.Concatenate(axis=1)(embedded)
    for _ in range(blocks):
        attended = layers.MultiHeadAttention(num_heads=heads, key_dim=dim, dropout=0.1)(h, h)
        h = layers.LayerNormalization(epsilon=1e-6)(layers.Add()([attended, h]))
        ff = layers.Dense(dim)(layers.Dropout(0.1)(layers.Dense(dim, activation="gelu")(h)))
        h = layers.LayerNormalization(epsilon=1e-6)(layers.Add()([ff, h]))
    numeric = layers.LayerNormalization(epsilon=1e-6)(layers.Concatenate()([inputs[n] for n in NUMERIC]))
    h = layers.Concatenate()([layers.Flatten()(h), numeric])
    h = layers.Dropout(0.2)(layers.Dense(64, activation="selu")(h))
    outputs = layers.Dense(1, activation="sigmoid")(layers.Dense(32, activation="selu")(h))
    model = keras.Model(inputs, outputs, name="tab_transformer")
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3, weight_decay=1e-4),
                  loss=keras.losses.BinaryCrossentropy(), metrics=[keras.metrics.BinaryAccuracy()])
    return model


def _roberta(length=64):
    import keras
    import keras_hub

    backbone = keras_hub.models.RobertaBackbone(vocabulary_size=500, num_layers=2, num_heads=2, hidden_dim=64,
                                                intermediate_dim=128, max_sequence_length=length)
    inputs = {n: keras.Input((length,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    first = keras.layers.Lambda(lambda t: t[:, 0, :])(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(first), name="roberta_hub")


# ---------------------------------------------------------------- checks (child)

def _image_arrays_fit(make, budget, batch=16, shape=(32, 32, 3), extra=None, **fit_extra):
    import tensorflow as tf

    x, y = _images(batch * TRAIN_STEPS, shape)
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False, **fit_extra}
    return fit_compared(make, fit_kwargs, budget, (tf.constant(x[:batch]), tf.constant(y[:batch])),
                        _nbytes(x[:batch], y[:batch]), extra=extra)


def check_xception(budget, work):
    import keras

    def make():  # 71x71 is Xception's smallest input
        return _compiled(keras.applications.Xception(input_shape=(72, 72, 3), weights=None, classes=10))

    return _image_arrays_fit(make, budget, batch=4, shape=(72, 72, 3))


def check_fnet_fft(budget, work):
    import numpy as np

    rng = np.random.default_rng(0)
    batch = 16
    x = rng.integers(1, 1000, (batch * TRAIN_STEPS, 64)).astype("int32")
    y = rng.integers(0, 4, batch * TRAIN_STEPS)
    return callback_fit_compared(lambda: _compiled(_fnet()), budget, x, y, batch)


def callback_fit_compared(make, budget, x, y, batch: int) -> dict:
    """``fit_compared``'s row for a user who passes the callback to ``model.fit`` (``fit_compared``
    calls ``tfremat.fit``, model.fit with it): ``make()``'s model trained on arrays ``x``, ``y``
    plainly and with ``RematCallback(budget)``, a refused budget retried at the one the refusal
    names, as ``run_pair`` does."""
    import keras
    import tensorflow as tf

    from tfremat.keras import RematCallback

    timing = (tf.constant(x[:batch]), tf.constant(y[:batch]))
    plain_weights, remat_weights = weights_at_callback(), weights_at_callback()
    plain_peaks, remat_peaks = step_peaks_callback(_nbytes(*timing)), step_peaks_callback(_nbytes(*timing))
    keras.utils.set_random_seed(0)
    plain = make()
    plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[plain_weights, plain_peaks])
    row = {"budget_as_written": budget}
    for attempt in range(3):
        keras.utils.set_random_seed(0)
        model = make()
        callback = RematCallback(budget)
        try:
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                      callbacks=[callback, remat_weights, remat_peaks])
            break
        except Exception as error:
            text = f"{type(error).__name__}: {error}"
            suggested = re.search(SUGGESTED, text)
            if attempt == 2 or not suggested:
                row["error"] = text
                return row
            budget = suggested.group(1)
            row.setdefault("refused", []).append(text)
            row.setdefault("retried_at", []).append(budget)
    row["plain_step_peaks"], row["step_peaks"] = plain_peaks.peaks[1:], remat_peaks.peaks[1:]
    row["weights_at"] = {str(s): user_check_5._weights_cell(remat_weights.weights[s], plain_weights.weights[s])
                         for s in user_check_5.COMPARED_STEPS}
    row["weights_at"]["last"] = user_check_5._weights_cell(model.get_weights(), plain.get_weights())
    row.update(user_check_5.user_check_3.step_measures(callback, model, timing))
    row["graph_nodes"] = [len(p.extraction.graph.names) for p in callback.plans.values()]
    return row


def check_convlstm_frames(budget, work):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batch, frames = 4, 6
    movies = (rng.random((batch * TRAIN_STEPS, frames + 1, 16, 16, 1)) > 0.8).astype("float32")
    x, y = movies[:, :-1], movies[:, 1:]  # next-frame targets, as the example shifts them
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}
    return fit_compared(_convlstm, fit_kwargs, budget, (tf.constant(x[:batch]), tf.constant(y[:batch])),
                        _nbytes(x[:batch], y[:batch]))


def check_convlstm_frames_all(budget, work):
    return check_convlstm_frames(budget, work)


def check_convlstm_executor(budget, work):
    """The allocator's peak of one plain tape step (a ConvLSTM2D and a Conv3D, no tfremat) on
    TensorFlow's default executor and on the single-threaded one the compiled step runs on
    with default inter-op threads (:func:`tfremat.runtime.executor.step_executor`)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers

    from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR

    keras.utils.set_random_seed(0)
    recurrent = layers.ConvLSTM2D(16, 3, padding="same", return_sequences=True)
    head = layers.Conv3D(1, 3, padding="same", activation="sigmoid")
    x = tf.constant(np.random.default_rng(0).random((4, 6, 16, 16, 1), dtype=np.float32))
    head(recurrent(x))
    variables = recurrent.trainable_variables + head.trainable_variables

    def step(frames):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.binary_crossentropy(frames, head(recurrent(frames, training=True))))
        return tape.gradient(loss, variables)

    def peak(function) -> int:
        function(x)
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        [g.numpy() for g in function(x)]
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start

    peaks = {"default": [], "single_threaded": []}
    for _ in range(2):  # in turns
        peaks["default"].append(peak(tf.function(step, autograph=False)))
        with tf.experimental.function_executor_type(SEQUENTIAL_EXECUTOR):
            peaks["single_threaded"].append(peak(tf.function(step, autograph=False)))
    return {"executor_peaks": peaks, "outcome": "single-threaded over default: "
            f"{max(peaks['single_threaded']) / max(peaks['default']):.1f}x"}


def check_seq2seq_teacher(budget, work):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batch, samples, source_len, target_len = 16, 16 * TRAIN_STEPS * 5 // 4, 12, 14
    source = np.eye(24, dtype="float32")[rng.integers(0, 24, (samples, source_len))]
    target = np.eye(28, dtype="float32")[rng.integers(0, 28, (samples, target_len + 1))]
    decoder_in, decoder_out = target[:, :-1], target[:, 1:]  # teacher forcing: the target shifted by one
    fit_kwargs = {"x": [source, decoder_in], "y": decoder_out, "batch_size": batch, "epochs": 1,
                  "validation_split": 0.2, "shuffle": False}
    timing = ((tf.constant(source[:batch]), tf.constant(decoder_in[:batch])), tf.constant(decoder_out[:batch]))
    return fit_compared(_seq2seq, fit_kwargs, budget, timing, _nbytes(source[:batch], target[:batch]))


def check_tab_stringlookup(budget, work, oov_indices=0):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batch, n = 32, 32 * TRAIN_STEPS
    x = {name: np.array(vocabulary, dtype=object)[rng.integers(0, len(vocabulary), (n, 1))]
         for name, vocabulary in CATEGORIES.items()}
    x.update({name: rng.normal(40, 10, (n, 1)).astype("float32") for name in NUMERIC})
    y = rng.integers(0, 2, (n, 1)).astype("float32")
    # A dataset of string columns, as the example reads its CSV (Keras's array adapter takes no
    # object arrays).
    columns = {k: tf.constant(v) for k, v in x.items()}
    fit_kwargs = {"x": tf.data.Dataset.from_tensor_slices((columns, y)).batch(batch), "epochs": 1}
    timing = ({k: v[:batch] for k, v in columns.items()}, tf.constant(y[:batch]))
    return fit_compared(lambda: _tab_transformer(oov_indices=oov_indices), fit_kwargs, budget, timing,
                        _nbytes([x[n][:batch] for n in NUMERIC], y[:batch]) + batch * len(CATEGORIES) * 8)


def check_tab_stringlookup_oov1(budget, work):
    return check_tab_stringlookup(budget, work, oov_indices=1)


def check_roberta_hub(budget, work):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batch, n, length = 8, 8 * TRAIN_STEPS, 64
    tokens = rng.integers(3, 500, (n, length)).astype("int32")
    padding = np.ones((n, length), dtype="int32")
    for row_, keep in enumerate(rng.integers(16, length, n)):
        tokens[row_, keep:], padding[row_, keep:] = 1, 0
    x = {"token_ids": tokens, "padding_mask": padding}
    y = rng.integers(0, 3, n)
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}
    timing = ({k: tf.constant(v[:batch]) for k, v in x.items()}, tf.constant(y[:batch]))
    return fit_compared(lambda: _compiled(_roberta(length)), fit_kwargs, budget, timing,
                        _nbytes(tokens[:batch], padding[:batch], y[:batch]))


def _bitwise(a, b) -> bool:
    import numpy as np

    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b))


def check_adamw_ema_clip(budget, work):
    import keras

    def make():
        model = _cnn()
        model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3, use_ema=True, ema_momentum=0.9,
                                                       global_clipnorm=1.0),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def ema(plain_model, model):
        averages = {tag: [v.numpy() for v in m.optimizer._model_variables_moving_average]
                    for tag, m in (("plain", plain_model), ("remat", model))}
        return {"ema_bitwise": _bitwise(averages["plain"], averages["remat"]), "ema_count": len(averages["remat"]),
                "iterations": [int(plain_model.optimizer.iterations.numpy()), int(model.optimizer.iterations.numpy())]}

    return _image_arrays_fit(make, budget, extra=ema)


def check_steps_per_execution(budget, work):
    import keras

    def make():
        model = _cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                      steps_per_execution=4)
        return model

    def iterations(plain_model, model):
        return {"iterations": [int(plain_model.optimizer.iterations.numpy()), int(model.optimizer.iterations.numpy())]}

    return _image_arrays_fit(make, budget, extra=iterations)


def check_loss_scale_clipnorm(budget, work):
    import keras

    def make():
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = _cnn()
        finally:
            keras.mixed_precision.set_global_policy("float32")
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(clipnorm=1.0))
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def scale(plain_model, model):
        return {"loss_scale": [float(m.optimizer.dynamic_scale.numpy()) for m in (plain_model, model)],
                "iterations": [int(plain_model.optimizer.iterations.numpy()), int(model.optimizer.iterations.numpy())]}

    return _image_arrays_fit(make, budget, extra=scale)


def check_second_fit_reload(budget, work):
    import keras
    import numpy as np

    import tfremat

    x, y = _images(16 * TRAIN_STEPS)
    xv, yv = _images(48, seed=1)

    def make():
        return _compiled(_cnn())

    def again(plain_model, model):
        out = {}
        began = time.perf_counter()
        plain_model.fit(x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
        out["plain_second_fit_s"] = time.perf_counter() - began
        began = time.perf_counter()
        history = tfremat.fit(model, budget, x, y, batch_size=16, epochs=2, initial_epoch=1, shuffle=False, verbose=1)
        out["second_fit_s"] = time.perf_counter() - began
        out["second_fit_epochs"] = len(history.history.get("loss", []))
        out["second_plans"] = [{"shape": str(k), "budget": p.budget_bytes, "predicted": p.predicted_peak_bytes,
                                "overhead": p.overhead} for k, p in history.plans.items()]
        out["second_weights_bitwise"] = _bitwise(model.get_weights(), plain_model.get_weights())
        out["iterations"] = [int(plain_model.optimizer.iterations.numpy()), int(model.optimizer.iterations.numpy())]
        evaluated = [m.evaluate(xv, yv, batch_size=16, verbose=0) for m in (plain_model, model)]
        predicted = [m.predict(xv, batch_size=16, verbose=0) for m in (plain_model, model)]
        out["evaluate"] = evaluated
        out["predict_max_diff"] = float(np.abs(predicted[0] - predicted[1]).max())
        path = os.path.join(work, "remat.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        reloaded = loaded.predict(xv, batch_size=16, verbose=0)
        out["loaded_predict_max_diff"] = float(np.abs(reloaded - predicted[1]).max())
        out["loaded_iterations"] = int(loaded.optimizer.iterations.numpy())
        out["loaded_optimizer_bitwise"] = _bitwise([v.numpy() for v in loaded.optimizer.variables],
                                                   [v.numpy() for v in model.optimizer.variables])
        began = time.perf_counter()
        loaded_history = tfremat.fit(loaded, budget, x[:32], y[:32], batch_size=16, epochs=1, shuffle=False,
                                     verbose=0)
        out["loaded_fit_s"] = time.perf_counter() - began
        out["loaded_fit_loss"] = float(loaded_history.history["loss"][-1])
        return out

    return _image_arrays_fit(make, budget, extra=again)


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "user_check_6_")


# ---------------------------------------------------------------- parent: render

FACTS = ("executor_peaks", "ema_bitwise", "ema_count", "iterations", "loss_scale", "graph_nodes", "plain_second_fit_s",
         "second_fit_s", "second_fit_epochs", "second_plans", "second_weights_bitwise", "evaluate", "predict_max_diff",
         "loaded_predict_max_diff", "loaded_iterations", "loaded_optimizer_bitwise", "loaded_fit_s", "loaded_fit_loss",
         "memory_error", "timing_error", "plain_error", "first_step_s", "plain_first_step_s", "wall_s", "load")


def render(rows) -> str:
    """:func:`user_check_5.render`'s table, then each row's own facts and its tfremat lines."""
    out = [user_check_5.render(rows), "Per check facts:", ""]
    for row in rows:
        facts = {k: row[k] for k in FACTS if k in row}
        out.append(f"- `{row['check']}`: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    return json_rows_main(argv, __doc__, __file__, CHECKS, child, render, DEFAULT_JSON, "tfremat_user_check_6_")


if __name__ == "__main__":
    sys.exit(main())
