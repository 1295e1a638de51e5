"""Allocator-measured peak memory of a plain ``tf.GradientTape`` training step.

This is the ground truth the checkpoint-all prediction of an extracted graph is held to.
It needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the environment before TensorFlow is imported
(on CPU; GPUs always use the BFC allocator), otherwise the allocator reports nothing.

The step's peak is reported in the graph's convention: the allocator peak during the step
above what was allocated before it, plus the bytes that exist before the step and that the
graph counts as fixed (parameters, optimizer slots, non-trainable variables, the batch).
Other tensors the process happens to hold are thus not counted.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.analysis import device_name
from tfremat.extract.layer_graph import model_output_names
from tfremat.extract.side_table import flatten_by_name

__all__ = ["measure_plain_step_peak"]

logger = logging.getLogger(__name__)


def _bytes(tensors) -> int:
    return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tensors)


def measure_plain_step_peak(model, x, y, loss_fn, optimizer, warmup: int = 1) -> int:
    """Runs plain training steps and returns the allocator peak of the last one, in bytes.

    Args:
        model: the Keras model.
        x, y: one batch (tensors or nested structures of them).
        loss_fn: ``fn(labels_list, preds_list) -> scalar`` (``SideTable.loss_fn``).
        optimizer: a Keras optimizer; it is built first so its slots exist before the step.
        warmup: steps run (and traced) before the measured one.

    Returns:
        The peak bytes of one step, including parameters, optimizer state and the batch.

    Raises:
        ExtractionError: the allocator reports no usage (``TF_CPU_ALLOCATOR_USE_BFC`` unset).
    """
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            preds = model(inputs, training=True)
            loss = loss_fn(flatten_by_name(labels, model_output_names(model), "outputs"), tf.nest.flatten(preds))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    saved = [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]
    device = device_name().split("device:")[-1]
    for _ in range(warmup):
        step(x, y).numpy()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    step(x, y).numpy()
    peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    for variable, value in zip(list(model.variables) + list(optimizer.variables), saved):
        variable.assign(value)
    if start == 0 and peak == 0:
        raise ExtractionError(
            "the allocator reports no memory use; set TF_CPU_ALLOCATOR_USE_BFC=true before importing TensorFlow"
        )
    resident = _bytes(model.variables) + _bytes(optimizer.variables) + _bytes(tf.nest.flatten(x)) + _bytes(tf.nest.flatten(y))
    logger.info("plain step peak: %d bytes above start, %d resident", peak, resident)
    return int(peak + resident)
