"""The requested-bytes ledger (tfremat.measure.requested_ledger): the simulator's memory at
every compute statement beside what the compiled step requests while it runs, the tool that
found where mixed precision's prediction over-counts (benchmarks/results/fidelity_mixed.md)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat.extract.extractor import extract
from tfremat.measure import requested_ledger
from tfremat.plan.execution import Op, build_plan
from tfremat.plan.simulator import simulate
from tfremat.runtime.memory import measure_step_peak
from tfremat.static_graph.compile import compile_step
from tfremat.strategies import get_strategy


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))


def test_the_ledger_has_every_compute_and_reaches_both_peaks():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="relu", name="wide")(inputs)
    outputs = keras.layers.Dense(4, name="head")(keras.layers.Dense(64, activation="relu", name="deep")(hidden))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((16, 32)), tf.float32)
    y = tf.constant(rng.standard_normal((16, 4)), tf.float32)
    optimizer = keras.optimizers.SGD()
    extraction = extract(model, sample_batch=(x, y), loss=keras.losses.MeanSquaredError(), optimizer=optimizer,
                         cost_model="flops", use_cache=False)
    graph = extraction.graph
    # Recomputing the first layer's output gives the ledger a reforward statement.
    schedule = get_strategy("chen_sqrtn")(graph, None)
    plan = build_plan(graph, schedule)
    step_optimizer = keras.optimizers.SGD()
    step_optimizer.build(model.trainable_variables)
    step = compile_step(extraction, schedule, optimizer=step_optimizer)
    resident = list(model.variables) + list(step_optimizer.variables)

    rows = requested_ledger(extraction, schedule, step, x, y, resident)

    computes = [(index, s) for index, s in enumerate(plan.statements) if s.op is Op.COMPUTE]
    assert [row["statement"] for row in rows] == [index for index, _ in computes]
    assert [row["node"] for row in rows] == [s.node for _, s in computes]
    assert {row["scope"] for row in rows} >= {f"forward_{graph.names.index('wide')}", f"loss_{graph.loss_node}"}
    assert plan.recompute_count > 0 and any(row["scope"].startswith("reforward_") for row in rows)
    assert max(row["predicted_bytes"] for row in rows) == simulate(graph, plan).peak_bytes
    # Every dense layer's forward and backward statement allocates (its output, its
    # gradients), and the step's requested peak falls inside one of them, but for a few
    # hundred bytes of scalars outside any statement's scope (an update's, on TensorFlow's
    # default executor: 512 B here).
    for row in rows:
        if not row["scope"].startswith("loss"):
            assert row["requested_bytes"] is not None, row
    peak = measure_step_peak(step, x, y, resident=resident, warmup=0, count="requested")
    assert peak - 1024 <= max(row["requested_bytes"] or 0 for row in rows) <= peak
