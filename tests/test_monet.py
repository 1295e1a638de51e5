"""The ``monet`` strategy (issue 23): checkpoints and operator implementations chosen by one
MILP (MONeT sec. 4, appendices C.4 and F), checked by brute force over keep matrices and
implementation choices on tiny graphs, against the one simulator, and against ``optimal``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from graph_factories import (
    random_training_graph,
    training_graph,
    with_alternatives,
    with_residuals,
)
from milp_agreement import assert_milp_memory_is_simulated

from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import DFGraph, Implementation
from tfremat.ilp import build_milp, solve_model
from tfremat.ilp.formulation import (
    cheapest_implementations,
    implementation_modes,
    memory_lower_bound,
)
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.monet import leanest_implementations, solve_monet
from tfremat.plan.schedule import Schedule, schedule_from_keep_matrix, validate_schedule
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import get_strategy, solver_strategy_names


def tiny_graph(seed: int) -> DFGraph:
    """Two forward layers (5 nodes), one or both with alternatives, a third of them with residuals."""
    base = random_training_graph(seed, 2)
    if seed % 3 == 1:
        base = with_residuals(base, seed)
    return with_alternatives(base, seed, 1 + seed % 2)


def choices(graph: DFGraph):
    """Every implementation choice (only the non-default entries)."""
    modes = implementation_modes(graph)
    for names in itertools.product(*([mode.name for mode in node_modes] for node_modes in modes.values())):
        yield {node: name for node, name in zip(modes, names) if name != "default"}


def brute_force_points(graph: DFGraph) -> set[tuple[int, float, bool]]:
    """``(peak, cost, default choice)`` of every keep matrix under every implementation
    choice, completed with solve R given S. Keeps past a value's last reader are left out:
    pruning drops them, so every schedule these complete to is one of the others'."""
    points = set()
    for choice in choices(graph):
        under = graph.with_implementations(choice)
        cells = [(t, i) for i in range(under.size) for t in range(i + 1, max(under.successors[i], default=i) + 1)]
        for bits in itertools.product((False, True), repeat=len(cells)):
            S = np.zeros((under.size, under.size), dtype=bool)
            for (t, i), bit in zip(cells, bits):
                S[t, i] = bit
            schedule = schedule_from_keep_matrix(under, S, "brute")
            points.add((simulate(under, schedule).peak_bytes, schedule.cost(under), not choice))
    return points


def peak(graph: DFGraph, schedule: Schedule) -> int:
    return simulate(graph, schedule).peak_bytes


@pytest.mark.parametrize("seed", range(8))
def test_brute_force_over_checkpoints_and_implementations_equals_monet(seed):
    """At every budget that some schedule's peak sets, monet's cost is the least of all
    keep matrices under all implementation choices, never above optimal's, and below the
    smallest such peak the budget is infeasible."""
    graph = tiny_graph(seed)
    points = brute_force_points(graph)
    smallest_default = min(p for p, _, default in points if default)
    for budget in sorted({p for p, _, _ in points}):
        best = min(c for p, c, _ in points if p <= budget)
        schedule = solve_monet(graph, budget, threads=1, warm_start=seed % 2 == 0, mip_gap=0.0)
        validate_schedule(graph, schedule)
        assert schedule.cost(graph) == pytest.approx(best)
        assert peak(graph, schedule) <= budget
        assert schedule.facts.status == "optimal" and schedule.facts.objective == pytest.approx(best)
        assert schedule.facts.best_bound <= best * (1 + 1e-9)
        if budget < smallest_default:
            assert schedule.implementations, "only an alternative fits"
            with pytest.raises(InfeasibleBudgetError):
                solve_optimal(graph, budget, threads=1, warm_start=False)
        else:
            assert schedule.cost(graph) <= solve_optimal(graph, budget, threads=1, mip_gap=0.0).cost(graph) + 1e-9
    smallest = min(p for p, _, _ in points)
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_monet(graph, smallest - 1, threads=1, warm_start=False)
    assert info.value.lower_bound_bytes <= smallest


def test_some_budgets_are_feasible_only_with_an_alternative():
    """The tiny graphs above include budgets below every default schedule's peak (the
    case the brute-force test checks against optimal's infeasibility)."""
    assert sum(
        min(p for p, _, _ in points) < min(p for p, _, default in points if default)
        for points in map(brute_force_points, map(tiny_graph, range(8)))
    ) >= 4


def random_case(seed: int) -> DFGraph:
    """A small random training graph with one to three nodes with alternatives."""
    base = random_training_graph(seed, 4 + seed % 3)
    if seed % 2:
        base = with_residuals(base, seed)
    return with_alternatives(base, seed, 1 + seed % 3)


@pytest.mark.parametrize("seed", range(8))
def test_milp_memory_equals_the_simulated_memory_of_its_solution(seed):
    """The exact model's memory while each node runs equals the simulator's for its raw
    solution under its implementations (no pruning), and for the strategy's schedule."""
    graph = random_case(seed)
    low, high = memory_lower_bound(graph, choose_implementations=True), checkpoint_all_peak(graph)
    for budget in (low, (low + high) // 2, high):
        model = build_milp(graph, budget, choose_implementations=True)
        result = solve_model(model, threads=1)
        if result.x is None:
            continue
        R, S = model.decode(result.x)
        schedules = [(Schedule(R, S, "raw", implementations=model.implementations(result.x)), result.x)]
        returned = solve_monet(graph, budget, threads=1)
        schedules.append((returned, model.encode(returned)))
        for schedule, x in schedules:
            validate_schedule(graph, schedule)
            assert x is not None
            simulation = simulate(graph, schedule)
            modelled = assert_milp_memory_is_simulated(model, x, simulation)
            assert max(modelled.values()) == pytest.approx(simulation.peak_bytes) and simulation.peak_bytes <= budget


@pytest.mark.parametrize("seed", range(6))
def test_a_schedule_that_fits_is_a_solution_of_every_relaxation(seed):
    """The stage-end relaxation, with any stages exact, accepts every schedule that fits
    (RINS's and the starts' schedules warm-start it): its columns for the values a node
    reads under some implementations only sit between the FREE columns of exact stages."""
    graph = random_case(seed)
    budget = (memory_lower_bound(graph, choose_implementations=True) + checkpoint_all_peak(graph)) // 2
    schedule = solve_monet(graph, budget, threads=1)
    for exact_stages in ((), range(0, graph.size, 2), range(1, graph.size, 3), None):
        model = build_milp(graph, budget, exact_stages=exact_stages, choose_implementations=True)
        assert model.encode(schedule) is not None, exact_stages
    assert model.resident_keys == () and build_milp(graph, budget, exact_stages=(), choose_implementations=True).resident_keys


@pytest.mark.parametrize("seed", range(6))
def test_monet_never_worse_than_optimal_and_its_warm_starts_encode(seed):
    graph = random_case(seed)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    for budget in (low, (low + high) // 2):
        try:
            optimal = solve_optimal(graph, budget, threads=1, mip_gap=0.0)
        except InfeasibleBudgetError:
            continue
        model = build_milp(graph, budget, choose_implementations=True, exact_stages=())
        assert model.encode(optimal) is not None, "optimal's schedule is a solution of monet's model"
        lean = leanest_implementations(graph)
        keep_all = get_strategy("checkpoint_all")(graph, implementations=lean)
        if peak(graph, keep_all) <= budget:
            assert model.encode(keep_all) is not None
        monet = solve_monet(graph, budget, threads=1, mip_gap=0.0)
        assert monet.cost(graph) <= optimal.cost(graph) + 1e-9
        for start in (lean, cheapest_implementations(graph)):
            try:
                under_start = solve_optimal(graph, budget, threads=1, mip_gap=0.0, implementations=start)
            except InfeasibleBudgetError:
                continue
            assert monet.cost(graph) <= under_start.cost(graph) + 1e-9
        assert peak(graph, monet) <= budget and monet.facts.peak_bytes == peak(graph, monet)
        assert monet.facts.status == "optimal" and monet.facts.objective == pytest.approx(monet.cost(graph))
        assert monet.facts.best_bound <= monet.cost(graph) + 1e-9 and monet.facts.budget_bytes == budget


def test_under_a_time_limit_monet_fits_and_reports_its_bound():
    """With a time limit (half of it for optimal's schedules that start the MILP) the
    schedule fits with a bound over every choice, and below the memory lower bound the
    smallest peak the starts reached explains the infeasible budget."""
    graph = with_alternatives(random_training_graph(5, 12), 5, 4)
    low, high = memory_lower_bound(graph, choose_implementations=True), checkpoint_all_peak(graph)
    budget = (low + high) // 2
    monet = solve_monet(graph, budget, threads=1, time_limit=4)
    assert peak(graph, monet) <= budget and monet.facts.status in ("optimal", "time_limit")
    assert monet.facts.best_bound <= monet.cost(graph) + 1e-9
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_monet(graph, low - 1, threads=1, time_limit=4)
    assert info.value.lower_bound_bytes == low and info.value.min_feasible_bytes >= low


def test_without_alternatives_monet_is_optimal():
    graph = random_training_graph(3, 6)
    budget = (memory_lower_bound(graph) + checkpoint_all_peak(graph)) // 2
    model = build_milp(graph, budget, choose_implementations=True)
    plain = build_milp(graph, budget)
    assert model.num_vars == plain.num_vars and model.num_constraints == plain.num_constraints
    assert np.array_equal(model.value, plain.value) and not model.chooses_implementations
    monet = solve_monet(graph, budget, threads=1, mip_gap=0.0)
    optimal = solve_optimal(graph, budget, threads=1, mip_gap=0.0)
    assert monet.strategy == "monet" and monet.implementations is None
    assert monet.cost(graph) == pytest.approx(optimal.cost(graph))
    assert monet.facts.status == "optimal" and monet.facts.gap == pytest.approx(0.0, abs=1e-9)


def test_no_budget_runs_everything_once_under_the_cheapest_implementations():
    """MASK is dearer and CHEAP cheaper than node 1's default: without a budget monet keeps
    everything under CHEAP, which is below the default's no-remat cost."""
    base = training_graph([(j, j + 1) for j in range(3)], [40] * 4, reads_output=(1, 2))
    cheap = Implementation("cheap", 0, True, True, 0.5, 1.0)
    mask = Implementation("mask", 10, False, False, 1.5, 2.0)
    graph = DFGraph(base.names, base.edges, base.cost, base.output_bytes, base.workspace_bytes, base.is_backward,
                    base.loss_node, dict(base.forward_of), implementations={1: [mask, cheap]})
    schedule = get_strategy("monet")(graph)
    assert dict(schedule.implementations) == {1: "cheap"} and schedule.recompute_count == 0
    assert schedule.cost(graph) == pytest.approx(graph.total_cost - 1.0 - 2.0 + 0.5 + 1.0)
    assert schedule.facts.status == "optimal" and schedule.facts.best_bound == pytest.approx(schedule.cost(graph))


def test_a_chosen_implementation_is_planned_as_given():
    """implementations= fixes the choice (Strategy.__call__ plans the graph under it), and
    the schedule records it."""
    graph = tiny_graph(1)
    choice = {node: modes[1].name for node, modes in implementation_modes(graph).items()}
    under = graph.with_implementations(choice)
    budget = checkpoint_all_peak(under)
    schedule = get_strategy("monet")(graph, budget, implementations=choice, threads=1)
    assert dict(schedule.implementations) == choice and peak(graph, schedule) <= budget


def test_monet_is_a_solver_strategy_listed_after_optimal():
    names = solver_strategy_names()
    assert names[names.index("optimal") + 1] == "monet"
    monet, optimal = get_strategy("monet").options, get_strategy("optimal").options
    assert set(monet) - set(optimal) == {"exclude_implementations"} and set(optimal) <= set(monet)


def test_the_memory_unit_divides_residual_bytes():
    """Output bytes in multiples of 8 and residual parts of odd sizes: the model's unit
    (the bytes' greatest common divisor) divides the parts too, so the smallest peak, not
    a multiple of 8, is feasible (a unit of 8 rounded the budget down to 8s and called
    such budgets infeasible)."""
    base = random_training_graph(39, 2)
    residual = [0] * base.size
    for node, backward in base.backward_of.items():
        if backward in base.successors[node] and len(base.successors[node]) > 1:
            residual[node] = 3
    graph = DFGraph(base.names, base.edges, base.cost, [8 * b for b in base.output_bytes],
                    [8 * b for b in base.workspace_bytes], base.is_backward, base.loss_node, dict(base.forward_of),
                    residual_bytes=residual)
    points = brute_force_points(graph)
    assert any(p % 8 for p, _, _ in points)
    for budget in sorted({p for p, _, _ in points}):
        best = min(c for p, c, _ in points if p <= budget)
        assert build_milp(graph, budget).scale in (1, budget - graph.fixed_bytes)
        for strategy in (solve_optimal, solve_monet):
            assert strategy(graph, budget, threads=1, warm_start=False, mip_gap=0.0).cost(graph) == pytest.approx(best)
