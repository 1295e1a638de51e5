"""Operator implementation variants (tfremat.runtime.variants): gradients against
TensorFlow's, inside ``tf.function``, and the bytes each keeps for the backward, measured.

The bytes are measured with :func:`tfremat.runtime.variants.measure_kept`: the forward and
the gradient are traced into one graph, the operations that depend on the upstream gradient
(data or control edges) form the backward, and the forward-phase tensors they read are what
the step keeps; their sizes are read at run time. Each measurement is compared with
:func:`kept_tensors` tensor by tensor (the sorted list of sizes) and in total.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat.errors import ArgumentError
from tfremat.runtime import variants as V

RNG = np.random.default_rng(20210423)


def _normal(shape, scale=1.0, shift=0.0, rng=None):
    return tf.constant(((rng or RNG).standard_normal(shape) * scale + shift).astype(np.float32))


def _bn_step(variant):
    """A traced step: ``variant``'s output and statistics, and its gradients with respect
    to x, gamma and beta under ``dy``."""

    @tf.function
    def step(x, gamma, beta, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            y, mean, variance = variant(x, gamma, beta, 1e-3)
        return (y, mean, variance, *tape.gradient(y, [x, gamma, beta], output_gradients=dy))

    return step


def _bits(a):
    """The float32 bit patterns, so signed zeros and NaN payloads compare too."""
    return np.asarray(a, np.float32).view(np.int32)


def _grad_fn(forward, n_wrt=1):
    """A tf.function returning forward's first output and its gradients w.r.t. the first
    ``n_wrt`` arguments under the upstream gradient ``dy`` (the last argument)."""

    @tf.function(autograph=False)
    def step(*args):
        *inputs, dy = args
        with tf.GradientTape() as tape:
            for t in inputs[:n_wrt]:
                tape.watch(t)
            y = tf.nest.flatten(forward(*inputs))[0]
        return y, tape.gradient(y, list(inputs[:n_wrt]), output_gradients=dy)

    return step


def _eager_grad(forward, x, dy):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = forward(x)
    return y, tape.gradient(y, x, output_gradients=dy)


def _check_kept(variant, fn, args, shape, wrt=(0,), dy=None, **params):
    kept, grads = V.measure_kept(fn, args, wrt, dy=dy)
    expected = V.kept_tensors(variant, shape, **params)
    assert sorted(k.nbytes for k in kept) == sorted(expected.values()), (variant, kept, expected)
    assert sum(k.nbytes for k in kept) == V.kept_bytes(variant, shape, **params)
    return kept, grads


# ----------------------------------------------------------------------------- ReLU

RELU_SHAPES = [(2, 7, 9, 3), (33,), (5, 31)]


@pytest.mark.parametrize("shape", RELU_SHAPES)
@pytest.mark.parametrize("mask", ["bool", "bits"])
@pytest.mark.parametrize("max_value", [None, 6])
def test_relu_mask_gradient_is_bit_identical(shape, mask, max_value):
    x = 4 * _normal(shape).numpy()
    flat = x.reshape(-1)
    # TF's convention at zero (and at 6 for ReLU6): no gradient
    flat[:6] = [0.0, -0.0, np.nan, 1.0, 6.0, 7.0][:flat.size]
    dy = _normal(shape).numpy()
    dy.reshape(-1)[6:8] = [np.inf, -np.inf]  # inf * 0 -> NaN where the mask is off
    x, dy = tf.constant(x), tf.constant(dy)
    reference = tf.nn.relu if max_value is None else tf.nn.relu6
    ref_y, (ref_dx,) = _grad_fn(reference)(x, dy)
    y, (dx,) = _grad_fn(lambda t: V.relu_with_mask(t, mask, max_value))(x, dy)
    assert np.array_equal(_bits(y), _bits(ref_y))
    assert np.array_equal(_bits(dx), _bits(ref_dx))
    # eager too (the custom gradient closes over the mask only)
    _, eager_dx = _eager_grad(lambda t: V.relu_with_mask(t, mask, max_value), x, dy)
    assert np.array_equal(_bits(eager_dx), _bits(ref_dx))


@pytest.mark.parametrize("shape", [(2, 7, 9, 3), (64,), (65,)])
def test_relu_kept_bytes(shape):
    x = _normal(shape)
    _check_kept("relu_default", tf.nn.relu, [x], shape)
    _check_kept("relu_bool", lambda t: V.relu_with_mask(t, "bool"), [x], shape)
    kept, _ = _check_kept("relu_bits", lambda t: V.relu_with_mask(t, "bits"), [x], shape)
    rows = shape[0] if len(shape) >= 2 else 1
    assert kept[0].dtype == "int32" and kept[0].shape == (rows, -(-math.prod(shape) // rows // 32))


@pytest.mark.parametrize("shape", RELU_SHAPES)
@pytest.mark.parametrize("mask", ["bool", "bits"])
def test_leaky_relu_mask_gradient_is_bit_identical(shape, mask):
    x = 4 * _normal(shape).numpy()
    x.reshape(-1)[:3] = [0.0, -0.0, np.nan][:x.size]
    dy = _normal(shape).numpy()
    dy.reshape(-1)[3:5] = [np.inf, -np.inf]
    x, dy = tf.constant(x), tf.constant(dy)
    ref_y, (ref_dx,) = _grad_fn(lambda t: tf.nn.leaky_relu(t, alpha=0.1))(x, dy)
    y, (dx,) = _grad_fn(lambda t: V.relu_with_mask(t, mask, negative_slope=0.1))(x, dy)
    assert np.array_equal(_bits(y), _bits(ref_y))
    assert np.array_equal(_bits(dx), _bits(ref_dx))
    _check_kept("leaky_relu_default", lambda t: tf.nn.leaky_relu(t, alpha=0.1), [x], shape)
    _check_kept(f"leaky_relu_{mask}", lambda t: V.relu_with_mask(t, mask, negative_slope=0.1), [x], shape)


def test_relu_mask_rejects_bad_slopes():
    for slope, max_value in ((1.0, None), (-0.1, None), (0.1, 6), ("0.1", None)):
        with pytest.raises(ArgumentError, match="negative_slope"):
            V.relu_with_mask(tf.ones([2]), "bits", max_value=max_value, negative_slope=slope)


# ------------------------------------------------------------ recomputed in backward

ACTIVATIONS = {
    "gelu": keras.activations.gelu,
    "gelu_tanh": lambda t: keras.activations.gelu(t, approximate=True),
    "mish": keras.activations.mish,
    "hard_silu": keras.activations.hard_silu,
}


def _normwise_error(actual, expected):
    return np.linalg.norm(np.ravel(actual) - np.ravel(expected)) / np.linalg.norm(np.ravel(expected))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_recomputed_activation_keeps_only_its_input(name):
    """The registered gradients keep several input-sized tensors; recomputed in the
    backward, only the input stays, and the gradient is TensorFlow's own."""
    activation, shape = ACTIVATIONS[name], (3, 5, 16)
    x = 3 * _normal(shape)
    default_kept, default_grads = V.measure_kept(activation, [x])
    kept, grads = V.measure_kept(lambda t: V.recomputed_in_backward(activation, t), [x])
    full_size = [k for k in kept if k.nbytes >= 4 * math.prod(shape)]
    assert sum(k.nbytes for k in full_size) == V.kept_bytes("recomputed", shape)
    assert sum(k.nbytes for k in default_kept) >= 2 * V.kept_bytes("recomputed", shape), default_kept
    assert sum(k.nbytes for k in kept) - V.kept_bytes("recomputed", shape) <= 8  # a scalar at most
    assert _normwise_error(grads[0], default_grads[0]) < 1e-6


def test_layer_norm_recomputed_keeps_input_and_parameters():
    shape = (4, 6, 8)
    x, gamma, beta = _normal(shape, 2.0, 1.0), _normal(shape[-1:], 1.0, 1.0), _normal(shape[-1:])

    def layer_norm(t, g, b):
        return keras.ops.layer_normalization(t, g, b, -1, 1e-3)

    _, expected = V.measure_kept(layer_norm, [x, gamma, beta], wrt=(0, 1, 2))
    kept, grads = _check_kept("layer_norm_recomputed", lambda *a: V.recomputed_in_backward(layer_norm, *a),
                              [x, gamma, beta], shape, wrt=(0, 1, 2))
    for actual, wanted in zip(grads, expected):
        assert _normwise_error(actual, wanted) < 1e-6


def test_recomputed_in_backward_refuses_integer_arguments():
    with pytest.raises(ArgumentError, match=r"args\[0\]"):
        V.recomputed_in_backward(tf.nn.relu, tf.constant([1, 2]))


# -------------------------------------------------------------------------- MaxPool

POOLS = [(2, 2, "VALID"), (3, 2, "SAME"), (3, 1, "SAME"), (3, 2, "VALID"), ((2, 3), (1, 2), "SAME"),
         (3, 3, "SAME")]


def _overlaps(pool, strides):
    kh, kw = (pool, pool) if isinstance(pool, int) else pool
    sh, sw = (strides, strides) if isinstance(strides, int) else strides
    return -(-kh // sh) * -(-kw // sw)


@pytest.mark.parametrize("pool,strides,padding", POOLS)
def test_max_pool_index_matches_tf_gradient(pool, strides, padding):
    """Ties (integer inputs with many equal values) and SAME padding included. TF's CPU
    kernel (eager) is matched bit for bit; the oneDNN kernel TF uses in tf.function picks the
    same positions (integer-valued dy: every sum exact) and sums ties of three or more
    overlapping windows in another order (random dy: bit-identical only when at most two
    windows overlap on an element)."""
    shape = (3, 9, 11, 4)
    tied = tf.constant(RNG.integers(0, 3, shape).astype(np.float32))
    out_shape = V.pool_output_shape(shape, pool, strides, padding)
    assert out_shape == tuple(tf.nn.max_pool2d(tied, pool, strides, padding).shape)
    default = lambda t: tf.nn.max_pool2d(t, pool, strides, padding)  # noqa: E731
    for variant in (V.max_pool_with_index, V.max_pool_with_argmax_variant):
        fn = lambda t: variant(t, pool, strides, padding)  # noqa: E731
        for x in (tied, _normal(shape)):
            dy = _normal(out_shape)
            y, (dx,) = _grad_fn(fn)(x, dy)
            ref_y, ref_dx = _eager_grad(default, x, dy)
            assert np.array_equal(_bits(y), _bits(ref_y))
            assert np.array_equal(_bits(dx), _bits(ref_dx))
            graph_y, (graph_dx,) = _grad_fn(default)(x, dy)
            assert np.array_equal(_bits(y), _bits(graph_y))
            if _overlaps(pool, strides) <= 2:
                assert np.array_equal(_bits(dx), _bits(graph_dx))
            else:
                np.testing.assert_allclose(dx, graph_dx, rtol=1e-6, atol=1e-6)
            exact_dy = tf.constant(RNG.integers(-8, 9, out_shape).astype(np.float32))
            _, (dx,) = _grad_fn(fn)(x, exact_dy)
            _, (graph_dx,) = _grad_fn(default)(x, exact_dy)
            assert np.array_equal(_bits(dx), _bits(graph_dx))


def test_max_pool_argmax_variant_matches_registered_gradient():
    shape, pool = (2, 7, 9, 3), (3, 2, "SAME")
    x = tf.constant(RNG.integers(0, 3, shape).astype(np.float32))
    dy = _normal(V.pool_output_shape(shape, *pool))
    default = lambda t: tf.nn.max_pool_with_argmax(t, pool[0], pool[1], pool[2], include_batch_in_index=True)[0]  # noqa: E731
    _, (ref_dx,) = _grad_fn(default)(x, dy)
    _, (dx,) = _grad_fn(lambda t: V.max_pool_with_argmax_variant(t, *pool))(x, dy)
    assert np.array_equal(_bits(dx), _bits(ref_dx))


def test_max_pool_index_all_minus_inf_windows():
    """max_pool2d returns the lowest float for an all -inf window and TF's gradient goes to
    the window's first valid element; the index falls back to that element."""
    x = tf.constant(np.full([1, 5, 5, 2], -np.inf, np.float32))
    dy = _normal([1, 3, 3, 2])
    default = lambda t: tf.nn.max_pool2d(t, 2, 2, "SAME")  # noqa: E731
    ref_y, ref_dx = _eager_grad(default, x, dy)
    y, (dx,) = _grad_fn(lambda t: V.max_pool_with_index(t, 2, 2, "SAME"))(x, dy)
    assert np.array_equal(_bits(y), _bits(ref_y)) and np.array_equal(_bits(dx), _bits(ref_dx))
    y, (dx,) = _grad_fn(lambda t: V.max_pool_with_argmax_variant(t, 2, 2, "SAME"))(x, dy)
    assert np.all(y.numpy() == -np.inf) and np.array_equal(_bits(dx), _bits(ref_dx))  # -inf, not the lowest float


@pytest.mark.parametrize("pool,strides,padding", [(2, 2, "VALID"), (3, 2, "SAME")])
def test_max_pool_kept_bytes(pool, strides, padding):
    shape = (2, 7, 9, 3)
    x = _normal(shape)
    params = dict(pool_size=pool, strides=strides, padding=padding)
    _check_kept("max_pool_default", lambda t: tf.nn.max_pool2d(t, pool, strides, padding), [x], shape, **params)
    kept, _ = _check_kept("max_pool_index", lambda t: V.max_pool_with_index(t, pool, strides, padding), [x], shape,
                          **params)
    assert kept[0].dtype == "uint8"
    _check_kept("max_pool_argmax", lambda t: V.max_pool_with_argmax_variant(t, pool, strides, padding), [x], shape,
                **params)
    _check_kept("max_pool_argmax_default",
                lambda t: tf.nn.max_pool_with_argmax(t, pool, strides, padding, include_batch_in_index=True)[0],
                [x], shape, **params)


def test_max_pool_index_rejects_bad_arguments():
    with pytest.raises(ArgumentError):
        V.max_pool_with_index(_normal([1, 4, 4, 1]), 2, 2, "FULL")
    with pytest.raises(ArgumentError):
        V.max_pool_with_index(_normal([1, 20, 20, 1]), 17, 1, "VALID")  # 289 window positions
    with pytest.raises(ArgumentError):
        V.max_pool_with_index(_normal([4, 4, 1]), 2)


# -------------------------------------------------------------------------- Dropout


@pytest.mark.parametrize("shape,rate,seed_dtype", [((2, 7, 9, 3), 0.3, tf.int32), ((1001,), 0.5, tf.int64),
                                                   ((5, 31), 0.9, tf.int32)])
def test_dropout_gradients_are_bit_identical(shape, rate, seed_dtype):
    x, dy = _normal(shape), _normal(shape)
    seed = tf.constant([17, 4], seed_dtype)
    default = lambda t, s: tf.nn.experimental.stateless_dropout(t, rate, s)  # noqa: E731
    ref_y, (ref_dx,) = _grad_fn(default)(x, seed, dy)
    for variant in (V.dropout_regenerated, V.dropout_bool_mask):
        step = _grad_fn(lambda t, s: variant(t, rate, s))
        y, (dx,) = step(x, seed, dy)
        assert np.array_equal(_bits(y), _bits(ref_y))
        assert np.array_equal(_bits(dx), _bits(ref_dx))
        # second call, same seed: the same mask in the forward and the backward
        y2, (dx2,) = step(x, seed, dy)
        assert np.array_equal(_bits(y2), _bits(y)) and np.array_equal(_bits(dx2), _bits(dx))
        kept = y.numpy() != 0
        assert np.array_equal(dx.numpy() != 0, kept)
        other, _ = step(x, tf.constant([18, 4], seed_dtype), dy)
        assert not np.array_equal(other.numpy() != 0, kept)


def test_dropout_kept_bytes():
    shape = (2, 7, 9, 3)
    x = _normal(shape)
    for dtype in ("int32", "int64"):
        seed = tf.constant([1, 2], dtype)
        kept, _ = _check_kept("dropout_regenerated", lambda t, s: V.dropout_regenerated(t, 0.3, s), [x, seed], shape,
                              seed_dtype=dtype)
        assert kept[0].op_type == "Placeholder" and kept[0].dtype == dtype  # the seed argument itself
    seed = tf.constant([1, 2], tf.int32)
    _check_kept("dropout_bool", lambda t, s: V.dropout_bool_mask(t, 0.3, s), [x, seed], shape)
    _check_kept("dropout_default", lambda t, s: tf.nn.experimental.stateless_dropout(t, 0.3, s), [x, seed], shape)


def test_dropout_rate_zero_and_bad_arguments():
    x = _normal([3, 4])
    assert np.array_equal(V.dropout_regenerated(x, 0.0, tf.constant([1, 2])), x)
    with pytest.raises(ArgumentError):
        V.dropout_regenerated(x, 1.0, tf.constant([1, 2]))
    with pytest.raises(ArgumentError):
        V.dropout_bool_mask(x, 0.5, tf.constant([1.0, 2.0]))


# ---------------------------------------------------------------------- BatchNorm

BN_SHAPES = [(4, 5, 7, 6), (33, 5), (3, 3, 3, 1)]


def _keras_bn(shape, gamma, beta, epsilon=1e-3):
    layer = keras.layers.BatchNormalization(epsilon=epsilon)
    layer.build(shape)
    layer.gamma.assign(gamma)
    layer.beta.assign(beta)
    return layer


def _keras_bn_grads(layer, x, dy, training=True):
    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training)
        return (y, *tape.gradient(y, [x, layer.gamma, layer.beta], output_gradients=dy))

    return [t.numpy() for t in step(x, dy)]


def _assert_close(actual, expected):
    """float32 rtol 1e-5; elements that are sums with cancellation (near zero against the
    tensor's scale) get an absolute tolerance of 1e-5 times the largest magnitude."""
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_output_activated_matches_keras(shape):
    channels = shape[-1]
    x, dy = _normal(shape, 2.0, 0.5), _normal(shape)
    gamma, beta = _normal([channels], 1.0, 0.2), _normal([channels])
    layer = _keras_bn(shape, gamma, beta)
    ref = _keras_bn_grads(layer, x, dy)

    step = _bn_step(V.batch_norm_output_activated)

    y, mean, variance, *grads = [t.numpy() for t in step(x, gamma, beta, dy)]
    assert np.array_equal(_bits(y), _bits(ref[0]))  # the forward is Keras's, op for op
    ref_mean, ref_variance = tf.nn.moments(x, list(range(len(shape) - 1)))
    assert np.array_equal(_bits(mean), _bits(ref_mean)) and np.array_equal(_bits(variance), _bits(ref_variance))
    for got, want in zip(grads, ref[1:]):
        _assert_close(got, want)


def test_batch_norm_output_activated_as_accurate_as_keras():
    """Against float64 autodiff, the rebuilt-from-output gradient errs about as much as
    Keras's own float32 autodiff (both are float32 sums over 4096 elements), for gammas
    around Keras's initial 1. Rebuilding x_hat from y loses digits as |beta| / |gamma|
    grows (dgamma's error reached 6x Keras's at |gamma| = 0.002): that case is
    ``gamma_floor``'s (test_batch_norm_gamma_floor_covers_tiny_gamma). Own seeded data, so the
    outcome does not depend on which tests ran before in the worker."""
    global RNG
    shape = (64, 8, 8, 16)
    saved, RNG = RNG, np.random.default_rng(7)
    try:
        x, dy = _normal(shape, 2.0, 0.5), _normal(shape)
        gamma, beta = _normal([16], 0.2, 1.0), _normal([16])
    finally:
        RNG = saved
    ref = _keras_bn_grads(_keras_bn(shape, gamma, beta), x, dy)
    step = _grad_fn(lambda x, g, b: V.batch_norm_output_activated(x, g, b), 3)
    _, grads = step(x, gamma, beta, dy)
    x64, g64, b64, dy64 = (tf.cast(t, tf.float64) for t in (x, gamma, beta, dy))
    with tf.GradientTape() as tape:
        tape.watch([x64, g64, b64])
        y64 = tf.nn.batch_normalization(x64, *tf.nn.moments(x64, [0, 1, 2]), b64, g64, 1e-3)
    truth = tape.gradient(y64, [x64, g64, b64], output_gradients=dy64)
    for got, keras_grad, true in zip(grads, ref[1:], truth):
        err, keras_err = np.abs(got.numpy() - true).max(), np.abs(keras_grad - true).max()
        assert err <= max(3 * keras_err, 1e-6 * np.abs(true).max())


@pytest.mark.parametrize("shape", [(4, 5, 7, 6), (33, 5)])
def test_batch_norm_zero_gamma_takes_the_fallback(shape):
    """A zero gamma makes x_hat unrecoverable from y on its channel: the forward keeps that
    channel's normalized values, the backward's tf.cond uses them, and the gradients (dgamma
    of the zero channel included, which the rebuilt path would get as 0) stay correct."""
    channels = shape[-1]
    # Data of its own: drawn from the module's generator it depended on which tests ran
    # before in the worker, and one draw in a CI run rounded 1.6e-4 apart on one element.
    rng = np.random.default_rng(0)
    x, dy = _normal(shape, 2.0, 0.5, rng), _normal(shape, rng=rng)
    gamma = _normal([channels], 1.0, 0.2, rng).numpy()
    gamma[[0, channels - 1]] = 0.0
    gamma, beta = tf.constant(gamma), _normal([channels], rng=rng)
    ref = _keras_bn_grads(_keras_bn(shape, gamma, beta), x, dy)
    unsafe = 2
    kept, grads = _check_kept("batch_norm_output_activated", lambda x, g, b: V.batch_norm_output_activated(x, g, b),
                              [x, gamma, beta], shape, wrt=(0, 1, 2), dy=dy, unsafe_channels=unsafe)
    assert any(k.nbytes == 4 * math.prod(shape[:-1]) * unsafe for k in kept)  # the fallback's values
    for got, want in zip(grads, ref[1:]):
        _assert_close(got, want)
    assert abs(ref[2][0]) > 1e-3 and abs(grads[1][0] - ref[2][0]) <= 1e-5 * np.abs(ref[2]).max()


def test_batch_norm_gamma_floor_covers_tiny_gamma():
    """With |gamma| tiny against |beta| the rebuilt x_hat loses its digits; gamma_floor moves
    such channels to the kept-values path."""
    shape = (16, 4, 4, 3)
    x, dy = _normal(shape, 2.0, 0.5), _normal(shape)
    gamma, beta = tf.constant([1e-6, 1.0, -2.0]), tf.constant([50.0, 0.1, 0.3])
    ref = _keras_bn_grads(_keras_bn(shape, gamma, beta), x, dy)
    floor0 = _grad_fn(lambda x, g, b: V.batch_norm_output_activated(x, g, b), 3)(x, gamma, beta, dy)[1]
    floored = _grad_fn(lambda x, g, b: V.batch_norm_output_activated(x, g, b, gamma_floor=1e-4), 3)(x, gamma, beta,
                                                                                                    dy)[1]
    assert abs(floor0[1].numpy()[0] - ref[2][0]) > 1e-2 * abs(ref[2][0])  # the documented loss of precision
    for got, want in zip(floored, ref[1:]):
        _assert_close(got.numpy(), want)


def test_batch_norm_output_activated_inference_mode():
    shape = (6, 5, 5, 4)
    x, dy = _normal(shape, 2.0, 0.5), _normal(shape)
    gamma, beta = _normal([4], 1.0, 0.2), _normal([4])
    layer = _keras_bn(shape, gamma, beta)
    layer.moving_mean.assign(_normal([4], 0.1, 0.4))
    layer.moving_variance.assign(_normal([4], 0.1, 2.0))
    ref = _keras_bn_grads(layer, x, dy, training=False)
    mm, mv = tf.constant(layer.moving_mean.numpy()), tf.constant(layer.moving_variance.numpy())
    step = _grad_fn(lambda x, g, b: V.batch_norm_output_activated(x, g, b, training=False, moving_mean=mm,
                                                                     moving_variance=mv), 3)
    y, grads = step(x, gamma, beta, dy)
    assert np.array_equal(_bits(y), _bits(ref[0]))
    assert np.array_equal(_bits(grads[0]), _bits(ref[1]))  # dy * rsqrt(var + eps) * gamma, as autodiff
    for got, want in zip(grads, ref[1:]):
        _assert_close(got.numpy(), want)


@pytest.mark.parametrize("shape", [(4, 5, 7, 6), (33, 5)])
def test_batch_norm_kept_bytes(shape):
    channels = shape[-1]
    x, gamma, beta = _normal(shape), _normal([channels], 1.0, 0.2), _normal([channels])
    kept, _ = _check_kept("batch_norm_output_activated", lambda x, g, b: V.batch_norm_output_activated(x, g, b),
                          [x, gamma, beta], shape, wrt=(0, 1, 2))
    assert not any(k.name.startswith("inputs_0") for k in kept)  # x is not kept
    stats = _normal([channels]), _normal([channels], 0.1, 1.0)
    _check_kept("batch_norm_output_activated",
                lambda x, g, b, mm, mv: V.batch_norm_output_activated(x, g, b, training=False, moving_mean=mm,
                                                                      moving_variance=mv),
                [x, gamma, beta, *stats], shape, wrt=(0, 1, 2))
    fn = lambda x, g, b: tf.nn.batch_normalization(x, *tf.nn.moments(x, list(range(len(shape) - 1))), b, g, 1e-3)  # noqa: E731
    kept, _ = _check_kept("batch_norm_default", fn, [x, gamma, beta], shape, wrt=(0, 1, 2))
    layer = _keras_bn(shape, gamma, beta)
    _check_kept("batch_norm_default", lambda x: layer(x, training=True), [x], shape)
    kept, _ = _check_kept("fused_batch_norm", lambda x, g, b: V.fused_batch_norm_variant(x, g, b), [x, gamma, beta],
                          shape, wrt=(0, 1, 2))
    assert sorted(k.name for k in kept if k.op_type == "FusedBatchNormV3") == [
        "FusedBatchNormV3:3", "FusedBatchNormV3:4", "FusedBatchNormV3:5"]


@pytest.mark.parametrize("shape", [(4, 5, 7, 6), (33, 5)])
def test_fused_batch_norm_matches_keras(shape):
    channels = shape[-1]
    x, dy = _normal(shape, 2.0, 0.5), _normal(shape)
    gamma, beta = _normal([channels], 1.0, 0.2), _normal([channels])
    ref = _keras_bn_grads(_keras_bn(shape, gamma, beta), x, dy)

    step = _bn_step(V.fused_batch_norm_variant)

    y, mean, variance, *grads = [t.numpy() for t in step(x, gamma, beta, dy)]
    _assert_close(y, ref[0])
    count = math.prod(shape[:-1])
    biased = tf.nn.moments(x, list(range(len(shape) - 1)))[1].numpy()
    np.testing.assert_allclose(variance, biased * count / (count - 1), rtol=1e-5)  # Bessel-corrected
    for got, want in zip(grads, ref[1:]):
        _assert_close(got, want)


def test_variants_run_with_unknown_batch_size():
    """Graph-mode safe with a dynamic batch dimension (the pool needs static H and W); the
    results equal the static-shape ones (bit for bit but for batch norm's reductions)."""
    variants = [lambda t: V.relu_with_mask(t, "bits"), lambda t: V.max_pool_with_index(t, 3, 2, "SAME"),
                lambda t: V.max_pool_with_argmax_variant(t, 3, 2, "SAME"),
                lambda t: V.dropout_regenerated(t, 0.3, tf.constant([1, 2])),
                lambda t: V.batch_norm_output_activated(t, tf.ones([3]), tf.zeros([3]))[0]]
    x = _normal([2, 7, 9, 3])
    for n, fn in enumerate(variants):
        dy = _normal(fn(x).shape)
        out_shape = [None, *dy.shape[1:]]

        @tf.function(input_signature=[tf.TensorSpec([None, 7, 9, 3]), tf.TensorSpec(out_shape)], autograph=False)
        def step(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return y, tape.gradient(y, x, output_gradients=dy)

        static_y, (static_dx,) = _grad_fn(fn)(x, dy)
        y, dx = step(x, dy)
        assert np.array_equal(_bits(y), _bits(static_y))
        if n == len(variants) - 1:
            _assert_close(dx.numpy(), static_dx.numpy())
        else:
            assert np.array_equal(_bits(dx), _bits(static_dx))


def test_batch_norm_output_activated_takes_keras_variables():
    shape = (4, 5, 5, 3)
    x, dy = _normal(shape, 2.0, 1.0), _normal(shape)
    layer = _keras_bn(shape, _normal([3], 1.0, 0.2), _normal([3]))
    ref = _keras_bn_grads(layer, x, dy)

    @tf.function(autograph=False)
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = V.batch_norm_output_activated(x, layer.gamma, layer.beta, layer.epsilon)[0]
        return tape.gradient(y, [x, layer.gamma, layer.beta], output_gradients=dy)

    for got, want in zip(step(x, dy), ref[1:]):
        _assert_close(got.numpy(), want)


def test_measurement_sees_recomputation_not_anchored_to_dy():
    """Why every variant's backward runs under a control dependency on dy: a regenerated
    mask that depends only on the seed runs in the forward phase, and the measurement
    reports the full-size mask as kept."""
    shape, rate = (2, 7, 9, 3), 0.3

    def naive(x, seed):
        @tf.custom_gradient
        def dropout(x, seed):
            keep = tf.random.stateless_uniform(tf.shape(x), seed) >= rate
            y = tf.where(keep, x / (1 - rate), 0.0)

            def grad(dy):
                again = tf.random.stateless_uniform(shape, seed) >= rate
                return tf.where(again, dy / (1 - rate), 0.0), None

            return y, grad

        return dropout(x, seed)

    kept, _ = V.measure_kept(naive, [_normal(shape), tf.constant([1, 2])])
    assert max(k.nbytes for k in kept) >= math.prod(shape)  # the early mask, not the 8-byte seed
    assert V.kept_bytes("dropout_regenerated", shape) == 8


def test_kept_bytes_rejects_unknown_variant():
    with pytest.raises(ArgumentError):
        V.kept_bytes("relu_fancy", (2, 3))
    assert set(V.VARIANTS) >= {"relu_bits", "max_pool_index", "dropout_regenerated", "batch_norm_output_activated"}
