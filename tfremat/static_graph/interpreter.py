"""The trace-time interpreter: turns an execution plan into TensorFlow operations.

It runs while ``tf.function`` traces the training step and walks the plan statement by
statement (Checkmate's Algorithm 1 order):

* **compute of a forward node**: call the layer on the resident values of its inputs
  under a fresh ``tf.GradientTape`` and keep the tape with the outputs. The tape is what
  makes the backward node cheap: its ``gradient`` call later reads exactly the residuals
  the layer's gradient needs, from *this* (re)computation, with no extra forward pass
  (the "cost trap" of re-running the layer under a new tape in the backward node).
* **compute of the loss node**: the loss and its gradients with respect to the model
  outputs.
* **compute of a backward node**: sum the upstream gradient contributions, then
  ``tape.gradient(outputs, inputs + weights, output_gradients=dy)`` (each input also a target
  with the contributions to its gradient that earlier backward statements made, so that the
  tape sums them with the layer's own as plain training's does: ``_earlier_contributions``) on the forward node's
  latest instance: one call for the input and weight gradients whose weight-only
  operations wait for the input gradients (:mod:`tfremat.runtime.gradient_order`; two
  calls rebuilt the work they share), or one call on a non-persistent tape when the layer's forward runs a
  ``tf.while_loop`` (:func:`~tfremat.runtime.tape.takes_one_gradient_call`). If that instance was computed from
  an older copy of an input the gradient reads (the input was freed and recomputed since,
  the forward node was not), the vector-Jacobian product is rebuilt on the resident input
  so the old copy is not kept alive; when the gradient reads nothing but inputs
  (convolutions, dense layers) the rebuilt forward op has no consumer and TensorFlow
  prunes it, so it costs nothing. A gradient that also reads the forward node's value
  would repeat its forward work that way, so plans never ask for one: the schedule
  recomputes the forward node in the backward node's stage, where the simulator counts it
  (:func:`tfremat.plan.schedule.with_fresh_gradient_reads`). ``costly_vjp_rebuilds``
  counts what is left (a layer with a one-call tape differentiated twice).
* **deallocate**: drop the value from the resident table; nothing created later can read
  it, so TensorFlow frees the tensor once its last (earlier) consumer has run.
* **offload** (Beaumont et al. 2021's ``O``): ``tf.identity`` of the value's tensors under
  the host device, created right after the compute that made them, so the copy starts as
  soon as they exist. At the value's deallocate the next statement waits for the copy, so
  the device tensor's last consumer has run where the plan frees it.
* **prefetch** (``P``): ``tf.identity`` of the host copy back under the value's device,
  ordered after the previous statement; it becomes the resident value, with a new
  generation, so readers use it and a backward node whose recorded forward read the old
  device copy rebuilds its vector-Jacobian product on it (as after a recomputation). A
  gradient that reads the forward node's own outputs through its tape still reads the
  device tensors the tape recorded; only values read as inputs leave the device entirely.

Each weight gradient reaches the optimizer through a control dependency on the last
statement that used its layer, so no update can overtake a read of the variable in the
same step (automatic control dependencies alone let training drift after a few steps).
The other way round, the statement after that one waits for the update
(:func:`order_updates`): TensorFlow's executor runs a ready operation that no statement
waits for only when nothing else is ready, so the updates (and with them the end of every
weight gradient) were all deferred to the end of the backward pass, holding weight
gradients that the graph counts as transient (docs/compiled-step.md, "Evidence").

Every statement is created under a control dependency on the previous compute
statement's token, except in a chain of first forward computations each of which reads
the one before it, which share the token before the chain (:func:`_chained_computes`: a
token inside it kept Grappler from regrouping arithmetic across layers as it does in
plain training).
That order is what keeps a recomputation late (TensorFlow would otherwise run it as soon
as its inputs exist, raising the peak) and distinct from the first computation
(common-subexpression elimination does not merge operations with different control
inputs). Control edges do not extend tensor lifetimes.

A token is an ``IdentityN`` that reads the statement's outputs as data (:func:`_token`),
not the outputs themselves. Graph passes that merge a producer into its consumer check
that the producer has no other data consumer but ignore its control edges: with oneDNN on,
a ``ZeroPadding2D`` statement's ``Pad`` was merged into the next statement's ``Conv2D``,
whose kernel read waited on the ``Pad``, and the merged operation then waited on itself
(every recomputing schedule of ResNet50, DenseNet121 and EfficientNetB0 failed with
"nodes in a cycle"). A data consumer blocks such merges; the token is kept from Grappler's
dependency optimizer, which would otherwise turn it back into control edges.

Under XLA (``jit_compile=True``, :func:`interpret_plan`'s ``xla``) control dependencies order
nothing: XLA keeps only data dependencies, its common-subexpression elimination merges a
recomputation with the first computation (the same operation on the same operands, so the
first result stays alive until the backward pass), and its scheduler may run a
recomputation as soon as its inputs exist. So a statement that recomputes a node reads each
input that comes from the first forward pass, and the state a recomputed layer replays (a
dropout seed), plus a zero computed from the previous statement's tensors
(:func:`_runtime_zero`): to XLA a new value, which exists only once that statement has run.
``XlaOptimizationBarrier`` (what JAX's ``remat`` uses) does not do it on XLA's CPU backend:
the barrier is expanded before CSE runs, and ``exp(barrier(x))`` was merged with ``exp(x)``.
The first forward pass and the backward statements are left to XLA, which fuses and
schedules them (docs/compiled-step.md, "XLA").

Reading a value that the plan does not hold resident raises :class:`CompileError`: the
interpreter cannot consume a tensor after its deallocate statement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfremat.errors import CompileError
from tfremat.graph import DFGraph
from tfremat.plan.execution import ExecutionPlan, Op
from tfremat.plan.simulator import held_weight_gradients
from tfremat.runtime.gradient_order import input_then_weight_gradients
from tfremat.runtime.internals import get_keras_mask, set_keras_mask
from tfremat.runtime.layer_variants import running
from tfremat.runtime.memory import resident_bytes
from tfremat.runtime.state import (
    StateSnapshot,
    call_replaying,
    call_with_snapshot,
    reads_global_seed_generator,
    stateful_random_ops,
)

__all__ = ["STATEMENT_SCOPE", "TraceReport", "interpret_plan", "order_updates"]

logger = logging.getLogger(__name__)

#: The component of an operation's name that names the plan statement it was created for
#: (``forward_<node>``, ``reforward_<node>``, ``backward_<node>``, ``loss_<node>``; groups: ``re``,
#: the kind, the node), wherever it stands: a first forward computation's follows its layer's
#: path (``step/<layer path>/forward_<node>/``, ``_Interpreter._statement_scope``), and a
#: gradient operation is named ``gradient_tape/<forward op's name>``.
STATEMENT_SCOPE = re.compile(r"(?:^|/)(re)?(forward|backward|loss)_(\d+)(?:/|$)")


@dataclasses.dataclass
class TraceReport:
    """What one trace of the step emitted.

    Attributes:
        ledger_bytes: live bytes at every plan statement, counted from the tensors the traced
            step holds (fixed bytes + the static sizes of each resident value's tensors and
            a forward node's residuals + the running node's workspace), in the simulator's
            convention; equal to its trace when the compiled step holds what the graph says.
        layer_calls: forward layer calls traced, recomputations included.
        recomputed_layer_calls: forward layer calls made by recompute statements.
        recompute_statements: compute statements (any node kind) that re-run a node.
        vjp_rebuilds: backward nodes whose vector-Jacobian product was rebuilt on a newer
            copy of an input (see the module docstring).
        costly_vjp_rebuilds: the subset of ``vjp_rebuilds`` whose gradient also reads the
            layer's output or residuals, so the rebuild re-runs forward work the plan does
            not count.
        offloads_held_by_tape: offloaded values whose own gradient reads them through the
            layer's recorded tape: the device tensor stays until that gradient runs, so on a
            GPU the offload frees nothing (on a CPU there is nothing to free).
        update_points: per trainable variable (``id``), the index into ``statement_ops`` of
            the first compute statement after the last one that used its layer that
            created an operation (other than a placeholder), which :func:`order_updates`
            makes wait for the variable's optimizer update; absent when no such statement
            follows.
        statement_ops: the operations each compute statement created, in plan order.
        ordered_updates: variables whose update :func:`order_updates` placed before the
            next statement (the others run whenever TensorFlow gets to them).
        folded_contributions: gradient contributions of earlier consumers that a backward
            node summed with its own terms in its gradient call, as plain training's tape
            sums them, instead of leaving them to the producer's backward node
            (``_Interpreter._earlier_contributions``).
    """

    ledger_bytes: list[int] = dataclasses.field(default_factory=list)
    layer_calls: int = 0
    recomputed_layer_calls: int = 0
    recompute_statements: int = 0
    vjp_rebuilds: int = 0
    costly_vjp_rebuilds: int = 0
    offloads_held_by_tape: int = 0
    update_points: dict[int, int] = dataclasses.field(default_factory=dict, repr=False)
    statement_ops: list[list] = dataclasses.field(default_factory=list, repr=False)
    ordered_updates: int = 0
    folded_contributions: int = 0


@dataclasses.dataclass
class _Instance:
    """One (re)computation of a forward node: outputs, the tape that recorded them, inputs,
    and whether its backward takes one gradient call (:func:`~tfremat.runtime.tape.takes_one_gradient_call`)."""

    outputs: list
    tape: tf.GradientTape
    inputs: list
    input_generations: list
    one_gradient_call: bool = False
    differentiated: bool = False
    # A prefetched copy: the instance whose tape recorded the outputs it copies (gradients
    # are taken there, at the recorded outputs).
    recorded: Any = None
    # A backward node's value: the other consumers' gradient contributions (GradRef) that
    # its input gradients already include (_Interpreter._earlier_contributions).
    folded: frozenset = frozenset()


class _Interpreter:
    def __init__(self, graph: DFGraph, side_table: Any, x, y, scale_loss: Callable[[Any], Any], sample_weight=None,
                 implementations=None, xla: bool = False):
        # The graph under the plan's implementations: what each backward node reads.
        self.graph = graph
        # node -> the layer implementation its calls run (MONeT; tfremat.runtime.layer_variants)
        self.implementations = dict(implementations or {})
        self.table = side_table
        self.x = side_table.flat_inputs(x)
        self.y = side_table.flat_labels(y)
        self.scale_loss = scale_loss
        self.sample_weight = sample_weight
        self.resident: dict[int, Any] = {}
        # Parts of a resident value the plan has freed (a node with residual bytes frees its
        # output and its residuals apart; DFGraph.residual_bytes).
        self.freed_parts: dict[int, set[str]] = {}
        self.instances: dict[int, _Instance] = {}
        self.generation: dict[int, int] = {}
        self.snapshots: dict[int, StateSnapshot | None] = {}
        self.token: list = []
        self.xla = xla
        # Under XLA: the previous compute statement's tensors, and those the running
        # statement's reads are tied to (None: its reads are not tied; _ordered).
        self.previous: list = []
        self.tie: list | None = None
        # node -> (the offloaded instance, its host copies); the copies not yet waited for.
        self.host: dict[int, tuple[_Instance, list]] = {}
        self.copying: dict[int, list] = {}
        self.loss = None
        self.predictions: list = []
        # (node, input position) -> whether the gradient that node gives the input is
        # taken at the input's logits (see ``_loss`` and ``_input_gradients``); the
        # backward node of the node that made the input must take the same target.
        self.reads_logits: dict[tuple[int, int], bool] = {}
        # Per variable: the variable and its gradient contributions, one per backward node
        # of a layer that owns it (several for a layer called more than once).
        self.weight_grads: dict[int, tuple[Any, list]] = {}
        self.last_reader: dict[int, list] = {}
        # Keras masks (_with_keras_masks): per (source, index, output_index) of a value, the
        # mask its tensor carries in plain training so far; per node, the masks its first
        # call was given.
        self.keras_masks: dict[tuple, Any] = {}
        self.call_masks: dict[int, list] = {}
        # node -> the outputs of its first computation (_first_tensor).
        self.first_outputs: dict[int, list] = {}
        # node -> the plan position of its latest compute statement (_earlier_contributions).
        self.computed_at: dict[int, int] = {}
        # The name scopes the statements run under: the enclosing one ("" or "replica_1/"
        # under a distribution strategy) and "step/" in it (_statement_scope).
        self.outer_scope = ""
        self.root_scope = ""
        # node -> backward statements scoped so far (a schedule may compute a backward node twice).
        self.backward_scopes: dict[int, int] = {}
        self.report = TraceReport()

    # ----- reading resident values -----

    def _value(self, node: int, reader: int):
        part = self.graph.part_read_by(node, reader)
        if node not in self.resident or part in self.freed_parts.get(node, ()):
            what = "" if part is None else f"the {part} of "
            raise CompileError(
                f"node {reader} ({self.graph.names[reader]}) reads {what}node {node} ({self.graph.names[node]}), "
                f"which the plan does not hold resident at that point: the schedule is invalid for this graph"
            )
        return self.resident[node]

    def _tensor(self, ref, reader: int):
        if ref.source == "model_input":
            return self.x[ref.index]
        return self._value(ref.index, reader).outputs[ref.output_index]

    def _input_generation(self, ref) -> int:
        return -1 if ref.source == "model_input" else self.generation[ref.index]

    # ----- statements -----

    def run(self, plan: ExecutionPlan):
        allocated: set[int] = set()
        held_bytes: dict[int, dict] = {}  # compute statement position -> bytes its value holds, per part
        tf_graph = tf.compat.v1.get_default_graph()
        last_statement: dict[int, int] = {}
        # A backward node's weight gradients are taken at its last compute only (_backward).
        last_compute = {statement.node: k for k, statement in enumerate(plan) if statement.op is Op.COMPUTE}
        # Each statement runs under its name scope (_statement_scope), in or beside "step/".
        chained = _chained_computes(self.graph, plan, self._last_weight_uses(plan))
        in_chain, chain_produced = False, []
        outer = tf.get_current_name_scope()
        self.outer_scope = f"{outer}/" if outer else ""
        with tf.name_scope("step") as self.root_scope, contextlib.ExitStack() as chain_block:
            for position, statement in enumerate(plan):
                node = statement.node
                if statement.op is Op.ALLOCATE:
                    allocated.add(node)
                elif statement.op is Op.COMPUTE:
                    if node not in allocated:
                        raise CompileError(f"plan computes node {node} without allocating it first")
                    allocated.discard(node)
                    self.report.recompute_statements += statement.recompute
                    first_op = len(tf_graph.get_operations())
                    self.tie = self.previous if self.xla and statement.recompute else None
                    if not in_chain:
                        chain_block.enter_context(tf.control_dependencies(self.token))
                        in_chain = True
                    produced = self._compute(node, statement.recompute, last_compute[node] == position)
                    self.computed_at[node] = position
                    self.report.statement_ops.append(tf_graph.get_operations()[first_op:])
                    produced = [t for t in produced if t is not None]
                    self.freed_parts.pop(node, None)
                    held_bytes[position] = self._held_bytes(node)
                    if not chained[position]:
                        chain_block.close()
                        in_chain = False
                        if produced or chain_produced:
                            self.token = [_token(produced or chain_produced, after=self.token)]
                        chain_produced = []
                    elif produced:
                        chain_produced = produced
                    if produced:
                        self.previous = produced
                    # A chained statement is never a layer's last use (_chained_computes).
                    if produced and not chained[position]:
                        layer = self.table[self.table[node].forward_node].layer if self.table[node].kind != "loss" else None
                        for variable in getattr(layer, "trainable_variables", ()):
                            self.last_reader[id(variable)] = self.token
                            last_statement[id(variable)] = len(self.report.statement_ops) - 1
                elif statement.op is Op.OFFLOAD:
                    self._offload(node)
                elif statement.op is Op.PREFETCH:
                    with tf.control_dependencies(self.token):
                        self._prefetch(node)
                    held_bytes[position] = self._held_bytes(node)
                else:
                    if node not in self.resident:
                        raise CompileError(f"plan frees node {node} ({self.graph.names[node]}), which is not resident")
                    if node in self.copying:
                        self.token = self.token + self.copying.pop(node)
                    parts = self.freed_parts.setdefault(node, set())
                    parts.add(statement.part)
                    if statement.part is None or len(parts) == len(self.graph.value_parts(node)):
                        del self.resident[node]
                        del self.freed_parts[node]
        # Automatic control dependencies did not reliably keep an optimizer update behind
        # every read of its variable in this step (training drifted after a few steps);
        # gate each gradient on the last statement that used the variable's layer instead.
        # For a layer that is not recomputed after its backward node, that is the backward
        # node itself, so weight gradients still die right after it; otherwise they live
        # until the recomputation, as the simulator counts (DFGraph.weight_grad_bytes).
        # The gate is the statement's token, not its outputs: the token reads the weight
        # gradient too, and TensorFlow's single-threaded executor, which runs a fixed order,
        # ran it after the update, whose ``lr * gradient`` then could not reuse the
        # gradient's buffer (a 512x512 MLP requested 1 MiB over its prediction;
        # tests/test_executor.py).
        gated = {}
        for key, (variable, parts) in self.weight_grads.items():
            grad = parts[0] if len(parts) == 1 else _add_gradients(parts)
            with tf.control_dependencies(self.last_reader.get(key, [])):
                gated[key] = (variable, tf.identity(grad))
        # A statement that created no operation cannot wait for anything: the backward
        # node of an ``Add`` (or any layer whose gradient passes the upstream gradient
        # through unchanged) reuses existing tensors. Pointing an update at it left the
        # update unordered, so its weight gradient, and the filter-gradient convolution
        # with the upstream gradient it reads, ran at the end of the backward pass
        # (EfficientNetB0: the expand convolutions of blocks 3a-7a, whose input is a
        # residual ``Add``). The next statement that created an operation is the point.
        next_gateable: list[int | None] = [None] * (len(self.report.statement_ops) + 1)
        for index in range(len(self.report.statement_ops) - 1, -1, -1):
            gateable = any(op.type != "Placeholder" for op in self.report.statement_ops[index])
            next_gateable[index] = index if gateable else next_gateable[index + 1]
        self.report.update_points = {
            key: next_gateable[index + 1] for key, index in last_statement.items()
            if next_gateable[index + 1] is not None
        }
        self.report.ledger_bytes = self._ledger(plan, held_bytes)
        self._log_summary()
        return self.loss, self.predictions, gated

    def _last_weight_uses(self, plan: ExecutionPlan) -> set[int]:
        """Positions of the compute statements that are the last use of a layer with
        trainable variables: its weight gradients are gated on their tokens (``run``)."""
        last_use: dict[int, int] = {}
        for position, statement in enumerate(plan):
            entry = self.table[statement.node] if statement.op is Op.COMPUTE else None
            if entry is None or entry.kind == "loss":
                continue
            layer = self.table[entry.forward_node].layer
            if getattr(layer, "trainable_variables", ()):
                last_use[id(layer)] = position
        return set(last_use.values())

    def _log_summary(self) -> None:
        """One line for what the per-node debug lines say (the node numbers are in the debug log)."""
        report = self.report
        if report.costly_vjp_rebuilds:
            logger.info("%d backward nodes rebuild their gradient on an input recomputed since their forward value "
                        "was kept, repeating forward work the plan does not count", report.costly_vjp_rebuilds)
        if report.offloads_held_by_tape:
            logger.warning("%d offloaded values are read by their own gradient through the layer's tape, so their "
                           "device copies stay until that gradient runs and the offload frees no device memory "
                           "for them", report.offloads_held_by_tape)

    def _offload(self, node: int) -> None:
        """Starts copying the resident value of ``node`` to host memory (module docstring)."""
        if node not in self.resident:
            raise CompileError(f"plan offloads node {node} ({self.graph.names[node]}), which is not resident")
        instance = self.resident[node]
        with tf.device("/CPU:0"):
            copies = [None if t is None else tf.identity(t, name=f"offload_{node}") for t in instance.outputs]
        self.host[node] = (instance, copies)
        self.copying[node] = [c.op for c in copies if c is not None]
        backward = self.graph.backward_of.get(node)
        if backward is not None and node in self.graph.predecessors[backward]:
            self.report.offloads_held_by_tape += 1
            logger.debug("node %d (%s) is offloaded, but its gradient reads its recorded output: the device tensor "
                         "stays until that gradient runs", node, self.graph.names[node])

    def _prefetch(self, node: int) -> None:
        """Copies ``node``'s host copy back and makes it the resident value (module docstring)."""
        if node not in self.host:
            raise CompileError(f"plan prefetches node {node} ({self.graph.names[node]}), which has no host copy")
        if node in self.resident:
            raise CompileError(f"plan prefetches node {node} ({self.graph.names[node]}) while it is still resident")
        instance, copies = self.host[node]
        back = []
        for original, copy in zip(instance.outputs, copies):
            if copy is None:
                back.append(None)
                continue
            with tf.device(original.device or None):
                back.append(tf.identity(copy, name=f"prefetch_{node}"))
        self.resident[node] = dataclasses.replace(instance, outputs=back, recorded=instance.recorded or instance)
        self.generation[node] = self.generation.get(node, -1) + 1

    def _held_bytes(self, node: int) -> dict:
        """Bytes of the value ``node``'s compute just made resident, per part
        (:meth:`~tfremat.graph.DFGraph.value_parts`): its distinct tensors (an ``Add``'s
        gradient hands one tensor to both inputs), the loss itself for the loss node, and a
        forward node's residuals, which its tape keeps for the gradient (measured by the
        extraction; the tape's internals are not visible here)."""
        entry = self.table[node]
        tensors = [t for t in self.resident[node].outputs if t is not None]
        if entry.kind == "loss":
            tensors.append(self.loss)
        distinct = list({id(t): t for t in tensors}.values())
        output = resident_bytes(distinct)
        residual = entry.residual_bytes if entry.kind == "forward" else 0
        if self.graph.residual_bytes[node]:
            return {"output": output, "residual": residual}
        return {None: output + residual}

    def _ledger(self, plan: ExecutionPlan, held_bytes: dict[int, dict]) -> list[int]:
        """Live bytes at every statement from the tensors the step holds: the graph's fixed
        bytes, plus for each allocated value the static size of the tensors its compute
        statement produced (and a forward node's residuals), plus the running node's
        workspace. A value is counted from its allocate statement, with the tensors of the
        compute that follows it, to its deallocate statement. Weight gradients held beyond
        their backward node's workspace (until the layer's last compute, or the step's end)
        are the simulator's count (:func:`tfremat.plan.simulator.held_weight_gradients`):
        the step hands them to the updates, not to a statement."""
        upcoming: dict[int, dict] = {}
        allocate_bytes: dict[int, dict] = {}
        for position in range(len(plan) - 1, -1, -1):
            statement = plan.statements[position]
            if statement.op is Op.COMPUTE:
                upcoming[statement.node] = held_bytes[position]
            elif statement.op is Op.ALLOCATE:
                allocate_bytes[position] = upcoming[statement.node]
            elif statement.op is Op.PREFETCH:
                allocate_bytes[position] = held_bytes[position]
        # node -> {part: [bytes, holders]}: a view computed from its resident source holds
        # the source's buffer (TensorFlow's reshape forwards it), which is freed with its
        # last holder; a prefetched copy has a buffer of its own.
        live, holding, ledger = self.graph.fixed_bytes, {}, []
        for position, statement in enumerate(plan):
            node = statement.node
            if statement.op in (Op.ALLOCATE, Op.PREFETCH):
                source = self.graph.view_of.get(node) if statement.op is Op.ALLOCATE else None
                shared = holding.get(source, {}).get(self.graph.shared_part(source)) if source is not None else None
                if shared is not None:
                    shared[1] += 1
                    holding[node] = {None: shared}
                else:
                    holding[node] = {part: [size, 1] for part, size in allocate_bytes[position].items()}
                    live += sum(allocate_bytes[position].values())
                ledger.append(live)
            elif statement.op is Op.OFFLOAD:
                ledger.append(live)
            elif statement.op is Op.COMPUTE:
                ledger.append(live + self.graph.workspace_bytes[statement.node])
            else:
                parts = holding[node]
                for buffer in (list(parts.values()) if statement.part is None else [parts.pop(statement.part, None)]):
                    if buffer is not None:
                        buffer[1] -= 1
                        live -= buffer[0] if not buffer[1] else 0
                if statement.part is None or not parts:
                    del holding[node]
                ledger.append(live)
        return [int(b) for b in np.asarray(ledger, dtype=np.int64) + held_weight_gradients(self.graph, plan)]

    def _statement_scope(self, node: int, entry, recompute: bool) -> str:
        """The name scope of ``node``'s compute statement, named ``forward_<node>``,
        ``reforward_<node>``, ``backward_<node>`` or ``loss_<node>``: a first forward
        computation's under ``step/`` and its layer's path (``step/<layer path>/forward_<node>/``),
        a backward statement's beside ``step/`` (``backward_<node>/``), the others' in ``step/``.

        Grappler's arithmetic optimizer and constant folding break ties between the operands
        of a commutative operation in name order (the canonical order of its inputs, then
        which operand a constant or a scalar is paired with), and a gradient operation is
        named ``gradient_tape/<forward op's name>``. Plain training names its forward
        operations ``<model>/<layer>/...`` and the sums its tape forms of a tensor's gradient
        contributions ``AddN_<k>``, at the root, before every other name. Under statement
        scopes numbered by node, node numbers ordered the layers' operations instead, and the
        sums sorted after the gradients, so the step rounded otherwise than plain training
        where such a tie decided a float32 sum or product (a hard-swish then a dropout; a
        tensor read by a layer norm and a residual ``Add``, whose gradient's ``AddN`` is sorted
        by the readers' names; every gradient of a CCT: tests/test_mobilenetv3_exact.py,
        tests/test_exactness_models.py, benchmarks/results/exactness_models.md "Session 31 (N)").
        The layer's path before the statement orders the first forward pass as plain
        training's names do, and ``backward_`` sorts before ``gradient_tape/`` and ``step/`` as
        ``AddN`` does; the statement component keeps each scope its statement's
        (:data:`STATEMENT_SCOPE`, which ``tfremat.measure`` reads). These scopes are absolute,
        so TensorFlow does not uniquify a layer's path into another layer's place in the order.

        ``step/`` itself sorts after ``gradient_tape/``, unlike plain training's model scope:
        where a product of a forward value and a gradient ties, the gradient is taken first.
        In plain training's order Grappler pairs an attention softmax gradient's scale with
        the softmax, a product of forward values that then runs in the forward pass and is
        held to the backward (one float32 batch x heads x queries x keys buffer per attention
        call, which no profile counts: benchmarks/results/fidelity_mixed.md). So an
        attention layer's gradients are not bitwise plain training's. Recomputations keep
        ``step/reforward_<node>``, distinct from the first computation's name.
        """
        statement = f"{'re' if recompute else ''}{entry.kind}_{node}"
        if entry.kind == "backward":
            repeat = self.backward_scopes.get(node, 0)
            self.backward_scopes[node] = repeat + 1
            return f"{self.outer_scope}{statement}{f'_{repeat}' if repeat else ''}/"
        if entry.kind != "forward" or recompute:
            return statement
        return f"{self.root_scope}{_scope_name(entry.name)}/{statement}/"

    def _compute(self, node: int, recompute: bool, last: bool) -> list:
        entry = self.table[node]
        with tf.name_scope(self._statement_scope(node, entry, recompute)):
            if entry.kind == "forward":
                return self._forward(node, entry, recompute)
            if entry.kind == "loss":
                return self._loss(node, entry)
            return self._backward(node, entry, last)

    def _call_layer(self, node: int, entry, inputs: list, purpose: str):
        """Calls the layer on ``inputs`` (flattened like ``entry.inputs``) under a new tape.

        ``purpose`` is ``"forward"``, ``"recompute"`` or ``"vjp"`` (a rebuilt gradient), for
        the trace report.

        The tape is non-persistent when the call takes one gradient call
        (:func:`~tfremat.runtime.tape.takes_one_gradient_call`, recorded on the node by the extraction, since the
        tape must exist before the real call is recorded).

        Returns:
            ``(outputs, tape, one_gradient_call)``.
        """
        lookup = dict(zip(entry.inputs, inputs))
        args, kwargs = entry.fill_in(lookup.__getitem__)
        if entry.takes_training:
            kwargs["training"] = True
        one_call = entry.one_gradient_call
        tape = tf.GradientTape(persistent=not one_call)
        with tape:
            for tensor, needs in zip(inputs, entry.input_needs_grad or [False] * len(inputs)):
                if needs:
                    # The logits a softmax/sigmoid input carries too: a cross-entropy reads
                    # them instead of the input (``_input_gradients``).
                    tape.watch([tensor, _logits(tensor)])

            def call():
                return self._with_keras_masks(node, entry, inputs, lambda: entry.layer(*args, **kwargs))

            graph = tf.compat.v1.get_default_graph()
            first_op = len(graph.get_operations())
            with running(entry.layer, self.implementations.get(node)):
                if node in self.snapshots:
                    outputs = call_replaying(self._ordered_snapshot(self.snapshots[node]), call)
                else:
                    outputs, self.snapshots[node] = call_with_snapshot(entry.layer, call)
            if purpose != "forward":
                traced = graph.get_operations()[first_op:]
                if reads_global_seed_generator(graph, traced):
                    raise CompileError(
                        f"layer {entry.name!r} draws random numbers from Keras's global seed generator (an unseeded "
                        "keras.random call), so recomputing it would change its output. Pass seed= a "
                        "keras.random.SeedGenerator kept on the layer (as Keras' own random layers do), or use a "
                        "budget/strategy that does not recompute it"
                    )
                random_ops = stateful_random_ops(traced)
                if random_ops:
                    raise CompileError(
                        f"layer {entry.name!r} draws random numbers with {', '.join(random_ops)}, whose generator "
                        "state no variable holds, so recomputing it would change its output. Seed it with a "
                        "keras.random.SeedGenerator (as Keras' own random layers do), or use a budget/strategy "
                        "that does not recompute it"
                    )
        if purpose == "vjp":
            self.report.vjp_rebuilds += 1
        else:
            self.report.layer_calls += 1
            self.report.recomputed_layer_calls += purpose == "recompute"
        outputs = tf.nest.flatten(outputs)
        if len(outputs) != max(entry.num_outputs, 1):
            raise CompileError(
                f"layer {entry.name!r} returned {len(outputs)} tensors, the extraction recorded {entry.num_outputs}"
            )
        return outputs, tape, one_call

    def _with_keras_masks(self, node: int, entry, inputs: list, call: Callable[[], Any]):
        """``call()`` with each of ``inputs`` carrying the Keras mask that plain training's
        call of the node sees.

        Keras hands masks from layer to layer as an attribute of the tensors
        (``_keras_mask``, set on a layer's outputs by its ``__call__``: ``Embedding(mask_zero=True)``,
        ``Masking``, a ``compute_mask``), and layers change it on their inputs:
        ``MultiHeadAttention`` reads its query's mask, then clears the masks of its inputs.
        A recomputation or a rebuilt gradient reads a resident tensor an earlier consumer
        cleared, and a copy made to order a statement (:meth:`_ordered`) or a prefetched
        copy carries none: each would compute unmasked (issue 33). So the masks follow the
        first calls, which run in the order of plain training's calls (the order of the
        functional graph), and every later call of a node gets the masks of its first call;
        a mask tensor read again that way stays alive until then (one bool per token).

        An opened layer (:mod:`tfremat.extract.opening`, "Keras masks") reads its masks as
        inputs; what its whole call did to the attributes is done here at the first calls:
        the masks it clears on its inputs are cleared before its first call
        (``entry.clears_masks``), and its outputs get the masks Keras sets on them where the
        call that makes them left none (``entry.output_masks``, the mask's first
        computation, as ``Layer.__call__`` sets them once).
        """
        first_call = node not in self.call_masks
        keys = [_mask_key(ref) for ref in entry.inputs]
        if first_call:
            self.keras_masks.update((_mask_key(ref), None) for ref in entry.clears_masks)
            self.call_masks[node] = [self.keras_masks.get(key) for key in keys]
        for tensor, mask in zip(inputs, self.call_masks[node]):
            set_keras_mask(tensor, mask)
        outputs = call()
        if first_call:
            self.keras_masks.update((key, get_keras_mask(tensor)) for key, tensor in zip(keys, inputs))
            self.keras_masks.update((("node", node, k), get_keras_mask(tensor))
                                    for k, tensor in enumerate(tf.nest.flatten(outputs)))
            for k, ref in enumerate(entry.output_masks):
                if ref is not None and self.keras_masks[("node", node, k)] is None:
                    self.keras_masks[("node", node, k)] = self._first_tensor(ref, node)
        return outputs

    def _first_tensor(self, ref, reader: int):
        """The tensor of ``ref`` as its first computation made it (a Keras mask that an
        attribute hands on, which the plan may have freed as a value since)."""
        if ref.source == "model_input":
            return self.x[ref.index]
        if ref.index not in self.first_outputs:
            raise CompileError(
                f"node {reader} ({self.graph.names[reader]}) carries the Keras mask of node {ref.index} "
                f"({self.graph.names[ref.index]}), which the plan has not computed before it"
            )
        return self.first_outputs[ref.index][ref.output_index]

    def _ordered(self, tensors: list, node: int | None = None) -> list:
        """``tensors`` made new values to XLA that exist only after the previous statement
        when the running statement is tied (a recomputation under XLA; module docstring),
        else unchanged: each plus a zero that XLA cannot fold, read from the previous
        statement's tensors (:func:`_runtime_zero`). With ``node``, only the inputs that
        come from the first forward pass (model inputs and values never recomputed) are
        changed: a recomputed value is a new value already, and has its own order."""
        if self.tie is None:
            return list(tensors)
        zero = _runtime_zero(self.tie)
        if zero is None:
            return list(tensors)
        refs = self.table[node].inputs if node is not None else [None] * len(tensors)
        done: dict[int, Any] = {}
        result = []
        for ref, tensor in zip(refs, tensors):
            first_pass = ref is None or ref.source == "model_input" or self.generation.get(ref.index, 0) == 0
            if not first_pass or not isinstance(tensor, tf.Tensor) or not (tensor.dtype.is_floating or
                                                                             tensor.dtype.is_integer):
                result.append(tensor)
                continue
            if id(tensor) not in done:
                done[id(tensor)] = tensor + tf.cast(zero, tensor.dtype)
            result.append(done[id(tensor)])
        return result

    def _ordered_snapshot(self, snapshot: StateSnapshot | None) -> StateSnapshot | None:
        """The state a recomputation replays, made new values when tied (:meth:`_ordered`)."""
        if snapshot is None or self.tie is None:
            return snapshot
        return dataclasses.replace(snapshot, before=tuple(self._ordered(list(snapshot.before))))

    def _forward(self, node: int, entry, recompute: bool) -> list:
        inputs = self._ordered([self._tensor(ref, node) for ref in entry.inputs], node)
        outputs, tape, one_call = self._call_layer(node, entry, inputs, "recompute" if recompute else "forward")
        generation = self.generation.get(node, -1) + 1
        self.generation[node] = generation
        self.first_outputs.setdefault(node, list(outputs))
        instance = _Instance(outputs, tape, inputs, [self._input_generation(r) for r in entry.inputs], one_call)
        self.instances[node] = instance
        self.resident[node] = instance
        return list(outputs)

    def _loss(self, node: int, entry) -> list:
        predictions = [self._tensor(ref, node) for ref in entry.inputs]
        for ref, prediction in zip(entry.inputs, predictions):  # Keras's losses apply the outputs' masks
            set_keras_mask(prediction, self.keras_masks.get(_mask_key(ref)))
        # Cross-entropy losses read a softmax/sigmoid output's logits (``_keras_logits``)
        # directly, as plain training does; their gradient is then taken at the logits so
        # it follows the same path (the backward node picks the logits up again). Other
        # losses (mse on a sigmoid output) read the output itself, and the logits get no
        # gradient: the output is the target then.
        with tf.GradientTape() as tape:
            tape.watch(predictions + [_logits(p) for p in predictions])
            # SideTable.loss_fn takes lists (one entry per model output) in every case.
            loss = self.table.loss_fn(list(self.y), list(predictions), self.sample_weight)
            scaled = self.scale_loss(loss)
        grads = self._input_gradients(node, "the loss reads model output", tape, scaled, predictions, list(range(len(predictions))),
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
        self.loss = loss
        self.predictions = predictions
        self.resident[node] = _Instance(grads, tape, predictions, [])
        return [loss, *grads]

    def _upstream(self, node: int, entry, outputs: list) -> tuple[list, list]:
        """Targets and output gradients for ``tape.gradient``, summed per target; a
        contribution that another one already includes (:meth:`_earlier_contributions`)
        is left out."""
        sums: dict[int, tuple[Any, list]] = {}
        for k, contributions in enumerate(entry.output_grads):
            included = set().union(*(self._value(ref.node, node).folded for ref in contributions))
            for ref in contributions:
                if ref in included:
                    continue
                grad = self._value(ref.node, node).outputs[ref.input_index]
                if grad is None:
                    continue
                reads_logits = self.reads_logits.get((ref.node, ref.input_index), False)
                target = _logits(outputs[k]) if reads_logits else outputs[k]
                sums.setdefault(id(target), (target, []))[1].append(grad)
        targets = [target for target, _ in sums.values()]
        grads = [parts[0] if len(parts) == 1 else _add_gradients(parts) for _, parts in sums.values()]
        return targets, grads

    def _backward(self, node: int, entry, last: bool) -> list:
        """Input gradients of ``entry``'s layer call, and at the node's last compute
        statement (``last``) its weight gradients too.

        A schedule may compute a backward node more than once (at the tightest budgets of
        ``eviction`` and ``optimal``). Adding every computation's weight gradients trains on
        a multiple of the gradient, and keeping the first computation's until the update
        holds bytes the graph (which counts them in the node's workspace only) does not
        have. Taking them at the last computation only keeps both right.
        """
        forward = entry.forward_node
        forward_entry = self.table[forward]
        reads_forward = forward in self.graph.predecessors[node]
        instance = self.instances.get(forward)
        if reads_forward:
            instance = self._value(forward, node)
            instance = instance.recorded or instance
        stale = instance is None or (instance.one_gradient_call and instance.differentiated) or any(
            forward_entry.inputs[pos].source == "node"
            and instance.input_generations[pos] != self.generation[forward_entry.inputs[pos].index]
            for pos in self._inputs_read(node, entry, forward_entry)
        )
        if stale:
            # Rebuild the VJP on the resident inputs so no freed copy is read (module doc),
            # or because a non-persistent tape has given its one gradient already.
            inputs = [self._tensor(ref, node) for ref in forward_entry.inputs]
            outputs, tape, one_call = self._call_layer(forward, forward_entry, inputs, "vjp")
            instance = _Instance(outputs, tape, inputs, [], one_call)
            if reads_forward:
                self.report.costly_vjp_rebuilds += 1
                logger.debug(
                    "backward node %d (%s): the forward value is resident but one of its inputs was recomputed "
                    "since; the layer's forward work is repeated to rebuild its gradient", node, entry.name,
                )
        targets, dys = self._upstream(node, entry, instance.outputs)
        # A split backward (NodeEntry.gradient_part): the weight-gradient node takes no
        # input gradient, the input-gradient node no weight gradient.
        grad_positions = [p for p, needs in enumerate(forward_entry.input_needs_grad)
                          if needs and entry.gradient_part != "weights"]
        sources = [instance.inputs[p] for p in grad_positions]
        folded: frozenset = frozenset()
        if targets:
            earlier_targets, earlier_grads, folded = self._earlier_contributions(node, forward_entry, grad_positions,
                                                                                 sources)
            targets, dys = targets + earlier_targets, dys + earlier_grads
        variables = list(forward_entry.trainable_variables) if last and entry.gradient_part != "inputs" else []
        if not targets:
            grads = [None] * (len(sources) + len(variables))
        elif instance.one_gradient_call:
            # A while loop's backward is one loop for all gradients (takes_one_gradient_call).
            instance.differentiated = True
            if any(_logits_read_apart(s, sources) is not s for s in sources):
                grads = self._input_gradients(node, f"{entry.name} reads input", instance.tape, targets, sources,
                                              grad_positions, output_gradients=dys, unconnected_gradients=tf.UnconnectedGradients.NONE)
                grads += instance.tape.gradient(targets, variables, output_gradients=dys,
                                                unconnected_gradients=tf.UnconnectedGradients.NONE) if variables else []
            else:
                grads = _gradient_once_per_tensor(
                    instance.tape, targets, sources + variables, output_gradients=dys,
                    unconnected_gradients=tf.UnconnectedGradients.NONE,
                )
            grads[:len(sources)] = [tf.zeros_like(s) if g is None else g for s, g in zip(sources, grads)]
        else:
            # Input gradients first, weight gradients after them, in one gradient call
            # (tfremat.runtime.gradient_order). A variable the training forward does not
            # use gets no gradient, as in model.fit (a zero one would let weight decay
            # change it; and a zero for a Keras variable failed on its string dtype).
            grads = self._input_gradients(
                node, f"{entry.name} reads input", instance.tape, targets, sources, grad_positions, variables,
                output_gradients=dys, unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        input_grads: list = [None] * len(forward_entry.inputs)
        for p, g in zip(grad_positions, grads[: len(sources)]):
            input_grads[p] = g
        produced = [g for g in input_grads if g is not None]
        for variable, g in zip(variables, grads[len(sources):]):
            if g is None:
                continue  # no loss reaches this layer (an output compiled without loss)
            key = id(variable)
            self.weight_grads.setdefault(key, (variable, []))[1].append(g)
            produced.append(g)
        self.resident[node] = _Instance(input_grads, instance.tape, [], [], folded=folded)
        return produced

    def _earlier_contributions(self, node: int, forward_entry, grad_positions: list,
                               sources: list) -> tuple[list, list, frozenset]:
        """Extra targets for backward ``node``'s gradient call: each input it differentiates
        whose other readers' backward nodes have all run, with their gradient contributions to
        that input, so that the input's gradient is summed here, at its last reader, in one
        ``AddN`` with this layer's own terms, the earlier contributions first (in the order
        they were computed).

        That is the sum plain training's tape forms (it adds up a tensor's gradient over all
        its readers at once, in the order their gradients arrived); summing this layer's
        terms here and the earlier contributions in the producer's backward rounds
        otherwise: a tensor read by a ``LayerNormalization`` and a residual ``Add``, in
        every pre-norm transformer block (benchmarks/results/exactness_models.md,
        tests/test_exactness_models.py). Summed at every reader in turn, three readers (an
        opened attention's query, key and value projections) gave nested sums of two. The
        producer's backward then leaves the folded contributions out (:meth:`_upstream`).
        Only resident contributions are folded, so no value is read that the plan has freed;
        contributions taken at an input's logits, or sparse ones, are left to the producer.

        Returns:
            ``(targets, output gradients, folded contributions)``; the folded ones include
            those the taken contributions had folded in turn.
        """
        targets, grads, folded = [], [], set()
        seen: set = set()
        for position, source in zip(grad_positions, sources):
            ref = forward_entry.inputs[position]
            if ref.source != "node" or ref in seen or _logits_read_apart(source, sources) is not source:
                continue
            seen.add(ref)
            producer = self.table[ref.index].backward_node
            if producer is None:
                continue
            others = [c for c in self.table[producer].output_grads[ref.output_index] if c.node != node]
            if any(c.node not in self.resident or c.node in self.freed_parts for c in others):
                continue  # a reader's backward is still to come (or to be recomputed): it sums them
            earlier = {}
            for contribution in others:
                value = self.resident[contribution.node]
                gradient = value.outputs[contribution.input_index]
                if (gradient is None or isinstance(gradient, tf.IndexedSlices) or gradient.dtype != source.dtype
                        or self.reads_logits.get((contribution.node, contribution.input_index), False)):
                    continue
                earlier[contribution] = (gradient, value.folded)
            covered = set().union(*(inner for _, inner in earlier.values()))
            for contribution in sorted(earlier, key=lambda c: self.computed_at[c.node]):
                if contribution not in covered:
                    targets.append(source)
                    grads.append(earlier[contribution][0])
                    self.report.folded_contributions += 1
            folded |= set(earlier) | covered
        return targets, grads, frozenset(folded)


    def _input_gradients(self, node: int, reader: str, tape, targets, sources: list, positions: list,
                         variables: list = (), **options) -> list:
        """``tape``'s gradients of ``targets`` at ``sources`` (inputs ``positions`` of
        ``node``), taken at a source's logits where the node's computation reads them, then
        those of ``variables`` (None where unconnected), in the same call with their own
        operations after the sources' (:func:`input_then_weight_gradients`).

        Keras's cross-entropies read the logits a softmax/sigmoid output carries
        (``_keras_logits``) instead of the output, as plain training does, and so does a
        loss traced into the graph by ``value_and_grad``: the gradient then exists at the
        logits only, and the backward node of the node that made the input continues from
        there (``_upstream``), as Keras's own gradient does. Without it the gradient at
        the output was zero. The flags are recorded in ``reads_logits``.

        Raises:
            CompileError: the node reads one input both through its activation and through
                its logits; the two gradients would need two targets in one backward call.
        """
        # Logits that are themselves an input of the node (a swish: ``x * sigmoid(x)``)
        # get their gradient as that input.
        logits = [_logits_read_apart(s, sources) for s in sources]
        distinct = [l for l, s in zip(logits, sources) if l is not s]
        unconnected = options.pop("unconnected_gradients")

        def take(xs: list) -> list:
            return _gradient_once_per_tensor(tape, targets, xs, unconnected_gradients=tf.UnconnectedGradients.NONE,
                                             **options)

        gradients, weight_grads = input_then_weight_gradients(take, distinct + sources, list(variables))
        if not distinct:
            # A tensor listed twice gets its gradient at its first place only (None at the others).
            firsts = {id(s): p for p, s in reversed(list(enumerate(sources)))}
            zero = unconnected == tf.UnconnectedGradients.ZERO
            return [tf.zeros_like(s) if g is None and zero and firsts[id(s)] == p else g
                    for p, (s, g) in enumerate(zip(sources, gradients))] + weight_grads
        of_logits = iter(gradients[:len(distinct)])
        at_logits = [next(of_logits) if l is not s else None for l, s in zip(logits, sources)]
        grads = []
        for position, source, at_logit, at_source in zip(positions, sources, at_logits, gradients[len(distinct):]):
            if at_logit is not None and at_source is not None:
                raise CompileError(
                    f"{reader} {position} both through its softmax/sigmoid and through the logits Keras "
                    "attached to it (BinaryFocalCrossentropy on a sigmoid output, or a sum of a cross-entropy and "
                    "another loss); the rematerialized step supports one of the two per output. Give the output "
                    "layer no activation and compute losses with from_logits=True (apply the activation inside a "
                    "custom loss), or use one loss per output"
                )
            self.reads_logits[(node, position)] = at_logit is not None
            gradient = at_logit if at_logit is not None else at_source
            if gradient is None and unconnected == tf.UnconnectedGradients.ZERO:
                gradient = tf.zeros_like(source)
            grads.append(gradient)
        return grads + weight_grads

    def _inputs_read(self, node: int, entry, forward_entry) -> tuple[int, ...]:
        """Positions of the forward call's inputs that backward ``node`` reads: as measured
        for the layer's own implementation, or as the graph under another says."""
        if entry.forward_node not in self.implementations:
            return entry.reads_inputs
        return tuple(pos for pos, ref in enumerate(forward_entry.inputs)
                     if ref.source == "node" and ref.index in self.graph.predecessors[node])


def order_updates(report: TraceReport, update_ops: dict[int, tuple[Any, list]]) -> int:
    """Makes the statement after each variable's last use wait for its optimizer update.

    Call it while the step is traced, after the optimizer's update operations exist. The
    graph's memory model frees a layer's weight gradients right after its backward node
    (``weight_grads="transient"``), or after the layer's last recomputation
    (``DFGraph.weight_grad_bytes``), but the updates hang off the statement chain and
    TensorFlow's executor runs them last (see the module docstring), so the edge is added
    to the statement's first operations (those that read nothing else of it).

    An edge is left out where it could close a cycle: when an update reads what a later
    statement computes (a global gradient norm, a loss-scale check over every gradient),
    or touches a resource a later statement touches (automatic control dependencies
    order those by creation, which would put the update after that statement).

    Args:
        report: the trace report of :func:`interpret_plan` for this step.
        update_ops: ``{id(variable): (variable, operations its update created)}``.

    Returns:
        The number of variables whose update was ordered (also in
        ``report.ordered_updates``).
    """
    statement_of: dict[int, int] = {}
    last_touch: dict[int, int] = {}  # id of a resource tensor -> last statement reading it
    for index, ops in enumerate(report.statement_ops):
        for op in ops:
            statement_of[id(op)] = index
            for tensor in op.inputs:
                if tensor.dtype == tf.resource:
                    last_touch[id(tensor)] = index
    upstream: dict[int, int] = {}  # id(op) -> latest statement among the op and its ancestors

    def latest_upstream(root) -> int:
        stack = [root]
        while stack:
            op = stack[-1]
            if id(op) in upstream:
                stack.pop()
                continue
            parents = [t.op for t in op.inputs] + list(op.control_inputs)
            pending = [p for p in parents if id(p) not in upstream]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            upstream[id(op)] = max([statement_of.get(id(op), -1), *(upstream[id(p)] for p in parents)])
        return upstream[id(root)]

    gates: dict[int, list] = {}
    ordered = 0
    for key, (_, ops) in update_ops.items():
        point = report.update_points.get(key)
        if point is None or not ops:
            continue
        if any(op.graph is not ops[0].graph for op in ops):
            continue
        if any(last_touch.get(id(t), -1) >= point for op in ops for t in op.inputs if t.dtype == tf.resource):
            continue
        if any(latest_upstream(op) >= point for op in ops):
            continue
        statement = report.statement_ops[point]
        if statement[0].graph is not ops[0].graph:
            continue
        gates.setdefault(point, []).extend(ops)
        ordered += 1
    for point, ops in gates.items():
        statement = report.statement_ops[point]
        inside = {id(op) for op in statement}
        gate = tf.group(*ops)
        for op in statement:
            if op.type != "Placeholder" and not any(id(t.op) in inside for t in op.inputs):
                op._add_control_input(gate)  # pylint: disable=protected-access
    report.ordered_updates = ordered
    return ordered


def _gradient_once_per_tensor(tape, targets, sources: list, **options) -> list:
    """``tape.gradient(targets, sources)`` with the gradient of a tensor that appears in
    several places of ``sources`` given at its first place only, None at the others.

    The same tensor passed twice (``MultiHeadAttention()(h, h)``, ``Add()([h, h])``, a
    model output listed twice) is one tensor to the tape, which returns its whole
    gradient at every place; routing each place's copy back to the tensor's producer
    counted it twice (training diverged silently from ``model.fit``).
    """
    first: dict[int, int] = {}
    for position, tensor in enumerate(sources):
        first.setdefault(id(tensor), position)
    unique = [sources[p] for p in first.values()]
    gradients = dict(zip(first.values(), tape.gradient(targets, unique, **options)))
    return [gradients.get(p) for p in range(len(sources))]


def _add_gradients(parts: list):
    """The sum of gradients for one tensor or variable, as ``tf.GradientTape`` forms it:
    sparse gradients (``tf.IndexedSlices``, from an ``Embedding`` called twice) are
    concatenated, which ``+`` and ``tf.add_n`` refuse; a mix is summed densely."""
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], axis=0), tf.concat([p.indices for p in parts], axis=0),
            parts[0].dense_shape,
        )
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])


def _scope_name(path: str) -> str:
    """``path`` (a layer's name or nested path) as a TensorFlow name scope: characters a scope
    may not hold replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", path).strip("/") or "_"


def _mask_key(ref) -> tuple:
    """The key of a value's tensor in ``_Interpreter.keras_masks``."""
    return ref.source, ref.index, ref.output_index


def _token(tensors, after: list):
    """An operation that reads ``tensors`` as data, for the next statement to wait on
    (see the module docstring); marked so that Grappler does not remove it.

    It also waits for ``after``, the previous statement's token: a statement that creates
    no operation (an ``Add``'s backward hands the upstream gradient on) makes its token of
    tensors computed before, so without that edge nothing later waited for the rest of the
    statement before it. The weight gradient of a norm's scale (a ``Sum`` over the batch of
    an activation-sized product) followed by a residual ``Add``'s backward then ran only
    where its optimizer update needed it, at the end of the step with
    ``weight_grads="fixed"``, holding the product over its prediction until then
    (``tests/test_token_chain.py``; benchmarks/results/gemma_opening.md)."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    with tf.control_dependencies(after):
        token = tf.raw_ops.IdentityN(input=values, name="token")[0].op
    token._set_attr("_grappler_do_not_remove", tf.compat.v1.AttrValue(b=True))  # pylint: disable=protected-access
    return token


def _runtime_zero(tensors: list):
    """A float32 scalar zero computed from one element of the first floating tensor of
    ``tensors`` (None when there is none), which XLA cannot fold to a constant: the element
    is replaced by 0 when not finite, then subtracted from itself. Adding it to a value
    changes no bit of it (but the sign of a zero) and makes it depend on ``tensors``."""
    for tensor in tensors:
        values = getattr(tensor, "values", tensor)
        if isinstance(values, tf.Tensor) and values.dtype.is_floating and values.shape.num_elements() != 0:
            element = tf.cast(tf.reshape(values, [-1])[0], tf.float32)
            finite = tf.where(tf.math.is_finite(element), element, tf.zeros_like(element))
            return finite - finite
    return None


def _logits(tensor):
    """The logits Keras attached to a softmax/sigmoid output, else the tensor itself."""
    return getattr(tensor, "_keras_logits", tensor)


def _logits_read_apart(tensor, inputs: list):
    """``tensor``'s logits when a node with ``inputs`` can read them only through the
    attribute, else ``tensor``: logits that are one of the inputs themselves are read as
    that input."""
    logits = _logits(tensor)
    return tensor if any(logits is other for other in inputs) else logits


def interpret_plan(graph: DFGraph, side_table: Any, plan: ExecutionPlan, x, y,
                   scale_loss: Callable[[Any], Any] | None = None, sample_weight=None, xla: bool = False):
    """Emits the operations of one training step following ``plan`` (call while tracing).

    Args:
        graph: the extracted graph the plan was built for.
        side_table: the extraction's :class:`~tfremat.extract.SideTable`.
        plan: the execution plan.
        x: the input batch (structure matching the model inputs).
        y: the labels.
        scale_loss: the loss that is differentiated, as a function of the loss (None: the
            loss itself); the compiled step applies the optimizer's loss scale
            (``mixed_float16``), as Keras's own ``train_step`` does (Keras losses divide by
            the number of replicas themselves under a distribution strategy).
        sample_weight: one weight per sample, applied to every output's loss as
            ``model.fit(sample_weight=...)`` applies it (None: unweighted).
        xla: the step is compiled with XLA (``jit_compile=True``): recomputations read
            their first-pass inputs and replayed state plus a runtime zero (module
            docstring). The operations are otherwise the same.

    Returns:
        ``(loss, predictions, weight_grads, report)``: the scalar loss, the model outputs
        (flattened) as the loss node read them, ``{id(variable): (variable, gradient)}``
        and the :class:`TraceReport`.
    """
    interpreter = _Interpreter(graph.with_implementations(plan.implementations), side_table, x, y,
                               scale_loss or (lambda loss: loss), sample_weight, plan.implementations, xla)
    loss, predictions, weight_grads = interpreter.run(plan)
    return loss, predictions, weight_grads, interpreter.report


def _chained_computes(graph: DFGraph, plan: ExecutionPlan, weight_gates: set[int]) -> dict[int, bool]:
    """Compute statement position -> whether both it and the next compute statement are
    first forward computations (:func:`_first_forward`) and the next reads its node, with
    nothing but allocate statements and deallocates of values never offloaded in between
    (a deallocate of an offloaded value makes the next statement wait for the copy, which
    needs a token), and the statement is not in ``weight_gates``, the last
    uses of layers whose weight gradients wait for its token: a token made only for them
    would have no reader in the statement chain, so TensorFlow's executor would run it
    late and hold the outputs it reads (an input gradient) until then.

    No token is made between two such statements: the second reads the first's outputs, so
    it runs after them anyway, and both are created in one ``tf.control_dependencies`` block
    on the token before the chain, where an operation that reads one made in the block gets
    no control input (as in plain training). Grappler's arithmetic optimizer rewrites a sum
    only where the inner ``Add`` has no other data consumer and the root none control
    input; a token reading a batch norm's output, and a control input on the ``Add`` that
    reads it, kept the batch norm's final add from being regrouped into a residual ``Add``
    as plain training does, so the gradients differed in the last bits
    (benchmarks/results/mobilenetv3_exact.md, tests/test_mobilenetv3_exact.py). Without a
    control edge inside the chain, a producer merged into its consumer (oneDNN's ``Pad``
    into ``Conv2D``) cannot wait on itself.
    """
    statements = plan.statements
    offloaded: set[int] = set()
    chained: dict[int, bool] = {}
    for position, statement in enumerate(statements):
        if statement.op is Op.OFFLOAD:
            offloaded.add(statement.node)
        if statement.op is not Op.COMPUTE:
            continue
        chained[position] = False
        if position in weight_gates or not _first_forward(graph, statement):
            continue
        for later in statements[position + 1:]:
            if later.op is Op.COMPUTE:
                chained[position] = _first_forward(graph, later) and statement.node in graph.predecessors[later.node]
                break
            if not (later.op is Op.ALLOCATE or (later.op is Op.DEALLOCATE and later.node not in offloaded)):
                break
    return chained


def _first_forward(graph: DFGraph, statement) -> bool:
    """Whether ``statement`` is a forward node's first computation (not a recomputation,
    a backward node or the loss): only those are chained (:func:`_chained_computes`). In a
    chain of backward statements the operations that do not read the previous statement
    (the values of an attention's probabilities-times-values gradient) lost their place
    after it and ran at another point, so a statement requested more than its prediction
    (tests/test_requested_statements.py)."""
    return statement.op is Op.COMPUTE and not statement.recompute and not graph.is_backward[statement.node]
