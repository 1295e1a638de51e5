"""Keras integration: a callback that makes ``model.fit`` train with a rematerialization schedule.

``model.fit(x, y, callbacks=[RematCallback("50%")])`` replaces the model's train function
for the duration of ``fit``: each batch shape met gets its own extraction, schedule and
compiled step (a smaller last batch is planned separately, never run over budget), and
the model's loss tracker and compiled metrics are updated as ``model.fit`` would. A model
built and compiled under ``tf.distribute.MirroredStrategy`` trains on every replica, each
step planned for one replica's batch (:class:`RematCallback`, :class:`DistributedTrainStep`).

Keras restores nothing when ``fit`` raises (``on_train_end`` does not run), so the
rematerialized step puts the model's own train function back itself when it raises (a
budget no schedule fits, an interrupt), and when it is called by a ``fit`` it is not a
callback of (one that ended without ``on_train_end``, because another callback raised
or an interrupt came between steps, left it on the model): Keras announces every batch
to the callbacks of its own ``fit`` (``on_train_batch_begin``) just before calling the
train function, so a call without that announcement is a plain ``model.fit``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from tfremat.allocator_check import (
    WATCHED_STEPS,
    allocator_peak,
    hold_allocator_peak,
    planner_refusal_read,
    replan,
    replica_allocators,
    training_step_peak,
    unchecked_from,
    wants_allocator_check,
)
from tfremat.budget import budget_kind, check_budget, format_bytes, larger_shapes, share_floor
from tfremat.errors import (
    ArgumentError,
    CompileError,
    InfeasibleBudgetError,
    TfrematError,
    fixed_parts,
)
from tfremat.extract.checks import refuse_unmodelled_training
from tfremat.extract.extractor import COST_MODELS
from tfremat.extract.opening import DEFAULT_GRANULARITY, GRANULARITIES
from tfremat.ilp.solvers import DEFAULT_SOLVER, check_solver_options
from tfremat.model_planning import (
    check_exact_gradients,
    exact_only_options,
    extract_model,
    wants_implementations,
    with_rounding,
)
from tfremat.multi_worker import refuse_model_fit
from tfremat.plan.offload import check_bandwidth
from tfremat.plan.registry import in_user_terms, parse_graph_budget
from tfremat.planner import PhaseProgress, check_cache_argument, plan_graph, plan_summary
from tfremat.runtime.host_link import host_link_bandwidth
from tfremat.static_graph.train_step import DistributedTrainStep, update_metrics
from tfremat.strategies import (
    get_strategy,
    offloading_strategy_names,
    solver_strategy_names,
)

__all__ = [
    "RematCallback",
    "DistributedTrainStep",
    "check_distribute_strategy",
    "is_distributed",
    "replica_allocators",
    "replica_batch",
    "update_metrics",
    "wants_allocator_check",
]

logger = logging.getLogger(__name__)


class RematCallback(keras.callbacks.Callback):
    """Trains with a schedule chosen under a memory budget.

    Args:
        budget: bytes, "3.5GiB"-style strings, or a share of the checkpoint-all peak
            ("50%" or 0.5, "50% of activations"), applied to every batch shape. A share is
            resolved against each shape's own step, but never to fewer bytes than for a larger
            shape planned before: a smaller last batch keeps the full batches' bytes (its
            phase line says so; :func:`~tfremat.budget.share_floor`).
        strategy: the strategy name (default "optimal", the MILP).
        solver: MILP solver name ("highs" default, "gurobi" when licensed).
        time_limit: MILP time limit in seconds per batch shape (None: 60 s,
            ``tfremat.planner.DEFAULT_TIME_LIMIT``; ``math.inf``: until proven optimal);
            ``optimal`` also stops once 5 s of search (CPU time) find nothing cheaper (docs/solver.md).
        cost_model: "profile" or "flops" for the extraction.
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        cache: schedule cache (True: default directory; a path; False: off, and the
            profile cache with it).
        allocator_check: hold the budget for the device allocator's peak, where
            out-of-memory happens, not only for the bytes the step's operations request
            (what the prediction counts; TensorFlow's BFC allocator hands a free chunk out
            whole when it is less than twice the request; docs/memory-model.md). Each
            new step is run eight times before training (its state put back): one warm-up,
            three reads (:data:`~tfremat.allocator_check.ALLOCATOR_READS`) and four with the
            allocator's free chunks put in other states
            (:data:`~tfremat.allocator_check.PERTURBED_READS`: the peak moves with them),
            held as the largest plus a small slack of the step's own bytes
            (:data:`~tfremat.allocator_check.ALLOCATOR_SLACK`); while that exceeds
            the budget, the step is planned again under a smaller planning budget, up to
            :data:`~tfremat.allocator_check.ALLOCATOR_ROUNDS` plans, else :class:`InfeasibleBudgetError`. The first
            :data:`~tfremat.allocator_check.WATCHED_STEPS` training steps are read too (not
            under a strategy or XLA), and one over the budget has the step planned again from
            the next on. The planning budget accepted is kept with the schedule cache, where
            another process with the same model and budget starts.
            None (default): for every budget but ``"min"`` and shares at or above the
            checkpoint-all peak (nothing recomputed; a refusal names such a share only where
            the checkpoint-all step was read within it), and not on a distribution
            strategy's CPU replica (its input pipeline shares the allocator).
            ``"min"`` promises the least requested memory the strategy finds within its
            overhead bound, not an allocator figure: there is no smaller plan to fall back
            on, so its step's allocator peak is read as the check reads it, held with the
            same slack, and reported (the compiling phase's line, :attr:`allocator_peaks`,
            which also keeps the largest of the first watched training steps' reads) as the
            memory that plan needs, above its prediction by the allocator's chunks
            (a GRU at ``"min"``: 53.68 MiB predicted, 54.3-60.1 MiB allocator;
            benchmarks/results/user_check_2.md). ``allocator_check=True`` holds a ``"min"``
            plan's bytes as an amount, which a smaller plan rarely reaches: it is then
            refused in the allocator's terms. Skipped, with a warning, when the allocator
            keeps no statistics (on CPU, TensorFlow imported before tfremat).
        bandwidth: the host link of the strategies that offload activations to host memory
            (pofo, pofo_ap, autocapper, opportunist), in bytes per second; None: measured on
            the GPU (:func:`~tfremat.runtime.host_link.host_link_bandwidth`), required on a
            machine without one. Refused for the other strategies. Offloading needs
            ``cost_model="profile"`` (costs in seconds).
        exact_gradients: for a strategy that chooses layer implementations (``monet``),
            choose only those that round gradients exactly as the layer's own does (each
            plan names the others it chose: ``PlanResult.inexact_implementations``).
        verbose: 0 silences the lines written to stderr for a new batch shape, one per phase
            (extraction, planning, compiling) with its seconds
            (:class:`~tfremat.planner.PhaseProgress`).

    A model built and compiled in the scope of a ``tf.distribute.MirroredStrategy`` (one
    machine, several devices) or ``OneDeviceStrategy`` trains on every replica as
    ``model.fit`` does under it; other strategies are refused when training begins
    (:func:`check_distribute_strategy`), ``MultiWorkerMirroredStrategy`` pointing to
    :func:`tfremat.fit` (Keras's ``model.fit`` does not train under it). The budget is per device: each batch shape is
    planned for one replica's part of the global batch (:func:`replica_batch`), with the
    weight gradients resident for the whole step (the all-reduce waits for all of them:
    extraction with ``weight_grads="fixed"``), and every replica runs that plan
    (:class:`DistributedTrainStep`). The all-reduce's own buffers are not in the memory
    model. ``allocator_check`` holds each replica's GPU allocator to the budget; replicas
    on the logical devices of one CPU share one allocator, so there it is skipped, with a
    warning when asked for, and the budget holds for the bytes each replica requests
    (:func:`replica_allocators`).

    Attributes:
        plans: ``{batch shapes: PlanResult}`` for every shape trained so far (under a
            strategy, the shapes of one replica's batch).
        allocator_peaks: ``{batch shapes: bytes}``, the allocator's peak held for each
            shape's step (:func:`~tfremat.allocator_check.held_peak`): the accepted plan's
            where ``allocator_check`` held it (requested bytes under XLA), and a ``"min"``
            plan's, read and not held, raised to its first training steps' largest read
            (see ``allocator_check``).
    """

    def __init__(self, budget, strategy: str = "optimal", solver: str | None = None, time_limit: float | None = None,
                 cost_model: str = "profile", granularity: str = DEFAULT_GRANULARITY, cache=True,
                 allocator_check: bool | None = None, verbose: int = 1, bandwidth: float | None = None,
                 exact_gradients: bool = False):
        super().__init__()
        # Refuse a malformed budget or an unknown strategy here, not at the first step.
        check_budget(budget)
        get_strategy(strategy)
        if get_strategy(strategy).takes_solver_options:
            check_solver_options(DEFAULT_SOLVER if solver is None else solver, time_limit=time_limit)
        elif solver is not None or time_limit is not None:
            raise ArgumentError(
                f"solver= and time_limit= configure the MILP strategies ({', '.join(solver_strategy_names())}); "
                f"strategy {strategy!r} takes neither, so leave them out"
            )
        if get_strategy(strategy).offloads:
            if cost_model != "profile":
                raise ArgumentError(f"strategy {strategy!r} offloads over a link measured in bytes per second, which "
                                    f"needs costs in seconds: use cost_model='profile', not {cost_model!r}")
            if bandwidth is None:
                bandwidth = host_link_bandwidth()  # None without a GPU: check_bandwidth says what to pass
            check_bandwidth(bandwidth, strategy)
        elif bandwidth is not None:
            raise ArgumentError(f"bandwidth= is the host link of the offloading strategies "
                                f"({', '.join(offloading_strategy_names())}); strategy {strategy!r} does not offload, "
                                "so leave it out")
        if cost_model not in COST_MODELS:
            raise ArgumentError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
        if granularity not in GRANULARITIES:
            raise ArgumentError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        check_cache_argument(cache)
        check_exact_gradients(exact_gradients)
        self.exact_gradients = exact_gradients
        self.budget = budget
        self.strategy = strategy
        self.solver = solver
        self.time_limit = time_limit
        self.bandwidth = bandwidth
        self.cost_model = cost_model
        self.granularity = granularity
        self.cache = cache
        if allocator_check is not None and not isinstance(allocator_check, bool):
            raise ArgumentError(f"allocator_check must be True, False or None (the default: see the docstring), "
                                f"got {allocator_check!r}")
        self.allocator_check = allocator_check
        self.verbose = verbose
        self.plans: dict = {}
        self._steps: dict = {}
        # Per batch shape: the budget it is planned under (_share_budget).
        self._budgets: dict = {}
        # Per batch shape checked: [training steps still read, planning budget, plan options]
        # (allocator_check.WATCHED_STEPS).
        self._watched: dict = {}
        # What the compiled steps belong to (_training_setup): a callback reused on another
        # model, or on the same model compiled anew, must not run stale steps.
        self._steps_belong_to: tuple = ()
        self._original_train_function = None
        self._batch_announced = False
        # The model's tf.distribute strategy (None: the default one) and whether the step
        # is compiled with XLA, read at on_train_begin.
        self._strategy = None
        self._jit_compile = False
        # The phase lines of a new step, the last closed after its first run (which traces it),
        # and the line of a re-plan that a watched training step asked for.
        self._tracing: PhaseProgress | None = None
        self._replanning: PhaseProgress | None = None
        self.allocator_peaks: dict = {}

    # What the compiled steps were planned with; changing one later would leave steps
    # planned for the old value in use, so they are fixed when the callback is built.
    _SETTINGS = ("budget", "strategy", "solver", "time_limit", "bandwidth", "cost_model", "granularity", "cache",
                 "allocator_check", "exact_gradients")

    def __setattr__(self, name, value):
        if name in self._SETTINGS and name in self.__dict__:
            raise AttributeError(
                f"RematCallback.{name} is fixed when the callback is built (its steps are planned with it); "
                f"build a new RematCallback(..., {name}=...) instead"
            )
        super().__setattr__(name, value)

    def on_train_begin(self, logs=None):
        model = self.model
        refuse_unmodelled_training(model)  # first: a train_step override is compiled without a loss
        if getattr(model, "optimizer", None) is None or getattr(model, "loss", None) is None:
            raise TfrematError("RematCallback needs a compiled model (model.compile(optimizer=..., loss=...))")
        check_distribute_strategy(model.distribute_strategy)
        refuse_model_fit(model)  # MultiWorkerMirroredStrategy: tfremat.fit trains in a loop of its own
        self._strategy = model.distribute_strategy if is_distributed(model.distribute_strategy) else None
        if getattr(model, "steps_per_execution", 1) != 1:
            raise ArgumentError(f"model.compile(steps_per_execution={model.steps_per_execution}): RematCallback runs "
                                "one batch per step; compile the model with steps_per_execution=1")
        # XLA (jit_compile=True, Keras's default on a GPU) compiles the planned step too; its
        # recompute statements are kept apart from the values they replace
        # (docs/compiled-step.md). compile_step does not combine it with a distribution
        # strategy (nor does Keras's "auto") or with offloading.
        self._jit_compile = bool(model.jit_compile)
        if self._jit_compile and (self._strategy is not None or get_strategy(self.strategy).offloads):
            self._jit_compile = False
            reason = (f"under {type(self._strategy).__name__}" if self._strategy is not None
                      else f"with the offloading strategy {self.strategy!r}")
            logger.warning("the rematerialized step runs without XLA %s (jit_compile=True is not applied there); "
                           "compile the model with jit_compile=False to silence this", reason)
        if model.run_eagerly:
            logger.warning("the rematerialized step runs as a tf.function (run_eagerly=True is not applied); "
                           "train with model.fit alone to debug eagerly")
        setup = _training_setup(model)
        if len(setup) != len(self._steps_belong_to) or any(a is not b for a, b in zip(setup, self._steps_belong_to)):
            self._steps, self.plans, self._watched, self._steps_belong_to = {}, {}, {}, setup
            self._budgets = {}
            self.allocator_peaks = {}
        if model.train_function != self._train_function:  # else left over from a fit stopped between steps
            self._original_train_function = model.train_function
        model.train_function = self._train_function

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_announced = True

    def on_train_end(self, logs=None):
        self._restore()

    def _restore(self):
        if self._original_train_function is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None

    def _step_for(self, x, y, sample_weight=None, strategy=None):
        """The compiled step for the batch shape of ``x, y`` (one replica's batch under
        ``strategy``), extracted, planned and compiled the first time the shape is met."""
        from tfremat.static_graph.compile import compile_step

        key = _shape_key(x, y)
        if key not in self._steps:
            model = self.model
            takes_solver_options = get_strategy(self.strategy).takes_solver_options
            options = {"solver": self.solver, "time_limit": self.time_limit} if takes_solver_options else {}
            if get_strategy(self.strategy).offloads:
                options["bandwidth"] = self.bandwidth
            # One line per phase (PhaseProgress): each can take seconds to minutes.
            phases = PhaseProgress(_batch_label(x), bool(self.verbose))
            self._tracing = phases  # closed after the first step, or when a phase raises
            phases.start("extracting the training graph and profiling its layers")
            # The model's own loss, loss weights and optimizer, as tfremat.plan_model takes
            # them. Under a strategy the all-reduce holds every weight gradient until the
            # updates, so the gradients are counted as resident for the whole step; and the
            # model is extracted as replica 0 sees it: a mirrored variable's gradient needs a
            # replica context, which a fit called inside ``strategy.scope()`` is not in.
            as_replica = contextlib.nullcontext() if strategy is None else tf.distribute.ReplicaContext(strategy, 0)
            with as_replica:
                extraction = extract_model(model, x, y, batch_size=int(tf.nest.flatten(x)[0].shape[0]), loss=None,
                                           optimizer=None, cost_model=self.cost_model, cache=self.cache,
                                           granularity=self.granularity,
                                           implementations=wants_implementations([self.strategy]),
                                           weight_grads="auto" if strategy is None else "fixed",
                                           replicas=1 if strategy is None else strategy.num_replicas_in_sync,
                                           xla="memory" if self._jit_compile else False, budget=self.budget,
                                           strategy=self.strategy)
            phases.done(f"{extraction.graph.size} nodes (profiling {extraction.profile_seconds:.1f}s)"
                        if not extraction.cache_hit else f"{extraction.graph.size} nodes, profiles from the cache")
            budget, floor = self._share_budget(key, extraction.graph)
            self._budgets[key] = budget
            if budget == self.budget:
                phases.start(f"planning with {self.strategy}")
            else:
                # A smaller (last) batch keeps the bytes the share gave a larger one (_share_budget).
                larger = f"the batch of {floor[0][0]}" if floor[0] else "a larger batch"
                held = (f"under {format_bytes(budget)}, the {self.budget!r} of {larger} (more than the "
                        f"{format_bytes(floor[1])} it is of this batch's step)")
                phases.start(f"planning with {self.strategy} {held}")
                logger.info("batch shape %s: planning %s", key, held)
            progress = {"progress": phases.solver_progress(extraction.graph.total_cost)} if takes_solver_options else {}
            options = exact_only_options(extraction, self.strategy, self.exact_gradients, options)
            try:
                with warnings.catch_warnings():
                    if budget != self.budget:
                        # Above this batch's checkpoint-all peak is what the rule gives it, not a
                        # budget to lower.
                        warnings.filterwarnings("ignore", message=".*at or above the checkpoint-all peak")
                    result = plan_graph(extraction.graph, budget, self.strategy, cache=self.cache, verbose=0,
                                        **options, **progress)
            except InfeasibleBudgetError as error:
                error = self._read_refusal(error, extraction, budget, key, x, y, sample_weight, options, strategy)
                raise self._refusal(error, extraction.graph, key, budget) from error.__cause__
            result = with_rounding(dataclasses.replace(result, extraction=extraction))
            phases.done(plan_summary(result))
            logger.info("batch shape %s: %s, %s", key, self.strategy, plan_summary(result))
            checks_allocator = self._checks_allocator(result, strategy, budget, key)
            reads_min = not checks_allocator and self._reads_min_allocator(result, strategy)
            # The check runs the step eight times and may plan again: its seconds are this phase's.
            phases.start("compiling the step" + (" and holding its allocator peak to the budget" if checks_allocator
                                                 else " and reading its allocator peak" if reads_min else ""))
            step = compile_step(result.extraction, result.schedule, optimizer=model.optimizer, strategy=strategy,
                                return_outputs=True, jit_compile=self._jit_compile)
            if checks_allocator:
                try:
                    result, step, planning = self._within_allocator(result, step, x, y, sample_weight, options,
                                                                    strategy)
                except InfeasibleBudgetError as error:
                    raise self._refusal(error, extraction.graph, key, budget) from error.__cause__
                if planning is not None and strategy is None and not self._jit_compile:
                    self._watched[key] = [WATCHED_STEPS, planning, options]
            elif reads_min:
                peak = allocator_peak(step, model, x, y, sample_weight)
                if peak is not None:
                    self.allocator_peaks[key] = peak
                    self._watched[key] = [WATCHED_STEPS, None, options]  # read, not held
                    # "min" is read, not held: there is no smaller plan to hold it with.
                    phases.done(f"the allocator needs {format_bytes(peak)} for the {self.budget!r} plan's "
                                f"{format_bytes(result.predicted_peak_bytes)} predicted (read, not held)")
                    logger.info("batch shape %s: %r plan predicted at %s, the allocator needs %s (read, not held)",
                                key, self.budget, format_bytes(result.predicted_peak_bytes), format_bytes(peak))
                    phases.start("running the first step")
            if strategy is not None:
                step = DistributedTrainStep(model, step)
            self.plans[key] = result
            self._steps[key] = step
        return self._steps[key]

    def _share_budget(self, key: tuple, graph) -> tuple:
        """The budget the batch shape ``key`` is planned under, and ``(larger batch's first
        shape, the share's own bytes here)`` when that is not the budget as given: a share is
        never resolved to fewer bytes than for a larger batch shape planned before
        (:func:`~tfremat.budget.share_floor`: a smaller last batch keeps the full batches')."""
        floor = share_floor(self.budget, [(shape, plan.budget_bytes) for shape, plan in self.plans.items()], key)
        if floor is None:
            return self.budget, None
        own = parse_graph_budget(graph, self.budget)
        if floor[0] <= own:
            return self.budget, None
        return floor[0], (floor[1][0] if floor[1] else None, own)

    def _refusal(self, error: InfeasibleBudgetError, graph, key: tuple, budget) -> InfeasibleBudgetError:
        """``error`` for the batch shape ``key`` told as the user can act on it: the budget as
        written, the smallest one in the same terms (a share when a share was given: an
        allocator check's refusal is in bytes), what the fixed memory holds (no optimizer
        state for plain SGD), the batch named, and for a batch smaller than one planned
        before (a last batch) that ``drop_remainder=True`` avoids its shape. ``budget``: the
        budget the shape was planned under (:meth:`_share_budget`)."""
        kind = budget_kind(self.budget)
        if kind in ("share", "activations"):
            error = in_user_terms(error, graph, self.budget)
            if budget != self.budget:
                error = error.in_terms(fixed_bytes=error.fixed_bytes, shown=error.shown,
                                       budget_text=f"{self.budget!r} as it was resolved for a larger batch")
        error = error.with_fixed_parts(fixed_parts(self.model.optimizer))
        samples = key[0][0] if key and key[0] else None
        larger = [shape[0][0] for shape in self.plans if larger_shapes(shape, key) and shape[0]]
        label = _batch_label_of(key)
        if samples is None or not larger:
            return error.for_batch(label)
        return error.for_batch(
            f"{label}, the last batch: {samples} samples of {max(larger)}",
            advice=(f"The last batch is smaller ({samples} samples), so it is planned on its own; batching with "
                    "drop_remainder=True (tf.data) or a batch size that divides the number of samples avoids its "
                    "shape."))

    def _reads_min_allocator(self, result, strategy=None) -> bool:
        """Whether the allocator's peak of a ``"min"`` plan's step is read (not held: no
        smaller plan to fall back on) and kept in :attr:`allocator_peaks`: with
        ``allocator_check`` None, on one device, without XLA."""
        return (budget_kind(self.budget) == "min" and self.allocator_check is None and strategy is None
                and not self._jit_compile and result.budget_bytes is not None)

    def _checks_allocator(self, result, strategy=None, budget=None, key=None) -> bool:
        """Whether ``result``'s step is held to its budget for the allocator's peak
        (``allocator_check``; None: see the class docstring, and not on a strategy's CPU
        replica; under a strategy whose replicas share one allocator, never:
        :func:`replica_allocators`). ``budget``: the shape's
        (:meth:`_share_budget`; default the budget as given) for the batch shape ``key``. The
        bytes a share was resolved to for a larger batch shape are held like bytes,
        also above this shape's checkpoint-all peak, where the larger batch's plan was held;
        where it was not (the share recomputed nothing there), neither is this shape's: a last
        batch is not refused for what the full batches were never held to (with oneDNN off a
        half batch's convolution scratch peaked above the full batch's bytes)."""
        floor = None if budget is None or budget == self.budget else share_floor(
            self.budget, [(shape, plan.budget_bytes) for shape, plan in self.plans.items()], key)
        if floor is not None:
            wanted = wants_allocator_check(self.allocator_check, self.budget, self.plans[floor[1]])
        else:
            wanted = wants_allocator_check(self.allocator_check, self.budget if budget is None else budget, result)
        if not wanted:
            return False
        if strategy is None:
            return True
        allocators = replica_allocators(strategy)
        if self.allocator_check is None and (allocators is None or allocators[0].startswith("CPU")):
            # The distributed input pipeline's prefetched batches share a CPU replica's
            # allocator: its reads are not the step's, and held them a third above what the
            # steps used (MirroredStrategy on one CPU, benchmarks/results/user_check_5.md).
            logger.info("allocator_check not run by default on a CPU replica of %s (the input pipeline shares its "
                        "allocator): the budget holds for requested bytes; allocator_check=True runs it",
                        type(strategy).__name__)
            return False
        if allocators is None:
            log = logger.warning if self.allocator_check else logger.info
            log("allocator_check skipped: the %d replicas of %s share one allocator (logical devices of one CPU), "
                "which cannot be read per device; the budget holds for each replica's requested bytes (the plan's "
                "prediction)", strategy.num_replicas_in_sync, type(strategy).__name__)
            return False
        return True

    def _within_allocator(self, result, step, x, y, sample_weight, options, strategy=None, exceeded=None):
        """Re-plans until the step's allocator peak is within the budget (``allocator_check``;
        :func:`~tfremat.allocator_check.hold_allocator_peak`, from the planning budget a check
        accepted before for this graph and budget); under a strategy, the largest peak over
        the replicas' allocators, each replica running the step on ``x, y`` (one replica's
        batch). ``exceeded``: ``(planning budget, peak)`` of a plan that a training step found
        over the budget, planned again first.

        Returns ``(result, step, planning budget)``; the planning budget is None when the
        allocator keeps no statistics (nothing was held)."""
        hooks = self._allocator_hooks(result.extraction.graph, x, y, sample_weight, options, strategy)

        def accepted(candidate, peak):
            self.allocator_peaks[_shape_key(x, y)] = peak
            if self._jit_compile:
                self._warn_xla_allocator(candidate, x, y, sample_weight, hooks.devices, result.budget_bytes, peak)

        return hold_allocator_peak(result, step, hooks.plan_at, hooks.read_peak, strategy=self.strategy,
                                   options=options, cache=self.cache, exceeded=exceeded, accepted=accepted,
                                   log=logger, count=hooks.count, unchecked_from=hooks.unchecked_from)

    def _allocator_hooks(self, graph, x, y, sample_weight, options, strategy=None) -> _CheckHooks:
        """What the allocator check of the batch ``x, y`` (of ``graph``) reads and plans with,
        for :meth:`_within_allocator` and :meth:`_read_refusal` alike (under a strategy, each
        replica runs the step on ``x, y``, one replica's batch)."""
        model = self.model
        devices = [None] if strategy is None else replica_allocators(strategy)
        # XLA takes one block for all of a step's temporaries, which the allocator may serve
        # from a chunk up to twice its size: what XLA requests is held instead.
        count = "requested" if self._jit_compile else "allocator"
        # A share resolved for a larger batch is held as bytes (_checks_allocator).
        shape_budget = self._budgets.get(_shape_key(x, y), self.budget) if self._budgets else self.budget

        def read_peak(candidate):
            peaks = [allocator_peak(candidate, model, x, y, sample_weight, device=d, count=count) for d in devices]
            return None if None in peaks else max(peaks)

        return _CheckHooks(read_peak, lambda current, planning: self._replanned(current, planning, options, strategy),
                           count, unchecked_from(self.allocator_check, shape_budget, graph), devices)

    def _read_refusal(self, error: InfeasibleBudgetError, extraction, budget, key: tuple, x, y, sample_weight,
                      options: dict, strategy=None) -> InfeasibleBudgetError:
        """The planner's refusal of ``budget`` for the batch shape ``key``, naming a smallest
        budget the allocator check accepts where the check would hold it
        (:func:`~tfremat.allocator_check.planner_refusal_read`)."""
        from tfremat.static_graph.compile import compile_step

        def plan_smallest(planning_budget):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*at or above the checkpoint-all peak")
                planned = plan_graph(extraction.graph, planning_budget, self.strategy, cache=self.cache, verbose=0,
                                     **options)
            planned = with_rounding(dataclasses.replace(planned, extraction=extraction))
            return planned, compile_step(extraction, planned.schedule, optimizer=self.model.optimizer,
                                         strategy=strategy, return_outputs=True, jit_compile=self._jit_compile)

        hooks = self._allocator_hooks(extraction.graph, x, y, sample_weight, options, strategy)
        return planner_refusal_read(error, plan_smallest, hooks.plan_at, hooks.read_peak,
                                    lambda planned: self._checks_allocator(planned, strategy, budget, key),
                                    strategy=self.strategy, options=options, cache=self.cache, log=logger,
                                    count=hooks.count, unchecked_from=hooks.unchecked_from)

    def _warn_xla_allocator(self, step, x, y, sample_weight, devices, budget: int, requested: int) -> None:
        """Warns when an XLA step whose requested bytes fit the budget peaks over it in the
        allocator: XLA asks for all its temporaries as one block, which BFC may serve from a
        chunk up to twice its size, and no plan decides that (a 4-conv CNN at "70% of
        activations": 19.39 MiB requested, 32.95 MiB allocator, 23.93 MiB budget;
        benchmarks/results/user_check.md)."""
        peaks = [allocator_peak(step, self.model, x, y, sample_weight, device=d, count="allocator") for d in devices]
        if None in peaks or max(peaks) <= budget:
            return
        logger.warning("with jit_compile=True the step requests %s, within the budget %s, but the allocator's peak "
                       "can reach %s (the largest read in other states of its free chunks, plus a slack): XLA takes its temporaries as one block, which the allocator may serve from a chunk up "
                       "to twice its size; the budget holds for requested bytes. Compile the model with "
                       "jit_compile=False to hold the allocator's peak", format_bytes(requested), format_bytes(budget),
                       format_bytes(max(peaks)))

    def _watched_step(self, step, x, y, sample_weight):
        """Runs ``step`` on a batch whose shape a check accepted a plan for, during the first
        :data:`~tfremat.allocator_check.WATCHED_STEPS` steps: reads the step's allocator peak
        and, over the budget, plans again (from the next step on) under the budget less the
        excess, as the check does. The check's runs before training see other free chunks
        than training's steps, which can peak higher (docs/memory-model.md). A ``"min"``
        plan's steps (``planning`` None) are read only: :attr:`allocator_peaks` keeps the
        largest of its check and these reads."""
        key = _shape_key(x, y)
        remaining, planning, options = self._watched[key]
        model = self.model
        resident = [*model.variables, *model.optimizer.variables, *tf.nest.flatten((x, y))]
        outputs, peak = training_step_peak(lambda: step(x, y, sample_weight), None, resident)
        result = self.plans[key]
        if planning is None:
            self.allocator_peaks[key] = max(self.allocator_peaks.get(key, 0), peak)
        if planning is None or peak <= result.budget_bytes:
            if remaining > 1:
                self._watched[key][0] = remaining - 1
            else:
                del self._watched[key]
            return outputs
        logger.info("a training step's allocator peak %s exceeds the budget %s: planning again",
                    format_bytes(peak), format_bytes(result.budget_bytes))
        # Its own line, with the batch's prefix, for the solver's progress (_replanned).
        self._replanning = PhaseProgress(_batch_label(x), bool(self.verbose))
        self._replanning.start(f"a training step's allocator peak {format_bytes(peak)} exceeds the budget "
                               f"{format_bytes(result.budget_bytes)}: planning again")
        try:
            result, new_step, planning = self._within_allocator(result, step, x, y, sample_weight, options,
                                                                exceeded=(planning, peak))
            self._replanning.done(plan_summary(result))
        except InfeasibleBudgetError as error:
            # The budget as the user wrote it, not the planning budget the step was over.
            raise self._refusal(error, result.extraction.graph, key, self._budgets.get(key, self.budget)) \
                from error.__cause__
        finally:
            self._replanning.close()
            self._replanning = None
        self.plans[key], self._steps[key] = result, new_step
        self._watched[key] = [WATCHED_STEPS, planning, options]
        return outputs

    def _replanned(self, result, planning_budget: int, options: dict, strategy=None):
        """``result``'s graph planned under ``planning_budget`` (the new result's budget
        until the check accepts it; :func:`~tfremat.allocator_check.replan`) and its
        compiled step."""
        from tfremat.static_graph.compile import compile_step

        # The solver's progress on the open phase's line, with the batch's prefix.
        phases = self._tracing or self._replanning
        progress = ({"progress": phases.solver_progress(result.extraction.graph.total_cost)}
                    if phases is not None and get_strategy(self.strategy).takes_solver_options else {})
        replanned = with_rounding(replan(result, planning_budget, self.strategy, {**options, **progress}, self.cache,
                                         0 if progress else self.verbose, planner=plan_graph, log=logger))
        step = compile_step(replanned.extraction, replanned.schedule, optimizer=self.model.optimizer,
                            strategy=strategy, return_outputs=True, jit_compile=self._jit_compile)
        return replanned, step

    def _train_function(self, iterator):
        if not self._batch_announced:
            # Left on the model by a fit that ended without on_train_end, and called by a
            # fit this callback is no part of (module docstring).
            own = self._original_train_function
            self._restore()
            if own is None:
                own = self.model.make_train_function(force=True)
            return own(iterator)
        self._batch_announced = False
        try:
            return self._remat_step(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            raise  # the end of an epoch's data: Keras catches it and goes on training
        except BaseException:
            if self._tracing is not None:
                self._tracing.close()
                self._tracing = None
            self._restore()
            raise

    def _remat_step(self, iterator):
        data = next(iterator)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if tf.nest.is_nested(sample_weight):
            raise CompileError(
                "sample weights given per output (a list or dict) are not supported by the rematerialized step; "
                "pass one array of sample weights, which weights every output's loss"
            )
        if y is None:
            raise ArgumentError(
                "the batch has no labels (y is None): tfremat trains on (x, y) batches; pass y to model.fit, or x "
                "as a tf.data.Dataset yielding (x, y)"
            )
        model, strategy = self.model, self._strategy
        if strategy is not None:
            # Planned for one replica's batch; Keras's train function gets the distributed
            # iterator, whose batches hold each replica's part (DistributedTrainStep).
            step = self._step_for(*replica_batch(strategy, (x, y, sample_weight)), strategy=strategy)
            logs = step(x, y, sample_weight)
        else:
            step = self._step_for(x, y, sample_weight)
            if _shape_key(x, y) in self._watched:
                loss, y_pred = self._watched_step(step, x, y, sample_weight)
            else:
                loss, y_pred = step(x, y, sample_weight)
            key = _shape_key(x, y)
            if self.plans[key].step_sequential != step.sequential:
                # A step that calls functions leaves the single-threaded executor when it
                # first runs; its planned time then drops plain training's overlap.
                self.plans[key] = dataclasses.replace(self.plans[key], step_sequential=step.sequential)
            logs = update_metrics(model, step, loss, x, y, y_pred, sample_weight)
        if self._tracing is not None:
            self._tracing.done("traced and ran the first step")
            self._tracing = None
        return logs


class _CheckHooks(NamedTuple):
    """What :class:`RematCallback`'s allocator check of one batch reads and plans with."""

    #: ``read_peak(step)``: the step's held peak, the largest over a strategy's replicas.
    read_peak: Callable
    #: ``plan_at(result, planning budget) -> (result, step)``.
    plan_at: Callable
    #: What ``read_peak`` reads: ``"allocator"``, or ``"requested"`` under XLA.
    count: str
    #: :func:`~tfremat.allocator_check.unchecked_from` of the batch's budget.
    unchecked_from: int | None
    #: The replicas' allocators (``[None]``: the default device's).
    devices: list


def _batch_label(x) -> str:
    """The prefix of a batch shape's progress lines: ``tfremat batch (8, 64, 64, 3)``."""
    shapes = [tuple(t.shape) for t in tf.nest.flatten(x)]
    return f"tfremat batch {shapes[0] if len(shapes) == 1 else shapes}"


def _batch_label_of(key: tuple) -> str:
    """A batch shape ``key`` (:func:`_shape_key`) as a refusal names it: its first input's shape."""
    return f"batch {key[0]}" if key else "batch"


def _shape_key(x, y) -> tuple:
    """The batch shapes a step is planned and compiled for."""
    return tuple(tuple(t.shape) for t in tf.nest.flatten((x, y)))


def _training_setup(model) -> tuple:
    """What a compiled step is specific to, as objects compared by identity: the model,
    its optimizer and loss, the compiled loss (a new one at every ``model.compile``: new
    loss weights) and the trainable variables (a layer frozen and the model recompiled).
    Keyed by the first three alone, a reused callback kept training a frozen layer and
    the old loss weights after a recompile."""
    return (model, model.optimizer, model.loss, getattr(model, "_compile_loss", None), *model.trainable_variables)


#: Strategies refused by :func:`check_distribute_strategy`, by the name their classes begin
#: with (``TPUStrategy`` and ``ParameterServerStrategy`` cannot be built without their
#: hardware or cluster), and why.
_REFUSED_STRATEGIES = {
    "TPUStrategy": "its step is compiled by XLA, which ignores the control dependencies that order "
                   "recomputations and merges them back",
    "ParameterServerStrategy": "its variables live on parameter servers and the workers step asynchronously, "
                               "which the per-device memory model does not describe",
    "CentralStorageStrategy": "its variables and gradient reductions live on one central device, which the "
                              "per-device memory model does not describe",
}


def check_distribute_strategy(strategy) -> None:
    """Raises :class:`TfrematError` in one line for a ``tf.distribute`` strategy tfremat
    cannot train under, naming it and what works instead.

    Accepted: none (the default strategy), ``OneDeviceStrategy``, ``MirroredStrategy`` (one
    machine, several devices) and ``MultiWorkerMirroredStrategy`` (several machines, trained
    by :func:`tfremat.fit`'s own loop, :mod:`tfremat.multi_worker`): every replica holds all
    the variables and runs the whole step on its part of the batch, so one plan for one
    replica's batch holds on every device. Refused, by class name so that strategies which
    cannot be built here are recognized too: ``TPUStrategy``, ``ParameterServerStrategy``
    and ``CentralStorageStrategy`` (:data:`_REFUSED_STRATEGIES`).
    """
    for cls in type(strategy).__mro__:
        for name, reason in _REFUSED_STRATEGIES.items():
            if cls.__name__.startswith(name):
                raise TfrematError(
                    f"tfremat does not train under {type(strategy).__name__}: {reason}; build and compile the model "
                    "under tf.distribute.MirroredStrategy (one machine, several devices), MultiWorkerMirroredStrategy "
                    "(several machines) or OneDeviceStrategy instead"
                )


def is_distributed(strategy) -> bool:
    """Whether ``strategy`` is a ``tf.distribute`` strategy other than the default one (no
    strategy), i.e. whether Keras's train function gets distributed batches."""
    with strategy.scope():
        return tf.distribute.has_strategy()


def replica_batch(strategy, data):
    """The first replica's part of a distributed batch ``data`` (any structure of
    per-replica values; None left as is): the batch the plan is made for.

    The budget is per device: each replica runs the step on its own part (the global batch
    over the replicas), so one plan for that part holds on every replica. A global batch
    that does not divide evenly is split with the first replicas taking
    ``ceil(global / replicas)`` samples and the last the rest (7 over 3: 3, 3, 1), so the
    first replica's part is the largest and its plan bounds the others' memory.
    """
    return tf.nest.map_structure(
        lambda value: value if value is None else strategy.experimental_local_results(value)[0], data)
