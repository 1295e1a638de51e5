"""Step timing in turns (tfremat.runtime.timing.time_in_turns, re-exported by tfremat.measure):
a load that changes between rounds must not read as overhead."""

import pytest
import tensorflow as tf

from tfremat import measure
from tfremat.errors import ArgumentError
from tfremat.runtime import timing as turns


class _LoadedClock:
    """A fake ``perf_counter`` for steps whose duration is their work times the machine's
    load, and a load that triples after the first rounds (as when another job starts)."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self):
        return self.now

    def step(self, name, work):
        def run():
            self.calls.append(name)
            load = 1.0 if len(self.calls) <= 6 else 3.0
            self.now += work * load
            return tf.constant(0.0)
        return run


def test_time_in_turns_reads_the_ratio_through_a_load_change(monkeypatch):
    clock = _LoadedClock()
    monkeypatch.setattr(turns.time, "perf_counter", clock)
    timing = turns.time_in_turns(clock.step("planned", 2.0), clock.step("plain", 1.0), rounds=6, warmup=1)
    # Timed one after the other the load change would read as 3x plain; in turns each
    # round's ratio is the work's.
    assert timing.ratio == pytest.approx(2.0)
    assert timing.ratio_quartiles == pytest.approx((2.0, 2.0))
    assert timing.rounds == 6
    # Warm-up runs both, then the order alternates within rounds.
    assert clock.calls[:6] == ["planned", "plain", "planned", "plain", "plain", "planned"]
    assert timing.seconds == pytest.approx(6.0) and timing.reference_seconds == pytest.approx(3.0)
    assert measure.time_in_turns is turns.time_in_turns and measure.TurnTiming is turns.TurnTiming


def test_time_in_turns_reports_the_spread_and_refuses_bad_rounds(monkeypatch):
    clock = _LoadedClock()
    monkeypatch.setattr(turns.time, "perf_counter", clock)
    works = iter([1.0, 1.0, 1.0, 2.0, 1.5])

    def noisy():
        return clock.step("planned", next(works))()

    # After the warm-up the planned step's work is 1, 1, 2, 1.5 times plain's.
    timing = turns.time_in_turns(noisy, clock.step("plain", 1.0), rounds=4, warmup=1)
    assert timing.ratio == pytest.approx(1.25)
    assert timing.ratio_quartiles == pytest.approx((1.0, 1.625))
    for bad in ({"rounds": 0}, {"rounds": 1.5}, {"rounds": 2, "warmup": -1}):
        with pytest.raises(ArgumentError, match="rounds|warmup"):
            turns.time_in_turns(noisy, noisy, **{"warmup": 0, **bad})


def test_a_gradient_mismatch_keeps_its_graph_and_schedule_for_a_report(tmp_path, monkeypatch, caplog):
    """A schedule whose gradients differ from plain training's depends on the run's profile:
    measure keeps the graph and schedule, readable back, and names where in a warning."""
    import json

    from graph_factories import random_training_graph
    from tfremat.graph import load_graph
    from tfremat.numerics import closeness
    from tfremat.plan.schedule import Schedule
    from tfremat.strategies import get_strategy

    graph = random_training_graph(3, 6)
    schedule = get_strategy("checkpoint_all")(graph, None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with caplog.at_level("WARNING", logger="tfremat.measure"):
        measure._keep_mismatch(graph, schedule, closeness([[1.0, 2.0]], [[0.0, 0.0]]))
    (kept,) = tmp_path.iterdir()
    assert str(kept) in caplog.text and "please report" in caplog.text
    read_back = Schedule.from_dict(json.loads((kept / "schedule.json").read_text()), graph)
    assert (read_back.R == schedule.R).all() and (read_back.S == schedule.S).all()
    assert load_graph(kept / "graph.json").fingerprint == graph.fingerprint


def test_the_gradient_comparison_starts_both_steps_from_the_saved_state():
    """Dropout draws from a seed state that any earlier run advances (an extraction, a warm-up):
    the planned and the plain step must both start from the saved variables, or their masks
    differ and a correct schedule reads as wrong gradients."""
    import keras
    import numpy as np

    from tfremat.extract.extractor import extract
    from tfremat.strategies import get_strategy

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dropout(0.5, seed=1)(keras.layers.Dense(16, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 8)), tf.float32)
    y = tf.constant([0, 1, 2, 0])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    extraction = extract(model, sample_batch=(x, y), loss=loss, optimizer=keras.optimizers.SGD(),
                         cost_model="flops", use_cache=False)
    schedule = get_strategy("checkpoint_all")(extraction.graph, None)
    saved = [v.numpy() for v in model.variables]
    model(x, training=True)  # advances the dropout layer's seed state past the saved one
    assert measure._compare_gradients(model, extraction, schedule, x, y, saved).equal
