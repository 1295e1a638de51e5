"""Gradients rebuilt by repeating forward work (issue #33): what the plan counts against
what the compiled step runs.

A backward node that reads its forward node's value and one of its inputs (a dense with an
activation after a layer norm) used to rebuild its gradient by running the layer again
whenever the schedule recomputed the input while keeping the layer's value: forward work
and bytes outside the plan. Schedules now recompute the forward node in that stage
(:func:`tfremat.plan.schedule.with_fresh_gradient_reads`) and the MILP excludes the pattern.

For keras.io's ViT (tests/models.py, small enough for a CPU) under FLOP costs, for each
strategy and budget: the compiled step's ``costly_vjp_rebuilds`` (its trace report), the
simulated peak, the peak of the bytes the step's operations request (what the prediction
models), their ratio, the predicted overhead (simulated cost over one pass of every node)
and the plan's recomputations. Ops run one at a time (``TF_NUM_INTEROP_THREADS=1``), the
execution the simulator models.

Run: ``python benchmarks/vjp_rebuilds.py [--out FILE]`` (default: print the table). To
compare with an older tfremat, run this file from a copy of that checkout's tree: it
imports the tfremat next to it.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)  # the tfremat of the tree this file is in

from models import keras_io_vit  # noqa: E402

from tfremat.errors import InfeasibleBudgetError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.model_planning import synthetic_batch  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

STRATEGIES = ("chen_sqrtn", "chen_greedy", "griewank_logn", "hong", "rotor", "eviction", "repair", "intervals",
              "autocapper", "opportunist", "optimal")
BUDGETS = ("80%", "60%", "45%")
# Host link for the offloading strategies, bytes per FLOP of cost: slow enough that they
# recompute too.
BANDWIDTH = 0.05
OPTIMAL_SECONDS = 60


def rows(batch: int):
    model = keras_io_vit(image_size=32, patch_size=4, dim=32, heads=2, blocks=2, head=(64,))
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x, y = (tf.constant(v) for v in synthetic_batch(model, batch, loss="categorical_crossentropy", seed=0))
    extraction = extract(model, sample_batch=(x, y), cost_model="flops", use_cache=False,
                         optimizer=keras.optimizers.Adam())
    graph = extraction.graph
    yield f"keras.io ViT (2 blocks, dim 32), batch {batch}: {graph.size} nodes, FLOP costs"
    saved = [v.numpy() for v in model.variables]
    for name in STRATEGIES:
        options = {"bandwidth": BANDWIDTH} if name in ("autocapper", "opportunist") else {}
        if name == "optimal":
            options["time_limit"] = OPTIMAL_SECONDS
        for budget in BUDGETS if name != "optimal" else BUDGETS[:2]:
            try:
                schedule = get_strategy(name)(graph, budget, **options)
            except InfeasibleBudgetError:
                yield (name, budget, None)
                continue
            result = simulate(graph, schedule)
            optimizer = keras.optimizers.Adam()
            optimizer.build(model.trainable_variables)
            step = compile_step(extraction, schedule, optimizer=optimizer)
            requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                          count="requested")
            for variable, value in zip(model.variables, saved):
                variable.assign(value)
            yield (name, budget, {
                "rebuilds": step.report.costly_vjp_rebuilds,
                "predicted": result.peak_bytes,
                "requested": requested,
                "overhead": result.cost / graph.total_cost - 1,
                "recomputes": result.recompute_count,
            })


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", help="write the table here (markdown)")
    args = parser.parse_args()
    lines = []
    for row in rows(args.batch):
        if isinstance(row, str):
            lines += [row, "", "| strategy | budget | costly VJP rebuilds | predicted KiB | requested KiB | "
                      "requested/predicted | predicted overhead | recomputations |",
                      "|---|---|---|---|---|---|---|---|"]
        else:
            name, budget, r = row
            if r is None:
                lines.append(f"| {name} | {budget} | infeasible | | | | | |")
            else:
                lines.append(f"| {name} | {budget} | {r['rebuilds']} | {r['predicted'] / 1024:.1f} | "
                             f"{r['requested'] / 1024:.1f} | {r['requested'] / r['predicted']:.3f} | "
                             f"{100 * r['overhead']:+.1f}% | {r['recomputes']} |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
