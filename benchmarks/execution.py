"""Execution benchmark: compiled schedules against plain Keras, tf.recompute_grad and RematScope.

For a ResNet-style model (residual blocks with batch norm and dropout) and two U-Nets at
sizes a CPU trains in about a second per step, at budgets of 100/80/60/50/40/33% of the
checkpoint-all peak (:func:`tfremat.budget.parse_budget` of
:func:`tfremat.plan.simulator.checkpoint_all_peak`): the schedule (the cheapest fitting heuristic,
:func:`tfremat.ilp.portfolio.best_baseline`, or ``--strategy``), its predicted peak, the
compiled step's peak as the bytes its operations request (what the prediction models) and
as the BFC allocator's peak (which adds chunk rounding), the prediction error against the
requested bytes, the median step time, and memory and time ratios to plain Keras training
(``model.train_on_batch``, the step ``model.fit`` runs). Each step is timed in turns with the
plain one (:func:`tfremat.measure.time_in_turns`): its time ratio is the median of the
per-round ratios, with their quartiles, so a change of load on a shared machine slows both
steps of a round instead of reading as overhead. In the same run:
``tf.recompute_grad`` over sqrt(n) segments of the layer sequence and
``keras.RematScope(mode="full")``.

Run: ``python benchmarks/execution.py`` (writes ``benchmarks/results/execution.md``;
``--only`` runs some models and then needs ``--out``). Ops run one at a time
(``TF_NUM_INTEROP_THREADS=1``), the sequential execution the simulator models and the
setting the profiles are taken under.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models (unet)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from models import unet  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.budget import parse_budget  # noqa: E402
from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.extract import TensorRef, extract  # noqa: E402
from tfremat.extract.layer_graph import walk_model  # noqa: E402
from tfremat.ilp.formulation import memory_lower_bound  # noqa: E402
from tfremat.ilp.portfolio import best_baseline  # noqa: E402
from tfremat.measure import time_in_turns  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

logger = logging.getLogger("benchmarks.execution")

BUDGETS = ("100%", "80%", "60%", "50%", "40%", "33%")
MiB = 2**20
DEFAULT_OUT = os.path.join(HERE, "results", "execution.md")


def resnet_style(input_shape=(64, 64, 3), channels=16, blocks=8, classes=10, seed=0):
    """Residual blocks conv-BN-ReLU-dropout-conv-BN + Add + ReLU, then pooling and a softmax head."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    x = keras.Input(input_shape)
    h = layers.Conv2D(channels, 3, padding="same", name="stem")(x)
    for b in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same", name=f"b{b}_conv1")(h)
        r = layers.BatchNormalization(name=f"b{b}_bn1")(r)
        r = layers.ReLU(name=f"b{b}_relu1")(r)
        r = layers.Dropout(0.1, seed=b, name=f"b{b}_drop")(r)
        r = layers.Conv2D(channels, 3, padding="same", name=f"b{b}_conv2")(r)
        r = layers.BatchNormalization(name=f"b{b}_bn2")(r)
        h = layers.ReLU(name=f"b{b}_out")(layers.Add(name=f"b{b}_add")([h, r]))
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, layers.Dense(classes, activation="softmax", name="head")(h), name="resnet_style")


def unet_double(input_shape=(64, 64, 3), base=8, depth=4, classes=2, seed=0):
    """A U-Net with two conv-BN-ReLU per level and skip connections across ``depth`` levels."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers

    def double_conv(h, filters, name):
        for i in (1, 2):
            h = layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv{i}")(h)
            h = layers.BatchNormalization(name=f"{name}_bn{i}")(h)
            h = layers.ReLU(name=f"{name}_relu{i}")(h)
        return h

    x = keras.Input(input_shape)
    h, skips = x, []
    for level in range(depth):
        h = double_conv(h, base * 2**level, f"down{level}")
        skips.append(h)
        h = layers.MaxPooling2D(name=f"down{level}_pool")(h)
    h = double_conv(h, base * 2**depth, "bottom")
    for level in reversed(range(depth)):
        h = layers.UpSampling2D(name=f"up{level}_upsample")(h)
        h = layers.Concatenate(name=f"up{level}_concat")([h, skips[level]])
        h = double_conv(h, base * 2**level, f"up{level}")
    out = layers.Conv2D(classes, 1, activation="softmax", name="head")(h)
    return keras.Model(x, out, name="unet_double")


MODELS = {
    "ResNet-style, 8 blocks x 16 ch (64x64, batch 32)": (lambda: resnet_style(), 32),
    "U-Net depth 3, base 16 (64x64, batch 16)": (lambda: unet(input_shape=(64, 64, 3), base=16, depth=3), 16),
    "U-Net 2 convs/level, depth 4, base 8 (64x64, batch 16)": (lambda: unet_double(), 16),
}


def make_batch(model, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *model.input.shape[1:])).astype("float32")
    classes = model.output.shape[-1]
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, size=(batch, *model.output.shape[1:-1]))]
    return tf.constant(x), tf.constant(y)


def peaks(step, x, y, variables):
    """Peaks of ``step(x, y)`` in the graph convention: ``(requested, allocator)``. The
    requested bytes are what the step's operations ask for, the figure the prediction
    models; the allocator's peak adds BFC chunk rounding, which swings by tens of MiB between
    runs of the same step (README, known limits)."""
    requested = measure_step_peak(step, x, y, resident=variables, count="requested")
    allocator = measure_step_peak(step, x, y, resident=variables)
    return requested, allocator


def measure(step, x, y, variables, repeats, plain):
    """``(peaks, timing)`` of ``step(x, y)``: its :func:`peaks`, then ``repeats`` rounds
    timed in turns with the plain step ``plain(x, y)`` (a :class:`tfremat.measure.TurnTiming`)."""
    measured = peaks(step, x, y, variables)
    return measured, time_in_turns(lambda: step(x, y), lambda: plain(x, y), repeats)


def plain_fit(build, x, y, loss):
    """``model.train_on_batch``: the compiled train function ``model.fit`` runs per batch;
    its peaks and the step, which every other step is timed against."""
    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    model.compile(optimizer=optimizer, loss=loss)
    optimizer.build(model.trainable_variables)
    step = lambda a, b: tf.constant(model.train_on_batch(a, b))  # noqa: E731
    return peaks(step, x, y, list(model.variables) + list(optimizer.variables)), step


def _segments(calls, count):
    """Splits the layer calls into ``count`` contiguous runs of about equal length."""
    bounds = np.linspace(0, len(calls), count + 1).round().astype(int)
    return [calls[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def recompute_grad_step(build, x, y, loss_fn, repeats, plain):
    """``tf.recompute_grad`` over sqrt(n) contiguous segments of the model's layer calls.

    Each segment takes every tensor produced before it that it or a later layer reads and
    returns every tensor it produces that a later layer reads, so any DAG splits correctly.
    Batch norm and dropout inside a recomputed segment run twice (statistics updated twice,
    a fresh mask), which is tf.recompute_grad's documented behavior.
    """
    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    calls, outputs = walk_model(model)
    segments = _segments(calls, max(1, round(math.sqrt(len(calls)))))
    read_after = []
    for index in range(len(segments)):
        later = [c for seg in segments[index + 1:] for c in seg]
        needed = {(r.source, r.index, r.output_index) for c in later for r in c.inputs}
        needed |= {(r.source, r.index, r.output_index) for r in outputs}
        read_after.append(needed)

    def key(ref):
        return (ref.source, ref.index, ref.output_index)

    def run_segment(segment, live_keys, out_keys):
        def fn(*tensors):
            env = dict(zip(live_keys, tensors))
            def resolve(value):
                return env[key(value)] if isinstance(value, TensorRef) else value

            for call in segment:
                args = tf.nest.map_structure(resolve, tuple(call.call_args))
                kwargs = tf.nest.map_structure(resolve, dict(call.call_kwargs))
                if call.layer._call_has_training_arg:
                    kwargs["training"] = True
                result = tf.nest.flatten(call.layer(*args, **kwargs))
                for o, tensor in enumerate(result):
                    env[("node", call.position, o)] = tensor
            return [env[k] for k in out_keys]

        return tf.recompute_grad(fn)

    @tf.function
    def step(a, b):
        with tf.GradientTape() as tape:
            env = {("model_input", 0, 0): a}
            for index, segment in enumerate(segments):
                live_keys = sorted(k for k in env if k in _reads(segment) or k in read_after[index])
                produced = [("node", c.position, o) for c in segment for o in range(c.num_outputs)]
                out_keys = [k for k in produced if k in read_after[index]]
                results = run_segment(segment, live_keys, out_keys)(*[env[k] for k in live_keys])
                env = {k: env[k] for k in live_keys if k in read_after[index]}
                env.update(zip(out_keys, results))
            loss = loss_fn([b], [env[key(outputs[0])]])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return measure(step, x, y, list(model.variables) + list(optimizer.variables), repeats, plain)


def _reads(segment):
    return {(r.source, r.index, r.output_index) for c in segment for r in c.inputs}


def remat_scope_step(build, x, y, loss, repeats, run_eagerly, plain):
    """Keras' own rematerialization: every layer built under ``keras.RematScope(mode="full")``.

    On the TensorFlow backend it wraps layer calls in ``tf.custom_gradient``, which refuses
    keyword arguments (``training=True``) inside a ``tf.function``; the compiled
    ``train_on_batch`` therefore fails and only ``run_eagerly=True`` runs.
    """
    with keras.RematScope(mode="full"):
        model = build()
    optimizer = keras.optimizers.SGD(0.01)
    model.compile(optimizer=optimizer, loss=loss, run_eagerly=run_eagerly)
    optimizer.build(model.trainable_variables)
    step = lambda a, b: tf.constant(model.train_on_batch(a, b))  # noqa: E731
    return measure(step, x, y, list(model.variables) + list(optimizer.variables), repeats, plain)


def choose_schedule(graph, budget, strategy, time_limit=60, threads=2):
    """The named strategy's schedule, or for ``"best"`` the cheapest fitting heuristic
    (:func:`tfremat.ilp.portfolio.best_baseline`, what ``optimal`` warm-starts from; the
    time-limited heuristics get ``time_limit`` seconds in all)."""
    if strategy != "best":
        options = {"time_limit": time_limit, "threads": threads} if get_strategy(strategy).takes_solver_options else {}
        return get_strategy(strategy)(graph, budget, **options)
    schedule, smallest_peak = best_baseline(graph, budget, time_limit, time.perf_counter() + time_limit, threads)
    if schedule is None:
        raise InfeasibleBudgetError(budget, smallest_peak, strategy="best")
    return schedule


def bench_model(label, build, batch, strategy, repeats):
    rows = []
    probe = build()
    x, y = make_batch(probe, batch)
    loss = "categorical_crossentropy"
    plain_peak, plain = plain_fit(build, x, y, loss)
    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    extraction = extract(model, (x, y), loss=loss, optimizer=optimizer, cost_model="profile")
    graph = extraction.graph
    reference = checkpoint_all_peak(graph)
    variables = list(model.variables) + list(optimizer.variables)
    initial = [v.numpy() for v in variables]
    for share in BUDGETS:
        # 100% is the checkpoint-all peak itself, not "no budget" (which a heuristic reads
        # as its own lowest-memory default).
        budget = parse_budget(share, reference)
        name = f"tfremat {share}"
        try:
            schedule = choose_schedule(graph, budget, strategy)
        except (InfeasibleBudgetError, SolverTimeLimitError) as err:
            smallest = "" if err.min_feasible_bytes is None else f"smallest peak reached {err.min_feasible_bytes / MiB:.1f} MiB; "
            status = "infeasible" if isinstance(err, InfeasibleBudgetError) else "no schedule"
            rows.append((name, status, None, None, None,
                         f"{smallest}no schedule peaks below {memory_lower_bound(graph) / MiB:.1f} MiB"))
            continue
        for variable, value in zip(variables, initial):
            variable.assign(value)
        predicted = simulate(graph, schedule).peak_bytes
        step = compile_step(extraction, schedule)
        peak, timing = measure(step, x, y, variables, repeats, plain)
        note = f"{schedule.recompute_count} recomputations, {step.report.costly_vjp_rebuilds} costly VJP rebuilds"
        rows.append((name, schedule.strategy, predicted, peak, timing, note))
        logger.info("%s %s: predicted %.1f MiB requested %.1f MiB allocator %.1f MiB %.3f s (%.2fx plain)", label,
                    name, predicted / MiB, peak[0] / MiB, peak[1] / MiB, timing.seconds, timing.ratio)
    rg_peak, rg_time = recompute_grad_step(build, x, y, extraction.side_table.loss_fn, repeats, plain)
    rows.append(("tf.recompute_grad, sqrt(n) segments", "-", None, rg_peak, rg_time, "BN/dropout run twice"))
    try:
        rs_peak, rs_time = remat_scope_step(build, x, y, loss, repeats, run_eagerly=False, plain=plain)
        rows.append(('keras.RematScope(mode="full")', "-", None, rs_peak, rs_time, ""))
    except ValueError as err:
        reason = str(err).split("\n")[2].replace("\x1b[1m", "").replace("\x1b[0m", "").strip()[:110]
        rows.append(('keras.RematScope(mode="full")', "fails", None, None, None, f"compiled step: {reason}"))
        rs_peak, rs_time = remat_scope_step(build, x, y, loss, repeats, run_eagerly=True, plain=plain)
        rows.append(('keras.RematScope(mode="full"), run_eagerly', "-", None, rs_peak, rs_time, "eager execution"))
    timed = [row[4].reference_seconds for row in rows if row[4] is not None]
    plain_row = ("plain Keras (train_on_batch)", "-", None, plain_peak, None, "")
    return reference, [plain_row, *rows], plain_peak, float(np.median(timed))


NOTES = [
    "## Notes",
    "",
    "- Step times come from a 2-core machine shared with other jobs. Each step is timed in turns "
    "with the plain one, so a load that changes between rows does not move the ratio; a load that "
    "changes within rounds widens the spread column.",
    "- Allocator peaks of convolution-heavy steps vary between runs (CPU convolution scratch "
    "buffers), for plain Keras as much as for tfremat; the U-Nets' peaks are dominated by them, "
    "which is also why no heuristic fits their budgets below 60-80% of the checkpoint-all peak "
    "(an infeasible row gives the smallest peak any heuristic reached and the proven lower bound, "
    "what one node needs while it runs with its inputs and scratch).",
    "- A costly VJP rebuild is a backward node whose layer output is kept but one of whose inputs "
    "was recomputed since: the layer is re-run on the resident input, forward work the plan does "
    "not count.",
    "- tf.recompute_grad segments recompute batch norm and dropout with side effects (statistics "
    "updated twice, a new mask); tfremat recomputes them exactly.",
    "",
]


def render(results, strategy, repeats, argv=None):
    lines = [
        "# Execution benchmark",
        "",
        header(argv),
        "",
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}, CPU, `TF_NUM_INTEROP_THREADS=1`, "
        f"`TF_CPU_ALLOCATOR_USE_BFC=true`; schedule: `{strategy}`; step time: median of {repeats} steps, each "
        "timed in turn with a plain step (`time / plain`: the median of the per-round ratios, "
        "`spread`: their first and third quartile). "
        "Peaks are in the graph's convention (step peak above the bytes allocated before it, plus "
        "variables, optimizer slots and the batch): requested = bytes the step's operations request "
        "(what the prediction models), allocator = the BFC allocator's peak (adds chunk rounding that "
        "swings between runs). Error = requested / predicted - 1. Memory ratios compare requested "
        "bytes, and time, to plain Keras `train_on_batch` (what `model.fit` runs per batch); the plain "
        "row's step time is the median over all its rounds.",
        "",
    ]
    for label, (reference, rows, plain_peak, plain_time) in results.items():
        lines += [
            f"## {label}",
            "",
            f"Checkpoint-all predicted peak: {reference / MiB:.1f} MiB.",
            "",
            "| run | schedule | predicted MiB | requested MiB | error | allocator MiB | memory / plain | step s "
            "| time / plain | spread | notes |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, sched, predicted, peak, timing, note in rows:
            if peak is None:
                lines.append(f"| {name} | {sched} | | | | | | | | | {note} |")
                continue
            requested, allocator = peak
            pred = f"{predicted / MiB:.1f}" if predicted else ""
            err = f"{(requested / predicted - 1) * 100:+.1f}%" if predicted else ""
            if timing is None:  # the plain step itself
                time_cells = f"{plain_time:.3f} | 1.00 | "
            else:
                low, high = timing.ratio_quartiles
                time_cells = f"{timing.seconds:.3f} | {timing.ratio:.2f} | {low:.2f}-{high:.2f}"
            lines.append(
                f"| {name} | {sched} | {pred} | {requested / MiB:.1f} | {err} | {allocator / MiB:.1f} | "
                f"{requested / plain_peak[0]:.2f} | {time_cells} | {note} |"
            )
        lines.append("")
    lines += NOTES
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="best",
                        help='"best" (the cheapest fitting heuristic, best_baseline) or a strategy name')
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds per configuration, each with one plain step")
    parser.add_argument("--out", default=None, help=f"markdown file to write (default {DEFAULT_OUT}; required "
                        "with --only, so a partial run does not replace the full table)")
    parser.add_argument("--only", default=None, help="run only models whose label contains this")
    args = parser.parse_args(argv)
    if args.only is not None and args.out is None:
        parser.error(f"--only runs some models only; give --out (the default {DEFAULT_OUT} holds all of them)")
    args.out = args.out or DEFAULT_OUT
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    results = {}
    for label, (build, batch) in MODELS.items():
        if args.only and args.only not in label:
            continue
        results[label] = bench_model(label, build, batch, args.strategy, args.repeats)
    if not results:
        parser.error(f"no model label contains --only={args.only!r}; labels: {list(MODELS)}")
    text = render(results, args.strategy, args.repeats, argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
