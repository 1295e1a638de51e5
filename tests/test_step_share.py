"""The share of a plain step that the graph's costs account for (PlanResult.step_share, issue
33 item 2): the step also runs the optimizer's updates, which no node's cost holds and every
schedule pays alike, so the predicted time over plain counts the recomputation against the
whole step, ``(1 + overhead * step_share) * plain_overlap``, with the share
``total_cost / (total_cost + update seconds)`` (benchmarks/results/executor_time.md, "The step's
time beyond the graph's costs"; benchmarks/results/step_share.md).

Structural only: the update's seconds are given, or checked to be timed and kept, never bounded;
the parts of a traced step are attributed exactly on hand-made allocator events.
"""

import dataclasses
import types

import keras
import pytest
import tensorflow as tf

from tfremat.extract import extract
from tfremat.extract.overlap import PlainOverlap, attributed_seconds, measure_plain_overlap
from tfremat.extract.plain_step import StepParts, plain_train_step
from tfremat.planner import plan_graph, plan_summary
from tfremat.runtime import timing as turns

from models import tiny_bn_dropout_batch, tiny_bn_dropout_net


def _planned():
    extraction = extract(tiny_bn_dropout_net(), tiny_bn_dropout_batch(), loss="mse", cost_model="flops", use_cache=False)
    result = plan_graph(extraction.graph, "95% of activations", "chen_sqrtn", cache=False)
    assert result.overhead > 0
    return result


def test_the_recomputation_counts_against_the_whole_step():
    result = _planned()
    total = result.graph.total_cost
    timed = dataclasses.replace(result, extraction=types.SimpleNamespace(
        plain_overlap=1.1, plain_overlap_range=(0.9, 1.3), plain_overlap_load=4.0, plain_step_seconds=3 * total,
        plain_update_seconds=0.25 * total))
    assert timed.step_share == pytest.approx(0.8)
    assert timed.step_overhead == pytest.approx(0.8 * result.overhead)
    slower = 1 + 0.8 * result.overhead
    assert timed.predicted_time_over_plain == pytest.approx(slower * 1.1)
    assert timed.predicted_time_over_plain_range == pytest.approx((slower * 0.9, slower * 1.3))
    row = timed.summary()
    assert row["overhead"] == pytest.approx(result.overhead, abs=1e-6)
    assert row["step_overhead"] == pytest.approx(0.8 * result.overhead, abs=1e-6)
    assert row["predicted_time_over_plain"] == pytest.approx(slower * 1.1, abs=1e-4)
    line = plan_summary(timed)
    assert (f"predicted overhead {100 * result.overhead:+.1f}% of the graph's costs, "
            f"{100 * 0.8 * result.overhead:+.1f}% of a plain step, {slower * 1.1:.2f}x plain training's time") in line
    assert "of a plain step" not in plan_summary(result)


def test_an_update_not_timed_keeps_the_overhead():
    result = _planned()
    # The plain step's own least run no longer sets the share: only the update's seconds do.
    untimed = dataclasses.replace(result, extraction=types.SimpleNamespace(
        plain_overlap=1.0, plain_step_seconds=2 * result.graph.total_cost, plain_update_seconds=None))
    older = dataclasses.replace(result, extraction=types.SimpleNamespace(plain_overlap=1.0))
    for kept in (untimed, older, result):
        assert kept.step_share == 1.0 and kept.step_overhead == result.overhead
        assert kept.predicted_time_over_plain == pytest.approx(1 + result.overhead)


def test_the_step_seconds_round_trip_and_an_older_entry_has_none():
    overlap = PlainOverlap(0.8, 0.79, 0.81, 5, 3.9, 0.0123, 0.0021)
    assert PlainOverlap.from_dict(overlap.to_dict()) == overlap
    older = {key: value for key, value in overlap.to_dict().items() if key not in ("step_seconds", "update_seconds")}
    assert PlainOverlap.from_dict(older) == dataclasses.replace(overlap, step_seconds=None, update_seconds=None)


def test_time_in_turns_keeps_each_side_s_least_run():
    step = lambda: tf.constant(0.0)  # noqa: E731
    timing = turns.time_in_turns(step, step, rounds=5, warmup=1)
    assert 0 < timing.least_seconds <= timing.seconds
    assert 0 < timing.reference_least_seconds <= timing.reference_seconds


def test_the_measured_overlap_times_the_plain_step_and_the_extraction_keeps_it(parallel, monkeypatch, tmp_path):
    model, (x, y) = tiny_bn_dropout_net(), tiny_bn_dropout_batch()
    measured = measure_plain_overlap(model, tf.constant(x), [tf.constant(y)],
                                     lambda labels, preds: tf.reduce_mean((labels[0] - preds[0]) ** 2),
                                     keras.optimizers.Adam())
    assert measured.rounds >= 1 and measured.step_seconds is not None and measured.step_seconds > 0
    # The update is read off the traced step's runs: a part of the step's run.
    assert measured.update_seconds is not None and 0 < measured.update_seconds < measured.step_seconds
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tfremat.extract.extractor.measure_plain_overlap",
                        lambda *args: PlainOverlap(1.25, 1.1, 1.4, 7, 3.5, 0.0042, 0.0007))
    first = extract(tiny_bn_dropout_net(), tiny_bn_dropout_batch(), loss="mse", cost_model="profile", repeats=1)
    second = extract(tiny_bn_dropout_net(), tiny_bn_dropout_batch(), loss="mse", cost_model="profile", repeats=1)
    assert not first.cache_hit and second.cache_hit
    assert first.plain_step_seconds == second.plain_step_seconds == 0.0042
    assert first.plain_update_seconds == second.plain_update_seconds == 0.0007
    untimed = extract(tiny_bn_dropout_net(), tiny_bn_dropout_batch(), loss="mse", cost_model="flops", use_cache=False)
    assert untimed.plain_step_seconds is None and untimed.plain_update_seconds is None


def test_measure_model_s_predicted_time_uses_the_update_s_share(parallel, monkeypatch):
    import tfremat.extract.extractor as extractor
    from tfremat.measure import measure_model

    extractions, extract_now = [], extractor.extract

    def kept(*args, **kwargs):
        extractions.append(extract_now(*args, **kwargs))
        return extractions[-1]

    monkeypatch.setattr(extractor, "extract", kept)
    monkeypatch.setattr(extractor, "measure_plain_overlap",
                        lambda *args: PlainOverlap(1.25, 1.1, 1.4, 7, 3.5, 1.0, 0.001))
    model = tiny_bn_dropout_net()
    model.compile(optimizer="adam", loss="mse")
    row = measure_model(model, None, strategy="chen_sqrtn", batch_size=4, steps=2, cache=False,
                        verbose=0)
    total = extractions[0].graph.total_cost
    assert row["step_share"] == pytest.approx(total / (total + 0.001), abs=1e-4) and row["step_share"] < 1
    assert row["predicted_step_overhead"] == pytest.approx(row["predicted_overhead"] * row["step_share"], abs=1e-3)
    assert row["predicted_time_over_plain"] == pytest.approx(1.25 * (1 + row["predicted_step_overhead"]), abs=1e-3)


def test_each_allocating_operation_owns_the_time_to_the_next_one():
    parts = StepParts()
    for part, names in (("forward", ["model/dense/MatMul", "model/dense/BiasAdd"]), ("loss", ["mse/sub"]),
                        ("backward", ["gradient_tape/model/dense/MatMul", "AddN"]), ("update", ["adam/Mul"])):
        parts.record(part, [types.SimpleNamespace(name=name) for name in names])
    us = 1_000_000  # picoseconds
    events = [(0, "model/dense/MatMul"), (2 * us, None), (3 * us, "model/dense/BiasAdd"), (4 * us, "mse/sub"),
              (5 * us, "gradient_tape/model/dense/MatMul"), (9 * us, "adam/Mul"), (10 * us, "adam/Sqrt_1"),
              (14 * us, "AddN"), (15 * us, "ConstantFolding/x"), (16 * us, None)]
    seconds = attributed_seconds(events, parts)
    # adam/Sqrt_1 was not recorded (Grappler's), but its top scope holds the update only; at
    # its hand-over to the backward the update keeps its median interval (1 us of 4).
    assert seconds == pytest.approx({"forward": 4e-6, "loss": 1e-6, "backward": 8e-6, "update": 2e-6,
                                     "other": 1e-6})
    assert sum(seconds.values()) == pytest.approx(16e-6)  # from the first allocation to the last event


def test_the_plain_step_records_which_part_made_each_operation():
    model, (x, y) = tiny_bn_dropout_net(), tiny_bn_dropout_batch()
    step = plain_train_step(model, lambda labels, preds: tf.reduce_mean((labels[0] - preds[0]) ** 2),
                            keras.optimizers.Adam())
    graph = step.get_concrete_function(tf.constant(x), [tf.constant(y)]).graph
    parts = {step.parts.of(op.name) for op in graph.get_operations()}
    assert {"forward", "loss", "backward", "update"} <= parts
    matmuls = {step.parts.of(op.name) for op in graph.get_operations() if op.type == "MatMul"}
    assert matmuls == {"forward", "backward"}
    # The step's names are a user's step's: no scope of its own above the model's.
    assert any(op.name.startswith(model.name) for op in graph.get_operations())
