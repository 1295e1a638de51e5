"""``value_and_grad``: the rematerialized counterpart of a ``tf.GradientTape`` block, for
custom training loops and models that override ``train_step`` (GANs, contrastive models).

The loss function is called once on ``keras.Input`` placeholders shaped like the example
arguments: Keras records its layer calls and ``keras.ops`` as a functional graph whose
output is the loss, the same graph a functional model has. That graph is wrapped in a
``keras.Model``, extracted with a loss that passes its scalar output through
(:mod:`tfremat.extract`), planned (:mod:`tfremat.planner`) and compiled into a step that
returns the gradients instead of applying an optimizer
(:func:`tfremat.static_graph.compile.compile_step` with ``apply_gradients=False``), so the
weight gradients are counted as resident until the step ends (``weight_grads="fixed"``).
Like :func:`tfremat.fit`, the budget is then held for the allocator's peak, not only for the
bytes the step requests (:func:`tfremat.allocator_check.hold_allocator_peak`).

What the placeholders cannot record would make the compiled step compute something else
than the tape, so it is refused when the function is traced: Python control flow on tensor
values and TensorFlow ops (``tf.py_function`` included) fail on placeholders; a layer called
without ``training=True`` would be trained in training mode; and a value computed from no
argument (a variable read outside a layer, such as ``sum(model.losses)``, or random numbers
drawn in the function) would be frozen at its value when the step was planned.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import warnings
from collections.abc import Callable

import keras
import networkx as nx
import numpy as np
import tensorflow as tf

from tfremat.allocator_check import (
    hold_allocator_peak,
    perturbing_sizes,
    planner_refusal_read,
    replan,
    step_allocator_peak,
    unchecked_from,
    wants_allocator_check,
)
from tfremat.budget import budget_kind, check_budget, format_bytes, share_floor
from tfremat.cache import ScheduleCache
from tfremat.errors import ArgumentError, ExtractionError, InfeasibleBudgetError
from tfremat.extract.extractor import COST_MODELS, extract
from tfremat.extract.opening import DEFAULT_GRANULARITY, GRANULARITIES
from tfremat.model_planning import wants_implementations
from tfremat.plan.registry import in_user_terms, parse_graph_budget
from tfremat.planner import PlanResult, check_cache_argument, plan_graph, split_solver_options

__all__ = ["value_and_grad", "ValueAndGrad"]

logger = logging.getLogger(__name__)


def value_and_grad(fn: Callable, budget, *example_args, strategy: str = "optimal", cost_model: str = "profile",
                   granularity: str = DEFAULT_GRANULARITY, cache: bool | str | ScheduleCache = True,
                   verbose: int = 1, jit_compile: bool = False, allocator_check: bool | None = None,
                   **options) -> ValueAndGrad:
    """Plans ``fn``'s gradient under ``budget``: ``g(*args)`` returns ``(loss, gradients)``.

    ``g`` replaces a ``tf.GradientTape`` block in a custom training loop or a ``train_step``::

        with tf.GradientTape() as tape:              g = tfremat.value_and_grad(fn, "50%", x, y)
            loss = fn(x, y)                          ...
        grads = tape.gradient(loss, variables)       loss, grads = g(x, y)

    ``fn(*args)`` must return a scalar loss computed from its arguments by Keras layers and
    models called with ``training=True`` and by ``keras.ops`` (Keras losses included); a
    model may be called several times (a GAN's discriminator on real and fake images, an
    encoder on two views). Planning happens here, from the example arguments' shapes and
    dtypes; a call with other shapes plans again. ``g`` can be called eagerly, inside a
    ``tf.function`` and inside a model's ``train_step``.

    Args:
        fn: the loss function.
        budget: as for :func:`tfremat.fit`: bytes, "3.5GiB", a share of the checkpoint-all
            peak ("50%", 0.5), "50% of activations" or "min". It covers the step: the
            arguments, the variables, their gradients and the activations (an optimizer's
            slots are not counted: the update runs outside ``g``). It holds for the
            allocator's peak of ``g``'s step (``allocator_check``), as for :func:`tfremat.fit`.
        *example_args: tensors or arrays (or nested lists, tuples and dicts of them) like
            the ones ``g`` will be called with; their static shapes and dtypes are planned for.
        strategy: the strategy name (default "optimal", the MILP).
        cost_model: "profile" (timed on this device) or "flops".
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        cache: the schedule cache; False also turns off the profile cache.
        verbose: 0 silences planning progress.
        jit_compile: compile the planned step with XLA, recomputations kept
            (:func:`tfremat.static_graph.compile.compile_step`'s ``jit_compile``), e.g.
            when the ``train_step`` that calls ``g`` runs under a model compiled with
            ``jit_compile=True``.
        allocator_check: hold the budget for the device allocator's peak, where
            out-of-memory happens, not only for the bytes the step requests (see
            :class:`tfremat.keras.RematCallback`): each new argument shape's step is run
            eight times when it is planned (one warm-up, three reads on zeros shaped like the
            arguments and four more with the allocator's free chunks put in other states, the
            layers' variables and random state put back), and planned again under a smaller
            planning budget while the held peak exceeds the budget. With
            ``jit_compile`` the bytes XLA requests are held instead. None (default): for
            every budget but ``"min"`` and shares at or above the checkpoint-all peak
            (:func:`tfremat.allocator_check.wants_allocator_check`); False holds the budget
            for requested bytes only (the plan's prediction).
        **options: the strategy's solver options (``solver``, ``time_limit``, ...) or an
            offloading strategy's ``bandwidth``, as :func:`tfremat.fit` takes them.

    Returns:
        A :class:`ValueAndGrad`.

    Raises:
        ArgumentError: ``fn`` is not callable, ``budget`` is None, no example arguments or
            one that is no tensor, an unknown strategy, option or cost model, or a
            ``jit_compile`` or ``allocator_check`` that is not a bool (None for the latter).
        ExtractionError: ``fn`` cannot be traced on placeholders (see the module docstring);
            one line naming the cause.
        InfeasibleBudgetError: no schedule of the strategy fits ``budget``, for the
            allocator's peak where it is checked.
    """
    if not callable(fn):
        raise ArgumentError(f"fn must be a callable returning the loss, got {type(fn).__name__}")
    if budget is None:
        raise ArgumentError("budget=None: value_and_grad needs a budget (bytes, '3.5GiB' or '50%'); without one every "
                            "activation is kept, which is what tf.GradientTape does already")
    check_budget(budget)
    if not example_args:
        raise ArgumentError("value_and_grad needs example arguments after the budget: tensors shaped like those g "
                            "will be called with (value_and_grad(fn, budget, x, y))")
    _, per_strategy = split_solver_options([strategy], options)
    if cost_model not in COST_MODELS:
        raise ArgumentError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    if granularity not in GRANULARITIES:
        raise ArgumentError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    check_cache_argument(cache)
    if not isinstance(jit_compile, bool):
        raise ArgumentError(f"jit_compile must be True or False, got {jit_compile!r}")
    if allocator_check is not None and not isinstance(allocator_check, bool):
        raise ArgumentError(f"allocator_check must be True, False or None (the default: every budget but 'min' and "
                            f"shares at or above the checkpoint-all peak), got {allocator_check!r}")
    settings = _Settings(budget, strategy, cost_model, granularity, cache, verbose, per_strategy.get(strategy, {}),
                         jit_compile, allocator_check)
    return ValueAndGrad(fn, settings, example_args)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What every batch shape is planned with."""

    budget: object
    strategy: str
    cost_model: str
    granularity: str
    cache: object
    verbose: int
    options: dict
    jit_compile: bool = False
    allocator_check: bool | None = None


#: What ``g``'s fixed memory holds, as a refused budget names it: no optimizer state.
_FIXED_PARTS = ("weights", "gradients", "the arguments")


class ValueAndGrad:
    """``fn``'s loss and gradients under a memory budget; build it with :func:`value_and_grad`.

    Attributes:
        trainable_variables: every trainable variable ``fn`` reads through its layers, the
            layers' own variable objects, in the order of the gradients ``g`` returns
            (``optimizer.apply_gradients(zip(grads, g.trainable_variables))``; pick a
            model's by identity).
        plans: ``{argument signature: PlanResult}`` for every signature planned so far.
    """

    def __init__(self, fn: Callable, settings: _Settings, example_args: tuple):
        self._fn = fn
        self._settings = settings
        self._structure = _signature(example_args)[0]
        self._steps: dict = {}
        self.plans: dict = {}
        self._label = _eagerly(lambda: tf.zeros(()))  # the extraction's label: the loss reads none
        self._example_key = _eagerly(lambda: self._plan_for(example_args))
        self.trainable_variables = list(self._steps[self._example_key].variables)

    @property
    def plan(self) -> PlanResult:
        """The plan for the example arguments' shapes (predicted peak, overhead, solver facts)."""
        return self.plans[self._example_key]

    def __call__(self, *args):
        """Returns ``(loss, gradients)``: the scalar loss and one gradient per variable of
        :attr:`trainable_variables` (None where the loss does not depend on it).

        Raises:
            ArgumentError: the arguments differ in structure from the example's, or a
                dimension is unknown while tracing (give the ``tf.function`` or the
                dataset a fixed batch size).
        """
        key = _signature(args)
        if key not in self._steps:
            unknown = [shape for shape, _ in key[1] if None in shape]
            if unknown:
                raise ArgumentError(f"g was called with a tensor of shape {unknown[0]} while a tf.function traced: "
                                    "each batch shape gets its own plan, so give the tf.function an input_signature "
                                    "with the batch size, or the dataset a fixed one (batch(..., drop_remainder=True))")
            _eagerly(lambda: self._plan_for(args))
            variables = self._steps[key].variables
            if [id(v) for v in variables] != [id(v) for v in self.trainable_variables]:
                raise ExtractionError(f"fn reads other trainable variables at argument shapes {key[1]} than at the "
                                      "example's; g lists one set of variables, so fn must read the same at every shape")
        return self._steps[key](tf.nest.flatten(args), self._label)

    def _plan_for(self, args: tuple):
        """Traces ``fn`` on placeholders like ``args``, plans and compiles its step, held for
        the allocator's peak (``allocator_check``); returns its key.

        Raises:
            InfeasibleBudgetError: naming what ``g``'s fixed memory holds (no optimizer state).
        """
        key = _signature(args)
        structure, specs = key
        if structure != self._structure:
            raise ArgumentError(f"g was called with arguments structured as {structure}; it was made for "
                                f"{self._structure}")
        settings = self._settings
        model = trace_loss(self._fn, args)
        samples = [np.broadcast_to(np.zeros((), tf.as_dtype(dtype).as_numpy_dtype), shape) for shape, dtype in specs]
        extraction = extract(model, sample_batch=(samples, np.zeros((), np.float32)), loss=_output_is_loss,
                             cost_model=settings.cost_model, granularity=settings.granularity,
                             use_cache=settings.cache is not False and settings.cache is not None,
                             weight_grads="fixed", implementations=wants_implementations([settings.strategy]),
                             xla="memory" if settings.jit_compile else False)
        budget = self._share_budget(specs, extraction.graph)

        def plan_at_budget(planning_budget):
            with warnings.catch_warnings():
                if planning_budget != settings.budget:
                    # Above this shape's checkpoint-all peak is what the rule gives it, not a budget to lower.
                    warnings.filterwarnings("ignore", message=".*at or above the checkpoint-all peak")
                planned = plan_graph(extraction.graph, planning_budget, settings.strategy, cache=settings.cache,
                                     verbose=settings.verbose, **settings.options)
            planned = dataclasses.replace(planned, extraction=extraction)
            return planned, self._compiled(planned)

        def checks(planned):
            return wants_allocator_check(settings.allocator_check, settings.budget, planned)

        try:
            try:
                result, step = plan_at_budget(budget)
            except InfeasibleBudgetError as error:
                plan_at, read_peak, count = self._allocator_hooks(specs, model)
                raise planner_refusal_read(error, plan_at_budget, plan_at, read_peak, checks,
                                           strategy=settings.strategy, options=settings.options, cache=settings.cache,
                                           count=count, unchecked_from=unchecked_from(
                                               settings.allocator_check, settings.budget, extraction.graph)) \
                    from error.__cause__
            if checks(result):
                result, step, _ = self._within_allocator(result, step, specs, model)
        except InfeasibleBudgetError as error:
            if budget_kind(settings.budget) in ("share", "activations"):
                # An allocator check's refusal, or a budget kept from a larger shape, is in bytes.
                error = in_user_terms(error, extraction.graph, settings.budget)
                if budget != settings.budget:
                    error = error.in_terms(fixed_bytes=error.fixed_bytes, shown=error.shown,
                                           budget_text=f"{settings.budget!r} as it was resolved for larger arguments")
            raise error.with_fixed_parts(_FIXED_PARTS).for_batch(f"arguments of shapes {[s for s, _ in specs]}") \
                from error.__cause__
        self.plans[key] = result
        self._steps[key] = step
        return key

    def _share_budget(self, specs: tuple, graph):
        """The budget arguments of ``specs`` are planned under: a share is never resolved to
        fewer bytes than for larger arguments (the same dtypes) planned before
        (:func:`~tfremat.budget.share_floor`: a smaller last batch keeps the full batches')."""
        budget = self._settings.budget
        dtypes = tuple(dtype for _, dtype in specs)
        planned = [(tuple(shape for shape, _ in key[1]), plan.budget_bytes) for key, plan in self.plans.items()
                   if tuple(dtype for _, dtype in key[1]) == dtypes]
        floor = share_floor(budget, planned, tuple(shape for shape, _ in specs))
        if floor is None or floor[0] <= parse_graph_budget(graph, budget):
            return budget
        logger.info("arguments of shapes %s: planning under %s, the %r of larger arguments %s (more than it is here)",
                    [shape for shape, _ in specs], format_bytes(floor[0]), budget, list(floor[1]))
        return floor[0]

    def _compiled(self, result: PlanResult):
        """``result``'s step, returning the gradients (no optimizer)."""
        from tfremat.static_graph.compile import compile_step

        return compile_step(result.extraction, result.schedule, apply_gradients=False,
                            jit_compile=self._settings.jit_compile)

    def _within_allocator(self, result: PlanResult, step, specs: tuple, model) -> tuple:
        """``result`` and ``step`` planned again until the step's allocator peak is within the
        budget (:func:`~tfremat.allocator_check.hold_allocator_peak`): read on zeros shaped
        like the arguments (the call being planned may be a trace's, whose arguments hold no
        values), ``model``'s variables (the traced loss's layers: the weights, batch-norm
        statistics and seed generators the step reads and moves) resident and put back."""
        settings = self._settings
        plan_at, read_peak, count = self._allocator_hooks(specs, model)
        return hold_allocator_peak(result, step, plan_at, read_peak, strategy=settings.strategy,
                                   options=settings.options, cache=settings.cache, count=count,
                                   unchecked_from=unchecked_from(settings.allocator_check, settings.budget,
                                                                 result.extraction.graph))

    def _allocator_hooks(self, specs: tuple, model) -> tuple:
        """``(plan_at, read_peak, count)`` of the allocator check of arguments shaped ``specs``,
        for :meth:`_within_allocator` and a planner's refusal alike
        (:func:`~tfremat.allocator_check.planner_refusal_read`): the step read on zeros shaped
        like the arguments, ``model``'s variables resident and put back; ``count`` what it
        reads."""
        settings = self._settings
        arguments = [tf.zeros(shape, dtype) for shape, dtype in specs]
        variables = list(model.variables)
        # XLA takes one block for all of a step's temporaries, which the allocator may serve
        # from a chunk up to twice its size: what XLA requests is held instead (as the callback).
        count = "requested" if settings.jit_compile else "allocator"

        def read_peak(candidate):
            return step_allocator_peak(candidate, arguments, self._label, variables, count=count,
                                       sizes=perturbing_sizes(getattr(candidate, "graph", None)))

        def plan_at(current, planning_budget):
            replanned = replan(current, planning_budget, settings.strategy, settings.options, settings.cache,
                               settings.verbose)
            return replanned, self._compiled(replanned)

        return plan_at, read_peak, count


def _eagerly(work: Callable):
    """``work()``, run eagerly also while a ``tf.function`` (a ``train_step``) traces.

    The extraction measures each layer call eagerly under gradient tapes. ``tf.init_scope``
    would leave the trace but also stop every tape on the thread, so the extraction would
    see no gradient read any forward value; a thread of its own runs eagerly with no
    trace and no stopped tape.
    """
    if tf.executing_eagerly():
        return work()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


def _output_is_loss(y_true, y_pred):
    """The extraction's loss: the traced model's output is the loss already."""
    return y_pred


def _signature(args: tuple) -> tuple:
    """``(structure, ((shape, dtype) per tensor))``: what a plan is specific to.

    Raises:
        ArgumentError: an argument holds something that is no tensor or array.
    """
    specs = []
    for leaf in tf.nest.flatten(list(args)):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise ArgumentError(f"the arguments of g must be tensors or arrays (or lists, tuples and dicts of them), "
                                f"got a {type(leaf).__name__}; let fn close over other values")
        specs.append((tuple(leaf.shape), tf.as_dtype(leaf.dtype).name))
    return repr(tf.nest.map_structure(lambda _: "T", list(args))), tuple(specs)


def trace_loss(fn: Callable, args: tuple):
    """``fn`` recorded on ``keras.Input`` placeholders like ``args``, as a ``keras.Model``
    from the flattened arguments to the loss.

    ``fn`` is traced twice: a value it computes from no argument (random numbers drawn in
    it) differs between the two traces, and would be frozen in the step.

    Raises:
        ExtractionError: what the module docstring lists, naming the cause.
    """
    model, constants = _record(fn, args)
    _, again = _record(fn, args)
    if len(constants) != len(again) or not all(np.array_equal(a, b) for a, b in zip(constants, again)):
        raise ExtractionError("fn computes a value from no argument that changes from call to call (random "
                              "numbers?), which the planned step would freeze at its first value; draw it outside fn "
                              "and pass it to g as an argument")
    return model


def _record(fn: Callable, args: tuple):
    """One trace of ``fn``: the model, and the values of the tensors it combined with the
    placeholders (constants of the recorded graph), in graph order."""
    placeholders = tf.nest.map_structure(
        lambda leaf: keras.Input(batch_shape=tuple(leaf.shape), dtype=tf.as_dtype(leaf.dtype).name), list(args))
    with tf.GradientTape(watch_accessed_variables=True) as tape:
        try:
            loss = fn(*placeholders)
        except Exception as error:  # noqa: BLE001 - any failure on placeholders is the refusal's cause
            cause = (str(error).strip().splitlines() or [""])[0]
            raise ExtractionError(
                f"fn cannot be traced on symbolic inputs ({type(error).__name__}: {cause}); value_and_grad needs a "
                "loss built from Keras layers and keras.ops: no tf.* functions (tf.py_function included) and no "
                "Python control flow on tensor values") from None
    read = [v.path if hasattr(v, "path") else v.name for v in tape.watched_variables()]
    if read:
        raise ExtractionError(f"fn reads variable {read[0]} outside a layer call (a weight penalty such as "
                              "sum(model.losses)?), which the planned step would freeze at its current value; add "
                              "such a term and its gradient outside g")
    if not isinstance(loss, keras.KerasTensor):
        raise ExtractionError(f"fn returned a {type(loss).__name__}, not a value computed from its arguments; it must "
                              "return the loss computed from them by Keras layers and keras.ops")
    if tuple(loss.shape) != ():
        raise ExtractionError(f"fn returned a tensor of shape {tuple(loss.shape)}; it must return a scalar loss "
                              "(reduce it, e.g. keras.ops.mean)")
    inputs = tf.nest.flatten(placeholders)
    model = keras.Model(inputs, loss)
    _in_call_order(model)
    constants = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            operation = node.operation
            if node.is_input or operation is None:
                continue
            if getattr(operation, "_call_has_training_arg", False) and node.arguments.kwargs.get("training") is not True:
                raise ExtractionError(
                    f"fn calls {operation.name!r} without training=True; the planned step runs every layer in "
                    "training mode, as a training step does: call it with training=True, or call it outside fn "
                    "and pass its output as an argument", layer=operation.name)
            for value in tf.nest.flatten((node.arguments.args, node.arguments.kwargs)):
                if isinstance(value, (tf.Variable, keras.Variable)):
                    raise ExtractionError(f"fn passes variable {value.name} to {operation.name!r} directly, so no "
                                          "gradient would reach it; read variables through the layers that own them",
                                          layer=operation.name)
                if isinstance(value, tf.Tensor):
                    constants.append(np.asarray(value))
    return model, constants


def _in_call_order(model) -> None:
    """Orders the traced model's nodes so that the calls of one layer or model run in the
    order ``fn`` made them.

    Keras orders a functional graph by depth from the output, which may put a GAN's
    discriminator call on fake images before its call on real ones; each call advances
    the layers' dropout seeds and moves their batch-norm statistics, so the step would
    give other masks and statistics than the tape. The extraction walks
    ``_nodes_by_depth``, so this model (traced for the extraction alone) gets one node
    per depth, in Keras's order where it leaves a choice.
    """
    nodes = [node for depth in sorted(model._nodes_by_depth, reverse=True) for node in model._nodes_by_depth[depth]]
    position = {id(node): k for k, node in enumerate(nodes)}
    order = nx.DiGraph()
    order.add_nodes_from(range(len(nodes)))
    calls: dict[int, list] = {}
    for k, node in enumerate(nodes):
        order.add_edges_from((position[id(parent)], k) for parent in node.parent_nodes if id(parent) in position)
        if node.operation is not None and not node.is_input:
            calls.setdefault(id(node.operation), []).append(node)
    for same in calls.values():
        same.sort(key=lambda node: node.operation._inbound_nodes.index(node))
        order.add_edges_from((position[id(a)], position[id(b)]) for a, b in zip(same, same[1:]))
    ordered = list(nx.lexicographical_topological_sort(order))
    model._nodes_by_depth = {len(nodes) - 1 - rank: [nodes[k]] for rank, k in enumerate(ordered)}
