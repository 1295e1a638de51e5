"""The per-block ``tf.recompute_grad`` baseline of ``benchmarks/transformers.py``.

Each outermost layer that holds sublayers (a transformer block, or a ``MultiHeadAttention``
where blocks are not layers) has its ``call`` wrapped in ``tf.recompute_grad``, with its
keyword arguments bound in a closure: ``keras.RematScope`` passes them to
``tf.custom_gradient``, which refuses keyword arguments outside eager mode. The recomputed
forward runs every layer again, dropout included, so it draws new masks: the gradients
differ from plain training's, and :func:`gradient_difference` measures by how much.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def outermost_composites(model: keras.Model) -> list:
    """The outermost non-model layers that hold sublayers, nested models searched."""
    found = []

    def visit(layer):
        for sub in getattr(layer, "_layers", None) or []:
            if isinstance(sub, keras.Model):
                visit(sub)
            elif getattr(sub, "_layers", None):
                found.append(sub)

    visit(model)
    return found


def recompute_per_block(model: keras.Model) -> int:
    """Wraps every outermost composite layer's call in ``tf.recompute_grad``; returns how
    many were wrapped."""
    blocks = outermost_composites(model)
    for layer in blocks:
        original = layer.call

        def call(*args, _original=original, **kwargs):
            def forward(*tensors):
                return _original(*tensors, **kwargs)

            return tf.recompute_grad(forward)(*args)

        layer.call = call
    return len(blocks)


def gradient_difference(plain: keras.Model, other: keras.Model, x, y, loss: keras.losses.Loss) -> float:
    """The largest absolute difference between the two models' gradients on one batch,
    relative to the largest plain gradient (the models must start from equal weights and
    seeds)."""

    def gradients(model):
        @tf.function
        def compute(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            return tape.gradient(value, model.trainable_variables)

        return [tf.convert_to_tensor(g).numpy() for g in compute(x, y)]

    reference, measured = gradients(plain), gradients(other)
    largest = max(float(np.max(np.abs(g))) for g in reference)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(reference, measured)) / largest
