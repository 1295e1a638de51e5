"""Predicted peak vs the compiled step's requested bytes (checkpoint-all; the VAE also at
its least budget), with and without the backward workspace measured with the upstream
gradient dying inside the node (``CallAnalysis.dying_backward_workspace``, used where
``assembly.sole_upstream`` allows).

Each model is profiled once (into a temporary profile cache) and assembled twice: "held"
with ``sole_upstream`` answering no call (the workspace measured with the upstream held,
what tfremat did before), "dying" as tfremat does now. Memory only, so the machine's load
does not matter. Run once with oneDNN and once with ``TF_ENABLE_ONEDNN_OPTS=0``:

    .venv/bin/python benchmarks/forwarded_upstream.py
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/forwarded_upstream.py

Results: benchmarks/results/forwarded_upstream.md. Columns: predicted and requested peak
(MiB), their ratio, and the least ``predicted - requested`` (bytes) over the step's statements
(:func:`tfremat.measure.requested_ledger`; negative: a statement requests more than the
simulator holds there).
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFREMAT_CACHE_DIR", tempfile.mkdtemp(prefix="tfremat_forwarded_upstream_"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
import user_check  # noqa: E402
from tfremat.extract import assembly, extract  # noqa: E402
from tfremat.measure import requested_ledger  # noqa: E402
from tfremat.plan.simulator import simulate  # noqa: E402
from tfremat.runtime.memory import measure_step_peak  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402
from test_forwarded_upstream import relu_convnet, residual_net  # noqa: E402

MIB = 2.0 ** 20
BATCH = 16
SOLE = assembly.sole_upstream


def keras_case(build):
    """``(predicted, requested, least margin)`` of a Keras model's checkpoint-all step."""
    model = build()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((BATCH, *model.input_shape[1:]), dtype=np.float32))
    y = tf.constant(rng.random((BATCH, *model.output_shape[1:]), dtype=np.float32))
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), loss="mse", optimizer=optimizer, repeats=1)
    schedule = get_strategy("checkpoint_all")(extraction.graph)
    step = compile_step(extraction, schedule, optimizer=optimizer)
    resident = list(model.variables) + list(optimizer.variables)
    requested = measure_step_peak(step, x, y, resident=resident, count="requested")
    rows = requested_ledger(extraction, schedule, step, x, y, resident=resident)
    return simulate(extraction.graph, schedule).peak_bytes, requested, _least_margin(rows)


def vae_case(budget):
    """The user_check VAE (benchmarks/user_check.py, :func:`user_check.vae_case`) through
    ``value_and_grad`` at ``budget``."""
    vae_loss, data, epsilon = user_check.vae_case(BATCH)
    g = tfremat.value_and_grad(vae_loss, budget, data, epsilon, verbose=0)
    plan = g.plan
    step = g._steps[g._example_key]  # pylint: disable=protected-access
    resident = list(g.trainable_variables)
    requested = measure_step_peak(lambda a, b: g(a, b), data, epsilon, resident=resident, count="requested")
    rows = requested_ledger(plan.extraction, plan.schedule, lambda x, y: step(tf.nest.flatten(x), y),
                            [data, epsilon], g._label, resident=resident)  # pylint: disable=protected-access
    return plan.predicted_peak_bytes, requested, _least_margin(rows)


def _least_margin(rows) -> int:
    return int(min(r["predicted_bytes"] - r["requested_bytes"] for r in rows if r["requested_bytes"] is not None))


def main():
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"
    cases = {"relu_convnet": lambda: keras_case(relu_convnet), "residual_net": lambda: keras_case(residual_net),
             "vae": lambda: vae_case("100%"), "vae at min": lambda: vae_case("min")}
    print("| model | oneDNN | workspace | predicted | requested | predicted/requested | least statement margin (B) |")
    print("|---|---|---|--:|--:|--:|--:|")
    for name, run in cases.items():
        for mode in ("held", "dying"):
            assembly.sole_upstream = SOLE if mode == "dying" else (lambda *args, **kwargs: set())
            predicted, requested, margin = run()
            print(f"| {name} | {'on' if onednn else 'off'} | {mode} | {predicted / MIB:.3f} | {requested / MIB:.3f} "
                  f"| {predicted / requested:.3f} | {margin:+,d} |", flush=True)
    assembly.sole_upstream = SOLE


if __name__ == "__main__":
    main()
