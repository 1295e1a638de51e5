"""Run a ``tf.function`` one operation at a time, whatever the inter-op thread setting.

The memory model (one simulator, :mod:`tfremat.plan.simulator`) and the profiled costs
assume that operations run one after another in the order the step's statements give
them. TensorFlow's default executor runs independent operations together on its inter-op
threads, so inside one statement several buffers can be live at once: a transformer's
ordered checkpoint-all step requested 1.21x its predicted peak with TensorFlow's default
threads and 0.99x with one (benchmarks/step_overhead.py). The inter-op thread count is
fixed for the process before TensorFlow runs anything, so it cannot be set for one step;
TensorFlow's single-threaded executor can: a function call traced or run inside
:func:`sequential` executes its operations synchronously, each kernel still using the
intra-op threads.

These facts of TensorFlow 2.21 decide where it holds (``tests/test_executor.py``):

* A call traced into another function gets the executor as an attribute of its call op,
  but TensorFlow inlines the callee into the caller, whose executor then runs it; a
  function made with :data:`NOT_INLINED` stays a call and runs on the executor its call
  op names.
* A function whose operations are placed on several devices (replicas of a
  ``MirroredStrategy``) is partitioned per device; each partition runs one operation at a
  time, the devices still in parallel, which is what the per-device memory model counts;
  but each partition waits at a receive in its own fixed order, so partitions that send
  each other values (a MirroredStrategy step's replicas) can wait for ever.
* It runs a function's operations in one fixed topological order (a reverse post-order
  of a depth-first search over the graph's edges, control edges included), not in the
  order they become ready, and frees an operation's inputs only after it ran: an input
  still held for a later reader cannot be reused in place. A statement's token read the
  weight gradient after the optimizer update's ``lr * gradient`` had copied it (a
  weight-heavy MLP requested 1.24x its prediction); the update now waits for the token
  (``tests/test_default_threads_memory.py``).

* It refuses reference-typed edges, which Grappler's memory optimizer makes when it rewrites
  a sum of more than two inputs (an ``AddN``: a gradient's sum at a fan-out, adds the
  arithmetic optimizer gathered) into a ``TemporaryVariable`` and ``AssignAdd``s. It does so
  when its static estimate of the function's peak exceeds 80% of the device's memory, and
  TensorFlow gives its CPU device 256 MiB: a function holding over 205 MiB at once, such as
  InceptionV3's training step at 75x75 and batch 4, was refused. :func:`sequential` therefore
  instantiates its functions without the memory optimizer, through the configuration a
  function call carries (as the executor's name), so the user's Grappler options and every
  call made outside it are untouched; on CPU the optimizer does nothing else to a TF2 step
  (its recomputation looks for TF1's ``gradients/`` scopes, its swapping for GPUs), and the
  one-op-at-a-time sum it would replace is the one the memory model counts
  (``tests/test_reference_edges.py``, ``benchmarks/results/reference_edges.md``).

* It runs an operation that calls a function (a ``tf.cond``, a call kept out of its
  caller, a loop body holding either) or that waits for another device by blocking an
  inter-op thread until the callee finishes, and the callee runs on another: with one
  inter-op thread, or as many calls nested as threads, the step waits for ever (a
  ``LossScaleOptimizer``'s update hung with one thread and with two on two cores; a
  ``While`` whose body calls nothing runs). The step and the optimizer update probe find
  such calls in their trace (:func:`calls_functions`), are traced again without this
  executor (conditionals lowered to control-flow primitives) and run on the default one,
  which runs one op at a time with one inter-op thread (with several, a warning naming the
  first call :func:`blocking_call` finds: Keras runs a grouped ``Conv2D`` on CPU as a call of
  its ``jit_compile=True`` function ``_conv_xla``, so ConvNeXt's step is one of these).

* It runs a loop (a Keras RNN's ``tf.while_loop``) as a ``While`` operation, whose body
  TensorFlow instantiates without the graph passes that put oneDNN's kernels in; the default
  executor lowers the loop into the step's graph, where they do. TensorFlow's own CPU kernels
  of a 2-D convolution's input and filter gradients allocate scratch sized for a 30 MiB
  working set whatever the batch: a ConvLSTM2D's backward loop (3x3 filter, 16x16 frames,
  batch 4) allocated 26.8 MB per kernel, and a plain tape step of it peaked at 9.9x the
  default executor's (:data:`_SCRATCH_KERNELS`; ``benchmarks/convlstm_executor.py``). With
  oneDNN on, such a loop keeps its step on the default executor, as a call does
  (:func:`blocking_call`); with oneDNN off both executors run TensorFlow's kernels and the
  single-threaded one, one at a time, holds less. LSTMs and GRUs, whose loops hold matrix
  products, hold less on the single-threaded executor and keep it.

``compile_step``, the profiler and the optimizer update probe use it only with several
inter-op threads (:func:`step_executor`). With one, used for every step too, it ran a
bidirectional LSTM 0.68x plain against 0.85x and halved its requested bytes at batch 2 (a
loop stays a ``While``; benchmarks/results/step_overhead.md), but the optimizer update
probe's counts changed from one process to the next (SGD with Nesterov and Adagrad 0 or 1
buffer per concurrent update, Lion 1 or 2; ``benchmarks/optimizer_update.py``), and an MLP
step with SGD momentum and ``clipnorm`` requested 14.9 MB against 12.6 MB predicted from
the default executor's counts (``tests/test_optimizer_update_memory.py``): one thread
keeps the default executor.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context

from tfremat.runtime import internals

__all__ = ["NOT_INLINED", "SEQUENTIAL_EXECUTOR", "BlockingCall", "LoopOnDefaultExecutor", "blocking_call",
           "calls_functions", "check_loop_executor", "default_executor", "on_its_executor", "sequential",
           "sequential_ops", "step_executor"]

# The name under which TensorFlow registers its single-threaded function executor.
SEQUENTIAL_EXECUTOR = "SINGLE_THREADED_EXECUTOR"

#: ``tf.function(..., experimental_attributes=NOT_INLINED)``: calls of the function traced
#: into another function are kept as calls, so the executor :func:`sequential` names runs
#: them (inlined, the caller's executor ran their operations several at a time).
NOT_INLINED = {"_noinline": True}

# Whether the code running now is inside sequential() (check_loop_executor).
_IN_SEQUENTIAL = contextvars.ContextVar("tfremat_in_sequential", default=False)

# The serialized ConfigProto of function calls outside the outermost sequential(), which
# default_executor() puts back inside it; None outside sequential().
_OUTER_CONFIG = contextvars.ContextVar("tfremat_outer_config", default=None)

# Operations whose kernels run a function asynchronously, which the single-threaded
# executor waits for on its own thread (module docstring); a While's kernel runs its body
# on the calling thread.
_CALLING_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                          "StatefulPartitionedCall", "RemoteCall"})

_LOOPS = frozenset({"While", "StatelessWhile"})

# Operations whose TensorFlow CPU kernels allocate scratch for a fixed working set rather
# than for their inputs, which oneDNN's kernels replace only outside a While's body (module
# docstring). A 3-D convolution's gradients in a ConvLSTM3D's loop held 1.1x the default
# executor's (benchmarks/results/convlstm_executor.md): not among them.
_SCRATCH_KERNELS = frozenset({"Conv2DBackpropInput", "Conv2DBackpropFilter"})


@contextlib.contextmanager
def sequential():
    """Function calls made (eagerly) or traced (into an enclosing graph) inside this
    context run on TensorFlow's single-threaded executor, instantiated without Grappler's
    memory optimizer (module docstring: its sums through a temporary variable are refused
    there); a traced call keeps to both only when the called function is not inlined
    (:data:`NOT_INLINED`). The user's Grappler options hold for every call made outside."""
    options = context.context().function_call_options
    outer = _OUTER_CONFIG.set(options.config_proto_serialized) if not _IN_SEQUENTIAL.get() else None
    token = _IN_SEQUENTIAL.set(True)
    try:
        with tf.experimental.function_executor_type(SEQUENTIAL_EXECUTOR):
            # function_executor_type restores the options it found, this config included.
            context.context().function_call_options.config_proto_serialized = _without_memory_optimizer(
                options.config_proto_serialized)
            yield
    finally:
        _IN_SEQUENTIAL.reset(token)
        if outer is not None:
            _OUTER_CONFIG.reset(outer)


@contextlib.contextmanager
def default_executor():
    """Function calls made or traced inside this context run on TensorFlow's default
    executor with the Grappler options of calls outside :func:`sequential`, also inside it
    (a loop traced here is lowered to control-flow primitives, which only the default
    executor runs; the compiled step holding it runs outside :func:`sequential`)."""
    token = _IN_SEQUENTIAL.set(False)
    try:
        with tf.experimental.function_executor_type(""):
            if _OUTER_CONFIG.get() is not None:
                context.context().function_call_options.config_proto_serialized = config_pb2.ConfigProto.FromString(
                    _OUTER_CONFIG.get())
            yield
    finally:
        _IN_SEQUENTIAL.reset(token)


def _without_memory_optimizer(serialized: bytes) -> config_pb2.ConfigProto:
    """``serialized`` (a function call's ``ConfigProto``) with Grappler's memory optimizer
    off, its other options as they were (module docstring)."""
    config = config_pb2.ConfigProto.FromString(serialized)
    config.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    return config


def sequential_ops() -> bool:
    """Whether TensorFlow's default executor runs one op at a time (``TF_NUM_INTEROP_THREADS=1``
    or ``tf.config.threading.set_inter_op_parallelism_threads(1)``), as the memory and time
    models assume, for a step that cannot run on the single-threaded executor (which runs
    one at a time whatever the setting)."""
    return (tf.config.threading.get_inter_op_parallelism_threads() == 1
            or os.environ.get("TF_NUM_INTEROP_THREADS", "").strip() == "1")


def on_its_executor(function: Any) -> Any:
    """``function`` (a concrete function, to be run inside :func:`step_executor`) as a callable
    that runs it on the executor it was traced for: the default one when it holds a loop
    traced outside :func:`sequential` (:func:`check_loop_executor` has such a layer call
    traced again there), which the single-threaded executor refuses ("does not support low
    level control flow"); else ``function`` itself. A layer call's loops are its function's own
    operations."""
    function_def = getattr(function, "function_def", None)  # None: not a traced function
    if function_def is None or not any(node.op in _LOOPS and node.attr["_lower_using_switch_merge"].b
                                       for node in function_def.node_def):
        return function

    def on_default(*args):
        with default_executor():
            return function(*args)

    return on_default


def step_executor():
    """The executor the compiled step runs on, for whatever must be measured the same way
    (the profiler, the optimizer update probe): TensorFlow's default one with one inter-op
    thread, where it runs one op at a time in ready order already, else the single-threaded
    one (:func:`sequential`; module docstring for why not with one thread too)."""
    return contextlib.nullcontext() if sequential_ops() else sequential()


@dataclasses.dataclass(frozen=True)
class BlockingCall:
    """The first thing of a graph that keeps its step off the single-threaded executor
    (:func:`blocking_call`), for a warning that names it.

    Attributes:
        op: the operation's name ("" for operations on several devices).
        op_type: its type (``StatefulPartitionedCall``, ``If``, ``CollectiveReduceV2``, ...).
        functions: the functions it runs (a call's callee, a conditional's branches).
        within: the function of the graph's library whose body holds ``op``; "" when the
            graph itself does.
        reached: every function it runs, directly or through the calls and loops of their
            bodies (a ``tf.cond`` under a gradient tape is a call of a wrapper holding the
            ``If``).
        xla: whether one of ``reached`` is compiled with XLA (``jit_compile=True``).
        conditional: whether ``op`` or one of ``reached`` is a conditional (``If``, ``Case``).
        devices: the devices, when the cause is operations placed on several.
        loop_kernel: when the cause is a loop (``op``, a ``While``) whose body runs
            TensorFlow's own kernel of a scratch-heavy operation on the single-threaded
            executor (:data:`_SCRATCH_KERNELS`), that operation's type.
    """

    op: str
    op_type: str
    functions: tuple[str, ...] = ()
    within: str = ""
    reached: tuple[str, ...] = ()
    xla: bool = False
    conditional: bool = False
    devices: tuple[str, ...] = ()
    loop_kernel: str = ""

    def describe(self) -> str:
        """What was found, in words a user can place in the model: e.g. "Keras compiles
        grouped convolutions (Conv2D with groups > 1) with XLA on CPU
        (model/conv/StatefulPartitionedCall calls __forward__conv_xla_5414)"."""
        if self.devices:
            return f"its operations are placed on {len(self.devices)} devices ({', '.join(self.devices)})"
        where = self.op + (f" in {self.within}" if self.within else "")
        if self.loop_kernel:
            return (f"a loop ({where}, a recurrent layer's) holds {self.loop_kernel}, which the single-threaded "
                    "executor runs with TensorFlow's own kernel instead of oneDNN's, allocating scratch of up to "
                    "30 MiB per call (a ConvLSTM1D's or ConvLSTM2D's backward)")
        if self.op_type.startswith("Collective"):
            return f"it holds a collective operation ({where}, {self.op_type})"
        runs = f"{where} {'runs' if self.op_type in _CONDITIONALS else 'calls'} {' or '.join(self.functions)}"
        if any("_conv_xla" in name for name in self.reached):
            return f"Keras compiles grouped convolutions (Conv2D with groups > 1) with XLA on CPU ({runs})"
        if self.conditional:
            return f"it holds a conditional (a tf.cond, a loss scale's update; {runs})"
        compiled = " compiled with XLA (jit_compile=True)" if self.xla else ""
        return f"it calls a function{compiled} ({runs})"


_CONDITIONALS = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})


def blocking_call(graph: Any) -> BlockingCall | None:
    """The first operation of ``graph`` (a ``tf.Graph``, e.g. a concrete function's), or of
    a function it calls, that runs a function (:data:`_CALLING_OPS`) or a collective, or the
    devices when its operations are placed on several: what the single-threaded executor
    can wait on for ever (module docstring); else, with oneDNN on, the first loop whose body
    holds a scratch-heavy kernel (:data:`_SCRATCH_KERNELS`), which the single-threaded
    executor runs with several times the default executor's memory; None when there is none.
    The graph's own operations come first, in the order they were created."""
    definition = graph.as_graph_def()
    library = {function.signature.name: function for function in definition.library.function}
    nodes = [*((node, "") for node in definition.node),
             *((node, name) for name, function in library.items() for node in function.node_def)]
    devices = sorted({node.device for node, _ in nodes if node.device})
    if len(devices) > 1:
        return BlockingCall(op="", op_type="", devices=tuple(devices))
    for node, within in nodes:
        if node.op in _CALLING_OPS or node.op.startswith("Collective"):
            reached = _reached(node, library)
            conditional = node.op in _CONDITIONALS or any(
                inner.op in _CONDITIONALS for name in reached for inner in library[name].node_def)
            return BlockingCall(op=node.name, op_type=node.op, functions=_called(node), within=within,
                                reached=reached, xla=any(library[name].attr["_XlaMustCompile"].b for name in reached),
                                conditional=conditional)
    if not internals.onednn_enabled():
        return None
    for node, within in nodes:
        if node.op in _LOOPS:
            reached = _reached(node, library)
            kernel = next((inner.op for name in reached for inner in library[name].node_def
                           if inner.op in _SCRATCH_KERNELS), "")
            if kernel:
                return BlockingCall(op=node.name, op_type=node.op, functions=_called(node), within=within,
                                    reached=reached, loop_kernel=kernel)
    return None


def _reached(node, library: dict) -> tuple[str, ...]:
    """Every function of ``library`` that ``node`` (a ``NodeDef``) runs, directly or through
    the calls and loops of their bodies, nearest first."""
    reached, pending = [], list(_called(node))
    while pending:
        name = pending.pop(0)
        if name in reached or name not in library:
            continue
        reached.append(name)
        pending += [callee for inner in library[name].node_def for callee in _called(inner)]
    return tuple(reached)


def _called(node) -> tuple[str, ...]:
    """The functions ``node`` (a ``NodeDef``) names: a call's ``f``, a conditional's
    ``then_branch`` and ``else_branch`` (in that order) or ``branches``, a loop's ``cond``
    and ``body``."""
    names = []
    for key, value in sorted(node.attr.items(), key=lambda item: (item[0] != "then_branch", item[0])):
        names += [value.func.name] if value.func.name else [f.name for f in value.list.func]
    return tuple(names)


def calls_functions(graph: Any) -> bool:
    """Whether ``graph`` (a ``tf.Graph``, e.g. a concrete function's) must run on the default
    executor: the single-threaded one can wait for ever on it (some operation of it or of a
    function it calls runs a function, :data:`_CALLING_OPS`, or a collective, or its
    operations are placed on several devices) or would run a loop of it with TensorFlow's
    scratch-heavy kernels (module docstring; :func:`blocking_call` says which)."""
    return blocking_call(graph) is not None


class LoopOnDefaultExecutor(Exception):
    """A function traced for the single-threaded executor holds a loop that the step runs
    on the default one (:func:`check_loop_executor`): trace and measure it again there."""


def check_loop_executor(graph: Any) -> None:
    """Raises :class:`LoopOnDefaultExecutor` when ``graph`` (a traced layer call) was traced
    inside :func:`sequential` and holds a loop whose body runs a scratch-heavy kernel
    (:func:`blocking_call`'s ``loop_kernel``): the compiled step holding it runs on the
    default executor, so its memory and time are measured there too (a ConvLSTM2D's
    backward requested 26.8 MB of scratch per convolution gradient on the single-threaded
    executor, under 0.1 MB on the default one).

    Raises:
        LoopOnDefaultExecutor: as above; the caller traces the call again outside
            :func:`sequential`.
    """
    if not _IN_SEQUENTIAL.get() or not any(op.type in _LOOPS for op in graph.get_operations()):
        return
    blocking = blocking_call(graph)
    if blocking is not None and blocking.loop_kernel:
        raise LoopOnDefaultExecutor(blocking.describe())
