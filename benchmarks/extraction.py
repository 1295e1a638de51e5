"""Extraction benchmark: graph size, checkpoint-all prediction vs measured peak, timings.

For each model: nodes, edges, the simulator's checkpoint-all peak against a plain
``tf.GradientTape`` step measured two ways (:func:`tfremat.extract.measure_plain_step_peak`):
the bytes its operations request (the kind of bytes the prediction counts; the error is
against these) and the BFC allocator's peak (which adds chunk rounding that moves by
several percent between runs); the bytes tfremat's compiled checkpoint-all step requests
(the step the prediction describes and a budget holds); then the extraction seconds with
a cold profile cache, the profiling part of it, and the seconds of a second (cached)
extraction.

Run: ``python benchmarks/extraction.py`` (writes ``benchmarks/results/extraction.md``).
Ops run one at a time (``TF_NUM_INTEROP_THREADS=1``), the sequential execution the simulator
models; see ``tfremat.extract.assembly`` for what overlapping ops do to the peak.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from models import small_convnet, unet  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.applications import build_application  # noqa: E402
from tfremat.extract import extract, measure_plain_step_peak  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

logger = logging.getLogger("benchmarks.extraction")

MODELS = {
    "small_convnet (32x32, batch 8)": (lambda: small_convnet(), 8),
    "unet depth 4 (64x64, batch 2)": (lambda: unet(input_shape=(64, 64, 3), depth=4), 2),
    "ResNet50 (64x64, batch 2)": (lambda: build_application("resnet50", (64, 64, 3), num_classes=10), 2),
    "MobileNetV2 (64x64, batch 2)": (lambda: build_application("mobilenet_v2", (64, 64, 3), num_classes=10), 2),
    "VGG16 (64x64, batch 2)": (lambda: build_application("vgg16", (64, 64, 3), num_classes=10), 2),
}


def run_one(label, builder, batch):
    model = builder()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input.shape[1:])).astype("float32")
    y = np.zeros((batch, *model.output.shape[1:]), "float32")
    y[..., 0] = 1
    cold = extract(model, (x, y), cost_model="profile")
    warm = extract(model, (x, y), cost_model="profile")
    g = cold.graph
    predicted = checkpoint_all_peak(g)
    table = cold.side_table
    requested = measure_plain_step_peak(model, x, y, table.loss_fn, table.optimizer, count="requested")
    allocator = measure_plain_step_peak(model, x, y, table.loss_fn, table.optimizer)
    step = compile_step(cold, get_strategy("checkpoint_all")(g))
    variables = list(model.variables) + list(table.optimizer.variables)
    saved = [v.numpy() for v in variables]
    compiled = measure_step_peak(step, tf.constant(x), tf.constant(y), resident=variables, count="requested")
    for variable, value in zip(variables, saved):
        variable.assign(value)
    return {
        "model": label,
        "nodes": g.size,
        "edges": len(g.edges),
        "fixed_mb": g.fixed_bytes / 2**20,
        "predicted_mb": predicted / 2**20,
        "requested_mb": requested / 2**20,
        "allocator_mb": allocator / 2**20,
        "error_pct": 100.0 * (requested / predicted - 1),
        "compiled_mb": compiled / 2**20,
        "compiled_error_pct": 100.0 * (compiled / predicted - 1),
        "extract_s": cold.seconds,
        "profile_s": cold.profile_seconds,
        "cached_s": warm.seconds,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "extraction.md"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TFREMAT_CACHE_DIR"] = cache
        rows = []
        for label, (builder, batch) in MODELS.items():
            row = run_one(label, builder, batch)
            logger.info("%s", row)
            rows.append(row)
    lines = [
        "# Extraction benchmark",
        "",
        header(argv),
        "",
        "Checkpoint-all peak predicted by the simulator on the extracted graph vs a plain",
        f"`tf.GradientTape` step (TensorFlow {tf.__version__} CPU, BFC allocator, `TF_NUM_INTEROP_THREADS=1`):",
        "requested = the bytes the step's operations request (the kind of bytes the prediction counts),",
        "allocator = the BFC allocator's peak (adds chunk rounding that moves between runs).",
        "Error = requested / predicted - 1 (negative: the step used less than predicted).",
        "tfremat step = the bytes tfremat's compiled checkpoint-all step requests, and its error against the",
        "prediction (the step a budget holds; the plain step runs weight gradients in another order).",
        "Extraction with `cost_model=\"profile\"` and a cold cache; `cached` is a second extraction.",
        "",
        "| model | nodes | edges | fixed MiB | predicted MiB | requested MiB | error % | allocator MiB "
        "| tfremat step MiB | step error % | extract s | profiling s | cached s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['edges']} | {r['fixed_mb']:.1f} | {r['predicted_mb']:.1f} | "
            f"{r['requested_mb']:.1f} | {r['error_pct']:+.1f} | {r['allocator_mb']:.1f} | {r['compiled_mb']:.1f} | "
            f"{r['compiled_error_pct']:+.1f} | {r['extract_s']:.1f} | "
            f"{r['profile_s']:.1f} | {r['cached_s']:.2f} |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
