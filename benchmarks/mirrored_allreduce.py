"""What MirroredStrategy's all-reduce adds to the step's memory, on two logical CPU devices (issue 35 item 4).

Logical CPU devices share one allocator, so a mirrored step's peak is the two replicas'
together. The step for one replica's batch is measured alone (no strategy) and under a
two-replica ``MirroredStrategy`` on twice the batch; what the mirrored peak holds beyond
two single steps is what data parallelism adds (the cross-device reduction's copies and
sums; on CPU ``ReductionToOneDevice``), given here in units of the model's gradient bytes.
Both steps are extracted with ``weight_grads="fixed"`` (the gradients resident until the
updates, as under a strategy), so the single step already holds one copy of the gradients.
A weight-heavy MLP (5 Dense layers, 512 wide) makes the gradients dominate the activations.

The mirrored extraction counts the all-reduce's buffers in its fixed bytes (``all_reduce``,
one copy of the gradients per replica: :mod:`tfremat.extract.assembly`); the last columns
hold each replica's share of the mirrored peak against the plan's prediction less what is
resident before the step (weights, optimizer slots, the batch), with and without that term.

Run: ``python benchmarks/mirrored_allreduce.py`` (writes ``benchmarks/results/mirrored_allreduce.md``).
"""

import contextlib
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from tfremat.budget import format_bytes  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.planner import plan_graph  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PER_REPLICA_BATCH = 64
RUNS = 5
CONFIGS = [("checkpoint-all", None, "checkpoint_all"), ("75% of activations", "75% of activations", "optimal")]


def mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    hidden = inputs
    for _ in range(4):
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))


def peak_above_start(run) -> int:
    """The CPU allocator's largest peak over ``RUNS`` runs of ``run()``, each above what it
    held before (after two runs that trace): the replicas run in threads of their own, and
    how their steps overlap moves the mirrored peak by up to a gradient copy from run to run."""
    run()
    run()
    peaks = []
    for _ in range(RUNS):
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        run()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
    return max(peaks)


def measure(budget: str, strategy_name: str, x, y) -> dict:
    rows = {}
    for replicas in (1, 2):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if replicas == 2 else None
        scope = strategy.scope() if strategy else contextlib.nullcontext()
        with scope:
            model = mlp()
            optimizer = keras.optimizers.SGD(0.01)
            optimizer.build(model.trainable_variables)
        half = (x[:PER_REPLICA_BATCH], y[:PER_REPLICA_BATCH])
        extraction = extract(model, half, optimizer=optimizer, cost_model="flops", use_cache=False,
                             weight_grads="fixed")
        plan = plan_graph(extraction.graph, budget, strategy_name, cache=False, verbose=0)
        step = compile_step(extraction, plan.schedule, optimizer=optimizer, strategy=strategy)
        if strategy is None:
            batch = tuple(tf.constant(a) for a in half)
        else:
            data = tf.data.Dataset.from_tensors((x[:2 * PER_REPLICA_BATCH], y[:2 * PER_REPLICA_BATCH]))
            batch = next(iter(strategy.experimental_distribute_dataset(data)))
        rows[replicas] = (plan, extraction, peak_above_start(lambda: step(*batch).numpy()))
    gradients = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    (plan, _, single), (replica_plan, replica_extraction, mirrored) = rows[1], rows[2]
    parts = replica_extraction.side_table.fixed_bytes_breakdown
    resident = sum(parts[name] for name in ("params", "optimizer_slots", "non_trainable", "inputs", "labels"))
    predicted = replica_plan.predicted_peak_bytes - resident
    return dict(plan=plan, single=single, mirrored=mirrored, gradients=gradients, extra=mirrored - 2 * single,
                all_reduce=parts["all_reduce"], predicted=predicted, without=predicted - parts["all_reduce"])


def main() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * PER_REPLICA_BATCH, 512)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 2 * PER_REPLICA_BATCH)]
    rows = [(label, measure(budget, strategy_name, x, y)) for label, budget, strategy_name in CONFIGS]
    largest = max(r["extra"] / r["gradients"] for _, r in rows) / 2
    lines = [
        "# What MirroredStrategy's all-reduce adds (two logical CPU devices, one allocator)",
        "",
        f"`python benchmarks/mirrored_allreduce.py`: a 5-Dense MLP (512 wide, float32), per-replica batch "
        f"{PER_REPLICA_BATCH}, flops cost model, weight_grads='fixed', TF_NUM_INTEROP_THREADS=1. Peaks are the CPU "
        f"allocator's largest over {RUNS} steps above its state before the step (the resident weights and batch not "
        f"included). Load average at the end: {os.getloadavg()[0]:.1f}.",
        "",
        "Per replica: half the mirrored peak. Predicted: the replica plan's peak less the weights, optimizer slots "
        "and batch (resident before the step), with the extraction's all-reduce term (`all_reduce`, one gradient "
        "copy per replica) and without it. The largest all-reduce excess here is "
        f"{largest:.2f} gradient copies per replica.",
        "",
        "| budget | recomputations | one replica's step alone | 2-replica mirrored step (both replicas) | beyond two "
        "single steps | gradients | beyond / gradients | per replica | predicted | predicted without all_reduce |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(f"| {label} | {r['plan'].schedule.recompute_count} | {format_bytes(r['single'])} | "
                     f"{format_bytes(r['mirrored'])} | {format_bytes(r['extra'])} | {format_bytes(r['gradients'])} | "
                     f"{r['extra'] / r['gradients']:.2f} | {format_bytes(r['mirrored'] / 2)} | "
                     f"{format_bytes(r['predicted'])} | {format_bytes(r['without'])} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "mirrored_allreduce.md"), "w") as out:
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
