"""``allocator_check``: holding a plan's budget for the device allocator's peak.

The plan bounds the bytes the step requests; TensorFlow's BFC allocator can peak above them
(whole chunks, docs/memory-model.md). :class:`tfremat.keras.RematCallback`,
:func:`tfremat.multi_worker.fit_multi_worker` and :func:`tfremat.value_and_grad` run the
planned step a few times, some in other states of the allocator's free chunks, hold each
replica's allocator peak (:func:`held_peak`) and plan again under the excess (:func:`hold_allocator_peak`, the one
re-plan loop); these are the pieces they use (the callback also reads its first training
steps: :data:`WATCHED_STEPS`). The planning budget a check accepted
is remembered next to the schedule cache (:func:`remember_planning_budget`), so another
process with the same graph and budget plans under it first and finds its schedule cached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf

from tfremat.budget import budget_kind, format_bytes
from tfremat.cache import ScheduleCache, default_cache_dir, read_entry, warn_once, write_atomically
from tfremat.errors import CompileError, InfeasibleBudgetError, SolverTimeLimitError

__all__ = ["ALLOCATOR_ROUNDS", "ALLOCATOR_READS", "PERTURBED_READS", "PERTURBED_KEPT_SHARE", "ALLOCATOR_SLACK",
           "PLANNING_GRID", "WATCHED_STEPS", "wants_allocator_check",
           "hold_allocator_peak", "replan", "allocator_peak", "step_allocator_peak", "held_peak", "training_step_peak",
           "replica_allocators", "next_planning_budget", "perturbing_sizes",
           "replan_strategy", "remembered_planning_budget", "remember_planning_budget"]

logger = logging.getLogger(__name__)

#: Plans tried by ``allocator_check`` before it gives up.
ALLOCATOR_ROUNDS = 3

#: Runs of a step the check reads, after one warm-up run. The allocator's peak of one compiled
#: step moves from run to run (the executor's parallel operations allocate in a different
#: order each time, so BFC splits different chunks): DenseNet121 64x64 batch 8 read
#: 118.6-123.1 MiB over 12 training steps of one plan (benchmarks/allocator_check.py).
ALLOCATOR_READS = 3

#: Reads of a step after the allocator's free chunks were put in another state (one each,
#: after the :data:`ALLOCATOR_READS`): BFC hands out a free chunk whole when it is under twice
#: the request, so the peak of one plan's step depends on the free chunks present when it runs,
#: set by what ran before (the batch's buffers, a re-plan, a user's tensors kept between
#: steps); reads in one state repeat to the byte. Before each, tensors the size of the step's
#: largest values and of random sizes are made and most freed in a random order, small
#: spacers kept between them, leaving holes the step's requests may take whole
#: (:func:`perturbed_state`). A GRU's embedding gradient put its training steps 27% of the
#: step's own bytes above the check's reads, and a U-Net 1.021x its budget with a user's
#: tensors kept alive, which a fixed margin of a fifth missed, while it refused plans that read
#: under the budget in training (benchmarks/results/allocator_check.md).
PERTURBED_READS = 4

#: The most of the step's own allocator bytes that the tensors of a perturbed state keep
#: alive during its read, besides small spacers (:func:`perturbed_state`), so that the check
#: asks a device near its limit for little more than the step's peak. Keeping about half the
#: tensors alive (up to 0.88 of the step's own bytes) read a spread over the plain reads of
#: the same step, in turns, wider on some rows and narrower on others: the largest read over
#: the plain ones 1.30 and 1.00 on multi_io (two processes) against 1.15 and 1.09 here,
#: gru_text 1.11 and 1.00 against 0.98 and 1.01 (its embedding gradient's wider state is found
#: in some processes only), accum_lr_schedule 1.02 against 1.09, unet_seg 1.00 against 0.99
#: (benchmarks/perturbed_footprint.py).
PERTURBED_KEPT_SHARE = 1 / 16

#: The slack held above the largest read, plain or perturbed, as a share of the step's own
#: allocator bytes (the read less the variables and the batch): for states none of the reads
#: put the allocator in.
ALLOCATOR_SLACK = 0.03

#: Training steps after a check accepted a plan whose allocator peak is read (statistics reset
#: before each) and held to the budget, a plan exceeding it planned again between two steps.
#: The check's reads run before training, and the allocator's free chunks then differ from
#: training's: an accepted DenseNet121 64x64 plan held at 108.8 MiB read 109.5-110.1 MiB over
#: 20 later steps (benchmarks/allocator_check.py).
WATCHED_STEPS = 10

#: Planning budgets after a check are rounded down to a multiple of the budget over this, so
#: that processes whose reads differ by less land on the same budget and schedule cache entry.
PLANNING_GRID = 256


def wants_allocator_check(allocator_check: bool | None, budget, result) -> bool:
    """Whether a plan for ``budget`` is held to it for the allocator's peak:
    ``allocator_check`` True or False as given; None (the default) for every budget but
    ``"min"`` (no smaller plan to fall back on). Shares at or above the checkpoint-all peak
    are held too: a refusal's smallest budget, in a share, may round up to one, and the step
    that recomputes nothing still peaks above its prediction in the allocator (mixed_float16:
    1.18x at "100% of activations"; benchmarks/results/user_check_3.md). Never without a
    budget."""
    if result.budget_bytes is None or allocator_check is False:
        return False
    return bool(allocator_check) or budget_kind(budget) != "min"


def allocator_peak(step, model, x, y, sample_weight=None, device: str | None = None,
                   count: str = "allocator", reads: int = ALLOCATOR_READS) -> int | None:
    """The allocator's peak of ``device`` (default: the default device's) that a training
    ``step`` of ``model`` is held to: :func:`step_allocator_peak` of ``step(x, y,
    sample_weight)``, the model's and the optimizer's variables resident and put back, the
    allocator perturbed with the sizes of the step's graph (:func:`perturbing_sizes`). A step
    compiled with a strategy gets ``x, y`` (one replica's batch) on every replica, so each
    replica device's allocator sees one replica's step."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)  # its slots exist before the runs, as in training
    variables = list(model.variables) + list(optimizer.variables)
    return step_allocator_peak(lambda a, b: step(a, b, sample_weight), x, y, variables, device=device, count=count,
                               reads=reads, sizes=perturbing_sizes(getattr(step, "graph", None)))


def perturbing_sizes(graph, largest: int = 8) -> tuple[int, ...]:
    """The ``largest`` distinct sizes of the values, workspaces and weight gradients of
    ``graph`` (a :class:`~tfremat.graph.DFGraph`; None: none), largest first: the requests
    whose chunks move the step's peak most, for :func:`perturbed_state`."""
    if graph is None:
        return ()
    sizes = {*graph.output_bytes, *graph.workspace_bytes, *getattr(graph, "weight_grad_bytes", ())}
    return tuple(sorted((size for size in sizes if size > 0), reverse=True)[:largest])


@contextlib.contextmanager
def perturbed_state(device: str | None, own_bytes: int, sizes: Sequence[int], seed: int):
    """The allocator of ``device`` put in another free-chunk state for the read inside: yields
    True, or False when no state was made (then nothing is left allocated).

    Tensors of up to ``own_bytes`` in all (the step's own allocator bytes) are made in a
    random order, of sizes a random 1-1.9 times the step's large ``sizes`` (holes its
    requests would take whole: BFC hands out a free chunk under twice the request whole) and
    log-uniform sizes from 4 KiB to half the step's bytes, each followed by a spacer of 256
    B-16 KiB. Then all the spacers and a random few of the tensors, at most
    :data:`PERTURBED_KEPT_SHARE` of ``own_bytes``, stay alive and the other tensors are freed
    in a random order: holes of those sizes that the spacers keep from merging.

    The check's extra footprint: during the read, at most :data:`PERTURBED_KEPT_SHARE` of the
    step's own bytes plus the spacers (16 KiB each, one per tensor made, at most 16) stay
    alive, on top of the step's peak; before it, the tensors made take at most the step's own
    bytes at once, while the step is not running. An allocation that fails
    (``tf.errors.ResourceExhaustedError``: a device near its limit) frees what was made and
    yields False, logged: the check never fails a fit for a state of its own making.
    ``seed``: the state (the check's reads are repeatable)."""
    import numpy as np

    from tfremat.runtime.memory import default_device

    rng = np.random.default_rng(seed)
    floor = 4096
    upper = max(own_bytes // 2, 2 * floor)
    wanted = [int(size * rng.uniform(1.0, 1.9)) for size in sizes if floor <= size <= own_bytes]
    wanted += [int(np.exp(rng.uniform(np.log(floor), np.log(upper)))) for _ in range(8)]
    rng.shuffle(wanted)
    device = device or default_device()
    made, spacers, total, failure = [], [], 0, None
    try:
        with tf.device(device):
            for size in wanted:
                if total + size > own_bytes:
                    continue
                total += size
                made.append(tf.ones([size // 4], tf.float32))
                spacers.append(tf.ones([int(rng.integers(64, floor))], tf.float32))
    except tf.errors.ResourceExhaustedError as error:
        failure = str(error).splitlines()[0] if str(error) else type(error).__name__
    if failure is not None:
        made.clear()
        spacers.clear()
        logger.warning("allocator_check: a perturbed read skipped, its tensors did not fit on %s (%s)", device, failure)
        yield False
        return
    kept_bytes, kept = int(PERTURBED_KEPT_SHARE * own_bytes), []
    for index in rng.permutation(len(made)):
        size = made[index].shape[0] * 4
        if rng.random() < 0.5 and size <= kept_bytes:
            kept_bytes -= size
            kept.append(made[index])
        made[index] = None
    try:
        yield True
    finally:
        kept.clear()
        spacers.clear()


def step_allocator_peak(run_step: Callable, x, y, variables: Sequence, device: str | None = None,
                        count: str = "allocator", reads: int = ALLOCATOR_READS,
                        perturbed: int = PERTURBED_READS, sizes: Sequence[int] = ()) -> int | None:
    """The allocator's peak of ``device`` that the step ``run_step(x, y)`` is held to:
    :func:`held_peak` of ``reads`` runs in the allocator's state as found, each read with fresh
    statistics, after one untimed run that traces it, and of ``perturbed`` runs each in another
    state (:func:`perturbed_state`, with ``sizes``: the step's large requests,
    :func:`perturbing_sizes`); in the graph's convention
    (:func:`tfremat.runtime.memory.measure_step_peak`: ``variables``, ``x`` and ``y`` counted
    resident), with the state the runs change put back: ``variables``, Python's ``random`` and
    Keras's global seed generator (one that the trace created is forgotten, as the extraction
    does, but the step keeps the state it advanced). None when the allocator keeps no
    statistics (a warning says so). ``count`` as
    :func:`~tfremat.runtime.memory.measure_step_peak` takes it; ``"requested"`` is read once
    and held as read (the profiler's events, the same every run and in every state).
    """
    from tfremat.runtime.memory import measure_step_peak, resident_bytes
    from tfremat.runtime.state import state_restored

    variables = list(variables)
    resident = resident_bytes([*variables, *tf.nest.flatten((x, y))])
    runs = 1 if count == "requested" else max(1, reads)
    peaks: list[int] = []

    def read(warmup: int) -> None:
        peaks.append(measure_step_peak(run_step, x, y, resident=variables, device=device, warmup=warmup, count=count))

    def perturbed_read(state: int) -> None:
        try:
            read(0)
        except tf.errors.ResourceExhaustedError as error:
            # The step out of memory in a state the check made, not training's: that read is
            # left out (training runs it in its own states; the watched steps read those).
            logger.warning("allocator_check: perturbed read %d skipped, the step ran out of memory in it (%s)",
                           state, str(error).splitlines()[0])

    with state_restored(variables):
        try:
            for run in range(runs):
                read(1 if run == 0 else 0)
            if count != "requested":
                own = max(max(peaks) - resident, 0)
                for state in range(perturbed):
                    with perturbed_state(device, own, sizes, seed=state) as made:
                        if made:
                            perturbed_read(state)
        except CompileError as error:
            logger.warning("allocator_check skipped: %s", error)
            return None
    if count == "requested":
        return peaks[0]
    return held_peak(peaks, resident)


def held_peak(peaks: Sequence[int], resident: int = 0) -> int:
    """The peak a plan is held to from the allocator's peaks over runs of its step in several
    states of the allocator's free chunks (:func:`step_allocator_peak`; ``resident``: the bytes
    of the variables and the batch they count): the largest, plus :data:`ALLOCATOR_SLACK` of
    its bytes above ``resident`` for the states not read."""
    largest = max(peaks)
    return largest + int(ALLOCATOR_SLACK * max(largest - resident, 0))


def training_step_peak(run, device: str | None, resident: Sequence) -> tuple:
    """``run()``'s result (a training step's, waited for) and the allocator's peak of ``device``
    (None: the default device) over it, in the graph's convention (above what was allocated
    when it started, plus the bytes of ``resident``: variables and the batch)."""
    from tfremat.runtime.memory import default_device, resident_bytes, synchronize

    device = device or default_device()
    tf.config.experimental.reset_memory_stats(device)
    start = tf.config.experimental.get_memory_info(device)["current"]
    result = run()
    synchronize(result)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - start
    return result, int(peak + resident_bytes(resident))


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


def next_planning_budget(planning_budget: int, budget: int, peak: int, predicted: int,
                         fixed: int | None = None) -> int:
    """The budget to plan under after a plan predicted at ``predicted`` bytes, planned under
    ``planning_budget``, held at ``peak`` against ``budget``, rounded down to a multiple of
    ``budget / PLANNING_GRID`` (:data:`PLANNING_GRID`) and at most the planning budget less
    one such step. With ``fixed`` (the graph's fixed bytes: weights, gradients, optimizer
    state, the batch): the prediction whose held peak is the budget when the allocator's
    excess scales with the bytes a plan adds to ``fixed`` (whole chunks and the held slack go
    with the step's own bytes), so a smaller plan is credited with a smaller excess;
    subtracting the whole excess of the budget's plan aimed 1.2 MiB under the plan that held
    on U-Net (benchmarks/results/allocator_check.md). Without: the budget less that whole
    excess (``peak - predicted``), and at most the planning budget less the excess over the
    budget, for a plan whose excess did not scale: a plan a little under the last one often
    lands in the same chunks (a five-conv net at "95% of activations": 0.12 MiB a round for
    3 rounds)."""
    step = max(1, budget // PLANNING_GRID)
    if fixed is not None and peak > fixed and predicted > fixed:
        aim = fixed + (budget - fixed) * (predicted - fixed) // (peak - fixed)
    else:
        aim = min(planning_budget - (peak - budget), budget - (peak - predicted))
    return min(aim, planning_budget - step) // step * step


def replan_strategy(result, strategy: str) -> str:
    """The strategy a check plans ``result``'s graph with again, a little under its budget:
    ``strategy``, unless ``result`` (planned with it) returned the schedule of a heuristic
    that takes no time limit, unimproved (its facts' warm start, at that heuristic's own
    cost at the budget, not proven optimal): then that heuristic, whose schedule the same
    search would most likely return again after repeating the heuristics and the LP. On
    EfficientNetV2B0 64x64 batch 8 at "50% of activations" (541 nodes) ``optimal`` returned
    ``eviction``'s schedule, and at the re-plan's budget both give the same +7.8% plan,
    ``optimal`` in 25-60 s and ``eviction`` in 1.4 CPU s (docs/solver.md, "Re-plans of the
    allocator check"). A re-plan with that heuristic (named in ``result.planned_with``)
    keeps it for later rounds."""
    import inspect

    from tfremat.ilp.portfolio import HEURISTICS

    plain = {h.name: h for h in HEURISTICS if "time_limit" not in inspect.signature(h.function).parameters}
    ran = getattr(result, "planned_with", None) or result.strategy
    if ran in plain:
        return ran
    facts = result.facts
    name = None if facts is None or facts.status == "optimal" else facts.warm_start
    if name not in plain or result.budget_bytes is None:
        return strategy
    graph = result.graph
    try:
        own = plain[name](graph, result.budget_bytes)
    except InfeasibleBudgetError:
        return strategy
    cost = result.schedule.cost(graph)
    return name if abs(own.cost(graph) - cost) <= 1e-9 * max(cost, 1e-12) else strategy


def _record_path(cache, graph, budget_bytes: int, strategy: str, options: dict) -> Path | None:
    """Where the planning budget accepted for ``graph`` under ``budget_bytes`` is kept: next to
    the schedule cache's entries (``cache`` as :func:`tfremat.planner.plan_graph` takes it;
    None when it is off), named by the schedule key with ``allocator-`` before it."""
    if cache is False or cache is None:
        return None
    directory = (cache.directory if isinstance(cache, ScheduleCache)
                 else default_cache_dir() if cache is True else Path(os.fspath(cache)))
    return directory / f"allocator-{ScheduleCache.key(graph, budget_bytes, strategy, options)}.json"


def remembered_planning_budget(cache, graph, budget_bytes: int, strategy: str, options: dict) -> int | None:
    """The planning budget a check accepted for ``graph`` under ``budget_bytes`` with
    ``strategy`` and ``options`` (:func:`remember_planning_budget`), in this process or
    another; None when none was, the cache is off, or the record cannot be read or trusted
    (a number below the budget, for this graph and budget)."""
    path = _record_path(cache, graph, budget_bytes, strategy, options)
    text = None if path is None else read_entry(path)
    if text is None:
        return None
    try:
        document = json.loads(text)
        planning = document["planning_budget"]
        trusted = (document["graph"] == graph.fingerprint and document["budget"] == budget_bytes
                   and isinstance(planning, int) and 0 < planning < budget_bytes)
    except (ValueError, TypeError, KeyError):
        trusted = False
    if not trusted:
        logger.warning("allocator_check record %s is not trusted; checking from the budget", path)
        return None
    return planning


def remember_planning_budget(cache, graph, budget_bytes: int, strategy: str, options: dict,
                             planning_budget: int) -> None:
    """Keeps ``planning_budget``, under which a plan for ``graph`` held the allocator's peak
    to ``budget_bytes``, for :func:`remembered_planning_budget` (written atomically; a
    directory that cannot be written is logged once, as the schedule cache's)."""
    path = _record_path(cache, graph, budget_bytes, strategy, options)
    if path is None:
        return
    text = json.dumps({"graph": graph.fingerprint, "budget": budget_bytes, "planning_budget": planning_budget})
    try:
        write_atomically(path, text)
    except OSError as error:
        warn_once(path.parent, "written", error)


def hold_allocator_peak(result, step, plan_at: Callable, read_peak: Callable, *, strategy: str, options: dict,
                        cache, exceeded: tuple[int, int] | None = None, accepted: Callable | None = None,
                        log: logging.Logger = logger, count: str = "allocator") -> tuple:
    """Plans ``result``'s graph (``result.extraction.graph``) again until the allocator's peak
    of its compiled ``step`` is within ``result.budget_bytes``: the re-plan loop of
    :class:`tfremat.keras.RematCallback` and :func:`tfremat.value_and_grad`.

    ``read_peak(step)`` is the step's held peak (:func:`step_allocator_peak`; the largest over
    a strategy's replicas), None when the allocator keeps no statistics. Over the budget, the
    graph is planned under :func:`next_planning_budget` by ``plan_at(result, planning_budget)``,
    which returns the new ``(result, step)``, for at most :data:`ALLOCATOR_ROUNDS` plans; where
    no schedule fits that budget, the smallest plan the planner found (its
    ``min_feasible_bytes``) is read once before refusing, as a smaller plan's chunks may be
    fewer. The
    loop starts from the planning budget a check accepted before for this graph and budget,
    in this process or another (:func:`remembered_planning_budget`, keyed by ``strategy`` and
    ``options`` in ``cache``): its schedule is cached, so a second process solves nothing; a
    planning budget accepted below the budget is remembered likewise. ``exceeded``:
    ``(planning budget, peak)`` of a plan that a training step found over the budget,
    planned again first. ``accepted(step, peak)`` is called on the plan accepted. ``log``:
    the caller's logger, which tells each round. ``count``: what ``read_peak`` reads, as a
    refusal words it: ``"allocator"`` (the allocator's peak and its chunks) or ``"requested"``
    (the bytes an XLA step requests, over its prediction).

    Returns:
        ``(result, step, planning budget)``: the accepted result (its ``budget_bytes`` the
        budget), its step and the budget it was planned under; the planning budget is None
        when the allocator keeps no statistics (nothing was held).

    Raises:
        InfeasibleBudgetError: no schedule fits the planning budget the peak asks for, told
            in the allocator's terms, or the peak stayed above the budget after
            :data:`ALLOCATOR_ROUNDS` plans; both name ``allocator_check=False``.
    """
    budget = result.budget_bytes
    graph = result.extraction.graph
    planning_budget, peak, remembered = budget, None, None
    if exceeded is not None:
        planning_budget, peak = exceeded
    else:
        remembered = remembered_planning_budget(cache, graph, budget, strategy, options)
    if remembered is not None:
        try:
            result, step = plan_at(result, remembered)
            planning_budget = remembered
            log.info("planning under %s, where a plan held the allocator's peak to the budget %s before",
                     format_bytes(remembered), format_bytes(budget))
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            # Its schedule left the cache and was not found again: check from the budget.
            log.info("the remembered planning budget %s found no plan (%s); checking from the budget",
                     format_bytes(remembered), error)
    last, read_smallest = peak, False
    for _ in range(ALLOCATOR_ROUNDS):
        if peak is None:
            peak = read_peak(step)
            if peak is None:
                return result, step, None
            last = peak
            if peak <= budget:
                if accepted is not None:
                    accepted(step, peak)
                if planning_budget != budget:
                    log.info("planned under %s so that the allocator's peak (%s held) stays within the budget %s",
                             format_bytes(planning_budget), format_bytes(peak), format_bytes(budget))
                    if planning_budget != remembered:
                        remember_planning_budget(cache, graph, budget, strategy, options, planning_budget)
                return dataclasses.replace(result, budget_bytes=budget), step, planning_budget
        previous = planning_budget
        # The first plan over is aimed by the excess scaled to the next plan's bytes; a plan
        # over after that one subtracts its whole excess (the scaling did not hold for it).
        planning_budget = next_planning_budget(planning_budget, budget, peak, result.predicted_peak_bytes,
                                               graph.fixed_bytes if previous == budget else None)
        log.info("the allocator's peak %s held exceeds the budget %s (prediction %s); planning again under %s",
                 format_bytes(peak), format_bytes(budget), format_bytes(result.predicted_peak_bytes),
                 format_bytes(planning_budget))
        try:
            if planning_budget <= 0:
                raise InfeasibleBudgetError(planning_budget, strategy=strategy)
            replanned, step = plan_at(result, planning_budget)
        except InfeasibleBudgetError as error:
            smallest = error.min_feasible_bytes
            if read_smallest or smallest is None or not planning_budget < smallest < previous:
                raise _chunks_refusal(budget, peak, result.predicted_peak_bytes, planning_budget, error,
                                      strategy, count) from error
            # A smaller plan's chunks are not this plan's: U-Net's 41.95 MiB plan read up to 4.8
            # MiB above its requested bytes, its 34.45 MiB plan 2.0 (benchmarks/results/
            # allocator_check.md). The smallest plan found is read before refusing.
            log.info("no schedule fits %s; reading the smallest plan found, under %s", format_bytes(planning_budget),
                     format_bytes(smallest))
            try:
                replanned, step = plan_at(result, int(smallest))
            except (InfeasibleBudgetError, SolverTimeLimitError):
                raise _chunks_refusal(budget, peak, result.predicted_peak_bytes, planning_budget, error,
                                      strategy, count) from error
            planning_budget, read_smallest = int(smallest), True
        result, peak = replanned, None
    what, unchecked = (("the XLA step's requested bytes", "the predicted bytes") if count == "requested"
                       else ("the allocator's peak", "requested bytes"))
    raise InfeasibleBudgetError(
        budget, strategy=strategy,
        detail=f"{what} stayed above it after {ALLOCATOR_ROUNDS} plans (last {format_bytes(last)} "
               f"held, planned under {format_bytes(planning_budget)}); allocator_check=False holds the budget for "
               f"{unchecked} only",
    )


def _chunks_refusal(budget: int, peak: int, predicted: int, planning_budget: int, error: InfeasibleBudgetError,
                    strategy: str, count: str = "allocator") -> InfeasibleBudgetError:
    """The refusal of a budget that no plan held for the allocator's peak, in the allocator's
    terms: the smallest plan's prediction plus the chunks the last plan's peak showed (``peak``
    held against its ``predicted`` bytes) is the smallest budget found. The planner's own
    figures are below the budget (ResNet50 at 300MiB: "smallest feasible 289.64 MiB" for a
    300 MiB budget it refused; benchmarks/user_check.py). ``count="requested"``: ``peak`` is
    the bytes an XLA step requests (held instead of the allocator's peak), worded so."""
    chunks = max(peak - predicted, 0)
    smallest = None if error.min_feasible_bytes is None else error.min_feasible_bytes + chunks
    excess = "that excess" if count == "requested" else "those chunks"
    smallest_plan = ("" if error.min_feasible_bytes is None else
                     f"the smallest plan's {format_bytes(error.min_feasible_bytes)} predicted plus {excess} "
                     "is the smallest budget found; ")
    if count == "requested":
        held = (f"held for the bytes the XLA step requests: it requests {format_bytes(peak)}, "
                f"{format_bytes(chunks)} over the {format_bytes(predicted)} predicted")
        unchecked = "the predicted bytes only, which XLA's request exceeds"
    else:
        held = (f"held for the allocator's peak: it was {format_bytes(peak)} held, its chunks adding "
                f"{format_bytes(chunks)} to the {format_bytes(predicted)} predicted")
        unchecked = "requested bytes only"
    return InfeasibleBudgetError(
        budget, smallest, None, strategy,
        detail=f"{held}, and no schedule fits {format_bytes(max(planning_budget, 0))}; {smallest_plan}"
               f"allocator_check=False holds the budget for {unchecked}",
    )


def replan(result, planning_budget: int, strategy: str, options: dict, cache, verbose: int,
           planner: Callable | None = None, log: logging.Logger = logger):
    """``result``'s graph planned under ``planning_budget`` (the new result's budget until a
    check accepts it), with ``result.extraction`` kept: with :func:`replan_strategy`'s
    heuristic where it returned ``result``'s schedule unimproved (the result named
    ``strategy``, ``planned_with`` that heuristic), else, or where that heuristic finds no
    schedule, with ``strategy`` and ``options``. ``planner``: the planning function
    (default :func:`tfremat.planner.plan_graph`)."""
    if planner is None:
        from tfremat.planner import plan_graph as planner

    graph = result.extraction.graph
    strategy_name = replan_strategy(result, strategy)
    if strategy_name != strategy:
        log.info("planning with %s, whose schedule %s returned unimproved under %s", strategy_name, strategy,
                 format_bytes(result.budget_bytes))
        try:
            replanned = planner(graph, planning_budget, strategy_name, cache=cache, verbose=0)
            # Named as asked for (plans[key].strategy), with the heuristic that planned it.
            replanned = dataclasses.replace(replanned, strategy=strategy, planned_with=strategy_name)
        except InfeasibleBudgetError:
            strategy_name = strategy
    if strategy_name == strategy:
        replanned = planner(graph, planning_budget, strategy, cache=cache, verbose=verbose, **options)
    return dataclasses.replace(replanned, extraction=result.extraction)
