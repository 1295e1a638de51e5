"""Training under ``tf.distribute.MultiWorkerMirroredStrategy``: :func:`tfremat.fit`'s own loop.

Keras 3's ``model.fit`` fails under this strategy before its first step (it converts the
strategy's per-replica batch to one tensor, keras-team/keras#20585), so no callback can
make it train there. :func:`fit_multi_worker` is the loop ``fit`` would run: the strategy's
distributed dataset, one compiled step per per-replica batch shape run on every
replica with Keras's metrics (:class:`~tfremat.static_graph.train_step.DistributedTrainStep`,
as ``RematCallback`` runs it under ``MirroredStrategy``), and Keras's ``CallbackList`` around it, so History, the progress bar (on
the chief only), validation data and callbacks such as EarlyStopping behave as in
``model.fit``. Every log value is reduced over all replicas, so callbacks that decide
(EarlyStopping, ReduceLROnPlateau) decide alike on every worker; callbacks that write
files (:data:`FILE_WRITING_CALLBACKS`) run on the chief only, so two workers never write
one file.

How the workers agree on one schedule, per per-replica batch shape:

1. Every worker extracts the graph for the per-replica batch (each needs its own side
   table to build the step). Profiled costs differ between machines and runs, so plans
   made independently could differ; only the chief plans.
2. The workers gather, through one collective, a fingerprint of what the schedule
   depends on and must agree: the graph's structure (edges, tensor sizes, fixed bytes,
   not the measured costs), the planning settings (budget, strategy, cost model,
   granularity, ...) and the TensorFlow and Keras versions. A worker whose fingerprint
   differs from the chief's is named in a :class:`PlanMismatchError` raised on every
   worker (all see the same gathered values, so none is left waiting in a collective).
3. The chief plans and broadcasts the schedule as its JSON document (an all-reduce to
   which only the chief contributes); every worker compiles the same schedule. A chief
   that cannot plan broadcasts its error instead, which every worker raises.

With ``allocator_check``, each worker runs the compiled step a few more times on its
replica's batch and holds its own allocator's peak (:func:`tfremat.allocator_check.allocator_peak`) (a process per worker, an allocator per
process); the workers take the largest peak through one collective, so all decide alike
whether to plan again under the budget less the excess, and the chief plans again as in
step 3 (:func:`allocator_checked`).

A worker that dies makes the next collective of the others fail (TensorFlow aborts the
collectives: at once when the peer's connection is reset, within its health check's
interval otherwise); the loop turns that into a :class:`WorkerLostError`.

The weight gradients live until the all-reduce, so the graph is extracted with
``weight_grads="fixed"`` (each gradient held from its backward node until the updates).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import keras
import numpy as np
import tensorflow as tf

from tfremat.allocator_check import (
    allocator_peak,
    hold_allocator_peak,
    planner_refusal_read,
    replan_strategy,
    replica_allocators,
    unchecked_from,
    wants_allocator_check,
)
from tfremat.errors import ArgumentError, InfeasibleBudgetError, TfrematError
from tfremat.graph import DFGraph
from tfremat.planner import PlanResult, plan_graph, plan_summary

__all__ = [
    "FILE_WRITING_CALLBACKS", "PlanMismatchError", "WorkerLostError", "agreed_plan", "allocator_checked",
    "disagreements",
    "fit_multi_worker", "is_multi_worker",
    "refuse_model_fit", "structure_fingerprint",
]

logger = logging.getLogger(__name__)

#: Callbacks that write files; on a worker other than the chief they are left out.
FILE_WRITING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore,
                          keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)

#: The ``fit`` keyword arguments the multi-worker loop takes besides those it names.
_FIT_KWARGS = ("sample_weight", "shuffle", "initial_epoch")

#: The seed of the shuffled order; the same on every worker, so the global batches of an
#: epoch partition the data as one process's batches would.
_SHUFFLE_SEED = 1337


class PlanMismatchError(TfrematError):
    """A worker's graph, planning settings or versions differ from the chief's."""


class WorkerLostError(TfrematError):
    """A collective failed because another worker stopped (died or was cut off)."""


def is_multi_worker(strategy) -> bool:
    """Whether ``strategy`` is a ``MultiWorkerMirroredStrategy``."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def refuse_model_fit(model) -> None:
    """Raises :class:`TfrematError` when ``model`` belongs to a ``MultiWorkerMirroredStrategy``:
    for a callback of ``model.fit``, which does not train there (module docstring)."""
    if is_multi_worker(getattr(model, "distribute_strategy", None)):
        raise TfrematError("model.fit does not train under MultiWorkerMirroredStrategy (keras-team/keras#20585); "
                           "call tfremat.fit(model, budget, x, y, ...) instead of model.fit with RematCallback")


def structure_fingerprint(graph: DFGraph) -> str:
    """A hash of the graph's structure: edges, tensor and fixed bytes, which nodes are
    backward and of what, implementation names; not the names (Keras numbers layers per
    process) nor the measured costs and workspace (they differ between machines)."""
    payload = graph.to_dict()
    payload.pop("name")
    for node in payload["nodes"]:
        for key in ("name", "cost", "workspace_bytes"):
            node.pop(key)
        if "implementations" in node:
            node["implementations"] = [variant.get("name") for variant in node["implementations"]]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _hash64(text: str) -> int:
    """60 bits of ``text``'s SHA-256, an int64 a collective carries."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _task(strategy) -> tuple[str, int]:
    """This worker's task type and index in the cluster (``worker``, 0 for one process)."""
    resolver = strategy.cluster_resolver
    if resolver is None or resolver.task_type is None:
        return "worker", 0
    return resolver.task_type, int(resolver.task_id or 0)


def _worker_name(strategy) -> tuple[str, bool]:
    """This worker's name in the cluster ("worker 1") and whether it is the chief (the
    ``chief`` task, else worker 0, as TensorFlow decides)."""
    task_type, task_id = _task(strategy)
    tasks = strategy.cluster_resolver.cluster_spec().as_dict() if strategy.cluster_resolver is not None else {}
    chief = task_type == "chief" if "chief" in tasks else (task_type == "worker" and task_id == 0)
    return ("the chief" if task_type == "chief" else f"{task_type} {task_id}"), chief


class _Collectives:
    """The small collectives the workers agree through, each a ``strategy.run`` in a
    ``tf.function`` (traced once per shape)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self._gather = tf.function(self._gather_replicas, autograph=False)
        self._broadcast = tf.function(self._broadcast_replicas, autograph=False)

    def gather(self, row: list[int]) -> np.ndarray:
        """Every replica's ``row`` (int64), in replica order: ``[replicas, len(row)]``."""
        return self._local(self._gather(tf.constant([row], tf.int64))).numpy()

    def broadcast(self, data: bytes, source_replica: int, length: int) -> bytes:
        """``data`` of the replica ``source_replica``, ``length`` bytes, on every replica."""
        padded = np.zeros(length, np.int32)
        padded[:len(data)] = np.frombuffer(data, np.uint8)
        value = self._broadcast(tf.constant(padded), tf.constant(source_replica))
        return self._local(value).numpy().astype(np.uint8).tobytes()

    # The arguments are copied in the replica context (tf.identity): a collective places
    # its result by its input's device, which a tf.function argument lacks.
    def _gather_replicas(self, value):
        return self.strategy.run(lambda: tf.distribute.get_replica_context().all_gather(tf.identity(value), axis=0))

    def _broadcast_replicas(self, value, source_replica):
        def contribute():
            context = tf.distribute.get_replica_context()
            own = tf.equal(context.replica_id_in_sync_group, source_replica)
            mine = tf.identity(value)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(own, mine, tf.zeros_like(mine)))

        return self.strategy.run(contribute)

    def _local(self, value):
        """One replica's copy of a value that is the same on every replica."""
        return self.strategy.experimental_local_results(value)[0]


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What fit plans with, for the fingerprint and the planning."""

    budget: object
    strategy: str
    options: dict
    cost_model: str
    granularity: str
    cache: object
    allocator_check: bool | None = None
    exact_gradients: bool = False

    def text(self) -> str:
        # allocator_check is agreed too: the workers measure their peaks together.
        return json.dumps({"budget": repr(self.budget), "strategy": self.strategy, "cost_model": self.cost_model,
                           "granularity": self.granularity, "allocator_check": repr(self.allocator_check),
                           "exact_gradients": self.exact_gradients,
                           "options": {k: repr(v) for k, v in sorted(self.options.items())}}, sort_keys=True)


def _versions() -> str:
    return f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def disagreements(rows: np.ndarray, chief_replica: int) -> list[str]:
    """What the workers disagree on with the chief, one line per worker and cause, from the
    gathered rows (one per replica: extracted, graph structure, settings and versions
    hashes, chief flag, whether the task is ``chief``, task index); empty when they agree."""
    reference = rows[chief_replica]
    problems = []
    for other in rows:
        worker = "the chief" if other[5] else f"worker {other[6]}"
        if other[0] == 0:
            problems.append(f"{worker} could not extract its graph (its own log says why)")
        elif other[1] != reference[1]:
            problems.append(f"{worker} extracted another training graph than the chief (edges or tensor sizes "
                            "differ: another model, batch shape, TensorFlow or Keras version)")
        elif other[2] != reference[2]:
            problems.append(f"{worker} plans with other settings than the chief (budget, strategy, cost_model, "
                            "granularity, allocator_check, exact_gradients or solver options of tfremat.fit)")
        elif other[3] != reference[3]:
            problems.append(f"{worker} runs other TensorFlow or Keras versions than the chief")
    return list(dict.fromkeys(problems))


def agreed_plan(strategy, model, x, y, settings: _Settings, *, verbose: int = 1, sample_weight=None) -> PlanResult:
    """The chief's plan for the per-replica batch ``(x, y)``, the same on every worker,
    with this worker's extraction (module docstring, steps 1-3).

    Raises:
        PlanMismatchError: a worker's graph structure, settings or versions differ from
            the chief's (named), or one could not extract its graph.
        InfeasibleBudgetError: no schedule fits the budget (the chief's refusal, on every
            worker), naming a smallest budget the allocator check accepts where it would
            hold it (:func:`tfremat.allocator_check.planner_refusal_read`, the steps read on
            ``x, y, sample_weight``).
        TfrematError: the chief could not plan otherwise (its error, on every worker).
    """
    from tfremat.extract.extractor import extract
    from tfremat.model_planning import exact_only_options, loss_and_optimizer, wants_implementations

    name, chief = _worker_name(strategy)
    collectives = _Collectives(strategy)
    extraction, failure = None, ""
    try:
        extraction = extract(model, sample_batch=(x, y), cost_model=settings.cost_model,
                             granularity=settings.granularity, weight_grads="fixed",
                             use_cache=settings.cache is not False and settings.cache is not None,
                             implementations=wants_implementations([settings.strategy]),
                             **loss_and_optimizer(model, None, None))
    except TfrematError as error:
        failure = str(error)
    task_type, task_id = _task(strategy)
    row = [0 if extraction is None else 1,
           0 if extraction is None else _hash64(structure_fingerprint(extraction.graph)),
           _hash64(settings.text()), _hash64(_versions()), int(chief), int(task_type == "chief"), task_id]
    rows = collectives.gather(row)
    if failure:
        raise PlanMismatchError(f"{name} could not extract its graph for the per-replica batch: {failure}")
    chief_replica = int(np.flatnonzero(rows[:, 4])[0])
    problems = disagreements(rows, chief_replica)
    if problems:
        raise PlanMismatchError(f"{name}: " + "; ".join(problems) +
                                f"; run every worker with the same model, arguments and versions (this worker runs "
                                f"{_versions()})")
    # exact_gradients leaves out the layer implementations that change rounding, as on one device.
    settings = dataclasses.replace(settings, options=exact_only_options(
        extraction, settings.strategy, settings.exact_gradients, settings.options))
    try:
        data = _chief_plan(collectives, extraction.graph, settings.budget, settings, chief, chief_replica,
                           verbose=verbose)
    except InfeasibleBudgetError as error:
        raise _read_refusal(error, strategy, model, extraction, x, y, settings, sample_weight=sample_weight,
                            verbose=verbose) from error.__cause__
    return _plan_result(extraction, data, settings.strategy)


def _read_refusal(error: InfeasibleBudgetError, distribution, model, extraction, x, y, settings: _Settings, *,
                  sample_weight, verbose: int) -> InfeasibleBudgetError:
    """The chief's refusal ``error`` (on every worker), naming a smallest budget the
    allocator check accepts where the workers would hold it: the smallest plan found, planned
    by the chief, read as :func:`allocator_checked` reads (every worker at once, the largest
    peak), by :func:`tfremat.allocator_check.planner_refusal_read`."""
    from tfremat.static_graph.compile import compile_step

    if settings.allocator_check is False:
        return error  # the same on every worker (the settings are agreed): no collective
    check = _WorkerCheck(distribution, model, x, y, settings, sample_weight=sample_weight, verbose=verbose)

    def plan_smallest(planning_budget):
        data = _chief_plan(check.collectives, extraction.graph, planning_budget, settings, check.chief,
                           check.chief_replica, verbose=verbose)
        planned = _plan_result(extraction, data, settings.strategy)
        return planned, compile_step(extraction, planned.schedule, optimizer=model.optimizer, strategy=distribution,
                                     return_outputs=True)

    return planner_refusal_read(error, plan_smallest, check.plan_at, check.read_peak, check.wanted,
                                strategy=settings.strategy, options=settings.options, cache=False, log=check.log,
                                unchecked_from=unchecked_from(settings.allocator_check, settings.budget,
                                                              extraction.graph))


def _chief_plan(collectives: _Collectives, graph: DFGraph, budget, settings: _Settings, chief: bool,
                chief_replica: int, *, verbose: int, replanning: PlanResult | None = None) -> dict:
    """The chief's plan of ``graph`` under ``budget`` as its JSON document, on every worker
    (module docstring, step 3; every worker calls it at the same point).

    ``replanning``: the plan an allocator check plans again under ``budget``. The chief
    then runs :func:`~tfremat.allocator_check.replan_strategy`'s choice, as
    :class:`tfremat.keras.RematCallback` does: the heuristic whose schedule the settings'
    strategy returned unimproved (on EfficientNetV2B0 ``eviction`` re-plans in 3.3 CPU s,
    ``optimal`` in 8.1, to the same +6.1%: ``benchmarks/latency.py``), the strategy itself
    when that heuristic finds no schedule. The document names it (``planned_with``) for every worker's
    :class:`PlanResult`.

    Raises:
        TfrematError: the chief could not plan: its own error on the chief, the error's
            text on the other workers.
    """
    document, planning_error = b"", None
    if chief:
        try:
            result = _chief_replan(graph, budget, settings, replanning) if replanning is not None else None
            if result is None:
                result = plan_graph(graph, budget, settings.strategy, cache=settings.cache, verbose=verbose,
                                    **settings.options)
            document = json.dumps({"schedule": result.schedule.to_dict(), "budget_bytes": result.budget_bytes,
                                   "solve_seconds": result.solve_seconds, "from_cache": result.from_cache,
                                   "planned_with": result.planned_with}).encode()
        except TfrematError as error:
            # Shared before it is raised: the other workers wait for the schedule.
            planning_error = error
            shared = {"error": f"{type(error).__name__}: {error}"}
            if isinstance(error, InfeasibleBudgetError):
                shared["refusal"] = {name: getattr(error, name) for name in (
                    "budget_bytes", "min_feasible_bytes", "lower_bound_bytes", "strategy", "detail", "proven")}
            document = json.dumps(shared).encode()
    length = int(collectives.gather([len(document)])[:, 0].max())
    data = json.loads(collectives.broadcast(document, chief_replica, length).decode())
    if planning_error is not None:
        raise planning_error
    if "refusal" in data:
        # The chief's refusal as an error of its own, so that every worker reads its smallest plan.
        refusal = data["refusal"]
        raise InfeasibleBudgetError(refusal["budget_bytes"], refusal["min_feasible_bytes"],
                                    refusal["lower_bound_bytes"], refusal["strategy"], refusal["detail"],
                                    refusal["proven"])
    if "error" in data:
        raise TfrematError(f"the chief could not plan for the per-replica batch: {data['error']}")
    return data


def _chief_replan(graph: DFGraph, budget: int, settings: _Settings, replanning: PlanResult) -> PlanResult | None:
    """The chief's re-plan of ``graph`` under ``budget`` with the heuristic that
    :func:`~tfremat.allocator_check.replan_strategy` picks for ``replanning``, named as the
    settings' strategy with the heuristic in ``planned_with``; None when it picks the
    settings' strategy or the heuristic finds no schedule (then that strategy plans)."""
    heuristic = replan_strategy(replanning, settings.strategy)
    if heuristic == settings.strategy:
        return None
    logger.info("planning with %s, whose schedule %s returned unimproved", heuristic, settings.strategy)
    try:
        result = plan_graph(graph, budget, heuristic, cache=settings.cache, verbose=0)
    except InfeasibleBudgetError as error:
        logger.info("%s found no schedule (%s): planning with %s", heuristic, error, settings.strategy)
        return None
    return dataclasses.replace(result, strategy=settings.strategy, planned_with=heuristic)


def _plan_result(extraction, data: dict, strategy: str) -> PlanResult:
    """A :class:`PlanResult` for this worker's graph from the chief's document."""
    from tfremat.plan.schedule import Schedule, validate_schedule
    from tfremat.plan.simulator import checkpoint_all_peak, simulate

    graph = extraction.graph
    schedule = Schedule.from_dict(data["schedule"])
    validate_schedule(graph, schedule)
    simulated = simulate(graph, schedule)
    return PlanResult(strategy=strategy, schedule=schedule, graph=graph, budget_bytes=data["budget_bytes"],
                      predicted_peak_bytes=simulated.peak_bytes, checkpoint_all_peak_bytes=checkpoint_all_peak(graph),
                      overhead=simulated.makespan / graph.total_cost - 1 if graph.total_cost else 0.0,
                      solve_seconds=float(data["solve_seconds"]), from_cache=bool(data["from_cache"]),
                      extraction=extraction, planned_with=data.get("planned_with"))


def allocator_checked(distribution, model, plan: PlanResult, step, x, y, settings: _Settings, *,
                      sample_weight=None, verbose: int = 0) -> tuple[PlanResult, object, int | None]:
    """``plan`` and its compiled ``step``, planned again until the largest allocator peak
    over the workers is within the budget (``allocator_check``, as
    :class:`tfremat.keras.RematCallback` does on one machine), and that peak (None when not
    checked).

    Each worker runs the step on its replica's batch ``x, y`` (every replica at once: the
    step's all-reduce is a collective) and reads its own allocator's peak; the workers
    gather the peaks and all take the largest, so they decide alike whether to plan again
    and under what budget: :func:`tfremat.allocator_check.hold_allocator_peak`'s loop, the
    one-process check's, with no planning budget remembered. The chief plans and broadcasts
    the schedule, as for the first plan, so every worker keeps one schedule. Skipped on
    every worker when one cannot read its allocator (a CPU allocator without statistics,
    or replicas sharing one: :func:`tfremat.allocator_check.replica_allocators`).

    ``allocator_check=None`` (the default) checks as :class:`tfremat.keras.RematCallback`
    does, but only on GPU replicas: a CPU replica's allocator also serves the input
    pipeline, whose batches, prefetched while the step runs, split the step's free chunks,
    so the step's peak in whole chunks exceeds what it requests by an amount no plan
    controls (a 12-conv net at 50% of activations: 29.0 MiB requested, 36-40 MiB allocator
    peak with the distributed iterator running, 29.0 MiB without; ``benchmarks/distributed.py``).
    ``allocator_check=True`` checks there too.

    Raises:
        InfeasibleBudgetError: no plan within :data:`tfremat.allocator_check.ALLOCATOR_ROUNDS` kept
            the largest peak within the budget, or the chief could not plan under the
            reduced budget (on every worker).
    """
    if settings.allocator_check is False or plan.budget_bytes is None:
        return plan, step, None  # the same on every worker (the settings are agreed): no collective
    check = _WorkerCheck(distribution, model, x, y, settings, sample_weight=sample_weight, verbose=verbose)
    if not check.wanted(plan):
        return plan, step, None
    held = []
    # No remembered planning budget (cache=False): a worker's own cache could start it where
    # another worker's does not, and their collectives would part.
    plan, step, _ = hold_allocator_peak(plan, step, check.plan_at, check.read_peak, strategy=settings.strategy,
                                        options=settings.options, cache=False,
                                        accepted=lambda _step, peak: held.append(peak), log=check.log,
                                        unchecked_from=unchecked_from(settings.allocator_check, settings.budget,
                                                                      plan.extraction.graph))
    return plan, step, held[-1] if held else None


class _WorkerCheck:
    """What the workers' allocator check reads and plans with, for :func:`allocator_checked`
    and a refusal's read (:func:`_read_refusal`) alike: each method is a collective every
    worker calls at the same point (one gather on construction finds the chief's replica)."""

    def __init__(self, distribution, model, x, y, settings: _Settings, *, sample_weight, verbose: int):
        self.distribution, self.model, self.x, self.y = distribution, model, x, y
        self.settings, self.sample_weight, self.verbose = settings, sample_weight, verbose
        self.name, self.chief = _worker_name(distribution)
        self.log = _WorkerLog(logger, self.name)
        self.collectives = _Collectives(distribution)
        self.devices = replica_allocators(distribution)
        self.chief_replica = int(np.flatnonzero(self.collectives.gather([int(self.chief)])[:, 0])[0])

    def wanted(self, plan: PlanResult) -> bool:
        """Whether the workers hold ``plan``'s step to its budget: when any wants to, and all
        can (a worker's plan, and with it whether its budget is below its checkpoint-all
        peak, may differ)."""
        settings, devices = self.settings, self.devices
        wants = wants_allocator_check(settings.allocator_check, settings.budget, plan)
        if settings.allocator_check is None and devices is not None and any(d.startswith("CPU") for d in devices):
            wants = False  # the input pipeline shares a CPU replica's allocator (allocator_checked)
        rows = self.collectives.gather([int(wants), int(devices is not None)])
        if not rows[:, 0].any():
            return False
        if not rows[:, 1].all():
            (logger.warning if settings.allocator_check else logger.info)(
                "%s: allocator_check skipped: a worker's replicas share one allocator (logical devices of one CPU), "
                "which cannot be read per device; the budget holds for each replica's requested bytes", self.name)
            return False
        return True

    def read_peak(self, candidate) -> int | None:
        """The largest held peak of ``candidate`` over the workers: every worker reads and
        gathers, so all take the same largest peak and decide alike."""
        local = [allocator_peak(candidate, self.model, self.x, self.y, self.sample_weight, device=device)
                 for device in self.devices]
        peaks = self.collectives.gather([-1 if None in local else max(local)])[:, 0]
        if (peaks < 0).any():
            logger.warning("%s: allocator_check skipped: a worker's allocator keeps no statistics (its log says why)",
                           self.name)
            return None
        return int(peaks.max())

    def plan_at(self, current: PlanResult, planning_budget: int) -> tuple:
        """``current``'s graph planned again by the chief under ``planning_budget``, and its step."""
        from tfremat.static_graph.compile import compile_step

        try:
            data = _chief_plan(self.collectives, current.extraction.graph, planning_budget, self.settings, self.chief,
                               self.chief_replica, verbose=self.verbose, replanning=current)
        except InfeasibleBudgetError:
            raise
        except TfrematError as error:  # the chief's failure, told on every worker
            raise InfeasibleBudgetError(planning_budget, strategy=self.settings.strategy, detail=str(error)) from error
        replanned = _plan_result(current.extraction, data, self.settings.strategy)
        return replanned, compile_step(replanned.extraction, replanned.schedule, optimizer=self.model.optimizer,
                                       strategy=self.distribution, return_outputs=True)


class _WorkerLog(logging.LoggerAdapter):
    """The module's logger with the worker's name before each message."""

    def __init__(self, log: logging.Logger, name: str):
        super().__init__(log, {"worker": name})

    def process(self, msg, kwargs):
        return f"{self.extra['worker']}: {msg}", kwargs


def fit_multi_worker(model, budget, x, y, *, batch_size, epochs: int, validation_data, callbacks, strategy: str,
                     options: dict, cost_model: str, granularity: str, cache, verbose: int,
                     allocator_check: bool | None = None, exact_gradients: bool = False, **fit_kwargs):
    """:func:`tfremat.fit` under the model's ``MultiWorkerMirroredStrategy`` (module docstring).

    ``x, y`` are arrays of the whole data set, the same on every worker, batched by
    ``batch_size`` global samples (split evenly over the replicas, each worker taking its
    share of every global batch), or ``x`` a ``tf.data.Dataset`` of global ``(x, y)``
    batches, distributed by ``strategy.experimental_distribute_dataset``. A last global
    batch short of ``batch_size`` samples is left out (a warning says how many samples):
    every replica's step must run on equal shares. ``shuffle`` (default True, as in
    ``model.fit``) draws the same order on every worker. ``sample_weight`` (one weight per
    sample of ``x``, or a third element of the data set's and ``validation_data``'s
    batches) weights every output's loss as in ``model.fit``: each replica's loss is its
    weighted sum over its share divided by the share's size, and the all-reduce averages
    the replicas, which is Keras's weighted mean over the global batch.

    ``allocator_check`` holds the largest allocator peak over the workers to the budget,
    each worker measuring its own (:func:`allocator_checked`).

    Returns:
        The Keras ``History`` with ``history.plans`` (``{per-replica batch shapes: PlanResult}``)
        and ``history.allocator_peaks`` (``{per-replica batch shapes: bytes}``, the largest
        allocator peak over the workers, for the shapes ``allocator_check`` measured).

    Raises:
        ArgumentError: a ``fit`` argument the loop does not take, or a batch that does not
            split evenly over the replicas.
        PlanMismatchError, WorkerLostError: see the module docstring.
    """
    from tfremat.static_graph.compile import compile_step
    from tfremat.static_graph.train_step import DistributedTrainStep

    unknown = sorted(set(fit_kwargs) - set(_FIT_KWARGS))
    if unknown:
        raise ArgumentError(f"{unknown[0]}= is not taken by tfremat.fit under MultiWorkerMirroredStrategy (it takes "
                            f"x, y, batch_size, epochs, validation_data, callbacks, {', '.join(_FIT_KWARGS)}); leave "
                            "it out")
    distribution = model.distribute_strategy
    name, chief = _worker_name(distribution)
    if not model.optimizer.built:
        # Its slots are mirrored variables, made in the strategy's scope (as model.fit
        # builds them); the extraction, outside the scope, would fail to build them.
        with distribution.scope():
            model.optimizer.build(model.trainable_variables)
    shuffle = fit_kwargs.get("shuffle", True)
    train = _distributed(distribution, x, y, batch_size, shuffle=shuffle, argument="x",
                         sample_weight=fit_kwargs.get("sample_weight"))
    validation = None
    if validation_data is not None:
        if isinstance(validation_data, tf.data.Dataset):
            validation = _distributed(distribution, validation_data, None, None, shuffle=False,
                                      argument="validation_data")
        elif isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
            validation = _distributed(distribution, *validation_data[:2], batch_size, shuffle=False,
                                      argument="validation_data",
                                      sample_weight=validation_data[2] if len(validation_data) == 3 else None)
        else:
            raise ArgumentError("validation_data must be (x_val, y_val) or (x_val, y_val, sample_weight_val) arrays, "
                                "or a tf.data.Dataset of (x, y) or (x, y, sample_weight) batches")
    settings = _Settings(budget, strategy, options, cost_model, granularity, cache, allocator_check, exact_gradients)
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    kept = [c for c in (callbacks or []) if chief or not isinstance(c, FILE_WRITING_CALLBACKS)]
    if len(kept) < len(callbacks or []):
        logger.info("%s leaves out the callbacks that write files (%s): the chief runs them", name,
                    ", ".join(type(c).__name__ for c in callbacks if c not in kept))
    callback_list = keras.callbacks.CallbackList(kept, add_history=True, add_progbar=bool(verbose) and chief,
                                                 verbose=verbose if chief else 0, epochs=epochs,
                                                 steps=train.steps, model=model)
    steps: dict = {}
    plans: dict = {}
    allocator_peaks: dict = {}

    def train_function(x_batch, y_batch, w_batch):
        local_x, local_y, local_w = tf.nest.map_structure(
            lambda v: v if v is None else distribution.experimental_local_results(v)[0], (x_batch, y_batch, w_batch))
        shapes = tuple(tuple(t.shape) for t in tf.nest.flatten((local_x, local_y)))
        if shapes not in steps:
            plan = agreed_plan(distribution, model, local_x, local_y, settings, verbose=verbose if chief else 0,
                               sample_weight=local_w)
            logger.info("%s, per-replica batch %s: %s", name, shapes, plan_summary(plan))
            step = compile_step(plan.extraction, plan.schedule, optimizer=model.optimizer, strategy=distribution,
                                return_outputs=True)
            plan, step, peak = allocator_checked(distribution, model, plan, step, local_x, local_y, settings,
                                                 sample_weight=local_w, verbose=verbose if chief else 0)
            if peak is not None:
                allocator_peaks[shapes] = peak
            plans[shapes] = plan
            steps[shapes] = DistributedTrainStep(model, step)
        return steps[shapes](x_batch, y_batch, w_batch)

    test_function = tf.function(lambda data: distribution.run(model.test_step, args=(data,)), autograph=False)
    model.stop_training = False
    try:
        callback_list.on_train_begin()
        logs = {}
        for epoch in range(fit_kwargs.get("initial_epoch", 0), epochs):
            model.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            for batch, data in enumerate(train.dataset):
                callback_list.on_train_batch_begin(batch)
                train_function(*_unpacked(data))
                logs = _logs(model)
                callback_list.on_train_batch_end(batch, logs)
                if model.stop_training:
                    break
            epoch_logs = _logs(model)
            if validation is not None:
                model.reset_metrics()
                for data in validation.dataset:
                    test_function(tuple(data))
                epoch_logs.update({f"val_{k}": v for k, v in _logs(model).items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
        callback_list.on_train_end(logs)
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError) as error:
        raise WorkerLostError(f"{name}: a collective failed, another worker stopped or cannot be reached "
                              f"({type(error).__name__}: {error.message.strip().splitlines()[-1][:200]}); "
                              "restart every worker (BackupAndRestore resumes from the last epoch)") from error
    history = model.history
    history.plans = dict(plans)
    history.allocator_peaks = dict(allocator_peaks)
    return history


def _logs(model) -> dict:
    """The model's metric results as Python floats (each reduced over every replica)."""
    return {key: float(value) for key, value in model.get_metrics_result().items()}


@dataclasses.dataclass(frozen=True)
class _Data:
    dataset: object
    steps: int | None


def _unpacked(data) -> tuple:
    """``(x, y, sample_weight)`` of a distributed batch of 2 or 3 elements (None: no weights)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(tuple(data))
    if y is None:
        raise ArgumentError("the data set yields batches without labels: tfremat.fit trains on (x, y) or "
                            "(x, y, sample_weight) batches")
    if tf.nest.is_nested(sample_weight):
        raise ArgumentError("sample weights given per output (a list or dict) are not supported by the rematerialized "
                            "step; pass one array of sample weights, which weights every output's loss")
    return x, y, sample_weight


def _distributed(distribution, x, y, batch_size, *, shuffle: bool, argument: str, sample_weight=None) -> _Data:
    """The strategy's distributed dataset of global batches (see :func:`fit_multi_worker`),
    of ``(x, y)`` or, with ``sample_weight``, ``(x, y, sample_weight)``."""
    replicas = distribution.num_replicas_in_sync
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ArgumentError(f"{argument}: a tf.data.Dataset yields (x, y) or (x, y, sample_weight) batches; leave "
                                "y and sample_weight out")
        return _Data(distribution.experimental_distribute_dataset(x), None)
    if x is None or y is None:
        raise ArgumentError(f"{argument}: pass x and y (arrays), or x as a tf.data.Dataset of (x, y) batches")
    if batch_size is None or batch_size % replicas:
        raise ArgumentError(f"batch_size={batch_size!r}: under MultiWorkerMirroredStrategy it is the global batch, "
                            f"split evenly over the {replicas} replicas; pass a multiple of {replicas}")
    samples = int(tf.nest.flatten(x)[0].shape[0])
    steps = samples // batch_size
    if samples % batch_size:
        logger.warning("%s: the last %d of %d samples make a batch short of batch_size=%d, left out (every replica "
                       "trains on an equal share)", argument, samples % batch_size, samples, batch_size)
    if steps == 0:
        raise ArgumentError(f"{argument} has {samples} samples, fewer than batch_size={batch_size}")
    if sample_weight is not None and len(sample_weight) != samples:
        raise ArgumentError(f"{argument}: sample_weight has {len(sample_weight)} weights for {samples} samples; pass "
                            "one weight per sample")
    elements = (x, y) if sample_weight is None else (x, y, sample_weight)
    data = tf.data.Dataset.from_tensor_slices(elements).take(steps * batch_size)
    if shuffle:
        data = data.shuffle(steps * batch_size, seed=_SHUFFLE_SEED, reshuffle_each_iteration=True)

    def shard(context):
        # Element k of the shuffled order goes to worker k mod W: global batch j is
        # samples [j*B, (j+1)*B) of the order, split over the replicas.
        per_replica = context.get_per_replica_batch_size(batch_size)
        return data.shard(context.num_input_pipelines, context.input_pipeline_id).batch(per_replica,
                                                                                          drop_remainder=True)

    return _Data(distribution.distribute_datasets_from_function(shard), steps)
