"""The temporaries of an optimizer's update, measured on probe variables.

A Keras optimizer's update of one variable requests weight-sized buffers beyond the
variable, its gradient and its slots: SGD with momentum and Adam one (``m * momentum`` or
``g - m`` before it is assigned), RMSprop two, RMSprop with momentum three, plain SGD none
(its ``g * lr`` takes the gradient's buffer). Updates of several variables whose gradients
all exist run one after the other in TensorFlow's executor (one inter-op thread), except
for Lion, which computes one more weight-sized product of every other variable's momentum
first. ``benchmarks/optimizer_update.py`` holds the table for the common optimizers.

:func:`update_temporaries` measures the optimizer the user gave: a copy of it (same config,
its own variables, so the user's optimizer state does not move) updates one, then two probe
variables whose gradients exist before the update starts, in a ``tf.function`` traced as
the compiled step applies gradients (no all-reduce), and the profiler's requested bytes
above the gradients give the two ratios of :class:`UpdateTemporaries`, the largest over
:data:`_TRACES` traces. Results are cached per optimizer class and config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import keras
import numpy as np
import tensorflow as tf

from tfremat.errors import CompileError
from tfremat.runtime.memory import default_device, requested_peak
from tfremat.runtime.optimizer import apply_gated

__all__ = ["UpdateTemporaries", "update_temporaries"]

logger = logging.getLogger(__name__)

# A probe variable of 512 x 512 float32 (1 MiB): the update's scalars (learning rate,
# iteration count) are then below 0.1% of it. Two dimensions, so that optimizers that treat
# matrices apart (factored second moments) take the matrix path.
_PROBE_SHAPE = (512, 512)
# Used when the profiler records nothing (no BFC allocator): the most any optimizer of the
# table needs (RMSprop with momentum: three weight-sized buffers).
_UNMEASURED = 3.0

# Independent traces of each probe, the largest kept: the executor's order of an update's
# operations can differ between traces, and the step's own trace may take either (AdamW read
# 1 or 2 buffers until :func:`~tfremat.runtime.optimizer.apply_gated` ordered its decay first).
_TRACES = 2

_cache: dict[str, "UpdateTemporaries"] = {}


@dataclasses.dataclass(frozen=True)
class UpdateTemporaries:
    """Bytes an update requests beyond the variables, gradients and slots, per variable byte.

    Attributes:
        first: for the variable whose update peaks (the largest).
        concurrent: for every other variable updated at the same time (its gradient exists
            when the updates start), held while the first one peaks.
    """

    first: float
    concurrent: float

    def bytes_for(self, sizes) -> int:
        """The temporaries of updating variables of ``sizes`` bytes together."""
        sizes = [int(s) for s in sizes if s]
        if not sizes:
            return 0
        largest = max(sizes)
        return int(math.ceil(self.first * largest + self.concurrent * (sum(sizes) - largest)))


def update_temporaries(optimizer) -> UpdateTemporaries:
    """The update temporaries of ``optimizer`` (module docstring), measured once per class
    and config."""
    key = _config_key(optimizer)
    if key not in _cache:
        _cache[key] = _measure(optimizer)
        logger.info("optimizer %s: its update requests %.2fx the largest variable + %.2fx the others",
                    type(optimizer).__name__, _cache[key].first, _cache[key].concurrent)
    return _cache[key]


def _config_key(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}:" + json.dumps(
        keras.optimizers.serialize(optimizer), sort_keys=True, default=str)


def _measure(optimizer) -> UpdateTemporaries:
    variable_bytes = int(np.prod(_PROBE_SHAPE)) * 4
    try:
        one = max(_probe(optimizer, 1) for _ in range(_TRACES)) / variable_bytes
        two = max(_probe(optimizer, 2) for _ in range(_TRACES)) / variable_bytes
    except CompileError as error:
        logger.warning("could not measure %s's update temporaries (%s); counting %.0f weight-sized buffers",
                       type(optimizer).__name__, error, _UNMEASURED)
        return UpdateTemporaries(_UNMEASURED, 0.0)
    # To 1/100 of a variable: the update's scalars are a few hundred bytes.
    return UpdateTemporaries(round(one, 2), round(max(two - one, 0.0), 2))


def _probe(optimizer, count: int) -> int:
    """Bytes ``count`` probe updates request above their gradients, all updated at once."""
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    variables = [keras.Variable(np.zeros(_PROBE_SHAPE, "float32"), name=f"probe_{i}") for i in range(count)]
    clone.build(variables)
    seeds = [tf.constant(np.full(_PROBE_SHAPE, 0.5, "float32")) for _ in range(count)]

    @tf.function(autograph=False)
    def step(seeds):
        # Fresh gradients (not held by the caller, as in the training step), all made
        # before the update starts.
        gradients = [seed * 2.0 for seed in seeds]
        with tf.control_dependencies(gradients):
            gradients = [tf.identity(g) for g in gradients]
        _apply(clone, list(zip(gradients, variables)))
        return tf.constant(0.0)

    step(seeds)
    peak = requested_peak(lambda: step(seeds).numpy(), default_device())
    return max(peak - count * int(np.prod(_PROBE_SHAPE)) * 4, 0)


def _apply(optimizer, pairs) -> None:
    """The update as the compiled step applies gradients on one replica (its
    ``_apply_without_barrier``): :func:`~tfremat.runtime.optimizer.apply_gated` where the
    optimizer has Keras's TensorFlow all-reduce to skip, else unchanged."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(inner, "_all_reduce_sum_gradients"):
        apply_gated(optimizer, pairs)
    else:
        optimizer.apply_gradients(pairs)
