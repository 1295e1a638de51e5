"""Keras's train function around a compiled step: the loss tracker and compiled metrics
updated as Keras's ``train_step`` updates them (:func:`update_metrics`), and the step run
on every replica of a ``tf.distribute`` strategy (:class:`DistributedTrainStep`), for
:class:`tfremat.keras.RematCallback` and the multi-worker loop of :func:`tfremat.fit`."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfremat.errors import CompileError
from tfremat.runtime import executor

__all__ = ["DistributedTrainStep", "update_metrics"]


def update_metrics(model, step, loss, x, y, y_pred, sample_weight=None) -> dict:
    """Updates ``model``'s loss tracker and compiled metrics with one step's loss and
    predictions, as Keras's ``train_step`` does, and returns the logs (metric results).

    Runs eagerly after a one-device step, and in the replica context under a strategy
    (:class:`DistributedTrainStep`), where Keras's metric variables sum the replicas'
    updates as they do in ``model.fit``. ``loss`` is the step's (unscaled) loss.
    """
    batch = tf.shape(tf.nest.flatten(x)[0])[0]
    model._loss_tracker.update_state(loss, sample_weight=batch)
    if len(step.side_table.output_names) > 1 and getattr(model, "_compile_loss", None) is not None:
        # Keras records each output's own loss (``<output>_loss`` in the history) while
        # computing the total; the step returns only the total, so the per-output
        # losses are evaluated once more on its predictions (a reduction, no layer).
        model._compile_loss(y, y_pred, sample_weight)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class DistributedTrainStep:
    """A compiled step run on every replica of its strategy, with Keras's metrics: the
    equivalent of the train function Keras 3 makes under a ``tf.distribute`` strategy
    (``strategy.run`` of ``train_step`` in a ``tf.function``, logs averaged over the replicas).

    Call it on one batch of a distributed dataset or iterator
    (``strategy.experimental_distribute_dataset``), ``x, y`` and optional ``sample_weight``
    as per-replica values: each replica runs :meth:`~tfremat.static_graph.CompiledStep.replica_step` on its part,
    the optimizer all-reduces the gradients, and :func:`update_metrics` runs on each
    replica. Returns the logs, as ``model.train_function`` does. A loop of its own (one
    that ``model.fit`` cannot run, e.g. under ``MultiWorkerMirroredStrategy``) calls it
    once per distributed batch. Like the step, it runs on TensorFlow's single-threaded
    executor (one operation at a time on each replica's device) unless the step was
    compiled with ``sequential=False``.

    Attributes:
        model: the Keras model, built and compiled in the strategy's scope.
        step: the :class:`~tfremat.static_graph.CompiledStep`, compiled with ``strategy=``
            from a plan for one replica's batch (:func:`tfremat.keras.replica_batch`).
        strategy: the step's strategy.
    """

    def __init__(self, model, step):
        if step.strategy is None or not step.return_outputs:
            raise CompileError("DistributedTrainStep needs a step compiled with compile_step(..., strategy=..., "
                               "return_outputs=True)")
        self.model = model
        self.step = step
        self.strategy = step.strategy
        # Whether the traced function calls functions, which the single-threaded executor
        # can wait for for ever (executor.calls_functions); None: not traced yet.
        self._calls_functions: bool | None = None
        self._sequential = step.sequential
        self.function = tf.function(self._run, autograph=False,
                                    experimental_attributes=executor.NOT_INLINED if step.sequential else None)

    def _replica(self, x, y, sample_weight):
        loss, y_pred = self.step.replica_step(x, y, sample_weight, caller_sequential=self._sequential)
        return update_metrics(self.model, self.step, loss, x, y, y_pred, sample_weight)

    def _run(self, x, y, sample_weight=None):
        logs = self.strategy.run(self._replica, args=(x, y, sample_weight))
        # Keras's metrics are equal on every replica (their variables sum the replicas'
        # updates); their mean is what Keras's train function reports.
        return tf.nest.map_structure(
            lambda value: self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None), logs)

    def __call__(self, x, y, sample_weight=None):
        args = (x, y) if sample_weight is None else (x, y, sample_weight)
        if self._sequential and self._calls_functions is None:
            with executor.sequential():  # traced as it runs
                graph = self.function.get_concrete_function(*args).graph
            self._calls_functions = executor.calls_functions(graph)
            if self._calls_functions:  # traced again for the default executor, its conditionals lowered
                self._sequential = False
                self.function = tf.function(self._run, autograph=False)
        with executor.sequential() if self._sequential else contextlib.nullcontext():
            return self.function(*args)
