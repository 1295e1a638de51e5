"""Will it fit, how slow: the planned step measured against a plain Keras step in one run.

Time is taken in turns (:func:`tfremat.runtime.timing.time_in_turns`, re-exported here):
after both steps have run, each round times the planned step and the plain one back to
back, and the ratio is the median of the per-round ratios, with its quartiles as the
spread, so a change of load on a shared machine does not read as overhead.

Peak memory comes from the TensorFlow allocator (on CPU it needs
``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow is imported; the ``tfremat`` command
sets it), read by :func:`tfremat.runtime.memory.measure_step_peak` for both steps, in
the graph's convention: the allocator peak during a step above what was allocated before
it, plus the bytes resident before it that the graph counts as fixed (weights, optimizer
state, the batch).
"""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from tfremat.errors import ArgumentError, is_int
from tfremat.extract.plain_step import plain_train_step
from tfremat.model_planning import (
    check_exact_gradients,
    check_keras_model,
    exact_only_options,
    loss_and_optimizer,
    sample_batch,
    synthetic_batch,
    wants_implementations,
    with_rounding,
)
from tfremat.numerics import GLOBAL_TOLERANCE, TENSOR_TOLERANCE, Closeness, closeness
from tfremat.planner import plan_graph
from tfremat.runtime.memory import (
    default_device,
    measure_step_peak,
    requested_peak_live,
    reset_allocator_peak,
    resident_bytes,
    synchronize,
)
from tfremat.runtime.timing import TurnTiming, time_in_turns

__all__ = ["TurnTiming", "explain_requested_peak", "gradient_tolerances", "measure_model", "requested_ledger",
           "time_in_turns"]

logger = logging.getLogger(__name__)


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


def _gradient_pairs(model, extraction, schedule, x, y, saved):
    """The planned step's gradients beside a plain traced tape's on ``(x, y)``: ``(variable,
    planned, plain)`` numpy arrays per variable that gets a gradient; the model's variables are put back to
    ``saved`` before and after each, so both draw the same dropout masks from the same
    batch-norm state."""
    from tfremat.plan.execution import build_plan
    from tfremat.static_graph.interpreter import interpret_plan

    graph, table = extraction.graph, extraction.side_table
    plan = build_plan(graph, schedule)

    @tf.function
    def planned_gradients(inputs, labels):
        _, _, grads, _ = interpret_plan(graph, table, plan, inputs, labels)
        return {key: grad for key, (_, grad) in grads.items()}

    _restore(model, saved)  # both steps start from the same state, whatever ran before
    planned = planned_gradients(x, y)
    reference = _plain_gradients(model, table, x, y, saved, traced=True)
    # An Embedding's gradients are IndexedSlices, which have no .numpy().
    return [(variable, tf.convert_to_tensor(planned[id(variable)]).numpy(), plain)
            for variable, plain in zip(model.trainable_variables, reference)
            if id(variable) in planned and plain is not None]


def _plain_gradients(model, table, x, y, saved, *, traced: bool) -> list:
    """A plain tape's gradients of ``model``'s loss on ``(x, y)`` from the ``saved`` state
    (numpy, None for a variable without one): in a ``tf.function`` (``traced``), or eagerly,
    where no graph pass fuses operations across layers."""
    def gradients(inputs, labels):
        with tf.GradientTape() as tape:
            predictions = model(inputs, training=True)
            value = table.loss_fn(table.flat_labels(labels), tf.nest.flatten(predictions))
        return tape.gradient(value, model.trainable_variables)

    _restore(model, saved)
    grads = (tf.function(gradients) if traced else gradients)(x, y)
    _restore(model, saved)
    return [None if grad is None else tf.convert_to_tensor(grad).numpy() for grad in grads]


def _compare_gradients(model, extraction, schedule, x, y, saved):
    """The planned step's gradients against a plain traced tape's on ``(x, y)``, as
    :func:`tfremat.numerics.closeness` (None when no variable gets a gradient)."""
    compared = _gradient_pairs(model, extraction, schedule, x, y, saved)
    return closeness([p for _, p, _ in compared], [e for _, _, e in compared]) if compared else None


def _judge_gradients(model, extraction, schedule, x, y, saved, tolerances):
    """The planned step's gradients against plain training's: ``(closeness to the traced
    tape, matches, closeness to the eager tape, closeness of the two plain tapes)``.

    A step outside ``tolerances`` of the traced tape is compared with the eager one too:
    two plain computations round differently (Grappler fuses operations across layers in a
    traced step, never across the interpreter's statements), and where the gradients are
    ill-conditioned (a model trained to a near-zero loss on its batch: MobileNetV2's
    reported mismatch, benchmarks/mnv2_gradient_check.py) that difference exceeds float32's
    tolerances, and a correct step is as close to one plain tape as they are to each other.
    The step matches when within ``tolerances`` of either; the last two are None when the
    traced tape decided.
    """
    compared = _gradient_pairs(model, extraction, schedule, x, y, saved)
    if not compared:
        return None, None, None, None
    planned, traced = [p for _, p, _ in compared], [e for _, _, e in compared]
    gradients = closeness(planned, traced)
    if _within(gradients, tolerances):
        return gradients, True, None, None
    eager_of = {id(variable): grad for variable, grad in zip(
        model.trainable_variables, _plain_gradients(model, extraction.side_table, x, y, saved, traced=False))}
    eager = [eager_of[id(variable)] for variable, _, _ in compared]
    to_eager = closeness(planned, eager)
    spread = closeness(eager, traced)
    return gradients, _within(to_eager, tolerances), to_eager, spread


#: Unit roundoff of the low-precision compute dtypes of Keras's mixed-precision policies.
_UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
#: Per-tensor and global tolerances of the gradient check when layers compute in float16.
#: float32's (tfremat.numerics) call float16 rounding a mismatch: on the fidelity_mixed
#: transformer_encoder the checkpoint-all step's gradients are 1.1e-3 (per tensor) and
#: 6.7e-4 (global) from a plain float16 tape's, while the plain float16 tape is itself
#: 8.3e-3 and 3.1e-3 from the same model computed in float32; a wrong dropout mask, a
#: stale input or a gradient taken twice stays of order one.
_FLOAT16_TOLERANCES = (1e-2, 5e-3)


def gradient_tolerances(model) -> tuple[float, float]:
    """The per-tensor and global tolerances within which the planned step's gradients
    match a plain tape's for ``model``: float32's (:mod:`tfremat.numerics`), or, when a
    layer computes in float16 or bfloat16 (a mixed-precision policy), tolerances scaled to
    that dtype's rounding (:data:`_FLOAT16_TOLERANCES`): two correct steps that group or
    order a float16 reduction differently differ by far more than float32's tolerances."""
    import keras

    roundoff = 0.0
    for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
        dtype = getattr(layer, "compute_dtype", None)
        if dtype is not None:
            roundoff = max(roundoff, _UNIT_ROUNDOFF.get(keras.backend.standardize_dtype(dtype), 0.0))
    if not roundoff:
        return TENSOR_TOLERANCE, GLOBAL_TOLERANCE
    scale = roundoff / _UNIT_ROUNDOFF["float16"]
    return _FLOAT16_TOLERANCES[0] * scale, _FLOAT16_TOLERANCES[1] * scale


def _within(gradients: Closeness, tolerances: tuple[float, float]) -> bool:
    return gradients.max_tensor_error <= tolerances[0] and gradients.global_error <= tolerances[1]


def _keep_mismatch(graph, schedule, gradients, spread=None) -> None:
    """Writes the graph and schedule whose gradients differ from plain training's to a new
    temporary directory and names it in a warning: such a schedule depends on the profile
    the run measured, so it is kept for a bug report rather than lost with the process.
    ``spread``: how far the eager plain tape's gradients are from the traced one's, the
    rounding any computation of these gradients may differ by."""
    import json
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(prefix="tfremat_mismatch_"))
    graph.to_json(directory / "graph.json")
    (directory / "schedule.json").write_text(json.dumps(schedule.to_dict(graph)))
    between = "" if spread is None else (f"; an eager and a traced plain tape differ by {spread.max_tensor_error:.3g} "
                                         f"(global {spread.global_error:.3g})")
    logger.warning("the planned step's gradients differ from plain training's (largest per-variable error %.3g, "
                   "global %.3g%s); its graph and schedule are in %s: please report them", gradients.max_tensor_error,
                   gradients.global_error, between, directory)


def _rounding_by_implementation(model, extraction, result, x, y, saved) -> list[dict]:
    """Per implementation name among ``result.inexact_implementations``: the nodes that
    run it and the largest per-variable normwise error of the gradients (against a plain
    tape's) of the checkpoint-all step with only those nodes under it, so that each
    implementation's rounding is told apart from the others' and from the schedule's."""
    from tfremat.strategies import get_strategy

    graph = extraction.graph
    nodes_of: dict[str, list[int]] = {}
    for node, name in (result.schedule.implementations or {}).items():
        if (graph.names[node], name) in result.inexact_implementations:
            nodes_of.setdefault(name, []).append(node)
    rows = []
    for name, nodes in sorted(nodes_of.items()):
        choice = {node: name for node in nodes}
        alone = get_strategy("checkpoint_all")(graph.with_implementations(choice)).with_implementations(choice)
        gradients = _compare_gradients(model, extraction, alone, x, y, saved)
        rows.append({"implementation": name, "nodes": [graph.names[node] for node in sorted(nodes)],
                     "grad_error": None if gradients is None else gradients.max_tensor_error})
    return rows


def _statement_of(op: str, graph) -> tuple[str, int | None, bool]:
    """The plan statement an operation of the compiled step ran for: its scope
    (``forward_<node>``, ``backward_<node>``, ``reforward_<node>``, ``loss_<node>``, or
    ``other``), its node and whether it is a recomputation. A gradient op is named
    ``gradient_tape/forward_<node>/...`` after the call it differentiates, under the backward
    statement's tape: it belongs to that node's backward node."""
    from tfremat.static_graph.interpreter import STATEMENT_SCOPE

    match = STATEMENT_SCOPE.search(op)
    if match is None:
        return "other", None, False
    node = int(match.group(3))
    if "gradient_tape/" in op[:match.start() + 1]:
        node = graph.backward_of.get(node, node)
        return f"backward_{node}", node, False
    return match.group(0).strip("/"), node, bool(match.group(1))


#: Allocations of at most this many bytes (a few scalars) are not charged to a statement by
#: :func:`requested_ledger`: their ops run whenever the executor likes.
_BOOKKEEPING_BYTES = 16


def requested_ledger(extraction, schedule, step, x, y, resident=()) -> list[dict]:
    """The simulator's memory at each compute statement beside the most bytes the compiled
    step requests while that statement's operations run: where along the step the memory
    model over- or under-counts, not only at the peak (benchmarks/requested_ledger.py;
    docs/memory-model.md).

    The requested bytes are replayed from the profiler's allocation events of one run of
    ``step(x, y)`` (after a warm-up run), in the graph's convention (plus the bytes of
    ``resident``, the batch and the labels); each allocation is charged to the statement
    whose name scope made it (:func:`explain_requested_peak`), except allocations of a few
    scalars (a dropout's seed update, a counter), which the executor runs whenever it likes:
    with oneDNN off a seed update ran late and charged 12 MiB to its dropout's forward
    (:data:`_BOOKKEEPING_BYTES`). A statement runs more than
    once when a node is recomputed: a recomputation has its own ``reforward_`` scope, and a
    node's first compute statement gets the requested bytes of its scope.

    Returns:
        one dict per compute statement in plan order: ``statement`` (its index), ``scope``,
        ``node``, ``name``, ``predicted_bytes`` (the simulator's memory while it runs) and
        ``requested_bytes`` (None where its scope allocated nothing).
    """
    import tempfile

    from tfremat.plan.execution import Op, build_plan
    from tfremat.plan.simulator import simulate
    from tfremat.runtime.memory import allocation_events
    from tfremat.runtime.profiler import profiler_trace

    graph = extraction.graph
    plan = build_plan(graph, schedule)
    simulation = simulate(graph, plan)
    device = default_device()
    synchronize(step(x, y))
    with tempfile.TemporaryDirectory(prefix="tfremat_ledger_") as logdir:
        with profiler_trace(logdir):
            synchronize(step(x, y))
        events = allocation_events(logdir, device)
    events.sort(key=lambda e: (e[0], not e[1]))
    fixed = (resident_bytes(list(resident)) + resident_bytes(tf.nest.flatten(x))
             + resident_bytes(tf.nest.flatten(y)))
    live: dict = {}
    current = 0
    most: dict[str, int] = {}
    for _, allocation, addr, requested, info in events:
        if allocation:
            live[addr] = requested
            current += requested
            if requested > _BOOKKEEPING_BYTES:
                scope = _statement_of(info["op"], graph)[0]
                most[scope] = max(most.get(scope, 0), current)
        else:
            current -= live.pop(addr, requested)
    rows, seen = [], set()
    for index, statement in enumerate(plan.statements):
        if statement.op is not Op.COMPUTE:
            continue
        node = statement.node
        kind = "loss" if node == graph.loss_node else "backward" if graph.is_backward[node] else "forward"
        scope = f"{'re' if statement.recompute else ''}{kind}_{node}"
        first = scope not in seen
        seen.add(scope)
        requested = most.get(scope) if first else None
        rows.append({"statement": index, "scope": scope, "node": node, "name": graph.names[node],
                     "predicted_bytes": int(simulation.trace_bytes[index]),
                     "requested_bytes": None if requested is None else int(requested + fixed)})
    return rows


def explain_requested_peak(extraction, schedule, step, x, y, resident=(), *, top: int = 8) -> dict:
    """Where the compiled step's requested peak falls and what is live there, against the
    simulator at the same statement: which node's buffers make a step request more than its
    prediction (``benchmarks/fidelity.py --explain``; docs/memory-model.md).

    The requested peak is replayed from the profiler's allocation events
    (:func:`tfremat.runtime.memory.requested_peak_live`); each live buffer is charged to the
    plan statement whose name scope allocated it (``forward_<node>``, ``backward_<node>``,
    ``reforward_<node>``), others to ``other``. The statement that made the peak is the last
    live allocation's; the simulator's live values at that statement's compute (the first
    one, or the first recompute for ``re``) are the prediction it is compared with. A
    gradient op is named ``gradient_tape/forward_<node>/...`` after the call it differentiates;
    it is charged to that node's backward node.

    Returns:
        ``requested_bytes`` and ``predicted_bytes`` (both with the fixed bytes), ``at`` (the
        statement's scope and node name), ``predicted_peak_bytes`` (the simulator's own peak,
        elsewhere perhaps), and ``differences``: up to ``top`` ``(scope, requested,
        predicted)`` with the largest requested-minus-predicted bytes, a scope's predicted
        bytes being its node's live output (and, for the running node, its workspace).
    """
    from tfremat.plan.execution import Op, build_plan
    from tfremat.plan.simulator import simulate

    graph = extraction.graph
    plan = build_plan(graph, schedule)
    simulation = simulate(graph, plan)
    device = default_device()
    synchronize(step(x, y))
    peak, live = requested_peak_live(lambda: synchronize(step(x, y)), device)
    fixed = (resident_bytes(list(resident)) + resident_bytes(tf.nest.flatten(x))
             + resident_bytes(tf.nest.flatten(y)))

    def scope_of(op: str) -> tuple[str, int | None, bool]:
        return _statement_of(op, graph)

    requested_by_node: dict[int | None, int] = {}
    for buffer in live:
        node = scope_of(buffer["op"])[1]
        requested_by_node[node] = requested_by_node.get(node, 0) + buffer["bytes"]
    at_scope, at_node, at_recompute = scope_of(live[-1]["op"]) if live else ("other", None, False)

    implemented = graph.with_implementations(plan.implementations)
    resident_values: dict[int, int] = {}
    predicted_by_node: dict[int, int] = {}
    predicted = None
    for index, statement in enumerate(plan.statements):
        node = statement.node
        if statement.op in (Op.ALLOCATE, Op.PREFETCH):
            resident_values[node] = resident_values.get(node, 0) + implemented.output_bytes[node]
        elif statement.op is Op.DEALLOCATE:
            freed = (implemented.output_bytes[node] if statement.part is None
                     else implemented.part_bytes(node, statement.part))
            resident_values[node] = resident_values.get(node, 0) - freed
        elif (statement.op is Op.COMPUTE and node == at_node and statement.recompute == at_recompute
              and predicted is None):
            predicted = int(simulation.trace_bytes[index])
            predicted_by_node = {n: b for n, b in resident_values.items() if b > 0}
            predicted_by_node[node] = predicted_by_node.get(node, 0) + implemented.workspace_bytes[node]

    rows = [("other" if node is None else f"{node} {graph.names[node]}", requested_by_node.get(node, 0),
             predicted_by_node.get(node, 0)) for node in set(requested_by_node) | set(predicted_by_node)]
    rows.sort(key=lambda r: r[2] - r[1])
    return {
        "requested_bytes": int(peak + fixed),
        "predicted_bytes": predicted,
        "predicted_peak_bytes": int(simulation.peak_bytes),
        "at": at_scope if at_node is None else f"{at_scope} ({graph.names[at_node]})",
        "differences": rows[:top],
    }


def _restore(model, saved) -> None:
    for variable, value in zip(model.variables, saved):
        variable.assign(value)


def measure_model(model, budget, x=None, y=None, *, batch_size: int | None = None, strategy: str = "optimal",
                  steps: int = 5, loss=None, optimizer=None, cost_model: str = "profile",
                  granularity: str = "sublayer", seed: int = 0, verbose: int = 1, cache=True,
                  exact_gradients: bool = False, explain: bool = False,
                  **strategy_options) -> dict:
    """Plans, compiles and runs ``model``'s step under ``budget``, and a plain training step.

    The model is measured as it trains: with its compiled loss (and loss weights) and a
    fresh copy of its compiled optimizer, unless ``loss`` / ``optimizer`` are given. The
    plain step runs on the model itself (a ``tf.GradientTape`` step with the same loss and
    another fresh optimizer copy), so custom layers need no cloning.

    Args:
        model: a Keras model (its weights are restored afterwards, also when a step raises).
        budget: any budget form of :func:`tfremat.planner.plan_graph`.
        x, y: the data to measure on, as :func:`tfremat.plan_model` takes them (arrays with
            ``batch_size``, or a ``tf.data.Dataset`` of batches): its first batch is the one
            measured. Without them the data is random, its labels made for the loss
            (:func:`tfremat.model_planning.synthetic_batch`), which needs every input axis
            but the batch fixed and numeric inputs; a model with a time axis of unknown
            length or string inputs (a ``StringLookup`` inside) is measured on its own data.
        batch_size: the batch size (with arrays or without data; a dataset's batches fix it).
        strategy: the strategy name.
        steps: timed rounds, each one planned step and one plain step back to back
            (:func:`time_in_turns`), after the peaks are measured.
        loss: a loss name or object; default the compiled one.
        optimizer: a Keras optimizer or its name; default the compiled one.
        cost_model: "profile" (timed on this device) or "flops".
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        verbose: 0 silences the solver's progress line.
        cache: the schedule cache, as for :func:`tfremat.planner.plan_graph`; False (or
            None) also turns off the profile cache.
        exact_gradients: as for :func:`tfremat.plan_model` (``monet`` then chooses only
            implementations whose gradients are bit-exact with the layer's default).
        explain: also return ``requested_explained``, :func:`explain_requested_peak`'s
            account of the requested peak (one more profiled run of the step).

    Returns:
        the loss and optimizer (class) measured with,
        predicted_peak_bytes, measured_peak_bytes (the allocator's peak),
        requested_peak_bytes (the bytes the step's operations request, what the prediction
        counts), step_seconds, plain_peak_bytes, plain_step_seconds (medians of the timed
        rounds), the gradients against
        plain training's (:mod:`tfremat.numerics`): grad_error (the largest per-variable
        normwise error), grad_global_error and gradients_match (both within grad_tolerances,
        :func:`gradient_tolerances`: float32's, or wider for a float16 or bfloat16 policy,
        of the traced plain tape or, failing that, of an eager one: grad_eager_error, and
        grad_reference_spread, the two plain tapes' own difference, are None unless the
        traced tape's comparison failed; see :func:`_judge_gradients`),
        and the ratios measured/predicted, requested/predicted, peak/plain and time/plain
        (time_over_plain: the median of the per-round ratios; time_over_plain_quartiles:
        their first and third quartile, the spread the machine's load left; timed_rounds),
        predicted_overhead, predicted_step_overhead and step_share (the overhead against the
        whole plain step, optimizer update included: :attr:`tfremat.planner.PlanResult.step_share`),
        plain_overlap and predicted_time_over_plain (what time_over_plain
        is predicted to be: :attr:`tfremat.planner.PlanResult.predicted_time_over_plain`,
        for step_executor, "single-threaded" or "default", the executor the step ran on),
        recomputed_layer_calls and costly_vjp_rebuilds (the compiled step's
        :class:`~tfremat.static_graph.interpreter.TraceReport` counts: layer calls its
        recomputations make, and gradients rebuilt by repeating a layer's forward work the
        plan does not count),
        and inexact_implementations: per implementation the schedule chose that is not
        bit-exact with its layer's default, its name, its nodes and grad_error, the
        gradients' largest per-variable normwise error with only those nodes under it
        (checkpoint-all step): which implementations change rounding, and by how much.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, ``steps`` or ``batch_size`` not an
            int >= 1 (``batch_size`` may be left out with a dataset), data that
            :func:`tfremat.plan_model` refuses, an unknown optimizer name, or no loss or
            optimizer (an uncompiled model without ``loss=`` / ``optimizer=``), before anything runs.
    """
    from tfremat.extract.extractor import extract
    from tfremat.static_graph.compile import compile_step

    check_keras_model(model)
    checked = [("steps", steps)] + ([] if isinstance(x, tf.data.Dataset) else [("batch_size", batch_size)])
    for name, value in checked:
        if not is_int(value) or value < 1:
            raise ArgumentError(f"{name}={value!r} must be an int >= 1")
    check_exact_gradients(exact_gradients)
    training = loss_and_optimizer(model, loss, optimizer)
    if training["optimizer"] is None:
        raise ArgumentError("no optimizer: compile the model or pass optimizer= (a Keras optimizer or its name)")
    if x is None and y is None:
        batch = synthetic_batch(model, batch_size, loss=training["loss"], seed=seed)
    else:
        batch = sample_batch(model, x, y, batch_size)
    x, y = tf.nest.map_structure(tf.convert_to_tensor, batch)
    batch_size = int(tf.nest.flatten(x)[0].shape[0])
    saved = [v.numpy() for v in model.variables]
    try:
        extraction = extract(model, sample_batch=(x, y), cost_model=cost_model, granularity=granularity,
                             use_cache=cache is not False and cache is not None,
                             implementations=wants_implementations([strategy]),
                             **{**training, "optimizer": _fresh(training["optimizer"])})
        strategy_options = exact_only_options(extraction, strategy, exact_gradients, strategy_options)
        result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **strategy_options)
        result = with_rounding(dataclasses.replace(result, extraction=extraction))
        tolerances = gradient_tolerances(model)
        gradients, matches, to_eager, spread = _judge_gradients(model, extraction, result.schedule, x, y, saved,
                                                                tolerances)
        if matches is False and not result.inexact_implementations:
            _keep_mismatch(extraction.graph, result.schedule, gradients, spread)
        rounding = _rounding_by_implementation(model, extraction, result, x, y, saved)

        step_optimizer = _fresh(training["optimizer"])
        step_optimizer.build(model.trainable_variables)
        step = compile_step(extraction, result.schedule, optimizer=step_optimizer)
        resident = list(model.variables) + list(step_optimizer.variables)
        # reset_allocator_peak says how to enable the allocator's statistics when they are off.
        reset_allocator_peak(default_device())
        measured = measure_step_peak(step, x, y, resident=resident)
        # Run once, the step knows its executor: on the default one it overlaps as plain
        # training does, and the predicted time over plain leaves the plain overlap out.
        result = dataclasses.replace(result, step_sequential=step.sequential)
        # What the prediction counts; the allocator's peak adds BFC chunk rounding that
        # depends on what the process allocated before (the demo: 47.70 MiB requested,
        # exactly the prediction, 52.70 MiB allocator).
        requested = measure_step_peak(step, x, y, resident=resident, warmup=0, count="requested")
        explained = explain_requested_peak(extraction, result.schedule, step, x, y, resident) if explain else None
        _restore(model, saved)

        plain_optimizer = _fresh(training["optimizer"])
        plain_step = plain_train_step(model, extraction.side_table.loss_fn, plain_optimizer)
        plain = measure_step_peak(plain_step, x, y, resident=list(model.variables) + list(plain_optimizer.variables))
        # The peaks are taken from the saved state, before any timing; the timed rounds
        # train the model on (its weights are restored below).
        timing = time_in_turns(lambda: step(x, y), lambda: plain_step(x, y), steps)
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
            "step_seconds": round(timing.seconds, 5),
            "plain_peak_bytes": plain,
            "plain_step_seconds": round(timing.reference_seconds, 5),
            "grad_error": None if gradients is None else gradients.max_tensor_error,
            "grad_global_error": None if gradients is None else gradients.global_error,
            "gradients_match": matches,
            "grad_eager_error": None if to_eager is None else to_eager.max_tensor_error,
            "grad_reference_spread": None if spread is None else spread.max_tensor_error,
            "grad_tolerances": list(tolerances),
            "measured_over_predicted": round(measured / result.predicted_peak_bytes, 4),
            "requested_over_predicted": round(requested / result.predicted_peak_bytes, 4),
            "peak_over_plain": round(measured / plain, 4),
            "time_over_plain": round(timing.ratio, 4),
            "time_over_plain_quartiles": [round(q, 4) for q in timing.ratio_quartiles],
            "timed_rounds": timing.rounds,
            "predicted_overhead": round(result.overhead, 4),
            # The same recomputation against the whole plain step (the optimizer's updates
            # included), which the predicted time uses: PlanResult.step_share.
            "predicted_step_overhead": round(result.step_overhead, 4),
            "step_share": round(result.step_share, 4),
            # Plain training overlaps operations the step runs in turn (tfremat.extract.overlap),
            # unless the step runs on the default executor too.
            "plain_overlap": round(result.plain_overlap, 4),
            "step_executor": "single-threaded" if step.sequential else "default",
            "predicted_time_over_plain": round(result.predicted_time_over_plain, 4),
            "predicted_time_over_plain_range": [round(t, 4) for t in result.predicted_time_over_plain_range],
            # Forward work the step repeats beyond the plan's recomputations (a gradient
            # rebuilt on a recomputed input; interpreter.TraceReport), for the time's account.
            "recomputed_layer_calls": step.report.recomputed_layer_calls,
            "costly_vjp_rebuilds": step.report.costly_vjp_rebuilds,
            "inexact_implementations": rounding,
            "device": default_device(),
            **({"requested_explained": explained} if explain else {}),
        }
    finally:
        # Also when planning or a run raises: the docstring promises the weights back.
        _restore(model, saved)
