"""Beaumont et al.'s optimal recompute-only schedule of a chain ("rotor"), and the ``rotor`` strategies.

Beaumont, Eyraud-Dubois and Shilova, "Efficient Combination of Rematerialization and
Offloading for Training DNNs" (NeurIPS 2021, ``shared/papers/004_970af3ac90aaba55.txt``).

**The model** (sec. 3.1, Table 1). A chain of stages ``l = 1 .. N`` processes a mini-batch:
stage l reads the activation ``a^{l-1}`` and produces ``a^l``; its backward ``B_l`` reads the
gradient ``delta^l``, the input ``a^{l-1}`` and ``abar^l`` (everything the forward of l made
that ``B_l`` needs; it contains ``a^l``) and produces ``delta^{l-1}``. The forward runs in one
of three ways:

* ``F_all`` keeps its input and stores ``abar^l``;
* ``F_ck`` keeps its input (a checkpoint) and produces ``a^l``;
* ``F_no`` (the paper's F with an empty-set subscript) produces ``a^l`` and deletes its input.

``B_l`` deletes ``abar^l`` and its input ``a^{l-1}`` (an input ``abar^{l-1}`` stays, for
``B_{l-1}``). Each forward takes ``u_F`` and needs ``o^f`` bytes besides its operands while it
runs; each backward ``u_B`` and ``o^b``. The loss is a last stage computed by ``F_all`` and
``B`` (appendix B.2).

**The recurrence.** Sec. 5.2 compares against "the optimal rematerialization-only algorithm
from [2]" (rotor: Beaumont et al., Inria RR-9302, 2019) without restating it. Appendix B.3
gives ``C_Delta(i, j, A, Delta)``, the duration of a sub-chain's rematerialization sequence
(Eq. 2); with no offloading (``Delta = 0``) every idle time ``epsilon`` (Lemma 1) is 0 and
only its memory tests remain. That specialization is what :func:`solve_chain` computes. The
sub-chain i..j starts with its input stored (counted in A) and ``delta^j`` held; ``m = M - A``
is the memory left for everything else:

    C(i, i, m)     = u_F_i + u_B_i                          if m >= M_all(i; i), M_B(i)
    C_all(i, j, m) = u_F_i + C(i+1, j, m - abar^i) + u_B_i  if m >= M_all(i; j), M_B(i)
    C_ck(i, j, m)  = min over i <= i' < j of
                     sum_{k=i..i'} u_F_k + C(i'+1, j, m - a^{i'}) + C(i, i', m)
                                                            if m >= M_no(k; i, j), k = i..i'
    C(i, j, m)     = min(C_all(i, j, m), C_ck(i, j, m))     (Eq. 2)

with appendix B's operation memories (the sub-chain's input not counted):
``M_all(i; j) = delta^j + abar^i + o^f_i``, ``M_no(i; i, j) = delta^j + a^i + o^f_i`` (the
``F_ck^i`` that opens the part), ``M_no(k; i, j) = delta^j + a^{k-1} + a^k + o^f_k`` for
``k > i`` and ``M_B(i) = abar^i + delta^i + delta^{i-1} + o^b_i``. ``C_all`` runs
``F_all^i``, the sub-chain i+1..j with ``abar^i`` as its stored input, then ``B_i``;
``C_ck`` runs ``F_ck^i F_no^{i+1} .. F_no^{i'}``, the sub-chain i'+1..j with ``a^{i'}`` as
its input, then i..i' again after ``B_{i'+1}`` freed ``a^{i'}``. Both rely on memory
persistency (sec. 3.2, assumption 2). Appendix B.3 writes the ``C_ck`` test as "for some k,
i <= k < j"; the forwards that run are i..i', and those are what is tested here. Memory is
discretized into slots (sec. 4 uses 50 for pofo; here ``memory_slots``, 500 by default), sizes
rounded up, so a sequence that fits its slots fits the limit in bytes. Each forward may have
its own overhead for ``F_all`` (:attr:`RotorChain.forward_all_overhead`), a generalization
that a stage of several graph nodes needs; with one overhead it is the paper's recurrence.

**Offloading (not implemented).** The paper's pofo (sec. 4, appendix B) adds offload and
prefetch operations: its forward phase ``OC_x(i, A_i, Delta_F, Delta_B)`` (Eq. 1) chooses
``F_all`` or ``F_ck`` per stage and whether the input goes to the host, carrying the bytes
still to offload and to prefetch; its backward phase is ``C_Delta`` with prefetching (idle
times from Lemma 1). Setting every transfer to zero leaves the recurrence above.

**Training graphs.** A stage is a *unit* of forward nodes (every forward node its own unit for
``rotor``, the blocks between forward articulation points for ``rotor_ap``) plus the backward
nodes of its members; the loss node is the last stage. :func:`graph_chain` documents how each
quantity is read off the graph. A sequence becomes a keep matrix through the model's
computation points (:func:`sequence_keep_matrix`), completed by ``solve R given S``. The chain
model ignores DAG edges between units and what a gradient reads outside it, so the simulator
judges each schedule and the strategies search a few memory limits around the budget.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from tfremat.errors import ArgumentError, InfeasibleBudgetError, is_int, is_number
from tfremat.graph import DFGraph
from tfremat.plan.baselines import (
    _forward_order,
    _OutOfTime,
    _units_between,
    cheapest_fitting,
    known_peak,
    schedule_for_checkpoints,
    time_is_up,
)
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule, schedule_from_keep_matrix

__all__ = [
    "OPERATIONS",
    "MAX_TABLE_CELLS",
    "DEFAULT_SLOTS",
    "MIN_DEFAULT_SLOTS",
    "ChainOp",
    "RotorChain",
    "ChainRun",
    "RotorTable",
    "GraphChain",
    "solve_chain",
    "sequences_at_limits",
    "run_sequence",
    "keep_everything_sequence",
    "graph_chain",
    "sequence_keep_matrix",
    "rotor",
    "rotor_ap",
]

logger = logging.getLogger(__name__)

# Table 1's operations: the three forwards and the backward.
OPERATIONS = ("F_all", "F_ck", "F_no", "B")

# The DP holds a cost (float64) and a choice (int16) per (i, j, m): N(N+1)/2 x (slots + 1)
# cells, 10 bytes each; 2**24 cells are 168 MB and, on a 2-core CPU, seconds of numpy.
MAX_TABLE_CELLS = 1 << 24
# Memory slots when none are asked for; fewer on chains too long for them, down to the
# 50 steps that showed no discretization effect in the paper's experiments (sec. 4).
DEFAULT_SLOTS = 500
MIN_DEFAULT_SLOTS = 50

# With a budget the table reaches this share above the budget's activation memory, so that
# the search can try limits above it where the model over-counts what the simulator holds.
_HEADROOM = 0.25

# solve_chain masks a staircase of at most this many steps by slices, more with a mask.
_MASK_STEPS = 16

# With a budget, memory limits tried on a grid over the table, then bisections between the
# largest that fitted and the next above it (each a schedule built and simulated, milliseconds
# on the Checkmate graphs against seconds for the DP).
_GRID_LIMITS = 16
_BISECTIONS = 6


class ChainOp(NamedTuple):
    """One operation of Table 1: ``kind`` one of :data:`OPERATIONS`, on ``stage`` (1..N)."""

    kind: str
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}^{self.stage}"


def _numbers(values, what: str, length: int | None = None) -> np.ndarray:
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ArgumentError(f"{what} must be a sequence of numbers >= 0, got {values!r}") from None
    if array.ndim != 1 or (length is not None and array.size != length):
        expected = f"{length} entries" if length is not None else "a 1-D sequence"
        raise ArgumentError(f"{what} must have {expected}, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ArgumentError(f"{what} must hold finite numbers >= 0")
    return array


@dataclasses.dataclass(frozen=True, eq=False)
class RotorChain:
    """A chain in the notation of sec. 3.1 (Table 1), stage l = 1 .. N at index l - 1.

    Attributes:
        forward_cost: ``u_F`` of each stage.
        backward_cost: ``u_B`` of each stage.
        output_bytes: ``a^l``, what the next stage reads (the checkpoint of ``F_ck``).
        stored_bytes: ``abar^l``, what ``F_all`` stores for ``B_l``; it contains ``a^l``, so
            it is at least ``output_bytes``.
        forward_overhead: ``o^f``: bytes a forward (``F_ck``, ``F_no``) needs besides its
            input and output while it runs.
        backward_overhead: ``o^b``: bytes a backward needs besides its operands and result.
        gradient_bytes: ``delta^0 .. delta^N`` (N + 1 entries): ``delta^l`` is the gradient
            ``B_{l+1}`` produces and ``B_l`` reads; ``delta^N`` is held from the start.
        input_bytes: ``a^0``, the chain's input, stored throughout.
        forward_all_overhead: ``o^f`` of ``F_all``, where it differs (None: the same).
            Table 1 has one forward overhead per layer; a stage of several graph nodes keeps
            what it makes under ``F_all`` but drops it as it goes under ``F_no``, so its
            two runs hold different amounts beyond ``abar^l`` and ``a^l``.

    Raises:
        ArgumentError: a field that is not finite numbers >= 0 of the right length, or
            ``stored_bytes`` below ``output_bytes``.
    """

    forward_cost: np.ndarray
    backward_cost: np.ndarray
    output_bytes: np.ndarray
    stored_bytes: np.ndarray
    forward_overhead: np.ndarray
    backward_overhead: np.ndarray
    gradient_bytes: np.ndarray
    input_bytes: float = 0.0
    forward_all_overhead: np.ndarray | None = None

    def __post_init__(self):
        length = len(np.atleast_1d(self.forward_cost))
        if length == 0:
            raise ArgumentError("a chain needs at least one stage")
        if self.forward_all_overhead is None:
            object.__setattr__(self, "forward_all_overhead", self.forward_overhead)
        for field in dataclasses.fields(self):
            if field.name == "input_bytes":
                continue
            size = length + 1 if field.name == "gradient_bytes" else length
            array = _numbers(getattr(self, field.name), field.name, size)
            array.setflags(write=False)
            object.__setattr__(self, field.name, array)
        if not is_number(self.input_bytes) or not math.isfinite(self.input_bytes) or self.input_bytes < 0:
            raise ArgumentError(f"input_bytes must be a finite number >= 0, got {self.input_bytes!r}")
        if np.any(self.stored_bytes < self.output_bytes):
            stage = int(np.argmax(self.stored_bytes < self.output_bytes)) + 1
            raise ArgumentError(f"stored_bytes must be at least output_bytes (abar^l contains a^l); stage {stage} "
                                "has less")

    @property
    def length(self) -> int:
        """N, the number of stages."""
        return len(self.forward_cost)

    def _padded(self) -> dict[str, np.ndarray]:
        """Per-stage arrays indexed by the paper's l (entry 0: a^0 for ``output_bytes``)."""
        out = {name: np.concatenate([[0.0], getattr(self, name)]) for name in
               ("forward_cost", "backward_cost", "stored_bytes", "forward_overhead", "forward_all_overhead",
                "backward_overhead")}
        out["output_bytes"] = np.concatenate([[self.input_bytes], self.output_bytes])
        out["gradient_bytes"] = np.asarray(self.gradient_bytes)
        return out


class ChainRun(NamedTuple):
    """What a sequence of operations costs under the model (:func:`run_sequence`)."""

    cost: float
    peak_bytes: float


def run_sequence(chain: RotorChain, ops: Sequence[ChainOp]) -> ChainRun:
    """Replays ``ops`` under Table 1's semantics: its total time and its peak memory.

    The memory at any time is every stored activation (``a^0`` included) plus the gradient
    held; an operation adds its result and its overhead while it runs (appendix B's
    operation memories). Forwards read ``a^{l-1}`` when it is stored, else ``abar^{l-1}``;
    ``F_no`` deletes the one it read and may not delete ``a^0`` (appendix B.1: the chain's
    input is kept); ``B_l`` must be the next backward, deletes ``abar^l`` and an ``a^{l-1}``
    input (read in preference to ``abar^{l-1}``, which stays).

    Raises:
        ArgumentError: an unknown operation, one whose operands are not stored, a backward
            out of order, or a sequence that does not end with ``B_1``.
    """
    p = chain._padded()
    N = chain.length
    stored: set[tuple[str, int]] = {("a", 0)}
    sizes = {"a": p["output_bytes"], "abar": p["stored_bytes"]}
    pending = N  # the next backward is B_pending; delta^pending is held
    cost = 0.0

    def memory() -> float:
        return float(sum(sizes[kind][k] for kind, k in stored) + p["gradient_bytes"][pending])

    peak = memory()
    for position, op in enumerate(ops):
        kind, stage = op if isinstance(op, tuple) and len(op) == 2 else (None, None)
        if kind not in OPERATIONS or not is_int(stage) or not 1 <= stage <= N:
            raise ArgumentError(f"operation {position} ({op!r}) is not one of {OPERATIONS} on a stage 1..{N}")
        where = f"operation {position} ({ChainOp(*op)})"
        source = ("a", stage - 1) if ("a", stage - 1) in stored else ("abar", stage - 1)
        if source not in stored:
            raise ArgumentError(f"{where}: its input a^{stage - 1} is not stored")
        if kind == "B":
            if stage != pending:
                raise ArgumentError(f"{where}: the next backward is B^{pending}")
            if ("abar", stage) not in stored:
                raise ArgumentError(f"{where}: abar^{stage} is not stored")
            peak = max(peak, memory() + p["gradient_bytes"][stage - 1] + p["backward_overhead"][stage])
            stored.discard(("abar", stage))
            if source[0] == "a" and stage > 1:
                stored.discard(source)
            pending -= 1
            cost += p["backward_cost"][stage]
            continue
        result = ("abar", stage) if kind == "F_all" else ("a", stage)
        overhead = p["forward_all_overhead" if kind == "F_all" else "forward_overhead"][stage]
        peak = max(peak, memory() + sizes[result[0]][stage] + overhead)
        if kind == "F_no":
            if source == ("a", 0):
                raise ArgumentError(f"{where}: F_no^1 would delete the chain's input a^0")
            stored.discard(source)
        stored.add(result)
        cost += p["forward_cost"][stage]
    if pending != 0:
        raise ArgumentError(f"the sequence ends before B^1 (the next backward is B^{pending})")
    return ChainRun(float(cost), float(peak))


def keep_everything_sequence(length: int) -> list[ChainOp]:
    """``F_all^1 .. F_all^N B^N .. B^1``: no recomputation (the most memory)."""
    forwards = [ChainOp("F_all", stage) for stage in range(1, length + 1)]
    return forwards + [ChainOp("B", stage) for stage in range(length, 0, -1)]


def _check_slots(memory_slots) -> None:
    if not is_int(memory_slots) or memory_slots < 1:
        raise ArgumentError(f"memory_slots must be None or an int >= 1 (the memory limit is split into that many "
                            f"slots; None: {DEFAULT_SLOTS}, fewer for long chains), got {memory_slots!r}")


def _most_slots(length: int, ratio: float) -> int:
    """The most slots ``memory_slots`` may ask for when the table has ``ratio`` times as many
    (headroom), within :data:`MAX_TABLE_CELLS` cells (0: not even one)."""
    pairs = length * (length + 1) // 2
    most = int((MAX_TABLE_CELLS // pairs - 1) / ratio)
    while most >= 1 and pairs * (int(most * ratio) + 1) > MAX_TABLE_CELLS:
        most -= 1
    while pairs * (int((most + 1) * ratio) + 1) <= MAX_TABLE_CELLS:
        most += 1
    return max(most, 0)


def _check_table(length: int, slots: int, memory_slots: int, strategy: str | None = None) -> None:
    """Raises ArgumentError, naming ``memory_slots`` and a value that fits, when a table of
    ``slots`` slots (``memory_slots`` asked for, plus any headroom) over ``length`` stages
    would exceed :data:`MAX_TABLE_CELLS`."""
    cells = length * (length + 1) // 2 * (slots + 1)
    if cells <= MAX_TABLE_CELLS:
        return
    most = _most_slots(length, slots / memory_slots)
    fix = f"use memory_slots <= {most}" if most >= 1 else "the chain is too long for any slot count"
    if strategy == "rotor":
        fix += ", or rotor_ap (its stages are the blocks between forward articulation points)"
    raise ArgumentError(
        f"memory_slots={memory_slots}: the DP table of a {length}-stage chain would hold {cells} cells, more than "
        f"{MAX_TABLE_CELLS} (about {MAX_TABLE_CELLS * 10 // 10**6} MB): {fix}"
    )


def _resolve_slots(memory_slots: int | None, length: int, budget: int | None, strategy: str) -> int:
    """``memory_slots``, checked against the table's size; None: :data:`DEFAULT_SLOTS`, or as
    many as the table holds for a long chain, at least :data:`MIN_DEFAULT_SLOTS`.

    Raises:
        ArgumentError: an explicit ``memory_slots`` too large; a chain too long for
            :data:`MIN_DEFAULT_SLOTS` without a budget.
        InfeasibleBudgetError: the same, with a budget (so a comparison of every strategy
            records it as this strategy's outcome).
    """
    headroom = _table_slots(DEFAULT_SLOTS, budget) / DEFAULT_SLOTS
    if memory_slots is not None:
        _check_table(length, _table_slots(memory_slots, budget), memory_slots, strategy)
        return memory_slots
    most = min(DEFAULT_SLOTS, _most_slots(length, headroom))
    if most >= MIN_DEFAULT_SLOTS:
        if most < DEFAULT_SLOTS:
            logger.info("%s: %d memory slots for a chain of %d stages (the DP table holds at most %d cells)", strategy,
                        most, length, MAX_TABLE_CELLS)
        return most
    detail = (f"a chain of {length} stages is too long for the DP at {MIN_DEFAULT_SLOTS} memory slots or more "
              f"(at most {MAX_TABLE_CELLS} table cells)")
    if strategy == "rotor":
        detail += "; rotor_ap has fewer stages"
    if budget is not None:
        raise InfeasibleBudgetError(budget, strategy=strategy, detail=detail)
    raise ArgumentError(f"{strategy}: {detail}")


def _slots(value: float, slot_count: int, limit: float) -> int:
    """``value`` bytes in slots of ``limit / slot_count`` bytes, rounded up, exactly."""
    return math.ceil(Fraction(value) * slot_count / Fraction(limit))


@dataclasses.dataclass(frozen=True, eq=False)
class RotorTable:
    """The solved DP of a chain for every memory limit up to ``slots`` slots.

    Attributes:
        chain: the chain.
        slots: the largest limit, in slots.
        slot_bytes: bytes per slot.
        cost: ``C(1, N, m)`` for the whole chain at each limit m = 0 .. slots (inf: no
            sequence fits); the limit counts the stored input ``a^0``.
    """

    chain: RotorChain
    slots: int
    slot_bytes: float
    cost: np.ndarray
    _choice: np.ndarray = dataclasses.field(repr=False)
    _offsets: np.ndarray = dataclasses.field(repr=False)
    _sizes: dict = dataclasses.field(repr=False)

    @property
    def min_slots(self) -> int | None:
        """The smallest limit (slots) at which a sequence fits; None when none does."""
        feasible = np.flatnonzero(np.isfinite(self.cost))
        return int(feasible[0]) if len(feasible) else None

    def sequence(self, slots: int | None = None) -> list[ChainOp]:
        """The optimal sequence within ``slots`` slots (default: all of them).

        Raises:
            ArgumentError: ``slots`` outside 0..``self.slots``, or no sequence fits it.
        """
        slots = self.slots if slots is None else slots
        if not is_int(slots) or not 0 <= slots <= self.slots:
            raise ArgumentError(f"slots must be an int in 0..{self.slots}, got {slots!r}")
        if not np.isfinite(self.cost[slots]):
            raise ArgumentError(f"no sequence fits in {slots} slots (the least is {self.min_slots})")
        N = self.chain.length
        x, xbar = self._sizes["output_bytes"], self._sizes["stored_bytes"]
        ops: list[ChainOp] = []
        # A stack of pending work, so that a long chain does not recurse N deep.
        stack: list = [(1, N, int(slots) - int(x[0]))]
        while stack:
            item = stack.pop()
            if isinstance(item, ChainOp):
                ops.append(item)
                continue
            i, j, m = item
            choice = int(self._choice[self._offsets[i] + j - i, m])
            if choice < 0:
                tail = [] if i == j else [(i + 1, j, m - int(xbar[i]))]
                work = [ChainOp("F_all", i), *tail, ChainOp("B", i)]
            else:
                split = choice
                work = [ChainOp("F_ck", i), *(ChainOp("F_no", k) for k in range(i + 1, split + 1)),
                        (split + 1, j, m - int(x[split])), (i, split, m)]
            stack.extend(reversed(work))
        return ops


def _shift(row: np.ndarray, by: int) -> np.ndarray:
    """``out[m] = row[m - by]`` (inf where ``m < by``)."""
    out = np.full(len(row), math.inf)
    if by < len(row):
        out[by:] = row[: len(row) - by]
    return out


def solve_chain(chain: RotorChain, memory_limit: float, memory_slots: int | None = DEFAULT_SLOTS) -> RotorTable:
    """The recompute-only DP (appendix B.3, Eq. 2, with ``Delta = 0``) for every limit up to
    ``memory_limit``.

    Memory is ``memory_slots`` slots of ``memory_limit / memory_slots`` bytes; every size is
    rounded up to whole slots, so a sequence the table says fits in m slots holds at most
    ``m * slot_bytes`` bytes under :func:`run_sequence`. Column m of the table is the
    optimum at that limit: one solve serves every smaller limit of the same slot size.
    O(N^3 memory_slots) time and O(N^2 memory_slots) memory; under a
    :func:`~tfremat.plan.baselines.heuristic_deadline` it stops at the deadline.

    Raises:
        ArgumentError: ``memory_limit`` not a number > 0, ``memory_slots`` not an int >= 1
            (None: :data:`DEFAULT_SLOTS`), or a table of more than :data:`MAX_TABLE_CELLS` cells.
    """
    if not is_number(memory_limit) or not math.isfinite(memory_limit) or memory_limit <= 0:
        raise ArgumentError(f"memory_limit must be a finite number of bytes > 0, got {memory_limit!r}")
    memory_slots = DEFAULT_SLOTS if memory_slots is None else memory_slots
    _check_slots(memory_slots)
    N = chain.length
    _check_table(N, memory_slots, memory_slots)
    padded = chain._padded()
    sizes = {name: np.array([_slots(v, memory_slots, memory_limit) for v in padded[name]], dtype=np.int64)
             for name in ("output_bytes", "stored_bytes", "forward_overhead", "forward_all_overhead", "backward_overhead",
                          "gradient_bytes")}
    x, xbar, delta = sizes["output_bytes"], sizes["stored_bytes"], sizes["gradient_bytes"]
    of, of_all, ob = sizes["forward_overhead"], sizes["forward_all_overhead"], sizes["backward_overhead"]
    uf, ub = padded["forward_cost"], padded["backward_cost"]
    width = memory_slots + 1
    m = np.arange(width)
    offsets = np.zeros(N + 2, dtype=np.int64)  # row of C(i, j) is offsets[i] + j - i
    for i in range(1, N + 1):
        offsets[i + 1] = offsets[i] + N - i + 1
    cost = np.full((int(offsets[N + 1]), width), math.inf)
    choice = np.full(cost.shape, -1, dtype=np.int16 if N < 2**15 else np.int32)
    forward_prefix = np.concatenate([[0.0], np.cumsum(uf[1:])])  # sum of u_F over 1..l
    # M_no(k; i, j) - delta^j for k > i: a^{k-1} + a^k + o^f_k
    no_need = np.zeros(N + 1, dtype=np.int64)
    no_need[1:] = x[:-1] + x[1:] + of[1:]
    for j in range(1, N + 1):
        if time_is_up(allow_step=False):
            raise _OutOfTime
        # shifted[k] = C(k + 1, j, m - a^k), filled as C(k + 1, j) is solved (i descends).
        shifted = np.empty((j + 1, width))
        for i in range(j, 0, -1):
            need_all = max(delta[j] + xbar[i] + of_all[i], xbar[i] + delta[i] + delta[i - 1] + ob[i])
            if i == j:
                best = np.full(width, uf[i] + ub[i])
            else:
                best = uf[i] + ub[i] + _shift(cost[offsets[i + 1] + j - i - 1], int(xbar[i]))
            best[: min(need_all, width)] = math.inf
            picked = np.full(width, -1, dtype=choice.dtype)
            if i < j:
                # C_ck: one row per i' = i .. j-1.
                need = delta[j] + np.maximum.accumulate(np.concatenate([[x[i] + of[i]], no_need[i + 1 : j]]))
                low = int(need[0])
                # need rises with i': only the first `count` rows fit some limit, and row r
                # is infeasible below need[r], a staircase masked one step at a time.
                count = int(np.searchsorted(need, width))
                if count:
                    total = cost[offsets[i] : offsets[i] + count, low:] + shifted[i : i + count, low:]
                    total += (forward_prefix[i : i + count] - forward_prefix[i - 1])[:, None]
                    steps = np.flatnonzero(np.diff(need[:count])) + 1
                    if len(steps) <= _MASK_STEPS:
                        for start, stop in zip(steps.tolist(), [*steps[1:].tolist(), count]):
                            total[start:stop, : int(need[start]) - low] = math.inf
                    else:
                        np.copyto(total, math.inf, where=m[None, low:] < need[:count, None])
                    rows = np.argmin(total, axis=0)
                    values = np.take_along_axis(total, rows[None], 0)[0]
                    better = values < best[low:]
                    np.copyto(best[low:], values, where=better)
                    np.copyto(picked[low:], i + rows, where=better, casting="unsafe")
            row = offsets[i] + j - i
            cost[row] = best
            choice[row] = picked
            if i > 1:
                shifted[i - 1] = _shift(best, int(x[i - 1]))
    whole = _shift(cost[offsets[1] + N - 1], int(x[0]))  # the limit counts a^0
    whole.setflags(write=False)
    return RotorTable(chain, memory_slots, memory_limit / memory_slots, whole, choice, offsets, sizes)


def sequences_at_limits(chain: RotorChain, limits, memory_slots: int | None = None) -> list[list[ChainOp] | None]:
    """rotor's optimal sequence at each memory limit of ``limits`` (bytes, ``a^0`` counted;
    None where none fits), from one table: column m of :func:`solve_chain`'s table is the
    optimum at m slots, so one solve in slots of ``max(limits) / memory_slots`` bytes
    answers every limit (each read at the most whole slots it holds). None (default): as
    many slots as hold the smallest limit in :data:`DEFAULT_SLOTS`, within
    :data:`MAX_TABLE_CELLS` and at least :data:`MIN_DEFAULT_SLOTS`.

    Raises:
        ArgumentError: no limit > 0, a bad ``memory_slots``, or a chain too long for the table.
    """
    positive = [float(limit) for limit in limits if is_number(limit) and limit > 0]
    if not positive:
        raise ArgumentError(f"limits must hold a number of bytes > 0, got {limits!r}")
    top = max(positive)
    if memory_slots is None:
        wanted = math.ceil(DEFAULT_SLOTS * top / min(positive))
        memory_slots = max(MIN_DEFAULT_SLOTS, min(wanted, _most_slots(chain.length, 1.0)))
    table = solve_chain(chain, top, memory_slots)
    sequences = []
    for limit in limits:
        slots = math.floor(limit / table.slot_bytes * (1 + 1e-12)) if is_number(limit) and limit > 0 else 0
        slots = min(slots, table.slots)
        sequences.append(table.sequence(slots) if math.isfinite(table.cost[slots]) else None)
    return sequences


# ----- training graphs -----


class GraphChain(NamedTuple):
    """A training graph as a chain (:func:`graph_chain`).

    Attributes:
        chain: the :class:`RotorChain`; its last stage is the loss.
        forward_units: per stage, its forward nodes (the loss stage has none).
        backward_units: per stage, its backward nodes, ascending (the loss stage: the loss).
    """

    chain: RotorChain
    forward_units: tuple[tuple[int, ...], ...]
    backward_units: tuple[tuple[int, ...], ...]


def _output_part(graph: DFGraph, node: int) -> int:
    """Bytes of ``node``'s value that its readers other than its backward node read."""
    return graph.part_bytes(node, "output" if graph.residual_bytes[node] else None)


def _forward_overheads(graph: DFGraph, unit: Sequence[int], backward: set, outputs: set, output_bytes: int,
                       stored_bytes: int) -> tuple[int, int]:
    """``o^f`` of a unit for ``F_ck``/``F_no`` and for ``F_all``: the most its forward run
    alone holds (a node's result and workspace, and what the unit made that a later member
    reads or the run keeps) beyond what it keeps at the end, ``a^l`` or ``abar^l``; at least
    0. For one node: its workspace plus, for ``F_no``, the residual bytes it makes and drops."""
    successors = graph.successors
    overheads = []
    for keep_all in (False, True):
        live: dict[tuple[int, str | None], int] = {}
        peak = 0
        for position, node in enumerate(unit):
            peak = max(peak, sum(live.values()) + graph.output_bytes[node] + graph.workspace_bytes[node])
            later = set(unit[position + 1 :])
            for part in graph.value_parts(node):
                live[(node, part)] = graph.part_bytes(node, part)
            for key in list(live):
                holder, part = key
                readers = [r for r in successors[holder] if graph.part_read_by(holder, r) == part]
                kept = (holder in outputs and part != "residual") or (keep_all and any(r in backward for r in readers))
                if not kept and not any(r in later for r in readers):
                    del live[key]
        overheads.append(max(0, peak - (stored_bytes if keep_all else output_bytes)))
    return overheads[0], overheads[1]


def _backward_peak(graph: DFGraph, unit: Sequence[int], forward: set) -> int:
    """The most a unit's backward nodes hold while one of them runs, run in id order: its
    result and workspace, the results of the unit's earlier backward nodes still read,
    and the unit's forward values and incoming gradients still read by it or a later one.
    Values of other stages' forward nodes are left out (the model counts ``a^{l-1}``)."""
    successors, predecessors = graph.successors, graph.predecessors
    position = {b: p for p, b in enumerate(unit)}
    inside = set(unit)
    last_read: dict[tuple[int, str | None], int] = {}  # forward parts and incoming gradients
    for p, b in enumerate(unit):
        for v in predecessors[b]:
            if v in forward or (graph.is_backward[v] and v not in inside):
                last_read[(v, graph.part_read_by(v, b))] = p
    live: dict[int, int] = {}
    peak = 0
    for p, node in enumerate(unit):
        held = sum(graph.part_bytes(v, part) for (v, part), last in last_read.items() if last >= p)
        peak = max(peak, held + sum(live.values()) + graph.output_bytes[node] + graph.workspace_bytes[node])
        live[node] = graph.output_bytes[node]
        for own in list(live):
            if not any(r not in inside or position[r] > p for r in successors[own]):
                del live[own]
    return peak


def graph_chain(graph: DFGraph, articulation: bool = False) -> GraphChain:
    """The chain the DP sees for a training graph (one with a loss node).

    Stages: the units of the linearized forward order (every forward node alone, or with
    ``articulation`` the blocks between forward articulation points), then the loss. Stage
    l's backward ``B_l`` is the backward nodes of its members (``forward_of``), in id order;
    the loss stage's is the loss node. For stage l with forward nodes U and backward nodes BU:

    * ``u_F``, ``u_B``: the summed costs of U and of BU (the loss stage: 0 and the loss's cost).
    * ``a^l`` (``output_bytes``): the output part (:attr:`DFGraph.residual_bytes`) of every
      node of U that a node outside U and BU reads: what the next stage reads, the checkpoint.
    * ``abar^l`` (``stored_bytes``): ``a^l`` plus every part of a node of U that BU reads
      and ``a^l`` does not hold: residual bytes, or values inside the unit its gradient reads.
    * ``delta^l`` (``gradient_bytes``): the larger of what BU_{l+1} hands on (its results read
      by backward nodes outside it) and what BU_l reads from backward nodes outside it (the
      loss's output included); ``delta^N`` is what the loss reads of gradients (none).
    * ``o^f``: the unit's forward run alone beyond ``a^l`` (``F_ck``, ``F_no``) or ``abar^l``
      (``F_all``; :func:`_forward_overheads`): a node's workspace, plus the residual bytes
      ``F_no`` makes and drops.
    * ``o^b``: the most BU holds while one of its nodes runs (its forward values and
      gradients still read, its own results, workspace; :func:`_backward_peak`) beyond
      ``abar^l + delta^l + delta^{l-1}``, at least 0: for one node, its workspace (and its
      result when no other gradient reads it).
    * ``a^0`` is 0: the batch is part of the graph's fixed bytes.

    What the model does not see: a forward value read by a stage other than the next one (a
    skip connection across units), a gradient's reads of forward values outside its own stage
    and the previous one (in Checkmate's graphs a gradient also reads the next layer's
    output), backward nodes without ``forward_of``. The simulator counts them all.

    Raises:
        ArgumentError: the graph has no loss node or no forward node.
    """
    if graph.loss_node is None or not graph.forward_nodes:
        raise ArgumentError(f"graph {graph.name!r} needs a loss node and forward nodes to be seen as a chain")
    order = _forward_order(graph)
    units = _units_between(graph, graph.forward_articulation_points) if articulation else [[v] for v in order]
    backward_units = [sorted(b for v in unit for b in graph.backward_nodes_of.get(v, ())) for unit in units]
    units.append([])
    backward_units.append([graph.loss_node])
    successors, predecessors = graph.successors, graph.predecessors
    N = len(units)
    fields = {name: np.zeros(N) for name in ("forward_cost", "backward_cost", "output_bytes", "stored_bytes",
                                             "forward_overhead", "forward_all_overhead")}
    backward_peak = np.zeros(N)
    gradient_in = np.zeros(N + 1)  # per stage l (index l): what BU_l reads of other backward nodes
    gradient_out = np.zeros(N + 1)  # per stage l: what BU_l hands on
    for index, (unit, bunit) in enumerate(zip(units, backward_units)):
        inside, backward = set(unit), set(bunit)
        outputs = {v for v in unit if any(r not in inside and r not in backward for r in successors[v])}
        x = sum(_output_part(graph, v) for v in outputs)
        extra = 0
        for v in unit:
            for part in {graph.part_read_by(v, r) for r in successors[v] if r in backward}:
                if part == "residual" or v not in outputs:
                    extra += graph.part_bytes(v, part)
        fields["forward_cost"][index] = sum(graph.cost[v] for v in unit)
        fields["backward_cost"][index] = sum(graph.cost[b] for b in bunit)
        fields["output_bytes"][index] = x
        fields["stored_bytes"][index] = x + extra
        fields["forward_overhead"][index], fields["forward_all_overhead"][index] = _forward_overheads(
            graph, unit, backward, outputs, x, x + extra)
        backward_peak[index] = _backward_peak(graph, bunit, inside)
        feeding = {p for b in bunit for p in predecessors[b] if graph.is_backward[p] and p not in backward}
        gradient_in[index + 1] = sum(graph.output_bytes[p] for p in feeding)
        gradient_out[index + 1] = sum(graph.output_bytes[b] for b in bunit
                                      if any(r not in backward for r in successors[b]))
    gradient = np.zeros(N + 1)
    gradient[N] = gradient_in[N]
    for stage in range(N):  # delta^stage: made by B_{stage+1}, read by B_stage
        gradient[stage] = max(gradient_out[stage + 1], gradient_in[stage] if stage else 0.0)
    # B_l holds abar^l, delta^l and delta^{l-1} in the model (besides a^{l-1}).
    held = fields["stored_bytes"] + gradient[1:] + gradient[:N]
    backward_overhead = np.maximum(0.0, backward_peak - held)
    chain = RotorChain(**fields, backward_overhead=backward_overhead, gradient_bytes=gradient, input_bytes=0.0)
    return GraphChain(chain, tuple(tuple(u) for u in units), tuple(tuple(b) for b in backward_units))


def sequence_keep_matrix(graph: DFGraph, mapped: GraphChain, ops: Sequence[ChainOp]) -> np.ndarray:
    """The keep matrix S that runs ``ops`` on the graph, from where the model computes values.

    Stages: before the loss's ``B`` (the forward phase) a forward of stage l computes its
    nodes in their own Checkmate stages; after it, a forward runs in the stage of the
    first backward node of the next backward in the sequence that has one (the stage the
    recomputed values are first read in). Every copy a forward makes of a node is kept from
    its stage until the last stage that reads it before the model computes the node again
    (readers: backward nodes in their stage, forward nodes wherever the model computes
    them), so ``F_ck``'s checkpoint lives until ``B`` frees it, ``F_all``'s stored values
    until their backward, ``F_no``'s until the next forward; a read the chain model does not
    see keeps the copy too. Gradients are kept until their last reader. ``solve R given S``
    (:func:`~tfremat.plan.schedule.schedule_from_keep_matrix`) then adds the computations.
    """
    n = graph.size
    units, backward_units = mapped.forward_units, mapped.backward_units
    loss_stage = len(units)
    try:
        loss_at = list(ops).index(ChainOp("B", loss_stage))
    except ValueError:
        raise ArgumentError(f"the sequence has no B^{loss_stage} (the loss)") from None
    stage_of = [0] * len(ops)
    running = n - 1
    for position in range(len(ops) - 1, -1, -1):
        kind, stage = ops[position]
        if kind == "B" and backward_units[stage - 1]:
            running = min(running, backward_units[stage - 1][0])
        stage_of[position] = running
    computed: dict[int, set[int]] = {v: {v} for v in graph.forward_nodes}
    for position, (kind, stage) in enumerate(ops):
        if kind != "B" and position > loss_at:
            for v in units[stage - 1]:
                computed[v].add(stage_of[position])
    S = np.zeros((n, n), dtype=bool)
    for v in graph.forward_nodes:
        reads = sorted({t for r in graph.successors[v] for t in (computed.get(r, {r}))})
        copies = sorted(computed[v])
        for made, again in zip(copies, copies[1:] + [n]):
            lo = bisect.bisect_right(reads, made)
            hi = bisect.bisect_left(reads, again)
            if hi > lo:
                S[made + 1 : reads[hi - 1] + 1, v] = True
    for g in graph.backward_nodes:
        if graph.successors[g]:
            S[g + 1 : max(graph.successors[g]) + 1, g] = True
    return S


# ----- the strategies -----


def _rotor(graph: DFGraph, budget: int | None, memory_slots: int | None, articulation: bool) -> Schedule:
    name = "rotor_ap" if articulation else "rotor"
    if memory_slots is not None:
        _check_slots(memory_slots)
    if graph.loss_node is None or not graph.forward_nodes:
        # No backward pass to schedule: the chain model has nothing to trade.
        return cheapest_fitting(graph, [schedule_for_checkpoints(graph, _forward_order(graph), name)], budget, name)
    mapped = graph_chain(graph, articulation)
    N = mapped.chain.length
    memory_slots = _resolve_slots(memory_slots, N, budget, name)

    def schedule_of(ops) -> Schedule:
        return schedule_from_keep_matrix(graph, sequence_keep_matrix(graph, mapped, ops), name)

    def candidates() -> Iterator[Schedule]:
        # Keeping everything is the cheap end; when it fits nothing is cheaper.
        everything = schedule_of(keep_everything_sequence(N))
        yield everything
        reference = known_peak(graph, everything)
        if budget is not None and reference <= budget:
            return
        # Weight gradients held to the end (DFGraph.weight_grads_to_end) are in the chain
        # only in their own backward node's workspace; the limits below are tried down to
        # the smallest feasible and the simulator, which holds them, judges each schedule.
        activations = reference - graph.fixed_bytes
        if activations <= 0:
            return
        try:
            if budget is None or budget <= graph.fixed_bytes:
                yield from _lowest_peak(graph, mapped, activations, memory_slots, schedule_of)
                return
            found = yield from _around_budget(graph, mapped, budget, memory_slots, schedule_of)
            if not found:
                # Nothing fits near the budget: the least-memory schedules tell the caller
                # how far off it is (the error's smallest peak).
                yield from _lowest_peak(graph, mapped, activations, memory_slots, schedule_of)
        except _OutOfTime:
            # The DP passed the deadline: cheapest_fitting returns the best schedule so far,
            # or says the time ran out, with the smallest peak it simulated.
            return

    return cheapest_fitting(graph, candidates(), budget, name)


def _table_slots(memory_slots: int, budget: int | None) -> int:
    """Slots of the table: ``memory_slots`` over the budget's activation memory, plus the
    headroom above it (none without a budget)."""
    return memory_slots if budget is None else int(memory_slots * (1 + _HEADROOM))


def _lowest_peak(graph: DFGraph, mapped: GraphChain, activations: int, memory_slots: int, schedule_of):
    """Without a budget: the DP's least-memory sequences, at the smallest limit that fits
    and a few above it, each a candidate; the caller keeps the lowest simulated peak. The
    table's top is the larger of the checkpoint-all peak's activation bytes and the model's
    peak of keeping everything (the model may count more than the simulator), so that some
    sequence fits it."""
    everything = run_sequence(mapped.chain, keep_everything_sequence(mapped.chain.length)).peak_bytes
    table = solve_chain(mapped.chain, max(activations, everything), memory_slots)
    low = table.min_slots
    if low is None:
        return
    seen = set()
    for extra in (0, 1, 2, 4, 8, 16, 32):
        slots = min(low + extra, table.slots)
        ops = tuple(table.sequence(slots))
        if ops not in seen:
            seen.add(ops)
            yield schedule_of(ops)


def _around_budget(graph: DFGraph, mapped: GraphChain, budget: int, memory_slots: int, schedule_of):
    """With a budget: the DP's sequences at memory limits around the budget's activation
    bytes (``budget - fixed_bytes`` in ``memory_slots`` slots; the table reaches 25% above).
    The simulated peak is not monotone in the limit (the model misses what DAG edges keep),
    so limits on a grid from the smallest feasible one to the table's top are tried, then
    the gap between the largest that fitted and the next above it is bisected. Yields each
    schedule (one per distinct sequence); returns whether one fitted."""
    limit = budget - graph.fixed_bytes
    slots = _table_slots(memory_slots, budget)
    table = solve_chain(mapped.chain, limit * slots / memory_slots, slots)
    low = table.min_slots
    if low is None:
        return False
    peaks: dict[tuple, int] = {}
    peak_at: dict[int, int] = {}

    def tried(m: int):
        ops = tuple(table.sequence(m))
        fresh = ops not in peaks
        if fresh:
            schedule = schedule_of(ops)
            peaks[ops] = known_peak(graph, schedule)
        peak_at[m] = peaks[ops]
        return schedule if fresh else None

    grid = np.unique(np.round(np.linspace(low, table.slots, _GRID_LIMITS)).astype(int))
    for m in sorted({*grid.tolist(), min(max(low, memory_slots), table.slots)}):
        schedule = tried(m)
        if schedule is not None:
            yield schedule
    fitting = [m for m, peak in peak_at.items() if peak <= budget]
    if not fitting:
        return False
    fits = max(fitting)
    above = [m for m in peak_at if m > fits]
    fails = min(above) if above else None
    for _ in range(_BISECTIONS):
        if fails is None or fails - fits <= 1:
            break
        middle = (fits + fails) // 2
        schedule = tried(middle)
        if schedule is not None:
            yield schedule
        if peak_at[middle] <= budget:
            fits = middle
        else:
            fails = middle
    logger.debug("rotor: %d sequences tried around %d bytes; the largest limit that fitted is %d slots of %.0f bytes",
                 len(peaks), budget, fits, table.slot_bytes)
    return True


@as_strategy("rotor")
def rotor(graph: DFGraph, budget: int | None = None, memory_slots: int | None = None) -> Schedule:
    """Beaumont et al.'s optimal recompute-only chain schedule (rotor) over the linearized
    forward order, every forward node a stage.

    The DP of appendix B.3 without offloading (module docstring) solves the chain
    :func:`graph_chain` reads off the graph; each sequence becomes a schedule through
    :func:`sequence_keep_matrix`. With a budget, the memory limit is the budget less the
    fixed bytes, in ``memory_slots`` slots; since the chain model is an approximation of the
    simulator (DAG edges across stages, reads it does not see), a few limits around it are
    tried (lower where the simulated peak overflows, higher where it leaves room) and the
    cheapest schedule whose simulated peak fits is returned, keep-everything when it fits.
    Without a budget, the lowest simulated peak among the DP's least-memory sequences
    (limits from the smallest feasible one up, in slots of the checkpoint-all peak's
    activation bytes). A graph without a loss node has no backward pass to schedule: it
    keeps everything.

    Args:
        memory_slots: how many slots the memory limit is split into (an int >= 1): more is
            finer and slower (O(N^3 memory_slots) time and O(N^2 memory_slots) memory for N
            stages; the table holds at most :data:`MAX_TABLE_CELLS` cells). None (default):
            :data:`DEFAULT_SLOTS`, or as many as the table holds on a long chain, at least
            :data:`MIN_DEFAULT_SLOTS`.

    Raises:
        ArgumentError: ``memory_slots`` not None or an int >= 1, or too many for this graph's
            table; without a budget, a chain too long for :data:`MIN_DEFAULT_SLOTS`.
        InfeasibleBudgetError: no tried schedule fits (it carries the smallest simulated
            peak), or, with a budget, a chain too long for :data:`MIN_DEFAULT_SLOTS`.
    """
    return _rotor(graph, budget, memory_slots, articulation=False)


@as_strategy("rotor_ap")
def rotor_ap(graph: DFGraph, budget: int | None = None, memory_slots: int | None = None) -> Schedule:
    """:func:`rotor` whose stages are the blocks between forward articulation points: a
    checkpoint is then always a value the rest of the forward pass reads alone."""
    return _rotor(graph, budget, memory_slots, articulation=True)
