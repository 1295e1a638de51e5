"""Planning a long graph unit by unit: each distinct unit's schedules solved once over a
grid of memory levels, then one per unit chosen along the chain by dynamic programming.

The Checkmate MILP of a 12-block transformer at sublayer granularity has a quarter of a
million columns: HiGHS solves only its LP within a minute, and the LP's rounding is no
better than the heuristics. The graph, though, is a chain of small pieces, and most
pieces repeat. As Rockmate (Zhao et al., ICML 2023) combines per-block schedules with
rotor's chain DP (Beaumont et al. 2021, sec. 5.2), this module

1. cuts the forward order where no forward edge jumps over a node (:func:`chain_units`):
   a unit's forward nodes read only their own unit and the value at the cut before it,
   which is kept from its computation to its last reader;
2. builds, for each unit, a small graph of its forward nodes, a *hold* node and its
   backward nodes (:func:`unit_graph`) and solves Checkmate's MILP on it over a grid of
   (peak, kept) levels (:func:`unit_options`): the hold node's workspace ``peak - kept``
   makes the peak bound the bytes the unit keeps while the rest of the step runs between
   its forward and its backward. Each solution is an *option* (:class:`UnitOption`).
   Units with equal graphs share one solve;
3. picks one option per unit by a DP over the units in forward order whose state is the
   bytes kept by the units before (:func:`choose_options`): while unit ``u`` runs, forward
   or backward, the earlier units' kept bytes are resident besides its own working set and
   the later units' are not (not yet computed, or already freed);
4. writes the chosen options into one keep matrix of the whole graph, completes it with
   ``solve R given S`` and judges it by the one simulator. What else is resident while a
   unit runs (cuts, gradients, fixed bytes) is calibrated on that simulation, unit by unit,
   and the DP runs again, keeping the cheapest schedule that fits (:func:`plan_by_units`).

The result is a schedule without a proof: ``optimal`` starts from it on models too large
for its MILP and reports the gap to its LP bound (benchmarks/transformers.py).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import numpy as np

from tfremat.graph import DFGraph
from tfremat.ilp.formulation import build_milp, memory_lower_bound
from tfremat.ilp.portfolio import best_baseline
from tfremat.ilp.solvers import DEFAULT_SOLVER, solve_model
from tfremat.plan.schedule import (
    Schedule,
    SolveStatus,
    checkpoint_all_s,
    schedule_from_keep_matrix,
)
from tfremat.plan.simulator import simulate, stage_peaks

__all__ = ["chain_units", "unit_graph", "UnitOption", "unit_options", "choose_options", "plan_by_units"]

logger = logging.getLogger(__name__)


def chain_units(graph: DFGraph) -> list[list[int]] | None:
    """The forward order cut after every node that no forward edge jumps over; None when
    there are fewer than two units.

    A forward edge ``(a, b)`` jumps over every node strictly between ``a`` and ``b`` in the
    forward order. Cutting only where no edge jumps makes each unit read nothing from
    earlier units except the cut value just before it (the residual stream between
    transformer blocks, for instance; a mask computed once and read by every block
    leaves no cut at all). A unit has at least two nodes, but for the last."""
    forward = list(graph.forward_nodes)
    position = {node: index for index, node in enumerate(forward)}
    jumped = np.zeros(len(forward) + 1, dtype=np.int64)
    for a, b in graph.edges:
        if a in position and b in position and position[b] - position[a] > 1:
            jumped[position[a] + 1] += 1
            jumped[position[b]] -= 1
    jumped = np.cumsum(jumped)
    units: list[list[int]] = [[]]
    for index, node in enumerate(forward):
        units[-1].append(node)
        # A cut after a lone node (a layer normalization between two residual adds) would
        # pin the cheap value it makes; it joins the next unit instead.
        if index + 1 < len(forward) and jumped[index] == 0 and len(units[-1]) > 1:
            units.append([])
    return units if len(units) >= 2 else None


@dataclasses.dataclass(frozen=True)
class UnitGraph:
    """A unit's own graph: ``graph`` with local ids; ``nodes[j]`` is the graph's node of
    local node j (None for the hold node, at ``hold``, and the incoming-gradient node
    after it)."""

    graph: DFGraph
    nodes: tuple
    hold: int


def _unit_members(graph: DFGraph, unit: list[int], last: bool) -> tuple[list[int], list[int]]:
    members = set(unit)
    backward = [b for b in graph.backward_nodes if graph.forward_of.get(b) in members]
    if last and graph.loss_node is not None:
        backward = sorted(set(backward) | {graph.loss_node})
    return list(unit), backward


def unit_graph(graph: DFGraph, unit: list[int], last: bool, hold_bytes: int) -> UnitGraph:
    """The graph of one unit: its forward nodes, a hold node (no inputs, no outputs,
    ``hold_bytes`` of workspace, standing for the rest of the step between the unit's
    forward and backward), one node for the gradients that arrive from later units, and
    its backward nodes (the loss with the last unit). Values from outside the unit (the
    cut before it, pinned values) are resident by construction and not counted here."""
    forward, backward = _unit_members(graph, unit, last)
    incoming = sorted({p for b in backward for p in graph.predecessors[b]
                       if graph.is_backward[p] and p not in set(backward)})
    nodes = [*forward, None, None, *backward]
    hold, gradient_in = len(forward), len(forward) + 1
    local = {g: j for j, g in enumerate(nodes) if g is not None}
    # Per local node: name, cost, output bytes, workspace bytes, backward flag, residual bytes.
    records = []
    for j, g in enumerate(nodes):
        if j == hold:
            records.append(("hold", 0.0, 0, hold_bytes, False, 0))
        elif j == gradient_in:
            records.append(("gradient_in", 0.0, sum(graph.output_bytes[p] for p in incoming), 0, True, 0))
        else:
            records.append((graph.names[g], graph.cost[g], graph.output_bytes[g], graph.workspace_bytes[g],
                            graph.is_backward[g], graph.residual_bytes[g]))
    names, cost, out, work, is_backward, residual = (list(field) for field in zip(*records))
    edges = set()
    for j, g in enumerate(nodes):
        if g is None:
            continue
        for p in graph.predecessors[g]:
            if p in local:
                edges.add((local[p], j))
            elif graph.is_backward[p]:
                edges.add((gradient_in, j))
    forward_of = {local[b]: local[f] for b, f in graph.forward_of.items() if b in local and f in local}
    loss = local.get(graph.loss_node) if last and graph.loss_node is not None else gradient_in
    weight_grads = [0] * len(nodes)
    for f in set(forward_of.values()):
        weight_grads[f] = graph.weight_grad_bytes[nodes[f]]
    sub = DFGraph(names, sorted(edges), cost, out, work, is_backward, loss_node=loss, forward_of=forward_of,
                  residual_bytes=residual, name=f"{graph.name}/unit", weight_grad_bytes=weight_grads,
                  weight_grads_to_end=graph.weight_grads_to_end)
    return UnitGraph(sub, tuple(nodes), hold)


@dataclasses.dataclass(frozen=True)
class UnitOption:
    """One way to run a unit: ``kept`` bytes it holds between its forward and its backward,
    its peaks in its forward (``forward_peak``) and backward (``backward_peak``) windows,
    its compute ``cost``, and its schedule over the unit graph, whose local node j is the
    graph's node ``nodes[j]`` (None for the hold and incoming-gradient nodes, at
    ``hold`` and ``hold + 1``)."""

    kept: int
    forward_peak: int
    backward_peak: int
    cost: float
    schedule: Schedule
    nodes: tuple
    hold: int

    def peak_with_hold(self, hold_bytes: int) -> int:
        """The schedule's peak on the unit graph whose hold node has ``hold_bytes`` of
        workspace: only the hold stage's memory depends on it."""
        return max(self.forward_peak, self.backward_peak, self.kept + hold_bytes)


# The grid of memory levels each distinct unit is solved at. On the 12-block GPT-2 graph
# (benchmarks/transformers.py) 16 x 4 levels reach within 0.1% of the cost 32 x 6 reach,
# and 8 x 3 cost 1.5% more.
KEPT_LEVELS = 16
PEAK_LEVELS = 3
# Per unit MILP: a 30-node unit graph's MILP rarely proves 1% in seconds (its LP is as
# weak as the whole graph's), but its incumbent is final within half a second.
_SECONDS_EACH = 0.5
# The heuristics' share of a level: their cheapest fitting schedule starts its MILP.
_HEURISTIC_SECONDS = 0.2
_MIP_GAP = 0.01
# Options of the most recently solved distinct units, by unit-graph fingerprint.
_OPTIONS: dict = {}
_OPTIONS_KEPT = 256


def _option(unit: UnitGraph, schedule: Schedule) -> UnitOption:
    sub = unit.graph
    result = simulate(sub, schedule)
    peaks = stage_peaks(result, sub.size)
    hold_workspace = sub.workspace_bytes[unit.hold]
    return UnitOption(
        kept=int(peaks[unit.hold] - hold_workspace),
        forward_peak=int(peaks[: unit.hold].max(initial=0)),
        backward_peak=int(peaks[unit.hold + 1:].max(initial=0)),
        cost=float(result.cost),
        schedule=schedule,
        nodes=unit.nodes,
        hold=unit.hold,
    )


def unit_options(graph: DFGraph, unit: list[int], last: bool, *, kept_levels: int = KEPT_LEVELS,
                 solver: str = DEFAULT_SOLVER, deadline: float | None = None) -> list[UnitOption]:
    """The unit's schedules over a grid of memory levels, each solved by Checkmate's exact
    MILP of the unit graph: :data:`PEAK_LEVELS` peaks from a quarter of the larger of the
    unit's keep-everything and keep-nothing peaks to all of it, times ``kept_levels`` caps
    on the kept bytes from none to all. Dominated options are dropped; keeping everything
    and keeping nothing between stages are always among the candidates. When ``deadline``
    (a ``time.perf_counter()`` time) passes, the levels solved so far are returned.

    Units with equal graphs (up to names) share their options within a process, once all
    their levels are solved."""
    plain = unit_graph(graph, unit, last, 0)
    key = (plain.graph.fingerprint, kept_levels, solver)
    options = _OPTIONS.get(key)
    if options is None:
        options, complete = _solve_levels(graph, unit, last, plain, kept_levels, solver, deadline)
        if complete:
            if len(_OPTIONS) >= _OPTIONS_KEPT:
                _OPTIONS.pop(next(iter(_OPTIONS)))
            _OPTIONS[key] = options
    return [dataclasses.replace(o, nodes=plain.nodes) for o in options]


def _solve_levels(graph, unit, last, plain, kept_levels, solver, deadline) -> tuple[list[UnitOption], bool]:
    """The unit's options, and whether every level was solved before ``deadline``."""
    keep_all = _option(plain, schedule_from_keep_matrix(plain.graph, checkpoint_all_s(plain.graph), "units"))
    # Nothing kept between stages: every stage recomputes what it reads (the least
    # memory, and a start every level's model accepts).
    keep_none = schedule_from_keep_matrix(plain.graph, np.zeros((plain.graph.size,) * 2, dtype=bool), "units")
    options = [keep_all, _option(plain, keep_none)]
    # Recomputing everything in the backward window can peak above keeping everything.
    top = max(option.peak_with_hold(0) for option in options)
    peaks = np.unique(np.linspace(0.25, 1.0, PEAK_LEVELS) * top).astype(int)
    caps = np.unique(np.linspace(0.0, 1.0, kept_levels) * keep_all.kept).astype(int)
    for peak in peaks[peaks >= memory_lower_bound(plain.graph)]:
        # From the largest cap down: once a cap is infeasible, every smaller one is.
        for cap in caps[::-1]:
            if deadline is not None and time.perf_counter() > deadline:
                return _undominated(options), False
            hold = max(int(peak) - int(cap), 0)
            level = unit_graph(graph, unit, last, hold)
            heuristic, _ = best_baseline(level.graph, int(peak), 0.0, time.perf_counter() + _HEURISTIC_SECONDS,
                                         quiet=True)
            # The MIP start: without one, HiGHS often finds no solution of a tight level in
            # its half second.
            candidates = options + ([_option(level, heuristic)] if heuristic is not None else [])
            start = min((o for o in candidates if o.peak_with_hold(hold) <= peak), key=lambda o: o.cost, default=None)
            # The stage-end relaxation first (a third of the exact model's size); the exact
            # model where its solution overflows.
            solved = None
            for exact_stages in ((), None):
                model = build_milp(level.graph, int(peak), exact_stages=exact_stages)
                result = solve_model(model, solver=solver, time_limit=_SECONDS_EACH, mip_gap=_MIP_GAP, quiet=True,
                                     start=None if start is None else model.encode(start.schedule))
                if result.x is not None:
                    solved = _option(level, model.schedule(result.x, "units"))
                    if solved.peak_with_hold(hold) <= peak:
                        break
                    solved = None
            if result.status == SolveStatus.INFEASIBLE:
                break
            if solved is not None or start is not None:
                options.append(solved or start)
    return _undominated(options), True


def _undominated(options: list[UnitOption]) -> list[UnitOption]:
    key = lambda o: (o.kept, o.forward_peak, o.backward_peak, o.cost)  # noqa: E731
    kept = []
    for option in sorted(options, key=key):
        if not any(all(a <= b for a, b in zip(key(other), key(option))) for other in kept):
            kept.append(option)
    return kept


def choose_options(options: list[list[UnitOption]], budget: int, base: np.ndarray, step: int) -> list[int] | None:
    """One option per unit, in forward order, of least total cost such that while unit u
    runs its forward (backward), ``base[u, 0]`` (``base[u, 1]``) plus the bytes kept by
    units before it plus its own window peak fit ``budget``; kept bytes are rounded up to
    ``step`` to bound the states. None when no choice fits."""
    states = {0: (0.0, ())}
    for unit_options_, (forward_base, backward_base) in zip(options, base):
        following: dict[int, tuple[float, tuple]] = {}
        for prefix, (cost, picks) in states.items():
            room = budget - prefix * step
            for index, option in enumerate(unit_options_):
                if option.forward_peak + forward_base > room or option.backward_peak + backward_base > room:
                    continue
                key = prefix + math.ceil(option.kept / step)
                total = cost + option.cost
                if key not in following or total < following[key][0]:
                    following[key] = (total, picks + (index,))
        # Only states that keep fewer bytes or cost less than every other survive.
        states, best = {}, math.inf
        for key in sorted(following):
            if following[key][0] < best:
                best = following[key][0]
                states[key] = following[key]
        if not states:
            return None
    return list(min(states.values())[1])


def _keep_matrix(graph: DFGraph, units: list[list[int]], chosen: list[UnitOption]) -> np.ndarray:
    """The global keep matrix of the chosen options: each unit's forward values kept as its
    own schedule keeps them (through the stages of other units, as into its next own
    stage), cut values and gradients from their computation to their last reader."""
    n = graph.size
    S = np.zeros((n, n), dtype=bool)
    last_reader = [max(s) if s else i for i, s in enumerate(graph.successors)]
    local_forward = set()
    for unit, option in zip(units, chosen):
        nodes = option.nodes
        local = {g: j for j, g in enumerate(nodes) if g is not None}
        S_local = option.schedule.S
        own_stages = sorted(g for g in nodes if g is not None)
        backward_stages = [g for g in own_stages if graph.is_backward[g]]
        end = max(own_stages)
        for g in unit[:-1]:
            j = local[g]
            local_forward.add(g)
            following = own_stages[own_stages.index(g) + 1:]
            # For every later global stage: the unit's next own stage at or after it.
            cursor = 0
            for t in range(g + 1, end + 1):
                while following[cursor] < t:
                    cursor += 1
                nxt = following[cursor]
                if graph.is_backward[nxt] and nxt == backward_stages[0] and t < nxt:
                    S[t, g] = S_local[option.hold + 1, j]
                else:
                    S[t, g] = S_local[local[nxt], j]
    for i in range(n):
        if i not in local_forward and graph.successors[i]:
            S[i + 1: last_reader[i] + 1, i] = True
    return S


def plan_by_units(graph: DFGraph, budget: int, *, solver: str = DEFAULT_SOLVER, deadline: float | None = None,
                  rounds: int = 8) -> Schedule | None:
    """The cheapest schedule the unit decomposition finds within ``budget`` (simulated),
    or None: no cut, or no choice of options fits. Units reached after ``deadline`` (a
    ``time.perf_counter()`` time) get only the levels solved by then, at least keeping
    everything or nothing. ``rounds`` bounds the DP/simulation calibration rounds."""
    units = chain_units(graph)
    if units is None:
        return None
    last = len(units) - 1
    plains = [unit_graph(graph, unit, index == last, 0) for index, unit in enumerate(units)]
    signatures = [plain.graph.fingerprint for plain in plains]
    repeats = collections.Counter(signatures)
    first = {}
    for index, signature in enumerate(signatures):
        first.setdefault(signature, index)
    # The most repeated units first: they weigh most in the total if the deadline comes.
    solved = {}
    for signature in sorted(first, key=lambda s: -repeats[s]):
        index = first[signature]
        # A unit that occurs once weighs little in the total: half the levels.
        levels = KEPT_LEVELS if repeats[signature] > 1 else KEPT_LEVELS // 2
        solved[signature] = unit_options(graph, units[index], index == last, kept_levels=levels, solver=solver,
                                         deadline=deadline)
    options = [[dataclasses.replace(o, nodes=plain.nodes) for o in solved[signature]]
               for plain, signature in zip(plains, signatures)]
    cut_bytes = [graph.output_bytes[unit[-1]] for unit in units]
    # What the rest of the step holds while a unit runs, besides earlier units' kept
    # bytes: at first the fixed bytes and the cuts before it; then calibrated on each
    # assembled schedule's simulation, unit by unit and window by window.
    base = np.array([[graph.fixed_bytes + sum(cut_bytes[:index])] * 2 for index in range(len(units))], dtype=float)
    windows = [_unit_members(graph, unit, index == last) for index, unit in enumerate(units)]
    step = max(budget // 2000, 1)
    best, seen = None, set()
    for _ in range(rounds):
        picks = choose_options(options, budget, base, step)
        if picks is None or tuple(picks) in seen:
            break
        seen.add(tuple(picks))
        chosen = [options[u][p] for u, p in enumerate(picks)]
        schedule = schedule_from_keep_matrix(graph, _keep_matrix(graph, units, chosen), "units")
        result = simulate(graph, schedule)
        logger.info("units: %d units -> peak %d (budget %d), cost %.6g", len(units), result.peak_bytes, budget,
                    result.cost)
        if result.peak_bytes <= budget and (best is None or result.cost < best.cost(graph)):
            best = schedule
        peaks = stage_peaks(result, graph.size)
        prefix = np.concatenate([[0], np.cumsum([o.kept for o in chosen])[:-1]])
        for u, option in enumerate(chosen):
            for side, (stages, local_peak) in enumerate(zip(windows[u], (option.forward_peak, option.backward_peak))):
                if stages:
                    base[u, side] = peaks[stages].max() - prefix[u] - local_peak
    return best
