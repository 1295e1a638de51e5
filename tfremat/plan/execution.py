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
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.schedule import Schedule

__all__ = ["Op", "Statement", "ExecutionPlan", "build_plan"]


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
    """

    op: Op
    node: int
    stage: int
    recompute: bool = False


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
    computed_before = np.zeros(n, dtype=bool)
    statements: list[Statement] = []
    for t in range(n):
        row_r = R[t]
        keep_next = S[t + 1] if t + 1 < n else np.zeros(n, dtype=bool)
        computed = np.flatnonzero(row_r)
        # last_use[i]: the last node of stage t that reads or produces value i.
        last_use = {}
        for k in computed:
            last_use[int(k)] = int(k)
            for i in preds[k]:
                last_use[i] = max(last_use.get(i, -1), int(k))
        for i in np.flatnonzero(S[t]):
            if int(i) not in last_use and not keep_next[i]:
                statements.append(Statement(Op.DEALLOCATE, int(i), t))
        frees_after: dict[int, list[int]] = {}
        for i, k in last_use.items():
            if not keep_next[i]:
                frees_after.setdefault(k, []).append(i)
        for k in computed:
            k = int(k)
            statements.append(Statement(Op.ALLOCATE, k, t))
            statements.append(Statement(Op.COMPUTE, k, t, recompute=bool(computed_before[k])))
            computed_before[k] = True
            for i in sorted(frees_after.get(k, ())):
                statements.append(Statement(Op.DEALLOCATE, i, t))
    return ExecutionPlan(tuple(statements), n)
