"""The Keras side of :func:`tfremat.max_batch_size`: the batch the search builds each graph on,
and the answer's step held to the budget on the device allocator.

The search (:mod:`tfremat.maxbatch`) judges graphs; this module gives it what a Keras model
needs around them. :func:`batch_maker` makes the batch at each size tried: the user's sample
tiled or cut to that size, so that lookups and embeddings are profiled on ids they accept
(made-up zeros are outside a ``StringLookup(num_oov_indices=0)`` vocabulary), or a made-up
batch without one. :class:`AllocatorHold` runs a batch's step as ``tfremat.fit`` runs it and
holds its allocator peak to the budget with the check ``fit`` uses
(:func:`tfremat.allocator_check.hold_allocator_peak`), for
:func:`tfremat.maxbatch.hold_on_allocator`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, SolverTimeLimitError
from tfremat.maxbatch import AllocatorVerdict

__all__ = ["AllocatorHold", "batch_maker"]

logger = logging.getLogger(__name__)

#: The planner's warning for a budget at or above a graph's checkpoint-all peak: a batch
#: below the answer, or the smallest plan a check reads, is planned so on purpose.
_NOTHING_RECOMPUTED = ".*at or above the checkpoint-all peak"


def batch_maker(model, x, y, loss) -> Callable[[int], tuple]:
    """``batch -> (x, y)``: the batch of that size the search extracts a graph from and, with
    the allocator check, runs a step on.

    Args:
        model: the Keras model (its inputs fix the shapes checked).
        x: None (a made-up batch, :func:`~tfremat.model_planning.synthetic_batch`), the
            model's inputs as Keras takes them (an array, or a list or dict of arrays by
            input), or a ``tf.data.Dataset`` yielding ``(x, y)`` batches, of which the first
            is taken. Its samples are repeated in order, or the first kept, to each size.
        y: the labels for array ``x``, tiled alike; None: made up for ``loss`` (their values
            move no byte). Not with a dataset, whose batches carry theirs.
        loss: the loss the made-up labels are shaped for.

    Raises:
        ArgumentError: ``y`` without ``x`` or with a dataset; ``x`` or ``y`` without a sample
            axis, with no samples, or with differing sample counts; an input whose shape is not
            the model's (checked here, before any graph is built).
    """
    import tensorflow as tf

    from tfremat.model_planning import sample_batch, synthetic_batch

    if x is None:
        if y is not None:
            raise ArgumentError("y was given without x: pass x (the inputs the labels belong to) as well, or neither "
                                "for a made-up batch")
        return lambda batch: synthetic_batch(model, batch, loss=loss)
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ArgumentError("y was given with a tf.data.Dataset x: the dataset's (x, y) batches carry the labels; "
                                "leave y out")
        x, y = sample_batch(model, x, None, None)
    x = tf.nest.map_structure(_as_array, x)
    y = None if y is None else tf.nest.map_structure(_as_array, y)
    samples = _check_sample(model, x, y)

    def at(batch: int) -> tuple:
        rows = np.arange(batch) % samples
        labels = synthetic_batch(model, batch, loss=loss)[1] if y is None else tf.nest.map_structure(
            lambda a: a[rows], y)
        return tf.nest.map_structure(lambda a: a[rows], x), labels

    return at


def _as_array(value) -> np.ndarray:
    """A NumPy array of ``value`` (an array or an eager tensor; strings as bytes objects)."""
    return np.asarray(value)


def _check_sample(model, x, y) -> int:
    """The number of samples of ``x`` and ``y`` (NumPy structures), after checking that every
    array has a sample axis and that count, and that each input's shape past the batch is
    the model's where the model fixes it."""
    import tensorflow as tf

    from tfremat.extract.layer_graph import model_input_names, require_functional
    from tfremat.extract.side_table import flatten_by_name
    from tfremat.model_planning import build_from_batch, check_batch_ranks

    build_from_batch(model, x)
    check_batch_ranks(model, x)
    inputs = require_functional(model).inputs
    arrays = flatten_by_name(x, model_input_names(model), "inputs")
    if len(arrays) != len(inputs):
        raise ArgumentError(f"x holds {len(arrays)} arrays, but the model has {len(inputs)} inputs: pass one array per "
                            "input (a list in the model's order, or a dict by input name)")
    counts = set()
    for argument, data in (("x", arrays), ("y", [] if y is None else tf.nest.flatten(y))):
        for array in data:
            if array.ndim == 0 or array.shape[0] == 0:
                raise ArgumentError(f"{argument} must be arrays with a first axis of samples, at least one, got an "
                                    f"array of shape {array.shape}")
            counts.add(array.shape[0])
    if len(counts) > 1:
        raise ArgumentError(f"x and y must hold the same number of samples in every array, got {sorted(counts)}")
    for array, tensor, name in zip(arrays, inputs, model_input_names(model)):
        wanted = tuple(tensor.shape[1:])
        if len(array.shape) - 1 != len(wanted) or any(
                size is not None and size != given for size, given in zip(wanted, array.shape[1:])):
            raise ArgumentError(f"x: input {name!r} takes samples of shape {wanted}, got arrays of shape "
                                f"{array.shape} (samples of {array.shape[1:]}); pass samples of the model's input "
                                "shape")
    return counts.pop()


@dataclasses.dataclass
class AllocatorHold:
    """``hold(batch) -> AllocatorVerdict``: ``batch``'s graph planned with ``strategy`` under
    ``budget`` and its training step compiled and held to ``budget`` on the device allocator,
    as ``tfremat.fit``'s ``allocator_check`` holds a batch shape's step (planning again under
    the allocator's excess for a few rounds, then refusing with the smallest budget it read;
    :func:`~tfremat.allocator_check.hold_allocator_peak`). The step runs on ``batch_at(batch)``
    with ``optimizer``'s and the model's variables resident and put back after
    (:func:`~tfremat.allocator_check.step_allocator_peak`). The step is compiled without XLA,
    as ``fit`` runs a model compiled with ``jit_compile=False``.

    Attributes:
        model: the Keras model.
        budget: the budget in bytes.
        strategy: the strategy name, and ``options`` its options (``time_limit``, ...).
        extraction_at: ``batch -> Extraction``, the profiled extraction at that batch.
        batch_at: ``batch -> (x, y)`` (:func:`batch_maker`).
        optimizer: the Keras optimizer the step applies.
        cache: the schedule cache argument, as ``fit`` takes it: the plans and the planning
            budget a check accepted are kept there, so ``fit`` at the answer finds them.
        made_up: ``batch_at`` makes its batches up (no sample was given), as an error says.

    Raises (when called):
        ArgumentError: the step fails on the batch's values (a lookup without an OOV index
            fed made-up values), naming ``x``.
    """

    model: object
    budget: int
    strategy: str
    options: dict
    extraction_at: Callable
    batch_at: Callable[[int], tuple]
    optimizer: object
    cache: object
    made_up: bool

    def __call__(self, batch: int) -> AllocatorVerdict:
        import tensorflow as tf

        from tfremat.allocator_check import (
            hold_allocator_peak,
            perturbing_sizes,
            replan,
            step_allocator_peak,
        )
        from tfremat.model_planning import with_rounding
        from tfremat.planner import plan_graph

        extraction = self.extraction_at(batch)
        try:
            result = self._plan(extraction)
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            return AllocatorVerdict(False, needed_bytes=error.min_feasible_bytes, error=error)
        x, y = tf.nest.map_structure(tf.convert_to_tensor, self.batch_at(batch))
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)  # its slots exist before the runs, as in training
        variables = [*self.model.variables, *self.optimizer.variables]
        read: dict[str, int] = {}

        def read_peak(step) -> int | None:
            peak = step_allocator_peak(lambda a, b: step(a, b, None), x, y, variables,
                                       sizes=perturbing_sizes(getattr(step, "graph", None)))
            if peak is not None:
                read["smallest"] = min(peak, read.get("smallest", peak))
            return peak

        def plan_at(current, planning_budget: int) -> tuple:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NOTHING_RECOMPUTED)
                replanned = with_rounding(replan(current, planning_budget, self.strategy, self.options, self.cache, 0,
                                                 planner=plan_graph, log=logger))
            return replanned, self._compiled(replanned)

        try:
            result, _, planning = hold_allocator_peak(
                result, self._compiled(result), plan_at, read_peak, strategy=self.strategy, options=self.options,
                cache=self.cache, accepted=lambda step, peak: read.update(held=peak), log=logger)
        except tf.errors.InvalidArgumentError as error:
            reason = [line for line in error.message.splitlines() if line.strip()][-1]
            given = ("a made-up batch (zeros, empty strings)" if self.made_up
                     else "x's samples repeated to the batch")
            raise ArgumentError(
                f"the training step at batch {batch} fails on {given}: {reason}; the allocator check runs it on the "
                "batch: pass x (and y), a sample of the training data whose values the model accepts, or "
                "allocator_check=False") from error
        except InfeasibleBudgetError as error:
            # The smallest plan's held peak aims the next batch (the refusal's figure adds a slack).
            smallest = read.get("smallest", error.min_feasible_bytes)
            return AllocatorVerdict(False, held_peak=read.get("smallest"), needed_bytes=smallest, error=error)
        return AllocatorVerdict(True, held_peak=read.get("held"), schedule=result.schedule, graph=extraction.graph,
                                planning_budget=self.budget if planning is None else planning)

    def _plan(self, extraction):
        """``extraction``'s graph planned under the budget as ``fit`` plans it."""
        from tfremat.model_planning import with_rounding
        from tfremat.planner import plan_graph

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOTHING_RECOMPUTED)
            planned = plan_graph(extraction.graph, self.budget, self.strategy, cache=self.cache, verbose=0,
                                 **self.options)
        return with_rounding(dataclasses.replace(planned, extraction=extraction))

    def _compiled(self, result):
        """``result``'s training step, returning the loss and outputs as ``fit``'s does."""
        from tfremat.static_graph.compile import compile_step

        return compile_step(result.extraction, result.schedule, optimizer=self.optimizer, return_outputs=True)
