"""Which executor a recurrent layer's training step holds less memory on (issue 33, session 30's task H).

TensorFlow's single-threaded executor runs a ``While`` body without oneDNN's kernels, and
TensorFlow's own CPU kernels of a 2-D convolution's gradients allocate scratch for a 30 MiB
working set (:mod:`tfremat.runtime.executor`). Two parts, with TensorFlow's default inter-op
threads:

- ``plain``: the allocator's peak of a plain tape step (a recurrent layer, no tfremat) on the
  default and on the single-threaded executor, in turns, for ConvLSTM2D, ConvLSTM1D,
  ConvLSTM3D, LSTM and GRU, and whether :func:`tfremat.runtime.executor.blocking_call` keeps
  the layer's step off the single-threaded executor;
- ``step``: a ConvLSTM2D model's compiled checkpoint-all step (memory-only extraction, so
  that its workspaces are measured on the step's executor) with the loop check (the default
  executor) and without it (oneDNN reported off to the check: the single-threaded executor,
  as before the check): the predicted peak, the allocator's peak and its seconds over a
  plain tape step on the default executor, in turns, and the gradients against plain's.

Run: ``python benchmarks/convlstm_executor.py [--rounds 5]``; prints one JSON object.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfremat.extract import extract  # noqa: E402
from tfremat.plan.simulator import simulate  # noqa: E402
from tfremat.runtime import executor, internals  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

MIB = 1 << 20
LAYERS = {
    "ConvLSTM2D": (lambda: keras.layers.ConvLSTM2D(16, 3, padding="same", return_sequences=True), (6, 16, 16, 1)),
    "ConvLSTM1D": (lambda: keras.layers.ConvLSTM1D(16, 3, padding="same", return_sequences=True), (6, 16, 1)),
    "ConvLSTM3D": (lambda: keras.layers.ConvLSTM3D(8, 3, padding="same", return_sequences=True), (4, 8, 8, 8, 1)),
    "LSTM": (lambda: keras.layers.LSTM(256, return_sequences=True), (6, 64)),
    "GRU": (lambda: keras.layers.GRU(128, return_sequences=True), (6, 32)),
}


def _model(name):
    keras.utils.set_random_seed(0)
    layer, shape = LAYERS[name]
    inputs = keras.Input(shape)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(layer()(inputs)))
    model = keras.Model(inputs, outputs, name=name.lower())
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((4, *shape), dtype=np.float32))
    return model, x, tf.constant(rng.random((4, 1), dtype=np.float32))


def _plain(model):
    def step(a, b):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(b, model(a, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    return step


def _peak(run) -> int:
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start


def plain_part(rounds):
    rows = {}
    for name in LAYERS:
        model, x, y = _model(name)
        default = tf.function(_plain(model), autograph=False)
        with executor.sequential():
            single = tf.function(_plain(model), autograph=False)
            blocking = executor.blocking_call(single.get_concrete_function(x, y).graph)

        def run_single():
            with executor.sequential():
                [g.numpy() for g in single(x, y)]

        def run_default():
            [g.numpy() for g in default(x, y)]

        run_default(), run_single()
        peaks = {"default": [], "single_threaded": []}
        for _ in range(rounds):  # in turns
            peaks["default"].append(_peak(run_default))
            peaks["single_threaded"].append(_peak(run_single))
        rows[name] = {"peaks_mib": {k: [round(v / MIB, 2) for v in p] for k, p in peaks.items()},
                      "single_over_default": round(max(peaks["single_threaded"]) / max(peaks["default"]), 2),
                      "kept_off_single_threaded": blocking.describe() if blocking else None}
    return rows


def step_part(rounds, loop_check):
    model, x, y = _model("ConvLSTM2D")
    saved = [v.numpy() for v in model.variables]
    reported = internals.onednn_enabled
    if not loop_check:
        internals.onednn_enabled = lambda: False
    try:
        started = time.perf_counter()
        extraction = extract(model, (x, y), loss="mse", timing=False, use_cache=False)
        extract_seconds = time.perf_counter() - started
        step = compile_step(extraction, get_strategy("checkpoint_all")(extraction.graph), apply_gradients=False)
        _, grads = step(x, y)  # traced: the executor chosen
    finally:
        internals.onednn_enabled = reported
    plain = tf.function(_plain(model), autograph=False)
    expected = plain(x, y)
    error = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, expected))
    run_step = lambda: [g.numpy() for g in step(x, y)[1]]  # noqa: E731
    run_plain = lambda: [g.numpy() for g in plain(x, y)]  # noqa: E731
    peaks, plain_peaks, seconds, plain_seconds = [], [], [], []
    for _ in range(rounds):  # in turns
        peaks.append(_peak(run_step))
        plain_peaks.append(_peak(run_plain))
        for runs, run in ((seconds, run_step), (plain_seconds, run_plain)):
            start = time.perf_counter()
            run()
            runs.append(time.perf_counter() - start)
    for variable, value in zip(model.variables, saved):
        variable.assign(value)
    return {"executor": "single-threaded" if step.sequential else "default",
            "predicted_mib": round(simulate(step.graph, step.schedule).peak_bytes / MIB, 2),
            "allocator_mib": [round(p / MIB, 2) for p in peaks],
            "plain_default_mib": [round(p / MIB, 2) for p in plain_peaks],
            "allocator_over_plain": round(max(peaks) / max(plain_peaks), 2),
            "time_over_plain": round(min(seconds) / min(plain_seconds), 2),
            "gradient_max_abs_error": error, "extract_seconds": round(extract_seconds, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("plain", "step"))
    args = parser.parse_args()
    result = {"onednn": bool(internals.onednn_enabled()),
              "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
              "load_before": os.getloadavg()[0]}
    if args.only in (None, "plain"):
        result["plain"] = plain_part(args.rounds)
    if args.only in (None, "step"):
        result["step_with_loop_check"] = step_part(args.rounds, True)
        result["step_without_loop_check"] = step_part(args.rounds, False)
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
