"""Checkmate's rematerialization MILP, built as solver-neutral sparse arrays, and its
extension to operator implementations (MONeT).

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

Views (``DFGraph.view_of``: a ``Flatten`` sharing its input's buffer) count once: the
view's value has no bytes, its readers are also readers of its source's output (so the
source stays resident while they run), and the view is kept only with its source
(``S[t, v] <= S[t, u]``). That gives up nothing: keeping the source beside a view of it
holds no more memory, and recomputing the source while an older view lives would make a
second buffer. With it the model's memory is the simulator's.

Weight gradients (``DFGraph.weight_grad_bytes``) are counted in the workspace of the
backward node that makes them; the simulator holds them on while the layer runs again
after that node (its optimizer update waits for the layer's last statement). The model
forbids what would hold them instead of counting them: a forward node with weight
gradients is not computed after the stage of its weight-gradient node (its ``R`` columns
there are fixed at 0, :func:`weight_gradient_stages`), and a split backward
(weight-gradient node w, input-gradient node w+1) recomputes w+1 only right after w, and
runs nothing else in stage w+1 unless it recomputes w there too. A forward node runs
after its backward only to recompute a later node that was kept neither (a backward
node), so little cost is given up; but near the smallest feasible budget that may be the
only way to fit, so these rules and the fresh-gradient rows below (the step rules,
:func:`has_step_rules`) can make the model infeasible where a schedule fits, and
``step_rules=False`` leaves them out. Graphs without weight gradients (Checkmate's) are
unchanged.

With ``DFGraph.weight_grads_to_end`` (the optimizer updates all run after the backward
pass) a layer's weight gradients stay from the first run of the node that takes them to
the end of the step. That node first runs in its own stage (``R[w, w] = 1``, ``R`` lower
triangular), so they add a constant to every moment of the later stages, whatever the
schedule: stage t's capacity is the budget less the fixed bytes and the weight gradients
of the take nodes before t (:func:`weight_gradients_to_end`), and a later run of a
layer's backward node, whose workspace counts them, is given them back. None of the
restrictions above is needed then.

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
  the values of a node that holds several (below): recomputing the node for one of
  them makes the others, which may have no reader in the stage. For any other node the
  equality leaves it no role, since a computed value must be read or kept.

A backward node that reads its forward node's value and one of its inputs
(``DFGraph.inputs_read_with_forward``) never runs after that input ran again while the
forward value was kept (:func:`_fresh_gradient_rows`): the compiled step would repeat the
forward work to rebuild that gradient, outside the model's cost and memory. Recomputing the
forward node in the backward node's stage, which the model counts, is the schedule's way.

A node with residual bytes (``DFGraph.residual_bytes``) holds two values: its output,
read by its successors other than its backward node, and its residuals, read by its
backward node. Each has its own keep column (``S`` for the output, ``S_res`` for the
residuals) and its own ``FREE`` columns and rows; ``R`` computes both. A decoded schedule
keeps the node when it keeps either, and its execution plan frees each part after its last
reader as the model does (:mod:`tfremat.plan.execution`).

Operator implementations (``choose_implementations``; MONeT, Shah et al. 2021, sec. 4
and appendix F). A forward node f with alternatives (``DFGraph.implementations``) and its
backward node b have one mode per implementation a ("default" first), chosen once for the
whole step by binaries ``delta[f, a]`` (``sum_a delta[f, a] = 1``, MONeT's ``delta_i``
and ``delta^hat_k``). Their ``R`` splits into continuous ``R_a[t, i]`` with ``sum_a R_a =
R`` and ``R_a <= delta[f, a]`` (appendix F's ``R^v_{t,i}``), so ``R_a = R * delta[f, a]``
without a product (appendix C.4's linearization, here exact). The chosen implementation
sets the costs (the objective, MONeT eq. 9, through ``R_a``), the workspaces (through
``R_a``) and what b reads (MONeT's dependencies ``D_k^a``, eqs. 5, 6 and 8): f's output
part (the bytes its other successors read) is one value, computed by ``R``; each
implementation's residual bytes are a value of their own, computed only by its ``R_a``,
with own keep and ``FREE`` columns. Appendix F's dependent ``DEPS``/``USERS`` become
readers that read a value only through the ``R_a`` of the implementations that read it
(b reads f's output, a residual, or f's inputs only under implementations that do), in
the dependency rows and the rows that free a value after its last reader; so the
accounting stays exact (eq. 5's products ``delta * |D^a|`` appear as ``R_a`` terms). An
implementation whose backward reads the output and residual bytes too holds one value in
the simulator; its residual value is tied to the output (kept exactly when the output
is, when that implementation is chosen). A graph without alternatives, or
``choose_implementations=False``, builds Checkmate's model above, column for column.

The stage-end relaxation (``exact_stages``) keeps ``FREE`` and ``U`` only for some stages;
every other stage t gets one memory row, exact at the moment node t runs (the stage's
last: every value kept into stage t+1 is resident then, with t's inputs, output and
workspace), plus the keep-source rows its ``FREE`` equality implied. Moments earlier in
the stage are unbounded there, so the model is a relaxation, a third to a half the size
of the exact one. Its LP is as tight as the exact LP on the benchmark graphs and several
times faster (docs/solver.md), and its solutions usually fit: ``optimal`` accounts exactly
only the stages where one overflows. Where node t reads a value only under some
implementations, the row counts it by a continuous ``resident`` column at least its
keep into stage t+1 and at least the indicator that t reads it (a product of two
choices linearized as in MONeT appendix C.4).

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
from collections.abc import Iterable, Mapping
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
    "Mode",
    "build_milp",
    "overflowing_stages",
    "memory_lower_bound",
    "last_descendants",
    "weight_gradient_stages",
    "has_step_rules",
    "r_column_count",
    "implementation_modes",
    "cheapest_implementations",
    "no_remat_cost",
]

_MAX_EXACT_UNITS = 1e3
_DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class Mode:
    """One implementation of a forward node with alternatives, as the model sees it: the
    graph's own numbers (``"default"``) or an :class:`~tfremat.graph.Implementation`
    (MONeT sec. 4: what the backward reads, the bytes kept for it, costs, workspaces).

    Attributes:
        name: ``"default"`` or the implementation's name.
        residual_bytes: bytes the forward keeps that only the backward reads.
        reads_output: the backward reads the node's output part (with the residual bytes,
            if any, as one value).
        inputs_read: the forward inputs of the node that the backward reads.
        cost, backward_cost: forward and backward compute cost.
        workspace_bytes, backward_workspace_bytes: transient bytes of each while it runs.
    """

    name: str
    residual_bytes: int
    reads_output: bool
    inputs_read: frozenset[int]
    cost: float
    backward_cost: float
    workspace_bytes: int
    backward_workspace_bytes: int

    def kept_bytes(self, graph: DFGraph, node: int) -> int:
        """Bytes the backward of ``node`` reads under this implementation: its residual
        bytes, the node's output part if it reads it, and the inputs it reads."""
        output_part = graph.output_bytes[node] - graph.residual_bytes[node]
        inputs = sum(graph.part_bytes(p, graph.part_read_by(p, graph.backward_of[node])) for p in self.inputs_read)
        return self.residual_bytes + (output_part if self.reads_output else 0) + inputs


def implementation_modes(graph: DFGraph) -> dict[int, tuple[Mode, ...]]:
    """Per forward node with alternatives, its :class:`Mode` s, ``"default"`` first, as
    :meth:`DFGraph.with_implementations` applies them."""
    edges = set(graph.edges)
    modes = {}
    for node, alternatives in graph.implementations.items():
        backward = graph.backward_of[node]
        inputs = frozenset(p for p in graph.predecessors[node] if not graph.is_backward[p])
        residual = graph.residual_bytes[node]
        default = Mode(_DEFAULT, residual, not residual and (node, backward) in edges,
                       frozenset(p for p in inputs if (p, backward) in edges), graph.cost[node], graph.cost[backward],
                       graph.workspace_bytes[node], graph.workspace_bytes[backward])
        modes[node] = (default, *(
            Mode(a.name, a.residual_bytes, a.reads_output, inputs if a.reads_inputs else frozenset(), a.cost,
                 a.backward_cost, a.workspace_bytes, a.backward_workspace_bytes)
            for a in alternatives
        ))
    return modes


def cheapest_implementations(graph: DFGraph) -> dict[int, str]:
    """The choice with the least compute cost of running every node once: per node with
    alternatives, the implementation of least forward plus backward cost (of fewest kept
    bytes among equals); only the non-default choices."""
    choice = {}
    for node, modes in implementation_modes(graph).items():
        best = min(modes, key=lambda m: (m.cost + m.backward_cost, m.kept_bytes(graph, node)))
        if best.name != _DEFAULT:
            choice[node] = best.name
    return choice


def no_remat_cost(graph: DFGraph, choose_implementations: bool = False) -> float:
    """The least cost of running every node once, a lower bound on any schedule's cost:
    ``graph.total_cost``, or with ``choose_implementations`` that of the graph under
    :func:`cheapest_implementations`."""
    if not choose_implementations:
        return graph.total_cost
    return graph.with_implementations(cheapest_implementations(graph)).total_cost


def last_descendants(graph: DFGraph) -> np.ndarray:
    """``last[i]``: the largest node id reachable from i (i itself when it has no readers).

    A value is only useful in stages up to ``last[i]``: every computation serves some
    later frontier node, which must be a descendant.
    """
    return _last_descendants(graph.successors)


def weight_gradient_stages(graph: DFGraph) -> np.ndarray:
    """The last stage in which the model may compute each node: that of its
    weight-gradient node for a forward node with ``weight_grad_bytes`` (module doc), the
    last stage otherwise."""
    until = np.full(graph.size, graph.size - 1)
    if graph.weight_grads_to_end:
        return until
    for f, grads in enumerate(graph.weight_grad_bytes):
        if grads:
            until[f] = max(f, graph.backward_nodes_of[f][0])
    return until


def has_step_rules(graph: DFGraph, choose_implementations: bool = False) -> bool:
    """Whether :func:`build_milp`'s step rules may cut schedules off ``graph``: a forward
    node with weight gradients not computed after its weight-gradient node's stage
    (:func:`weight_gradient_stages`), split backwards kept together
    (:func:`_split_weight_gradient_rows`), no backward node on a stale input
    (:func:`_fresh_gradient_rows`). Each keeps the model's memory exact, but a schedule
    they cut off may be the only one that fits a budget (a layer recomputed after its
    backward pass, to free a value held across the heaviest node: issue 33), so the
    model's infeasibility proves nothing about the budget where they apply."""
    weight_rules = not graph.weight_grads_to_end and any(graph.weight_grad_bytes)
    fresh_rules = bool(graph.inputs_read_with_forward) or (choose_implementations and bool(graph.implementations))
    return weight_rules or fresh_rules


def weight_gradients_to_end(graph: DFGraph) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """With ``weight_grads_to_end`` (module doc): per stage t, the weight-gradient bytes
    held through it, those of every layer whose take node (its first backward node) is
    before t; and per backward node of such a layer, ``(take node, bytes)``, which a run of
    it after the take node's stage counts in its workspace instead. Zeros and {} otherwise."""
    held = np.zeros(graph.size, dtype=np.int64)
    own: dict[int, tuple[int, int]] = {}
    if not graph.weight_grads_to_end:
        return held, own
    for f, grads in enumerate(graph.weight_grad_bytes):
        if grads:
            take = graph.backward_nodes_of[f][0]
            held[take + 1:] += grads
            own.update({b: (take, grads) for b in graph.backward_nodes_of[f]})
    return held, own


def _last_descendants(successors) -> np.ndarray:
    n = len(successors)
    last = np.arange(n)
    for i in range(n - 1, -1, -1):
        for j in successors[i]:
            if last[j] > last[i]:
                last[i] = last[j]
    return last


@dataclasses.dataclass(frozen=True, eq=False)
class _Value:
    """One value the model keeps and frees on its own (the whole value of a node, its
    output part, or one implementation's residual bytes).

    Attributes:
        node: the node that computes it.
        size: its bytes.
        mode: the mode of the node that makes it (None: every computation of the node).
        residual: it is a residual part (only the node's backward reads it, or with the
            output when ``tied``).
        readers: ``(reader, modes)`` by ascending reader: the modes of the reader's node
            through which it reads the value (None: whatever the choice).
        keep: its keep column per stage, -1 where none is built (a view into ``s_index``
            or ``sr_index`` for the output and the default's residuals).
        tied: kept and freed with the node's output when its mode is chosen (a backward
            that reads the output and residual bytes reads one value).
    """

    node: int
    size: int
    mode: int | None
    residual: bool
    readers: tuple[tuple[int, tuple[int, ...] | None], ...]
    keep: np.ndarray
    tied: bool = False


class _Layout:
    """The values of a graph's nodes, who reads each and under which modes (MONeT appendix
    F: ``DEPS`` and ``USERS`` that depend on the implementation), the modes' costs and
    workspaces, and with ``keep_columns`` the keep column arrays, filled as the columns are
    built (n x n: only a model needs them, not its bounds)."""

    def __init__(self, graph: DFGraph, choose_implementations: bool, keep_columns: bool = False,
                 step_rules: bool = True):
        n = graph.size
        self.graph = graph
        self.modes = implementation_modes(graph) if choose_implementations else {}
        self.family: dict[int, int] = {}
        for node in self.modes:
            self.family[node] = self.family[graph.backward_of[node]] = node
        shape = (n, n) if keep_columns else (0, n)
        self.s_index = np.full(shape, -1, dtype=np.int64)
        self.sr_index = np.full(shape, -1, dtype=np.int64)
        # Readers of each node's output (or whole value), with the modes they read it through.
        successors = [[(k, None) for k in graph.successors[i]] for i in range(n)]
        for node, modes in self.modes.items():
            backward = graph.backward_of[node]
            for source in {node, *(p for m in modes for p in m.inputs_read)}:
                reading = tuple(a for a, m in enumerate(modes)
                                if (m.reads_output if source == node else source in m.inputs_read))
                edges = [(k, s) for k, s in successors[source] if k != backward]
                if reading:
                    edges.append((backward, None if len(reading) == len(modes) else reading))
                successors[source] = sorted(edges)
        # A view's readers read its source's buffer too (module doc): they keep the source
        # resident; the view's own value has no bytes. Later views first, for chains.
        for view in sorted(graph.view_of, reverse=True):
            source = graph.view_of[view]
            successors[source] = sorted(set(successors[source]) | set(successors[view]))
        self.values = tuple(self._values_of(i, successors[i]) for i in range(n))
        self.last = _last_descendants([sorted({k for v in values for k, _ in v.readers}) for values in self.values])
        self.until = weight_gradient_stages(graph) if step_rules else np.full(n, n - 1)
        self.held, self.held_own = weight_gradients_to_end(graph)
        self.most_values = max(map(len, self.values))
        # Per node, the bytes it makes by the mode that makes them (None: every computation).
        self.made = []
        for values in self.values:
            made: dict[int | None, int] = {}
            for value in values:
                made[value.mode] = made.get(value.mode, 0) + value.size
            self.made.append(list(made.items()))
        # The keeps' bytes by node in s_index and sr_index, and the values with keep arrays
        # of their own (alternatives' residuals).
        self.s_bytes = np.array([values[0].size for values in self.values], dtype=np.int64)
        self.sr_bytes = np.array(graph.residual_bytes, dtype=np.int64)
        self.own_keeps = [v for values in self.values for v in values if v.mode]
        self.reads: list[list[tuple[_Value, tuple[int, ...] | None]]] = [[] for _ in range(n)]
        for values in self.values:
            for value in values:
                for reader, modes in value.readers:
                    self.reads[reader].append((value, modes))

    def _values_of(self, i: int, readers: list) -> tuple[_Value, ...]:
        graph = self.graph
        residual = graph.residual_bytes[i]
        size = 0 if i in graph.view_of else graph.output_bytes[i] - residual
        output = _Value(i, size, None, False, (), self.s_index[:, i])
        if i in self.modes:
            backward = graph.backward_of[i]
            output = dataclasses.replace(output, readers=tuple(readers))
            values = [output]
            for a, mode in enumerate(self.modes[i]):
                if mode.residual_bytes:
                    keep = self.sr_index[:, i] if a == 0 else np.full(len(self.sr_index), -1, dtype=np.int64)
                    own = output.readers if mode.reads_output else ((backward, (a,)),)
                    values.append(_Value(i, mode.residual_bytes, a, True, own, keep, tied=mode.reads_output))
            return tuple(values)
        if not residual:
            return (dataclasses.replace(output, readers=tuple(readers)),)
        backward = graph.backward_of[i]
        return (dataclasses.replace(output, readers=tuple((k, s) for k, s in readers if k != backward)),
                _Value(i, residual, None, True, ((backward, None),), self.sr_index[:, i]))

    def mode_of(self, node: int, mode: int | None, field: str) -> float:
        """``field`` ("cost" or "workspace_bytes") of ``node`` in ``mode`` of its family
        (the graph's own number for a node without modes)."""
        family = self.family.get(node)
        if family is None:
            return getattr(self.graph, field)[node]
        chosen = self.modes[family][mode]
        return getattr(chosen, field if node == family else f"backward_{field}")

    def node_modes(self, node: int) -> range | tuple[None]:
        """The modes ``node`` may run in (``(None,)`` for a node without modes)."""
        family = self.family.get(node)
        return (None,) if family is None else range(len(self.modes[family]))

    def running_bytes(self, node: int, mode: int | None) -> int:
        """Bytes resident while ``node`` runs in ``mode``, beyond the fixed bytes: its inputs,
        its output and its workspace (a value that exists only under another node's
        implementation counted as absent, so the least over modes bounds every choice)."""
        family = self.family.get(node)
        made = sum(v.size for v in self.values[node] if v.mode is None or v.mode == mode)
        read = 0
        for value, modes in self.reads[node]:
            if modes is not None and mode not in modes:
                continue
            if value.mode is None or (self.family.get(value.node) == family and value.mode == mode):
                read += value.size
        return made + read + int(self.mode_of(node, mode, "workspace_bytes"))

    def held_at(self, t: int, k: int) -> int:
        """Weight-gradient bytes held beyond the workspace while node k runs in stage t
        (``weight_grads_to_end``, module doc; 0 otherwise)."""
        take, grads = self.held_own.get(k, (t, 0))
        return int(self.held[t]) - (grads if take < t else 0)

    def least_running_bytes(self, node: int) -> int:
        return min(self.running_bytes(node, mode) for mode in self.node_modes(node))

    def sizes(self) -> list[int]:
        """Every byte count the model's memory rows use."""
        sizes = [v.size for values in self.values for v in values]
        sizes += [int(self.mode_of(k, m, "workspace_bytes")) for k in range(self.graph.size) for m in self.node_modes(k)]
        if self.graph.weight_grads_to_end:
            sizes += list(self.graph.weight_grad_bytes)
        return sizes

    def costs(self) -> list[float]:
        return [self.mode_of(k, m, "cost") for k in range(self.graph.size) for m in self.node_modes(k)]


def r_column_count(graph: DFGraph, choose_implementations: bool = False) -> int:
    """Number of R columns :func:`build_milp` creates (the whole model has about 4.5-6
    times as many columns: 287k for ResNet50's 62k, 4.1M for the 1000-node random graph's
    500k), known before building it."""
    last = _Layout(graph, choose_implementations).last
    return int((last - np.arange(graph.size) + 1).sum())


def overflowing_stages(graph: DFGraph, outcome: SimulationResult, budget_bytes: int) -> set[int]:
    """The stages of a simulated schedule whose memory exceeds the budget: those a
    stage-end relaxation must account exactly (``exact_stages``) to exclude it."""
    return set(map(int, np.flatnonzero(stage_peaks(outcome, graph.size) > budget_bytes)))


def memory_lower_bound(graph: DFGraph, choose_implementations: bool = False) -> int:
    """A proven lower bound on the peak of any schedule, in bytes.

    Every node runs at least once, and while it runs its inputs, its output and its
    workspace are resident together with the fixed bytes (with
    ``choose_implementations``, under the implementation that needs the least).
    """
    layout = _Layout(graph, choose_implementations)
    return graph.fixed_bytes + layout.least_running_bytes(_heaviest(layout))


def _heaviest(layout: _Layout) -> int:
    return max(range(layout.graph.size), key=layout.least_running_bytes)


def heaviest_node(graph: DFGraph, choose_implementations: bool = False) -> int:
    """The node that sets :func:`memory_lower_bound`."""
    return _heaviest(_Layout(graph, choose_implementations))


def lower_bound_reason(graph: DFGraph, choose_implementations: bool = False) -> str:
    """Why no schedule goes below :func:`memory_lower_bound`, naming the node, for errors."""
    layout = _Layout(graph, choose_implementations)
    node = _heaviest(layout)
    how = " under its leanest implementation" if node in layout.family else ""
    return (f"node {node} ({graph.names[node]}) needs {format_bytes(layout.least_running_bytes(node))} while it "
            f"runs{how}: its inputs, its output and its workspace")


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
            (-1 for nodes without residual bytes); under its default implementation for a
            node with alternatives, whose other residuals have keep arrays of their own
            (``layout``).
        free_keys: ``(column, t, i, place, k, modes)`` of every FREE column (free value
            ``layout.values[i][place]`` after node k in stage t, k reading it through
            ``modes``). Plain numbers, so that the garbage collector stops tracking the
            hundreds of thousands of them.
        free_start: the first column after the schedule's (R, S and the implementation
            columns), where ``FREE`` and the stage-end rows' columns begin.
        u_keys: ``(t, k)`` of every U column, in column order from ``u_start``.
        capacity: the budget less the fixed bytes in model units, as the rows use it.
        peak_column: the column of the peak when the model minimizes it, else -1.
        mode_names: per forward node whose implementation the model chooses, the names of
            its modes (``"default"`` first); empty for Checkmate's model.
        mode_index: per node with modes (such a forward node and its backward node), a
            (modes, n) array: the column of ``R_a[t, node]``, -1 where not built.
        delta_index: per forward node in ``mode_names``, the column of ``delta[node, a]``
            of each mode.
        resident_keys: ``(column, t, i, place, modes)`` of the stage-end rows' ``resident``
            columns (value counted while node t runs, read through ``modes``).
        layout: the values, their readers and the modes' numbers.
        fresh_keys: ``(column, t, f, x)`` of every ``fresh`` column (input x of forward
            node f ran after f's last run, up to stage t; :func:`_fresh_gradient_rows`).
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
    mode_names: Mapping[int, tuple[str, ...]]
    mode_index: Mapping[int, np.ndarray]
    delta_index: Mapping[int, np.ndarray]
    resident_keys: tuple
    layout: _Layout
    fresh_keys: tuple = ()

    @property
    def chooses_implementations(self) -> bool:
        """Whether the model chooses some node's implementation (MONeT)."""
        return bool(self.mode_names)

    def implementations(self, x: np.ndarray) -> dict[int, str]:
        """The implementation choice of a solution vector (only the non-default choices)."""
        x = np.asarray(x, dtype=float)
        choice = {}
        for node, columns in self.delta_index.items():
            mode = int(np.argmax(x[columns]))
            if mode:
                choice[node] = self.mode_names[node][mode]
        return choice

    def decode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rounds a solution vector to boolean ``(R, S)`` (S keeps a node when any of its
        values is kept)."""
        x = np.asarray(x, dtype=float)
        R = np.zeros(self.r_index.shape, dtype=bool)
        S = np.zeros(self.s_index.shape, dtype=bool)
        mask = self.r_index >= 0
        R[mask] = x[self.r_index[mask]] > 0.5
        for index in (self.s_index, self.sr_index):
            mask = index >= 0
            S[mask] |= x[index[mask]] > 0.5
        for value in self.layout.own_keeps:
            mask = value.keep >= 0
            S[mask, value.node] |= x[value.keep[mask]] > 0.5
        return R, S

    def schedule(self, x: np.ndarray, strategy: str) -> Schedule:
        """The valid schedule of a solution vector, under its implementation choice: rounded,
        with a value kept into a stage not also recomputed there (a zero-cost node makes
        both optimal) and unread keeps dropped. Memory only goes down."""
        R, S = self.decode(x)
        choice = self.implementations(x)
        R &= ~np.tril(S, -1)
        schedule = Schedule(R, prune_s(self.graph.with_implementations(choice), R, S), strategy,
                            implementations=choice)
        validate_schedule(self.graph, schedule)
        return schedule

    def memory_while_running(self, x: np.ndarray) -> dict[tuple[int, int], float]:
        """The model's bytes while node k runs in stage t (``U + workspace``), for computed k."""
        x = np.asarray(x, dtype=float)
        work = self.graph.with_implementations(self.implementations(x)).workspace_bytes
        memory = {}
        for offset, (t, k) in enumerate(self.u_keys):
            if x[self.r_index[t, k]] > 0.5:
                memory[(t, k)] = (self.graph.fixed_bytes + x[self.u_start + offset] * self.scale + work[k]
                                  + self.layout.held_at(t, k))
        return memory

    def encode(self, schedule: Schedule) -> np.ndarray | None:
        """The solution vector of a schedule (a MIP start), or None when the schedule
        uses a variable this model does not build (an implementation among them) or
        breaks one of its cuts."""
        graph, n, layout = self.graph, self.graph.size, self.layout
        chosen = {}
        for node, name in (schedule.implementations or {}).items():
            if name not in self.mode_names.get(node, ()):
                return None
            chosen[node] = self.mode_names[node].index(name)
        under = graph.with_implementations(schedule.implementations)
        R, S = schedule.R, schedule.S
        if (R & (self.r_index < 0)).any():
            return None
        # A kept view holds its source's buffer (the simulator's convention), and the model
        # keeps the source with it (_view_rows); prune_s drops the source's keep when only
        # the view is read, and parts_needed_later counts the view, not its readers, as
        # the output's reader. Without both, no schedule of a graph with views (keras-hub's
        # reshapes) was a MIP start, and the MILP started from nothing.
        S = S.copy()
        for view in sorted(graph.view_of, reverse=True):
            S[:, graph.view_of[view]] |= S[:, view]
        held_by_views: dict[int, np.ndarray] = {}
        for view, source in graph.view_of.items():
            held_by_views[source] = held_by_views.get(source, np.zeros(n, dtype=bool)) | S[:, view]

        def mode(node: int) -> int | None:
            family = layout.family.get(node)
            return None if family is None else chosen.get(family, 0)

        def made(value: _Value) -> bool:
            return value.mode is None or value.mode == mode(value.node)

        def reads(t: int, k: int, modes) -> bool:
            return bool(R[t, k]) and (modes is None or mode(k) in modes)

        x = np.zeros(self.num_vars)
        x[self.r_index[R]] = 1.0
        for node, columns in self.mode_index.items():
            x[columns[mode(node)][R[:, node]]] = 1.0
        for node, columns in self.delta_index.items():
            x[columns[chosen.get(node, 0)]] = 1.0
        keeps = {}  # id(value) -> its keep matrix column
        for i in range(n):
            # A part is kept into stage t while a stage >= t reads that copy of it.
            needed = parts_needed_later(under, R, i) if under.residual_bytes[i] else None
            for value in layout.values[i]:
                kept = S[:, i].copy() if made(value) else np.zeros(n, dtype=bool)
                if needed is not None:
                    kept &= np.concatenate([[False], needed["residual" if value.residual else "output"][:-1]])
                    if not value.residual and i in held_by_views and made(value):
                        kept |= held_by_views[i]
                if (kept & (value.keep < 0)).any():
                    return None
                x[value.keep[kept]] = 1.0
                keeps[id(value)] = kept
        frees: dict[tuple[int, int], float] = {}
        for column, t, i, place, k, modes in self.free_keys:
            value = layout.values[i][place]
            later_reader = any(reads(t, j, m) for j, m in value.readers if k < j <= t)
            kept = t + 1 < n and keeps[id(value)][t + 1]
            if made(value) and reads(t, k, modes) and not kept and not later_reader:
                x[column] = 1.0
                frees[(t, k)] = frees.get((t, k), 0.0) + value.size / self.scale
        if self.fresh_keys:
            stages = np.arange(n)[:, None]
            last_run = np.maximum.accumulate(np.where(R, stages, -1), axis=0)
            for column, t, f, i in self.fresh_keys:
                x[column] = float(last_run[t, i] > last_run[t, f])
        for column, t, i, place, modes in self.resident_keys:
            value = layout.values[i][place]
            kept = t + 1 < n and keeps[id(value)][t + 1]
            x[column] = float(kept or (made(value) and (modes is None or mode(t) in modes)))
        out = [0 if k in under.view_of else size for k, size in enumerate(under.output_bytes)]
        previous = None
        for offset, (t, k) in enumerate(self.u_keys):
            if previous is None or previous[0] != t:
                level = sum(value.size * keeps[id(value)][t] for i in range(t) for value in layout.values[i]) / self.scale
            else:
                level -= frees.get(previous, 0.0)
            level += out[k] / self.scale * R[t, k]
            x[self.u_start + offset] = level
            previous = (t, k)
        if self.peak_column >= 0:
            work = under.workspace_bytes
            x[self.peak_column] = max(
                (x[self.u_start + offset] + (work[k] + layout.held_at(t, k)) / self.scale
                 for offset, (t, k) in enumerate(self.u_keys) if R[t, k]),
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


def _memory_scale(layout: _Layout, capacity_bytes: float) -> tuple[int | float, bool]:
    """Bytes per model unit, and whether memory is exact integers in that unit (then the
    unit is an int, the greatest common divisor of the byte counts).

    ``capacity_bytes`` is the budget less the fixed bytes.
    """
    sizes = [b for b in layout.sizes() if b > 0]
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


def _units(layout: _Layout, budget_bytes: float) -> tuple[int | float, float, float]:
    """``(scale, capacity, cost_scale)``: bytes per memory unit, the budget less the fixed
    bytes in those units, and graph cost per objective unit."""
    graph = layout.graph
    scale, exact = _memory_scale(layout, budget_bytes - graph.fixed_bytes)
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
    cost_scale = max(layout.costs()) or 1.0
    return scale, capacity, cost_scale


@dataclasses.dataclass
class _Columns:
    """The schedule's columns as :func:`_schedule_columns` built them, and the terms the
    rows take from them."""

    layout: _Layout
    r_index: np.ndarray
    mode_index: dict[int, np.ndarray]
    delta_index: dict[int, np.ndarray]

    def reading(self, t: int, k: int, modes) -> list[int]:
        """The columns whose sum says node k runs in stage t in one of ``modes`` (None: any)."""
        if modes is None:
            return [self.r_index[t, k]]
        return [self.mode_index[k][a, t] for a in modes]

    def making(self, t: int, value: _Value) -> int:
        """The column that says stage t computes ``value``."""
        if value.mode is None:
            return self.r_index[t, value.node]
        return self.mode_index[value.node][value.mode, t]

    def per_mode(self, t: int, k: int, field: str) -> list[tuple[int, float]]:
        """``(column, number)`` terms of node k's ``field`` ("cost" or "workspace_bytes") in
        stage t: on ``R`` for a node without modes, on each ``R_a`` otherwise."""
        layout = self.layout
        if k not in layout.family:
            return [(self.r_index[t, k], getattr(layout.graph, field)[k])]
        return [(self.mode_index[k][a, t], layout.mode_of(k, a, field)) for a in layout.node_modes(k)]

    def held_base(self, t: int) -> int:
        """The least weight-gradient bytes held beyond the workspace at any moment of stage
        t (``_Layout.held_at`` over the nodes it may run): the memory rows' constant."""
        return min(self.layout.held_at(t, k) for k in range(t + 1) if self.r_index[t, k] >= 0)

    def running_terms(self, t: int, k: int, base: int, scale: float) -> list[tuple[int, float]]:
        """Node k's workspace and its held weight gradients above ``base``, in model units,
        on the columns that say k runs in stage t (module doc: held only while it runs)."""
        extra = self.layout.held_at(t, k) - base
        return [(column, (size + extra) / scale) for column, size in self.per_mode(t, k, "workspace_bytes")
                if size + extra]

    def made_bytes(self, t: int, k: int) -> list[tuple[int, int]]:
        """``(column, bytes)``: the values node k makes in stage t, by the column that makes them."""
        made = self.layout.made[k]
        if len(made) == 1 and made[0][0] is None:
            return [(self.r_index[t, k], made[0][1])]
        return [(self.r_index[t, k] if mode is None else self.mode_index[k][mode, t], size) for mode, size in made]


def _schedule_columns(b: SparseBuilder, layout: _Layout, cost_scale: float, minimize_peak: bool) -> _Columns:
    """The binary columns ``R[t, i]`` and ``S[t, i]`` (Checkmate sec. 4.2) with the
    objective, total compute cost ``sum_t sum_i C_i R[t, i]`` (sec. 4.3; zero when the
    model minimizes the peak), and the frontier-advancing constraint ``R[t, t] = 1``
    (sec. 4.3) as a column bound.

    Only columns an optimal schedule can use are built (sec. 4.6 and the module doc):
    lower triangular, nothing after ``last_descendant[i]``, no keep of a value without
    readers. A node with residual bytes gets a keep column per value (``S`` for its output,
    ``S_res`` for its residuals). A node with modes gets ``R_a[t, i]`` after each
    ``R[t, i]``, which carry its cost (MONeT eq. 9), each residual value of an alternative
    its own keep columns, and each forward node with alternatives its ``delta`` after all
    of them, so that these columns are numbered alike whatever stages are exact.
    """
    graph, n, last = layout.graph, layout.graph.size, layout.last
    r_index = np.full((n, n), -1, dtype=np.int64)
    mode_index = {k: np.full((len(layout.node_modes(k)), n), -1, dtype=np.int64) for k in layout.family}
    for t in range(n):
        for i in range(t + 1):
            if t <= last[i]:
                fixed = 1.0 if i == t else 0.0
                modes = mode_index.get(i)
                objective = 0.0 if minimize_peak or modes is not None else graph.cost[i] / cost_scale
                r_index[t, i] = b.column(objective, fixed, 1.0 if t <= layout.until[i] else 0.0, True)
                for a in range(0 if modes is None else len(modes)):
                    # R_a = R * delta[a] is integral whenever R and delta are: no integrality needed.
                    objective = 0.0 if minimize_peak else layout.mode_of(i, a, "cost") / cost_scale
                    modes[a, t] = b.column(objective, 0.0, 1.0, False)
        for i in range(t):
            for value in layout.values[i]:
                if value.readers and t <= max(last[k] for k, _ in value.readers):
                    value.keep[t] = b.column(0.0, 0.0, 1.0, True)
    delta_index = {f: np.array([b.column(0.0, 0.0, 1.0, True) for _ in modes], dtype=np.int64)
                   for f, modes in layout.modes.items()}
    return _Columns(layout, r_index, mode_index, delta_index)


def _dependency_rows(b: SparseBuilder, cols: _Columns, t: int) -> None:
    """Stage t's dependency constraints ``R[t, k] <= R[t, i] + S[t, i]`` for every edge
    ``(i, k)`` (Checkmate sec. 4.3, "dependencies must be resident"; MONeT eq. 7): an input
    of a node computed in the stage is kept into it or computed earlier in it (for a node
    with residual bytes, the value k reads of it). A node that reads a value only in some
    modes requires it only in those (MONeT eq. 8: ``s + r >= delta_hat`` for the
    dependencies ``D^a`` of the implementation chosen); a residual tied to the output
    needs no row of its own (the output's row and the tie imply it)."""
    r_index = cols.r_index
    for k in range(t + 1):
        rk = r_index[t, k]
        if rk < 0:
            continue
        for value, modes in cols.layout.reads[k]:
            if value.tied:
                continue
            terms = [(rk, 1.0)] if modes is None else [(c, 1.0) for c in cols.reading(t, k, modes)]
            terms.append((r_index[t, value.node] if value.mode is None else cols.making(t, value), -1.0))
            keep = value.keep[t]
            if keep >= 0:
                terms.append((keep, -1.0))
            b.row(terms, -math.inf, 0.0)


def _keep_or_recompute_rows(b: SparseBuilder, layout: _Layout, t: int, r_index) -> None:
    """``S[t, i] + R[t, i] <= 1``: a value kept into stage t is not recomputed in it. Not
    one of Checkmate's constraints; valid for some optimal schedule (recomputing a kept
    value adds cost and no memory saving), and it makes ``FREE`` exact (module doc).
    Rows by the value's place in its node (the output's keeps first)."""
    for place in range(layout.most_values):
        for i in range(t):
            if place < len(layout.values[i]) and layout.values[i][place].keep[t] >= 0:
                b.row([(layout.values[i][place].keep[t], 1.0), (r_index[t, i], 1.0)], -math.inf, 1.0)


def _implementation_rows(b: SparseBuilder, cols: _Columns) -> None:
    """One implementation per forward node with alternatives (``sum_a delta[f, a] = 1``,
    MONeT sec. 4), every computation of it and of its backward node in that one
    (``sum_a R_a[t, i] = R[t, i]`` and ``R_a[t, i] <= delta[f, a]``, appendix F's
    ``R_{t,i} = sum_v R^v_{t,i}``), an implementation's residual value kept into stage
    f+1 only when stage f makes it, and a residual value tied to the output kept exactly
    when the output is under its implementation (``S_res <= S`` and ``S - S_res <= 1 -
    delta[f, a]``, appendix C.4's product ``S * delta`` linearized)."""
    layout, n = cols.layout, cols.layout.graph.size
    for deltas in cols.delta_index.values():
        b.row([(d, 1.0) for d in deltas], 1.0, 1.0)
    for k, columns in cols.mode_index.items():
        deltas = cols.delta_index[layout.family[k]]
        for t in np.flatnonzero(cols.r_index[:, k] >= 0):
            b.row([*((columns[a, t], 1.0) for a in range(len(deltas))), (cols.r_index[t, k], -1.0)], 0.0, 0.0)
            for a, delta in enumerate(deltas):
                b.row([(columns[a, t], 1.0), (delta, -1.0)], -math.inf, 0.0)
    for f in cols.delta_index:
        output = layout.values[f][0]
        for value in layout.values[f][1:]:
            # Kept out of stage f only when stage f makes it (the other stages' keep sources
            # are rows of their own; R[f, f] = 1 made every value before implementations).
            if f + 1 < n and value.keep[f + 1] >= 0:
                b.row([(value.keep[f + 1], 1.0), (cols.making(f, value), -1.0)], -math.inf, 0.0)
            if not value.tied:
                continue
            for t in range(n):
                if value.keep[t] >= 0:
                    b.row([(value.keep[t], 1.0), (output.keep[t], -1.0)], -math.inf, 0.0)
                    b.row([(output.keep[t], 1.0), (value.keep[t], -1.0), (cols.delta_index[f][value.mode], 1.0)],
                          -math.inf, 1.0)


def _split_weight_gradient_rows(b: SparseBuilder, cols: _Columns) -> None:
    """For each split backward (w, w+1) of a forward node with ``weight_grad_bytes``: a
    stage after w+1 computes w+1 only with w (``R[t, w+1] <= R[t, w]``), and stage w+1
    computes nothing before w unless it computes w (``R[w+1, k] <= R[w+1, w]``), so no
    statement runs between the last run of w, which takes the weight gradients, and that
    of w+1, which ends the layer (module doc)."""
    graph, r_index = cols.layout.graph, cols.r_index
    for f, grads in enumerate(graph.weight_grad_bytes):
        nodes = graph.backward_nodes_of.get(f, ())
        if not grads or len(nodes) < 2:
            continue
        w, last = nodes[0], nodes[-1]
        pairs = [(t, last, t) for t in range(last + 1, graph.size)] + [(last, k, last) for k in range(w)]
        for t, k, stage in pairs:
            if r_index[t, k] >= 0:
                terms = [(r_index[t, k], 1.0)]
                if r_index[stage, w] >= 0:
                    terms.append((r_index[stage, w], -1.0))
                b.row(terms, -math.inf, 0.0)


def _view_rows(b: SparseBuilder, layout: _Layout) -> None:
    """``S[t, v] <= S[t, u]`` for a view v of u: a view is kept only with its source,
    which holds the buffer they share (module doc)."""
    for view, source in layout.graph.view_of.items():
        kept, holder = layout.values[view][0].keep, layout.values[source][0].keep
        for t in np.flatnonzero(kept >= 0):
            b.row([(kept[t], 1.0)] + ([(holder[t], -1.0)] if holder[t] >= 0 else []), -math.inf, 0.0)


def _fresh_gradient_rows(b: SparseBuilder, cols: _Columns) -> list[tuple[int, int, int, int]]:
    """No backward node runs on a forward value older than an input it reads
    (:attr:`DFGraph.inputs_read_with_forward`; under modes, the modes whose backward reads
    both the forward node's value and the input): the compiled step would run the forward
    node again to rebuild that gradient, work and memory outside the model
    (:func:`tfremat.plan.schedule.with_fresh_gradient_reads`). A schedule recomputes the forward node in the
    backward node's stage instead, which the model counts.

    Per forward node f and such input x, a continuous ``fresh[t]`` in [0, 1] is at least 1
    when x ran after f's last run up to stage t (within a stage x runs first):
    ``fresh[t] >= R[t, x] - R[t, f]`` and ``fresh[t] >= fresh[t-1] - R[t, f]``; and
    ``R[t, b] + fresh[t] <= 1`` (``R_a[t, b]`` summed over those modes). Exact for integer
    R: the least ``fresh`` is the indicator itself.

    Returns:
        ``(column, t, f, x)`` of every ``fresh`` column, by (f, x) and then stage.
    """
    layout, r_index = cols.layout, cols.r_index
    graph = layout.graph
    readers: dict[tuple[int, int], list[tuple[int, tuple[int, ...] | None]]] = {}
    for backward, f in sorted(graph.forward_of.items()):
        modes = layout.modes.get(f) if layout.family.get(backward) == f else None
        if modes is None:
            for x in graph.inputs_read_with_forward.get(backward, ()):
                readers.setdefault((f, x), []).append((backward, None))
            continue
        for x in sorted(set().union(*(m.inputs_read for m in modes))):
            reading = tuple(a for a, m in enumerate(modes)
                            if x in m.inputs_read and (m.reads_output or m.residual_bytes))
            if reading:
                readers.setdefault((f, x), []).append((backward, None if len(reading) == len(modes) else reading))
    keys = []
    for (f, x), backwards in sorted(readers.items()):
        last = max(int(np.flatnonzero(r_index[:, k] >= 0).max(initial=-1)) for k, _ in backwards)
        previous = -1
        for t in range(f + 1, last + 1):
            rx, rf = r_index[t, x], r_index[t, f]
            if rx < 0 and previous < 0:
                continue
            column = b.column(0.0, 0.0, 1.0, False)
            keys.append((column, t, f, x))
            for source in (rx, previous):
                if source >= 0:
                    b.row([(column, 1.0), (source, -1.0)] + ([(rf, 1.0)] if rf >= 0 else []), 0.0, math.inf)
            previous = column
            for k, modes in backwards:
                if r_index[t, k] >= 0:
                    b.row([*((c, 1.0) for c in cols.reading(t, k, modes)), (column, 1.0)], -math.inf, 1.0)
    return keys


def _free_rows(b: SparseBuilder, cols: _Columns, t: int, free_keys: list, frees_after: dict) -> None:
    """Stage t's ``FREE[t, i, k]`` columns (free value i right after node k runs) and the
    rows that make them Checkmate's deallocation indicator (sec. 4.4, eqs. (4)-(6c)).

    Instead of the big-M cast-to-boolean rows (6a)-(6c), per resident value i:
    ``sum_k FREE[t, i, k] + S[t+1, i] = R[t, i] + S[t, i]`` (one fate: kept into the
    next stage or freed after exactly one reader; implies the keep-source constraint
    ``S[t+1, i] <= R[t, i] + S[t, i]`` of sec. 4.3), ``FREE[t, i, k] <= R[t, k]``, and
    for every reader j, ``sum_{k < j} FREE[t, i, k] + R[t, j] <= 1`` (no free before a
    later reader); for a node with several values, the rows hold per value, over the
    readers of that value, with the value's maker (``R``, or one implementation's ``R_a``)
    and each reader's ``R`` through the modes it reads the value in (MONeT appendix F's
    ``FREE^v``). Appends ``(column, t, i, place, k, modes)`` to ``free_keys`` and ``(column, bytes)``
    to ``frees_after[(t, k)]``.
    """
    layout, r_index, n = cols.layout, cols.r_index, cols.layout.graph.size
    for i in range(t):
        if r_index[t, i] < 0:
            continue
        split = len(layout.values[i]) > 1
        for place, value in enumerate(layout.values[i]):
            keep_next = value.keep[t + 1] if t + 1 < n else -1
            made = r_index[t, i] if value.mode is None else cols.making(t, value)
            outcomes = [(keep_next, 1.0)] if keep_next >= 0 else []
            earlier_frees = []
            if split:
                # Recomputing a split node for one of its values makes the others too;
                # unread in the stage, such a value is freed right after the node runs.
                col = b.column(0.0, 0.0, 1.0, False)
                free_keys.append((col, t, i, place, i, None))
                outcomes.append((col, 1.0))
                earlier_frees.append((col, 1.0))
                frees_after.setdefault((t, i), []).append((col, value.size))
                b.row([(col, 1.0), (made, -1.0)], -math.inf, 0.0)
            for k, modes in value.readers:
                if k > t or r_index[t, k] < 0:
                    continue
                if modes is None:
                    reading, unread = [(r_index[t, k], 1.0)], [(r_index[t, k], -1.0)]
                else:
                    columns = cols.reading(t, k, modes)
                    reading, unread = [(c, 1.0) for c in columns], [(c, -1.0) for c in columns]
                if earlier_frees:
                    b.row(earlier_frees + reading, -math.inf, 1.0)
                col = b.column(0.0, 0.0, 1.0, False)
                free_keys.append((col, t, i, place, k, modes))
                outcomes.append((col, 1.0))
                earlier_frees.append((col, 1.0))
                frees_after.setdefault((t, k), []).append((col, value.size))
                if k < t or modes is not None:
                    b.row([(col, 1.0), *unread], -math.inf, 0.0)
            resident = [(made, -1.0)]
            if value.keep[t] >= 0:
                resident.append((value.keep[t], -1.0))
            b.row([*outcomes, *resident], 0.0, 0.0)


def _memory_rows(b: SparseBuilder, cols: _Columns, t: int, frees_after: dict, u_keys: list, scale: float,
                 capacity: float) -> None:
    """Stage t's memory accounting ``U[t, k]`` (Checkmate sec. 4.4) and the budget.

    ``U[t, k]`` is the memory while node k runs, without its workspace: eq. (1) starts
    the stage with every kept value (plus the first node's output), eq. (2) adds node k's
    output and subtracts what was freed after the previous node (eq. (3)'s
    ``mem_freed``). The budget ``U[t, k] <= M_budget`` (sec. 4.5) is the column's upper
    bound, and with k's workspace a row of its own. A node with modes adds each value
    through the column that makes it and its workspace through each ``R_a`` (MONeT's
    ``c_i = sum_l c_i^l delta_{i,l}``). Weight gradients held to the end (module doc) lower
    the stage's capacity by their least amount and add the rest on k's ``R`` columns.
    Appends ``(t, k)`` to ``u_keys``.
    """
    layout, r_index = cols.layout, cols.r_index
    active = [k for k in range(t + 1) if r_index[t, k] >= 0]
    base = cols.held_base(t)
    room = capacity - base / scale
    previous, k_prev = None, -1
    for k in active:
        u = b.column(0.0, 0.0, max(room, 0.0), False)
        u_keys.append((t, k))
        terms = [(u, 1.0)] + [(column, -size / scale) for column, size in cols.made_bytes(t, k)]
        if previous is None:
            for index, sizes in ((layout.s_index[t, :t], layout.s_bytes[:t]), (layout.sr_index[t, :t], layout.sr_bytes[:t])):
                kept = (index >= 0) & (sizes > 0)
                terms += zip(index[kept].tolist(), (-sizes[kept] / scale).tolist())
            terms += [(value.keep[t], -value.size / scale) for value in layout.own_keeps
                      if value.node < t and value.keep[t] >= 0 and value.size]
            b.row(terms, 0.0, 0.0)
        else:
            terms.append((previous, -1.0))
            terms += [(col, size / scale) for col, size in frees_after.get((t, k_prev), ()) if size]
            b.row(terms, 0.0, 0.0)
        work = cols.running_terms(t, k, base, scale)
        if work or room < 0:
            b.row([(u, 1.0), *work], -math.inf, room)
        previous, k_prev = u, k


def _read_while_running(cols: _Columns, t: int, value: _Value, modes):
    """Whether node t reads ``value`` when it runs in stage t (it runs there: frontier
    advancing): True when it surely does, None when it cannot, else a linear lower bound
    ``(terms, constant)`` on the indicator. ``R_a[t, t]`` equals ``delta[f, a]``; a value
    that exists only under another node's implementation m is read by the product of two
    choices, at least ``delta[m] + reading - 1`` (MONeT appendix C.4)."""
    layout = cols.layout
    if value.mode is None:
        return True if modes is None else ([(c, 1.0) for c in cols.reading(t, t, modes)], 0.0)
    family = layout.family[value.node]
    if layout.family.get(t) == family:
        if modes is not None and value.mode not in modes:
            return None
        return [(cols.mode_index[t][value.mode, t], 1.0)], 0.0
    delta = [(cols.delta_index[family][value.mode], 1.0)]
    if modes is None:
        return delta, 0.0
    return [*delta, *((c, 1.0) for c in cols.reading(t, t, modes))], -1.0


def _stage_end_row(b: SparseBuilder, cols: _Columns, t: int, scale: float, capacity: float,
                   resident_keys: list) -> None:
    """The rows of stage t when its memory is not accounted exactly (the stage-end
    relaxation; module doc).

    The memory row is exact at the moment node t runs, the stage's last: every value
    kept into stage t+1 is resident then (kept since the stage began, or computed earlier
    in it), as are t's inputs, t's output and t's workspace. Earlier moments of the stage
    are not bounded. Without the stage's ``FREE`` equality, Checkmate's keep-source
    constraint ``S[t+1, i] <= R[t, i] + S[t, i]`` (sec. 4.3) is built instead. A value
    that t reads only under some implementation counts through a ``resident`` column at
    least its keep into stage t+1 and at least the indicator that t reads it (appended
    to ``resident_keys``); t's own values and workspace count through its ``R_a[t, t]``.
    """
    layout, n = cols.layout, cols.layout.graph.size
    read_by_t = {id(value): modes for value, modes in layout.reads[t]}
    fixed = 0
    terms = []
    for i in range(t):
        for place, value in enumerate(layout.values[i]):
            keep = value.keep[t + 1] if t + 1 < n else -1
            if keep >= 0:
                source = [(keep, 1.0), (cols.making(t, value), -1.0)]
                if value.keep[t] >= 0:
                    source.append((value.keep[t], -1.0))
                b.row(source, -math.inf, 0.0)
            if not value.size:
                continue
            modes = read_by_t.get(id(value), False)
            read = None if modes is False else _read_while_running(cols, t, value, modes)
            if read is None:
                if keep >= 0:
                    terms.append((keep, value.size / scale))
            elif read is True:
                fixed += value.size
            else:
                resident = b.column(0.0, 0.0, 1.0, False)
                resident_keys.append((resident, t, i, place, modes))
                if keep >= 0:
                    b.row([(keep, 1.0), (resident, -1.0)], -math.inf, 0.0)
                b.row([*read[0], (resident, -1.0)], -math.inf, -read[1])
                terms.append((resident, value.size / scale))
    running: dict[int, int] = {}  # t's output and workspace, by the column that makes them
    for column, size in [*cols.made_bytes(t, t), *cols.per_mode(t, t, "workspace_bytes")]:
        running[column] = running.get(column, 0) + size
    fixed += running.pop(cols.r_index[t, t], 0)
    terms += [(column, size / scale) for column, size in running.items() if size]
    b.row(terms, -math.inf, capacity - (fixed + layout.held_at(t, t)) / scale)


def _peak_rows(b: SparseBuilder, cols: _Columns, u_keys, u_start: int, scale: float, capacity: float,
               cost_scale: float, max_cost: float) -> int:
    """The batch-size variant (Checkmate's batch-size maximization, arXiv text sec. 5.3):
    a ``peak`` column, the objective, above every ``U[t, k] + workspace``, and the cost
    constraint (7), total compute cost at most ``max_cost``. Returns the peak's column."""
    n, r_index = cols.layout.graph.size, cols.r_index
    peak_column = b.column(1.0, 0.0, capacity, False)
    bases = {t: cols.held_base(t) for t, _ in u_keys}
    for offset, (t, k) in enumerate(u_keys):
        work = cols.running_terms(t, k, bases[t], scale)
        b.row([(u_start + offset, 1.0), *work, (peak_column, -1.0)], -math.inf, -bases[t] / scale)
    costs = [(column, cost / cost_scale) for t in range(n) for i in range(t + 1) if r_index[t, i] >= 0
             for column, cost in cols.per_mode(t, i, "cost")]
    b.row(costs, -math.inf, max_cost / cost_scale)
    return peak_column


def build_milp(
    graph: DFGraph,
    budget_bytes: float,
    *,
    peak_within_cost: float | None = None,
    exact_stages: Iterable[int] | None = None,
    choose_implementations: bool = False,
    step_rules: bool = True,
) -> CheckmateModel:
    """Builds Checkmate's MILP for ``graph`` under ``budget_bytes`` (see the module doc).

    Columns are numbered R and S first (with ``R_a`` and ``delta`` when the model chooses
    implementations; alike whatever stages are exact), then ``FREE`` (and the stage-end
    rows' ``resident`` columns), then ``U``, then the peak.

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
        choose_implementations: choose every node's implementation among the graph's
            alternatives jointly with the schedule (MONeT; module doc). False: the
            graph's own numbers (Checkmate's model).
        step_rules: build the rules :func:`has_step_rules` names. False leaves them
            out; the model then counts no more memory than the simulator for any
            schedule (the weight gradients a rule kept out of a moment are not counted
            there), so it is a relaxation of every schedule: its infeasibility proves
            that none fits ``budget_bytes``, and its solutions must be simulated.

    Returns:
        The model. Its objective, times ``cost_scale``, is the total compute cost of the
        schedule, or with ``peak_within_cost`` its peak in bytes less the fixed bytes.
    """
    if peak_within_cost is not None and exact_stages is not None:
        raise ArgumentError("peak_within_cost needs every stage accounted exactly; leave exact_stages=None")
    n = graph.size
    layout = _Layout(graph, choose_implementations, keep_columns=True, step_rules=step_rules)
    scale, capacity, cost_scale = _units(layout, budget_bytes)
    b = SparseBuilder()
    cols = _schedule_columns(b, layout, cost_scale, minimize_peak=peak_within_cost is not None)
    for t in range(n):
        _dependency_rows(b, cols, t)
        _keep_or_recompute_rows(b, layout, t, cols.r_index)
    _implementation_rows(b, cols)
    if step_rules:
        _split_weight_gradient_rows(b, cols)
    _view_rows(b, layout)
    fresh_keys = _fresh_gradient_rows(b, cols) if step_rules else []

    exact_stage = np.ones(n, dtype=bool) if exact_stages is None else np.isin(np.arange(n), list(exact_stages))
    free_start = len(b.cost)
    free_keys: list = []
    resident_keys: list = []
    frees_after: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(n):
        if exact_stage[t]:
            _free_rows(b, cols, t, free_keys, frees_after)
        else:
            _stage_end_row(b, cols, t, scale, capacity, resident_keys)

    u_start = len(b.cost)
    u_keys: list = []
    for t in map(int, np.flatnonzero(exact_stage)):
        _memory_rows(b, cols, t, frees_after, u_keys, scale, capacity)

    peak_column = -1
    if peak_within_cost is not None:
        peak_column = _peak_rows(b, cols, u_keys, u_start, scale, capacity, cost_scale, peak_within_cost)
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
        r_index=cols.r_index,
        s_index=layout.s_index,
        sr_index=layout.sr_index,
        free_keys=tuple(free_keys),
        free_start=free_start,
        u_keys=tuple(u_keys),
        u_start=u_start,
        capacity=float(capacity),
        peak_column=peak_column,
        mode_names={f: tuple(m.name for m in modes) for f, modes in layout.modes.items()},
        mode_index=cols.mode_index,
        delta_index=cols.delta_index,
        resident_keys=tuple(resident_keys),
        layout=layout,
        fresh_keys=tuple(fresh_keys),
    )
