"""The budget "min" against "absolute min", and how far two profiles move "min" (issue 33 item 4).

Two models: a keras.io-style ViT and a residual conv net (tests/models.py's
``residual_chain``: 12 conv-BN-ReLU-dropout blocks added to a running sum, 48x48 inputs).
The ViT follows the keras.io image-classification example, scaled to a CPU: a ``Patches``
layer (``keras.ops.image.extract_patches``), a patch encoder (Dense projection plus a
position ``Embedding``), transformer blocks of LayerNormalization, MultiHeadAttention and a
GELU MLP with dropout, then an MLP head; 32x32 inputs. Each run extracts the training graph
with fresh profiles (no profile cache), so the runs show how far profiling moves "min":

* one forward pass as a share of the step ("min" keeps to it, and to at most half a step:
  :func:`tfremat.strategies.min_overhead`);
* "absolute min" and "min" as shares of the checkpoint-all peak, the seconds the budget
  took to find, and ``optimal``'s predicted overhead there (``--time_limit`` each); the
  spread of "min" over the runs, in points of the checkpoint-all peak;
* with ``--measure``, the compiled step at "min" against plain training
  (:func:`tfremat.measure_model`, interleaved rounds, its own fresh profile): step time
  over plain, allocator peak over the prediction.

Run: ``python benchmarks/min_budget.py [--models vit,residual_chain] [--runs 2] [--measure]``
(writes ``benchmarks/results/min_budget.md``). The machine's cores may be shared: compare
ratios measured in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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


def one_run(model, time_limit: float) -> dict:
    from tfremat.model_planning import extract_model, synthetic_batch
    from tfremat.planner import plan_graph, resolve_min_budget
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.strategies import forward_share

    x, y = synthetic_batch(model, BATCH, seed=0)
    graph = extract_model(model, x, y, batch_size=BATCH, loss=None, optimizer=None, cost_model="profile",
                          cache=False).graph
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
    args = parser.parse_args()
    lines = [
        "# \"min\" and \"absolute min\": a keras.io-style ViT and a residual conv net",
        "",
        header(),
        "",
        f"Batch {BATCH}, Adam; fresh profiles each run. \"min\" keeps to one forward pass, at most half a step. "
        "Shares of the checkpoint-all peak; overhead = `optimal`'s predicted extra time over one plain step at that "
        "budget; seconds = finding the budget. The machine's 2 cores were shared.",
    ]
    for name in args.models.split(","):
        model = MODELS[name]()
        rows = [one_run(model, args.time_limit) for _ in range(args.runs)]
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
                      f"{measured['gradients_match']}."]
        print("\n".join(lines), flush=True)
    with open(args.out, "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
