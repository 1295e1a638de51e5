"""Beaumont et al.'s pofo (rematerialization and offloading on a chain) against an
exhaustive search, its at-once replay against rotor's ``run_sequence`` and by hand, and
the recompute-only DP it generalizes."""

import itertools
import math
import random
import statistics
import time

import pytest

import tfremat.plan.pofo as pofo_module
from tfremat.errors import ArgumentError
from tfremat.plan.baselines import _OutOfTime, heuristic_deadline
from tfremat.plan.pofo import (
    MAX_POFO_CELLS,
    OFFLOAD_OPERATIONS,
    _Pofo,
    _prefetched,
    run_offload_sequence,
    solve_pofo,
    solve_pofo_limits,
)
from tfremat.plan.rotor import (
    ChainOp,
    RotorChain,
    keep_everything_sequence,
    run_sequence,
    sequences_at_limits,
    solve_chain,
)


def random_chain(rng, length, floats=False):
    """Small integer sizes and costs (abar >= a), some zeros; with ``floats``, real ones."""
    number = (lambda lo, hi: rng.uniform(lo, hi)) if floats else rng.randint
    a = [number(0, 4) for _ in range(length)]
    return RotorChain(
        forward_cost=[number(1, 5) for _ in range(length)],
        backward_cost=[number(1, 5) for _ in range(length)],
        output_bytes=a,
        stored_bytes=[x + rng.choice([0, 0, number(1, 4)]) for x in a],
        forward_overhead=[rng.choice([0, 0, number(1, 5)]) for _ in range(length)],
        backward_overhead=[rng.choice([0, number(1, 4)]) for _ in range(length)],
        gradient_bytes=[number(0, 4) for _ in range(length + 1)],
        input_bytes=number(0, 3),
        forward_all_overhead=[number(0, 5) for _ in range(length)] if rng.random() < 0.3 else None,
    )


def top_bytes(chain):
    """The peak of keeping everything: the most any limit needs to recompute nothing."""
    return run_sequence(chain, keep_everything_sequence(chain.length)).peak_bytes


def sequential_time(chain):
    return float(sum(chain.forward_cost) + sum(chain.backward_cost))


def fits(run, limit):
    return run.peak_bytes <= limit * (1 + 1e-9)


# ----- the exhaustive search -----


def _read_before_recomputed(ops):
    """Whether every ``F_all``/``F_ck`` result is read (by the next stage or its backward)
    before its stage's forward runs again: a sequence with a wasted forward is dominated."""
    for q, op in enumerate(ops):
        if op.kind not in ("F_all", "F_ck"):
            continue
        for later in ops[q + 1 :]:
            if later.stage == op.stage and later.kind != "B":
                return False
            if later.stage == op.stage + 1 or later == ChainOp("B", op.stage):
                break
        else:
            return False
    return True


def compute_sequences(chain, limit):
    """Every compute sequence within the paper's assumptions (sec. 3.2), no transfers.

    Forward phase: each stage's forward once, in order (``F_all``, ``F_ck``, or ``F_no``
    where it deletes an ``a`` no forward kept; a recomputation before the loss only adds
    time and memory), the loss by ``F_all`` then ``B``. Backward phase: every sequence
    keeping memory persistency (test_rotor's ``persistent_optimum`` rules: no operation
    below i between ``F_all^i`` and ``B_i``, no ``F_no`` deleting an ``abar`` or a kept
    input), minus those with a wasted forward. An operation whose own operands, result and
    gradient exceed ``limit`` is cut (offloading cannot help it)."""
    p = chain._padded()
    N = chain.length
    size = {"a": p["output_bytes"], "abar": p["stored_bytes"]}
    delta, ob = p["gradient_bytes"], p["backward_overhead"]
    out = []

    def source(stored, stage):
        return ("a", stage - 1) if ("a", stage - 1) in stored else ("abar", stage - 1)

    def walk(stored, pending, opened, kept, ops):
        if pending == 0:
            if _read_before_recomputed(ops):
                out.append(ops)
            return
        for stage in range(max([1, *opened]), pending + 1):
            src = source(stored, stage)
            if src not in stored:
                continue
            keep = {stage - 1} if src[0] == "a" else set()
            held = size[src[0]][stage - 1] + delta[pending]
            if ("abar", stage) not in stored and held + size["abar"][stage] + p["forward_all_overhead"][stage] <= limit:
                walk(stored | {("abar", stage)}, pending, opened | {stage}, kept | keep,
                     ops + [ChainOp("F_all", stage)])
            if ("a", stage) not in stored and held + size["a"][stage] + p["forward_overhead"][stage] <= limit:
                walk(stored | {("a", stage)}, pending, opened, kept | keep, ops + [ChainOp("F_ck", stage)])
                if src[0] == "a" and src[1] not in kept:
                    walk((stored - {src}) | {("a", stage)}, pending, opened, kept, ops + [ChainOp("F_no", stage)])
        src = source(stored, pending)
        need = size[src[0]][pending - 1] + size["abar"][pending] + delta[pending] + delta[pending - 1] + ob[pending]
        if ("abar", pending) in stored and src in stored and need <= limit:
            drop = {src} if src[0] == "a" and pending > 1 else set()
            walk(stored - {("abar", pending)} - drop, pending - 1, opened - {pending}, kept - {s for _, s in drop},
                 ops + [ChainOp("B", pending)])

    for kinds in itertools.product(("F_all", "F_ck", "F_no"), repeat=N - 1):
        stored, opened, kept, ops = {("a", 0)}, set(), {0}, []
        for stage, kind in enumerate([*kinds, "F_all"], start=1):
            src = source(stored, stage)
            if kind == "F_no":
                if src[0] != "a" or src[1] in kept:
                    break
                stored.discard(src)
            elif src[0] == "a":
                kept.add(stage - 1)
            stored.add(("abar", stage) if kind == "F_all" else ("a", stage))
            opened |= {stage} if kind == "F_all" else set()
            ops.append(ChainOp(kind, stage))
        else:
            src = source(stored, N)
            drop = {src} if src[0] == "a" and N > 1 else set()
            walk(frozenset(stored - {("abar", N)} - drop), N - 1, frozenset(opened - {N}),
                 frozenset(kept - {s for _, s in drop}), ops + [ChainOp("B", N)])
    return out


def with_transfers(chain, ops, free_prefetches):
    """``ops`` with every subset of offloads, each right after the forward that made the
    value (``O^1`` first), and each offloaded value's prefetch once after the loss's forward:
    anywhere up to its first reader, in any order (``free_prefetches``), or just before it.
    That last placement loses nothing when transfers are free (a prefetch then holds memory
    the least) or when the optimum moves nothing."""
    N = chain.length
    loss = next(q for q, op in enumerate(ops) if op.stage == N)
    candidates = [(0, 1)] + [(q + 1, op.stage + 1) for q, op in enumerate(ops[:loss])]
    for count in range(len(candidates) + 1):
        for chosen in itertools.combinations(candidates, count):
            base = list(ops)
            for q, stage in sorted(chosen, reverse=True):
                base.insert(q, ChainOp("O", stage))
            loss_at = loss + count
            stages = [stage for _, stage in chosen]
            spans = []
            for stage in stages:
                first = next(q for q in range(loss_at + 1, len(base)) if base[q].stage == stage and base[q].kind != "O")
                spans.append(range(loss_at + 1, first + 1) if free_prefetches else [first])
            for positions in itertools.product(*spans):
                order = sorted(range(len(stages)), key=lambda k: positions[k])
                groups = [list(g) for _, g in itertools.groupby(order, key=lambda k: positions[k])]
                for arrangement in itertools.product(*(itertools.permutations(g) for g in groups)):
                    sequence = list(base)
                    for k in reversed([k for group in arrangement for k in group]):
                        sequence.insert(positions[k], ChainOp("P", stages[k]))
                    yield sequence


def brute_force(chain, limit, bandwidth, free_prefetches):
    """The least replayed makespan (:func:`run_offload_sequence` waiting within ``limit``)
    over :func:`compute_sequences` with :func:`with_transfers`; None when none fits."""
    best = None
    for ops in compute_sequences(chain, limit):
        for sequence in with_transfers(chain, ops, free_prefetches):
            try:
                run = run_offload_sequence(chain, sequence, bandwidth, limit)
            except ArgumentError:  # an offloaded value read again before the loss
                continue
            if fits(run, limit) and (best is None or run.makespan < best):
                best = run.makespan
    return best


def tiny_cases(seed, count, longest, shortest=2):
    """(chain, limit) pairs: chains of ``shortest``..``longest`` stages (the loss included),
    limits from a third of the keep-everything peak up, in bytes (one slot per byte)."""
    rng = random.Random(seed)
    for _ in range(count):
        chain = random_chain(rng, rng.randint(shortest, longest))
        top = int(top_bytes(chain))
        for limit in range(max(1, top // 3), top + 1, 2):
            yield chain, limit


def test_free_transfers_reach_the_exhaustive_optimum():
    """Infinite bandwidth: transfers take no time, the DP's model and the replay agree
    (no idle), and pofo's replayed makespan is the exhaustive optimum at every limit; None
    exactly when nothing fits. It also equals the DP's duration. Chains of 2 and 3 stages
    and one of 4 (the loss included); most limits checked need offloads to beat rotor."""
    checked = 0
    for chain, limit in itertools.chain(tiny_cases(1, 40, 3), tiny_cases(8, 1, 4, shortest=4)):
        expected = brute_force(chain, limit, math.inf, free_prefetches=False)
        solution = solve_pofo(chain, limit, math.inf, limit)
        if expected is None:
            assert solution is None, (chain, limit)
            continue
        assert solution.run.makespan == expected == solution.duration, (chain, limit)
        assert fits(solution.run, limit) and solution.run.idle == 0
        checked += 1
    assert checked > 60


def test_an_unusable_link_leaves_the_recompute_only_optimum():
    """A bandwidth of 1e-6 bytes per unit: wherever rotor fits, moving any byte costs more
    than recomputing everything, so pofo, the exhaustive search and rotor agree. (Where
    rotor does not fit, offloading still does, in a huge time.)"""
    checked = 0
    for chain, limit in tiny_cases(3, 40, 3):
        rotor_cost = solve_chain(chain, limit, limit).cost[limit]
        if math.isinf(rotor_cost):
            continue
        solution = solve_pofo(chain, limit, 1e-6, limit)
        assert solution.run.makespan == rotor_cost == brute_force(chain, limit, 1e-6, free_prefetches=False)
        assert fits(solution.run, limit)
        checked += 1
    assert checked > 35
    rng = random.Random(6)
    for _ in range(20):  # real sizes in 50 slots: rotor's optimum at the same slots
        chain = random_chain(rng, rng.randint(2, 7), floats=True)
        limit = top_bytes(chain) * rng.uniform(0.7, 1.0)
        rotor_cost = solve_chain(chain, limit, 50).cost[50]
        if math.isfinite(rotor_cost):
            solution = solve_pofo(chain, limit, 1e-9)
            assert solution.run.makespan == pytest.approx(rotor_cost, rel=1e-12) and fits(solution.run, limit)


@pytest.mark.parametrize("bandwidth", [0.5, 2.0])
def test_a_finite_link_is_never_worse_than_recomputing(bandwidth):
    """At a finite bandwidth the DP optimizes continuous transfers (sec. 3.2, assumption 3)
    and the replay runs them at once, so pofo is checked between bounds: never below the
    exhaustive optimum over every prefetch placement (it is one of those sequences), never
    above the best recompute-only sequence (rotor's optimum), and equal to the exhaustive
    optimum on most cases."""
    checked = equal = 0
    for chain, limit in tiny_cases(4, 18, 3):
        expected = brute_force(chain, limit, bandwidth, free_prefetches=True)
        solution = solve_pofo(chain, limit, bandwidth, limit)
        if expected is None:
            assert solution is None
            continue
        rotor_cost = solve_chain(chain, limit, limit).cost[limit]
        assert expected <= solution.run.makespan <= rotor_cost, (chain, limit)
        assert fits(solution.run, limit)
        checked += 1
        equal += solution.run.makespan == expected
    assert checked > 30 and equal >= 0.9 * checked


# ----- every sequence pofo returns -----


def check_solution(chain, limit, bandwidth, solution):
    """A valid sequence under the paper's assumptions: offloads before the loss, prefetches
    after it, each at most once, one prefetch per offload; it replays to ``solution.run``
    within the limit, at least the sequential time, at most rotor's optimum."""
    ops = solution.ops
    loss = ops.index(ChainOp("F_all", chain.length))
    offloaded = [op.stage for op in ops[:loss] if op.kind == "O"]
    assert all(op.kind != "O" for op in ops[loss:]) and all(op.kind != "P" for op in ops[:loss])
    assert sorted(offloaded) == sorted(op.stage for op in ops if op.kind == "P") == sorted(set(offloaded))
    run = run_offload_sequence(chain, ops, bandwidth, limit)
    assert run == solution.run and fits(run, limit)
    assert run.makespan >= sequential_time(chain) - 1e-9
    rotor = solve_chain(chain, limit, 50)
    assert run.makespan <= rotor.cost[50] * (1 + 1e-12)


def test_every_returned_sequence_is_valid_on_random_chains():
    """Many random chains (integer and real sizes, 50 slots so sizes round up) at several
    limits and bandwidths: a solution whenever rotor has one, and every one valid."""
    rng = random.Random(11)
    solved = offloading = 0
    for case in range(40):
        chain = random_chain(rng, rng.randint(1, 7), floats=case % 2 == 1)
        top = top_bytes(chain)
        for share in (0.5, 0.7, 0.85, 1.0):
            limit = top * share + 0.5
            for bandwidth in (1e-3, 0.5, 4.0, math.inf):
                solution = solve_pofo(chain, limit, bandwidth)
                if solution is None:
                    assert math.isinf(solve_chain(chain, limit, 50).cost[50])
                    continue
                check_solution(chain, limit, bandwidth, solution)
                solved += 1
                offloading += any(op.kind == "O" for op in solution.ops)
    assert solved > 250 and offloading > 100


def test_the_dp_duration_against_the_replay():
    """How the DP's duration compares to the at-once replay of its own sequence (before
    :func:`solve_pofo` compares it with rotor's). The replay can be slower: an offload frees
    its bytes at its end, not as it goes, and prefetches hold theirs from their start. It can
    be faster: the DP rounds each pending transfer up to whole slots (here a slot is a byte,
    a few time units at these bandwidths) and adds Lemma 1's idle times of consecutive
    steps separately. Measured on these 591 cases: median 1, all within [0.83, 1.21] (and
    [0.82, 1.34] on 7,000 more); the bounds below leave a margin."""
    ratios = []
    for chain, limit in tiny_cases(5, 60, 6):
        for bandwidth in (0.3, 1.0, 3.0):
            dp = _Pofo(chain, limit, bandwidth, limit)
            if math.isfinite(dp.duration):
                ops, run = _prefetched(chain, dp.sequence(), bandwidth, limit)
                ratios.append(run.makespan / dp.duration)
    assert len(ratios) > 500
    assert statistics.median(ratios) == 1.0
    assert 0.75 <= min(ratios) and max(ratios) <= 1.5


def test_the_dp_is_monotone_in_the_bandwidth():
    """A faster link never lengthens the DP's duration (its idle times shrink and pending
    transfers drain faster), which stays between the sequential time and rotor's optimum
    at the same slots (the same recurrence without transfers)."""
    rng = random.Random(21)
    for case in range(40):
        chain = random_chain(rng, rng.randint(2, 7), floats=case % 2 == 1)
        for share in (0.5, 0.8):
            limit = top_bytes(chain) * share + 0.5
            rotor_cost = solve_chain(chain, limit, 30).cost[30]
            durations = [_Pofo(chain, limit, bandwidth, 30).duration for bandwidth in (1e-6, 0.3, 1, 3, 30, math.inf)]
            assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(durations, durations[1:]))
            assert durations[0] <= rotor_cost * (1 + 1e-12)
            assert math.isinf(durations[-1]) or durations[-1] >= sequential_time(chain) - 1e-9


def test_a_fast_link_reaches_the_sequential_time_where_rotor_cannot():
    """A homogeneous chain at half the memory of keeping everything: rotor recomputes, while
    pofo offloads and runs in the sequential time (exactly with free transfers, within the
    transfer times with a fast link)."""
    length = 8
    chain = RotorChain(forward_cost=[1] * length, backward_cost=[2] * length, output_bytes=[2] * length,
                       stored_bytes=[3] * length, forward_overhead=[1] * length, backward_overhead=[1] * length,
                       gradient_bytes=[2] * (length + 1), input_bytes=2)
    limit = top_bytes(chain) / 2
    sequential = sequential_time(chain)
    assert solve_chain(chain, limit, 50).cost[50] > sequential + 2
    free = solve_pofo(chain, limit, math.inf)
    assert free.run.makespan == free.duration == sequential and fits(free.run, limit)
    fast = solve_pofo(chain, limit, 1e6)
    assert fast.run.makespan == pytest.approx(sequential, abs=1e-3) and fits(fast.run, limit)
    assert any(op.kind == "O" for op in fast.ops)


def test_thirty_stages_at_fifty_slots_are_solved():
    """The size the brief asks for: O(N^2 S^3) in numpy, about 0.5 s here for 30 stages
    (2.4 s for 60; benchmarks/offload_speed.py times whole graphs)."""
    rng = random.Random(30)
    chain = random_chain(rng, 30, floats=True)
    solution = solve_pofo(chain, top_bytes(chain) * 0.3, top_bytes(chain) / sequential_time(chain))
    check_solution(chain, top_bytes(chain) * 0.3, top_bytes(chain) / sequential_time(chain), solution)


# ----- the replay -----


def test_the_replay_is_run_sequence_without_transfers():
    """Rotor's sequences (integer and real sizes) replay to their cost and peak exactly,
    without idle, whatever the bandwidth and with or without a limit."""
    rng = random.Random(13)
    for case in range(60):
        chain = random_chain(rng, rng.randint(1, 6), floats=case % 2 == 1)
        top = top_bytes(chain)
        table = solve_chain(chain, 2 * top, 40)
        for slots in {table.min_slots, (table.min_slots + 40) // 2, 40}:
            ops = table.sequence(slots)
            cost, peak = run_sequence(chain, ops)
            for bandwidth, limit in ((1.0, None), (math.inf, top), (0.01, peak)):
                run = run_offload_sequence(chain, ops, bandwidth, limit)
                assert (run.makespan, run.peak_bytes, run.idle) == (cost, peak, 0.0)
                assert run.offloaded_bytes == run.prefetched_bytes == 0


def hand_chain():
    """a^0 = 2; stage 1: a^1 = 2, abar^1 = 4; stage 2: a^2 = 1, abar^2 = 3; the loss:
    abar^3 = 1. Forwards take 2, 2, 1, backwards 3, 3, 1; no gradients, no overheads."""
    return RotorChain(forward_cost=[2, 2, 1], backward_cost=[3, 3, 1], output_bytes=[2, 1, 0], stored_bytes=[4, 3, 1],
                      forward_overhead=[0, 0, 0], backward_overhead=[0, 0, 0], gradient_bytes=[0, 0, 0, 0],
                      input_bytes=2)


HAND_OPS = [ChainOp(*op) for op in (("O", 1), ("F_all", 1), ("O", 2), ("F_all", 2), ("F_all", 3), ("B", 3),
                                    ("P", 2), ("B", 2), ("P", 1), ("B", 1))]


def test_the_replay_by_hand():
    """One byte per unit of time. O^1 moves a^0 over [0, 2] while F_all^1 ([0, 2], peak
    2 + 4) reads it; O^2 moves abar^1 over [2, 6] while F_all^2 ([2, 4], 4 + 3 once a^0 has
    gone) reads it, so it stays until 6; F_all^3 [4, 5] peaks at 3 + 3 + 1 + 1 = 8; B^3
    [5, 6]. P^2 brings abar^1 over [6, 10] (its 4 bytes count from 6), B^2 waits until 10
    and runs to 13; P^1 over [13, 15], B^1 waits and runs to 18: idle 4 + 2.

    With a limit of 7, F_all^3 (8 at 4) waits for abar^1's release at 6 (idle 2) and
    everything after shifts by 2: B^2 [12, 15], P^1 [15, 17], B^1 [17, 20]."""
    chain = hand_chain()
    assert run_offload_sequence(chain, HAND_OPS, 1.0) == (18, 8, 6, 6, 6)
    assert run_offload_sequence(chain, HAND_OPS, 1.0, memory_limit=7) == (20, 7, 8, 6, 6)
    # Without any release to wait for, an operation that does not fit runs anyway.
    assert run_offload_sequence(chain, HAND_OPS, 1.0, memory_limit=6).peak_bytes == 7
    # Free transfers: no idle, each value gone right after its reader; the peak is F_all^2's.
    assert run_offload_sequence(chain, HAND_OPS, math.inf) == (12, 7, 0, 6, 6)


def test_invalid_sequences_name_the_position_and_the_rule():
    chain = hand_chain()

    def sequence(*names):
        return [ChainOp(name.split("^")[0], int(name.split("^")[1])) for name in names]

    for bad, message in (
        (sequence("O^1", "O^1"), r"operation 1 \(O\^1\): no input of stage 1 .* on the device"),
        (sequence("F_all^1", "P^2"), r"operation 1 \(P\^2\): no input of stage 2 is on the host"),
        (sequence("O^1", "F_ck^1", "F_all^1"), r"operation 2 \(F_all\^1\): its input a\^0 is on the host"),
        (sequence("O^1", "F_all^1", "F_all^2", "F_all^3", "B^3", "B^2", "B^1"), r"operation 6 .* a\^0 is on the host"),
        (sequence("F_ck^1", "O^2", "F_all^2", "F_all^3", "B^3", "F_ck^1"), r"operation 5 .*a\^1 is on the host: "
                                                                              "prefetch it instead of recomputing"),
        (sequence("F_all^1", "O^2", "F_all^2", "F_all^3", "B^3", "B^2"), r"operation 5 .* abar\^1 is on the host"),
        (sequence("F_all^1", "F_all^2", "F_all^3", "B^3", "B^1"), r"the next backward is B\^2"),
        (sequence("F_all^1", "F_all^2"), r"ends before B\^1"),
        ([("F_some", 1)], "is not one of"),
        ([ChainOp("O", 4)], r"on a stage 1\.\.3"),
    ):
        with pytest.raises(ArgumentError, match=message):
            run_offload_sequence(chain, bad, 1.0)
    assert OFFLOAD_OPERATIONS == ("F_all", "F_ck", "F_no", "B", "O", "P")


# ----- arguments, limits, deadline -----


def test_bad_arguments_name_the_argument():
    chain = hand_chain()
    for bandwidth in (0, -1.0, math.nan, "fast", True, -math.inf):
        with pytest.raises(ArgumentError, match="bandwidth must be"):
            solve_pofo(chain, 10, bandwidth)
        with pytest.raises(ArgumentError, match="bandwidth must be"):
            run_offload_sequence(chain, HAND_OPS, bandwidth)
    for limit in (0, -5, math.inf, "10", None):
        with pytest.raises(ArgumentError, match="memory_limit must be a finite number"):
            solve_pofo(chain, limit, 1.0)
    with pytest.raises(ArgumentError, match="memory_limit must be a finite number"):
        run_offload_sequence(chain, HAND_OPS, 1.0, memory_limit=0)
    for slots in (0, 2.5, "50", True):
        with pytest.raises(ArgumentError, match="memory_slots must be an int >= 1"):
            solve_pofo(chain, 10, 1.0, slots)
    with pytest.raises(ArgumentError, match=r"memory_slots=400: .* more than \d+: use memory_slots <= \d+"):
        solve_pofo(chain, 10, 1.0, 400)
    assert MAX_POFO_CELLS == 2**26


def test_nothing_fits_and_a_single_stage():
    chain = hand_chain()
    assert solve_pofo(chain, 3, math.inf) is None  # F_all^1 alone needs 2 + 4
    loss_only = RotorChain(forward_cost=[1], backward_cost=[2], output_bytes=[0], stored_bytes=[1],
                           forward_overhead=[0], backward_overhead=[0], gradient_bytes=[0, 0], input_bytes=1)
    solution = solve_pofo(loss_only, 2, 1.0)
    assert solution.ops == [ChainOp("F_all", 1), ChainOp("B", 1)] and solution.run.makespan == solution.duration == 3


def test_the_dp_stops_at_the_deadline():
    chain = random_chain(random.Random(2), 6)
    with heuristic_deadline(time.perf_counter() - 1):
        with pytest.raises(_OutOfTime):
            solve_pofo(chain, top_bytes(chain) / 2, 1.0)


# ----- one table for several limits -----


def test_one_table_answers_every_smaller_limit_as_its_own_solve():
    """The DP over S slots read at A = S - c is the DP solved at c slots of the same size:
    the same duration and sequence (slots of one byte keep both discretizations exact)."""
    rng = random.Random(11)
    for trial in range(12):
        chain = random_chain(rng, rng.randint(2, 6))
        top = int(top_bytes(chain)) + 2
        bandwidth = rng.choice([0.3, 1.0, 4.0, math.inf])
        shared = _Pofo(chain, top, bandwidth, top)
        for count in range(1, top + 1):
            alone = _Pofo(chain, count, bandwidth, count)
            assert shared.duration_at(count) == alone.duration, (trial, count)
            if math.isfinite(alone.duration):
                assert shared.sequence(count) == alone.sequence(), (trial, count)


def test_the_forward_blocks_give_the_table_of_one_block(monkeypatch):
    """The forward phase's A ranges (_Pofo._blocks) change which cells it evaluates, not
    what any limit's optimum is: the same durations and sequences as one range."""
    rng = random.Random(17)
    cases = []
    for trial in range(10):
        chain = random_chain(rng, rng.randint(3, 7), floats=trial % 2 == 1)
        top = int(top_bytes(chain)) + 3
        cases.append((chain, top, rng.choice([0.3, 1.0, 4.0, math.inf])))
    blocked = [_Pofo(chain, top, bandwidth, top) for chain, top, bandwidth in cases]
    monkeypatch.setattr(pofo_module, "_FORWARD_BLOCKS", 1)
    for (chain, top, bandwidth), dp in zip(cases, blocked):
        whole = _Pofo(chain, top, bandwidth, top)
        for count in range(1, top + 1):
            assert dp.duration_at(count) == whole.duration_at(count), (chain, count)
            if math.isfinite(whole.duration_at(count)):
                assert dp.sequence(count) == whole.sequence(count), (chain, count)
    assert any(op.kind == "O" for dp in blocked for count in range(1, dp.S + 1)
               if math.isfinite(dp.duration_at(count)) for op in dp.sequence(count))


def test_solve_pofo_limits_equals_solve_pofo_per_limit():
    rng = random.Random(5)
    for trial in range(6):
        chain = random_chain(rng, rng.randint(3, 6))
        slots = int(top_bytes(chain))
        counts = [slots, max(1, slots - 3), slots + 4]
        together = solve_pofo_limits(chain, slots, 1.0, counts, slots)
        for count, solution in zip(counts, together):
            alone = solve_pofo(chain, count, 1.0, count)
            assert (solution is None) == (alone is None), (trial, count)
            if alone is not None:
                assert solution.ops == alone.ops and solution.run == alone.run, (trial, count)
    with pytest.raises(ArgumentError, match="slot_counts must be ints >= 1"):
        solve_pofo_limits(chain, 10, 1.0, [0], 10)


def test_rotor_sequences_at_limits_are_each_limits_own_optimum():
    """One rotor table read at several limits gives each limit's own solve at the same slot
    size (one byte), and None where nothing fits."""
    rng = random.Random(3)
    for trial in range(10):
        chain = random_chain(rng, rng.randint(2, 7))
        top = int(top_bytes(chain)) + 1
        limits = list(range(1, top + 1))
        for limit, ops in zip(limits, sequences_at_limits(chain, limits, top)):
            alone = solve_chain(chain, limit, limit)
            if not math.isfinite(alone.cost[limit]):
                assert ops is None, (trial, limit)
                continue
            assert ops == alone.sequence(), (trial, limit)
            assert run_sequence(chain, ops).peak_bytes <= limit
    with pytest.raises(ArgumentError, match="limits must hold a number of bytes > 0"):
        sequences_at_limits(chain, [0, -1])


# solve_pofo_limits's answers on integer chains (seeds 200..203, 14 stages, half the
# keep-everything peak in 20 slots, read at 16, 20 and 24 slots), recorded before the
# C_Delta table was evaluated only where A + Delta <= S: (DP duration, replayed makespan,
# sha1 of the sequence as _sequence_text writes it).
RECORDED_LIMITS = {
    0: [(86.0, 88.7, '50a8ae35392d'), (81.925, 80.0, '1c824b85f5fb'), (78.0, 78.0, '281882655d9b')],
    1: [(124.0, 124.0, 'a88f1b0fe9b9'), (106.0, 106.0, '722e80867927'), (101.0, 101.0, 'af91182ce4a8')],
    2: [(128.0, 128.0, 'ea2213543abb'), (114.0, 114.0, 'e26530d779a8'), (107.0, 107.0, '3c24ba0ce391')],
    3: [(142.0, 142.0, '26a4d70e9b12'), (121.0, 121.0, '7596c9219149'), (114.0, 114.0, '1b2c15d84bc0')],
}


def _sequence_text(ops):
    return "".join(f"{kind[0]}{'a' if kind == 'F_all' else ''}{stage}" for kind, stage in ops)


def test_solve_pofo_limits_gives_the_recorded_answers():
    import hashlib

    for seed, expected in RECORDED_LIMITS.items():
        rng = random.Random(200 + seed)
        chain = random_chain(rng, 14)
        bandwidth = top_bytes(chain) / sequential_time(chain) / (1 + seed)
        solutions = solve_pofo_limits(chain, top_bytes(chain) // 2, bandwidth, [16, 20, 24], 20)
        found = [None if s is None else (round(s.duration, 9), round(s.run.makespan, 9),
                                         hashlib.sha1(_sequence_text(s.ops).encode()).hexdigest()[:12])
                 for s in solutions]
        assert found == expected, seed
    assert any(op.kind == "O" for s in solutions if s is not None for op in s.ops)
