"""The allocator check's margin, its re-plans' progress lines and what it does for ``"min"``
(tfremat/allocator_check.py, tfremat/keras.py).

The reads of one plan's step repeat to the byte while the allocator's free chunks stay as
they are, and move when something else changes them (benchmarks/results/allocator_check.md),
so the held peak keeps a margin of the step's own bytes even where the reads agree.
"""

import dataclasses
import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from models import five_conv_net

import tfremat.keras as remat_keras
from tfremat import allocator_check
from tfremat.errors import InfeasibleBudgetError
from tfremat.keras import RematCallback
from tfremat.plan.simulator import simulate

BATCH = 16


def batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 32, 32, 3)).astype("float32")
    return x, np.eye(10, dtype="float32")[rng.integers(0, 10, BATCH)]


def test_reads_that_agree_keep_a_share_of_the_steps_own_bytes():
    resident = 600
    step_bytes = 1000  # the largest read less the resident bytes
    margin = int(allocator_check.ALLOCATOR_MARGIN * step_bytes)
    assert margin > 0
    assert allocator_check.held_peak([1600, 1600, 1600], resident) == 1600 + margin
    # A spread wider than the share is held instead.
    assert allocator_check.held_peak([1600 - 2 * margin, 1600], resident) == 1600 + 2 * margin
    # Reads at or under the resident bytes keep no share (nothing of the step's own).
    assert allocator_check.held_peak([500, 500], resident) == 500


def test_the_check_adds_the_share_above_the_variables_and_the_batch(monkeypatch):
    """allocator_peak holds its reads above the model's and optimizer's variables and the
    batch, and a step measured by requested bytes as read (the same every run)."""
    import tfremat.runtime.memory as memory

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    x, y = tf.zeros((2, 4)), tf.zeros((2, 2))
    model.optimizer.build(model.trainable_variables)
    resident = memory.resident_bytes([*model.variables, *model.optimizer.variables, x, y])
    reads = iter([resident + 5000] * 3)
    monkeypatch.setattr(memory, "measure_step_peak", lambda *args, **kwargs: next(reads))
    expected = resident + 5000 + int(allocator_check.ALLOCATOR_MARGIN * 5000)
    assert remat_keras.allocator_peak(None, model, x, y) == expected
    reads = iter([resident + 5000])
    assert remat_keras.allocator_peak(None, model, x, y, count="requested") == resident + 5000


def test_re_plans_show_their_progress_on_the_batch_line(monkeypatch, capsys):
    """The re-plans' solver progress is written on the batch's phase line, not on a line of
    its own without the batch (user_check_2 finding 7). The allocator's excess is made up:
    a tenth of the prediction on every plan, so the first plan is planned again."""
    planned = []

    def chunky_peak(step, *_args, **_kwargs):
        planned.append(step.schedule)
        predicted = simulate(step.graph, step.schedule).peak_bytes
        return predicted + predicted // 10

    monkeypatch.setattr(remat_keras, "allocator_peak", chunky_peak)
    model, (x, y) = five_conv_net(), batch()
    callback = RematCallback("90% of activations", time_limit=20, cost_model="flops", cache=False,
                             allocator_check=True, verbose=1)
    callback.set_model(model)
    try:
        callback._step_for(tf.constant(x), tf.constant(y))
    except InfeasibleBudgetError:
        pass  # refused in the allocator's terms after a re-plan: its lines are what is checked
    finally:
        if callback._tracing is not None:
            callback._tracing.close()
    assert len(planned) >= 2
    lines = [part for line in capsys.readouterr().err.splitlines() for part in line.split("\r") if part.strip()]
    assert not [line for line in lines if line.startswith("tfremat optimal")], lines
    progress = [line for line in lines if "best schedule" in line]
    assert progress and all(line.startswith("tfremat batch (16, 32, 32, 3)") for line in progress), lines
    assert [line for line in progress if "holding its allocator peak" in line], lines  # the re-plan's


def test_min_reads_the_allocator_and_holds_nothing(monkeypatch):
    """"min" is not held (no smaller plan to fall back on): its step's allocator peak is read
    as the check reads it, then over the first training steps, the largest kept in
    allocator_peaks, and nothing is planned again."""
    calls = []
    real_peak = remat_keras.allocator_peak

    def recording_peak(*args, **kwargs):
        calls.append(real_peak(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(remat_keras, "allocator_peak", recording_peak)
    model, (x, y) = five_conv_net(), batch()
    callback = RematCallback("min", cost_model="flops", cache=False, verbose=0)
    x2, y2 = batch(1)
    model.fit(np.concatenate([x, x2]), np.concatenate([y, y2]), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])
    ((key, plan),) = callback.plans.items()
    assert len(calls) == 1 and list(callback.allocator_peaks) == [key]
    assert callback.allocator_peaks[key] >= calls[0]
    # Read in the allocator's chunks: at least the bytes the plan predicts, less the
    # allocator's spread between runs (the memory module's docstring).
    assert calls[0] >= plan.predicted_peak_bytes - 2 * 2**20
    # Two training steps read, the plan kept.
    assert callback._watched[key][:2] == [allocator_check.WATCHED_STEPS - 2, None] and callback.plans[key] is plan


def test_min_is_not_read_when_the_check_is_off(monkeypatch):
    monkeypatch.setattr(remat_keras, "allocator_peak", lambda *a, **k: pytest.fail("read with the check off"))
    model, (x, y) = five_conv_net(), batch()
    callback = RematCallback("min", cost_model="flops", cache=False, verbose=0, allocator_check=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert callback.allocator_peaks == {}


def test_a_refusal_names_optimizer_state_only_where_the_optimizer_keeps_some():
    """fit's refusals name what the graph's fixed memory holds (user_check_2 finding 8):
    plain SGD keeps no state per weight, Adam two slots per weight."""
    model, (x, y) = five_conv_net(), batch()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="categorical_crossentropy")
    callback = RematCallback("1%", cost_model="flops", cache=False, verbose=0)
    with pytest.raises(InfeasibleBudgetError) as refused:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert "(weights, gradients, the batch)" in str(refused.value), refused.value
    assert "optimizer state" not in str(refused.value)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    with pytest.raises(InfeasibleBudgetError) as refused:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[RematCallback("1%", cost_model="flops", cache=False, verbose=0)])
    assert "(weights, gradients, optimizer state, the batch)" in str(refused.value), refused.value


@dataclasses.dataclass(frozen=True)
class _Plan:
    budget_bytes: int
    predicted_peak_bytes: int
    extraction: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(graph=None))


def test_the_smallest_plan_is_read_before_a_refusal():
    """Where the budget less the chunks of the budget's plan fits no schedule, the smallest
    plan found is read before refusing: a smaller plan's chunks may be fewer (U-Net's 41.95
    MiB plan read 4.8 MiB above its requests, its 34.45 MiB plan 2.0). Made-up plans: the
    smallest feasible plan predicts 70, every plan reads 5 above its prediction plus 1 per
    byte over 70, and a plan is planned at the budget asked for."""
    budget = 100
    result = _Plan(budget_bytes=budget, predicted_peak_bytes=99)
    planned = []

    def plan_at(current, planning_budget):
        planned.append(planning_budget)
        if planning_budget < 70:
            raise InfeasibleBudgetError(planning_budget, 70, strategy="optimal")
        return dataclasses.replace(current, predicted_peak_bytes=planning_budget), planning_budget

    def read_peak(step):
        return step + 5 + (step - 70)

    accepted, step, planning = allocator_check.hold_allocator_peak(
        result, 99, plan_at, read_peak, strategy="optimal", options={}, cache=False)
    assert planned[-1] == planning == 70 and read_peak(step) <= budget
    assert accepted.budget_bytes == budget
    # Where the smallest plan is over too, the refusal is told in the allocator's terms.
    with pytest.raises(InfeasibleBudgetError, match="allocator's peak"):
        allocator_check.hold_allocator_peak(result, 99, plan_at, lambda step: step + 40, strategy="optimal",
                                            options={}, cache=False)
