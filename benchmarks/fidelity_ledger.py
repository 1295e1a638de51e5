"""The requested ledger (:func:`tfremat.measure.requested_ledger`) for a user_check model: the
simulator's memory at each compute statement beside the most bytes the compiled step requests
while it runs, the statements where the step requests more than predicted first, then the
largest over-counts (benchmarks/results/fidelity_requested.md).

Run: ``python benchmarks/fidelity_ledger.py unet_seg --plan "optimal:60% of activations" --batch 4``
(``--cache DIR`` reuses profiles from DIR, so that a second run plans the same schedule).
"""

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

MiB = 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a benchmarks/user_check.py model name (unet_seg, ts_transformer, ...)")
    parser.add_argument("--plan", default="checkpoint_all:100%", help="strategy:budget (default checkpoint_all:100%%)")
    parser.add_argument("--batch", type=int, default=4, help="batch size")
    parser.add_argument("--time_limit", type=float, default=30.0, help="seconds for an optimal solve")
    parser.add_argument("--cache", default=None, help="profile cache folder (default: profile afresh)")
    parser.add_argument("--top", type=int, default=12, help="rows of each list")
    parser.add_argument("--events", default=None, help="also list the step's allocations under this scope (forward_70)")
    args = parser.parse_args(argv)
    if args.cache:
        os.environ["TFREMAT_CACHE_DIR"] = args.cache

    import keras
    import tensorflow as tf

    import user_check
    from tfremat.extract.extractor import extract
    from tfremat.measure import requested_ledger
    from tfremat.model_planning import loss_and_optimizer, synthetic_batch
    from tfremat.planner import plan_graph
    from tfremat.static_graph.compile import compile_step

    strategy, budget = args.plan.split(":", 1)
    keras.utils.set_random_seed(0)
    model, loss = user_check.build(args.model)
    model.compile(optimizer="adam", loss=loss)
    training = loss_and_optimizer(model, None, None)
    x, y = tf.nest.map_structure(tf.constant, synthetic_batch(model, args.batch, loss=training["loss"], seed=0))

    def fresh():
        return type(training["optimizer"]).from_config(training["optimizer"].get_config())

    extraction = extract(model, sample_batch=(x, y), cost_model="profile", use_cache=bool(args.cache),
                         **{**training, "optimizer": fresh()})
    options = {"time_limit": args.time_limit} if strategy in ("optimal", "monet") else {}
    result = plan_graph(extraction.graph, budget, strategy, verbose=0, **options)
    optimizer = fresh()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, result.schedule, optimizer=optimizer)
    rows = requested_ledger(extraction, result.schedule, step, x, y,
                            list(model.variables) + list(optimizer.variables))
    graph = extraction.graph
    peak = max(row["predicted_bytes"] for row in rows)
    requested = max(row["requested_bytes"] or 0 for row in rows)
    measured = [r for r in rows if r["requested_bytes"] is not None]
    lines = [f"{args.model} {strategy} at {budget}, batch {args.batch}: predicted {peak / MiB:.3f} MiB, "
             f"requested {requested / MiB:.3f} MiB ({requested / peak:.3f})", "",
             "| statement | scope | node | predicted MiB | requested MiB | predicted - requested KiB | workspace KiB |",
             "|---|---|---|---|---|---|---|"]

    def cells(row):
        got = row["requested_bytes"]
        ws = graph.workspace_bytes[row["node"]] if hasattr(graph, "workspace_bytes") else 0
        return ("| " + " | ".join([str(row["statement"]), row["scope"], row["name"],
                                   f"{row['predicted_bytes'] / MiB:.3f}", f"{got / MiB:.3f}",
                                   f"{(row['predicted_bytes'] - got) / 1024:+.1f}", f"{ws / 1024:.1f}"]) + " |")

    margin = sorted(measured, key=lambda r: r["predicted_bytes"] - r["requested_bytes"])
    lines += [cells(r) for r in margin[:args.top]]
    lines += ["", "Near the predicted peak (within 5%):"]
    lines += [cells(r) for r in measured if r["predicted_bytes"] >= 0.95 * peak][:args.top]
    lines += ["", "Near the requested peak (within 2%):"]
    lines += [cells(r) for r in measured if r["requested_bytes"] >= 0.98 * requested][:args.top]
    if args.events:
        lines += ["", f"Allocations (+) and frees (-) while {args.events} runs, live bytes after each:"]
        lines += _events(step, x, y, graph, args.events)
    sys.stdout.write("\n".join(lines) + "\n")


def _events(step, x, y, graph, scope: str) -> list[str]:
    """The step's allocation events from the first to the last one charged to ``scope``."""
    import tempfile

    from tfremat.measure import _statement_of
    from tfremat.runtime.memory import allocation_events, default_device, synchronize
    from tfremat.runtime.profiler import profiler_trace

    synchronize(step(x, y))
    with tempfile.TemporaryDirectory(prefix="tfremat_ledger_") as logdir:
        with profiler_trace(logdir):
            synchronize(step(x, y))
        events = allocation_events(logdir, default_device())
    events.sort(key=lambda e: (e[0], not e[1]))
    live, current, out, ops = {}, 0, [], {}
    for _, allocation, addr, requested, info in events:
        if allocation:
            live[addr] = requested
            ops[addr] = info["op"]
            current += requested
        else:
            requested = live.pop(addr, requested)
            current -= requested
        mine = _statement_of(info["op"], graph)[0] == scope
        if mine or out:
            out.append(f"{'+' if allocation else '-'}{requested / 1024:.1f} KiB {info['op'] if allocation else ops.get(addr)}"
                       f" -> {current / MiB:.3f} MiB{'' if mine else ' (other)'}")
        if out and not mine and len(out) > 400:
            out = [line for line in out if not line.endswith("(other)")]  # the scope's own, to the end
    while out and out[-1].endswith("(other)"):
        out.pop()
    return out


if __name__ == "__main__":
    main()
