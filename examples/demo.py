"""The tfremat demo (`make demo`): extract, plan, train, measure, plot — on this machine's CPU.

1. Extract the training graph of a small residual conv net (profiled on this device).
2. Plan it at 50% of the checkpoint-all memory with several strategies; print the table.
3. Train a few steps with the optimal schedule and with plain Keras; print predicted vs
   measured peak memory (TensorFlow allocator) and step time for both.
4. Write two plots to out/: memory over the step per strategy, and overhead against budget.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator counts bytes only with BFC
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")  # one op at a time, as the memory model assumes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.budget import format_bytes, parse_budget  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.measure import measure_model  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402
from tfremat.planner import compare_graph  # noqa: E402
from tfremat.plots import plot_memory_traces, plot_overhead_vs_budget  # noqa: E402

BUDGET = "50%"
BATCH = 32
STRATEGIES = ["checkpoint_all", "chen_sqrtn", "chen_greedy", "griewank_logn", "hong", "eviction", "approx_lp", "optimal"]
OUT = Path("out")


def residual_net(seed: int = 0, blocks: int = 4, channels: int = 32) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    h = layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same")(h)
        r = layers.BatchNormalization()(r)
        r = layers.ReLU()(r)
        r = layers.Conv2D(channels, 3, padding="same")(r)
        h = layers.ReLU()(layers.Add()([h, r]))
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="residual_net")


def main() -> int:
    started = time.perf_counter()
    model = residual_net()
    model.compile(optimizer="sgd", loss="categorical_crossentropy")  # what measure_model trains with
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 32, 32, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, BATCH)]

    print(f"1. extracting {model.name} (batch {BATCH}) ...")
    extraction = extract(model, sample_batch=(x, y), loss="categorical_crossentropy", optimizer=keras.optimizers.SGD())
    graph = extraction.graph
    print(f"   {graph.size} nodes, {len(graph.edges)} edges, fixed bytes {format_bytes(graph.fixed_bytes)}, "
          f"{extraction.seconds:.1f} s")

    print(f"\n2. planning at {BUDGET} of the checkpoint-all peak:")
    # The schedule cache lets step 3 reuse the optimal schedule solved here.
    rows = compare_graph(graph, BUDGET, STRATEGIES, verbose=0, time_limit=60)
    print(f"   {'strategy':<16}{'predicted peak':>16}{'overhead':>10}{'solve s':>9}")
    schedules = {}
    for name, row in zip(STRATEGIES, rows):
        if isinstance(row, tfremat.InfeasibleBudgetError):
            print(f"   {name:<16}{'infeasible':>16}   (smallest peak {format_bytes(row.min_feasible_bytes or 0)})")
            continue
        if isinstance(row, tfremat.TfrematError):  # a MILP stopped at its time limit without a schedule
            print(f"   {name:<16}{'no schedule':>16}   ({row})")
            continue
        schedules[name] = row.schedule
        print(f"   {name:<16}{format_bytes(row.predicted_peak_bytes):>16}{100 * row.overhead:>9.1f}%{row.solve_seconds:>9.2f}")

    print("\n3. training 5 steps with the optimal schedule and with plain Keras ...")
    record = measure_model(model, BUDGET, batch_size=BATCH, strategy="optimal", steps=5, cost_model="profile",
                           time_limit=60, verbose=0)
    print(f"   predicted peak {format_bytes(record['predicted_peak_bytes'])}, requested by the step "
          f"{format_bytes(record['requested_peak_bytes'])} ({record['requested_over_predicted']:.3f}x predicted), "
          f"allocator peak {format_bytes(record['measured_peak_bytes'])} (adds BFC chunk rounding)")
    print(f"   plain Keras peak {format_bytes(record['plain_peak_bytes'])}: tfremat uses {record['peak_over_plain']:.2f}x")
    print(f"   step time {1000 * record['step_seconds']:.1f} ms vs plain {1000 * record['plain_step_seconds']:.1f} ms "
          f"({record['time_over_plain']:.2f}x)")
    verdict = "match" if record["gradients_match"] else "DO NOT MATCH"
    print(f"   gradients {verdict} plain Keras: largest per-variable error {record['grad_error']:.1e}, "
          f"global {record['grad_global_error']:.1e} (tfremat.numerics)")

    print("\n4. plots ...")
    OUT.mkdir(exist_ok=True)
    reference = checkpoint_all_peak(graph)
    memory = plot_memory_traces(graph, schedules, OUT / "demo_memory.png", budget_bytes=parse_budget(BUDGET, reference))
    budgets = [parse_budget(f"{percent}%", reference) for percent in range(30, 101, 10)]
    overhead, _ = plot_overhead_vs_budget(graph, [s for s in STRATEGIES if s != "optimal"], budgets, OUT / "demo_overhead.png")
    print(f"   wrote {memory} and {overhead}")
    print(f"\ndone in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
