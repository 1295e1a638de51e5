"""Execution plans: Checkmate's Algorithm 1, turning (R, S) into ordered statements.

A plan is the sequence the compiled training step follows: ``allocate`` (the output
buffer of a node about to run), ``compute`` (run it; ``recompute`` when it already ran in
an earlier stage) and ``deallocate`` (nothing reads the value any more in this stage and
it is not kept into the next). Every value is freed at the earliest point the schedule
allows:

* a value kept into stage t that no node of stage t reads and that is not kept into
  stage t+1 is freed when stage t begins;
* otherwise a value resident in stage t (kept into it, or computed in it) that is not
  kept into stage t+1 is freed right after its last reader in stage t runs, or right
  after it is computed when nothing in stage t reads it.

A node with residual bytes (:attr:`tfremat.graph.DFGraph.residual_bytes`) has two parts,
freed by the rules above each on its own: the residuals, read only by the node's backward
node, and the output, read by its other successors. Keeping the node into stage t+1 keeps
a part only while a later stage still reads that copy of it (before the node is computed
again): a softmax whose backward runs stages later keeps its residual and frees its
output once the next forward node has read it.

A schedule that offloads (``Schedule.H``) adds two statements, timed by the graph's
costs and the schedule's ``host_bandwidth`` as Beaumont et al. advise (sec. 4, Lemma 1:
offload as early, prefetch as late as possible):

* ``offload`` right after the compute that starts a host copy. The device copy's
  ``deallocate`` moves to the first compute predicted to start after the copy ends (the
  transfers queue on one link), but before the node is computed again; the step waits
  there for the copy, so the bytes are gone when the plan says.
* ``prefetch`` (it allocates the device copy) as late as the link allows the copy to land
  before the stage that keeps the value, after the device copy's ``deallocate``; the
  first reader waits for it.

Predictions count compute costs only; the simulator replays the two timelines and
reports the waits (:func:`tfremat.plan.simulator.simulate`).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from collections.abc import Mapping

import numpy as np

from tfremat.errors import ScheduleError
from tfremat.graph import DFGraph
from tfremat.plan.schedule import Schedule, graph_under, prefetch_stages, with_fresh_gradient_reads

__all__ = ["Op", "Statement", "ExecutionPlan", "build_plan", "parts_needed_later"]


class Op(enum.Enum):
    ALLOCATE = "allocate"
    COMPUTE = "compute"
    DEALLOCATE = "deallocate"
    OFFLOAD = "offload"  # start copying the value to host memory
    PREFETCH = "prefetch"  # allocate the device copy and start copying the value back


@dataclasses.dataclass(frozen=True)
class Statement:
    """One plan statement.

    Attributes:
        op: what happens.
        node: the node whose value it concerns.
        stage: the stage t it belongs to.
        recompute: for COMPUTE, True when the node was already computed in an earlier stage.
        part: for DEALLOCATE, the part of the value freed (``"output"`` or ``"residual"``,
            :meth:`tfremat.graph.DFGraph.value_parts`); None frees the whole value.
    """

    op: Op
    node: int
    stage: int
    recompute: bool = False
    part: str | None = None


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    """An ordered, immutable list of statements for one training step.

    ``host_bandwidth``: the host link its copies were timed for (None: no copies).
    ``implementations``: the schedule's implementation choice (None: the defaults); the plan
    is for the graph under it (:func:`~tfremat.plan.schedule.graph_under`).
    """

    statements: tuple[Statement, ...]
    num_nodes: int
    host_bandwidth: float | None = None
    implementations: Mapping[int, str] | None = None

    def __iter__(self):
        return iter(self.statements)

    def __len__(self) -> int:
        return len(self.statements)

    @property
    def recompute_count(self) -> int:
        return sum(1 for s in self.statements if s.op is Op.COMPUTE and s.recompute)


def build_plan(graph: DFGraph, schedule: Schedule) -> ExecutionPlan:
    """Emits the statements of ``schedule`` in row-major order of R (Checkmate Alg. 1),
    with its host copies placed by :func:`_place_transfers` when it offloads.

    The schedule is assumed valid (see :func:`tfremat.plan.schedule.validate_schedule`); it
    runs on ``graph`` under its implementations. A gradient that would read an input
    computed again after its forward value is preceded by a recomputation of the forward
    node (:func:`~tfremat.plan.schedule.with_fresh_gradient_reads`), so the plan
    holds all the work and memory the compiled step does.

    Raises:
        ScheduleError: the schedule offloads without a ``host_bandwidth``.
    """
    schedule = with_fresh_gradient_reads(graph, schedule)
    graph = graph_under(graph, schedule)
    n = graph.size
    R, S = schedule.R, schedule.S
    preds = graph.predecessors
    # Per node: its parts, and per predecessor the part of it the node reads (the
    # graph's accessors, looked up once: a plan reads them for every value in every stage).
    parts = [graph.value_parts(i) for i in range(n)]
    reads = [[(i, graph.part_read_by(i, k)) for i in preds[k]] for k in range(n)]
    needed_later = {i: {part: flags.tolist() for part, flags in parts_needed_later(graph, R, i).items()}
                    for i in range(n) if graph.residual_bytes[i]}
    computed_before = [False] * n
    freed: set[tuple[int, str | None]] = set()  # parts freed since their node last ran
    statements: list[Statement] = []

    def free(i: int, part, t: int) -> None:
        if (i, part) not in freed:
            freed.add((i, part))
            statements.append(Statement(Op.DEALLOCATE, i, t, part=part))

    computed_in = _rows(R)
    # The kept values a stage may free before its computations: those not kept into the next
    # stage, and those with parts (a part may not be kept on). A value kept on whole is never
    # freed there, so it is left out of the walk (in order, as before).
    kept_on = np.zeros_like(S)
    kept_on[:-1] = S[1:]
    has_parts = np.array([bool(b) for b in graph.residual_bytes])
    may_free_in = _rows(S & (~kept_on | has_parts))
    prefetched = _rows(prefetch_stages(R, S, schedule.H))
    for t in range(n):
        keep_next = S[t + 1].tolist() if t + 1 < n else [False] * n
        if t:
            for i in prefetched[t - 1]:  # a copy back from the host is freed anew
                for part in parts[i]:
                    freed.discard((i, part))

        def kept(i: int, part) -> bool:
            return keep_next[i] and (part is None or needed_later[i][part][t])

        computed = computed_in[t]
        # last_use[(i, part)]: the last node of stage t that reads or produces that part of value i.
        last_use: dict[tuple[int, str | None], int] = {}
        for k in computed:
            for part in parts[k]:
                last_use[(k, part)] = k
            for key in reads[k]:
                if last_use.get(key, -1) < k:
                    last_use[key] = k
        for i in may_free_in[t]:
            for part in parts[i]:
                if (i, part) not in last_use and not kept(i, part):
                    free(i, part, t)
        frees_after: dict[int, list[tuple[int, str | None]]] = {}
        for (i, part), k in last_use.items():
            if not kept(i, part):
                frees_after.setdefault(k, []).append((i, part))
        for k in computed:
            statements.append(Statement(Op.ALLOCATE, k, t))
            statements.append(Statement(Op.COMPUTE, k, t, recompute=computed_before[k]))
            computed_before[k] = True
            for part in parts[k]:
                freed.discard((k, part))
            for i, part in sorted(frees_after.get(k, ()), key=lambda key: (key[0], key[1] or "")):
                free(i, part, t)
    if not schedule.offloads:
        return ExecutionPlan(tuple(statements), n, None, schedule.implementations)
    return ExecutionPlan(tuple(_place_transfers(graph, schedule, statements)), n, float(schedule.host_bandwidth),
                         schedule.implementations)


def _place_transfers(graph: DFGraph, schedule: Schedule, statements: list[Statement]) -> list[Statement]:
    """Inserts the offloads and prefetches of ``schedule.H`` into the statements of R and S
    and moves each offloaded device copy's deallocation behind its copy (module docstring).

    Times are predicted on the statements without transfers: a statement starts when the
    computes before it are done. Offloads queue on the link in plan order; prefetches are
    laid out backwards from when their stage begins, each ending before the next starts.
    """
    if schedule.host_bandwidth is None:
        raise ScheduleError("the schedule offloads values but names no host_bandwidth to time the copies by",
                            rule="host-link")
    bandwidth = float(schedule.host_bandwidth)
    H = schedule.H
    out, cost = graph.output_bytes, graph.cost
    starts = [0.0, *itertools.accumulate(cost[s.node] if s.op is Op.COMPUTE else 0.0 for s in statements)]
    computes = [p for p, s in enumerate(statements) if s.op is Op.COMPUTE]
    compute_starts = [starts[p] for p in computes]
    # Insertions keyed by (base position they precede, rank): offloads right after their
    # compute, then moved deallocations, then prefetches.
    inserted: list[tuple[tuple[int, int], Statement]] = []
    moved: set[int] = set()
    freed_at: dict[int, list[tuple[int, int]]] = {}  # node -> keys of its device copies' deallocations
    stage_begins = {}
    for position, statement in enumerate(statements):
        stage_begins.setdefault(statement.stage, position)
    wanted = []
    for t, i in np.argwhere(prefetch_stages(schedule.R, schedule.S, H)):
        need = stage_begins.get(int(t) + 1, len(statements))
        wanted.append((need, int(i), int(t)))
    # Per node, the positions of its allocations and deallocations and the stage begins its
    # prefetches must precede, in order: each offload looks up the next ones by bisection.
    allocations: dict[int, list[int]] = {}
    deallocations: dict[int, list[int]] = {}
    for position, statement in enumerate(statements):
        if statement.op is Op.ALLOCATE:
            allocations.setdefault(statement.node, []).append(position)
        elif statement.op is Op.DEALLOCATE:
            deallocations.setdefault(statement.node, []).append(position)
    needs: dict[int, list[int]] = {}
    for need, i, _ in wanted:
        needs.setdefault(i, []).append(need)
    for positions in needs.values():
        positions.sort()

    def next_after(positions: list[int], position: int) -> int | None:
        """The first of the sorted ``positions`` after ``position`` (None: none)."""
        k = bisect.bisect_right(positions, position)
        return positions[k] if k < len(positions) else None

    # (t, i): a host copy of value i starts after stage t computes it.
    copies = set(zip(*(axis.tolist() for axis in np.nonzero(H[1:] & ~H[:-1]))))
    link = 0.0
    for position, statement in enumerate(statements):
        i, t = statement.node, statement.stage
        if statement.op is not Op.COMPUTE or (t, i) not in copies:
            continue
        begin = max(starts[position + 1], link)
        link = begin + out[i] / bandwidth
        inserted.append(((position + 1, 0), Statement(Op.OFFLOAD, i, t)))
        free = next_after(deallocations.get(i, []), position)
        if free is None:
            continue
        # Before the node is computed again or its host copy comes back.
        again = min(p for p in (next_after(allocations.get(i, []), position), next_after(needs.get(i, []), position),
                                len(statements)) if p is not None)
        landed = bisect.bisect_left(compute_starts, link)
        target = computes[landed] if landed < len(computes) else len(statements)
        target = min(max(target, free), again)
        moved.add(free)
        key = (target, 1)
        freed_at.setdefault(i, []).append(key)
        inserted.append((key, dataclasses.replace(statements[free], stage=_stage_at(statements, target))))
    link_back = np.inf
    for need, i, t in sorted(wanted, reverse=True):
        end = min(starts[need], link_back)
        begin = end - out[i] / bandwidth
        link_back = begin
        issue = bisect.bisect_right(compute_starts, begin) - 1
        key = (computes[issue] if issue >= 0 else 0, 2)
        earliest = max((k for k in freed_at.get(i, ()) if k <= (need, 1)), default=(0, 1))
        key = min(max(key, (earliest[0], 2)), (need, 2))
        inserted.append((key, Statement(Op.PREFETCH, i, _stage_at(statements, key[0]))))
    inserted.sort(key=lambda item: item[0])
    result: list[Statement] = []
    cursor = 0
    for position, statement in enumerate(statements):
        while cursor < len(inserted) and inserted[cursor][0][0] <= position:
            result.append(inserted[cursor][1])
            cursor += 1
        if position not in moved:
            result.append(statement)
    result.extend(statement for _, statement in inserted[cursor:])
    return result


def _rows(matrix: np.ndarray) -> list[list[int]]:
    """The columns of each row's nonzero entries, in order (one ``nonzero`` for the matrix)."""
    rows, columns = np.nonzero(matrix)
    bounds = np.searchsorted(rows, np.arange(matrix.shape[0] + 1)).tolist()
    columns = columns.tolist()
    return [columns[bounds[t] : bounds[t + 1]] for t in range(matrix.shape[0])]


def _stage_at(statements: list[Statement], position: int) -> int:
    """The stage of the statement at ``position`` (the last stage past the end)."""
    return statements[min(position, len(statements) - 1)].stage


def parts_needed_later(graph: DFGraph, R: np.ndarray, node: int) -> dict[str, np.ndarray]:
    """Per part of ``node``'s value, for every stage t: whether a stage after t reads the
    copy resident at the end of t, i.e. a reader of that part runs in a later stage before
    any stage recomputes ``node`` (a stage that recomputes it reads the new copy)."""
    n = graph.size
    backward = graph.backward_of[node]
    readers = {"residual": [backward], "output": [k for k in graph.successors[node] if k != backward]}
    stages = np.arange(n)
    never = n

    def next_after(flags: np.ndarray) -> np.ndarray:
        first = np.minimum.accumulate(np.where(flags, stages, never)[::-1])[::-1]
        return np.append(first[1:], never)

    recomputes = R[:, node]
    next_recompute = next_after(recomputes)
    needed = {}
    for part, nodes in readers.items():
        reads = R[:, nodes].any(axis=1) & ~recomputes if nodes else np.zeros(n, dtype=bool)
        needed[part] = next_after(reads) < next_recompute
    return needed
