"""Per-layer-call measurements: what the gradient reads, sizes, workspace, cost.

Each layer call is traced once as a ``tf.function`` that runs the call under a
``tf.GradientTape`` and then asks the tape for the vector-Jacobian product. The ops created
before ``tape.gradient`` are the forward pass, the rest is the gradient. Every forward tensor
that a gradient op consumes is what the tape keeps alive from the forward pass until the
backward runs, so it is classified by identity, not by layer type:

* one of the call's inputs (a convolution's gradient reads its input),
* the call's output (a ReLU's gradient reads its output),
* anything else is an internal *residual* (Dense's pre-activation, dropout's scaled mask,
  batch norm's per-channel statistics). Residuals whose leading dimension is the batch
  grow with the batch and are counted with the node (see :mod:`tfremat.extract.assembly`);
  the others (per-channel statistics, weight casts) are small and counted as fixed bytes.

Reads that only take a tensor's shape (``Shape``, ``Size``, ``Rank``) keep nothing alive
once shapes are static, variable reads are parameters (already fixed bytes), and constants
live in the graph: none of them count.

A call whose inputs carry Keras masks in the step (``LayerCall.input_masks``: a
``MultiHeadAttention`` kept whole on masked tokens) runs with them set on its inputs, as the
compiled step sets them (:func:`_with_input_masks`), so that what is measured is its masked
path (the attention mask it builds and its backward keeps). The masks are traced inputs after
the call's own; the backward's reads of them count as nothing, like any placeholder's: a
mask is the value of the call that set it, one bool per token.

A ``tf.while_loop`` (a Keras RNN with ``unroll=False``) keeps its per-step intermediates for
the gradient in ``TensorList`` accumulators: ``variant`` tensors of shape ``()`` whose
static size says nothing about the bytes they hold (by static size they would count as 0,
and the planner would free the layer's activations long before the tape does, so the step
would use several times its prediction). Their bytes are measured instead
(:func:`_held_bytes`): the call runs
forward, with the accumulators the gradient creates, returning only those residuals, and
the allocator's bytes in use after it are what the tape holds. They count as batch-sized
residuals, and such a call is recorded on a non-persistent tape and takes its gradients in
one ``gradient`` call, as the step does
(:func:`tfremat.runtime.tape.takes_one_gradient_call`).

Every call is traced and run on the executor the compiled step runs on (:func:`~tfremat.runtime.executor.step_executor`):
with several inter-op threads TensorFlow's single-threaded one
(:func:`tfremat.runtime.executor.sequential`), where the default one would overlap a layer's
independent operations (a convolution's input and filter gradients) in the profile, in time
and in memory, where they do not in the step.

With ``profile=True`` the same functions are run on the target device and timed
(:mod:`tfremat.extract.call_timing`: the least seconds of many runs, on CPU read off
TensorFlow's profiler trace, in passes over all of an extraction's calls, rounded to a
relative grid). The peak of the bytes the run's operations request
from the allocator (the profiler's allocation events, :func:`_requested_peak`; not the BFC
allocator's own peak, which counts whole chunks) gives the workspace, i.e. the transient
bytes beyond the node's output, residuals and gradients. A kernel may keep bytes from the forward to
the backward that the traced graph does not show (oneDNN's max-pool workspace): they are
read off the run's allocations and count as residuals (:func:`_hidden_residual_bytes`). Profiling runs the layer with
``training=True``, which would move batch-norm statistics and dropout seeds, so the layer's
non-trainable variables are restored afterwards: extraction leaves the model exactly as it
found it. The backward workspace of a call that runs a while loop is the largest over a few
traces (see :func:`_other_orders`), on the single-threaded executor with one more
loop variable (:func:`_loop_peak`), and that of any other call the largest over three
orders of its operations, the greediest among them (:func:`_run_greediest`).

Within :func:`xla_costs` (``extract(..., xla=True)``, for a step compiled with
``jit_compile=True``) the seconds are those of the same calls compiled by XLA: the timed
forward and forward-plus-backward functions are ``tf.function(jit_compile=True)``, so a
chain of pointwise operations costs one fused kernel, as in the compiled step, where it
costs a kernel per operation without XLA. The dispatch subtracted is that of an XLA
function that computes nothing. A while loop's forward is timed without its tape there (an
XLA function cannot return a loop's accumulators): the accumulators' pushes count in its
backward. The workspaces stay those of TensorFlow's kernels: XLA's buffer assignment of one
call says little of the whole step's, whose requested bytes the graph's other numbers are
held to.

Within :func:`xla_layouts` (``extract(..., xla=...)``) an input that the gradient reads
through a layout copy XLA makes of it (a convolution's filter gradient on XLA's CPU
backend, :mod:`tfremat.extract.xla_layouts`) is read as a residual of the copy's size
instead, found in the optimized HLO of the call and its gradient compiled by XLA, and the
copy XLA makes of each trainable variable it updates counts as a small residual
(:func:`_with_xla_layouts`); everything else is measured as without it.

Within :func:`memory_only` (``extract(..., timing=False)``) profiling measures the bytes
above and times nothing: the seconds stay 0, and the graph's costs come from elsewhere.

The ``flops`` cost model sums TensorFlow's registered per-op flop statistics over the traced
ops (``Conv2D``, ``MatMul``, ...), and the element count of every other computing op. A
while loop counts its body's ops times the iterations it ran on a sample batch (the length
of its accumulators; its gradient loop runs as many), and a called function its function's
ops; a loop nested in a loop's body counts its body once per outer iteration.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import logging
import math
import re
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.call_timing import call_costs, derive, dispatch_only, time_call, xla_compiled
from tfremat.extract.views import view_position
from tfremat.extract.xla_layouts import backward_layout_copies
from tfremat.runtime import executor
from tfremat.runtime.gradient_order import input_then_weight_gradients, needed_ops
from tfremat.runtime.internals import node_flops, resource_handle_data, set_keras_mask
from tfremat.runtime.memory import (
    AllocationWindows,
    _replayed_peak,
    default_device,
    order_free_peak,
    requested_peak,
    reset_allocator_peak,
    synchronize,
)
from tfremat.runtime.tape import takes_one_gradient_call

__all__ = ["CallAnalysis", "analyze_call", "analyze_loss", "call_values", "memory_only", "tensor_bytes", "xla_costs",
           "xla_layouts"]

logger = logging.getLogger(__name__)

_SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"})
_NOT_RESIDUAL_OPS = frozenset({"ReadVariableOp", "Const", "Placeholder", "VarHandleOp"})
_LOOP_OPS = frozenset({"While", "StatelessWhile"})
# Ops that read only a tensor's shape, which constant folding replaces with a constant.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "Const"})
# Ops whose output shares its (first) input's buffer: TensorFlow forwards the buffer, no copy.
_VIEW_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Identity", "StopGradient", "Snapshot"})
_CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
# A gradient made by one of these may be folded into a constant, whose buffer no reader can take.
_CONSTANT_LIKE_OPS = frozenset({"Const", "ZerosLike", "OnesLike", "Fill", "Zeros"})
_LOOP_TRACES = 4  # traces of a loop call's backward whose largest workspace is kept (_other_orders)
# Per loop call (_loop_key) and part ("forward", "backward"): the largest over its profiles
# in this process of the least requested peak of a profile's traces, and the largest peak
# (_loop_peak); with "held", the fewest bytes its accumulators held (_loop_residuals).
_LOOP_PEAKS: dict[tuple[str, str], tuple[int, int]] = {}
_SEED_SPEC = tf.TensorSpec([], tf.float32)  # the scalar the upstream gradients are filled with
_NO_COMPUTE_OPS = frozenset(
    {"Const", "Placeholder", "ReadVariableOp", "Identity", "IdentityN", "NoOp", "Shape", "ShapeN",
     "Size", "Rank", "Reshape", "StopGradient", "VarHandleOp", "AssignVariableOp", "AssignAddVariableOp",
     "AssignSubVariableOp", "BroadcastGradientArgs", "ZerosLike", "OnesLike"}
)
# Whether profiled seconds are those of XLA-compiled calls (xla_costs).
_XLA_COSTS = contextvars.ContextVar("tfremat_xla_costs", default=False)
# Whether the layout copies XLA makes for a call's gradient count as its residuals (xla_layouts).
_XLA_LAYOUTS = contextvars.ContextVar("tfremat_xla_layouts", default=False)
# Whether profiling times the calls (False within memory_only: bytes measured, seconds 0).
_TIMED = contextvars.ContextVar("tfremat_timed", default=True)
# Per input of the call analyzed, its value on the user's batch or None (call_values).
_CALL_VALUES = contextvars.ContextVar("tfremat_call_values", default=())


def _sequentially(function: Callable) -> Callable:
    """``function`` traced and run on the step's executor (:func:`~tfremat.runtime.executor.step_executor`),
    or again on the default one when its call holds a loop the step runs there
    (:func:`~tfremat.runtime.executor.check_loop_executor`)."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with executor.step_executor():
            try:
                return function(*args, **kwargs)
            except executor.LoopOnDefaultExecutor:
                pass
        with executor.default_executor():
            return function(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def xla_costs(enabled: bool = True):
    """Within it, :func:`analyze_call` and :func:`analyze_loss` time the calls compiled by
    XLA (module docstring): the costs of a step compiled with ``jit_compile=True``, where
    fused pointwise operations cost little to recompute. A context, not an argument, so
    that every caller between :func:`~tfremat.extract.extractor.extract` and the analysis
    passes it on unchanged."""
    token = _XLA_COSTS.set(bool(enabled))
    try:
        yield
    finally:
        _XLA_COSTS.reset(token)


@contextlib.contextmanager
def xla_layouts(enabled: bool = True):
    """Within it, :func:`analyze_call` counts the layout copies XLA makes of a call's inputs
    for its gradient as the call's residuals (module docstring, :func:`_with_xla_layouts`):
    the memory of a step compiled with ``jit_compile=True``. A context, as :func:`xla_costs`."""
    token = _XLA_LAYOUTS.set(bool(enabled))
    try:
        yield
    finally:
        _XLA_LAYOUTS.reset(token)


@contextlib.contextmanager
def memory_only(enabled: bool = True):
    """Within it, profiling (:func:`analyze_call`, :func:`analyze_loss` with ``profile``)
    measures every byte as it does otherwise (traces, requested peaks, workspaces, hidden
    residuals) but times nothing: the seconds stay 0. For a graph whose costs come from
    elsewhere (``extract(..., timing=False)``); the timing passes are most of a profile's
    time (ResNet50 at 64x64, batch 142: 54.8 s -> 27.1 s, benchmarks/results/maxbatch_quick.md).
    A context, as :func:`xla_costs`."""
    token = _TIMED.set(not enabled)
    try:
        yield
    finally:
        _TIMED.reset(token)


@dataclasses.dataclass(frozen=True)
class CallAnalysis:
    """What one layer call (or the loss) costs and keeps, measured as described above.

    Attributes:
        output_specs: ``(shape, dtype name)`` per flattened output, batch included.
        output_bytes: bytes of the outputs.
        reads_inputs: positions of the call's inputs that the gradient reads.
        reads_output: the gradient reads the call's output.
        residual_bytes: residuals that grow with the batch (``loop_residual_bytes``
            included).
        loop_residual_bytes: bytes held by ``variant`` residuals (a while loop's
            accumulators), measured by running the call.
        one_gradient_call: the backward takes one gradient call on a non-persistent
            tape (the call runs a while loop; the step uses the same rule).
        small_residual_bytes: residuals that do not.
        input_grad_bytes: bytes of the gradients the backward returns for the inputs.
        forward_flops, backward_flops: analytic counts from the traced ops.
        forward_seconds, backward_seconds: least timed seconds on the cost grid (0 without
            profiling; :func:`~tfremat.extract.call_timing.call_costs`).
        forward_workspace, backward_workspace: transient requested bytes (0 without profiling).
        input_gradient_reads_forward: the operations computing the input gradients read
            a forward tensor (an input, the output or a residual). When they do not (a
            convolution or a Dense layer without activation: ``dy`` and the weights only),
            the backward can be split into a weight-gradient node that reads the forward
            values and an input-gradient node after it that reads none (MONeT appendix D).
        input_gradient_flops: the flops of the operations the input gradients need.
        view_input: the position of the input whose buffer the output shares (a reshape:
            :func:`tfremat.extract.views.view_position`), or None.
        dying_backward_workspace: the backward workspace measured with the upstream
            gradients, the output and the residuals dying inside the backward (the
            ``"dying"`` trace, :func:`_profile_call`), where an elementwise gradient
            (``ReluGrad``) writes into the upstream gradient's buffer; None when not
            measured. Graph assembly uses it only where the backward node is the sole
            reader of its upstream gradients (:func:`tfremat.extract.assembly.sole_upstream`).
        passed_input_grads: positions whose gradient is the upstream gradient's buffer
            (an ``Add``, a ``Reshape``: the upstream or a view of it).
        shared_input_grads: positions whose gradient is one buffer with another
            position's (an ``Add``'s inputs): several readers in the step.
    """

    output_specs: tuple
    output_bytes: int
    reads_inputs: tuple[int, ...]
    reads_output: bool
    residual_bytes: int
    small_residual_bytes: int
    input_grad_bytes: int
    forward_flops: float
    backward_flops: float
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    forward_workspace: int = 0
    backward_workspace: int = 0
    loop_residual_bytes: int = 0
    one_gradient_call: bool = False
    input_gradient_reads_forward: bool = True
    input_gradient_flops: float = 0.0
    view_input: int | None = None
    dying_backward_workspace: int | None = None
    passed_input_grads: tuple[int, ...] = ()
    shared_input_grads: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CallAnalysis":
        data = dict(data)
        data["output_specs"] = tuple((tuple(s), d) for s, d in data["output_specs"])
        for key in ("reads_inputs", "passed_input_grads", "shared_input_grads"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


def tensor_bytes(shape: Sequence[int | None], dtype, what: str, layer: str) -> int:
    """Bytes of a tensor with a fully static shape.

    Raises:
        ExtractionError: a dimension is unknown.
    """
    if any(d is None for d in shape):
        raise ExtractionError(
            f"layer {layer!r}: {what} has shape {tuple(shape)} with an unknown dimension; tfremat needs "
            "static shapes. Give every model input a fixed shape (keras.Input(shape=...)) and a batch "
            "size, or avoid layers whose output shape depends on the data.",
            layer=layer,
        )
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size


def _is_float(dtype) -> bool:
    return tf.as_dtype(dtype).is_floating


def _op_flops(graph, op) -> float:
    if op.type in _NO_COMPUTE_OPS:
        return 0.0
    registered = node_flops(graph, op.node_def)
    if registered is not None:
        return registered
    total = 0.0
    for out in op.outputs:
        if out.shape.rank is not None and out.shape.is_fully_defined():
            total += float(np.prod(out.shape.as_list(), dtype=np.int64))
    return total


def _requested_peaks(runs: Sequence[tuple[Callable, tuple]], warmup: int, may_cycle: int | None = None,
                     held: int | None = None, shared: bool = True) -> list[list[tuple]]:
    """The allocation events of one measured run of each ``fn(*args)`` of ``runs``, after
    ``warmup`` unmeasured runs of it (at least one), as :func:`_requested_peak` measures
    each; their requested peaks are :func:`~tfremat.runtime.memory._replayed_peak` of them.

    The first run of each (which instantiates the function: Grappler and its kernels) runs
    before the profiler starts, the further warm-up run and the measured one of each in
    turn inside one profiler session, the measured ones each in its window
    (:class:`~tfremat.runtime.memory.AllocationWindows`): a session of its own per peak cost
    about 20 ms of wall time, most of a small layer's peak. The runs and the bytes they
    request are those of separate sessions (``benchmarks/first_step_latency.py --phases``
    compares the graph's memory fields with the per-peak sessions bit for bit).

    ``may_cycle``: the position of a run whose added order (:func:`_sources_first`) may
    close a cycle once Grappler has rewritten the graph: with oneDNN off a ``monet`` variant
    of a VGG block's convolution ran "129 nodes in a cycle" (tests/test_layer_variants.py).
    That order cannot run, so it adds nothing to the largest over the orders that can (no
    events). ``held``: the position of a run whose results are held to the end of its window
    (:func:`_hidden_residual_bytes`), so that none of them is freed in it. ``shared=False``:
    each run in a session of its own, its warm-up runs outside it, for a call that runs a
    while loop, whose warm-up runs record so many events (a few per iteration) that reading
    them cost more than the sessions saved (bilstm_text's peaks: 2.5 -> 3.8 CPU s shared).

    Raises:
        ExtractionError: the allocator keeps no statistics (:func:`reset_allocator_peak`).
    """
    device = default_device()
    reset_allocator_peak(device)  # raises, saying how to turn the statistics on, when they are off
    runnable = []
    for position, (fn, args) in enumerate(runs):
        try:
            synchronize(fn(*args))
        except tf.errors.InvalidArgumentError as error:
            if position != may_cycle or "in a cycle" not in str(error):
                raise
            logger.debug("%s: the forward with the inputs' own operations first closes a cycle; order left out",
                         getattr(fn, "name", fn))
            continue
        runnable.append(position)
    events: list[list[tuple]] = [[] for _ in runs]
    groups = [runnable] if shared else [[position] for position in runnable]
    for group in groups:
        if not shared:
            for _ in range(max(1, warmup) - 1):
                synchronize(runs[group[0]][0](*runs[group[0]][1]))
        with AllocationWindows(device) as session:
            windows = {}
            for position in group:
                fn, args = runs[position]
                for _ in range(max(1, warmup) - 1 if shared else 0):
                    synchronize(fn(*args))

                def run(fn=fn, args=args, hold=position == held):
                    result = fn(*args)
                    synchronize(result)
                    if hold:
                        kept.append(result)

                kept = []
                windows[position] = session.run(run)
        for position, window in windows.items():
            events[position] = session.events(window)
    return events


def _requested_peak(fn: Callable, args, warmup: int) -> int:
    """The peak of the bytes ``fn(*args)`` requests from the allocator above what existed
    before it, after ``warmup`` unmeasured runs (at least one: first-run allocations such
    as kernel caches are not the call's), from the profiler's allocation events
    (:func:`tfremat.runtime.memory.requested_peak`, what
    ``measure_step_peak(..., count="requested")`` reads of a compiled step).

    Requested bytes, not the allocator's own peak: BFC counts whole chunks and hands out a
    free chunk whole when it is less than twice the request, so its peak depends on what
    the process allocated before (a convolution gradient's scratch buffer, tens of MiB on
    CPU, may land in a chunk twice its size; a loop's many small per-iteration
    allocations likewise). The requested bytes are what the step's memory is held to and
    do not depend on the process's history. One measured run after the warm-up: the
    order in which a loop's iterations run is fixed by its trace
    (:func:`_other_orders_peak`); further runs settle on the same peak or a smaller one.

    Raises:
        ExtractionError: the allocator keeps no statistics (:func:`reset_allocator_peak`).
    """
    device = default_device()
    reset_allocator_peak(device)  # raises, saying how to turn the statistics on, when they are off
    for _ in range(max(1, warmup)):
        synchronize(fn(*args))
    return requested_peak(lambda: synchronize(fn(*args)), device, allow_empty=True)


@contextlib.contextmanager
def call_values(values: Sequence[tf.Tensor | None]):
    """Within it, the calls analyzed take ``values`` (per flattened input of the call, a
    tensor or None) for their inputs that are neither floats nor booleans, instead of zeros.

    A layer may assert what its integer or string inputs hold: a ``StringLookup`` or
    ``IntegerLookup`` with ``num_oov_indices=0`` fails on any value outside its vocabulary,
    so the zeros and empty strings :func:`_sample` makes up crashed profiling where
    ``model.fit`` trained (benchmarks/results/user_check_6.md, finding 2). The extraction
    passes what the user's batch gives each call (:func:`tfremat.extract.extractor.extract`).
    Floats stay made up: their values move no byte and no cost that is measured.
    """
    token = _CALL_VALUES.set(tuple(values))
    try:
        yield
    finally:
        _CALL_VALUES.reset(token)


def _samples(specs: Sequence[tf.TensorSpec], values: Sequence[tf.Tensor | None] | None = None) -> list[tf.Tensor]:
    """:func:`_sample` per spec, with the input values of :func:`call_values` (or ``values``)
    where they are known; specs past them (the Keras masks a call's inputs carry) have none."""
    values = _CALL_VALUES.get() if values is None else values
    return [_sample(spec, values[p] if p < len(values) else None) for p, spec in enumerate(specs)]


def _sample(spec: tf.TensorSpec, value: tf.Tensor | None = None) -> tf.Tensor:
    """A deterministic tensor for a spec: small random floats, True for booleans (a Keras
    mask that keeps every step: a value-dependent shape at its largest), ``value`` fitted to
    the spec's shape for anything else (:func:`_fitted`), zeros (empty strings) where it
    is None or cannot be fitted."""
    if _is_float(spec.dtype):
        rng = np.random.default_rng(0)
        return tf.constant(rng.standard_normal(spec.shape).astype(np.float32) * 0.1, dtype=spec.dtype)
    if spec.dtype == tf.bool:
        return tf.ones(spec.shape, dtype=tf.bool)
    fitted = None if value is None else _fitted(value, spec)
    return fitted if fitted is not None else tf.zeros(spec.shape, dtype=spec.dtype)


def _fitted(value: tf.Tensor, spec: tf.TensorSpec) -> tf.Tensor | None:
    """``value`` cut or repeated along each dimension to the spec's shape (a batch of 4
    values fills a spec of 6 as values 0, 1, 2, 3, 0, 1); None when its dtype or rank is
    not the spec's or a dimension is empty."""
    value = tf.convert_to_tensor(value)
    if value.dtype != spec.dtype or value.shape.rank != spec.shape.rank or 0 in value.shape:
        return None
    for axis, (have, want) in enumerate(zip(value.shape, spec.shape)):
        if have != want:
            value = tf.gather(value, tf.range(want) % have, axis=axis)
    return value


def _batch_sized_vectors(tracer: _CallTracer, batch_size: int, names: Sequence[str], layer_name: str) -> set[str]:
    """Which of the vectors ``names`` (residuals of shape ``[batch_size]``) grow with the batch.

    A vector as long as the batch may be per sample (a per-sample loss) or per channel
    (batch norm's statistics when the channel count equals the batch size; counted as
    batch-sized they would keep each batch norm's output alive to its backward in the
    graph, which the step does not). The step is traced again, trace only, with one more
    sample; the tensors of the two traces are matched by name. A layer that cannot be
    traced at another batch size keeps every such vector batch-sized, the side that never
    predicts less than the step holds.
    """
    if not names:
        return set()
    probe_specs = [
        tf.TensorSpec([batch_size + 1, *s.shape[1:]], s.dtype) if s.shape.rank and s.shape[0] == batch_size else s
        for s in tracer.input_specs
    ]
    try:
        tracer.trace("probe", probe_specs)
    except Exception as error:  # noqa: BLE001 - any layer code may refuse another batch size
        logger.debug("layer %s does not trace at batch %d (%s); its %d batch-long vectors count as batch-sized",
                     layer_name, batch_size + 1, type(error).__name__, len(names))
        return set(names)
    finally:
        probed = tracer.records.pop("probe", None)
    shapes = {t.name: t.shape for t in probed["reads"][2]} if probed else {}
    return {n for n in names if n not in shapes or shapes[n].rank != 1 or shapes[n][0] == batch_size + 1}


class _CallTracer:
    """Traces one layer call together with its VJP, as the compiled step runs them.

    Every trace records what it saw in ``records[fetch]``: the forward and backward
    operations, what the backward reads of the forward (:func:`_backward_reads`) and the
    input positions whose gradients are distinct tensors. ``fetch`` names the trace and
    picks what it returns (see :meth:`forward_backward`): ``"step"`` (the trace the
    analysis reads and the run the backward is measured on), ``"probe"`` (the step at
    another batch size, :func:`_batch_sized_vectors`), ``"held"`` (the forward returning
    only a loop's accumulators, :func:`_held_bytes`), ``"ungated"`` (the step without
    the order the compiled step imposes), ``"greediest"`` (the step's backward in the order
    of :func:`_run_greediest`) and ``"kept_forward"`` (the forward returning its
    outputs and what the gradient reads of it, the backward pruned: the forward as the step
    runs it, with the tape holding its residuals).
    """

    def __init__(self, call_layer: Callable[[list], object], input_specs: Sequence[tf.TensorSpec],
                 needs_grad: Sequence[bool], variables: Sequence[tf.Variable], one_call: bool):
        self.call_layer = call_layer
        self.input_specs = list(input_specs)
        self.grad_positions = [i for i, (s, g) in enumerate(zip(input_specs, needs_grad)) if g and _is_float(s.dtype)]
        self.variables = variables
        self.one_call = one_call
        self.records: dict[str, dict] = {}

    def trace(self, fetch: str, specs: Sequence[tf.TensorSpec] | None = None, gated: bool = True,
              greediest: bool = False, jit_compile: bool = False):
        """A fresh concrete function of :meth:`forward_backward` (a new ``tf.function``
        each time, so each call traces again) on ``specs`` (default: the call's inputs),
        compiled by XLA with ``jit_compile``."""

        def run(flat_inputs, seed):
            return self.forward_backward(flat_inputs, seed, fetch, gated, greediest)

        specs = self.input_specs if specs is None else specs
        return tf.function(run, autograph=False, jit_compile=jit_compile).get_concrete_function(list(specs), _SEED_SPEC)

    def forward_backward(self, flat_inputs, seed, fetch: str, gated: bool = True, greediest: bool = False):
        """The call and its VJP as the compiled step runs them (the trace the analysis
        reads, and the run the backward's time and workspace come from).

        The step asks a persistent tape for the input and weight gradients in one
        ``gradient`` call whose weight-only operations wait for the input gradients
        (:func:`~tfremat.runtime.gradient_order.input_then_weight_gradients`; a
        non-persistent tape and one unordered call when the forward runs a while loop,
        :func:`~tfremat.runtime.tape.takes_one_gradient_call`), and the memory model
        counts the forward value (outputs and the tensors the gradient reads) and the
        upstream gradients as resident while the backward node runs: they are returned
        here, so they live to the end, and the upstream gradients are made inside (from
        ``seed``, after the forward) as the step makes them. With one ``gradient`` call
        on caller-owned gradients TensorFlow frees a residual mid-way, and a transient
        such as ``ReluGrad``'s batch-sized output would measure as 0 bytes. A loop's
        accumulators are the exception: the gradient loop, their only reader, pops them
        one step at a time, so they are not returned (returning them would over-count the
        backward's workspace).

        With ``fetch="consumed"`` the residuals are not returned, so each dies when the
        gradient has read it: how the step runs the backward node of a call whose gradient
        reads residuals but not its output, where nothing else reads them
        (``DFGraph.residual_bytes``).

        With ``fetch="dying"`` it returns the gradients only: the upstream gradients, the
        output and the residuals die inside the backward, as in the step where the backward
        node is their last reader (``CallAnalysis.dying_backward_workspace``).

        With ``fetch="held"`` it returns only the ``variant`` residuals: nothing returned
        reads the gradient, so its operations do not run, and the bytes still allocated
        afterwards are those the accumulators hold.

        ``gated``: the backward starts once the forward value and the upstream gradients
        exist, as in the step (each statement waits for the previous one), so what the
        workspace subtracts as held is live at the backward's peak; and once the forward's
        state updates ran (batch norm's moving averages), which the single-threaded
        executor otherwise ran before or after the backward's first operations depending
        on the trace, so that their temporaries counted as the backward's workspace or as
        hidden residuals (0, 32 or 64 B of a batch norm over 8 channels) from one
        extraction to the next. Ungated, the upstream gradients still wait for the forward,
        as in the step: without it TensorFlow ran a convolution's forward after its filter
        gradient in about half the traces, or with its scratch buffer alive when the
        upstream was made, so that the forward's temporaries counted in the backward's
        workspace (benchmarks/results/workspace_repeatability.md). The ungated order is measured
        too (``profile``): the order of the gradient's own ops follows what is ready when,
        and batch norm's gradient can hold one more batch-sized buffer that way, as in
        some of the step's backward statements.

        ``greediest``: the backward's operations run one at a time in the order that holds
        the most of its temporaries at once (:func:`_run_greediest`); the step's executor
        may pick it where the isolated run does not. With ``fetch="kept_forward"`` the
        forward's operations that read only its inputs run first instead
        (:func:`_sources_first`).
        """
        one_call, variables = self.one_call, self.variables
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape(persistent=not one_call) as tape:
            for i in self.grad_positions:
                tape.watch(flat_inputs[i])
            outputs = tf.nest.flatten(self.call_layer(list(flat_inputs)))
        mark = len(graph.get_operations())
        targets = [o for o in outputs if _is_float(o.dtype)]
        updates = [op for op in graph.get_operations()[:mark] if not op.outputs and op.op_def.is_stateful]
        with tf.control_dependencies(outputs + updates):
            upstream = [tf.fill(tf.shape(o), tf.cast(seed, o.dtype)) for o in targets]
        sources = [flat_inputs[i] for i in self.grad_positions]
        gradient = functools.partial(tape.gradient, targets, output_gradients=upstream,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
        input_ops = None  # the input gradients' own operations, with ordered weight gradients only
        with tf.control_dependencies(outputs + upstream if gated else []):
            if not targets:
                input_part, weight_part = [], []
            elif one_call:
                both = gradient(sources + list(variables), unconnected_gradients=tf.UnconnectedGradients.NONE) \
                    if sources or variables else []
                input_part, weight_part = both[:len(sources)], both[len(sources):]
            else:
                # As the step takes them (tfremat.runtime.gradient_order): one call, the
                # weight gradients' own operations after the input gradients.
                input_part, weight_part = input_then_weight_gradients(
                    lambda xs: gradient(xs, unconnected_gradients=tf.UnconnectedGradients.NONE), sources,
                    list(variables))
                input_part = [tf.zeros_like(s) if g is None else g for s, g in zip(sources, input_part)]
                input_ops = _needed_ops([g for g in input_part if g is not None], mark)
        operations = graph.get_operations()
        reads = _backward_reads(operations[:mark], operations[mark:], flat_inputs, outputs)
        input_reads = None if input_ops is None else _backward_reads(operations[:mark], input_ops, flat_inputs, outputs)
        # Input gradients that are one tensor (an Add's gradient is its upstream gradient
        # for every input) are one buffer in the step: their positions, counted once.
        distinct: dict = {}
        for position, g in zip(self.grad_positions, input_part):
            if g is not None:
                distinct.setdefault(g.ref(), position)
        # What runs: a registered gradient function makes gradients nobody asks for (the
        # filter gradient of a convolution when only its input gradient is taken), which
        # the step's graph prunes; the flops count only what runs.
        running = _needed_ops([g for g in (*input_part, *weight_part) if g is not None], mark)
        if greediest and fetch != "kept_forward":
            _run_greediest(running, _returned(fetch, [g for g in (*input_part, *weight_part) if g is not None],
                                              outputs, upstream, reads[2]))
        self.records[fetch] = {"forward_ops": operations[:mark], "backward_ops": operations[mark:],
                               "running_backward_ops": running, "reads": reads,
                               "grad_positions": sorted(distinct.values()), "input_ops": input_ops,
                               "input_reads": input_reads,
                               "buffers": _gradient_buffers(self.grad_positions, input_part, upstream,
                                                            operations[mark:])}
        if fetch == "held":
            return [t for t in reads[2] if t.dtype == tf.variant]
        grads = [g for g in (*input_part, *weight_part) if g is not None]
        if fetch == "dying":
            return grads
        if fetch == "consumed":
            return grads + upstream
        if fetch == "kept_forward" and greediest:
            _sources_first(_forward_without_inputs(self.records[fetch]))
        if fetch == "kept_forward":
            # Keras's cross-entropies read a softmax/sigmoid output's logits (``_keras_logits``),
            # which then outlive the activation: alone, it wrote into their buffer, and the
            # U-Net's last convolution requested one output more than predicted
            # (benchmarks/results/fidelity_requested.md).
            logits = [getattr(o, "_keras_logits", None) for o in outputs]
            return outputs + [t for t in logits if t is not None] + [t for t in reads[2] if t.dtype != tf.variant]
        return grads + outputs + upstream + [t for t in reads[2] if t.dtype != tf.variant]


@_sequentially
def analyze_call(
    call_layer: Callable[[list], object],
    layer_name: str,
    input_specs: Sequence[tf.TensorSpec],
    needs_grad: Sequence[bool],
    variables: Sequence[tf.Variable],
    batch_size: int,
    profile: bool,
    repeats: int = 5,
    warmup: int = 2,
    input_masks: Sequence[tf.TensorSpec | None] = (),
) -> CallAnalysis:
    """Traces (and with ``profile`` runs) one layer call and its VJP.

    A call whose backward reads ``variant`` residuals (a while loop's accumulators), or
    whose forward runs a while loop, is also run once without ``profile``: the bytes those
    residuals hold and the loops' iteration counts exist only at run time.

    Args:
        call_layer: runs the layer on the flattened input tensors (with ``training=True``).
        layer_name: for error messages.
        input_specs: the flattened inputs, batch included.
        needs_grad: per input, whether the backward returns its gradient.
        variables: the trainable variables the backward differentiates.
        batch_size: the batch dimension, to tell batch-sized residuals from small ones.
        profile: also time the call and measure its workspace.
        repeats, warmup: the fewest timed runs and untimed warm-up runs
            (:func:`~tfremat.extract.call_timing.time_call`).
        input_masks: per input, the spec of the Keras mask it carries when the step first
            calls the layer, or None (``LayerCall.input_masks``; a dimension left None is
            the input's); empty: none does (module docstring).

    Returns:
        A :class:`CallAnalysis`.

    Raises:
        ExtractionError: a shape is not static, or a ``variant`` residual cannot be sized
            (no allocator statistics and no ``TensorList`` element shape), or a mask's
            shape is not fixed by its input's.
    """
    num_inputs = len(input_specs)
    if any(mask is not None for mask in input_masks):
        call_layer, input_specs, needs_grad = _with_input_masks(call_layer, input_specs, needs_grad, input_masks,
                                                                layer_name)
    forward_concrete, output_specs, one_call = _trace_forward(call_layer, input_specs)
    output_bytes = sum(tensor_bytes(s, d, "the output", layer_name) for s, d in output_specs)
    tracer = _CallTracer(call_layer, input_specs, needs_grad, variables, one_call)
    fb_concrete = tracer.trace("step")
    executor.check_loop_executor(fb_concrete.graph)
    record = tracer.records["step"]
    reads_inputs, reads_output, read_tensors = record["reads"]
    residuals, small = _sized_residuals(tracer, read_tensors, batch_size, layer_name, fb_concrete)
    held_concrete, loop_bytes, iterations = _loop_residuals(tracer, read_tensors, layer_name)
    graph = fb_concrete.graph
    analysis = CallAnalysis(
        output_specs=output_specs,
        output_bytes=output_bytes,
        reads_inputs=tuple(sorted(p for p in reads_inputs if p < num_inputs)),
        reads_output=reads_output,
        residual_bytes=sum(residuals.values()) + loop_bytes,
        small_residual_bytes=sum(small.values()),
        input_grad_bytes=sum(
            tensor_bytes(input_specs[i].shape, input_specs[i].dtype, f"input {i}", layer_name)
            for i in record["grad_positions"]
        ),
        forward_flops=_flops(graph, record["forward_ops"], iterations),
        backward_flops=_flops(graph, record["running_backward_ops"], iterations),
        loop_residual_bytes=loop_bytes,
        one_gradient_call=one_call,
        input_gradient_reads_forward=record["input_reads"] is None or _reads_forward(record["input_reads"], num_inputs),
        input_gradient_flops=0.0 if record["input_ops"] is None else _flops(graph, record["input_ops"], iterations),
        view_input=_own_input(view_position(forward_concrete, input_specs), num_inputs),
        passed_input_grads=record["buffers"][0],
        shared_input_grads=record["buffers"][1],
    )
    if profile:
        upstream_bytes = sum(tensor_bytes(s, d, "an output gradient", layer_name) for s, d in output_specs
                             if _is_float(tf.as_dtype(d)))
        analysis = _profile_call(analysis, tracer, forward_concrete, fb_concrete, held_concrete, upstream_bytes,
                                 batch_size, repeats, warmup, layer_name)
    if _XLA_LAYOUTS.get():
        timed, analysis = analysis, _with_xla_layouts(analysis, tracer, layer_name)
        derive(timed, analysis)
    return analysis


def _with_input_masks(call_layer: Callable[[list], object], input_specs: Sequence[tf.TensorSpec],
                      needs_grad: Sequence[bool], input_masks: Sequence[tf.TensorSpec | None], layer_name: str):
    """``(call_layer, input_specs, needs_grad)`` extended by one input per mask of
    ``input_masks`` (module docstring): the masks follow the call's inputs, need no gradient,
    and are set on their inputs (``_keras_mask``) before ``call_layer`` runs, where
    ``Layer.__call__`` reads them, as in the compiled step
    (``tfremat.static_graph.interpreter``, ``_with_keras_masks``)."""
    masked = [(position, _mask_spec(mask, input_specs[position], position, layer_name))
              for position, mask in enumerate(input_masks) if mask is not None]
    count = len(input_specs)

    def call_masked(flat_inputs):
        inputs = list(flat_inputs[:count])
        for (position, _), mask in zip(masked, flat_inputs[count:]):
            set_keras_mask(inputs[position], mask)
        return call_layer(inputs)

    return call_masked, [*input_specs, *(spec for _, spec in masked)], [*needs_grad, *(False for _ in masked)]


def _mask_spec(mask: tf.TensorSpec, input_spec: tf.TensorSpec, position: int, layer_name: str) -> tf.TensorSpec:
    """The full shape of the Keras mask on input ``position``: a dimension unknown when the
    model was built (the batch, a sequence length) is the input's at that axis, as a mask
    shapes the leading axes of the tensor it masks."""
    shape = [input_spec.shape[axis] if size is None and axis < input_spec.shape.rank else size
             for axis, size in enumerate(mask.shape)]
    if any(size is None for size in shape):
        raise ExtractionError(
            f"layer {layer_name!r}: the Keras mask on input {position} has shape {mask.shape}, which the input's "
            f"shape {input_spec.shape} does not fix; give the model inputs of static shape (keras.Input(shape=...) "
            "or a sample batch), or pass the mask as an argument",
            layer=layer_name,
        )
    return tf.TensorSpec(shape, mask.dtype)


def _reads_forward(reads: tuple[set[int], bool, list], num_inputs: int) -> bool:
    """Whether :func:`_backward_reads`' ``reads`` read any of the forward pass beyond the masks."""
    inputs, output, residuals = reads
    return any(p < num_inputs for p in inputs) or output or bool(residuals)


def _own_input(position: int | None, num_inputs: int) -> int | None:
    """``position`` if it is one of the call's own inputs (not a mask), else None."""
    return position if position is not None and position < num_inputs else None


def _with_xla_layouts(analysis: CallAnalysis, tracer: _CallTracer, layer_name: str) -> CallAnalysis:
    """``analysis`` with what XLA holds beyond TensorFlow's kernels for the call in a step
    compiled with ``jit_compile=True``:

    * each input that the gradient reads only through a layout copy XLA makes of it
      (:func:`~tfremat.extract.xla_layouts.backward_layout_copies`, on the call and its
      gradient compiled by XLA) is read as a batch-sized residual of the copy's bytes;
    * a copy of each trainable variable, as a small residual (fixed bytes): XLA updates a
      variable in its own buffer and copies it at the start of the step for the reads of
      the old value (``copy(argN)`` of every kernel in the optimized HLO of both steps of
      ``benchmarks/xla.py``'s residual chain and of the small conv net of
      ``tests/test_xla.py``, where the head's 160 KiB kernel was a fifth of the peak).

    Measured with ``benchmarks/xla.py``: the residual chain's step at 50% of its
    activations requested 1.17x its prediction without the layout copies (five 2.25 MiB
    copies live at its peak) and 0.91x with them.

    Raises:
        ExtractionError: XLA cannot compile the call or its gradient.
    """
    variable_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in tracer.variables)
    analysis = dataclasses.replace(analysis, small_residual_bytes=analysis.small_residual_bytes + variable_bytes)
    if not analysis.reads_inputs:
        return analysis
    inputs = _samples(tracer.input_specs)

    def step(flat_inputs, seed):
        return tracer.forward_backward(flat_inputs, seed, "xla_layouts")

    def forward(flat_inputs):
        return tracer.call_layer(list(flat_inputs))

    with xla_compiled(layer_name):
        step_hlo = tf.function(step, autograph=False, jit_compile=True).experimental_get_compiler_ir(
            inputs, tf.constant(1.0))(stage="optimized_hlo")
        forward_hlo = tf.function(forward, autograph=False, jit_compile=True).experimental_get_compiler_ir(
            inputs)(stage="optimized_hlo")
    workspace, indices = _select_and_scatter_bytes(step_hlo, [s.shape.num_elements() for s in tracer.input_specs])
    if workspace:
        logger.debug("layer %s: XLA selects its gradient's positions with %d bytes of indices, %d kept", layer_name,
                     workspace, indices)
        analysis = dataclasses.replace(analysis, forward_workspace=analysis.forward_workspace + workspace,
                                       residual_bytes=analysis.residual_bytes + indices)
    copied = {p: elements for p, elements in backward_layout_copies(step_hlo, forward_hlo, len(inputs)).items()
              if p in analysis.reads_inputs}
    if not copied:
        return analysis
    extra = sum(elements * tf.as_dtype(tracer.input_specs[p].dtype).size for p, elements in copied.items())
    logger.debug("layer %s: XLA's gradient reads layout copies of inputs %s (%d bytes)", layer_name, sorted(copied),
                 extra)
    return dataclasses.replace(analysis, reads_inputs=tuple(p for p in analysis.reads_inputs if p not in copied),
                               residual_bytes=analysis.residual_bytes + extra)


_IOTA = re.compile(r"=\s*([a-z]+)(\d*)\[([\d,]*)\]\S*\s+iota\(")
_VARIADIC_WINDOW = re.compile(r"=\s*\(([^()]*)\)\s+reduce-window\(")
_ARRAY = re.compile(r"([a-z]+)(\d*)\[([\d,]*)\]")


def _array_bytes(kind: str, bits: str, dims: str) -> int:
    """Bytes of an HLO array type (``s32``, ``[32,16]``); ``pred`` is one byte."""
    return math.prod(int(d) for d in dims.split(",") if d) * (int(bits) // 8 if bits else 1)


def _select_and_scatter_bytes(step_hlo: str, input_elements: Sequence[int]) -> tuple[int, int]:
    """``(workspace, indices)``: the bytes XLA's CPU backend adds to a call whose gradient
    scatters to selected positions (a max pool's), from the optimized HLO of the call and
    its gradient. It rewrites the select-and-scatter into a reduce-window that carries one
    ``iota`` of the input's shape per dimension next to the input, returning the selected
    positions (one integer array of the output's size per dimension), and a scatter of the
    upstream gradient to them in the backward. Its scheduler runs the reduce-window in the
    forward, so the iotas and its outputs are the forward's workspace and the positions
    live to the backward (a residual). TensorFlow's kernels need neither: the CNN of
    user_check_3.md finding 4 (a 2x2 max pool of a 4 MiB map) requested 10.00 MiB more than
    predicted under ``jit_compile=True``, with four 4 MiB iotas live at its peak
    (benchmarks/results/fidelity_requested.md)."""
    windows = [m.group(1) for m in _VARIADIC_WINDOW.finditer(step_hlo)]
    if not windows:
        return 0, 0
    sizes = set(input_elements)
    iotas = sum(_array_bytes(*array) for array in _IOTA.findall(step_hlo)
                if math.prod(int(d) for d in array[2].split(",") if d) in sizes)
    outputs = [_ARRAY.findall(window) for window in windows]
    returned = sum(_array_bytes(*array) for arrays in outputs for array in arrays)
    indices = sum(_array_bytes(*array) for arrays in outputs for array in arrays if array[0] in ("s", "u"))
    return iotas + returned, indices


def _trace_forward(call_layer: Callable[[list], object], input_specs: Sequence[tf.TensorSpec],
                   jit_compile: bool = False):
    """``(concrete function, output specs, one_gradient_call)`` of a forward-only trace
    (compiled by XLA with ``jit_compile``).

    The output specs come from it, and whether the backward takes one gradient call: the
    interpreter decides on the same forward-only trace (its trial trace).
    """

    def forward(flat_inputs):
        return call_layer(list(flat_inputs))

    concrete = tf.function(forward, autograph=False, jit_compile=jit_compile).get_concrete_function(list(input_specs))
    out_tensors = tf.nest.flatten(concrete.structured_outputs)
    output_specs = tuple((tuple(t.shape.as_list()), t.dtype.name) for t in out_tensors)
    return concrete, output_specs, takes_one_gradient_call(concrete.graph.get_operations())


def _sized_residuals(tracer: _CallTracer, read_tensors, batch_size: int, layer_name: str,
                     step_concrete) -> tuple[dict[str, int], dict[str, int]]:
    """The residuals' bytes by name, split into those that grow with the batch (the node's
    value) and the others (fixed bytes); ``variant`` residuals are left to
    :func:`_loop_residuals`.

    A residual whose shape depends on values (the normalized values an output-activated
    batch norm keeps for its channels whose gamma is 0, :mod:`tfremat.runtime.variants`) or
    is not known when traced (a fused batch norm's third reserve space) is sized on one run
    of the step on a sample batch, with the variables as they are; its batch dimension,
    when static, still decides where it counts."""
    residuals: dict[str, int] = {}
    small: dict[str, int] = {}
    vectors = [t.name for t in read_tensors if t.shape.rank == 1 and t.shape[0] == batch_size]
    batch_vectors = _batch_sized_vectors(tracer, batch_size, vectors, layer_name)
    kept = [t for t in read_tensors if t.dtype != tf.variant]
    run_shapes = {}
    if any(not t.shape.is_fully_defined() for t in kept):
        values = step_concrete(_samples(tracer.input_specs), tf.constant(1.0))
        run_shapes = {t.name: v.shape.as_list() for t, v in zip(kept, values[len(values) - len(kept):])}
    for t in read_tensors:
        if t.dtype == tf.variant:
            continue  # sized by running the call (_loop_residuals)
        shape = t.shape.as_list() if t.shape.rank is not None else [None]
        size = tensor_bytes(run_shapes.get(t.name, shape), t.dtype, f"residual {t.name}", layer_name)
        batch_sized = len(shape) >= 1 and shape[0] == batch_size and (len(shape) > 1 or t.name in batch_vectors)
        (residuals if batch_sized else small)[t.name] = size
    return residuals, small


def _loop_residuals(tracer: _CallTracer, read_tensors, layer_name: str):
    """``(held concrete function or None, bytes the loop's accumulators hold, iterations)``.

    Only for a call that runs a while loop or whose gradient reads ``variant`` tensors:
    their bytes and the iteration count exist only at run time, so the ``"held"`` trace is
    run once (:func:`_held_bytes`); on the single-threaded executor the fewest bytes over
    the call's profiles in this process count (:data:`_LOOP_PEAKS`). Otherwise
    ``(None, 0, 1)``.
    """
    if not (tracer.one_call or any(t.dtype == tf.variant for t in read_tensors)):
        return None, 0, 1
    held_concrete = tracer.trace("held")
    loop_bytes, iterations = _held_bytes(
        held_concrete, (_samples(tracer.input_specs), tf.constant(1.0)), tracer.records["held"], layer_name,
    )
    if not executor.sequential_ops():
        # On the single-threaded executor the bytes in use after the run were up to 3.5 KiB
        # more in some profiles of a small LSTM (a body's temporary not freed yet, as in
        # _loop_peak): the fewest seen in this process count.
        key = (_loop_key(tracer.records["step"]), "held")
        loop_bytes = min(loop_bytes, _LOOP_PEAKS.get(key, (0, loop_bytes))[1])
        _LOOP_PEAKS[key] = (0, loop_bytes)
    logger.debug("layer %s: loop accumulators hold %d bytes over %d iterations", layer_name, loop_bytes, iterations)
    return held_concrete, loop_bytes, iterations


def _profile_call(analysis: CallAnalysis, tracer: _CallTracer, forward_concrete, fb_concrete, held_concrete,
                  upstream_bytes: int, batch_size: int, repeats: int, warmup: int, layer_name: str) -> CallAnalysis:
    """``analysis`` with the seconds and the workspaces measured on the device.

    The forward is timed alone, or for a loop with the tape filling its accumulators (the
    ``"held"`` trace); the backward's seconds are the step's minus the forward's. Each
    workspace is the requested peak minus what the node holds anyway: for the forward its
    value; for the backward the forward value, the upstream gradients, the small
    residuals, the input gradients and the weight gradients. For a call whose gradient
    reads residuals but not its output, the backward's peak is measured with the residuals
    dying as they are read and the output dead (the ``"consumed"`` trace), as in the step:
    kept to the end, a GELU Dense's four residuals were counted once as the forward value
    and again in the workspace; and the output, which the step frees before the backward
    when nothing else reads it, held a buffer that the gradient's temporaries take there.
    That peak is the largest over three orders of the gradient's operations: gated, ungated
    and the greediest one (:func:`_run_greediest`).

    For a call whose gradient reads its output or, as above, only residuals (not a loop's),
    the backward's peak is also measured on the ``"dying"`` trace (in the same three
    orders), which returns the gradients only: the upstream gradients and the output die
    inside it, so ``ReluGrad`` writes into the upstream gradient's buffer as in the step,
    where the held trace makes it allocate one more output-sized buffer, and an attention
    einsum's upstream dies once both its gradients have read it (the timeseries
    Transformer's einsum backward: 4,225 KiB of workspace held, 130 KiB dying;
    benchmarks/results/fidelity_requested.md). Its workspace (``dying_backward_workspace``,
    the same subtraction) holds only where the backward node is the upstream's sole
    reader, which graph assembly decides (:func:`tfremat.extract.assembly.sole_upstream`).

    The forward's peak (not a loop's) counts its allocations no larger than one example's
    output as live throughout (:func:`~tfremat.runtime.memory.order_free_peak`): which of a
    batch norm's per-channel vectors were live at its peak depended on the order the runtime
    drew for that trace, and with it the workspace (up to 40% of it) from one extraction to
    the next (benchmarks/results/profile_agreement.md, "Session 29 (W)").

    Within :func:`xla_costs` the seconds are timed on the forward and the step's trace
    compiled by XLA (:func:`_xla_functions`); the workspaces are measured as above. Within
    :func:`memory_only` nothing is timed (seconds 0).
    """
    inputs = _samples(tracer.input_specs)
    weight_grad_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in tracer.variables)
    timed_forward = (held_concrete, (inputs, tf.constant(1.0))) if held_concrete is not None else (forward_concrete, (inputs,))
    args = (inputs, tf.constant(1.0))
    # Every function whose requested peak counts, traced first and measured in one profiler
    # session (_requested_peaks): forward ones, backward ones, then the "dying" ones.
    forward_runs = [timed_forward]
    sources_first = None  # the position of the forward whose added order may close a cycle
    if held_concrete is None and not _XLA_LAYOUTS.get():
        # Alone, the forward's residuals have no reader and Grappler folds the arithmetic that
        # makes them: a LayerNormalization's full-size temporary counted 0 and its forward
        # statement requested one output more than predicted (benchmarks/results/layernorm_forward.md).
        forward_runs.append((tracer.trace("kept_forward"), args))
        if _first_ops(_forward_without_inputs(tracer.records["kept_forward"])):
            sources_first = len(forward_runs)
            forward_runs.append((tracer.trace("kept_forward", greediest=True), args))
    consumed = analysis.residual_bytes and not analysis.reads_output and held_concrete is None
    if consumed:
        # The residuals die as the gradient reads them: the node's residual part has no
        # other reader, and the simulator counts it as resident for the whole backward node.
        backward_runs = [(tracer.trace("consumed", gated=gated, greediest=greedy), args)
                         for gated, greedy in ((True, False), (False, False), (True, True))]
    else:
        backward_runs = [(fb_concrete, args), *_other_orders(tracer, held_concrete is not None, args)]
    # A loop's accumulators, which its forward allocates, are counted by _held_bytes already.
    hidden_run = [] if _XLA_LAYOUTS.get() or held_concrete is not None else [(fb_concrete, args)]
    dying_runs = []
    if (analysis.reads_output or consumed) and held_concrete is None and not _XLA_LAYOUTS.get():
        # The step's gradient writes into the upstream gradient's buffer (ReluGrad), or frees
        # it once read, when the node is its last reader; held to the end here, it cannot
        # (benchmarks/results/forwarded_upstream.md).
        dying_runs = [(tracer.trace("dying", gated=gated, greediest=greedy), args)
                      for gated, greedy in ((True, False), (False, False), (True, True))]
    runs = forward_runs + backward_runs + hidden_run + dying_runs
    events = _requested_peaks(runs, warmup, may_cycle=sources_first,
                              held=len(forward_runs) + len(backward_runs) if hidden_run else None,
                              shared=held_concrete is None)
    peaks = [_replayed_peak(run_events)[0] for run_events in events]
    if held_concrete is None and not _loop_variable_bytes(tracer.records["step"]["forward_ops"]):
        # Up to one example's output: on a 1x1 map a per-channel vector is that large.
        small_bytes = analysis.output_bytes // max(1, batch_size) + 1
        small_sizes = _small_output_sizes(_forward_without_inputs(tracer.records["step"]), small_bytes)
        forward_peaks = [order_free_peak(run_events, small_bytes, small_sizes=small_sizes)
                         for run_events in events[:len(forward_runs)]]
    else:
        forward_peaks = peaks[:len(forward_runs)]
    fwd_peak = _loop_peak(tracer.records["step"], "forward", [max(forward_peaks)])
    fb_peaks = peaks[len(forward_runs):len(forward_runs) + len(backward_runs)]
    fb_peak = max(fb_peaks) if consumed else _loop_peak(tracer.records["step"], "backward", fb_peaks)
    hidden = _hidden_residual_bytes(events[len(forward_runs) + len(backward_runs)], tracer.records["step"]) \
        if hidden_run else 0
    if hidden:
        logger.debug("layer %s: its kernels keep %d bytes from the forward to the backward", layer_name, hidden)
        analysis = dataclasses.replace(analysis, residual_bytes=analysis.residual_bytes + hidden)
    held_bytes = (0 if consumed else analysis.output_bytes) + upstream_bytes + analysis.residual_bytes \
        + analysis.small_residual_bytes
    dying = None
    if dying_runs:
        dying_peak = max(peaks[len(runs) - len(dying_runs):])
        dying = max(0, dying_peak - held_bytes - analysis.input_grad_bytes - weight_grad_bytes)
    measured = dataclasses.replace(
        analysis,
        forward_workspace=max(0, fwd_peak - analysis.output_bytes - analysis.residual_bytes),
        backward_workspace=max(0, fb_peak - held_bytes - analysis.input_grad_bytes - weight_grad_bytes),
        dying_backward_workspace=dying,
    )
    if not _TIMED.get():
        return measured
    xla = _XLA_COSTS.get()
    if xla:
        functions = _xla_functions(tracer, args)
    else:
        functions = (dispatch_only(timed_forward[1]), timed_forward[0], fb_concrete)

    specs = tracer.input_specs  # not the tracer: the passes keep this closure to the end
    values = _CALL_VALUES.get()  # the passes run after call_values is left

    def make_calls():
        fresh = _samples(specs, values)
        step_args = (fresh, tf.constant(1.0))
        forward_args = (fresh,) if xla or held_concrete is None else step_args
        return list(zip(functions, (step_args if xla else forward_args, forward_args, step_args)))

    def finish(least):
        forward_seconds, backward_seconds = call_costs(*least)
        return dataclasses.replace(measured, forward_seconds=forward_seconds, backward_seconds=backward_seconds)

    return time_call(measured, make_calls, repeats, warmup, layer_name, xla, finish)


def _small_output_sizes(ops, small_bytes: int) -> dict[str, int]:
    """Per operation of ``ops`` (a forward's), by name, the bytes of its outputs under
    ``small_bytes`` that may take a buffer of their own: all but constants, variable reads
    and views (:data:`_VIEW_OPS`). What the forward's small operations allocate in the order
    that forwards no buffer (:func:`~tfremat.runtime.memory.order_free_peak`); a batch norm's
    forward allocated 7 or 8 of its 13 per-channel vectors, by trace."""
    sizes = {op.name: sum(size for size in map(_static_bytes, op.outputs) if size < small_bytes)
             for op in ops if op.type not in _NOT_RESIDUAL_OPS | _VIEW_OPS}
    return {name: size for name, size in sizes.items() if size}


def _hidden_residual_bytes(events: list[tuple], record: dict) -> int:
    """Bytes a forward operation allocates beyond its outputs that live until the backward
    reads them: a kernel's own residual, invisible in the traced graph.

    With oneDNN on, TensorFlow rewrites ``MaxPool`` and ``MaxPoolGrad`` inside a function
    into oneDNN kernels that pass a workspace (one byte per output element) from the
    forward to the gradient; the trace shows only the output read. Counted as freed after
    the forward, the U-Net's compiled step requested 0.47% more than its prediction
    (``benchmarks/extraction.py``); with ``TF_ENABLE_ONEDNN_OPTS=0`` there is none.

    Read off the allocation ``events`` (in time order) of one run of the gated ``"step"``
    trace (:func:`_requested_peaks`), whose results were held to the end of its window: an
    allocation made by a forward operation before the backward's first, and freed before the run
    ends, is one the backward kept alive (the outputs and the traced residuals are returned, so
    they are not freed; the forward's own temporaries are freed before the backward starts).
    Counted as growing with the batch. Not measured for a call that runs a while loop (its
    accumulators are sized by :func:`_held_bytes`) nor for a step compiled by XLA, which runs no
    oneDNN kernel.
    """
    forward = {op.name for op in record["forward_ops"]}
    backward = {op.name for op in record["backward_ops"]}
    started = next((time for time, allocation, _, _, info in events if allocation and info["op"] in backward), None)
    if started is None:
        return 0
    alive: dict = {}
    kept = 0
    for time, allocation, address, requested, info in events:
        if allocation:
            alive[address] = (time, requested, info["op"])
        elif address in alive:
            made, size, op = alive.pop(address)
            if op in forward and made < started <= time:
                kept += size
    return kept


def _xla_functions(tracer: _CallTracer, args) -> tuple:
    """An XLA function that computes nothing (on ``args``, the step's), the call's forward
    (on the inputs) and the step's trace of its forward and backward (on ``args``), all
    compiled by XLA when first run (:func:`~tfremat.extract.call_timing.time_call` times them)."""
    forward = _trace_forward(tracer.call_layer, tracer.input_specs, jit_compile=True)[0]
    return dispatch_only(args, xla=True), forward, tracer.trace("step", jit_compile=True)


def _other_orders(tracer: _CallTracer, loop: bool, args) -> list[tuple[Callable, tuple]]:
    """The backward in the orders the step may run it in, besides the ``"step"`` trace, as
    functions to measure the requested peaks of on ``args`` (:func:`_requested_peaks`).

    A loop's gradient comes out of each trace with its operations in another order (not
    fixed by Python's hash seed either), and the order decides how many iterations'
    temporaries are in flight at once: the peak differs between traces (several-fold on a
    small LSTM) and is the same on every run of one. The step's trace is another draw, so
    the largest over :data:`_LOOP_TRACES` traces counts (:func:`_loop_peak`). Without a
    loop, the ungated order (:meth:`_CallTracer.forward_backward`) and the greediest one
    (:func:`_run_greediest`): Keras's batch-norm gradient is elementwise operations on
    batch-sized maps whose order the executor picks per process, one more map live in
    some (8 or 12 MiB on a (32, 32, 32, 32) input, so a CNN's checkpoint-all peak was
    37.24 MiB in one fresh process and 41.24 in the next; user_check_3.md finding 9,
    tests/test_batch_norm_workspace.py); the greediest order holds the most.
    """
    if loop:
        return [(tracer.trace("step"), args) for _ in range(_LOOP_TRACES - 1)]
    return [(tracer.trace("ungated", gated=False), args), (tracer.trace("greediest", greediest=True), args)]


def _loop_peak(record: dict, part: str, peaks: Sequence[int]) -> int:
    """The requested peak that counts for ``part`` (``"forward"`` or ``"backward"``) of a
    call, from ``peaks``, the peaks of its traces measured now: their largest, and where
    that part runs a ``While`` on the single-threaded executor (with several inter-op
    threads, :func:`~tfremat.runtime.executor.step_executor`) the least of them plus its
    largest loop variable (:func:`_loop_variable_bytes`) if that is more, each the largest
    over the call's profiles in this process.

    There the executor hands each iteration of the loop's body to an inter-op thread and
    the loop waits for its signal; in a few traces out of ten (and in the compiled step in
    a few processes per hundred) one more buffer of a loop variable was live at the peak: a
    small LSTM's backward requested 170,629 B in most traces and 187,013 B (+16,384, the
    recurrent kernel's gradient accumulator, 32x128 float32) in some; its first layer's
    +4,096, its input kernel's (``benchmarks/workspace_repeatability.py --model lstm``).
    Counting the buffer always, above the least trace, gives the same peak whether a trace
    had it or not, and keeping the largest over the process's profiles makes repeated
    profiles agree once one has seen the noise of the allocator's 256-byte steps
    (benchmarks/results/workspace_repeatability.md)."""
    extra = _loop_variable_bytes(record["forward_ops" if part == "forward" else "backward_ops"])
    if not extra or executor.sequential_ops():
        return max(peaks)
    key = (_loop_key(record), part)
    least, largest = _LOOP_PEAKS.get(key, (0, 0))
    least, largest = max(least, min(peaks)), max(largest, *peaks)
    _LOOP_PEAKS[key] = (least, largest)
    return max(largest, least + extra)


def _loop_key(record: dict) -> str:
    """A digest of a trace's operations (types and shapes, not names): one loop call's
    profiles in a process share it (:data:`_LOOP_PEAKS`)."""
    ops = (*record["forward_ops"], *record["backward_ops"])
    return hashlib.sha1(repr([(op.type, [str(t.shape) for t in op.inputs], [str(t.shape) for t in op.outputs])
                              for op in ops]).encode()).hexdigest()


def _loop_variable_bytes(ops) -> int:
    """Bytes of the largest loop variable of the ``While`` operations among ``ops`` whose
    size the graph gives (not a ``variant`` accumulator, not a resource): 0 without a loop."""
    return max((_static_bytes(t) for op in ops if op.type in _LOOP_OPS for t in op.inputs), default=0)


def _run_greediest(ops, kept) -> None:
    """Makes ``ops`` (operations of the graph being traced, in creation order) run one at a
    time in the order that holds the most bytes at once, as far as a greedy choice finds
    it: of the operations ready to run, the one that adds the most bytes (its outputs)
    less those it frees (inputs it is the last reader of, other than ``kept``: what the
    trace returns), creation order among equals; each waits on the one before through a
    control edge.

    A backward's peak depends on the order its operations run in: a GELU gradient's
    elementwise branches each make an input-sized temporary, and when every branch starts
    before any is summed, all of them are live at once (four in GPT-2's feed-forward
    backward inside the step, where the isolated run, which finished one branch before
    starting the next, had three). The executor's order in the step follows the whole
    step's graph and cannot be replayed in isolation; this order keeps the most
    temporaries open, so its peak covers the step's (``tests/test_requested_bytes.py``).

    What constant folding rewrites stays out of the chain (:func:`_off_chain`): shape reads
    and what Grappler folds into a constant, and operations with a constant operand, which
    it may swap with their reader (``(x * c) * y`` becomes ``(x * y) * c`` in ``Erf``'s
    gradient, each node keeping its control inputs). Either inside the chain closed a
    cycle ("the graph couldn't be sorted in topological order", logged on every layer
    norm and four times on every GELU Dense; ``tests/test_greediest_chain.py``). So does
    that reader once the chain makes it wait for an operation other than its own inputs
    (:func:`_swappable_readers`). A reduction over constant axes stays in the chain
    (:func:`_reduces_over_constant_axes`): left out, the executor ran a softmax gradient's
    ``Sum`` as soon as its input existed, freeing that score-sized input before the value
    gradient's kernel ran, where the step's order may hold both (an attention's backward
    peaked 48 KiB below the ungated trace in some extractions, so its workspace moved;
    ``benchmarks/results/workspace_repeatability.md``, "Session 30 (W2)")."""
    off = _off_chain(ops) - {id(op) for op in ops if _reduces_over_constant_axes(op)}
    off |= _swappable_readers(ops, off)
    ops = [op for op in ops if id(op) not in off]
    inside = {id(op) for op in ops}
    kept_names = {t.name for t in kept}
    readers: dict[str, int] = {}
    for op in ops:
        for t in op.inputs:
            readers[t.name] = readers.get(t.name, 0) + 1
    waits = _waits_within(ops, inside)

    def growth(op) -> int:
        made = sum(_static_bytes(t) for t in op.outputs)
        freed = sum(_static_bytes(t) for t in op.inputs
                    if readers[t.name] == 1 and t.name not in kept_names and t.op.type not in _NOT_RESIDUAL_OPS)
        return made - freed

    done: set[int] = set()
    ordered = []
    pending = list(ops)
    while pending:
        ready = [op for op in pending if waits[id(op)] <= done]
        chosen = max(ready, key=growth)  # the first of the largest: creation order among equals
        pending.remove(chosen)
        done.add(id(chosen))
        for t in chosen.inputs:
            readers[t.name] -= 1
        ordered.append(chosen)
    for previous, op in zip(ordered, ordered[1:]):
        op._add_control_input(previous)  # pylint: disable=protected-access


def _returned(fetch: str, grads: list, outputs: list, upstream: list, residuals: list) -> list:
    """What :meth:`_CallTracer.forward_backward` returns for a backward trace ``fetch``
    (``"dying"``, ``"consumed"`` or the step's), which lives to the end of its run: the
    greediest order (:func:`_run_greediest`) frees every other tensor at its last reader.
    Keeping the upstream gradients and the residuals in every trace, it ran an attention's
    value gradient, their last reader, after the score gradient's kernels, the order that
    peaks lowest (``benchmarks/workspace_repeatability.py --model transformer_encoder``)."""
    if fetch == "dying":
        return grads
    if fetch == "consumed":
        return grads + upstream
    return grads + outputs + upstream + [t for t in residuals if t.dtype != tf.variant]


# Reductions whose axes are a constant: chained by the greediest order (:func:`_run_greediest`).
_REDUCTION_OPS = frozenset({"Sum", "Mean", "Max", "Min", "Prod"})


def _reduces_over_constant_axes(op) -> bool:
    """Whether ``op`` reduces a computed tensor over constant axes (a softmax gradient's
    ``Sum``): constant folding leaves it in place, so it may wait in a chain of operations,
    although it reads a constant (:func:`_off_chain`)."""
    return (op.type in _REDUCTION_OPS and op.inputs[1].op.type == "Const"
            and op.inputs[0].op.type not in _SHAPE_OPS)


def _sources_first(ops) -> bool:
    """Makes the operations of a forward (``ops``, its inputs' placeholders left out) that
    read only the call's inputs and constants run before every other operation that does
    not wait for them already; True when there were such operations.

    Dropout's ``Mul(x, 1 / keep)`` reads nothing of its random chain; run first, the scaled
    input, the uniform draw and the mask are live at once, as in the step, where the
    isolated forward often ran it after the draw was freed (one output less with oneDNN off:
    benchmarks/results/layernorm_forward.md, tests/test_requested_statements.py). The
    forward is not chained as a backward is (:func:`_run_greediest`): Grappler fuses a
    convolution with its bias and activation, and a control edge between fused operations
    closes a cycle. Only operations that Grappler cannot reassociate with their readers
    are moved (:func:`_runs_first`)."""
    early = _first_ops(ops)
    if not early:
        return False
    off = _off_chain(ops)
    inside = {id(op) for op in ops}
    waits = _waits_within(ops, inside)
    firsts = {id(op) for op in early}
    for op in ops:
        if id(op) not in firsts and id(op) not in off and not waits[id(op)] & firsts:
            op._add_control_inputs(early)  # pylint: disable=protected-access
    return True


def _first_ops(ops) -> list:
    """The operations of a forward (``ops``, its inputs' placeholders left out) that
    :func:`_sources_first` runs first: those that read only the call's inputs and
    constants and that Grappler cannot reassociate with their readers (:func:`_runs_first`).
    Read off one trace of a call, it holds for every trace of it: without any, the order
    that runs them first is the call's own, and is neither traced nor measured."""
    off = _off_chain(ops)
    return [op for op in ops if _runs_first(op, off)]


def _forward_without_inputs(record: dict) -> list:
    """The forward operations of a trace's record, its inputs' placeholders left out."""
    return [op for op in record["forward_ops"] if op.type != "Placeholder"]


# Elementwise arithmetic that Grappler's arithmetic optimizer may reassociate with an
# operand that multiplies or adds a constant: ``(x * c) * y`` becomes ``(x * y) * c``.
_REASSOCIABLE_OPS = frozenset({"Mul", "AddV2", "Add", "Sub", "RealDiv", "Div", "AddN", "Neg", "MulNoNan"})


def _runs_first(op, off: set[int]) -> bool:
    """Whether ``op``, one that constant folding may rewrite (its id in ``off``), may run
    before the rest of its forward (:func:`_sources_first`): it reads the call's inputs and
    constants only, at least one input, and no reader could be reassociated with it."""
    if id(op) not in off or op.type in _SHAPE_OPS or op.op_def.is_stateful:
        return False
    kinds = [t.op.type for t in op.inputs]
    if "Placeholder" not in kinds or any(k not in _SHAPE_OPS and k != "Placeholder" for k in kinds):
        return False
    return not any(reader.type in _REASSOCIABLE_OPS for t in op.outputs for reader in t.consumers())


def _off_chain(ops) -> set[int]:
    """Ids of those of ``ops`` (in creation order, so inputs come first) that constant
    folding may replace or rewrite: shape reads and constants (:data:`_SHAPE_OPS`),
    stateless operations whose inputs are all of them, and operations reading one (an
    input made outside ``ops`` counts when it is a shape read or a constant)."""
    constant: set[int] = set()
    off: set[int] = set()
    for op in ops:
        constant_inputs = [id(t.op) in constant or t.op.type in _SHAPE_OPS for t in op.inputs]
        if op.type in _SHAPE_OPS or (constant_inputs and all(constant_inputs) and not op.op_def.is_stateful):
            constant.add(id(op))
        if id(op) in constant or any(constant_inputs):
            off.add(id(op))
    return off


def _swappable_readers(ops, off: set[int]) -> set[int]:
    """Ids of those of ``ops`` that Grappler may reassociate with an operand it may rewrite
    (ids in ``off``, :func:`_off_chain`): elementwise arithmetic (:data:`_REASSOCIABLE_OPS`)
    reading elementwise arithmetic with a constant operand, as ``(x * c) * y`` in ``Erf``'s
    gradient. Chained, such a reader waits for the operation before it; where that is not
    one of its inputs (``TimeDistributed(Dense(activation="gelu"))`` unrolls the GELU once
    per time step, and the greediest order runs every step's ``Exp`` before the first
    step's product), constant folding's swap closed a cycle: "arithmetic_optimizer failed
    ... topological order" and three more lines per profile
    (``tests/test_greediest_chain_unrolled.py``)."""
    return {id(op) for op in ops
            if op.type in _REASSOCIABLE_OPS
            and any(id(t.op) in off and t.op.type in _REASSOCIABLE_OPS for t in op.inputs)}


def _waits_within(ops, inside: set[int]) -> dict[int, set[int]]:
    """For each of ``ops``, the operations of ``ops`` (ids in ``inside``) it depends on,
    directly or through operations outside them (a shape read between two gradient ops),
    so that a chain in the greedy order closes no cycle."""
    reached: dict[int, set[int]] = {}

    def predecessors(op) -> list:
        return [t.op for t in op.inputs] + list(op.control_inputs)

    for root in ops:
        stack = [root]  # depth-first without recursion: a forward graph can be deep
        while stack:
            op = stack[-1]
            if id(op) in reached:
                stack.pop()
                continue
            pending = [b for b in predecessors(op) if id(b) not in inside and id(b) not in reached]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            reached[id(op)] = set().union(*[{id(b)} if id(b) in inside else reached[id(b)] for b in predecessors(op)])
    return {id(op): reached[id(op)] for op in ops}


def _static_bytes(tensor) -> int:
    """Bytes of a graph tensor with a static shape; 0 otherwise (a shape-only tensor)."""
    if tensor.dtype in (tf.resource, tf.variant) or not tensor.shape.is_fully_defined():
        return 0
    return int(np.prod(tensor.shape.as_list(), dtype=np.int64)) * tensor.dtype.size


def _function_graph(graph, name: str):
    """The graph of the function ``name`` in ``graph``'s library, or None."""
    function = graph._get_function(name)  # pylint: disable=protected-access
    return getattr(function, "graph", None)


def _flops(graph, ops, iterations: int) -> float:
    """Flops of ``ops`` (see the module docstring).

    A while loop counts its body ``iterations`` times; a function call (``tf.function``,
    and the wrapper TensorFlow puts around a loop recorded on a persistent tape) counts
    the ops of its function. A loop inside a loop's body counts its body once per outer
    iteration: its own count is not known.
    """
    total = 0.0
    for op in ops:
        if op.type in _LOOP_OPS:
            body = _function_graph(graph, op.get_attr("body").name)
            if body is None:
                logger.warning("while loop %s: its body is not in the graph's library; its flops are not counted", op.name)
                continue
            total += iterations * _flops(body, body.get_operations(), 1)
        elif op.type in _CALL_OPS:
            called = _function_graph(graph, op.get_attr("f").name)
            total += _op_flops(graph, op) if called is None else _flops(called, called.get_operations(), iterations)
        else:
            total += _op_flops(graph, op)
    return total


def _held_bytes(held_concrete, args, record: dict, layer: str) -> tuple[int, int]:
    """Bytes the ``variant`` residuals of a call hold, and its loops' iteration count.

    Runs ``held_concrete`` (the call's forward, returning only those residuals) once to
    warm up and once measured. The allocator's bytes in use after the measured run, above
    those before it, are what the returned accumulators keep: the
    elements they share with tensors that exist anyway (the variables a loop reads on
    every step) are not counted, as they cost nothing more in the step either. Without
    allocator statistics each ``TensorList``'s length times its element size (from the
    handle data) is used instead, which counts shared elements again.

    A loop pushes one element per iteration onto each accumulator, so the longest list is
    the iteration count (1 when no residual is a ``TensorList``; several loops of
    different lengths in one call all count the longest).

    Raises:
        ExtractionError: no allocator statistics and a ``variant`` residual that is not a
            ``TensorList`` with a static element shape.
    """
    variants = [t for t in record["reads"][2] if t.dtype == tf.variant]
    warm = held_concrete(*args)  # first-run allocations are not the tape's
    del warm
    device = default_device()
    try:
        before = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError:
        before = None
    result = held_concrete(*args)
    if before is not None:
        held = max(0, tf.config.experimental.get_memory_info(device)["current"] - before)
    else:
        held = sum(_list_bytes(t, value, layer) for t, value in zip(variants, result))
    lengths = [int(tf.raw_ops.TensorListLength(input_handle=value).numpy())
               for t, value in zip(variants, result) if _list_element(t) is not None]
    return int(held), max(lengths, default=1)


def _list_element(tensor):
    """The element's ``TensorShapeProto`` and dtype of a ``TensorList`` variant tensor, from
    its handle data; None for another kind of variant."""
    data = resource_handle_data(tensor)
    shapes = list(data.shape_and_type) if data is not None and data.is_set else []
    return (shapes[0].shape, tf.dtypes.as_dtype(shapes[0].dtype)) if len(shapes) == 1 else None


def _list_bytes(tensor, value, layer: str) -> int:
    """Bytes of the ``TensorList`` ``value`` (the run's value of the graph tensor ``tensor``)."""
    element = _list_element(tensor)
    if element is None or element[0].unknown_rank or any(d.size < 0 for d in element[0].dim):
        raise ExtractionError(
            f"layer {layer!r}: its gradient keeps the variant tensor {tensor.name} (a while loop's accumulator), "
            "whose size cannot be read without allocator statistics: set TF_CPU_ALLOCATOR_USE_BFC=true before "
            "TensorFlow is imported (importing tfremat first does it), or unroll the loop (unroll=True)",
            layer=layer,
        )
    size = tensor_bytes([d.size for d in element[0].dim], element[1], tensor.name, layer)
    return size * int(tf.raw_ops.TensorListLength(input_handle=value).numpy())


def _gradient_buffers(positions: Sequence[int], grads, upstream,
                      backward_ops) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(passed, shared)``: the positions whose gradient (in ``grads``, one per position,
    None when unconnected) is an upstream gradient's buffer (itself, or a view of it:
    :data:`_VIEW_OPS`), and those whose buffer is also another position's gradient or is
    none the backward made for itself (a constant, a ``ZerosLike`` that Grappler folds
    into one). A gradient of either kind has another reader than the node it flows to,
    or may have, so that node cannot write into it (``CallAnalysis.dying_backward_workspace``)."""

    def base(t):
        while t.op.type in _VIEW_OPS or t.op.type == "IdentityN":
            t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
        return t

    made = {id(op) for op in backward_ops}
    upstream_names = {base(u).name for u in upstream}
    bases = {p: base(g) for p, g in zip(positions, grads) if g is not None}
    counts: dict[str, int] = {}
    for t in bases.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    passed = tuple(p for p, t in bases.items() if t.name in upstream_names)
    shared = tuple(p for p, t in bases.items() if counts[t.name] > 1 or (
        t.name not in upstream_names and (id(t.op) not in made or t.op.type in _CONSTANT_LIKE_OPS)))
    return passed, shared


def _needed_ops(tensors, first: int) -> list:
    """The operations at or after position ``first`` of the current graph that ``tensors``
    depend on (data and control edges): what running them runs. A registered gradient
    function makes every gradient of an op at once (a convolution's filter gradient next to
    its input gradient); the ones nothing asks for are pruned from the step's graph."""
    graph = tf.compat.v1.get_default_graph()
    late = {id(op) for op in graph.get_operations()[first:]}
    needed = needed_ops([t.op for t in tensors], late)
    return [op for op in graph.get_operations()[first:] if id(op) in needed]


def _backward_reads(forward_ops, backward_ops, inputs, outputs) -> tuple[set[int], bool, list]:
    """What the backward ops read of the forward: ``(positions of the inputs read, whether
    an output is read, the other forward tensors read)``; the last are the residuals the
    tape keeps (shape-only reads and variable reads are not).

    A read of a view (:data:`_VIEW_OPS`: a ``Reshape`` that ``Dense`` makes of a 3-D input,
    say) is a read of the tensor it views, whose buffer it shares: counting the view as a
    residual of its own counted the input's bytes twice. Likewise an output that is a view
    of a tensor the backward reads (a ``tf.custom_gradient``'s output is an ``IdentityN`` of
    the value its gradient function holds) makes that read a read of the output."""
    forward = {id(op) for op in forward_ops}
    input_position = {t.name: i for i, t in enumerate(inputs)}
    output_names = {t.name for t in outputs}
    for t in outputs:
        while t.op.type in _VIEW_OPS or t.op.type == "IdentityN":
            t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
            if t.name not in input_position:
                output_names.add(t.name)
    reads_inputs: set[int] = set()
    reads_output = False
    tensors: dict[str, tf.Tensor] = {}
    for op in backward_ops:
        if op.type in _SHAPE_ONLY_OPS:
            continue
        for t in op.inputs:
            if id(t.op) not in forward:
                continue
            while t.op.type in _VIEW_OPS and t.name not in input_position and t.name not in output_names:
                t = t.op.inputs[0]
            if t.name in input_position:
                reads_inputs.add(input_position[t.name])
            elif t.name in output_names:
                reads_output = True
            elif t.op.type not in _NOT_RESIDUAL_OPS and t.dtype != tf.resource:
                tensors[t.name] = t
    return reads_inputs, reads_output, list(tensors.values())


@_sequentially
def analyze_loss(
    loss_fn: Callable,
    pred_specs: Sequence[tf.TensorSpec],
    label_specs: Sequence[tf.TensorSpec],
    profile: bool,
    repeats: int = 5,
    warmup: int = 2,
) -> CallAnalysis:
    """Sizes, flops and (with ``profile``) time and workspace of the loss and its gradient.

    The loss node's value is the scalar loss plus the gradient of the loss with respect to
    every model output; the loss reads the predictions it differentiates (its inputs).
    Within :func:`xla_costs` its seconds are those of the same function compiled by XLA.
    """

    buffers = {}

    def loss_and_grads(preds, labels):
        with tf.GradientTape() as tape:
            for p in preds:
                tape.watch(p)
            loss = loss_fn(list(labels), list(preds))
        graph = tf.compat.v1.get_default_graph()
        mark = len(graph.get_operations())
        grads = tape.gradient(loss, list(preds))
        buffers["shared"] = _gradient_buffers(range(len(grads)), grads, [], graph.get_operations()[mark:])[1]
        return [loss] + grads

    fn = tf.function(loss_and_grads, autograph=False)
    concrete = fn.get_concrete_function(list(pred_specs), list(label_specs))
    loss_tensor = tf.nest.flatten(concrete.structured_outputs)[0]
    if loss_tensor.shape.rank != 0:
        raise ExtractionError(
            f"the loss returns shape {loss_tensor.shape}; it must reduce to a scalar "
            "(use a keras loss with a reduction, or reduce the callable's result)",
            layer="loss",
        )
    pred_bytes = sum(tensor_bytes(s.shape, s.dtype, "a model output", "loss") for s in pred_specs)
    output_bytes = loss_tensor.dtype.size + pred_bytes
    flops = sum(_op_flops(concrete.graph, op) for op in concrete.graph.get_operations())
    analysis = CallAnalysis(
        output_specs=((tuple(), loss_tensor.dtype.name),),
        output_bytes=output_bytes,
        reads_inputs=tuple(range(len(pred_specs))),
        reads_output=False,
        residual_bytes=0,
        small_residual_bytes=0,
        input_grad_bytes=pred_bytes,
        forward_flops=flops,
        backward_flops=0.0,
        shared_input_grads=buffers["shared"],
    )
    if not profile:
        return analysis
    preds = [_sample(s) for s in pred_specs]
    labels = [_sample(s) for s in label_specs]
    # The executor draws the order of the loss's independent elementwise branches per
    # instantiation (a cross-entropy's workspace 212-404 B by extraction). Counting its
    # allocations up to the prediction's bytes as live throughout held every order, but a
    # per-pixel loss's prediction-sized temporaries then all counted at once (a segmentation
    # head's step requested 0.72x its prediction), and up to one example's bytes moved again:
    # the loss keeps its requested peak (benchmarks/results/workspace_repeatability.md).
    peak = _requested_peak(concrete, (preds, labels), warmup)
    measured = dataclasses.replace(analysis, forward_workspace=max(0, peak - output_bytes))
    if not _TIMED.get():
        return measured
    xla = _XLA_COSTS.get()
    timed = tf.function(loss_and_grads, autograph=False, jit_compile=True).get_concrete_function(
        list(pred_specs), list(label_specs)) if xla else concrete
    nothing = dispatch_only((preds, labels), xla=xla)
    del preds, labels

    def make_calls():
        args = ([_sample(s) for s in pred_specs], [_sample(s) for s in label_specs])
        return [(nothing, args), (timed, args)]

    def finish(least):
        return dataclasses.replace(measured, forward_seconds=call_costs(*least)[0])

    return time_call(measured, make_calls, repeats, warmup, "loss", xla, finish)
