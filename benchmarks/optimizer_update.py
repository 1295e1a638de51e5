"""Optimizer update temporaries: the probe's counts and the compiled step against the prediction.

Per optimizer: the weight-sized buffers its update requests beyond the variable, its
gradient and its slots, for the variable whose update peaks ("first") and for every other
variable updated at the same time ("concurrent"), as :func:`tfremat.extract.optimizer_update.update_temporaries`
measures them; and on a weight-heavy MLP (4 x Dense(512), batch 64) the compiled
checkpoint-all step's requested bytes and allocator peak against the prediction, which
counts them (``count="requested"`` of :func:`tfremat.runtime.memory.measure_step_peak`).

Run: ``TF_NUM_INTEROP_THREADS=1 .venv/bin/python benchmarks/optimizer_update.py``
(writes ``benchmarks/results/optimizer_update.md``).
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the test models (dense_mlp)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tfremat, not an installed one

import tfremat  # noqa: E402,F401  (sets the BFC allocator before TensorFlow)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import dense_mlp  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.extract.optimizer_update import update_temporaries  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.01),
    "SGD momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
    "SGD nesterov": lambda: keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(1e-3),
    "AdamW": lambda: keras.optimizers.AdamW(1e-3),
    "RMSprop": lambda: keras.optimizers.RMSprop(1e-3),
    "RMSprop momentum": lambda: keras.optimizers.RMSprop(1e-3, momentum=0.9),
    "Adagrad": lambda: keras.optimizers.Adagrad(1e-3),
    "Lion": lambda: keras.optimizers.Lion(1e-4),
    "SGD momentum clipnorm": lambda: keras.optimizers.SGD(0.01, momentum=0.9, clipnorm=1.0),
    "Adam global_clipnorm": lambda: keras.optimizers.Adam(1e-3, global_clipnorm=1.0),
    "LossScaleOptimizer(SGD momentum)": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9)),
}
MIB = 2**20


def _row(name: str, make) -> str:
    temporaries = update_temporaries(make())
    model = dense_mlp()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((64, 256)).astype("float32"))
    y = tf.constant(np.eye(10, dtype="float32")[rng.integers(0, 10, 64)])
    optimizer = make()
    extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", repeats=1, use_cache=False)
    schedule = get_strategy("checkpoint_all")(extraction.graph)
    predicted = simulate(extraction.graph, schedule).peak_bytes
    step = compile_step(extraction, schedule, optimizer=optimizer)
    resident = list(model.variables) + list(optimizer.variables)
    requested = measure_step_peak(step, x, y, resident=resident, count="requested")
    allocator = measure_step_peak(step, x, y, resident=resident)
    updates = sum(extraction.side_table.update_bytes.values())
    return (f"| {name} | {temporaries.first:.2f} | {temporaries.concurrent:.2f} | {extraction.side_table.weight_grads} "
            f"| {updates / MIB:.3f} | {predicted / MIB:.3f} | {requested / MIB:.3f} | {allocator / MIB:.3f} "
            f"| {predicted / requested:.3f} |")


def main() -> None:
    rows = [_row(name, make) for name, make in OPTIMIZERS.items()]
    load = os.getloadavg()[0]
    text = "\n".join([
        "# Optimizer update temporaries",
        "",
        "Produced by `TF_NUM_INTEROP_THREADS=1 .venv/bin/python benchmarks/optimizer_update.py` "
        f"(TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU, load {load:.1f}; memory does not depend "
        "on load).",
        "",
        "first / concurrent: weight-sized buffers of the update beyond the variable, gradient and slots, for the "
        "variable that peaks and for each other one updated at once (512 x 512 probe). MLP: 4 x Dense(512) on 256 "
        "inputs, batch 64, compiled checkpoint-all step; update MiB: what the prediction counts for the updates "
        "(all nodes); MiB in the graph's convention.",
        "",
        "| optimizer | first | concurrent | weight grads | update MiB | predicted MiB | requested MiB "
        "| allocator MiB | predicted / requested |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])
    path = pathlib.Path(__file__).parent / "results" / "optimizer_update.md"
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
