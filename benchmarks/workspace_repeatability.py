"""Are the profiled workspaces the same from one extraction to the next?

Extracts one small model N times in one process (``cost_model="profile"``, nothing timed
unless ``--timed``, no cache) and prints, per node, the distinct forward and backward
workspaces the graphs got (``DFGraph.workspace_bytes``). A node with more than one value makes graphs differ
between runs: profile cache entries that disagree, and schedules that change with them.
Exit status 1 when any node's workspace differs, 0 when all agree.

Models: ``conv`` is tests/test_memory_only_extract.py's (Conv2D(8), ReLU, MaxPool, Dense,
batch 8), whose convolution backward measured 912 or 13,232 bytes;
``batchnorm`` puts a BatchNormalization after its convolution; ``lstm`` is
tests/test_default_threads_memory.py's two stacked LSTMs (16 steps, 32 units, batch 4),
whose loops' workspaces move (run it with TensorFlow's default inter-op threads, as that
test does); ``transformer_encoder`` is benchmarks/conformance.py's (six post-norm encoder
blocks over 64 tokens, batch 2), whose attention backwards measured 82,944, 116,352 or
131,072 bytes, and its dropouts and loss a few bytes apart. ``--timed`` profiles as
``extract`` does by default, the calls timed too.

Run: ``python benchmarks/workspace_repeatability.py [--model conv|batchnorm|lstm|transformer_encoder] [--runs 6]
[--timed]``
(results and the cause: ``benchmarks/results/workspace_repeatability.md``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tfremat, not an installed one

import tfremat  # noqa: E402,F401  (sets the allocator before TensorFlow loads)
import keras  # noqa: E402

from tfremat.extract.extractor import extract  # noqa: E402

MODELS = ("conv", "batchnorm", "lstm", "transformer_encoder")


def build(kind: str, batch: int = 8):
    """The model and one batch: ``kind`` is one of :data:`MODELS`."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "lstm":
        return _lstm(batch=4)
    if kind == "transformer_encoder":
        import conformance

        model = conformance.build(kind)
        return model, conformance.sample_batch(model)
    x = keras.Input((16, 16, 3))
    h = layers.Conv2D(8, 3, padding="same")(x)
    if kind == "batchnorm":
        h = layers.BatchNormalization()(h)
    h = layers.ReLU()(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Flatten()(h)
    model = keras.Model(x, layers.Dense(4, activation="softmax")(h))
    inputs = np.random.default_rng(0).standard_normal((batch, 16, 16, 3)).astype("float32")
    labels = np.zeros((batch, 4), "float32")
    labels[:, 0] = 1
    return model, (inputs, labels)


def _lstm(batch: int):
    inputs = keras.Input((16, 8))
    hidden = keras.layers.LSTM(32, return_sequences=True)(inputs)
    hidden = keras.layers.LSTM(32)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    sequences = np.random.default_rng(0).standard_normal((batch, 16, 8)).astype("float32")
    labels = np.zeros((batch, 3), "float32")
    labels[:, 0] = 1
    return model, (sequences, labels)


def distinct_workspaces(model, batch, runs: int, timed: bool = False) -> dict[str, list[int]]:
    """Per node, the distinct workspace bytes over ``runs`` extractions, memory-only
    or ``timed`` (as ``extract`` profiles by default), in the order first seen.

    Nodes are matched by position, named as in the first extraction: the node order is the
    same in every extraction, and the names of the calls a layer is opened into are not
    (``dot_product_attention``, then ``dot_product_attention_6``: Keras numbers each new one).
    """
    names: list[str] = []
    values: list[list[int]] = []
    for _ in range(runs):
        graph = extract(model, batch, cost_model="profile", use_cache=False, timing=timed).graph
        if not names:
            names, values = list(graph.names), [[] for _ in graph.names]
        for seen, workspace in zip(values, graph.workspace_bytes):
            if workspace not in seen:
                seen.append(workspace)
    return dict(zip(names, values))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="conv")
    parser.add_argument("--runs", type=int, default=6, help="extractions in this process (default 6)")
    parser.add_argument("--timed", action="store_true",
                        help="time the calls too, as extract() does by default (slower; the workspaces are "
                             "measured the same way, but after other calls' timing passes)")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2 to compare extractions")
    model, batch = build(args.model)
    seen = distinct_workspaces(model, batch, args.runs, args.timed)
    differing = {name: values for name, values in seen.items() if len(values) > 1}
    print(f"{args.model}: {args.runs} {'timed' if args.timed else 'memory-only'} extractions, workspace bytes per node")
    for name, values in seen.items():
        print(f"  {name:28s} {', '.join(map(str, values))}{'   <- differs' if len(values) > 1 else ''}")
    print(f"{len(differing)} of {len(seen)} nodes differ" if differing else "every node agrees")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
