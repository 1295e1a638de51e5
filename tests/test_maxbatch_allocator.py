"""max_batch_size's answer held for the device allocator's peak (tfremat.maxbatch.hold_on_allocator,
tfremat.maxbatch_keras), and the search on the user's sample."""

from __future__ import annotations

import pytest

from tests.test_ilp import checkpoint_all_peak, training_chain
from tfremat.errors import InfeasibleBudgetError
from tfremat.maxbatch import AllocatorVerdict, hold_on_allocator, max_batch_size
from tfremat.strategies import get_strategy

BUDGET = 16 + 4 * 40


def _answer():
    """The search's answer on training chains, for the bytes its schedule requests."""
    return max_batch_size(lambda b: training_chain(4, b), BUDGET, strategy="checkpoint_all", max_batch=64)


def _held_by_chunks(excess: float, calls: list[int]):
    """A ``hold`` whose allocator reads the keep-everything step at ``excess`` times its
    predicted bytes above the fixed ones, refusing with that figure where it is over."""
    def hold(batch: int) -> AllocatorVerdict:
        calls.append(batch)
        graph = training_chain(4, batch)
        schedule = get_strategy("checkpoint_all")(graph, None)
        peak = graph.fixed_bytes + int(excess * (checkpoint_all_peak(graph) - graph.fixed_bytes))
        if peak <= BUDGET:
            return AllocatorVerdict(True, peak, schedule, graph, planning_budget=BUDGET)
        error = InfeasibleBudgetError(BUDGET, min_feasible_bytes=peak, strategy="checkpoint_all")
        return AllocatorVerdict(False, peak, needed_bytes=peak, error=error)

    return hold


def test_an_answer_over_on_the_allocator_steps_down_to_the_largest_batch_that_holds():
    answer = _answer()
    calls: list[int] = []
    held = hold_on_allocator(answer, _held_by_chunks(1.25, calls), BUDGET)
    expected = max(b for b in range(1, answer.batch_size + 1)
                   if 16 + int(1.25 * (checkpoint_all_peak(training_chain(4, b)) - 16)) <= BUDGET)
    assert expected < answer.batch_size
    assert held.batch_size == expected and held.allocator_peak <= BUDGET
    assert held.allocator_tried[expected] and not held.allocator_tried[expected + 1]
    assert calls[0] == answer.batch_size and list(held.allocator_tried) == calls
    # The first step down aims where the bytes meet the budget, so few batches are run.
    assert len(calls) <= 4
    assert held.graph == training_chain(4, expected) and held.cost <= held.cost_cap
    assert set(calls) <= set(held.built) and not held.reached_max_batch


def test_an_answer_held_at_once_keeps_its_batch_and_reports_the_held_peak():
    answer = _answer()
    calls: list[int] = []
    held = hold_on_allocator(answer, _held_by_chunks(1.0, calls), BUDGET)
    assert calls == [answer.batch_size] and held.batch_size == answer.batch_size
    assert held.allocator_peak == checkpoint_all_peak(training_chain(4, answer.batch_size)) <= BUDGET
    assert dict(held.allocator_tried) == {answer.batch_size: True}
    assert answer.allocator_peak is None and not answer.allocator_tried  # the search alone holds nothing


def test_a_plan_held_only_beyond_the_overhead_cap_does_not_count():
    """Above batch ``limit`` the allocator is held only by a plan that recomputes: with no
    overhead allowed such a batch does not count, and the answer steps down to one held by
    keeping all."""
    answer = _answer()
    limit = answer.batch_size // 2

    def hold(batch: int) -> AllocatorVerdict:
        graph = training_chain(4, batch)
        keep_all = get_strategy("checkpoint_all")(graph, None)
        if batch <= limit:
            return AllocatorVerdict(True, BUDGET - 1, keep_all, graph, planning_budget=BUDGET)
        recomputing = get_strategy("chen_sqrtn")(graph, None)
        assert recomputing.cost(graph) > keep_all.cost(graph)
        return AllocatorVerdict(True, BUDGET - 1, recomputing, graph, planning_budget=BUDGET - 8)

    held = hold_on_allocator(answer, hold, BUDGET, max_overhead=0.0)
    assert held.batch_size == limit and held.cost == held.cost_cap == training_chain(4, limit).total_cost
    assert not held.allocator_tried[limit + 1]


def test_a_smallest_batch_not_held_is_refused_naming_the_batch():
    answer = _answer()
    with pytest.raises(InfeasibleBudgetError, match="batch 1") as raised:
        hold_on_allocator(answer, _held_by_chunks(50.0, []), BUDGET)
    assert raised.value.min_feasible_bytes > BUDGET


# Keras models: the answer's step run and held as fit holds it.


def _conv_net(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(hidden)
    outputs = keras.layers.Dense(4, activation="softmax")(keras.layers.GlobalAveragePooling2D()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model


def test_the_answer_is_held_on_the_allocator_within_the_budget():
    """The answer's step read on the allocator is within the budget; without the check the
    answer is the search's own, for requested bytes, with no held peak."""
    from tfremat.api import max_batch_size as keras_max_batch_size

    model = _conv_net()
    # Above the 33 MiB a batch-1 step read with oneDNN off (TensorFlow's own convolution gradients'
    # scratch, which flops costs leave out): the check finds it and steps down where it reads over.
    options = dict(strategies=["checkpoint_all"], cost_model="flops", cache=False, max_batch=4096, verbose=0)
    unchecked = keras_max_batch_size(model, "48MiB", allocator_check=False, **options)["checkpoint_all"]
    assert unchecked.allocator_peak is None and not unchecked.allocator_tried
    held = keras_max_batch_size(model, "48MiB", **options)["checkpoint_all"]
    budget = 48 * 2**20
    assert held.allocator_peak is not None and held.allocator_peak <= budget
    assert held.batch_size <= unchecked.batch_size and next(iter(held.allocator_tried)) == unchecked.batch_size
    assert held.allocator_tried[held.batch_size]
    assert all(not ok for batch, ok in held.allocator_tried.items() if batch > held.batch_size)
    assert held.graph.name and held.cost <= held.cost_cap


def test_a_budget_over_on_the_allocator_steps_down_with_the_check_fit_uses(monkeypatch, capsys):
    """Reads injected at the allocator: a step of more than ``limit`` samples peaks over the
    budget, whatever its plan. The answer steps down to ``limit`` through fit's own check
    (its re-plan, its refusal's figure), one stderr line per batch run."""
    import tfremat.allocator_check as allocator_check
    from tfremat.api import max_batch_size as keras_max_batch_size

    budget = 4 * 2**20
    model = _conv_net(seed=1)
    unchecked = keras_max_batch_size(model, budget, strategies=["checkpoint_all"], cost_model="flops", cache=False,
                                     max_batch=256, allocator_check=False, verbose=0)["checkpoint_all"]
    limit = unchecked.batch_size * 2 // 3

    def injected(run_step, x, y, variables, **_):
        return int(budget * x.shape[0] / (limit + 0.5))

    monkeypatch.setattr(allocator_check, "step_allocator_peak", injected)
    held = keras_max_batch_size(model, budget, strategies=["checkpoint_all"], cost_model="flops", cache=False,
                                max_batch=256)["checkpoint_all"]
    assert held.batch_size == limit and held.allocator_peak == int(budget * limit / (limit + 0.5)) <= budget
    assert not held.allocator_tried[limit + 1] and list(held.allocator_tried)[0] == unchecked.batch_size
    assert len(held.allocator_tried) <= 5
    assert held.graph.fixed_bytes > 0 and limit in held.built
    lines = [line for line in capsys.readouterr().err.splitlines() if "checkpoint_all on the allocator" in line]
    assert [line.split("s batch ", 1)[1] for line in lines] == [
        f"{batch} {'fits' if ok else 'does not fit'}" for batch, ok in held.allocator_tried.items()]


def _lookup_model():
    """Strings through a StringLookup without an OOV index into an Embedding: made-up empty
    strings are outside its vocabulary."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary=["red", "green", "blue"], num_oov_indices=0)(inputs)
    hidden = keras.layers.Flatten()(keras.layers.Embedding(3, 8)(ids))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_a_string_lookup_without_oov_is_searched_on_the_users_sample():
    import numpy as np
    import tensorflow as tf

    from tfremat.api import max_batch_size as keras_max_batch_size
    from tfremat.errors import ArgumentError

    model = _lookup_model()
    words = np.array([["red", "green", "blue", "red"], ["blue", "blue", "green", "red"], ["green"] * 4])
    labels = np.array([0, 1, 1])
    options = dict(strategies=["checkpoint_all"], cost_model="flops", cache=False, max_batch=64, verbose=0)
    with pytest.raises(ArgumentError, match="fails on a made-up batch .*pass x"):
        keras_max_batch_size(model, "2MiB", **options)
    arrays = keras_max_batch_size(model, "2MiB", words, labels, **options)["checkpoint_all"]
    assert arrays.batch_size == 64 and arrays.reached_max_batch and arrays.allocator_peak <= 2 * 2**20
    dataset = tf.data.Dataset.from_tensor_slices((words, labels)).batch(2)
    from_dataset = keras_max_batch_size(model, "2MiB", dataset, allocator_check=False, **options)["checkpoint_all"]
    unlabelled = keras_max_batch_size(model, "2MiB", words, allocator_check=False, **options)["checkpoint_all"]
    assert from_dataset.batch_size == unlabelled.batch_size == 64


def test_a_sample_the_model_does_not_take_is_refused_before_any_extraction():
    import numpy as np
    import tensorflow as tf

    from tfremat.api import max_batch_size as keras_max_batch_size
    from tfremat.errors import ArgumentError

    model = _conv_net()
    images = np.zeros((5, 16, 16, 3), "float32")
    labels = np.zeros((5, 4), "float32")
    for x, y, match in (
        (np.zeros((5, 16, 16, 1), "float32"), None, r"takes samples of shape \(16, 16, 3\)"),
        (images, labels[:3], "same number of samples"),
        (None, labels, "y was given without x"),
        (tf.data.Dataset.from_tensor_slices((images, labels)).batch(2), labels, "leave y out"),
        (images[:0], None, "at least one"),
        ([images, images], None, "2 arrays, but the model has 1 inputs"),
    ):
        with pytest.raises(ArgumentError, match=match):
            keras_max_batch_size(model, "4MiB", x, y, strategies=["checkpoint_all"], verbose=0)
    with pytest.raises(ArgumentError, match="allocator_check must be True or False"):
        keras_max_batch_size(model, "4MiB", allocator_check=None)
