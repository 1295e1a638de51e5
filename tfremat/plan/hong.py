"""Hong et al.'s checkpoint selection for chains, as published, and the ``hong`` strategies.

Hong, Tsai, Wang, Liu and Wu, "GPU Memory Usage Optimization for Backward Propagation in
Deep Network Training" (``shared/papers/003_ac913870907ea453.txt``). A chain of data
``d_0 .. d_n`` (``d_0`` the input, ``d_n`` the output; both are checkpoints, sec. 3.1) is
split by a checkpoint subset C into segments of non-checkpoints that the backward pass
recomputes from the checkpoint before them. The paper minimizes the *modeled peak* over C,
under two memory models:

* **classic** (sec. 3.1, Eq. 6, after Chen et al.'s Algorithm 2): every checkpoint stays
  resident, plus the largest segment: ``sum(C) + max_segment sum(segment)``. Solved exactly
  by Algorithm 3 (Eq. 8: for each possible segment memory s, the least checkpoint memory
  ``c_s``; the answer is ``min_s s + c_s``), O(n^3) by Theorem 1.
* **eager** (sec. 4, Algorithm 4, Eqs. 9-12): a framework that frees each value after its
  last use (PyTorch; TensorFlow does the same) and keeps an output-gradient buffer the size
  of the largest datum of the segment and its left checkpoint. Reversing the segment that
  ends at checkpoint i, with h the checkpoint before it, holds
  ``m(i) = sum(C up to i) + sum(d_{h+1} .. d_{i-1}) + max(d_h .. d_{i-1})`` (Eqs. 9, 11,
  12); the modeled peak is the largest m(i). Solved by the O(n^2) DP of Algorithm 5
  (Eq. 13) and the O(n) DP of Algorithm 6 (Eqs. 14-16, Lemmas 1-4, Theorem 3).

The pure functions here take the sizes as a sequence (``sizes[0]`` is d_0) and, optionally,
a mask of positions allowed to be checkpoints (the ends always are): that is how the
articulation-point variant forbids checkpoints inside a block. They return the positions of
an optimal subset (ends included) and its modeled peak.

The strategies ``hong`` and ``hong_ap`` apply the DP to a training graph's linearized
forward order (every forward node a candidate) or to its forward articulation points, with
``d_0`` a virtual input of 0 bytes (the batch is part of the graph's fixed memory). The
paper's subset minimizes the *modeled* peak and ignores compute; the simulator decides what
the schedule really holds (:func:`hong_prediction` gives both numbers;
``benchmarks/hong.py`` compares them).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from tfremat.errors import ArgumentError
from tfremat.graph import DFGraph
from tfremat.plan.baselines import (
    _forward_order,
    _OutOfTime,
    cheapest_fitting,
    out_of_time_error,
    schedule_for_checkpoints,
    time_is_up,
)
from tfremat.plan.registry import as_strategy
from tfremat.plan.schedule import Schedule

__all__ = [
    "MEMORY_MODELS",
    "CLASSIC_MAX_LAYERS",
    "ChainCheckpoints",
    "HongPrediction",
    "classic_peak",
    "eager_peak",
    "classic_checkpoints",
    "eager_checkpoints_quadratic",
    "eager_checkpoints",
    "hong_prediction",
    "hong",
    "hong_ap",
]

logger = logging.getLogger(__name__)

MEMORY_MODELS = ("eager", "classic")

# Algorithm 3 sweeps the whole chain once per possible segment memory (O(n^2) of them).
# Most sweeps stop early (see _classic_sweep), but a chain that defeats that takes about
# 30 s at n = 1000 layers on a 2-core CPU and 7 min at 2000: longer chains are refused.
CLASSIC_MAX_LAYERS = 1000

# Floats in the vectorized Algorithm 3's range-minimum table, (log2 n) x n x (segment
# memories swept at once): 32 MiB.
_SWEEP_CELLS = 1 << 22


class ChainCheckpoints(NamedTuple):
    """An optimal checkpoint subset of a chain under one of the paper's memory models.

    Attributes:
        positions: the checkpoints, ascending, the first and last position included.
        peak: the modeled peak of that subset (Eq. 6 or Eq. 12), in the sizes' unit.
    """

    positions: tuple[int, ...]
    peak: float


class HongPrediction(NamedTuple):
    """Hong et al.'s checkpoint subset of a graph and the peak their memory model predicts.

    Attributes:
        checkpoints: forward node ids kept as checkpoints.
        predicted_peak_bytes: the graph's fixed bytes plus the modeled peak of the subset,
            to compare with the simulated peak of the same subset (which counts fixed
            bytes too).
    """

    checkpoints: tuple[int, ...]
    predicted_peak_bytes: int


# ----- checking the pure functions' arguments -----


def _sizes(sizes) -> np.ndarray:
    try:
        array = np.asarray(sizes, dtype=float)
    except (TypeError, ValueError):
        raise ArgumentError(f"sizes must be a sequence of numbers >= 0 (one per chain position), got {sizes!r}") from None
    if array.ndim != 1 or array.size == 0:
        raise ArgumentError(f"sizes must be a non-empty 1-D sequence (one size per chain position), got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ArgumentError("sizes must be finite numbers >= 0")
    return array


def _allowed(candidates, length: int) -> np.ndarray:
    """The candidate mask with both ends set (sec. 3.1: d_0 and d_n are always checkpoints)."""
    if candidates is None:
        return np.ones(length, dtype=bool)
    mask = np.asarray(candidates)
    if mask.dtype != bool or mask.shape != (length,):
        raise ArgumentError(f"candidates must be a boolean mask with one entry per chain position ({length}), "
                            f"got {mask.dtype} of shape {mask.shape}")
    mask = mask.copy()
    mask[0] = mask[-1] = True
    return mask


def _positions(checkpoints, length: int) -> list[int]:
    chosen = {0, length - 1}
    for p in checkpoints:
        if not (isinstance(p, (int, np.integer)) and 0 <= p < length):
            raise ArgumentError(f"checkpoints must be chain positions 0..{length - 1}, got {p!r}")
        chosen.add(int(p))
    return sorted(chosen)


# ----- the two memory models -----


def classic_peak(sizes: Sequence[float], checkpoints: Sequence[int]) -> float:
    """The classic model's peak of a checkpoint subset (sec. 3.1, Eq. 6).

    ``sum of the checkpoints + the largest segment``, a segment being the non-checkpoints
    between two consecutive checkpoints (0 when every segment is empty).

    Args:
        sizes: d_0 .. d_n, the size of each chain position.
        checkpoints: positions kept; the first and last are added if missing.

    Raises:
        ArgumentError: sizes not finite numbers >= 0, or a position outside the chain.
    """
    d = _sizes(sizes)
    chosen = _positions(checkpoints, len(d))
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    segment = max((prefix[b] - prefix[a + 1] for a, b in itertools.pairwise(chosen)), default=0.0)
    return float(d[chosen].sum() + segment)


def eager_peak(sizes: Sequence[float], checkpoints: Sequence[int]) -> float:
    """The eager-free model's peak of a checkpoint subset (sec. 4, Alg. 4, Eqs. 9-12).

    For consecutive checkpoints h < i, reversing the segment between them holds every
    checkpoint up to i, the recomputed segment d_{h+1} .. d_{i-1} and an output-gradient
    buffer of ``max(d_h .. d_{i-1})``: ``m(i) = sum(C(i)) + s(h, i)`` (Eqs. 11, 12). The
    peak is the largest m(i); the memory between checkpoints only falls (Eq. 10). A chain
    of one position holds just d_0.

    Args:
        sizes: d_0 .. d_n.
        checkpoints: positions kept; the first and last are added if missing.

    Raises:
        ArgumentError: sizes not finite numbers >= 0, or a position outside the chain.
    """
    d = _sizes(sizes)
    chosen = _positions(checkpoints, len(d))
    if len(d) == 1:
        return float(d[0])
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    peak, kept = 0.0, d[0]
    for h, i in itertools.pairwise(chosen):
        kept += d[i]
        peak = max(peak, kept + prefix[i] - prefix[h + 1] + d[h:i].max())
    return float(peak)


# ----- the classic model: Algorithm 3 -----


def _segment_memories(d: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Every segment memory a subset can have, ascending (Theorem 1's O(n^2) values): the
    bytes strictly between two candidate positions, and 0."""
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    where = np.flatnonzero(allowed)
    # A segment between candidates a < b holds positions a+1 .. b-1: prefix[b] - prefix[a+1].
    sums = prefix[where][None, :] - prefix[where + 1][:, None]
    upper = np.triu_indices(len(where), k=1)
    return np.unique(np.concatenate([[0.0], sums[upper]]))


def _classic_queue(d: np.ndarray, allowed: np.ndarray, s: float) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 3's inner loop for one segment memory s, with its monotone queue.

    ``M[i]`` (Eq. 8) is the least checkpoint memory of d_0 .. d_i whose segments, the
    trailing run after the last checkpoint included, hold at most s; ``M[-1]`` stands for
    M(-1) = 0 so that M(0) = d_0. The queue Q holds the j's of the window
    ``l(i) <= j <= i`` in increasing order of ``d_j + M(j - 1)``; its head is the argmin
    (ties: the earliest j, as the paper removes only strictly larger tails). Returns
    ``(M, last)`` for i = 0 .. n - 1, ``last[i]`` the argmin j (-1: infeasible).

    i joins Q before M(i) is read from its head, as Eq. 8's range ``j <= i`` requires (the
    pseudo-code adds i after setting M(i), which would leave out j = i).
    """
    n = len(d) - 1
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    # l(i): the least j with d_{j+1} + .. + d_i <= s, that is prefix[j+1] >= prefix[i+1] - s.
    window_start = np.maximum(np.searchsorted(prefix, prefix[1 : n + 1] - s, side="left") - 1, 0)
    M = np.full(n + 1, math.inf)  # M[n] is M(-1), which M[j - 1] reaches at j = 0
    M[n] = 0.0
    last = np.full(n, -1)
    queue: list[int] = []
    head = 0
    for i in range(n):
        if allowed[i]:
            value = d[i] + M[i - 1]
            while len(queue) > head and d[queue[-1]] + M[queue[-1] - 1] > value:
                queue.pop()
            queue.append(i)
        while len(queue) > head and queue[head] < window_start[i]:
            head += 1
        if len(queue) > head:
            q = queue[head]
            M[i] = d[q] + M[q - 1]
            last[i] = q
    return M[:n], last


def _classic_sweep(d: np.ndarray, allowed: np.ndarray, memories: np.ndarray) -> np.ndarray:
    """Algorithm 3's step 1 for many segment memories at once: ``c_s = d_n + M(n - 1, s)``.

    The same recurrence (Eq. 8) as :func:`_classic_queue`, vectorized over s: the window
    minimum over ``l(i) <= j <= i`` comes from a sparse range-minimum table that grows a row
    per position, where the paper keeps one monotone queue per s (the same values, a log n
    factor more work, and numpy instead of a Python loop per s). ``memories`` ascending;
    once a chunk's smallest s gives ``s + d_0 + d_n`` no less than the least ``s + c_s`` so
    far, the rest are skipped (left inf): both ends are checkpoints, so ``c_s >= d_0 + d_n``
    and none of them can do better. Under a heuristic deadline it raises
    ``_OutOfTime``.
    """
    n = len(d) - 1
    out = np.full(len(memories), math.inf)
    if n == 0:
        out[:] = d[0]
        return out
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    levels = n.bit_length()  # 2 ** (levels - 1) <= n
    chunk = max(16, _SWEEP_CELLS // (levels * n))
    stop_at = math.inf
    for begin in range(0, len(memories), chunk):
        if time_is_up(allow_step=False):
            raise _OutOfTime
        s = memories[begin : begin + chunk]
        if s[0] + d[0] + d[n] >= stop_at:
            break
        width = len(s)
        columns = np.arange(width)
        table = np.full((levels, n, width), math.inf)
        M_previous = np.zeros(width)  # M(i - 1, s); M(-1) = 0
        for i in range(n):
            row = d[i] + M_previous if allowed[i] else np.full(width, math.inf)
            table[0, i] = row
            for k in range(1, levels):
                start = i - (1 << k) + 1
                if start < 0:
                    break
                np.minimum(table[k - 1, start], table[k - 1, start + (1 << (k - 1))], out=table[k, start])
            start = np.maximum(np.searchsorted(prefix, prefix[i + 1] - s, side="left") - 1, 0)
            k = np.floor(np.log2(i - start + 1)).astype(int)
            M_previous = np.minimum(table[k, start, columns], table[k, i - (1 << k) + 1, columns])
        out[begin : begin + width] = d[n] + M_previous
        stop_at = min(stop_at, float(np.min(s + out[begin : begin + width])))
    return out


def classic_checkpoints(sizes: Sequence[float], candidates: Sequence[bool] | None = None) -> ChainCheckpoints:
    """The subset of least classic-model peak (Eq. 6): Algorithm 3, O(n^3) (Theorem 1).

    For each possible segment memory s (the bytes between two candidate positions, or 0),
    the least checkpoint memory ``c_s`` whose segments fit in s (Eq. 8); the answer is the s
    of least ``s + c_s`` (the smallest on ties), its subset rebuilt by Algorithm 3's
    monotone queue. Both ends are checkpoints (sec. 3.1), so ``c_s = d_n + M(n - 1, s)``.

    Args:
        sizes: d_0 .. d_n.
        candidates: which positions may be checkpoints (a bool per position; the ends
            always are); None: every position.

    Raises:
        ArgumentError: bad sizes or mask, or n > :data:`CLASSIC_MAX_LAYERS` (the O(n^3)
            sweep would take minutes).
    """
    d = _sizes(sizes)
    allowed = _allowed(candidates, len(d))
    if len(d) - 1 > CLASSIC_MAX_LAYERS:
        raise ArgumentError(
            f"memory_model='classic' runs Algorithm 3, O(n^3), on chains of at most {CLASSIC_MAX_LAYERS} "
            f"layers after the input; this one has {len(d) - 1}: use memory_model='eager' (Algorithm 6, O(n))"
        )
    n = len(d) - 1
    if n == 0:
        return ChainCheckpoints((0,), float(d[0]))
    memories = _segment_memories(d, allowed)
    totals = memories + _classic_sweep(d, allowed, memories)
    best = int(np.argmin(totals))
    _, last = _classic_queue(d, allowed, memories[best])
    positions, i = [n], n - 1
    while i >= 0:
        j = int(last[i])
        positions.append(j)
        i = j - 1
    positions = tuple(sorted(positions))
    return ChainCheckpoints(positions, float(totals[best]))


# ----- the eager-free model: Algorithms 5 and 6 -----


def _range_max_table(d: np.ndarray) -> list[np.ndarray]:
    """Sparse table: ``table[k][a] = max(d[a : a + 2**k])``."""
    table = [d]
    width = 1
    while 2 * width <= len(d):
        previous = table[-1]
        table.append(np.maximum(previous[: len(previous) - width], previous[width:]))
        width *= 2
    return table


def _range_max(table: list[np.ndarray], a: int, b: int) -> float:
    """``max(d[a : b + 1])`` for a <= b."""
    k = (b - a + 1).bit_length() - 1
    return max(table[k][a], table[k][b - (1 << k) + 1])


def _walk(next_checkpoint: Sequence[int], n: int) -> tuple[int, ...]:
    positions, i = [0], 0
    while i != n:
        i = int(next_checkpoint[i])
        positions.append(i)
    return tuple(positions)


def eager_checkpoints_quadratic(sizes: Sequence[float], candidates: Sequence[bool] | None = None) -> ChainCheckpoints:
    """The subset of least eager-model peak (Eq. 12) by Algorithm 5, O(n^2) (Theorem 2).

    ``M(i)`` is the least peak from checkpoint i to the end, counting checkpoints from i
    on; ``M(n) = d_n`` and (Eq. 13)
    ``M(i) = min_j max(d_i + M(j), d_i + s(i, j) + d_j)`` over the next checkpoint j,
    ``i < j <= n`` (Algorithm 5's loop; Eq. 13's ``j < n`` would leave M(n - 1) without
    a choice). The answer is M(0). The inner loop over j is one numpy expression; ties go
    to the nearest j.

    Args:
        sizes: d_0 .. d_n.
        candidates: which positions may be checkpoints; None: every position.

    Raises:
        ArgumentError: bad sizes or mask.
    """
    d = _sizes(sizes)
    allowed = _allowed(candidates, len(d))
    n = len(d) - 1
    if n == 0:
        return ChainCheckpoints((0,), float(d[0]))
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    M = np.full(n + 1, math.inf)
    M[n] = d[n]
    nxt = np.full(n + 1, -1)
    for i in range(n - 1, -1, -1):
        if not allowed[i]:
            continue
        j = np.arange(i + 1, n + 1)
        # s(i, j) = d_{i+1} + .. + d_{j-1} + max(d_i .. d_{j-1})  (Eq. 11)
        s = prefix[j] - prefix[i + 1] + np.maximum.accumulate(d[i:n])
        options = np.maximum(M[j], s + d[j])
        best = int(np.argmin(options))
        M[i] = d[i] + options[best]
        nxt[i] = i + 1 + best
    return ChainCheckpoints(_walk(nxt, n), float(M[0]))


def eager_checkpoints(sizes: Sequence[float], candidates: Sequence[bool] | None = None) -> ChainCheckpoints:
    """The subset of least eager-model peak (Eq. 12) by Algorithm 6, O(n) (Theorem 3).

    ``M(i) = d_i + min_j max(M(j), U(i, j))`` with ``U(i, j) = s(i, j) + d_j`` (Eqs. 15,
    16), computed for i from n down to 0 with the monotone queue Q: after M(i), every M
    at Q's head that is no less than M(i) is dropped and M(i) becomes the head, so along Q
    (head to tail) indices rise and M falls (Lemma 2), and only Q's j's need be tried
    (Lemma 3). U(i, .) rises along Q (Lemma 1), so the best j is one of the two around
    the crossing of U and M; the crossing moves only toward the head as i falls (Lemma 4),
    so the search starts from the previous best j* and walks toward the head while
    ``U(i, j) >= M(j)`` (lines 4-14).

    Differences from the pseudo-code, none changing its result: ``j + 1`` in lines 13-14
    is the element after j in Q; a j* that left Q restarts the walk at its head (the
    crossing is then at the head or just after it); ties keep the nearer j. U's
    ``max(d_i .. d_{j-1})`` comes from a range-maximum table (O(n log n) to build) because
    the running maximum of line 10 cannot drop the elements the walk leaves behind.

    Args:
        sizes: d_0 .. d_n.
        candidates: which positions may be checkpoints; None: every position. Lemmas 1-4
            hold over any subset of positions, so Q simply never holds a non-candidate.

    Raises:
        ArgumentError: bad sizes or mask.
    """
    d = _sizes(sizes)
    allowed = _allowed(candidates, len(d))
    n = len(d) - 1
    if n == 0:
        return ChainCheckpoints((0,), float(d[0]))
    prefix = np.concatenate([[0.0], np.cumsum(d)]).tolist()
    table = _range_max_table(d)
    values = d.tolist()

    def U(i: int, j: int) -> float:
        return prefix[j] - prefix[i + 1] + _range_max(table, i, j - 1) + values[j]

    M = [math.inf] * (n + 1)
    nxt = [-1] * (n + 1)
    M[n] = values[n]
    # Q as a list from its tail (index 0, the largest j) to its head (the end): the queue
    # changes only at its head, so a position in this list stays valid while it exists.
    queue = [n]
    best_at = 0  # j*: a position in ``queue``
    for i in range(n - 1, -1, -1):
        if not allowed[i]:
            continue
        p = min(best_at, len(queue) - 1)
        u = U(i, queue[p])
        while u >= M[queue[p]] and p < len(queue) - 1:
            p += 1
            u = U(i, queue[p])
        best, chosen = max(M[queue[p]], u), p
        if p > 0:
            after = max(M[queue[p - 1]], U(i, queue[p - 1]))
            if after < best:
                best, chosen = after, p - 1
        M[i] = values[i] + best
        nxt[i] = queue[chosen]
        best_at = chosen
        while queue and M[queue[-1]] >= M[i]:
            queue.pop()
        queue.append(i)
    return ChainCheckpoints(_walk(nxt, n), float(M[0]))


# ----- training graphs -----


def _check_memory_model(memory_model) -> None:
    if not isinstance(memory_model, str) or memory_model not in MEMORY_MODELS:
        raise ArgumentError(
            f"memory_model must be 'eager' (Hong et al.'s model of a framework that frees values after their "
            f"last use, Algorithm 4, Eqs. 9-12) or 'classic' (Eq. 6, Chen et al.'s), got {memory_model!r}"
        )


def _graph_chain(graph: DFGraph, articulation: bool) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The forward order, and the chain d_0 .. d_n the paper's DPs see: a virtual input of
    0 bytes (the batch is counted in the graph's fixed bytes), then every forward node's
    output; with ``articulation``, only forward articulation points may be checkpoints."""
    order = _forward_order(graph)
    sizes = np.array([0.0] + [graph.output_bytes[i] for i in order])
    if articulation:
        points = set(graph.forward_articulation_points)
        allowed = np.array([True] + [i in points for i in order])
    else:
        allowed = np.ones(len(sizes), dtype=bool)
    return order, sizes, allowed


def _solve(sizes: np.ndarray, allowed: np.ndarray, memory_model: str) -> ChainCheckpoints:
    if memory_model == "classic":
        return classic_checkpoints(sizes, allowed)
    return eager_checkpoints(sizes, allowed)


def hong_prediction(graph: DFGraph, memory_model: str = "eager", articulation: bool = False) -> HongPrediction:
    """Hong et al.'s checkpoint subset of ``graph`` and the peak their model predicts for it.

    The chain is the linearized forward order (``articulation``: only the forward
    articulation points may be checkpoints) behind a virtual input of 0 bytes; the last
    forward node is always a checkpoint (sec. 3.1). The prediction is the graph's fixed
    bytes plus the modeled peak (Eq. 12 for "eager", Eq. 6 for "classic"); simulate
    ``schedule_for_checkpoints(graph, checkpoints, ...)`` for the peak the schedule has.
    Within a :func:`~tfremat.plan.baselines.heuristic_deadline` the classic DP stops at the
    deadline (the strategies turn that into the time-limit ``InfeasibleBudgetError``).

    Raises:
        ArgumentError: unknown ``memory_model``, or a chain too long for the classic model
            (:data:`CLASSIC_MAX_LAYERS`).
    """
    _check_memory_model(memory_model)
    order, sizes, allowed = _graph_chain(graph, articulation)
    if not order:
        return HongPrediction((), int(graph.fixed_bytes))
    found = _solve(sizes, allowed, memory_model)
    checkpoints = tuple(order[p - 1] for p in found.positions if p > 0)
    return HongPrediction(checkpoints, int(graph.fixed_bytes + round(found.peak)))


def _hong(graph: DFGraph, budget: int | None, memory_model: str, articulation: bool) -> Schedule:
    name = "hong_ap" if articulation else "hong"
    _check_memory_model(memory_model)
    order = _forward_order(graph)
    if not order:
        return cheapest_fitting(graph, [schedule_for_checkpoints(graph, [], name)], budget, name)
    try:
        subset, predicted = hong_prediction(graph, memory_model, articulation)
    except _OutOfTime:
        raise out_of_time_error(budget, None, name) from None
    logger.debug("%s: %d checkpoints of %d forward nodes, %s model's peak %d bytes", name, len(subset), len(order),
                 memory_model, predicted)

    def candidates():
        # The paper's subset minimizes the modeled peak and never compute; keeping every
        # forward value is the cheap end, so a budget that allows it recomputes nothing.
        yield schedule_for_checkpoints(graph, order, name)
        yield schedule_for_checkpoints(graph, subset, name)

    return cheapest_fitting(graph, candidates(), budget, name)


@as_strategy("hong", fixed_candidates=True)
def hong(graph: DFGraph, budget: int | None = None, memory_model: str = "eager") -> Schedule:
    """Hong et al.'s optimal checkpoint subset of the linearized forward chain.

    The subset of least modeled peak: Algorithm 6 (O(n)) for ``memory_model="eager"``, the
    model of a framework that frees values after their last use and keeps a per-segment
    output-gradient buffer (Eqs. 9-12; the paper measured 2.8% error against PyTorch);
    Algorithm 3 (O(n^3), at most :data:`CLASSIC_MAX_LAYERS` forward nodes) for ``"classic"``
    (Eq. 6). The candidates are that subset and keep-everything; the
    simulator judges both. With a budget, the cheaper that fits (keep-everything when it
    does); without one, the lower simulated peak. The subset is memory-optimal under the
    paper's model only: the simulator counts gradients, workspaces and DAG edges that the
    chain model does not, and no subset between the two ends is tried.

    Args:
        memory_model: "eager" (default) or "classic".

    Raises:
        ArgumentError: unknown ``memory_model``; "classic" on a chain that is too long.
        InfeasibleBudgetError: neither candidate fits; it carries the smaller peak.
    """
    return _hong(graph, budget, memory_model, articulation=False)


@as_strategy("hong_ap", fixed_candidates=True)
def hong_ap(graph: DFGraph, budget: int | None = None, memory_model: str = "eager") -> Schedule:
    """:func:`hong` with checkpoints restricted to the forward articulation points.

    The chain is still the whole forward order (the blocks between articulation points are
    its segments), but only articulation points may be checkpoints.
    """
    return _hong(graph, budget, memory_model, articulation=True)
