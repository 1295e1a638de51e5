"""Allocator-measured peak memory of one training step, in the graph's convention.

On CPU the numbers exist only with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is
imported. The peak reported is the allocator's peak during the step above what was allocated
when it started, plus the bytes that exist before the step and that the graph counts as
fixed (variables, optimizer slots, the batch): the same convention as
:func:`tfremat.extract.plain_step.measure_plain_step_peak`, so a compiled step, a plain step and the
simulator's prediction compare directly. Tensors the process holds for other reasons are
not counted.

The allocator's peak (``count="allocator"``, what ``get_memory_info`` reports) counts whole
BFC chunks, and BFC hands out a free chunk whole when it is less than twice the request,
so a scratch buffer can count as nearly twice its size. Which free chunks exist depends on
everything the process allocated before, so the same step measures differently in
different processes (docs/memory-model.md). ``count="requested"`` sums the bytes the step's
operations asked for instead, from the profiler's allocation events: the quantity the
simulator predicts, independent of the allocator's history.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfremat.errors import CompileError, ExtractionError
from tfremat.runtime.profiler import profiler_trace

__all__ = ["AllocationWindows", "measure_step_peak", "order_free_peak", "requested_peak", "requested_peak_live", "reset_allocator_peak", "resident_bytes", "default_device", "synchronize"]

logger = logging.getLogger(__name__)


def default_device() -> str:
    """``GPU:0`` when TensorFlow sees a GPU, else ``CPU:0``."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def synchronize(result) -> None:
    """Waits for a (possibly asynchronous) device result by reading one element back
    (of a numeric tensor: a ``variant`` one, a loop's accumulator, cannot be read)."""
    for t in tf.nest.flatten(result):
        if t is not None and t.dtype != tf.variant:
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


def resident_bytes(tensors: Sequence) -> int:
    """Bytes of tensors or variables from their static shapes and dtypes."""
    return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tensors)


def measure_step_peak(step: Callable, x, y, resident: Sequence = (), device: str | None = None, warmup: int = 1,
                      count: str = "allocator") -> int:
    """Runs ``step(x, y)`` and returns the allocator peak of the last run, in bytes.

    Args:
        step: the training step (a :class:`~tfremat.static_graph.CompiledStep` or any
            callable of the batch); its first output is synchronized on.
        x, y: one batch, already tensors on the device.
        resident: the variables that exist before the step and that the graph counts as
            fixed (model and optimizer variables); their bytes and the batch's are added.
        device: the allocator to read (default :func:`default_device`).
        warmup: runs (tracing included) before the measured one.
        count: ``"allocator"``: the allocator's peak bytes in use (whole chunks, so it
            includes the allocator's internal fragmentation, which depends on the process's
            history); ``"requested"``: the peak of the bytes the step's operations
            requested, from the profiler's allocation events (see the module docstring).

    Returns:
        Peak bytes of one step in the graph's convention (see the module docstring).

    Raises:
        CompileError: the allocator reports nothing (``TF_CPU_ALLOCATOR_USE_BFC`` unset),
            or ``count`` is unknown.
    """
    if count not in ("allocator", "requested"):
        raise CompileError(f"count must be 'allocator' or 'requested', got {count!r}")
    device = device or default_device()

    def run():
        result = step(x, y)
        tf.nest.flatten(result)[0].numpy()

    for _ in range(warmup):
        run()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    if count == "requested":
        peak = requested_peak(run, device)
    else:
        run()
        peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    if start == 0 and tf.config.experimental.get_memory_info(device)["peak"] == 0:
        raise CompileError("the allocator reports no memory use; set TF_CPU_ALLOCATOR_USE_BFC=true before importing TensorFlow")
    fixed = resident_bytes(list(resident)) + resident_bytes(tf.nest.flatten(x)) + resident_bytes(tf.nest.flatten(y))
    logger.info("step peak on %s: %d bytes above start, %d resident", device, peak, fixed)
    return int(peak + fixed)


def _allocator_matches(name: str, device: str) -> bool:
    """Whether the allocator called ``name`` serves ``device`` (``CPU:0``, ``GPU:1``)."""
    kind, _, index = device.upper().rpartition("/")[2].partition(":")
    if kind == "GPU":
        return name.startswith(f"GPU_{index or 0}_")
    return "cpu" in name.lower()


def requested_peak(run: Callable[[], None], device: str, *, allow_empty: bool = False) -> int:
    """Peak of the bytes requested from ``device``'s allocator by allocations made in ``run()``.

    Replays the profiler's ``MemoryAllocation``/``MemoryDeallocation`` events in time order;
    the peak is above the start. A tensor allocated before the run and freed in it counts
    by its requested bytes: a slot variable assigned a new value (momentum, RMSprop) takes
    the new buffer and frees its old one, and ignoring those frees counted the slots again
    (an SGD-momentum MLP read 11.4 MiB where the allocator peaked at 9.8 MiB;
    ``benchmarks/optimizer_update.py``).

    Args:
        run: what to measure (it must finish its device work before it returns).
        device: the allocator to read ("CPU:0", "GPU:0").
        allow_empty: a run that allocates nothing has peak 0 (one layer call that only
            reshapes); otherwise no event means the profiler saw nothing, an error.

    Raises:
        CompileError: no allocation event and not ``allow_empty``, or the profiler protos
            are missing from this TensorFlow build.
    """
    return requested_peak_live(run, device, allow_empty=allow_empty)[0]


def requested_peak_live(run: Callable[[], None], device: str, *,
                        allow_empty: bool = False) -> tuple[int, list[dict]]:
    """:func:`requested_peak` and what is live at that peak: which operations' buffers make
    the step request more than its prediction (fidelity diagnostics, benchmarks/fidelity.py).

    Returns:
        ``(peak, live)``: ``live`` holds one dict per allocation made in ``run()`` and not
        freed at the peak's first moment, in allocation order: ``op`` (the allocating
        operation's name, name scope included: the compiled step's statements are scoped as
        ``tfremat.static_graph.interpreter.STATEMENT_SCOPE`` reads them), ``region``
        (``output`` or ``temp``), ``shape`` and ``bytes`` (requested); the peak is their sum.

    Raises:
        CompileError: as :func:`requested_peak`.
    """
    events = _allocation_events(run, device)
    if not events and not allow_empty:
        raise CompileError(f"the profiler recorded no allocation on {device}")
    return _replayed_peak(events)


def _replayed_peak(events: list[tuple]) -> tuple[int, list[dict]]:
    """:func:`requested_peak_live` of the allocation ``events`` of one run (any order)."""
    events = sorted(events, key=lambda e: (e[0], not e[1]))
    live: dict = {}
    current = peak = 0
    at_peak: list = []
    for _, allocation, addr, requested, info in events:
        if allocation:
            live[addr] = (requested, info)
            current += requested
            if current > peak:
                peak = current
                at_peak = list(live.values())
        else:
            current -= live.pop(addr, (requested, None))[0]
    return peak, [{**info, "bytes": requested} for requested, info in at_peak]


def order_free_peak(events: list[tuple], small_bytes: int, small_total: int = 0,
                    small_sizes: Mapping[str, int] | None = None) -> int:
    """The requested peak of one run's allocation ``events`` with every allocation under
    ``small_bytes`` counted as live from the start to the end: the replayed peak of the
    others plus the total of those, or ``small_total`` if that is more.

    An upper bound of the peak over every order in which the runtime may run the small
    operations, and the same bound whichever it ran. The executor runs a function's
    independent operations in an order drawn per instantiation (identical
    ``FunctionDef``s, different orders), so a batch norm's forward peaked with two to
    five of its per-channel vectors (statistics, moving-average updates) live, by trace,
    and the graph's workspace figures differed from one extraction to the next
    (benchmarks/results/profile_agreement.md, "Session 29 (W)"). Which small operations
    allocate also depends on the order (one that forwards its input's buffer allocates
    nothing when it is that input's last reader): ``small_total``, their bytes counted off
    the graph, makes the total the same in every order where the graph knows every size.
    ``small_sizes`` does it operation by operation (name: bytes of its small outputs by the
    graph): each counts the larger of those and what it allocated in this run, so one whose
    outputs the graph cannot size (a random op's key and counter) counts what it allocated,
    and one that forwarded a buffer in this order (a dropout's seed ``FloorMod``, 16 B in
    some extractions and none in others) counts its outputs. A small buffer made before the
    run and freed in it (the seed variable's old value, which its assignment frees) counts
    as held to the end: freed before or after the peak by order, it moved the peak by its
    16 B (benchmarks/results/workspace_repeatability.md, "Session 30 (W2)")."""
    kept, small_live, made = [], set(), set()
    allocated: dict[str, int] = {}
    for event in sorted(events, key=lambda e: (e[0], not e[1])):
        _, allocation, addr, requested, info = event
        if allocation:
            made.add(addr)
        if allocation and requested < small_bytes:
            small_live.add(addr)
            allocated[info.get("op", "")] = allocated.get(info.get("op", ""), 0) + requested
        elif not allocation and addr in small_live:
            small_live.discard(addr)  # its free, whatever bytes the event carries
        elif not allocation and addr not in made and requested < small_bytes:
            continue  # a small buffer from before the run (a variable's old value), held to its end
        else:
            kept.append(event)
    sizes = dict(small_sizes or {})
    total_small = sum(max(size, sizes.pop(op, 0)) for op, size in allocated.items()) + sum(sizes.values())
    return _replayed_peak(kept)[0] + max(total_small, small_total)


class AllocationWindows:
    """Several runs' allocation events read off one profiler session, each run's as
    :func:`requested_peak` reads them from a session of its own.

    Starting, stopping and reading a profiler session cost about 20 ms of wall time (4 ms
    of CPU) whatever it records, and profiling one layer call measures the requested peaks
    of six to ten functions (:func:`tfremat.extract.analysis._profile_call`). Inside the
    context, :meth:`run` marks its run with a trace event of its own
    (``tf.profiler.experimental.Trace``), recorded on the clock the allocation events are;
    on leaving, each run's events are those between its event's start and end. What runs
    in the session outside :meth:`run` (warm-up runs) is not counted.

    Example:
        >>> with AllocationWindows("CPU:0") as windows:
        ...     first = windows.run(lambda: synchronize(fn(x)))
        >>> windows.peak(first)
    """

    _MARK = "tfremat_allocation_window_"

    def __init__(self, device: str):
        self.device = device
        self._count = 0
        self._events: list[list[tuple]] | None = None

    def __enter__(self) -> "AllocationWindows":
        self._logdir = tempfile.TemporaryDirectory(prefix="tfremat_memory_")
        self._trace = profiler_trace(self._logdir.name)
        self._trace.__enter__()
        return self

    def run(self, run: Callable[[], None]) -> int:
        """Runs ``run()`` (it must finish its device work before it returns) in a window of
        its own; returns the window's index for :meth:`events` and :meth:`peak`."""
        index = self._count
        self._count += 1
        with tf.profiler.experimental.Trace(f"{self._MARK}{index}"):
            run()
        return index

    def __exit__(self, *exc) -> None:
        try:
            self._trace.__exit__(*exc)
            if exc[0] is None:
                self._events = self._windowed(self._logdir.name)
        finally:
            self._logdir.cleanup()

    def _windowed(self, logdir: str) -> list[list[tuple]]:
        spaces = _spaces(logdir)
        spans = _marked_spans(spaces, self._MARK)
        if sorted(spans) != list(range(self._count)):
            raise CompileError(f"the profiler's trace shows {len(spans)} of the {self._count} marked runs: this "
                               "TensorFlow's profiler events differ from 2.21's (tfremat.runtime.memory)")
        windows: list[list[tuple]] = [[] for _ in range(self._count)]
        starts = sorted((start, end, index) for index, (start, end) in spans.items())
        for event in _space_allocation_events(spaces, self.device):
            for start, end, index in starts:
                if start <= event[0] <= end:
                    windows[index].append(event)
                    break
        return windows

    def events(self, index: int) -> list[tuple]:
        """The allocation events of window ``index`` (:func:`allocation_events`' form, in time order)."""
        return sorted(self._events[index], key=lambda e: (e[0], not e[1]))

    def peak(self, index: int) -> int:
        """The requested peak of window ``index`` (:func:`requested_peak` with ``allow_empty``)."""
        return _replayed_peak(self._events[index])[0]


def _marked_spans(spaces: list, prefix: str) -> dict[int, tuple[int, int]]:
    """``{index: (start ps, end ps)}`` of the trace events named ``prefix<index>`` in
    parsed ``XSpace`` protos (:func:`_spaces`)."""
    spans = {}
    for space in spaces:
        for plane in space.planes:
            marks = {k: int(v.name[len(prefix):]) for k, v in plane.event_metadata.items() if v.name.startswith(prefix)}
            if not marks:
                continue
            for line in plane.lines:
                for event in line.events:
                    if event.metadata_id in marks:
                        start = line.timestamp_ns * 1000 + event.offset_ps
                        spans[marks[event.metadata_id]] = (start, start + event.duration_ps)
    return spans


def _allocation_events(run: Callable[[], None], device: str) -> list[tuple]:
    """The profiler's allocation events on ``device`` during ``run()``, as
    :func:`allocation_events` reads them."""
    with tempfile.TemporaryDirectory(prefix="tfremat_memory_") as logdir:
        with profiler_trace(logdir):
            run()
        return allocation_events(logdir, device)


def allocation_events(logdir: str, device: str) -> list[tuple]:
    """The allocation events on ``device`` in a profiler log directory (its ``*.xplane.pb``
    files, at any depth): ``(time_ps, is_allocation, addr, requested_bytes, {op, region,
    shape})``, unsorted. benchmarks/distributed.py profiles one step inside ``fit`` and
    reads its directory with this."""
    return _space_allocation_events(_spaces(logdir), device)


def _spaces(logdir: str) -> list:
    """The ``XSpace`` protos of a profiler log directory (its ``*.xplane.pb`` files, at any depth).

    Raises:
        CompileError: the profiler protos are missing from this TensorFlow build.
    """
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError as error:  # pragma: no cover - depends on the TensorFlow build
        raise CompileError(f"count='requested' needs TensorFlow's profiler protos: {error}") from error
    spaces = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        spaces.append(space)
    return spaces


def _space_allocation_events(spaces: list, device: str) -> list[tuple]:
    """:func:`allocation_events` of parsed ``XSpace`` protos."""
    events = []
    for space in spaces:
        for plane in space.planes:
            stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
            kinds = {
                k: v.name for k, v in plane.event_metadata.items()
                if v.name in ("MemoryAllocation", "MemoryDeallocation")
            }
            if not kinds:
                continue
            for line in plane.lines:
                for event in line.events:
                    kind = kinds.get(event.metadata_id)
                    if kind is None:
                        continue
                    stats = {}
                    for stat in event.stats:
                        name = stat_names.get(stat.metadata_id)
                        if name in ("allocator_name", "tf_op", "region_type", "shape"):
                            stats[name] = stat_names.get(stat.ref_value, "") if stat.ref_value else stat.str_value
                        elif name in ("addr", "requested_bytes"):
                            stats[name] = stat.uint64_value or stat.int64_value
                    if _allocator_matches(stats.get("allocator_name", ""), device):
                        info = {"op": stats.get("tf_op", ""), "region": stats.get("region_type", ""),
                                "shape": stats.get("shape", "")}
                        events.append((line.timestamp_ns * 1000 + event.offset_ps, kind == "MemoryAllocation",
                                       stats.get("addr"), stats.get("requested_bytes", 0), info))
    return events
