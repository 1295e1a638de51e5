"""Opening a layer: the calls and operations inside a layer's ``call`` as a graph of their own.

A node of the graph is one call of one layer, and a layer's output and everything its
gradient reads are one value: a transformer block that is one layer leaves the planner
nothing to choose inside it. Keras builds functional models by calling layers and
``keras.ops`` on symbolic ``KerasTensor`` s; calling a layer's own ``call`` on fresh symbolic
inputs records its sublayer calls and operations the same way, as a ``keras.Function``
that :mod:`~tfremat.extract.layer_graph` walks like a nested model (the finer nodes of
issue 22; how Keras records a layer call: ``keras.src.layers.layer.Layer.__call__``).

A layer is opened only when the recorded graph computes what the layer computes, with the
same trainable and non-trainable state, so that the step trains exactly as the whole call
would. Otherwise it stays one node, for a reason (:class:`KeptWhole`) that the walker logs
once per layer class (:func:`log_kept`), when:

* it is a Keras RNN: its time steps run in one ``while`` loop, and splitting the loop into
  chunks of steps would change the layer's call (not done);
* it owns variables that its recorded sublayer calls do not cover (a weight read by an op in
  ``call``, a seed generator drawn in ``call``, a sublayer called on a constant, which Keras
  runs at once instead of recording): their gradients or state updates would be lost;
* it calls a sublayer with ``training=False`` while training (a frozen batch norm): the
  step calls every layer with ``training=True``, as ``model.fit`` does;
* its compute dtype differs from a floating input's dtype (mixed precision: ``__call__``
  casts inputs before ``call``, which calling ``call`` itself would skip);
* a tensor it reads or returns carries a Keras mask (``Embedding(mask_zero=True)`` or
  ``Masking`` upstream, a ``compute_mask``): Keras hands masks from layer to layer as an
  attribute of the tensors, not as graph values, so the recorded graph would compute without
  them (a ``MultiHeadAttention`` opened so attended to padding, issue 33), and its outputs
  would lose the mask the layer sets on them;
* its ``call`` cannot run symbolically (a raw TensorFlow op on a ``KerasTensor``, Python
  control flow on tensor values): the error is the reason.

``granularity`` chooses how far to open (:data:`GRANULARITIES`): ``"layer"`` opens nothing
(a node per top-level layer call, nested models flattened), ``"sublayer"`` opens every layer
that holds sublayers (custom blocks, ``MultiHeadAttention``, keras-hub's transformer blocks),
``"op"`` also opens variable-free layers whose ``call`` composes several operations. A
subclassed ``keras.Model`` called inside a functional model is opened as a custom block is
(the way tfremat plans a subclassed model); a functional one is flattened by the walker.

A layer kept whole that holds most of the model's layers leaves the planner almost nothing to
recompute: a subclassed model that stays one node is planned as input, one call and the
loss, and every budget below checkpoint-all is out of reach. That is logged as a warning
with what to change (issue 33); any other kept layer at INFO level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import keras
import tensorflow as tf

from tfremat.runtime.internals import (
    CallContext,
    get_keras_mask,
    keras_global_attribute,
    set_keras_global_attribute,
)

__all__ = ["GRANULARITIES", "DEFAULT_GRANULARITY", "KeptWhole", "open_layer", "log_kept", "detach_recorded_nodes"]

logger = logging.getLogger(__name__)

GRANULARITIES = ("layer", "sublayer", "op")
DEFAULT_GRANULARITY = "sublayer"

#: Share of the model's leaf layers above which a layer kept whole is warned about.
DOMINANT_SHARE = 0.5

_reasons_logged: set[tuple[str, str, bool]] = set()


@dataclasses.dataclass(frozen=True)
class KeptWhole:
    """Why a layer with sublayers stays one node, and what its author can change.

    Attributes:
        reason: what keeps the recorded graph from computing what the call computes.
        remedy: the change to the layer's code that lets it be opened.
    """

    reason: str
    remedy: str


def open_layer(layer, node, granularity: str, inputs):
    """The graph of ``layer``'s call at ``node`` as a ``keras.Function``; else None, or a
    :class:`KeptWhole` saying why a layer that holds sublayers stays one node (see the
    module docstring), for the caller to log (:func:`log_kept`).

    ``inputs`` are the call's tensor arguments, in the order ``tf.nest.flatten((args,
    kwargs))`` gives them, as ``KerasTensor`` s whose shapes are as known as the model's
    input shapes make them; the function's inputs are placeholders of those shapes, and its
    outputs are the call's outputs flattened, so the caller maps them to the references of
    the enclosing graph. Its nodes are recorded on the sublayers;
    :func:`detach_recorded_nodes` removes them once walked.
    """
    if granularity == "layer" or not isinstance(layer, keras.layers.Layer):
        return None
    has_sublayers = bool(layer._flatten_layers(include_self=False, recursive=False))
    if not has_sublayers and granularity != "op":
        return None
    if isinstance(layer, keras.layers.RNN):
        return KeptWhole("a Keras RNN runs its time steps in one while loop; chunks of steps are not separate calls",
                         "a smaller batch or shorter sequences lower its memory; recomputation cannot split it")
    if not has_sublayers and layer.variables:
        return None
    kept = _dtype_reason(layer, node) or _mask_reason(node)
    if kept:
        return kept
    try:
        function = _record_call(layer, node, inputs)
    except Exception as error:  # noqa: BLE001 - any failure to run symbolically keeps the layer whole
        return KeptWhole(f"its call does not run on symbolic tensors ({type(error).__name__}: {error})",
                         "write that step with keras.ops (keras.ops.cond, keras.ops.where) in place of Python "
                         "control flow on tensor values or raw TensorFlow ops")
    kept = _coverage_reason(layer, function) or _inference_call_reason(function)
    single_operation = not has_sublayers and _operation_count(function) < 2
    if kept or single_operation:
        detach_recorded_nodes(function)
        return kept if has_sublayers else None
    return function


def log_kept(layer, kept: KeptWhole, share: float) -> None:
    """Logs why ``layer`` stays one node, once per layer class and reason: as a warning
    with the remedy when the layer holds more than :data:`DOMINANT_SHARE` of the model's
    leaf layers (``share``), since recomputation then has next to nothing to choose from and
    budgets much below checkpoint-all cannot be met; else at INFO level."""
    dominant = share > DOMINANT_SHARE
    key = (type(layer).__qualname__, kept.reason, dominant)
    if key in _reasons_logged:
        return
    _reasons_logged.add(key)
    if dominant:
        logger.warning(
            "layer %r (%s) stays one node with %.0f%% of the model's layers inside it, so recomputation has next "
            "to nothing to choose and budgets much below checkpoint-all cannot be met: %s. To let tfremat split "
            "it, %s",
            layer.name, type(layer).__name__, 100 * share, kept.reason, kept.remedy,
        )
    else:
        logger.info("layer %r (%s) stays one node: %s", layer.name, type(layer).__name__, kept.reason)


def detach_recorded_nodes(function) -> None:
    """Removes the nodes :func:`open_layer` recorded from the sublayers' and operations'
    node lists, so that extraction leaves the model's layers as it found them (a sublayer's
    ``output`` property, for one, refuses a layer with several inbound nodes)."""
    links = []
    for nodes in function._nodes_by_depth.values():
        for node in nodes:
            if node.operation is not None:
                links.append((node.operation._inbound_nodes, node))
                links.extend((parent.operation._outbound_nodes, node) for parent in node.parent_nodes)
    for node_list, node in links:
        if node in node_list:
            node_list.remove(node)


def _record_call(layer, node, inputs):
    """Calls ``layer.call`` on fresh symbolic inputs shaped like ``inputs`` in place of
    ``node``'s tensor arguments.

    A ``StatelessScope`` discards any state update that runs eagerly while recording (a
    seed drawn outside a sublayer call, say); such a layer then fails the coverage check.
    The call runs with ``training=True`` and in a Keras call context with
    ``training=True``, as inside ``model.fit``, so that a ``call`` that branches on
    ``training`` in Python (noise or dropout under ``if training:``) records its training
    branch, and a sublayer records ``training=False`` only when the layer passes it
    explicitly. The node's own recorded ``training`` is replaced, not kept: Keras records
    the default of the call's signature there (``def call(self, x, training=False)``), and
    a functional model in ``fit`` replaces it with ``training=True`` too
    (``keras.src.models.functional.operation_fn``).
    """
    flat = [t for t in tf.nest.flatten((node.arguments.args, node.arguments.kwargs)) if isinstance(t, keras.KerasTensor)]
    placeholders = {id(t): keras.Input(batch_shape=known.shape, dtype=t.dtype, sparse=t.sparse)
                    for t, known in zip(flat, inputs)}

    def symbolic(value):
        return placeholders[id(value)] if isinstance(value, keras.KerasTensor) else value

    args = tf.nest.map_structure(symbolic, tuple(node.arguments.args))
    kwargs = tf.nest.map_structure(symbolic, dict(node.arguments.kwargs))
    if layer._call_has_training_arg:
        kwargs["training"] = True
    context = CallContext(entry_layer=layer)
    context.set_value("training", True)
    outer = keras_global_attribute("current_call_ctx")
    set_keras_global_attribute("current_call_ctx", context)
    try:
        with keras.StatelessScope(), _traced_output_specs(layer):
            outputs = layer.call(*args, **kwargs)
    finally:
        set_keras_global_attribute("current_call_ctx", outer)
    outputs = tf.nest.flatten(outputs)
    if len(outputs) != len(node.outputs) or not all(isinstance(t, keras.KerasTensor) for t in outputs):
        raise ValueError(f"it returned {len(outputs)} values where the recorded call returned {len(node.outputs)} tensors")
    return keras.Function([placeholders[id(t)] for t in flat], outputs)


@contextlib.contextmanager
def _traced_output_specs(layer):
    """Lets a sublayer whose own ``compute_output_spec`` refuses the arguments its parent
    passes fall back to tracing its ``call`` (Keras's generic ``Operation`` rule).

    Keras records a sublayer call by asking the sublayer for its output spec; keras-hub's
    ``CachedMultiHeadAttention`` inherits ``MultiHeadAttention.compute_output_spec``, which
    takes no ``cache`` argument, so its decoder could not be recorded at all. The fallback is
    an instance attribute, removed on exit.
    """
    patched = []
    for sublayer in layer._flatten_layers(include_self=False):
        if type(sublayer).compute_output_spec is keras.layers.Layer.compute_output_spec:
            continue
        own = sublayer.compute_output_spec

        def tolerant(*args, _own=own, _sublayer=sublayer, **kwargs):
            try:
                return _own(*args, **kwargs)
            except TypeError:
                return keras.Operation.compute_output_spec(_sublayer, *args, **kwargs)

        object.__setattr__(sublayer, "compute_output_spec", tolerant)
        patched.append(sublayer)
    try:
        yield
    finally:
        for sublayer in patched:
            object.__delattr__(sublayer, "compute_output_spec")


def _coverage_reason(layer, function) -> KeptWhole | None:
    """Why the recorded graph does not carry the layer's whole state, or None when it does."""
    covered = set()
    for nodes in function._nodes_by_depth.values():
        for recorded in nodes:
            covered.update(id(v) for v in getattr(recorded.operation, "variables", ()))
    missing = [v for v in layer.variables if id(v) not in covered]
    if missing:
        names = ", ".join(v.path for v in missing[:3]) + (" ..." if len(missing) > 3 else "")
        return KeptWhole(
            f"its call uses {len(missing)} variable(s) outside its recorded sublayer calls ({names}); their gradients "
            "or updates would be lost",
            "move each such variable into a sublayer that call() calls on its inputs (a weight read by an op into a "
            "small layer that owns it; random draws into keras.layers.Dropout or GaussianNoise called on a tensor, "
            "not a constant)",
        )
    return None


def _inference_call_reason(function) -> KeptWhole | None:
    """Why a sublayer called in inference mode keeps the layer whole, or None."""
    for nodes in function._nodes_by_depth.values():
        for recorded in nodes:
            if recorded.arguments is not None and recorded.arguments.kwargs.get("training") is False:
                return KeptWhole(
                    f"it calls {recorded.operation.name!r} with training=False",
                    "pass the call's own training on (training=training); to freeze a BatchNormalization, set its "
                    "trainable = False, which keeps it in inference mode while training",
                )
    return None


def _dtype_reason(layer, node) -> KeptWhole | None:
    """Why mixed precision keeps the layer whole, or None."""
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    for tensor in tf.nest.flatten((node.arguments.args, node.arguments.kwargs)):
        if isinstance(tensor, keras.KerasTensor) and "float" in tensor.dtype and tensor.dtype != compute:
            return KeptWhole(f"an input of dtype {tensor.dtype} is cast to its compute dtype {compute} on entry",
                             f"give it inputs already in {compute} (keras.ops.cast them in the layer before it)")
    return None


def _mask_reason(node) -> KeptWhole | None:
    """Why a Keras mask on the call's tensors keeps the layer whole, or None."""
    tensors = tf.nest.flatten((node.arguments.args, node.arguments.kwargs)) + list(node.outputs)
    if any(isinstance(t, keras.KerasTensor) and get_keras_mask(t) is not None for t in tensors):
        return KeptWhole("its inputs or outputs carry a Keras mask, which the layers inside it would not receive",
                         "compute the mask as a tensor (keras.ops.not_equal(token_ids, 0)) and pass it as an argument "
                         "(MultiHeadAttention's attention_mask=), with mask_zero=False upstream")
    return None


def _operation_count(function) -> int:
    return sum(1 for nodes in function._nodes_by_depth.values() for n in nodes if not n.is_input and n.operation is not None)

