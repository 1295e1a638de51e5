"""tfremat.fit under MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1.

The test starts this file as a script twice (``--worker``), with ``TF_CONFIG`` naming two
free local ports; each worker builds the model in the strategy's scope from the same
initial weights, trains with ``tfremat.fit`` and writes its weights and history. Data
parallel SGD on a mean loss computes the step a single process computes on the same
global batches, so both workers must end with the weights of a plain ``model.fit`` in
this process (closeness rule of :mod:`tfremat.numerics`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# 64 samples a replica's batch: the weight gradients, held from their backward node to the
# end of the step, put a smaller batch's checkpoint-all peak at the step's end, where no
# schedule saves anything (the allocator-check test needs one 1 KiB below it).
SAMPLES, FEATURES, OUTPUTS, BATCH, EPOCHS, LEARNING_RATE = 256, 8, 3, 128, 2, 0.05
#: Seconds a worker pair may take (two TensorFlow imports, the cluster's start, an
#: extraction and a few steps on a loaded 2-core machine take about 20-40 s).
WORKER_TIMEOUT = 150
#: Seconds the surviving worker may take to stop once its peer died.
FAULT_BOUND = 30


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype("float32")
    y = rng.standard_normal((SAMPLES, OUTPUTS)).astype("float32")
    return x, y


def _sample_weights():
    return np.random.default_rng(1).uniform(0.2, 2.0, SAMPLES).astype("float32")


def _model(momentum: float = 0.9):
    """Momentum by default: the optimizer has slot variables, mirrored on every worker. The
    allocator-check test trains without: on this tiny net the allocator's chunks for the
    momentum updates put the real peak over the checkpoint-all peak, where the test wants
    only worker 1's reported excess."""
    import keras

    inputs = keras.Input((FEATURES,))
    hidden = inputs
    for width in (32, 32, 32, 32):
        hidden = keras.layers.Dense(width, activation="tanh")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(OUTPUTS)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=momentum), loss="mse", metrics=["mae"])
    return model


def _worker(out: Path, index: int, die_at_batch: int | None, budget: str, check: str) -> None:
    """One worker (TF_CONFIG set by the test): trains and writes ``worker{index}.json``.

    ``check``: ``allocator_check`` ("None", "True", "False"), or "inflated": True, planned
    with ``rotor`` and trained with sample weights, each worker running the measuring
    steps but reporting as its allocator's peak the measured step's predicted peak, except
    worker 1's first, reported 1 KiB over the checkpoint-all peak (an allocator that
    rounds more than the chief's). Reported, not measured: on this net's tens of KiB of
    activations the allocator's chunks vary by more from run to run."""
    import keras
    import tensorflow as tf

    import tfremat
    import tfremat.multi_worker
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.multi_worker import PlanMismatchError, WorkerLostError
    from tfremat.plan.simulator import checkpoint_all_peak, simulate

    allocator_check = {"None": None, "True": True, "False": False, "inflated": True}[check]
    calls = []
    if check == "inflated":
        measure = tfremat.multi_worker.allocator_peak  # the name the multi-worker loop calls

        def reported(step, *args, **kwargs):
            calls.append(measure(step, *args, **kwargs))  # the step runs, its state put back
            if index == 1 and len(calls) == 1:
                return checkpoint_all_peak(step.graph) + 1024
            return simulate(step.graph, step.schedule).peak_bytes

        tfremat.multi_worker.allocator_peak = reported

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(0.0 if check == "inflated" else 0.9)
    model.set_weights(list(np.load(out / "initial.npz").values()))
    x, y = _data()
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=10),
                 keras.callbacks.ModelCheckpoint(str(out / f"checkpoint{index}.weights.h5"), save_weights_only=True)]
    if die_at_batch is not None:
        def die(batch, logs):
            if batch == die_at_batch:
                (out / "died").write_text(str(time.time()))
                os._exit(9)

        callbacks.append(keras.callbacks.LambdaCallback(on_train_batch_end=die))
    record = {}
    try:
        history = tfremat.fit(model, budget, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                              validation_data=(x[:BATCH], y[:BATCH]), callbacks=callbacks,
                              strategy="rotor" if check == "inflated" else "chen_sqrtn",
                              sample_weight=_sample_weights() if check == "inflated" else None,
                              cost_model="flops", cache=False, verbose=0, allocator_check=allocator_check,
                              exact_gradients=True)
        record.update(history=history.history, plans=[str(k) for k in history.plans],
                      recomputations=[p.schedule.recompute_count for p in history.plans.values()],
                      schedules=[p.schedule.to_dict() for p in history.plans.values()],
                      predicted=[p.predicted_peak_bytes for p in history.plans.values()],
                      budgets=[p.budget_bytes for p in history.plans.values()],
                      allocator_peaks=[history.allocator_peaks.get(k) for k in history.plans], measured=len(calls))
        np.savez(out / f"weights{index}.npz", *model.get_weights())
    except (WorkerLostError, PlanMismatchError, InfeasibleBudgetError) as error:
        record.update(error=type(error).__name__, message=str(error), at=time.time())
    (out / f"worker{index}.json").write_text(json.dumps(record))


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_workers(out: Path, *, die_at_batch=None, budgets=("100%", "100%"), allocator_check=None) -> list[dict]:
    # Budgets per worker: two that differ make every worker raise PlanMismatchError naming
    # worker 1 (checked by hand; test_disagreeing_workers_are_named tests the naming).
    """Runs two workers to their end (or WORKER_TIMEOUT), reaping both whatever happens."""
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    try:
        for index in range(2):
            # The BFC CPU allocator keeps the statistics allocator_check reads (set before
            # TensorFlow is imported).
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                       TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
            command = [sys.executable, __file__, "--worker", str(out), str(index), budgets[index], str(allocator_check)]
            if die_at_batch is not None and index == 1:
                command.append(str(die_at_batch))
            processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              cwd=Path(__file__).resolve().parents[1]))
        deadline = time.monotonic() + WORKER_TIMEOUT
        outputs = []
        for process in processes:
            try:
                outputs.append(process.communicate(timeout=max(deadline - time.monotonic(), 1))[0].decode())
            except subprocess.TimeoutExpired:
                raise AssertionError(f"workers still running after {WORKER_TIMEOUT} s") from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    records = []
    for index, output in enumerate(outputs):
        path = out / f"worker{index}.json"
        records.append(json.loads(path.read_text()) if path.exists() else {"exit": processes[index].returncode,
                                                                             "log": output[-3000:]})
    return records


def _initial_weights(out: Path) -> list:
    import keras

    keras.utils.set_random_seed(0)
    weights = _model().get_weights()
    np.savez(out / "initial.npz", *weights)
    return weights


def test_two_workers_train_like_one_process(tmp_path):
    from tfremat.numerics import closeness

    weights = _initial_weights(tmp_path)
    records = _run_workers(tmp_path)
    for index, record in enumerate(records):
        assert "history" in record, f"worker {index}: {record}"
    plain = _model()
    plain.set_weights(weights)
    x, y = _data()
    expected = plain.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, validation_data=(x[:BATCH], y[:BATCH]),
                         verbose=0).history
    trained = [list(np.load(tmp_path / f"weights{index}.npz").values()) for index in range(2)]
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)  # one all-reduced update on both: the same bits
    assert closeness(trained[0], plain.get_weights()).equal, closeness(trained[0], plain.get_weights())
    history = records[0]["history"]
    assert records[1]["history"] == history
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-4, err_msg=key)
    assert records[0]["plans"] == [str(((BATCH // 2, FEATURES), (BATCH // 2, OUTPUTS)))]
    assert records[0]["recomputations"][0] > 0
    assert (tmp_path / "checkpoint0.weights.h5").exists()  # the chief's ModelCheckpoint
    assert not (tmp_path / "checkpoint1.weights.h5").exists()  # file-writing callbacks: the chief only


def test_allocator_check_replans_for_the_largest_peak(tmp_path):
    # Worker 1 (not the chief) reports its first peak 1 KiB over the budget ("100%", the
    # checkpoint-all peak, where rotor recomputes nothing; see _worker): every worker
    # takes that largest peak, the chief plans again under the budget less the excess,
    # and both train with its schedule, measured again within the budget. The measuring
    # runs put the weights back: training, with sample weights, still matches model.fit.
    from tfremat.numerics import closeness

    weights = _initial_weights(tmp_path)
    records = _run_workers(tmp_path, allocator_check="inflated")
    for index, record in enumerate(records):
        assert "history" in record, f"worker {index}: {record}"
    chief, other = records
    assert chief["measured"] == other["measured"] == 2  # the first plan's step, then the new plan's
    assert chief["schedules"] == other["schedules"]
    assert chief["recomputations"][0] > 0
    budget = chief["budgets"][0]
    assert chief["predicted"][0] <= budget - 1024
    assert chief["allocator_peaks"] == other["allocator_peaks"] == chief["predicted"]  # the new plan's step
    trained = [list(np.load(tmp_path / f"weights{index}.npz").values()) for index in range(2)]
    for a, b in zip(*trained):
        np.testing.assert_array_equal(a, b)
    plain = _model(0.0)
    plain.set_weights(weights)
    x, y = _data()
    expected = plain.fit(x, y, sample_weight=_sample_weights(), batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                         verbose=0).history
    assert closeness(trained[0], plain.get_weights()).equal, closeness(trained[0], plain.get_weights())
    for key in ("loss", "mae"):
        np.testing.assert_allclose(chief["history"][key], expected[key], rtol=1e-4, err_msg=key)


def test_dead_worker_stops_the_other(tmp_path):
    _initial_weights(tmp_path)
    records = _run_workers(tmp_path, die_at_batch=1)
    survivor = records[0]
    assert survivor.get("error") == "WorkerLostError", survivor
    assert "another worker stopped" in survivor["message"]
    assert survivor["at"] - float((tmp_path / "died").read_text()) < FAULT_BOUND
    assert records[1].get("exit") == 9


def test_disagreeing_workers_are_named():
    from tfremat.multi_worker import disagreements

    # Rows as the workers gather them: extracted, structure, settings, versions, chief,
    # task is "chief", task index.
    agreeing = np.array([[1, 11, 22, 33, 1, 0, 0], [1, 11, 22, 33, 0, 0, 1], [1, 11, 22, 33, 0, 0, 1]])
    assert disagreements(agreeing, 0) == []
    rows = agreeing.copy()
    rows[1, 1] = 12  # another graph
    rows[2, 3] = 34  # other versions (a second replica of worker 1: named once)
    assert disagreements(rows, 0) == ["worker 1 extracted another training graph than the chief (edges or tensor "
                                      "sizes differ: another model, batch shape, TensorFlow or Keras version)",
                                      "worker 1 runs other TensorFlow or Keras versions than the chief"]
    with_chief = np.array([[1, 11, 22, 33, 1, 1, 0], [0, 0, 22, 33, 0, 0, 0]])
    assert disagreements(with_chief, 0) == ["worker 0 could not extract its graph (its own log says why)"]


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[6]) if len(sys.argv) > 6 else None, sys.argv[4],
            sys.argv[5])
