"""tfremat.fit on two machines, played by two local processes (MultiWorkerMirroredStrategy).

Run ``python examples/multi_worker.py``: it starts itself twice as workers on two free ports
of 127.0.0.1 (``TF_CONFIG`` names the cluster and each worker's index, as on real machines),
and each worker builds a small conv net inside the strategy's scope and trains it with
``tfremat.fit`` at 50% of its activation memory (the MILP on analytic costs, which
every worker computes alike and quickly; the default profiled costs are the chief's). The chief (worker 0) plans the schedule for
the per-replica batch and shares it; both print their final weights' checksum, which agree.
On real machines run the ``--worker`` part on each, with ``TF_CONFIG`` listing every
machine's address and its own index.
"""

import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 32  # split over the replicas: 16 per worker here


def worker() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((32, 32, 3))
        hidden = inputs
        for channels in (16,) * 12:
            hidden = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(hidden)
        hidden = keras.layers.GlobalAveragePooling2D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    rng = np.random.default_rng(0)  # the same data on every worker; each trains on its share of every batch
    x = rng.standard_normal((256, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 256)
    history = tfremat.fit(model, "50% of activations", x, y, batch_size=GLOBAL_BATCH, epochs=2,
                          validation_data=(x[:64], y[:64]), cost_model="flops", time_limit=20,
                          callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)])
    plan = next(iter(history.plans.values()))
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
    print(f"worker {task}: loss {history.history['loss']}, {plan.schedule.recompute_count} recomputations per step, "
          f"weights checksum {checksum:.6f}", flush=True)


def main() -> int:
    sockets = [socket.socket() for _ in range(2)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    processes = []
    try:
        for index in range(2):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            processes.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env))
        return max(process.wait(timeout=600) for process in processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        sys.exit(main())
