"""How much faster plain training runs than the step's executor lets it: the plain overlap.

With several inter-op threads (TensorFlow's default) the compiled step and the profiler run
on TensorFlow's single-threaded executor (:mod:`tfremat.runtime.executor`), one operation at
a time, while plain Keras training runs independent operations together. The profiled costs
and the predicted overhead are therefore relative to a plain step run one operation at a
time; the checkpoint-all step ran 1.02-1.14x plain with the default threads
(benchmarks/results/step_overhead.md), and 0.67x for a bidirectional LSTM, whose loops plain
training runs lowered to control-flow operations on the default executor and the step as
``While`` operations (benchmarks/results/fidelity_default_threads.md). The factor measured here,
median over rounds of (plain step on the single-threaded executor) / (plain step on the
default one), turns the predicted overhead into the predicted time over plain training:
``(1 + step_overhead) * factor`` (:attr:`tfremat.planner.PlanResult.predicted_time_over_plain`).
It scales every schedule alike, so the planners never see it.

With one inter-op thread both executors run one operation at a time: the factor is 1.0 and
nothing is measured. Nor when the plain step calls functions (a ``tf.cond``, a loss scale's
update, Keras's XLA-compiled grouped convolution on CPU: :func:`tfremat.runtime.executor.blocking_call`):
the compiled step, holding the same calls, then runs on the default executor as plain training
does, and the factor measured for the single-threaded one does not apply (ConvNeXt-like
blocks planned +0.3% as 1.21x plain ran 1.05x; benchmarks/results/executor_time.md). Measured, it costs a trace of the plain step (two with control flow),
each executor's first call (its instantiation: Grappler, then the executor's setup; the two
together about as long as the trace on small models, more than twice as long on
EfficientNetV2B0) and the timed rounds: 1.6-11 s of a 6.7-36 s uncached extraction on 2 loaded
cores, 60-85% of it the traces and first calls; 18.5 of EfficientNetV2B0's 63 CPU s at 64x64
(benchmarks/results/first_step_latency.md, "Session 30 (E)"; fidelity_default_threads.md for
how two extractions agree).

The factor holds for the load it was measured at, not for the model: the default executor's
inter-op threads gain on a machine with idle cores and lose on a busy one. A bidirectional GRU
measured 1.25 at load 2.1 and 0.64-0.78 at load 5.6 on 2 cores, and one 5-round median
moves 9-18% at one load (benchmarks/results/executor_time.md, "The GRU's overlap"). So the
measurement keeps the quartiles of its per-round ratios and the load average it ran at
(:class:`PlainOverlap`), and the plan states the range they give, widened to at least
:data:`MIN_SPREAD` either side (:meth:`PlainOverlap.expected_range`,
:attr:`tfremat.planner.PlanResult.predicted_time_over_plain_range`): five steady rounds gave
quartiles 0.793-0.799 where the same process measured 0.70-0.75 a minute later at the same
load (benchmarks/results/executor_time.md, "Loop models in turns"). They cost nothing beyond
the rounds already timed.

The same measurement traces a few of the plain step's runs on the single-threaded executor and
reads off the trace how long each part of the step ran (:class:`_StepTrace`): the optimizer
update, which no node's cost holds, with the graph's costs gives the share of the step the
recomputation is counted against (:attr:`tfremat.planner.PlanResult.step_share`); the other
parts say where the step's time goes (benchmarks/results/step_share.md).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfremat.extract.layer_graph import model_input_names
from tfremat.extract.plain_step import StepParts, plain_train_step
from tfremat.runtime import executor
from tfremat.runtime.executor import sequential
from tfremat.runtime.profiler import profiler_trace
from tfremat.runtime.timing import time_in_turns

__all__ = ["PlainOverlap", "attributed_seconds", "batch_from_specs", "measure_plain_overlap", "plain_overlap_applies",
           "step_parts"]

logger = logging.getLogger(__name__)

_EXECUTE = "EagerLocalExecute: "  # the profiler's event for a function call (TensorFlow 2.21)

# Rounds timed after the warm-up: at least MIN_ROUNDS, then until the median ratio is known
# to PRECISION (its standard error over it, :func:`_median_error`), the rounds took
# TARGET_SECONDS or MAX_ROUNDS ran. Fresh measurements under load differ by far more
# (a transformer on 2 loaded cores gave 0.99-1.17, GPT-2 1.00-1.02;
# benchmarks/results/fidelity_default_threads.md), so stopping there moves the factor within
# its noise. A steady step stops after 5-6 rounds instead of 20-25 (6 of 27 extractions at
# loads 3.5-9 on 2 cores, benchmarks/results/first_step_latency.md). The time bound keeps the
# rounds under the plain step's trace.
MIN_ROUNDS = 5
MAX_ROUNDS = 25
TARGET_SECONDS = 1.5
PRECISION = 0.02
# The least relative spread the stated range has either side of the factor: measured again in
# the same process at the same load, the factor of a bidirectional GRU or LSTM moved by up to
# 14% from the extraction's (benchmarks/results/executor_time.md, "Loop models in turns").
MIN_SPREAD = 0.10
# Traced runs of the plain step per pass (_StepTrace), two passes: one before the overlap's
# rounds and one after. Few, since every run's allocations are read off the trace in Python
# (a 2-layer GPT-2's step at batch 8 allocates about 530 times).
UPDATE_ROUNDS = 5


@dataclasses.dataclass(frozen=True)
class PlainOverlap:
    """A plain overlap as measured (module docstring).

    Attributes:
        factor: the median over rounds of (plain step on the single-threaded executor) /
            (plain step on the default one); 1.0 when not measured.
        low, high: the first and third quartile of the per-round ratios: the spread the load
            left in them (equal to ``factor`` when not measured).
        rounds: the rounds timed (0: not measured).
        load: the 1-minute load average when the rounds ended (None: not measured, or the
            platform has none); the factor holds for a load like it.
        step_seconds: the plain step's least seconds on the single-threaded executor over
            the rounds (None: not measured).
        update_seconds: the optimizer update's least seconds within the plain step's runs on
            the single-threaded executor, read off their trace (:class:`_StepTrace`; None:
            not measured): with the graph's costs, the share of the step they account for
            (:attr:`tfremat.planner.PlanResult.step_share`).
    """

    factor: float = 1.0
    low: float = 1.0
    high: float = 1.0
    rounds: int = 0
    load: float | None = None
    step_seconds: float | None = None
    update_seconds: float | None = None

    @classmethod
    def of(cls, value) -> "PlainOverlap":
        """``value`` itself, or a factor given as a number (measured elsewhere, without its
        rounds: no spread)."""
        if isinstance(value, PlainOverlap):
            return value
        return cls(float(value), float(value), float(value))

    def expected_range(self) -> tuple[float, float]:
        """Where a later measurement at a like load is expected: the quartiles, widened to
        at least MIN_SPREAD of the factor either side (a few steady rounds can agree far more
        closely than two measurements do); ``(factor, factor)`` when not measured."""
        if self.rounds == 0:
            return (self.factor, self.factor)
        return (min(self.low, self.factor * (1 - MIN_SPREAD)), max(self.high, self.factor * (1 + MIN_SPREAD)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PlainOverlap":
        def optional(key):
            value = data.get(key)
            return None if value is None else float(value)

        return cls(float(data["factor"]), float(data["low"]), float(data["high"]), int(data["rounds"]),
                   optional("load"), optional("step_seconds"), optional("update_seconds"))


def plain_overlap_applies() -> bool:
    """Whether TensorFlow's default executor may run several operations at once (more than
    one inter-op thread), so that plain training can overlap what the step runs in turn."""
    return not executor.sequential_ops()


def measure_plain_overlap(model, x, y, loss_fn, optimizer) -> PlainOverlap:
    """The median over rounds of a plain training step's seconds on the single-threaded
    executor over its seconds on the default one, with the quartiles of the rounds and the
    load (module docstring); ``PlainOverlap()`` (1.0) without measuring when there is one
    inter-op thread, the plain step calls functions (the compiled step will run on the
    default executor too) or ``optimizer`` cannot be copied from its config (the last two
    logged).

    The steps train ``model`` with a fresh copy of ``optimizer`` (its own slots and step
    count, ``optimizer`` itself untouched); the model's variables (weights, batch-norm
    statistics, seed states) are restored afterwards, so the model is left as it was.

    Args:
        model: the Keras model (a functional one: extraction's wrapper).
        x, y: one batch, as the model and ``loss_fn`` take them.
        loss_fn: ``fn(labels_list, preds_list) -> scalar`` (``SideTable.loss_fn``).
        optimizer: the Keras optimizer whose configuration the steps use.
    """
    if not plain_overlap_applies():
        return PlainOverlap()
    started = time.perf_counter()
    try:
        fresh = type(optimizer).from_config(optimizer.get_config())
    except Exception as error:  # noqa: BLE001 - a user optimizer's config may fail anyhow; the factor is optional
        logger.warning("plain overlap not measured (1.0): %s cannot be copied from its config (%s: %s); the "
                       "predicted time over plain leaves out what plain training gains by running operations "
                       "together", type(optimizer).__name__, type(error).__name__, error)
        return PlainOverlap()
    saved = [v.numpy() for v in model.variables]
    try:
        steps = _traced_steps(model, x, y, loss_fn, fresh)
        if steps is None:
            return PlainOverlap()
        default_step, sequential_step = steps

        def run_sequential():
            with sequential():
                loss = sequential_step(x, y)
                loss.numpy()  # done before the executor is put back
            return loss

        called = _first_calls(run_sequential, lambda: default_step(x, y), sequential_step, x, y)
        parts = _StepTrace(run_sequential, called, sequential_step.parts)
        parts.run_pass()
        timing = time_in_turns(run_sequential, lambda: default_step(x, y), MAX_ROUNDS, warmup=0,
                               enough=_enough_rounds(time.perf_counter()))
        parts.run_pass()
    finally:
        for variable, value in zip(model.variables, saved):
            variable.assign(value)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    logger.info("plain overlap of %s: %.3f (single-threaded over default executor, median of %d rounds, quartiles "
                "%.3f-%.3f, load %s; plain step %.2f ms, traced by part: %s) in %.1f s", model.name,
                timing.ratio, timing.rounds, *timing.ratio_quartiles, "unknown" if load is None else f"{load:.1f}",
                1e3 * timing.least_seconds, ", ".join(f"{part} {1e3 * seconds:.2f} ms" for part, seconds in
                                                      sorted(parts.least.items())) or "no allocator events",
                time.perf_counter() - started)
    return PlainOverlap(timing.ratio, *timing.ratio_quartiles, timing.rounds, load, timing.least_seconds, parts.update)


def _traced_steps(model, x, y, loss_fn, optimizer):
    """The plain step traced for the default and the single-threaded executor
    (:func:`~tfremat.extract.plain_step.plain_train_step`), or None when it calls a function
    (:func:`~tfremat.runtime.executor.blocking_call`; logged), so that the compiled step
    will run on the default executor as plain training does.

    Traced on the default executor: a conditional or call is the same operation in either
    executor's trace (only its lowering attribute differs). One trace serves both executors
    (tracing a 6-block transformer took 4.5 s, a second instantiation 1.2 s), unless the step
    holds a loop: a loop traced for the single-threaded executor stays a While operation,
    which a default trace lowers (tfremat.runtime.executor.step_executor)."""
    default_step = plain_train_step(model, loss_fn, optimizer)
    graph = default_step.get_concrete_function(x, y).graph
    blocking = executor.blocking_call(graph)
    if blocking is not None:
        logger.info("plain overlap of %s: 1.0, not measured: the step runs on TensorFlow's default executor as "
                    "plain training does, since %s", model.name, blocking.describe())
        return None
    return default_step, plain_train_step(model, loss_fn, optimizer) if _has_loop(graph) else default_step


def _first_calls(run_sequential, run_default, sequential_step, x, y) -> str:
    """Runs the plain step once on each executor, untimed (each first call instantiates the
    function for its executor: Grappler, then the executor's setup), and returns the name of
    the function the single-threaded executor calls, which its trace names
    (:class:`_StepTrace`)."""
    run_sequential()
    run_default().numpy()
    with sequential():
        return sequential_step.get_concrete_function(x, y).function_def.signature.name


class _StepTrace:
    """The plain step's seconds on the single-threaded executor, part by part, read off
    TensorFlow's trace of its runs (:func:`step_parts`): the least of each part over
    UPDATE_ROUNDS runs per pass, the passes seconds apart (each :meth:`run_pass`), so a stall
    of the loaded machine costs one pass only.

    The update's part is what no node's cost holds and every schedule runs alike
    (:attr:`tfremat.planner.PlanResult.step_share`). Read off the step's own runs, it costs
    a trace of runs the overlap makes anyway, where a traced function of the update alone
    cost its own trace and first call (3-4 s of a transformer's uncached extraction;
    benchmarks/results/step_share.md). The runs are traced as the profiled calls are, with
    the allocator's events, so the parts are in the costs' terms.
    """

    def __init__(self, run_step, function_name: str, parts: StepParts):
        self._run_step = run_step
        self._function_name = function_name
        self._parts = parts
        self.least: dict[str, float] = {}

    @property
    def update(self) -> float | None:
        """The update's least seconds (None: the trace held no allocator events)."""
        return self.least.get("update")

    def run_pass(self) -> None:
        """Runs and traces UPDATE_ROUNDS steps and keeps each part's least seconds so far."""
        with tempfile.TemporaryDirectory(prefix="tfremat_step_") as logdir:
            with profiler_trace(logdir):
                for _ in range(UPDATE_ROUNDS):
                    self._run_step()
            for run in step_parts(logdir, self._function_name, self._parts):
                for part, seconds in run.items():
                    self.least[part] = min(self.least.get(part, math.inf), seconds)


def step_parts(logdir: str, function_name: str, parts: StepParts) -> list[dict[str, float]]:
    """Per traced run of ``function_name`` in the profiler log ``logdir``, its seconds by part
    (``parts``: the plain step's :class:`~tfremat.extract.plain_step.StepParts`).

    The single-threaded executor marks no operation in the trace, but the allocator does:
    each allocation names the operation that requested it, in the order they ran. The time
    from one operation's first allocation to the next allocating operation's is that
    operation's (with the operations between that allocate nothing: a variable's read or
    assignment, a reshape, which belong to the same part but at a part's edge); the last
    one's ends at the run's last allocator event. Empty without allocator events (no BFC
    allocator)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    runs = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if plane.name.startswith("/host:"):
                runs.extend(_plane_runs(plane, function_name))
    return [attributed_seconds(events, parts) for events in runs]


def _plane_runs(plane, function_name: str) -> list[list[tuple[int, str | None]]]:
    """Per call of ``function_name`` on ``plane``, the allocator events on the thread that
    ran it: ``(time ps, operation name)`` for an allocation, ``(time ps, None)`` for a
    deallocation, in time order."""
    stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
    op_stat = next((key for key, name in stat_names.items() if name == "tf_op"), None)
    kinds = {key: meta.name for key, meta in plane.event_metadata.items()
             if meta.name in ("MemoryAllocation", "MemoryDeallocation", _EXECUTE + function_name)}
    calls, by_line = [], {}
    for line in plane.lines:
        base = line.timestamp_ns * 1000
        for event in line.events:
            kind = kinds.get(event.metadata_id)
            if kind is None:
                continue
            time_ps = base + event.offset_ps
            if kind.startswith(_EXECUTE):
                calls.append((time_ps, time_ps + event.duration_ps))
                continue
            op = None
            if kind == "MemoryAllocation":
                for stat in event.stats:
                    if stat.metadata_id == op_stat:
                        op = stat_names.get(stat.ref_value, "") if stat.ref_value else stat.str_value
            by_line.setdefault(line.id, []).append((time_ps, op or None))
    runs = []
    for begin, end in sorted(calls):
        within = {line_id: [e for e in events if begin <= e[0] <= end] for line_id, events in by_line.items()}
        # The executor's thread is the one that allocated most: another thread's events
        # (an intra-op worker's scratch) mark no operation's start.
        busiest = max(within.values(), key=lambda events: sum(op is not None for _, op in events), default=[])
        if any(op is not None for _, op in busiest):
            runs.append(sorted(busiest, key=lambda e: e[0]))
    return runs


def attributed_seconds(events: list[tuple[int, str | None]], parts: StepParts) -> dict[str, float]:
    """Seconds by part (``parts``) of one run's allocator events in time order
    (:func:`_plane_runs`): from each allocation to the next one, the last one's to the last
    event, except where the update hands over to another part.

    The update's operations interleave with the backward's (a variable's update runs once its
    gradient exists: 57-75 hand-overs a run in ConvMixer and GPT-2), and an operation may
    allocate well after it started (a convolution's filter gradient sets up its kernel
    first), so the time up to the next part's allocation is partly that part's. The update's
    operations are small and alike, so at a hand-over the update keeps the median of its
    own intervals between two update allocations and the next part gets the rest: ConvMixer's
    update read 0.95 ms otherwise, 0.70 with it, against 0.30-0.52 ms timed alone
    (benchmarks/results/step_share.md)."""
    marks = [(time_ps, parts.of(op)) for time_ps, op in events if op is not None]
    ends = [time_ps for time_ps, _ in marks[1:]] + [events[-1][0]]
    following = [part for _, part in marks[1:]] + [None]
    own = [end - time_ps for (time_ps, part), end, after in zip(marks, ends, following)
           if part == after == "update"]
    typical = statistics.median(own) if own else math.inf
    seconds: dict[str, float] = {}
    for (time_ps, part), end, after in zip(marks, ends, following):
        kept = min(end - time_ps, typical) if part == "update" and after not in (None, "update") else end - time_ps
        seconds[part] = seconds.get(part, 0.0) + kept * 1e-12
        if kept < end - time_ps:
            seconds[after] = seconds.get(after, 0.0) + (end - time_ps - kept) * 1e-12
    return seconds


def _enough_rounds(began: float):
    """``enough`` for :func:`~tfremat.runtime.timing.time_in_turns`: from MIN_ROUNDS on, True
    once the rounds started at ``began`` (``time.perf_counter()``) took TARGET_SECONDS or the
    median ratio is known to PRECISION."""
    def enough(ratios: list[float]) -> bool:
        return len(ratios) >= MIN_ROUNDS and (time.perf_counter() - began >= TARGET_SECONDS
                                              or _median_error(ratios) <= PRECISION)
    return enough


def _median_error(ratios: list[float]) -> float:
    """The standard error of the median of ``ratios`` over the median, from their
    interquartile range: for normal noise sigma is about IQR / 1.349 and the median's
    error 1.2533 sigma / sqrt(n). The quartiles of a few rounds resist one slow round,
    which a standard deviation would not."""
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return 1.2533 * (high - low) / 1.349 / math.sqrt(len(ratios)) / statistics.median(ratios)


def _has_loop(graph) -> bool:
    """Whether ``graph`` (a traced step's) holds a functional loop (a conditional is a
    :func:`~tfremat.runtime.executor.blocking_call`, which measures nothing)."""
    return any(op.type in ("While", "StatelessWhile") for op in graph.get_operations())


def batch_from_specs(model, in_specs, label_specs, seed: int = 0, values=()) -> tuple:
    """A batch ``(x, y)`` shaped by an extraction's input and label specs, as ``model`` and
    its loss function take it (a dict of inputs keyed by name for a model built on one):
    uniform floats, zeros for integers (a valid token or class index); the values barely
    move a step's time. ``values``: per model input, a tensor to take instead of zeros (a
    ``StringLookup`` without OOV index refuses empty strings), or None."""
    rng = np.random.default_rng(seed)

    def make(spec, value=None):
        if spec.dtype.is_floating:
            return tf.constant(rng.random(spec.shape.as_list()), dtype=spec.dtype)
        return tf.zeros(spec.shape, spec.dtype) if value is None else value

    inputs = [make(s, values[p] if p < len(values) else None) for p, s in enumerate(in_specs)]
    if isinstance(getattr(model, "_inputs_struct", None), dict):  # as model_input_names reads it
        x = dict(zip(model_input_names(model), inputs))
    else:
        x = inputs[0] if len(inputs) == 1 else inputs
    return x, [make(s) for s in label_specs]
