"""A ``mixed_float16`` step against its prediction and against plain training, with the
float32 step of the same model as the control (benchmarks/results/mixed_precision_step.md).

Under ``mixed_float16`` Keras wraps the optimizer in a ``LossScaleOptimizer``, whose update
holds a ``tf.cond`` on the gradients being finite: a call that TensorFlow's single-threaded
executor can wait on for ever (:mod:`tfremat.runtime.executor`). Each row is one fresh
process (TensorFlow's default inter-op threads unless ``--interop 1``, oneDNN as the machine
has it, the BFC allocator, no cache) running :func:`tfremat.measure.measure_model` on one
model, policy and strategy: the predicted peak, the bytes the step's operations request,
the allocator's peak, the executor the step's planned part ran on, and its time over a plain
tape step in turns (median and quartiles of ``--steps`` rounds) against the plan's predicted
time over plain. The 1-minute load is recorded at each row's start.

Models: ``cnn`` is user_check_3.py's ``mixed_cnn`` model (three 32-filter convolutions with
batch normalization, max pooling, two 64-filter convolutions, dropout, a float32 softmax head)
at batch 32; ``mlp`` is four Dense(1024, relu) layers on 256 features and a float32 head,
at batch 256.

    python benchmarks/mixed_precision_step.py --out benchmarks/results/mixed_precision_step.json
    python benchmarks/mixed_precision_step.py --models cnn --policies mixed_float16 --interop 1

At 7c6c8b0 this script had a ``--turns`` mode comparing, in one process, the step split into
the plan (single-threaded executor) and the update apart (``CompiledStep.update_apart``, reverted
since) with the one-call default-executor step; ``git show 7c6c8b0:benchmarks/mixed_precision_step.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2**20
ROW = "MIXED_STEP_ROW "


def _cnn():
    import keras
    from keras import layers

    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (32, 32, 32):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = layers.BatchNormalization()(h)
    h = layers.MaxPooling2D()(h)
    for filters in (64, 64):
        h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    h = layers.Dropout(0.3)(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax", dtype="float32")(h), name="cnn")


def _mlp():
    import keras
    from keras import layers

    inputs = keras.Input((256,))
    h = inputs
    for _ in range(4):
        h = layers.Dense(1024, activation="relu")(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax", dtype="float32")(h), name="mlp")


MODELS = {"cnn": (_cnn, 32), "mlp": (_mlp, 256)}
STRATEGIES = {"checkpoint_all": 1.0, "chen_sqrtn": 1.0}


def child(model_name: str, policy: str, strategy: str, steps: int) -> dict:
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    sys.path.insert(0, ROOT)
    import keras
    import tensorflow as tf

    from tfremat import measure

    keras.mixed_precision.set_global_policy(policy)
    build, batch = MODELS[model_name]
    keras.utils.set_random_seed(0)
    model = build()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    row = measure.measure_model(model, STRATEGIES[strategy], batch_size=batch, strategy=strategy, steps=steps,
                                verbose=0, cache=False)
    keys = ("optimizer", "predicted_peak_bytes", "requested_peak_bytes", "measured_peak_bytes", "step_executor",
            "time_over_plain", "time_over_plain_quartiles", "predicted_time_over_plain", "gradients_match",
            "step_seconds", "plain_step_seconds")
    return {**{key: row[key] for key in keys}, "interop": tf.config.threading.get_inter_op_parallelism_threads()}


def run(model_name: str, policy: str, strategy: str, steps: int, interop: str, timeout: float) -> dict:
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               TFREMAT_CACHE_DIR=tempfile.mkdtemp(prefix="tfremat_mixed_step_"))
    env.pop("TF_NUM_INTEROP_THREADS", None)
    if interop != "default":
        env["TF_NUM_INTEROP_THREADS"] = interop
    load = os.getloadavg()[0]
    began = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model_name, policy, strategy,
                           str(steps)], env=env, capture_output=True, text=True, timeout=timeout)
    rows = [line[len(ROW):] for line in done.stdout.splitlines() if line.startswith(ROW)]
    row = json.loads(rows[-1]) if rows else {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return {"model": model_name, "policy": policy, "strategy": strategy, "interop_asked": interop, "load": load,
            "wall_s": round(time.perf_counter() - began, 1), **row}


def describe(row: dict) -> str:
    if "error" in row:
        return f"| {row['model']} | {row['policy']} | {row['strategy']} | {row['error']} |"
    predicted = row["predicted_peak_bytes"]
    q1, q3 = row["time_over_plain_quartiles"]
    return (f"| {row['model']} | {row['policy']} | {row['strategy']} | {row['interop']} | {row['step_executor']} | "
            f"{predicted / MiB:.2f} | {row['requested_peak_bytes'] / MiB:.2f} "
            f"({row['requested_peak_bytes'] / predicted:.3f}) | {row['measured_peak_bytes'] / MiB:.2f} "
            f"({row['measured_peak_bytes'] / predicted:.3f}) | {row['time_over_plain']:.3f} ({q1:.2f}-{q3:.2f}) | "
            f"{row['predicted_time_over_plain']:.3f} | {row['gradients_match']} | {row['load']:.1f} |")


HEADER = ("| model | policy | strategy | inter-op | planned part on | predicted MiB | requested MiB (/pred) | "
          "allocator MiB (/pred) | time/plain (quartiles) | predicted time/plain | gradients match | load |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_float16"])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--interop", default="default", help="TF_NUM_INTEROP_THREADS of the rows ('default': unset)")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (step and plain in turns)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", help="a JSON file for the rows")
    args = parser.parse_args()
    if args.child:
        model_name, policy, strategy, steps = args.child
        print(ROW + json.dumps(child(model_name, policy, strategy, int(steps))), flush=True)
        return
    rows = []
    print(HEADER, flush=True)
    for model_name in args.models:
        for policy in args.policies:
            for strategy in args.strategies:
                rows.append(run(model_name, policy, strategy, args.steps, args.interop, args.timeout))
                print(describe(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
