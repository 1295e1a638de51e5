"""Will it fit, how slow: the planned step measured against a plain Keras step in one run.

Peak memory comes from the TensorFlow allocator (on CPU it needs
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow is imported; the ``tfremat`` command
sets it), read by :func:`tfremat.runtime.memory.measure_step_peak` for both steps, in
the graph's convention: the allocator peak during a step above what was allocated before
it, plus the bytes resident before it that the graph counts as fixed (weights, optimizer
state, the batch).
"""

from __future__ import annotations

import logging
import statistics
import time

import tensorflow as tf

from tfremat.errors import ArgumentError, is_int
from tfremat.extract.plain_step import plain_train_step
from tfremat.model_planning import (
    check_keras_model,
    loss_and_optimizer,
    synthetic_batch,
    wants_implementations,
)
from tfremat.numerics import closeness
from tfremat.planner import plan_graph
from tfremat.runtime.memory import (
    default_device,
    measure_step_peak,
    reset_allocator_peak,
)

__all__ = ["measure_model"]

logger = logging.getLogger(__name__)


def _peak_and_seconds(step, x, y, resident, steps: int) -> tuple[int, float]:
    """``step(x, y)``'s peak in the graph's convention (:func:`measure_step_peak`: one
    tracing run, then a measured one) and the median seconds of ``steps`` more runs."""
    # reset_allocator_peak says how to enable the allocator's statistics when they are off.
    reset_allocator_peak(default_device())
    peak = measure_step_peak(step, x, y, resident=resident)
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        tf.nest.flatten(step(x, y))[0].numpy()
        seconds.append(time.perf_counter() - began)
    return peak, float(statistics.median(seconds))


def _fresh(optimizer):
    """A new optimizer configured as ``optimizer`` (no slots, no step count): each measured
    step gets its own, as a training run starts with one."""
    return type(optimizer).from_config(optimizer.get_config())


def _name_of(loss) -> str:
    """A loss as a report names it: its name, a Keras loss's ``name``, a function's name."""
    if isinstance(loss, str):
        return loss
    if isinstance(loss, (list, tuple, dict)):
        return repr(loss)
    return getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__)


def _compare_gradients(model, extraction, schedule, x, y, saved):
    """The planned step's gradients against a plain tape's on ``(x, y)``, as
    :func:`tfremat.numerics.closeness` (None when no variable gets a gradient); the model's
    variables are put back to ``saved`` after each."""
    from tfremat.plan.execution import build_plan
    from tfremat.static_graph.interpreter import interpret_plan

    graph, table = extraction.graph, extraction.side_table
    plan = build_plan(graph, schedule)

    @tf.function
    def planned_gradients(inputs, labels):
        _, _, grads, _ = interpret_plan(graph, table, plan, inputs, labels)
        return {key: grad for key, (_, grad) in grads.items()}

    @tf.function
    def plain_gradients(inputs, labels):
        with tf.GradientTape() as tape:
            predictions = model(inputs, training=True)
            value = table.loss_fn(table.flat_labels(labels), tf.nest.flatten(predictions))
        return tape.gradient(value, model.trainable_variables)

    planned = planned_gradients(x, y)
    _restore(model, saved)
    reference = plain_gradients(x, y)
    _restore(model, saved)
    compared = [
        # An Embedding's gradients are IndexedSlices, which have no .numpy().
        (tf.convert_to_tensor(planned[id(variable)]).numpy(), tf.convert_to_tensor(plain).numpy())
        for variable, plain in zip(model.trainable_variables, reference)
        if id(variable) in planned and plain is not None
    ]
    return closeness([p for p, _ in compared], [e for _, e in compared]) if compared else None


def _restore(model, saved) -> None:
    for variable, value in zip(model.variables, saved):
        variable.assign(value)


def measure_model(model, budget, *, batch_size: int, strategy: str = "optimal", steps: int = 5, loss=None,
                  optimizer=None, cost_model: str = "profile", granularity: str = "sublayer", seed: int = 0,
                  verbose: int = 1, cache=True, **strategy_options) -> dict:
    """Plans, compiles and runs ``model``'s step under ``budget``, and a plain training step.

    The model is measured as it trains: with its compiled loss (and loss weights) and a
    fresh copy of its compiled optimizer, unless ``loss`` / ``optimizer`` are given. The
    plain step runs on the model itself (a ``tf.GradientTape`` step with the same loss and
    another fresh optimizer copy), so custom layers need no cloning.

    Args:
        model: a Keras model (its weights are restored afterwards, also when a step raises).
        budget: any budget form of :func:`tfremat.planner.plan_graph`.
        batch_size: the batch size; the data is random, its labels made for the loss
            (:func:`tfremat.model_planning.synthetic_batch`).
        strategy: the strategy name.
        steps: timed steps per variant (after a tracing step and a measured one).
        loss: a loss name or object; default the compiled one.
        optimizer: a Keras optimizer or its name; default the compiled one.
        cost_model: "profile" (timed on this device) or "flops".
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        verbose: 0 silences the solver's progress line.
        cache: the schedule cache, as for :func:`tfremat.planner.plan_graph`; False (or
            None) also turns off the profile cache.

    Returns:
        the loss and optimizer (class) measured with,
        predicted_peak_bytes, measured_peak_bytes (the allocator's peak),
        requested_peak_bytes (the bytes the step's operations request, what the prediction
        counts), step_seconds, plain_peak_bytes, plain_step_seconds, the gradients against
        plain training's (:mod:`tfremat.numerics`): grad_error (the largest per-variable
        normwise error), grad_global_error and gradients_match (both within tolerance),
        and the ratios measured/predicted, requested/predicted, peak/plain and time/plain.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, ``steps`` or ``batch_size`` not an
            int >= 1, an unknown optimizer name, or no loss or optimizer (an uncompiled
            model without ``loss=`` / ``optimizer=``), before anything runs.
    """
    from tfremat.extract.extractor import extract
    from tfremat.static_graph.compile import compile_step

    check_keras_model(model)
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not is_int(value) or value < 1:
            raise ArgumentError(f"{name}={value!r} must be an int >= 1")
    training = loss_and_optimizer(model, loss, optimizer)
    if training["optimizer"] is None:
        raise ArgumentError("no optimizer: compile the model or pass optimizer= (a Keras optimizer or its name)")
    x, y = tf.nest.map_structure(tf.constant, synthetic_batch(model, batch_size, loss=training["loss"], seed=seed))
    saved = [v.numpy() for v in model.variables]
    try:
        extraction = extract(model, sample_batch=(x, y), cost_model=cost_model, granularity=granularity,
                             use_cache=cache is not False and cache is not None,
                             implementations=wants_implementations([strategy]),
                             **{**training, "optimizer": _fresh(training["optimizer"])})
        result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **strategy_options)
        gradients = _compare_gradients(model, extraction, result.schedule, x, y, saved)

        step_optimizer = _fresh(training["optimizer"])
        step_optimizer.build(model.trainable_variables)
        step = compile_step(extraction, result.schedule, optimizer=step_optimizer)
        resident = list(model.variables) + list(step_optimizer.variables)
        measured, seconds = _peak_and_seconds(step, x, y, resident, steps)
        # What the prediction counts; the allocator's peak adds BFC chunk rounding that
        # depends on what the process allocated before (the demo: 47.70 MiB requested,
        # exactly the prediction, 52.70 MiB allocator).
        requested = measure_step_peak(step, x, y, resident=resident, warmup=0, count="requested")
        _restore(model, saved)

        plain_optimizer = _fresh(training["optimizer"])
        plain_step = plain_train_step(model, extraction.side_table.loss_fn, plain_optimizer)
        plain, plain_seconds = _peak_and_seconds(
            plain_step, x, y, list(model.variables) + list(plain_optimizer.variables), steps)
        return {
            "model": model.name,
            "loss": _name_of(training["loss"]),
            "optimizer": type(training["optimizer"]).__name__,
            "strategy": strategy,
            "batch_size": batch_size,
            "budget_bytes": result.budget_bytes,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "measured_peak_bytes": measured,
            "requested_peak_bytes": requested,
            "step_seconds": round(seconds, 5),
            "plain_peak_bytes": plain,
            "plain_step_seconds": round(plain_seconds, 5),
            "grad_error": None if gradients is None else gradients.max_tensor_error,
            "grad_global_error": None if gradients is None else gradients.global_error,
            "gradients_match": None if gradients is None else gradients.equal,
            "measured_over_predicted": round(measured / result.predicted_peak_bytes, 4),
            "requested_over_predicted": round(requested / result.predicted_peak_bytes, 4),
            "peak_over_plain": round(measured / plain, 4),
            "time_over_plain": round(seconds / plain_seconds, 4),
            "predicted_overhead": round(result.overhead, 4),
            "device": default_device(),
        }
    finally:
        # Also when planning or a run raises: the docstring promises the weights back.
        _restore(model, saved)
