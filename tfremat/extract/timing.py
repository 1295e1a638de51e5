"""How long TensorFlow ran each function call, read from its profiler's trace.

Timed from Python, a profiled call of a few layers' kernels (10-150 us on CPU) sits behind
about 350 us of calling a function from Python and TensorFlow's eager runtime, and a few
microseconds of jitter there were tens of percent of a node between two profiles
(benchmarks/results/profile_agreement.md). The compiled step, one function, pays none of it
per node. TensorFlow's trace says when each function ran: the eager runtime hands the
function's execution to an inter-op thread (a ``ThreadpoolListener::Record`` event on the
calling thread, with a ``_p`` id), and that thread brackets the execution with
``ThreadpoolListener::StartRegion`` (the same id as ``_c``) and ``StopRegion``. On the
single-threaded executor the region is the whole run of the function's operations, its
kernels' intra-op threads included (they finish within it); on TensorFlow's default
executor a run hands ready operations to further regions, so a call's seconds are the span
of the regions it led to, transitively, each ending at the latest when the call returned
(the thread that ran it may be preempted before it marks the end). The calling thread names each call by its function
(``EagerLocalExecute: <function name>``), which attributes the regions to the calls of one
trace: the runs of one timing pass of many calls are traced together (:class:`TracedRounds`),
and the calls' order attributes them (TensorFlow 2.21; the event and stat names are the
profiler's own).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import glob
import os
import tempfile
from collections.abc import Callable, Sequence

import tensorflow as tf

from tfremat.runtime.profiler import profiler_trace

__all__ = ["TracedRounds"]

_EXECUTE = "EagerLocalExecute: "
_RECORD = "ThreadpoolListener::Record"
_START = "ThreadpoolListener::StartRegion"
_STOP = "ThreadpoolListener::StopRegion"
_ID_MASK = (1 << 64) - 1
# Host events only: no Python tracer, no device tracer (nothing runs on a device). TensorFlow 2.21's
# binding ignores them (it logs '<option> expects an i value' and traces at its default host level
# 2, the same events here); asked for where a TensorFlow takes them.
_OPTIONS = dict(host_tracer_level=1, python_tracer_level=0, device_tracer_level=0)


class TracedRounds:
    """One trace over the rounds of many groups of calls, started and stopped once.

    Starting, stopping and parsing a trace costs about 10-20 ms besides the events it
    holds; timing each profiled call in a trace of its own paid that once per call and
    pass (``benchmarks/profile_agreement.py``, profiling seconds). Within the context each
    :meth:`run` calls one group's functions in rounds; on leaving, the trace is read once
    and each group's ``done`` gets its seconds: per position of its ``names``, the seconds of
    its calls in the order they ran (:func:`_attributed`)."""

    def __init__(self):
        self._groups: list[tuple[list[str], int, int, Callable[[list[list[float]]], None]]] = []
        self._context = None

    def __enter__(self) -> "TracedRounds":
        self._context = _traced()
        self._calls_of = self._context.__enter__()
        return self

    def run(self, names: Sequence[str], run: Callable[[], int], untimed: int,
            done: Callable[[list[list[float]]], None]) -> None:
        """Calls ``run()``, which calls the functions ``names`` in rounds (one call of each per
        round, in the order of ``names``; other eager operations between them are not counted)
        and returns how many; the first ``untimed`` rounds (a warm-up) are not timed. ``done``
        gets the seconds of the others once the trace is read."""
        rounds = run()
        _settle()
        self._groups.append((list(names), untimed, rounds, done))

    def __exit__(self, *exc) -> None:
        context, self._context = self._context, None
        context.__exit__(*exc)
        if exc[0] is not None:
            return
        calls = self._calls_of({name for names, _, _, _ in self._groups for name in names})
        first = 0
        for names, untimed, rounds, _ in self._groups:
            first += len(names) * (untimed + rounds)
        if first != len(calls):
            raise RuntimeError(
                f"TensorFlow's trace shows {len(calls)} calls where {first} were made: this TensorFlow's profiler "
                "events differ from 2.21's (tfremat.extract.timing)")
        first = 0
        for names, untimed, rounds, done in self._groups:
            last = first + len(names) * (untimed + rounds)
            done(_attributed(calls[first + len(names) * untimed:last], names))
            first = last


@contextlib.contextmanager
def _traced():
    """TensorFlow's profiler traces the host inside this context, which gives a function
    that reads the calls of the functions it is given off the trace, once it stopped."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    spaces = []

    def calls_of(wanted: set[str]) -> list[tuple[int, str, float | None]]:
        calls = []
        for space in spaces:
            for plane in space.planes:
                if plane.name.startswith("/host:"):
                    calls.extend(_plane_calls(plane, wanted))
        calls.sort(key=lambda call: call[0])
        return calls

    with tempfile.TemporaryDirectory(prefix="tfremat_timing_") as logdir:
        with profiler_trace(logdir, tf.profiler.experimental.ProfilerOptions(**_OPTIONS)):
            yield calls_of
        for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
            space = xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            spaces.append(space)


def _attributed(calls: list[tuple[int, str, float | None]], names: Sequence[str]) -> list[list[float]]:
    """Per position of ``names``, the seconds of the ``calls`` (in time order, rounds of
    ``names``) made there; a call whose end the trace missed (the last round's may,
    :func:`_settle`) is left out."""
    seconds: list[list[float]] = [[] for _ in names]
    for k, (_, name, span) in enumerate(calls):
        position = k % len(names)
        if name != names[position]:
            raise RuntimeError(
                f"TensorFlow's trace shows call {k} of {len(calls)} as {name!r} where {names[position]!r} was "
                f"called, in rounds of {len(names)}: this TensorFlow's profiler events differ from 2.21's "
                "(tfremat.extract.timing)")
        if span is not None:
            seconds[position].append(span)
    # A call whose region the trace missed (seen once in a mid-round call of a dispatch-only
    # function at load 3: 'no execution of __inference_<lambda> (call 42 of 144)') is timed by its
    # other rounds; only a function with no timed round at all means the events are not 2.21's.
    if not all(seconds):
        raise RuntimeError(f"TensorFlow's trace shows no execution of {names[seconds.index([])]!r}")
    return seconds


@functools.cache
def _settler():
    return tf.function(lambda: tf.constant(0.0), autograph=False).get_concrete_function()


def _settle() -> None:
    """Calls a function that computes nothing, so that the thread that ran the last call
    marks the end of its region before the trace stops: the caller resumes when the call's
    results are ready, and the region's end is recorded just after (a 1-round trace missed
    its last call's end without this). The last round's calls are allowed to miss it."""
    _settler()()


def _plane_calls(plane, wanted: set[str]) -> list[tuple[int, str, float | None]]:
    """``(start ps, function name, seconds or None)`` of every call of a function in
    ``wanted`` on ``plane``: the span of the regions the call's records led to."""
    stat_ids = {meta.name: key for key, meta in plane.stat_metadata.items()}
    producer_id, consumer_id = stat_ids.get("_p"), stat_ids.get("_c")
    # Only these events are read: a trace holds many more (every allocation of every run).
    kinds = {}
    for key, meta in plane.event_metadata.items():
        if meta.name in (_RECORD, _START, _STOP):
            kinds[key] = meta.name
        elif meta.name.startswith(_EXECUTE) and meta.name[len(_EXECUTE):] in wanted:
            kinds[key] = meta.name[len(_EXECUTE):]
    executes = []  # (start, end, line, name)
    records: dict[int, list[tuple[int, int]]] = {}  # line -> (time, id)
    regions: dict[int, tuple[int, int, int]] = {}  # consumer id -> (line, start, end)
    for line in plane.lines:
        base = line.timestamp_ns * 1000
        open_regions = []
        line_records = records.setdefault(line.id, [])
        # One lookup per event: a trace holds hundreds of thousands, and this loop was most of
        # reading one (benchmarks/first_step_latency.py, Session 29).
        kept = [(event.offset_ps, kind, event) for event in line.events
                if (kind := kinds.get(event.metadata_id)) is not None]
        kept.sort(key=lambda item: item[0])
        for offset, kind, event in kept:
            time = base + offset
            if kind == _RECORD:
                line_records.append((time, _stat(event, producer_id)))
            elif kind == _START:
                open_regions.append((time, _stat(event, consumer_id)))
            elif kind == _STOP:
                if open_regions:
                    start, consumer = open_regions.pop()
                    if consumer is not None:
                        regions[consumer] = (line.id, start, time)
            else:
                executes.append((time, time + event.duration_ps, line.id, kind))
    times = {line_id: [t for t, _ in line_records] for line_id, line_records in records.items()}

    def produced(line_id: int, start: int, end: int) -> list[int]:
        """The ids of the records on ``line_id`` between ``start`` and ``end`` (in time order)."""
        line_times = times.get(line_id, [])
        first, last = bisect.bisect_left(line_times, start), bisect.bisect_right(line_times, end)
        return [p for _, p in records[line_id][first:last] if p is not None]

    calls = []
    for start, end, line_id, name in executes:
        spans = []
        pending = produced(line_id, start, end)
        seen = set()
        while pending:
            producer = pending.pop()
            if producer in seen or producer not in regions:
                continue
            seen.add(producer)
            region_line, region_start, region_end = regions[producer]
            # A region ends after it handed the caller its results, at the latest when the
            # caller returns: a thread preempted in between (the caller waking up takes
            # its core) marked the end of a 3 ms loop call up to 30 ms late under load.
            spans.append((region_start, min(region_end, end)))
            pending.extend(produced(region_line, region_start, region_end))
        span = (max(e for _, e in spans) - min(s for s, _ in spans)) * 1e-12 if spans else None
        calls.append((start, name, span))
    return calls


def _stat(event, stat_id: int | None) -> int | None:
    """The value of ``event``'s stat whose metadata id is ``stat_id`` (None: absent)."""
    for stat in event.stats:
        if stat.metadata_id == stat_id:
            return (stat.uint64_value or stat.int64_value) & _ID_MASK
    return None
