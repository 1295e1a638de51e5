"""The allocator check's perturbed reads and held peak, its re-plans' progress lines and what
it does for ``"min"`` (tfremat/allocator_check.py, tfremat/keras.py).

The reads of one plan's step repeat to the byte while the allocator's free chunks stay as
they are, and move when something else changes them (benchmarks/results/allocator_check.md),
so the check also reads the step with the free chunks put in other states.
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
from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError
from tfremat.keras import RematCallback
from tfremat.plan.simulator import simulate

BATCH = 16
SLACK = allocator_check.REFUSAL_SLACK  # a refusal's over the held peak it names


def batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 32, 32, 3)).astype("float32")
    return x, np.eye(10, dtype="float32")[rng.integers(0, 10, BATCH)]


def test_the_held_peak_is_the_largest_read_plus_a_slack_of_the_steps_own_bytes():
    resident = 600
    reads = [1300, 1600, 1450, 1500]  # plain and perturbed
    slack = int(allocator_check.ALLOCATOR_SLACK * (1600 - resident))
    assert slack > 0
    held = allocator_check.held_peak(reads, resident)
    assert held == 1600 + slack
    # At least the spread of the reads above every read: no state read is left over.
    assert held >= max(reads) and held - min(reads) >= max(reads) - min(reads)
    # Reads at or under the resident bytes keep no slack (nothing of the step's own).
    assert allocator_check.held_peak([500, 500], resident) == 500


def test_the_check_reads_the_step_in_perturbed_states_of_the_allocator(monkeypatch):
    """allocator_peak reads the step ALLOCATOR_READS times as it finds the allocator, then
    PERTURBED_READS times each with other tensors made (most freed, small spacers and a few
    kept alive: the allocator holds a few more bytes), and holds the largest read, whichever state gave it, with the slack above the
    variables and the batch. A step measured by requested bytes is read once, as read."""
    import tfremat.runtime.memory as memory

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    x, y = tf.zeros((2, 4)), tf.zeros((2, 2))
    model.optimizer.build(model.trainable_variables)
    resident = memory.resident_bytes([*model.variables, *model.optimizer.variables, x, y])
    own = 4 * 2**20
    plain_reads = allocator_check.ALLOCATOR_READS
    in_use = []

    def fake_measure(*args, **kwargs):
        in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        # The second perturbed state gives the largest read.
        return resident + own + (2**20 if len(in_use) == plain_reads + 2 else 0)

    monkeypatch.setattr(memory, "measure_step_peak", fake_measure)
    held = remat_keras.allocator_peak(None, model, x, y)
    assert len(in_use) == plain_reads + allocator_check.PERTURBED_READS
    largest = resident + own + 2**20
    assert held == largest + int(allocator_check.ALLOCATOR_SLACK * (largest - resident))
    # Every perturbed read ran with the spacers kept alive that the plain reads did not have.
    assert min(in_use[plain_reads:]) > max(in_use[:plain_reads]), in_use
    in_use.clear()
    monkeypatch.setattr(memory, "measure_step_peak", lambda *a, **k: in_use.append(0) or resident + own)
    assert remat_keras.allocator_peak(None, model, x, y, count="requested") == resident + own
    assert len(in_use) == 1


def test_a_perturbed_state_frees_most_of_what_it_made_and_everything_after():
    """perturbed_state makes tensors of up to the step's own bytes, then frees all but
    PERTURBED_KEPT_SHARE of them before the read (the spacers between the holes stay, 16 KiB
    at most each): the check's extra footprint during a read is small. After, nothing is kept."""
    device = "CPU:0"
    own = 8 * 2**20
    spacers = 16 * 16 * 2**10
    for seed in range(4):
        before = tf.config.experimental.get_memory_info(device)["current"]
        tf.config.experimental.reset_memory_stats(device)
        with allocator_check.perturbed_state(device, own, (3 * 2**20, 2**20, 2**16), seed=seed) as made:
            info = tf.config.experimental.get_memory_info(device)
        after = tf.config.experimental.get_memory_info(device)["current"]
        assert made is True
        kept, made_at_once = info["current"] - before, info["peak"] - before
        assert 0 < kept <= allocator_check.PERTURBED_KEPT_SHARE * own + spacers, (seed, kept)
        # The holes: far more was made than is kept, within the step's bytes (in whole chunks).
        assert own // 4 < made_at_once <= 2 * own, (seed, made_at_once)
        assert after - before < own // 16, (seed, after - before)


def test_a_perturbation_that_does_not_fit_is_skipped_not_raised(monkeypatch, caplog):
    """On a device near its limit the perturbation's tensors may not fit: that state is skipped
    (logged) and nothing it made stays allocated; a step out of memory in a perturbed state is
    skipped likewise, and the check holds the other reads."""
    device = "CPU:0"
    real_ones = tf.ones
    made = []

    def ones_until_full(shape, dtype=tf.float32):
        if len(made) >= 3:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
        made.append(real_ones(shape, dtype))
        return made[-1]

    before = tf.config.experimental.get_memory_info(device)["current"]
    monkeypatch.setattr(tf, "ones", ones_until_full)
    with caplog.at_level("WARNING", logger="tfremat.allocator_check"):
        with allocator_check.perturbed_state(device, 8 * 2**20, (2**20,), seed=0) as state:
            assert state is False
        made.clear()
        assert tf.config.experimental.get_memory_info(device)["current"] - before < 2**16
        assert "did not fit" in caplog.text
    monkeypatch.setattr(tf, "ones", real_ones)

    reads, out_of_memory = [], {allocator_check.ALLOCATOR_READS + 1, allocator_check.ALLOCATOR_READS + 3}

    def step_out_of_memory_when_perturbed(*_args, **_kwargs):
        reads.append(len(reads))
        if len(reads) in out_of_memory:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
        return 1000 + len(reads)

    import tfremat.runtime.memory as memory

    monkeypatch.setattr(memory, "measure_step_peak", step_out_of_memory_when_perturbed)
    with caplog.at_level("WARNING", logger="tfremat.allocator_check"):
        x, y = tf.zeros((2,)), tf.zeros((2,))
        held = allocator_check.step_allocator_peak(None, x, y, [], sizes=(2**16,))
    last = allocator_check.ALLOCATOR_READS + allocator_check.PERTURBED_READS
    assert len(reads) == last
    read = [1000 + n for n in range(1, last + 1) if n not in out_of_memory]
    assert held == allocator_check.held_peak(read, memory.resident_bytes([x, y]))
    assert "ran out of memory" in caplog.text


def test_perturbing_sizes_are_the_graphs_largest_requests():
    graph = types.SimpleNamespace(output_bytes=(10, 400, 400, 30), workspace_bytes=(0, 0, 900, 0),
                                  weight_grad_bytes=(50, 0, 0, 0))
    assert allocator_check.perturbing_sizes(graph, largest=3) == (900, 400, 50)
    assert allocator_check.perturbing_sizes(None) == ()


@pytest.mark.parametrize("budget, checked", [("100% of activations", False), ("120%", False), ("60%", True),
                                             ("80MiB", True), ("120MiB", True), ("min", False)])
def test_shares_at_or_above_checkpoint_all_are_not_held(budget, checked):
    """A share at or above the checkpoint-all peak recomputes nothing (the step is model.fit's
    own): refusing it helps no one, so it is not held (a tiny mixed_float16 model at "100%" was
    refused, 168%); bytes are held at any size."""
    resolved = {"100% of activations": 100, "120%": 120, "60%": 60, "80MiB": 80, "120MiB": 120, "min": 50}
    result = types.SimpleNamespace(budget_bytes=resolved[budget], checkpoint_all_peak_bytes=100)
    assert allocator_check.wants_allocator_check(None, budget, result) is checked
    assert allocator_check.wants_allocator_check(False, budget, result) is False
    assert allocator_check.wants_allocator_check(True, budget, result) is True


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
    extraction: object = dataclasses.field(
        default_factory=lambda: types.SimpleNamespace(graph=types.SimpleNamespace(fixed_bytes=0)))


def test_the_smallest_plan_is_read_before_a_refusal():
    """Where the budget less the chunks of the budget's plan fits no schedule, the smallest
    plan found is read before refusing: a smaller plan's chunks may be fewer (U-Net's 41.95
    MiB plan read 4.8 MiB above its requests, its 34.45 MiB plan 2.0). Made-up plans: the
    smallest feasible plan predicts 70, every plan reads 5 above its prediction plus 3 per
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
        return step + 5 + 3 * (step - 70)

    accepted, step, planning = allocator_check.hold_allocator_peak(
        result, 99, plan_at, read_peak, strategy="optimal", options={}, cache=False)
    assert planned[-1] == planning == 70 and read_peak(step) <= budget
    assert accepted.budget_bytes == budget
    # Where the smallest plan is over too, the refusal is told in the allocator's terms.
    with pytest.raises(InfeasibleBudgetError, match="allocator's peak"):
        allocator_check.hold_allocator_peak(result, 99, plan_at, lambda step: step + 40, strategy="optimal",
                                            options={}, cache=False)


@dataclasses.dataclass(frozen=True)
class _GraphPlan:
    """A made-up plan of a graph with a fingerprint (the check keeps the plans it read by it)."""
    budget_bytes: int
    predicted_peak_bytes: int
    fingerprint: str
    checkpoint_all_peak_bytes: int = 200

    @property
    def extraction(self):
        return types.SimpleNamespace(graph=types.SimpleNamespace(fixed_bytes=0, fingerprint=self.fingerprint))


def _smallest_planner(plan_at, fingerprint):
    """The planner's smallest plan at ``planning_budget``, a made-up plan of graph ``fingerprint``."""
    return lambda planning_budget: plan_at(_GraphPlan(planning_budget, planning_budget, fingerprint), planning_budget)


def _plans_over_from(floor, excess):
    """``plan_at`` for made-up plans predicted at their planning budget, none under ``floor``,
    and the held peak ``excess(predicted)`` above the prediction; the steps are the
    predictions."""
    planned = []

    def plan_at(current, planning_budget):
        planned.append(planning_budget)
        if planning_budget < floor:
            raise InfeasibleBudgetError(planning_budget, floor, strategy="optimal")
        predicted = min(planning_budget, current.checkpoint_all_peak_bytes)
        return dataclasses.replace(current, predicted_peak_bytes=predicted), predicted

    return plan_at, (lambda step: step + excess(step)), planned


def test_a_refused_budgets_figure_is_accepted_when_copied_back():
    """The smallest budget a refusal names is the held peak of a plan it read, and copied back
    it is accepted: the check plans under that plan's planning budget (MHA + GroupNorm at "70%
    of activations" named 86%, refused naming 87%; user_check_4 finding 5). Made-up plans whose
    chunks grow as they shrink, so that a smaller plan's excess is not the last plan's."""
    plan_at, read_peak, planned = _plans_over_from(70, lambda predicted: 10 + (100 - predicted) // 2)
    with pytest.raises(InfeasibleBudgetError) as refused:
        allocator_check.hold_allocator_peak(_GraphPlan(80, 80, "copied back"), 80, plan_at, read_peak,
                                            strategy="optimal", options={}, cache=False)
    named = refused.value.min_feasible_bytes
    assert named == 95 + int(SLACK * 95) and read_peak(70) == 95, refused.value  # the smallest plan read, a slack
    assert "allocator_check=False" in str(refused.value)
    accepted, step, planning = allocator_check.hold_allocator_peak(
        _GraphPlan(named, named, "copied back"), named, plan_at, read_peak, strategy="optimal", options={},
        cache=False)
    assert read_peak(step) <= named and planning >= 70 and accepted.budget_bytes == named


def test_a_refusal_names_no_unchecked_share_its_step_reads_over():
    """Where the smallest plan read is held where a share goes unchecked when copied back (at or
    above the checkpoint-all share), and no plan that recomputes holds below the checkpoint-all
    step, the refusal names that step's held peak, which that share trains unchecked
    (mixed_float16: "100% of activations" named, read 1.18x; user_check_3 finding 5), not a
    figure clipped to it. Made-up plans: recomputing ones held 140 above their prediction."""
    plan_at, read_peak, planned = _plans_over_from(150, lambda predicted: 86 if predicted == 200 else 140)
    with pytest.raises(InfeasibleBudgetError) as refused:
        allocator_check.hold_allocator_peak(_GraphPlan(190, 190, "unchecked"), 190, plan_at, read_peak,
                                            strategy="optimal", options={}, cache=False, unchecked_from=199)
    assert planned[-1] == 200 and read_peak(200) == 286 < read_peak(150), planned
    assert refused.value.min_feasible_bytes == 286 + int(SLACK * 286), refused.value
    assert not refused.value.smallest_as_amount and "nothing recomputed" in str(refused.value), refused.value
    # Told as a share of activations (the graph's fixed bytes 0), unclipped.
    graph = types.SimpleNamespace(fixed_bytes=0, weight_grads_to_end_bytes=0)
    from tfremat.plan.registry import in_user_terms
    share = -(-100 * refused.value.min_feasible_bytes // 200)
    assert f"{share}% of activations" in str(in_user_terms(refused.value, graph, "95% of activations", reference=200))
    # Without unchecked_from (bytes, or allocator_check=True) the smallest plan read is named.
    with pytest.raises(InfeasibleBudgetError) as refused:
        allocator_check.hold_allocator_peak(_GraphPlan(190, 190, "checked"), 190, plan_at, read_peak,
                                            strategy="optimal", options={}, cache=False)
    assert refused.value.min_feasible_bytes == read_peak(150) + int(SLACK * 290)


def test_a_re_plan_out_of_time_is_a_refusal_in_the_allocators_terms():
    """A re-plan whose MILP finds no schedule within its time limit ends the check as a refusal
    naming the check, the smallest held peak and allocator_check=False, not a
    SolverTimeLimitError about an internal planning budget (WaveNet at "15MB": 219 s, then
    "no baseline fits 11777193 bytes"; user_check_4 finding 3); the re-plan's limit is cut."""
    def plan_at(current, planning_budget):
        raise SolverTimeLimitError("highs found no schedule within time_limit=20s", planning_budget, None, 20.0)

    with pytest.raises(InfeasibleBudgetError) as refused:
        allocator_check.hold_allocator_peak(_GraphPlan(100, 99, "out of time"), 99, plan_at, lambda step: 120,
                                            strategy="optimal", options={}, cache=False)
    text = str(refused.value)
    assert "held for the allocator's peak" in text and "time limit of 20 s" in text, text
    assert "allocator_check=False" in text and refused.value.min_feasible_bytes == 120 + int(SLACK * 120), text
    assert refused.value.__cause__ is None or isinstance(refused.value.__cause__, SolverTimeLimitError)

    seen = {}

    def planner(graph, budget, strategy, cache, verbose, **options):
        seen.update(options)
        return _Plan(budget, budget)

    result = types.SimpleNamespace(extraction=types.SimpleNamespace(graph=None), planned_with=None,
                                   strategy="optimal", facts=None, budget_bytes=100)
    allocator_check.replan(result, 90, "optimal", {"time_limit": 60.0}, False, 0, planner=planner)
    assert seen["time_limit"] == allocator_check.REPLAN_TIME_LIMIT < 60


def _buffer_address(variable) -> int:
    """Where ``variable``'s buffer lies: a read (``ReadVariableOp``) shares the variable's
    buffer, and numpy's DLPack view of it shares the read's."""
    inner = variable if isinstance(variable, tf.Variable) else variable.value
    return np.from_dlpack(tf.raw_ops.ReadVariableOp(resource=inner.handle, dtype=inner.dtype)).ctypes.data


def _chunks_handed_out() -> list[int]:
    """Where the allocator puts tensors of a few sizes made one after the other (then freed):
    the same while its free chunks stay as they are."""
    made = [tf.ones([n]) for n in (100, 5000, 300, 70000, 20, 1200)]
    return [np.from_dlpack(t).ctypes.data for t in made]


def test_the_checks_restore_writes_each_variable_back_into_its_own_buffer():
    """The check's runs end in a restore of the variables (runtime.state.state_restored). An
    ``assign`` would hand each variable a new buffer and free the old one, so the first training
    step after the check would run among free chunks none of the check's reads saw (a U-Net's
    first step read over its held peak so: benchmarks/results/allocator_check.md, Session 30).
    The restore writes into the buffers the variables have, and the values are the saved ones
    to the bit; the allocator holds no more bytes after it than before, and hands the same
    requests the same chunks (its temporaries are freed into the chunks they split)."""
    from tfremat.runtime.state import state_restored

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    x, y = np.ones((4, 8), "float32"), np.zeros((4, 4), "float32")
    model.train_on_batch(x, y)
    variables = list(model.variables) + list(model.optimizer.variables)
    saved = [v.numpy() for v in variables]
    probe = tf.Variable(tf.ones([64]))
    moved_from = _buffer_address(probe)
    assert _buffer_address(probe) == moved_from  # the probe reads the buffer itself
    probe.assign(probe.numpy())
    assert _buffer_address(probe) != moved_from  # and sees an assign move it
    with state_restored(variables):
        for _ in range(2):
            model.train_on_batch(x, y)
        assert any(not np.array_equal(v.numpy(), s) for v, s in zip(variables, saved))
        before = [_buffer_address(v) for v in variables]
        current = tf.config.experimental.get_memory_info("CPU:0")["current"]
        chunks = _chunks_handed_out()
        if _chunks_handed_out() != chunks:
            pytest.skip("something else in this process allocates on the CPU meanwhile")
    assert [_buffer_address(v) for v in variables] == before
    assert tf.config.experimental.get_memory_info("CPU:0")["current"] == current
    assert _chunks_handed_out() == chunks
    for variable, value in zip(variables, saved):
        assert variable.numpy().tobytes() == value.tobytes(), variable.path


def test_a_restore_is_exact_where_writing_in_place_would_not_be():
    """Subtracting the current value and adding the saved one (the in-place restore) cannot give
    -0.0, a subnormal (the CPU kernels flush them) or anything after an infinite current value;
    those variables, and a bool one (no such kernels), are assigned: still exact."""
    from tfremat.runtime.state import restore

    saved = np.array([-0.0, 1e-40, 1.0, np.nan, -1e-45, 3.5], np.float32)
    variable = tf.Variable(np.array([1.0, 2.0, np.inf, 3.0, np.nan, -0.0], np.float32))
    restore(variable, saved)
    assert variable.numpy().tobytes() == saved.tobytes()
    flags = tf.Variable([True, False])
    restore(flags, np.array([False, True]))
    assert flags.numpy().tolist() == [False, True]
    counter = tf.Variable(np.int64(2**62))
    counter.assign_add(1)  # its own buffer, no longer its initial value's, as training leaves it
    address = _buffer_address(counter)
    restore(counter, np.int64(-(2**63)))
    assert counter.numpy() == -(2**63) and _buffer_address(counter) == address


def test_a_planner_refusal_names_the_smallest_plans_held_peak_and_that_is_accepted_copied_back():
    """Where the check would hold the planner's smallest feasible budget, the refusal names the
    smallest plan's held peak, read from the allocator, not the planner's prediction, which the
    check refused again (text classifier: "75%" named "98%", refused naming "105%";
    user_check_5 finding 2); copied back it is accepted, under the smallest plan's planning
    budget. Made-up plans: none under 70, each held 20 above its prediction."""
    plan_at, read_peak, planned = _plans_over_from(70, lambda predicted: 20)
    refused = InfeasibleBudgetError(40, 70, 60, "optimal", detail="node 3 needs 60", proven=True)

    plan_smallest = _smallest_planner(plan_at, "planner refusal")
    named = allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, read_peak, lambda plan: True,
                                                 strategy="optimal", options={}, cache=False)
    assert named.min_feasible_bytes == 90 + int(SLACK * 90), named  # the held peak, a slack
    assert (named.budget_bytes, named.lower_bound_bytes, named.proven) == (40, 60, True)
    assert "node 3 needs 60" in str(named) and "read from the allocator" in str(named), named
    accepted, step, planning = allocator_check.hold_allocator_peak(
        _GraphPlan(named.min_feasible_bytes, named.min_feasible_bytes, "planner refusal"), named.min_feasible_bytes,
        plan_at, read_peak, strategy="optimal", options={}, cache=False)
    assert planning == 70 and read_peak(step) <= named.min_feasible_bytes
    # Not held (the check would not run, or cannot read): the planner's refusal as it was.
    for checks, reads in ((lambda plan: False, read_peak), (lambda plan: True, lambda step: None)):
        assert allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, reads, checks,
                                                    strategy="optimal", options={}, cache=False) is refused


def test_a_planner_refusal_whose_smallest_plan_reads_over_every_checked_share_names_checkpoint_all():
    """Where the smallest plan is held at a share the check does not hold (``unchecked_from``
    and up), and above the checkpoint-all step, the refusal names that step's held peak and
    says plainly that at it nothing is recomputed."""
    plan_at, read_peak, planned = _plans_over_from(150, lambda predicted: 80 if predicted == 200 else 140)
    refused = InfeasibleBudgetError(100, 150, None, "optimal")

    plan_smallest = _smallest_planner(plan_at, "unchecked refusal")
    named = allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, read_peak, lambda plan: True,
                                                 strategy="optimal", options={}, cache=False, unchecked_from=199)
    assert planned == [150, 200] and named.min_feasible_bytes == 280 + int(SLACK * 280), named
    assert "nothing recomputed" in str(named) and "checkpoint-all" in str(named), named


def _fixed_bytes_peak(excess_share):
    """A made-up allocator for fit's check: the step's predicted peak plus ``excess_share`` of
    its bytes above the graph's fixed bytes (as whole chunks add to a plan's own bytes)."""
    def peak(step, *_args, **_kwargs):
        predicted = simulate(step.graph, step.schedule).peak_bytes
        return predicted + int(excess_share * max(predicted - step.graph.fixed_bytes, 0))

    return peak


@pytest.mark.parametrize("make, shape", [("five_conv_net", (32, 32, 3)), ("unet", (32, 32, 3))])
def test_every_budget_a_refusal_names_trains_when_copied_back(monkeypatch, make, shape):
    """Every budget fit's refusals name, the planner's (at "50%") and the check's (at the
    planner's own figure), copied back verbatim trains without a refusal: one copy-back. The
    allocator is made up (a third above the plan's own bytes, so the check refuses the
    planner's figure) and the training steps read nothing over, so nothing here depends on
    the machine's allocator."""
    import re

    import models

    monkeypatch.setattr(remat_keras, "allocator_peak", _fixed_bytes_peak(1 / 3))
    monkeypatch.setattr(remat_keras, "training_step_peak", lambda run, device, resident: (run(), 0))
    rng = np.random.default_rng(0)
    model = getattr(models, make)()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x = rng.standard_normal((BATCH, *shape)).astype("float32")
    classes = model.output_shape[-1]
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, model.output_shape[1:-1] + (BATCH,))]
    y = np.moveaxis(y, -2, 0) if y.ndim > 2 else y

    def fit(budget, **options):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[RematCallback(budget, cost_model="flops", cache=False, verbose=0, **options)])

    def named(budget, **options):
        with pytest.raises(InfeasibleBudgetError) as refused:
            fit(budget, **options)
        return re.search(r"smallest feasible budget found is (\d+%)", str(refused.value)).group(1), refused.value

    read_figure, refusal = named("50%")
    assert "read from the allocator" in str(refusal), refusal
    fit(read_figure)
    planners_figure, _ = named("50%", allocator_check=False)
    if int(planners_figure[:-1]) < int(read_figure[:-1]):
        checks_figure, refusal = named(planners_figure)
        assert "held for the allocator's peak" in str(refusal), refusal
        fit(checks_figure)


def test_value_and_grad_names_a_budget_its_check_accepts(monkeypatch):
    """tfremat.value_and_grad's planner refusal takes the same path as fit's (one function,
    :func:`allocator_check.planner_refusal_read`): the figure is the smallest plan's held peak,
    and copied back it plans. The allocator is made up, as above."""
    import re

    import tfremat
    import tfremat.custom_loops as custom_loops

    monkeypatch.setattr(custom_loops, "step_allocator_peak", _fixed_bytes_peak(1 / 3))
    model, (x, y) = five_conv_net(), batch()
    loss = keras.losses.CategoricalCrossentropy()

    def fn(a, b):
        return loss(b, model(a, training=True))

    x, y = tf.constant(x), tf.constant(y)
    fast = {"cost_model": "flops", "cache": False, "verbose": 0}
    with pytest.raises(InfeasibleBudgetError) as refused:
        tfremat.value_and_grad(fn, "50%", x, y, **fast)
    assert "read from the allocator" in str(refused.value), refused.value
    figure = re.search(r"smallest feasible budget found is (\d+%)", str(refused.value)).group(1)
    g = tfremat.value_and_grad(fn, figure, x, y, **fast)
    held = _fixed_bytes_peak(1 / 3)(g._steps[g._example_key])
    assert held <= g.plan.budget_bytes, (held, g.plan)


def test_a_recomputing_plan_held_above_every_checked_share_is_named_as_an_amount_and_trains_copied_back():
    """Where the smallest plan read is held at a share the check does not hold but below the
    checkpoint-all step, the refusal names that plan's held peak as an amount in bytes, which
    the check holds at every size, and what it saves against recomputing nothing (the masked
    text transformer: 4.44 MiB against 5.01 MiB held; user_check_5, "Session 30 (A2)").
    Copied back, the amount is accepted under the smallest plan's planning budget: a schedule
    that recomputes. Made-up plans: recomputing ones held 50 above their prediction,
    checkpoint-all 80; an amount whose slack reaches checkpoint-all's read is not named."""
    from tfremat.plan.registry import in_user_terms

    plan_at, read_peak, planned = _plans_over_from(150, lambda predicted: 80 if predicted == 200 else 50)
    refused = InfeasibleBudgetError(100, 150, None, "optimal", detail="node 3 needs 150")

    plan_smallest = _smallest_planner(plan_at, "amount refusal")
    named = allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, read_peak, lambda plan: True,
                                                 strategy="optimal", options={}, cache=False, unchecked_from=199)
    assert planned == [150, 200] and named.min_feasible_bytes == 200 + int(SLACK * 200), named
    saved = 280 - named.min_feasible_bytes  # the amount against checkpoint-all's held peak
    assert named.smallest_as_amount and f"saves {saved} B against recomputing nothing" in str(named), named
    # Told in the user's terms of a share, the figure stays an amount.
    graph = types.SimpleNamespace(fixed_bytes=0, weight_grads_to_end_bytes=0)
    amount = named.min_feasible_bytes
    shown = str(in_user_terms(named, graph, "50%", reference=200))
    assert f'found is "{amount} B", an amount in bytes' in shown and "node 3 needs 150" in shown, shown
    accepted, step, planning = allocator_check.hold_allocator_peak(
        _GraphPlan(amount, amount, "amount refusal"), amount, plan_at, read_peak, strategy="optimal", options={},
        cache=False)
    assert planning == 150 and read_peak(step) <= amount and accepted.predicted_peak_bytes < 200, (planning, accepted)
    # The check's own refusal of a share names the same amount.
    with pytest.raises(InfeasibleBudgetError) as again:
        allocator_check.hold_allocator_peak(_GraphPlan(190, 190, "amount check"), 190, plan_at, read_peak,
                                            strategy="optimal", options={}, cache=False, unchecked_from=199)
    assert again.value.min_feasible_bytes == amount and again.value.smallest_as_amount, again.value
    # Checkpoint-all held within the amount's slack: it is named, and nothing is recomputed at it.
    plan_at, read_peak, planned = _plans_over_from(150, lambda predicted: 5 if predicted == 200 else 50)
    named = allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, read_peak, lambda plan: True,
                                                 strategy="optimal", options={}, cache=False, unchecked_from=199)
    assert 200 < 205 <= 200 + int(SLACK * 200) and not named.smallest_as_amount, named
    assert named.min_feasible_bytes == 205 + int(SLACK * 205) and "nothing recomputed" in str(named), named


def _recomputing_peak(recomputing_share, checkpoint_all_share):
    """A made-up allocator for fit's check: a step that recomputes held at
    ``recomputing_share`` of the graph's checkpoint-all peak, the checkpoint-all step at
    ``checkpoint_all_share`` (every plan's whole chunks the same, the masked text
    transformer's case in small)."""
    from tfremat.plan.simulator import checkpoint_all_peak

    def peak(step, *_args, **_kwargs):
        share = recomputing_share if step.schedule.recompute_count else checkpoint_all_share
        return int(share * checkpoint_all_peak(step.graph))

    return peak


def test_fit_names_an_amount_that_trains_recomputing_when_copied_back(monkeypatch):
    """fit's refusal of "50%" where every plan that recomputes is held above 99% of the
    checkpoint-all peak, and the checkpoint-all step above them, names an amount in bytes;
    copied back verbatim, fit trains on a schedule that recomputes, held within it. The
    allocator is made up and the training steps read nothing over, so nothing here depends on
    the machine's allocator."""
    import re

    monkeypatch.setattr(remat_keras, "allocator_peak", _recomputing_peak(1.02, 1.25))
    # Plans other tests read of the same graph, under other made-up allocators, are not this one's.
    monkeypatch.setattr(allocator_check, "_HELD_PLANS", {})
    monkeypatch.setattr(remat_keras, "training_step_peak", lambda run, device, resident: (run(), 0))
    model = five_conv_net()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x, y = batch()

    def fit(budget):
        callback = RematCallback(budget, cost_model="flops", cache=False, verbose=0)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        return callback

    with pytest.raises(InfeasibleBudgetError) as refused:
        fit("50%")
    message = str(refused.value)
    assert refused.value.smallest_as_amount and "read from the allocator" in message, message
    assert "saves" in message and "against recomputing nothing" in message, message
    amount = re.search(r'smallest feasible budget found is "([\d.]+ [KMG]?i?B)", an amount', message).group(1)
    callback = fit(amount)
    (plan,) = callback.plans.values()
    assert plan.schedule.recompute_count > 0 and plan.predicted_peak_bytes < plan.checkpoint_all_peak_bytes, plan
    assert callback.allocator_peaks[next(iter(callback.plans))] <= plan.budget_bytes, callback.allocator_peaks


def test_a_refusal_after_re_plans_names_a_figure_over_the_budget_it_refused():
    """A plan held within the budget before (in a state the allocator has left) is no figure
    for the budget's refusal: the figure is over the budget refused, not over the last re-plan's
    planning budget (five_conv_net at 70%, refused after a watched step read over, named 69%;
    user_check_5, "Session 30 (A3)"). Made-up plans: none under 70, each held 60 above its
    prediction now; the budget's own plan was held at 80 before."""
    made_up, read_peak, planned = _plans_over_from(70, lambda predicted: 60)

    def plan_at(current, planning_budget):  # a re-plan's budget is its planning budget, as replan's
        replanned, step = made_up(current, planning_budget)
        return dataclasses.replace(replanned, budget_bytes=planning_budget), step

    current = _GraphPlan(100, 100, "left state")
    allocator_check._remember_held(False, current.extraction.graph, "optimal", {}, 100, 80)
    with pytest.raises(InfeasibleBudgetError) as refused:
        allocator_check.hold_allocator_peak(current, 100, plan_at, read_peak, strategy="optimal", options={},
                                            cache=False, exceeded=(100, 140))
    assert 70 in planned and refused.value.min_feasible_bytes > 100, (planned, refused.value)


def test_a_figure_whose_slack_reaches_an_unchecked_share_is_told_as_an_amount():
    """The figure with its slack, not the held peak alone, decides whether a share copied back
    would be checked: a plan held at 200 (under the share checked below 203) is named 206, which
    as a share would train unchecked; the refusal reads checkpoint-all (held 280) and names 206
    as an amount, which the check holds (results/user_check_6.md, "Session 30 (V2)")."""
    plan_at, read_peak, planned = _plans_over_from(150, lambda predicted: 80 if predicted == 200 else 50)
    refused = InfeasibleBudgetError(100, 150, None, "optimal", detail="node 3 needs 150")

    plan_smallest = _smallest_planner(plan_at, "slack refusal")
    named = allocator_check.planner_refusal_read(refused, plan_smallest, plan_at, read_peak, lambda plan: True,
                                                 strategy="optimal", options={}, cache=False, unchecked_from=203)
    assert named.min_feasible_bytes == 200 + int(SLACK * 200) >= 203, named
    assert planned == [150, 203] and named.smallest_as_amount, (planned, named)  # checkpoint-all read at 203
    assert "against recomputing nothing" in str(named), named
