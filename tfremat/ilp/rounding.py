"""Checkmate's two-phase rounding of an LP solution into schedules (Jain et al., MLSys 2020, sec. 5).

Phase one rounds the fractional keep matrix S* (a deterministic threshold sweep, then
randomized rounding); phase two completes each rounded S with the cheapest R
(:func:`~tfremat.plan.schedule.solve_r_given_s`). ``approx_lp`` returns the cheapest
rounding that fits; ``optimal`` lets one compete with the baselines for its warm start.
"""

from __future__ import annotations

import time

import numpy as np

from tfremat.ilp.formulation import CheckmateModel
from tfremat.plan.schedule import Schedule, schedule_from_keep_matrix
from tfremat.plan.simulator import simulate

__all__ = ["round_candidates", "cheapest_rounding", "cheaper_rounding"]

# Randomized roundings tried when an LP's rounding competes for ``optimal``'s schedule.
_COMPETING_SAMPLES = 16


def round_candidates(model: CheckmateModel, x: np.ndarray, num_samples: int, rng: np.random.Generator):
    """Checkmate's rounding of the fractional keep matrix S* of the LP point ``x``: a
    deterministic threshold sweep, then randomized rounding (keep i with probability
    S*[t, i]); each distinct keep matrix once."""
    fractional = np.zeros(model.s_index.shape)
    mask = model.s_index >= 0
    fractional[mask] = np.clip(x[model.s_index[mask]], 0.0, 1.0)
    seen = set()
    thresholds = np.linspace(0.05, 0.95, 19)
    draws = (rng.random(fractional.shape) < fractional for _ in range(num_samples))
    for S in (*(fractional >= threshold for threshold in thresholds), *draws):
        key = np.packbits(S).tobytes()
        if key not in seen:
            seen.add(key)
            yield S


def cheapest_rounding(
    model: CheckmateModel, x: np.ndarray, budget_bytes: int, num_samples: int, rng: np.random.Generator,
    strategy: str, deadline: float | None = None, cost_to_beat: float | None = None,
) -> tuple[Schedule | None, int | None]:
    """The cheapest rounding of the LP point ``x`` (completed by solve R given S) whose
    simulated peak fits ``budget_bytes`` (the user's budget: approx_lp builds its model for
    a smaller allowance), or None, and the smallest peak of any rounding simulated. Stops at
    ``deadline`` (a ``time.perf_counter()`` time) after the first rounding.

    With ``cost_to_beat`` only roundings cheaper than it count: the others are not
    simulated (their cost is known from R alone), so the smallest peak is over the cheaper
    ones (None when there are none)."""
    graph = model.graph
    best, best_cost, smallest_peak = None, cost_to_beat, None
    for S in round_candidates(model, x, num_samples, rng):
        schedule = schedule_from_keep_matrix(graph, S, strategy)
        cost = schedule.cost(graph)
        if best_cost is None or cost < best_cost:
            peak = simulate(graph, schedule).peak_bytes
            smallest_peak = peak if smallest_peak is None else min(smallest_peak, peak)
            if peak <= budget_bytes:
                best, best_cost = schedule, cost
        if deadline is not None and time.perf_counter() > deadline:
            break
    return best, smallest_peak


def cheaper_rounding(model: CheckmateModel, lp_x: np.ndarray, incumbent: Schedule | None, *, seed: int,
                     strategy: str, deadline: float | None) -> Schedule | None:
    """The cheaper of ``incumbent`` (or None) and the cheapest rounding of the LP point
    ``lp_x`` that fits the model's budget."""
    rng = np.random.default_rng(seed)
    cost_to_beat = None if incumbent is None else incumbent.cost(model.graph)
    rounded, _ = cheapest_rounding(model, lp_x, int(model.budget_bytes), _COMPETING_SAMPLES, rng, strategy, deadline,
                                   cost_to_beat)
    return incumbent if rounded is None else rounded
