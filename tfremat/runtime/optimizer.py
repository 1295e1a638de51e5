"""Applying a Keras optimizer's update one variable at a time (its TensorFlow backend).

Shared by the compiled step (:func:`tfremat.static_graph.compile.compile_step`, which says
why) and the measurement of the update's temporaries
(:mod:`tfremat.extract.optimizer_update`), so that both run the same operations.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["apply_gated"]


def apply_gated(optimizer, pairs) -> dict[int, tuple[Any, list]]:
    """``optimizer.apply_gradients(pairs)`` on one replica: without Keras's all-reduce (a
    sum over one replica that makes every update wait for the last gradient), each
    variable's weight decay and update step under a control dependency on its own gradient,
    the update after the decay.
    The optimizer (or its ``inner_optimizer``) must have ``_all_reduce_sum_gradients``.

    Returns:
        ``{id(variable): (variable, the operations its update step created)}``, keyed by
        the Keras variable of ``pairs``.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    update_step = inner.update_step
    weight_decay = inner._apply_weight_decay
    created: dict[int, tuple[Any, list]] = {}
    # The update step gets the TensorFlow variable behind a Keras variable: keyed back.
    keras_id = {}
    for _, variable in pairs:
        value = getattr(variable, "value", None)
        keras_id[id(value if isinstance(value, tf.Variable) else variable)] = id(variable)

    def gated_update_step(gradient, variable, learning_rate):
        gate = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with tf.control_dependencies([gate]):
            weight_decay([variable])
            decay = graph.get_operations()[first:]
        # The update after the decay has written the variable: in either order the
        # executor could hold the decay's product and the update's temporaries at once.
        with tf.control_dependencies([gate, *decay]):
            result = update_step(gradient, variable, learning_rate)
        created[keras_id.get(id(variable), id(variable))] = (variable, graph.get_operations()[first:])
        return result

    # Instance attributes shadow the two methods while apply_gradients traces.
    inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
    inner.update_step = gated_update_step
    inner._apply_weight_decay = lambda variables: None
    try:
        optimizer.apply_gradients(pairs)
    finally:
        del inner._all_reduce_sum_gradients
        del inner.update_step
        del inner._apply_weight_decay
    return created
