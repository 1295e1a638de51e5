"""Conformance benchmark: the compiled step on models nobody here wrote (issue 19).

For every model constructor in ``keras.applications`` (``weights=None``, the smallest input
each accepts, 10 classes) and architectures written the way Keras users write them (a
transformer encoder whose blocks are a custom ``keras.layers.Layer`` holding
MultiHeadAttention, LayerNormalization, Dropout and a Sequential feed-forward; a ViT with a
patch-embedding layer; a bidirectional LSTM text model; a ConvMixer; a U-Net with
Conv2DTranspose; a ZeroPadding2D/Conv2D/ReLU chain), at batch 2, the graph is extracted
once and planned with ``checkpoint_all`` (100%), ``optimal`` (``time_limit=30``) and two
heuristics that recompute, ``eviction`` and ``chen_sqrtn_ap``, each at its first feasible
budget among 60% and 80% of the checkpoint-all peak, else at the smallest peak the strategy
reported reaching when that is below the checkpoint-all peak (so that it still recomputes).

Each schedule is compiled (:func:`tfremat.static_graph.compile_step`) and trains one step,
whose gradients (recorded by the optimizer as the step applies them) are compared with a
plain ``tf.GradientTape`` step's from the same state: per variable
``||a - e|| / max(||e||, 1e-2 * ||E||)`` (``E`` all expected gradients together; the floor
keeps a variable whose gradient is tiny next to the others from turning rounding into a
large relative error), its maximum over the variables, and the global ``||A - E|| / ||E||``.
Twice: as TensorFlow runs by default, and with Grappler's fusing rewrites off for both steps
(:class:`grappler_rewrites_off`), when they run the same kernels and agree up to summation
order. The plain step's own rounding noise (its gradients with the rewrites off against on)
is reported beside: at batch 2 some applications' gradients are mostly rounding (a batch
norm over 2 values normalizes them to +-1, whose gradient is 0 in exact arithmetic), where
only the rewrites-off comparison can tell. Then the step with the extraction's own optimizer
is measured (:func:`tfremat.static_graph.measure_step_peak`): the bytes its operations
request and the allocator's peak, against the simulator's prediction.

A strategy's status is ``ok`` (compiled, trained, finite; rewrites off: loss and gradients
within ``--var_tol`` / ``--global_tol``; default: within those or ``NOISE_FACTOR`` times the
noise), ``refused`` (tfremat raised one of its own errors on purpose: an extraction or
compile refusal, no schedule below the checkpoint-all peak), ``failed`` (any other
exception, a mismatch, a crash) or ``timeout`` (the model's subprocess ran out of time
before this strategy finished).

Each model runs in a fresh subprocess (TensorFlow state and memory) with a timeout, so a
crash or hang costs one row; ``--jobs 2`` runs two at once. Run:
``python benchmarks/conformance.py`` (writes ``benchmarks/results/conformance.md``);
``--only`` takes model names (or substrings, comma separated). Ops run one at a time
(``TF_NUM_INTEROP_THREADS=1``), the sequential execution the simulator models.
``tests/test_conformance.py`` runs a fast subset through :class:`ModelCheck`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

logger = logging.getLogger("benchmarks.conformance")

DEFAULT_OUT = os.path.join(HERE, "results", "conformance.md")
BATCH = 2
CLASSES = 10
# Vocabulary of the text models (random token ids below it).
VOCAB = 500
# Strategy, the budgets tried in order (share of the checkpoint-all peak), strategy options.
STRATEGIES = (
    ("checkpoint_all", (1.0,), {}),
    ("optimal", (0.6, 0.8), {"time_limit": 30}),
    ("eviction", (0.6, 0.8), {}),
    ("chen_sqrtn_ap", (0.6, 0.8), {}),
)
VAR_TOL = 1e-4
GLOBAL_TOL = 1e-5
# The per-variable error's denominator is at least this share of the global gradient norm.
FLOOR = 1e-2
LOSS_RTOL = 1e-5
# The default step (Grappler on) may differ from the plain one by this many times the plain
# step's own rounding noise (its gradients with Grappler's rewrites off against on).
NOISE_FACTOR = 10.0
# A fallback budget whose schedule costs more than this many extra plain steps is relaxed
# halfway to the checkpoint-all peak, at most RELAX_STEPS times (see ModelCheck.plan).
MAX_OVERHEAD = 3.0
RELAX_STEPS = 3
# Budgets tried after the strategy's own ones when an InfeasibleBudgetError does not say
# the smallest peak the strategy reached (eviction's does not).
FALLBACK_FRACTIONS = (0.9, 0.95)

# keras.applications constructors and the smallest square input each accepts (Inception
# and Xception refuse anything smaller; every other one takes 32x32, NASNet included when
# weights=None).
APPLICATION_SIZES = {
    "InceptionResNetV2": 75,
    "InceptionV3": 75,
    "Xception": 71,
}
APPLICATIONS = (
    "ConvNeXtBase", "ConvNeXtLarge", "ConvNeXtSmall", "ConvNeXtTiny", "ConvNeXtXLarge",
    "DenseNet121", "DenseNet169", "DenseNet201",
    "EfficientNetB0", "EfficientNetB1", "EfficientNetB2", "EfficientNetB3", "EfficientNetB4",
    "EfficientNetB5", "EfficientNetB6", "EfficientNetB7",
    "EfficientNetV2B0", "EfficientNetV2B1", "EfficientNetV2B2", "EfficientNetV2B3",
    "EfficientNetV2L", "EfficientNetV2M", "EfficientNetV2S",
    "InceptionResNetV2", "InceptionV3",
    "MobileNet", "MobileNetV2", "MobileNetV3Large", "MobileNetV3Small",
    "NASNetLarge", "NASNetMobile",
    "ResNet101", "ResNet101V2", "ResNet152", "ResNet152V2", "ResNet50", "ResNet50V2",
    "VGG16", "VGG19", "Xception",
)
USER_MODELS = ("zeropad_conv_chain", "transformer_encoder", "vit", "bilstm_text", "convmixer", "unet_transpose")
HUB_MODELS = ("gpt2_hub", "bert_hub")  # keras-hub backbones with a token classification head


def model_names() -> list[str]:
    """Every model of the suite: the user-style architectures, the keras-hub ones when
    keras-hub is installed, then the applications."""
    return list(USER_MODELS) + (list(HUB_MODELS) if keras_hub_installed() else []) + list(APPLICATIONS)


def keras_hub_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("keras_hub") is not None


def describe(name: str) -> str:
    """The input the model is built for, for the table."""
    if name in APPLICATIONS:
        size = APPLICATION_SIZES.get(name, 32)
        return f"{size}x{size}x3"
    return {"transformer_encoder": "64 tokens", "bilstm_text": "64 tokens", "gpt2_hub": "64 tokens",
            "bert_hub": "64 tokens"}.get(name, "32x32x3")


# --------------------------------------------------------------------------------------
# Models written the way Keras users write them (keras.io examples' style). TensorFlow and
# Keras are imported inside the builders so that the parent process never loads them.


def _user_layers():
    """The custom layers, defined on first use (they subclass keras.layers.Layer)."""
    import keras
    from keras import layers, ops

    class TokenAndPositionEmbedding(layers.Layer):
        """Token embedding plus a learned position embedding (keras.io's text transformer)."""

        def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            positions = ops.arange(0, ops.shape(x)[-1], 1)
            return self.token_emb(x) + self.pos_emb(positions)

    class TransformerBlock(layers.Layer):
        """Post-norm encoder block: attention, dropout, residual, LayerNorm, feed-forward."""

        def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
            super().__init__(**kwargs)
            self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads)
            self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
            self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
            self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
            self.dropout1 = layers.Dropout(rate)
            self.dropout2 = layers.Dropout(rate)

        def call(self, inputs, training=None):
            attn_output = self.att(inputs, inputs)
            attn_output = self.dropout1(attn_output, training=training)
            out1 = self.layernorm1(inputs + attn_output)
            ffn_output = self.ffn(out1)
            ffn_output = self.dropout2(ffn_output, training=training)
            return self.layernorm2(out1 + ffn_output)

    class PatchEmbedding(layers.Layer):
        """Non-overlapping patches projected by a strided Conv2D, a class token prepended,
        plus a learned position embedding."""

        def __init__(self, patch_size, num_patches, projection_dim, **kwargs):
            super().__init__(**kwargs)
            self.projection = layers.Conv2D(projection_dim, patch_size, strides=patch_size)
            self.num_patches = num_patches
            self.projection_dim = projection_dim

        def build(self, input_shape):
            self.projection.build(input_shape)
            self.class_token = self.add_weight(shape=(1, 1, self.projection_dim), initializer="zeros", name="cls")
            self.position_embedding = self.add_weight(
                shape=(1, self.num_patches + 1, self.projection_dim), initializer="random_normal", name="pos")

        def call(self, images):
            patches = self.projection(images)
            batch = ops.shape(patches)[0]
            patches = ops.reshape(patches, (batch, self.num_patches, self.projection_dim))
            cls = ops.broadcast_to(self.class_token, (batch, 1, self.projection_dim))
            return ops.concatenate([cls, patches], axis=1) + self.position_embedding

    return TokenAndPositionEmbedding, TransformerBlock, PatchEmbedding


def _zeropad_conv_chain():
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    x = inputs
    for filters, stride in ((16, 1), (16, 2), (32, 1), (32, 2)):
        x = layers.ZeroPadding2D(1)(x)
        x = layers.Conv2D(filters, 3, strides=stride)(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="zeropad_conv_chain")


def _transformer_encoder(maxlen=64, vocab_size=VOCAB, embed_dim=32, num_heads=2, ff_dim=64, blocks=6):
    import keras
    from keras import layers

    TokenAndPositionEmbedding, TransformerBlock, _ = _user_layers()
    inputs = layers.Input(shape=(maxlen,), dtype="int32")
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    for _ in range(blocks):
        x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(32, activation="relu")(x)
    outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="transformer_encoder")


def _vit(image_size=32, patch_size=4, projection_dim=32, num_heads=2, layers_count=3):
    import keras
    from keras import layers

    _, _, PatchEmbedding = _user_layers()
    num_patches = (image_size // patch_size) ** 2
    inputs = keras.Input((image_size, image_size, 3))
    encoded = PatchEmbedding(patch_size, num_patches, projection_dim)(inputs)
    for _ in range(layers_count):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=projection_dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = layers.Dense(projection_dim * 2, activation=keras.activations.gelu)(x3)
        x3 = layers.Dropout(0.1)(x3)
        x3 = layers.Dense(projection_dim, activation=keras.activations.gelu)(x3)
        x3 = layers.Dropout(0.1)(x3)
        encoded = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded)
    representation = layers.Lambda(lambda t: t[:, 0])(representation)
    representation = layers.Dropout(0.2)(representation)
    outputs = layers.Dense(CLASSES, activation="softmax")(representation)
    return keras.Model(inputs, outputs, name="vit")


def _bilstm_text(maxlen=64, max_features=VOCAB):
    import keras
    from keras import layers

    inputs = keras.Input(shape=(maxlen,), dtype="int32")
    x = layers.Embedding(max_features, 32)(inputs)
    x = layers.Bidirectional(layers.LSTM(16, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(16))(x)
    outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="bilstm_text")


def _convmixer(image_size=32, filters=32, depth=4, kernel_size=5, patch_size=2):
    import keras
    from keras import layers

    def activation_block(x):
        x = layers.Activation("gelu")(x)
        return layers.BatchNormalization()(x)

    inputs = keras.Input((image_size, image_size, 3))
    x = layers.Rescaling(scale=1.0 / 255)(inputs)
    x = layers.Conv2D(filters, kernel_size=patch_size, strides=patch_size)(x)
    x = activation_block(x)
    for _ in range(depth):
        x0 = x
        x = layers.DepthwiseConv2D(kernel_size=kernel_size, padding="same")(x)
        x = layers.Add()([activation_block(x), x0])
        x = layers.Conv2D(filters, kernel_size=1)(x)
        x = activation_block(x)
    x = layers.GlobalAvgPool2D()(x)
    outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="convmixer")


def _unet_transpose(image_size=32, base=8, depth=3):
    import keras
    from keras import layers

    def conv_block(x, filters):
        for _ in range(2):
            x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization()(x)
            x = layers.Activation("relu")(x)
        return x

    inputs = keras.Input((image_size, image_size, 3))
    x = inputs
    skips = []
    for level in range(depth):
        x = conv_block(x, base * 2**level)
        skips.append(x)
        x = layers.MaxPooling2D(2)(x)
    x = conv_block(x, base * 2**depth)
    for level in reversed(range(depth)):
        x = layers.Conv2DTranspose(base * 2**level, 2, strides=2, padding="same")(x)
        x = layers.Concatenate()([x, skips[level]])
        x = conv_block(x, base * 2**level)
    outputs = layers.Conv2D(CLASSES, 1, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="unet_transpose")


def _hub_backbone_head(backbone, seq_len: int):
    """``backbone`` on dict inputs of ``seq_len`` tokens, with a per-token softmax head."""
    import keras

    inputs = {name: keras.Input((seq_len,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")}
    if "segment_ids" in [t.name for t in backbone.inputs]:
        inputs["segment_ids"] = keras.Input((seq_len,), dtype="int32", name="segment_ids")
    hidden = backbone(inputs)
    if isinstance(hidden, dict):
        hidden = hidden["sequence_output"]
    outputs = keras.layers.Dense(CLASSES, activation="softmax", name="head")(hidden)
    return keras.Model(inputs, outputs, name=f"{backbone.name}_tagger")


def _gpt2_hub(seq_len=64, layers_count=2, hidden=64, heads=2):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=layers_count, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=hidden * 4, max_sequence_length=seq_len)
    return _hub_backbone_head(backbone, seq_len)


def _bert_hub(seq_len=64, layers_count=2, hidden=64, heads=2):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=layers_count, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=hidden * 4, max_sequence_length=seq_len)
    return _hub_backbone_head(backbone, seq_len)


USER_BUILDERS = {
    "gpt2_hub": _gpt2_hub,
    "bert_hub": _bert_hub,
    "zeropad_conv_chain": _zeropad_conv_chain,
    "transformer_encoder": _transformer_encoder,
    "vit": _vit,
    "bilstm_text": _bilstm_text,
    "convmixer": _convmixer,
    "unet_transpose": _unet_transpose,
}


def build(name: str, seed: int = 0):
    """The model called ``name`` (an application constructor or a user-style model)."""
    import keras

    keras.utils.set_random_seed(seed)
    if name in USER_BUILDERS:
        return USER_BUILDERS[name]()
    if name not in APPLICATIONS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    size = APPLICATION_SIZES.get(name, 32)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=CLASSES)


def sample_batch(model, batch: int = BATCH, seed: int = 0):
    """Random inputs (token ids for integer inputs) and one-hot labels shaped like the output."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    xs = {}
    for spec in model.inputs:
        shape = (batch, *spec.shape[1:])
        if "mask" in spec.name:
            xs[spec.name] = np.ones(shape, "int32")
        elif "segment" in spec.name:
            xs[spec.name] = np.zeros(shape, "int32")
        elif "int" in str(spec.dtype):
            xs[spec.name] = rng.integers(0, VOCAB, size=shape).astype("int32")
        else:
            xs[spec.name] = rng.standard_normal(shape).astype("float32")
    if isinstance(model._inputs_struct, dict):
        x = {name: tf.constant(value) for name, value in xs.items()}
    else:
        x = tf.constant(next(iter(xs.values())))
    classes = model.output.shape[-1]
    labels = rng.integers(0, classes, size=(batch, *model.output.shape[1:-1]))
    y = np.eye(classes, dtype="float32")[labels]
    return x, tf.constant(y)


# --------------------------------------------------------------------------------------
# The checks (in the worker process, or in the test's).


def _recording_sgd(**kwargs):
    """A plain SGD whose update step first copies the gradient it applies into a variable
    of its own: the gradients of the compiled step itself, as the optimizer receives them."""
    import keras
    import tensorflow as tf

    class RecordingSGD(keras.optimizers.SGD):
        def build(self, variables):
            if self.built:
                return
            super().build(variables)
            self.recorded = [self.add_variable_from_reference(v, name="recorded_gradient") for v in variables]

        def update_step(self, gradient, variable, learning_rate):
            dense = tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient
            self.recorded[self._get_variable_index(variable)].assign(dense)
            super().update_step(gradient, variable, learning_rate)

    return RecordingSGD(**kwargs)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}"[:300]


def gradient_errors(got, expected, floor: float = FLOOR):
    """``(max per-variable error, global error, index of the worst variable)``, norm-relative
    (see the module docstring)."""
    import numpy as np

    squares = [float(np.sum(np.square(e.astype(np.float64)))) for e in expected]
    total = math.sqrt(sum(squares))
    worst, worst_index, diff_squares = 0.0, -1, 0.0
    for k, (a, e) in enumerate(zip(got, expected)):
        d = float(np.sum(np.square(a.astype(np.float64) - e.astype(np.float64))))
        diff_squares += d
        denominator = max(math.sqrt(squares[k]), floor * total)
        error = math.sqrt(d) / denominator if denominator > 0 else (0.0 if d == 0 else math.inf)
        if math.isnan(worst):
            continue  # a NaN stays the worst
        if error > worst or math.isnan(error):
            worst, worst_index = error, k
    global_error = math.sqrt(diff_squares) / total if total > 0 else (0.0 if diff_squares == 0 else math.inf)
    return worst, global_error, worst_index


GRAPPLER_REWRITES = ("remapping", "arithmetic_optimization", "layout_optimizer", "constant_folding")


class grappler_rewrites_off:
    """Turns off Grappler's fusing rewrites for the functions first run inside (the plain and
    the compiled step are then the same kernels in the same order, bit for bit), restoring
    the options after. oneDNN's own graph rewrites (``TF_ENABLE_ONEDNN_OPTS``) stay as set."""

    def __enter__(self):
        import tensorflow as tf

        self.saved = tf.config.optimizer.get_experimental_options()
        tf.config.optimizer.set_experimental_options({name: False for name in GRAPPLER_REWRITES})
        return self

    def __exit__(self, *exc):
        import tensorflow as tf

        # Unset options read as absent; these four are on by default.
        tf.config.optimizer.set_experimental_options({name: self.saved.get(name, True) for name in GRAPPLER_REWRITES})
        return False


class ModelCheck:
    """One model, its extraction and a plain step's loss and gradients, for checking schedules.

    ``strict=True`` (the default) also takes the plain step with Grappler's rewrites off
    (:class:`grappler_rewrites_off`), for :meth:`check`'s ``strict`` comparison, and the
    noise floor: how far that plain step's gradients are from the default plain step's
    (rounding alone, amplified by the model's conditioning).
    """

    def __init__(self, name: str, *, cost_model: str = "flops", batch: int = BATCH, model=None, strict: bool = True,
                 granularity: str = "sublayer"):
        import numpy as np

        from tfremat.extract import extract

        self.name = name
        self.model = model if model is not None else build(name)
        self.x, self.y = sample_batch(self.model, batch)
        started = time.perf_counter()
        self.extraction = extract(self.model, (self.x, self.y), cost_model=cost_model, use_cache=False,
                                  granularity=granularity)
        self.extract_seconds = time.perf_counter() - started
        self.graph = self.extraction.graph
        self.initial = [v.numpy() for v in self.model.variables]
        self._recorder = None
        self.plain_loss, self.expected = self._plain()
        self.strict_loss = self.expected_strict = None
        self.noise = (0.0, 0.0)
        if strict:
            with grappler_rewrites_off():
                self.strict_loss, self.expected_strict = self._plain()
            self.noise = gradient_errors(self.expected_strict, self.expected)[:2]
        # Variables whose plain gradient is not finite as TensorFlow runs by default (the
        # default comparison then says nothing; EfficientNetV2L at 32x32: the stem's kernel
        # gradient overflows, finite with Grappler's remapping or constant folding off).
        self.plain_nonfinite = [v.path for v, g in zip(self.model.trainable_variables, self.expected)
                                if not np.all(np.isfinite(g))]
        if not math.isfinite(self.plain_loss):
            self.plain_nonfinite.insert(0, "loss")

    def _plain(self):
        """The loss and gradients of a plain ``tf.GradientTape`` step from the initial state."""
        import tensorflow as tf

        model, loss_fn = self.model, self.extraction.side_table.loss_fn

        @tf.function
        def plain(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn([y], [model(x, training=True)])
                if model.losses:
                    loss = loss + tf.add_n(model.losses)
            return loss, tape.gradient(loss, model.trainable_variables)

        self.reset()
        loss, grads = plain(self.x, self.y)
        expected = [
            tf.zeros_like(v).numpy() if g is None else tf.convert_to_tensor(g).numpy()
            for v, g in zip(model.trainable_variables, grads)
        ]
        self.reset()
        return float(loss), expected

    def reset(self):
        for variable, value in zip(self.model.variables, self.initial):
            variable.assign(value)

    def plan(self, strategy: str, fractions, options, max_overhead: float = MAX_OVERHEAD) -> dict:
        """The strategy's plan at the first feasible budget of ``fractions`` (shares of the
        checkpoint-all peak). When none is: at the first feasible share of
        :data:`FALLBACK_FRACTIONS` if the error does not say how low the strategy gets, else
        at the smallest peak it reported reaching, if that is below the checkpoint-all peak
        (so that the schedule still recomputes), and while that schedule's overhead exceeds ``max_overhead``, at the
        budget halfway to the checkpoint-all peak (at most :data:`RELAX_STEPS` times; the
        tightest peaks of the large EfficientNets are reached only by ``griewank_logn`` at
        40-55x the compute, plans of 400k statements that take longer to trace than a model's
        timeout). Else raises the last InfeasibleBudgetError."""
        from tfremat.errors import InfeasibleBudgetError
        from tfremat.plan.simulator import checkpoint_all_peak
        from tfremat.planner import plan_graph

        reference = checkpoint_all_peak(self.graph)
        failure = None

        def first_fitting(shares):
            """The plan at the first of ``shares`` that fits, else None (``failure`` says why)."""
            nonlocal failure
            for fraction in shares:
                started = time.perf_counter()
                try:
                    result = plan_graph(self.graph, fraction, strategy, cache=False, verbose=0, **options)
                except InfeasibleBudgetError as error:
                    failure = error
                    continue
                return {"result": result, "fraction": fraction, "at_min": False, "relaxed": 0,
                        "plan_s": time.perf_counter() - started}
            return None

        planned = first_fitting(fractions)
        if planned is not None:
            return planned
        smallest = getattr(failure, "min_feasible_bytes", None)
        if failure is not None and smallest is None:
            # The strategy did not say how low it gets (eviction): the fallback shares.
            planned = first_fitting(FALLBACK_FRACTIONS)
            if planned is not None:
                return planned
        if failure is None:
            raise ValueError("no budget to try")
        if not smallest or int(smallest) >= reference:
            raise failure
        budget = int(smallest)
        for relaxed in range(RELAX_STEPS + 1):
            started = time.perf_counter()
            result = plan_graph(self.graph, budget, strategy, cache=False, verbose=0, **options)
            seconds = time.perf_counter() - started
            if result.overhead <= max_overhead or relaxed == RELAX_STEPS:
                break
            logger.info("%s at %d bytes: overhead %.1f > %.1f, relaxing the budget", strategy, budget,
                        result.overhead, max_overhead)
            budget = (budget + reference) // 2
        return {"result": result, "fraction": budget / reference, "at_min": True, "relaxed": relaxed,
                "plan_s": seconds}

    def check(self, schedule, *, strict: bool = False) -> dict:
        """Compiles ``schedule``, trains one step from the initial state and compares its
        loss and gradients (recorded by the optimizer) with the plain step's: the default
        one, or with ``strict`` the one with Grappler's rewrites off, the compiled step then
        traced and run with them off too. Exceptions propagate."""
        import numpy as np
        import tensorflow as tf

        from tfremat.static_graph import compile_step

        if strict and self.expected_strict is None:
            raise ValueError("strict=True needs a ModelCheck built with strict=True")
        self.reset()
        if self._recorder is None:
            # One per model: its gradient copies are as large as the model's weights, and
            # every compiled step keeps its optimizer alive (11 GiB on ConvNeXtXLarge with a
            # new one per check).
            self._recorder = _recording_sgd(learning_rate=0.01)
            self._recorder.build(self.model.trainable_variables)
        optimizer = self._recorder
        for variable in optimizer.recorded:
            variable.assign(tf.zeros_like(variable))
        started = time.perf_counter()
        step = compile_step(self.extraction, schedule, optimizer=optimizer)
        if strict:
            with grappler_rewrites_off():
                loss = float(step(self.x, self.y))
        else:
            loss = float(step(self.x, self.y))
        seconds = time.perf_counter() - started
        got = [v.numpy() for v in optimizer.recorded]
        expected, plain_loss = (self.expected_strict, self.strict_loss) if strict else (self.expected, self.plain_loss)
        worst, global_error, index = gradient_errors(got, expected)
        loss_error = abs(loss - plain_loss) / max(abs(plain_loss), 1e-30)
        finite = bool(np.isfinite(loss)) and all(np.all(np.isfinite(v.numpy())) for v in self.model.trainable_variables)
        changed = any(np.any(v.numpy() != value) for v, value in zip(self.model.variables, self.initial))
        self.reset()
        del step
        gc.collect()
        return {
            "loss": loss,
            "loss_error": loss_error,
            "max_var_error": worst,
            "worst_variable": self.model.trainable_variables[index].path if index >= 0 else "",
            "global_error": global_error,
            "finite": finite,
            "trained": changed,
            "compile_s": seconds,
        }

    def measure(self, schedule) -> dict:
        """The bytes the compiled step's operations request and the allocator's peak
        (:func:`tfremat.static_graph.measure_step_peak`), with the extraction's own optimizer:
        the recording one's gradient copies would move both (+33% / +61% on VGG16)."""

        from tfremat.static_graph import compile_step, measure_step_peak

        self.reset()
        optimizer = self.extraction.side_table.optimizer
        saved_optimizer = [v.numpy() for v in optimizer.variables]
        step = compile_step(self.extraction, schedule)
        resident = list(self.model.variables) + list(optimizer.variables)
        x, y = self.x, self.y
        requested = measure_step_peak(step, x, y, resident=resident, count="requested")
        allocator = measure_step_peak(step, x, y, resident=resident, count="allocator", warmup=0)
        del step
        gc.collect()
        self.reset()
        for variable, value in zip(optimizer.variables, saved_optimizer):
            variable.assign(value)
        return {"requested": requested, "allocator": allocator}


def verdict(default: dict, strict: dict | None, noise, *, var_tol: float = VAR_TOL, global_tol: float = GLOBAL_TOL,
            noise_factor: float = NOISE_FACTOR, plain_nonfinite=()) -> str:
    """"" when the checks pass, else what failed.

    The step must be finite and move the weights; its loss (rewrites off) equal the plain
    step's within ``LOSS_RTOL``; its gradients, in both comparisons, within the tolerances
    or ``noise_factor`` times the plain step's own rounding noise, whichever is larger.
    Rounding is all the math leaves: with the rewrites off the two steps still add a
    value's gradient contributions in different orders (DenseNet121's many-reader
    concatenations: 6e-5 where the noise is 6e-5). Where the plain step itself is not
    finite by default (``plain_nonfinite`` names what), only the rewrites-off check counts,
    and the noise floor is then taken as 0.
    """
    problems = []
    if plain_nonfinite and strict is None:
        return "the plain step is not finite as TensorFlow runs by default, and there is no rewrites-off check"
    if plain_nonfinite:
        # Nothing to compare by default: the rewrites-off step must be finite and move the weights.
        if not strict["finite"]:
            problems.append("non-finite loss or weights with the rewrites off")
        elif not strict["trained"]:
            problems.append("the step changed no variable")
    elif not default["finite"]:
        problems.append("non-finite loss or weights")
    elif not default["trained"]:
        problems.append("the step changed no variable")
    noise = (0.0, 0.0) if plain_nonfinite else noise
    var_limit = max(var_tol, noise_factor * noise[0])
    global_limit = max(global_tol, noise_factor * noise[1])
    limits = f"(limits {var_limit:.1e}, {global_limit:.1e})"
    if strict is not None:
        if not (strict["loss_error"] <= LOSS_RTOL and strict["max_var_error"] <= var_limit
                and strict["global_error"] <= global_limit):  # NaN fails
            problems.append(f"rewrites-off mismatch: loss rel {strict['loss_error']:.1e}, max var "
                            f"{strict['max_var_error']:.1e} ({strict.get('worst_variable', '')}), global "
                            f"{strict['global_error']:.1e} {limits}")
    if not plain_nonfinite and not (default["max_var_error"] <= var_limit and default["global_error"] <= global_limit):
        problems.append(f"mismatch: max var {default['max_var_error']:.1e} ({default['worst_variable']}), global "
                        f"{default['global_error']:.1e} {limits}")
    return "; ".join(problems)


def reverdict(row: dict, **tolerances) -> None:
    """Recomputes the status of every strategy of a saved row that got as far as a verdict
    (for ``--from_rows`` after the tolerances or :func:`verdict` changed)."""
    noise = row.get("noise") or (0.0, 0.0)
    for entry in row.get("strategies", {}).values():
        detail = entry.get("detail") or ""
        if "max_var_error" not in entry:
            continue
        if entry.get("status") not in ("ok", "failed") or (detail and not detail.startswith(VERDICT_PREFIXES)):
            continue
        strict = None
        if "strict_var_error" in entry:
            strict = {"loss_error": entry["strict_loss_error"], "max_var_error": entry["strict_var_error"],
                      "global_error": entry["strict_global_error"],
                      "worst_variable": entry.get("strict_worst_variable", ""),
                      "finite": entry.get("strict_finite", True), "trained": entry.get("strict_trained", True)}
        problem = verdict(entry, strict, noise, plain_nonfinite=row.get("plain_nonfinite", ()), **tolerances)
        entry.update(status="failed" if problem else "ok", detail=problem)


VERDICT_PREFIXES = ("non-finite", "the step changed", "rewrites-off mismatch", "mismatch")


def check_model(name: str, *, strategies=STRATEGIES, cost_model: str = "flops", measure: bool = True,
                strict: bool = True, var_tol: float = VAR_TOL, global_tol: float = GLOBAL_TOL,
                on_update=None) -> dict:
    """Runs the suite on one model; returns its row (statuses, errors, bytes, seconds).

    ``on_update(row)`` is called after each stage, so that a caller can save partial rows.
    """
    import tensorflow as tf

    from tfremat.errors import TfrematError

    row = {"model": name, "input": describe(name), "batch": BATCH, "tf": tf.__version__,
           "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"), "strategies": {}}
    update = on_update or (lambda _row: None)
    stage = "build"
    try:
        model = build(name)
        row["params"] = int(model.count_params())
        stage = "extract"
        case = ModelCheck(name, cost_model=cost_model, model=model, strict=strict)
    except Exception as error:  # noqa: BLE001 - every failure is a row
        kind = "refused" if isinstance(error, TfrematError) else "failed"
        logger.exception("%s: %s", name, stage)
        row["stage_error"] = {"status": kind, "detail": f"{stage}: {first_line(error)}"}
        update(row)
        return row
    row.update(nodes=case.graph.size, extract_s=case.extract_seconds, noise=list(case.noise),
               plain_nonfinite=case.plain_nonfinite)
    update(row)
    for strategy, fractions, options in strategies:
        entry = row["strategies"][strategy] = {"status": "failed", "detail": "started", "stage": "plan"}
        stage = "plan"
        try:
            planned = case.plan(strategy, fractions, options)
            result = planned["result"]
            entry.update(budget=planned["fraction"], at_min=planned["at_min"], relaxed=planned["relaxed"],
                         plan_s=planned["plan_s"],
                         predicted=int(result.predicted_peak_bytes), overhead=float(result.overhead),
                         recomputes=int(result.schedule.recompute_count))
            stage = "compile/train"
            entry["stage"] = stage
            update(row)
            default = case.check(result.schedule)
            entry.update(default)
            update(row)
            checked = None
            if strict:
                stage = entry["stage"] = "compile/train (rewrites off)"
                checked = case.check(result.schedule, strict=True)
                entry.update(strict_var_error=checked["max_var_error"], strict_global_error=checked["global_error"],
                             strict_loss_error=checked["loss_error"], strict_worst_variable=checked["worst_variable"],
                             strict_finite=checked["finite"], strict_trained=checked["trained"])
                update(row)
            if measure:
                stage = entry["stage"] = "measure"
                entry.update(case.measure(result.schedule))
            problem = verdict(default, checked, case.noise, var_tol=var_tol, global_tol=global_tol,
                              plain_nonfinite=case.plain_nonfinite)
            entry.update(status="failed" if problem else "ok", detail=problem)
        except Exception as error:  # noqa: BLE001 - every failure is a row
            kind = "refused" if isinstance(error, TfrematError) else "failed"
            if kind == "failed":
                logger.exception("%s %s: %s", name, strategy, stage)
            entry.update(status=kind, detail=f"{stage}: {first_line(error)}")
        logger.info("%s %s: %s %s", name, strategy, entry["status"], entry["detail"])
        update(row)
    return row


# --------------------------------------------------------------------------------------
# The driver: one subprocess per model.


def _worker(args) -> None:
    """Runs one model and writes its row to ``args.row_file`` after every stage."""
    sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

    def save(row):
        temporary = args.row_file + ".tmp"
        with open(temporary, "w") as f:
            json.dump(row, f)
        os.replace(temporary, args.row_file)

    names = {s[0] for s in STRATEGIES} if args.strategies is None else set(args.strategies.split(","))
    strategies = [s for s in STRATEGIES if s[0] in names]
    check_model(args.worker, strategies=strategies, cost_model=args.cost_model, measure=not args.no_measure,
                strict=not args.no_strict, var_tol=args.var_tol, global_tol=args.global_tol, on_update=save)


def _run_subprocess(name: str, args, directory: str) -> dict:
    row_file = os.path.join(directory, f"{name}.json")
    log_file = os.path.join(directory, f"{name}.log")
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--row_file", row_file,
               "--cost_model", args.cost_model, "--var_tol", str(args.var_tol), "--global_tol", str(args.global_tol)]
    if args.no_measure:
        command.append("--no_measure")
    if args.no_strict:
        command.append("--no_strict")
    if args.strategies:
        command += ["--strategies", args.strategies]
    env = dict(os.environ, TFREMAT_CACHE_DIR=os.path.join(directory, "cache"))
    started = time.perf_counter()
    problem = None
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = process.wait(timeout=args.timeout)
            if code != 0:
                problem = f"worker exited with code {code}" if code > 0 else f"worker killed by signal {-code}"
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            problem = f"timeout after {args.timeout:.0f} s"
    seconds = time.perf_counter() - started
    row = {"model": name, "input": describe(name), "strategies": {}}
    if os.path.exists(row_file):
        with open(row_file) as f:
            row = json.load(f)
    row["wall_s"] = seconds
    if problem:
        names = [s[0] for s in STRATEGIES if not args.strategies or s[0] in args.strategies.split(",")]
        finish_row(row, problem, log_file, names)
    with open(row_file, "w") as f:
        json.dump(row, f)  # with the wall time and any problem, for --from_rows
    return row


def finish_row(row: dict, problem: str, log_file: str, strategies) -> None:
    """Marks what a worker that timed out or crashed (``problem``) left unfinished in its row.

    A timeout is no verdict on the strategies it did not reach (status ``timeout``, with the
    stage it was in); a crash fails the strategy it was running and the ones after it.
    """
    kind = "timeout" if problem.startswith("timeout") else "failed"
    tail = _log_tail(log_file) if kind == "failed" else ""
    row["problem"] = f"{problem}{': ' + tail if tail else ''}"
    for strategy in strategies:
        entry = row["strategies"].setdefault(strategy, {"status": kind, "detail": "started"})
        if entry.get("detail") == "started":
            stage = entry.get("stage", "before it started")
            entry.update(status=kind, detail=row["problem"] if kind == "failed" else f"{problem} ({stage})")
    if "stage_error" not in row and "nodes" not in row:
        row["stage_error"] = {"status": kind, "detail": row["problem"]}


def _log_tail(path: str) -> str:
    """The last error-looking line of a worker's log."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Fatal" in line or "Check failed" in line:
            return line[:200]
    return ""


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


def _pct(value, reference) -> str:
    if value is None or not reference:
        return ""
    return f"{100.0 * (value / reference - 1):+.1f}"


def _status_cell(entry: dict) -> str:
    status = entry.get("status", "failed")
    if status == "ok":
        return "ok"
    detail = entry.get("detail", "").replace("|", "\\|").replace("\n", " ")
    return f"**{status}**: {detail}" if detail else f"**{status}**"


def _row_status(row: dict, strategy: str) -> dict:
    if "stage_error" in row:
        return row["stage_error"]
    return row["strategies"].get(strategy, {"status": "failed", "detail": "not run"})


def _errors(entry: dict, var: str, total: str) -> str:
    if var not in entry:
        return ""
    return f"{entry[var]:.0e} / {entry[total]:.0e}"


def render(rows: list[dict], args, argv, seconds: float | None) -> str:
    from provenance import header

    strategies = [s[0] for s in STRATEGIES if not args.strategies or s[0] in args.strategies.split(",")]
    tf_version = next((r["tf"] for r in rows if "tf" in r), "?")
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset (TensorFlow's default: on with AVX-512)")
    lines = [
        "# Conformance benchmark",
        "",
        header(argv),
        "",
        f"Every `keras.applications` constructor (`weights=None`, the smallest input it accepts, {CLASSES} classes) and",
        "user-style architectures (`transformer_encoder`: keras.io's text transformer, custom `TransformerBlock` layer",
        "holding MultiHeadAttention/LayerNormalization/Dropout/Sequential FFN; `vit`: custom `PatchEmbedding` layer with",
        "class token and position weights; `bilstm_text`; `convmixer`; `unet_transpose`: U-Net with Conv2DTranspose;",
        f"`zeropad_conv_chain`), batch {BATCH}, extracted once with "
        f"`cost_model=\"{args.cost_model}\"`; TensorFlow {tf_version} CPU, `TF_ENABLE_ONEDNN_OPTS` {onednn},",
        "BFC allocator, `TF_NUM_INTEROP_THREADS=1`, each model in its own subprocess "
        f"(timeout {args.timeout:.0f} s, {args.jobs} at once). Strategies: `checkpoint_all` at 100%; `optimal`",
        "(`time_limit=30`), `eviction` and `chen_sqrtn_ap` at the first feasible budget of 60%, 80%, else at the",
        "smallest peak the strategy reported reaching (`min`), when that is below the checkpoint-all peak (at 90%, then",
        "95%, when the error does not say: eviction's); a `min`",
        f"schedule costing over {MAX_OVERHEAD:g}x a plain step extra is re-planned halfway to the checkpoint-all peak "
        f"(`relaxed`, at most {RELAX_STEPS}x).",
        "",
        "Each schedule is compiled (`compile_step`) and trains one step; the gradients the optimizer receives are",
        "compared with a plain `tf.GradientTape` step's, per variable `||a-e|| / max(||e||, "
        f"{FLOOR:g}*||E||)` (max over the",
        "variables) and globally `||A-E||/||E||` (`err`, shown as max var / global): once as TensorFlow runs by",
        "default, once with Grappler's fusing rewrites off for both steps (`err, rewrites off`; the two steps are then",
        "the same kernels in the same order, so the errors are 0 unless the schedule changes the math). `noise` is",
        "the plain step's own rounding noise: its gradients with the rewrites off against on. At batch 2 and 1x1",
        "final feature maps a batch norm normalizes 2 values to +-1, whose gradient is 0 in exact arithmetic, so",
        "some applications' gradients are mostly rounding (noise near 1) and only the rewrites-off check can tell.",
        "",
        "Status: **ok** = compiled, trained (finite loss, weights moved), loss with the rewrites off equal to the plain",
        f"step's (rel. {LOSS_RTOL:g}), and both gradient errors <= max({args.var_tol:g} / {args.global_tol:g}, "
        f"{NOISE_FACTOR:g} x noise): with the rewrites off",
        "the steps still sum a value's gradient contributions in different orders, so rounding is all the math",
        "rules out; errors of exactly 0 with the rewrites off mean bit-identical gradients. **refused** = tfremat",
        "raised its own error on purpose (first line shown; an InfeasibleBudgetError: no schedule of the strategy",
        "peaks below the checkpoint-all peak); **failed** = any other exception, a mismatch or a crash; **timeout** =",
        "the model's subprocess ran out of time before the strategy finished (the stage it was in is shown).",
        "`req` / `alloc`: the compiled step's requested bytes / allocator peak against the simulator's",
        "prediction (%, + = above; extraction's SGD optimizer). `overhead`: the schedule's compute over a plain step's,",
        "minus 1 (simulated). `plan s`: seconds of the planning call that gave the schedule. `nodes`: graph nodes.",
        *([] if args.cost_model != "flops" else [
            "With `cost_model=\"flops\"` every node's workspace is 0, so `req` / `alloc` also count the scratch CPU",
            "kernels request (weight-sized for some gradients): large positive values there are the cost model's",
            "omission, not the step's; `--cost_model profile` measures workspace (minutes on the large models)."]),
        "",
    ]
    lines += ["## Summary", "",
              "| strategy | ok | ok, bit-identical with rewrites off | refused | failed | timeout |",
              "|---|---|---|---|---|---|"]
    for strategy in strategies:
        counts = {"ok": 0, "refused": 0, "failed": 0, "timeout": 0}
        exact = 0
        for row in rows:
            entry = _row_status(row, strategy)
            status = entry.get("status", "failed")
            counts[status if status in counts else "failed"] += 1
            exact += status == "ok" and entry.get("strict_var_error") == 0.0
        lines.append(f"| {strategy} | {counts['ok']}/{len(rows)} | {exact} | {counts['refused']} | {counts['failed']} "
                     f"| {counts['timeout']} |")
    all_ok = sum(all(_row_status(r, s).get("status") == "ok" for s in strategies) for r in rows)
    total = sum(r.get("wall_s", 0.0) for r in rows)
    timing = (f"Wall time {seconds / 60:.1f} min" if seconds is not None else "Written from saved rows") + \
        f" (per-model wall times sum to {total / 60:.1f} min)."
    lines += ["", f"Models ok under every strategy: {all_ok}/{len(rows)}. {timing}", ""]
    if getattr(args, "notes", None):
        with open(args.notes) as f:
            lines += ["## Notes", "", f.read().strip(), ""]
    lines += ["## Models", "",
              "| model | input | params | nodes | extract s | noise | strategy | budget | status | err "
              "| err, rewrites off | predicted MiB | req % | alloc % | recomputes | overhead | plan s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        noise = row.get("noise")
        head = [row["model"], row.get("input", ""), str(row.get("params", "")), str(row.get("nodes", "")),
                f"{row['extract_s']:.1f}" if "extract_s" in row else "",
                (f"{noise[0]:.0e} / {noise[1]:.0e}" if noise else "")
                + (f" (plain step not finite by default: {', '.join(row['plain_nonfinite'][:3])})"
                   if row.get("plain_nonfinite") else "")]
        for k, strategy in enumerate(strategies):
            entry = _row_status(row, strategy)
            budget = entry.get("budget")
            predicted = entry.get("predicted")
            shown_budget = "" if budget is None else f"{100 * budget:.0f}%" + (
                f" (min, relaxed {entry['relaxed']}x)" if entry.get("relaxed") else " (min)" if entry.get("at_min") else "")
            cells = [
                strategy,
                shown_budget,
                _status_cell(entry),
                _errors(entry, "max_var_error", "global_error"),
                _errors(entry, "strict_var_error", "strict_global_error"),
                _mib(predicted),
                _pct(entry.get("requested"), predicted),
                _pct(entry.get("allocator"), predicted),
                "" if "recomputes" not in entry else str(entry["recomputes"]),
                "" if entry.get("overhead") is None else f"{entry['overhead']:.2f}",
                "" if "plan_s" not in entry else f"{entry['plan_s']:.1f}",
                f"{row.get('wall_s', 0):.0f}" if k == 0 else "",
            ]
            lines.append("| " + " | ".join((head if k == 0 else [""] * len(head)) + cells) + " |")
    not_ok = [(row["model"], strategy, _row_status(row, strategy)) for row in rows for strategy in strategies
              if _row_status(row, strategy).get("status") != "ok"]
    if not_ok:
        lines += ["", "## Not ok", ""]
        lines += [f"- {model} / {strategy}: {entry.get('status')}: {entry.get('detail', '')}"
                  for model, strategy, entry in not_ok]
    problems = [r for r in rows if r.get("problem")]
    if problems:
        lines += ["", "## Worker problems", ""]
        lines += [f"- {r['model']}: {r['problem']}" for r in problems]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the markdown results file")
    parser.add_argument("--only", default=None,
                        help="comma-separated model names or substrings (case-insensitive) to run")
    parser.add_argument("--strategies", default=None, help="comma-separated subset of the strategies")
    parser.add_argument("--cost_model", default="flops", choices=("flops", "profile"),
                        help="the extraction's cost model (profile: minutes on the large applications)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model (its subprocess)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="models run at once (each its own subprocess, with its share of the cores for "
                             "TensorFlow's intra-op threads); timings then include the contention")
    parser.add_argument("--var_tol", type=float, default=VAR_TOL)
    parser.add_argument("--global_tol", type=float, default=GLOBAL_TOL)
    parser.add_argument("--no_measure", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--no_strict", action="store_true",
                        help="skip the second check with Grappler's rewrites off (and the noise floor)")
    parser.add_argument("--rows_dir", default=None, help="keep the per-model JSON rows and logs here")
    parser.add_argument("--notes", default=None, help="a markdown file put under the summary as ## Notes")
    parser.add_argument("--from_rows", default=None,
                        help="run nothing: write the table from the JSON rows a --rows_dir run left in this directory")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row_file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.worker:
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
        os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        _worker(args)
        return
    sys.path.insert(0, HERE)
    names = model_names()
    if args.only:
        wanted = [w.strip().lower() for w in args.only.split(",") if w.strip()]
        exact = {n.lower(): n for n in names}
        names = [n for n in names if any(w == n.lower() for w in wanted)
                 or any(w not in exact and w in n.lower() for w in wanted)]
        if not names:
            parser.error(f"--only {args.only!r} matches no model; models: {', '.join(model_names())}")
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    if args.from_rows:
        rows = []
        for name in names:
            path = os.path.join(args.from_rows, f"{name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    row = json.load(f)
                reverdict(row, var_tol=args.var_tol, global_tol=args.global_tol)
                rows.append(row)
        _write(render(rows, args, argv, None), args.out)
        return
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.rows_dir or scratch
        os.makedirs(directory, exist_ok=True)
        if args.jobs > 1:
            # Each worker gets its share of the cores for TensorFlow's intra-op threads.
            os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))

        def run(name):
            row = _run_subprocess(name, args, directory)
            summary = ", ".join(f"{s}={_row_status(row, s).get('status')}" for s in row.get("strategies", {}) or ["-"])
            logger.info("%s (%.0f s): %s%s", name, row["wall_s"], summary,
                        f" [{row['stage_error']['detail']}]" if "stage_error" in row else "")
            return row

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run, names))
    _write(render(rows, args, argv, time.perf_counter() - started), args.out)


def _write(text: str, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    sys.stdout.write(text)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
