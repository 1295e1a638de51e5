"""``extract``: a Keras model, an input signature, a loss and an optimizer -> graph + side table.

The steps, each in its own module: refuse what the graph cannot model
(:mod:`~tfremat.extract.checks`), walk the layer calls (:mod:`~tfremat.extract.layer_graph`),
resolve the loss (:mod:`~tfremat.extract.losses`), measure every distinct call and the loss
(:mod:`~tfremat.extract.analysis`) and plain training's overlap (:mod:`~tfremat.extract.overlap`)
or read them from the profile cache (:mod:`~tfremat.extract.profile_cache`), and assemble the graph and the side table
(:mod:`~tfremat.extract.assembly`, whose docstring states what the graph's numbers mean).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfremat.errors import ExtractionError, is_int
from tfremat.extract.analysis import CallAnalysis, analyze_loss, call_values, memory_only, xla_costs, xla_layouts
from tfremat.extract.assembly import assemble, backward_flags, weight_gradient_lifetime
from tfremat.extract.call_timing import timing_passes
from tfremat.extract.checks import (
    analyze_checked,
    check_layer,
    refuse_unmodelled_training,
)
from tfremat.extract.layer_graph import (
    LayerCall,
    functional_model,
    model_input_names,
    model_output_names,
    takes_training,
    walk_model,
)
from tfremat.extract.losses import loss_cache_name, resolve_loss
from tfremat.extract.opening import DEFAULT_GRANULARITY
from tfremat.extract.overlap import PlainOverlap, batch_from_specs, measure_plain_overlap
from tfremat.extract.profile_cache import (
    cache_key,
    layer_signature,
    load_cache,
    store_cache,
)
from tfremat.extract.side_table import SideTable, TensorRef, flatten_by_name
from tfremat.graph import DFGraph
from tfremat.runtime.layer_variants import layer_implementations
from tfremat.runtime.memory import default_device
from tfremat.runtime.state import state_restored

__all__ = ["Extraction", "extract", "COST_MODELS"]

logger = logging.getLogger(__name__)

COST_MODELS = ("profile", "flops")


@dataclasses.dataclass(frozen=True)
class Extraction:
    """The result of :func:`extract`.

    Attributes:
        graph: the data-flow graph for the planners.
        side_table: the Keras half, indexed by node id.
        seconds: wall-clock seconds of the whole extraction.
        profile_seconds: seconds spent tracing and profiling layer calls and measuring the
            plain overlap (0 on a cache hit).
        cache_hit: the per-call measurements came from the on-disk cache.
        plain_overlap: a plain training step's seconds on the step's single-threaded executor
            over its seconds on TensorFlow's default one (:mod:`~tfremat.extract.overlap`);
            1.0, not measured, with one inter-op thread, the ``"flops"`` cost model, ``timing=False``,
            several replicas or XLA. Cached with the profile.
        plain_overlap_range: the first and third quartile of the overlap's per-round ratios,
            widened to at least 10% of it either side
            (:meth:`~tfremat.extract.overlap.PlainOverlap.expected_range`; both ``plain_overlap``
            when it was not measured): where it is expected at a like load.
        plain_overlap_load: the 1-minute load average the overlap was measured at (None: not
            measured); the factor moves with the load (:mod:`~tfremat.extract.overlap`).
        plain_step_seconds: a plain step's least seconds on the single-threaded executor,
            timed with the overlap (None: not measured).
        plain_update_seconds: its optimizer update's least seconds, timed as the costs are
            (None: not measured; :attr:`tfremat.planner.PlanResult.step_share`).
    """

    graph: DFGraph
    side_table: SideTable
    seconds: float
    profile_seconds: float
    cache_hit: bool
    plain_overlap: float = 1.0
    plain_overlap_range: tuple[float, float] = (1.0, 1.0)
    plain_overlap_load: float | None = None
    plain_step_seconds: float | None = None
    plain_update_seconds: float | None = None


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
    granularity: str = DEFAULT_GRANULARITY,
    implementations: bool = False,
    replicas: int | None = None,
    xla: bool | str = False,
    timing: bool = True,
) -> Extraction:
    """Extracts the training graph of a Keras model.

    Args:
        model: a built Functional or Sequential ``keras.Model`` (nested models are flattened), or a
            subclassed one, which is called on symbolic inputs shaped like the sample batch or
            signature and extracted through that functional wrapper
            (:func:`~tfremat.extract.layer_graph.functional_model`; the side table holds the
            wrapper, whose variables are the model's).
        sample_batch: ``(x, y)`` arrays or tensors; their shapes and dtypes fix the signature.
        input_signature: instead of a sample batch, ``tf.TensorSpec`` per model input; labels
            are shaped like the model outputs. A ``None`` batch dimension needs ``batch_size``.
        loss: a Keras loss object, its name, or ``fn(y_true, y_pred) -> scalar``, applied
            to every output; or, as ``model.compile`` takes it, a list or dict of those
            (see :func:`~tfremat.extract.losses.resolve_loss`).
        loss_weights: as ``model.compile`` takes them (None: 1 for every output).
        optimizer: a Keras optimizer (default SGD); it is built on the model's trainable
            variables so that its slot variables are counted.
        cost_model: ``"profile"`` (least wall-clock seconds on the device, plus allocator workspace) or
            ``"flops"`` (an analytic count; workspace 0).
        batch_size: the batch size when the signature leaves it open.
        repeats: timed runs per node when profiling.
        use_cache: read and write the on-disk profile cache (see :func:`~tfremat.extract.profile_cache.cache_dir`).
        weight_grads: ``"transient"`` (each layer's weight gradients live only while its
            backward node runs, then the optimizer consumes them), ``"fixed"`` (all resident
            for the whole step) or ``"auto"`` (``"fixed"`` when the optimizer or a shared
            layer needs the gradients together, see :func:`~tfremat.extract.assembly.weight_gradient_lifetime`).
        granularity: what a graph node is: ``"layer"`` (one call of a model's layer, nested
            models flattened), ``"sublayer"`` (layers that hold sublayers, such as a custom
            transformer block or ``MultiHeadAttention``, opened into their sublayer calls and
            operations) or ``"op"`` (variable-free layers composing several operations
            opened too); see :mod:`~tfremat.extract.opening`.
        implementations: also measure the alternatives of the layers that have them
            (:mod:`tfremat.runtime.layer_variants`: ReLU masks, a max pooling's window index,
            regenerated dropout, output-activated batch norm), recorded in the graph as
            :class:`~tfremat.graph.Implementation` s for the strategy ``monet`` (MONeT). Each
            costs one more analysis of the call. It also splits the backward of each
            convolution or Dense layer without activation into a weight-gradient node and
            an input-gradient node (MONeT appendix D; :mod:`~tfremat.extract.assembly`),
            so a schedule frees the layer's input before its input gradient is made.
        replicas: how many replicas of a ``tf.distribute`` strategy run the step and
            all-reduce their gradients; the graph describes one replica (its batch is one
            replica's). With more than one, the weight gradients are resident for the whole
            step (``"auto"`` gives ``"fixed"``: the all-reduce waits for all of them) and the
            fixed bytes hold the all-reduce's buffers (``all_reduce`` in
            ``SideTable.fixed_bytes_breakdown``, see :mod:`~tfremat.extract.assembly`). None:
            the replicas of the strategy ``model`` was built under (Keras records it as
            ``model.distribute_strategy``; 1 outside any strategy).
        xla: the step will be compiled by XLA (``jit_compile=True``). ``"memory"``: the
            layout copies XLA makes of a call's inputs for its gradient (a convolution's
            filter gradient on CPU) count as the call's residuals, read from an XLA compile
            of each call (:func:`~tfremat.extract.analysis.xla_layouts`); costs and
            workspaces come from TensorFlow's kernels. ``True``: that, and the
            ``"profile"`` cost model times every call compiled by XLA, where fused
            pointwise operations cost little to recompute
            (:func:`~tfremat.extract.analysis.xla_costs`). Cached apart from each other.
        timing: False: the ``"profile"`` cost model measures every byte (workspaces, hidden
            residuals) but times nothing, neither the calls nor the plain overlap
            (:func:`~tfremat.extract.analysis.memory_only`), and the graph's costs are the
            ``"flops"`` model's: for a caller that needs the bytes at this batch and takes
            the costs elsewhere (the certifying build of
            :func:`tfremat.maxbatch.max_batch_size`), about half a profile's time. Cached
            apart from a timed profile.

    Under a strategy's scope (a cross-replica context) the model is extracted as replica 0
    sees it, inside ``tf.distribute.ReplicaContext(strategy, 0)``: a mirrored variable has
    no single value outside a replica context (``DistributedVariable.handle`` raises).

    Returns:
        An :class:`Extraction`.

    Raises:
        ExtractionError: naming the layer, when the model cannot be extracted (a subclassed
            model whose call cannot run on symbolic inputs, unknown static shapes, stateful RNNs, layers with
            Python side effects, a bad loss, cost model or number of replicas).

    Example:
        >>> ex = extract(model, (x, y), loss="categorical_crossentropy", cost_model="flops")
        >>> ex.graph.size, ex.side_table.loss_node
    """
    started = time.perf_counter()
    _check_arguments(model, sample_batch, input_signature, cost_model, weight_grads, replicas)
    if xla not in (False, True, "memory"):
        raise ExtractionError(f"xla must be False, 'memory' or True, got {xla!r}")
    if not isinstance(timing, bool):
        raise ExtractionError(f"timing must be True or False (False: measure bytes only), got {timing!r}")
    optimizer = optimizer if optimizer is not None else keras.optimizers.SGD()
    replicas = model.distribute_strategy.num_replicas_in_sync if replicas is None else replicas
    # Variables are made where the caller is (in a strategy's scope they are mirrored, as
    # model.fit makes them), not in the replica context entered below: a subclassed model's
    # by its wrapper's call, the optimizer's slots by building it.
    model = functional_model(model, sample_batch[0] if sample_batch is not None else input_signature)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    with _as_replica(), _tensorflow_warnings_once():
        return _extract(model, sample_batch, input_signature, loss, loss_weights, optimizer, cost_model, batch_size,
                        repeats, use_cache, weight_grads, granularity, implementations, replicas, started,
                        "timed" if xla is True and cost_model == "profile" and timing else "memory" if xla else "",
                        timing or cost_model != "profile")


class _OnceEach(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


@contextlib.contextmanager
def _tensorflow_warnings_once():
    """TensorFlow's Python log (the ``tensorflow`` logger) shows each message once during an
    extraction: it traces every layer call several times (forward, backward, orders, timing),
    and a warning TensorFlow logs per trace (casting complex64 to float32 in keras.io's FNet)
    came 18 times more than in plain training (benchmarks/results/user_check_6.md)."""
    tensorflow_log = logging.getLogger("tensorflow")
    once = _OnceEach()
    tensorflow_log.addFilter(once)
    try:
        yield
    finally:
        tensorflow_log.removeFilter(once)


def _as_replica():
    """``tf.distribute.ReplicaContext(strategy, 0)`` in a cross-replica context of a
    strategy other than the default one (``extract``'s docstring), else no context."""
    if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
        return tf.distribute.ReplicaContext(tf.distribute.get_strategy(), 0)
    return contextlib.nullcontext()


def _extract(model, sample_batch, input_signature, loss, loss_weights, optimizer, cost_model: str,
             batch_size: int | None, repeats: int, use_cache: bool, weight_grads: str, granularity: str,
             implementations: bool, replicas: int, started: float, xla: str, timed: bool) -> Extraction:
    """:func:`extract` once the arguments are checked, the model wrapped, the optimizer
    built and the replica context entered; ``xla``: ``"memory"`` counts XLA's layout copies,
    ``"timed"`` that and the calls are timed compiled by XLA, ``""`` neither; ``timed``:
    False for a ``"profile"`` extraction that measures bytes only (``timing=False``)."""
    in_specs, label_specs = _input_specs(model, sample_batch, input_signature, batch_size)
    calls, output_refs = walk_model(model, granularity, [spec.shape for spec in in_specs])
    batch = int(in_specs[0].shape[0])
    loss_name = loss_cache_name(loss, loss_weights)
    loss_fn = resolve_loss(loss, len(output_refs), model_output_names(model), loss_weights)
    # A memory-only profile is cached under its own cost model: it never serves a timed request.
    key = cache_key(model, calls, in_specs, label_specs, loss_name, cost_model if timed else "profile, untimed",
                    default_device(), implementations, ("layouts", xla) if xla else False)
    cached = load_cache(key, len(calls)) if use_cache else None
    needs_backward = backward_flags(calls)
    values = _BatchValues(calls, sample_batch[0] if sample_batch is not None else None, model)

    profile_started = time.perf_counter()
    if cached is not None:
        logger.info("extract %s: profile cache hit %s", model.name, key)
    # The timing passes run the calls again after analyze_checked restored each layer's
    # state: without this, a cold profile moved batch-norm statistics and dropout seeds.
    with state_restored(model.non_trainable_variables), xla_costs(xla == "timed"), xla_layouts(bool(xla)), \
            memory_only(not timed), timing_passes() as passes:
        analyses, out_specs = _analyze_calls(
            calls, needs_backward, in_specs, None if cached is None else cached[0], batch, cost_model, repeats, values,
        )
        if cached is not None:
            loss_analysis, alternatives = cached[1], cached[2]
        else:
            pred_specs = [out_specs[r.index][r.output_index] for r in output_refs]
            loss_analysis = analyze_loss(loss_fn, pred_specs, label_specs, cost_model == "profile", repeats)
            alternatives = _analyze_alternatives(calls, needs_backward, in_specs, out_specs, batch, cost_model,
                                                 repeats, implementations, values)
        # Every call timed again, in passes over all of them (timing_passes).
        analyses = [passes.final(a) for a in analyses]
        loss_analysis = passes.final(loss_analysis)
        alternatives = [{name: passes.final(a) for name, a in measured.items()} for measured in alternatives]
    if cached is not None:
        overlap = cached[3]
    elif cost_model == "profile" and timed and replicas == 1 and not xla and not tf.distribute.has_strategy():
        overlap = PlainOverlap.of(
            measure_plain_overlap(model, *batch_from_specs(model, in_specs, label_specs,
                                                           values=values.of_model_inputs(in_specs)),
                                  loss_fn, optimizer))
    else:
        overlap = PlainOverlap()
    profile_seconds = 0.0 if cached is not None else time.perf_counter() - profile_started
    if cached is None and use_cache:
        store_cache(key, analyses, loss_analysis, alternatives, overlap)

    if weight_grads == "auto" and replicas > 1:
        logger.info("weight gradients are counted as resident for the whole step (%d replicas all-reduce them)",
                    replicas)
        weight_grads = "fixed"
    elif weight_grads == "auto":
        weight_grads = weight_gradient_lifetime(optimizer, [call.layer for call in calls])
    graph, table = assemble(
        model, calls, output_refs, needs_backward, analyses, loss_analysis, in_specs, label_specs,
        loss_fn, optimizer, batch, cost_model if timed else "flops", weight_grads, alternatives,
        split_backward=implementations,
        replicas=replicas, use_cache=use_cache,
    )
    seconds = time.perf_counter() - started
    logger.info(
        "extract %s: %d nodes, %d edges in %.2f s (profiling %.2f s)", model.name, graph.size, len(graph.edges),
        seconds, profile_seconds,
    )
    return Extraction(graph, table, seconds, profile_seconds, cached is not None, overlap.factor,
                      overlap.expected_range(), overlap.load, overlap.step_seconds,
                      overlap.update_seconds)


def _check_arguments(model, sample_batch, input_signature, cost_model: str, weight_grads: str,
                     replicas: int | None) -> None:
    """Refuses bad arguments and a model the graph cannot model, before anything is traced.

    Raises:
        ExtractionError: an unknown cost model or weight-gradient lifetime, a number of
            replicas that is no positive int, both a sample
            batch and a signature, not a Keras model, or training the
            compiled loss does not describe (:func:`~tfremat.extract.checks.refuse_unmodelled_training`).
    """
    if cost_model not in COST_MODELS:
        raise ExtractionError(f"cost_model must be one of {COST_MODELS}, got {cost_model!r}")
    if weight_grads not in ("auto", "transient", "fixed"):
        raise ExtractionError(f"weight_grads must be 'auto', 'transient' or 'fixed', got {weight_grads!r}")
    if replicas is not None and (not is_int(replicas) or replicas < 1):
        raise ExtractionError(f"replicas must be a positive int (the strategy's num_replicas_in_sync) or None (the "
                              f"strategy the model was built under), got {replicas!r}")
    if sample_batch is not None and input_signature is not None:
        raise ExtractionError("pass either sample_batch or input_signature, not both")
    if not isinstance(model, keras.Model):
        raise ExtractionError(f"model must be a keras.Model, got {type(model).__name__}")
    refuse_unmodelled_training(model)


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


def _analyze_calls(calls: Sequence[LayerCall], needs_backward: Sequence[bool], in_specs: list[tf.TensorSpec],
                   cached: list[CallAnalysis] | None, batch: int, cost_model: str,
                   repeats: int, values: _BatchValues) -> tuple[list[CallAnalysis], list[list[tf.TensorSpec]]]:
    """Every call's :class:`CallAnalysis` and output specs, in call order.

    Each call is checked (:func:`~tfremat.extract.checks.check_layer`), on a cache hit too.
    Without ``cached`` each distinct call is measured once: calls of layers with the same
    signature, input specs, gradient needs and non-tensor arguments share one analysis
    (a model's repeated blocks are profiled once), on the values ``values`` gives its
    inputs that are neither floats nor booleans (:func:`_analyzed`).
    """
    analyses: list[CallAnalysis] = []
    out_specs: list[list[tf.TensorSpec]] = []
    by_signature: dict[tuple, CallAnalysis] = {}
    for call in calls:
        check_layer(call.layer, call.name)
        specs, grads = _call_inputs(call, in_specs, out_specs, needs_backward)
        if cached is not None:
            analysis = cached[call.position]
        else:
            signature = _call_signature(call, specs, grads)
            analysis = by_signature.get(signature)
            if analysis is None:
                analysis = _analyzed(call, specs, grads, batch, cost_model, repeats, values)
                by_signature[signature] = analysis
        analyses.append(analysis)
        out_specs.append([tf.TensorSpec(s, d) for s, d in analysis.output_specs])
    return analyses, out_specs


def _call_inputs(call: LayerCall, in_specs: list[tf.TensorSpec], out_specs: list[list[tf.TensorSpec]],
                 needs_backward: Sequence[bool]) -> tuple[list[tf.TensorSpec], list[bool]]:
    """The specs of ``call``'s inputs and, per input, whether its backward returns a gradient."""
    specs = [in_specs[ref.index] if ref.source == "model_input" else out_specs[ref.index][ref.output_index]
             for ref in call.inputs]
    return specs, [r.source == "node" and needs_backward[r.index] for r in call.inputs]


def _analyze_alternatives(calls: Sequence[LayerCall], needs_backward: Sequence[bool], in_specs: list[tf.TensorSpec],
                          out_specs: list[list[tf.TensorSpec]], batch: int, cost_model: str, repeats: int,
                          wanted: bool, values: _BatchValues) -> list[dict[str, CallAnalysis]]:
    """Per call, its layer's alternatives measured like the layer's own implementation
    (empty unless ``wanted``; a call without a backward node keeps nothing either way)."""
    alternatives: list[dict[str, CallAnalysis]] = []
    by_signature: dict[tuple, CallAnalysis] = {}
    for call in calls:
        measured: dict[str, CallAnalysis] = {}
        if wanted and needs_backward[call.position]:
            specs, grads = _call_inputs(call, in_specs, out_specs, needs_backward)
            for alternative in layer_implementations(call.layer):
                signature = (alternative.name, *_call_signature(call, specs, grads))
                if signature not in by_signature:
                    by_signature[signature] = _analyzed(call, specs, grads, batch, cost_model, repeats, values,
                                                        alternative.name)
                measured[alternative.name] = by_signature[signature]
        alternatives.append(measured)
    return alternatives


def _call_signature(call: LayerCall, specs: Sequence[tf.TensorSpec], grads: Sequence[bool]) -> tuple:
    """What decides a call's measurements: the layer, its input specs, which inputs need a
    gradient, its non-tensor arguments, and the Keras masks its inputs carry."""
    return (
        layer_signature(call.layer),
        tuple((tuple(s.shape), s.dtype.name) for s in specs),
        tuple(grads),
        repr(tf.nest.map_structure(lambda v: "T" if isinstance(v, TensorRef) else v, (call.call_args, call.call_kwargs))),
        repr(call.input_masks),
    )


def _analyzed(call: LayerCall, specs: Sequence[tf.TensorSpec], grads: Sequence[bool], batch: int, cost_model: str,
              repeats: int, values: _BatchValues, implementation: str | None = None) -> CallAnalysis:
    """:func:`~tfremat.extract.checks.analyze_checked` of ``call`` (its ``implementation``),
    run on the batch's values of its inputs that are neither floats nor booleans
    (:func:`~tfremat.extract.analysis.call_values`, :class:`_BatchValues`).

    Raises:
        ExtractionError: the call fails on those values (a lookup layer without an OOV
            index fed a value outside its vocabulary), naming the layer, where each value
            came from and what to pass instead.
    """
    positions = [p for p, spec in enumerate(specs) if _takes_batch_values(spec)]
    if not positions:
        return analyze_checked(call, takes_training(call.layer), specs, grads, batch, cost_model, repeats,
                               implementation)
    given = values.of_inputs(call, positions)
    try:
        with call_values(given):
            return analyze_checked(call, takes_training(call.layer), specs, grads, batch, cost_model, repeats,
                                   implementation)
    except tf.errors.InvalidArgumentError as error:
        fed = ", ".join(f"input {p}: " + ("the sample batch's values" if given[p] is not None else
                                          "empty strings" if specs[p].dtype == tf.string else "zeros")
                        for p in positions)
        fix = ("pass a sample batch whose values it accepts" if all(given[p] is not None for p in positions) else
               "pass a sample batch with values it accepts (sample_batch=(x, y), not an input_signature; "
               "tfremat.fit passes your first batch)")
        reason = re.sub(r"\s*\[Op:[^\]]*\]$", "", [line for line in error.message.splitlines() if line.strip()][-1])
        raise ExtractionError(
            f"layer {call.name!r} fails when profiled on the values given to its integer and string inputs ({fed}): "
            f"{reason}; profiling runs every layer on such values: {fix}",
            layer=call.name,
        ) from error


def _takes_batch_values(spec: tf.TensorSpec) -> bool:
    """Whether an input is profiled on the sample batch's values: neither a float (made-up
    values move no byte or cost measured) nor a boolean (all True: a Keras mask at its
    largest, :func:`~tfremat.extract.analysis.call_values`)."""
    return not spec.dtype.is_floating and spec.dtype != tf.bool


class _BatchValues:
    """The values a sample batch gives the calls' inputs, each computed once on demand.

    A model input's value is the batch's tensor; another call's output is computed by
    running the calls it depends on, in call order, eagerly and with ``training=False``, so
    that no batch-norm statistic or dropout seed moves (an integer or string value seldom
    depends on it). For a model whose integer and string inputs are all model inputs (token
    ids into an ``Embedding``) nothing runs; for a model of floats nothing is asked.
    """

    def __init__(self, calls: Sequence[LayerCall], x, model):
        self._calls = calls
        self._inputs = None if x is None else flatten_by_name(x, model_input_names(model), "inputs")
        self._known: dict[TensorRef, tf.Tensor | None] = {}

    def of_inputs(self, call: LayerCall, positions: Sequence[int]) -> list[tf.Tensor | None]:
        """Per flattened input of ``call``, its value on the batch for the ``positions``
        asked, else None; None too where no batch was given or a call it depends on could
        not run (logged)."""
        return [self._value(ref) if p in positions else None for p, ref in enumerate(call.inputs)]

    def of_model_inputs(self, specs: Sequence[tf.TensorSpec]) -> list[tf.Tensor | None]:
        """Per model input (``specs``), the batch's tensor where :func:`_takes_batch_values`,
        else None."""
        return [self._value(TensorRef("model_input", p)) if _takes_batch_values(spec) else None
                for p, spec in enumerate(specs)]

    def _value(self, ref: TensorRef) -> tf.Tensor | None:
        if self._inputs is None:
            return None
        if ref.source == "model_input":
            return tf.convert_to_tensor(self._inputs[ref.index])
        needed, pending = set(), [ref.index]
        while pending:
            position = pending.pop()
            if position not in needed and TensorRef("node", position) not in self._known:
                needed.add(position)
                pending.extend(r.index for r in self._calls[position].inputs if r.source == "node")
        for position in sorted(needed):  # call order is an order of dependencies
            self._run(self._calls[position])
        return self._known.get(ref)

    def _run(self, call: LayerCall) -> None:
        """Records ``call``'s outputs on the batch: None each, logged, when it cannot run."""
        inputs = [self._value(ref) if ref.source == "model_input" else self._known.get(ref) for ref in call.inputs]
        outputs = [None] * call.num_outputs
        if all(value is not None for value in inputs):
            remaining = iter(inputs)

            def swap(value):
                return next(remaining) if isinstance(value, TensorRef) else value

            args = tf.nest.map_structure(swap, call.call_args)
            kwargs = tf.nest.map_structure(swap, dict(call.call_kwargs))
            if takes_training(call.layer):
                kwargs["training"] = False
            try:
                outputs = tf.nest.flatten(call.layer(*args, **kwargs))
            except (tf.errors.OpError, ValueError, TypeError) as error:
                logger.info("layer %s did not run on the sample batch (%s): the layers that read its outputs are "
                            "profiled on zeros", call.name, error)
        for index, value in enumerate(outputs):
            self._known[TensorRef("node", call.position, index)] = value
