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
            # Only tensors go through tf.recompute_grad; None and other arguments are bound.
            positions = [i for i, a in enumerate(args) if tf.is_tensor(a)]

            def forward(*tensors):
                filled = list(args)
                for i, tensor in zip(positions, tensors):
                    filled[i] = tensor
                return _original(*filled, **kwargs)

            return tf.recompute_grad(forward)(*(args[i] for i in positions))

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

        # Variables the loss does not reach (a pooler the head skips) have no gradient.
        return [None if g is None else tf.convert_to_tensor(g).numpy() for g in compute(x, y)]

    pairs = [(a, b) for a, b in zip(gradients(plain), gradients(other)) if a is not None and b is not None]
    largest = max(float(np.max(np.abs(a))) for a, _ in pairs)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs) / largest
