"""Wide sums on the single-threaded executor (issue 33: InceptionV3 crashed tfremat.fit).

``--part trigger``: when Grappler's memory optimizer rewrites a sum of more than two inputs into
a ``TemporaryVariable`` and ``AssignAdd``s, which TensorFlow's single-threaded executor refuses
(reference-typed edge): a ``tf.function`` summing ``terms`` float32 tensors of ``mib`` MiB each
(``terms + 1`` of them live), run on the single-threaded executor with Grappler's options as
they are and inside :func:`tfremat.runtime.executor.sequential` (the memory optimizer off), with
the CPU device's memory limit that Grappler compares against.

``--part inception``: ``keras.applications.InceptionV3(weights=None)`` at 75x75, batch 4, Adam:
its plain training step (as the plain overlap runs it) on the single-threaded executor both
ways; the plain overlap as extraction measures it (:func:`tfremat.extract.overlap.measure_plain_overlap`);
then one step's gradients of the compiled plan (checkpoint-all and ``--budget`` with
``--strategy``, ``cost_model="flops"``) run inside ``sequential()`` against a plain traced tape's
on the default executor, beside a plain eager tape's against the same (plain rounding).

Run: ``python benchmarks/reference_edges.py --part trigger``; ``--part inception`` (4-6 min on 2
loaded cores). Results: results/reference_edges.md.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfremat.runtime import executor  # noqa: E402


def _outcome(run) -> str:
    try:
        run()
        return "runs"
    except tf.errors.UnimplementedError as error:
        return "refused" if "reference-typed" in str(error) else f"UnimplementedError {error.message[:80]}"


def trigger() -> None:
    from tensorflow.python.client import device_lib

    limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "CPU")
    print(f"CPU device memory limit {limit / 2**20:.0f} MiB; 80% of it {0.8 * limit / 2**20:.1f} MiB")
    print("| terms | MiB each | live MiB (terms + input) | single-threaded, Grappler as is | inside sequential() |")
    print("|---|---|---|---|---|")
    for terms, mib in ((2, 80), (3, 50), (3, 52), (5, 33), (5, 35), (8, 22), (8, 23)):
        x = tf.ones([int(mib * 2**20) // 4])

        @tf.function(autograph=False)
        def total(x, terms=terms):
            return tf.reduce_max(tf.add_n([x * float(term + 1) for term in range(terms)]))

        def raw():
            with tf.experimental.function_executor_type(executor.SEQUENTIAL_EXECUTOR):
                total(x).numpy()

        def fixed():
            with executor.sequential():
                total(x).numpy()

        print(f"| {terms} | {mib} | {(terms + 1) * mib} | {_outcome(raw)} | {_outcome(fixed)} |", flush=True)


def inception(args) -> None:
    import keras

    from tfremat.extract import extract
    from tfremat.extract.overlap import measure_plain_overlap
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.measure import _plain_gradients, _restore
    from tfremat.numerics import closeness
    from tfremat.plan.execution import build_plan
    from tfremat.static_graph.interpreter import interpret_plan
    from tfremat.strategies import get_strategy

    keras.utils.set_random_seed(0)
    model = keras.applications.InceptionV3(input_shape=(75, 75, 3), weights=None, classes=10)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((4, 75, 75, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, 4))
    loss = keras.losses.SparseCategoricalCrossentropy()

    def loss_fn(labels, predictions):
        return loss(labels[0], predictions[0])

    saved = [v.numpy() for v in model.variables]
    step = plain_train_step(model, loss_fn, keras.optimizers.Adam())

    def raw():
        with tf.experimental.function_executor_type(executor.SEQUENTIAL_EXECUTOR):
            step(x, [y]).numpy()

    def fixed():
        with executor.sequential():
            step(x, [y]).numpy()

    began = time.perf_counter()
    print(f"plain training step on the single-threaded executor: Grappler as is {_outcome(raw)}; inside "
          f"sequential() {_outcome(fixed)} ({time.perf_counter() - began:.1f} s)", flush=True)
    _restore(model, saved)
    for attempt in range(args.overlaps):
        overlap = measure_plain_overlap(model, x, [y], loss_fn, keras.optimizers.Adam())
        print(f"plain overlap {attempt + 1}: factor {overlap.factor:.3f} (quartiles "
              f"{overlap.low:.3f}-{overlap.high:.3f}, {overlap.rounds} rounds, load {overlap.load:.1f}), "
              f"single-threaded plain step {1e3 * overlap.step_seconds:.0f} ms", flush=True)
    began = time.perf_counter()
    extraction = extract(model, (x, y), optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy",
                         cost_model="flops", use_cache=False)
    print(f"extraction (flops): {extraction.graph.size} nodes, {time.perf_counter() - began:.0f} s", flush=True)
    table = extraction.side_table
    eager = _plain_gradients(model, table, x, y, saved, traced=False)
    traced = _plain_gradients(model, table, x, y, saved, traced=True)
    pairs = [(e, t) for e, t in zip(eager, traced) if t is not None]
    print(f"plain eager tape against plain traced tape: {sum(not np.array_equal(e, t) for e, t in pairs)} of "
          f"{len(pairs)} gradients differ, largest per-tensor error "
          f"{closeness([e for e, _ in pairs], [t for _, t in pairs]).max_tensor_error:.1e}", flush=True)
    for strategy, budget in (("checkpoint_all", None), (args.strategy, args.budget)):
        schedule = get_strategy(strategy)(extraction.graph, budget)
        plan = build_plan(extraction.graph, schedule)

        @tf.function(autograph=False)
        def planned_gradients(inputs, labels, plan=plan):
            _, _, grads, _ = interpret_plan(extraction.graph, table, plan, inputs, labels)
            return {key: grad for key, (_, grad) in grads.items()}

        _restore(model, saved)
        began = time.perf_counter()
        with executor.sequential():
            planned = planned_gradients(x, y)
        _restore(model, saved)
        compared = [(tf.convert_to_tensor(planned[id(v)]).numpy(), t)
                    for v, t in zip(model.trainable_variables, traced) if id(v) in planned and t is not None]
        print(f"{strategy} ({budget or 'no budget'}, {schedule.recompute_count} recomputations) on the single-threaded "
              f"executor against plain traced: {sum(not np.array_equal(p, t) for p, t in compared)} of {len(compared)} "
              f"gradients differ, largest per-tensor error "
              f"{closeness([p for p, _ in compared], [t for _, t in compared]).max_tensor_error:.1e} "
              f"({time.perf_counter() - began:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("trigger", "inception"), default="trigger")
    parser.add_argument("--budget", default="97%")
    parser.add_argument("--strategy", default="eviction")
    parser.add_argument("--overlaps", type=int, default=2, help="plain overlap measurements (inception)")
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f} at start, TensorFlow {tf.__version__}", flush=True)
    trigger() if args.part == "trigger" else inception(args)
    print(f"load {os.getloadavg()[0]:.1f} at end", flush=True)


if __name__ == "__main__":
    main()
