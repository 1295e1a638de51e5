"""Measured layer calls -> the :class:`~tfremat.graph.DFGraph` and the :class:`SideTable`.

Memory model (what the graph's numbers mean, so that the planner's simulator describes a
training step that records each forward call on a tape and asks it for the gradient later,
which is what plain ``tf.GradientTape`` training and tfremat's compiled step both do):

* **Forward node** value = the layer's output + its batch-sized *residuals*: the internal
  tensors its gradient reads (measured, see :mod:`tfremat.extract.analysis`). The tape keeps
  them from the forward call until the backward node runs, and a recomputation recreates
  them together with the output. When the gradient does not read the output, the two are
  parts of the value freed apart (``DFGraph.residual_bytes``): the output dies after its
  last forward reader, the residuals after the backward node. A while loop's
  accumulators (a Keras RNN with ``unroll=False``) are such residuals, sized by running the
  call. The edge ``forward -> backward`` of a layer exists exactly when its gradient reads
  its output or a batch-sized residual; otherwise the output is freed after its last
  forward reader.
* **Loss node** value = the scalar loss + the gradient of the loss with respect to every
  model output (one op computes both, so they are one value).
* **Backward node** value = the gradients with respect to the layer's inputs that need one.
  With ``split_backward`` (MONeT appendix D), a call whose input gradients read nothing
  of the forward pass (a convolution or Dense layer without activation: only the upstream
  gradient and the weights) gets two backward nodes: the weight-gradient node, which
  reads the call's inputs, and then the input-gradient node, which reads the upstream
  gradient only, so the inputs can be freed between the two. An edge between them (an
  empty value) keeps their order; their costs split the measured backward cost by the
  flops of each part. Both count the weight gradients in their workspace (the layer's
  update waits for its last statement).
  Weight gradients (``weight_grads="transient"``) are counted in the backward node's
  workspace: tfremat's compiled step makes the statement after a layer's backward wait for
  the layer's optimizer update (:func:`tfremat.static_graph.interpreter.order_updates`), so
  they die right after the node; counting all of them as fixed would over-predict the
  compiled step on models with many parameters (VGG16, ResNet50). A plain
  ``tf.GradientTape`` step has no such order: TensorFlow's executor runs most filter
  gradients and updates after the whole input-gradient chain and holds each convolution's
  input and output gradient until then, so it requests more than the checkpoint-all
  prediction, which describes the compiled step (``benchmarks/extraction.py`` ->
  ``benchmarks/results/extraction.md``, the plain "requested" column against the "tfremat
  step" column). With ``weight_grads="fixed"`` the updates run after the backward pass:
  each layer's weight gradients are counted in its backward node's workspace and held
  from there to the end of the step (``DFGraph.weight_grads_to_end``; a shared layer's
  by its first backward node). At gpt2_hub fp16's activation peak, early in the
  backward pass, few of them exist yet (``benchmarks/requested_ledger.py`` ->
  ``benchmarks/results/fidelity_mixed.md``); counting them as fixed for the whole step
  over-predicted it. :func:`weight_gradient_lifetime` chooses between the two for ``"auto"``.
* **Optimizer update** temporaries: the weight-sized buffers an update requests beyond
  the variable, its gradient and its slots (``m * momentum``, RMSprop's two), measured per
  optimizer on probe variables (:mod:`tfremat.extract.optimizer_update`). With
  ``weight_grads="transient"`` a layer's update runs right after its backward node (its
  input-gradient node when split), so the temporaries of the layer's variables count in
  that node's workspace. With ``"fixed"`` the updates run after the backward pass, so the
  temporaries of all variables updated together count in the last node's workspace: that
  covers the end of the step without raising the activation peak. Each node's share is in
  ``SideTable.update_bytes``.
* **Workspace** = the peak of the bytes the node's operations request while it runs in
  isolation, minus its value and what it reads (see :mod:`tfremat.extract.analysis`); 0
  with ``cost_model="flops"``. A backward node that is the only reader of its upstream
  gradients (:func:`sole_upstream`) takes the workspace measured with them dying inside it
  (``CallAnalysis.dying_backward_workspace``): its ``ReluGrad`` writes into the upstream's
  buffer, one output size less (``benchmarks/results/forwarded_upstream.md``).
  The simulator runs one node at a time, so workspace is meant
  for sequential op execution (``TF_NUM_INTEROP_THREADS=1``). With several inter-op
  threads TensorFlow overlaps independent ops, e.g. a convolution's input and filter
  gradients, each with its own scratch buffer on CPU, which no sequential model predicts.
  Profile and train with the same setting; the profile cache key includes it.
* **Fixed bytes** = parameters (+ with ``weight_grads="fixed"``, the gradients of the
  variables no backward node reads, ``param_grads``) +
  optimizer slot variables + non-trainable variables (batch-norm statistics, dropout
  seeds) + the input batch + the labels + the residuals that do not grow with the batch
  (per-channel statistics) + the all-reduce's buffers when several replicas of a
  ``tf.distribute`` strategy train (below) + with fixed weight gradients, the optimizer
  update's temporaries (:mod:`tfremat.extract.optimizer_update`; the updates run after the
  backward pass). Each part is in ``SideTable.fixed_bytes_breakdown``.
* **All-reduce** (``replicas > 1``): the graph describes one replica; after the backward
  pass the replicas sum their gradients, and each replica receives the reduced gradients
  in new buffers while its own are still resident (``weight_grads="fixed"``), until the
  optimizer updates. One copy of the parameter gradients per replica is counted
  (``all_reduce``). On two logical CPU devices (``MirroredStrategy``'s
  ``ReductionToOneDevice``) the mirrored step held 0.45-0.96 gradient copies per replica
  beyond two single-replica steps over ten runs (``benchmarks/mirrored_allreduce.py`` ->
  ``benchmarks/results/mirrored_allreduce.md``). The buffers exist only at the end of the
  step, when the activations are freed; counting them as fixed keeps the planning core
  unchanged and over-predicts by at most that copy while the activations peak.

* **Views**: a call whose output is its input reshaped (``CallAnalysis.view_input``: a
  ``Flatten``, a ``Reshape``) shares that input's buffer, so the graph marks it as a view
  (``DFGraph.view_of``) and the simulator and the MILP count the buffer once.
* **Held weight gradients** (``DFGraph.weight_grad_bytes``): with transient gradients, a
  layer whose forward node a schedule computes after its backward node holds its weight
  gradients until then (its update waits for the recompute's read of the weights).

Node order: forward calls in Keras execution order, the loss, then the backward nodes in
reverse forward order (the order plain backpropagation runs them), a split backward's
weight-gradient node right before its input-gradient node.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import tensorflow as tf

from tfremat.extract.analysis import CallAnalysis, tensor_bytes
from tfremat.extract.layer_graph import (
    LayerCall,
    model_input_names,
    model_output_names,
    regularized_variables,
    takes_training,
    trainable_variables,
)
from tfremat.extract.optimizer_update import UpdateTemporaries, update_temporaries
from tfremat.extract.side_table import GradRef, NodeEntry, SideTable, TensorRef
from tfremat.graph import DFGraph, Implementation

__all__ = ["assemble", "backward_flags", "sole_upstream", "weight_gradient_lifetime"]

logger = logging.getLogger(__name__)

# Weight-sized buffers a weight regularizer's penalty gradient adds next to its variable's
# gradient in the compiled step (CompiledStep._add_weight_penalties), counted in the
# backward node's workspace: the upstream broadcast to the variable's shape and the product.
_PENALTY_BUFFERS = 2


def backward_flags(calls: Sequence[LayerCall]) -> list[bool]:
    """Per call, whether it passes a gradient back: it owns trainable weights or is fed by
    such a call. The others get no backward node."""
    needs_backward: list[bool] = []
    for call in calls:
        upstream = any(r.source == "node" and needs_backward[r.index] for r in call.inputs)
        needs_backward.append(bool(trainable_variables(call.layer)) or upstream)
    return needs_backward


def weight_gradient_lifetime(optimizer, layers: Sequence) -> str:
    """How long weight gradients live in a training step with ``optimizer``: ``"transient"``
    or ``"fixed"`` (see the module docstring).

    A plain update consumes each gradient as soon as it exists. Gradient clipping of any
    kind, gradient accumulation and the loss scale of ``mixed_float16`` (a
    ``LossScaleOptimizer`` checks all gradients for overflow first) keep them longer; so
    does a layer with weights called more than once, whose first gradient waits for the
    others. With those, a schedule planned on transient gradients overruns its budget
    (``tests/test_extract.py::test_weight_gradients_are_resident_when_the_optimizer_or_a_shared_layer_needs_them``).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    reasons = [name for name in ("clipnorm", "global_clipnorm", "clipvalue", "gradient_accumulation_steps")
               if getattr(inner, name, None)]
    if inner is not optimizer:
        reasons.append("loss scaling")
    owners = [id(layer) for layer in layers if trainable_variables(layer)]
    if len(owners) != len(set(owners)):
        reasons.append("a layer with weights called more than once")
    if reasons:
        logger.info("weight gradients are counted as resident for the whole step (%s)", ", ".join(reasons))
        return "fixed"
    return "transient"


@dataclasses.dataclass
class _Nodes:
    """The graph's per-node numbers and the side table's entries while they are filled in."""

    names: list[str]
    cost: list[float]
    out_bytes: list[int]
    work: list[int]
    is_bwd: list[bool]
    entries: list[NodeEntry | None]
    residual: list[int]
    edges: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    forward_of: dict[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> "_Nodes":
        return cls(names=[""] * n, cost=[0.0] * n, out_bytes=[0] * n, work=[0] * n, is_bwd=[False] * n,
                   entries=[None] * n, residual=[0] * n)


def assemble(model, calls: Sequence[LayerCall], output_refs: Sequence[TensorRef], needs_backward: Sequence[bool],
             analyses: Sequence[CallAnalysis], loss_analysis: CallAnalysis, in_specs, label_specs,
             loss_fn, optimizer, batch: int, cost_model: str, weight_grads: str,
             alternatives: Sequence[Mapping[str, CallAnalysis]] | None = None,
             split_backward: bool = False, replicas: int = 1, use_cache: bool = True) -> tuple[DFGraph, SideTable]:
    """Numbers the nodes, wires the edges and builds the graph and the side table;
    ``alternatives``: per call, its layer's alternatives measured by name, which the graph
    carries as :class:`~tfremat.graph.Implementation` s of the call's forward node;
    ``split_backward``: split the backward of every call that allows it (module doc);
    ``replicas``: how many replicas all-reduce their gradients (module doc, "All-reduce");
    ``use_cache``: read and store the optimizer's update temporaries on disk."""
    loss_node = len(calls)
    backward_calls = [c.position for c in reversed(calls) if needs_backward[c.position]]
    split = {c.position for c in calls if split_backward and needs_backward[c.position]
             and _splits(c, analyses[c.position], alternatives[c.position] if alternatives else None)}
    weight_id, backward_id, next_id = {}, {}, loss_node + 1
    for p in backward_calls:
        if p in split:
            weight_id[p], next_id = next_id, next_id + 1
        backward_id[p], next_id = next_id, next_id + 1
    nodes = _Nodes.empty(next_id)
    output_grads = _output_gradients(calls, output_refs, needs_backward, loss_node, backward_id)
    flops = cost_model == "flops"
    implementations: dict[int, list[Implementation]] = {}
    small_total = 0
    temporaries = (update_temporaries(optimizer, use_cache=use_cache) if model.trainable_variables
                   else UpdateTemporaries(0.0, 0.0))
    update_bytes: dict[int, int] = {}
    held = _held_weight_gradients(calls, backward_calls) if weight_grads == "fixed" else {}
    sole = sole_upstream(analyses, loss_analysis, output_grads, loss_node,
                         {node: p for p, node in backward_id.items()})
    for call in calls:
        small_total += analyses[call.position].small_residual_bytes if needs_backward[call.position] else 0
        b = backward_id.get(call.position)
        if b is not None and weight_grads == "transient":
            update_bytes[b] = temporaries.bytes_for(_variable_sizes(trainable_variables(call.layer)))
        workspace = _backward_workspace(analyses[call.position], call.position in sole)
        _add_call(nodes, call, analyses[call.position], b, output_grads[call.position],
                  needs_backward, flops, update_bytes.get(b, 0), workspace)
        if call.position in split:
            _split_backward(nodes, call, analyses[call.position], weight_id[call.position],
                            backward_id[call.position], update_bytes.get(b, 0))
        if alternatives and alternatives[call.position] and call.position in backward_id:
            implementations[call.position] = [
                _implementation(name, a, len(call.inputs), flops, nodes.work[backward_id[call.position]] - workspace)
                for name, a in alternatives[call.position].items()
            ]
    _add_loss(nodes, loss_node, output_refs, loss_analysis, flops)
    breakdown = _fixed_bytes(model, optimizer, in_specs, label_specs, small_total, weight_grads, replicas)
    if weight_grads == "fixed":
        # Made by the backward nodes and held from there to the end of the step
        # (DFGraph.weight_grads_to_end); what no backward node makes stays fixed.
        breakdown["param_grads"] -= sum(held.values())
        # The updates run after the backward pass, when the activations are freed: counted
        # as fixed like the all-reduce's buffers (module docstring). In the last node's
        # workspace they made small nets' shares of activations infeasible, the node's own
        # upstream gradient being counted beside them.
        breakdown["update_temporaries"] = temporaries.bytes_for(_variable_sizes(model.trainable_variables))
    graph = DFGraph(
        names=nodes.names, edges=nodes.edges, cost=nodes.cost, output_bytes=nodes.out_bytes,
        workspace_bytes=nodes.work, is_backward=nodes.is_bwd, loss_node=loss_node, forward_of=nodes.forward_of,
        fixed_bytes=sum(breakdown.values()), name=model.name, residual_bytes=nodes.residual,
        implementations=implementations,
        # What a held layer's weight gradients add while its update waits for a recompute of
        # its forward node (the simulator's ``held_weight_gradients``); they are in the
        # backward node's workspace only with transient gradients.
        weight_grad_bytes=[(_variables_bytes(trainable_variables(call.layer))
                            if weight_grads == "transient" else held.get(call.position, 0))
                           if call.position in backward_id else 0
                           for call in calls] + [0] * (next_id - len(calls)),
        weight_grads_to_end=weight_grads == "fixed" and any(held.values()),
    ).with_views({call.position: call.inputs[a.view_input].index for call, a in zip(calls, analyses)
                  if a.view_input is not None and call.inputs[a.view_input].source == "node"})
    table = SideTable(
        model=model, entries=tuple(nodes.entries), input_specs=tuple(in_specs), label_specs=tuple(label_specs),
        outputs=tuple(output_refs), loss_node=loss_node, loss_fn=loss_fn, optimizer=optimizer, batch_size=batch,
        fixed_bytes_breakdown=MappingProxyType(breakdown), weight_grads=weight_grads,
        update_bytes=MappingProxyType({node: size for node, size in update_bytes.items() if size}),
        input_names=tuple(model_input_names(model)), output_names=tuple(model_output_names(model)),
    )
    return graph, table


def sole_upstream(analyses: Sequence[CallAnalysis], loss_analysis: CallAnalysis,
                  output_grads: Mapping[int, list[list[GradRef]]], loss_node: int,
                  call_of: Mapping[int, int]) -> set[int]:
    """The call positions whose backward node is the only reader of its upstream gradients
    in the compiled step, so that an elementwise gradient (``ReluGrad``) writes into their
    buffer and the node's workspace is ``CallAnalysis.dying_backward_workspace``.

    Each float output must get its gradient from one contribution (several are summed into
    a buffer the sum may or may not take over) whose buffer no other node reads: not one
    the producing node passes to two of its inputs (a residual ``Add``'s gradient, read by
    both branches' backward nodes), nor a constant; a gradient that is the producer's own
    upstream passed on (an ``Add`` with one differentiable input, a ``Reshape``) counts
    when that upstream is sole in turn. ``call_of`` maps a backward node to its call.
    With the upstream held by a second reader the isolated ``"dying"`` trace under-counts
    by one output (a residual net's relu convolution, ``tests/test_forwarded_upstream.py``).
    Not seen here: a schedule that computes a backward node twice (the tightest budgets of
    ``eviction`` and ``optimal``) keeps its upstream for the second computation.
    """
    memo: dict[int, bool] = {}

    def sole(position: int) -> bool:
        if position in memo:
            return memo[position]
        memo[position] = False  # a gradient is passed on against the forward order: no cycle
        analysis = analyses[position]
        floats = [k for k, (_, dtype) in enumerate(analysis.output_specs) if tf.as_dtype(dtype).is_floating]
        answer = True
        for k in floats:
            contributions = output_grads[position][k]
            if len(contributions) > 1:
                answer = False
            elif contributions:
                ref = contributions[0]
                producer = loss_analysis if ref.node == loss_node else analyses[call_of[ref.node]]
                if ref.input_index in producer.shared_input_grads:
                    answer = False
                elif ref.input_index in producer.passed_input_grads:
                    passer = call_of[ref.node]
                    answer = answer and len(analyses[passer].output_specs) == 1 and sole(passer)
            if not answer:
                break
        memo[position] = answer
        return answer

    return {position for position in output_grads if sole(position)}


def _backward_workspace(analysis: CallAnalysis, sole: bool) -> int:
    """The measured backward workspace of a call: the one with the upstream gradients
    dying inside the node (``CallAnalysis.dying_backward_workspace``) where its backward
    node is their only reader (``sole``, :func:`sole_upstream`) and it was measured."""
    if sole and analysis.dying_backward_workspace is not None:
        return analysis.dying_backward_workspace
    return analysis.backward_workspace


def _held_weight_gradients(calls: Sequence[LayerCall], backward_calls: Sequence[int]) -> dict[int, int]:
    """Per call position, the bytes of the weight gradients its backward node makes and
    holds to the end of the step (``weight_grads="fixed"``): each trainable variable once,
    by the first backward node in backward order that reads it (a shared layer's
    gradients begin with its last call's backward)."""
    by_position = {call.position: call for call in calls}
    seen: set[int] = set()
    held = {}
    for p in backward_calls:
        fresh = [v for v in trainable_variables(by_position[p].layer) if id(v) not in seen]
        seen.update(id(v) for v in fresh)
        if fresh:
            held[p] = _variables_bytes(fresh)
    return held


def _output_gradients(calls, output_refs, needs_backward, loss_node: int,
                      backward_id: dict[int, int]) -> dict[int, list[list[GradRef]]]:
    """Per call and flattened output, where the contributions to its upstream gradient come
    from: the loss node for a model output, the backward node of each consumer that passes
    a gradient back."""
    output_grads: dict[int, list[list[GradRef]]] = {c.position: [[] for _ in range(c.num_outputs)] for c in calls}
    for k, ref in enumerate(output_refs):
        output_grads[ref.index][ref.output_index].append(GradRef(loss_node, k))
    for call in calls:
        if not needs_backward[call.position]:
            continue
        for pos, ref in enumerate(call.inputs):
            if ref.source == "node" and needs_backward[ref.index]:
                output_grads[ref.index][ref.output_index].append(GradRef(backward_id[call.position], pos))
    return output_grads


def _add_call(nodes: _Nodes, call: LayerCall, a: CallAnalysis, b: int | None, output_grads: list[list[GradRef]],
              needs_backward: Sequence[bool], flops: bool, update_bytes: int = 0,
              backward_workspace: int | None = None) -> None:
    """Fills in the forward node of ``call`` and, when ``b`` is not None, its backward node
    ``b``: names, costs, values, workspaces, edges and side-table entries; ``update_bytes``:
    the temporaries of the layer's optimizer update (transient weight gradients), counted in
    ``b``'s workspace with the weight gradients ``b`` makes, all of the layer's whether it
    holds them to the end of the step or not: a shared layer's other calls make their own
    before they are summed (a ``Dense(512)`` called twice requested 1.4x its prediction
    without them; tests/test_dying_upstream_guard.py); ``backward_workspace``: the measured part of ``b``'s workspace (default
    ``a.backward_workspace``; :func:`_backward_workspace`)."""
    i = call.position
    layer = call.layer
    nodes.names[i] = call.name
    nodes.cost[i] = a.forward_flops if flops else a.forward_seconds
    nodes.out_bytes[i] = a.output_bytes + a.residual_bytes
    nodes.work[i] = a.forward_workspace
    for ref in call.inputs:
        if ref.source == "node":
            nodes.edges.add((ref.index, i))
    for ref in call.output_masks:
        # The compiled step hands this mask to the call's outputs at its first call (the
        # interpreter's _first_tensor): the call reads it, so it exists by then (opening.py,
        # "Keras masks"), and the nodes computing it are not left without a reader.
        if ref is not None and ref.source == "node":
            nodes.edges.add((ref.index, i))
    needs = tuple(r.source == "node" and needs_backward[r.index] for r in call.inputs)
    common = dict(
        layer=layer, call_args=call.call_args, call_kwargs=MappingProxyType(dict(call.call_kwargs)),
        inputs=call.inputs, takes_training=takes_training(layer), one_gradient_call=a.one_gradient_call,
        trainable_variables=tuple(trainable_variables(layer)), num_outputs=call.num_outputs,
        input_needs_grad=needs, clears_masks=call.clears_masks, output_masks=call.output_masks,
    )
    nodes.entries[i] = NodeEntry(
        node=i, kind="forward", name=call.name, forward_node=i, backward_node=b,
        output_bytes=a.output_bytes, residual_bytes=a.residual_bytes if b is not None else 0,
        small_residual_bytes=a.small_residual_bytes if b is not None else 0,
        workspace_bytes=a.forward_workspace, cost=nodes.cost[i], **common,
    )
    if b is None:
        # Nothing differentiates this call, so the tape keeps none of its residuals.
        nodes.out_bytes[i] = a.output_bytes
        return
    nodes.names[b] = f"{call.name}_backward"
    nodes.is_bwd[b] = True
    nodes.forward_of[b] = i
    nodes.cost[b] = a.backward_flops if flops else a.backward_seconds
    nodes.out_bytes[b] = a.input_grad_bytes
    nodes.work[b] = a.backward_workspace if backward_workspace is None else backward_workspace
    nodes.work[b] += _variables_bytes(trainable_variables(layer)) + update_bytes
    nodes.work[b] += _PENALTY_BUFFERS * _variables_bytes(regularized_variables(layer))
    grads = tuple(tuple(g) for g in output_grads)
    for contributions in grads:
        for g in contributions:
            nodes.edges.add((g.node, b))
    for pos in _inputs_backward_needs(a, len(call.inputs)):
        ref = call.inputs[pos]
        if ref.source == "node":
            nodes.edges.add((ref.index, b))
    if a.reads_output or a.residual_bytes:
        nodes.edges.add((i, b))
    if a.residual_bytes and not a.reads_output:
        # The output and the residuals are freed apart (DFGraph.residual_bytes).
        nodes.residual[i] = a.residual_bytes
    nodes.entries[b] = NodeEntry(
        node=b, kind="backward", name=nodes.names[b], forward_node=i, output_grads=grads,
        reads_inputs=a.reads_inputs, reads_output=a.reads_output, output_bytes=a.input_grad_bytes,
        workspace_bytes=nodes.work[b], cost=nodes.cost[b], **common,
    )


def _splits(call: LayerCall, a: CallAnalysis, alternatives: Mapping[str, CallAnalysis] | None) -> bool:
    """Whether the backward of ``call`` splits: its input gradients read nothing of the
    forward pass, it has weight gradients and input gradients to take, and it keeps no
    residuals nor has alternatives (those are read by one backward node)."""
    return (not a.input_gradient_reads_forward and not a.one_gradient_call and a.input_grad_bytes > 0
            and not a.reads_output and not a.residual_bytes and bool(trainable_variables(call.layer))
            and not alternatives)


def _split_backward(nodes: _Nodes, call: LayerCall, a: CallAnalysis, w: int, b: int, update_bytes: int) -> None:
    """Splits the backward node ``b`` that :func:`_add_call` made into the weight-gradient
    node ``w`` (reads the inputs, makes the weight gradients) and ``b``, which makes the
    input gradients and reads the upstream gradients only (module doc); the update's
    temporaries (``update_bytes``) stay with ``b``, after which the update runs."""
    entry = nodes.entries[b]
    forward_inputs = {ref.index for ref in call.inputs if ref.source == "node"}
    for source, target in list(nodes.edges):
        if target == b:
            nodes.edges.add((source, w))
            if source in forward_inputs:
                nodes.edges.discard((source, b))
    nodes.edges.add((w, b))
    share = a.input_gradient_flops / a.backward_flops if a.backward_flops else 0.5
    total = nodes.cost[b]
    nodes.names[w] = f"{call.name}_weight_backward"
    nodes.is_bwd[w] = True
    nodes.forward_of[w] = call.position
    nodes.cost[w], nodes.cost[b] = total * (1 - share), total * share
    nodes.out_bytes[w] = 0
    # The weight gradients live on through the input-gradient node: the layer's optimizer
    # update waits for the layer's last statement (interpreter.order_updates).
    nodes.work[w] = nodes.work[b] - update_bytes
    nodes.entries[w] = dataclasses.replace(entry, node=w, name=nodes.names[w], gradient_part="weights", output_bytes=0,
                                           workspace_bytes=nodes.work[w], cost=nodes.cost[w])
    nodes.entries[b] = dataclasses.replace(entry, gradient_part="inputs", reads_inputs=(),
                                           workspace_bytes=nodes.work[b], cost=nodes.cost[b])


def _implementation(name: str, a: CallAnalysis, num_inputs: int, flops: bool, weight_bytes: int) -> Implementation:
    """An alternative of a forward node from its measurement: what its backward reads and
    keeps, its costs and workspaces (``weight_bytes``: what the backward node's workspace
    adds to the measured one for weight gradients and penalties, as for the default)."""
    return Implementation(
        name, residual_bytes=a.residual_bytes, reads_output=a.reads_output,
        reads_inputs=bool(_inputs_backward_needs(a, num_inputs)),
        cost=a.forward_flops if flops else a.forward_seconds,
        backward_cost=a.backward_flops if flops else a.backward_seconds,
        workspace_bytes=a.forward_workspace, backward_workspace_bytes=a.backward_workspace + weight_bytes,
    )


def _inputs_backward_needs(analysis: CallAnalysis, num_inputs: int) -> tuple[int, ...]:
    """The positions of the inputs a backward node depends on: those its gradient reads,
    or every input when it reads some but not all and not the forward node's value. When a
    schedule recomputes a read input after the forward call, the compiled step re-runs the
    call on the current inputs to rebuild the gradient (so that the tape's older copy is
    not kept alive), and that call needs all of them. A gradient that also reads the
    forward value is never rebuilt: plans recompute its forward node in the backward
    node's stage instead, which reads the inputs through the forward node's own edges
    (:func:`tfremat.plan.schedule.with_fresh_gradient_reads`). So ``einsum`` over attention
    probabilities and values, which reads a transposed copy of the values (a residual) and
    the probabilities, does not keep the values: the timeseries Transformer of
    benchmarks/user_check.py held 4 MiB per block the step had freed
    (benchmarks/results/fidelity_requested.md)."""
    reads_value = (analysis.reads_output or analysis.residual_bytes) and not analysis.one_gradient_call
    if analysis.reads_inputs and len(analysis.reads_inputs) < num_inputs and not reads_value:
        return tuple(range(num_inputs))
    return analysis.reads_inputs


def _add_loss(nodes: _Nodes, loss_node: int, output_refs: Sequence[TensorRef], loss_analysis: CallAnalysis,
              flops: bool) -> None:
    """Fills in the loss node, which reads every model output."""
    nodes.names[loss_node] = "loss"
    nodes.is_bwd[loss_node] = True
    nodes.cost[loss_node] = loss_analysis.forward_flops if flops else loss_analysis.forward_seconds
    nodes.out_bytes[loss_node] = loss_analysis.output_bytes
    nodes.work[loss_node] = loss_analysis.forward_workspace
    for ref in output_refs:
        nodes.edges.add((ref.index, loss_node))
    nodes.entries[loss_node] = NodeEntry(
        node=loss_node, kind="loss", name="loss", inputs=tuple(output_refs),
        reads_inputs=tuple(range(len(output_refs))), output_bytes=loss_analysis.output_bytes,
        workspace_bytes=loss_analysis.forward_workspace, cost=nodes.cost[loss_node],
    )


def _fixed_bytes(model, optimizer, in_specs, label_specs, small_residuals: int, weight_grads: str,
                 replicas: int) -> dict[str, int]:
    """The parts of the fixed bytes (module docstring), as ``SideTable.fixed_bytes_breakdown``."""
    trainable = _variables_bytes(model.trainable_variables)
    return {
        "params": trainable,
        "param_grads": trainable if weight_grads == "fixed" else 0,
        "optimizer_slots": _variables_bytes(optimizer.variables),
        "non_trainable": _variables_bytes(model.non_trainable_variables),
        "inputs": sum(tensor_bytes(s.shape, s.dtype, "the input batch", "input") for s in in_specs),
        "labels": sum(tensor_bytes(s.shape, s.dtype, "the labels", "labels") for s in label_specs),
        "small_residuals": small_residuals,
        "all_reduce": trainable if replicas > 1 else 0,
        "update_temporaries": 0,
    }


def _variables_bytes(variables) -> int:
    return sum(_variable_sizes(variables))


def _variable_sizes(variables) -> list[int]:
    return [int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables]
