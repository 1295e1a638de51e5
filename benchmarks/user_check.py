"""A new user's check (issue 33): models tfremat was not written for, TensorFlow's default threads.

Each check builds a model the way its source writes it (``keras.applications`` at 64x64,
keras-hub GPT-2 / BERT backbones at test sizes, keras.io-style code: a ViT with a
``Patches`` layer, a text transformer with a ``TransformerBlock`` layer, a Siamese net, a
VAE whose own ``train_step`` takes its gradients from :func:`tfremat.value_and_grad`; and a
second user's five: keras.io's U-Net segmentation, timeseries Transformer and bidirectional
recurrent text model (GRUs), ConvNeXtTiny at an amount, and a subclassed ``keras.Model``
whose ``train_step`` calls :func:`tfremat.value_and_grad`, checked against its tape over three
``fit`` batches),
compiles it with Adam and trains one epoch of three batches with
:class:`tfremat.keras.RematCallback` at defaults (what :func:`tfremat.fit` does), from an
empty tfremat cache so the first step pays extraction, profiling, planning and compiling.
Then, on the step the callback trained with (after its allocator check): the allocator's
peak (five reads), the bytes it requests, and its time against a plain Keras-style step
timed in turns; and :func:`tfremat.measure.measure_model` on the same model and budget
(its plan is held to requested bytes only: the plan before the allocator check), with the
gradients against plain training's.

Every check runs in its own process (the allocator's history is its own), with
``TF_NUM_INTEROP_THREADS`` removed from the environment (TensorFlow's default inter-op
threads, as a user has them) and oneDNN on. The stderr lines that are not TensorFlow's
start-up lines are counted (log spam) and tfremat's phase lines kept.

Run: ``python benchmarks/user_check.py`` (all checks, writes
``benchmarks/results/user_check.md``; the second user's rows are in ``user_check_2.md``);
``--only`` takes check names (substrings, comma separated); ``--list`` lists them;
``--steps`` the timed rounds; ``--timeout`` seconds per check.
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
DEFAULT_OUT = os.path.join(HERE, "results", "user_check.md")
MiB = 2**20
TIME_BAND = (0.87, 1.15)  # measured time/plain over predicted time/plain that issue 33 accepts

# name: (builder, budget, batch, kind, options). kind "fit": RematCallback + measure_model;
# "vae": a custom train_step with tfremat.value_and_grad; "train_step": a subclassed Model's own
# train_step on it (check_train_step).
CHECKS = {
    "mobilenetv2-60act": ("mobilenetv2", "60% of activations", 8, "fit", {}),
    "efficientnetb0-70": ("efficientnetb0", "70%", 8, "fit", {}),
    "resnet50-MiB": ("resnet50", "300MiB", 8, "fit", {}),
    "densenet121-min": ("densenet121", "min", 8, "fit", {}),
    "gpt2_hub-50": ("gpt2_hub", "50%", 8, "fit", {}),
    "bert_hub-60act": ("bert_hub", "60% of activations", 8, "fit", {}),
    "vit_patches-50act": ("vit_patches", "50% of activations", 16, "fit", {}),
    "text_transformer-60": ("text_transformer", "60%", 16, "fit", {}),
    "siamese-80act": ("siamese", "80% of activations", 16, "fit", {}),
    "vae_value_and_grad-min": ("vae", "min", 16, "vae", {}),
    "text_transformer_mixed-60act": ("text_transformer", "60% of activations", 16, "fit", {"mixed": True}),
    "cnn_jit-70act": ("small_cnn", "70% of activations", 16, "fit", {"jit": True}),
    # A second user (results/user_check_2.md): five more sources. ConvNeXtTiny at 64x64, batch 4: "min" 541.8 MiB,
    # checkpoint-all 599.0 MiB (tfremat.plan_model).
    "unet_seg-60act": ("unet_seg", "60% of activations", 4, "fit", {}),
    "ts_transformer-50": ("ts_transformer", "50%", 8, "fit", {}),
    "gru_text-min": ("gru_text", "min", 16, "fit", {}),
    "convnext_tiny-MiB": ("convnext_tiny", "570MiB", 4, "fit", {}),
    "custom_train_step-70": ("dropout_layernorm_cnn", "70%", 32, "train_step", {}),
    "custom_train_step-85": ("dropout_layernorm_cnn", "85%", 32, "train_step", {}),
    "custom_train_step_convln-70": ("dropout_layernorm_cnn", "70%", 32, "train_step", {"conv_norm": True}),
}


# ---------------------------------------------------------------- models (child process)

def _applications(name):
    import keras

    constructor = {"mobilenetv2": keras.applications.MobileNetV2, "efficientnetb0": keras.applications.EfficientNetB0,
                   "resnet50": keras.applications.ResNet50, "densenet121": keras.applications.DenseNet121}[name]
    return constructor(weights=None, input_shape=(64, 64, 3), classes=10)


def _hub(name, seq_len=64):
    import keras
    import keras_hub

    kind = keras_hub.models.GPT2Backbone if name == "gpt2_hub" else keras_hub.models.BertBackbone
    backbone = kind(vocabulary_size=500, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=256,
                    max_sequence_length=seq_len)
    inputs = {n: keras.Input((seq_len,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    if "segment_ids" in [t.name for t in backbone.inputs]:
        inputs["segment_ids"] = keras.Input((seq_len,), dtype="int32", name="segment_ids")
    hidden = backbone(inputs)
    hidden = hidden["sequence_output"] if isinstance(hidden, dict) else hidden
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(pooled), name=name)


def _vit_patches():
    """keras.io "Image classification with Vision Transformer", small: 32x32, patch 4, 4 blocks."""
    import keras
    from keras import layers, ops

    class Patches(layers.Layer):
        def __init__(self, patch_size, **kwargs):
            super().__init__(**kwargs)
            self.patch_size = patch_size

        def call(self, images):
            shape = ops.shape(images)
            patches = ops.image.extract_patches(images, size=self.patch_size)
            count = (shape[1] // self.patch_size) * (shape[2] // self.patch_size)
            return ops.reshape(patches, (shape[0], count, self.patch_size * self.patch_size * shape[-1]))

    class PatchEncoder(layers.Layer):
        def __init__(self, num_patches, projection_dim, **kwargs):
            super().__init__(**kwargs)
            self.num_patches = num_patches
            self.projection = layers.Dense(projection_dim)
            self.position_embedding = layers.Embedding(num_patches, projection_dim)

        def call(self, patch):
            positions = ops.expand_dims(ops.arange(0, self.num_patches, 1), axis=0)
            return self.projection(patch) + self.position_embedding(positions)

    dim, heads = 64, 4
    inputs = keras.Input((32, 32, 3))
    encoded = PatchEncoder(64, dim)(Patches(4)(inputs))
    for _ in range(4):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = layers.Dropout(0.1)(layers.Dense(dim * 2, activation="gelu")(x3))
        x3 = layers.Dropout(0.1)(layers.Dense(dim, activation="gelu")(x3))
        encoded = layers.Add()([x3, x2])
    x = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    x = layers.Dropout(0.5)(layers.Dense(128, activation="gelu")(layers.Dropout(0.5)(x)))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x), name="vit_patches")


def _text_transformer():
    """keras.io "Text classification with Transformer": a TransformerBlock layer, 3 blocks, 128 tokens."""
    import keras
    from keras import layers, ops

    class TransformerBlock(layers.Layer):
        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
            super().__init__(**kwargs)
            self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
            self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = layers.Dropout(rate)
            self.dropout2 = layers.Dropout(rate)

        def call(self, inputs, training=False):
            attn_output = self.dropout1(self.att(inputs, inputs), training=training)
            out1 = self.layernorm1(inputs + attn_output)
            ffn_output = self.dropout2(self.ffn(out1), training=training)
            return self.layernorm2(out1 + ffn_output)

    class TokenAndPositionEmbedding(layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            positions = self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))
            return self.token_emb(x) + positions

    maxlen = 128
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    x = TokenAndPositionEmbedding(maxlen, 2000, 32)(inputs)
    for _ in range(3):
        x = TransformerBlock(32, 2, 64)(x)
    x = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(x))
    x = layers.Dropout(0.1)(layers.Dense(20, activation="relu")(x))
    return keras.Model(inputs=inputs, outputs=layers.Dense(2, activation="softmax")(x), name="text_transformer")


def _siamese():
    """keras.io-style Siamese net: one shared conv tower on two 28x28 images, distance head."""
    import keras
    from keras import layers, ops

    image = keras.Input((28, 28, 1))
    h = image
    for filters in (16, 32, 32):
        h = layers.Conv2D(filters, 3, padding="same", activation="tanh")(h)
        h = layers.BatchNormalization()(h)
        h = layers.AveragePooling2D(2)(h) if filters != 32 or h.shape[1] > 7 else h
    tower = keras.Model(image, layers.Dense(16, activation="tanh")(layers.Flatten()(h)), name="tower")
    left, right = keras.Input((28, 28, 1), name="left"), keras.Input((28, 28, 1), name="right")
    distance = layers.Lambda(lambda v: ops.sqrt(ops.maximum(ops.sum(ops.square(v[0] - v[1]), axis=1,
                                                                    keepdims=True), 1e-7)))(
        [tower(left), tower(right)])
    output = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(distance))
    return keras.Model([left, right], output, name="siamese")


def _small_cnn():
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (32, 32, 64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="small_cnn")


def _unet_seg():
    """keras.io "Image segmentation with a U-Net-like architecture" (Oxford pets), at 64x64, 3 classes."""
    import keras
    from keras import layers

    inputs = keras.Input((64, 64, 3))
    x = layers.Conv2D(32, 3, strides=2, padding="same")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous_block_activation = x
    for filters in [64, 128, 256]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    for filters in [256, 128, 64, 32]:
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling2D(2)(x)
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])
        previous_block_activation = x
    outputs = layers.Conv2D(3, 3, activation="softmax", padding="same")(x)
    return keras.Model(inputs, outputs, name="unet_seg")


def _ts_transformer():
    """keras.io "Timeseries classification with a Transformer model" (FordA): its sizes (head 256,
    4 heads, Conv1D feed-forward of 4, 4 blocks, MLP 128), 128 of its 500 steps for 2 cores."""
    import keras
    from keras import layers

    def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
        x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads, dropout=dropout)(inputs, inputs)
        x = layers.Dropout(dropout)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        res = x + inputs
        x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
        x = layers.Dropout(dropout)(x)
        x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        return x + res

    inputs = keras.Input((128, 1))
    x = inputs
    for _ in range(4):
        x = transformer_encoder(x, 256, 4, 4, 0.25)
    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    for dim in [128]:
        x = layers.Dense(dim, activation="relu")(x)
        x = layers.Dropout(0.4)(x)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(x), name="ts_transformer")


def _gru_text():
    """keras.io "Bidirectional LSTM on IMDB" with GRUs: Embedding(20000, 128), two Bidirectional
    GRU(64), 200 tokens."""
    import keras
    from keras import layers

    inputs = keras.Input(shape=(200,), dtype="int32")
    x = layers.Embedding(20000, 128)(inputs)
    x = layers.Bidirectional(layers.GRU(64, return_sequences=True))(x)
    x = layers.Bidirectional(layers.GRU(64))(x)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x), name="gru_text")


def build(name: str):
    """The model and the loss it is compiled with."""
    if name in ("mobilenetv2", "efficientnetb0", "resnet50", "densenet121"):
        return _applications(name), "categorical_crossentropy"
    if name == "convnext_tiny":
        import keras

        return (keras.applications.ConvNeXtTiny(include_top=True, weights=None, input_shape=(64, 64, 3), classes=10),
                "categorical_crossentropy")
    if name in ("unet_seg", "ts_transformer"):
        return {"unet_seg": _unet_seg, "ts_transformer": _ts_transformer}[name](), "sparse_categorical_crossentropy"
    if name == "gru_text":
        return _gru_text(), "binary_crossentropy"
    if name in ("gpt2_hub", "bert_hub"):
        return _hub(name), "categorical_crossentropy"
    if name == "siamese":
        return _siamese(), "binary_crossentropy"
    return {"vit_patches": _vit_patches, "text_transformer": _text_transformer,
            "small_cnn": _small_cnn}[name](), "categorical_crossentropy"


# ---------------------------------------------------------------- one check (child process)

def _fresh(optimizer):
    return type(optimizer).from_config(optimizer.get_config())


def check_fit(name, budget, batch, options, steps) -> dict:
    import keras
    import tensorflow as tf

    from tfremat.allocator_check import allocator_peak
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.keras import RematCallback
    from tfremat.measure import measure_model
    from tfremat.model_planning import synthetic_batch
    from tfremat.runtime.timing import time_in_turns

    if options.get("mixed"):
        keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model, loss = build(name)
    model.compile(optimizer="adam", loss=loss, jit_compile=bool(options.get("jit")))
    x, y = synthetic_batch(model, 3 * batch, loss=loss, seed=0)
    remat = RematCallback(budget)
    began = {}

    class FirstStep(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            began["train"] = time.perf_counter()

        def on_train_batch_end(self, index, logs=None):
            if index == 0:
                began["first_step_s"] = time.perf_counter() - began["train"]

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, callbacks=[remat, FirstStep()], verbose=0)
    (key, result), = remat.plans.items()
    step = remat._steps[key]
    xb, yb = tf.nest.map_structure(lambda a: tf.constant(a[:batch]), (x, y))
    allocator = [allocator_peak(step, model, xb, yb, reads=1) for _ in range(5)]
    requested = allocator_peak(step, model, xb, yb, count="requested")
    loss_fn = result.extraction.side_table.loss_fn
    plain = plain_train_step(model, loss_fn, _fresh(model.optimizer))
    if options.get("jit"):
        plain = tf.function(plain.python_function, jit_compile=True)
    timing = time_in_turns(lambda: step(xb, yb, None), lambda: plain(xb, yb), steps)
    row = {**_step_row(result, requested, allocator, timing, began.get("first_step_s")),
           "planned_with": getattr(result, "planned_with", None)}
    try:
        measured = measure_model(model, budget, batch_size=batch, steps=steps, verbose=0)
    except Exception as error:  # e.g. its plan (never XLA's) infeasible where fit's was not
        row["m_error"] = f"{type(error).__name__}: {error}"
        return row
    row.update({f"m_{k}": measured[k] for k in (
        "predicted_peak_bytes", "requested_peak_bytes", "measured_peak_bytes", "predicted_time_over_plain",
        "time_over_plain", "time_over_plain_quartiles", "grad_error", "grad_global_error", "gradients_match",
        "costly_vjp_rebuilds", "recomputed_layer_calls", "inexact_implementations")})
    return row


def _step_row(result, requested: int, allocator: list[int], timing, first_step_s) -> dict:
    """The columns of a trained step: its plan's prediction and budget, the bytes it
    requested, the allocator's reads and its time against plain in turns."""
    return {
        "budget_bytes": result.budget_bytes,
        "fit_predicted": result.predicted_peak_bytes,
        "fit_requested": requested,
        "fit_allocator_max": max(allocator),
        "fit_allocator_min": min(allocator),
        "fit_planned_time": result.predicted_time_over_plain,
        "fit_time": timing.ratio,
        "fit_time_quartiles": list(timing.ratio_quartiles),
        "fit_overhead": result.overhead,
        "first_step_s": first_step_s,
        "checkpoint_all_peak": result.checkpoint_all_peak_bytes,
    }


def vae_case(batch: int):
    """keras.io's VAE (conv encoder / decoder, 28x28): its loss on (data, epsilon) and one
    batch of each; the noise comes in as an argument, since value_and_grad refuses noise
    drawn inside the function (benchmarks/forwarded_upstream.py uses it too)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers, ops

    keras.utils.set_random_seed(0)
    latent = 2
    image = keras.Input((28, 28, 1))
    h = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(image)
    h = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Dense(16, activation="relu")(layers.Flatten()(h))
    encoder = keras.Model(image, [layers.Dense(latent)(h), layers.Dense(latent)(h)], name="encoder")
    code = keras.Input((latent,))
    h = layers.Reshape((7, 7, 64))(layers.Dense(7 * 7 * 64, activation="relu")(code))
    h = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(h)
    h = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(h)
    decoder = keras.Model(code, layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(h), name="decoder")

    def vae_loss(data, epsilon):
        z_mean, z_log_var = encoder(data, training=True)
        z = z_mean + ops.exp(0.5 * z_log_var) * epsilon
        reconstruction = decoder(z, training=True)
        rec = ops.mean(ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
        kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
        return rec + ops.mean(ops.sum(kl, axis=1))

    rng = np.random.default_rng(0)
    data = tf.constant(rng.random((batch, 28, 28, 1), dtype=np.float32))
    epsilon = tf.constant(rng.standard_normal((batch, latent), dtype=np.float32))
    return vae_loss, data, epsilon


def check_vae(budget, batch, steps) -> dict:
    """keras.io's VAE (:func:`vae_case`) with a train_step on tfremat.value_and_grad."""
    import tensorflow as tf

    import tfremat
    from tfremat.numerics import closeness
    from tfremat.runtime.memory import measure_step_peak
    from tfremat.runtime.timing import time_in_turns

    vae_loss, data, epsilon = vae_case(batch)
    began = time.perf_counter()
    g = tfremat.value_and_grad(vae_loss, budget, data, epsilon)
    loss, grads = g(data, epsilon)
    first_step_s = time.perf_counter() - began
    variables = g.trainable_variables

    @tf.function
    def tape_grads(d, e):
        with tf.GradientTape() as tape:
            value = vae_loss(d, e)
        return value, tape.gradient(value, variables)

    plain_loss, plain = tape_grads(data, epsilon)
    match = closeness([t.numpy() for t in grads], [t.numpy() for t in plain])
    resident = list(variables)
    allocator = [measure_step_peak(lambda a, b: g(a, b), data, epsilon, resident=resident) for _ in range(5)]
    requested = measure_step_peak(lambda a, b: g(a, b), data, epsilon, resident=resident, warmup=0,
                                  count="requested")
    timing = time_in_turns(lambda: g(data, epsilon), lambda: tape_grads(data, epsilon), steps)
    result = g.plan
    return {
        **_step_row(result, requested, allocator, timing, first_step_s),
        "m_grad_error": match.max_tensor_error,
        "m_grad_global_error": match.global_error,
        "m_gradients_match": bool(match.max_tensor_error <= 1e-4 and abs(float(loss) - float(plain_loss)) < 1e-4),
    }


def check_train_step(budget, batch, steps, conv_norm=False) -> dict:
    """keras.io "Customizing what happens in fit()": a subclassed Model whose own train_step
    (loss tracker, ``optimizer.apply``) takes its gradients from :func:`tfremat.value_and_grad`
    instead of a tape, on a CNN with LayerNormalization and Dropout. Trained three batches with
    ``fit`` and again, from the same weights and dropout seeds, with the tape its source writes:
    the losses, the weights and the seeds after must agree. Then, with the seeds put back before
    each call, one step's gradients against the tape's, the allocator and time as for the VAE."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers

    import tfremat
    from tfremat.numerics import closeness
    from tfremat.runtime.memory import measure_step_peak
    from tfremat.runtime.timing import time_in_turns

    class CustomModel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
            self.value_and_grad = None  # tfremat's, else the tape

        def compute(self, x, y):
            return self.loss_fn(y, self(x, training=True))

        def train_step(self, data):
            x, y = data
            if self.value_and_grad is not None:
                loss, gradients = self.value_and_grad(x, y)
                variables = self.value_and_grad.trainable_variables
            else:
                with tf.GradientTape() as tape:
                    loss = self.compute(x, y)
                variables = self.trainable_variables
                gradients = tape.gradient(loss, variables)
            self.optimizer.apply(gradients, variables)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker]

    keras.utils.set_random_seed(0)
    inputs = keras.Input((28, 28, 1))
    h = inputs
    for filters, convolutions in ((32, 3), (64, 2)):
        for _ in range(convolutions):
            h = layers.Conv2D(filters, 3, activation="relu", padding="same")(h)
            h = layers.LayerNormalization()(h) if conv_norm else h
        h = layers.MaxPooling2D()(h)
    h = layers.Dropout(0.5)(layers.Flatten()(h))
    for units in (128, 64):
        h = layers.Dense(units, activation="relu")(h)
        h = layers.Dropout(0.3)(h if conv_norm else layers.LayerNormalization()(h))
    model = CustomModel(inputs, layers.Dense(10, activation="softmax")(h), name="dropout_layernorm_cnn")
    rng = np.random.default_rng(0)
    x = rng.random((3 * batch, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, 3 * batch)
    state = [v for v in model.variables if "seed" in v.path or v.trainable]  # weights, the dropouts' seeds
    start = [v.numpy() for v in state]
    xb, yb = tf.constant(x[:batch]), tf.constant(y[:batch])

    def train(g):
        for variable, value in zip(state, start):
            variable.assign(value)
        model.value_and_grad = g
        model.compile(optimizer="adam")
        losses = []
        logger = keras.callbacks.LambdaCallback(on_train_batch_end=lambda i, logs: losses.append(float(logs["loss"])))
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
        return losses, [v.numpy() for v in state]

    began = time.perf_counter()
    g = tfremat.value_and_grad(model.compute, budget, xb, yb)
    made_s = time.perf_counter() - began
    fit_losses, fit_after = train(g)
    first_step_s = time.perf_counter() - began
    plain_losses, plain_after = train(None)
    weights = [i for i, v in enumerate(state) if v.trainable]
    after = closeness([fit_after[i] for i in weights], [plain_after[i] for i in weights])
    seeds = [v for v in state if not v.trainable]
    seeds_after_fit = all(np.array_equal(fit_after[i], plain_after[i]) for i, v in enumerate(state) if not v.trainable)
    values = [v.numpy() for v in seeds]
    variables = g.trainable_variables

    def put_back():
        for variable, value in zip(seeds, values):
            variable.assign(value)

    @tf.function
    def tape_grads(a, b):
        with tf.GradientTape() as tape:
            value = model.compute(a, b)
        return value, tape.gradient(value, variables)

    put_back()
    loss, grads = g(xb, yb)
    seeds_after_g = [v.numpy() for v in seeds]
    put_back()
    plain_loss, plain = tape_grads(xb, yb)
    seeds_after_tape = [v.numpy() for v in seeds]
    match = closeness([t.numpy() for t in grads], [t.numpy() for t in plain])
    resident = list(variables)
    allocator = [measure_step_peak(lambda a, b: g(a, b), xb, yb, resident=resident) for _ in range(5)]
    requested = measure_step_peak(lambda a, b: g(a, b), xb, yb, resident=resident, warmup=0, count="requested")
    timing = time_in_turns(lambda: g(xb, yb), lambda: tape_grads(xb, yb), steps)
    return {
        **_step_row(g.plan, requested, allocator, timing, first_step_s),
        "value_and_grad_s": made_s,
        "fit_losses": fit_losses,
        "plain_losses": plain_losses,
        "weights_after_error": after.max_tensor_error,
        "seeds_after_fit_alike": seeds_after_fit,
        "seeds_advance_alike": all(np.array_equal(a, b) for a, b in zip(seeds_after_g, seeds_after_tape)),
        "m_grad_error": match.max_tensor_error,
        "m_grad_global_error": match.global_error,
        "m_gradients_match": bool(match.max_tensor_error <= 1e-4 and abs(float(loss) - float(plain_loss)) < 1e-4),
    }


def child(check: str, steps: int) -> None:
    builder, budget, batch, kind, options = CHECKS[check]
    sys.path.insert(0, ROOT)  # this checkout's tfremat
    try:
        if kind == "vae":
            row = check_vae(budget, batch, steps)
        elif kind == "train_step":
            row = check_train_step(budget, batch, steps, bool(options.get("conv_norm")))
        else:
            row = check_fit(builder, budget, batch, options, steps)
    except Exception as error:  # the row says what a user would have seen
        row = {"error": f"{type(error).__name__}: {error}"}
    print("USER_CHECK_ROW " + json.dumps(row, default=float), flush=True)


# ---------------------------------------------------------------- parent: run, collect, render

STARTUP = re.compile(r"oneDNN custom operations|cpu_feature_guard|rebuild TensorFlow|absl::InitializeLog|"
                     r"To enable the following instructions|port\.cc|^\s*$")


PROFILER = re.compile(r"profiler_session\.cc|save_profile\.cc")


def run_child(script: str, child_args: list[str], timeout: float, cache_dir: str, sample: int = 60) -> dict:
    """One check in a fresh process, as a user has it: ``script --child ...`` under TensorFlow's
    default inter-op threads and oneDNN setting, the BFC allocator and an empty tfremat cache.
    Its row (the last ``USER_CHECK_ROW`` line, or the error) with its wall seconds and stderr
    lines counted (those from TensorFlow's profiler apart), ``sample`` of the others kept."""
    env = dict(os.environ)
    env.pop("TF_NUM_INTEROP_THREADS", None)  # TensorFlow's default, as a user has it
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env["TFREMAT_CACHE_DIR"] = cache_dir
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(script), "--child", *child_args],
                              env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as error:
        stdout = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else (error.stderr or "")
        stdout += "\nUSER_CHECK_ROW " + json.dumps({"error": f"over the {timeout:.0f} s limit"})
    rows = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("USER_CHECK_ROW ")]
    row = json.loads(rows[-1]) if rows else {"error": "no result: " + (stderr.strip().splitlines() or ["?"])[-1]}
    lines = [line for line in re.split(r"[\r\n]", stderr) if not STARTUP.search(line)]
    row.update({"wall_s": time.perf_counter() - began, "stderr_lines": len(lines),
                "profiler_lines": sum(bool(PROFILER.search(line)) for line in lines),
                "stderr_sample": [line for line in lines if not PROFILER.search(line)][:sample]})
    return row


def run_rows(names: list[str], run_one: Callable[[str, str], dict], prefix: str) -> list[dict]:
    """``run_one(name, cache_dir)`` for each check, each with its own empty cache, the load
    at its start recorded and a line printed as it ends."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=prefix) as cache_dir:
        for name in names:
            load = os.getloadavg()[0]
            row = run_one(name, os.path.join(cache_dir, name))
            row["load"] = load
            rows.append(row)
            print(f"{name}: {row.get('error') or 'done'} ({row['wall_s']:.0f} s, load {load:.1f})", flush=True)
    return rows


def run_check(check: str, steps: int, timeout: float, cache_dir: str) -> dict:
    row = run_child(__file__, [check, "--steps", str(steps)], timeout, cache_dir)
    row.update({"check": check, "model": CHECKS[check][0], "budget": CHECKS[check][1], "batch": CHECKS[check][2],
                "kind": CHECKS[check][3], "options": CHECKS[check][4]})
    return row


def _mib(n):
    return "" if n is None else f"{n / MiB:.2f}"


def _notes(row: dict) -> str:
    notes = []
    options = row["options"]
    if options.get("mixed"):
        notes.append("mixed_float16")
    if options.get("jit"):
        notes.append("jit_compile")
    if row["kind"] == "vae":
        notes.append("custom train_step, value_and_grad")
    if row["kind"] == "train_step":
        notes.append("subclassed Model, own train_step on value_and_grad"
                     + (", LayerNormalization on the conv maps" if options.get("conv_norm") else ""))
    if row.get("error"):
        return "; ".join(notes + [row["error"][:300].replace("|", "/")])
    budget = row["budget_bytes"]
    if budget is not None and row["fit_allocator_max"] > budget:
        notes.append(f"ALLOCATOR OVER BUDGET {row['fit_allocator_max'] / budget:.3f}x")
    if row["fit_requested"] > row["fit_predicted"]:
        notes.append(f"requested {row['fit_requested'] / row['fit_predicted']:.3f}x predicted")
    if row.get("m_error"):
        notes.append("measure_model: " + row["m_error"][:160])
    if row.get("m_predicted_peak_bytes"):
        m = row["m_measured_peak_bytes"] / row["m_predicted_peak_bytes"]
        notes.append(f"measure_model (no allocator check): pred {_mib(row['m_predicted_peak_bytes'])}, "
                     f"req {row['m_requested_peak_bytes'] / row['m_predicted_peak_bytes']:.3f}x, alloc {m:.3f}x; "
                     f"time {row['m_time_over_plain']:.3f} vs planned {row['m_predicted_time_over_plain']:.3f}")
    if row.get("m_costly_vjp_rebuilds"):
        notes.append(f"{row['m_costly_vjp_rebuilds']} costly VJP rebuilds")
    if row.get("m_inexact_implementations"):
        notes.append("inexact: " + ", ".join(i["name"] for i in row["m_inexact_implementations"]))
    if row.get("fit_losses") is not None:
        worst = max(abs(a - b) for a, b in zip(row["fit_losses"], row["plain_losses"]))
        notes.append(f"3 fit batches against the tape's: losses within {worst:.1e}, weights after within "
                     f"{row['weights_after_error']:.1e}, dropout seeds advance "
                     + ("alike" if row["seeds_advance_alike"] else "DIFFERENTLY"))
    if row.get("planned_with"):
        notes.append(f"re-planned with {row['planned_with']}")
    notes.append(f"{row['stderr_lines']} stderr lines ({row['profiler_lines']} from TF's profiler)")
    return "; ".join(notes)


def render(rows: list[dict], argv: list[str], header_lines: list[str]) -> str:
    out = ["# A new user's check: models tfremat was not written for, default inter-op threads", "",
           f"Command: `python benchmarks/user_check.py {' '.join(argv)}`.", *header_lines, "",
           "One process per row, `TF_NUM_INTEROP_THREADS` unset (TensorFlow's default), oneDNN on, "
           "an empty tfremat cache per run, Adam. The step is the one `RematCallback` (what `tfremat.fit` runs) "
           "trained with after its allocator check. `alloc` is the largest of five allocator reads of that step; "
           "`time ratio` is its measured time/plain (median per-round ratio of steps timed in turns with a plain "
           "tape step, quartiles in brackets) over the plan's `predicted_time_over_plain` (issue 33's band: "
           f"{TIME_BAND[0]}-{TIME_BAND[1]}). Gradients and the `measure_model` note come from "
           "`tfremat.measure.measure_model` on the same model and budget (planned without the allocator check). "
           "`first step s`: from `fit` starting to the first batch ending (extraction, profiling, planning, "
           "compile, allocator check).", "",
           "| model | budget | batch | predicted MiB | requested MiB | alloc MiB | budget MiB | planned | time/plain | "
           "time ratio | gradients | first step s | notes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("error"):
            out.append(f"| {row['model']} | {row['budget']} | {row['batch']} | | | | | | | | | | {_notes(row)} |")
            continue
        quartiles = row["fit_time_quartiles"]
        ratio = row["fit_time"] / row["fit_planned_time"]
        flag = "" if TIME_BAND[0] <= ratio <= TIME_BAND[1] else " **out**"
        grads = row.get("m_gradients_match")
        grads = "" if grads is None else ("match" if grads else f"DIFFER ({row['m_grad_error']:.1e})")
        out.append(
            f"| {row['model']} | {row['budget']} | {row['batch']} | {_mib(row['fit_predicted'])} | "
            f"{_mib(row['fit_requested'])} | {_mib(row['fit_allocator_max'])} | {_mib(row['budget_bytes'])} | "
            f"{row['fit_planned_time']:.3f} | {row['fit_time']:.3f} ({quartiles[0]:.2f}-{quartiles[1]:.2f}) | "
            f"{ratio:.3f}{flag} | {grads} | {row['first_step_s']:.1f} | {_notes(row)} |")
    return "\n".join(out) + "\n"


def saved_rows(from_json: str) -> dict:
    """Rows saved as JSON by check name, from comma-separated files (later rows replace earlier)."""
    rows = {}
    for path in from_json.split(","):
        with open(path) as handle:
            rows.update({row["check"]: row for row in json.load(handle)})
    return rows


def chosen_checks(checks, only: str | None) -> list[str]:
    """The names of ``checks`` that contain one of ``only``'s comma-separated substrings (all without)."""
    names = list(checks)
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        names = [n for n in names if any(w in n for w in wanted)]
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="check names or substrings, comma separated")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per check (default 300)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the markdown table (default %(default)s)")
    parser.add_argument("--json", help="also write the rows (with their stderr lines) as JSON here")
    parser.add_argument("--from_json", help="render rows saved with --json (comma separated files; a later "
                                            "file's row replaces an earlier one of the same check) instead of running")
    parser.add_argument("--measured_at", help="the tree the rows were measured at, for the header (default: this "
                                              "checkout's git log -1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps)
        return 0
    if args.from_json:
        rows = saved_rows(args.from_json)
        write(list(rows.values()), args, argv)
        return 0
    names = chosen_checks(CHECKS, args.only)
    if args.list or not names:
        print("\n".join(f"{n}: {CHECKS[n][0]} at {CHECKS[n][1]}, batch {CHECKS[n][2]}" for n in CHECKS))
        return 0 if args.list else 2
    rows = run_rows(names, lambda name, cache: run_check(name, args.steps, args.timeout, cache), "tfremat_user_check_")
    write(rows, args, argv)
    return 0


def write(rows: list[dict], args, argv) -> None:
    """The table of ``rows`` to ``--out`` (and the rows to ``--json``), at this checkout's commit."""
    commit = subprocess.run(["git", "log", "-1", "--oneline"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--short", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    loads = [r["load"] for r in rows]
    at = args.measured_at or f"`{commit}`" + (f" with uncommitted changes in {len(dirty.splitlines())} files" if dirty else "")
    header_lines = [f"At {at}; "
                    f"1-minute load average {min(loads):.1f}-{max(loads):.1f} at the rows' starts (2 shared cores)."]
    with open(args.out, "w") as handle:
        handle.write(render(rows, sys.argv[1:] if argv is None else argv, header_lines))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1, default=float)


if __name__ == "__main__":
    sys.exit(main())
