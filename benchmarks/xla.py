"""The compiled step under XLA (``jit_compile=True``, issue 37) against plain XLA training.

For each model: plain training (a ``GradientTape`` step and the optimizer update, as
Keras's ``train_step`` runs it) compiled with XLA and without; tfremat's compiled step at
checkpoint-all and at 50% of the activation memory, with XLA and without; and, as the
evidence of what XLA does to an unmarked schedule, the 50% step under XLA with the
recomputations' runtime zero turned off (:mod:`tfremat.static_graph.interpreter`).

The XLA steps are planned on the graph that counts the copies XLA makes
(``extract(..., xla="memory")``: a convolution's input transposed for its filter gradient,
each trainable variable), the steps without XLA on TensorFlow's kernels; one row plans the
XLA step on TensorFlow's kernels, as before that option.

Memory: the bytes the step requests from the allocator (profiler allocation events,
``count="requested"``) and the allocator's own peak, both in the graph's convention
(:func:`tfremat.runtime.memory.measure_step_peak`). On CPU XLA's buffers go through
TensorFlow's allocator: the executable requests its parameters' and outputs' buffers and
one preallocated block for every temporary, sized by XLA's buffer assignment (the
``--xla_dump_to`` memory-usage report gives the same bytes), so the requested peak is
XLA's own; BFC may serve that block from a free chunk up to twice its size, so the
allocator's peak may read higher. Time: each step against the plain step of the same
compiler, in turns (:func:`tfremat.measure.time_in_turns`); the ratio is the median of the
per-round ratios. Recomputed ops in the HLO: instructions of the optimized HLO named from a
recompute statement (``step/reforward_N``); CSE keeps the first computation's name when it merges.

The cost model under XLA (second table per model): the 50% schedule planned on costs
profiled without XLA (TensorFlow's kernels, ``xla="memory"``) and under XLA
(``extract(..., xla=True)``: every
layer call timed compiled by XLA, as ``RematCallback`` profiles a model compiled with
``jit_compile=True``), each compiled with XLA and timed against plain XLA training. Planned:
the schedule's total cost on its own graph, and its overhead, that cost over
checkpoint-all's on the same graph; "plan's XLA cost" evaluates each schedule on the XLA
costs, so the two plans are compared under one cost model. Measured overhead: the step's
time over plain XLA training's, in turns; measured / planned: that over the planned
overhead (1 when the costs predict what recomputing adds).

A GPU section runs when TensorFlow sees a GPU (larger models).

Run: ``python benchmarks/xla.py`` (writes ``benchmarks/results/xla.md``).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# Ops one at a time, the execution the simulator models (as execution.py runs them).
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the test models (residual_chain)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tfremat, not an installed one

from models import residual_chain  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.errors import InfeasibleBudgetError  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.measure import time_in_turns  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.registry import parse_graph_budget  # noqa: E402
from tfremat.runtime.memory import measure_step_peak  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402
from tfremat.static_graph import interpreter  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "xla.md")
# Heuristics that need no solver; the cheapest schedule that fits the budget is run.
STRATEGIES = ("chen_greedy", "chen_greedy_ap", "griewank_logn", "griewank_logn_ap", "chen_sqrtn", "rotor")
MIB = 2**20


def transformer(blocks, tokens, width, heads, vocab=256, seed=0):
    """Post-norm encoder blocks (attention and residual dropout, a GELU feed-forward)."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    ids = keras.Input((tokens,), dtype="int32")
    h = layers.Embedding(vocab, width)(ids)
    for b in range(blocks):
        attended = layers.MultiHeadAttention(heads, width // heads, dropout=0.1, seed=b)(h, h)
        h = layers.LayerNormalization()(layers.Add()([h, layers.Dropout(0.1, seed=100 + b)(attended)]))
        f = layers.Dense(4 * width, activation="gelu")(h)
        h = layers.LayerNormalization()(layers.Add()([h, layers.Dense(width)(f)]))
    pooled = layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, layers.Dense(10, activation="softmax")(pooled), name="transformer")


CPU_CASES = {
    "residual_chain": (lambda: residual_chain(input_shape=(48, 48, 3), channels=8, blocks=8), 32,
                       "8 blocks, 8 channels, 48x48, batch 32"),
    "transformer": (lambda: transformer(4, 128, 128, 4), 16, "4 blocks, width 128, 128 tokens, batch 16"),
}
GPU_CASES = {
    "residual_chain": (lambda: residual_chain(input_shape=(128, 128, 3), channels=32, blocks=16), 64,
                       "16 blocks, 32 channels, 128x128, batch 64"),
    "transformer": (lambda: transformer(6, 1024, 768, 12, vocab=1024), 8,
                    "6 blocks, width 768, 1024 tokens, batch 8 (GPT-2-shaped)"),
}


def batch_for(model, batch):
    shape = (batch, *model.input.shape[1:])
    if model.input.dtype.startswith("int"):
        x = tf.random.stateless_uniform(shape, seed=[1, 2], maxval=256, dtype=tf.int32)
    else:
        x = tf.random.stateless_normal(shape, seed=[1, 2])
    labels = tf.random.stateless_uniform((batch,), seed=[3, 4], maxval=10, dtype=tf.int32)
    return x, tf.one_hot(labels, 10)


def plain_step(model, loss_fn, optimizer, jit_compile):
    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn([y], [model(x, training=True)])
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return step


def cheapest_fitting(graph, budget):
    found = []
    for name in STRATEGIES:
        try:
            schedule = get_strategy(name)(graph, budget)
        except InfeasibleBudgetError:
            continue
        if simulate(graph, schedule).peak_bytes <= budget:
            found.append(schedule)
    if not found:
        raise SystemExit(f"no strategy of {', '.join(STRATEGIES)} fits {budget} bytes")
    return min(found, key=lambda s: s.cost(graph))


def recomputed_in_hlo(step, x, y) -> int:
    hlo = step.function.experimental_get_compiler_ir(x, y, None)(stage="optimized_hlo")
    return len(re.findall(r'op_name="step/reforward_', hlo))


class _Unmarked:
    """The recomputations' runtime zero off: what XLA makes of the plain schedule."""

    def __enter__(self):
        self.saved = interpreter._runtime_zero
        interpreter._runtime_zero = lambda tensors: None

    def __exit__(self, *exc):
        interpreter._runtime_zero = self.saved


def measure_case(build, batch, rounds, device):
    model = build()
    x, y = batch_for(model, batch)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    # The XLA steps are planned on the graph that counts XLA's copies (extract(xla="memory")),
    # the others on TensorFlow's kernels; the row "planned on TensorFlow's kernels" is the step
    # under XLA as it was planned before.
    kernels = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False)
    copies = extract(model, (x, y), optimizer=optimizer, cost_model="flops", use_cache=False, xla="memory")
    resident = list(model.variables) + list(optimizer.variables)
    loss_fn = kernels.side_table.loss_fn
    rows = []

    def peaks(step):
        return (measure_step_peak(step, x, y, resident=resident, device=device, count="requested"),
                measure_step_peak(step, x, y, resident=resident, device=device))

    def plans(extraction):
        graph = extraction.graph
        return (get_strategy("checkpoint_all")(graph),
                cheapest_fitting(graph, parse_graph_budget(graph, "50% of activations")))

    for jit in (True, False):
        plain = plain_step(model, loss_fn, optimizer, jit)
        requested, allocator = peaks(plain)
        label = "plain, XLA" if jit else "plain, no XLA"
        timing = time_in_turns(lambda: plain(x, y), lambda: plain(x, y), rounds)
        rows.append((label, None, requested, allocator, timing.reference_seconds, None, None))
        checkpoint_all, half = plans(copies if jit else kernels)
        extraction = copies if jit else kernels
        variants = [("checkpoint-all", extraction, checkpoint_all, False),
                    ("50% of activations", extraction, half, False)]
        if jit:
            variants += [("50% of activations, planned on TensorFlow's kernels", kernels, plans(kernels)[1], False),
                         ("50% of activations, recomputations unmarked", extraction, half, True)]
        for what, planned_on, schedule, unmarked in variants:
            if unmarked:
                with _Unmarked():
                    step = compile_step(planned_on, schedule, optimizer=optimizer, jit_compile=jit)
                    step.trace()
            else:
                step = compile_step(planned_on, schedule, optimizer=optimizer, jit_compile=jit)
            requested, allocator = peaks(step)
            timing = time_in_turns(lambda: step(x, y), lambda: plain(x, y), rounds)
            in_hlo = recomputed_in_hlo(step, x, y) if jit and schedule.recompute_count else None
            rows.append((f"tfremat {what}, {'XLA' if jit else 'no XLA'} ({schedule.strategy})",
                         simulate(planned_on.graph, schedule).peak_bytes, requested, allocator, timing.seconds, timing,
                         in_hlo))
    return rows


def measure_costs(build, batch, rounds):
    """The 50% schedule planned on costs profiled without and with XLA, each step compiled
    with XLA (module docstring); rows of (costs, schedule, graph, timing)."""
    model = build()
    x, y = batch_for(model, batch)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    planned = []
    for xla in (False, True):
        extraction = extract(model, (x, y), optimizer=optimizer, cost_model="profile", xla=xla or "memory",
                             use_cache=False)
        half = cheapest_fitting(extraction.graph, parse_graph_budget(extraction.graph, "50% of activations"))
        planned.append((xla, extraction, half))
    plain = plain_step(model, planned[0][1].side_table.loss_fn, optimizer, True)
    xla_graph = planned[1][1].graph
    rows = []
    for xla, extraction, half in planned:
        step = compile_step(extraction, half, optimizer=optimizer, jit_compile=True)
        timing = time_in_turns(lambda: step(x, y), lambda: plain(x, y), rounds)
        rows.append((xla, half, extraction.graph, xla_graph, timing))
    return rows


def cost_table(rows):
    lines = ["| costs profiled | schedule | recomputations | planned ms | planned overhead | plan's XLA cost ms | "
             "step ms | measured overhead [q1, q3] | measured / planned overhead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for xla, schedule, graph, xla_graph, timing in rows:
        every = get_strategy("checkpoint_all")(graph).cost(graph)
        overhead = schedule.cost(graph) / every
        lines.append(
            f"| {'under XLA' if xla else 'without XLA'} | {schedule.strategy} | {schedule.recompute_count} | "
            f"{schedule.cost(graph) * 1e3:.0f} | {overhead:.2f} | {schedule.cost(xla_graph) * 1e3:.0f} | "
            f"{timing.seconds * 1e3:.0f} | {timing.ratio:.2f} [{timing.ratio_quartiles[0]:.2f}, "
            f"{timing.ratio_quartiles[1]:.2f}] | {timing.ratio / overhead:.2f} |")
    return lines


def table(rows):
    lines = ["| step | predicted MiB | requested MiB | allocator MiB | requested / predicted | ms | "
             "time / plain (same compiler) [q1, q3] | recomputed ops in HLO |", "|---|---|---|---|---|---|---|---|"]
    for label, predicted, requested, allocator, seconds, timing, in_hlo in rows:
        ratio = "" if timing is None else f"{timing.ratio:.2f} [{timing.ratio_quartiles[0]:.2f}, " \
                                          f"{timing.ratio_quartiles[1]:.2f}]"
        lines.append(
            f"| {label} | {'' if predicted is None else f'{predicted / MIB:.1f}'} | {requested / MIB:.1f} | "
            f"{allocator / MIB:.1f} | {'' if predicted is None else f'{requested / predicted:.2f}'} | "
            f"{seconds * 1e3:.0f} | {ratio} | {'' if in_hlo is None else in_hlo} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds per step")
    parser.add_argument("--models", nargs="*", default=list(CPU_CASES), help="models to run")
    parser.add_argument("--out", default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument("--no-costs", action="store_true", help="skip the cost-model table (profiling)")
    args = parser.parse_args(argv)
    lines = ["# XLA: the compiled step with jit_compile=True", "", header(argv), "",
             f"TensorFlow {tf.__version__}, Keras {keras.__version__}. Load average at the start: "
             f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs). Schedules: the cheapest of {', '.join(STRATEGIES)} "
             "that fits (flops cost model). See the module docstring for what each column measures.", ""]
    sections = [("CPU", CPU_CASES, "CPU:0")]
    if tf.config.list_physical_devices("GPU"):
        sections.append(("GPU", GPU_CASES, "GPU:0"))
    for title, cases, device in sections:
        lines += [f"## {title}", ""]
        for name in args.models:
            build, batch, description = cases[name]
            with tf.device(device):
                rows = measure_case(build, batch, args.rounds, device)
            first = len(lines)
            lines += [f"### {name}: {description}", "", *table(rows), ""]
            if not args.no_costs:
                with tf.device(device):
                    cost_rows = measure_costs(build, batch, args.rounds)
                lines += ["Cost model under XLA (50% of activations, every step compiled with XLA):", "",
                          *cost_table(cost_rows), ""]
            print("\n".join(lines[first:]), flush=True)
    if len(sections) == 1:
        lines += ["## GPU", "", "No GPU in this run: the section runs when TensorFlow sees one.", ""]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
