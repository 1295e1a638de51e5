"""``allocator_check``: holding a plan's budget for the device allocator's peak.

The plan bounds the bytes the step requests; TensorFlow's BFC allocator can peak above them
(whole chunks, docs/memory-model.md). :class:`tfremat.keras.RematCallback`,
:func:`tfremat.multi_worker.fit_multi_worker` and :func:`tfremat.value_and_grad` run the
planned step a few times, some in other states of the allocator's free chunks, hold each
replica's allocator peak (:func:`held_peak`) and plan again under the excess (:func:`hold_allocator_peak`, the one
re-plan loop); these are the pieces they use (the callback also reads its first training
steps: :data:`WATCHED_STEPS`). The planning budget a check accepted
is remembered next to the schedule cache (:func:`remember_planning_budget`), so another
process with the same graph and budget plans under it first and finds its schedule cached;
so is the held peak of every plan read, for any budget (a refusal names the smallest, and
that budget copied back is planned under the same planning budget).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import tensorflow as tf

from tfremat.budget import budget_kind, format_bytes
from tfremat.cache import ScheduleCache, default_cache_dir, read_entry, warn_once, write_atomically
from tfremat.errors import CompileError, InfeasibleBudgetError, SolverTimeLimitError

__all__ = ["ALLOCATOR_ROUNDS", "ALLOCATOR_READS", "PERTURBED_READS", "PERTURBED_KEPT_SHARE", "ALLOCATOR_SLACK",
           "PLANNING_GRID", "WATCHED_STEPS", "REPLAN_TIME_LIMIT", "REFUSAL_SLACK", "wants_allocator_check",
           "unchecked_from", "planner_refusal_read",
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

#: The slack a refusal adds to the held peak it names as the smallest budget found, as a
#: share of the step's own bytes (the held peak less the graph's fixed bytes): the budget
#: copied back is checked in another state of the allocator, most often in another process,
#: where the same plan's held peak moves by more than :data:`ALLOCATOR_SLACK`: the check's
#: plain reads of one five_conv_net plan settle in one state per process, 6.66-10.64 MiB over
#: fresh processes, and the refusing process's reads do not show which (7.66-7.69 MiB in all
#: seven states of one). With 0.03, 5 of 16 copy-backs in fresh processes without the
#: refusing process's cache were refused again (by 1.3-12.8% of the budget), none of 16 with
#: it; with 0.15, 1 of 16 without it, by 2.2% (benchmarks/results/user_check_5.md,
#: "Session 30 (A3)"). A copy-back in the next run shares the refusing run's cache (the
#: default), and 0.15 names 12% of the step's bytes more in every refusal, so the check's own.
REFUSAL_SLACK = ALLOCATOR_SLACK

#: The most seconds a re-plan's MILP runs (a strategy's ``time_limit``, capped): a re-plan
#: is a few percent under a budget already planned, and a full minute at each of
#: :data:`ALLOCATOR_ROUNDS` budgets made a WaveNet's check run 219 s before it failed
#: (benchmarks/results/user_check_4.md, finding 3).
REPLAN_TIME_LIMIT = 20.0


def wants_allocator_check(allocator_check: bool | None, budget, result) -> bool:
    """Whether a plan for ``budget`` is held to it for the allocator's peak:
    ``allocator_check`` True or False as given; None (the default) for every budget but
    ``"min"`` (no smaller plan to fall back on) and shares at or above the checkpoint-all
    peak (nothing recomputed: the step is ``model.fit``'s own, and refusing it helps no one).
    A refusal never names such a share unless the checkpoint-all step was read within it
    (:func:`hold_allocator_peak`'s ``unchecked_from``). Never without a budget."""
    if result.budget_bytes is None or allocator_check is False:
        return False
    if allocator_check:
        return True
    kind = budget_kind(budget)
    if kind == "min":
        return False
    return kind == "bytes" or result.budget_bytes < result.checkpoint_all_peak_bytes


def unchecked_from(allocator_check: bool | None, budget, graph) -> int | None:
    """The fewest bytes that a refusal of ``budget`` for ``graph``, told in the user's terms,
    would name as a budget :func:`wants_allocator_check` does not hold: for a share with
    ``allocator_check`` None, just above its 99% (a figure above it is rounded up to the
    checkpoint-all share, 100%); None otherwise (every budget named is held)."""
    from tfremat.plan.registry import parse_graph_budget

    kind = budget_kind(budget)
    if allocator_check is not None or kind not in ("share", "activations"):
        return None
    return parse_graph_budget(graph, "99% of activations" if kind == "activations" else "99%") + 1


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


def _held_path(cache, graph, strategy: str, options: dict) -> Path | None:
    """Where the plans read for ``graph`` (:func:`_remember_held`) are kept: next to the
    schedule cache's entries, as :func:`_record_path`'s, for every budget at once."""
    return _record_path(cache, graph, 0, strategy, {**options, "held plans": True})


#: The plans read in this process, by :func:`_held_path` (or the graph's fingerprint, the
#: strategy and the options where the cache is off): ``{planning budget: held peak}``.
_HELD_PLANS: dict = {}


def _held_plans(cache, graph, strategy: str, options: dict) -> dict[int, int]:
    """The held peak of every plan of ``graph`` read by a check, by the planning budget it
    was planned under, in this process or another (:func:`_remember_held`)."""
    if getattr(graph, "fingerprint", None) is None:
        return {}  # a graph without a fingerprint (a test's stand-in) keeps its reads to this check
    path = _held_path(cache, graph, strategy, options)
    key = path or (graph.fingerprint, strategy, json.dumps(options, sort_keys=True, default=str))
    held = _HELD_PLANS.setdefault(key, {})
    text = None if path is None else read_entry(path)
    if text is not None:
        try:
            document = json.loads(text)
            if document["graph"] == graph.fingerprint:
                for planning, peak in document["held"]:
                    if isinstance(planning, int) and isinstance(peak, int):
                        held.setdefault(planning, peak)
        except (ValueError, TypeError, KeyError):
            logger.warning("allocator_check record %s is not trusted; its plans are read again", path)
    return held


def _remember_held(cache, graph, strategy: str, options: dict, planning_budget: int, peak: int) -> None:
    """Keeps ``peak``, the held peak of the plan of ``graph`` planned under
    ``planning_budget``, for the checks of other budgets (:func:`_held_plans`): a refusal
    names the smallest such peak, and a check of that budget plans under the same planning
    budget rather than aiming by the chunks of plans that are not this one."""
    held = _held_plans(cache, graph, strategy, options)
    held[planning_budget] = max(peak, held.get(planning_budget, 0))
    path = None if getattr(graph, "fingerprint", None) is None else _held_path(cache, graph, strategy, options)
    if path is None:
        return
    text = json.dumps({"graph": graph.fingerprint, "held": sorted(held.items())})
    try:
        write_atomically(path, text)
    except OSError as error:
        warn_once(path.parent, "written", error)


def _known_planning_budget(held: dict[int, int], budget: int, below: int) -> int | None:
    """The largest planning budget under ``below`` whose plan was read held within
    ``budget`` (``held``: :func:`_held_plans`), or None."""
    fitting = [planning for planning, peak in held.items() if planning < below and peak <= budget]
    return max(fitting, default=None)


def hold_allocator_peak(result, step, plan_at: Callable, read_peak: Callable, *, strategy: str, options: dict,
                        cache, exceeded: tuple[int, int] | None = None, accepted: Callable | None = None,
                        log: logging.Logger = logger, count: str = "allocator",
                        unchecked_from: int | None = None) -> tuple:
    """Plans ``result``'s graph (``result.extraction.graph``) again until the allocator's peak
    of its compiled ``step`` is within ``result.budget_bytes``: the re-plan loop of
    :class:`tfremat.keras.RematCallback` and :func:`tfremat.value_and_grad`.

    ``read_peak(step)`` is the step's held peak (:func:`step_allocator_peak`; the largest over
    a strategy's replicas), None when the allocator keeps no statistics. Over the budget, the
    graph is planned under :func:`next_planning_budget` by ``plan_at(result, planning_budget)``,
    which returns the new ``(result, step)``, for at most :data:`ALLOCATOR_ROUNDS` plans; never
    under, and after one re-plan read over at, the largest planning budget whose plan a check
    read within the budget before (in this process or another): a refusal names that plan's
    held peak, and the budget copied back plans under it. Where no schedule fits a planning
    budget (none is found within the time limit included), the smallest plan the planner found
    (its ``min_feasible_bytes``) is read before refusing, as a smaller plan's chunks may be
    fewer. The loop starts from the
    planning budget a check accepted before for this graph and budget, in this process or
    another (:func:`remembered_planning_budget`, keyed by ``strategy`` and ``options`` in
    ``cache``): its schedule is cached, so a second process solves nothing; a planning budget
    accepted below the budget is remembered likewise. ``exceeded``: ``(planning budget,
    peak)`` of a plan that a training step found over the budget, planned again first.
    ``accepted(step, peak)`` is called on the plan accepted. ``log``: the caller's logger,
    which tells each round. ``count``: what ``read_peak`` reads, as a refusal words it:
    ``"allocator"`` (the allocator's peak and its chunks) or ``"requested"`` (the bytes an
    XLA step requests, over its prediction). ``unchecked_from``: the bytes from which a budget
    the refusal names goes unchecked when copied back (:func:`unchecked_from`); where the
    smallest held peak is there, the checkpoint-all step is read, and named unless a plan that
    recomputes holds below it, which is named as an amount in bytes (:func:`_refusal_figure`).

    Returns:
        ``(result, step, planning budget)``: the accepted result (its ``budget_bytes`` the
        budget), its step and the budget it was planned under; the planning budget is None
        when the allocator keeps no statistics (nothing was held).

    Raises:
        InfeasibleBudgetError: no schedule fits the planning budget the peak asks for, or the
            peak stayed above the budget after :data:`ALLOCATOR_ROUNDS` plans; told in the
            allocator's terms, naming the smallest held peak of a plan read, plus
            :data:`REFUSAL_SLACK`, as the smallest budget found, and ``allocator_check=False``.
    """
    budget = result.budget_bytes
    graph = result.extraction.graph
    held = _held_plans(cache, graph, strategy, options)
    read_here: dict[int, int] = {}
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

    def read(planning: int) -> int | None:
        """The held peak of the current step (planned under ``planning``), recorded."""
        peak = read_peak(step)
        if peak is not None:
            read_here[planning] = max(peak, read_here.get(planning, 0))
            _remember_held(cache, graph, strategy, options, planning, peak)
        return peak

    def accept(planning: int, peak: int, log_it: bool) -> tuple:
        if accepted is not None:
            accepted(step, peak)
        if log_it and planning != budget:
            log.info("planned under %s so that the allocator's peak (%s held) stays within the budget %s",
                     format_bytes(planning), format_bytes(peak), format_bytes(budget))
        if planning != budget and planning != remembered:
            remember_planning_budget(cache, graph, budget, strategy, options, planning)
        return dataclasses.replace(result, budget_bytes=budget), step, planning

    first_predicted = result.predicted_peak_bytes
    last, read_smallest, failure = peak, False, None
    for _ in range(ALLOCATOR_ROUNDS):
        if peak is None:
            peak = read(planning_budget)
            if peak is None:
                return result, step, None
            last = peak
            if peak <= budget:
                return accept(planning_budget, peak, log_it=True)
        previous = planning_budget
        planning_budget = _aimed_planning_budget(previous, budget, peak, result.predicted_peak_bytes,
                                                 graph.fixed_bytes, {**held, **read_here}, log)
        try:
            if planning_budget <= 0:
                raise InfeasibleBudgetError(planning_budget, strategy=strategy)
            replanned, step = plan_at(result, planning_budget)
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            failure = error
            smallest = error.min_feasible_bytes
            if read_smallest or smallest is None or not planning_budget < smallest < previous:
                break
            # A smaller plan's chunks are not this plan's: U-Net's 41.95 MiB plan read up to 4.8
            # MiB above its requested bytes, its 34.45 MiB plan 2.0 (benchmarks/results/
            # allocator_check.md). The smallest plan found is read before refusing.
            log.info("no schedule fits %s; reading the smallest plan found, under %s", format_bytes(planning_budget),
                     format_bytes(smallest))
            try:
                replanned, step = plan_at(result, int(smallest))
            except (InfeasibleBudgetError, SolverTimeLimitError):
                break
            planning_budget, read_smallest = int(smallest), True
        result, peak = replanned, None
    else:
        failure = None
    if peak is None:
        # The rounds ended on a plan not read yet (the smallest found): read it, for the figure.
        peak = read(planning_budget)
        if peak is not None:
            last = peak
            if peak <= budget:
                return accept(planning_budget, peak, log_it=False)
    figure = _refusal_figure(result, budget, {**held, **read_here}, last, plan_at, read_peak, unchecked_from, log)
    raise _allocator_refusal(budget, last, result.predicted_peak_bytes, first_predicted, planning_budget, figure,
                             failure, strategy, count)


def planner_refusal_read(error: InfeasibleBudgetError, plan_smallest: Callable, plan_at: Callable,
                         read_peak: Callable, checks: Callable, *, strategy: str, options: dict, cache,
                         log: logging.Logger = logger, count: str = "allocator",
                         unchecked_from: int | None = None) -> InfeasibleBudgetError:
    """The planner's refusal ``error`` naming a smallest budget the allocator check accepts:
    the one path of :class:`tfremat.keras.RematCallback`, :func:`tfremat.value_and_grad` and
    :func:`tfremat.multi_worker.fit_multi_worker` for a budget no schedule fits.

    The planner's smallest feasible budget is a prediction, and a check that holds it
    (``checks(result)``, as it would hold the budget) reads the allocator above it: a text
    classifier's refusal of "75%" named "98%", refused again by the check for 4.62 MiB held
    (benchmarks/results/user_check_5.md). So the smallest plan the planner found is planned
    (``plan_smallest(planning budget) -> (result, step)``), its step read as
    :func:`hold_allocator_peak` reads (``read_peak``, recorded for the check of the budget
    copied back, which plans under it) and the refusal names :func:`_refusal_figure`'s figure
    (``plan_at``: as :func:`hold_allocator_peak` takes it, for the checkpoint-all step
    where the figure is a share the check does not hold). The planner's own figure, and
    ``error`` unchanged, where nothing can be planned, checked or read.
    """
    smallest = error.min_feasible_bytes
    if smallest is None:
        return error
    planning = math.ceil(smallest)
    try:
        result, step = plan_smallest(planning)
    except (InfeasibleBudgetError, SolverTimeLimitError) as failure:
        log.info("the smallest plan found, under %s, was not planned again (%s): refusing with the planner's figure",
                 format_bytes(planning), failure)
        return error
    if not checks(result):
        return error
    log.info("no schedule fits %s: reading the allocator's peak of the smallest plan found (%s predicted), so that "
             "the budget the refusal names is one the check holds", format_bytes(error.budget_bytes),
             format_bytes(result.predicted_peak_bytes))
    peak = read_peak(step)
    if peak is None:
        return error
    graph = result.extraction.graph
    _remember_held(cache, graph, strategy, options, planning, peak)
    figure = _refusal_figure(result, error.budget_bytes, _held_plans(cache, graph, strategy, options), peak, plan_at,
                             read_peak, unchecked_from, log)
    read = "its XLA step requesting" if count == "requested" else "held in the allocator at"
    detail = (f"the smallest budget found was read from the allocator: the smallest plan found, predicted at "
              f"{format_bytes(result.predicted_peak_bytes)}, was {read} {format_bytes(peak)}; "
              f"{_named_figure(figure, count)}")
    return error.with_changes(min_feasible_bytes=max(figure.bytes, smallest),
                              detail=f"{error.detail}; {detail}" if error.detail else detail,
                              smallest_as_amount=figure.as_amount)


def _aimed_planning_budget(previous: int, budget: int, peak: int, predicted: int, fixed: int,
                           held: dict[int, int], log: logging.Logger) -> int:
    """The budget to plan under after the plan planned under ``previous`` and predicted at
    ``predicted`` bytes was held at ``peak``, over ``budget``: the first plan over is aimed
    by the excess scaled to the next plan's bytes above ``fixed``, a plan over after that one
    subtracts its whole excess (the scaling did not hold for it; :func:`next_planning_budget`).
    A plan read within the budget before (``held``: by planning budget) bounds the aim from
    below, and after one aimed plan read over, is planned under at once (aims between read
    over in a row: MHA + GroupNorm at the 86% of activations a refusal named)."""
    planning_budget = next_planning_budget(previous, budget, peak, predicted, fixed if previous == budget else None)
    known = _known_planning_budget(held, budget, previous)
    if known is not None and (known > planning_budget or previous != budget):
        log.info("a plan under %s was read within the budget %s before: planning under it",
                 format_bytes(known), format_bytes(budget))
        planning_budget = known
    log.info("the allocator's peak %s held exceeds the budget %s (prediction %s); planning again under %s",
             format_bytes(peak), format_bytes(budget), format_bytes(predicted), format_bytes(planning_budget))
    return planning_budget


class _RefusalFigure(NamedTuple):
    """The smallest budget a refusal names (:func:`_refusal_figure`) and what it is."""

    #: The bytes named: ``held`` plus :data:`REFUSAL_SLACK` of its bytes above the fixed bytes.
    bytes: int
    #: The held peak of the plan named.
    held: int
    #: The checkpoint-all step's held peak where it was read (the smallest plan read was held
    #: at a share the check does not hold), else None; above ``bytes`` where ``as_amount``.
    checkpoint_all_held: int | None
    #: The figure is a plan that recomputes, held at a share the check does not hold, named as
    #: an amount in bytes (which the check holds at every size).
    as_amount: bool


def _refusal_figure(result, budget: int, held: dict[int, int], last: int, plan_at: Callable, read_peak: Callable,
                    unchecked_from: int | None, log: logging.Logger) -> _RefusalFigure:
    """The smallest budget a refusal of ``budget`` names for ``result``'s graph (``result``:
    the last plan read, whose own budget is a re-plan's planning budget): the smallest held peak
    over ``budget`` of a plan read (``held``: by planning budget, this process's and other
    processes' records; ``last``: the last plan's), plus :data:`REFUSAL_SLACK` of its bytes
    above the graph's fixed bytes, as the budget copied back is checked in other states of
    the allocator.

    Where that peak, told as a share, is one the check does not hold (``unchecked_from`` and
    up), the checkpoint-all step is read (:func:`_checkpoint_all_held`): a share there trains
    it unchecked. Where the smallest plan read, with the slack, is below that step's held
    peak, it is named as an amount in bytes, which the check holds at every size (the masked
    text transformer's smallest plan held 4.44 MiB against checkpoint-all's 5.01 MiB;
    benchmarks/results/user_check_5.md, "Session 30 (A2)"); else the checkpoint-all step is
    named (nothing recomputed): an amount at or above its read is accepted for it.
    """
    graph = result.extraction.graph

    def named(peak: int, checkpoint_all: int | None, as_amount: bool) -> _RefusalFigure:
        return _RefusalFigure(peak + int(REFUSAL_SLACK * max(peak - graph.fixed_bytes, 0)), peak, checkpoint_all,
                              as_amount)

    # Reads over this budget only: a record of another process may hold a plan within it
    # that read over here.
    smallest = min([peak for peak in held.values() if peak > budget] + [last])
    # The figure with its slack decides: a held peak under the share the check holds from
    # whose figure is not would still be copied back unchecked (a loss-scaled clipnorm CNN:
    # held 42.26 MiB, named 43.49 MiB, 100% of activations; results/user_check_6.md, V2).
    if unchecked_from is None or named(smallest, None, False).bytes < unchecked_from:
        return named(smallest, None, False)
    everything = _checkpoint_all_held(result, plan_at, read_peak, unchecked_from, log)
    amount = named(smallest, everything, True)
    if everything is not None and everything <= amount.bytes:
        return named(everything, everything, False)
    return amount


def _checkpoint_all_held(result, plan_at: Callable, read_peak: Callable, unchecked_from: int,
                         log: logging.Logger) -> int | None:
    """The budget a refusal names where the smallest held peak, told as a share, is one the
    check does not hold (``unchecked_from`` and up): the held peak of the checkpoint-all step,
    which such a budget trains unchecked, and at least ``unchecked_from``. None where it cannot
    be planned or read. Under mixed_float16 a small CNN's "100% of activations", named by a
    refusal of 70%, read 1.18x in training (benchmarks/results/user_check_3.md)."""
    everything = getattr(result, "checkpoint_all_peak_bytes", None)
    if everything is None:
        return None
    log.info("the smallest plan read is held above the checkpoint-all peak: reading the checkpoint-all step")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*at or above the checkpoint-all peak")
            _, step = plan_at(result, max(everything, unchecked_from))
    except (InfeasibleBudgetError, SolverTimeLimitError):
        return None
    peak = read_peak(step)
    return None if peak is None else max(peak, unchecked_from)


def _allocator_refusal(budget: int, peak: int, predicted: int, first_predicted: int, planning_budget: int,
                       figure: _RefusalFigure, failure: Exception | None, strategy: str,
                       count: str = "allocator") -> InfeasibleBudgetError:
    """The refusal of a budget that no plan held for the allocator's peak, in the allocator's
    terms: the last plan's ``peak`` held against its ``predicted`` bytes, why the loop ended
    (``failure``: no schedule fits ``planning_budget``, or none was found in the time limit;
    None: :data:`ALLOCATOR_ROUNDS` plans read over), and as the smallest budget found
    :func:`_refusal_figure`'s ``figure``, a held peak plus :data:`REFUSAL_SLACK` (a budget
    that plan was read within, so that copied back it is accepted: the check plans under that
    plan's planning budget), in words (:func:`_named_figure`).
    The planner's own figures are below the budget (ResNet50 at 300MiB: "smallest feasible
    289.64 MiB" for a 300 MiB budget it refused; benchmarks/user_check.py).
    ``count="requested"``: ``peak`` is the bytes an XLA step requests (held instead of the
    allocator's peak), worded so."""
    chunks = max(peak - predicted, 0)
    if count == "requested":
        held = (f"held for the bytes the XLA step requests: it requests {format_bytes(peak)}, "
                f"{format_bytes(chunks)} over the {format_bytes(predicted)} predicted")
        unchecked = "the predicted bytes only, which XLA's request exceeds"
    else:
        held = (f"held for the allocator's peak: it was {format_bytes(peak)} held, its chunks adding "
                f"{format_bytes(chunks)} to the {format_bytes(predicted)} predicted")
        unchecked = "requested bytes only"
    if isinstance(failure, SolverTimeLimitError):
        limit = "" if failure.time_limit is None else f" of {failure.time_limit:g} s"
        ended = (f"no schedule under {format_bytes(max(planning_budget, 0))} was found within the re-plan's "
                 f"time limit{limit}")
    elif failure is not None:
        ended = f"no schedule fits {format_bytes(max(planning_budget, 0))}"
    else:
        ended = f"it stayed above the budget after {ALLOCATOR_ROUNDS} plans (the first predicted at " \
                f"{format_bytes(first_predicted)})"
    return InfeasibleBudgetError(
        budget, figure.bytes, None, strategy,
        detail=f"{held}, and {ended}; {_named_figure(figure, count)}; "
               f"allocator_check=False holds the budget for {unchecked}",
        smallest_as_amount=figure.as_amount,
    )


def _named_figure(figure: _RefusalFigure, count: str) -> str:
    """What a refusal's smallest budget ``figure`` is, in words: a plan's held peak; where the
    smallest plan read was held at a share the check does not hold, a plan that recomputes
    named as an amount and what it saves against recomputing nothing, or the checkpoint-all
    step's held peak and that at it nothing is recomputed."""
    if figure.checkpoint_all_held is None and not figure.as_amount:
        return "the smallest budget found is the smallest held peak of a plan read, with a slack"
    read = "requesting" if count == "requested" else "held in the allocator at"
    unchecked = "every plan read that recomputes was held at a share the check does not hold (above 99%)"
    if not figure.as_amount:
        return (f"{unchecked}, none below the step that recomputes nothing, so the smallest budget found is that step "
                f"(checkpoint-all, as model.fit's), {read} {format_bytes(figure.checkpoint_all_held)}, with a slack: "
                f"at it the model trains with nothing recomputed")
    text = (f"{unchecked}, so the smallest budget found is named as an amount in bytes, which the check holds at "
            f"every size: the smallest plan read, {read} {format_bytes(figure.held)}, with a slack")
    if figure.checkpoint_all_held is None:
        return text
    return (f"{text}; it saves {format_bytes(figure.checkpoint_all_held - figure.bytes)} against recomputing nothing "
            f"(checkpoint-all, as model.fit's, {read} {format_bytes(figure.checkpoint_all_held)})")


def replan(result, planning_budget: int, strategy: str, options: dict, cache, verbose: int,
           planner: Callable | None = None, log: logging.Logger = logger):
    """``result``'s graph planned under ``planning_budget`` (the new result's budget until a
    check accepts it), with ``result.extraction`` kept: with :func:`replan_strategy`'s
    heuristic where it returned ``result``'s schedule unimproved (the result named
    ``strategy``, ``planned_with`` that heuristic), else, or where that heuristic finds no
    schedule, with ``strategy`` and ``options`` (a finite ``time_limit`` cut to
    :data:`REPLAN_TIME_LIMIT`). ``planner``: the planning function
    (default :func:`tfremat.planner.plan_graph`)."""
    if planner is None:
        from tfremat.planner import plan_graph as planner

    graph = result.extraction.graph
    if options.get("time_limit") is not None and REPLAN_TIME_LIMIT < options["time_limit"] < math.inf:
        options = {**options, "time_limit": REPLAN_TIME_LIMIT}
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
