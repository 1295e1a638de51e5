"""How far the masked text transformer of user_check_5.py plans once its attention is opened (issue 33).

Session 29 kept every layer whose tensors carry a Keras mask as one node, so keras.io's text
classifier (``TokenAndPositionEmbedding`` with ``mask_zero=True``, ``MultiHeadAttention(h, h)``)
was planned with its attention whole. Session 30 opens it with the masks as values of the graph
(tfremat/extract/opening.py, "Keras masks"). This extracts the model's training graph (batch 16,
64 tokens padded after 8 to 63, ``cost_model="flops"``, no cache) with the tfremat of a given
checkout and prints, TensorFlow-free from there on: the graph's nodes, whether the attention is
opened, the checkpoint-all peak, the proven lower bound, "absolute min" (the least peak a
heuristic reaches: :func:`tfremat.strategies.least_peak`) and "min"
(:func:`tfremat.strategies.least_budget_within`) as shares of the activations above the fixed
bytes and of the checkpoint-all peak, and the node whose own need (inputs, output and workspace
while it runs) is largest.

With ``--measure``, the compiled step at each budget given (``optimal``, profiled costs,
:func:`tfremat.measure.measure_model`: its own random tokens, or with ``--padded`` the padded
batch above, plain and planned steps timed in turns) against its prediction: requested and
allocator peak over the predicted peak, time over plain against the predicted time over
plain, and the load average while it ran. ``--granularity layer`` keeps every top-level layer
whole (the attention's block one node, measured with the masks it reads in the step since
session 30 C2; before, on an unmasked call).

Run: ``python benchmarks/keras_masks.py [--tfremat DIR] [--save FILE] [--granularity layer]
[--measure 90%,min [--padded]]``: ``DIR`` a checkout whose ``tfremat`` is imported (default
this one; an older commit unpacked with ``git archive`` gives the "before" column),
``--save`` keeps the graph. The results, with the step measured by ``python
benchmarks/user_check_5.py --only text_mask``, are in benchmarks/results/keras_masks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def text_batch(batch: int = 16, length: int = 64, seed: int = 0):
    """Token ids padded with zeros after 8 to 63 tokens, and binary labels (user_check_5's data)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(1, 2000, (batch, length)).astype("int32")
    for row, keep in enumerate(rng.integers(8, length, batch)):
        x[row, keep:] = 0
    return x, rng.integers(0, 2, batch)


def largest_need(graph) -> tuple[str, int]:
    """The node with the most bytes live while it runs alone: its inputs, its output and its workspace."""
    needs = {node: graph.workspace_bytes[node] + graph.output_bytes[node]
             + sum(graph.output_bytes[p] for p in graph.predecessors[node]) for node in range(graph.size)}
    node = max(needs, key=needs.get)
    return graph.names[node], needs[node]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tfremat", default=os.path.dirname(HERE), help="checkout whose tfremat is imported")
    parser.add_argument("--save", help="write the extracted graph here (JSON)")
    parser.add_argument("--measure", default="", help="budgets to compile and measure the step at, comma separated")
    parser.add_argument("--granularity", default="sublayer", choices=("layer", "sublayer", "op"),
                        help="what a graph node is (tfremat.extract.opening)")
    parser.add_argument("--padded", action="store_true", help="measure the step on the padded batch, not random tokens")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.tfremat))
    sys.path.insert(0, HERE)
    import keras

    import tfremat
    from tfremat.ilp.formulation import memory_lower_bound
    from tfremat.model_planning import extract_model
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.strategies import least_budget_within, least_peak
    from user_check_5 import _compiled, _text_transformer

    keras.utils.set_random_seed(0)
    model = _compiled(_text_transformer(64))
    x, y = text_batch()
    graph = extract_model(model, x, y, batch_size=16, loss=None, optimizer=None, cost_model="flops",
                          cache=False, granularity=args.granularity).graph
    if args.save:
        graph.to_json(args.save)
    peak = checkpoint_all_peak(graph)
    activations = peak - graph.fixed_bytes
    row = {"tfremat": os.path.abspath(os.path.dirname(tfremat.__file__)), "granularity": args.granularity,
           "nodes": graph.size,
           "attention_opened": not any(name == "multi_head_attention" or name.endswith("/multi_head_attention")
                                       for name in graph.names),
           "checkpoint_all_peak": peak, "fixed_bytes": graph.fixed_bytes}
    for label, value in (("lower_bound", memory_lower_bound(graph)), ("absolute_min", least_peak(graph)),
                         ("min", least_budget_within(graph))):
        row[label] = {"bytes": value, "of_activations": (value - graph.fixed_bytes) / activations,
                      "of_peak": value / peak}
    row["largest_need"] = dict(zip(("node", "bytes"), largest_need(graph)))
    data = (x, y) if args.padded else (None, None)
    row["measured"] = [measured_step(model, budget, args.granularity, *data)
                       for budget in args.measure.split(",") if budget]
    print(json.dumps(row, indent=1))


def measured_step(model, budget: str, granularity: str, x=None, y=None) -> dict:
    """:func:`tfremat.measure.measure_model` at ``budget`` (batch 16, 9 rounds; on ``x, y``
    when given), the ratios the results table reads."""
    import tfremat
    from tfremat.measure import measure_model

    load_before = os.getloadavg()[0]
    try:
        result = measure_model(model, budget, x, y, batch_size=16, steps=9, verbose=0, cache=False,
                               granularity=granularity)
    except tfremat.InfeasibleBudgetError as error:
        return {"budget": budget, "refused": str(error).split(";")[0]}
    keys = ("predicted_peak_bytes", "requested_peak_bytes", "measured_peak_bytes", "plain_peak_bytes",
            "predicted_overhead", "time_over_plain", "time_over_plain_quartiles", "predicted_time_over_plain",
            "recomputed_layer_calls", "costly_vjp_rebuilds", "gradients_match", "grad_error")
    row = {"budget": budget, **{key: result.get(key) for key in keys}}
    row["requested_over_predicted"] = result["requested_peak_bytes"] / result["predicted_peak_bytes"]
    row["load"] = [load_before, os.getloadavg()[0]]
    return row


if __name__ == "__main__":
    main()
