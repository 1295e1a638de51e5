"""``compile_step``: a schedule compiled into one ``tf.function`` training step."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfremat.errors import CompileError
from tfremat.graph import DFGraph
from tfremat.plan.execution import ExecutionPlan, Op, build_plan
from tfremat.plan.schedule import Schedule, validate_schedule
from tfremat.runtime import executor
from tfremat.runtime.optimizer import apply_gated
from tfremat.static_graph.interpreter import STATEMENT_SCOPE, TraceReport, interpret_plan, order_updates

__all__ = ["CompiledStep", "compile_step", "check_acyclic"]

logger = logging.getLogger(__name__)


class CompiledStep:
    """A training step that runs one schedule; build it with :func:`compile_step`.

    Call it as ``step(x, y)`` or ``step(x, y, sample_weight)`` (one weight per sample,
    applied to every output's loss as ``model.fit(sample_weight=...)`` does): one
    forward/backward pass following the plan and one optimizer update; returns the loss
    (the mean over the global batch under a distribution strategy), or ``(loss, y_pred)``
    when compiled with ``return_outputs=True`` (``y_pred`` structured like the model
    outputs; per replica under a distribution strategy), e.g. for metrics. Compiled with
    ``apply_gradients=False`` it updates nothing and returns ``(loss, gradients)``, one
    gradient (or None) per variable of :attr:`variables`.

    A call runs on TensorFlow's single-threaded executor (:mod:`tfremat.runtime.executor`)
    when :attr:`sequential` (see :func:`compile_step`): one operation at a time, in the
    plan's order, as the plan counts memory and time, whatever the inter-op thread
    setting; also when the call is traced into another ``tf.function`` (a ``train_step``,
    a custom loop), where the step stays a call of its own. :attr:`function` called
    directly runs on the executor of its caller.

    Attributes:
        graph: the extracted graph.
        side_table: the extraction's side table.
        schedule: the compiled schedule.
        plan: the execution plan the step follows, statement by statement.
        optimizer: the Keras optimizer the step updates the weights with (None when it
            returns the gradients).
        variables: the model's trainable variables, in the order gradients are listed.
        strategy: the ``tf.distribute`` strategy, or None.
        function: the underlying ``tf.function`` (for ``get_concrete_function``).
        jit_compile: whether the step is compiled with XLA.
        sequential: whether calls run on the single-threaded executor (see :func:`compile_step`).
    """

    def __init__(self, graph: DFGraph, side_table: Any, schedule: Schedule, plan: ExecutionPlan, optimizer: Any,
                 strategy: Any, return_outputs: bool, apply_gradients: bool = True, jit_compile: bool = False,
                 sequential: bool = True):
        self.graph = graph
        self.side_table = side_table
        self.schedule = schedule
        self.plan = plan
        self.optimizer = optimizer
        self.strategy = strategy
        self.return_outputs = return_outputs
        self.apply_gradients = apply_gradients
        self.jit_compile = jit_compile
        self.sequential = sequential
        self._report: TraceReport | None = None
        # Whether the traced step calls functions, which the single-threaded executor can
        # wait for for ever (executor.calls_functions); None: not traced yet.
        self._calls_functions: bool | None = None
        self.variables = list(side_table.model.trainable_variables)
        self._regularized = [v for v in self.variables if getattr(v, "regularizer", None) is not None]
        # No AutoGraph: the interpreter has no tensor-dependent Python control flow, and
        # AutoGraph would wrap its CompileErrors in StagingError. Not inlined into a caller's
        # function, whose executor would run it (tfremat.runtime.executor).
        self.function = self._make_function()

    def _make_function(self):
        return tf.function(
            self._distributed_step if self.strategy is not None else self._step, jit_compile=self.jit_compile,
            autograph=False, experimental_attributes=executor.NOT_INLINED if self.sequential else None,
        )

    def _replica_step(self, x, y, sample_weight, replicas: int):
        if not self.apply_gradients:
            # The gradients of the loss node's loss alone, as tape.gradient gives them: no
            # loss scale and no weight penalties, which the caller adds as it would to a tape's.
            loss, _, weight_grads, self._report = interpret_plan(self.graph, self.side_table, self.plan, x, y,
                                                                 sample_weight=sample_weight, xla=self.jit_compile)
            return loss, [weight_grads[id(v)][1] if id(v) in weight_grads else None for v in self.variables]
        # The loss to differentiate, as Keras's ``train_step`` forms it: multiplied by the
        # optimizer's loss scale (a ``LossScaleOptimizer`` under ``mixed_float16``, whose
        # ``apply_gradients`` divides the gradients by it again). Keras losses divide by
        # the number of replicas themselves in a replica context; dividing again here
        # halved the gradients on two replicas.
        loss, predictions, weight_grads, report = interpret_plan(
            self.graph, self.side_table, self.plan, x, y, self.optimizer.scale_loss, sample_weight, self.jit_compile,
        )
        if self._regularized:
            loss = self._add_weight_penalties(loss, weight_grads)
        if replicas > 1:
            # Reported unscaled, as Keras's loss tracker does: the replicas' mean is the
            # loss of the global batch.
            loss = loss * tf.cast(replicas, loss.dtype)
        self._report = report
        pairs = [(weight_grads[id(v)][1], v) for v in self.variables if id(v) in weight_grads]
        missing = [v.path for v in self.variables if id(v) not in weight_grads]
        if missing:
            logger.debug("no gradient reaches %d trainable variables: %s", len(missing), ", ".join(missing))
        # Each variable's update waits only for its own (gated) gradient, and the statement
        # after the variable's last use waits for the update, so weight gradients are freed
        # as the backward pass goes, as the graph's memory model says.
        update_ops = _apply_without_barrier(self.optimizer, pairs)
        if update_ops and self.side_table.weight_grads == "transient":
            order_updates(report, update_ops)
        if self.return_outputs:
            return loss, self._structure_outputs(predictions)
        return loss

    def _add_weight_penalties(self, loss, weight_grads: dict):
        """Adds the weight regularizers' penalties (``kernel_regularizer``,
        ``bias_regularizer``, ...) to the loss and their gradients to ``weight_grads``, as
        Keras's ``train_step`` does through ``compute_loss``; returns the total loss.

        A penalty reads only its variable, so it is computed with the variable's own
        gradient (under a control dependency on it) rather than at the start of the step:
        its weight-sized temporaries then live next to that gradient, where the extraction
        counts them in the backward node's workspace. The two gradients are summed as the
        tape sums them (one addition, which does not depend on the order), the penalty
        gradient seeded through ``optimizer.scale_loss`` like the loss's, and the penalties
        enter the reported loss through ``keras.ops.sum`` like Keras's total, so training
        matches ``model.fit`` bit for bit. A regularized variable no layer reads still
        gets its penalty's gradient, as in Keras.
        """
        penalties = [loss]
        for variable in self._regularized:
            _, gradient = weight_grads.get(id(variable), (variable, None))
            gate = [] if gradient is None else [tf.convert_to_tensor(gradient)]
            with tf.control_dependencies(gate):
                with tf.GradientTape() as tape:
                    penalty = variable.regularizer(variable)
                    scaled = self.optimizer.scale_loss(penalty)
                # The penalty's value is not on the update's path (d/dx sum(x^2) does not
                # read x^2); left to run after the update, its read of the variable made
                # the update copy the variable (one weight-sized buffer each).
                with tf.control_dependencies([penalty]):
                    penalty_gradient = tape.gradient(scaled, variable)
            penalties.append(keras.ops.sum(penalty))
            total = penalty_gradient if gradient is None else gate[0] + penalty_gradient
            weight_grads[id(variable)] = (variable, total)
        return keras.ops.sum(penalties)

    def _structure_outputs(self, predictions: list):
        """The flat predictions in the structure ``model(x)`` returns."""
        model = self.side_table.model
        structure = getattr(model, "_outputs_struct", None)
        if structure is None:
            return predictions[0] if len(predictions) == 1 else predictions
        return tf.nest.pack_sequence_as(structure, predictions)

    def _step(self, x, y, sample_weight=None):
        return self._replica_step(x, y, sample_weight, 1)

    def replica_step(self, x, y, sample_weight=None, *, caller_sequential: bool = False):
        """One replica's part of the step, for a loop that calls ``strategy.run`` itself
        (in a ``tf.function``, in the strategy's replica context), e.g. to update Keras
        metrics on each replica as ``model.fit``'s ``train_step`` does
        (:class:`tfremat.static_graph.train_step.DistributedTrainStep`).

        Its operations run on the executor of the loop's ``tf.function``: call that function
        inside :func:`tfremat.runtime.executor.sequential` (as ``DistributedTrainStep``
        does) and say so with ``caller_sequential=True``; otherwise, with several inter-op
        threads, a warning says that the step can exceed its predicted peak.

        Runs the plan on this replica's batch and the optimizer update, whose gradients the
        strategy all-reduces. Returns what the step returns (the loss, or ``(loss,
        y_pred)`` with ``return_outputs``), the loss being this replica's mean loss
        unscaled, as Keras's loss tracker takes it: over equal shards, the replicas' mean
        is the global batch's loss.

        Raises:
            CompileError: the step was compiled without ``strategy`` (call the step itself).
        """
        if self.strategy is None:
            raise CompileError("replica_step runs under a tf.distribute strategy: compile with "
                               "compile_step(..., strategy=...), or call the step itself on one device")
        if self.sequential and not caller_sequential:
            _warn_parallel_ops("replica_step runs on the executor of the tf.function that calls it, not on "
                               "TensorFlow's single-threaded one: call that function inside "
                               "tfremat.runtime.executor.sequential() and pass replica_step(..., "
                               "caller_sequential=True)")
        return self._replica_step(x, y, sample_weight, self.strategy.num_replicas_in_sync)

    def _distributed_step(self, x, y, sample_weight=None):
        replicas = self.strategy.num_replicas_in_sync
        per_replica = self.strategy.run(self._replica_step, args=(x, y, sample_weight, replicas))
        if self.return_outputs:
            loss, outputs = per_replica
            return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None), outputs
        return self.strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    def __call__(self, x, y, sample_weight=None):
        args = (x, y) if sample_weight is None else (x, y, sample_weight)
        if self.sequential and self._calls_functions is None:
            with executor.sequential():  # traced as it runs, a loop staying a While
                graph = self.function.get_concrete_function(*args).graph
            blocking = executor.blocking_call(graph)
            self._calls_functions = blocking is not None
            if blocking is not None:
                why = ("the default executor lowers the loop into the step, where oneDNN's kernels run it" if
                       blocking.loop_kernel else "the single-threaded executor holds an inter-op thread for each "
                       "call and waited for ever once they ran out")
                _warn_parallel_ops(f"the step of {self.graph.name} runs on TensorFlow's default executor, as plain "
                                   f"training does: {blocking.describe()}; {why}",
                                   key=("calls functions", self.graph.name, _blocking_kind(blocking)))
                # Traced again for that executor, which lowers the conditionals to control-flow
                # primitives (a LossScaleOptimizer's step requested 1 MiB more with an If).
                self.sequential = False
                self._report = None
                self.function = self._make_function()
        try:
            with executor.sequential() if self.sequential else contextlib.nullcontext():
                return self.function(*args)
        except (tf.errors.FailedPreconditionError, tf.errors.UnimplementedError) as error:
            if not self.sequential or "single-threaded executor" not in str(error).lower():
                raise
            raise CompileError(
                f"TensorFlow's single-threaded executor ({executor.SEQUENTIAL_EXECUTOR}), which runs the step one "
                f"operation at a time as its plan counts memory, refused the compiled step of {self.graph.name}: "
                f"{error.message}. "
                "compile_step(..., sequential=False) runs it on TensorFlow's default executor, where a statement's "
                "operations run together and the peak can exceed the prediction unless TF_NUM_INTEROP_THREADS=1"
            ) from error
        except tf.errors.InvalidArgumentError as error:
            if "in a cycle" not in str(error) or self.strategy is not None:
                raise
            # Traced already (the call failed at run time): no new trace, no variable creation.
            check_acyclic(self.function.get_concrete_function(*args).graph, self.graph)
            raise CompileError(
                f"TensorFlow's runtime graph passes closed a cycle in the compiled step of {self.graph.name} "
                f"(schedule {self.schedule.strategy}), which is acyclic as traced: {error.message}. Its log lines "
                "'Cycle detected' name the operations (their scopes forward_N / backward_N are graph nodes). "
                "With oneDNN on (the default on AVX-512 CPUs) TF_ENABLE_ONEDNN_OPTS=0 turns its graph rewrites off; "
                "please report the model"
            ) from error

    def trace(self):
        """Traces the step for the extraction's input signature (once), filling the report.

        Not available under a distribution strategy, whose step is traced on first call.
        """
        if self._report is None:
            if self.strategy is not None:
                raise CompileError("a distributed step is traced on its first call; call it before reading the report")
            inputs, labels = (
                tuple(specs) if len(specs) > 1 else specs[0]
                for specs in (self.side_table.input_specs, self.side_table.label_specs)
            )
            with executor.sequential() if self.sequential else contextlib.nullcontext():  # as __call__ traces
                self.function.get_concrete_function(inputs, labels)
        return self._report

    @property
    def report(self) -> TraceReport:
        """What the trace emitted (traces first when needed)."""
        return self.trace()

    @property
    def ledger_bytes(self) -> np.ndarray:
        """Live bytes at every plan statement, from the tensors the traced step holds
        (:attr:`TraceReport.ledger_bytes`); :func:`tfremat.plan.simulator.simulate`'s
        ``trace_bytes`` for the same plan is what they should be."""
        return np.asarray(self.report.ledger_bytes, dtype=np.int64)

    @property
    def recomputed_layer_calls(self) -> int:
        """Layer calls that recompute a forward node, counted while tracing."""
        return self.report.recomputed_layer_calls


def check_acyclic(func_graph, graph: DFGraph) -> None:
    """Raises :class:`CompileError` when the traced step's operations (data and control
    edges, automatic control dependencies included) form a cycle, naming the plan
    statements whose operations are on it; TensorFlow reports only a count of nodes.
    :meth:`CompiledStep.__call__` runs it when TensorFlow refuses a step for a cycle."""
    ops = func_graph.get_operations()
    index = {id(op): k for k, op in enumerate(ops)}
    successors: list[list[int]] = [[] for _ in ops]
    pending = [0] * len(ops)
    for k, op in enumerate(ops):
        for parent in {id(t.op) for t in op.inputs} | {id(c) for c in op.control_inputs}:
            if parent in index:
                successors[index[parent]].append(k)
                pending[k] += 1
    ready = [k for k, count in enumerate(pending) if count == 0]
    while ready:
        k = ready.pop()
        for child in successors[k]:
            pending[child] -= 1
            if pending[child] == 0:
                ready.append(child)
    stuck = [ops[k].name for k, count in enumerate(pending) if count > 0]
    if not stuck:
        return
    statements = sorted({match.group(0).strip("/") if (match := STATEMENT_SCOPE.search(name)) else name.split("/")[0]
                         for name in stuck})
    described = []
    for scope in statements[:8]:
        kind, _, number = scope.rpartition("_")
        node = int(number) if number.isdigit() else None
        described.append(f"{scope} ({graph.names[node]})" if node is not None and node < graph.size and kind else scope)
    raise CompileError(
        f"the compiled step of {graph.name} has a cycle through {len(stuck)} operations of the statements "
        f"{', '.join(described)}{' ...' if len(statements) > 8 else ''}; this is a bug in tfremat's ordering, please "
        "report the model and the schedule"
    )


_warned_parallel: set = set()


def _warn_parallel_ops(why: str, key: Any = None) -> None:
    """Warns once per process and cause (``key``, else the text ``why``: what runs the step
    on an executor other than the single-threaded one) when TensorFlow runs several ops at a
    time there. A text naming traced functions (``cond_true_21000``) differs in every step
    compiled for the same model (each batch shape, each replan): its caller keys it on the
    model and the kind of call, so that one ``fit`` warns once.

    On TensorFlow's default executor the operations of one statement run together: a
    transformer's checkpoint-all step requested 1.21x its predicted peak with the default
    inter-op threads, 0.99x with one or on the single-threaded executor
    (benchmarks/step_overhead.py)."""
    key = why if key is None else key
    if key in _warned_parallel or executor.sequential_ops():
        return
    _warned_parallel.add(key)
    logger.warning(
        "%s; TensorFlow runs several ops at a time there (TF_NUM_INTEROP_THREADS is not 1), while the memory "
        "prediction assumes one op at a time, so the step can exceed its predicted peak; set "
        "TF_NUM_INTEROP_THREADS=1 before importing TensorFlow, or call "
        "tf.config.threading.set_inter_op_parallelism_threads(1) before it runs anything", why,
    )


def _blocking_kind(blocking: executor.BlockingCall) -> str:
    """The kind of what keeps a step off the single-threaded executor, as
    :meth:`~tfremat.runtime.executor.BlockingCall.describe` words it, without the names of
    the traced functions (new in every trace)."""
    if blocking.devices:
        return "devices"
    if blocking.loop_kernel:
        return "loop kernel"
    if blocking.op_type.startswith("Collective"):
        return "collective"
    if any("_conv_xla" in name for name in blocking.reached):
        return "grouped convolution"
    if blocking.conditional:
        return "conditional"
    return "xla function" if blocking.xla else "function"


def _devices_exchanging(plan: ExecutionPlan, strategy: Any) -> str:
    """Why the step's operations run on several devices that exchange values, or "".

    TensorFlow partitions such a function per device, and each partition runs on an
    executor of its own: the single-threaded executor waits in its fixed order at every
    receive, so two partitions that each receive what the other sends later deadlock.
    Replicas of a strategy exchange their gradients (the all-reduce); an offloading plan on
    a GPU sends values to host memory and back.
    """
    if strategy is not None and strategy.num_replicas_in_sync > 1:
        return f"its {strategy.num_replicas_in_sync} replicas exchange values (the all-reduce)"
    if tf.config.list_logical_devices("GPU") and any(statement.op is Op.OFFLOAD for statement in plan):
        return "it offloads values from the GPU to host memory and back"
    return ""


def _apply_without_barrier(optimizer, pairs) -> dict[int, tuple[Any, list]]:
    """``optimizer.apply_gradients(pairs)`` with each update waiting for its own gradient only.

    Keras's TensorFlow optimizer all-reduces the gradients also without a distribution
    strategy (a sum over one replica), and ``ReplicaContext.all_reduce`` passes them all
    through one ``IdentityN``: every update then waits for the last weight gradient, so all
    weight gradients stay alive until the backward pass ends. Grappler removes that
    ``IdentityN`` in some graphs and not in others, so whether the transient memory model
    held depended on the graph (docs/compiled-step.md, "Evidence"). Without a strategy the
    reduction is the identity and is skipped here. Each update step is also gated on its
    gradient: the parts of an update that do not read the gradient (momentum times the
    velocity) would otherwise run at the start of the step, holding a weight-sized buffer
    until the gradient arrives. So is a decoupled weight decay (``AdamW``'s, which Keras
    applies to every variable before the updates): run early, it copied each kernel that
    the tape still held for the backward pass (0.6 MiB over the prediction on the MLP of
    ``benchmarks/optimizer_update.py``); it now runs with the variable's update, before
    it, as in Keras. Under a distribution
    strategy the all-reduce does need every gradient; the optimizer runs unchanged.

    Returns:
        ``{id(variable): (variable, the operations its update step created)}``, for
        :func:`~tfremat.static_graph.interpreter.order_updates`; empty when the optimizer
        ran unchanged.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if tf.distribute.has_strategy() or not hasattr(inner, "_all_reduce_sum_gradients"):
        optimizer.apply_gradients(pairs)
        return {}
    return apply_gated(optimizer, pairs)


def compile_step(
    extraction: Any,
    schedule: Schedule,
    *,
    optimizer: Any = None,
    strategy: Any = None,
    jit_compile: bool = False,
    return_outputs: bool = False,
    apply_gradients: bool = True,
    sequential: bool = True,
) -> CompiledStep:
    """Compiles a schedule into one ``tf.function`` training step.

    The step runs the plan of ``schedule`` (:func:`tfremat.plan.execution.build_plan`)
    statement by statement: forward layer calls recorded on per-node tapes, recomputations
    where the schedule recomputes, per-layer backward passes and the optimizer update. Control
    dependencies keep the statements in plan order, so recomputations run late and are
    not merged with the first computation; stateful layers (batch norm, dropout) are
    recomputed without side effects (see :mod:`tfremat.runtime.state`).

    Args:
        extraction: the result of :func:`tfremat.extract.extract`: ``.graph`` (a
            :class:`~tfremat.graph.DFGraph`) and ``.side_table``.
        schedule: a schedule for ``extraction.graph`` from any strategy.
        optimizer: a Keras optimizer; default: the extraction's optimizer.
        strategy: a ``tf.distribute`` strategy (e.g. ``MirroredStrategy``) to run the
            step on each replica; the model and optimizer must have been created in its
            scope, and the extraction should count weight gradients as resident
            (``extract(..., weight_grads="fixed")``: the all-reduce holds every gradient
            until the updates; a warning says so otherwise). The step then takes
            distributed batches; a loop that calls ``strategy.run`` itself runs
            :meth:`CompiledStep.replica_step` instead. Default: none.
        jit_compile: compile the step with XLA, as Keras's ``jit_compile=True`` does
            (fused kernels). XLA keeps no control dependency and would merge recomputations
            into their first computation, so each recomputation reads its inputs through a
            data dependency on the plan's previous statement
            (:mod:`tfremat.static_graph.interpreter`): it still runs, and not earlier. XLA
            schedules and frees the rest on its own, and copies convolution inputs and
            variables that TensorFlow's kernels read in place: plan on an extraction made
            with ``extract(..., xla="memory")``, which counts those copies, or the peak can
            exceed the prediction (docs/compiled-step.md, "XLA"). Not with ``strategy`` or a schedule
            that offloads.
        return_outputs: the step returns ``(loss, y_pred)``.
        apply_gradients: False: the step applies no optimizer and returns ``(loss,
            gradients)`` for a custom training loop (:func:`tfremat.value_and_grad`); the
            gradients then live until the step ends, which an extraction with
            ``weight_grads="fixed"`` counts. Not with ``strategy`` or ``return_outputs``.
        sequential: when TensorFlow has several inter-op threads, run the step on its
            single-threaded executor (:mod:`tfremat.runtime.executor`), one operation at a
            time as the plan counts memory and time; the default executor would run a
            statement's operations together. With one inter-op thread the default executor
            runs one at a time already and is kept (module docstring of the executor
            module). Not where the step's devices exchange values (several replicas of
            ``strategy``, or an offloading plan on a GPU), or where it calls functions (a
            ``tf.cond``, a loss scale's update: found in its trace), which that executor
            can deadlock: those steps, and ``sequential=False``, run on the default
            executor (with several inter-op threads a warning says so).

    Returns:
        A :class:`CompiledStep`.

    Raises:
        CompileError: ``jit_compile=True`` with ``strategy`` or an offloading schedule,
            ``apply_gradients=False`` with ``strategy`` or ``return_outputs``, or the
            extraction or schedule is unusable.
        ScheduleError: the schedule is invalid for the graph.

    Example:
        >>> step = compile_step(extract(model, sample_batch=(x, y)), schedule)
        >>> loss = step(x, y)
    """
    if jit_compile and strategy is not None:
        raise CompileError("jit_compile=True with a distribution strategy is not supported (Keras also compiles "
                           "without XLA under one): leave jit_compile= or strategy= out")
    graph = getattr(extraction, "graph", None)
    side_table = getattr(extraction, "side_table", None)
    if not isinstance(graph, DFGraph) or side_table is None:
        raise CompileError("extraction must have .graph (a DFGraph) and .side_table, as tfremat.extract.extract returns")
    if len(side_table) != graph.size:
        raise CompileError(f"the side table has {len(side_table)} entries but the graph has {graph.size} nodes")
    if not isinstance(schedule, Schedule):
        raise CompileError(f"schedule must be a tfremat Schedule, got {type(schedule).__name__}")
    validate_schedule(graph, schedule)
    if not apply_gradients:
        if strategy is not None or return_outputs:
            raise CompileError("apply_gradients=False returns (loss, gradients) on one device: leave strategy= and "
                               "return_outputs= out")
        if side_table.weight_grads != "fixed":
            logger.warning("the extraction counts weight gradients as transient, but the step returns them all, so "
                           "its peak will exceed the prediction; extract with weight_grads='fixed' to plan for it")
    else:
        optimizer = optimizer if optimizer is not None else side_table.optimizer
        if optimizer is None:
            raise CompileError("no optimizer: pass optimizer= or extract with one")
    if strategy is not None and strategy.num_replicas_in_sync > 1 and side_table.weight_grads == "transient":
        logger.warning(
            "the extraction counts weight gradients as transient, but %d replicas all-reduce every gradient before "
            "any update, so the step's peak will exceed the prediction; extract with weight_grads='fixed' to plan "
            "for it", strategy.num_replicas_in_sync,
        )
    if not isinstance(sequential, bool):
        raise CompileError(f"sequential must be True or False, got {sequential!r}")
    plan = build_plan(graph, schedule)
    if not sequential:
        _warn_parallel_ops("compile_step(..., sequential=False) runs the step on TensorFlow's default executor")
    elif executor.sequential_ops():
        # One inter-op thread: the default executor runs one op at a time already, and the
        # profiler and the update probe measure on it (executor.step_executor).
        sequential = False
    else:
        devices = _devices_exchanging(plan, strategy)
        if devices:
            sequential = False
            _warn_parallel_ops(
                f"the step runs on TensorFlow's default executor, not its single-threaded one, because {devices}: "
                "the single-threaded executor runs each device's part of the step in a fixed order of its own, and "
                "two such orders can wait on each other for ever (a MirroredStrategy step on two CPUs hung)")
    if jit_compile and any(statement.op is Op.OFFLOAD for statement in plan):
        raise CompileError(f"schedule {schedule.strategy} offloads values to host memory, which an XLA-compiled step "
                           "cannot do (XLA keeps every tensor on its device): use jit_compile=False with it, or a "
                           "strategy that does not offload")
    logger.info(
        "compiling %s: %d statements, %d recomputations (strategy %s)",
        graph.name, len(plan), plan.recompute_count, schedule.strategy,
    )
    return CompiledStep(graph, side_table, schedule, plan, optimizer, strategy, return_outputs, apply_gradients,
                        jit_compile, sequential)
