"""The user-facing API: plan, compare, fit and max_batch_size.

``plan_graph`` / ``compare_graph`` work on a :class:`~tfremat.graph.DFGraph` and import no
TensorFlow; ``plan``, ``compare``, ``fit`` and ``max_batch_size`` take a Keras model, extract
its graph (:mod:`tfremat.extract`) and import TensorFlow when called.
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

from tfremat.budget import checkpoint_all_peak, format_bytes, parse_budget
from tfremat.cache import ScheduleCache, default_cache_dir
from tfremat.errors import (
    ArgumentError,
    BudgetFormatError,
    InfeasibleBudgetError,
    SolverTimeLimitError,
    TfrematError,
    failure_status,
    is_int,
)
from tfremat.graph import DFGraph
from tfremat.ilp.solvers import DEFAULT_SOLVER, check_solver_options
from tfremat.ilp.strategies import MILP_STRATEGIES
from tfremat.plan.registry import check_options, get_strategy, option_names, strategy_names
from tfremat.plan.schedule import Schedule
from tfremat.plan.simulator import simulate

__all__ = [
    "PlanResult", "plan_graph", "compare_graph", "plan", "compare", "fit", "max_batch_size", "strategy_options",
    "DEFAULT_TIME_LIMIT", "keras_optimizer", "check_cache_argument", "check_keras_model", "failure_status",
    "summary_row",
]

logger = logging.getLogger(__name__)

# Seconds the MILP strategies get from the high-level API when the caller names none: a
# solve without a limit can take hours on a ResNet-sized graph at a tight budget, while
# within 60 s `optimal` proves most budgets optimal and returns the rest with their gap
# (README, "Solvers on the Checkmate graphs").
DEFAULT_TIME_LIMIT = 60.0


def strategy_options(strategy: str, **options) -> dict:
    """The options the high-level API passes to ``strategy``: those given (None means not
    given), and for the MILP strategies ``time_limit=DEFAULT_TIME_LIMIT`` unless one is;
    ``time_limit=math.inf`` asks for no limit (the strategies read it as None: solve until
    proven optimal). Applying it twice changes nothing."""
    options = {k: v for k, v in options.items() if v is not None}
    if strategy in MILP_STRATEGIES:
        options.setdefault("time_limit", DEFAULT_TIME_LIMIT)
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
        overhead: extra compute as a fraction of one plain step (cost / total cost - 1).
        solve_seconds: wall-clock seconds spent choosing the schedule (0 on a cache hit).
        from_cache: the schedule came from the on-disk cache.
        extraction: the model's extraction (graph + side table) when planned from a model.
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

    @property
    def facts(self) -> Mapping:
        """Solver facts: status, objective, best bound, gap, ... (empty for heuristics)."""
        return self.schedule.facts

    def summary(self) -> dict:
        """A JSON-ready one-line summary."""
        return {
            "strategy": self.strategy,
            "status": self.facts.get("status", "feasible"),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "checkpoint_all_peak_bytes": self.checkpoint_all_peak_bytes,
            "overhead": round(self.overhead, 6),
            "recomputations": self.schedule.recompute_count,
            "gap": self.facts.get("gap"),
            "solve_seconds": round(self.solve_seconds, 3),
            "from_cache": self.from_cache,
        }


class _SolverProgress:
    """A one-line progress display of the solver's incumbent, bound and gap on stderr."""

    def __init__(self, label: str):
        self.label = label
        self.shown = False

    def __call__(self, report) -> None:
        parts = [f"{self.label}: {report.seconds:6.1f}s"]
        parts.append(f"incumbent {report.incumbent:.6g}" if report.incumbent is not None else "incumbent -")
        parts.append(f"bound {report.bound:.6g}" if report.bound is not None else "bound -")
        parts.append(f"gap {100 * report.gap:.2f}%" if report.gap is not None else "gap -")
        sys.stderr.write("\r" + " ".join(parts) + "   ")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")


class _BatchProgress:
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
            ("50%" or 0.5), or None for no limit.
        strategy: a registered strategy name (``tfremat.plan.registry.strategy_names()``).
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
    budget_bytes = None if budget is None else parse_budget(budget, reference)
    options = strategy_options(strategy, **options)
    check_options(function, options, f"strategy {strategy!r}")
    cache_options = {k: v for k, v in options.items() if k != "progress"}
    schedule = store.load(graph, budget_bytes, strategy, cache_options) if store else None
    from_cache = schedule is not None
    started = time.perf_counter()
    if schedule is None:
        progress = None
        if strategy in MILP_STRATEGIES and verbose and "progress" not in options:
            progress = _SolverProgress(f"tfremat {strategy}")
            options["progress"] = progress
        try:
            schedule = function(graph, budget_bytes, **options)
        finally:
            if progress is not None:
                progress.close()
        if store:
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
        overhead=result.cost / graph.total_cost - 1 if graph.total_cost else 0.0,
        solve_seconds=seconds,
        from_cache=from_cache,
    )


def _check_graph(graph) -> None:
    """Raises ArgumentError unless ``graph`` is a DFGraph (None failed deep inside the
    simulator with an AttributeError)."""
    if not isinstance(graph, DFGraph):
        raise ArgumentError(f"graph must be a DFGraph (tfremat.load_graph(path), or "
                            f"tfremat.extract.extract(model).graph), got {type(graph).__name__}; a Keras model is "
                            "planned by tfremat.plan / tfremat.compare")


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
    names, per_strategy = _split_milp_options(strategy_names() if strategies is None else strategies, milp_options)
    results: list[PlanResult | InfeasibleBudgetError | SolverTimeLimitError] = []
    for name in names:
        options = per_strategy.get(name, {})
        try:
            results.append(plan_graph(graph, budget, name, cache=cache, verbose=verbose, **options))
        except (InfeasibleBudgetError, SolverTimeLimitError) as exc:
            results.append(exc)
    return results


def _split_milp_options(strategies: Sequence[str], options: Mapping[str, Any]) -> tuple[list[str], dict]:
    """The strategy names, and for each MILP strategy among them the ``options`` it takes
    (``mip_gap`` is for ``optimal`` alone), checked before any strategy runs.

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
                            "(tfremat.plan.registry.strategy_names() lists them)")
    for name in names:
        get_strategy(name)  # an unknown name is refused before any strategy runs
    per_strategy = {}
    for name in names:
        if name in MILP_STRATEGIES:
            taken = option_names(get_strategy(name)) or []
            per_strategy[name] = {key: value for key, value in options.items() if key in taken}
    unknown = sorted(set(options) - {key for chosen in per_strategy.values() for key in chosen})
    if unknown:
        raise ArgumentError(f"option {', '.join(map(repr, unknown))} is taken by no MILP strategy among {names} "
                            f"(the options go to {', '.join(MILP_STRATEGIES)} only)")
    for chosen in per_strategy.values():
        # Values too, so that a bad one fails before the heuristics run, not after them.
        check_solver_options(chosen.get("solver", DEFAULT_SOLVER), time_limit=chosen.get("time_limit"),
                             mip_gap=chosen.get("mip_gap"), threads=chosen.get("threads"), seed=chosen.get("seed"))
    return names, per_strategy


# ----- Keras models -----


def check_keras_model(model) -> None:
    """Raises ArgumentError unless ``model`` is a ``keras.Model`` (None got as far as the
    loss lookup and was told to compile itself)."""
    import keras

    if not isinstance(model, keras.Model):
        hint = "; a DFGraph is planned by tfremat.api.plan_graph / compare_graph" if isinstance(model, DFGraph) else ""
        raise ArgumentError(f"model must be a keras.Model (Functional or Sequential), got {type(model).__name__}{hint}")


def _sample_batch(x, y, batch_size: int | None):
    """One batch (x, y) from arrays or a ``tf.data.Dataset``, for extraction.

    Every input and label array is checked, not x's first alone: a label array shorter
    than the batch reached Keras as a shape error, a Python list as an AttributeError.
    """
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        element = next(iter(x.take(1)))
        if not isinstance(element, (tuple, list)) or len(element) < 2:
            raise TfrematError("a tf.data.Dataset must yield (x, y) batches")
        return element[0], element[1]
    if x is None or y is None:
        raise TfrematError("pass x and y (arrays) or x as a tf.data.Dataset yielding (x, y) batches")
    if batch_size is None:
        raise TfrematError("batch_size is needed with array inputs: it fixes the shapes the schedule is planned for")
    if not is_int(batch_size) or batch_size < 1:
        raise ArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    for argument, data, holds in (("x", x, "inputs"), ("y", y, "outputs")):
        for array in tf.nest.flatten(data):
            shape = getattr(array, "shape", None)
            if shape is None or len(shape) == 0:
                raise ArgumentError(
                    f"{argument} must be arrays with a sample axis (NumPy arrays or tensors, a list or dict of them "
                    f"for several model {holds}), got a {type(data).__name__} holding a {type(array).__name__}; "
                    f"convert it with np.asarray({argument}), or pass x as a tf.data.Dataset of (x, y) batches"
                )
            samples = int(shape[0])
            if samples < batch_size:
                raise ArgumentError(
                    f"{argument} has {samples} samples (an array of shape {tuple(shape)}), fewer than "
                    f"batch_size={batch_size}: the schedule is planned for one full batch; pass at least that many "
                    "samples or a smaller batch_size"
                )
    take = lambda a: tf.nest.map_structure(lambda t: t[:batch_size], a)  # noqa: E731
    return take(x), take(y)


def _loss_and_optimizer(model, loss, optimizer) -> dict:
    """``extract``'s loss, loss_weights and optimizer arguments: those given, else the
    compiled model's (its ``loss_weights`` come with its loss only); an optimizer name
    becomes a new Keras optimizer, as ``model.compile`` makes one."""
    loss_weights = None
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is not None and getattr(model, "compiled", False):
            # get_compile_config serializes the whole config, and warns of a lambda loss
            # while doing so; only the weights are read here.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                loss_weights = (model.get_compile_config() or {}).get("loss_weights")
    if loss is None:
        raise TfrematError("no loss: compile the model or pass loss=")
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if isinstance(optimizer, str):
        optimizer = keras_optimizer(optimizer, "optimizer")
    return {"loss": loss, "loss_weights": loss_weights, "optimizer": optimizer}


def keras_optimizer(name: str, argument: str):
    """A new Keras optimizer from its name, as ``model.compile`` makes one.

    Raises:
        ArgumentError: not a Keras optimizer name; the message names ``argument``.
    """
    import keras

    try:
        return keras.optimizers.get(name)
    except ValueError as err:
        raise ArgumentError(f"{argument}={name!r} is not a Keras optimizer name ({err}); pass a keras.optimizers "
                            "object or a name such as 'sgd' or 'adam'") from None


def plan(
    model,
    budget,
    x=None,
    y=None,
    *,
    batch_size: int | None = None,
    loss=None,
    optimizer=None,
    strategy: str = "optimal",
    cost_model: str = "profile",
    cache: bool | str | ScheduleCache = True,
    verbose: int = 1,
    **options,
) -> PlanResult:
    """Extracts ``model``'s training graph and chooses a schedule, without training.

    Args:
        model: a built Keras Functional or Sequential model.
        budget: see :func:`plan_graph`; relative budgets refer to this batch's checkpoint-all peak.
        x, y: data (arrays with ``batch_size``, or a ``tf.data.Dataset`` of batches) whose
            first batch fixes the shapes.
        loss, optimizer: default to the model's compiled ones.
        strategy: the strategy name.
        cost_model: "profile" (timed on this device) or "flops".
        **options: strategy options (``time_limit``, ``solver``, ...).

    Returns:
        A :class:`PlanResult` whose ``extraction`` holds the graph and side table.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, data that are no arrays, fewer
            samples in x or y than ``batch_size``, or an argument of :func:`plan_graph`.
    """
    from tfremat.extract.extractor import extract

    # The arguments that need no graph are checked before the extraction, which takes
    # seconds to minutes.
    check_keras_model(model)
    get_strategy(strategy)
    check_cache_argument(cache)
    training = _loss_and_optimizer(model, loss, optimizer)
    batch = _sample_batch(x, y, batch_size)
    extraction = extract(model, sample_batch=batch, cost_model=cost_model, **training)
    result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **options)
    return dataclasses.replace(result, extraction=extraction)


def compare(model, budget, x=None, y=None, *, strategies: Sequence[str] | None = None, batch_size=None,
            loss=None, optimizer=None, cost_model: str = "profile", cache=True, verbose: int = 1, **milp_options):
    """:func:`compare_graph` for a Keras model (extracts once, plans with every strategy)."""
    from tfremat.extract.extractor import extract

    # As plan does, the arguments that need no graph are checked before the extraction.
    check_keras_model(model)
    _split_milp_options(strategy_names() if strategies is None else strategies, milp_options)
    check_cache_argument(cache)
    training = _loss_and_optimizer(model, loss, optimizer)
    batch = _sample_batch(x, y, batch_size)
    extraction = extract(model, sample_batch=batch, cost_model=cost_model, **training)
    return compare_graph(extraction.graph, budget, strategies, cache=cache, verbose=verbose, **milp_options)


def fit(
    model,
    budget,
    x=None,
    y=None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    validation_data=None,
    callbacks=None,
    strategy: str = "optimal",
    solver: str | None = None,
    time_limit: float | None = None,
    cost_model: str = "profile",
    cache: bool | str | ScheduleCache = True,
    allocator_check: bool | None = None,
    verbose: int = 1,
    **fit_kwargs,
):
    """Trains ``model`` like ``model.fit``, with every step following a schedule under ``budget``.

    Extracts the graph for each batch shape met, plans it with ``strategy`` and compiles the
    schedule into a ``tf.function`` step (:class:`tfremat.keras.RematCallback` does the
    work, so ``model.fit(..., callbacks=[RematCallback(...)])`` is the same thing).
    The model must be compiled (loss, optimizer, metrics are taken from it). The MILP
    strategies get ``time_limit`` seconds per batch shape (60 unless given; ``math.inf``
    solves until proven optimal); the schedule's facts say whether it was proven.

    Args:
        budget: bytes, a string with a unit ("3.5GiB") or a share of each batch shape's
            checkpoint-all peak ("50%" or 0.5). Required: unlike :func:`plan`, fit refuses
            None (no limit), whose schedule keeps every activation, which is the step
            ``model.fit`` runs already, here after an extraction and profiling that buy
            nothing; train without a limit with ``model.fit``.
        allocator_check: hold the budget for the device allocator's peak, not only for
            the bytes the step requests; None: for amounts of memory, not for shares
            (see :class:`tfremat.keras.RematCallback`).

    Returns:
        The Keras ``History``.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, or ``budget`` is None.
        TfrematError: the model is not compiled.
    """
    import keras

    from tfremat.keras import RematCallback

    check_keras_model(model)
    if budget is None:
        raise ArgumentError("budget=None: tfremat.fit needs a budget (bytes, '3.5GiB' or '50%'); without one every "
                            "activation is kept, which is model.fit's own step: call model.fit to train without a limit")
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise TfrematError("compile the model first (model.compile(optimizer=..., loss=..., metrics=...)); fit uses its loss, optimizer and metrics")
    remat = RematCallback(budget, strategy=strategy, solver=solver, time_limit=time_limit, cost_model=cost_model,
                          cache=cache, allocator_check=allocator_check, verbose=verbose)
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]  # model.fit takes one callback as well as a list
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, validation_data=validation_data,
                     callbacks=[remat, *(callbacks or [])], verbose=verbose, **fit_kwargs)


def max_batch_size(
    model,
    budget,
    *,
    strategies: Sequence[str] = ("optimal",),
    max_overhead: float | None = None,
    loss=None,
    optimizer=None,
    min_batch: int = 1,
    max_batch: int = 4096,
    cost_model: str = "profile",
    verbose: int = 1,
    **options,
) -> dict[str, Any]:
    """The largest batch that trains within ``budget``, per strategy.

    Checkmate's criterion by default: the schedule may cost at most one extra forward
    pass; ``max_overhead`` (e.g. 0.3 for 30%) sets another cap. The graph is extracted at
    each batch size tried; the default "profile" cost model measures each node's workspace
    (on CPU a convolution's gradient can need tens of MiB of scratch), which "flops" leaves
    at zero, so keep "profile" when the answer must fit.

    Args:
        model: a Keras model whose inputs have static shapes apart from the batch.
        budget: bytes or a string with a unit; a relative budget is refused (no batch to refer to).
        strategies: strategy names to search with (an empty list is refused, as by
            :func:`compare_graph`).
        loss, optimizer: default to the model's compiled ones; the labels the graphs are
            extracted with fit the loss (class ids for a sparse one,
            :func:`tfremat.measure.synthetic_batch`).
        min_batch, max_batch: the batch sizes searched. When ``max_batch`` itself fits,
            the result's ``reached_max_batch`` is True and a warning is logged: the
            largest batch may be larger.
        verbose: 0 silences the line written to stderr for each batch size tried (also
            logged at INFO on ``tfremat.ilp.maxbatch``).
        **options: MILP options (``time_limit`` per batch solve, 60 s unless given,
            ``math.inf`` for none; ``solver``, ...), see :func:`strategy_options`.

    Returns:
        ``{strategy: tfremat.ilp.MaxBatchResult}``.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, ``strategies`` is empty or names
            an unknown strategy, or ``min_batch`` / ``max_batch`` are no ints with
            1 <= min_batch <= max_batch (all before any extraction).
        BudgetFormatError: a relative or unparsable budget.
        InfeasibleBudgetError: even ``min_batch`` does not fit.
    """
    from tfremat.extract.extractor import extract
    from tfremat.ilp.maxbatch import max_batch_size as search
    from tfremat.measure import synthetic_batch

    check_keras_model(model)
    if isinstance(budget, float) and budget <= 1 or isinstance(budget, str) and budget.strip().endswith("%"):
        raise BudgetFormatError(f"budget={budget!r}: max_batch_size needs an absolute budget (bytes or '3GiB'), not a share")
    budget_bytes = parse_budget(budget)
    names, per_strategy = _split_milp_options(strategies, options)
    training = _loss_and_optimizer(model, loss, optimizer)
    graphs: dict[int, DFGraph] = {}

    def graph_for_batch(batch: int) -> DFGraph:
        if batch not in graphs:
            # Zero-cost arrays of the batch's shapes, labels shaped for the loss: extraction
            # reads nothing else, and a batch of thousands of images would be gigabytes.
            sample = synthetic_batch(model, batch, loss=training["loss"])
            graphs[batch] = extract(model, sample_batch=sample, cost_model=cost_model, **training).graph
            logger.info("batch %d: checkpoint-all peak %s", batch, format_bytes(checkpoint_all_peak(graphs[batch])))
        return graphs[batch]

    results = {}
    for name in names:
        results[name] = search(graph_for_batch, budget_bytes, strategy=name, max_overhead=max_overhead,
                               min_batch=min_batch, max_batch=max_batch,
                               batch_progress=_BatchProgress(f"tfremat max_batch_size {name}") if verbose else None,
                               **(strategy_options(name, **per_strategy[name]) if name in per_strategy else {}))
    return results

