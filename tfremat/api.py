"""The user-facing API on Keras models: fit, compare and max_batch_size (and plan_model,
from :mod:`tfremat.planner`).

Each extracts the model's graph (:mod:`tfremat.extract`) and imports TensorFlow when called.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from tfremat.budget import budget_kind, format_bytes, parse_budget
from tfremat.cache import ScheduleCache
from tfremat.errors import ArgumentError, BudgetFormatError, TfrematError
from tfremat.graph import DFGraph
from tfremat.model_planning import (
    check_keras_model,
    extract_model,
    loss_and_optimizer,
    plan_model,
    wants_implementations,
)
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import (
    BatchProgress,
    PlanResult,
    check_cache_argument,
    compare_graph,
    split_solver_options,
    strategy_options,
)
from tfremat.runtime.host_link import host_link_bandwidth
from tfremat.strategies import get_strategy, offloading_strategy_names, strategy_names

__all__ = ["plan_model", "compare", "fit", "max_batch_size", "PlanResult"]

logger = logging.getLogger(__name__)


def compare(model, budget, x=None, y=None, *, strategies: Sequence[str] | None = None, batch_size=None,
            loss=None, optimizer=None, cost_model: str = "profile", granularity: str = "sublayer", cache=True,
            verbose: int = 1, **milp_options):
    """:func:`compare_graph` for a Keras model (extracts once, plans with every strategy).

    The offloading strategies take part when a host link exists: ``bandwidth=`` (bytes per
    second), or, without it and with profiled costs, the link measured on the GPU
    (:func:`~tfremat.runtime.host_link.host_link_bandwidth`); on a machine without a GPU and
    without ``bandwidth`` they are left out.

    Args:
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
    """
    # As plan_model does, the arguments that need no graph are checked before the extraction.
    check_keras_model(model)
    wants_link = strategies is None or (not isinstance(strategies, str) and isinstance(strategies, Sequence)
                                        and bool(set(offloading_strategy_names()) & set(map(str, strategies))))
    if "bandwidth" not in milp_options and cost_model == "profile" and wants_link:
        measured = host_link_bandwidth()
        if measured is not None:
            milp_options["bandwidth"] = measured
    every = strategy_names(offloading="bandwidth" in milp_options)
    names, _ = split_solver_options(every if strategies is None else strategies, milp_options)
    extraction = extract_model(model, x, y, batch_size=batch_size, loss=loss, optimizer=optimizer,
                               cost_model=cost_model, cache=cache, granularity=granularity,
                               implementations=wants_implementations(names))
    results = compare_graph(extraction.graph, budget, strategies, cache=cache, verbose=verbose, **milp_options)
    # The extraction on each plan, as plan_model leaves it: its plain overlap is in the predicted time.
    return [dataclasses.replace(r, extraction=extraction) if isinstance(r, PlanResult) else r for r in results]


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
    granularity: str = "sublayer",
    cache: bool | str | ScheduleCache = True,
    allocator_check: bool | None = None,
    verbose: int = 1,
    bandwidth: float | None = None,
    exact_gradients: bool = False,
    **fit_kwargs,
):
    """Trains ``model`` like ``model.fit``, with every step following a schedule under ``budget``.

    Extracts the graph for each batch shape met, plans it with ``strategy`` and compiles the
    schedule into a ``tf.function`` step (:class:`tfremat.keras.RematCallback` does the
    work, so ``model.fit(..., callbacks=[RematCallback(...)])`` is the same thing).
    The model must be compiled (loss, optimizer, metrics are taken from it). The MILP
    strategies get ``time_limit`` seconds per batch shape (60 unless given; ``math.inf``
    solves until proven optimal), ``optimal`` less once 5 s of search (CPU time) find nothing cheaper
    (docs/solver.md); the schedule's facts say whether it was proven.

    Args:
        budget: bytes, a string with a unit ("3.5GiB") or a share of each batch shape's
            checkpoint-all peak ("50%" or 0.5). Required: unlike :func:`plan`, fit refuses
            None (no limit), whose schedule keeps every activation, which is the step
            ``model.fit`` runs already, here after an extraction and profiling that buy
            nothing; train without a limit with ``model.fit``.
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        allocator_check: hold the budget for the device allocator's peak, not only for
            the bytes the step requests; None: for every budget but ``"min"`` and shares at
            or above the checkpoint-all peak (see :class:`tfremat.keras.RematCallback`); under
            ``MultiWorkerMirroredStrategy``, None checks GPU replicas only (a CPU worker's
            input pipeline shares its allocator).
        bandwidth: the host link, in bytes per second, for a strategy that offloads
            activations to host memory (``pofo``, ``pofo_ap``, ``autocapper``,
            ``opportunist``); None measures it on a GPU (required without one); refused for
            the other strategies.
        exact_gradients: ``monet`` chooses only layer implementations that round gradients
            as the layer's own does (see :class:`tfremat.keras.RematCallback`).

    Returns:
        The Keras ``History``, with the plans it trained with as ``history.plans``
        (``{batch shapes: PlanResult}``, as :attr:`RematCallback.plans`).

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, or ``budget`` is None.
        TfrematError: the model is not compiled.
        ExtractionError: the model overrides ``train_step``, ``compute_loss`` or ``call``, or
            adds losses (checked first: such a model is often compiled without a loss).
    """
    import keras

    from tfremat.extract.checks import refuse_unmodelled_training
    from tfremat.keras import RematCallback

    check_keras_model(model)
    if budget is None:
        raise ArgumentError("budget=None: tfremat.fit needs a budget (bytes, '3.5GiB' or '50%'); without one every "
                            "activation is kept, which is model.fit's own step: call model.fit to train without a limit")
    # A train_step override (keras.io's VAE, GAN) is compiled without a loss and trains without
    # labels: its refusal names the way in (value_and_grad), which the checks below would hide.
    refuse_unmodelled_training(model)
    if y is None and x is not None and all(hasattr(a, "shape") for a in _flat(x)):
        raise ArgumentError("y=None: tfremat.fit trains on labelled batches; pass y with the arrays x, or x as a "
                            "tf.data.Dataset yielding (x, y) batches")
    if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
        raise TfrematError("compile the model first (model.compile(optimizer=..., loss=..., metrics=...)); fit uses its loss, optimizer and metrics")
    remat = RematCallback(budget, strategy=strategy, solver=solver, time_limit=time_limit, bandwidth=bandwidth,
                          cost_model=cost_model,
                          granularity=granularity, cache=cache, allocator_check=allocator_check, verbose=verbose,
                          exact_gradients=exact_gradients)
    if _multi_worker_strategy(model) is not None:
        from tfremat.multi_worker import fit_multi_worker

        # The strategy options RematCallback plans with (its arguments checked when it was built).
        options = {"solver": solver, "time_limit": time_limit} if get_strategy(strategy).takes_solver_options else {}
        if get_strategy(strategy).offloads:
            options["bandwidth"] = remat.bandwidth
        return fit_multi_worker(model, budget, x, y, batch_size=batch_size, epochs=epochs,
                                validation_data=validation_data, callbacks=callbacks, strategy=strategy,
                                options=options, cost_model=cost_model,
                                granularity=granularity, cache=cache, verbose=verbose,
                                allocator_check=allocator_check, exact_gradients=exact_gradients, **fit_kwargs)
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]  # model.fit takes one callback as well as a list
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, validation_data=validation_data,
                        callbacks=[remat, *(callbacks or [])], verbose=verbose, **fit_kwargs)
    history.plans = dict(remat.plans)
    return history


def _multi_worker_strategy(model):
    """The model's ``MultiWorkerMirroredStrategy``, or None when it trains otherwise.

    Raises:
        TfrematError: such a strategy is active but the model was not built in its scope.
    """
    import tensorflow as tf

    from tfremat.multi_worker import is_multi_worker

    if is_multi_worker(model.distribute_strategy):
        return model.distribute_strategy
    if tf.distribute.has_strategy() and is_multi_worker(tf.distribute.get_strategy()):
        raise TfrematError("the model was built outside the active MultiWorkerMirroredStrategy's scope: build and "
                           "compile it inside `with strategy.scope():`, then call tfremat.fit")
    return None


def _flat(data) -> list:
    """The arrays of ``x`` as Keras takes it: one array, or a list, tuple or dict of them."""
    if isinstance(data, dict):
        return list(data.values())
    return list(data) if isinstance(data, (list, tuple)) else [data]


def max_batch_size(
    model,
    budget,
    x=None,
    y=None,
    *,
    strategies: Sequence[str] = ("optimal",),
    max_overhead: float | None = None,
    loss=None,
    optimizer=None,
    min_batch: int = 1,
    max_batch: int = 4096,
    method: str = "scaled",
    cost_model: str = "profile",
    granularity: str = "sublayer",
    cache=True,
    allocator_check: bool = True,
    verbose: int = 1,
    **options,
) -> dict[str, Any]:
    """The largest batch that trains within ``budget``, per strategy.

    Checkmate's criterion by default: the schedule may cost at most one extra forward
    pass; ``max_overhead`` (e.g. 0.3 for 30%) sets another cap. By default
    (``method="scaled"``) the graph is extracted at twice and four times the smallest
    batch and every other batch is judged on graphs scaled from those; the answer is then
    extracted and certified on its own graph, or a smaller batch is
    (:func:`tfremat.maxbatch.max_batch_size`): with ``"profile"`` that extraction measures
    the bytes only (``extract(..., timing=False)``, about half a profile's time) and takes
    its costs from the line through the two profiled graphs; ``"search"`` extracts every
    batch size tried. The default "profile" cost model measures each node's workspace (on CPU a
    convolution's gradient can need tens of MiB of scratch), which "flops" leaves at zero,
    so keep "profile" when the answer must fit.

    That answer holds the budget for the bytes its step is predicted to request. With
    ``allocator_check`` (the default) it is then held for the device allocator's peak, which
    BFC's whole chunks put above those bytes, as :func:`fit` holds it by default: the answer's
    graph is extracted (profiled), planned as ``fit`` plans it, its step compiled and run and
    held to the budget by ``fit``'s check (planning again under the allocator's excess), and
    where no plan within the overhead cap holds, smaller batches are tried until one does
    (:func:`tfremat.maxbatch.hold_on_allocator`). The allocator's peak depends on the state of
    its free chunks, so ``fit`` at the answer can still read its step a little higher and
    refuse it, naming a budget a few percent larger (``benchmarks/maxbatch_allocator.py``).

    Args:
        model: a Keras model whose inputs have static shapes apart from the batch.
        budget: bytes or a string with a unit; a relative budget is refused (no batch to refer to).
        x: a sample of the training inputs (an array, a list or dict of arrays by input, or
            a ``tf.data.Dataset`` yielding ``(x, y)`` batches, whose first batch is taken),
            repeated or cut to each batch size tried: integer and string inputs are
            profiled on its values, so a ``StringLookup`` or ``IntegerLookup`` without an
            OOV index, or an ``Embedding``, gets ids it accepts. None: a made-up batch
            (zeros), as :func:`tfremat.model_planning.synthetic_batch` makes it.
        y: the labels of array ``x`` (None: made up for the loss; their values move no byte).
        strategies: strategy names to search with (an empty list is refused, as by
            :func:`compare_graph`).
        loss, optimizer: default to the model's compiled ones; the labels the graphs are
            extracted with fit the loss (class ids for a sparse one,
            :func:`tfremat.model_planning.synthetic_batch`).
        min_batch, max_batch: the batch sizes searched. When ``max_batch`` itself fits,
            the result's ``reached_max_batch`` is True and a warning is logged: the
            largest batch may be larger.
        method: ``"scaled"`` (default) or ``"search"`` (only extracted graphs decide).
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        cache: False (or None) turns the profile cache off, and the schedule cache of the
            plans the allocator check makes (the search itself uses none); True or a
            directory leaves them on, so that ``fit`` at the answer finds the plan held.
        allocator_check: hold the answer for the device allocator's peak (above). False
            holds it for the requested bytes only, without running a step, as
            ``fit(..., allocator_check=False)`` trains: faster, and the answer's
            ``allocator_peak`` is None. On CPU the peak is read with
            ``TF_CPU_ALLOCATOR_USE_BFC=true`` (importing tfremat before TensorFlow sets
            it); where the allocator keeps no statistics nothing is held (a warning says so)
            and ``allocator_peak`` is None.
        verbose: 0 silences the lines written to stderr for each batch size tried (also
            logged at INFO on ``tfremat.maxbatch``), and for each batch held on the allocator.
        **options: MILP options (``time_limit`` per batch solve, 60 s unless given,
            ``math.inf`` for none; ``solver``, ...), see :func:`strategy_options`.

    Returns:
        ``{strategy: tfremat.maxbatch.MaxBatchResult}``; with ``allocator_check`` each
        result's ``allocator_peak`` is the held peak of its step and ``allocator_tried`` the
        batches run.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, ``strategies`` is empty or names
            an unknown strategy, ``min_batch`` / ``max_batch`` are no ints with
            1 <= min_batch <= max_batch, ``x`` / ``y`` are not a sample the model takes, or
            ``allocator_check`` without an optimizer to run a step with (all before any
            extraction).
        BudgetFormatError: a relative or unparsable budget.
        InfeasibleBudgetError: even ``min_batch`` does not fit (with ``allocator_check``:
            is not held on the allocator).
    """
    from tfremat.extract.extractor import extract
    from tfremat.maxbatch import hold_on_allocator
    from tfremat.maxbatch import max_batch_size as search
    from tfremat.maxbatch_keras import AllocatorHold, batch_maker

    check_keras_model(model)
    check_cache_argument(cache)
    if budget_kind(budget) != "bytes":
        raise BudgetFormatError(f"budget={budget!r}: max_batch_size needs an absolute budget (bytes or '3GiB'); a "
                                "share or 'min' refers to one batch's peak, and the batch is what is searched")
    if allocator_check not in (True, False):
        raise ArgumentError(f"allocator_check must be True or False, got {allocator_check!r}")
    budget_bytes = parse_budget(budget)
    names, per_strategy = split_solver_options(strategies, options)
    training = loss_and_optimizer(model, loss, optimizer)
    if allocator_check and training["optimizer"] is None:
        raise ArgumentError("allocator_check runs training steps and needs an optimizer: compile the model or pass "
                            "optimizer=, or pass allocator_check=False to hold the budget for requested bytes only")
    batch_at = batch_maker(model, x, y, training["loss"])
    extractions: dict[tuple[int, bool], Any] = {}

    def built(batch: int, timing: bool):
        if (batch, timing) not in extractions:
            # The user's sample repeated to the batch, or zero-cost arrays of the batch's
            # shapes with labels shaped for the loss: a made-up batch of thousands of images
            # would be gigabytes.
            extraction = extract(model, sample_batch=batch_at(batch), cost_model=cost_model, granularity=granularity,
                                 use_cache=cache is not False and cache is not None,
                                 implementations=wants_implementations(names), timing=timing, **training)
            extractions[batch, timing] = extraction
            logger.info("batch %d: checkpoint-all peak %s%s", batch,
                        format_bytes(checkpoint_all_peak(extraction.graph)), "" if timing else " (memory only)")
        return extractions[batch, timing]

    def graph_for_batch(batch: int) -> DFGraph:
        return built(batch, True).graph

    def memory_graph_for_batch(batch: int) -> DFGraph:
        # A profiled graph already built here has the same bytes.
        return (extractions[batch, True] if (batch, True) in extractions else built(batch, False)).graph

    def progress(label: str) -> BatchProgress | None:
        return BatchProgress(label) if verbose else None

    results = {}
    for name in names:
        result = search(graph_for_batch, budget_bytes, strategy=name, max_overhead=max_overhead,
                        min_batch=min_batch, max_batch=max_batch, method=method,
                        batch_progress=progress(f"tfremat max_batch_size {name}"),
                        memory_graph_for_batch=memory_graph_for_batch if cost_model == "profile" else None,
                        **(strategy_options(name, **per_strategy[name]) if name in per_strategy else {}))
        if allocator_check:
            hold = AllocatorHold(model, budget_bytes, name, _fit_options(name, per_strategy.get(name, {})),
                                 lambda batch: built(batch, True), batch_at, training["optimizer"],
                                 False if cache is None else cache, made_up=x is None)
            result = hold_on_allocator(result, hold, budget_bytes, max_overhead=max_overhead, min_batch=min_batch,
                                       batch_progress=progress(f"tfremat max_batch_size {name} on the allocator"))
        results[name] = result
    return results


def _fit_options(strategy: str, given: dict) -> dict:
    """The strategy options :func:`fit` plans with for the options given to
    :func:`max_batch_size` (its solver and time limit, or the host link), so that the plan
    held and the planning budget its check remembers are those ``fit`` finds."""
    if get_strategy(strategy).takes_solver_options:
        return {"solver": given.get("solver"), "time_limit": given.get("time_limit")}
    return {"bandwidth": given["bandwidth"]} if get_strategy(strategy).offloads else {}
