"""Beaumont et al.'s pofo: the optimal mix of rematerialization and offloading on a chain.

Beaumont, Eyraud-Dubois and Shilova, "Efficient Combination of Rematerialization and
Offloading for Training DNNs" (NeurIPS 2021, ``shared/papers/004_970af3ac90aaba55.txt``).
The chain, its operations and the recompute-only DP are :mod:`tfremat.plan.rotor`'s; this
module adds the host link (sec. 3.1: ``O_l`` and ``P_l`` move the stored input of stage l,
``a^{l-1}`` or ``abar^{l-1}``) under the assumptions of sec. 3.2: offloads only before the
loss, each prefetch once after it, memory persistency, continuous transfers in the DP.

**Forward phase** (appendix B.1). ``OC_x(i, A, Delta_F, Delta_B)`` is the least time from
``F_i`` to ``B_i`` when the input ``I_i^x`` (``a^{i-1}`` for x = 0, ``abar^{i-1}`` for x = 1)
is stored, A bytes of earlier activations stay on the device, ``Delta_F`` bytes are still
to offload and ``Delta_B`` are to prefetch before ``B_{i-1}`` (sec. 4.2). Eq. 1 takes the
better of ``F_all^i`` (then ``OC_1(i+1)`` and ``B_i``) and ``F_ck^i F_no^{i+1} .. F_no^j``
(then ``OC_0(j+1)`` and the sub-chain i..j by ``C_Delta``), each with v = 1 (offload
``I_i``, an ``O_i`` right before ``F^i``) or v = 2 (keep it); Table 2 gives the next state.
The idle times ``epsilon^F``, ``epsilon^B`` are Lemma 1's. **Loss** (B.2): ``F_all`` and
``B`` of the last stage, with ``epsilon^G = (Delta_F + Delta_B) / beta`` between them.
**Backward phase** (B.3): ``C_Delta(i, j, A, Delta)`` (Eq. 2) is rotor's recurrence where
A includes the input and Delta bytes must arrive by the end; its idle times come from
Lemma 1 with the ``Delta_1 .. Delta_3`` of B.3. With ``beta -> inf`` every idle time is 0,
with no offload every Delta stays 0: both leave rotor's recurrence.

**Readings of the appendix** (an OCR'd copy). The gradient held in the forward phase is the
loss stage's ``delta^N`` (the paper's ``M^{i,L}``, with the loss as layer L + 1).
``M_GPU`` counts ``a^0``: it is ``I_1`` in ``OC_0(1, 0, 0, 0)``, as rotor's limit does. The
garbled validity tests of case 1 are read ``M_{F_all^i} + I_i <= M_GPU - A_i`` and
``M_{B_i} + I_i <= M_GPU - A_i``; case 2's as printed (``F_ck^i`` needs ``I_i``, and so do
the ``F_no^k`` unless ``I_i`` is offloaded). B.3's case-2 test "for some k, i <= k < j"
is applied to the forwards that run, k = i .. i', as rotor does. Lemma 1 needs
``m_min >= 0``: a state whose pending transfers do not fit beside what it stores
(``A + I + max(Delta_F, Delta_B) > M_GPU``, ``A + Delta > M_GPU`` in ``C_Delta``) is
infeasible. Memory is ``memory_slots`` slots of ``memory_limit / memory_slots`` bytes,
sizes rounded up (rotor's ``_slots``); a Delta that indexes a state is rounded up to whole
slots after each transfer, the ones only used in an idle time are not. ``F_all`` uses the
chain's own ``forward_all_overhead``, as rotor does.

**At once** (sec. 3.2: the experiments run each transfer at once). The DP knows how many
bytes are in flight, not which, so the prefetches of its sequence are placed afterwards:
each just before its first reader after the loss (where the DP's memory tests hold), then
each moved as early as :func:`run_offload_sequence` keeps the peak within the limit. The
returned sequence is the best replayed of that and rotor's optimum at the same slots (which
the DP contains), so pofo never executes slower than recompute-only. Not implemented: a DP
over at-once transfers; the prefetch placement is a greedy, not part of the optimum.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tfremat.errors import ArgumentError, is_int, is_number
from tfremat.plan.baselines import _OutOfTime, time_is_up
from tfremat.plan.rotor import OPERATIONS, ChainOp, RotorChain, _slots, solve_chain

__all__ = [
    "OFFLOAD_OPERATIONS",
    "MAX_POFO_CELLS",
    "OffloadRun",
    "PofoSolution",
    "run_offload_sequence",
    "solve_pofo",
    "solve_pofo_limits",
]

# Table 1's operations, then offload and prefetch of a stage's input (sec. 3.1).
OFFLOAD_OPERATIONS = OPERATIONS + ("O", "P")
# The forward tables hold N x 2 x (slots + 2)^3 costs (float64) and choices (int16):
# 2**26 cells are 671 MB. 92 stages (MobileNet) at 62 slots take 48.2 M.
MAX_POFO_CELLS = 1 << 26
# The forward phase cuts the A axis of its state grid into this many ranges (_Pofo._blocks):
# the fastest of 1, 2, 4, 6 and 8 on MobileNet (benchmarks/offload_speed.py).
_FORWARD_BLOCKS = 4
# A transfer amount within this many slots of a whole number is that number (float noise).
_EPS = 1e-9
# Memory levels compare to a limit within this relative tolerance (float sums of sizes).
_TOLERANCE = 1e-9
# Event kinds of the replay, in the order they apply at one instant: frees first.
_RELEASE, _ALLOCATE = 0, 1


class OffloadRun(NamedTuple):
    """What a sequence costs under :func:`run_offload_sequence` (bytes, and units of the
    chain's costs)."""

    makespan: float
    peak_bytes: float
    idle: float
    offloaded_bytes: float
    prefetched_bytes: float


class PofoSolution(NamedTuple):
    """:func:`solve_pofo`'s answer: the sequence (``O`` and ``P`` included), its duration in
    the DP's model (continuous transfers, appendix B) and its replay at once."""

    ops: list[ChainOp]
    duration: float
    run: OffloadRun


def _check_bandwidth(bandwidth) -> None:
    if not is_number(bandwidth) or math.isnan(bandwidth) or bandwidth <= 0:
        raise ArgumentError(f"bandwidth must be bytes per unit of the chain's cost, a number > 0 (math.inf: "
                            f"transfers take no time), got {bandwidth!r}")


def _check_limit(memory_limit) -> None:
    if not is_number(memory_limit) or not math.isfinite(memory_limit) or memory_limit <= 0:
        raise ArgumentError(f"memory_limit must be a finite number of bytes > 0, got {memory_limit!r}")


def _fits(level: float, limit: float) -> bool:
    return level <= limit * (1 + _TOLERANCE)


def _name(value) -> str:
    return f"{value[0]}^{value[1]}"


def _missing(where: str, value, what: str, host: set) -> ArgumentError:
    if value in host:
        return ArgumentError(f"{where}: {what} {_name(value)} is on the host: prefetch it first")
    return ArgumentError(f"{where}: {what} {_name(value)} is not stored")


def run_offload_sequence(chain: RotorChain, ops: Sequence[ChainOp], bandwidth: float,
                         memory_limit: float | None = None) -> OffloadRun:
    """Replays ``ops`` (kinds :data:`OFFLOAD_OPERATIONS`) with each transfer done at once.

    Compute operations run one after another, with :func:`~tfremat.plan.rotor.run_sequence`'s
    semantics and memory: the stored activations (``a^0`` included) and the held gradient,
    plus an operation's result and overhead while it runs. Transfers run one after another
    on one link at ``bandwidth`` bytes per unit of cost, each issued when the compute
    operation before it in ``ops`` has ended, started when the link is free. ``O^l`` moves
    the input of stage l (``a^{l-1}`` if stored, else ``abar^{l-1}``) to the host: its
    device bytes are freed at the transfer's end, or at the end of the next compute
    operation if that one reads the value (the one reader it may have before a ``P^l``).
    ``P^l`` brings it back: its bytes count from the transfer's start, its readers wait for
    the end (idle time). Memory is tracked through time, so a prefetch that starts while an
    operation runs adds to that operation's peak. With ``memory_limit``, an operation that
    does not fit waits for in-flight offloads until it does (and does not wait when no
    release would make it fit); without, nothing waits. ``makespan`` is the end of the last
    operation of either kind; ``idle`` the time computing waited. Without ``O``/``P`` it is
    ``run_sequence``: makespan its cost, the same peak, no idle.

    Raises:
        ArgumentError: a bad ``bandwidth``/``memory_limit``, an unknown operation, an operand
            not on the device (on the host: prefetch it first), ``O`` of a value not on the
            device, ``P`` of one not on the host, recomputing a value that is on the host,
            or what ``run_sequence`` rejects; each names the position.
    """
    _check_bandwidth(bandwidth)
    if memory_limit is not None:
        _check_limit(memory_limit)
    p = chain._padded()
    N = chain.length
    sizes = {"a": p["output_bytes"], "abar": p["stored_bytes"]}
    counted = {("a", 0)}  # values whose device bytes are allocated now
    device = {("a", 0)}  # values on the device, readable from ready[value]
    ready: dict = {}
    host: set = set()
    leaving: dict = {}  # offloads issued since the last compute operation: value -> transfer end
    events: list = []  # (time, kind, tie, value)
    tie = itertools.count()
    pending = N
    clock = link = idle = offloaded = prefetched = 0.0

    def memory(values=counted) -> float:
        return float(sum(sizes[kind][k] for kind, k in values) + p["gradient_bytes"][pending])

    def apply(until: float, inclusive: bool, extra=(0.0, 0.0)) -> None:
        nonlocal peak
        while events and (events[0][0] <= until if inclusive else events[0][0] < until):
            _, kind, _, value = heapq.heappop(events)
            (counted.add if kind == _ALLOCATE else counted.discard)(value)
            peak = max(peak, memory() + extra[0] + extra[1])

    def fitting_start(start: float, extra) -> float:
        """The first release time at which the operation fits, or ``start``."""
        held = set(counted)
        future = sorted(events)
        for index, (time, kind, _, value) in enumerate(future):
            (held.add if kind == _ALLOCATE else held.discard)(value)
            last_at_time = index + 1 == len(future) or future[index + 1][0] > time
            if last_at_time and _fits(memory(held) + extra[0] + extra[1], memory_limit):
                return time
        return start

    def transfer(value) -> tuple[float, float]:
        nonlocal link
        start = max(clock, link)
        link = start + (0.0 if bandwidth == math.inf else sizes[value[0]][value[1]] / bandwidth)
        return start, link

    peak = memory()
    for position, op in enumerate(ops):
        kind, stage = op if isinstance(op, tuple) and len(op) == 2 else (None, None)
        if kind not in OFFLOAD_OPERATIONS or not is_int(stage) or not 1 <= stage <= N:
            raise ArgumentError(f"operation {position} ({op!r}) is not one of {OFFLOAD_OPERATIONS} on a stage 1..{N}")
        where = f"operation {position} ({ChainOp(*op)})"
        inputs = (("a", stage - 1), ("abar", stage - 1))
        if kind == "O":
            value = next((v for v in inputs if v in device), None)
            if value is None:
                raise ArgumentError(f"{where}: no input of stage {stage} (a^{stage - 1} or abar^{stage - 1}) is on "
                                    "the device to offload")
            device.discard(value)
            leaving[value] = transfer(value)[1]
            offloaded += sizes[value[0]][value[1]]
            continue
        if kind == "P":
            value = next((v for v in inputs if v in host), None)
            if value is None:
                raise ArgumentError(f"{where}: no input of stage {stage} is on the host (offload it with O^{stage} "
                                    "first)")
            host.discard(value)
            start, ready[value] = transfer(value)
            heapq.heappush(events, (start, _ALLOCATE, next(tie), value))
            device.add(value)
            prefetched += sizes[value[0]][value[1]]
            continue
        readable = device | leaving.keys()
        source = inputs[0] if inputs[0] in readable else inputs[1]
        if source not in readable:
            raise _missing(where, inputs[1] if inputs[1] in host else inputs[0], "its input", host)
        reads = [source]
        if kind == "B":
            if stage != pending:
                raise ArgumentError(f"{where}: the next backward is B^{pending}")
            if ("abar", stage) not in readable:
                raise _missing(where, ("abar", stage), "its", host)
            reads.append(("abar", stage))
            extra = (p["gradient_bytes"][stage - 1], p["backward_overhead"][stage])
            cost = p["backward_cost"][stage]
        else:
            result = ("abar", stage) if kind == "F_all" else ("a", stage)
            if result in host or result in leaving:
                raise ArgumentError(f"{where}: {_name(result)} is on the host: prefetch it instead of recomputing it")
            if kind == "F_no" and source == ("a", 0):
                raise ArgumentError(f"{where}: F_no^1 would delete the chain's input a^0")
            overhead = p["forward_all_overhead" if kind == "F_all" else "forward_overhead"][stage]
            extra = (sizes[result[0]][stage], overhead)
            cost = p["forward_cost"][stage]
        start = max([clock] + [ready.get(v, 0.0) for v in reads])
        apply(start, True)
        if memory_limit is not None and not _fits(memory() + extra[0] + extra[1], memory_limit):
            start = fitting_start(start, extra)
            apply(start, True)
        idle += start - clock
        peak = max(peak, memory() + extra[0] + extra[1])
        end = start + cost
        apply(end, False, extra)
        dropped = []
        if kind == "B":
            dropped.append(("abar", stage))
            if source[0] == "a" and stage > 1:
                dropped.append(source)
            pending -= 1
        else:
            if kind == "F_no":
                dropped.append(source)
            counted.add(result)
            device.add(result)
        for value in dropped:
            if value not in leaving:  # a value being offloaded is freed by its transfer
                counted.discard(value)
                device.discard(value)
        for value, done in leaving.items():
            heapq.heappush(events, (max(done, end) if value in reads else done, _RELEASE, next(tie), value))
            host.add(value)
        leaving.clear()
        clock = end
    if pending != 0:
        raise ArgumentError(f"the sequence ends before B^1 (the next backward is B^{pending})")
    for value, done in leaving.items():
        heapq.heappush(events, (done, _RELEASE, next(tie), value))
    apply(math.inf, True)
    return OffloadRun(float(max(clock, link)), float(peak), float(idle), float(offloaded), float(prefetched))


class _Pofo:
    """The DP of appendix B in slots; solved on construction (C_Delta, then OC_x)."""

    def __init__(self, chain: RotorChain, memory_limit: float, bandwidth: float, memory_slots: int,
                 table_slots: int | None = None):
        padded = chain._padded()
        self.N, self.S = chain.length, memory_slots if table_slots is None else table_slots
        slots = {name: np.array([_slots(v, memory_slots, memory_limit) for v in padded[name]], dtype=np.int64)
                 for name in ("output_bytes", "stored_bytes", "forward_overhead", "forward_all_overhead",
                              "backward_overhead", "gradient_bytes")}
        self.x, self.xbar, self.delta = slots["output_bytes"], slots["stored_bytes"], slots["gradient_bytes"]
        self.of, self.ofa = slots["forward_overhead"], slots["forward_all_overhead"]
        self.ob = slots["backward_overhead"]
        self.uf, self.ub = padded["forward_cost"], padded["backward_cost"]
        self.prefix = np.concatenate([[0.0], np.cumsum(self.uf[1:])])  # sum of u_F over 1..l
        self.b = bandwidth * memory_slots / memory_limit  # slots per unit of time
        self._solve_backward()
        self._solve_forward()
        self.duration = self.duration_at(self.S)  # at the table's own limit

    def duration_at(self, slots: int) -> float:
        """``OC_0(1, 0, 0, 0)`` at a limit of ``slots`` slots (at most the table's): the
        recurrence reads memory only as ``M_GPU - A``, so that limit's optimum is the
        table's entry at ``A = S - slots``."""
        return float(self.oc[(1, 0)][self.S - slots, 0, 0])

    # ----- Lemma 1's quantities -----

    def wait(self, excess):
        """Idle time for the link to move ``excess`` slots (none when <= 0)."""
        if self.b == math.inf:
            return np.zeros(np.shape(excess))
        return np.maximum(excess, 0) / self.b

    def drain(self, amount, time, whole: bool = True):
        """What is left of ``amount`` slots to transfer after ``time``; rounded up to whole
        slots when it is a state (``whole``)."""
        if self.b == math.inf:
            return np.zeros(np.broadcast(amount, time).shape, dtype=np.int64 if whole else float)
        left = np.asarray(np.subtract(amount, np.multiply(time, self.b), dtype=float))
        if not whole:
            return np.maximum(left, 0.0, out=left)
        left -= _EPS  # in place: these arrays are the DP's largest
        np.ceil(left, out=left)
        return np.maximum(left, 0.0, out=left).astype(np.int64)

    def input(self, i: int, x: int) -> int:
        """``I_i^x``: ``a^{i-1}`` (x = 0) or ``abar^{i-1}`` (x = 1), in slots."""
        return int(self.x[i - 1] if x == 0 else self.xbar[i - 1])

    # ----- backward phase: C_Delta (appendix B.3) -----

    def _cd_at(self, i, j, A, D):
        """``C_Delta(i, j, A, D)`` (inf where A > S); i, j, A, D broadcast."""
        row = self.cd_offsets[i] + j - i
        return self.cd.ravel().take((row * (self.S + 2) + np.minimum(A, self.S + 1)) * (self.S + 1) + D)

    def _cd_one(self, i, A, D):
        """Initialization: ``F_all^i B_i`` with Lemma 1's idle time."""
        m_fa = self.delta[i] + self.xbar[i] + self.ofa[i]
        m_b = self.xbar[i] + self.delta[i] + self.delta[i - 1] + self.ob[i]
        eps = np.maximum(np.maximum(self.wait(m_fa + A + D - self.S) - self.ub[i], self.wait(m_b + A + D - self.S)), 0)
        return np.where(A + max(m_fa, m_b) <= self.S, self.uf[i] + self.ub[i] + eps, math.inf)

    def _cd_all(self, i, j, A, D):
        """Case 1: ``F_all^i``, C_Delta(i+1, j, A + abar^i, Delta_1), ``B_i``; returns the
        cost and Delta_1."""
        m_fa = self.delta[j] + self.xbar[i] + self.ofa[i]
        m_b = self.xbar[i] + self.delta[i] + self.delta[i - 1] + self.ob[i]
        e_b = self.wait(m_b + A + D - self.S)
        d1 = self.drain(D, self.ub[i] + e_b)
        inner = self._cd_at(i + 1, j, A + self.xbar[i], d1)
        e_f = self.wait(m_fa + A + self.drain(d1, inner, whole=False) - self.S)
        cost = self.uf[i] + inner + self.ub[i] + e_f + e_b
        return np.where(A + max(m_fa, m_b) <= self.S, cost, math.inf), d1

    def _ck_terms(self, i: int, j: int, grad: int, from_start: bool):
        """For the runs ``F_ck^i F_no^{i+1} .. F_no^s`` (s = i .. j): the most memory of one
        (``max M_{F_no^k}``, gradient ``grad`` included), and Lemma 1's ``max_k (M_k - beta
        d_k)`` with d_k the time from the run's start to ``F_k`` (forward phase) or from
        ``F_k``'s end to the run's end (backward phase)."""
        memories = [grad + self.x[i] + self.of[i]] + [grad + self.x[k - 1] + self.x[k] + self.of[k]
                                                      for k in range(i + 1, j + 1)]
        most = np.maximum.accumulate(np.array(memories, dtype=np.int64))
        if self.b == math.inf:
            return most, np.zeros(len(memories)), memories
        peaks, run = [], -math.inf
        for k, level in zip(range(i, j + 1), memories):
            if from_start:
                run = max(run, level - self.b * (self.prefix[k - 1] - self.prefix[i - 1]))
            else:
                run = max(run - self.b * self.uf[k], level)
            peaks.append(run)
        return most, np.array(peaks), memories

    def _cd_ck(self, i, j, s, A, D, left=None):
        """Case 2: ``F_ck^i F_no^{i+1..s}``, C_Delta(s+1, j, A + a^s, Delta_2), then
        C_Delta(i, s, A, Delta); returns the cost and Delta_2 (s may be an array).
        ``left``: ``C_Delta(i, s, A, D)`` where the caller has it (a slice of the table)."""
        most, peaks, _ = self._ck_terms(i, j - 1, int(self.delta[j]), from_start=False)
        if left is None:
            left = self._cd_at(i, s, A, D)
        d2 = self.drain(D, left)
        right = self._cd_at(s + 1, j, A + self.x[s], d2)
        e_f = self.wait(peaks[s - i] + A + self.drain(d2, right, whole=False) - self.S)
        cost = (self.prefix[s] - self.prefix[i - 1]) + right + left + e_f
        return np.where(A + most[s - i] <= self.S, cost, math.inf), d2

    def _solve_backward(self):
        n, S = self.N - 1, self.S  # the loss is never inside a C_Delta sub-chain
        self.cd_offsets = np.zeros(n + 2, dtype=np.int64)
        for i in range(1, n + 1):
            self.cd_offsets[i + 1] = self.cd_offsets[i] + n - i + 1
        rows = int(self.cd_offsets[n + 1])
        self.cd = np.full((rows, S + 2, S + 1), math.inf)
        self.cd_choice = np.full((rows, S + 1, S + 1), -1, dtype=np.int16)
        A, D = np.arange(S + 1)[:, None], np.arange(S + 1)[None, :]
        # Case 2 is evaluated only where A + Delta <= S (Lemma 1: elsewhere inf), about half
        # of the (A, Delta) grid: `packed` holds each row at those pairs, in row-major order.
        pair_a, pair_d = np.nonzero(A + D <= S)
        packed = np.full((rows, len(pair_a)), math.inf)
        for j in range(1, n + 1):
            if time_is_up(allow_step=False):
                raise _OutOfTime
            for i in range(j, 0, -1):
                row = self.cd_offsets[i] + j - i
                if i == j:
                    best = self._cd_one(i, A, D)
                else:
                    best = self._cd_all(i, j, A, D)[0]
                    # C_Delta(i, s) for s = i .. j-1 are consecutive rows of the table.
                    left = packed[self.cd_offsets[i] : self.cd_offsets[i] + j - i]
                    total = self._cd_ck(i, j, np.arange(i, j)[:, None], pair_a[None], pair_d[None], left)[0]
                    split = np.argmin(total, axis=0)
                    values = np.take_along_axis(total, split[None], 0)[0]
                    better = values < best[pair_a, pair_d]
                    at = (pair_a[better], pair_d[better])
                    best[at] = values[better]
                    self.cd_choice[row][at] = i + split[better]
                best[A + D > S] = math.inf  # Lemma 1's m_min = M_GPU - A - Delta >= 0
                self.cd[row, : S + 1] = best
                packed[row] = best[pair_a, pair_d]

    # ----- forward phase: OC_x (appendix B.1, B.2) -----

    def _oc_at(self, i, x, A, F, B):
        """``OC_x(i, A, Delta_F, Delta_B)`` (inf outside the table)."""
        top, width = self.S + 1, self.S + 2
        index = (np.minimum(A, top) * width + np.minimum(F, top)) * width + np.minimum(B, top)
        return self.oc[(i, x)].ravel().take(index)

    def _phase_times(self, i, x, A, F, B):
        """Case 1 (and the loss): ``u_F + epsilon^F`` and ``u_B + epsilon^B`` of ``F_all^i``
        and ``B_i``, the time the link has during each (Lemma 1 with ``M_{F_i}^x``, ``M_{B_i}^x``)."""
        I = self.input(i, x)
        m_f, m_b = self._all_memories(i)
        return (self.uf[i] + self.wait(m_f + A + F + I - self.S), self.ub[i] + self.wait(m_b + A + B + I - self.S))

    def _all_memories(self, i):
        return (self.delta[self.N] + self.xbar[i] + self.ofa[i],
                self.xbar[i] + self.delta[i] + self.delta[i - 1] + self.ob[i])

    def _oc_loss(self, x, A, F, B):
        """B.2: the loss's ``F_all`` and ``B``; the link finishes the offloads and the
        prefetches ``B`` needs in between (``epsilon^G``)."""
        t_f, t_b = self._phase_times(self.N, x, A, F, B)
        left = self.drain(F, t_f, whole=False) + self.drain(B, t_b, whole=False)
        return t_f + t_b + (left / self.b if self.b != math.inf else 0.0)

    def _oc_all_step(self, i, x, A, F, B):
        """Case 1: the time of ``F_all^i`` and ``B_i`` with their idle times, and Table 2's
        next state for v = 2 (keep ``I_i``) and v = 1 (offload it)."""
        I = self.input(i, x)
        t_f, t_b = self._phase_times(i, x, A, F, B)
        back = self.drain(B, t_b)
        return t_f + t_b, {2: (A + I, self.drain(F, t_f), back), 1: (A, self.drain(F + I, t_f), back + I)}

    def _oc_ck_step(self, i, x, j, A, F, B, terms):
        """Case 2: the time of ``F_ck^i F_no^{i+1..j}`` with ``epsilon^F`` plus
        ``C_Delta(i, j, A + I_i, Delta_B)``, and the next states (v = 2, 1) for OC_0(j+1)."""
        I = self.input(i, x)
        run = (self.prefix[j] - self.prefix[i - 1]) + self.wait(terms[1][j - i] + A + F + I - self.S)
        rest = self._cd_at(i, j, A + I, B)
        back = self.drain(B, rest)
        return run + rest, {2: (A + I, self.drain(F, run), back), 1: (A, self.drain(F + I, run), back + I)}

    def _blocks(self, I: int, pending: int) -> list[tuple[int, int, int]]:
        """The parts of the state grid the forward phase evaluates for a stage whose input
        takes ``I`` slots: ``(a0, a1, top)`` for A in ``a0 .. a1 - 1`` and Delta_F, Delta_B in
        ``0 .. top``. OC is inf where ``A + I + max(Delta_F, Delta_B) > S`` (Lemma 1) and
        unreachable from ``OC_0(1, A, 0, 0)`` where a Delta exceeds ``pending``, the inputs
        of the earlier stages (a Delta grows only by an offloaded input): the grid's A range
        is cut into _FORWARD_BLOCKS ranges, each with the Deltas that can matter there."""
        room = self.S - I
        if room < 0:
            return []
        cuts = sorted({room * k // _FORWARD_BLOCKS for k in range(_FORWARD_BLOCKS)} | {room + 1})
        blocks: list = []
        for a0, a1 in zip(cuts, cuts[1:]):
            top = min(room - a0, pending)
            if blocks and blocks[-1][2] == top:  # the bound on pending transfers rules: one block
                blocks[-1] = (blocks[-1][0], a1, top)
            else:
                blocks.append((a0, a1, top))
        return blocks

    def _solve_forward(self):
        N, S = self.N, self.S
        grid = np.arange(S + 1)
        self.oc, self.oc_choice = {}, {}
        # The most slots of earlier inputs that can be in flight at stage i (either input kind).
        pending = np.concatenate([[0], np.cumsum(np.maximum(self.x, self.xbar)[:N])])
        for i in range(N, 0, -1):
            if time_is_up(allow_step=False):
                raise _OutOfTime
            for x in (0,) if i == 1 else (0, 1):
                I = self.input(i, x)
                if x == 1 and I == self.input(i, 0):  # same sizes, same table
                    self.oc[(i, 1)], self.oc_choice[(i, 1)] = self.oc[(i, 0)], self.oc_choice[(i, 0)]
                    continue
                table = np.full((S + 2,) * 3, math.inf)
                choice = np.full((S + 1,) * 3, -3, dtype=np.int16)
                self.oc[(i, x)], self.oc_choice[(i, x)] = table, choice
                top_all = S - I - max(self._all_memories(i))
                if i < N:
                    terms = self._ck_terms(i, N - 1, int(self.delta[N]), from_start=True)
                    most, memories = terms[0], terms[2]
                    rest = np.maximum.accumulate(np.array([0] + memories[1:], dtype=np.int64))
                for a0, a1, top in self._blocks(I, int(pending[i - 1])):
                    A, F, B = grid[a0:a1, None, None], grid[None, : top + 1, None], grid[None, None, : top + 1]
                    best = np.full((a1 - a0, top + 1, top + 1), math.inf)
                    codes = np.full(best.shape, -3, dtype=np.int16)

                    def offer(last: int, cost, code: int) -> None:
                        view, better = best[: last - a0 + 1], cost < best[: last - a0 + 1]
                        np.copyto(view, cost, where=better)
                        np.copyto(codes[: last - a0 + 1], code, where=better)

                    last = min(top_all, a1 - 1)
                    if i == N and last >= a0:
                        offer(last, self._oc_loss(x, A[: last - a0 + 1], F, B), -2)
                    elif last >= a0:  # F_all^i, codes -2 (keep I_i) and -1 (offload it)
                        local, nexts = self._oc_all_step(i, x, A[: last - a0 + 1], F, B)
                        for v in (2, 1):
                            offer(last, local + self._oc_at(i + 1, 1, *nexts[v]), -v)
                    for j in range(i, N):  # F_ck^i .. F_no^j, codes 2 (j - i) + (0: keep, 1: offload)
                        tops = {2: S - I - int(most[j - i]), 1: min(S - I - memories[0], S - int(rest[j - i]))}
                        if tops[1] < 0:
                            break
                        lasts = {v: min(tops[v], a1 - 1) for v in (2, 1)}
                        if lasts[1] < a0:
                            continue
                        local, nexts = self._oc_ck_step(i, x, j, A[: lasts[1] - a0 + 1], F, B, terms)
                        for v in (2, 1):
                            if lasts[v] >= a0:
                                cut = tuple(part[: lasts[v] - a0 + 1] for part in nexts[v])
                                offer(lasts[v], local[: lasts[v] - a0 + 1] + self._oc_at(j + 1, 0, *cut),
                                      2 * (j - i) + 2 - v)
                    # m_min >= 0 (Lemma 1) where the block's Deltas reach past the A it holds
                    best[A + I + np.maximum(F, B) > S] = math.inf
                    table[a0:a1, : top + 1, : top + 1], choice[a0:a1, : top + 1, : top + 1] = best, codes

    # ----- the sequence -----

    def sequence(self, slots: int | None = None) -> list[ChainOp]:
        """The optimal sequence within ``slots`` slots (default: the table's), with its
        offloads and without prefetches."""
        ops: list[ChainOp] = []
        stack: list = [("OC", 1, 0, self.S - (self.S if slots is None else slots), 0, 0)]
        while stack:
            item = stack.pop()
            if isinstance(item, ChainOp):
                ops.append(item)
                continue
            if item[0] == "OC":
                _, i, x, A, F, B = item
                if i == self.N:
                    stack.extend([ChainOp("B", i), ChainOp("F_all", i)])
                    continue
                code = int(self.oc_choice[(i, x)][A, F, B])
                if code < 0:
                    v = -code
                    _, nexts = self._oc_all_step(i, x, A, F, B)
                    work = [ChainOp("F_all", i), ("OC", i + 1, 1, *map(int, nexts[v])), ChainOp("B", i)]
                else:
                    j, v = i + code // 2, 2 - code % 2
                    terms = self._ck_terms(i, self.N - 1, int(self.delta[self.N]), from_start=True)
                    _, nexts = self._oc_ck_step(i, x, j, A, F, B, terms)
                    work = [ChainOp("F_ck", i), *(ChainOp("F_no", k) for k in range(i + 1, j + 1)),
                            ("OC", j + 1, 0, *map(int, nexts[v])), ("CD", i, j, A + self.input(i, x), B)]
                if v == 1:
                    work.insert(0, ChainOp("O", i))
            else:
                _, i, j, A, D = item
                s = -1 if i == j else int(self.cd_choice[self.cd_offsets[i] + j - i, A, D])
                if i == j:
                    work = [ChainOp("F_all", i), ChainOp("B", i)]
                elif s < 0:
                    d1 = int(self._cd_all(i, j, A, D)[1])
                    work = [ChainOp("F_all", i), ("CD", i + 1, j, A + int(self.xbar[i]), d1), ChainOp("B", i)]
                else:
                    d2 = int(self._cd_ck(i, j, s, A, D)[1])
                    work = [ChainOp("F_ck", i), *(ChainOp("F_no", k) for k in range(i + 1, s + 1)),
                            ("CD", s + 1, j, A + int(self.x[s]), d2), ("CD", i, s, A, D)]
            stack.extend(reversed(work))
        return ops


def _with_prefetches(base: list[ChainOp], where: list[list[int]]) -> list[ChainOp]:
    """``base`` with ``P^stage`` inserted before ``base[position]`` for each [position, stage]
    of ``where`` (in link order)."""
    out, k = [], 0
    for position, op in enumerate(base):
        while k < len(where) and where[k][0] == position:
            out.append(ChainOp("P", where[k][1]))
            k += 1
        out.append(op)
    return out


def _prefetched(chain: RotorChain, base: list[ChainOp], bandwidth: float, memory_limit: float):
    """The best replayed placement of a prefetch per offload in ``base`` (None: none fits).

    Each ``P^l`` starts just before its first reader after the loss's forward (the DP's
    memory tests cover that), in the order of those readers; then, in that order, each is
    moved to the earliest position from which the replay still fits ``memory_limit``
    (a bisection: an earlier prefetch holds its bytes longer). O(K log n) replays for K
    prefetches in n operations."""
    loss = next(q for q, op in enumerate(base) if op.stage == chain.length)
    readers = []
    for op in base:
        if op.kind == "O":  # the first reader of stage l's input is F^l or B^l
            first = next(q for q in range(loss + 1, len(base)) if base[q].stage == op.stage and base[q].kind != "O")
            readers.append((first, -op.stage))
    where = [[q, -negative] for q, negative in sorted(readers)]
    best = None

    def fits():
        nonlocal best
        ops = _with_prefetches(base, where)
        run = run_offload_sequence(chain, ops, bandwidth, memory_limit)
        if not _fits(run.peak_bytes, memory_limit):
            return False
        if best is None or run.makespan < best[1].makespan:
            best = (ops, run)
        return True

    if not fits():
        return None
    for k, entry in enumerate(where):
        low, high = max(loss + 1, where[k - 1][0] if k else 0), entry[0]
        while low < high:
            entry[0] = (low + high) // 2
            if fits():
                high = entry[0]
            else:
                low = entry[0] + 1
        entry[0] = high
    return best


def solve_pofo(chain: RotorChain, memory_limit: float, bandwidth: float, memory_slots: int = 50) -> PofoSolution | None:
    """pofo (sec. 4, appendix B): the fastest sequence of Table 1's operations with offloads
    and prefetches within ``memory_limit`` bytes (``a^0`` counted) on a link of
    ``bandwidth`` bytes per unit of the chain's cost (``math.inf``: free transfers).

    The DP of the module docstring on ``memory_slots`` slots (the paper uses 50) gives the
    offloads and the compute sequence; prefetches are then placed at once
    (:func:`_prefetched`), and the result is the faster replay of it and of rotor's optimum
    (:func:`~tfremat.plan.rotor.solve_chain` at the same slots), ``duration`` being the DP's
    value for the one returned. Its replay (:func:`run_offload_sequence` with
    ``memory_limit``) peaks within the limit and takes at most rotor's optimum. Against the
    DP's duration the replay is slower where an offload frees its bytes only at its end,
    faster where the DP's rounding of pending transfers to whole slots and its separate
    idle times over-count (see ``tests/test_pofo.py``).

    O(N^2 S^3 + N^3 S^2) time and O(N S^3 + N^2 S^2) memory for N stages and S slots
    (Theorem 1), plus O(K log n) replays. Under a
    :func:`~tfremat.plan.baselines.heuristic_deadline` it raises ``_OutOfTime`` past the
    deadline, as :func:`~tfremat.plan.rotor.solve_chain` does.

    Returns:
        The :class:`PofoSolution`, or None when no sequence fits.

    Raises:
        ArgumentError: ``memory_limit`` not a finite number > 0, ``bandwidth`` not a number
            > 0, ``memory_slots`` not an int >= 1, or a table over :data:`MAX_POFO_CELLS`.
    """
    return solve_pofo_limits(chain, memory_limit, bandwidth, [memory_slots], memory_slots)[0]


def solve_pofo_limits(chain: RotorChain, memory_limit: float, bandwidth: float, slot_counts: Sequence[int],
                      memory_slots: int = 50) -> list[PofoSolution | None]:
    """:func:`solve_pofo` at several limits of one slot size, ``memory_limit / memory_slots``
    bytes: at ``c * memory_limit / memory_slots`` bytes for each ``c`` of ``slot_counts``
    (which may exceed ``memory_slots``), from one DP over ``max(slot_counts)`` slots.

    Appendix B's recurrences read the memory held (A) only through what is left of
    ``M_GPU``, so the table of the largest limit holds every smaller one's optimum at
    ``A = S - c`` (as rotor's table holds every smaller limit in its columns); one solve
    replaces one per limit. Entry k of the result answers ``slot_counts[k]`` (None: no
    sequence fits it).

    Raises:
        ArgumentError: as :func:`solve_pofo`; a count that is no int >= 1; a table over
            :data:`MAX_POFO_CELLS` (counted at ``max(slot_counts)`` slots).
    """
    _check_limit(memory_limit)
    _check_bandwidth(bandwidth)
    if not is_int(memory_slots) or memory_slots < 1:
        raise ArgumentError(f"memory_slots must be an int >= 1 (the memory limit is split into that many slots; the "
                            f"paper uses 50), got {memory_slots!r}")
    if not slot_counts or not all(is_int(c) and c >= 1 for c in slot_counts):
        raise ArgumentError(f"slot_counts must be ints >= 1 (limits in slots of memory_limit / memory_slots), got "
                            f"{slot_counts!r}")
    top = max(slot_counts)
    cells = 2 * chain.length * (top + 2) ** 3
    if cells > MAX_POFO_CELLS:
        most = int((MAX_POFO_CELLS / (2 * chain.length)) ** (1 / 3))
        while most >= 1 and 2 * chain.length * (most + 2) ** 3 > MAX_POFO_CELLS:
            most -= 1
        most = most * memory_slots // top
        fix = f"use memory_slots <= {most}" if most >= 1 else "the chain is too long for pofo"
        raise ArgumentError(f"memory_slots={memory_slots}: pofo's forward tables for {chain.length} stages would hold "
                            f"{cells} cells, more than {MAX_POFO_CELLS}: {fix}")
    dp = _Pofo(chain, memory_limit, bandwidth, memory_slots, top)
    # Rotor's table holds every smaller limit of its slot size in its columns.
    table = solve_chain(chain, memory_limit if top == memory_slots else memory_limit * top / memory_slots, top)
    solutions = []
    for count in slot_counts:
        limit = memory_limit * count / memory_slots
        candidates = []
        duration = dp.duration_at(count)
        if math.isfinite(duration):
            placed = _prefetched(chain, dp.sequence(count), bandwidth, limit)
            if placed is not None:
                candidates.append((placed[1].makespan, 1, PofoSolution(placed[0], duration, placed[1])))
        if math.isfinite(table.cost[count]):
            ops = table.sequence(count)
            run = run_offload_sequence(chain, ops, bandwidth, limit)
            candidates.append((run.makespan, 0, PofoSolution(ops, float(table.cost[count]), run)))
        solutions.append(min(candidates, key=lambda c: c[:2])[2] if candidates else None)
    return solutions
