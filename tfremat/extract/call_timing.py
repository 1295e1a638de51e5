"""How a profiled layer call is timed: rounds, passes over all the calls, the costs kept.

:mod:`tfremat.extract.analysis` measures what a call keeps and requests; this module times
its functions (the call's forward and forward-plus-backward, and one that computes nothing)
and turns their seconds into the node's costs. The cost is the least time of many runs
after warm-up (:func:`_rounds`): on CPU the seconds TensorFlow's executor ran the function
for, read off its profiler's trace (:func:`_kernel_seconds`, :mod:`tfremat.extract.timing`),
which leaves out the hundreds of microseconds of calling a function from Python that the
compiled step, one function, does not pay per node; on a GPU and for XLA functions the wall
time of the call from Python (:func:`_least_seconds`). A busy machine only ever adds time
to a run, so the least run is the one that repeats from profile to profile, where the
median moves with the load. Elapsed time, not the process's CPU time, which was steadier
under load but weighs a call by the threads it runs on: the step's time, what the plan
predicts, is elapsed time.

A busy machine also slows every run for a second or two at a time, longer than one call's
timing, so within an extraction every call is timed in :data:`_TIMING_PASSES` passes over
all the calls, the calls that make most of the step in three times as many, each timed
function keeping the mean of its least half (:func:`timing_passes`). The forward and the
forward-plus-backward are timed in turns, so the backward (their difference) is taken under
one load, and every cost is rounded to a relative grid (:func:`_on_grid`) so that two
profiles whose costs differ by noise give the solvers the same numbers (:func:`call_costs`).

Apart from :mod:`tfremat.extract.timing`, which reads the seconds of function calls off one
profiler trace and knows nothing of passes or costs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.timing import TracedRounds
from tfremat.runtime import executor
from tfremat.runtime.memory import default_device, synchronize

__all__ = ["TimingPasses", "call_costs", "derive", "dispatch_only", "time_call", "timing_passes", "xla_compiled"]

# A call's analysis (tfremat.extract.analysis.CallAnalysis, which imports this module): a frozen
# dataclass whose forward_seconds and backward_seconds the timing fills in.
Analysis = Any

# Timing (_rounds): runs go on until they took this long and numbered `repeats`, or
# this many; the least run of those is the cost. Within timing_passes every call is timed
# this many times, in passes over all the calls (the largest calls three times as many), and each
# keeps the mean of its least half (_Timing.chosen).
_MIN_TIMING_SECONDS = 0.05
_MAX_TIMED_RUNS = 400
_TIMING_PASSES = 3
# The calls that make this share of the timed seconds, largest first, are timed in three times
# as many passes: where the step's time is, one window's load moved a profile's costs most.
_LARGE_CALLS_SHARE = 0.8
# Traced timings per trace within a pass (TracedRounds): a trace costs 10-20 ms to start,
# stop and read besides its events, and one over a whole pass of a large model would hold
# all its events at once.
_TIMINGS_PER_TRACE = 32
_COST_GRID = 1.04  # costs are powers of this (seconds), so noise below ~2% cannot change them
# The functions that compute nothing, by the structure of their inputs' specs, device and XLA (dispatch_only).
_DISPATCH_FUNCTIONS: dict[tuple, Callable] = {}
# The passes that time every profiled call again (timing_passes), or None.
_TIMING = contextvars.ContextVar("tfremat_timing_passes", default=None)


class _Timing:
    """One profiled call's timed functions, the least seconds of each in every pass so far
    (:func:`_kernel_seconds`, :func:`_least_seconds`), and ``finish``, which makes the
    analysis of the chosen pass."""

    def __init__(self, make_calls: Callable[[], list], repeats: int, warmup: int, layer_name: str, xla: bool,
                 finish: Callable[[list[float]], Analysis]):
        self.make_calls, self.repeats, self.warmup = make_calls, repeats, warmup
        self.layer_name, self.xla, self.finish = layer_name, xla, finish
        self.passes: list[list[float]] = []

    @property
    def traced(self) -> bool:
        """Whether the calls are timed from TensorFlow's trace (on CPU, without XLA)."""
        return not self.xla and not default_device().startswith("GPU")

    def run_pass(self, trace: TracedRounds | None = None) -> None:
        """Times the calls once more, on fresh sample inputs (no pass keeps the inputs of
        every call alive while the others run), after one warm-up round once the first
        pass has warmed them up as asked. A traced timing runs within ``trace`` when given
        (its seconds come when the trace is read), else in a trace of its own."""
        calls = self.make_calls()
        warmup = 1 if self.passes else self.warmup
        if self.xla:
            self.passes.append(_compiled_least_seconds(calls, self.repeats, warmup, self.layer_name))
        elif not self.traced:
            self.passes.append(_least_seconds(calls, self.repeats, warmup))
        elif trace is None:
            self.passes.append(_kernel_seconds(calls, self.repeats, warmup))
        else:
            _traced_pass(trace, calls, self.repeats, warmup, self.passes.append)

    def chosen(self) -> list[float]:
        """Each function's mean over its least half of the passes (the least of three):
        a stall that slows every run of one window (the process waiting for a core
        for 50 ms on a loaded machine) costs that window only, for each of the timed
        functions apart, and the mean of a few quiet windows repeats better than the least
        one (``benchmarks/profile_spread.py``)."""
        return [float(np.mean(sorted(seconds)[:max(1, len(seconds) // 2)])) for seconds in zip(*self.passes)]


class TimingPasses:
    """The profiled calls of one extraction, timed again in passes over all of them
    (:func:`timing_passes`)."""

    def __init__(self, passes: int):
        self.passes = passes
        self._timings: dict[int, tuple[Analysis, _Timing, Callable]] = {}
        self._final: dict[int, Analysis] = {}
        self._done = False

    def add(self, analysis: Analysis, timing: _Timing) -> None:
        self._timings[id(analysis)] = (analysis, timing, lambda timed: timed)

    def derive(self, analysis: Analysis, derived: Analysis) -> None:
        """``derived`` (made from ``analysis`` after it was timed) takes its final seconds."""
        entry = self._timings.get(id(analysis))
        if entry is not None:
            def seconds_of(timed, adapt=entry[2]):
                timed = adapt(timed)
                return dataclasses.replace(derived, forward_seconds=timed.forward_seconds,
                                           backward_seconds=timed.backward_seconds)
            self._timings[id(derived)] = (derived, entry[1], seconds_of)

    def final(self, analysis: Analysis) -> Analysis:
        """``analysis`` with its seconds chosen over the passes (:meth:`_Timing.chosen`); the
        passes not run yet run on the first call, the calls that make most of the step
        (:data:`_LARGE_CALLS_SHARE`) in three times as many. An analysis not timed here (read
        from the cache) is returned as is."""
        if not self._done:
            self._done = True
            timings = list({id(timing): timing for _, timing, _ in self._timings.values()}.values())
            for done in range(self.passes):
                _run_passes([timing for timing in timings if len(timing.passes) == done], 1)
            _run_passes(_largest(timings, _LARGE_CALLS_SHARE), 2 * self.passes)
        entry = self._timings.get(id(analysis))
        if entry is None:
            return analysis
        if id(analysis) not in self._final:
            _, timing, adapt = entry
            self._final[id(analysis)] = adapt(timing.finish(timing.chosen()))
        return self._final[id(analysis)]


def _run_passes(timings: Sequence[_Timing], passes: int) -> None:
    """``passes`` more passes over ``timings``; the traced ones in traces of at most
    :data:`_TIMINGS_PER_TRACE` timings' rounds, consecutive passes sharing a trace."""
    traced = []
    for _ in range(passes):
        for timing in timings:
            if timing.traced:
                traced.append(timing)
            else:
                timing.run_pass()
    for first in range(0, len(traced), _TIMINGS_PER_TRACE):
        with TracedRounds() as trace:
            for timing in traced[first:first + _TIMINGS_PER_TRACE]:
                timing.run_pass(trace)


def _largest(timings: Sequence[_Timing], share: float) -> list[_Timing]:
    """The fewest of ``timings``, largest first by their least seconds so far (the longest
    timed function of each), whose seconds make ``share`` of all of theirs."""
    sizes = [max(timing.chosen()) for timing in timings]
    order = sorted(range(len(timings)), key=lambda k: -sizes[k])
    total, kept = 0.0, []
    for k in order:
        if total >= share * sum(sizes):
            break
        kept.append(timings[k])
        total += sizes[k]
    return kept


@contextlib.contextmanager
def timing_passes(passes: int | None = None):
    """Within it, every call :func:`~tfremat.extract.analysis.analyze_call` and
    :func:`~tfremat.extract.analysis.analyze_loss` profile is timed
    ``passes`` times (``passes`` defaults to :data:`_TIMING_PASSES`), in passes over all of
    them when the first analysis is asked for its final form (:meth:`TimingPasses.final`;
    on CPU each pass in one trace, :class:`~tfremat.extract.timing.TracedRounds`; an XLA or
    GPU call once at analysis and ``passes - 1`` times there), the calls that make
    :data:`_LARGE_CALLS_SHARE` of the timed seconds ``2 * passes`` times more; each timed
    function keeps the mean of its least half of the passes (:meth:`_Timing.chosen`).

    A busy machine slows every run for seconds at a time (on the 2-core machine at a load
    of 7, all runs of a call were 25-35% slower for a second or two, and least over a
    window shorter than that took the slow time); passes seconds apart give each call
    several such windows. ``benchmarks/profile_agreement.py`` measures what it buys."""
    timing = TimingPasses(_TIMING_PASSES if passes is None else passes)
    token = _TIMING.set(timing)
    try:
        yield timing
    finally:
        _TIMING.reset(token)


def time_call(untimed: Analysis, make_calls: Callable[[], list], repeats: int, warmup: int, layer_name: str,
              xla: bool, finish: Callable[[list[float]], Analysis]) -> Analysis:
    """``finish`` of the least seconds of ``make_calls()``'s calls, timed in turns; within
    :func:`timing_passes` the call is registered to be timed there, and the fewest
    rounds ``repeats`` are shared among the passes (a call of many milliseconds, timed by
    its rounds rather than by :data:`_MIN_TIMING_SECONDS`, takes about as long as in one
    window). A call timed from the trace is timed in the passes only, with the others:
    ``untimed`` (seconds 0) stands for it until :meth:`TimingPasses.final`; the others are
    timed once here."""
    passes = _TIMING.get()
    if passes is not None:
        repeats = max(2, math.ceil(repeats / passes.passes))
    timing = _Timing(make_calls, repeats, warmup, layer_name, xla, finish)
    if passes is None or not timing.traced:
        timing.run_pass()
        analysis = finish(timing.chosen())
    else:
        analysis = untimed
    if passes is not None:
        passes.add(analysis, timing)
    return analysis


def derive(timed: Analysis, derived: Analysis) -> None:
    """Within :func:`timing_passes`, ``derived`` (made from ``timed`` after :func:`time_call`)
    takes ``timed``'s final seconds (:meth:`TimingPasses.derive`); outside it nothing is
    left to time."""
    passes = _TIMING.get()
    if passes is not None:
        passes.derive(timed, derived)


def _least_seconds(calls: Sequence[tuple[Callable, tuple]], repeats: int, warmup: int) -> list[float]:
    """The least wall seconds of each ``fn(*args)`` in ``calls``, timed in turns from Python
    (:func:`_rounds`): for XLA functions and on a GPU, whose runs TensorFlow's host trace
    does not time (:func:`_kernel_seconds` does on CPU). Other processes and preemption only
    add time to a run, so the least run is what the call costs."""
    least = [math.inf] * len(calls)

    def timed(position: int, fn: Callable, args: tuple) -> None:
        start = time.perf_counter()
        synchronize(fn(*args))
        least[position] = min(least[position], time.perf_counter() - start)

    _rounds(calls, repeats, warmup, timed)
    return least


def _kernel_seconds(calls: Sequence[tuple[Callable, tuple]], repeats: int, warmup: int) -> list[float]:
    """The least seconds TensorFlow's executor ran each concrete function of ``calls``
    for, from its profiler's trace of all the rounds (:func:`_rounds`,
    :class:`tfremat.extract.timing.TracedRounds`): what the call's operations cost, without
    the ~350 us of calling a function from Python, whose jitter was tens of percent of a
    small node between two profiles (benchmarks/results/profile_agreement.md)."""
    least = []
    with TracedRounds() as trace:
        _traced_pass(trace, calls, repeats, warmup, least.append)
    return least[0]


def _traced_pass(trace: TracedRounds, calls: Sequence[tuple[Callable, tuple]], repeats: int, warmup: int,
                 done: Callable[[list[float]], None]) -> None:
    """Runs ``calls`` in rounds (:func:`_rounds`) within ``trace``; ``done`` gets the least
    traced seconds of each once the trace is read (:class:`tfremat.extract.timing.TracedRounds`)."""
    names = [fn.function_def.signature.name for fn, _ in calls]
    trace.run(names, lambda: _rounds(calls, repeats, warmup, lambda position, fn, args: synchronize(fn(*args))),
              warmup, lambda seconds: done([min(s) for s in seconds]))


def _rounds(calls: Sequence[tuple[Callable, tuple]], repeats: int, warmup: int,
            timed: Callable[[int, Callable, tuple], None]) -> int:
    """Runs every ``fn(*args)`` of ``calls`` ``warmup`` times unmeasured, then ``timed(position,
    fn, args)`` for each in rounds until there are at least ``repeats`` rounds and
    :data:`_MIN_TIMING_SECONDS` have passed, or :data:`_MAX_TIMED_RUNS` rounds, on the step's
    executor. The minimum time makes runs of a tiny call many, so that some run meets a
    quiet moment, and taking the calls in turns puts the same load on each. Returns the
    number of timed rounds."""
    calls = [(executor.on_its_executor(fn), args) for fn, args in calls]
    with executor.step_executor():
        _warm_up(calls, warmup)
        began = time.perf_counter()
        for round_ in range(1, _MAX_TIMED_RUNS + 1):
            for position, (fn, args) in enumerate(calls):
                timed(position, fn, args)
            if round_ >= repeats and time.perf_counter() - began >= _MIN_TIMING_SECONDS:
                break
    return round_


def _warm_up(calls: Sequence[tuple[Callable, tuple]], warmup: int) -> None:
    for _ in range(warmup):
        for fn, args in calls:
            synchronize(fn(*args))


def dispatch_only(args: tuple, xla: bool = False):
    """A concrete function that takes ``args`` and computes nothing: its time is what
    running a concrete function costs besides its operations, which a profiled call pays
    and the compiled step, one function for the whole step, does not pay per node: from
    Python hundreds of microseconds on CPU, more than a small layer's kernels; in the trace
    (:func:`_kernel_seconds`) the executor's start and end of a run, about 2 us.

    With ``xla`` an XLA function that returns a scalar: launching an executable costs
    more than calling a graph function, and an XLA identity would copy its inputs (its
    outputs cannot share the caller's buffers), which is computing.

    One function per structure of ``args``' specs, device and ``xla`` in the process
    (:data:`_DISPATCH_FUNCTIONS`): the functions for two calls with like inputs are the
    same computation, and tracing and instantiating one per profiled call cost a trace and
    a Grappler pass each (111 on EfficientNetV2B0, ``benchmarks/first_step_latency.py``)."""
    key = (xla, default_device(), repr(tf.nest.map_structure(lambda t: (tuple(t.shape), t.dtype.name), args)))
    if key not in _DISPATCH_FUNCTIONS:
        if xla:
            function = tf.function(lambda *xs: tf.zeros([]), autograph=False, jit_compile=True)
        else:
            function = tf.function(lambda *xs: tf.nest.map_structure(tf.identity, xs))
        _DISPATCH_FUNCTIONS[key] = function.get_concrete_function(*args)
    return _DISPATCH_FUNCTIONS[key]


def _less_dispatch(seconds: float, dispatch: float) -> float:
    """A call's seconds without the cost of calling it from Python (:func:`dispatch_only`),
    at least 5% of them (as a backward's difference of two timings is kept)."""
    return max(seconds - dispatch, 0.05 * seconds)


def _on_grid(seconds: float) -> float:
    """``seconds`` rounded to the nearest power of :data:`_COST_GRID` (0 stays 0): two
    profiles of one model whose costs differ by less than the grid's step mostly give the
    same numbers, and with them the same schedule, instead of a MILP that flips on noise."""
    if seconds <= 0:
        return 0.0
    return _COST_GRID ** round(math.log(seconds, _COST_GRID))


def call_costs(dispatch: float, forward: float, forward_backward: float = 0.0) -> tuple[float, float]:
    """A profiled call's forward and backward seconds, on the grid (:func:`_on_grid`), from
    the least seconds of its timed functions: one that computes nothing (:func:`dispatch_only`),
    its forward, and its forward-plus-backward (0 for the loss, whose node has no backward).
    The forward is its timing less the dispatch (:func:`_less_dispatch`); the backward the
    difference of the two timings, taken under one load, at least 5% of the
    forward-plus-backward (the dispatch cancels in the difference)."""
    backward = _on_grid(max(forward_backward - forward, 0.05 * forward_backward)) if forward_backward else 0.0
    return _on_grid(_less_dispatch(forward, dispatch)), backward


def _compiled_least_seconds(calls, repeats: int, warmup: int, layer_name: str) -> list[float]:
    """:func:`_least_seconds` of XLA functions, at least one warm-up run (it compiles).

    Raises:
        ExtractionError: XLA cannot compile one of them (an operation without an XLA
            kernel, a shape XLA needs static).
    """
    with xla_compiled(layer_name):
        return _least_seconds(calls, repeats, max(1, warmup))


@contextlib.contextmanager
def xla_compiled(layer_name: str):
    """Turns XLA's refusal to compile a call or its gradient (an operation without an XLA
    kernel, a shape XLA needs static) into one :class:`ExtractionError` naming the layer."""
    try:
        yield
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
        raise ExtractionError(
            f"layer {layer_name!r}: XLA cannot compile it or its gradient ({str(error).splitlines()[0][:200]}); "
            "compile the model with jit_compile=False, or extract without xla",
            layer=layer_name,
        ) from error
