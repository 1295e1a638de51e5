"""Planning a Keras model: its graph extracted from one batch, then :mod:`tfremat.planner`.

:func:`plan_model` is what :func:`tfremat.plan_model`, :func:`tfremat.compare`, the callback
and the command line call; the checks of a model, its data and its loss and optimizer, and
:func:`synthetic_batch` (the made-up batch extraction and measurement run on), live here.
"""

from __future__ import annotations

import dataclasses
import warnings

from tfremat.cache import ScheduleCache
from tfremat.errors import ArgumentError, InfeasibleBudgetError, TfrematError, fixed_parts, is_int
from tfremat.graph import DFGraph
from tfremat.planner import PlanResult, check_cache_argument, plan_graph
from tfremat.strategies import get_strategy

__all__ = [
    "plan_model", "extract_model", "wants_implementations", "check_keras_model", "sample_batch", "build_from_batch",
    "check_batch_ranks", "loss_and_optimizer",
    "keras_optimizer", "synthetic_batch", "check_exact_gradients", "exact_only_options", "with_rounding",
]


def check_keras_model(model) -> None:
    """Raises unless ``model`` is a ``keras.Model``, before any work (None got as far as the
    loss lookup and was told to compile itself). A subclassed model passes: the extraction
    wraps it from the batch (:func:`~tfremat.extract.layer_graph.functional_model`); so does
    a Sequential model without an ``Input``, which :func:`sample_batch` builds.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``.
    """
    import keras

    if not isinstance(model, keras.Model):
        hint = "; a DFGraph is planned by tfremat.planner.plan_graph / compare_graph" if isinstance(model, DFGraph) else ""
        raise ArgumentError(f"model must be a keras.Model (Functional, Sequential or subclassed), got "
                            f"{type(model).__name__}{hint}")


def sample_batch(model, x, y, batch_size: int | None):
    """One batch (x, y) from arrays or a ``tf.data.Dataset``, for extraction.

    Every input and label array is checked, not x's first alone: a label array shorter
    than the batch reached Keras as a shape error, a Python list as an AttributeError. A
    Sequential ``model`` without an ``Input`` is built from the batch's shape first, as
    ``model.fit`` builds it on its first batch; then the batch's ranks are checked against
    the model's inputs (:func:`check_batch_ranks`), before the sample counts, which an
    unbatched dataset's single samples would fail with a misleading count.
    """
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        element = next(iter(x.take(1)), None)
        if element is None:
            raise ArgumentError("x: the tf.data.Dataset yields no batch (it is empty): the schedule is planned on its "
                                "first batch; pass a dataset holding the training data")
        if not isinstance(element, (tuple, list)) or len(element) < 2:
            raise ArgumentError("x: a tf.data.Dataset must yield (x, y) batches")
        build_from_batch(model, element[0])
        check_batch_ranks(model, element[0])
        return element[0], element[1]
    if x is None or y is None:
        raise ArgumentError(f"{'x' if x is None else 'y'}=None: pass x and y (arrays), or x as a tf.data.Dataset "
                            "yielding (x, y) batches")
    if batch_size is None:
        raise TfrematError("batch_size is needed with array inputs: it fixes the shapes the schedule is planned for")
    if not is_int(batch_size) or batch_size < 1:
        raise ArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    arrays = {"x": tf.nest.flatten(x), "y": tf.nest.flatten(y)}
    for argument, holds in (("x", "inputs"), ("y", "outputs")):
        for array in arrays[argument]:
            shape = getattr(array, "shape", None)
            if shape is None or len(shape) == 0:
                data = x if argument == "x" else y
                raise ArgumentError(
                    f"{argument} must be arrays with a sample axis (NumPy arrays or tensors, a list or dict of them "
                    f"for several model {holds}), got a {type(data).__name__} holding a {type(array).__name__}; "
                    f"convert it with np.asarray({argument}), or pass x as a tf.data.Dataset of (x, y) batches"
                )
    build_from_batch(model, x)
    check_batch_ranks(model, x)
    for argument, data in arrays.items():
        for array in data:
            samples = int(array.shape[0])
            if samples == 0:
                raise ArgumentError(f"{argument} is empty (an array of shape {tuple(array.shape)}): the schedule is "
                                    "planned on one batch of the training data; pass the data")
            if samples < batch_size:
                raise ArgumentError(
                    f"{argument} has {samples} samples (an array of shape {tuple(array.shape)}), fewer than "
                    f"batch_size={batch_size}: the schedule is planned for one full batch; pass at least that many "
                    "samples or a smaller batch_size"
                )
    take = lambda a: tf.nest.map_structure(lambda t: t[:batch_size], a)  # noqa: E731
    return take(x), take(y)


def build_from_batch(model, x) -> None:
    """Builds a Sequential ``model`` that has no ``Input`` (and was never called) for inputs
    shaped like the batch ``x`` (any batch size), as ``model.fit`` builds it on its first
    batch; the extraction reads the layer graph, which building makes. Other models, and
    a batch of several inputs (a Sequential model takes one), are left alone."""
    import keras

    from tfremat.extract.layer_graph import functional_view

    if isinstance(model, keras.Sequential) and functional_view(model) is None and hasattr(x, "shape"):
        model.build((None, *x.shape[1:]))


def check_batch_ranks(model, x) -> None:
    """Raises ArgumentError when the batch ``x`` lacks the batch axis of ``model``'s inputs:
    an unbatched ``tf.data.Dataset`` yields single samples, whose first axis would
    otherwise be taken for the batch."""
    import keras
    import tensorflow as tf

    from tfremat.extract.layer_graph import functional_view, require_functional

    if functional_view(model) is None and not isinstance(model, keras.Sequential):
        return  # a subclassed model: its inputs are shaped by this batch (functional_model)
    for tensor, spec in zip(tf.nest.flatten(x), require_functional(model).inputs):
        if len(tensor.shape) == len(spec.shape) - 1:
            raise ArgumentError(
                f"x holds single samples of shape {tuple(tensor.shape)} where the model takes batches of shape "
                f"{tuple(spec.shape)}: batch the dataset (dataset.batch(batch_size)) before passing it (arrays need "
                "a first axis of samples)"
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
    granularity: str = "sublayer",
    cache: bool | str | ScheduleCache = True,
    verbose: int = 1,
    exact_gradients: bool = False,
    **options,
) -> PlanResult:
    """Extracts ``model``'s training graph and chooses a schedule, without training.

    A model built in a ``tf.distribute`` strategy's scope is planned for one replica, inside
    the scope or outside it: give one replica's batch (``batch_size`` per replica); with
    several replicas the gradients are resident and the all-reduce's buffers are counted
    (:func:`tfremat.extract.extract`, ``replicas``).

    Args:
        model: a Keras Functional or Sequential model (a Sequential one without ``Input`` is
            built from the first batch, as ``model.fit`` builds it).
        budget: see :func:`plan_graph`; relative budgets refer to this batch's checkpoint-all peak.
        x, y: data (arrays with ``batch_size``, or a ``tf.data.Dataset`` of batches) whose
            first batch fixes the shapes.
        loss, optimizer: default to the model's compiled ones.
        strategy: the strategy name.
        cost_model: "profile" (timed on this device) or "flops".
        granularity: what a graph node is, "layer", "sublayer" or "op" (see :mod:`tfremat.extract.opening`).
        cache: the schedule cache, as for :func:`plan_graph`; False (or None) also turns
            off the extraction's profile cache (nothing read from or written to disk).
        exact_gradients: for a strategy that chooses layer implementations (``monet``),
            offer only those whose gradients are bit-exact with the layer's default
            (:func:`exact_only_options`), so training rounds as plain Keras does. Either
            way the result names the chosen ones that change rounding
            (``PlanResult.inexact_implementations``).
        **options: strategy options (``time_limit``, ``solver``, ``exclude_implementations``, ...).

    Returns:
        A :class:`PlanResult` whose ``extraction`` holds the graph and side table.

    Raises:
        ArgumentError: ``model`` is no ``keras.Model``, data that are no arrays, fewer
            samples in x or y than ``batch_size``, ``exact_gradients`` not a bool, or an
            argument of :func:`plan_graph`.
    """
    # The arguments that need no graph are checked before the extraction, which takes
    # seconds to minutes.
    check_keras_model(model)
    get_strategy(strategy)
    check_exact_gradients(exact_gradients)
    try:
        extraction = extract_model(model, x, y, batch_size=batch_size, loss=loss, optimizer=optimizer,
                                   cost_model=cost_model, cache=cache, granularity=granularity,
                                   implementations=wants_implementations([strategy]), budget=budget,
                                   strategy=strategy)
        options = exact_only_options(extraction, strategy, exact_gradients, options)
        result = plan_graph(extraction.graph, budget, strategy, cache=cache, verbose=verbose, **options)
    except InfeasibleBudgetError as error:
        # Named as the fixed memory holds them: no optimizer state for plain SGD.
        raise error.with_fixed_parts(_fixed_parts_of(model, optimizer)) from error.__cause__
    return with_rounding(dataclasses.replace(result, extraction=extraction))


def _fixed_parts_of(model, optimizer) -> tuple[str, ...]:
    """:func:`~tfremat.errors.fixed_parts` of the optimizer ``plan_model`` trains with (the
    one given, else the model's), read from a built copy where it is not built yet: an unbuilt
    optimizer holds no slots, whatever it will keep per weight."""
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if isinstance(optimizer, str):
        optimizer = keras_optimizer(optimizer, "optimizer")
    if optimizer is not None and not getattr(optimizer, "built", True):
        optimizer = type(optimizer).from_config(optimizer.get_config())
        optimizer.build(model.trainable_variables)
    return fixed_parts(optimizer)


def check_exact_gradients(exact_gradients) -> None:
    """Raises ArgumentError unless ``exact_gradients`` is a bool."""
    if not isinstance(exact_gradients, bool):
        raise ArgumentError(f"exact_gradients={exact_gradients!r} must be True (monet chooses only layer "
                            "implementations whose gradients are bit-exact with the layer's default) or False "
                            "(any implementation; the plan names those that change rounding)")


def exact_only_options(extraction, strategy: str, exact_gradients: bool, options: dict) -> dict:
    """``options`` for ``strategy``, with ``exact_gradients`` turned into the
    strategy's ``exclude_implementations``: the ``(node, name)`` pairs of the graph's
    alternatives that are not bit-exact with their layer's default
    (:func:`tfremat.runtime.layer_variants.inexact_choices`), added to any given. Other
    strategies, and ``exact_gradients=False``, get ``options`` unchanged."""
    from tfremat.runtime.layer_variants import inexact_choices

    if not exact_gradients or not get_strategy(strategy).chooses_implementations:
        return options
    graph, table = extraction.graph, extraction.side_table
    excluded = sorted((node, alternative.name) for node, alternatives in graph.implementations.items()
                      for alternative in alternatives
                      if inexact_choices(table, {node: alternative.name}))
    given = list(options.get("exclude_implementations") or ())
    return {**options, "exclude_implementations": given + [list(pair) for pair in excluded]}


def with_rounding(result: PlanResult) -> PlanResult:
    """``result`` (planned from a model: its ``extraction`` set) with
    ``inexact_implementations``: the chosen implementations that change the gradients'
    rounding, by node name."""
    from tfremat.runtime.layer_variants import inexact_choices

    chosen = inexact_choices(result.extraction.side_table, result.schedule.implementations)
    named = tuple((result.graph.names[node], name) for node, name in sorted(chosen.items()))
    return dataclasses.replace(result, inexact_implementations=named)


def wants_implementations(strategies) -> bool:
    """Whether planning with ``strategies`` (names) needs the graph's operator
    implementations: one of them chooses among them (``monet``)."""
    from tfremat.strategies import get_strategy

    return any(get_strategy(name).chooses_implementations for name in strategies)


def extract_model(model, x, y, *, batch_size, loss, optimizer, cost_model: str, cache, granularity: str = "sublayer",
                  implementations: bool = False, weight_grads: str = "auto", replicas: int | None = None,
                  xla: bool | str = False, budget=None, strategy: str | None = None):
    """``model``'s extraction on the first batch of ``x, y``, with its (or the given) loss and
    optimizer; ``cache`` False or None turns the profile cache off as well as the schedule
    cache; ``granularity``, ``weight_grads`` and ``replicas`` as :func:`tfremat.extract.extract`
    takes them (the levels: :mod:`tfremat.extract.opening`). The model, the cache argument
    and the data are checked before anything runs, and a Sequential model without an
    ``Input`` is built from the batch (:func:`sample_batch`). ``xla="memory"`` for a step
    compiled with ``jit_compile=True`` (:func:`tfremat.extract.extract`'s ``xla``). An amount
    ``budget`` below the model's weights and optimizer state is refused before profiling
    (:func:`refuse_below_state`)."""
    from tfremat.extract.extractor import extract

    check_keras_model(model)
    check_cache_argument(cache)
    training = loss_and_optimizer(model, loss, optimizer)
    batch = sample_batch(model, x, y, batch_size)
    if budget is not None:
        refuse_below_state(model, training["optimizer"], budget, strategy)
    return extract(model, sample_batch=batch, cost_model=cost_model, granularity=granularity,
                   use_cache=cache is not False and cache is not None, implementations=implementations,
                   weight_grads=weight_grads, replicas=replicas, xla=xla, **training)


def refuse_below_state(model, optimizer, budget, strategy: str | None = None) -> None:
    """Raises :class:`InfeasibleBudgetError` when ``budget`` is an amount of memory below the
    bytes of ``model``'s variables and ``optimizer``'s (its slots built as training builds
    them, outside a distribution strategy), which every training step holds: a lower bound
    on any schedule's peak, known before the extraction profiles for minutes (ResNet50 at
    "100MiB" was refused after 83 s of profiling; benchmarks/results/user_check.md)."""
    import numpy as np
    import tensorflow as tf

    from tfremat.budget import budget_kind, parse_budget

    if budget_kind(budget) != "bytes":
        return
    budget_bytes = parse_budget(budget)
    variables = list(model.variables)
    if optimizer is not None and hasattr(optimizer, "build") and not tf.distribute.has_strategy():
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    state = sum(int(np.prod(v.shape, dtype=np.int64)) * tf.as_dtype(v.dtype).size for v in variables)
    if state > budget_bytes:
        raise InfeasibleBudgetError(
            budget_bytes, lower_bound_bytes=state, strategy=strategy, proven=True,
            detail="the model's weights and its optimizer's state alone, counted before profiling")


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
        model: a Keras model with static shapes apart from the batch (else ArgumentError,
            naming the input and the axis: a keras-hub model built with ``sequence_length``
            None failed with a ``TypeError``).
        batch_size: the batch size.
        loss: as ``model.compile`` takes it: a name, a Keras loss or function, or a list or
            dict of them by output (an output without a loss gets one-hot labels).
        seed: an int for random values (inputs from a standard normal), to run a step
            on; None for zeros that take no memory (broadcast views), all an extraction
            reads being shapes and dtypes.

    Integer and boolean inputs (token ids, padding masks) are 0 or 1, valid for any
    embedding; string inputs are empty strings (a lookup without an OOV index refuses
    them: pass the training data's values where the caller takes them).

    Returns:
        ``(x, y)``: an array each, or lists of them for several inputs or outputs; a dict of
        inputs by name for a model built on a dict of inputs.
    """
    import numpy as np

    from tfremat.extract.layer_graph import (
        model_input_names,
        model_output_names,
        require_functional,
    )
    from tfremat.extract.losses import per_output

    graph = require_functional(model)
    for index, (tensor, name) in enumerate(zip(graph.inputs, model_input_names(model))):
        unknown = [axis for axis, size in enumerate(tensor.shape) if axis > 0 and size is None]
        if unknown:
            example = tuple(128 if size is None else size for size in tensor.shape[1:])
            raise ArgumentError(
                f"model input {index} ({name!r}) has shape {tuple(tensor.shape)}: axis {unknown[0]} is unknown (None), and a "
                "made-up batch needs every axis but the batch fixed; give it a fixed length: build (and save) the "
                f"model on keras.Input(shape={example}), or wrap it: inputs = keras.Input(shape={example}, "
                f"dtype={tensor.dtype!r}); keras.Model(inputs, model(inputs)); or plan on your own batches, whose "
                "shapes fix it (tfremat.plan_model(model, budget, x, y), tfremat.fit)"
            )
    rng = None if seed is None else np.random.default_rng(seed)

    def array(shape, dtype, draw):
        if dtype == "string":
            # NumPy has no such dtype (np.zeros raised a TypeError): empty byte strings.
            return np.broadcast_to(np.array(b"", dtype=object), shape)
        if rng is None:
            return np.broadcast_to(np.zeros((), dtype), shape)
        return np.asarray(draw(rng, shape), dtype=dtype)

    def draw_input(r, shape, dtype):
        if np.issubdtype(np.dtype(dtype), np.integer) or np.dtype(dtype) == np.bool_:
            return r.integers(0, 2, size=shape)
        return r.standard_normal(shape)

    xs = [array((batch_size, *t.shape[1:]), t.dtype, lambda r, shape, d=t.dtype: draw_input(r, shape, d))
          for t in model.inputs]
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
    if isinstance(getattr(model, "_inputs_struct", None), dict):
        return dict(zip(model_input_names(model), xs)), unpack(ys)
    return unpack(xs), unpack(ys)
