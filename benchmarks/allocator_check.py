"""Does a plan accepted by ``allocator_check`` keep the allocator's peak within the budget on
later steps, and what does the check cost the first step?

One worker process per run (``--worker``) trains a model with ``RematCallback(budget)`` for one
epoch, timing the first step (extraction, planning, the check's runs and re-plans, the trace),
and records the check's reads; it then trains ``--steps`` more steps with the accepted step,
each on a new batch, reading the allocator's peak of each with fresh statistics
(:func:`tfremat.runtime.memory.measure_step_peak`, no warm-up). The driver runs, per model:
the check off, on in a first process (an empty schedule cache) and on in a second process
(the first's cache), and writes a markdown table.

    python benchmarks/allocator_check.py --out benchmarks/results/allocator_check.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models (five_conv_net)

MODELS = {
    # name: (budget, batch, default steps)
    "densenet121": ("45% of activations", 8, 20),
    "five_conv": ("95% of activations", 16, 20),
    # benchmarks/user_check.py's models (its builders, Adam, its losses)
    "unet_seg": ("60% of activations", 4, 20),
    "ts_transformer": ("50%", 8, 20),
}


def build(name: str):
    """The model, compiled, and its loss."""
    # Imported here, not at the top: the worker imports tfremat before Keras and TensorFlow.
    import keras
    from models import five_conv_net

    if name == "five_conv":
        return five_conv_net(), "categorical_crossentropy"
    from user_check import build as user_build

    keras.utils.set_random_seed(0)
    if name == "densenet121":
        model, loss = keras.applications.DenseNet121(weights=None, input_shape=(64, 64, 3), classes=10), \
            "categorical_crossentropy"
    else:
        model, loss = user_build(name)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    return model, loss


def worker(name: str, check: str, cache: str, steps: int, time_limit: float) -> dict:
    import tfremat  # noqa: F401 - before TensorFlow: the CPU allocator keeps statistics
    import keras
    import tensorflow as tf

    import tfremat.keras as remat_keras
    import tfremat.runtime.memory as memory
    from tfremat.model_planning import synthetic_batch
    from tfremat.runtime.memory import measure_step_peak

    budget, batch, _ = MODELS[name]
    model, loss = build(name)
    seeds = iter(range(10**6))

    def data(n):
        return synthetic_batch(model, n, loss=loss, seed=next(seeds))

    # What the check holds (one per plan it measured), the reads behind it, and each plan
    # with whether it came from the schedule cache.
    held, reads, plans = [], [], []
    real_peak, real_measure, real_plan = remat_keras.allocator_peak, memory.measure_step_peak, remat_keras.plan_graph

    def recording_peak(*args, **kwargs):
        held.append(real_peak(*args, **kwargs))
        return held[-1]

    def recording_measure(*args, **kwargs):
        reads.append(real_measure(*args, **kwargs))
        return reads[-1]

    def recording_plan(*args, **kwargs):
        result = real_plan(*args, **kwargs)
        plans.append([result.budget_bytes, result.predicted_peak_bytes, result.from_cache])
        return result

    remat_keras.allocator_peak, memory.measure_step_peak = recording_peak, recording_measure
    remat_keras.plan_graph = recording_plan
    times = {}

    class FirstStep(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            times["begin"], times["cpu"] = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch_index, logs=None):
            if batch_index == 0:
                times["first"] = time.perf_counter() - times["begin"]
                times["first_cpu"] = time.process_time() - times["cpu"]

    callback = remat_keras.RematCallback(budget, time_limit=time_limit, cache=cache, verbose=0,
                                         allocator_check={"on": None, "off": False}[check])
    x, y = data(3 * batch)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[FirstStep(), callback])
    (plan,) = callback.plans.values()
    (step,) = callback._steps.values()
    variables = list(model.variables) + list(model.optimizer.variables)
    per_step = []
    for _ in range(steps):
        bx, by = (tf.constant(a) for a in data(batch))
        per_step.append(measure_step_peak(lambda a, b: step(a, b, None), bx, by, resident=variables, warmup=0))
    return {"model": name, "check": check, "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
            "checkpoint_all": plan.checkpoint_all_peak_bytes, "held": held, "reads": reads, "plans": plans,
            "overhead": plan.overhead,
            "per_step": per_step,
            "first_s": times["first"], "first_cpu_s": times["first_cpu"], "load": os.getloadavg()[0]}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--steps", type=int, default=None, help="steps read after fit (default per model)")
    parser.add_argument("--time_limit", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "CHECK", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, check, cache = args.worker
        steps = args.steps if args.steps is not None else MODELS[name][2]
        print("RESULT " + json.dumps(worker(name, check, cache, steps, args.time_limit)), flush=True)
        return
    rows = []
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory(prefix="tfremat_allocator_check_") as cache:
            # The profile cache is shared by all three runs; the schedule cache starts empty for
            # the check's first process, whose re-plans the second process should find.
            env = dict(os.environ, TFREMAT_CACHE_DIR=cache)
            # One directory for profiles and schedules: the first run (check off) profiles and
            # solves the first plan; the check's first process finds those and solves its
            # re-plans, which its second process should find; the last run times the step
            # with every cache warm and no check.
            for label, check in (("off, cold caches", "off"), ("on, first process", "on"),
                                 ("on, second process", "on"), ("off, warm caches", "off")):
                command = [sys.executable, __file__, "--worker", name, check, os.path.join(cache, "schedules"),
                           "--time_limit", str(args.time_limit)]
                if args.steps is not None:
                    command += ["--steps", str(args.steps)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if not lines:
                    sys.stderr.write(done.stderr[-4000:])
                    raise SystemExit(f"{name} {label}: worker failed")
                row = json.loads(lines[-1][len("RESULT "):])
                row["label"] = label
                rows.append(row)
                print(json.dumps(row), flush=True)
    table = ["| model | allocator_check | budget MiB | plans (planning budget MiB, prediction MiB, cached?) | "
             "check: reads MiB -> held | peak per step MiB (min-max) | max/budget | overhead | "
             "first step s (wall/CPU) | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        steps = row["per_step"]
        plans = "; ".join(f"{mib(b)}, {mib(p)}, {'hit' if c else 'solved'}" for b, p, c in row["plans"])
        reads = ", ".join(mib(r) for r in row["reads"])
        held = ", ".join(mib(h) for h in row["held"])
        table.append(f"| {row['model']} | {row['label']} | {mib(row['budget'])} | {plans} | "
                     f"{f'{reads} -> {held}' if row['held'] else '-'} | {mib(min(steps))}-{mib(max(steps))} "
                     f"({len(steps)} steps) | {max(steps) / row['budget']:.3f} | +{100 * row['overhead']:.1f}% | "
                     f"{row['first_s']:.1f} / "
                     f"{row['first_cpu_s']:.1f} | {row['load']:.1f} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text + "\n\nPer step (MiB):\n\n")
            for row in rows:
                f.write(f"- {row['model']} {row['label']}: {', '.join(mib(s) for s in row['per_step'])}\n")
            f.write("\n")


if __name__ == "__main__":
    main()
