"""The side table: what the compiled training step needs to run each graph node.

The planning core's :class:`~tfremat.graph.DFGraph` carries numbers only. Everything that
ties a node back to Keras (the layer object, how its call arguments are wired, which
variables it owns, where its upstream gradients come from) lives here, indexed by the same
node ids. The compiled step (``tfremat.static_graph``) reads nothing else from the model.

Conventions every consumer relies on:

* **Forward node** (``kind == "forward"``): one call of one layer. Its value is the
  layer's output (a tuple when the layer returns several tensors; ``TensorRef.output_index``
  picks one in ``tf.nest.flatten`` order). Call it as
  ``entry.layer(*args, **kwargs)`` where ``args, kwargs = entry.fill_in(resolve)`` and
  add ``training=True`` when ``entry.takes_training``.
* **Loss node** (``kind == "loss"``, flagged backward as in Checkmate): reads the model
  outputs (``entry.inputs``, one ``TensorRef`` per model output) and the labels; its value is
  the loss and the gradient of the loss with respect to every model output.
* **Backward node** (``kind == "backward"``): the vector-Jacobian product of one forward
  node. The gradient flowing into flattened output ``k`` of the layer is the sum of the
  contributions in ``entry.output_grads[k]``; each :class:`GradRef` names the backward
  node (or the loss node) and the position among *that* node's flattened inputs whose
  gradient it produces. Its value is the gradient with respect to each flattened input of
  the forward call (``None`` where ``entry.input_needs_grad`` is False); the gradients of
  ``entry.trainable_variables`` go to the optimizer and are counted in fixed bytes. A layer
  called more than once owns the same variables in each of its forward nodes, and their
  weight gradients add up. A split backward (``extract(..., implementations=True)``, MONeT
  appendix D) is two backward nodes of one forward node: ``gradient_part == "weights"``
  takes only the weight gradients (its value is empty), and the ``"inputs"`` node after it
  only the input gradients, reading nothing of the forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from tfremat.errors import ExtractionError

__all__ = ["TensorRef", "GradRef", "NodeEntry", "SideTable", "NodeKind", "flatten_by_name"]

NodeKind = Literal["forward", "loss", "backward"]


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor of the training step comes from.

    Attributes:
        source: ``"node"`` for the output of a forward graph node, ``"model_input"`` for a
            tensor of the input batch.
        index: the graph node id, or the position in ``SideTable.input_specs``.
        output_index: for a node whose layer returns several tensors, which one (in
            ``tf.nest.flatten`` order); 0 otherwise.
    """

    source: Literal["node", "model_input"]
    index: int
    output_index: int = 0


@dataclasses.dataclass(frozen=True)
class GradRef:
    """One contribution to the gradient flowing into a layer output.

    Attributes:
        node: the backward node (or the loss node) that produces the contribution.
        input_index: which of that node's flattened inputs the contribution is the
            gradient of (for the loss node: which model output).
    """

    node: int
    input_index: int


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """Everything about one graph node that the graph itself does not carry.

    Attributes:
        node: the graph node id.
        kind: ``"forward"``, ``"loss"`` or ``"backward"``.
        name: the graph node name (the layer's path for nested models).
        layer: the Keras layer (for forward and backward nodes), or None for the loss.
        forward_node: for a backward node, the forward node it differentiates; for a
            forward node, itself; None for the loss.
        backward_node: for a forward node, its backward node, or None when no gradient
            passes through it (it only reads the input batch and owns no trainable weights).
        call_args: the positional arguments of the forward call, with :class:`TensorRef`
            where a tensor goes and the recorded constants elsewhere.
        call_kwargs: the keyword arguments, same convention.
        inputs: the tensors of the forward call, flattened (``tf.nest.flatten`` of
            ``(call_args, call_kwargs)`` restricted to tensors). For the loss: the model
            outputs.
        takes_training: pass ``training=True`` to the call (a Keras layer: Keras hands it
            on to its sublayers even when the layer's ``call`` has no ``training``
            argument).
        one_gradient_call: the backward takes one gradient call on a non-persistent tape
            (the call runs a while loop or calls a function:
            :func:`tfremat.runtime.tape.takes_one_gradient_call`,
            decided by the extraction on its trace of the call).
        trainable_variables: the variables whose gradients this node's backward computes.
        num_outputs: how many tensors the forward call returns.
        input_needs_grad: per entry of ``inputs``, whether the backward node must produce
            its gradient (it comes from a node that itself has a backward node).
        output_grads: backward nodes only: per flattened output of the layer, the
            contributions that add up to its upstream gradient.
        reads_inputs: backward nodes only: positions in ``inputs`` that the layer's gradient
            reads (measured by tracing the VJP).
        reads_output: backward nodes only: the layer's gradient reads the layer's output.
        gradient_part: backward nodes only: ``"all"``, or for a split backward
            ``"weights"`` (the weight gradients) or ``"inputs"`` (the input gradients).
        output_bytes: bytes of the forward output (forward), of the loss value plus the
            gradients of the model outputs (loss), or of the input gradients (backward).
        residual_bytes: forward nodes only: bytes of the internal tensors the gradient
            reads that grow with the batch; they are part of the node's graph value (see
            :mod:`tfremat.extract.assembly`).
        small_residual_bytes: forward nodes only: internal residuals that do not grow with
            the batch (per-channel statistics, cast weights), counted in fixed bytes.
        workspace_bytes: transient bytes while the node runs, as put in the graph.
        cost: the node's cost as put in the graph.
        clears_masks, output_masks: Keras masks an opened layer clears on its inputs
            before this call, and sets on this call's outputs
            (:class:`~tfremat.extract.layer_graph.LayerCall`).
    """

    node: int
    kind: NodeKind
    name: str
    layer: Any = None
    forward_node: int | None = None
    backward_node: int | None = None
    call_args: tuple = ()
    call_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: tuple[TensorRef, ...] = ()
    takes_training: bool = False
    one_gradient_call: bool = False
    trainable_variables: tuple = ()
    num_outputs: int = 1
    input_needs_grad: tuple[bool, ...] = ()
    output_grads: tuple[tuple[GradRef, ...], ...] = ()
    reads_inputs: tuple[int, ...] = ()
    reads_output: bool = False
    gradient_part: Literal["all", "weights", "inputs"] = "all"
    output_bytes: int = 0
    residual_bytes: int = 0
    small_residual_bytes: int = 0
    workspace_bytes: int = 0
    cost: float = 0.0
    clears_masks: tuple[TensorRef, ...] = ()
    output_masks: tuple[TensorRef | None, ...] = ()

    def fill_in(self, resolve: Callable[[TensorRef], Any]) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` with every :class:`TensorRef` replaced by ``resolve(ref)``.

        Args:
            resolve: maps a reference to the tensor the step holds for it.

        Returns:
            ``(args, kwargs)`` ready for ``entry.layer(*args, **kwargs)``.
        """
        import tensorflow as tf  # the side table itself stays importable without TF

        def swap(value):
            return resolve(value) if isinstance(value, TensorRef) else value

        args = tf.nest.map_structure(swap, self.call_args)
        kwargs = tf.nest.map_structure(swap, dict(self.call_kwargs))
        return tuple(args), kwargs


def flatten_by_name(values, names: Sequence[str], what: str) -> list:
    """Model inputs or labels as one tensor per model input or output, in model order.

    A dict is matched by name, as ``model.fit`` matches it (``tf.nest.flatten`` would
    order it by sorted key, which pairs the wrong tensors whenever the names are not in
    sorted order); anything else is flattened as it is.

    Raises:
        ExtractionError: a dict whose keys are not exactly the names.
    """
    import tensorflow as tf  # the side table itself stays importable without TF

    if not isinstance(values, Mapping):
        return tf.nest.flatten(values)
    if set(values) != set(names):
        raise ExtractionError(
            f"{what} is a dict with keys {sorted(map(str, values))}, but the model's {what} are named "
            f"{list(names)}; key the dict by those names, or pass a list in that order"
        )
    return [values[name] for name in names]


@dataclasses.dataclass(frozen=True)
class SideTable:
    """The framework half of an extraction, indexed by graph node id.

    Attributes:
        model: the Keras model the graph was extracted from.
        entries: one :class:`NodeEntry` per graph node, ``entries[i].node == i``.
        input_specs: the input batch signature (``tf.TensorSpec`` per model input, flattened).
        label_specs: the label signature (per model output).
        outputs: per model output (flattened), the forward node tensor it is.
        loss_node: the loss node id.
        loss_fn: ``loss_fn(labels, preds, sample_weight=None) -> scalar`` on the lists of
            labels and predictions, one per model output (see
            :func:`tfremat.extract.resolve_loss`).
        optimizer: the Keras optimizer (built, so its slot variables exist).
        batch_size: the batch size the sizes were measured for.
        fixed_bytes_breakdown: the parts of the graph's fixed bytes (``params``,
            ``param_grads``, ``optimizer_slots``, ``inputs``, ``labels``,
            ``small_residuals``, ``non_trainable``, and under a strategy with several
            replicas ``all_reduce``: the all-reduce's buffers, :func:`tfremat.extract.assembly.assemble`).
        weight_grads: ``"transient"``: the graph counts a layer's weight gradients in its
            backward node's workspace, so the step must hand them to the optimizer right
            after that node (apply the update or free them); ``"fixed"``: they are
            held from their backward node to the updates at the end of the step
            (:attr:`tfremat.graph.DFGraph.weight_grads_to_end`; ``param_grads`` in the
            breakdown keeps only gradients no backward node makes).
        input_names, output_names: the model's input and output names, in model order; a
            dict of inputs or labels is matched by them (:meth:`flat_inputs`).
        update_bytes: per node, the optimizer update's temporaries counted in its
            workspace (:mod:`tfremat.extract.optimizer_update`): a backward node's layer's
            with transient weight gradients (with fixed ones they are fixed bytes,
            ``fixed_bytes_breakdown["update_temporaries"]``).
    """

    model: Any
    entries: tuple[NodeEntry, ...]
    input_specs: tuple
    label_specs: tuple
    outputs: tuple[TensorRef, ...]
    loss_node: int
    loss_fn: Callable
    optimizer: Any
    batch_size: int
    fixed_bytes_breakdown: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    weight_grads: str = "transient"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    update_bytes: Mapping[int, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def flat_inputs(self, x) -> list:
        """A batch of inputs as one tensor per model input, a dict matched by input name."""
        return flatten_by_name(x, self.input_names, "inputs")

    def flat_labels(self, y) -> list:
        """Labels as one tensor per model output, a dict matched by output name."""
        return flatten_by_name(y, self.output_names, "outputs")

    def __getitem__(self, node: int) -> NodeEntry:
        return self.entries[node]

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def forward_entries(self) -> tuple[NodeEntry, ...]:
        """Forward nodes in execution order."""
        return tuple(e for e in self.entries if e.kind == "forward")

    @property
    def backward_entries(self) -> tuple[NodeEntry, ...]:
        """Backward nodes in execution order."""
        return tuple(e for e in self.entries if e.kind == "backward")

    def breakdown(self) -> list[dict]:
        """Per node: kind, name and the byte and cost numbers, JSON-able (for benchmarks)."""
        return [
            {
                "node": e.node,
                "kind": e.kind,
                "name": e.name,
                "output_bytes": e.output_bytes,
                "residual_bytes": e.residual_bytes,
                "small_residual_bytes": e.small_residual_bytes,
                "workspace_bytes": e.workspace_bytes,
                "cost": e.cost,
                "reads_inputs": list(e.reads_inputs),
                "reads_output": e.reads_output,
            }
            for e in self.entries
        ]
