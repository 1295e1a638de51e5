"""Allocator-measured peak memory of one training step, in the graph's convention.

On CPU the numbers exist only with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is
imported. The peak reported is the allocator's peak during the step above what was allocated
when it started, plus the bytes that exist before the step and that the graph counts as
fixed (variables, optimizer slots, the batch): the same convention as
:func:`tfremat.extract.measure_plain_step_peak`, so a compiled step, a plain step and the
simulator's prediction compare directly. Tensors the process holds for other reasons are
not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfremat.errors import CompileError

__all__ = ["measure_step_peak", "resident_bytes", "default_device"]

logger = logging.getLogger(__name__)


def default_device() -> str:
    """``GPU:0`` when TensorFlow sees a GPU, else ``CPU:0``."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def resident_bytes(tensors: Sequence) -> int:
    """Bytes of tensors or variables from their static shapes and dtypes."""
    return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tensors)


def measure_step_peak(step: Callable, x, y, resident: Sequence = (), device: str | None = None, warmup: int = 1) -> int:
    """Runs ``step(x, y)`` and returns the allocator peak of the last run, in bytes.

    Args:
        step: the training step (a :class:`~tfremat.static_graph.CompiledStep` or any
            callable of the batch); its first output is synchronized on.
        x, y: one batch, already tensors on the device.
        resident: the variables that exist before the step and that the graph counts as
            fixed (model and optimizer variables); their bytes and the batch's are added.
        device: the allocator to read (default :func:`default_device`).
        warmup: runs (tracing included) before the measured one.

    Returns:
        Peak bytes of one step in the graph's convention (see the module docstring).

    Raises:
        CompileError: the allocator reports nothing (``TF_CPU_ALLOCATOR_USE_BFC`` unset).
    """
    device = device or default_device()

    def run():
        result = step(x, y)
        tf.nest.flatten(result)[0].numpy()

    for _ in range(warmup):
        run()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    run()
    peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    if start == 0 and peak == 0:
        raise CompileError("the allocator reports no memory use; set TF_CPU_ALLOCATOR_USE_BFC=true before importing TensorFlow")
    fixed = resident_bytes(list(resident)) + resident_bytes(tf.nest.flatten(x)) + resident_bytes(tf.nest.flatten(y))
    logger.info("step peak on %s: %d bytes above start, %d resident", device, peak, fixed)
    return int(peak + fixed)
