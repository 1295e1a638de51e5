"""Where along the step the memory model over- or under-counts: the simulator's memory at each
compute statement beside the most bytes the compiled step requests while it runs
(:func:`tfremat.measure.requested_ledger`), for one conformance model and plan.

``--mixed`` builds the model under Keras's ``mixed_float16``; its optimizer is then a
``LossScaleOptimizer``, whose weight gradients are held from their backward node to the
updates at the end of the step (``tfremat.graph.DFGraph.weight_grads_to_end``).

Run: ``python benchmarks/requested_ledger.py gpt2_hub --mixed --plan optimal:"60% of activations"``
(prints a markdown table: every statement whose prediction or request is within ``--near``
of the predicted peak, and the largest gaps).
"""

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

import conformance  # noqa: E402

MiB = 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a conformance model name (benchmarks/conformance.py)")
    parser.add_argument("--mixed", action="store_true", help="build the model under mixed_float16")
    parser.add_argument("--plan", default="checkpoint_all:100%", help="strategy:budget (default checkpoint_all:100%%)")
    parser.add_argument("--batch", type=int, default=conformance.BATCH, help="batch size")
    parser.add_argument("--time_limit", type=float, default=20.0, help="seconds for an optimal solve")
    parser.add_argument("--near", type=float, default=0.9, help="list statements within this share of the peak")
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    from tfremat.extract.extractor import extract
    from tfremat.measure import requested_ledger
    from tfremat.model_planning import loss_and_optimizer, synthetic_batch
    from tfremat.planner import plan_graph
    from tfremat.static_graph.compile import compile_step

    strategy, budget = args.plan.split(":", 1)
    keras.mixed_precision.set_global_policy("mixed_float16" if args.mixed else "float32")
    try:
        model = conformance.build(args.model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    training = loss_and_optimizer(model, None, None)
    x, y = tf.nest.map_structure(tf.constant, synthetic_batch(model, args.batch, loss=training["loss"], seed=0))

    def fresh():
        return type(training["optimizer"]).from_config(training["optimizer"].get_config())

    extraction = extract(model, sample_batch=(x, y), cost_model="profile", use_cache=False,
                         **{**training, "optimizer": fresh()})
    options = {"time_limit": args.time_limit} if strategy in ("optimal", "monet") else {}
    result = plan_graph(extraction.graph, budget, strategy, verbose=0, **options)
    optimizer = fresh()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, result.schedule, optimizer=optimizer)
    rows = requested_ledger(extraction, result.schedule, step, x, y,
                            list(model.variables) + list(optimizer.variables))

    peak = max(row["predicted_bytes"] for row in rows)
    requested = max(row["requested_bytes"] or 0 for row in rows)
    lines = [f"{args.model}{' fp16' if args.mixed else ''} {strategy} at {budget}, batch {args.batch}: predicted "
             f"{peak / MiB:.3f} MiB, requested {requested / MiB:.3f} MiB ({requested / peak:.3f})",
             f"fixed bytes: {dict(extraction.side_table.fixed_bytes_breakdown)}", "",
             "| statement | scope | node | predicted MiB | requested MiB | predicted - requested KiB |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        got = row["requested_bytes"]
        if max(row["predicted_bytes"], got or 0) < args.near * peak:
            continue
        predicted = row["predicted_bytes"]
        cells = [str(row["statement"]), row["scope"], row["name"], f"{predicted / MiB:.3f}",
                 "" if got is None else f"{got / MiB:.3f}",
                 "" if got is None else f"{(predicted - got) / 1024:+.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
