"""Operator implementation variants that keep different tensors for the backward pass.

MONeT (Shah et al., ICLR 2021) optimizes, besides the checkpointing schedule, which
implementation each forward and backward operator uses (sec. 4, "Backward Operator
Optimization"; the dependencies ``D_k^l`` of backward implementation ``l`` enter its memory
constraint, eq. 5, and appendix C.1). Its operator list (appendix D, "Operator
optimizations") has *output-activated* backward operators (ReLU, BatchNorm read their
output instead of their input) and *intermediate-activated* ones (ReLU reads a 1-bit sign
mask, MaxPool an 8-bit window index); appendix F explains why such dependency changes do
not fit a Checkmate graph. This module is the TensorFlow side: layer-call implementations,
each a forward that returns the layer's output and keeps only what its backward reads, and
a backward written with :func:`tf.custom_gradient`, together with the exact byte count each
keeps (:func:`kept_bytes`) and a way to measure it (:func:`measure_kept`).

What "kept for the backward" means here. In a ``tf.function`` TensorFlow runs an operation
as soon as its inputs are ready, so a gradient operation whose inputs are all forward
tensors runs during the forward pass and its *output* is what stays alive until the
backward. The tensors a variant keeps are therefore the tensors produced by operations that
do not depend on the upstream gradient (through data or control edges) and that are read by
operations that do: that is what :func:`measure_kept` lists. Every backward below builds its
recomputations (the regenerated dropout mask, the unpacked ReLU bits, the reconstructed
normalized batch-norm value, the pool's flat indices) under
``tf.control_dependencies([dy])``; without that, TensorFlow would compute them early and
keep their full-size results, which would defeat the variant. Constants are not counted
(they belong to the graph, not to the step), nor are resource handles.

Exactness (checked by ``tests/test_variants.py`` inside ``tf.function``):

* ReLU masks, regenerated and bool-mask dropout: the same arithmetic as TensorFlow's
  gradient (``ReluGrad`` multiplies the upstream gradient by ``output > 0`` cast to float;
  dropout's autodiff is ``where(keep, dy, 0) * scale``), so bit-identical, signed zeros and
  NaNs included.
* MaxPool with a 1-byte index: the same positions as TensorFlow's ``MaxPoolGrad`` (first
  maximum in row-major window order; padding never selected; a window whose values are all
  ``-inf`` sends its gradient to its first valid element, as TensorFlow does); sums of
  overlapping windows in output row-major order, which is the order of TensorFlow's own CPU
  kernel (eager ``MaxPoolGrad``, ``MaxPoolGradWithArgmax``). Inside ``tf.function`` with oneDNN
  on, TensorFlow rewrites ``MaxPoolGrad`` to ``_MklNativeMaxPoolGrad``, which adds the
  contributions an input element receives from several windows in a blocked order (along W,
  descending inside blocks of a few outputs, blocks ascending, observed here): there the
  results are bit-identical whenever no input element is the maximum of three or more
  windows (always when ``ceil(kh/sh) * ceil(kw/sw) <= 2``) and otherwise differ only by the
  rounding of a different summation order. Inputs containing NaN are not covered.
* Batch norm, output-activated: the same formula as autodiff through Keras 3's layer, but
  rebuilt from the output, so equal within float32 rounding (rtol 1e-5 in the tests). The
  forward output and statistics are bit-identical to the Keras layer's.
* Fused batch norm: TensorFlow's registered ``FusedBatchNormGradV3``; the statistics differ
  from Keras 3's unfused ones by rounding, and its variance output is Bessel-corrected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfremat.errors import ArgumentError

__all__ = [
    "VARIANTS",
    "KeptTensor",
    "relu_with_mask",
    "max_pool_with_index",
    "max_pool_with_argmax_variant",
    "dropout_regenerated",
    "dropout_bool_mask",
    "batch_norm_output_activated",
    "normalize_output_activated",
    "fused_batch_norm_variant",
    "recomputed_in_backward",
    "kept_tensors",
    "kept_bytes",
    "measure_kept",
    "pool_output_shape",
]

_F32 = 4

# variant name -> what its backward keeps (documentation; kept_tensors has the numbers)
VARIANTS = {
    "relu_default": "tf.nn.relu with its registered gradient: the float output",
    "relu_bool": "relu_with_mask(mask='bool'): a 1-byte bool mask x > 0",
    "relu_bits": "relu_with_mask(mask='bits'): the mask packed 32 flags per int32",
    "max_pool_default": "tf.nn.max_pool2d with its registered gradient: input and output",
    "max_pool_index": "max_pool_with_index: a uint8 window index per output element",
    "max_pool_argmax": "max_pool_with_argmax_variant: the int64 flat argmax per output element",
    "max_pool_argmax_default": "tf.nn.max_pool_with_argmax, registered gradient: input and argmax",
    "dropout_default": "tf.nn.experimental.stateless_dropout (Keras 3 Dropout), autodiff: bool mask",
    "dropout_bool": "dropout_bool_mask: a 1-byte bool keep mask",
    "dropout_regenerated": "dropout_regenerated: the seed only",
    "batch_norm_default": "Keras 3 BatchNormalization (unfused), autodiff: input and statistics",
    "batch_norm_output_activated": "batch_norm_output_activated: output, gamma, beta, variance",
    "fused_batch_norm": "fused_batch_norm_variant (FusedBatchNormV3): input, scale, reserve spaces",
    "leaky_relu_default": "tf.nn.leaky_relu with its registered gradient: the float input",
    "leaky_relu_bool": "relu_with_mask(negative_slope=a, mask='bool'): a 1-byte mask x > 0",
    "leaky_relu_bits": "relu_with_mask(negative_slope=a, mask='bits'): the mask, 32 flags per int32",
    "recomputed": "recomputed_in_backward(activation, x): the input only",
    "layer_norm_recomputed": "recomputed_in_backward(layer norm, x, gamma, beta): input, gamma, beta",
}


# ----------------------------------------------------------------------------- ReLU


def relu_with_mask(x, mask: str = "bool", max_value: float | None = None, negative_slope: float = 0.0):
    """ReLU whose backward reads a sign mask of the input instead of the float output.

    MONeT appendix D, "intermediate-activated" ReLU (after Gist): the backward of ReLU only
    needs to know where the input was positive. TensorFlow's registered gradient
    (``ReluGrad``) reads the float output ``y`` and computes ``dy * cast(y > 0)``; since
    ``y > 0`` exactly where ``x > 0`` (NaN and both zeros give ``False`` on both sides), the
    backward here computes ``dy * cast(mask)`` and is bit-identical, including ``-0.0`` for a
    negative ``dy`` where the mask is off and NaN for an infinite one.

    Args:
        x: a floating tensor of any shape.
        mask: ``"bool"`` keeps ``x > 0`` as a bool tensor, 1 byte per element;
            ``"bits"`` packs the flags 32 per int32 word (``tf.bitwise``), each sample's
            flags zero-padded to a multiple of 32: ``4 * N * ceil(n / N / 32)`` bytes for
            ``N`` samples of ``n`` elements in all.
        max_value: None, or 6 for ReLU6 (``tf.nn.relu6``, what Keras runs for
            ``ReLU(6.0)`` and ``relu6``): the mask is then ``0 < x < 6``, and the backward
            ``dy * cast(mask)`` is ``Relu6Grad``'s arithmetic, bit-identical likewise.
        negative_slope: 0, or the slope of a leaky ReLU (``tf.nn.leaky_relu``, what Keras
            runs for ``LeakyReLU`` and ``leaky_relu``), whose registered gradient reads the
            float input: the backward is ``where(mask, dy, dy * slope)``, the arithmetic of
            ``LeakyReluGrad``, so bit-identical too.

    Returns:
        ``tf.nn.relu(x)``, ``tf.nn.relu6(x)`` or ``tf.nn.leaky_relu(x, negative_slope)``.
    """
    if mask not in ("bool", "bits"):
        raise ArgumentError(f"mask must be 'bool' or 'bits', got {mask!r}")
    if max_value not in (None, 6):
        raise ArgumentError(f"max_value must be None or 6 (ReLU6), got {max_value!r}")
    if not isinstance(negative_slope, numbers.Real) or not 0 <= negative_slope < 1 or (negative_slope and max_value):
        raise ArgumentError(f"negative_slope must be a number in [0, 1) and max_value None with it, "
                            f"got {negative_slope!r}")
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")

    @tf.custom_gradient
    def relu(x):
        if negative_slope:
            y = tf.nn.leaky_relu(x, alpha=negative_slope)
        else:
            y = tf.nn.relu(x) if max_value is None else tf.nn.relu6(x)
        positive = tf.math.greater(x, tf.zeros([], x.dtype))
        if max_value is not None:
            positive = tf.math.logical_and(positive, tf.math.less(x, tf.constant(max_value, x.dtype)))
        kept = positive if mask == "bool" else _pack_bits(positive)

        def grad(dy):
            with tf.control_dependencies([dy]):
                flags = kept if mask == "bool" else _unpack_bits(kept, tf.shape(dy))
                if negative_slope:
                    return tf.where(flags, dy, dy * tf.constant(negative_slope, dy.dtype))
                return dy * tf.cast(flags, dy.dtype)

        return _after(y, kept), grad

    return relu(x)


_BIT_SHIFTS = tuple(range(32))


def _pack_bits(flags):
    """Packs a bool tensor into int32 words per leading index (the batch): row ``n`` holds
    sample ``n``'s flags, flag ``32 * w + b`` at bit ``b`` of word ``w``, so the mask keeps
    the batch as its first dimension (the extraction counts it with the node's value). A
    tensor of rank 0 or 1 is one row."""
    rows = flags.shape[0] if flags.shape.rank and flags.shape.rank >= 2 else 1
    per_row = math.prod(flags.shape[1:]) if flags.shape.rank and flags.shape.rank >= 2 else flags.shape.num_elements()
    if rows is None or per_row is None:
        rows = tf.shape(flags)[0] if flags.shape.rank >= 2 else 1
        per_row = tf.size(flags) // rows
    flat = tf.cast(tf.reshape(flags, [rows, per_row]), tf.int32)
    pad = tf.math.floormod(-per_row, 32) if isinstance(per_row, tf.Tensor) else -per_row % 32
    words = tf.reshape(tf.pad(flat, [[0, 0], [0, pad]]), [rows, -1, 32])
    # the bits are disjoint, so their sum is their bitwise or (bit 31 makes a negative word)
    return tf.reduce_sum(tf.bitwise.left_shift(words, tf.constant(_BIT_SHIFTS, tf.int32)), axis=2)


def _unpack_bits(words, shape):
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[..., None], tf.constant(_BIT_SHIFTS, tf.int32)), 1)
    per_row = tf.reduce_prod(shape) // tf.shape(words)[0]
    flat = tf.reshape(bits, [tf.shape(words)[0], -1])[:, :per_row]
    return tf.reshape(tf.cast(flat, tf.bool), shape)


# -------------------------------------------------------------------------- MaxPool


def pool_output_shape(input_shape: Sequence[int], pool_size, strides=None, padding: str = "VALID"):
    """Output shape ``(N, OH, OW, C)`` of a 2D NHWC pooling, as TensorFlow computes it."""
    kh, kw, sh, sw, padding = _pool_args(pool_size, strides, padding)
    n, h, w, c = input_shape
    oh, _ = _out_and_pad(h, kh, sh, padding)
    ow, _ = _out_and_pad(w, kw, sw, padding)
    return (n, oh, ow, c)


def _pair(value, name):
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (int(value), int(value))
    value = tuple(value)
    if len(value) != 2 or not all(isinstance(v, numbers.Integral) and v >= 1 for v in value):
        raise ArgumentError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return int(value[0]), int(value[1])


def _pool_args(pool_size, strides, padding):
    kh, kw = _pair(pool_size, "pool_size")
    sh, sw = _pair(strides if strides is not None else (kh, kw), "strides")
    padding = str(padding).upper()
    if padding not in ("VALID", "SAME"):
        raise ArgumentError(f"padding must be 'VALID' or 'SAME', got {padding!r}")
    return kh, kw, sh, sw, padding


def _out_and_pad(size, k, s, padding):
    """Output length and padding before (TensorFlow's convention: the smaller half first)."""
    if padding == "VALID":
        if size < k:
            raise ArgumentError(f"a VALID pooling window of {k} does not fit an input of {size}")
        return (size - k) // s + 1, 0
    out = -(-size // s)
    return out, max((out - 1) * s + k - size, 0) // 2


def _spatial(x, name):
    if x.shape.rank != 4:
        raise ArgumentError(f"{name} must be NHWC (rank 4), got shape {x.shape}")
    h, w = x.shape[1], x.shape[2]
    if h is None or w is None:
        raise ArgumentError(f"{name} needs static height and width, got shape {x.shape}")
    return h, w


def _flat_input_index(window_row, window_col, dy, geometry):
    """int64 flat index ``((b * H + h) * W + w) * C + c`` of each output's input element,
    from its window offset; the batch and channel counts are read from ``dy``."""
    h_in, w_in, oh, ow, sh, sw, top, left = geometry
    shape = tf.shape(dy, out_type=tf.int64)
    batch, channels = shape[0], shape[3]
    rows = tf.range(oh, dtype=tf.int64)[None, :, None, None] * sh - top + window_row
    cols = tf.range(ow, dtype=tf.int64)[None, None, :, None] * sw - left + window_col
    b = tf.range(batch, dtype=tf.int64)[:, None, None, None]
    c = tf.range(channels, dtype=tf.int64)[None, None, None, :]
    return ((b * h_in + rows) * w_in + cols) * channels + c


def _scatter_to_input(flat_index, dy, h_in, w_in):
    """Adds each ``dy`` element into a zero input-shaped tensor at ``flat_index``, in output
    row-major order (``scatter_nd`` on CPU adds its updates in order: the order of
    TensorFlow's CPU ``MaxPoolGrad`` and ``MaxPoolGradWithArgmax``)."""
    shape = tf.shape(dy, out_type=tf.int64)
    total = shape[0] * h_in * w_in * shape[3]
    flat = tf.scatter_nd(tf.reshape(flat_index, [-1, 1]), tf.reshape(dy, [-1]), tf.reshape(total, [1]))
    return tf.reshape(flat, tf.stack([shape[0], h_in, w_in, shape[3]]))


def max_pool_with_index(x, pool_size, strides=None, padding: str = "VALID"):
    """2D max pooling (NHWC) whose backward reads a 1-byte window index per output element.

    MONeT appendix D, "intermediate-activated" MaxPool: an 8-bit output-shaped tensor holding
    the position of the maximum inside its window, instead of TensorFlow's ``MaxPoolGrad``
    dependencies (the float input and the float output).

    The index is ``i * kw + j`` for window offset ``(i, j)`` (row-major, padding counted), of
    the first element equal to the window's maximum; TensorFlow's CPU gradient picks the
    same element (it scans the window in row-major order and moves only on a strictly
    greater value). Padded positions never match (the padding is NaN); a window with no
    match (all its values ``-inf``, for which ``max_pool2d`` returns the lowest float) gets
    its first valid element, as TensorFlow's gradient does. The backward scatters ``dy``
    to those elements in output row-major order; see the module docstring for how that
    compares with the oneDNN kernel TensorFlow uses inside ``tf.function``.

    Args:
        x: float tensor ``[N, H, W, C]``, H and W static.
        pool_size: int or ``(kh, kw)``, at most 256 window elements (the index is uint8).
        strides: int or pair; defaults to ``pool_size``.
        padding: ``"VALID"`` or ``"SAME"``.

    Returns:
        ``tf.nn.max_pool2d(x, pool_size, strides, padding)``.
    """
    kh, kw, sh, sw, padding = _pool_args(pool_size, strides, padding)
    if kh * kw > 256:
        raise ArgumentError(f"a window of {kh}x{kw} has more than 256 positions for a uint8 index")
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")
    h_in, w_in = _spatial(x, "x")
    oh, top = _out_and_pad(h_in, kh, sh, padding)
    ow, left = _out_and_pad(w_in, kw, sw, padding)
    bottom = max((oh - 1) * sh + kh - h_in - top, 0)
    right = max((ow - 1) * sw + kw - w_in - left, 0)
    # first valid window offset of each output position (only SAME padding makes it nonzero)
    first_row = np.maximum(top - np.arange(oh) * sh, 0)
    first_col = np.maximum(left - np.arange(ow) * sw, 0)
    first_valid = (first_row[:, None] * kw + first_col[None, :]).astype(np.uint8)
    geometry = (h_in, w_in, oh, ow, sh, sw, top, left)

    @tf.custom_gradient
    def max_pool(x):
        y = tf.nn.max_pool2d(x, (kh, kw), (sh, sw), padding)
        padded = x
        if top or bottom or left or right:
            padded = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]], constant_values=float("nan"))
        if first_valid.any():
            index = tf.constant(first_valid[None, :, :, None])
        else:
            index = tf.zeros([], tf.uint8)
        previous = []
        for k in reversed(range(kh * kw)):  # the smallest matching offset is written last
            i, j = divmod(k, kw)
            # One window slice at a time: unordered, TensorFlow may slice them all at once.
            with tf.control_dependencies(previous):
                window = padded[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw, :]
            index = tf.where(tf.equal(window, y), tf.constant(k, tf.uint8), index)
            previous = [index]
        index = tf.broadcast_to(index, tf.shape(y))

        def grad(dy):
            with tf.control_dependencies([dy]):
                offset = tf.cast(index, tf.int64)
                flat = _flat_input_index(offset // kw, offset % kw, dy, geometry)
                return _scatter_to_input(flat, dy, h_in, w_in)

        return _after(y, index), grad

    return max_pool(x)


def max_pool_with_argmax_variant(x, pool_size, strides=None, padding: str = "VALID"):
    """2D max pooling through ``tf.nn.max_pool_with_argmax`` whose backward reads only the
    int64 argmax (8 bytes per output element).

    TensorFlow's registered gradient of ``MaxPoolWithArgmax`` reads the argmax *and* the
    input (``MaxPoolGradWithArgmax`` takes it for its shape only): the custom backward here
    scatters ``dy`` to the flat argmax (``include_batch_in_index=True``) and keeps the input
    out. Bit-identical to that registered gradient and to eager ``MaxPoolGrad`` (same
    positions, ties to the first maximum, same order of summation); ``MaxPoolWithArgmax``
    has a CPU kernel in TensorFlow 2.21 and oneDNN does not rewrite it.

    Returns:
        The pooled output (equal to ``tf.nn.max_pool2d``'s except for windows whose values
        are all ``-inf``: ``-inf`` here, the lowest float there).
    """
    kh, kw, sh, sw, padding = _pool_args(pool_size, strides, padding)
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")
    h_in, w_in = _spatial(x, "x")

    @tf.custom_gradient
    def max_pool(x):
        y, argmax = tf.nn.max_pool_with_argmax(x, (kh, kw), (sh, sw), padding, include_batch_in_index=True)

        def grad(dy):
            with tf.control_dependencies([dy]):
                return _scatter_to_input(argmax, dy, h_in, w_in)

        return y, grad

    return max_pool(x)


# -------------------------------------------------------------------------- Dropout


def _dropout_forward(x, rate, seed):
    """``tf.nn.experimental.stateless_dropout(x, rate, seed)`` (Keras 3 ``Dropout`` on
    TensorFlow) op for op: ``where(uniform(seed) >= rate, x * (1 / (1 - rate)), 0)``."""
    scale = tf.constant(1 / (1 - rate), x.dtype)
    scaled = x * scale
    keep = _keep_mask(tf.shape(x), rate, seed, x.dtype)
    return tf.where(keep, scaled, tf.zeros([], x.dtype)), keep, scale


def _keep_mask(shape, rate, seed, dtype):
    uniform = tf.random.stateless_uniform(shape, seed=seed, dtype=dtype)
    return uniform >= tf.constant(rate, dtype)


def _dropout_args(x, rate, seed):
    if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not 0 <= rate < 1:
        raise ArgumentError(f"rate must be a float in [0, 1), got {rate!r}")
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")
    seed = tf.convert_to_tensor(seed)
    if seed.dtype not in (tf.int32, tf.int64) or seed.shape.rank != 1 or seed.shape[0] not in (2, None):
        raise ArgumentError(f"seed must be an int32 or int64 tensor of shape [2], got {seed.dtype.name} {seed.shape}")
    return x, float(rate), seed


def dropout_regenerated(x, rate: float, seed):
    """Dropout whose backward regenerates its mask from the seed: it keeps the seed only.

    The forward is ``tf.nn.experimental.stateless_dropout(x, rate, seed)`` (what Keras 3's
    ``Dropout`` computes on TensorFlow with that seed): the keep mask is
    ``stateless_uniform(shape, seed) >= rate`` and kept values are scaled by
    ``1 / (1 - rate)``. A stateless generator returns the same numbers for the same seed and
    shape, so the backward draws the mask again (under a control dependency on ``dy``, so it
    runs in the backward) and computes ``where(keep, dy, 0) * scale``, the autodiff gradient
    of the forward op for op: bit-identical. This is MONeT's recomputation of an
    intermediate (appendix D) applied to the one intermediate dropout's backward reads.

    Args:
        x: a floating tensor.
        rate: a Python float in ``[0, 1)``; 0 returns ``x`` unchanged.
        seed: int32 or int64 tensor of shape ``[2]``. Keeps ``2 * itemsize`` bytes.
    """
    return _dropout(x, rate, seed, keep_mask=False)


def dropout_bool_mask(x, rate: float, seed):
    """The same dropout as :func:`dropout_regenerated`, keeping the bool keep mask (1 byte
    per element) for the backward instead of the seed. This is what TensorFlow's autodiff of
    ``stateless_dropout`` keeps too (``SelectV2``'s gradient reads its condition); the
    custom gradient makes the dependency explicit. Bit-identical to that autodiff."""
    return _dropout(x, rate, seed, keep_mask=True)


def _dropout(x, rate, seed, keep_mask: bool):
    """The two dropout variants: the backward reads the forward's bool mask
    (``keep_mask``) or regenerates it from the seed, under ``dy`` so that TensorFlow does
    not compute it early and keep it anyway (module docstring)."""
    x, rate, seed = _dropout_args(x, rate, seed)
    if rate == 0:
        return tf.identity(x)

    @tf.custom_gradient
    def dropout(x, seed):
        y, keep, scale = _dropout_forward(x, rate, seed)

        def grad(dy):
            with tf.control_dependencies([dy]):
                mask = keep if keep_mask else _keep_mask(tf.shape(dy), rate, seed, dy.dtype)
                return tf.where(mask, dy, tf.zeros([], dy.dtype)) * scale, None

        return y, grad

    return dropout(x, seed)


# ---------------------------------------------------------------------- BatchNorm


def batch_norm_output_activated(x, gamma, beta, epsilon: float = 1e-3, training: bool = True,
                                moving_mean=None, moving_variance=None, gamma_floor: float = 0.0):
    """Batch normalization over the last axis whose backward reads its output, not its input.

    The in-place activated batch-norm trick (Bulò et al. 2018; MONeT sec. 4 and appendix D,
    "output-activated"): with ``y = gamma * x_hat + beta`` the backward rebuilds
    ``x_hat = (y - beta) / gamma`` and needs neither ``x`` nor the batch mean:

    * ``dbeta = sum(dy)``, ``dgamma = sum(dy * x_hat)`` (sums over all axes but the last);
    * training: ``dx = gamma * rsqrt(var + eps) * (dy - dbeta / M - x_hat * dgamma / M)``,
      ``M`` the number of reduced elements (the gradient through the batch statistics);
    * inference (``training=False``, moving statistics): ``dx = gamma * rsqrt(var + eps) * dy``.

    The forward is Keras 3's ``BatchNormalization`` on TensorFlow op for op
    (``tf.nn.moments`` then ``tf.nn.batch_normalization``: ``inv = rsqrt(var + eps) * gamma``,
    ``y = x * inv + (beta - mean * inv)``), so ``y`` and the statistics are bit-identical to
    the layer's; the gradients equal autodiff through the layer up to float32 rounding.

    Zero gamma. ``x_hat`` cannot be rebuilt on a channel whose gamma is 0 (its output is the
    constant beta), and loses precision where ``|gamma|`` is tiny against ``|beta|`` (the
    rebuilt ``x_hat`` has an absolute error of about ``2**-24 * (|y| + |beta|) / |gamma|``).
    Channels with ``|gamma| <= gamma_floor`` (default: exactly zero) are *unsafe*: the
    forward keeps their normalized values ``(x - mean) * rsqrt(var + eps)`` (a tensor of
    ``M * Z`` floats for ``Z`` unsafe channels, found at run time, empty when there is none),
    and the backward, when ``tf.reduce_any`` finds an unsafe channel, takes a ``tf.cond``
    branch that uses those values instead of the rebuilt ones. With no unsafe channel the
    variant keeps ``y``, gamma, beta and the variance; with ``Z`` it keeps ``4 * M * Z``
    bytes more (``x`` itself is never kept).

    Args:
        x: float32 tensor of rank >= 2, channels last.
        gamma, beta: per-channel scale and offset (tensors or variables).
        epsilon: added to the variance, as the Keras layer's ``epsilon``.
        training: batch statistics (True) or ``moving_mean``/``moving_variance`` (False).
        gamma_floor: channels with ``|gamma| <= gamma_floor`` keep their normalized values.

    Returns:
        ``(y, mean, variance)``: the statistics used (batch ones in training, for the moving
        averages; biased variance as Keras), without gradient, as in the Keras layer where
        they only feed the moving-average updates.
    """
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")
    if x.shape.rank is None or x.shape.rank < 2:
        raise ArgumentError(f"x must have rank >= 2 (channels last), got shape {x.shape}")
    if gamma_floor < 0:
        raise ArgumentError(f"gamma_floor must be >= 0, got {gamma_floor!r}")
    gamma = tf.convert_to_tensor(gamma, x.dtype)
    beta = tf.convert_to_tensor(beta, x.dtype)
    axes = list(range(x.shape.rank - 1))
    if training:
        mean, variance = tf.nn.moments(x, axes)
    else:
        if moving_mean is None or moving_variance is None:
            raise ArgumentError("training=False needs moving_mean and moving_variance")
        mean = tf.convert_to_tensor(moving_mean, x.dtype)
        variance = tf.convert_to_tensor(moving_variance, x.dtype)
    mean, variance = tf.stop_gradient(mean), tf.stop_gradient(variance)
    y = normalize_output_activated(x, gamma, beta, mean, variance, epsilon, training, gamma_floor)
    return y, mean, variance


def normalize_output_activated(x, gamma, beta, mean, variance, epsilon: float, training: bool,
                               gamma_floor: float = 0.0):
    """``gamma * (x - mean) * rsqrt(variance + epsilon) + beta`` over the last axis, op for op
    as ``tf.nn.batch_normalization``, with the output-activated backward of
    :func:`batch_norm_output_activated` (see there). ``mean`` and ``variance`` are the
    statistics already computed (the batch's when ``training``, then the gradient through
    them is part of ``dx``); no gradient flows into them separately, as a caller that
    computed them from ``x`` expects."""
    axes = list(range(x.shape.rank - 1))
    mean, variance = tf.stop_gradient(mean), tf.stop_gradient(variance)

    @tf.custom_gradient
    def batch_norm(x, gamma, beta, mean, variance):
        rstd = tf.math.rsqrt(variance + epsilon)
        inv = rstd * gamma
        y = x * inv + (beta - mean * inv)
        unsafe = tf.where(tf.abs(gamma) <= gamma_floor)[:, 0]
        # normalized values of the unsafe channels: [..., Z], empty when Z == 0
        unsafe_x_hat = (tf.gather(x, unsafe, axis=-1) - tf.gather(mean, unsafe)) * tf.gather(rstd, unsafe)

        def grad(dy):
            with tf.control_dependencies([dy]):
                unsafe_mask = tf.abs(gamma) <= gamma_floor
                safe_gamma = tf.where(unsafe_mask, tf.ones_like(gamma), gamma)
                rebuilt = (y - beta) / safe_gamma

                def patched():
                    channels = tf.size(gamma)
                    position = tf.cumsum(tf.cast(unsafe_mask, tf.int32)) - 1
                    source = tf.where(unsafe_mask, channels + position, tf.range(channels))
                    return tf.gather(tf.concat([rebuilt, unsafe_x_hat], axis=-1), source, axis=-1)

                x_hat = tf.cond(tf.reduce_any(unsafe_mask), patched, lambda: rebuilt)
                dbeta = tf.reduce_sum(dy, axes)
                dgamma = tf.reduce_sum(dy * x_hat, axes)
                scale = tf.math.rsqrt(variance + epsilon) * gamma
                if training:
                    count = tf.cast(tf.size(dy) // tf.size(gamma), dy.dtype)
                    dx = scale * (dy - dbeta / count - x_hat * (dgamma / count))
                else:
                    dx = dy * scale
                return dx, dgamma, dbeta, None, None

        return _after(y, unsafe_x_hat), grad

    return batch_norm(x, gamma, beta, mean, variance)


def fused_batch_norm_variant(x, gamma, beta, epsilon: float = 1e-3):
    """Training-mode batch normalization over the last axis through
    ``tf.raw_ops.FusedBatchNormV3`` (NHWC) and its registered gradient.

    The gradient (``FusedBatchNormGradV3``) reads ``x``, the scale and the three reserve
    spaces. Measured on CPU with TensorFlow 2.21 and oneDNN on (see :func:`kept_tensors`):
    reserve spaces 1 and 2 hold one float per channel each (the batch mean and the biased
    batch variance) and reserve space 3 is empty, so it keeps ``4 * numel(x) + 3 * 4 * C``
    bytes. With oneDNN off (``TF_ENABLE_ONEDNN_OPTS=0``) reserve space 3 is one float;
    :func:`kept_tensors` reads its size from the running build.

    A rank-2 ``[N, C]`` input is run as ``[N, 1, 1, C]``.

    Returns:
        ``(y, mean, variance)`` where ``variance`` is FusedBatchNormV3's batch variance,
        Bessel-corrected (``M / (M - 1)`` times the biased variance Keras 3 uses),
        without gradient.
    """
    x = tf.convert_to_tensor(x)
    _require_float(x, "x")
    rank = x.shape.rank
    if rank not in (2, 4):
        raise ArgumentError(f"x must be NHWC or [N, C], got shape {x.shape}")
    gamma = tf.convert_to_tensor(gamma, x.dtype)
    beta = tf.convert_to_tensor(beta, x.dtype)
    inputs = x if rank == 4 else x[:, None, None, :]
    empty = tf.constant([], x.dtype)
    y, mean, variance = tf.raw_ops.FusedBatchNormV3(
        x=inputs, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=epsilon,
        exponential_avg_factor=1.0, data_format="NHWC", is_training=True)[:3]
    if rank == 2:
        y = y[:, 0, 0, :]
    return y, tf.stop_gradient(mean), tf.stop_gradient(variance)


# ------------------------------------------------------------ recomputed in backward


def recomputed_in_backward(fn: Callable, *args):
    """``fn(*args)`` whose backward keeps only ``args`` and recomputes ``fn`` from them.

    For operators whose registered gradients keep several input-sized intermediates
    (measured by :func:`measure_kept`, float32: exact GELU keeps three, its tanh
    approximation four, ``mish`` three, ``hard_silu`` four, Keras's
    ``LayerNormalization`` its input and the normalized value): the forward keeps nothing
    but its arguments, and the backward re-runs ``fn`` on them under a tape and takes
    TensorFlow's own gradient of it. The recomputation depends on the upstream gradient (a
    control edge on buffer-sharing identities of the arguments), so it runs in the backward
    pass and its intermediates live only there. The gradient is the default one's
    operations on the same values, so equal up to the rounding of kernels TensorFlow may
    fuse differently in the two places.

    Args:
        fn: a function of tensors returning one tensor.
        args: floating tensors; gradients flow to each.
    """
    args = [tf.convert_to_tensor(a) for a in args]
    for position, arg in enumerate(args):
        _require_float(arg, f"args[{position}]")

    @tf.custom_gradient
    def run(*inputs):
        def grad(dy):
            with tf.control_dependencies([dy]):
                again = [tf.identity(t) for t in inputs]
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(again)
                y_again = fn(*again)
            return tape.gradient(y_again, again, output_gradients=dy,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)

        return fn(*inputs), grad

    return run(*args)


# ---------------------------------------------------------------------- kept bytes


def kept_tensors(variant: str, input_shape: Sequence[int], **params) -> dict[str, int]:
    """The tensors a variant keeps for its backward, name -> bytes (float32 inputs).

    ``input_shape`` is the layer input's shape (fully known). Parameters by variant:

    * ``max_pool_*``: ``pool_size``, ``strides`` (default ``pool_size``), ``padding``;
    * ``dropout_regenerated``: ``seed_dtype`` (``"int32"``, the Keras convention, or
      ``"int64"``);
    * ``batch_norm_output_activated``: ``unsafe_channels`` (channels with
      ``|gamma| <= gamma_floor``, default 0).

    The numbers are the variant's data dependencies as :func:`measure_kept` lists them
    (the tests check each against a measurement): parameters the backward reads (gamma,
    beta) count, constants and resource handles do not. ``batch_norm_default`` is autodiff
    through Keras 3's ``BatchNormalization(training=True)``: besides ``x`` it keeps five
    per-channel vectors (the variable reads of gamma, the batch mean kept by
    ``squared_difference``'s gradient, ``rsqrt(var + eps)``, ``inv = rsqrt * gamma`` and the
    batch mean again as ``mean * inv``'s operand after its squeeze).
    """
    shape = tuple(int(d) for d in input_shape)
    numel = math.prod(shape)
    channels = shape[-1]
    if variant == "relu_default":
        return {"y": _F32 * numel}
    if variant in ("relu_bool", "leaky_relu_bool"):
        return {"mask": numel}
    if variant in ("leaky_relu_default", "recomputed"):
        return {"x": _F32 * numel}
    if variant in ("relu_bits", "leaky_relu_bits"):
        rows = shape[0] if len(shape) >= 2 else 1
        return {"mask_bits": 4 * rows * -(-(numel // rows) // 32)}
    if variant.startswith("max_pool_"):
        out = math.prod(pool_output_shape(shape, params.get("pool_size", 2), params.get("strides"),
                                          params.get("padding", "VALID")))
        table = {
            "max_pool_default": {"x": _F32 * numel, "y": _F32 * out},
            "max_pool_index": {"index": out},
            "max_pool_argmax": {"argmax": 8 * out},
            "max_pool_argmax_default": {"x": _F32 * numel, "argmax": 8 * out},
        }
        if variant in table:
            return table[variant]
    if variant in ("dropout_default", "dropout_bool"):
        return {"mask": numel}
    if variant == "dropout_regenerated":
        return {"seed": 2 * np.dtype(params.get("seed_dtype", "int32")).itemsize}
    if variant == "batch_norm_default":
        out = {"x": _F32 * numel}
        out.update({name: _F32 * channels for name in ("gamma", "mean", "rsqrt", "inv", "mean_squeezed")})
        return out
    if variant == "batch_norm_output_activated":
        unsafe = int(params.get("unsafe_channels", 0))
        return {"y": _F32 * numel, "gamma": _F32 * channels, "beta": _F32 * channels,
                "variance": _F32 * channels, "unsafe_x_hat": _F32 * (numel // channels) * unsafe}
    if variant == "layer_norm_recomputed":
        return {"x": _F32 * numel, "gamma": _F32 * channels, "beta": _F32 * channels}
    if variant == "fused_batch_norm":
        return {"x": _F32 * numel, "gamma": _F32 * channels, "reserve_space_1": _F32 * channels,
                "reserve_space_2": _F32 * channels, "reserve_space_3": _fused_reserve_space_3_bytes()}
    raise ArgumentError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


@functools.cache
def _fused_reserve_space_3_bytes() -> int:
    """Bytes of ``FusedBatchNormV3``'s third reserve space in this build, read off one tiny
    call: empty with oneDNN's kernel (the default on x86 CPUs), one float with TensorFlow's
    own (``TF_ENABLE_ONEDNN_OPTS=0``); it does not depend on the input's shape."""
    ones = tf.ones([1])
    out = tf.raw_ops.FusedBatchNormV3(x=tf.zeros([1, 1, 1, 1]), scale=ones, offset=tf.zeros([1]), mean=tf.zeros([1]),
                                      variance=ones, is_training=True)
    return int(tf.size(out.reserve_space_3)) * out.reserve_space_3.dtype.size


def kept_bytes(variant: str, input_shape: Sequence[int], **params) -> int:
    """Total bytes a variant keeps for its backward: ``sum(kept_tensors(...).values())``."""
    return sum(kept_tensors(variant, input_shape, **params).values())


# ---------------------------------------------------------------------- measurement


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One tensor the backward reads from the forward phase, as measured."""

    name: str
    op_type: str
    dtype: str
    shape: tuple
    nbytes: int


def measure_kept(fn: Callable, args: Sequence, wrt: Sequence[int] = (0,), dy=None, seed: int = 0):
    """Measures which tensors ``fn``'s backward keeps, and their bytes.

    Traces ``fn(*args)`` and ``tape.gradient`` of its first output (with respect to
    ``args[i]`` for ``i`` in ``wrt``, under the upstream gradient ``dy``, a function argument;
    random normal from ``seed`` when not given) into one ``tf.function`` with the arguments' static shapes. An operation is
    *backward* when it depends on ``dy`` through data or control edges; every other
    operation runs as soon as its inputs exist, i.e. in the forward phase. The kept tensors
    are the forward-phase tensors backward operations read, constants and resource handles
    excepted. Their sizes are read from the values the function returns, so shapes known
    only at run time (a gathered subset of channels, a reserve space) are measured too.

    Returns:
        ``(kept, gradients)``: a list of :class:`KeptTensor` in graph order, and the
        gradients (numpy arrays, one per ``wrt``), so one trace serves both checks.
    """
    args = [tf.convert_to_tensor(a) for a in args]
    specs = [tf.TensorSpec(a.shape, a.dtype) for a in args]
    out_spec = tf.function(fn).get_concrete_function(*specs).structured_outputs
    y_spec = tf.nest.flatten(out_spec)[0]
    found = []

    @tf.function(input_signature=[*specs, tf.TensorSpec(y_spec.shape, y_spec.dtype)])
    def step(*inputs):
        xs, dy = inputs[:-1], inputs[-1]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            for i in wrt:
                tape.watch(xs[i])
            y = tf.nest.flatten(fn(*xs))[0]
        grads = tape.gradient(y, [xs[i] for i in wrt], output_gradients=dy)
        graph = tf.compat.v1.get_default_graph()
        backward = {dy.op}
        for op in graph.get_operations():
            if any(t.op in backward for t in op.inputs) or any(c in backward for c in op.control_inputs):
                backward.add(op)
        kept, seen = [], set()
        for op in graph.get_operations():
            if op not in backward:
                continue
            for t in op.inputs:
                if t.op in backward or t.op.type == "Const" or t.dtype == tf.resource or t.ref() in seen:
                    continue
                seen.add(t.ref())
                kept.append(t)
        found[:] = [(t.name, t.op.type, t.dtype.name) for t in kept]
        return grads, kept

    if dy is None:
        dy = tf.random.stateless_normal(y_spec.shape, seed=[seed, 7], dtype=y_spec.dtype)
    grads, values = step(*args, dy)
    kept = [KeptTensor(name, op_type, dtype, tuple(v.shape), int(v.numpy().nbytes))
            for (name, op_type, dtype), v in zip(found, values)]
    return kept, [None if g is None else g.numpy() for g in grads]


def _after(y, *kept):
    """``y`` once ``kept`` exist: the tensors a backward keeps are computed before the
    forward's output (a control dependency on a buffer-sharing identity). The compiled step
    orders its statements on their outputs; without this, TensorFlow may compute a mask or
    an index late, keeping the tensors it reads (the layer's input) alive past their free
    (measured: a Conv2D(relu)'s pre-activation held into the backward pass)."""
    with tf.control_dependencies(kept):
        return tf.identity(y)


def _require_float(x, name):
    if not x.dtype.is_floating:
        raise ArgumentError(f"{name} must be a floating tensor, got {x.dtype.name}")
