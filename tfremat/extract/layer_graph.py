"""Walks a Keras 3 model's functional graph into a flat list of layer calls.

Keras keeps the layer DAG of a functional model in ``model._nodes_by_depth`` (this model's
nodes only; ``layer._inbound_nodes`` would mix in other models sharing a layer) and a built
``Sequential`` exposes its functional graph as ``model._functional``. Nested functional
models appear as one call in their parent; they are flattened here so that every graph
node is one call of one leaf layer, which is the granularity the compiled step recomputes.
Layers that compose sublayers (a custom transformer block, ``MultiHeadAttention``) are
opened the same way, as far as the granularity asks (:mod:`~tfremat.extract.opening`). A
subclassed top-level model is walked through a functional wrapper built from a batch
(:func:`functional_model`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import traceback
import warnings

import keras
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.opening import (
    DEFAULT_GRANULARITY,
    GRANULARITIES,
    MASK_CHANGED,
    MASK_UNTRACED,
    KeptWhole,
    detach_recorded_nodes,
    known_output_spec,
    log_kept,
    mask_sources,
    may_clear_masks,
    may_open,
    open_layer,
)
from tfremat.extract.side_table import TensorRef
from tfremat.runtime.internals import get_keras_mask

__all__ = [
    "LayerCall", "walk_model", "functional_view", "require_functional", "functional_model", "model_input_names",
    "model_output_names",
    "trainable_variables", "regularized_variables", "takes_training",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One call of a leaf layer, in execution order, before graph ids are assigned.

    Attributes:
        position: the call's index among all calls (forward execution order).
        name: the layer's path through nested models, suffixed when a layer is called twice.
        layer: the Keras layer.
        call_args, call_kwargs: the call's arguments with :class:`TensorRef` for tensors;
            ``TensorRef("node", p)`` refers to call position ``p`` here.
        inputs: the tensor references, flattened.
        num_outputs: number of flattened output tensors.
        output_shapes: static shapes (without the batch dimension) of the outputs.
        clears_masks: the first call of an opened layer that clears its inputs' Keras masks
            (``MultiHeadAttention``): those inputs, whose masks the calls after it no longer
            see (:mod:`~tfremat.extract.opening`, "Keras masks").
        output_masks: per output, the Keras mask that the opened layer whose output it is
            sets on it, as a reference to the mask's value (a node the graph has read
            before this call); empty when none.
        input_masks: per input, the spec of the Keras mask it carries when the step first
            calls the layer (None: none; dimensions unknown when the model was built are
            None), which the call's analysis sets on its inputs; empty when none does.
    """

    position: int
    name: str
    layer: object
    call_args: tuple
    call_kwargs: dict
    inputs: tuple[TensorRef, ...]
    num_outputs: int
    output_shapes: tuple
    clears_masks: tuple[TensorRef, ...] = ()
    output_masks: tuple[TensorRef | None, ...] = ()
    input_masks: tuple[tf.TensorSpec | None, ...] = ()


def functional_view(model) -> object | None:
    """The model's functional graph, or None when it has none (a subclassed model)."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if hasattr(model, "_nodes_by_depth") and getattr(model, "_nodes_by_depth", None):
        return model
    return None


def require_functional(model):
    """The model's functional graph (:func:`functional_view`), for the entry points that
    read the layer DAG or ``model.inputs`` without a batch to build one from (a subclassed
    model has neither until it is called: :func:`functional_model` wraps it from a batch).

    Raises:
        ExtractionError: a Sequential model not built yet (no ``keras.Input``, never
            called), or a subclassed model; each message says what to do.
    """
    graph = functional_view(model)
    if graph is not None:
        return graph
    if isinstance(model, keras.Sequential):
        raise ExtractionError(
            f"Sequential model {model.name!r} is not built; start it with a keras.Input or call it once on a batch",
            layer=model.name,
        )
    raise ExtractionError(
        f"model {model.name!r} is a subclassed model without a functional graph (layers in __init__, logic in "
        "call), whose input shapes come from a batch only: plan it on your data (tfremat.fit, "
        "tfremat.plan_model(model, budget, x, y), RematCallback), or wrap it: inputs = keras.Input(shape); "
        "wrapped = keras.Model(inputs, model(inputs))",
        layer=model.name,
    )


def functional_model(model, x):
    """``model`` itself when it has a functional graph; for a subclassed model, the
    functional model a user would wrap it in: one ``keras.Input`` per array of ``x``
    (arrays or ``tf.TensorSpec`` s with the batch axis, in x's structure: one, a list, a
    dict), the batch axis left open, and ``model`` called on them. The wrapper holds the
    model as its one layer, so its variables are the model's and a step compiled from it
    trains the user's model; the model's call is opened into its layer calls as any
    subclassed model called in a functional one is (:mod:`~tfremat.extract.opening`).

    Raises:
        ExtractionError: an unbuilt Sequential model or no ``x`` for a subclassed one
            (:func:`require_functional`), or a ``call`` that cannot run on symbolic inputs
            (Python control flow on tensor values, a raw TensorFlow op that needs eager
            values), naming the cause and the line; the model is left as it was.
    """
    if functional_view(model) is not None or isinstance(model, keras.Sequential) or x is None:
        return require_functional(model)

    def symbolic_input(array, name=None):
        return keras.Input(shape=tuple(array.shape[1:]), dtype=tf.as_dtype(array.dtype).name, name=name)

    if isinstance(x, dict):
        inputs = {key: symbolic_input(array, key) for key, array in x.items()}
    else:
        inputs = tf.nest.map_structure(symbolic_input, x)
    built = model.built
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Keras's "could not build" advice; the error says more
            outputs = model(inputs)
    except Exception as error:  # any error of the user's call: reported with its cause, never swallowed
        model.built = built
        raise ExtractionError(
            f"model {model.name!r} is a subclassed model whose call cannot run on symbolic inputs "
            f"({_error_cause(error)}{_user_line(model, error)}), so tfremat cannot open it into layer calls: write "
            "that step with keras.ops (keras.ops.cond, keras.ops.where), or keep the model and take its gradients "
            "from tfremat.value_and_grad(loss_fn, budget, x, y) in place of tf.GradientTape",
            layer=model.name,
        ) from error
    return keras.Model(inputs, outputs, name=model.name)


def _error_cause(error: Exception) -> str:
    """The first sentence of what went wrong: Keras wraps a symbolic call's error in
    several lines of advice after "Error encountered:"."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    text = text.split("Error encountered:", 1)[-1].strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first.split('. ')[0].rstrip('.')}"


def _user_line(model, error: Exception) -> str:
    """``; in file line N: code`` of the innermost frame in the model class's source file, if any."""
    try:
        source = inspect.getsourcefile(type(model))
    except TypeError:  # a class defined where its source is unknown (an interactive session)
        return ""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == source]
    if not frames:
        return ""
    frame = frames[-1]
    return f"; in {os.path.basename(frame.filename)} line {frame.lineno}: {(frame.line or '').strip()}"


def trainable_variables(layer) -> list:
    """A layer's trainable variables; none for a Keras operation that is not a layer
    (``x + y`` or ``keras.ops.relu(x)`` in a functional model)."""
    return list(getattr(layer, "trainable_variables", ()))


def regularized_variables(layer) -> list:
    """A layer's trainable variables that carry a weight regularizer."""
    return [v for v in trainable_variables(layer) if getattr(v, "regularizer", None) is not None]


def takes_training(layer) -> bool:
    """Whether the step calls ``layer`` with ``training=True``: every Keras layer takes it,
    as ``model.fit`` gives it. Keras passes it on to the sublayers through its call
    context even when the layer's own ``call`` has no ``training`` argument, so a custom
    block's Dropout and BatchNormalization train as in ``model.fit`` (not in inference
    mode). A plain Keras ``Operation`` (``keras.ops`` in a functional model) takes no such
    argument."""
    return isinstance(layer, keras.layers.Layer)


def model_input_names(model) -> list[str]:
    """The names a dict of inputs is keyed by, in the order of ``model.inputs``: the keys
    of a model built on a dict of inputs, else the input tensors' names."""
    keys = _dict_keys(getattr(model, "_inputs_struct", None))
    return keys or [getattr(t, "name", None) or f"input_{k}" for k, t in enumerate(model.inputs)]


def model_output_names(model) -> list[str]:
    """The names a dict of labels (or losses) is keyed by, in the order of ``model.outputs``:
    the keys of a model returning a dict, else ``model.output_names`` (``output_k`` where
    Keras gives none)."""
    keys = _dict_keys(getattr(model, "_outputs_struct", None))
    if keys:
        return keys
    names = list(getattr(model, "output_names", None) or [])
    if len(names) != len(model.outputs):
        return [f"output_{k}" for k in range(len(model.outputs))]
    return names


def _dict_keys(structure) -> list[str] | None:
    """The keys of a flat dict of tensors in flattened order (Keras sorts them), else None."""
    if not isinstance(structure, dict):
        return None
    return tf.nest.flatten({key: key for key in structure})


def walk_model(model, granularity: str = DEFAULT_GRANULARITY,
               input_shapes=None) -> tuple[list[LayerCall], list[TensorRef]]:
    """Lists every leaf layer call of ``model`` and where each model output comes from.

    Args:
        model: a built Functional or Sequential Keras model.
        granularity: how far layers are opened, one of
            :data:`~tfremat.extract.opening.GRANULARITIES`.
        input_shapes: the shape of each flattened model input (the batch dimension is
            ignored); where the model leaves a dimension open (a keras-hub backbone's
            sequence length), an opened layer is recorded at these shapes. None: the
            model's own input shapes.

    Returns:
        ``(calls, outputs)``: the calls in execution order and one reference per flattened
        model output.

    Raises:
        ExtractionError: the model has no functional graph (:func:`require_functional`),
            a model output is one of its inputs (nothing to train), or an unknown
            granularity.
    """
    if granularity not in GRANULARITIES:
        raise ExtractionError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    graph = require_functional(model)
    shapes = input_shapes if input_shapes is not None else [t.shape for t in graph.inputs]
    walker = _Walker(granularity, len(_leaf_layers(model)))
    inputs = []
    for index, (tensor, shape) in enumerate(zip(graph.inputs, shapes)):
        ref = TensorRef("model_input", index)
        walker.symbolic[ref] = keras.KerasTensor(tuple(shape), dtype=tensor.dtype, sparse=tensor.sparse)
        inputs.append(ref)
    outputs = walker.walk(graph, inputs, "")
    for ref in outputs:
        if ref.source == "model_input":
            raise ExtractionError(
                f"model {model.name!r} returns its input {ref.index} unchanged; every output must "
                "be computed by a layer",
                layer=model.name,
            )
    return walker.calls, outputs


def _leaf_layers(layer) -> list:
    """The layers inside ``layer`` (nested ones included) that compute and hold no sublayers."""
    return [inner for inner in layer._flatten_layers(include_self=False)
            if not isinstance(inner, keras.layers.InputLayer)
            and not inner._flatten_layers(include_self=False, recursive=False)]


class _Walker:
    """Walks functional graphs, nested models and opened layers into one list of calls.

    ``symbolic`` holds a ``KerasTensor`` per reference with every dimension the input
    shapes fix, the batch included: a layer is opened by recording its call on such
    tensors, since a layer like keras-hub's decoder builds its causal mask from the
    sequence length and the batch size, and keras-hub's Gemma attention reshapes to the
    shape it reads from its query (:mod:`~tfremat.extract.opening`, "Shapes"). It is
    sparse only where a model input is declared sparse and the calls from it keep it so.

    ``masks_touched`` holds the references that an earlier call of a layer that may clear
    Keras masks read (:func:`may_clear_masks`, a ``MultiHeadAttention`` kept whole) or
    whose masks an opened call cleared: a layer whose masked input is one of them stays one
    node (:data:`MASK_CHANGED`), since the mask it sees in ``model.fit`` may not be the one
    recorded when the model was built. ``value_masks`` holds, per reference, the Keras mask
    its tensor carries as the call that made it left it (the attribute ``Layer.__call__``
    set, or the opened layer's ``output_masks``), as the compiled step hands masks on:
    with ``masks_touched``, the masks a call kept whole reads (``LayerCall.input_masks``).
    """

    def __init__(self, granularity: str, model_leaf_layers: int):
        self.granularity = granularity
        self.model_leaf_layers = max(model_leaf_layers, 1)
        self.calls: list[LayerCall] = []
        self.names_seen: dict[str, int] = {}
        self.symbolic: dict[TensorRef, keras.KerasTensor] = {}
        self.masks_touched: set[TensorRef] = set()
        self.value_masks: dict[TensorRef, keras.KerasTensor] = {}

    def walk(self, graph, input_refs, prefix) -> list[TensorRef]:
        """Appends the calls of ``graph`` to ``calls``; returns the refs of its outputs."""
        refs: dict[int, TensorRef] = {id(t): r for t, r in zip(graph.inputs, input_refs)}
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for node in graph._nodes_by_depth[depth]:
                op = node.operation
                if node.is_input or op is None:
                    continue
                if any(id(t) not in refs for t in node.input_tensors):
                    raise ExtractionError(
                        f"layer {op.name!r}: an input tensor is not produced by the model's graph; "
                        "is the layer fed by a tensor from another model?",
                        layer=op.name,
                    )
                tensor_args = [t for t in tf.nest.flatten((node.arguments.args, node.arguments.kwargs))
                               if isinstance(t, keras.KerasTensor)]
                arg_refs = [refs[id(t)] for t in tensor_args]
                inner = functional_view(op) if isinstance(op, keras.Model) else None
                if inner is not None:
                    outs = self._walk_nested(op, inner, node, refs, prefix)
                else:
                    outs = self._open_or_add(op, node, refs, tensor_args, arg_refs, prefix)
                for t, r in zip(node.outputs, outs):
                    refs[id(t)] = r
        return [refs[id(t)] for t in graph.outputs]

    def _open_or_add(self, op, node, refs, tensor_args, arg_refs, prefix) -> list[TensorRef]:
        """Walks ``op``'s call at ``node`` opened (:func:`open_layer`) when it can be, else
        adds it as one call; returns the references of its outputs.

        The Keras masks its arguments and outputs carry become values of the graph first
        (:func:`mask_sources`; the nodes that compute them are walked before the opened
        calls, so they run before them), then the opened call is walked with the masks as
        inputs after its arguments; its first call gets the inputs whose masks it clears,
        and the calls that make its outputs the masks Keras sets on them.
        """
        if not may_open(op, self.granularity):
            return self._add_call(op, node, refs, arg_refs, prefix)
        masks = [get_keras_mask(t) for t in tensor_args]
        output_masks = [get_keras_mask(t) for t in node.outputs]
        mask_functions: dict[int, tuple] = {}
        opened = self._mask_functions(masks + output_masks, refs, node, mask_functions)
        if opened is None and any(m is not None and r in self.masks_touched for m, r in zip(masks, arg_refs)):
            opened = MASK_CHANGED
        if opened is None:
            known = [None if m is None else self._known_mask(m, refs, mask_functions) for m in masks]
            opened = open_layer(op, node, self.granularity, [self.symbolic[r] for r in arg_refs], known)
        if isinstance(opened, KeptWhole):
            log_kept(op, opened, len(_leaf_layers(op)) / self.model_leaf_layers)
            opened = None
        if opened is None:
            return self._add_call(op, node, refs, arg_refs, prefix)
        try:
            for mask_id, (function, sources) in mask_functions.items():
                (refs[mask_id],) = self.walk(function, sources, prefix)
            start = len(self.calls)
            mask_refs = [refs[id(m)] for m in masks if m is not None]
            outs = self.walk(opened.function, arg_refs + mask_refs, f"{prefix}{op.name}/")
        finally:
            detach_recorded_nodes(opened.function)
        cleared = tuple(arg_refs[p] for p in opened.clears_masks)
        if cleared and start < len(self.calls):
            first = self.calls[start]
            self.calls[start] = dataclasses.replace(first, clears_masks=first.clears_masks + cleared)
            self.masks_touched.update(cleared)
            # The step clears them before the first call: no call of the opened layer reads them.
            for position in range(start, len(self.calls)):
                call = self.calls[position]
                kept = tuple(None if ref in cleared else mask for ref, mask in zip(call.inputs, call.input_masks))
                self.calls[position] = dataclasses.replace(
                    call, input_masks=kept if any(mask is not None for mask in kept) else ())
        for out, mask in zip(outs, output_masks):
            if mask is not None and out.source == "node" and out.index >= start:
                producer = self.calls[out.index]
                given = list(producer.output_masks or [None] * producer.num_outputs)
                given[out.output_index] = refs[id(mask)]
                self.calls[out.index] = dataclasses.replace(producer, output_masks=tuple(given))
                self.value_masks.setdefault(out, mask)
        return outs

    def _mask_functions(self, masks, refs, node, functions: dict) -> KeptWhole | None:
        """Fills ``functions`` with ``id(mask) -> (keras.Function, source references)`` for
        each of ``masks`` that is not a value of the walk yet; :data:`MASK_UNTRACED` when
        one is not computed from the walk's tensors by recorded operations (or only through
        ``node``'s own outputs)."""
        own_outputs = {id(t) for t in node.outputs}
        for mask in masks:
            if mask is None or id(mask) in refs or id(mask) in functions:
                continue
            sources = mask_sources(mask, set(refs) | own_outputs)
            if sources is None or any(id(t) in own_outputs for t in sources):
                return MASK_UNTRACED
            functions[id(mask)] = (keras.Function(sources, [mask]), [refs[id(t)] for t in sources])
        return None

    def _known_mask(self, mask, refs, functions: dict):
        """``mask`` as a ``KerasTensor`` with the shape the walk's input shapes fix."""
        if id(mask) in refs:
            return self.symbolic[refs[id(mask)]]
        function, sources = functions[id(mask)]
        (spec,) = tf.nest.flatten(function.compute_output_spec([self.symbolic[r] for r in sources]))
        return keras.KerasTensor(spec.shape, dtype=spec.dtype)

    def _walk_nested(self, model, inner, node, refs, prefix) -> list[TensorRef]:
        inner_inputs = [refs[id(t)] for t in node.input_tensors]
        if len(inner_inputs) != len(inner.inputs):
            raise ExtractionError(
                f"nested model {model.name!r} is called with {len(inner_inputs)} tensors but has "
                f"{len(inner.inputs)} inputs; keyword tensors to nested models are not supported",
                layer=model.name,
            )
        return self.walk(inner, inner_inputs, f"{prefix}{model.name}/")

    def _add_call(self, op, node, refs, arg_refs, prefix) -> list[TensorRef]:
        position = len(self.calls)

        def to_ref(value):
            return refs[id(value)] if isinstance(value, keras.KerasTensor) else value

        args = tf.nest.map_structure(to_ref, tuple(node.arguments.args))
        kwargs = tf.nest.map_structure(to_ref, dict(node.arguments.kwargs))
        name = prefix + op.name
        seen = self.names_seen.get(name, 0)
        self.names_seen[name] = seen + 1
        if seen:
            name = f"{name}#{seen}"
        masks = [None if ref in self.masks_touched else self.value_masks.get(ref) for ref in arg_refs]
        self.calls.append(
            LayerCall(
                position=position,
                name=name,
                layer=op,
                call_args=args,
                call_kwargs=kwargs,
                inputs=tuple(v for v in tf.nest.flatten((args, kwargs)) if isinstance(v, TensorRef)),
                num_outputs=len(node.outputs),
                output_shapes=tuple(tuple(t.shape[1:]) for t in node.outputs),
                input_masks=tuple(None if m is None else tf.TensorSpec(m.shape, m.dtype) for m in masks)
                if any(m is not None for m in masks) else (),
            )
        )
        if may_clear_masks(op):
            self.masks_touched.update(arg_refs)
        outputs = [TensorRef("node", position, index) for index in range(len(node.outputs))]
        self.value_masks.update((ref, get_keras_mask(t)) for ref, t in zip(outputs, node.outputs)
                                if get_keras_mask(t) is not None)
        for ref, tensor in zip(outputs, self._output_tensors(op, node, arg_refs)):
            self.symbolic[ref] = tensor
        return outputs

    def _output_tensors(self, op, node, arg_refs) -> list:
        """The call's outputs as ``KerasTensor`` s with the shapes its inputs fix: the
        layer's output spec on the known input shapes, its open dimensions filled in
        (:func:`known_output_spec`; the recorded shapes when that fails), sparse only where
        an input is (Keras marks a tensor times a number sparse). Only needed while a layer
        may be opened."""
        if self.granularity == "layer":
            return list(node.outputs)
        inputs = [self.symbolic[r] for r in arg_refs]
        known = iter(inputs)

        def swap(value):
            return next(known) if isinstance(value, keras.KerasTensor) else value

        args = tf.nest.map_structure(swap, tuple(node.arguments.args))
        kwargs = tf.nest.map_structure(swap, dict(node.arguments.kwargs))
        try:
            spec = tf.nest.flatten(known_output_spec(op, args, kwargs))
        except Exception as error:  # noqa: BLE001 - any failure leaves the recorded (less known) shapes
            logger.debug("layer %s: no output spec at known shapes (%s)", op.name, error)
            spec = node.outputs
        if len(spec) != len(node.outputs):
            spec = node.outputs
        any_sparse = any(tensor.sparse for tensor in inputs)
        return [keras.KerasTensor(s.shape, dtype=s.dtype, sparse=s.sparse and any_sparse) for s in spec]
