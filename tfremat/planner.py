"""Planning a graph, shared by every user-facing entry point: a graph, a budget, a strategy
-> a :class:`PlanResult`.

``plan_graph`` / ``compare_graph`` work on a :class:`~tfremat.graph.DFGraph` and import no
TensorFlow (a Keras model's graph comes from :mod:`tfremat.model_planning`); the option
and cache checks the entry points share live here too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tfremat.budget import MIN_BUDGET, budget_kind, format_bytes, is_absolute_min
from tfremat.cache import ScheduleCache, default_cache_dir
from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverTimeLimitError,
    TfrematError,
    failure_status,
)
from tfremat.graph import DFGraph
from tfremat.ilp.solvers import DEFAULT_SOLVER, Progress, ProgressFn, check_solver_options
from tfremat.plan.offload import check_bandwidth
from tfremat.plan.registry import (
    check_options,
    in_user_terms,
    option_names,
    parse_graph_budget,
)
from tfremat.plan.schedule import Schedule, SolverFacts
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import (
    MIN_OVERHEAD_CAP,
    forward_share,
    get_strategy,
    least_budget_within,
    least_peak,
    offloading_strategy_names,
    solver_strategy_names,
    strategy_names,
)

__all__ = [
    "PlanResult", "plan_graph", "compare_graph", "strategy_options", "DEFAULT_TIME_LIMIT", "check_cache_argument",
    "split_solver_options", "summary_row", "resolve_min_budget", "BatchProgress", "PhaseProgress",
    "describe_report", "plan_summary", "DEFAULT_STALL_TIME",
]

logger = logging.getLogger(__name__)

# Seconds the MILP strategies get from the high-level API when the caller names none: a
# solve without a limit can take hours on a ResNet-sized graph at a tight budget, while
# within 60 s `optimal` proves most budgets optimal and returns the rest with their gap
# (README, "Solvers on the Checkmate graphs").
DEFAULT_TIME_LIMIT = 60.0
DEFAULT_STALL_TIME = 5.0


def strategy_options(strategy: str, **options) -> dict:
    """The options the high-level API passes to ``strategy``: those given (None means not
    given), and for the MILP strategies ``time_limit=DEFAULT_TIME_LIMIT`` unless one is;
    ``time_limit=math.inf`` asks for no limit (the strategies read it as None: solve until
    proven optimal). Applying it twice changes nothing."""
    options = {k: v for k, v in options.items() if v is not None}
    if get_strategy(strategy).takes_solver_options:
        options.setdefault("time_limit", DEFAULT_TIME_LIMIT)
        if "stall_time" in (option_names(get_strategy(strategy)) or ()):
            options.setdefault("stall_time", DEFAULT_STALL_TIME)
    return options


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A chosen schedule and what it is predicted to cost.

    Attributes:
        strategy: the strategy name.
        schedule: the schedule (R, S and solver facts).
        graph: the graph it was planned for.
        budget_bytes: the budget in bytes (None: unconstrained).
        predicted_peak_bytes: the simulator's peak for the schedule.
        checkpoint_all_peak_bytes: the peak without rematerialization.
        overhead: extra time as a fraction of one plain step (simulated makespan / total
            cost - 1): recomputation, and waits for host copies when the schedule offloads.
            The costs are those of operations run one at a time, as the step runs them;
            :attr:`step_overhead` counts it against the whole plain step, optimizer updates
            included, and :attr:`predicted_time_over_plain` adds what plain training gains
            by overlapping operations.
        solve_seconds: wall-clock seconds spent choosing the schedule (0 on a cache hit).
        from_cache: the schedule came from the on-disk cache.
        extraction: the model's extraction (graph + side table) when planned from a model.
        inexact_implementations: the implementations the schedule chose (``monet``) whose
            gradients are not bit-exact with their layer's default, as ``(node name,
            implementation name)`` pairs: they change the gradients' rounding (filled by
            ``plan_model``, which knows the layers; ``exact_gradients=True`` leaves them
            out of the choice).
        planned_with: the strategy that chose the schedule when it is not ``strategy``
            (which stays the one asked for): a re-plan of the allocator check that ran
            the heuristic whose schedule ``strategy`` had returned unimproved
            (:func:`tfremat.allocator_check.replan_strategy`); None otherwise.
        step_sequential: whether the compiled step runs one operation at a time on
            TensorFlow's single-threaded executor, which the plain overlap is measured
            against; False for a step on the default executor
            (:attr:`tfremat.static_graph.compile.CompiledStep.sequential` False: it calls
            functions, ``sequential=False``, replicas that exchange values), which overlaps
            operations as plain training does. True until a compiled step says otherwise
            (``measure_model`` and ``fit`` set it from theirs); the extraction already
            measures no overlap for a model whose plain step calls functions
            (:func:`tfremat.extract.overlap.measure_plain_overlap`).
    """

    strategy: str
    schedule: Schedule
    graph: DFGraph
    budget_bytes: int | None
    predicted_peak_bytes: int
    checkpoint_all_peak_bytes: int
    overhead: float
    solve_seconds: float
    from_cache: bool
    extraction: Any = None
    inexact_implementations: tuple[tuple[str, str], ...] = ()
    planned_with: str | None = None
    step_sequential: bool = True

    @property
    def plain_overlap(self) -> float:
        """How much faster plain training runs than the step's executor
        (:attr:`tfremat.extract.extractor.Extraction.plain_overlap`, measured against one
        operation at a time); 1.0 without an extraction (a graph planned alone), with one
        inter-op thread, or for a step on the default executor (:attr:`step_sequential`
        False: it overlaps operations as plain training does; ConvNeXt-like grouped
        convolutions, benchmarks/results/executor_time.md)."""
        return float(getattr(self.extraction, "plain_overlap", 1.0)) if self.step_sequential else 1.0

    @property
    def step_share(self) -> float:
        """The share of a plain step's seconds on the single-threaded executor that the
        graph's costs account for: ``total_cost / (total_cost + update seconds)``, the
        optimizer update timed as the costs are, with the plain overlap
        (:class:`tfremat.extract.overlap.PlainOverlap`); 1.0 where it was not timed (the
        overlap not measured). The update is what every schedule pays alike and no node's
        cost holds: a 6-block transformer's costs were 16 ms of a 22 ms step, and its plan
        ran +24% where +33% of the costs was planned (benchmarks/results/executor_time.md,
        "The step's time beyond the graph's costs"). Costs over costs plus update, rather
        than over the plain step's least run, so that a profile slowed by the load as a
        whole moves the share little (benchmarks/results/step_share.md)."""
        update = getattr(self.extraction, "plain_update_seconds", None)
        total = self.graph.total_cost
        if update is None or not total:
            return 1.0
        return total / (total + update)

    @property
    def step_overhead(self) -> float:
        """:attr:`overhead` as a fraction of the whole plain step: ``overhead * step_share``."""
        return self.overhead * self.step_share

    @property
    def predicted_time_over_plain(self) -> float:
        """The step's predicted seconds over plain training's: ``(1 + step_overhead) *
        plain_overlap`` (the overlap scales every schedule alike, so no strategy sees it)."""
        return (1 + self.step_overhead) * self.plain_overlap

    @property
    def plain_overlap_range(self) -> tuple[float, float]:
        """Where the plain overlap is expected at a like load: its rounds' quartiles, at least
        10% either side (:attr:`tfremat.extract.extractor.Extraction.plain_overlap_range`);
        both :attr:`plain_overlap` where it was not measured or does not apply."""
        if not self.step_sequential or self.extraction is None:
            return (self.plain_overlap, self.plain_overlap)
        low, high = getattr(self.extraction, "plain_overlap_range", (self.plain_overlap, self.plain_overlap))
        return (float(low), float(high))

    @property
    def predicted_time_over_plain_range(self) -> tuple[float, float]:
        """:attr:`predicted_time_over_plain` from each end of :attr:`plain_overlap_range`: where
        the step is expected at a load like the one the overlap was measured at (another load
        moves it further, :mod:`tfremat.extract.overlap`)."""
        low, high = self.plain_overlap_range
        return ((1 + self.step_overhead) * low, (1 + self.step_overhead) * high)

    @property
    def facts(self) -> SolverFacts | None:
        """What the solver proved (status, objective, best bound, gap, ...); None for heuristics."""
        return self.schedule.facts

    def summary(self) -> dict:
        """A JSON-ready one-line summary (with ``planned_with`` when a re-plan ran another
        strategy than ``strategy``)."""
        row = {
            "strategy": self.strategy,
            "status": self.facts.status if self.facts is not None else "feasible",
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "checkpoint_all_peak_bytes": self.checkpoint_all_peak_bytes,
            "overhead": round(self.overhead, 6),
            "step_overhead": round(self.step_overhead, 6),
            "plain_overlap": round(self.plain_overlap, 4),
            "predicted_time_over_plain": round(self.predicted_time_over_plain, 4),
            "predicted_time_over_plain_range": [round(t, 4) for t in self.predicted_time_over_plain_range],
            "recomputations": self.schedule.recompute_count,
            "gap": self.facts.gap if self.facts is not None else None,
            "solve_seconds": round(self.solve_seconds, 3),
            "from_cache": self.from_cache,
        }
        if self.planned_with is not None:
            row["planned_with"] = self.planned_with
        if not self.step_sequential:
            row["step_sequential"] = False
        return row


def describe_report(report, total_cost: float) -> str:
    """A solver's progress report in words, only what is known: seconds, then the best
    schedule's and the bound's compute as extra time over one plain step (``total_cost``)
    and the gap between them."""
    parts = [f"{report.seconds:.1f}s"]
    if report.note is not None:
        parts.append(report.note)
    if report.incumbent is not None:
        parts.append(f"best schedule {_extra(report.incumbent, total_cost)}")
    if report.bound is not None:
        parts.append(f"bound {_extra(report.bound, total_cost)}")
    if report.gap is not None:
        parts.append(f"gap {100 * report.gap:.2f}%")
    return ", ".join(parts)


def _extra(cost: float, total_cost: float) -> str:
    return f"{100 * (cost / total_cost - 1):+.1f}%" if total_cost > 0 else f"{cost:.6g}"


class _OpenLines:
    """The progress lines left open on stderr (rewritten in place with ``\\r``). A log record
    or a Python warning written while one is open ends it first, so that the message starts
    a line of its own instead of continuing the progress line ("gap 34.30%schedule repair
    is not ..."); the progress goes on below it. The hooks (a filter on the root logger's
    handlers and on ``logging.lastResort``, a wrapper of ``warnings.showwarning``) are in
    place only while a line is open."""

    def __init__(self):
        self.lines: list = []
        self._handlers: list[logging.Handler] = []
        self._showwarning = None

    def opened(self, line) -> None:
        if line in self.lines:
            return
        if not self.lines:
            self._hook()
        self.lines.append(line)

    def closed(self, line) -> None:
        if line in self.lines:
            self.lines.remove(line)
            if not self.lines:
                self._unhook()

    def end_lines(self, *_) -> bool:
        """Ends the open lines (a newline once), keeping them open for their next rewrite."""
        if any(line.width for line in self.lines):
            sys.stderr.write("\n")
            sys.stderr.flush()
        for line in self.lines:
            line.width = 0
        return True  # as a logging filter: the record is written

    def _hook(self) -> None:
        self._handlers = [*logging.getLogger().handlers, *([logging.lastResort] if logging.lastResort else [])]
        for handler in self._handlers:
            handler.addFilter(self.end_lines)
        self._showwarning = warnings.showwarning
        shown = self._showwarning

        def showwarning(*args, **kwargs):
            self.end_lines()
            shown(*args, **kwargs)

        warnings.showwarning = showwarning

    def _unhook(self) -> None:
        for handler in self._handlers:
            handler.removeFilter(self.end_lines)
        self._handlers = []
        warnings.showwarning = self._showwarning


_OPEN_LINES = _OpenLines()


class _SolverProgress:
    """A one-line progress display of the solver's best schedule, bound and gap on stderr
    (:func:`describe_report`), rewritten in place."""

    def __init__(self, label: str, total_cost: float):
        self.label = label
        self.total_cost = total_cost
        self.width = 0

    def __call__(self, report) -> None:
        _OPEN_LINES.opened(self)
        line = f"{self.label}: {describe_report(report, self.total_cost)}"
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = max(self.width, len(line))

    def close(self) -> None:
        if self.width:
            sys.stderr.write("\n")
        self.width = 0
        _OPEN_LINES.closed(self)


class PhaseProgress:
    """One stderr line per phase of preparing a training step (extraction, planning,
    compiling): what is being waited for while it runs, then what it gave and its seconds,
    since a new batch shape can wait many seconds before its first step. Silent when
    ``enabled`` is false (``verbose=0``).

    Example: ``tfremat batch (8, 64): extracting the training graph... 89 nodes (profiling
    9.6s), 10.7s``.
    """

    def __init__(self, label: str, enabled: bool = True):
        self.label = label
        self.enabled = enabled
        self.what = ""
        self.started = time.perf_counter()
        self.width = 0

    def start(self, what: str) -> None:
        """Announces the phase ``what`` (left open for :meth:`update` and :meth:`done`)."""
        self.what, self.started = what, time.perf_counter()
        self._write(f"{self.label}: {what}...")

    def update(self, text: str) -> None:
        """Rewrites the open phase's line with ``text`` (a solver's progress)."""
        self._write(f"\r{self.label}: {self.what}: {text}")

    def solver_progress(self, total_cost: float):
        """A ``progress`` callable for a MILP strategy that shows its reports on this line."""
        return lambda report: self.update(describe_report(report, total_cost))

    def done(self, result: str) -> float:
        """Ends the open phase's line with ``result`` and the phase's seconds; returns them."""
        seconds = time.perf_counter() - self.started
        self._write(f"\r{self.label}: {self.what}: {result}, {seconds:.1f}s", end="\n")
        self.width = 0
        _OPEN_LINES.closed(self)
        return seconds

    def close(self) -> None:
        """Ends an open phase's line as it is (the phase raised: its error follows)."""
        if self.enabled and self.width:
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.width = 0
        _OPEN_LINES.closed(self)

    def _write(self, line: str, end: str = "") -> None:
        if not self.enabled:
            return
        if not end:
            _OPEN_LINES.opened(self)
        visible = len(line.lstrip("\r"))
        sys.stderr.write(line + " " * max(self.width - visible, 0) + end)
        sys.stderr.flush()
        self.width = max(self.width, visible)


def plan_summary(result: PlanResult) -> str:
    """What a plan gives, in a line: values recomputed, predicted peak against the budget and
    the checkpoint-all peak, predicted overhead, and for a MILP whether it is proven optimal
    or its gap and why it stopped."""
    budget = "" if result.budget_bytes is None else f" within {format_bytes(result.budget_bytes)}"
    line = (f"{result.schedule.recompute_count} recomputations, predicted peak "
            f"{format_bytes(result.predicted_peak_bytes)}{budget} (checkpoint all "
            f"{format_bytes(result.checkpoint_all_peak_bytes)}), predicted overhead {100 * result.overhead:+.1f}%")
    if result.step_share < 1.0:
        line += f" of the graph's costs, {100 * result.step_overhead:+.1f}% of a plain step"
    if result.plain_overlap != 1.0:
        low, high = result.predicted_time_over_plain_range
        load = getattr(result.extraction, "plain_overlap_load", None)
        at = "" if load is None else f" at load {load:.1f}"
        line += (f", {result.predicted_time_over_plain:.2f}x plain training's time ({low:.2f}-{high:.2f}x{at}, where "
                 f"plain training on TensorFlow's default executor took {1 / result.plain_overlap:.2f}x the time of one "
                 "operation at a time: less on idle cores, more on busy ones)")
    facts = result.facts
    if result.inexact_implementations:
        named = sorted({name for _, name in result.inexact_implementations})
        line += (f", {len(result.inexact_implementations)} implementations that change rounding "
                 f"({', '.join(named)}; exact_gradients=True excludes them)")
    if result.from_cache:
        line += ", from the schedule cache"
    elif facts is not None and facts.status == "optimal":
        line += ", proven optimal"
    elif facts is not None and facts.gap is not None:
        why = " at the time limit" if facts.status == "time_limit" else ""
        line += f", within {100 * facts.gap:.2f}% of optimal{why} (not proven optimal)"
    return line


class BatchProgress:
    """One stderr line per batch size the search tries, as :class:`_SolverProgress` shows a
    solve: a search of a large model extracts a graph at every size it tries and can run
    for many minutes."""

    def __init__(self, label: str):
        self.label = label
        self.started = time.perf_counter()

    def __call__(self, batch: int, fits: bool) -> None:
        seconds = time.perf_counter() - self.started
        sys.stderr.write(f"{self.label}: {seconds:6.1f}s batch {batch} {'fits' if fits else 'does not fit'}\n")
        sys.stderr.flush()


def plan_graph(
    graph: DFGraph,
    budget,
    strategy: str = "optimal",
    *,
    cache: bool | str | ScheduleCache = True,
    verbose: int = 1,
    **options,
) -> PlanResult:
    """Chooses a schedule for ``graph`` under ``budget`` with one strategy.

    Args:
        graph: the graph.
        budget: bytes, a string with a unit ("3.5GiB"), a share of the checkpoint-all peak
            ("50%" or 0.5), a share of the activation memory above the fixed memory ("50% of
            activations"), "min" (the least memory within one extra forward pass of compute)
            or "absolute min" (at any cost), see :func:`resolve_min_budget`; or None for no
            limit. A budget at or above the checkpoint-all peak is planned, with a warning
            that nothing will be recomputed.
        strategy: a registered strategy name (``tfremat.strategies.strategy_names()``).
        cache: True for the default schedule cache, a directory, a :class:`ScheduleCache`,
            or False to always solve.
        verbose: 0 silences the solver's progress line.
        **options: passed to the strategy (e.g. ``time_limit``, ``solver``); the MILP
            strategies get ``time_limit=60`` unless told otherwise (``math.inf``: none),
            see :func:`strategy_options`.

    Raises:
        InfeasibleBudgetError: no schedule of the strategy fits.
        SolverTimeLimitError: a MILP strategy stopped at its time limit without a schedule.
        BudgetFormatError: the budget is unparsable.
        ArgumentError: ``graph`` is no DFGraph, ``strategy`` no strategy name, ``cache``
            none of its forms, or an option the strategy does not take (raised before
            anything runs).
    """
    _check_graph(graph)
    function = get_strategy(strategy)
    store = _cache_of(cache)
    reference = checkpoint_all_peak(graph)
    asked_min = budget is not None and budget_kind(budget) == MIN_BUDGET
    if asked_min:
        # The search's seconds are shown on the solver's line (a fit's phase line), or on a
        # line of its own: on graphs of a thousand nodes and more it takes a minute.
        line = None if options.get("progress") is not None or not verbose else _SolverProgress("tfremat", 0.0)
        try:
            budget = resolve_min_budget(graph, budget, progress=options.get("progress") or line)
        finally:
            if line is not None:
                line.close()
    budget_bytes = parse_graph_budget(graph, budget, reference)
    if budget_bytes is not None and budget_bytes >= reference and not asked_min:
        # warnings.warn, not the log: the caller can act on it, and the default filter shows it
        # once per call site and budget (compare plans every strategy at one budget).
        warnings.warn(f"budget={budget!r} ({format_bytes(budget_bytes)}) is at or above the checkpoint-all peak "
                      f"({format_bytes(reference)}): nothing will be recomputed; a smaller budget saves memory where a "
                      "schedule fits it (a refusal names the least one)",
                      UserWarning, stacklevel=2)
    options = strategy_options(strategy, **options)
    check_options(function, options, f"strategy {strategy!r}")
    cache_options = {k: v for k, v in options.items() if k != "progress"}
    schedule = store.load(graph, budget_bytes, strategy, cache_options) if store else None
    from_cache = schedule is not None
    started = time.perf_counter()
    if schedule is None:
        progress = None
        if get_strategy(strategy).takes_solver_options and verbose and "progress" not in options:
            progress = _SolverProgress(f"tfremat {strategy}", graph.total_cost)
            options["progress"] = progress
        try:
            # Bytes, parsed once above (a share would simulate the checkpoint-all peak again);
            # a refusal is told in the form the budget was given.
            schedule = function(graph, budget_bytes, **options)
        except InfeasibleBudgetError as error:
            raise in_user_terms(error, graph, budget, reference) from None
        finally:
            if progress is not None:
                progress.close()
        if store and (schedule.facts is None or schedule.facts.status != "interrupted"):  # Ctrl-C: not final
            store.store(graph, budget_bytes, strategy, schedule, cache_options)
    seconds = 0.0 if from_cache else time.perf_counter() - started
    result = simulate(graph, schedule)
    return PlanResult(
        strategy=strategy,
        schedule=schedule,
        graph=graph,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=result.peak_bytes,
        checkpoint_all_peak_bytes=reference,
        overhead=result.makespan / graph.total_cost - 1 if graph.total_cost else 0.0,
        solve_seconds=seconds,
        from_cache=from_cache,
    )


def resolve_min_budget(graph: DFGraph, budget, progress: ProgressFn | None = None):
    """``budget``, with ``"min"`` replaced by the least budget at which a schedule
    recomputes at most one forward pass, counted under costs no profile moves, and at most
    half a step under the profile (:func:`least_budget_within`), and ``"absolute min"`` by
    the least peak a heuristic reaches at any cost (:func:`least_peak`), in bytes (logged).
    ``progress`` gets a report (its ``note`` in words) for each budget the search for
    ``"min"`` judges."""
    if budget is None or budget_kind(budget) != MIN_BUDGET:
        return budget
    if is_absolute_min(budget):
        least = least_peak(graph)
        logger.info("budget 'absolute min': %s, the least peak a heuristic reaches on %s", format_bytes(least),
                    graph.name)
        return least
    began = time.perf_counter()

    def tell(note: str) -> None:
        logger.debug("%s", note)
        if progress is not None:
            progress(Progress(time.perf_counter() - began, None, None, None, note))

    least = least_budget_within(graph, progress=tell)
    logger.info("budget 'min': %s, the least at which a schedule of %s recomputes at most one forward pass "
                "(counted in nodes or bytes) and at most %.0f%% of a step (one forward pass is %.1f%% as profiled)",
                format_bytes(least), graph.name, 100 * MIN_OVERHEAD_CAP, 100 * forward_share(graph))
    return least


def _check_graph(graph) -> None:
    """Raises ArgumentError unless ``graph`` is a DFGraph (None failed deep inside the
    simulator with an AttributeError)."""
    if not isinstance(graph, DFGraph):
        raise ArgumentError(f"graph must be a DFGraph (tfremat.load_graph(path), or "
                            f"tfremat.extract.extract(model).graph), got {type(graph).__name__}; a Keras model is "
                            "planned by tfremat.plan_model / tfremat.compare")


def check_cache_argument(cache) -> None:
    """Raises ArgumentError unless ``cache`` is one of the forms the ``cache`` argument of
    :func:`plan_graph`, :func:`plan`, :func:`fit` and :class:`tfremat.keras.RematCallback`
    takes: True (the default directory), False or None (no cache), a directory path, or a
    :class:`ScheduleCache`.

    Shared so that the callback can refuse a bad cache when it is built, rather than at
    its first training step after the model's extraction.
    """
    if cache is True or cache is False or cache is None or isinstance(cache, (ScheduleCache, os.PathLike)):
        return
    if isinstance(cache, str) and cache.strip():
        return
    raise ArgumentError(f"cache must be True (the default directory, {default_cache_dir()}), False or None (no "
                        f"cache), a directory path, or a tfremat.cache.ScheduleCache; got {cache!r}")


def _cache_of(cache) -> ScheduleCache | None:
    check_cache_argument(cache)
    if cache is False or cache is None:
        return None
    if cache is True:
        return ScheduleCache()
    return cache if isinstance(cache, ScheduleCache) else ScheduleCache(cache)


def summary_row(strategy: str, entry: PlanResult | TfrematError, budget_bytes: int | None) -> dict:
    """One JSON-ready row of a comparison (:func:`compare_graph`'s entries): a plan's
    :meth:`PlanResult.summary`, or for a strategy that stopped with an error, its
    :func:`failure_status`, the budget, the smallest peak it reached (when known) and the
    error's message."""
    if isinstance(entry, PlanResult):
        return entry.summary()
    return {"strategy": strategy, "status": failure_status(entry), "budget_bytes": budget_bytes,
            "min_feasible_bytes": getattr(entry, "min_feasible_bytes", None), "error": str(entry)}


def compare_graph(
    graph: DFGraph,
    budget,
    strategies: Sequence[str] | None = None,
    *,
    cache: bool | str | ScheduleCache = True,
    verbose: int = 1,
    **milp_options,
) -> list[PlanResult | InfeasibleBudgetError | SolverTimeLimitError]:
    """Plans ``graph`` with every strategy (or the given ones) at one budget.

    Returns one entry per strategy, in order: its :class:`PlanResult`, or the error it
    stopped with, :class:`InfeasibleBudgetError` (nothing it produces fits) or
    :class:`SolverTimeLimitError` (a MILP strategy stopped at its time limit without a
    schedule; :func:`failure_status` tells them apart and :func:`summary_row` makes table
    rows of them). One strategy's failure leaves the others' entries: a SolverError from
    ``optimal`` used to end the whole comparison. ``milp_options`` go to the MILP
    strategies only, each getting those it takes (``mip_gap`` goes to ``optimal`` alone).

    Args:
        strategies: strategy names; None (the default) for every registered strategy. An
            empty list is refused, as by :func:`max_batch_size` (it meant every strategy
            here and none there).

    Raises:
        ArgumentError: ``graph`` is no DFGraph, ``strategies`` is empty or not a list of
            names, or an option no MILP strategy in the list takes (checked before any
            strategy runs).
        SolverError: the solver asked for cannot run (not installed, unlicensed for the
            model's size) or failed.
    """
    _check_graph(graph)
    every = strategy_names(offloading="bandwidth" in milp_options)
    names, per_strategy = split_solver_options(every if strategies is None else strategies, milp_options)
    line = _SolverProgress("tfremat", 0.0) if verbose else None
    try:
        budget = resolve_min_budget(graph, budget, progress=line)  # once for every strategy
    finally:
        if line is not None:
            line.close()
    results: list[PlanResult | InfeasibleBudgetError | SolverTimeLimitError] = []
    for name in names:
        options = per_strategy.get(name, {})
        try:
            results.append(plan_graph(graph, budget, name, cache=cache, verbose=verbose, **options))
        except (InfeasibleBudgetError, SolverTimeLimitError) as exc:
            results.append(exc)
    return results


def split_solver_options(strategies: Sequence[str], options: Mapping[str, Any]) -> tuple[list[str], dict]:
    """The strategy names, and for each MILP strategy among them the ``options`` it takes
    (``mip_gap`` is for ``optimal`` alone), and for each offloading strategy the host link's
    ``bandwidth``, checked before any strategy runs.

    Raises:
        ArgumentError: ``strategies`` is a string, no list, empty, or holds an unknown
            name, or an option no MILP strategy among them takes.
        SolverUnavailableError: the solver asked for is not installed.
    """
    if isinstance(strategies, str):
        raise ArgumentError(f"strategies must be a list of strategy names, got the string {strategies!r}; "
                            f"write [{strategies!r}]")
    if not isinstance(strategies, Iterable):
        raise ArgumentError(f"strategies must be a list of strategy names, got {strategies!r}")
    names = list(strategies)
    if not names:
        raise ArgumentError("strategies is empty; name at least one strategy, e.g. ['optimal'] "
                            "(tfremat.strategies.strategy_names() lists them)")
    for name in names:
        get_strategy(name)  # an unknown name is refused before any strategy runs
    per_strategy = {}
    options = dict(options)
    bandwidth = options.pop("bandwidth", None)
    for name in names:
        if get_strategy(name).takes_solver_options:
            taken = option_names(get_strategy(name)) or []
            per_strategy[name] = {key: value for key, value in options.items() if key in taken}
        elif get_strategy(name).offloads:
            per_strategy[name] = {"bandwidth": check_bandwidth(bandwidth, name)}
    unknown = sorted(set(options) - {key for chosen in per_strategy.values() for key in chosen})
    if unknown:
        raise ArgumentError(f"option {', '.join(map(repr, unknown))} is taken by no MILP strategy among {names} "
                            f"(the options go to {', '.join(solver_strategy_names())} only)")
    if bandwidth is not None and not any(get_strategy(name).offloads for name in names):
        raise ArgumentError(f"bandwidth is the host link of the offloading strategies "
                            f"({', '.join(offloading_strategy_names())}); none is among {names}")
    for name, chosen in per_strategy.items():
        if not get_strategy(name).takes_solver_options:
            continue
        # Values too, so that a bad one fails before the heuristics run, not after them.
        check_solver_options(chosen.get("solver", DEFAULT_SOLVER), time_limit=chosen.get("time_limit"),
                             mip_gap=chosen.get("mip_gap"), threads=chosen.get("threads"), seed=chosen.get("seed"))
    return names, per_strategy
