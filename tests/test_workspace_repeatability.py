"""A layer's profiled backward workspace is the same from one trace to the next (needs TensorFlow).

TensorFlow's runtime runs two independent branches of one function in an order that changes
from one instantiation of the function to the next (identical function definitions; with
Grappler's meta-optimizer off too). The ungated trace of a convolution has two: the forward
(oneDNN's fused conv with its 12,336-byte scratch) and the filter gradient, which reads the
input and the upstream gradient but not the output. When the forward ran last, its scratch
counted in the backward's workspace: 13,232 bytes instead of 912 in about half the
extractions (benchmarks/results/workspace_repeatability.md).
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.extract import analysis  # noqa: E402
from tfremat.runtime import executor  # noqa: E402

_TRACES = 8  # before the fix each trace ran the forward last with probability about 1/2


def test_the_ungated_backward_peak_does_not_depend_on_the_trace():
    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv2D(8, 3, padding="same")
    spec = tf.TensorSpec((8, 16, 16, 3), tf.float32)
    conv.build(spec.shape)
    x = tf.constant(np.random.default_rng(0).standard_normal(spec.shape).astype("float32"))
    args = ([x], tf.constant(1.0))
    with executor.step_executor():
        tracer = analysis._CallTracer(lambda xs: conv(xs[0]), [spec], [False], conv.trainable_variables,
                                      one_call=False)
        gated = analysis._requested_peak(tracer.trace("step"), args, 1)
        ungated = [analysis._requested_peak(tracer.trace("ungated", gated=False), args, 1) for _ in range(_TRACES)]
    # The upstream gradient waits for the forward in both orders, as in the step, so the
    # forward's scratch is freed before the backward starts whichever branch the runtime
    # would have run first.
    assert ungated == [gated] * _TRACES, (gated, ungated)


def _attention(inputs):
    """Keras's dot-product attention on (batch, tokens, heads, key_dim) projections, as
    ``MultiHeadAttention`` computes it: scores, softmax, weighted values."""
    query, key, value = inputs
    scores = tf.einsum("aecd,abcd->acbe", key, query * 0.25)
    return tf.einsum("acbe,aecd->abcd", tf.nn.softmax(scores, axis=-1), value)


@pytest.mark.parametrize("fetch", ["consumed", "dying"])
def test_the_greediest_attention_backward_peaks_at_least_as_high_as_any_drawn_order(fetch):
    # The executor draws the order of the ungated backward's independent operations per
    # instantiation: the value gradient's kernel ran after the softmax gradient's Sum in some
    # draws and before it in others, while the score-sized product Sum reads was live
    # (transformer_encoder's attention backward: 214,016 / 230,400 / 262,144 B by draw).
    # The greediest order holds both, so the largest over the orders does not depend on the draw.
    spec = tf.TensorSpec((2, 64, 2, 16), tf.float32)
    rng = np.random.default_rng(0)
    args = ([tf.constant(rng.standard_normal(spec.shape).astype("float32")) for _ in range(3)], tf.constant(1.0))
    with executor.step_executor():
        tracer = analysis._CallTracer(_attention, [spec] * 3, [True] * 3, [], one_call=False)
        greediest = {analysis._requested_peak(tracer.trace(fetch, greediest=True), args, 1) for _ in range(3)}
        drawn = [analysis._requested_peak(tracer.trace(fetch, gated=False), args, 1) for _ in range(_TRACES)]
    assert len(greediest) == 1, greediest
    assert max(drawn) <= min(greediest), (greediest, drawn)
    # Both score-sized buffers (2 x 2 x 64 x 64 float32) are live with the value gradient's.
    assert min(greediest) >= 3 * 65536, greediest
