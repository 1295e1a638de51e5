"""Beaumont et al.'s recompute-only chain DP (rotor) against an exhaustive search, its
mapping of training graphs to chains, and the ``rotor`` / ``rotor_ap`` strategies."""

import heapq
import itertools
import math
import random
import time

import numpy as np
import pytest
from graph_factories import random_training_graph, training_graph, with_residuals

from tfremat.errors import ArgumentError, InfeasibleBudgetError
from tfremat.graph import DFGraph
from tfremat.plan import rotor as rotor_module
from tfremat.plan import simulate, validate_schedule
from tfremat.plan.baselines import _units_between, heuristic_deadline
from tfremat.plan.rotor import (
    MAX_TABLE_CELLS,
    ChainOp,
    RotorChain,
    graph_chain,
    keep_everything_sequence,
    run_sequence,
    sequence_keep_matrix,
    solve_chain,
)
from tfremat.plan.schedule import schedule_from_keep_matrix
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.strategies import get_strategy, strategy_names


def random_chain(rng, length, split_overheads=False):
    """Small integer sizes (abar >= a), some zeros, positive costs."""
    a = [rng.randint(0, 4) for _ in range(length)]
    return RotorChain(
        forward_cost=[rng.randint(1, 5) for _ in range(length)],
        backward_cost=[rng.randint(1, 5) for _ in range(length)],
        output_bytes=a,
        stored_bytes=[x + rng.choice([0, 0, rng.randint(1, 4)]) for x in a],
        forward_overhead=[rng.choice([0, 0, rng.randint(1, 5)]) for _ in range(length)],
        backward_overhead=[rng.choice([0, rng.randint(1, 4)]) for _ in range(length)],
        gradient_bytes=[rng.randint(0, 4) for _ in range(length + 1)],
        input_bytes=rng.randint(0, 3),
        forward_all_overhead=[rng.randint(0, 5) for _ in range(length)] if split_overheads else None,
    )


def persistent_optimum(chain, limit, persistent=True):
    """The least time of any sequence of Table 1's operations within ``limit`` bytes, by
    Dijkstra over memory states (None: no sequence fits).

    The DP is optimal among the sequences that keep *memory persistency* (sec. 3.2,
    assumption 2; the appendix B derivations rely on it): with ``persistent`` the search
    covers exactly every such sequence, and no sequence is left out for any other reason.
    A state is what is stored, the next backward, the stages whose ``F_all`` ran and whose
    backward has not, and the activations a forward kept as its input. Moves: any forward
    on a stage up to the next backward whose input (``a`` or ``abar``) is stored, storing
    ``abar`` (F_all), ``a`` keeping its input (F_ck) or ``a`` deleting it (F_no), and the
    next backward; each within the limit while it runs (memory as in :func:`run_sequence`).
    Persistency forbids (appendix B.1 case 1, B.3): an ``F_no`` that deletes an ``abar``
    (``abar^i`` stays until ``B_i``) or an activation a forward kept as its input (a
    sub-chain's stored input stays until its backward), and any operation on a stage below
    i between ``F_all^i`` and ``B_i``. Without ``persistent`` only ``a^0`` is protected.
    """
    padded = chain._padded()
    a, abar, delta = padded["output_bytes"], padded["stored_bytes"], padded["gradient_bytes"]
    of, of_all, ob = padded["forward_overhead"], padded["forward_all_overhead"], padded["backward_overhead"]
    uf, ub = padded["forward_cost"], padded["backward_cost"]
    size = {"a": a, "abar": abar}
    N = chain.length
    start = (frozenset({("a", 0)}), N, frozenset(), frozenset({0}))
    best = {start: 0.0}
    heap, tie = [(0.0, 0, start)], itertools.count(1)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if best[state] != cost:
            continue
        stored, pending, opened, kept = state
        if pending == 0:
            return cost
        memory = sum(size[kind][stage] for kind, stage in stored) + delta[pending]
        if memory > limit:
            continue
        moves = []
        for stage in range(max([1, *opened]) if persistent else 1, pending + 1):
            for source in (("a", stage - 1), ("abar", stage - 1)):
                if source not in stored:
                    continue
                keep = {stage - 1} if source[0] == "a" else set()
                if ("abar", stage) not in stored and memory + abar[stage] + of_all[stage] <= limit:
                    moves.append((uf[stage], stored | {("abar", stage)}, pending, opened | {stage}, kept | keep))
                if ("a", stage) not in stored and memory + a[stage] + of[stage] <= limit:
                    moves.append((uf[stage], stored | {("a", stage)}, pending, opened, kept | keep))
                    protected = source[0] == "abar" or source[1] in kept if persistent else source == ("a", 0)
                    if not protected:
                        moves.append((uf[stage], (stored - {source}) | {("a", stage)}, pending, opened, kept))
        if ("abar", pending) in stored and memory + delta[pending - 1] + ob[pending] <= limit:
            for source in (("a", pending - 1), ("abar", pending - 1)):
                if source in stored:
                    drop = {source} if source[0] == "a" and pending > 1 else set()
                    moves.append((ub[pending], stored - {("abar", pending)} - drop, pending - 1, opened - {pending},
                                  kept - {s for _, s in drop}))
        for step, *new in moves:
            new = (frozenset(new[0]), new[1], frozenset(new[2]), frozenset(new[3]))
            if cost + step < best.get(new, math.inf):
                best[new] = cost + step
                heapq.heappush(heap, (cost + step, next(tie), new))
    return None


CHAINS = 24


def total_bytes(chain):
    return int(sum(chain.stored_bytes) + sum(chain.output_bytes) + sum(chain.gradient_bytes) + chain.input_bytes
               + sum(chain.forward_overhead) + sum(chain.forward_all_overhead) + sum(chain.backward_overhead))


# ----- the DP -----


def test_the_dp_is_the_persistent_optimum_at_every_limit():
    """Tiny random chains (N <= 5), one slot per byte (no rounding): at every limit from
    just below the least feasible one up, the DP's cost is the least of any persistent
    sequence (:func:`persistent_optimum`; infinite exactly when none fits), and the sequence
    it returns costs that under the model and peaks within the limit."""
    rng = random.Random(7)
    checked = 0
    for case in range(CHAINS):
        chain = random_chain(rng, rng.randint(1, 5), split_overheads=case % 3 == 0)
        top = total_bytes(chain) + 1
        table = solve_chain(chain, top, top)
        assert table.min_slots is not None
        for limit in range(max(0, table.min_slots - 2), top + 1, 1 if case % 2 else 3):
            expected = persistent_optimum(chain, limit)
            found = table.cost[limit]
            assert (None if math.isinf(found) else found) == expected, (chain, limit)
            if expected is not None:
                run = run_sequence(chain, table.sequence(limit))
                assert run.cost == found and run.peak_bytes <= limit, (chain, limit)
                checked += 1
    assert checked > 150


def test_every_sequence_of_the_table_keeps_its_limit_and_cost():
    """Many more chains than the exhaustive search can take: at every limit the table
    covers, its sequence costs what the table says and stays within the limit under the
    model (a DP that under-counts an operation's memory returns sequences that overflow)."""
    rng = random.Random(11)
    for case in range(400):
        chain = random_chain(rng, rng.randint(1, 6), split_overheads=case % 3 == 0)
        top = total_bytes(chain) + 1
        table = solve_chain(chain, top, top)
        for limit in np.flatnonzero(np.isfinite(table.cost)):
            run = run_sequence(chain, table.sequence(int(limit)))
            assert run.cost == table.cost[limit] and run.peak_bytes <= limit, (chain, limit)


def test_a_sequence_without_persistency_can_beat_the_dp():
    """The reason for the brute force's restriction (sec. 3.2: persistency holds in practice,
    but not always): here dropping the checkpoint a^2 during the backward and recomputing it
    later costs 35 against the DP's 39 within 18 bytes."""
    chain = RotorChain(forward_cost=[2, 4, 1, 1, 5], backward_cost=[1, 1, 3, 2, 2], output_bytes=[0, 3, 4, 1, 4],
                       stored_bytes=[2, 5, 4, 1, 4], forward_overhead=[0, 0, 1, 0, 2], backward_overhead=[0, 0, 2, 2, 0],
                       gradient_bytes=[0, 2, 3, 3, 3, 4], input_bytes=3)
    assert solve_chain(chain, 18, 18).cost[18] == persistent_optimum(chain, 18) == 39
    assert persistent_optimum(chain, 18, persistent=False) == 35


def test_run_sequence_follows_table_1():
    """By hand: a^0 = 4 stored, delta^2 = 0 held. F_ck^1 peaks at 4 + a^1 2 + o^f 1 = 7;
    F_all^2 at 6 + abar^2 3 = 9; B^2 at 9 + delta^1 1 + o^b 2 = 12 and frees abar^2 and a^1;
    F_all^1 at 4 + 1 + 5 + 1 = 11; B^1 at 10 + delta^0 1 = 11. Keeping everything needs 15
    (B^2 over a^0, abar^1, abar^2); nothing fits in 11."""
    chain = RotorChain(forward_cost=[1, 2], backward_cost=[3, 4], output_bytes=[2, 3], stored_bytes=[5, 3],
                       forward_overhead=[1, 0], backward_overhead=[0, 2], gradient_bytes=[1, 1, 0], input_bytes=4)
    ops = [ChainOp("F_ck", 1), ChainOp("F_all", 2), ChainOp("B", 2), ChainOp("F_all", 1), ChainOp("B", 1)]
    assert run_sequence(chain, ops) == (11, 12)
    assert run_sequence(chain, keep_everything_sequence(2)) == (10, 15)
    table = solve_chain(chain, 15, 15)
    assert table.min_slots == 12 and table.sequence(12) == ops and table.sequence(14) == ops
    assert list(table.cost[11:]) == [math.inf, 11, 11, 11, 10]
    for bad, message in (([ChainOp("F_all", 1), ChainOp("B", 1)], "next backward is B\\^2"),
                         ([ChainOp("F_no", 1)], "would delete the chain's input"),
                         ([ChainOp("F_all", 2)], "input a\\^1 is not stored"),
                         ([ChainOp("F_all", 1), ChainOp("F_ck", 2), ChainOp("B", 2)], "abar\\^2 is not stored"),
                         (keep_everything_sequence(2)[:-1], "ends before B\\^1"),
                         ([("F_some", 1)], "is not one of")):
        with pytest.raises(ArgumentError, match=message):
            run_sequence(chain, bad)


def test_rounding_to_slots_never_lets_a_sequence_overflow():
    """With few slots (sizes rounded up to whole slots) every sequence the table gives for
    m slots peaks within m slots' bytes under the exact model."""
    rng = random.Random(3)
    for case in range(30):
        chain = random_chain(rng, rng.randint(1, 6), split_overheads=case % 2 == 0)
        limit = total_bytes(chain) * rng.uniform(0.4, 1.0) + 0.5
        table = solve_chain(chain, limit, rng.randint(3, 9))
        for slots in np.flatnonzero(np.isfinite(table.cost)):
            run = run_sequence(chain, table.sequence(int(slots)))
            assert run.cost == table.cost[slots]
            assert run.peak_bytes <= slots * table.slot_bytes + 1e-9


# ----- training graphs -----


def test_graph_chain_reads_the_model_off_a_chain():
    """f0 -> f1 -> f2 -> loss; f1's gradient reads f1, f0's reads f0 (it has no input), f2's
    does not read f2. Workspaces: f1 3, f1's gradient 5. Worked by hand from graph_chain's
    rules: delta^1 = 6 (f1's gradient, read by f0's), o^b_1 = 4 (f0's gradient, read by
    nobody, made while B^1 runs), o^b_2 = 6 + 2 + 6 + 5 - (6 + 2 + 6) = 5."""
    g = training_graph([(0, 1), (1, 2)], sizes=[4, 6, 2], costs=[1.0, 2.0, 3.0], reads_output={1},
                       workspace=[0, 3, 0, 0, 0, 5, 0])
    mapped = graph_chain(g)
    chain = mapped.chain
    assert mapped.forward_units == ((0,), (1,), (2,), ())
    assert mapped.backward_units == ((6,), (5,), (4,), (3,))
    assert list(chain.forward_cost) == [1, 2, 3, 0] and list(chain.backward_cost) == [2, 4, 6, 1]
    assert list(chain.output_bytes) == [4, 6, 2, 0] and list(chain.stored_bytes) == [4, 6, 2, 0]
    assert list(chain.gradient_bytes) == [0, 6, 2, 1, 0]
    assert list(chain.forward_overhead) == [0, 3, 0, 0] and list(chain.forward_all_overhead) == [0, 3, 0, 0]
    assert list(chain.backward_overhead) == [4, 5, 0, 0]


def test_graph_chain_counts_residuals_and_units():
    """A node with residual bytes: its checkpoint is the output part, abar adds the residual,
    and F_no holds the residual while the node runs. A fork's gradient reads two gradients.
    rotor_ap's stages are the blocks between articulation points."""
    g = training_graph([(0, 1), (1, 2), (2, 3)], sizes=[4, 10, 3, 2], reads_output={1})
    residual = [0] * g.size
    residual[1] = 7
    g = DFGraph(g.names, g.edges, g.cost, g.output_bytes, g.workspace_bytes, g.is_backward, g.loss_node,
                dict(g.forward_of), g.fixed_bytes, "residual", residual_bytes=residual)
    chain = graph_chain(g).chain
    assert chain.output_bytes[1] == 3 and chain.stored_bytes[1] == 10
    assert chain.forward_overhead[1] == 7 and chain.forward_all_overhead[1] == 0
    # f0 feeds f1 and f2: its gradient reads both of theirs, so delta^1 holds both.
    fork = training_graph([(0, 1), (0, 2), (1, 2)], sizes=[4, 6, 2])
    assert list(graph_chain(fork).chain.gradient_bytes[:3]) == [0, 6 + 2, 2]
    dag = random_training_graph(5, 14, skip_probability=0.5)
    mapped = graph_chain(dag, articulation=True)
    assert [list(u) for u in mapped.forward_units[:-1]] == _units_between(dag, dag.forward_articulation_points)


def chain_graphs(count):
    """Random chain graphs in Table 1's shape; odd seeds have every gradient read its node's
    output (then Table 1 describes the graph exactly), every third carries residual bytes."""
    for seed in range(count):
        rng = random.Random(seed)
        m = rng.randint(2, 8)
        reads = set(range(m)) if seed % 2 else {j for j in range(m) if rng.random() < 0.5}
        g = training_graph([(j, j + 1) for j in range(m - 1)], sizes=[rng.randint(1, 20) for _ in range(m)],
                           costs=[float(rng.randint(1, 9)) for _ in range(m)], reads_output=reads,
                           fixed_bytes=rng.randint(0, 5),
                           workspace=[rng.choice([0, 0, rng.randint(1, 9)]) for _ in range(2 * m + 1)])
        yield seed, (with_residuals(g, seed) if seed % 3 == 0 else g)


def test_on_chain_graphs_the_schedule_runs_the_sequence():
    """On chains the keep matrix realizes the DP's sequence: the simulated peak is at most
    the model's (plus fixed bytes), the simulated cost is the model's where Table 1
    describes the graph exactly, and never more (a gradient that does not read its node's
    output spares recomputing it)."""
    compared = 0
    for seed, g in chain_graphs(24):
        exact = seed % 2 == 1 and seed % 3 != 0
        mapped = graph_chain(g)
        top = int(run_sequence(mapped.chain, keep_everything_sequence(mapped.chain.length)).peak_bytes)
        table = solve_chain(mapped.chain, top, top)
        for slots in range(table.min_slots, top + 1, 2):
            run = run_sequence(mapped.chain, table.sequence(slots))
            schedule = schedule_from_keep_matrix(g, sequence_keep_matrix(g, mapped, table.sequence(slots)), "rotor")
            validate_schedule(g, schedule)
            result = simulate(g, schedule)
            assert result.peak_bytes <= run.peak_bytes + g.fixed_bytes, (seed, slots)
            assert result.cost == pytest.approx(run.cost) if exact else result.cost <= run.cost + 1e-9, (seed, slots)
            compared += 1
    assert compared > 100


def test_keep_everything_sequence_is_checkpoint_all():
    for seed in range(4):
        g = with_residuals(random_training_graph(seed, 9), seed)
        for articulation in (False, True):
            mapped = graph_chain(g, articulation)
            S = sequence_keep_matrix(g, mapped, keep_everything_sequence(mapped.chain.length))
            schedule = schedule_from_keep_matrix(g, S, "rotor")
            assert schedule.recompute_count == 0
            assert simulate(g, schedule).peak_bytes == checkpoint_all_peak(g)


# ----- the strategies -----


def factory_graphs():
    yield training_graph([(j, j + 1) for j in range(15)], sizes=[10] * 16, reads_output=set(range(16)), name="chain16")
    for seed, g in chain_graphs(4):
        yield g
    for seed in range(4):
        yield random_training_graph(seed, 10 + 2 * seed)
        yield with_residuals(random_training_graph(seed + 10, 12), seed)


@pytest.mark.parametrize("name", ["rotor", "rotor_ap"])
def test_the_strategies_fit_their_budget_or_say_how_close_they_came(name):
    """Chains and random DAGs at budgets from 20% to 100% of the checkpoint-all peak: a
    valid schedule within the budget costing at least one pass, or InfeasibleBudgetError
    with a smallest peak above the budget. Without a budget, the lowest peak found."""
    strategy = get_strategy(name)
    fitted = 0
    for g in factory_graphs():
        full = checkpoint_all_peak(g)
        lowest = simulate(g, strategy(g)).peak_bytes
        assert lowest <= full
        for share in (0.2, 0.35, 0.5, 0.65, 0.8, 1.0):
            budget = max(1, int(share * full))
            try:
                schedule = strategy(g, budget)
            except InfeasibleBudgetError as error:
                assert error.min_feasible_bytes > budget, (g.name, share)
                assert budget < lowest or name == "rotor_ap", (g.name, share)
                continue
            validate_schedule(g, schedule)
            result = simulate(g, schedule)
            assert result.peak_bytes <= budget, (g.name, share)
            assert result.cost >= g.total_cost - 1e-9
            fitted += 1
    assert fitted > 30


@pytest.mark.parametrize("name", ["rotor", "rotor_ap"])
def test_a_budget_above_checkpoint_all_recomputes_nothing(name):
    for g in factory_graphs():
        for budget in (checkpoint_all_peak(g), 2 * checkpoint_all_peak(g)):
            schedule = get_strategy(name)(g, budget)
            assert schedule.recompute_count == 0 and schedule.cost(g) == pytest.approx(g.total_cost)
            assert schedule.strategy == name


def test_rotor_trades_memory_for_compute_on_a_chain():
    """A homogeneous chain of 16 layers: the DP fits 30% of the checkpoint-all peak (Chen's
    sqrt(n) does not), and a looser budget costs less."""
    g = training_graph([(j, j + 1) for j in range(15)], sizes=[10] * 16, reads_output=set(range(16)))
    full = checkpoint_all_peak(g)
    tight = simulate(g, get_strategy("rotor")(g, int(0.3 * full)))
    loose = simulate(g, get_strategy("rotor")(g, int(0.8 * full)))
    assert tight.peak_bytes <= 0.3 * full and loose.peak_bytes <= 0.8 * full
    assert g.total_cost < loose.cost < tight.cost
    with pytest.raises(InfeasibleBudgetError):
        get_strategy("chen_sqrtn")(g, int(0.3 * full))


def test_a_graph_without_a_loss_keeps_everything():
    g = DFGraph(names=["a", "b", "c"], edges=[(0, 1), (1, 2), (0, 2)], cost=[1, 2, 3], output_bytes=[5, 6, 7])
    for name in ("rotor", "rotor_ap"):
        schedule = get_strategy(name)(g)
        assert schedule.recompute_count == 0 and schedule.strategy == name
        with pytest.raises(InfeasibleBudgetError):
            get_strategy(name)(g, 5)


def test_the_strategies_stop_at_the_deadline():
    g = random_training_graph(2, 20)
    with heuristic_deadline(time.perf_counter() - 1):
        for name in ("rotor", "rotor_ap"):
            with pytest.raises(InfeasibleBudgetError, match="time limit ran out"):
                get_strategy(name)(g, checkpoint_all_peak(g) // 2)


def test_the_catalogue_lists_them_after_hong_ap():
    names = strategy_names()
    assert names[names.index("hong_ap") + 1 : names.index("hong_ap") + 3] == ["rotor", "rotor_ap"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "500", True])
@pytest.mark.parametrize("name", ["rotor", "rotor_ap"])
def test_bad_memory_slots_raise_argument_errors(name, bad):
    g = random_training_graph(1, 8)
    with pytest.raises(ArgumentError, match="memory_slots must be None or an int >= 1"):
        get_strategy(name)(g, int(0.6 * checkpoint_all_peak(g)), memory_slots=bad)


def test_a_table_too_large_names_memory_slots_and_the_fix():
    g = random_training_graph(1, 40)
    with pytest.raises(ArgumentError, match=r"memory_slots=100000: .* use memory_slots <= \d+, or rotor_ap"):
        get_strategy("rotor")(g, memory_slots=100_000)
    assert MAX_TABLE_CELLS == 2**24


def test_long_chains_get_fewer_slots_by_default(monkeypatch):
    """The default asks for 500 slots, fewer where the table would be too large (down to
    50); below that the chain is too long: an InfeasibleBudgetError with a budget (a
    comparison of every strategy goes on), an ArgumentError without."""
    g = random_training_graph(1, 12)  # 13 stages with the loss: 91 pairs of (i, j)
    budget = int(0.7 * checkpoint_all_peak(g))
    monkeypatch.setattr(rotor_module, "MAX_TABLE_CELLS", 91 * 101)
    assert rotor_module._resolve_slots(None, 13, None, "rotor") == 100
    assert rotor_module._resolve_slots(None, 13, budget, "rotor") == 80  # 100 slots with the headroom
    assert simulate(g, get_strategy("rotor")(g, budget)).peak_bytes <= budget
    with pytest.raises(ArgumentError, match="memory_slots=500: .* use memory_slots <= 80, or rotor_ap"):
        get_strategy("rotor")(g, budget, memory_slots=500)
    monkeypatch.setattr(rotor_module, "MAX_TABLE_CELLS", 91 * 40)
    with pytest.raises(InfeasibleBudgetError, match="a chain of 13 stages is too long .*rotor_ap has fewer stages"):
        get_strategy("rotor")(g, budget)
    with pytest.raises(ArgumentError, match="rotor: a chain of 13 stages is too long"):
        get_strategy("rotor")(g)


def test_bad_chains_and_limits_raise_argument_errors():
    good = {"forward_cost": [1], "backward_cost": [1], "output_bytes": [2], "stored_bytes": [3], "forward_overhead": [0],
            "backward_overhead": [0], "gradient_bytes": [0, 1]}
    chain = RotorChain(**good)
    for field, value, message in (("stored_bytes", [1], "at least output_bytes"),
                                  ("forward_cost", [-1], "finite numbers >= 0"),
                                  ("gradient_bytes", [1], "must have 2 entries"),
                                  ("output_bytes", ["x"], "numbers >= 0")):
        with pytest.raises(ArgumentError, match=message):
            RotorChain(**{**good, field: value})
    with pytest.raises(ArgumentError, match="input_bytes"):
        RotorChain(**good, input_bytes=-1)
    for limit in (0, -5, math.inf, "10"):
        with pytest.raises(ArgumentError, match="memory_limit must be"):
            solve_chain(chain, limit)
    table = solve_chain(chain, 10, 10)
    with pytest.raises(ArgumentError, match="slots must be an int in 0..10"):
        table.sequence(11)
    with pytest.raises(ArgumentError, match="no sequence fits in 2 slots"):
        table.sequence(2)


def test_the_staircase_mask_is_the_full_mask(monkeypatch):
    """solve_chain masks the infeasible splits by slices, one per rise of their memory
    need; on random chains its table (costs and choices) is the one a full mask gives."""
    rng = random.Random(11)
    for case in range(6):
        chain = random_chain(rng, rng.randint(20, 40), split_overheads=case % 2 == 0)
        top = total_bytes(chain)
        sliced = solve_chain(chain, top, top)
        monkeypatch.setattr(rotor_module, "_MASK_STEPS", -1)
        masked = solve_chain(chain, top, top)
        monkeypatch.undo()
        assert np.array_equal(sliced.cost, masked.cost) and np.array_equal(sliced._choice, masked._choice)
        assert np.isfinite(sliced.cost).sum() > 10
