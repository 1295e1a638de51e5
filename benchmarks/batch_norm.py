"""Batch-norm implementations timed: Keras 3's own against the ``fused`` alternative.

The ``fused`` implementation (:mod:`tfremat.runtime.layer_variants`) keeps the same bytes
for the backward as Keras's unfused batch norm; what it can change is cost. This times one
training-mode forward and backward (input, gamma and beta gradients), moving statistics
updated as the layer updates them, at ResNet50's batch-norm shapes for a 64x64 input at
batch 8, inside ``tf.function``: the median of timed runs after warm-up, both in the same
process.

Run: ``python benchmarks/batch_norm.py`` (writes ``benchmarks/results/batch_norm.md``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tfremat, not an installed one

from provenance import header  # noqa: E402

from tfremat.runtime.layer_variants import running  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "batch_norm.md")
# ResNet50's batch-norm inputs at 64x64, batch 8 (its four stages, narrow and wide).
SHAPES = ((8, 16, 16, 64), (8, 16, 16, 256), (8, 8, 8, 128), (8, 8, 8, 512), (8, 4, 4, 1024), (8, 2, 2, 2048))


def step_seconds(layer, shape, implementation: str, repeats: int) -> float:
    x = tf.random.stateless_normal(shape, seed=[1, 2])
    dy = tf.random.stateless_normal(shape, seed=[3, 4])

    @tf.function
    def step(x, dy):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return tape.gradient(y, [x, layer.gamma, layer.beta], output_gradients=dy)

    with running(layer, implementation):
        for _ in range(5):
            step(x, dy)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            [g.numpy() for g in step(x, dy)]
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per shape and implementation")
    parser.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)
    rows = []
    for shape in SHAPES:
        layer = keras.layers.BatchNormalization()
        layer.build(shape)
        keras_seconds = step_seconds(layer, shape, "default", args.repeats)
        fused_seconds = step_seconds(layer, shape, "fused", args.repeats)
        rows.append(f"| {shape} | {keras_seconds * 1e3:.3f} | {fused_seconds * 1e3:.3f} | "
                    f"{fused_seconds / keras_seconds:.2f} |")
    lines = [
        "# Batch norm: Keras 3's implementation against `fused`",
        "",
        header(argv),
        "",
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU. One training forward and backward "
        f"(gradients of input, gamma and beta) inside `tf.function`, median of {args.repeats} runs.",
        "",
        "| input shape | Keras ms | fused ms | fused / Keras |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
