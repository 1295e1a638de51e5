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
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.schedule import Schedule

__all__ = ["Op", "Statement", "ExecutionPlan", "build_plan", "parts_needed_later"]


class Op(enum.Enum):
    ALLOCATE = "allocate"
    COMPUTE = "compute"
    DEALLOCATE = "deallocate"


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
    """An ordered, immutable list of statements for one training step."""

    statements: tuple[Statement, ...]
    num_nodes: int

    def __iter__(self):
        return iter(self.statements)

    def __len__(self) -> int:
        return len(self.statements)

    @property
    def recompute_count(self) -> int:
        return sum(1 for s in self.statements if s.op is Op.COMPUTE and s.recompute)


def build_plan(graph: DFGraph, schedule: Schedule) -> ExecutionPlan:
    """Emits the statements of ``schedule`` in row-major order of R (Checkmate Alg. 1).

    The schedule is assumed valid (see :func:`tfremat.plan.schedule.validate_schedule`).
    """
    n = graph.size
    R, S = schedule.R, schedule.S
    preds = graph.predecessors
    needed_later = {i: parts_needed_later(graph, R, i) for i in range(n) if graph.residual_bytes[i]}
    computed_before = np.zeros(n, dtype=bool)
    freed: set[tuple[int, str | None]] = set()  # parts freed since their node last ran
    statements: list[Statement] = []

    def free(i: int, part, t: int) -> None:
        if (i, part) not in freed:
            freed.add((i, part))
            statements.append(Statement(Op.DEALLOCATE, i, t, part=part))

    for t in range(n):
        row_r = R[t]
        keep_next = S[t + 1] if t + 1 < n else np.zeros(n, dtype=bool)

        def kept(i: int, part) -> bool:
            return bool(keep_next[i]) and (part is None or bool(needed_later[i][part][t]))

        computed = np.flatnonzero(row_r)
        # last_use[(i, part)]: the last node of stage t that reads or produces that part of value i.
        last_use: dict[tuple[int, str | None], int] = {}
        for k in computed:
            k = int(k)
            for part in graph.value_parts(k):
                last_use[(k, part)] = k
            for i in preds[k]:
                key = (i, graph.part_read_by(i, k))
                last_use[key] = max(last_use.get(key, -1), k)
        for i in np.flatnonzero(S[t]):
            i = int(i)
            for part in graph.value_parts(i):
                if (i, part) not in last_use and not kept(i, part):
                    free(i, part, t)
        frees_after: dict[int, list[tuple[int, str | None]]] = {}
        for (i, part), k in last_use.items():
            if not kept(i, part):
                frees_after.setdefault(k, []).append((i, part))
        for k in computed:
            k = int(k)
            statements.append(Statement(Op.ALLOCATE, k, t))
            statements.append(Statement(Op.COMPUTE, k, t, recompute=bool(computed_before[k])))
            computed_before[k] = True
            for part in graph.value_parts(k):
                freed.discard((k, part))
            for i, part in sorted(frees_after.get(k, ()), key=lambda key: (key[0], key[1] or "")):
                free(i, part, t)
    return ExecutionPlan(tuple(statements), n)


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
