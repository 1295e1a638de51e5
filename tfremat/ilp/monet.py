"""The ``monet`` strategy: the minimum-cost schedule within a budget, choosing every node's
operator implementation jointly with the checkpoints (MONeT, Shah et al., ICLR 2021).

MONeT's 0-1 program (sec. 4) picks one implementation per operator (its ``delta``) and a
checkpointing schedule together, minimizing total compute cost (eq. 9) under the memory
budget (eqs. 4-6) with the dependencies of the chosen backward implementations resident
(eq. 8). Here that program is Checkmate's MILP extended as MONeT's appendix F outlines and
linearized as its appendix C.4 says (:func:`~tfremat.ilp.formulation.build_milp` with
``choose_implementations=True``): per-implementation columns ``R_a`` for a node with
alternatives and for its backward node, each implementation's residual bytes a value of
its own, and readers that read a value only under the implementations that do. The
memory it accounts is the simulator's, exactly, for the graph under the chosen
implementations.

The steps around the model are ``optimal``'s (:func:`~tfremat.ilp.milp.solve_milp`): a warm
start, the relaxation's LP rounding and RINS, the stage-end relaxation made exact where a
solution overflows, time limits and proven bounds. The warm start is the cheapest of
``optimal``'s schedules on the graph's own numbers, under the cheapest implementations and
under the leanest (:func:`_starts`), so without a time limit ``monet`` never returns worse
than ``optimal`` (it returns ``optimal``'s schedule when its model finds nothing cheaper);
with one, the starts share half of it. On a graph without alternatives its model is
Checkmate's, and ``monet`` is ``optimal``.
"""

from __future__ import annotations

from collections.abc import Collection

from tfremat.errors import ArgumentError, is_int
from tfremat.graph import DFGraph
from tfremat.ilp.formulation import cheapest_implementations, implementation_modes
from tfremat.ilp.milp import MilpProblem, solve_milp
from tfremat.ilp.solvers import DEFAULT_SOLVER, ProgressFn
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule

__all__ = ["solve_monet", "leanest_implementations", "without_implementations"]


def leanest_implementations(graph: DFGraph) -> dict[int, str]:
    """Per node with alternatives, the implementation whose backward reads the fewest bytes
    (its residual bytes, the output if it reads it, the inputs it reads; the cheaper among
    equals): MONeT's memory-light operators. Only the non-default choices."""
    choice = {}
    for node, modes in implementation_modes(graph).items():
        leanest = min(modes, key=lambda m: (m.kept_bytes(graph, node), m.cost + m.backward_cost))
        if leanest.name != "default":
            choice[node] = leanest.name
    return choice


def _starts(graph: DFGraph) -> list[dict[int, str]]:
    """The choices under which ``optimal``'s schedules start monet's MILP: the graph's own
    numbers, the cheapest implementations and the leanest, each once.

    The cheapest start matters where the implementations free little memory but cost
    differently: ResNet50's ReLU masks free nothing (each ReLU output feeds a convolution
    whose gradient reads it anyway), while a cheaper choice leaves more of a compute cap
    for recomputation (at 64x64, batch 8, profiled costs: ``optimal`` under the cheapest
    choice fit a 10% cap at 117 MiB where the other starts needed 123.5 MiB)."""
    starts: list[dict[int, str]] = [{}]
    for choice in (cheapest_implementations(graph), leanest_implementations(graph)):
        if choice not in starts:
            starts.append(choice)
    return starts


def without_implementations(graph: DFGraph, excluded: Collection) -> DFGraph:
    """``graph`` without the alternatives ``excluded`` names: an implementation name (not
    offered on any node) or a ``(node, name)`` pair (not offered on that node). A user
    excludes the implementations that change the gradients' rounding this way
    (``plan_model(..., exact_gradients=True)`` names them per node), and the MILP never
    sees them.

    Raises:
        ArgumentError: an item that is neither a name nor a ``(node id, name)`` pair.
    """
    names, pairs = set(), set()
    for item in excluded:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2 and is_int(item[0]) and isinstance(item[1], str):
            pairs.add((int(item[0]), item[1]))
        else:
            raise ArgumentError(f"exclude_implementations: {item!r} is neither an implementation name (such as "
                                "'fused') nor a (node id, name) pair; pass e.g. exclude_implementations=['fused'], "
                                "or exact_gradients=True to plan_model")
    if not names and not pairs:
        return graph
    kept = {node: [i for i in alternatives if i.name not in names and (node, i.name) not in pairs]
            for node, alternatives in graph.implementations.items()}
    return graph.replaced(implementations=kept)


_MONET = MilpProblem("monet", choose_implementations=True, starts=_starts)


@as_strategy("monet", takes_solver_options=True, chooses_implementations=True)
def solve_monet(
    graph: DFGraph,
    budget=None,
    *,
    solver: str = DEFAULT_SOLVER,
    time_limit: float | None = None,
    mip_gap: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    warm_start: bool = True,
    progress: ProgressFn | None = None,
    stall_time: float | None = None,
    exclude_implementations: Collection = (),
) -> Schedule:
    """The minimum-cost schedule within a memory budget, with one implementation chosen
    for every node that has alternatives (``DFGraph.implementations``; MONeT, sec. 4).

    The objective is the total compute cost of the step (MONeT eq. 9): every forward,
    backward and recomputation, each at its chosen implementation's cost. A node runs
    every time under the same implementation, and its backward node under that
    implementation's backward; the returned schedule records the non-default choices
    (``Schedule.implementations``), under which it validates and simulates. Otherwise it
    behaves as ``optimal`` (:func:`~tfremat.ilp.milp.solve_optimal`), with the same options,
    facts, time limits and errors; see there. On a graph without alternatives it returns
    ``optimal``'s schedule. Its model is larger: per node with alternatives, one ``R_a``
    column per implementation beside each ``R`` column of the node and of its backward
    node, and keep and free columns for each implementation's residual bytes (on ResNet50
    with alternatives for its ReLUs, batch norms and poolings, 1.8 times ``optimal``'s).

    Args:
        graph: the graph, with its alternatives.
        budget: peak bytes allowed (any form :func:`tfremat.budget.parse_graph_budget`
            takes). None means no memory limit: the checkpoint-all schedule under the
            cheapest implementations (least forward plus backward cost), which is the least
            cost any schedule can have.
        solver, time_limit, mip_gap, threads, seed, progress, stall_time: as for ``optimal``.
        exclude_implementations: implementations the schedule may not choose: names
            (``"fused"``, not on any node) or ``(node id, name)`` pairs
            (:func:`without_implementations`). ``plan_model(..., exact_gradients=True)``
            and ``measure_model`` fill it with the alternatives that are not bit-exact with
            their layer's default (``tfremat.runtime.layer_variants``), so the step's
            gradients round as plain Keras's.
        warm_start: start from the cheapest of ``optimal``'s schedules on the graph's own
            numbers, under the cheapest and under the leanest implementations
            (:func:`_starts`; together half the ``time_limit``), the rounding of the relaxation's LP and RINS,
            and return it if the solver does worse.

    Returns:
        The schedule, with :class:`~tfremat.plan.schedule.SolverFacts` (the bound is over
        every choice of implementations).

    Raises:
        InfeasibleBudgetError: no schedule fits under any choice (proven by the solver, or
            the budget is below the peak every choice needs while one node runs).
        ArgumentError: an item of ``exclude_implementations`` is neither a name nor a pair.
        SolverTimeLimitError, SolveInterrupted, ArgumentError, SolverUnavailableError,
            SolverLicenseError: as for ``optimal``.

    Example:
        >>> from tfremat.strategies import get_strategy
        >>> schedule = get_strategy("monet")(graph, "60%", time_limit=60)  # doctest: +SKIP
        >>> schedule.implementations  # doctest: +SKIP
        {3: 'mask', 7: 'output_activated'}
    """
    graph = without_implementations(graph, exclude_implementations)
    return solve_milp(graph, budget, _MONET, solver=solver, time_limit=time_limit, mip_gap=mip_gap,
                      threads=threads, seed=seed, warm_start=warm_start, progress=progress, stall_time=stall_time)
