"""Will it fit, how slow: the planned step measured against a plain Keras step in one run.

Peak memory comes from the TensorFlow allocator (on CPU it needs
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow is imported; the ``tfremat`` command
sets it). Both steps are reported in the graph's convention: the allocator peak during a
step above what was allocated before it, plus the bytes resident before it that the graph
counts as fixed (weights, optimizer state, the batch).
"""

from __future__ import annotations

import logging
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfremat.errors import ArgumentError, is_int
from tfremat.extract.analysis import reset_allocator_peak
from tfremat.static_graph.memory import default_device, resident_bytes

__all__ = ["measure_model"]

logger = logging.getLogger(__name__)


def _run_and_measure(run, steps: int) -> tuple[int, float]:
    """Runs ``run()`` once to trace, then ``steps`` timed times; returns (peak above start, median s)."""
    device = default_device()
    run()
    reset_allocator_peak(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    return int(peak), float(statistics.median(seconds))


def _random_batch(model, batch_size: int, seed: int):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((batch_size, *t.shape[1:])).astype(t.dtype) for t in model.inputs]
    ys = []
    for t in model.outputs:
        classes = t.shape[-1]
        labels = rng.integers(0, classes, size=(batch_size, *t.shape[1:-1]))
        ys.append(np.eye(classes, dtype="float32")[labels])
    unpack = lambda items: items[0] if len(items) == 1 else items  # noqa: E731
    return unpack([tf.constant(x) for x in xs]), unpack([tf.constant(y) for y in ys])


def measure_model(model, budget, *, batch_size: int, strategy: str = "optimal", steps: int = 5,
                  loss="categorical_crossentropy", optimizer_name: str = "sgd", cost_model: str = "profile",
                  seed: int = 0, verbose: int = 1, **strategy_options) -> dict:
    """Plans, compiles and runs ``model``'s step under ``budget``, and a plain Keras step.

    Args:
        model: a Keras model (its weights are restored afterwards, also when a step raises).
        budget: any budget form of :func:`tfremat.budget.parse_budget`.
        batch_size: the batch size; the data is random.
        strategy: the strategy name.
        steps: timed steps per variant (after one tracing step).
        loss: loss name or object; optimizer_name: a Keras optimizer name.
        verbose: 0 silences the solver's progress line.

    Returns:
        predicted_peak_bytes, measured_peak_bytes, step_seconds, plain_peak_bytes,
        plain_step_seconds, max_grad_rel_error, and the ratios measured/predicted,
        peak/plain and time/plain.

    Raises:
        ArgumentError: ``steps`` or ``batch_size`` not an int >= 1, or an unknown
            ``optimizer_name`` (before anything runs).
    """
    from tfremat.api import keras_optimizer, plan_graph
    from tfremat.extract.extractor import extract
    from tfremat.plan.execution import build_plan
    from tfremat.static_graph.compile import compile_step
    from tfremat.static_graph.interpreter import interpret_plan

    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not is_int(value) or value < 1:
            raise ArgumentError(f"{name}={value!r} must be an int >= 1")
    x, y = _random_batch(model, batch_size, seed)
    saved = [v.numpy() for v in model.variables]
    try:
        optimizer = keras_optimizer(optimizer_name, "optimizer_name")
        extraction = extract(model, sample_batch=(x, y), loss=loss, optimizer=optimizer, cost_model=cost_model)
        graph = extraction.graph
        result = plan_graph(graph, budget, strategy, verbose=verbose, **strategy_options)
        plan = build_plan(graph, result.schedule)

        @tf.function
        def planned_gradients(inputs, labels):
            _, _, grads, _ = interpret_plan(graph, extraction.side_table, plan, inputs, labels)
            return {key: grad for key, (_, grad) in grads.items()}

        @tf.function
        def plain_gradients(inputs, labels):
            with tf.GradientTape() as tape:
                predictions = model(inputs, training=True)
                value = extraction.side_table.loss_fn(extraction.side_table.flat_labels(labels), tf.nest.flatten(predictions))
            return tape.gradient(value, model.trainable_variables)

        planned = planned_gradients(x, y)
        for variable, value in zip(model.variables, saved):
            variable.assign(value)
        reference = plain_gradients(x, y)
        errors = []
        for variable, plain in zip(model.trainable_variables, reference):
            if id(variable) in planned and plain is not None:
                difference = np.abs(planned[id(variable)].numpy() - plain.numpy()).max()
                errors.append(float(difference / max(np.abs(plain.numpy()).max(), 1e-30)))
        for variable, value in zip(model.variables, saved):
            variable.assign(value)

        optimizer = keras_optimizer(optimizer_name, "optimizer_name")
        optimizer.build(model.trainable_variables)
        step = compile_step(extraction, result.schedule, optimizer=optimizer)
        peak, seconds = _run_and_measure(lambda: step(x, y).numpy(), steps)
        resident = resident_bytes(model.variables) + resident_bytes(optimizer.variables) + resident_bytes(tf.nest.flatten((x, y)))
        for variable, value in zip(model.variables, saved):
            variable.assign(value)

        plain_model = keras.models.clone_model(model)
        plain_model.set_weights(model.get_weights())
        plain_model.compile(optimizer=keras_optimizer(optimizer_name, "optimizer_name"), loss=loss)
        plain_peak, plain_seconds = _run_and_measure(lambda: plain_model.train_on_batch(x, y), steps)
        plain_resident = resident_bytes(plain_model.variables) + resident_bytes(plain_model.optimizer.variables) + resident_bytes(tf.nest.flatten((x, y)))

        measured = peak + resident
        plain = plain_peak + plain_resident
        return {
            "model": model.name,
            "strategy": strategy,
            "batch_size": batch_size,
            "budget_bytes": result.budget_bytes,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "measured_peak_bytes": measured,
            "step_seconds": round(seconds, 5),
            "plain_peak_bytes": plain,
            "plain_step_seconds": round(plain_seconds, 5),
            "max_grad_rel_error": max(errors) if errors else None,
            "measured_over_predicted": round(measured / result.predicted_peak_bytes, 4),
            "peak_over_plain": round(measured / plain, 4),
            "time_over_plain": round(seconds / plain_seconds, 4),
            "predicted_overhead": round(result.overhead, 4),
            "device": default_device(),
        }
    finally:
        # Also when planning or a run raises: the docstring promises the weights back.
        for variable, value in zip(model.variables, saved):
            variable.assign(value)
