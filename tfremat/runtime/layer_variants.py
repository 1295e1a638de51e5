"""Keras layers run with another implementation (MONeT, Shah et al. 2021, sec. 4 and
appendix D): which alternatives a layer has, and running a call under one of them.

An alternative changes what the layer's gradient keeps for the backward pass or its cost,
never the forward values nor the gradients beyond float32 rounding (:mod:`tfremat.runtime.variants` has the operators and
their exactness). It runs through the layer's own ``__call__`` (dtype policy, name scope,
``training``), with one attribute of the layer replaced while the call is traced:

* ``relu_bool`` / ``relu_bits``: a ReLU or ReLU6 (``keras.layers.ReLU`` without slope or
  threshold, an ``Activation("relu")``, or a layer whose ``activation`` is ``relu`` or
  ``relu6``, such as ``Conv2D(activation="relu")`` or ``Dense``) keeps a 1-byte, or 1-bit,
  mask instead of its float output (appendix D, "intermediate-activated");
* ``window_index``: ``MaxPooling2D`` keeps a 1-byte window index per output element
  instead of its input and output;
* ``regenerated``: ``Dropout`` draws the same seed as Keras and regenerates its mask in
  the backward instead of keeping it;
* ``output_activated``: ``BatchNormalization`` over the last axis computes its gradient
  from its output and the per-channel statistics, so its input is not kept (appendix D,
  "output-activated"); the moving statistics move exactly as Keras moves them;
* ``fused``: the same batch norm through TensorFlow's ``FusedBatchNormV3`` and its
  registered gradient (equal within float32 rounding): it keeps as many bytes as Keras's
  own implementation (the input and per-channel statistics) but runs faster at most shapes
  on CPU (``benchmarks/batch_norm.py``), so it is a cost choice; the moving statistics take its batch statistics, the variance biased
  as Keras takes it;
* ``relu_bits`` for a leaky ReLU (``keras.layers.LeakyReLU``, a ``leaky_relu``
  activation): the 1-bit sign mask instead of the float input;
* ``recomputed``: an activation whose gradient keeps several input-sized intermediates
  (``gelu``, ``mish``, ``hard_silu``: autodiff through their elementary ops), or a
  ``LayerNormalization``, keeps its input only and recomputes the rest inside its
  backward. Activations whose gradient keeps one tensor get no such alternative:
  ``silu``/``swish`` (TensorFlow's own gradient reads the input only), tanh, sigmoid, elu
  and softmax (their output); recomputing would keep as many bytes.

Which bytes each keeps is measured by the extraction (the same call analysis as the
layer's own implementation), not taken from this list.

Each alternative declares whether its gradients are bit-exact with the layer's default
(``LayerImplementation.exact``; ``tests/test_variant_rounding.py`` checks every
declaration over several shapes, with oneDNN on and off): the ReLU and leaky ReLU masks,
the regenerated dropout mask and the recomputed GELU, mish and layer norm run the same
arithmetic; ``window_index`` does where no input element is the maximum of three or more
windows (oneDNN sums those contributions in another order); the recomputed ``hard_silu``
and both batch norms round differently. ``plan_model(..., exact_gradients=True)``
leaves the others out of ``monet``'s choice (:func:`inexact_choices`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import keras
import tensorflow as tf

from tfremat.errors import ArgumentError
from tfremat.runtime.variants import (
    fused_batch_norm_variant,
    max_pool_with_index,
    normalize_output_activated,
    recomputed_in_backward,
    relu_with_mask,
)

__all__ = ["LayerImplementation", "layer_implementations", "running", "inexact_choices"]


@dataclasses.dataclass(frozen=True)
class LayerImplementation:
    """One alternative of a Keras layer.

    Attributes:
        name: the implementation's name in the graph and the schedule.
        attribute: the layer attribute replaced while a call runs under it.
        replacement: ``replacement(layer)`` is the value that attribute takes.
        exact: its gradients are bit-identical to the default's (same operations in the
            same order); False where they differ by float rounding.
    """

    name: str
    attribute: str
    replacement: Callable[[object], object]
    exact: bool


def _relu_max_value(layer):
    """``(applies, max_value)`` for a ReLU layer, or a layer whose activation is a ReLU:
    plain ReLU (max_value None) or ReLU6 (6)."""
    if isinstance(layer, keras.layers.ReLU):
        plain = not layer.negative_slope and not layer.threshold
        return plain and layer.max_value in (None, 6), layer.max_value
    activation = getattr(layer, "activation", None)
    if activation is keras.activations.relu:
        return True, None
    if activation is keras.activations.relu6:
        return True, 6
    return False, None


def _masked(mask: str, max_value):
    def replacement(layer):
        return lambda x: relu_with_mask(x, mask, max_value)
    return replacement


def _relu_alternatives(layer) -> list[LayerImplementation]:
    applies, max_value = _relu_max_value(layer)
    if not applies:
        return []
    attribute = "call" if isinstance(layer, keras.layers.ReLU) else "activation"
    return [LayerImplementation(f"relu_{mask}", attribute, _masked(mask, max_value), exact=True)
            for mask in ("bool", "bits")]


def _leaky_relu_alternatives(layer) -> list[LayerImplementation]:
    if isinstance(layer, keras.layers.LeakyReLU):
        slope, attribute = float(layer.negative_slope), "call"
    elif getattr(layer, "activation", None) is keras.activations.leaky_relu:
        slope, attribute = 0.2, "activation"  # the activation's default slope
    else:
        return []
    if not 0 < slope < 1:
        return []

    def replacement(layer):
        return lambda x: relu_with_mask(x, "bits", negative_slope=slope)
    return [LayerImplementation("relu_bits", attribute, replacement, exact=True)]


# Activations whose registered gradients keep more than their input (variants.recomputed_in_backward),
# and whether recomputing one inside the backward leaves its gradient bit-exact (hard_silu's
# rounds differently, by about 2e-7 relative).
_RECOMPUTED_ACTIVATIONS = ((keras.activations.gelu, True), (keras.activations.mish, True),
                           (keras.activations.hard_silu, False))


def _recomputed_activation_alternatives(layer) -> list[LayerImplementation]:
    activation = getattr(layer, "activation", None)
    exact = [bit_exact for known, bit_exact in _RECOMPUTED_ACTIVATIONS if activation is known]
    if not exact:
        return []

    def replacement(layer):
        return lambda x: recomputed_in_backward(activation, x)
    return [LayerImplementation("recomputed", "activation", replacement, exact=exact[0])]


def _layer_norm_call(layer):
    original = type(layer).call.__get__(layer)
    parameters = [p for p in (layer.gamma, layer.beta) if p is not None]

    def normalize(x, *values):
        given = iter(values)
        gamma = next(given) if layer.gamma is not None else None
        beta = next(given) if layer.beta is not None else None
        return keras.ops.layer_normalization(x, gamma, beta, layer.axis, layer.epsilon,
                                             rms_scaling=getattr(layer, "rms_scaling", False))

    def call(inputs):
        if inputs.dtype != tf.float32:
            return original(inputs)
        return recomputed_in_backward(normalize, inputs, *parameters)
    return call


def _layer_norm_alternatives(layer) -> list[LayerImplementation]:
    if type(layer) is keras.layers.LayerNormalization and layer.built and layer.compute_dtype == "float32":
        return [LayerImplementation("recomputed", "call", _layer_norm_call, exact=True)]
    return []


def _pool_call(layer):
    def call(inputs):
        return max_pool_with_index(inputs, layer.pool_size, layer.strides, layer.padding.upper())
    return call


def _pool_alternatives(layer) -> list[LayerImplementation]:
    if (type(layer) is keras.layers.MaxPooling2D and layer.data_format == "channels_last"
            and layer.pool_size[0] * layer.pool_size[1] <= 256):
        # Exact unless an input element can be the maximum of three or more windows, whose
        # gradient contributions oneDNN's MaxPoolGrad adds in another order (variants.py).
        overlaps = math.prod(-(-k // s) for k, s in zip(layer.pool_size, layer.strides))
        return [LayerImplementation("window_index", "call", _pool_call, exact=overlaps <= 2)]
    return []


def _dropout_call(layer):
    from keras.src.backend.tensorflow.random import _cast_seed
    from keras.src.random.seed_generator import draw_seed

    from tfremat.runtime.variants import dropout_regenerated

    def call(inputs, training=False):
        if not (training and layer.rate > 0):
            return inputs
        # Keras's own draw (keras.src.backend.tensorflow.random.dropout): the same seed,
        # so the same mask, and the seed generator moves as in plain training.
        seed = _cast_seed(draw_seed(layer.seed_generator))
        return dropout_regenerated(inputs, float(layer.rate), seed)
    return call


def _dropout_alternatives(layer) -> list[LayerImplementation]:
    if type(layer) is keras.layers.Dropout and layer.noise_shape is None and 0 < layer.rate < 1:
        return [LayerImplementation("regenerated", "call", _dropout_call, exact=True)]
    return []


def _move_statistics(layer, mean, variance):
    """Keras 3's moving-average update of a batch norm's statistics."""
    layer.moving_mean.assign(layer.moving_mean * layer.momentum + mean * (1.0 - layer.momentum))
    layer.moving_variance.assign(layer.moving_variance * layer.momentum + variance * (1.0 - layer.momentum))


def _batch_norm_call(layer):
    original = type(layer).call.__get__(layer)

    def call(inputs, training=None, mask=None):
        if not (training and layer.trainable) or mask is not None or inputs.dtype != tf.float32:
            return original(inputs, training=training, mask=mask)
        # Keras 3's BatchNormalization.call in training, with the normalization's gradient
        # taken from the output (the statistics and their moving averages as Keras has them).
        mean, variance = layer._moments(inputs, mask)
        _move_statistics(layer, mean, variance)
        return normalize_output_activated(inputs, layer.gamma, layer.beta, mean, variance, layer.epsilon,
                                          training=True)
    return call


def _fused_batch_norm_call(layer):
    original = type(layer).call.__get__(layer)

    def call(inputs, training=None, mask=None):
        if not (training and layer.trainable) or mask is not None or inputs.dtype != tf.float32:
            return original(inputs, training=training, mask=mask)
        outputs, mean, variance = fused_batch_norm_variant(inputs, layer.gamma, layer.beta, layer.epsilon)
        # FusedBatchNormV3 returns the Bessel-corrected variance; Keras moves the biased one.
        count = tf.cast(tf.size(inputs) // tf.shape(inputs)[-1], variance.dtype)
        variance = variance * (count - 1.0) / count
        _move_statistics(layer, mean, variance)
        return outputs
    return call


def _batch_norm_alternatives(layer) -> list[LayerImplementation]:
    if type(layer) is not keras.layers.BatchNormalization or not layer.built:
        return []
    rank = layer.input_spec.ndim if layer.input_spec is not None else None
    channels_last = layer.axis == -1 or (rank is not None and layer.axis == rank - 1)
    if not (channels_last and layer.scale and layer.center and not layer.renorm
            and not getattr(layer, "synchronized", False) and hasattr(layer, "_moments")):
        return []
    alternatives = [LayerImplementation("output_activated", "call", _batch_norm_call, exact=False)]
    if rank in (2, 4):
        alternatives.append(LayerImplementation("fused", "call", _fused_batch_norm_call, exact=False))
    return alternatives


def layer_implementations(layer) -> list[LayerImplementation]:
    """The alternatives ``layer`` has (none for most layers)."""
    return (_relu_alternatives(layer) + _leaky_relu_alternatives(layer) + _recomputed_activation_alternatives(layer)
            + _pool_alternatives(layer) + _dropout_alternatives(layer) + _batch_norm_alternatives(layer)
            + _layer_norm_alternatives(layer))


@contextlib.contextmanager
def running(layer, name: str | None):
    """Calls of ``layer`` inside the block run implementation ``name`` (None or
    ``"default"``: the layer's own).

    Raises:
        ArgumentError: ``layer`` has no implementation ``name``.
    """
    if name in (None, "default"):
        yield
        return
    chosen = {i.name: i for i in layer_implementations(layer)}.get(name)
    if chosen is None:
        raise ArgumentError(f"layer {layer.name!r} has no implementation {name!r}; it has "
                            f"{['default', *(i.name for i in layer_implementations(layer))]}")
    had_own = chosen.attribute in vars(layer)
    previous = vars(layer).get(chosen.attribute)
    object.__setattr__(layer, chosen.attribute, chosen.replacement(layer))
    try:
        yield
    finally:
        if had_own:
            object.__setattr__(layer, chosen.attribute, previous)
        else:
            object.__delattr__(layer, chosen.attribute)


def inexact_choices(side_table, choice) -> dict[int, str]:
    """Of ``choice`` (node -> implementation name, as ``Schedule.implementations``), the
    nodes whose implementation is not bit-exact with their layer's default
    (``LayerImplementation.exact``), with its name; ``side_table`` maps a node to its
    layer. With every alternative of a graph as ``choice`` (``{node: name}`` per pair), it
    names what ``exact_gradients=True`` leaves out."""
    inexact = {}
    for node, name in (choice or {}).items():
        if name in (None, "default"):
            continue
        declared = {i.name: i.exact for i in layer_implementations(side_table[node].layer)}
        if not declared.get(name, False):
            inexact[node] = name
    return inexact
