"""Measured peak memory of a plain ``tf.GradientTape`` training step.

This is the ground truth the checkpoint-all prediction of an extracted graph is held to.
It needs ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the environment before TensorFlow is imported
(on CPU; GPUs always use the BFC allocator), otherwise the allocator reports nothing.

The step is measured by :func:`tfremat.runtime.memory.measure_step_peak`, the code
that measures a compiled step, so both are in the graph's convention: the peak during the
step above what was allocated before it, plus the bytes that exist before the step and that
the graph counts as fixed (parameters, optimizer slots, non-trainable variables, the
batch). ``count="requested"`` sums the bytes the step's operations request, what the
simulator predicts; ``count="allocator"`` is the BFC allocator's peak, whose chunk rounding
depends on what the process allocated before (a few percent between runs).
"""

from __future__ import annotations

import functools
import logging

import tensorflow as tf

from tfremat.errors import CompileError, ExtractionError
from tfremat.extract.layer_graph import model_output_names
from tfremat.extract.side_table import flatten_by_name
from tfremat.runtime.memory import measure_step_peak

__all__ = ["StepParts", "measure_plain_step_peak", "plain_train_step"]

logger = logging.getLogger(__name__)


class StepParts:
    """Which part of a plain step made each of its operations: ``forward``, ``loss``,
    ``backward`` (the tape's gradient, with its sums at fan-out), ``update`` or ``other``
    (the step's inputs and outputs, operations Grappler made under names of its own).

    Recorded while the step is traced, from the operations each part added to the graph,
    rather than by name scopes of the step's own: a scope renames every operation, and
    Grappler breaks ties by name (a forward scope that sorted before ``gradient_tape/``
    changed a mixed-precision step's memory; tfremat/extract/checks.py), so the plain step
    keeps the names a user's step has. A profiler trace names the operations that ran, so
    this attributes a run's seconds to the parts (:func:`tfremat.extract.overlap.step_parts`).
    """

    def __init__(self):
        self._by_name: dict[str, str] = {}
        self._by_scope: dict[str, str] = {}

    def record(self, part: str, operations) -> None:
        """Marks ``operations`` (just added to the traced graph) as made by ``part``."""
        for op in operations:
            self._by_name[op.name] = part
            scope = op.name.split("/", 1)[0]
            # A top scope that holds one part's operations names that part for operations
            # Grappler renamed within it (a fused op, a folded constant).
            self._by_scope[scope] = part if self._by_scope.get(scope, part) == part else "other"

    def of(self, op_name: str) -> str:
        """The part that made ``op_name`` (by its top name scope where Grappler renamed it)."""
        return self._by_name.get(op_name) or self._by_scope.get(op_name.split("/", 1)[0], "other")


def plain_train_step(model, loss_fn, optimizer):
    """A plain training step ``step(x, y) -> loss`` as a ``tf.function``: the model's forward
    on a gradient tape, ``loss_fn`` on its outputs, the optimizer's update (built first, so
    its slots exist before the step, as they do before a compiled one). The function's
    ``parts`` (:class:`StepParts`) says which part of the step made each operation, once it
    is traced.

    Traced without AutoGraph, as the profiler's calls and the compiled step are: a model they
    can trace gives the same operations, without converting each user layer's code first (the
    plain overlap's trace is part of the first step's wait; the saving was below the noise
    of benchmarks/results/first_step_latency.md)."""
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    parts = StepParts()

    @functools.partial(tf.function, autograph=False)
    def step(inputs, labels):
        graph = tf.compat.v1.get_default_graph()

        def recorded(part: str, run):
            first = len(graph.get_operations())
            result = run()
            parts.record(part, graph.get_operations()[first:])
            return result

        with tf.GradientTape() as tape:
            preds = recorded("forward", lambda: model(inputs, training=True))
            loss = recorded("loss", lambda: loss_fn(flatten_by_name(labels, model_output_names(model), "outputs"),
                                                    tf.nest.flatten(preds)))
        grads = recorded("backward", lambda: tape.gradient(loss, model.trainable_variables))
        recorded("update", lambda: optimizer.apply_gradients(zip(grads, model.trainable_variables)))
        return loss

    step.parts = parts
    return step


def measure_plain_step_peak(model, x, y, loss_fn, optimizer, warmup: int = 1, count: str = "allocator") -> int:
    """Runs plain training steps and returns the peak of the last one, in bytes.

    The model's and the optimizer's variables are restored afterwards.

    Args:
        model: the Keras model.
        x, y: one batch (tensors or nested structures of them).
        loss_fn: ``fn(labels_list, preds_list) -> scalar`` (``SideTable.loss_fn``).
        optimizer: a Keras optimizer; it is built first so its slots exist before the step.
        warmup: steps run (and traced) before the measured one.
        count: ``"allocator"``: the BFC allocator's peak (whole chunks, so it varies with
            the process's allocation history); ``"requested"``: the peak of the bytes the
            step's operations request, from the profiler's allocation events (see
            :func:`tfremat.runtime.memory.measure_step_peak`).

    Returns:
        The peak bytes of one step, including parameters, optimizer state and the batch.

    Raises:
        ExtractionError: the allocator reports no usage (``TF_CPU_ALLOCATOR_USE_BFC``
            unset), or ``count`` is unknown.
    """
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    step = plain_train_step(model, loss_fn, optimizer)
    variables = list(model.variables) + list(optimizer.variables)
    saved = [v.numpy() for v in variables]
    try:
        peak = measure_step_peak(step, x, y, resident=variables, warmup=warmup, count=count)
    except CompileError as error:  # the compiled-step measurement's error type; here nothing is compiled
        raise ExtractionError(str(error)) from error
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)
    logger.info("plain step peak (%s): %d bytes", count, peak)
    return peak
