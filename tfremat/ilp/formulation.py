"""Checkmate's rematerialization MILP, built as solver-neutral sparse arrays.

The model follows Checkmate (Jain et al., MLSys 2020, sec. 4) over frontier-advancing
stages: stage ``t`` computes node ``t`` for the first time and may recompute any earlier
node. Binary ``R[t, i]`` (compute i in stage t) and ``S[t, i]`` (keep value i from stage
t-1 into stage t), ``FREE[t, i, k]`` (free value i right after node k runs in stage t;
0/1 by the rows below) and continuous ``U[t, k]`` (bytes resident while node k runs in
stage t, without k's workspace and without the fixed bytes, which the budget absorbs).

Memory follows the planning core's simulator (:mod:`tfremat.plan.simulator`) exactly:
``fixed_bytes`` always count; while node k runs, every value kept into the stage or
computed earlier in it and not yet freed counts, plus k's output and k's workspace; a
value is freed right after its last use in the stage (its last reader, or itself when
nobody in the stage reads it) unless it is kept into the next stage. A test holds
``U`` and the simulator together.

Only variables that an optimal schedule can use are built (Checkmate sec. 4.6 and the
reasoning behind it):

* ``R`` and ``S`` are lower triangular; ``R[t, t] = 1`` (frontier advancing).
* Every computation or keep in stage t ultimately serves a frontier node ``t' >= t``,
  so value i is never computed or kept after stage ``last_descendant[i]``; a value
  without readers is never kept.

Rows (each valid for some optimal schedule, since dropping a useless computation or keep
never adds cost or memory; together they make the memory accounting exact):

* every input of a computed node is resident (kept into the stage or computed earlier
  in it);
* a value is never kept and recomputed in the same stage;
* a value resident in stage t (``R[t, i] + S[t, i]``) has exactly one fate: it is kept
  into stage t+1 or freed after exactly one of its readers k in the stage
  (``sum_k FREE[t, i, k] + S[t+1, i]`` equals it). This one equality implies
  Checkmate's keep-source rows (``S[t+1, i] <= R[t, i] + S[t, i]``) and that a kept or
  computed value is read in the stage or kept on, so those rows are not built, and the
  simulator's "unread keep freed at the start of the stage" case never arises;
* ``FREE[t, i, k] <= R[t, k]`` and, for every reader j, ``sum_{k < j} FREE[t, i, k] +
  R[t, j] <= 1`` (no free before a later reader): one row per reader, tighter than
  Checkmate's per-pair big-M rows. With the equality, ``FREE`` is exactly the
  simulator's last-use indicator, so ``U`` equals the simulated memory;
* ``FREE[t, i, i]`` (a value freed right after it is computed, unread) is built only for
  the two values of a node with residual bytes (below): recomputing the node for one of
  them makes the other, which may have no reader in the stage. For any other node the
  equality leaves it no role, since a computed value must be read or kept.

A node with residual bytes (``DFGraph.residual_bytes``) holds two values: its output,
read by its successors other than its backward node, and its residuals, read by its
backward node. Each has its own keep column (``S`` for the output, ``S_res`` for the
residuals) and its own ``FREE`` columns and rows; ``R`` computes both. A decoded schedule
keeps the node when it keeps either, and its execution plan frees each part after its last
reader as the model does (:mod:`tfremat.plan.execution`).

The stage-end relaxation (``exact_stages``) keeps ``FREE`` and ``U`` only for some stages;
every other stage t gets one memory row, exact at the moment node t runs (the stage's
last: every value kept into stage t+1 is resident then, with t's inputs, output and
workspace), plus the keep-source rows its ``FREE`` equality implied. Moments earlier in
the stage are unbounded there, so the model is a relaxation, a third to a half the size
of the exact one. Its LP is as tight as the exact LP on the benchmark graphs and several
times faster (docs/solver.md), and its solutions usually fit: ``optimal`` accounts exactly
only the stages where one overflows.

Memory is measured in units of ``scale`` bytes. When every byte count is a multiple of a
common unit and the budget is at most 1000 such units, that unit is used and the budget
row is exact in integers. Otherwise the budget is one unit: the dual simplex is several
times faster with memory in units of the budget than in units of a tensor (measured on
the MobileNet and ResNet50 graphs at 80%).
The budget row is not shrunk to absorb the solver's tolerances: a margin would cut off
every schedule whose peak lies within it, so a schedule exactly at the budget (a budget
taken from a measured peak) was neither found nor accepted as a warm start, and the bound
and the "optimal" claim held only for the shrunk budget. A solution that overflows by the
tolerance is caught by the simulator instead (see ``optimal``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from functools import reduce

import numpy as np

from tfremat.errors import ArgumentError
from tfremat.graph import DFGraph
from tfremat.plan.execution import parts_needed_later
from tfremat.plan.schedule import Schedule, prune_s, validate_schedule
from tfremat.plan.simulator import SimulationResult, stage_peaks
from tfremat.units import format_bytes

__all__ = [
    "SparseMILP",
    "CheckmateModel",
    "build_milp",
    "overflowing_stages",
    "memory_lower_bound",
    "last_descendants",
    "r_column_count",
]

_MAX_EXACT_UNITS = 1e3


def last_descendants(graph: DFGraph) -> np.ndarray:
    """``last[i]``: the largest node id reachable from i (i itself when it has no readers).

    A value is only useful in stages up to ``last[i]``: every computation serves some
    later frontier node, which must be a descendant.
    """
    n = graph.size
    last = np.arange(n)
    for i in range(n - 1, -1, -1):
        for j in graph.successors[i]:
            if last[j] > last[i]:
                last[i] = last[j]
    return last


def r_column_count(graph: DFGraph) -> int:
    """Number of R columns :func:`build_milp` creates (the whole model has about 4.5-6
    times as many columns: 287k for ResNet50's 62k, 4.1M for the 1000-node random graph's
    500k), known before building it."""
    last = last_descendants(graph)
    return int((last - np.arange(graph.size) + 1).sum())


def overflowing_stages(graph: DFGraph, outcome: SimulationResult, budget_bytes: int) -> set[int]:
    """The stages of a simulated schedule whose memory exceeds the budget: those a
    stage-end relaxation must account exactly (``exact_stages``) to exclude it."""
    return set(map(int, np.flatnonzero(stage_peaks(outcome, graph.size) > budget_bytes)))


def _values(graph: DFGraph, i: int, s_index, sr_index) -> list[tuple[np.ndarray, int, list[int]]]:
    """The values node ``i`` holds, each as ``(keep column array, bytes, readers)``: the
    whole value, or for a node with residual bytes its output and its residuals."""
    if not graph.residual_bytes[i]:
        return [(s_index, graph.output_bytes[i], list(graph.successors[i]))]
    backward = graph.backward_of[i]
    return [(s_index, graph.part_bytes(i, "output"), [k for k in graph.successors[i] if k != backward]),
            (sr_index, graph.residual_bytes[i], [backward])]


def _keep_array(graph: DFGraph, i: int, reader: int, s_index, sr_index) -> np.ndarray:
    """The keep column array of the value of ``i`` that ``reader`` reads."""
    return sr_index if graph.part_read_by(i, reader) == "residual" else s_index


def _running_bytes(graph: DFGraph, node: int) -> int:
    """Bytes resident while ``node`` runs, beyond the fixed bytes: its inputs, its output and
    its workspace."""
    return graph.output_bytes[node] + graph.workspace_bytes[node] + sum(
        graph.part_bytes(i, graph.part_read_by(i, node)) for i in graph.predecessors[node])


def memory_lower_bound(graph: DFGraph) -> int:
    """A proven lower bound on the peak of any schedule, in bytes.

    Every node runs at least once, and while it runs its inputs, its output and its
    workspace are resident together with the fixed bytes.
    """
    return graph.fixed_bytes + _running_bytes(graph, heaviest_node(graph))


def heaviest_node(graph: DFGraph) -> int:
    """The node that sets :func:`memory_lower_bound`."""
    return max(range(graph.size), key=lambda k: _running_bytes(graph, k))


def lower_bound_reason(graph: DFGraph) -> str:
    """Why no schedule goes below :func:`memory_lower_bound`, naming the node, for errors."""
    node = heaviest_node(graph)
    return (f"node {node} ({graph.names[node]}) needs {format_bytes(_running_bytes(graph, node))} while it runs: "
            "its inputs, its output and its workspace")


@dataclasses.dataclass(frozen=True, eq=False)
class SparseMILP:
    """A MILP in column-wise sparse form, as the solver backends take it.

    Attributes:
        graph: the graph it schedules.
        cost_scale: graph cost (bytes, when minimizing the peak) per objective unit; the
            solver backends scale back, so objectives and bounds they report are in the
            graph's cost unit (in bytes).
        cost: objective coefficient of every column.
        lower, upper: column bounds.
        integer: True for binary columns.
        col_start, row_index, value: the constraint matrix, compressed sparse columns.
        row_lower, row_upper: row bounds (``-inf``/``inf`` where open).
    """

    graph: DFGraph
    cost_scale: float
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    col_start: np.ndarray
    row_index: np.ndarray
    value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray

    @property
    def num_vars(self) -> int:
        return len(self.cost)

    @property
    def num_constraints(self) -> int:
        return len(self.row_lower)


@dataclasses.dataclass(frozen=True, eq=False)
class CheckmateModel(SparseMILP):
    """Checkmate's MILP (a :class:`SparseMILP`) plus the maps back to the schedule.

    Attributes:
        budget_bytes: the memory budget the model was built for.
        scale: bytes per memory unit in the model.
        r_index, s_index: (n, n) int arrays, the column of ``R[t, i]`` / ``S[t, i]``, -1
            where the variable is not built (fixed to 0). For a node with residual bytes
            ``S`` keeps its output.
        sr_index: (n, n), the column of ``S_res[t, i]``, the keep of a node's residuals
            (-1 for nodes without residual bytes).
        free_keys: ``(t, i, k, keep array, bytes, readers)`` of every FREE column (free
            that value of node i after node k in stage t), in column order from ``free_start``.
        u_keys: ``(t, k)`` of every U column, in column order from ``u_start``.
        capacity: the budget less the fixed bytes in model units, as the rows use it.
        peak_column: the column of the peak when the model minimizes it, else -1.
    """

    budget_bytes: float
    scale: float
    r_index: np.ndarray
    s_index: np.ndarray
    sr_index: np.ndarray
    free_keys: tuple
    free_start: int
    u_keys: tuple
    u_start: int
    capacity: float
    peak_column: int

    def decode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rounds a solution vector to boolean ``(R, S)``."""
        x = np.asarray(x, dtype=float)
        R = np.zeros(self.r_index.shape, dtype=bool)
        S = np.zeros(self.s_index.shape, dtype=bool)
        mask = self.r_index >= 0
        R[mask] = x[self.r_index[mask]] > 0.5
        for index in (self.s_index, self.sr_index):
            mask = index >= 0
            S[mask] |= x[index[mask]] > 0.5
        return R, S

    def schedule(self, x: np.ndarray, strategy: str) -> Schedule:
        """The valid schedule of a solution vector: rounded, with a value kept into a stage
        not also recomputed there (a zero-cost node makes both optimal) and unread keeps
        dropped. Memory only goes down."""
        R, S = self.decode(x)
        R &= ~np.tril(S, -1)
        schedule = Schedule(R, prune_s(self.graph, R, S), strategy)
        validate_schedule(self.graph, schedule)
        return schedule

    def memory_while_running(self, x: np.ndarray) -> dict[tuple[int, int], float]:
        """The model's bytes while node k runs in stage t (``U + workspace``), for computed k."""
        x = np.asarray(x, dtype=float)
        work = self.graph.workspace_bytes
        memory = {}
        for offset, (t, k) in enumerate(self.u_keys):
            if x[self.r_index[t, k]] > 0.5:
                memory[(t, k)] = self.graph.fixed_bytes + x[self.u_start + offset] * self.scale + work[k]
        return memory

    def encode(self, schedule: Schedule) -> np.ndarray | None:
        """The solution vector of a schedule (a MIP start), or None when the schedule
        uses a variable this model does not build or breaks one of its cuts."""
        graph, n = self.graph, self.graph.size
        R, S = schedule.R, schedule.S
        keeps = {}  # per keep column array: the keep matrix of its values
        keeps[id(self.s_index)] = S.copy()
        keeps[id(self.sr_index)] = np.zeros_like(S)
        for i in np.flatnonzero(graph.residual_bytes):
            # A part is kept into stage t while a stage >= t reads that copy of it.
            needed = parts_needed_later(graph, R, int(i))
            after_previous = {part: np.concatenate([[False], flags[:-1]]) for part, flags in needed.items()}
            keeps[id(self.s_index)][:, i] = S[:, i] & after_previous["output"]
            keeps[id(self.sr_index)][:, i] = S[:, i] & after_previous["residual"]
        if (R & (self.r_index < 0)).any():
            return None
        x = np.zeros(self.num_vars)
        x[self.r_index[R]] = 1.0
        for index in (self.s_index, self.sr_index):
            kept = keeps[id(index)]
            if (kept & (index < 0)).any():
                return None
            x[index[kept]] = 1.0
        frees: dict[tuple[int, int], float] = {}
        for offset, (t, i, k, index, size, readers) in enumerate(self.free_keys):
            later_reader = any(R[t, j] for j in readers if k < j <= t)
            kept = t + 1 < n and keeps[id(index)][t + 1, i]
            if R[t, k] and not kept and not later_reader:
                x[self.free_start + offset] = 1.0
                frees[(t, k)] = frees.get((t, k), 0.0) + size / self.scale
        out = graph.output_bytes
        previous = None
        for offset, (t, k) in enumerate(self.u_keys):
            if previous is None or previous[0] != t:
                level = sum(size * keeps[id(index)][t, i] for i in range(t)
                            for index, size, _ in _values(graph, i, self.s_index, self.sr_index)) / self.scale
            else:
                level -= frees.get(previous, 0.0)
            level += out[k] / self.scale * R[t, k]
            x[self.u_start + offset] = level
            previous = (t, k)
        if self.peak_column >= 0:
            work = self.graph.workspace_bytes
            x[self.peak_column] = max(
                (x[self.u_start + offset] + work[k] / self.scale for offset, (t, k) in enumerate(self.u_keys) if R[t, k]),
                default=0.0,
            )
        if self._violation(x) > 1e-6:
            return None
        return x

    def dual_bound(self, row_dual: np.ndarray) -> float:
        """A proven lower bound on the LP relaxation's optimum (so on the MILP's), in the
        graph's cost unit, from any row multipliers, however inexact.

        Weak duality with bounded columns: for multipliers y of the right sign
        (``y >= 0`` on rows bounded only below, ``<= 0`` on rows bounded only above;
        others are clipped to that), every feasible x has ``c x >= sum_r y_r b_r +
        sum_j min over [l_j, u_j] of (c - A^T y)_j x_j``. Every column here is bounded.
        """
        y = np.asarray(row_dual, dtype=float).copy()
        lower, upper = self.row_lower, self.row_upper
        y[np.isinf(lower)] = np.minimum(y[np.isinf(lower)], 0.0)
        y[np.isinf(upper)] = np.maximum(y[np.isinf(upper)], 0.0)
        rows = np.where(y > 0, np.where(np.isinf(lower), 0.0, lower), np.where(np.isinf(upper), 0.0, upper)) * y
        counts = np.diff(self.col_start)
        reduced = self.cost - np.bincount(
            np.repeat(np.arange(self.num_vars), counts), weights=self.value * y[self.row_index], minlength=self.num_vars
        )
        cols = np.where(reduced > 0, reduced * self.lower, reduced * self.upper)
        return float((rows.sum() + cols.sum()) * self.cost_scale)

    def _violation(self, x: np.ndarray) -> float:
        activity = np.zeros(self.num_constraints)
        counts = np.diff(self.col_start)
        np.add.at(activity, self.row_index, self.value * np.repeat(x, counts))
        rows = np.maximum(self.row_lower - activity, activity - self.row_upper)
        cols = np.maximum(self.lower - x, x - self.upper)
        return float(max(rows.max(initial=0.0), cols.max(initial=0.0)))


def _memory_scale(graph: DFGraph, capacity_bytes: float) -> tuple[int | float, bool]:
    """Bytes per model unit, and whether memory is exact integers in that unit (then the
    unit is an int, the greatest common divisor of the byte counts).

    ``capacity_bytes`` is the budget less the fixed bytes.
    """
    sizes = [b for b in (*graph.output_bytes, *graph.workspace_bytes) if b > 0]
    if not sizes or capacity_bytes <= 0:
        return 1, True
    unit = reduce(math.gcd, sizes)
    if capacity_bytes / unit <= _MAX_EXACT_UNITS:
        return unit, True
    return float(capacity_bytes), False


class SparseBuilder:
    """Accumulates columns and rows; rows are stored as coordinate triples."""

    def __init__(self):
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []

    def column(self, cost: float, lower: float, upper: float, integer: bool) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(self.row_lower)
        for c, v in terms:
            self.rows.append(r)
            self.cols.append(c)
            self.vals.append(v)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def csc(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cols = np.asarray(self.cols, dtype=np.int64)
        rows = np.asarray(self.rows, dtype=np.int64)
        vals = np.asarray(self.vals, dtype=float)
        order = np.lexsort((rows, cols))
        start = np.zeros(len(self.cost) + 1, dtype=np.int64)
        np.cumsum(np.bincount(cols, minlength=len(self.cost)), out=start[1:])
        return start, rows[order], vals[order]


def _units(graph: DFGraph, budget_bytes: float) -> tuple[int | float, float, float]:
    """``(scale, capacity, cost_scale)``: bytes per memory unit, the budget less the fixed
    bytes in those units, and graph cost per objective unit."""
    scale, exact = _memory_scale(graph, budget_bytes - graph.fixed_bytes)
    # In integer units the solver's tolerances (1e-7 on rows, 1e-6 on integrality) stay
    # far below one unit; in units of the budget a solution may sit above it by about
    # 1e-7 of it, which the simulator catches (module docstring).
    if exact:
        # The whole units that fit, in integer arithmetic: every byte count is a multiple
        # of the unit, so a budget 1 byte short of a multiple allows one unit less. (Float
        # division with a rounding margin admitted schedules 1 byte over a budget just
        # below a unit boundary when the unit was 2**32 bytes.)
        capacity = (math.floor(budget_bytes) - graph.fixed_bytes) // scale
    else:
        capacity = (budget_bytes - graph.fixed_bytes) / scale
    # Node costs span many orders of magnitude (up to 2e12 in the FCN8 graph), which
    # stalls the simplex; the objective is in units of the largest node cost.
    cost_scale = max(graph.cost) or 1.0
    return scale, capacity, cost_scale


def _schedule_columns(b: SparseBuilder, graph: DFGraph, cost_scale: float, minimize_peak: bool):
    """The binary columns ``R[t, i]`` and ``S[t, i]`` (Checkmate sec. 4.2) with the
    objective, total compute cost ``sum_t sum_i C_i R[t, i]`` (sec. 4.3; zero when the
    model minimizes the peak), and the frontier-advancing constraint ``R[t, t] = 1``
    (sec. 4.3) as a column bound.

    Only columns an optimal schedule can use are built (sec. 4.6 and the module doc):
    lower triangular, nothing after ``last_descendant[i]``, no keep of a value without
    readers. A node with residual bytes gets a keep column per value (``S`` for its output,
    ``S_res`` for its residuals). Returns ``(r_index, s_index, sr_index)``, -1 where a
    column is not built.
    """
    n = graph.size
    last = last_descendants(graph)
    r_index = np.full((n, n), -1, dtype=np.int64)
    s_index = np.full((n, n), -1, dtype=np.int64)
    sr_index = np.full((n, n), -1, dtype=np.int64)
    for t in range(n):
        for i in range(t + 1):
            if t <= last[i]:
                fixed = 1.0 if i == t else 0.0
                objective = 0.0 if minimize_peak else graph.cost[i] / cost_scale
                r_index[t, i] = b.column(objective, fixed, 1.0, True)
        for i in range(t):
            for index, _, readers in _values(graph, i, s_index, sr_index):
                if readers and t <= max(last[k] for k in readers):
                    index[t, i] = b.column(0.0, 0.0, 1.0, True)
    return r_index, s_index, sr_index


def _dependency_rows(b: SparseBuilder, graph: DFGraph, t: int, r_index, s_index, sr_index) -> None:
    """Stage t's dependency constraints ``R[t, k] <= R[t, i] + S[t, i]`` for every edge
    ``(i, k)`` (Checkmate sec. 4.3, "dependencies must be resident"): an input of a node
    computed in the stage is kept into it or computed earlier in it (for a node with
    residual bytes, the value k reads of it)."""
    for k in range(t + 1):
        rk = r_index[t, k]
        if rk < 0:
            continue
        for i in graph.predecessors[k]:
            keep = _keep_array(graph, i, k, s_index, sr_index)[t, i]
            terms = [(rk, 1.0), (r_index[t, i], -1.0)]
            if keep >= 0:
                terms.append((keep, -1.0))
            b.row(terms, -math.inf, 0.0)


def _keep_or_recompute_rows(b: SparseBuilder, t: int, r_index, s_index, sr_index) -> None:
    """``S[t, i] + R[t, i] <= 1``: a value kept into stage t is not recomputed in it. Not
    one of Checkmate's constraints; valid for some optimal schedule (recomputing a kept
    value adds cost and no memory saving), and it makes ``FREE`` exact (module doc)."""
    for index in (s_index, sr_index):
        for i in range(t):
            if index[t, i] >= 0:
                b.row([(index[t, i], 1.0), (r_index[t, i], 1.0)], -math.inf, 1.0)


def _free_rows(b: SparseBuilder, graph: DFGraph, t: int, r_index, s_index, sr_index, free_keys: list,
               frees_after: dict) -> None:
    """Stage t's ``FREE[t, i, k]`` columns (free value i right after node k runs) and the
    rows that make them Checkmate's deallocation indicator (sec. 4.4, eqs. (4)-(6c)).

    Instead of the big-M cast-to-boolean rows (6a)-(6c), per resident value i:
    ``sum_k FREE[t, i, k] + S[t+1, i] = R[t, i] + S[t, i]`` (one fate: kept into the
    next stage or freed after exactly one reader; implies the keep-source constraint
    ``S[t+1, i] <= R[t, i] + S[t, i]`` of sec. 4.3), ``FREE[t, i, k] <= R[t, k]``, and
    for every reader j, ``sum_{k < j} FREE[t, i, k] + R[t, j] <= 1`` (no free before a
    later reader); for a node with residual bytes, the rows hold per value, over the
    readers of that value. Appends ``(t, i, k, keep array, bytes, readers)`` to
    ``free_keys`` and ``(column, bytes)`` to ``frees_after[(t, k)]``.
    """
    n = graph.size
    for i in range(t):
        if r_index[t, i] < 0:
            continue
        split = bool(graph.residual_bytes[i])
        for index, size, readers in _values(graph, i, s_index, sr_index):
            keep_next = index[t + 1, i] if t + 1 < n else -1
            outcomes = [(keep_next, 1.0)] if keep_next >= 0 else []
            earlier_frees = []
            if split:
                # Recomputing a split node for one of its values makes the other too;
                # unread in the stage, that one is freed right after the node runs.
                col = b.column(0.0, 0.0, 1.0, False)
                free_keys.append((t, i, i, index, size, tuple(readers)))
                outcomes.append((col, 1.0))
                earlier_frees.append((col, 1.0))
                frees_after.setdefault((t, i), []).append((col, size))
                b.row([(col, 1.0), (r_index[t, i], -1.0)], -math.inf, 0.0)
            for k in readers:
                if k > t or r_index[t, k] < 0:
                    continue
                if earlier_frees:
                    b.row([*earlier_frees, (r_index[t, k], 1.0)], -math.inf, 1.0)
                col = b.column(0.0, 0.0, 1.0, False)
                free_keys.append((t, i, k, index, size, tuple(readers)))
                outcomes.append((col, 1.0))
                earlier_frees.append((col, 1.0))
                frees_after.setdefault((t, k), []).append((col, size))
                if k < t:
                    b.row([(col, 1.0), (r_index[t, k], -1.0)], -math.inf, 0.0)
            resident = [(r_index[t, i], -1.0)]
            if index[t, i] >= 0:
                resident.append((index[t, i], -1.0))
            b.row([*outcomes, *resident], 0.0, 0.0)


def _memory_rows(b: SparseBuilder, graph: DFGraph, t: int, r_index, s_index, sr_index, frees_after: dict,
                 u_keys: list, scale: float, capacity: float) -> None:
    """Stage t's memory accounting ``U[t, k]`` (Checkmate sec. 4.4) and the budget.

    ``U[t, k]`` is the memory while node k runs, without its workspace: eq. (1) starts
    the stage with every kept value (plus the first node's output), eq. (2) adds node k's
    output and subtracts what was freed after the previous node (eq. (3)'s
    ``mem_freed``). The budget ``U[t, k] <= M_budget`` (sec. 4.5) is the column's upper
    bound, and with k's workspace a row of its own. Appends ``(t, k)`` to ``u_keys``.
    """
    out, work = graph.output_bytes, graph.workspace_bytes
    active = [k for k in range(t + 1) if r_index[t, k] >= 0]
    previous, k_prev = None, -1
    for k in active:
        u = b.column(0.0, 0.0, capacity, False)
        u_keys.append((t, k))
        terms = [(u, 1.0), (r_index[t, k], -out[k] / scale)]
        if previous is None:
            terms += [(index[t, i], -size / scale) for i in range(t)
                      for index, size, _ in _values(graph, i, s_index, sr_index) if index[t, i] >= 0 and size]
            b.row(terms, 0.0, 0.0)
        else:
            terms.append((previous, -1.0))
            terms += [(col, size / scale) for col, size in frees_after.get((t, k_prev), ()) if size]
            b.row(terms, 0.0, 0.0)
        if work[k]:
            b.row([(u, 1.0), (r_index[t, k], work[k] / scale)], -math.inf, capacity)
        previous, k_prev = u, k


def _stage_end_row(b: SparseBuilder, graph: DFGraph, t: int, r_index, s_index, sr_index, scale: float,
                   capacity: float) -> None:
    """The rows of stage t when its memory is not accounted exactly (the stage-end
    relaxation; module doc).

    The memory row is exact at the moment node t runs, the stage's last: every value
    kept into stage t+1 is resident then (kept since the stage began, or computed earlier
    in it), as are t's inputs, t's output and t's workspace. Earlier moments of the stage
    are not bounded. Without the stage's ``FREE`` equality, Checkmate's keep-source
    constraint ``S[t+1, i] <= R[t, i] + S[t, i]`` (sec. 4.3) is built instead.
    """
    n = graph.size
    reads = {(i, id(_keep_array(graph, i, t, s_index, sr_index))) for i in graph.predecessors[t]}
    terms = []
    for i in range(t):
        for index, size, _ in _values(graph, i, s_index, sr_index):
            keep = index[t + 1, i] if t + 1 < n else -1
            if keep < 0:
                continue
            source = [(keep, 1.0), (r_index[t, i], -1.0)]
            if index[t, i] >= 0:
                source.append((index[t, i], -1.0))
            b.row(source, -math.inf, 0.0)
            if (i, id(index)) not in reads and size:
                terms.append((keep, size / scale))
    b.row(terms, -math.inf, capacity - _running_bytes(graph, t) / scale)


def _peak_rows(b: SparseBuilder, graph: DFGraph, r_index, u_keys, u_start: int, scale: float, capacity: float,
               cost_scale: float, max_cost: float) -> int:
    """The batch-size variant (Checkmate's batch-size maximization, arXiv text sec. 5.3):
    a ``peak`` column, the objective, above every ``U[t, k] + workspace``, and the cost
    constraint (7), total compute cost at most ``max_cost``. Returns the peak's column."""
    n, work = graph.size, graph.workspace_bytes
    peak_column = b.column(1.0, 0.0, capacity, False)
    for offset, (t, k) in enumerate(u_keys):
        b.row([(u_start + offset, 1.0), (r_index[t, k], work[k] / scale), (peak_column, -1.0)], -math.inf, 0.0)
    costs = [(r_index[t, i], graph.cost[i] / cost_scale) for t in range(n) for i in range(t + 1) if r_index[t, i] >= 0]
    b.row(costs, -math.inf, max_cost / cost_scale)
    return peak_column


def build_milp(
    graph: DFGraph,
    budget_bytes: float,
    *,
    peak_within_cost: float | None = None,
    exact_stages: Iterable[int] | None = None,
) -> CheckmateModel:
    """Builds Checkmate's MILP for ``graph`` under ``budget_bytes`` (see the module doc).

    Columns are numbered R and S first (alike whatever stages are exact), then ``FREE``,
    then ``U``, then the peak.

    Args:
        graph: the graph.
        budget_bytes: peak memory allowed, fixed bytes included.
        peak_within_cost: when given, the model minimizes the peak instead (a column
            ``peak`` above every ``U + workspace``) subject to a total compute cost of
            at most this value; ``budget_bytes`` stays an upper bound on memory.
            Checkmate's batch-size maximization solves this model.
        exact_stages: the stages whose memory is accounted exactly (``FREE`` and ``U``);
            None means all (the exact model). Every other stage gets only its
            stage-end row (see the module doc), which makes the model a relaxation:
            its LP and MILP bounds hold for the exact model, and a solution whose
            schedule simulates within the budget is optimal for it too.

    Returns:
        The model. Its objective, times ``cost_scale``, is the total compute cost of the
        schedule, or with ``peak_within_cost`` its peak in bytes less the fixed bytes.
    """
    if peak_within_cost is not None and exact_stages is not None:
        raise ArgumentError("peak_within_cost needs every stage accounted exactly; leave exact_stages=None")
    n = graph.size
    scale, capacity, cost_scale = _units(graph, budget_bytes)
    b = SparseBuilder()
    r_index, s_index, sr_index = _schedule_columns(b, graph, cost_scale, minimize_peak=peak_within_cost is not None)
    for t in range(n):
        _dependency_rows(b, graph, t, r_index, s_index, sr_index)
        _keep_or_recompute_rows(b, t, r_index, s_index, sr_index)

    exact_stage = np.ones(n, dtype=bool) if exact_stages is None else np.isin(np.arange(n), list(exact_stages))
    free_start = len(b.cost)
    free_keys: list = []
    frees_after: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(n):
        if exact_stage[t]:
            _free_rows(b, graph, t, r_index, s_index, sr_index, free_keys, frees_after)
        else:
            _stage_end_row(b, graph, t, r_index, s_index, sr_index, scale, capacity)

    u_start = len(b.cost)
    u_keys: list = []
    for t in map(int, np.flatnonzero(exact_stage)):
        _memory_rows(b, graph, t, r_index, s_index, sr_index, frees_after, u_keys, scale, capacity)

    peak_column = -1
    if peak_within_cost is not None:
        peak_column = _peak_rows(b, graph, r_index, u_keys, u_start, scale, capacity, cost_scale, peak_within_cost)
        cost_scale = float(scale)

    start, rows, vals = b.csc()
    return CheckmateModel(
        graph=graph,
        budget_bytes=float(budget_bytes),
        scale=float(scale),
        cost_scale=cost_scale,
        cost=np.asarray(b.cost, dtype=float),
        lower=np.asarray(b.lower, dtype=float),
        upper=np.asarray(b.upper, dtype=float),
        integer=np.asarray(b.integer, dtype=bool),
        col_start=start,
        row_index=rows,
        value=vals,
        row_lower=np.asarray(b.row_lower, dtype=float),
        row_upper=np.asarray(b.row_upper, dtype=float),
        r_index=r_index,
        s_index=s_index,
        sr_index=sr_index,
        free_keys=tuple(free_keys),
        free_start=free_start,
        u_keys=tuple(u_keys),
        u_start=u_start,
        capacity=float(capacity),
        peak_column=peak_column,
    )
