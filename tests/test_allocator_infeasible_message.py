"""The error when the allocator check finds no plan: told in the allocator's terms.

ResNet50 (64x64, batch 8, Adam) at "300MiB" was refused with "the smallest feasible budget
found is 289.64 MiB; no schedule can use less than 288.64 MiB": figures below the budget
it refused, because they were the planner's requested bytes, not the allocator's peak
(benchmarks/user_check.py). The check's steps are faked here; nothing runs.
"""

import types

import pytest

import tfremat.keras as remat_keras
from tfremat import allocator_check
from tfremat.errors import InfeasibleBudgetError
from tfremat.keras import RematCallback

MiB = 2**20


def test_infeasible_after_allocator_check_names_a_budget_above_the_one_refused(monkeypatch):
    budget, predicted, peak, smallest_plan = 300 * MiB, 292 * MiB, 306 * MiB, 290 * MiB
    callback = RematCallback(budget, cache=False, verbose=0)
    callback._model = types.SimpleNamespace()  # keras.callbacks.Callback.model; the fakes never read it
    result = types.SimpleNamespace(budget_bytes=budget, predicted_peak_bytes=predicted,
                                   extraction=types.SimpleNamespace(graph=types.SimpleNamespace(fixed_bytes=0)))
    monkeypatch.setattr(remat_keras, "allocator_peak", lambda *args, **kwargs: peak)

    def replanned(result, planning_budget, options, strategy=None):
        raise InfeasibleBudgetError(planning_budget, smallest_plan, smallest_plan - MiB, "optimal")

    monkeypatch.setattr(callback, "_replanned", replanned)
    with pytest.raises(InfeasibleBudgetError) as raised:
        callback._within_allocator(result, None, None, None, None, {})
    error = raised.value
    assert error.budget_bytes == budget
    # The held peak of the one plan read (the smallest plan found could not be planned to be
    # read) with the refusal's slack: a figure a plan was read within, not the smallest plan
    # plus this plan's chunks.
    assert error.min_feasible_bytes == peak + int(allocator_check.REFUSAL_SLACK * peak) > budget
    assert error.lower_bound_bytes is None  # a bound on requested bytes, below the budget: not shown
    assert "allocator_check=False" in str(error)
