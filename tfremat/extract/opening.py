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
* a Keras mask on a tensor it reads or returns cannot be made a value of the graph, or an
  earlier call may have cleared the mask its input carries (see "Keras masks" below);
* its ``call`` cannot run symbolically (a raw TensorFlow op on a ``KerasTensor``, Python
  control flow on tensor values): the error is the reason;
* its recorded graph fails at the batch's shapes: a shape it read from a tensor whose
  dimensions were unknown when recorded went into an argument (see "Shapes" below).

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

Shapes
------
An operation's arguments are recorded as they were given: ``ops.reshape(y, ops.shape(x))``
records the tuple ``ops.shape(x)`` returned for the symbolic ``x``, and the step replays that
tuple on every batch. So a call is recorded on tensors with every dimension the batch fixes
(the walker's, :mod:`~tfremat.extract.layer_graph`), and what its sublayers make keeps them
known: a sublayer whose own shape rule leaves a dimension open that its inputs fix
(keras-hub's ``EinsumDense(output_shape=(None, heads, size))`` for the sequence axis) gets
the shape its ``call`` makes when traced at those inputs (:func:`known_output_spec`). A
shape read while a dimension is still unknown would replay ``None`` (keras-hub's
``CachedGemmaAttention._apply_rope`` recorded ``(8, None, 4, 16)`` for a reshape): a recorded
graph with an unknown dimension inside is traced at the batch's shapes, and the layer stays
whole when that fails (:func:`_unknown_shape_reason`).

Keras marks a tensor times a Python number sparse (``Multiply.compute_output_spec`` reads the
number's missing ``sparse`` attribute as True), and a sublayer whose output spec is traced
then gets a sparse placeholder its ``call`` cannot read (keras-hub's ``RMSNormalization``
after ``GemmaBackbone``'s embedding scale). No operation makes a sparse tensor out of dense
ones, so a recording whose inputs are all dense hands its sublayers dense specs.

Keras masks
-----------
Keras hands a mask (``Embedding(mask_zero=True)``, ``Masking``, a ``compute_mask``) from
layer to layer as an attribute of the tensors (``_keras_mask``), not as a graph value:
``Layer.__call__`` fills a call's mask arguments in from its arguments' attributes
(``mask=``, ``query_mask=``) and sets its outputs' from ``compute_mask``. A call recorded
on placeholders without them would compute unmasked (issue 33: an opened
``MultiHeadAttention`` attended to padding). So an opened call is recorded with a mask
placeholder on each masked argument (:func:`_record_call`), and the walker
(:mod:`~tfremat.extract.layer_graph`) makes each mask a value of the graph: the operations
Keras recorded for it (the ``not_equal`` on the token ids, :func:`mask_sources`) become
nodes that the opened calls read. What the whole call did to the attributes the compiled
step does at the first calls (:mod:`tfremat.static_graph.interpreter`): the masks the call
clears on its arguments (``OpenedCall.clears_masks``), and the masks it sets on its
outputs, which the node that computes such a mask hands to the call that makes the output
(``LayerCall.output_masks``; the graph has that edge, so the mask exists by then).

A mask that is no such value keeps the layer whole (:data:`MASK_UNTRACED`), and so does a
mask that an earlier call may have cleared in place (:data:`MASK_CHANGED`): the mask
recorded when the model was built is then not the one ``model.fit`` hands the layer. In
Keras 3.15 the one layer that clears is ``MultiHeadAttention`` (its ``call`` sets the masks
of ``query``, ``value`` and ``key`` to None); ``Layer.__call__`` reads its arguments' masks
and sets its outputs', never its arguments' (:func:`may_clear_masks`).

A layer kept whole is measured with the masks its first call reads in the step
(``LayerCall.input_masks``, :func:`tfremat.extract.analysis.analyze_call`): its masked
path, not the unmasked one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re

import keras
import tensorflow as tf

from tfremat.runtime.internals import (
    CallContext,
    CallSpec,
    get_keras_mask,
    keras_global_attribute,
    set_keras_global_attribute,
    set_keras_mask,
)

__all__ = [
    "GRANULARITIES", "DEFAULT_GRANULARITY", "KeptWhole", "OpenedCall", "open_layer", "log_kept",
    "detach_recorded_nodes", "may_open", "may_clear_masks", "mask_sources", "known_output_spec", "MASK_UNTRACED",
    "MASK_CHANGED",
]

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


@dataclasses.dataclass(frozen=True)
class OpenedCall:
    """A layer call recorded as a graph (:func:`open_layer`).

    Attributes:
        function: the recorded ``keras.Function``; its inputs are the call's tensor
            arguments, then one mask placeholder per argument given a mask, in order.
        clears_masks: positions of the tensor arguments whose Keras masks the call clears
            (``MultiHeadAttention`` clears its inputs' masks before its sublayers run).
    """

    function: object
    clears_masks: tuple[int, ...]


#: Why a layer stays one node when a mask it reads cannot be made a value of the graph.
MASK_UNTRACED = KeptWhole(
    "a Keras mask on its inputs or outputs is not computed from the model's tensors by operations Keras recorded",
    "compute the mask as a tensor (keras.ops.not_equal(token_ids, 0)) and pass it as an argument "
    "(MultiHeadAttention's attention_mask=), with mask_zero=False upstream",
)
#: Why a layer stays one node when an earlier call may have changed its input's mask.
MASK_CHANGED = KeptWhole(
    "an earlier layer call that may clear Keras masks in place (a MultiHeadAttention, a layer holding one, or a "
    "layer running code outside Keras) reads the same masked input, so the mask it reads in model.fit may not be "
    "the one recorded",
    "pass the masks as arguments (MultiHeadAttention's query_mask=, value_mask= or attention_mask=), so that no "
    "call depends on what another one changed in place",
)


def open_layer(layer, node, granularity: str, inputs, masks=None):
    """The graph of ``layer``'s call at ``node`` as an :class:`OpenedCall`; else None, or a
    :class:`KeptWhole` saying why a layer that holds sublayers stays one node (see the
    module docstring), for the caller to log (:func:`log_kept`).

    ``inputs`` are the call's tensor arguments, in the order ``tf.nest.flatten((args,
    kwargs))`` gives them, as ``KerasTensor`` s whose shapes are as known as the model's
    input shapes make them; the function's inputs are placeholders of those shapes, and its
    outputs are the call's outputs flattened, so the caller maps them to the references of
    the enclosing graph. ``masks``, aligned with ``inputs``: the Keras mask each argument
    carries, as a ``KerasTensor`` of known shape, or None; each becomes the mask of its
    argument's placeholder and an input of the function after the arguments (module
    docstring, "Keras masks"). Its nodes are recorded on the sublayers;
    :func:`detach_recorded_nodes` removes them once walked.
    """
    if not may_open(layer, granularity):
        return None
    has_sublayers = bool(layer._flatten_layers(include_self=False, recursive=False))
    if isinstance(layer, keras.layers.RNN):
        return KeptWhole("a Keras RNN runs its time steps in one while loop; chunks of steps are not separate calls",
                         "a smaller batch or shorter sequences lower its memory; recomputation cannot split it")
    if not has_sublayers and layer.variables:
        return None
    kept = _dtype_reason(layer, node)
    if kept:
        return kept
    masks = list(masks or [None] * len(inputs))
    try:
        function, clears = _record_call(layer, node, inputs, masks)
    except Exception as error:  # noqa: BLE001 - any failure to run symbolically keeps the layer whole
        return KeptWhole(f"its call does not run on symbolic tensors ({type(error).__name__}: {error})",
                         "write that step with keras.ops (keras.ops.cond, keras.ops.where) in place of Python "
                         "control flow on tensor values or raw TensorFlow ops")
    kept = (_coverage_reason(layer, function) or _inference_call_reason(function)
            or _unknown_shape_reason(function))
    single_operation = not has_sublayers and _operation_count(function) < 2
    if kept or single_operation:
        detach_recorded_nodes(function)
        return kept if has_sublayers else None
    return OpenedCall(function, clears)


def may_open(layer, granularity: str) -> bool:
    """Whether :func:`open_layer` considers opening ``layer`` at ``granularity`` at all: a
    Keras layer that holds sublayers, or at ``"op"`` any Keras layer."""
    if granularity == "layer" or not isinstance(layer, keras.layers.Layer):
        return False
    return granularity == "op" or bool(layer._flatten_layers(include_self=False, recursive=False))


def may_clear_masks(layer) -> bool:
    """Whether a call of ``layer`` may clear the Keras masks of its tensor arguments in
    place, so that a later call on the same tensors reads none (module docstring, "Keras
    masks"): it is or holds a ``MultiHeadAttention`` (a holder's ``call`` may pass its
    arguments to it), or it or a layer it holds runs code outside Keras (a user layer's
    ``call``, a ``Lambda``'s function), which may clear a mask as ``MultiHeadAttention``
    does. Keras's other layers leave their arguments' masks as they are; an operation
    (``keras.ops``) is no layer and reads no mask."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    return any(_own_call_may_clear_masks(inner) for inner in layer._flatten_layers(include_self=True, recursive=True))


def _own_call_may_clear_masks(layer) -> bool:
    if isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.Lambda)):
        return True
    module = type(layer).call.__module__ or ""
    return module.split(".")[0] != "keras"


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


def mask_sources(mask, known: set[int]) -> list | None:
    """The tensors among ``known`` (ids of ``KerasTensor`` s the caller has values for)
    from which Keras's recorded operations compute ``mask``, for a ``keras.Function`` from
    them to the mask; None when its history reaches a model input or an operation outside
    ``known`` without passing one (a mask made outside the graph), so it cannot be made a
    value of the graph (module docstring, "Keras masks")."""
    sources, seen, stack = {}, set(), [mask]
    while stack:
        tensor = stack.pop()
        if id(tensor) in known:
            sources.setdefault(id(tensor), tensor)
            continue
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        history = getattr(tensor, "_keras_history", None)
        if history is None or history.operation is None:
            return None
        recorded = history.operation._inbound_nodes[history.node_index]
        if recorded.is_input or not recorded.input_tensors:
            return None
        stack.extend(recorded.input_tensors)
    return list(sources.values())


def _record_call(layer, node, inputs, masks):
    """Calls ``layer.call`` on fresh symbolic inputs shaped like ``inputs`` in place of
    ``node``'s tensor arguments, each carrying a fresh placeholder for its mask in
    ``masks`` (None: no mask); returns the ``keras.Function`` and the positions whose mask
    the call cleared.

    Where an argument carries a mask, the mask arguments ``Layer.__call__`` would fill in
    from the attributes are filled in (:func:`_fill_in_mask_arguments`).

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
    placeholders = {id(t): keras.Input(batch_shape=known.shape, dtype=t.dtype, sparse=known.sparse)
                    for t, known in zip(flat, inputs)}
    mask_placeholders = [None if mask is None else keras.Input(batch_shape=mask.shape, dtype=mask.dtype)
                         for mask in masks]
    for tensor, mask in zip(flat, mask_placeholders):
        if mask is not None:
            set_keras_mask(placeholders[id(tensor)], mask)

    def symbolic(value):
        return placeholders[id(value)] if isinstance(value, keras.KerasTensor) else value

    args = tf.nest.map_structure(symbolic, tuple(node.arguments.args))
    kwargs = tf.nest.map_structure(symbolic, dict(node.arguments.kwargs))
    if any(mask is not None for mask in mask_placeholders):
        _fill_in_mask_arguments(layer, args, kwargs)
    if layer._call_has_training_arg:
        kwargs["training"] = True
    context = CallContext(entry_layer=layer)
    context.set_value("training", True)
    outer = keras_global_attribute("current_call_ctx")
    set_keras_global_attribute("current_call_ctx", context)
    try:
        dense = not any(placeholder.sparse for placeholder in placeholders.values())
        with keras.StatelessScope(), _recording_output_specs(layer, dense):
            outputs = layer.call(*args, **kwargs)
    finally:
        set_keras_global_attribute("current_call_ctx", outer)
    outputs = tf.nest.flatten(outputs)
    if len(outputs) != len(node.outputs) or not all(isinstance(t, keras.KerasTensor) for t in outputs):
        raise ValueError(f"it returned {len(outputs)} values where the recorded call returned {len(node.outputs)} tensors")
    cleared = tuple(position for position, (tensor, mask) in enumerate(zip(flat, mask_placeholders))
                    if mask is not None and get_keras_mask(placeholders[id(tensor)]) is None)
    function_inputs = [placeholders[id(t)] for t in flat] + [m for m in mask_placeholders if m is not None]
    return keras.Function(function_inputs, outputs), cleared


def _fill_in_mask_arguments(layer, args, kwargs: dict) -> None:
    """Fills in ``kwargs`` the mask arguments that ``Layer.__call__`` fills in from its
    tensor arguments' Keras masks before it calls ``call`` (``mask=`` for a call of one
    tensor argument, else ``query_mask=`` for ``query`` and so on), where the call takes
    one and is not given it. Keras records them in the node only when it did not convert
    the arguments first (not for ``MultiHeadAttention``'s two), so in ``model.fit`` they
    come from the attributes; recording ``call`` directly skips ``__call__``."""
    spec = CallSpec(layer._call_signature, layer._call_context_args, args, dict(kwargs))
    tensors = spec.tensor_arguments_dict
    if len(tensors) == 1:
        wanted = {"mask": next(iter(tensors.values()))}
    else:
        wanted = {f"{name}_mask": value for name, value in tensors.items()}
    for name, value in wanted.items():
        if name in spec.arguments_dict and spec.arguments_dict[name] is None:
            kwargs[name] = tf.nest.map_structure(get_keras_mask, value)


@contextlib.contextmanager
def _recording_output_specs(layer, dense: bool):
    """Makes each sublayer of ``layer`` give, while its call is recorded, the output spec
    :func:`known_output_spec` gives (every dimension its inputs fix known; module docstring,
    "Shapes"), from dense arguments where ``dense`` (the recording's inputs are all dense, so
    a sparse mark inside is Keras's product with a number), and fall back to tracing its
    ``call`` where its own ``compute_output_spec`` refuses the arguments its parent passes.

    Keras records a sublayer call by asking the sublayer for its output spec; keras-hub's
    ``CachedMultiHeadAttention`` inherits ``MultiHeadAttention.compute_output_spec``, which
    takes no ``cache`` argument, so its decoder could not be recorded at all. The specs are
    instance attributes, removed on exit.
    """
    patched = []
    for sublayer in layer._flatten_layers(include_self=False):
        own = sublayer.compute_output_spec

        def recorded_spec(*args, _own=own, _sublayer=sublayer, **kwargs):
            if dense:
                args, kwargs = tf.nest.map_structure(_dense_spec, (args, kwargs))
            return known_output_spec(_sublayer, args, kwargs, _own)

        object.__setattr__(sublayer, "compute_output_spec", recorded_spec)
        patched.append(sublayer)
    try:
        yield
    finally:
        for sublayer in patched:
            object.__delattr__(sublayer, "compute_output_spec")


def known_output_spec(operation, args, kwargs, own=None):
    """``operation``'s output spec for ``args`` and ``kwargs`` (``KerasTensor`` s among
    them), with every dimension that their shapes fix known: where the operation's own rule
    (``own``, default its ``compute_output_spec``) leaves an output dimension open although
    every argument's shape is known, that dimension is the one its ``call`` makes when traced
    at those shapes (Keras's generic rule, ``keras.Operation.compute_output_spec``); the
    dtypes and sparse marks stay the own rule's (module docstring, "Shapes"). The traced
    rule also answers where the own one refuses the arguments with a ``TypeError``.
    """
    own = own or operation.compute_output_spec
    try:
        spec = own(*args, **kwargs)
    except TypeError:
        return keras.Operation.compute_output_spec(operation, *args, **kwargs)
    tensors = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, keras.KerasTensor)]
    outputs = tf.nest.flatten(spec)
    if not tensors or not all(_fully_known(t.shape) for t in tensors):
        return spec
    if all(_fully_known(t.shape) for t in outputs if isinstance(t, keras.KerasTensor)):
        return spec
    try:
        traced = tf.nest.flatten(keras.Operation.compute_output_spec(operation, *args, **kwargs))
    except Exception as error:  # noqa: BLE001 - a call that does not trace keeps its own rule's spec
        logger.debug("%s: output spec not traced at known shapes (%s)", operation.name, error)
        return spec
    if len(traced) != len(outputs):
        return spec
    return tf.nest.pack_sequence_as(spec, [_filled_in(o, t) for o, t in zip(outputs, traced)])


def _filled_in(own, traced):
    """``own`` (a ``KerasTensor`` or another output) with the open dimensions that
    ``traced`` knows, where the two agree on the rank and every known dimension."""
    if not isinstance(own, keras.KerasTensor) or not isinstance(traced, keras.KerasTensor):
        return own
    if len(own.shape) != len(traced.shape) or any(o is not None and o != t for o, t in zip(own.shape, traced.shape)):
        return own
    shape = tuple(t if o is None else o for o, t in zip(own.shape, traced.shape))
    return keras.KerasTensor(shape, dtype=own.dtype, sparse=own.sparse)


def _dense_spec(value):
    if isinstance(value, keras.KerasTensor) and value.sparse:
        return keras.KerasTensor(value.shape, dtype=value.dtype)
    return value


def _fully_known(shape) -> bool:
    return None not in tuple(shape)


def _unknown_shape_reason(function) -> KeptWhole | None:
    """Why a recorded graph with a dimension unknown inside it keeps the layer whole, or None.

    Every dimension of the recording's inputs known, a tensor inside it with one unknown
    may have had its shape read into an operation's argument, which the step would replay
    with ``None`` in it (module docstring, "Shapes"). The graph is traced at its inputs'
    shapes, as the step traces it; None when that succeeds or nothing inside is unknown.
    """
    if not all(_fully_known(t.shape) for t in function.inputs):
        return None
    unknown = [(t.shape, recorded.operation.name) for depth in sorted(function._nodes_by_depth, reverse=True)
               for recorded in function._nodes_by_depth[depth] if recorded.operation is not None
               for t in recorded.outputs if not _fully_known(t.shape)]
    if not unknown:
        return None
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in function.inputs]
    try:
        tf.function(function.call, autograph=False).get_concrete_function(specs)
    except Exception as error:  # noqa: BLE001 - any failure at the batch's shapes keeps the layer whole
        shape, maker = unknown[0]
        return KeptWhole(
            f"its recorded graph fails at the batch's shapes ({type(error).__name__}: {_first_cause(error)}): a "
            f"shape read from a tensor with a dimension unknown when recorded (the first: {shape} from {maker!r}) "
            "went into an argument",
            "let the sublayer that makes that tensor compute every dimension its inputs fix (compute_output_shape), "
            "or read the shape inside a sublayer's own call, where it is the batch's",
        )
    return None


def _first_cause(error) -> str:
    """The first sentence of what ``error`` says, without the lines Keras wraps a layer's
    error in ("Exception encountered when calling ...", its arguments) or its colours."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()]
    said = [line for line in lines if line and not line.startswith(("Exception encountered", "Arguments received", "•"))]
    return said[0].split(". ")[0] if said else type(error).__name__


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


def _operation_count(function) -> int:
    return sum(1 for nodes in function._nodes_by_depth.values() for n in nodes if not n.is_input and n.operation is not None)

