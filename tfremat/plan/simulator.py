"""The memory simulator: the only code in tfremat that computes memory and cost of a plan.

Convention (Checkmate's memory accounting plus per-node workspace):

* ``fixed_bytes`` (parameters, their gradients, optimizer state, the input batch) are
  resident throughout.
* While node k runs in stage t, memory = fixed bytes + every value resident at that
  moment (kept into stage t, or computed earlier in stage t and not yet freed) + k's
  output + k's workspace.
* After k runs its workspace is released, and each value whose last use in stage t was
  k and that is not kept into stage t+1 is freed (see :mod:`tfremat.plan.execution`);
  a node's output and its residuals are freed each on its own.

* A forward node's weight gradients (``DFGraph.weight_grad_bytes``), which its backward
  node makes and counts in its workspace, stay after the last run of that backward node
  (the one that takes them, the first of a split backward) until the last run of the
  node or its backward nodes: the layer's optimizer update waits for the layer's last
  statement (:mod:`tfremat.static_graph.interpreter`). They count at every statement in
  between, except in the workspace of the layer's own backward nodes, which holds them.
  A schedule that recomputes a forward node after its backward node keeps them that long.
  With ``DFGraph.weight_grads_to_end`` (the updates all run after the backward pass) they
  stay from the first run of the node that takes them to the end of the step; a later run
  of the layer's backward nodes counts them in its workspace only, not twice.

* A view (``DFGraph.view_of``: a ``Flatten``, a ``Reshape``) shares its source's output
  buffer: the buffer counts once while any value sharing it is resident, and is freed
  with the last of them. Computing the source again makes a new buffer, so a view kept
  from the older computation still holds the old one.

The peak is the largest memory during any node's run. With offloading (Beaumont et al.
2021, sec. 3), a ``prefetch`` allocates its device copy where the plan issues it and a
``deallocate`` of an offloaded copy frees it where it stands, so memory still follows the
plan's order; the copies only add time. Two timelines run side by side: the compute one
(node costs) and one host link (``host_bandwidth`` bytes per unit of cost, one copy at a
time, in plan order). A copy starts when it is issued and the link is free (a prefetch
also waits for its offload); a ``deallocate`` of a copy still travelling to the host, and
a compute reading a prefetch still travelling to the device, wait for it: that idle time
makes the step's ``makespan`` longer than its compute ``cost``.

The MILP (``tfremat.ilp``) encodes
the same convention, and a test holds the two together. Solvers, tests, reports and plots
all call :func:`simulate`; there is no switch that changes what it counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfremat.graph import DFGraph
from tfremat.plan.execution import ExecutionPlan, Op, build_plan
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix

__all__ = ["SimulationResult", "simulate", "stage_peaks", "checkpoint_all_peak", "held_weight_gradients"]


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What one training step under a plan costs.

    Attributes:
        peak_bytes: the largest memory during any node's run (including fixed bytes).
        cost: total compute cost of every compute statement.
        recompute_count: compute statements that re-run a node.
        trace_bytes: memory at every statement (after allocate/deallocate; during compute,
            including the node's workspace), for plots.
        peak_statement: index of the statement where the peak occurs.
        plan: the simulated plan.
        makespan: when the step ends: ``cost`` plus the time compute waits for copies.
        idle: ``makespan - cost`` as it accrued (0 without offloading).
        transfer_bytes: bytes copied over the host link (offloads and prefetches).
        host_peak_bytes: the most bytes held in host memory at once; a host copy is held
            from its offload to its last prefetch.
    """

    peak_bytes: int
    cost: float
    recompute_count: int
    trace_bytes: np.ndarray
    peak_statement: int
    plan: ExecutionPlan
    makespan: float = 0.0
    idle: float = 0.0
    transfer_bytes: int = 0
    host_peak_bytes: int = 0


def simulate(graph: DFGraph, plan: ExecutionPlan | Schedule) -> SimulationResult:
    """Replays a plan (or a schedule, whose plan is built first) and counts bytes and cost.

    Args:
        graph: the graph the plan was made for (not yet under the plan's implementations:
            they are applied here).
        plan: an :class:`ExecutionPlan`, or a :class:`Schedule` to build one from.

    Returns:
        A :class:`SimulationResult`.
    """
    if isinstance(plan, Schedule):
        plan = build_plan(graph, plan)
    graph = graph.with_implementations(plan.implementations)
    out = graph.output_bytes
    work = graph.workspace_bytes
    costs = graph.cost
    live = graph.fixed_bytes
    held = held_weight_gradients(graph, plan)
    buffers = _Buffers(graph)
    total_cost = 0.0
    trace = np.empty(len(plan.statements), dtype=np.int64)
    peak = live
    peak_at = 0
    recomputes = 0
    link = _HostLink(graph, plan)
    for index, statement in enumerate(plan.statements):
        node = statement.node
        if statement.op is Op.ALLOCATE:
            live += buffers.allocate(node)
            current = live
        elif statement.op is Op.COMPUTE:
            link.compute(node)
            current = live + work[node] + held[index]
            total_cost += costs[node]
            recomputes += statement.recompute
            if current > peak:
                peak, peak_at = current, index
        elif statement.op is Op.OFFLOAD:
            link.offload(node)
            current = live
        elif statement.op is Op.PREFETCH:
            link.prefetch(node, index)
            live += buffers.allocate(node, share=False)
            current = live
        else:
            link.free(node)
            live -= buffers.free(node, statement.part)
            current = live
        if statement.op is not Op.COMPUTE:
            current += held[index]
        trace[index] = current
    trace.setflags(write=False)
    return SimulationResult(int(peak), total_cost, recomputes, trace, peak_at, plan, link.clock,
                            max(0.0, link.clock - total_cost), link.moved, link.host_peak)


def held_weight_gradients(graph: DFGraph, plan: ExecutionPlan) -> np.ndarray:
    """Per statement of ``plan``, the weight-gradient bytes held beyond the workspaces
    (module docstring): a forward node's ``weight_grad_bytes`` from after the last compute
    of its weight-gradient node to its layer's last compute (with ``weight_grads_to_end``:
    from the first such compute to the end), the computes of its backward nodes left out
    (their workspace holds them)."""
    held = np.zeros(len(plan.statements) + 1, dtype=np.int64)
    layers = [f for f, grads in enumerate(graph.weight_grad_bytes) if grads]
    if not layers:
        return held[:-1]
    layer_of = {}
    for f in layers:
        layer_of[f] = f
        for b in graph.backward_nodes_of[f]:
            layer_of[b] = f
    to_end = graph.weight_grads_to_end
    # layer -> index of the compute that takes its weight gradients: the last (they live to
    # the layer's last compute), or with ``to_end`` the first (they live to the step's end)
    taken: dict[int, int] = {}
    last: dict[int, int] = {}  # layer -> index of its last compute
    own: list[tuple[int, int]] = []  # (index, layer) of the computes of a layer's backward nodes
    for index, statement in enumerate(plan.statements):
        f = layer_of.get(statement.node)
        if f is None or statement.op is not Op.COMPUTE:
            continue
        last[f] = index
        if statement.node == graph.backward_nodes_of[f][0] and not (to_end and f in taken):
            taken[f] = index
        if statement.node != f:
            own.append((index, f))
    if to_end:
        last = {f: len(plan.statements) - 1 for f in taken}
    for f, start in taken.items():
        if last[f] > start:
            held[start + 1] += graph.weight_grad_bytes[f]
            held[last[f] + 1] -= graph.weight_grad_bytes[f]
    held = np.cumsum(held)
    for index, f in own:
        if taken.get(f, index) < index <= last[f]:
            held[index] -= graph.weight_grad_bytes[f]
    return held[:-1]


class _Buffers:
    """The device buffers of resident values, so that a view and its source count once
    (module docstring). Without views every value part has a buffer of its own, and
    allocating and freeing add and subtract its bytes."""

    def __init__(self, graph: DFGraph):
        self.graph = graph
        self.views = graph.view_of
        self.holder: dict[tuple[int, str | None], list[int]] = {}  # (node, part) -> [bytes, references]

    def allocate(self, node: int, share: bool = True) -> int:
        """Makes ``node``'s value resident; returns the bytes newly allocated. A view
        computed from its resident source shares the source's buffer (``share``; a
        prefetched copy never does)."""
        if not self.views:
            return self.graph.output_bytes[node]
        source = self.views.get(node) if share else None
        shared = self.holder.get((source, self.graph.shared_part(source))) if source is not None else None
        if shared is not None:
            shared[1] += 1
            self.holder[(node, None)] = shared
            return 0
        for part in self.graph.value_parts(node):
            self.holder[(node, part)] = [self.graph.part_bytes(node, part), 1]
        return self.graph.output_bytes[node]

    def free(self, node: int, part: str | None) -> int:
        """Drops ``node``'s value (``part``: one part, None: all of it); returns the bytes
        freed, those of the buffers nothing else holds."""
        if not self.views:
            return self.graph.output_bytes[node] if part is None else self.graph.part_bytes(node, part)
        freed = 0
        for each in (self.graph.value_parts(node) if part is None else (part,)):
            buffer = self.holder.pop((node, each), None)
            if buffer is None:
                continue
            buffer[1] -= 1
            if not buffer[1]:
                freed += buffer[0]
        return freed


class _HostLink:
    """The compute clock and the host link's timeline of one simulated plan (module
    docstring); without offloads it only adds up costs."""

    def __init__(self, graph: DFGraph, plan: ExecutionPlan):
        self.graph = graph
        self.bandwidth = plan.host_bandwidth
        self.clock = 0.0
        self.link_free = 0.0
        self.offloaded: dict[int, float] = {}  # node -> when its copy to the host ends
        self.arrives: dict[int, float] = {}  # node -> when its prefetched copy is on the device
        self.moved = 0
        self.host = 0
        self.host_peak = 0
        # The last prefetch of each host copy (before the node is offloaded again) frees it.
        self.last_prefetch: set[int] = set()
        pending: dict[int, int] = {}
        for index, statement in enumerate(plan.statements):
            if statement.op is Op.PREFETCH:
                pending[statement.node] = index
            elif statement.op is Op.OFFLOAD and statement.node in pending:
                self.last_prefetch.add(pending.pop(statement.node))
        self.last_prefetch.update(pending.values())

    def _transfer(self, node: int, ready: float) -> float:
        size = int(self.graph.output_bytes[node])
        begin = max(self.clock, self.link_free, ready)
        self.link_free = begin + size / self.bandwidth
        self.moved += size
        return self.link_free

    def compute(self, node: int) -> None:
        for source in self.graph.predecessors[node]:
            self.clock = max(self.clock, self.arrives.pop(source, 0.0))
        self.clock += self.graph.cost[node]

    def offload(self, node: int) -> None:
        self.offloaded[node] = self._transfer(node, 0.0)
        self.host += int(self.graph.output_bytes[node])
        self.host_peak = max(self.host_peak, self.host)

    def prefetch(self, node: int, index: int) -> None:
        self.arrives[node] = self._transfer(node, self.offloaded.get(node, 0.0))
        if index in self.last_prefetch:
            self.host -= int(self.graph.output_bytes[node])

    def free(self, node: int) -> None:
        self.clock = max(self.clock, self.offloaded.get(node, 0.0))


def stage_peaks(result: SimulationResult, num_stages: int) -> np.ndarray:
    """The largest memory during each stage of a simulated plan (0 for a stage without
    statements)."""
    statements = result.plan.statements
    stages = np.fromiter((s.stage for s in statements), dtype=np.int64, count=len(statements))
    peaks = np.zeros(num_stages)
    np.maximum.at(peaks, stages, result.trace_bytes)
    return peaks


def checkpoint_all_peak(graph: DFGraph) -> int:
    """The peak of the schedule that keeps every value (no recomputation): what relative
    budgets ("50%", 0.5) are a share of."""
    return simulate(graph, schedule_from_keep_matrix(graph, checkpoint_all_s(graph), "checkpoint_all")).peak_bytes
