"""Does a plan accepted by ``allocator_check`` keep the allocator's peak within the budget on
later steps, and what does the check cost the first step?

One worker process per run (``--worker``) trains a model with ``RematCallback(budget)`` in one
``fit`` of ``1 + --steps`` batches, timing the first step (extraction, planning, the check's
runs and re-plans, the trace) and recording the check's reads (and, per perturbed read, the
bytes its state keeps allocated over the step's own bytes: ``footprint``) and the watched
training steps' reads (``watched``, the first step's included: one over the budget plans
again); every later training step's
allocator peak is read with fresh statistics (a Keras callback: the peak above what was
allocated when the batch began, plus the model's and the optimizer's variables). From the
sixth step on, every fifth step first replaces eight tensors of random sizes (4 KB-2.4 MB)
that stay alive across the steps, as a user's own work between steps would (the U-Net of
benchmarks/user_check.py read 1.021x its budget so). A refused budget is a row too. The
driver runs, per model: the check off, on in a first process (an empty schedule cache) and
on in a second process (the first's cache), and writes a markdown table; ``--runs`` picks
some of them, ``--trees`` runs each with the ``tfremat`` of other checkouts in turns (a
``git archive`` of an earlier commit: before and after on the same rows), ``--repeats`` runs
``on1`` that many times in turns, each from the cache as the runs before it left it (a first
process each time: the first training step after the check moves from process to process).
``--reads_after N`` reads each plan the check read N more times straight after its check
returned, with no warm-up run (``after_check``, restored as the check restores): the first of
them is the first run in the state the check's restore leaves.

    python benchmarks/allocator_check.py --out benchmarks/results/allocator_check.md
    python benchmarks/allocator_check.py --only unet_seg,gru_text --runs on1 --trees before=/tmp/old,after=.
    python benchmarks/allocator_check.py --only unet_seg --runs off1,on1 --repeats 4 --steps 2 --trees ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
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
    "gru_text": ("min", 16, 20),
    # benchmarks/user_check_3.py's models, compiled as its checks compile them
    "multi_io": ("60% of activations", 16, 20),
    "accum_lr_schedule": ("70% of activations", 32, 20),
    # benchmarks/user_check.py's builders, models the check was not benchmarked on here: one
    # at a share, one at an amount (the text transformer's "60%" is 15.84 MiB at batch 16)
    "resnet50": ("50% of activations", 4, 20),
    "text_transformer": ("16MiB", 16, 20),
}

#: The driver's runs per model: (name for --runs, label, check).
RUNS = (("off1", "off, cold caches", "off"), ("on1", "on, first process", "on"),
        ("on2", "on, second process", "on"), ("off2", "off, warm caches", "off"))


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
    elif name == "multi_io":
        from user_check_3 import _multi_io

        model = _multi_io()
        loss = {"class": "sparse_categorical_crossentropy", "score": "mse"}
        model.compile(optimizer="adam", loss=loss, loss_weights={"class": 1.0, "score": 0.5},
                      metrics={"class": ["accuracy"], "score": ["mae"]})
        return model, loss
    elif name == "accum_lr_schedule":
        from user_check_3 import _cnn

        model, loss = _cnn(), "sparse_categorical_crossentropy"
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=1, decay_rate=0.5)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=schedule, gradient_accumulation_steps=2),
                      loss=loss, metrics=["accuracy"])
        return model, loss
    else:
        model, loss = user_build(name)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    return model, loss


def worker(name: str, check: str, cache: str, steps: int, time_limit: float, reads_after: int = 0) -> dict:
    import tfremat  # noqa: F401 - before TensorFlow: the CPU allocator keeps statistics
    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat.allocator_check as allocator_check
    import tfremat.keras as remat_keras
    import tfremat.runtime.memory as memory
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.model_planning import synthetic_batch
    from tfremat.runtime.state import state_restored

    budget, batch, _ = MODELS[name]
    model, loss = build(name)

    # What the check holds (one per plan it measured), the reads behind it, and each plan
    # with whether it came from the schedule cache.
    held, reads, plans, after_check = [], [], [], []
    real_peak, real_measure, real_plan = remat_keras.allocator_peak, memory.measure_step_peak, remat_keras.plan_graph

    def recording_peak(step, model, x, y, sample_weight=None, **kwargs):
        held.append(real_peak(step, model, x, y, sample_weight, **kwargs))
        if reads_after:
            variables = list(model.variables) + list(model.optimizer.variables)
            with state_restored(variables):
                after_check.append([real_measure(lambda a, b: step(a, b, sample_weight), x, y, resident=variables,
                                                 device=kwargs.get("device"), warmup=0) for _ in range(reads_after)])
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
    # The watched training steps' reads (the first step's included), which may plan again.
    watched, real_training_peak = [], getattr(remat_keras, "training_step_peak", None)

    def recording_training_peak(*args, **kwargs):
        outputs, peak = real_training_peak(*args, **kwargs)
        watched.append(peak)
        return outputs, peak

    if real_training_peak is not None:
        remat_keras.training_step_peak = recording_training_peak
    # The bytes a perturbed state keeps allocated during its read, over the step's own bytes
    # (a tree without perturbed reads records none).
    footprint = []
    real_perturbed = getattr(allocator_check, "perturbed_state", None)

    @contextlib.contextmanager
    def recording_perturbed(device, own_bytes, *args, **kwargs):
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        with real_perturbed(device, own_bytes, *args, **kwargs) as made:
            footprint.append((tf.config.experimental.get_memory_info("CPU:0")["current"] - start) / max(own_bytes, 1))
            yield made

    if real_perturbed is not None:
        allocator_check.perturbed_state = recording_perturbed
    times, per_step, kept = {}, [], []
    rng = np.random.default_rng(1)

    class Steps(keras.callbacks.Callback):
        """Times the first step; reads every later step's allocator peak, keeping tensors of
        random sizes alive from the sixth step on (replaced every fifth)."""

        def on_train_begin(self, logs=None):
            times["begin"], times["cpu"] = time.perf_counter(), time.process_time()

        def on_train_batch_begin(self, index, logs=None):
            if index >= 5 and index % 5 == 0:
                kept.clear()
                kept.extend(tf.ones([int(rng.integers(1024, 600 * 1024))]) for _ in range(8))
            tf.config.experimental.reset_memory_stats("CPU:0")
            times["start"] = tf.config.experimental.get_memory_info("CPU:0")["current"]

        def on_train_batch_end(self, index, logs=None):
            if index == 0:
                times["first"] = time.perf_counter() - times["begin"]
                times["first_cpu"] = time.process_time() - times["cpu"]
                return
            variables = list(model.variables) + list(model.optimizer.variables)
            per_step.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - times["start"]
                            + memory.resident_bytes(variables))

    callback = remat_keras.RematCallback(budget, time_limit=time_limit, cache=cache, verbose=0,
                                         allocator_check={"on": None, "off": False}[check])
    x, y = synthetic_batch(model, (1 + steps) * batch, loss=loss, seed=0)
    row = {"model": name, "check": check, "held": held, "reads": reads, "plans": plans, "per_step": per_step,
           "footprint": footprint, "watched": watched, "after_check": after_check}
    try:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Steps(), callback])
    except InfeasibleBudgetError as error:
        return {**row, "refused": str(error), "first_s": time.perf_counter() - times["begin"],
                "first_cpu_s": time.process_time() - times["cpu"], "load": os.getloadavg()[0]}
    (plan,) = callback.plans.values()
    return {**row, "budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes,
            "checkpoint_all": plan.checkpoint_all_peak_bytes, "overhead": plan.overhead,
            "first_s": times["first"], "first_cpu_s": times["first_cpu"], "load": os.getloadavg()[0]}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render(rows: list[dict]) -> str:
    table = ["| model | tree | allocator_check | budget MiB | plans (planning budget MiB, prediction MiB, cached?) | "
             "check: reads MiB -> held | first step MiB (/held) | peak per later step MiB (min-max) | max/budget | "
             "max/held | overhead | first step s (wall/CPU) | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plans = "; ".join(f"{mib(b)}, {mib(p)}, {'hit' if c else 'solved'}" for b, p, c in row["plans"])
        reads = ", ".join(mib(r) for r in row["reads"])
        held = ", ".join(mib(h) for h in row["held"])
        checked = f"{reads} -> {held}" if row["held"] else "-"
        times = f"{row['first_s']:.1f} / {row['first_cpu_s']:.1f}"
        first = row.get("watched") or []
        first = f"{mib(first[0])} ({first[0] / row['held'][-1]:.3f})" if first and row["held"] else "-"
        if "refused" in row:
            table.append(f"| {row['model']} | {row['tree']} | {row['label']} | refused | {plans} | {checked} | "
                         f"{first} | {row['refused'][:160]} | | | | {times} | {row['load']:.1f} |")
            continue
        steps = row["per_step"]
        over_held = f"{max(steps) / row['held'][-1]:.3f}" if row["held"] else "-"
        table.append(f"| {row['model']} | {row['tree']} | {row['label']} | {mib(row['budget'])} | {plans} | "
                     f"{checked} | {first} | {mib(min(steps))}-{mib(max(steps))} ({len(steps)} steps) | "
                     f"{max(steps) / row['budget']:.3f} | {over_held} | +{100 * row['overhead']:.1f}% | {times} | "
                     f"{row['load']:.1f} |")
    return "\n".join(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--runs", default=",".join(name for name, _, _ in RUNS),
                        help="runs per model, comma-separated, of " + ", ".join(name for name, _, _ in RUNS))
    parser.add_argument("--trees", default=None,
                        help="label=path,...: checkouts whose tfremat each run imports, in turns (default: this one)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="processes of on1, in turns, each from the cache the runs before it left")
    parser.add_argument("--steps", type=int, default=None, help="training steps read after the first (default per model)")
    parser.add_argument("--reads_after", type=int, default=0,
                        help="reads of each checked plan straight after its check, no warm-up")
    parser.add_argument("--time_limit", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", nargs=4, metavar=("MODEL", "CHECK", "CACHE", "TREE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, check, cache, tree = args.worker
        sys.path.insert(0, os.path.abspath(tree))  # that checkout's tfremat, imported first
        steps = args.steps if args.steps is not None else MODELS[name][2]
        print("RESULT " + json.dumps(worker(name, check, cache, steps, args.time_limit, args.reads_after)), flush=True)
        return
    trees = [("", ROOT)] if not args.trees else [tuple(item.split("=", 1)) for item in args.trees.split(",")]
    runs = [run for run in RUNS if run[0] in args.runs.split(",")]
    rows = []
    for name in args.only.split(","):
        # One cache directory per tree (profiles and schedules): the first run (check off)
        # profiles and solves the first plan; the check's first process finds those and
        # solves its re-plans, which its second process should find; the last run times the
        # step with every cache warm and no check. The trees take turns run by run.
        with tempfile.TemporaryDirectory(prefix="tfremat_allocator_check_") as cache_root:
            repeated = [run for run in runs for _ in range(args.repeats if run[0] == "on1" else 1)]
            for run_name, label, check in repeated:
                for tree_label, tree in trees:
                    cache = os.path.join(cache_root, tree_label or "tree")
                    if run_name == "on1" and args.repeats > 1:
                        before_on1 = cache + ".before_on1"
                        if not os.path.isdir(before_on1):
                            os.makedirs(cache, exist_ok=True)
                            shutil.copytree(cache, before_on1)
                        shutil.rmtree(cache)
                        shutil.copytree(before_on1, cache)
                    env = dict(os.environ, TFREMAT_CACHE_DIR=cache, TF_CPU_ALLOCATOR_USE_BFC="true")
                    command = [sys.executable, __file__, "--worker", name, check, os.path.join(cache, "schedules"),
                               tree, "--time_limit", str(args.time_limit)]
                    if args.steps is not None:
                        command += ["--steps", str(args.steps)]
                    if args.reads_after:
                        command += ["--reads_after", str(args.reads_after)]
                    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
                    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                    if not lines:
                        sys.stderr.write(done.stderr[-4000:])
                        raise SystemExit(f"{name} {label} {tree_label}: worker failed")
                    row = json.loads(lines[-1][len("RESULT "):])
                    row["label"], row["tree"] = label, tree_label or "-"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    text = render(rows)
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(text + "\n\nPer later step (MiB):\n\n")
            for row in rows:
                f.write(f"- {row['model']} {row['tree']} {row['label']}: {', '.join(mib(s) for s in row['per_step'])}\n")
            f.write("\n")


if __name__ == "__main__":
    main()
