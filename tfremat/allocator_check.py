"""``allocator_check``: holding a plan's budget for the device allocator's peak.

The plan bounds the bytes the step requests; TensorFlow's BFC allocator can peak above them
(whole chunks, docs/memory-model.md). :class:`tfremat.keras.RematCallback` and
:func:`tfremat.multi_worker.fit_multi_worker` run the planned step once, read the peak of each
replica's allocator and plan again under the excess; these are the pieces both use.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfremat.budget import budget_kind
from tfremat.errors import CompileError

__all__ = ["ALLOCATOR_ROUNDS", "wants_allocator_check", "allocator_peak", "replica_allocators", "next_planning_budget"]

logger = logging.getLogger(__name__)

#: Plans tried by ``allocator_check`` before it gives up.
ALLOCATOR_ROUNDS = 3


def wants_allocator_check(allocator_check: bool | None, budget, result) -> bool:
    """Whether a plan for ``budget`` is held to it for the allocator's peak:
    ``allocator_check`` True or False as given; None (the default) for every budget but
    ``"min"`` (no smaller plan to fall back on) and shares at or above the checkpoint-all
    peak (nothing recomputed: the step is ``model.fit``'s own). Never without a budget."""
    if result.budget_bytes is None or allocator_check is False:
        return False
    if allocator_check:
        return True
    kind = budget_kind(budget)
    if kind == "min":
        return False
    return kind == "bytes" or result.budget_bytes < result.checkpoint_all_peak_bytes


def allocator_peak(step, model, x, y, sample_weight=None, device: str | None = None,
                   count: str = "allocator") -> int | None:
    """The allocator's peak of ``device`` (default: the default device's) over one run of
    ``step`` (after one untimed run that traces it), in the graph's convention
    (:func:`tfremat.runtime.memory.measure_step_peak`), with the state the runs change put
    back: the model's and the optimizer's variables, Python's ``random`` and Keras's global
    seed generator (one that the trace created is forgotten, as the extraction does, but the
    step keeps the state it advanced). None when the allocator keeps no statistics (a
    warning says so). A step compiled with a strategy gets ``x, y`` (one replica's batch)
    on every replica, so each replica device's allocator sees one replica's step. ``count``
    as :func:`~tfremat.runtime.memory.measure_step_peak` takes it.
    """
    from tfremat.runtime.memory import measure_step_peak
    from tfremat.runtime.state import state_restored

    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)  # its slots exist before the runs, as in training
    variables = list(model.variables) + list(optimizer.variables)
    with state_restored(variables):
        try:
            return measure_step_peak(lambda a, b: step(a, b, sample_weight), x, y, resident=variables, device=device,
                                     warmup=1, count=count)
        except CompileError as error:
            logger.warning("allocator_check skipped: %s", error)
            return None


def replica_allocators(strategy) -> list[str] | None:
    """The allocator of each replica's device under ``strategy`` (``"GPU:0"``, ...), for
    ``allocator_check`` to hold each against the budget; None when replicas share one
    allocator: TensorFlow serves every CPU device of a process, logical devices made with
    ``tf.config.set_logical_device_configuration`` included, from one allocator, whose peak
    is the sum of the replicas'. There the budget holds for the bytes each replica's step
    requests (the plan's prediction), not for a measured peak."""
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    if sum(d.device_type == "CPU" for d in devices) > 1:
        return None
    return [f"{d.device_type}:{d.device_index or 0}" for d in devices]


def next_planning_budget(planning_budget: int, budget: int, peak: int, predicted: int) -> int:
    """The budget to plan under after a plan predicted at ``predicted`` bytes, planned under
    ``planning_budget``, peaked at ``peak`` in the allocator against ``budget``: less by the
    excess over the budget, and at most the budget less what the chunks added to the plan's
    bytes (``peak - predicted``). A plan a little under the last one often lands in the same
    chunks, so stepping by the excess over the budget alone could spend every round
    (a five-conv net at "95% of activations": 0.12 MiB a round for 3 rounds)."""
    return min(planning_budget - (peak - budget), budget - (peak - predicted))
