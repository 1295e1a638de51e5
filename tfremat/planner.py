"""Planning, shared by every user-facing entry point: a graph or a Keras model, a budget, a
strategy -> a :class:`PlanResult`.

``plan_graph`` / ``compare_graph`` work on a :class:`~tfremat.graph.DFGraph` and import no
TensorFlow; ``plan_model`` extracts a Keras model's graph first (:mod:`tfremat.extract`). The
checks of user arguments that :func:`tfremat.fit`, :class:`tfremat.keras.RematCallback`,
:func:`tfremat.measure.measure_model` and the command line share live here too, as does
:func:`synthetic_batch`, the made-up batch they extract and measure with.
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

from tfremat.budget import MIN_BUDGET, budget_kind, format_bytes
from tfremat.cache import ScheduleCache, default_cache_dir
from tfremat.errors import (
    ArgumentError,
    InfeasibleBudgetError,
    SolverTimeLimitError,
    TfrematError,
    failure_status,
    is_int,
)
from tfremat.graph import DFGraph
from tfremat.ilp.solvers import DEFAULT_SOLVER, check_solver_options
from tfremat.plan.registry import check_options, option_names, parse_graph_budget
from tfremat.plan.schedule import Schedule, SolverFacts
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import (
    get_strategy,
    least_peak,
    solver_strategy_names,
    strategy_names,
)

__all__ = [
    "PlanResult", "plan_graph", "compare_graph", "plan_model", "strategy_options", "DEFAULT_TIME_LIMIT",
    "keras_optimizer", "check_cache_argument", "check_keras_model", "split_solver_options", "summary_row",
    "sample_batch", "check_batch_ranks", "loss_and_optimizer", "synthetic_batch", "BatchProgress",
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
    if get_strategy(strategy).takes_solver_options:
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
    def facts(self) -> SolverFacts | None:
        """What the solver proved (status, objective, best bound, gap, ...); None for heuristics."""
        return self.schedule.facts

    def summary(self) -> dict:
        """A JSON-ready one-line summary."""
        return {
            "strategy": self.strategy,
            "status": self.facts.status if self.facts is not None else "feasible",
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "checkpoint_all_peak_bytes": self.checkpoint_all_peak_bytes,
            "overhead": round(self.overhead, 6),
            "recomputations": self.schedule.recompute_count,
            "gap": self.facts.gap if self.facts is not None else None,
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
            activations"), "min" (the least peak any heuristic reaches, :func:`least_peak`),
            or None for no limit.
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
    budget = resolve_min_budget(graph, budget)
    budget_bytes = parse_graph_budget(graph, budget)
    options = strategy_options(strategy, **options)
    check_options(function, options, f"strategy {strategy!r}")
    cache_options = {k: v for k, v in options.items() if k != "progress"}
    schedule = store.load(graph, budget_bytes, strategy, cache_options) if store else None
    from_cache = schedule is not None
    started = time.perf_counter()
    if schedule is None:
        progress = None
        if get_strategy(strategy).takes_solver_options and verbose and "progress" not in options:
            progress = _SolverProgress(f"tfremat {strategy}")
            options["progress"] = progress
        try:
            schedule = function(graph, budget, **options)
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
        overhead=result.cost / graph.total_cost - 1 if graph.total_cost else 0.0,
        solve_seconds=seconds,
        from_cache=from_cache,
    )


def resolve_min_budget(graph: DFGraph, budget):
    """``budget``, with ``"min"`` replaced by the bytes of :func:`least_peak` (logged)."""
    if budget is None or budget_kind(budget) != MIN_BUDGET:
        return budget
    least = least_peak(graph)
    logger.info("budget 'min': %s, the least peak a heuristic reaches on %s", format_bytes(least), graph.name)
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
    names, per_strategy = split_solver_options(strategy_names() if strategies is None else strategies, milp_options)
    budget = resolve_min_budget(graph, budget)  # once for every strategy
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
                            "(tfremat.strategies.strategy_names() lists them)")
    for name in names:
        get_strategy(name)  # an unknown name is refused before any strategy runs
    per_strategy = {}
    for name in names:
        if get_strategy(name).takes_solver_options:
            taken = option_names(get_strategy(name)) or []
            per_strategy[name] = {key: value for key, value in options.items() if key in taken}
    unknown = sorted(set(options) - {key for chosen in per_strategy.values() for key in chosen})
    if unknown:
        raise ArgumentError(f"option {', '.join(map(repr, unknown))} is taken by no MILP strategy among {names} "
                            f"(the options go to {', '.join(solver_strategy_names())} only)")
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
        hint = "; a DFGraph is planned by tfremat.planner.plan_graph / compare_graph" if isinstance(model, DFGraph) else ""
        raise ArgumentError(f"model must be a keras.Model (Functional or Sequential), got {type(model).__name__}{hint}")


def sample_batch(x, y, batch_size: int | None):
    """One batch (x, y) from arrays or a ``tf.data.Dataset``, for extraction.

    Every input and label array is checked, not x's first alone: a label array shorter
    than the batch reached Keras as a shape error, a Python list as an AttributeError.
    """
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        element = next(iter(x.take(1)))
        if not isinstance(element, (tuple, list)) or len(element) < 2:
            raise ArgumentError("x: a tf.data.Dataset must yield (x, y) batches")
        return element[0], element[1]
    if x is None or y is None:
        raise ArgumentError(f"{'x' if x is None else 'y'}=None: pass x and y (arrays), or x as a tf.data.Dataset "
                            "yielding (x, y) batches")
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


def check_batch_ranks(model, x) -> None:
    """Raises ArgumentError when the batch ``x`` (from :func:`sample_batch`) lacks the batch
    axis of ``model``'s inputs: an unbatched ``tf.data.Dataset`` yields single samples, whose
    first axis would otherwise be taken for the batch."""
    import tensorflow as tf

    for tensor, spec in zip(tf.nest.flatten(x), model.inputs):
        if len(tensor.shape) == len(spec.shape) - 1:
            raise ArgumentError(
                f"x holds single samples of shape {tuple(tensor.shape)} where the model takes batches of shape "
                f"{tuple(spec.shape)}: batch the dataset (dataset.batch(batch_size)) before passing it"
            )


def loss_and_optimizer(model, loss, optimizer) -> dict:
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


def plan_model(
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
        cache: the schedule cache, as for :func:`plan_graph`; False (or None) also turns
            off the extraction's profile cache (nothing read from or written to disk).
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
    training = loss_and_optimizer(model, loss, optimizer)
    batch = sample_batch(x, y, batch_size)
    check_batch_ranks(model, batch[0])
    # cache=False (or None) turns the profile cache off as well as the schedule cache.
    extraction = extract(model, sample_batch=batch, cost_model=cost_model,
                         use_cache=cache is not False and cache is not None, **training)
    result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **options)
    return dataclasses.replace(result, extraction=extraction)


# Losses, by normalized name (lower case, no underscores), whose labels are not a
# distribution over the output's last axis. Any other loss, a custom one included, gets
# one-hot labels shaped like the output (what every loss was given before, and values in
# [0, 1] that any loss reads).
_BINARY_LOSSES = ("hinge", "squaredhinge")
_REAL_LOSSES = (
    "meansquarederror", "meanabsoluteerror", "meanabsolutepercentageerror", "meansquaredlogarithmicerror", "huber",
    "logcosh", "cosinesimilarity", "poisson",
)


def _label_kind(loss) -> str:
    """What labels ``loss`` reads: "sparse" (integer class ids, without the class axis),
    "binary" (0 or 1 per output value), "real" (any real value, a regression) or
    "categorical" (one-hot along the last axis)."""
    import keras

    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)  # an alias ("mse", "bce") resolves to its function
        except ValueError:
            pass  # an unknown name, which extraction refuses naming it
    # A Keras loss object wraps its function as ``fn``; a function has a name; a custom
    # Loss subclass has its class name.
    function = getattr(loss, "fn", loss)
    name = function if isinstance(function, str) else getattr(function, "__name__", type(function).__name__)
    name = name.lower().replace("_", "")
    if "sparse" in name:
        return "sparse"
    if "binary" in name or name in _BINARY_LOSSES:
        return "binary"
    if name in _REAL_LOSSES:
        return "real"
    return "categorical"


def synthetic_batch(model, batch_size: int, *, loss="categorical_crossentropy", seed: int | None = None):
    """A batch ``(x, y)`` of NumPy arrays for ``model`` whose labels fit ``loss``.

    One place for the labels that :func:`tfremat.measure.measure_model`, the command line and
    :func:`tfremat.max_batch_size` make up (they were one-hot for every loss, which a sparse
    loss refuses with a rank error): integer class ids without the class axis for sparse
    losses, one-hot for categorical ones, 0/1 for binary cross-entropy and the hinge losses,
    real values for regression losses (mse, mae, huber, ...), one-hot for any other.

    Args:
        model: a Keras model with static shapes apart from the batch.
        batch_size: the batch size.
        loss: as ``model.compile`` takes it: a name, a Keras loss or function, or a list or
            dict of them by output (an output without a loss gets one-hot labels).
        seed: an int for random values (inputs from a standard normal), to run a step
            on; None for zeros that take no memory (broadcast views), all an extraction
            reads being shapes and dtypes.

    Returns:
        ``(x, y)``: an array each, or lists of them for several inputs or outputs.
    """
    import numpy as np

    from tfremat.extract.layer_graph import model_output_names, require_functional
    from tfremat.extract.losses import per_output

    require_functional(model)
    rng = None if seed is None else np.random.default_rng(seed)

    def array(shape, dtype, draw):
        if rng is None:
            return np.broadcast_to(np.zeros((), dtype), shape)
        return np.asarray(draw(rng, shape), dtype=dtype)

    xs = [array((batch_size, *t.shape[1:]), t.dtype, lambda r, shape: r.standard_normal(shape)) for t in model.inputs]
    ys = []
    for output, output_loss in zip(model.outputs, per_output(loss, model_output_names(model), "loss", None)):
        shape, classes = (batch_size, *output.shape[1:]), output.shape[-1]
        kind = _label_kind(output_loss)
        if kind == "sparse":
            ys.append(array(shape[:-1], "int32", lambda r, shape: r.integers(0, classes, size=shape)))
        elif kind == "binary":
            ys.append(array(shape, "float32", lambda r, shape: r.integers(0, 2, size=shape)))
        elif kind == "real":
            ys.append(array(shape, "float32", lambda r, shape: r.standard_normal(shape)))
        else:
            ys.append(array(shape, "float32",
                            lambda r, shape: np.eye(classes)[r.integers(0, classes, size=shape[:-1])]))
    unpack = lambda items: items[0] if len(items) == 1 else items  # noqa: E731
    return unpack(xs), unpack(ys)
