"""``extract``: a Keras model, an input signature, a loss and an optimizer -> graph + side table.

Memory model (what the graph's numbers mean, so that the planner's simulator describes a
training step that records each forward call on a tape and asks it for the gradient later,
which is what plain ``tf.GradientTape`` training and tfremat's compiled step both do):

* **Forward node** value = the layer's output + its batch-sized *residuals*: the internal
  tensors its gradient reads (measured, see :mod:`tfremat.extract.analysis`). The tape keeps
  them from the forward call until the backward node runs, and a recomputation recreates
  them together with the output, so they live and die with the node. A while loop's
  accumulators (a Keras RNN with ``unroll=False``) are such residuals, sized by running the
  call. The edge ``forward -> backward`` of a layer exists exactly when its gradient reads
  its output or a batch-sized residual; otherwise the output is freed after its last
  forward reader.
* **Loss node** value = the scalar loss + the gradient of the loss with respect to every
  model output (one op computes both, so they are one value).
* **Backward node** value = the gradients with respect to the layer's inputs that need one.
  Weight gradients (``weight_grads="transient"``, the default) are counted in the backward
  node's workspace: tfremat's compiled step makes the statement after a layer's backward
  wait for the layer's optimizer update
  (:func:`tfremat.static_graph.interpreter.order_updates`), so they die right after the
  node. Counting all parameter gradients as fixed instead over-predicted the measured
  checkpoint-all peak by 60-65% on VGG16 and ResNet50. A plain ``tf.GradientTape`` step
  has no such order, and TensorFlow's executor (one inter-op thread) runs most filter
  gradients and updates only after the whole input-gradient chain, holding each
  convolution's input and output gradient until then: at 64x64, batch 2, ResNet50's plain
  step requested 5.8% and MobileNetV2's 10.9% above the checkpoint-all prediction, which
  describes the compiled step (``benchmarks/results/extraction.md``). ``weight_grads="fixed"``
  keeps them resident for the whole step. The default, ``"auto"``, chooses ``"fixed"`` when
  the optimizer clips, accumulates or loss-scales gradients, or a layer with weights is
  called twice (its first gradient waits for the second); see
  :func:`weight_gradient_lifetime`.
* **Workspace** = the peak of the bytes the node's operations request while it runs in
  isolation, minus its value and what it reads (see :mod:`tfremat.extract.analysis`); 0 with ``cost_model="flops"``.
  The simulator runs one node at a time, so workspace is meant for sequential op execution
  (``TF_NUM_INTEROP_THREADS=1``). With several inter-op threads TensorFlow overlaps
  independent ops, e.g. a convolution's input and filter gradients, each with a 32 MiB
  scratch buffer on CPU; the measured plain-step peak of the small test conv net then rose
  from 39 MB to 52 MB, which no sequential model predicts. Profile and train with the same
  setting; the profile cache key includes it.
* **Fixed bytes** = parameters (+ parameter gradients with ``weight_grads="fixed"``) + optimizer slot variables +
  non-trainable variables (batch-norm statistics, dropout seeds) + the input batch + the
  labels + the residuals that do not grow with the batch (per-channel statistics). Each part
  is in ``SideTable.fixed_bytes_breakdown``.

Node order: forward calls in Keras execution order, the loss, then the backward nodes in
reverse forward order (the order plain backpropagation runs them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import numbers
import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import keras
import numpy as np
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.analysis import (
    CallAnalysis,
    analyze_call,
    analyze_loss,
    tensor_bytes,
)
from tfremat.extract.layer_graph import (
    LayerCall,
    model_input_names,
    model_output_names,
    require_functional,
    walk_model,
)
from tfremat.extract.side_table import (
    GradRef,
    NodeEntry,
    SideTable,
    TensorRef,
    flatten_by_name,
)
from tfremat.graph import DFGraph
from tfremat.runtime.internals import LossFunctionWrapper
from tfremat.runtime.memory import default_device
from tfremat.runtime.state import (
    forget_global_seed_generator,
    global_seed_generator,
    stateful_variables,
)

__all__ = [
    "Extraction", "extract", "resolve_loss", "per_output", "cache_dir", "weight_gradient_lifetime", "refuse_unmodelled_training",
    "COST_MODELS",
]

logger = logging.getLogger(__name__)

COST_MODELS = ("profile", "flops")
_CACHE_VERSION = 11
# Weight-sized buffers a weight regularizer's penalty gradient adds next to its variable's
# gradient in the compiled step (CompiledStep._add_weight_penalties), counted in the
# backward node's workspace: the upstream broadcast to the variable's shape and the product
# (an L2 penalty's gradient of a 512x512 kernel plus the sum with the gradient alone:
# allocator peak 2.0 MiB above the gradient; in a 6 x Dense(512) step, batch 2, 1 MiB above
# the unregularized step's requested bytes).
_PENALTY_BUFFERS = 2


@dataclasses.dataclass(frozen=True)
class Extraction:
    """The result of :func:`extract`.

    Attributes:
        graph: the data-flow graph for the planners.
        side_table: the Keras half, indexed by node id.
        seconds: wall-clock seconds of the whole extraction.
        profile_seconds: seconds spent tracing and profiling layer calls (0 on a cache hit).
        cache_hit: the per-call measurements came from the on-disk cache.
    """

    graph: DFGraph
    side_table: SideTable
    seconds: float
    profile_seconds: float
    cache_hit: bool


def cache_dir() -> str:
    """Where profiles are cached: ``$TFREMAT_CACHE_DIR``, else ``~/.cache/tfremat``."""
    return os.environ.get("TFREMAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfremat")


def _one_loss(loss, where: str) -> Callable:
    """A Keras loss object, its name or a callable, as a Keras ``Loss``.

    Names and plain functions are wrapped in Keras's ``LossFunctionWrapper`` (not exported
    by ``keras.losses``; ``model.compile`` wraps them in the same class): the wrapper
    applies the output's Keras mask (an ``Embedding(mask_zero=True)`` upstream) and
    Keras's mean over the batch, so the loss equals the one ``model.fit`` trains on.
    """
    if isinstance(loss, str):
        try:
            function = keras.losses.get(loss)
        except ValueError as err:
            raise ExtractionError(
                f"{where} {loss!r} is not a Keras loss name ({err}); pass a keras.losses object or a callable",
                layer="loss",
            ) from None
        name = loss
    elif callable(loss):
        # TensorFlow name scopes take [A-Za-z0-9_.\\/>-]: a lambda's "<lambda>" is refused.
        function, name = loss, re.sub(r"[^A-Za-z0-9_.-]", "_", getattr(loss, "__name__", "") or "").strip("_") or "loss"
    else:
        raise ExtractionError(
            f"{where} must be a Keras loss, its name or a callable, got {type(loss).__name__}", layer="loss"
        )
    if isinstance(function, keras.losses.Loss):
        if function.reduction in (None, "none"):
            raise ExtractionError(
                f"{where} {function.name!r} has reduction=None (one loss per sample, which Keras differentiates "
                "as their sum); give it reduction='sum' for that, or the default 'sum_over_batch_size'",
                layer="loss",
            )
        return function
    return LossFunctionWrapper(function, name=name)


def per_output(value, output_names: Sequence[str], what: str, default) -> list:
    """``value`` given as in ``model.compile`` (one for all outputs, a list with one per
    output, or a dict keyed by output name) as a list with one entry per output: the
    extraction's losses and weights, and the labels :func:`tfremat.measure.synthetic_batch`
    makes for them.

    Raises:
        ExtractionError: a dict names no output, or a list's length is not the number of
            outputs.
    """
    count = len(output_names)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(output_names))
        if unknown:
            raise ExtractionError(f"{what} names no model output {unknown}; the outputs are {list(output_names)}",
                                  layer="loss")
        return [value.get(name, default) for name in output_names]
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ExtractionError(f"{what} has {len(value)} entries for a model with {count} outputs", layer="loss")
        return list(value)
    return [value] * count


def resolve_loss(loss, num_outputs: int, output_names: Sequence[str] = (), loss_weights=None) -> Callable:
    """Turns a loss as ``model.compile`` takes it into ``fn(labels, preds, sample_weight=None)
    -> scalar``.

    ``labels`` and ``preds`` are lists with one tensor per model output; ``sample_weight``
    (one weight per sample, or None) weights every output's loss, as Keras's compiled loss
    does with one array of sample weights.
    ``loss`` is a Keras loss object, its name or a callable applied to every output, or a
    list (one per output, None for an output without loss) or a dict keyed by output name;
    ``loss_weights`` likewise a number, a list or a dict (None: 1 each). The result is
    the weighted sum over outputs of each loss's mean, which is what Keras trains on.

    Raises:
        ExtractionError: a name is not a Keras loss, or the structure does not match the
            model's outputs.
    """
    names = list(output_names) or [f"output_{k}" for k in range(num_outputs)]
    if len(names) != num_outputs:
        raise ExtractionError(f"{len(names)} output names for a model with {num_outputs} outputs", layer="loss")
    losses = [None if item is None else _one_loss(item, "loss")
              for item in per_output(loss, names, "loss", None)]
    if all(item is None for item in losses):
        raise ExtractionError("no loss for any model output", layer="loss")
    weights = per_output(1.0 if loss_weights is None else loss_weights, names, "loss_weights", 1.0)
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights):
        raise ExtractionError(f"loss_weights must be numbers, got {loss_weights!r}", layer="loss")
    terms = [(k, fn, float(w)) for k, (fn, w) in enumerate(zip(losses, weights)) if fn is not None]

    def loss_fn(labels, preds, sample_weight=None):
        total = None
        for k, fn, weight in terms:
            term = tf.reduce_mean(fn(labels[k], preds[k], sample_weight))
            term = term if weight == 1.0 else term * weight
            total = term if total is None else total + term
        return total

    return loss_fn


def _loss_name(loss, loss_weights) -> str:
    """A stable name of a loss (and its weights) for the profile cache's key; a callable's
    name comes with its code's fingerprint, so editing ``def my_loss`` is a new key."""
    def name(item):
        if item is None or isinstance(item, str):
            return repr(item)
        if isinstance(item, Mapping):
            return "{" + ", ".join(f"{k!r}: {name(v)}" for k, v in sorted(item.items())) + "}"
        if isinstance(item, (list, tuple)):
            return "[" + ", ".join(map(name, item)) + "]"
        named = getattr(item, "name", None) or getattr(item, "__name__", None) or repr(item)
        return f"{named}#{code_fingerprint(item)}"

    named = name(loss)
    return named if loss_weights is None else f"{named} weighted {name(loss_weights)}"


def _input_specs(model, sample_batch, input_signature, batch_size) -> tuple[list[tf.TensorSpec], list[tf.TensorSpec]]:
    """The flattened input and label specs, batch dimension included."""
    if sample_batch is not None:
        x, y = sample_batch
        xs = [tf.TensorSpec(np.shape(t), tf.as_dtype(getattr(t, "dtype", np.float32)))
              for t in flatten_by_name(x, model_input_names(model), "inputs")]
        ys = [tf.TensorSpec(np.shape(t), tf.as_dtype(getattr(t, "dtype", np.float32)))
              for t in flatten_by_name(y, model_output_names(model), "outputs")]
        return xs, ys
    if input_signature is not None:
        xs = list(tf.nest.flatten(input_signature))
    else:
        xs = [tf.TensorSpec(t.shape, t.dtype) for t in model.inputs]
    specs = []
    for i, spec in enumerate(xs):
        shape = list(spec.shape)
        if shape and shape[0] is None:
            if batch_size is None:
                raise ExtractionError(
                    f"model input {i} has no batch size; pass batch_size=... or a sample batch",
                    layer=getattr(model.inputs[i], "name", None) if i < len(model.inputs) else None,
                )
            shape[0] = batch_size
        if any(d is None for d in shape):
            name = model.inputs[i].name if i < len(model.inputs) else f"input {i}"
            raise ExtractionError(
                f"model input {name!r} has shape {tuple(shape)} with an unknown dimension; tfremat needs "
                "static shapes: build the model with keras.Input(shape=(H, W, C)) or pass a sample batch",
                layer=name,
            )
        specs.append(tf.TensorSpec(shape, spec.dtype))
    outputs = tf.nest.flatten(model.outputs)
    labels = [tf.TensorSpec([specs[0].shape[0], *o.shape[1:]], o.dtype) for o in outputs]
    return specs, labels


def _trainable(layer) -> list:
    """A layer's trainable variables; none for a Keras operation that is not a layer
    (``x + y`` or ``keras.ops.relu(x)`` in a functional model)."""
    return list(getattr(layer, "trainable_variables", ()))


def _regularized(layer) -> list:
    """A layer's trainable variables that carry a weight regularizer."""
    return [v for v in _trainable(layer) if getattr(v, "regularizer", None) is not None]


def refuse_unmodelled_training(model) -> None:
    """Refuses a model that ``model.fit`` trains on more than its compiled loss.

    The step's graph has one loss node, computed from the outputs and labels with the
    compiled loss, and would silently train without the rest:
    - a ``train_step``, ``compute_loss`` or ``call`` of the model's own class (custom
      training logic, an added penalty, a forward pass other than the layer graph);
    - ``add_loss`` terms. (Activity regularizers appear only once a layer is called; the
      extraction's per-call check refuses those.)

    Weight regularizers (``kernel_regularizer``, ``bias_regularizer``, ...) read only
    their variable: the compiled step adds their penalties and gradients
    (:class:`tfremat.static_graph.compile.CompiledStep`), so they are not refused.

    Raises:
        ExtractionError: naming the overriding method, or the first layer that adds a
            loss and listing all of them.
    """
    for method in ("train_step", "compute_loss", "call"):
        if not getattr(type(model), method).__module__.startswith("keras."):
            raise ExtractionError(
                f"model {model.name!r} overrides {method}; the rematerialized step runs the layer graph with the "
                "compiled loss alone and would silently skip it. Express the model as layers and the loss "
                "through model.compile(loss=...), or train this model without tfremat",
                layer=model.name,
            )
    if len(model.losses) == len(_regularized(model)):
        return
    leaves = [layer for layer in model._flatten_layers(include_self=False) if not layer._layers and layer._losses]
    names = [layer.name for layer in leaves] or [model.name]
    raise ExtractionError(
        f"layers {names} add losses to the model (add_loss); the rematerialized step trains on the compiled "
        "loss and the weight regularizers alone and would drop them. Add the term to the loss function, or "
        "express it as a weight regularizer",
        layer=names[0],
    )


def _check_layer(layer, name: str) -> None:
    """Refuses layers whose recomputation would not be a pure function of its inputs."""
    if getattr(layer, "stateful", False):
        raise ExtractionError(
            f"layer {name!r} is stateful (state carried across batches); recomputing it would advance its "
            "state twice. Use stateful=False, or keep the layer outside the rematerialized model.",
            layer=name,
        )


def _python_state(layer) -> dict:
    """A snapshot of a user layer's plain Python attributes, to catch side effects in ``call``."""
    state = {}
    for key, value in vars(layer).items():
        if isinstance(value, (bool, int, float, str, type(None))):
            state[key] = value
        elif isinstance(value, (list, dict, set)) and not key.startswith("_"):
            state[key] = len(value)
    return state


def _layer_signature(layer) -> str:
    """A description of a layer that is equal for layers that behave identically: its
    class, the fingerprint of that class's code (a user layer edited between two runs
    must not reuse the first run's cached measurements) and its config.

    ``get_config`` may raise anything (Keras raises ``NotImplementedError`` for a layer it
    cannot serialize; a keras-hub decoder block raised ``AttributeError``); such a layer
    is described by its state instead (:func:`_layer_state`)."""
    kind = f"{type(layer).__module__}.{type(layer).__qualname__}#{code_fingerprint(type(layer))}"
    try:
        config = dict(layer.get_config())
    except Exception as error:  # noqa: BLE001 - any failure of user code means "no config"
        logger.debug("layer %s: get_config raised %s; fingerprinted by its state", layer.name, type(error).__name__)
        return f"{kind}~{json.dumps(_layer_state(layer), sort_keys=True, default=str)}"
    config.pop("name", None)
    return f"{kind}:{json.dumps(config, sort_keys=True, default=str)}"


_SCALARS = (bool, int, float, str, type(None))


def _layer_state(layer) -> dict:
    """What distinguishes two instances of one layer class without ``get_config``: its
    plain attributes (numbers, strings, tuples of them; names left out, they differ
    between instances that behave alike), the shapes and dtypes of its weights, and the
    same for every sublayer, in tracking order."""

    def plain(value) -> bool:
        if isinstance(value, (tuple, list)):
            return all(plain(v) for v in value)
        return isinstance(value, _SCALARS)

    def describe(one) -> dict:
        attributes = {
            key: value for key, value in vars(one).items()
            if plain(value) and "name" not in key and "path" not in key
        }
        weights = [(list(w.shape), str(w.dtype)) for w in getattr(one, "_trainable_variables", [])
                   + getattr(one, "_non_trainable_variables", [])]
        return {"class": type(one).__qualname__, "attributes": attributes, "weights": weights}

    return {"layer": describe(layer), "sublayers": [describe(s) for s in getattr(layer, "_flatten_layers", lambda **_: [])(
        include_self=False, recursive=True)]}


_LIBRARY_MODULES = ("keras", "tensorflow", "tf_keras", "builtins", "abc", "typing")


def code_fingerprint(thing) -> str:
    """A digest of the Python code behind a user-defined class or callable.

    For a class: every function defined in it and in its base classes outside Keras and
    TensorFlow (whose code the TensorFlow version in the cache key covers); for a function
    or lambda: its code and default arguments; for another callable object: its class.
    Code objects are hashed with their bytecode, constants (nested functions included) and
    names, so any edit of a body changes the digest. "" when there is no user code.
    """
    if isinstance(thing, type):
        functions = [
            (f"{cls.__qualname__}.{name}", getattr(value, "__func__", value))
            for cls in thing.__mro__ if not _is_library(cls.__module__)
            for name, value in sorted(vars(cls).items())
        ]
    elif hasattr(thing, "__code__"):
        functions = [] if _is_library(getattr(thing, "__module__", None)) else [("", thing)]
    else:
        return code_fingerprint(type(thing))
    functions = [(name, function) for name, function in functions if hasattr(function, "__code__")]
    if not functions:
        return ""
    digest = hashlib.sha256()
    for name, function in functions:
        digest.update(name.encode())
        _hash_code(function.__code__, digest)
        digest.update(repr(getattr(function, "__defaults__", None)).encode())
    return digest.hexdigest()[:12]


def _is_library(module: str | None) -> bool:
    return (module or "").split(".")[0] in _LIBRARY_MODULES


def _hash_code(code, digest) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            _hash_code(constant, digest)
        else:
            digest.update(repr(constant).encode())


def _takes_training(layer) -> bool:
    """Whether the step calls ``layer`` with ``training=True``: every Keras layer takes it,
    as ``model.fit`` gives it. Keras passes it on to the sublayers through its call
    context even when the layer's own ``call`` has no ``training`` argument, so a custom
    block's Dropout and BatchNormalization train; without it they ran in inference mode.
    A plain Keras ``Operation`` (``keras.ops`` in a functional model) takes no such
    argument."""
    return isinstance(layer, keras.layers.Layer)


def _make_caller(call: LayerCall, takes_training: bool) -> Callable[[list], object]:
    def run(flat_inputs):
        it = iter(flat_inputs)

        def swap(value):
            return next(it) if isinstance(value, TensorRef) else value

        args = tf.nest.map_structure(swap, call.call_args)
        kwargs = tf.nest.map_structure(swap, dict(call.call_kwargs))
        if takes_training:
            kwargs["training"] = True
        # Inside a scope, as in a model's call and in the step: TensorFlow refuses a root
        # name scope that starts with "_", which Keras names a layer of a class like
        # ``_Block`` ("__block").
        with tf.name_scope("profile"):
            return call.layer(*args, **kwargs)

    return run


def _cache_key(model, calls, in_specs, label_specs, loss_name, cost_model, device) -> str:
    payload = {
        "version": _CACHE_VERSION,
        "tf": tf.__version__,
        "device": device,
        "inter_op_threads": (tf.config.threading.get_inter_op_parallelism_threads(), os.environ.get("TF_NUM_INTEROP_THREADS")),
        "cost_model": cost_model,
        "loss": loss_name,
        "inputs": [(list(s.shape), s.dtype.name) for s in in_specs],
        "labels": [(list(s.shape), s.dtype.name) for s in label_specs],
        "policy": keras.config.dtype_policy().name,
        "calls": [(_layer_signature(c.layer), [(r.source, r.index, r.output_index) for r in c.inputs]) for c in calls],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _load_cache(key: str, num_calls: int) -> tuple[list[CallAnalysis], CallAnalysis] | None:
    """The cached measurements of every call and of the loss, or None on a miss.

    A damaged entry (an interrupted write, an edit by hand) is a miss: it is logged,
    removed and measured again, as the schedule cache does.
    """
    path = os.path.join(cache_dir(), f"{key}.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        calls = [CallAnalysis.from_dict(d) for d in data["calls"]]
        loss = CallAnalysis.from_dict(data["loss"])
        if len(calls) != num_calls:
            raise ValueError(f"{len(calls)} calls cached for a model with {num_calls}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        logger.warning("profile cache entry %s is damaged (%s); measuring again", path, err)
        os.remove(path)
        return None
    return calls, loss


def _store_cache(key: str, data: dict) -> None:
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{key}.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(directory, f"{key}.json"))


def _variables_bytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def extract(
    model,
    sample_batch=None,
    *,
    input_signature=None,
    loss="categorical_crossentropy",
    loss_weights=None,
    optimizer=None,
    cost_model: str = "profile",
    batch_size: int | None = None,
    repeats: int = 5,
    use_cache: bool = True,
    weight_grads: str = "auto",
) -> Extraction:
    """Extracts the training graph of a Keras model.

    Args:
        model: a built Functional or Sequential ``keras.Model`` (nested models are flattened).
        sample_batch: ``(x, y)`` arrays or tensors; their shapes and dtypes fix the signature.
        input_signature: instead of a sample batch, ``tf.TensorSpec`` per model input; labels
            are shaped like the model outputs. A ``None`` batch dimension needs ``batch_size``.
        loss: a Keras loss object, its name, or ``fn(y_true, y_pred) -> scalar``, applied
            to every output; or, as ``model.compile`` takes it, a list or dict of those
            (see :func:`resolve_loss`).
        loss_weights: as ``model.compile`` takes them (None: 1 for every output).
        optimizer: a Keras optimizer (default SGD); it is built on the model's trainable
            variables so that its slot variables are counted.
        cost_model: ``"profile"`` (median seconds on the device, plus allocator workspace) or
            ``"flops"`` (an analytic count; workspace 0).
        batch_size: the batch size when the signature leaves it open.
        repeats: timed runs per node when profiling.
        use_cache: read and write the on-disk profile cache (see :func:`cache_dir`).
        weight_grads: ``"transient"`` (each layer's weight gradients live only while its
            backward node runs, then the optimizer consumes them), ``"fixed"`` (all resident
            for the whole step) or ``"auto"`` (``"fixed"`` when the optimizer or a shared
            layer needs the gradients together, see :func:`weight_gradient_lifetime`).

    Returns:
        An :class:`Extraction`.

    Raises:
        ExtractionError: naming the layer, when the model cannot be extracted (subclassed
            model without functional graph, unknown static shapes, stateful RNNs, layers with
            Python side effects, a bad loss or cost model).

    Example:
        >>> ex = extract(model, (x, y), loss="categorical_crossentropy", cost_model="flops")
        >>> ex.graph.size, ex.side_table.loss_node
    """
    started = time.perf_counter()
    if cost_model not in COST_MODELS:
        raise ExtractionError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if weight_grads not in ("auto", "transient", "fixed"):
        raise ExtractionError(f"weight_grads must be 'auto', 'transient' or 'fixed', got {weight_grads!r}")
    if sample_batch is not None and input_signature is not None:
        raise ExtractionError("pass either sample_batch or input_signature, not both")
    if not isinstance(model, keras.Model):
        raise ExtractionError(f"model must be a keras.Model, got {type(model).__name__}")
    require_functional(model)
    refuse_unmodelled_training(model)
    optimizer = optimizer if optimizer is not None else keras.optimizers.SGD()
    calls, output_refs = walk_model(model)
    in_specs, label_specs = _input_specs(model, sample_batch, input_signature, batch_size)
    batch = int(in_specs[0].shape[0])
    loss_name = _loss_name(loss, loss_weights)
    output_names = model_output_names(model)
    loss_fn = resolve_loss(loss, len(output_refs), output_names, loss_weights)
    device = default_device()
    key = _cache_key(model, calls, in_specs, label_specs, loss_name, cost_model, device)
    cached = _load_cache(key, len(calls)) if use_cache else None

    # Which calls pass a gradient back: those owning trainable weights or fed by such calls.
    needs_backward = []
    for call in calls:
        upstream = any(r.source == "node" and needs_backward[r.index] for r in call.inputs)
        needs_backward.append(bool(_trainable(call.layer)) or upstream)

    profile_started = time.perf_counter()
    analyses: list[CallAnalysis] = []
    if cached is not None:
        analyses, loss_analysis = cached
        logger.info("extract %s: profile cache hit %s", model.name, key)
    else:
        loss_analysis = None
    out_specs: list[list[tf.TensorSpec]] = []
    by_signature: dict[tuple, CallAnalysis] = {}
    for call in calls:
        _check_layer(call.layer, call.name)
        specs = []
        for ref in call.inputs:
            specs.append(in_specs[ref.index] if ref.source == "model_input" else out_specs[ref.index][ref.output_index])
        grads = [r.source == "node" and needs_backward[r.index] for r in call.inputs]
        if cached is not None:
            analysis = analyses[call.position]
        else:
            takes_training = _takes_training(call.layer)
            signature = (
                _layer_signature(call.layer),
                tuple((tuple(s.shape), s.dtype.name) for s in specs),
                tuple(grads),
                repr(tf.nest.map_structure(lambda v: "T" if isinstance(v, TensorRef) else v, (call.call_args, call.call_kwargs))),
            )
            analysis = by_signature.get(signature)
            if analysis is None:
                analysis = _analyze_with_checks(call, takes_training, specs, grads, batch, cost_model, repeats)
                by_signature[signature] = analysis
            analyses.append(analysis)
        out_specs.append([tf.TensorSpec(s, d) for s, d in analysis.output_specs])
    pred_specs = [out_specs[r.index][r.output_index] for r in output_refs]
    if loss_analysis is None:
        loss_analysis = analyze_loss(loss_fn, pred_specs, label_specs, cost_model == "profile", repeats)
    profile_seconds = 0.0 if cached is not None else time.perf_counter() - profile_started
    if cached is None and use_cache:
        _store_cache(key, {"calls": [a.to_dict() for a in analyses], "loss": loss_analysis.to_dict()})

    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    if weight_grads == "auto":
        weight_grads = weight_gradient_lifetime(optimizer, [call.layer for call in calls])
    graph, table = _assemble(
        model, calls, output_refs, needs_backward, analyses, loss_analysis, in_specs, label_specs,
        loss_fn, optimizer, batch, cost_model, weight_grads,
    )
    seconds = time.perf_counter() - started
    logger.info(
        "extract %s: %d nodes, %d edges in %.2f s (profiling %.2f s)", model.name, graph.size, len(graph.edges),
        seconds, profile_seconds,
    )
    return Extraction(graph, table, seconds, profile_seconds, cached is not None)


def weight_gradient_lifetime(optimizer, layers: Sequence) -> str:
    """How long weight gradients live in a training step with ``optimizer``: ``"transient"``
    or ``"fixed"`` (see the module docstring).

    A plain update consumes each gradient as soon as it exists. Gradient clipping of any
    kind, gradient accumulation and the loss scale of ``mixed_float16`` (a
    ``LossScaleOptimizer`` checks all gradients for overflow first) keep them longer; so
    does a layer with weights called more than once, whose first gradient waits for the
    others. Measured on a 7-layer MLP (batch 1024, ``optimal`` at 85% of the checkpoint-all
    peak): with ``clipnorm``, ``clipvalue``, ``gradient_accumulation_steps=2`` or a
    ``LossScaleOptimizer`` the transient model's schedule peaked 8-10% over its budget, the
    fixed model's stayed under it.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    reasons = [name for name in ("clipnorm", "global_clipnorm", "clipvalue", "gradient_accumulation_steps")
               if getattr(inner, name, None)]
    if inner is not optimizer:
        reasons.append("loss scaling")
    owners = [id(layer) for layer in layers if _trainable(layer)]
    if len(owners) != len(set(owners)):
        reasons.append("a layer with weights called more than once")
    if reasons:
        logger.info("weight gradients are counted as resident for the whole step (%s)", ", ".join(reasons))
        return "fixed"
    return "transient"


def _analyze_with_checks(call, takes_training, specs, grads, batch, cost_model, repeats) -> CallAnalysis:
    """Analyzes one call, refusing Python side effects and restoring non-trainable state."""
    layer = call.layer
    user_layer = not type(layer).__module__.startswith("keras")
    before = _python_state(layer) if user_layer else None
    saved = [v.numpy() for v in stateful_variables(layer)]
    # Profiling must leave every random state as it found it: an unseeded keras.random
    # call advances Keras's global seed generator, or creates it with a seed drawn from
    # Python's random, and plain training would then draw other numbers than tfremat's step.
    python_random = random.getstate()
    generator = global_seed_generator()
    generator_state = None if generator is None else generator.state.numpy()
    try:
        analysis = analyze_call(
            _make_caller(call, takes_training), call.name, specs, grads, list(_trainable(layer)), batch,
            profile=cost_model == "profile", repeats=repeats,
        )
    finally:
        for variable, value in zip(stateful_variables(layer), saved):
            variable.assign(value)
        random.setstate(python_random)
        if generator is not None:
            generator.state.assign(generator_state)
        elif global_seed_generator() is not None:
            forget_global_seed_generator()
    if user_layer:
        after = _python_state(layer)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            raise ExtractionError(
                f"layer {call.name!r} changes its Python attributes {changed} when called; a recomputation "
                "would repeat that side effect. Keep such state in tf.Variables or outside call().",
                layer=call.name,
            )
    if len(getattr(layer, "losses", ())) > len(_regularized(layer)):
        raise ExtractionError(
            f"layer {call.name!r} adds losses in call() (activity regularization / add_loss); tfremat's "
            "graph has one loss node and would drop them. Move the term into the loss function.",
            layer=call.name,
        )
    return analysis


def _assemble(model, calls, output_refs, needs_backward, analyses, loss_analysis, in_specs, label_specs,
              loss_fn, optimizer, batch, cost_model, weight_grads) -> tuple[DFGraph, SideTable]:
    """Numbers the nodes, wires the edges and builds the graph and the side table."""
    n_fwd = len(calls)
    loss_node = n_fwd
    backward_calls = [c.position for c in reversed(calls) if needs_backward[c.position]]
    backward_id = {p: loss_node + 1 + k for k, p in enumerate(backward_calls)}
    n = loss_node + 1 + len(backward_calls)

    # Where each call output's upstream gradient comes from.
    output_grads: dict[int, list[list[GradRef]]] = {c.position: [[] for _ in range(c.num_outputs)] for c in calls}
    for k, ref in enumerate(output_refs):
        output_grads[ref.index][ref.output_index].append(GradRef(loss_node, k))
    for call in calls:
        if not needs_backward[call.position]:
            continue
        for pos, ref in enumerate(call.inputs):
            if ref.source == "node" and needs_backward[ref.index]:
                output_grads[ref.index][ref.output_index].append(GradRef(backward_id[call.position], pos))

    flops = cost_model == "flops"
    names, cost, out_bytes, work, is_bwd = [""] * n, [0.0] * n, [0] * n, [0] * n, [False] * n
    edges: set[tuple[int, int]] = set()
    entries: list[NodeEntry | None] = [None] * n
    forward_of = {}
    small_total = 0
    for call in calls:
        a = analyses[call.position]
        i = call.position
        layer = call.layer
        takes_training = _takes_training(layer)
        names[i] = call.name
        cost[i] = a.forward_flops if flops else a.forward_seconds
        out_bytes[i] = a.output_bytes + a.residual_bytes
        work[i] = a.forward_workspace
        small_total += a.small_residual_bytes if needs_backward[i] else 0
        for ref in call.inputs:
            if ref.source == "node":
                edges.add((ref.index, i))
        needs = tuple(r.source == "node" and needs_backward[r.index] for r in call.inputs)
        common = dict(
            layer=layer, call_args=call.call_args, call_kwargs=MappingProxyType(dict(call.call_kwargs)),
            inputs=call.inputs, takes_training=takes_training, one_gradient_call=a.one_gradient_call,
            trainable_variables=tuple(_trainable(layer)), num_outputs=call.num_outputs,
            input_needs_grad=needs,
        )
        b = backward_id.get(i)
        entries[i] = NodeEntry(
            node=i, kind="forward", name=call.name, forward_node=i, backward_node=b,
            output_bytes=a.output_bytes, residual_bytes=a.residual_bytes if b is not None else 0,
            small_residual_bytes=a.small_residual_bytes if b is not None else 0,
            workspace_bytes=a.forward_workspace, cost=cost[i], **common,
        )
        if b is None:
            # Nothing differentiates this call, so the tape keeps none of its residuals.
            out_bytes[i] = a.output_bytes
            continue
        names[b] = f"{call.name}_backward"
        is_bwd[b] = True
        forward_of[b] = i
        cost[b] = a.backward_flops if flops else a.backward_seconds
        out_bytes[b] = a.input_grad_bytes
        work[b] = a.backward_workspace
        if weight_grads == "transient":
            work[b] += _variables_bytes(_trainable(layer))
        work[b] += _PENALTY_BUFFERS * _variables_bytes(_regularized(layer))
        grads = tuple(tuple(g) for g in output_grads[i])
        for contributions in grads:
            for g in contributions:
                edges.add((g.node, b))
        for pos in a.reads_inputs:
            ref = call.inputs[pos]
            if ref.source == "node":
                edges.add((ref.index, b))
        if a.reads_output or a.residual_bytes:
            edges.add((i, b))
        entries[b] = NodeEntry(
            node=b, kind="backward", name=names[b], forward_node=i, output_grads=grads,
            reads_inputs=a.reads_inputs, reads_output=a.reads_output, output_bytes=a.input_grad_bytes,
            workspace_bytes=work[b], cost=cost[b], **common,
        )
    names[loss_node] = "loss"
    is_bwd[loss_node] = True
    cost[loss_node] = loss_analysis.forward_flops if flops else loss_analysis.forward_seconds
    out_bytes[loss_node] = loss_analysis.output_bytes
    work[loss_node] = loss_analysis.forward_workspace
    for ref in output_refs:
        edges.add((ref.index, loss_node))
    entries[loss_node] = NodeEntry(
        node=loss_node, kind="loss", name="loss", inputs=tuple(output_refs),
        reads_inputs=tuple(range(len(output_refs))), output_bytes=loss_analysis.output_bytes,
        workspace_bytes=loss_analysis.forward_workspace, cost=cost[loss_node],
    )
    trainable = _variables_bytes(model.trainable_variables)
    breakdown = {
        "params": trainable,
        "param_grads": trainable if weight_grads == "fixed" else 0,
        "optimizer_slots": _variables_bytes(optimizer.variables),
        "non_trainable": _variables_bytes(model.non_trainable_variables),
        "inputs": sum(tensor_bytes(s.shape, s.dtype, "the input batch", "input") for s in in_specs),
        "labels": sum(tensor_bytes(s.shape, s.dtype, "the labels", "labels") for s in label_specs),
        "small_residuals": small_total,
    }
    graph = DFGraph(
        names=names, edges=edges, cost=cost, output_bytes=out_bytes, workspace_bytes=work, is_backward=is_bwd,
        loss_node=loss_node, forward_of=forward_of, fixed_bytes=sum(breakdown.values()), name=model.name,
    )
    table = SideTable(
        model=model, entries=tuple(entries), input_specs=tuple(in_specs), label_specs=tuple(label_specs),
        outputs=tuple(output_refs), loss_node=loss_node, loss_fn=loss_fn, optimizer=optimizer, batch_size=batch,
        fixed_bytes_breakdown=MappingProxyType(breakdown), weight_grads=weight_grads,
        input_names=tuple(model_input_names(model)), output_names=tuple(model_output_names(model)),
    )
    return graph, table
