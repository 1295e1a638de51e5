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
from collections.abc import Mapping, Sequence
from typing import Any

from tfremat.budget import checkpoint_all_peak, format_bytes, parse_budget
from tfremat.cache import ScheduleCache
from tfremat.errors import ArgumentError, BudgetFormatError, InfeasibleBudgetError, TfrematError, is_int
from tfremat.graph import DFGraph
from tfremat.ilp.solvers import DEFAULT_SOLVER, check_solver_options
from tfremat.ilp.strategies import MILP_STRATEGIES
from tfremat.plan.registry import check_options, get_strategy, option_names, strategy_names
from tfremat.plan.schedule import Schedule
from tfremat.plan.simulator import simulate

__all__ = [
    "PlanResult", "plan_graph", "compare_graph", "plan", "compare", "fit", "max_batch_size", "strategy_options",
    "DEFAULT_TIME_LIMIT", "keras_optimizer",
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
        BudgetFormatError: the budget is unparsable.
        ArgumentError: an option the strategy does not take (raised before anything runs).
    """
    reference = checkpoint_all_peak(graph)
    budget_bytes = None if budget is None else parse_budget(budget, reference)
    function = get_strategy(strategy)
    store = _cache_of(cache)
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


def _cache_of(cache) -> ScheduleCache | None:
    if cache is False or cache is None:
        return None
    if cache is True:
        return ScheduleCache()
    if isinstance(cache, ScheduleCache):
        return cache
    if not isinstance(cache, (str, os.PathLike)):
        raise TypeError(f"cache must be True, False, a directory path or a ScheduleCache, got {cache!r}")
    return ScheduleCache(cache)


def compare_graph(
    graph: DFGraph,
    budget,
    strategies: Sequence[str] | None = None,
    *,
    cache: bool | str | ScheduleCache = True,
    verbose: int = 1,
    **milp_options,
) -> list[PlanResult | InfeasibleBudgetError]:
    """Plans ``graph`` with every strategy (or the given ones) at one budget.

    Returns one entry per strategy, in order: its :class:`PlanResult`, or the
    :class:`InfeasibleBudgetError` it raised. ``milp_options`` go to the MILP strategies
    only, each getting those it takes (``mip_gap`` goes to ``optimal`` alone).

    Raises:
        ArgumentError: ``strategies`` is not a list of names, or an option no MILP
            strategy in the list takes (checked before any strategy runs).
    """
    names, per_strategy = _split_milp_options(strategies or strategy_names(), milp_options)
    results: list[PlanResult | InfeasibleBudgetError] = []
    for name in names:
        options = per_strategy.get(name, {})
        try:
            results.append(plan_graph(graph, budget, name, cache=cache, verbose=verbose, **options))
        except InfeasibleBudgetError as exc:
            results.append(exc)
    return results


def _split_milp_options(strategies: Sequence[str], options: Mapping[str, Any]) -> tuple[list[str], dict]:
    """The strategy names, and for each MILP strategy among them the ``options`` it takes
    (``mip_gap`` is for ``optimal`` alone), checked before any strategy runs.

    Raises:
        ArgumentError: ``strategies`` is a string, or an option no MILP strategy among them takes.
        SolverError: a solver option out of range.
    """
    if isinstance(strategies, str):
        raise ArgumentError(f"strategies must be a list of strategy names, got the string {strategies!r}; "
                            f"write [{strategies!r}]")
    names = list(strategies)
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


def _sample_batch(x, y, batch_size: int | None):
    """One batch (x, y) from arrays or a ``tf.data.Dataset``, for extraction."""
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
    samples = int(tf.nest.flatten(x)[0].shape[0])
    if samples < batch_size:
        raise ArgumentError(f"x has {samples} samples, fewer than batch_size={batch_size}: the schedule is planned "
                            "for one full batch; pass at least that many samples or a smaller batch_size")
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
    """
    from tfremat.extract.extractor import extract

    training = _loss_and_optimizer(model, loss, optimizer)
    batch = _sample_batch(x, y, batch_size)
    extraction = extract(model, sample_batch=batch, cost_model=cost_model, **training)
    result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **options)
    return dataclasses.replace(result, extraction=extraction)


def compare(model, budget, x=None, y=None, *, strategies: Sequence[str] | None = None, batch_size=None,
            loss=None, optimizer=None, cost_model: str = "profile", cache=True, verbose: int = 1, **milp_options):
    """:func:`compare_graph` for a Keras model (extracts once, plans with every strategy)."""
    from tfremat.extract.extractor import extract

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

    Returns:
        The Keras ``History``.
    """
    import keras

    from tfremat.keras import RematCallback

    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise TfrematError("compile the model first (model.compile(optimizer=..., loss=..., metrics=...)); fit uses its loss, optimizer and metrics")
    remat = RematCallback(budget, strategy=strategy, solver=solver, time_limit=time_limit, cost_model=cost_model,
                          cache=cache, verbose=verbose)
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
        strategies: strategy names to search with.
        **options: MILP options (``time_limit`` per batch solve, 60 s unless given,
            ``math.inf`` for none; ``solver``, ...), see :func:`strategy_options`.

    Returns:
        ``{strategy: tfremat.ilp.MaxBatchResult}``.
    """
    import tensorflow as tf

    from tfremat.extract.extractor import extract
    from tfremat.ilp.maxbatch import max_batch_size as search

    if isinstance(budget, float) and budget <= 1 or isinstance(budget, str) and budget.strip().endswith("%"):
        raise BudgetFormatError(f"budget={budget!r}: max_batch_size needs an absolute budget (bytes or '3GiB'), not a share")
    budget_bytes = parse_budget(budget)
    training = _loss_and_optimizer(model, loss, optimizer)
    graphs: dict[int, DFGraph] = {}

    def graph_for_batch(batch: int) -> DFGraph:
        if batch not in graphs:
            signature = [tf.TensorSpec((batch, *t.shape[1:]), t.dtype) for t in model.inputs]
            graphs[batch] = extract(model, input_signature=signature, cost_model=cost_model, **training).graph
            logger.info("batch %d: checkpoint-all peak %s", batch, format_bytes(checkpoint_all_peak(graphs[batch])))
        return graphs[batch]

    names, per_strategy = _split_milp_options(strategies, options)
    results = {}
    for name in names:
        results[name] = search(graph_for_batch, budget_bytes, strategy=name, max_overhead=max_overhead,
                               min_batch=min_batch, max_batch=max_batch,
                               **(strategy_options(name, **per_strategy[name]) if name in per_strategy else {}))
    return results
