"""A seventh new user (session 31's task U7): more models tfremat's authors did not write (issue 33).

The earlier checks (:mod:`user_check` to :mod:`user_check_6`) trained keras.applications'
MobileNets, EfficientNets, ResNet50, DenseNet121, ConvNeXtTiny and Xception, keras-hub's GPT-2,
BERT, DistilBERT and RoBERTa backbones, keras.io's ViT, CCT, Perceiver, FNet, U-Net, VAE, GAN,
ConvLSTM and seq2seq, a tiny GRU and a TabTransformer. Each check here is a model as keras.io /
keras.applications / keras-hub users write it, trained through the README's entry points with
default options, at one of each budget form:

- ``mlp_mixer``: keras.io's "Image classification with modern MLP models" MLP-Mixer (patches,
  token mixing by a transposed ``Dense``), ``tfremat.fit`` at ``"60%"``;
- ``conv1d_text``: keras.io's "Text classification from scratch" (``Embedding``, two strided
  ``Conv1D``, ``GlobalMaxPooling1D``) on 500-token rows, ``"50% of activations"``;
- ``char_gru``: a character-level text generator as TensorFlow's "Text generation with an RNN"
  writes it (``Embedding``, ``GRU(256, return_sequences=True)``, a ``Dense`` over the vocabulary)
  on 100-character rows, ``"min"`` (``_all``: ``"100%"``, nothing recomputed; ``_executor``: its
  plain tape step on TensorFlow's default and single-threaded executors, without tfremat);
- ``gemma_hub``: keras-hub's ``GemmaCausalLM`` around a tiny random ``GemmaBackbone``, its own
  ``compile()`` defaults, next-token targets with the padding mask as sample weights, ``"70%"``;
- ``deberta_hub``: keras-hub's ``DebertaV3TextClassifier`` around a tiny random
  ``DebertaV3Backbone`` (relative-position attention), ``"60% of activations"``;
- ``swin_hub``: keras-hub's ``SwinTransformerBackbone`` (shifted-window attention) at 32x32 with a
  pooling head, ``RematCallback("70% of activations")`` passed to ``model.fit``;
- ``augment_inside``: a CNN with ``RandomFlip``, ``RandomRotation`` and ``RandomCrop`` as its
  first layers (keras.io's augmentation inside the model), ``"70%"``;
- ``multi_output_weights``: two outputs (class and box) with a loss per output and
  ``loss_weights``, at an amount written as a user guesses it, ``"6MiB"``;
- ``nasnetmobile``: ``keras.applications.NASNetMobile(weights=None)`` at 64x64, batch 4, ``"min"``;
- ``inceptionv3``: ``keras.applications.InceptionV3(weights=None)`` at 75x75 (its smallest), batch 4,
  the budget written as the fraction ``0.8``.

Per training check, as :mod:`user_check_6` does (``fit_compared``, ``render`` and the command
line of :mod:`user_check_5` / :mod:`user_check_3` reused): plain ``model.fit`` and tfremat from
the same seeds; the weights after step 1, step 5 and the last step against plain's; the
allocator's peak of every step after the first in both fits; three allocator reads and the
requested bytes of the step afterwards; its time against a plain tape step in turns over the
plan's ``predicted_time_over_plain``; TensorFlow's E-level lines and tfremat's warnings on stderr.

Run: ``python benchmarks/user_check_7.py`` (writes the rows to ``benchmarks/results/user_check_7.json``
after each check and prints the table); ``--only`` check names (substrings), ``--list``,
``--timeout`` seconds per check, ``--from_json`` to print the table of saved rows.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat

import user_check_6  # noqa: E402
from user_check_3 import _images, child_row, json_rows_main  # noqa: E402
from user_check_4 import _nbytes  # noqa: E402
from user_check_5 import TRAIN_STEPS, _compiled, fit_compared  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "user_check_7.json")
TURNS = 10  # char_gru_executor's turns of the two executors

# name: (budget, what the check exercises)
CHECKS = {
    "mlp_mixer": ("60%", "keras.io MLP-Mixer, 32x32, patches of 4, 4 blocks"),
    "conv1d_text": ("50% of activations", "keras.io text classification from scratch, Conv1D x2, 500 tokens"),
    "char_gru": ("min", "char-level generator: Embedding, GRU(256, return_sequences), 100 characters, batch 32"),
    "char_gru_all": ("100%", "the same at 100%: nothing recomputed"),
    "char_gru_executor": ("-", "char_gru's plain tape step on the default and the single-threaded executor"),
    "gemma_hub": ("70%", "keras-hub GemmaCausalLM, tiny random GemmaBackbone, its compile() defaults"),
    "deberta_hub": ("60% of activations", "keras-hub DebertaV3TextClassifier, tiny random DebertaV3Backbone"),
    "swin_hub": ("70% of activations", "keras-hub SwinTransformerBackbone 32x32 + head; model.fit + RematCallback"),
    "augment_inside": ("70%", "CNN with RandomFlip, RandomRotation, RandomCrop inside the model"),
    "multi_output_weights": ("6MiB", "two outputs (class, box), a loss each, loss_weights"),
    "nasnetmobile": ("min", "keras.applications.NASNetMobile(weights=None), 64x64, batch 4"),
    "inceptionv3": (0.8, "keras.applications.InceptionV3(weights=None), 75x75, batch 4, budget as a fraction"),
}


# ---------------------------------------------------------------- models (child)

def _mlp_mixer(image=32, patch=4, dim=64, blocks=4):
    """keras.io's MLP-Mixer: patches projected, then per block an MLP across the patches (on the
    transposed tokens) and one across the channels, each with a residual."""
    import keras
    import tensorflow as tf
    from keras import layers

    patches_count = (image // patch) ** 2

    class Patches(layers.Layer):
        def call(self, images):
            patches = tf.image.extract_patches(images, sizes=[1, patch, patch, 1], strides=[1, patch, patch, 1],
                                               rates=[1, 1, 1, 1], padding="VALID")
            return tf.reshape(patches, (tf.shape(images)[0], patches_count, patch * patch * images.shape[-1]))

    inputs = keras.Input((image, image, 3))
    h = layers.Dense(dim)(Patches()(inputs))
    for _ in range(blocks):
        x = layers.LayerNormalization(epsilon=1e-6)(h)
        x = layers.Permute((2, 1))(x)
        x = layers.Dense(patches_count)(layers.Dense(patches_count, activation="gelu")(x))
        h = layers.Add()([h, layers.Permute((2, 1))(x)])
        x = layers.LayerNormalization(epsilon=1e-6)(h)
        x = layers.Dense(dim)(layers.Dense(dim, activation="gelu")(x))
        h = layers.Add()([h, layers.Dropout(0.2)(x)])
    h = layers.Dropout(0.2)(layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="mlp_mixer")


def _conv1d_text(length=500, vocabulary=20000, dim=128):
    """keras.io's "Text classification from scratch", its model as written."""
    import keras
    from keras import layers

    inputs = keras.Input((length,), dtype="int64")
    h = layers.Dropout(0.5)(layers.Embedding(vocabulary, dim)(inputs))
    h = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(h)
    h = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(h)
    h = layers.GlobalMaxPooling1D()(h)
    h = layers.Dropout(0.5)(layers.Dense(128, activation="relu")(h))
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid", name="predictions")(h), name="conv1d_text")
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def _char_gru(vocabulary=65, dim=64, units=256):
    import keras
    from keras import layers

    inputs = keras.Input((None,), dtype="int32")
    h = layers.GRU(units, return_sequences=True)(layers.Embedding(vocabulary, dim)(inputs))
    model = keras.Model(inputs, layers.Dense(vocabulary)(h), name="char_gru")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _gemma(length, vocabulary=512):
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=vocabulary, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=1, hidden_dim=64, intermediate_dim=128,
                                              head_dim=16)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile()  # keras-hub's defaults: Adam(2e-5), sparse cross-entropy from logits, weighted accuracy
    return model


def _deberta(length, vocabulary=512):
    import keras_hub

    backbone = keras_hub.models.DebertaV3Backbone(vocabulary_size=vocabulary, num_layers=2, num_heads=2,
                                                  hidden_dim=64, intermediate_dim=128, max_sequence_length=length,
                                                  bucket_size=32)
    model = keras_hub.models.DebertaV3TextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    model.compile()
    return model


def _swin(image=32):
    import keras
    import keras_hub
    from keras import layers

    backbone = keras_hub.models.SwinTransformerBackbone(image_shape=(image, image, 3), embed_dim=32, depths=[2, 2],
                                                        num_heads=[2, 4], window_size=4, patch_size=2)
    inputs = keras.Input((image, image, 3))
    features = backbone(inputs)
    pooled = layers.GlobalAveragePooling1D()(layers.Reshape((-1, features.shape[-1]))(features))
    return _compiled(keras.Model(inputs, layers.Dense(10, activation="softmax")(pooled), name="swin"))


def _augmented_cnn():
    import keras
    from keras import layers

    inputs = keras.Input((36, 36, 3))
    h = layers.RandomFlip("horizontal")(inputs)
    h = layers.RandomRotation(0.1)(h)
    h = layers.RandomCrop(32, 32)(h)
    for filters in (32, 32, 64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = layers.BatchNormalization()(h)
    h = layers.GlobalAveragePooling2D()(layers.MaxPooling2D()(h))
    return _compiled(keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="augmented_cnn"))


def _two_outputs():
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (32, 32, 64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    label = layers.Dense(10, activation="softmax", name="label")(h)
    box = layers.Dense(4, activation="sigmoid", name="box")(layers.Dense(32, activation="relu")(h))
    model = keras.Model(inputs, {"label": label, "box": box}, name="two_outputs")
    model.compile(optimizer="adam", loss={"label": "sparse_categorical_crossentropy", "box": "mse"},
                  loss_weights={"label": 1.0, "box": 5.0}, metrics={"label": ["accuracy"]})
    return model


# ---------------------------------------------------------------- checks (child)

def _arrays_fit(make, budget, x, y, batch, **fit_extra):
    import tensorflow as tf

    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False, **fit_extra}
    constant = tf.nest.map_structure(lambda a: tf.constant(a[:batch]), (x, y))
    return fit_compared(make, fit_kwargs, budget, constant, _nbytes(*tf.nest.map_structure(lambda a: a[:batch],
                                                                                           (x, y))))


def check_mlp_mixer(budget, work):
    x, y = _images(16 * TRAIN_STEPS)
    return _arrays_fit(lambda: _compiled(_mlp_mixer()), budget, x, y, 16)


def check_conv1d_text(budget, work):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(1, 20000, (32 * TRAIN_STEPS, 500)).astype("int64")
    return _arrays_fit(_conv1d_text, budget, x, rng.integers(0, 2, (32 * TRAIN_STEPS, 1)).astype("float32"), 32)


def check_char_gru(budget, work):
    import numpy as np

    rng = np.random.default_rng(0)
    text = rng.integers(0, 65, (32 * TRAIN_STEPS, 101)).astype("int32")
    return _arrays_fit(_char_gru, budget, text[:, :-1], text[:, 1:], 32)  # next-character targets


def check_char_gru_all(budget, work):
    return check_char_gru(budget, work)


def check_char_gru_executor(budget, work):
    """The allocator's peak of ``char_gru``'s plain tape step (no tfremat) on TensorFlow's
    default executor and on the single-threaded one the compiled step runs on with default
    inter-op threads (:func:`tfremat.runtime.executor.step_executor`), in turns."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfremat.runtime.executor import SEQUENTIAL_EXECUTOR

    keras.utils.set_random_seed(0)
    model = _char_gru()
    text = tf.constant(np.random.default_rng(0).integers(0, 65, (32, 101)).astype("int32"))
    x, y = text[:, :-1], text[:, 1:]
    model(x)

    def step(tokens, targets):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=tokens, y=targets, y_pred=model(tokens, training=True))
        return tape.gradient(loss, model.trainable_variables)

    def peak(function) -> int:
        function(x, y)
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        [tf.convert_to_tensor(g).numpy() for g in function(x, y)]
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start

    def seconds(function, runs=5) -> float:
        began = time.perf_counter()
        for _ in range(runs):
            [tf.convert_to_tensor(g).numpy() for g in function(x, y)]
        return (time.perf_counter() - began) / runs

    peaks = {"default": [], "single_threaded": []}
    times = {"default": [], "single_threaded": []}
    default = tf.function(step, autograph=False)
    with tf.experimental.function_executor_type(SEQUENTIAL_EXECUTOR):
        single_threaded = tf.function(step, autograph=False)
        single_threaded(x, y)  # traced here, so its calls run on the single-threaded executor
    for _ in range(TURNS):  # in turns, so that a change of load falls on both
        peaks["default"].append(peak(default))
        times["default"].append(seconds(default))
        with tf.experimental.function_executor_type(SEQUENTIAL_EXECUTOR):
            peaks["single_threaded"].append(peak(single_threaded))
            times["single_threaded"].append(seconds(single_threaded))
    ratios = sorted(s / d for s, d in zip(times["single_threaded"], times["default"]))
    return {"executor_peaks": peaks, "executor_seconds": times, "load_after": os.getloadavg()[0],
            "outcome": "single-threaded over default: peak "
            f"{max(peaks['single_threaded']) / max(peaks['default']):.2f}x, time {ratios[len(ratios) // 2]:.2f}x "
            f"(median of {TURNS} turns, {ratios[0]:.2f}-{ratios[-1]:.2f})"}


def _token_rows(n, length, vocabulary, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocabulary, (n, length)).astype("int32")
    padding = np.ones((n, length), dtype="int32")
    for row, keep in enumerate(rng.integers(length // 4, length, n)):
        tokens[row, keep:], padding[row, keep:] = 0, 0
    return tokens, padding


def check_gemma_hub(budget, work):
    import tensorflow as tf

    batch, length = 8, 64
    tokens, padding = _token_rows(batch * TRAIN_STEPS, length + 1, 512)
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding[:, :-1]}
    y, weights = tokens[:, 1:], padding[:, 1:].astype("float32")
    fit_kwargs = {"x": x, "y": y, "sample_weight": weights, "batch_size": batch, "epochs": 1, "shuffle": False}
    timing = ({k: tf.constant(v[:batch]) for k, v in x.items()}, tf.constant(y[:batch]))
    return fit_compared(lambda: _gemma(length), fit_kwargs, budget, timing,
                        _nbytes(x["token_ids"][:batch], x["padding_mask"][:batch], y[:batch], weights[:batch]))


def check_deberta_hub(budget, work):
    import numpy as np
    import tensorflow as tf

    batch, length = 8, 64
    tokens, padding = _token_rows(batch * TRAIN_STEPS, length, 512)
    x = {"token_ids": tokens, "padding_mask": padding}
    y = np.random.default_rng(1).integers(0, 3, batch * TRAIN_STEPS)
    fit_kwargs = {"x": x, "y": y, "batch_size": batch, "epochs": 1, "shuffle": False}
    timing = ({k: tf.constant(v[:batch]) for k, v in x.items()}, tf.constant(y[:batch]))
    return fit_compared(lambda: _deberta(length), fit_kwargs, budget, timing,
                        _nbytes(tokens[:batch], padding[:batch], y[:batch]))


def check_swin_hub(budget, work):
    """The user passes the callback to ``model.fit`` (:func:`user_check_6.callback_fit_compared`)."""
    x, y = _images(16 * TRAIN_STEPS)
    return user_check_6.callback_fit_compared(_swin, budget, x, y, 16)


def check_augment_inside(budget, work):
    x, y = _images(16 * TRAIN_STEPS, (36, 36, 3))
    return _arrays_fit(_augmented_cnn, budget, x, y, 16)


def check_multi_output_weights(budget, work):
    import numpy as np

    x, labels = _images(16 * TRAIN_STEPS)
    boxes = np.random.default_rng(2).random((16 * TRAIN_STEPS, 4), dtype=np.float32)
    return _arrays_fit(_two_outputs, budget, x, {"label": labels, "box": boxes}, 16)


def check_nasnetmobile(budget, work):
    import keras

    def make():
        return _compiled(keras.applications.NASNetMobile(input_shape=(64, 64, 3), weights=None, classes=10))

    x, y = _images(4 * TRAIN_STEPS, (64, 64, 3))
    return _arrays_fit(make, budget, x, y, 4)


def check_inceptionv3(budget, work):
    import keras

    def make():
        return _compiled(keras.applications.InceptionV3(input_shape=(75, 75, 3), weights=None, classes=10))

    x, y = _images(4 * TRAIN_STEPS, (75, 75, 3))
    return _arrays_fit(make, budget, x, y, 4)


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "user_check_7_")


def main(argv=None) -> int:
    return json_rows_main(argv, __doc__, __file__, CHECKS, child, user_check_6.render, DEFAULT_JSON,
                          "tfremat_user_check_7_")


if __name__ == "__main__":
    sys.exit(main())
