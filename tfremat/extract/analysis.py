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
  grow with the batch and are counted with the node (see :mod:`tfremat.extract.extractor`);
  the others (per-channel statistics, weight casts) are small and counted as fixed bytes.

Reads that only take a tensor's shape (``Shape``, ``Size``, ``Rank``) keep nothing alive
once shapes are static, variable reads are parameters (already fixed bytes), and constants
live in the graph: none of them count.

With ``profile=True`` the same functions are run on the target device: the median of timed
runs after warm-up gives the cost, and the ``TF_CPU_ALLOCATOR_USE_BFC`` allocator's peak
(reset before each run) gives the workspace, i.e. the transient bytes beyond the node's
output, residuals and gradients. Profiling runs the layer with ``training=True``, which
would move batch-norm statistics and dropout seeds, so the layer's non-trainable variables
are restored afterwards: extraction leaves the model exactly as it found it.

The ``flops`` cost model sums TensorFlow's registered per-op flop statistics over the traced
ops (``Conv2D``, ``MatMul``, ...), and the element count of every other computing op.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from tfremat.errors import ExtractionError

__all__ = ["CallAnalysis", "analyze_call", "analyze_loss", "tensor_bytes", "device_name"]

logger = logging.getLogger(__name__)

_SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"})
_NOT_RESIDUAL_OPS = frozenset({"ReadVariableOp", "Const", "Placeholder", "VarHandleOp"})
_NO_COMPUTE_OPS = frozenset(
    {"Const", "Placeholder", "ReadVariableOp", "Identity", "IdentityN", "NoOp", "Shape", "ShapeN",
     "Size", "Rank", "Reshape", "StopGradient", "VarHandleOp", "AssignVariableOp", "AssignAddVariableOp",
     "AssignSubVariableOp", "BroadcastGradientArgs", "ZerosLike", "OnesLike"}
)


@dataclasses.dataclass(frozen=True)
class CallAnalysis:
    """What one layer call (or the loss) costs and keeps, measured as described above.

    Attributes:
        output_specs: ``(shape, dtype name)`` per flattened output, batch included.
        output_bytes: bytes of the outputs.
        reads_inputs: positions of the call's inputs that the gradient reads.
        reads_output: the gradient reads the call's output.
        residual_bytes: residuals that grow with the batch.
        small_residual_bytes: residuals that do not.
        input_grad_bytes: bytes of the gradients the backward returns for the inputs.
        forward_flops, backward_flops: analytic counts from the traced ops.
        forward_seconds, backward_seconds: median timings (0 without profiling).
        forward_workspace, backward_workspace: transient allocator bytes (0 without profiling).
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CallAnalysis":
        data = dict(data)
        data["output_specs"] = tuple((tuple(s), d) for s, d in data["output_specs"])
        data["reads_inputs"] = tuple(data["reads_inputs"])
        return cls(**data)


def device_name() -> str:
    """The device extraction measures on: the first GPU if any, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else tf.config.list_logical_devices("CPU")[0].name


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
    try:
        stats = tf_ops.get_stats_for_node_def(graph, op.node_def, "flops")
        if stats.value:
            return float(stats.value)
    except (ValueError, TypeError):
        pass
    total = 0.0
    for out in op.outputs:
        if out.shape.rank is not None and out.shape.is_fully_defined():
            total += float(np.prod(out.shape.as_list(), dtype=np.int64))
    return total


def _sync(result) -> None:
    """Waits for a (possibly asynchronous) device result by reading one element back."""
    for t in tf.nest.flatten(result):
        if t is not None:
            tf.reshape(t, [-1])[:1].numpy()
            return


def reset_allocator_peak(device: str) -> None:
    """Resets the allocator's peak counter on ``device`` ("CPU:0", "GPU:0").

    Raises:
        ExtractionError: the allocator keeps no statistics: on CPU TensorFlow only counts
            with the BFC allocator, chosen by ``TF_CPU_ALLOCATOR_USE_BFC=true`` before it is
            imported (``import tfremat`` before TensorFlow sets it).
    """
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError:
        raise ExtractionError(
            f"TensorFlow's allocator keeps no memory statistics on {device}, so workspace and peaks cannot "
            "be measured: set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow is imported (importing tfremat "
            "first does it), or extract with cost_model='flops' (no workspace measurement)"
        ) from None


def _time_and_memory(fn: Callable, args, repeats: int, warmup: int) -> tuple[float, int]:
    """Median seconds of ``fn(*args)`` after warm-up, and its allocator peak above the start."""
    for _ in range(warmup):
        _sync(fn(*args))
    device = device_name().split("device:")[-1]
    reset_allocator_peak(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    result = fn(*args)
    _sync(result)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    del result
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        _sync(fn(*args))
        times.append(time.perf_counter() - begin)
    return statistics.median(times), max(0, int(peak))


def _sample(spec: tf.TensorSpec) -> tf.Tensor:
    """A deterministic tensor for a spec: small random floats, zeros for integers."""
    if _is_float(spec.dtype):
        rng = np.random.default_rng(0)
        return tf.constant(rng.standard_normal(spec.shape).astype(np.float32) * 0.1, dtype=spec.dtype)
    return tf.zeros(spec.shape, dtype=spec.dtype)


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
) -> CallAnalysis:
    """Traces (and with ``profile`` runs) one layer call and its VJP.

    Args:
        call_layer: runs the layer on the flattened input tensors (with ``training=True``).
        layer_name: for error messages.
        input_specs: the flattened inputs, batch included.
        needs_grad: per input, whether the backward returns its gradient.
        variables: the trainable variables the backward differentiates.
        batch_size: the batch dimension, to tell batch-sized residuals from small ones.
        profile: also time the call and measure its workspace.
        repeats, warmup: timed runs and untimed warm-up runs.

    Returns:
        A :class:`CallAnalysis`.
    """
    record: dict = {}
    grad_positions = [i for i, (s, g) in enumerate(zip(input_specs, needs_grad)) if g and _is_float(s.dtype)]

    def forward_backward(flat_inputs, seed):
        """The call and its VJP as the compiled step runs them (the trace the analysis
        reads, and the run the backward's time and workspace come from).

        The step asks the tape for the input gradients first and for the weight gradients
        after them (two ``gradient`` calls, see the interpreter), and the memory model
        counts the forward value (outputs and the tensors the gradient reads) and the
        upstream gradients as resident while the backward node runs: they are returned
        here, so they live to the end, and the upstream gradients are made inside (from
        ``seed``, after the forward) as the step makes them. One ``gradient`` call on
        caller-owned gradients had let TensorFlow free a residual mid-way and measured a
        Dense+ReLU layer's transient (``ReluGrad``'s batch-sized output) as 0 bytes: the
        step peaked one such buffer above the prediction (2 MiB on a Dense(512) MLP at
        batch 1024).
        """
        graph = tf.compat.v1.get_default_graph()
        with tf.GradientTape(persistent=True) as tape:
            for i in grad_positions:
                tape.watch(flat_inputs[i])
            outputs = tf.nest.flatten(call_layer(list(flat_inputs)))
        mark = len(graph.get_operations())
        targets = [o for o in outputs if _is_float(o.dtype)]
        upstream = [tf.fill(tf.shape(o), tf.cast(seed, o.dtype)) for o in targets]
        sources = [flat_inputs[i] for i in grad_positions]
        gradient = functools.partial(tape.gradient, targets, output_gradients=upstream,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
        input_part = gradient(sources) if sources and targets else []
        with tf.control_dependencies([g for g in input_part if g is not None]):
            weight_part = gradient(list(variables)) if variables and targets else []
        operations = graph.get_operations()
        record.update(
            forward_ops=operations[:mark], backward_ops=operations[mark:],
            reads=_backward_reads(operations[:mark], operations[mark:], flat_inputs, outputs),
        )
        grads = [g for g in (*input_part, *weight_part) if g is not None]
        return grads + outputs + upstream + list(record["reads"][2])

    def forward(flat_inputs):
        return call_layer(list(flat_inputs))

    # The output specs come from a forward-only trace.
    forward_fn = tf.function(forward, autograph=False)
    forward_concrete = forward_fn.get_concrete_function(list(input_specs))
    out_tensors = tf.nest.flatten(forward_concrete.structured_outputs)
    output_specs = tuple((tuple(t.shape.as_list()), t.dtype.name) for t in out_tensors)
    output_bytes = sum(tensor_bytes(s, d, "the output", layer_name) for s, d in output_specs)
    upstream_bytes = sum(tensor_bytes(s, d, "an output gradient", layer_name) for s, d in output_specs
                         if _is_float(tf.as_dtype(d)))

    fb_fn = tf.function(forward_backward, autograph=False)
    fb_concrete = fb_fn.get_concrete_function(list(input_specs), tf.TensorSpec([], tf.float32))
    reads_inputs, reads_output, read_tensors = record["reads"]
    residuals: dict[str, int] = {}
    small: dict[str, int] = {}
    for t in read_tensors:
        shape = t.shape.as_list() if t.shape.rank is not None else [None]
        size = tensor_bytes(shape, t.dtype, f"residual {t.name}", layer_name)
        batch_sized = len(shape) >= 1 and shape[0] == batch_size and not (len(shape) == 1 and t.dtype.is_integer)
        (residuals if batch_sized else small)[t.name] = size
    graph = fb_concrete.graph
    forward_flops = sum(_op_flops(graph, op) for op in record["forward_ops"])
    backward_flops = sum(_op_flops(graph, op) for op in record["backward_ops"])
    input_grad_bytes = sum(
        tensor_bytes(input_specs[i].shape, input_specs[i].dtype, f"input {i}", layer_name) for i in grad_positions
    )
    analysis = CallAnalysis(
        output_specs=output_specs,
        output_bytes=output_bytes,
        reads_inputs=tuple(sorted(reads_inputs)),
        reads_output=reads_output,
        residual_bytes=sum(residuals.values()),
        small_residual_bytes=sum(small.values()),
        input_grad_bytes=input_grad_bytes,
        forward_flops=forward_flops,
        backward_flops=backward_flops,
    )
    if not profile:
        return analysis
    inputs = [_sample(s) for s in input_specs]
    weight_grad_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)
    fwd_seconds, fwd_peak = _time_and_memory(forward_concrete, (inputs,), repeats, warmup)
    fb_seconds, fb_peak = _time_and_memory(fb_concrete, (inputs, tf.constant(1.0)), repeats, warmup)
    held = output_bytes + upstream_bytes + analysis.residual_bytes + analysis.small_residual_bytes
    return dataclasses.replace(
        analysis,
        forward_seconds=fwd_seconds,
        backward_seconds=max(fb_seconds - fwd_seconds, 0.05 * fb_seconds),
        forward_workspace=max(0, fwd_peak - output_bytes - analysis.residual_bytes),
        backward_workspace=max(0, fb_peak - held - input_grad_bytes - weight_grad_bytes),
    )


def _backward_reads(forward_ops, backward_ops, inputs, outputs) -> tuple[set[int], bool, list]:
    """What the backward ops read of the forward: ``(positions of the inputs read, whether
    an output is read, the other forward tensors read)``; the last are the residuals the
    tape keeps (shape-only reads and variable reads are not)."""
    forward = {id(op) for op in forward_ops}
    input_position = {t.name: i for i, t in enumerate(inputs)}
    output_names = {t.name for t in outputs}
    reads_inputs: set[int] = set()
    reads_output = False
    tensors: dict[str, tf.Tensor] = {}
    for op in backward_ops:
        if op.type in _SHAPE_ONLY_OPS:
            continue
        for t in op.inputs:
            if id(t.op) not in forward:
                continue
            if t.name in input_position:
                reads_inputs.add(input_position[t.name])
            elif t.name in output_names:
                reads_output = True
            elif t.op.type not in _NOT_RESIDUAL_OPS and t.dtype != tf.resource:
                tensors[t.name] = t
    return reads_inputs, reads_output, list(tensors.values())


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
    """

    def loss_and_grads(preds, labels):
        with tf.GradientTape() as tape:
            for p in preds:
                tape.watch(p)
            loss = loss_fn(list(labels), list(preds))
        return [loss] + tape.gradient(loss, list(preds))

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
    )
    if not profile:
        return analysis
    preds = [_sample(s) for s in pred_specs]
    labels = [_sample(s) for s in label_specs]
    seconds, peak = _time_and_memory(concrete, (preds, labels), repeats, warmup)
    return dataclasses.replace(analysis, forward_seconds=seconds, forward_workspace=max(0, peak - output_bytes))
