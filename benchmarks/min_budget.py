"""The budget "min" against "absolute min", and how far two profiles move "min" (issue 33 item 4).

Two models: a keras.io-style ViT and a residual conv net (tests/models.py's
``residual_chain``: 12 conv-BN-ReLU-dropout blocks added to a running sum, 48x48 inputs).
The ViT follows the keras.io image-classification example, scaled to a CPU: a ``Patches``
layer (``keras.ops.image.extract_patches``), a patch encoder (Dense projection plus a
position ``Embedding``), transformer blocks of LayerNormalization, MultiHeadAttention and a
GELU MLP with dropout, then an MLP head; 32x32 inputs. Each run extracts the training graph
with fresh profiles (no profile cache), so the runs show how far profiling moves "min":

* one forward pass as a share of the step as profiled ("min" counts one pass under cost
  proxies no profile moves, and keeps to at most half a step as profiled:
  :func:`tfremat.strategies.least_budget_within`);
* "absolute min" and "min" as shares of the checkpoint-all peak, the seconds the budget
  took to find, and ``optimal``'s predicted overhead there (``--time_limit`` each); the
  spread of "min" over the runs, in points of the checkpoint-all peak;
* with ``--measure``, the compiled step at "min" against plain training
  (:func:`tfremat.measure_model`, interleaved rounds, its own fresh profile): step time
  over plain, allocator peak over the prediction.

Run: ``python benchmarks/min_budget.py [--models vit,residual_chain] [--runs 2] [--measure]
[--save DIR]`` (writes ``benchmarks/results/min_budget.md``; ``--save`` keeps each run's graph).
``--graphs A.json,B.json`` instead finds "min" on saved graphs, TensorFlow-free, and prints
their table. The machine's cores may be shared: compare
ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The plan's times assume ops run one at a time (README, "Supported models and limits").
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models (residual_chain)

from provenance import header  # noqa: E402

BATCH = 32


def vit():
    """The keras.io ViT at CPU size (tests/models.py), compiled."""
    from models import keras_io_vit

    model = keras_io_vit()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    return model


def residual_chain():
    """tests/models.py's residual conv net, compiled like the ViT."""
    from models import residual_chain as build

    model = build()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    return model


MODELS = {"vit": vit, "residual_chain": residual_chain}


def saved_graphs(paths: list[str]) -> list[str]:
    """The table of "min" on saved graphs: one forward pass as profiled, "min" as a share
    of the checkpoint-all peak, ``eviction``'s profiled overhead there, and the spread."""
    from tfremat.graph import load_graph
    from tfremat.plan.eviction import eviction
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.strategies import forward_share, least_budget_within

    lines, shares = ["| graph | one forward pass | min | eviction's overhead there |", "| --- | --- | --- | --- |"], []
    for path in paths:
        graph = load_graph(path)
        least = least_budget_within(graph)
        shares.append(least / checkpoint_all_peak(graph))
        overhead = eviction(graph, least).cost(graph) / graph.total_cost - 1
        lines.append(f"| {os.path.basename(path)} | +{forward_share(graph):.1%} | {shares[-1]:.2%} | +{overhead:.1%} |")
    return lines + ["", f"\"min\" over the graphs: {100 * (max(shares) - min(shares)):.2f} points apart."]


def one_run(model, time_limit: float, save: str | None) -> dict:
    from tfremat.model_planning import extract_model, synthetic_batch
    from tfremat.planner import plan_graph, resolve_min_budget
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.strategies import forward_share

    x, y = synthetic_batch(model, BATCH, seed=0)
    graph = extract_model(model, x, y, batch_size=BATCH, loss=None, optimizer=None, cost_model="profile",
                          cache=False).graph
    if save:
        os.makedirs(save, exist_ok=True)
        graph.to_json(os.path.join(save, f"{model.name}_{time.strftime('%H%M%S')}.json"))
    reference = checkpoint_all_peak(graph)
    row = {"nodes": graph.size, "forward": forward_share(graph)}
    for budget in ("absolute min", "min"):
        started = time.perf_counter()
        budget_bytes = resolve_min_budget(graph, budget)
        seconds = time.perf_counter() - started
        plan = plan_graph(graph, budget_bytes, "optimal", cache=False, verbose=0, time_limit=time_limit)
        row[budget] = {"share": budget_bytes / reference, "seconds": seconds, "overhead": plan.overhead}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--time_limit", type=float, default=30.0)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "min_budget.md"))
    parser.add_argument("--save", default=None, help="a directory to keep each run's graph in")
    parser.add_argument("--graphs", default=None, help="comma-separated saved graphs (JSON): their table only")
    args = parser.parse_args()
    if args.graphs:
        print("\n".join(saved_graphs(args.graphs.split(","))))
        return
    lines = [
        "# \"min\" and \"absolute min\": a keras.io-style ViT and a residual conv net",
        "",
        header(),
        "",
        f"Batch {BATCH}, Adam; fresh profiles each run. \"min\" recomputes at most one forward pass counted in "
        "nodes or bytes (`eviction` under those cost proxies, with a tenth to spare), at most half a step as "
        "profiled. Shares of the checkpoint-all peak; one forward pass as profiled; overhead = `optimal`'s "
        "predicted extra time over one plain step at that budget; seconds = finding the budget. The machine's 2 "
        "cores were shared.",
    ]
    for name in args.models.split(","):
        model = MODELS[name]()
        rows = [one_run(model, args.time_limit, args.save) for _ in range(args.runs)]
        shares = [row["min"]["share"] for row in rows]
        lines += [
            "",
            f"## {model.name}",
            "",
            "| run | nodes | one forward pass | absolute min | its overhead | its seconds | min | its overhead "
            "| its seconds |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for number, row in enumerate(rows, 1):
            a, m = row["absolute min"], row["min"]
            lines.append(f"| {number} | {row['nodes']} | +{row['forward']:.1%} | {a['share']:.1%} "
                         f"| +{a['overhead']:.1%} | {a['seconds']:.1f} | {m['share']:.1%} | +{m['overhead']:.1%} "
                         f"| {m['seconds']:.1f} |")
        lines += ["", f"\"min\" over the runs: {100 * (max(shares) - min(shares)):.1f} points apart."]
        if args.measure:
            from tfremat.measure import measure_model

            measured = measure_model(model, "min", batch_size=BATCH, steps=7, verbose=0, cache=False,
                                     time_limit=args.time_limit)
            low, high = measured["time_over_plain_quartiles"]
            lines += ["", f"Measured at \"min\" (`measure_model`, 7 rounds): step time over plain "
                      f"{measured['time_over_plain']:.2f} (quartiles {low:.2f}-{high:.2f}), predicted overhead "
                      f"+{measured['predicted_overhead']:.1%}, allocator peak over predicted "
                      f"{measured['measured_peak_bytes'] / measured['predicted_peak_bytes']:.2f}, gradients match: "
                      f"{measured['gradients_match']} (largest per-variable error {measured['grad_error']:.2g})."]
        print("\n".join(lines), flush=True)
    with open(args.out, "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
