"""How repeatable the plain overlap is and what it costs (issue 33 item 2).

For each model, :func:`tfremat.extract.overlap.measure_plain_overlap` runs ``--repeats``
times, each a fresh measurement (its own traces, warm-up and rounds), as each extraction
without a cached profile makes it; the table gives every factor and its seconds. It runs
with TensorFlow's default inter-op threads (``TF_NUM_INTEROP_THREADS=0`` unless set; with
one the factor is 1.0 and nothing is measured).

Run: ``python benchmarks/plain_overlap.py --only transformer_encoder,gpt2_hub --batch 8``
(prints a markdown table; ``--out`` also writes it).
"""

import os

os.environ.setdefault("TF_NUM_INTEROP_THREADS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

import conformance  # noqa: E402
from provenance import header, load_line, write_report  # noqa: E402


def measure(name: str, batch: int, repeats: int) -> list[tuple[float, float]]:
    """``(factor, seconds)`` of ``repeats`` fresh measurements on the conformance model ``name``."""
    import keras
    import tensorflow as tf

    from tfremat.extract.layer_graph import model_output_names
    from tfremat.extract.losses import resolve_loss
    from tfremat.extract.overlap import measure_plain_overlap
    from tfremat.model_planning import synthetic_batch

    model = conformance.build(name)
    x, y = synthetic_batch(model, batch, loss="categorical_crossentropy", seed=0)
    x, y = tf.nest.map_structure(tf.constant, (x, y))
    loss_fn = resolve_loss("categorical_crossentropy", len(model.outputs), model_output_names(model))
    results = []
    for _ in range(repeats):
        started = time.perf_counter()
        factor = measure_plain_overlap(model, x, y, loss_fn, keras.optimizers.SGD()).factor
        results.append((factor, time.perf_counter() - started))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="conformance model names, comma separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="fresh measurements per model")
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    lines = [header(argv), "", f"Batch {args.batch}, SGD, inter-op threads "
             f"{os.environ['TF_NUM_INTEROP_THREADS']} (0: TensorFlow's default).", "",
             "| model | plain overlap per measurement | seconds per measurement |", "|---|---|---|"]
    for name in args.only.split(","):
        results = measure(name, args.batch, args.repeats)
        lines.append(f"| {name} | {', '.join(f'{f:.3f}' for f, _ in results)} | "
                     f"{', '.join(f'{s:.1f}' for _, s in results)} |")
    lines += ["", load_line()]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
