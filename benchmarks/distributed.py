"""Per-replica peak and step time under MultiWorkerMirroredStrategy, 1 and 2 replicas (issue 35 item 7).

Each replica is a local worker process (``TF_CONFIG`` on 127.0.0.1) with its own CPU
allocator, so the allocator's peak is per replica: what a budget per device must hold.
Every configuration trains a conv net with ``tfremat.fit`` at the same per-replica batch
(weak scaling: the global batch grows with the replicas) at checkpoint-all ("100%",
``checkpoint_all``) and at "50% of activations" (``optimal``, flops cost model). A worker
resets the allocator's statistics after the first epoch (which plans and traces) and
reports the peak over the second epoch and the median step time of its batches; the
table holds the chief's numbers and the largest peak over the replicas.

Run: ``python benchmarks/distributed.py`` (writes ``benchmarks/results/distributed.md``).
Ops run one at a time (``TF_NUM_INTEROP_THREADS=1``), as the simulator models.
"""

import json
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PER_REPLICA_BATCH = 32
STEPS = 8  # per epoch
CONFIGS = [("checkpoint-all", "100%", "checkpoint_all"), ("50% of activations", "50% of activations", "optimal")]


def worker(budget: str, strategy_name: str) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((32, 32, 3))
        hidden = inputs
        for channels in (32,) * 12:
            hidden = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(hidden)
        hidden = keras.layers.GlobalAveragePooling2D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = PER_REPLICA_BATCH * replicas
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, batch * STEPS)
    times, peaks = [], []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_begin(self, step, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            times.append(time.perf_counter() - self.started)

        def on_epoch_end(self, epoch, logs=None):
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])

    options = {"time_limit": 30} if strategy_name == "optimal" else {}
    history = tfremat.fit(model, budget, x, y, batch_size=batch, epochs=2, shuffle=False, strategy=strategy_name,
                          cost_model="flops", callbacks=[Timer()], verbose=0, **options)
    plan = next(iter(history.plans.values()))
    print("RESULT " + json.dumps({"peak": peaks[-1], "step": float(np.median(times[STEPS:])),
                                  "predicted": plan.predicted_peak_bytes, "budget": plan.budget_bytes,
                                  "recomputations": plan.schedule.recompute_count}), flush=True)


def run(replicas: int, budget: str, strategy_name: str) -> list[dict]:
    sockets = [socket.socket() for _ in range(replicas)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    processes = []
    try:
        for index in range(replicas):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            processes.append(subprocess.Popen([sys.executable, __file__, "--worker", budget, strategy_name], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for output in outputs:
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"a worker reported nothing:\n{output[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def main() -> None:
    from tfremat.budget import format_bytes

    rows = []
    for label, budget, strategy_name in CONFIGS:
        for replicas in (1, 2):
            results = run(replicas, budget, strategy_name)
            chief = results[0]
            rows.append(f"| {label} | {replicas} | {PER_REPLICA_BATCH * replicas} | {chief['recomputations']} | "
                        f"{format_bytes(chief['budget'])} | {format_bytes(chief['predicted'])} | "
                        f"{format_bytes(max(r['peak'] for r in results))} | {chief['step'] * 1000:.0f} |")
            print(rows[-1], flush=True)
    load = os.getloadavg()
    text = "\n".join([
        "# Per-replica peak and step time under MultiWorkerMirroredStrategy",
        "",
        "`python benchmarks/distributed.py`: a 12-conv net (32 channels, 32x32x3 input), per-replica batch "
        f"{PER_REPLICA_BATCH}, each replica a local worker process with its own BFC CPU allocator, "
        f"TF_NUM_INTEROP_THREADS=1, flops cost model, {STEPS} steps per epoch; peak and median step time over "
        f"the second epoch. Load average at the end: {load[0]:.1f} (2 cores, shared machine: times are noisy).",
        "",
        "| budget | replicas | global batch | recomputations | budget bytes | predicted peak | allocator peak "
        "(largest replica) | step ms (chief) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    with open(os.path.join(HERE, "results", "distributed.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
