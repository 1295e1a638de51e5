"""Why the compiled checkpoint-all step runs slower than plain Keras (issue 33 item 2).

The checkpoint-all step recomputes nothing and its plan says 1.00x plain, yet the keras.io
ViT of ``min_budget.py`` ran 1.12-1.47x plain there. For each model this benchmark compiles
the checkpoint-all step on the same extraction and batch, runs it three ways and compares
them with plain training:

* ``sequential``: the compiled step on TensorFlow's single-threaded executor
  (:mod:`tfremat.runtime.executor`), as ``step(x, y)`` runs it with several inter-op
  threads: one operation at a time whatever the setting;
* ``ordered``: the same step's ``tf.function`` called directly, on TensorFlow's default
  executor (several operations of a statement at a time with several inter-op threads,
  one at a time in ready order with one, as ``step(x, y)`` runs it there);
* ``unordered``: a diagnostic copy without the step's three orderings, the per-statement
  tokens (:func:`tfremat.static_graph.interpreter._token` made an empty ``NoOp``), the
  weight gradients after the input gradients
  (:func:`tfremat.runtime.gradient_order.wait_for` off) and the updates before the next
  statement (:func:`tfremat.static_graph.interpreter.order_updates` off); never a step to
  train with, only to show what the orderings cost;
* ``plain``: :func:`tfremat.extract.plain_step.plain_train_step`.

It reports the operations each step's graph has beyond plain's (by type) and its control
edges, the bytes each step requests over the checkpoint-all prediction, and the wall and
process-CPU time of the steps timed in turns (median per-round ratio to plain, quartiles).
Each model runs twice, in its own subprocess: with ``TF_NUM_INTEROP_THREADS=1`` (operations
one at a time, the sequential execution the simulator models and the other benchmarks use)
and with TensorFlow's default (as a user runs, and as ``min_budget.py --measure`` measured).

Run: ``python benchmarks/step_overhead.py [--models vit,transformer_encoder] [--rounds 30]``
(writes ``benchmarks/results/step_overhead.md``). ``vit`` is min_budget.py's ViT at batch
32 with Adam; the other names are conformance user-style models at ``--batch`` with SGD, as
``fidelity.py`` builds them. The machine's cores may be shared: compare ratios of one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "results", "step_overhead.md")
ORDERING_OPS = ("IdentityN", "Identity", "NoOp")


def build(name: str, batch: int):
    """The model ``name`` compiled, and its batch size."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, HERE)
    if name == "vit":
        import min_budget

        return min_budget.vit(), min_budget.BATCH
    import conformance

    model = conformance.build(name)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model, batch


def _op_profile(function, x, y) -> tuple[collections.Counter, int]:
    ops = function.get_concrete_function(x, y).graph.get_operations()
    return collections.Counter(op.type for op in ops), sum(len(op.control_inputs) for op in ops)


def measure(name: str, batch: int, rounds: int) -> dict:
    """One model's row in this process (its inter-op setting fixed at import)."""
    sys.path.insert(0, ROOT)
    import tensorflow as tf

    import tfremat.runtime.gradient_order as gradient_order
    import tfremat.static_graph.compile as compile_module
    import tfremat.static_graph.interpreter as interpreter
    from tfremat.runtime import executor
    from tfremat.extract.extractor import extract
    from tfremat.extract.plain_step import plain_train_step
    from tfremat.model_planning import loss_and_optimizer, synthetic_batch
    from tfremat.plan.baselines import checkpoint_all
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.runtime.memory import measure_step_peak

    model, batch = build(name, batch)
    training = loss_and_optimizer(model, None, None)
    optimizer = training["optimizer"]

    def fresh():
        return type(optimizer).from_config(optimizer.get_config())

    x, y = tf.nest.map_structure(tf.constant, synthetic_batch(model, batch, loss=training["loss"], seed=0))
    extraction = extract(model, sample_batch=(x, y), **{**training, "optimizer": fresh()})
    schedule = checkpoint_all(extraction.graph)
    predicted = checkpoint_all_peak(extraction.graph)
    saved = [v.numpy() for v in model.variables]

    def restore():
        for variable, value in zip(model.variables, saved):
            variable.assign(value)

    def empty_token(tensors):
        with tf.control_dependencies(None):
            return tf.no_op(name="no_token")

    def on_executor(function):
        # What step(x, y) runs with several inter-op threads, here with either setting.
        def call(*args):
            with executor.sequential():
                return function(*args)
        return call

    def compiled(ordered: bool):
        step_optimizer = fresh()
        step_optimizer.build(model.trainable_variables)
        kept = (interpreter._token, compile_module.order_updates, gradient_order.wait_for)
        if not ordered:
            interpreter._token = empty_token
            compile_module.order_updates = lambda report, update_ops: 0
            gradient_order.wait_for = lambda first, then, since: 0
        try:
            step = compile_module.compile_step(extraction, schedule, optimizer=step_optimizer)
            step.trace()
            step(x, y)
        finally:
            interpreter._token, compile_module.order_updates, gradient_order.wait_for = kept
        return step, list(step_optimizer.variables)

    steps, resident = {}, {}
    step, resident["ordered"] = compiled(True)
    steps["sequential"], steps["ordered"], resident["sequential"] = on_executor(step.function), step.function, \
        resident["ordered"]
    restore()
    unordered, resident["unordered"] = compiled(False)
    steps["unordered"] = unordered.function
    restore()
    plain_optimizer = fresh()
    steps["plain"] = plain_train_step(model, extraction.side_table.loss_fn, plain_optimizer)
    steps["plain"](x, y)
    resident["plain"] = list(plain_optimizer.variables)
    restore()

    interop = os.environ.get("TF_NUM_INTEROP_THREADS", "0")
    row = {"model": name, "batch": batch, "interop": "default" if interop == "0" else interop,
           "predicted_mib": predicted / 2**20}
    plain_ops, plain_control = _op_profile(steps["plain"], x, y)
    for label in ("ordered", "unordered"):
        ops, control = _op_profile(steps[label], x, y)
        extra = {k: ops[k] - plain_ops[k] for k in set(ops) | set(plain_ops) if ops[k] != plain_ops[k]}
        row[f"{label}_extra_ops"] = dict(sorted(extra.items(), key=lambda kv: -abs(kv[1])))
        row[f"{label}_control_edges"] = control
    row["plain_control_edges"] = plain_control
    for label, step in steps.items():
        peak = measure_step_peak(step, x, y, resident=list(model.variables) + resident[label], count="requested")
        row[f"{label}_requested_over_predicted"] = peak / predicted
        restore()

    row["load_before"] = os.getloadavg()[0]
    wall = {label: [] for label in steps}
    cpu = {label: [] for label in steps}
    order = list(steps)
    for round_ in range(rounds + 2):  # two untimed rounds first
        for label in order if round_ % 2 == 0 else order[::-1]:
            began, began_cpu = time.perf_counter(), time.process_time()
            steps[label](x, y).numpy()
            if round_ >= 2:
                wall[label].append(time.perf_counter() - began)
                cpu[label].append(time.process_time() - began_cpu)
    row["load_after"] = os.getloadavg()[0]
    restore()
    row["plain_ms"] = statistics.median(wall["plain"]) * 1e3
    for label in ("sequential", "ordered", "unordered"):
        ratios = [a / b for a, b in zip(wall[label], wall["plain"])]
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
        row[f"{label}_time_over_plain"] = statistics.median(ratios)
        row[f"{label}_time_quartiles"] = [quartiles[0], quartiles[2]]
        row[f"{label}_cpu_over_plain"] = statistics.median(cpu[label]) / statistics.median(cpu["plain"])
    row["plain_cores_used"] = statistics.median(c / w for c, w in zip(cpu["plain"], wall["plain"]))
    row["ordered_cores_used"] = statistics.median(c / w for c, w in zip(cpu["ordered"], wall["ordered"]))
    row["sequential_cores_used"] = statistics.median(c / w for c, w in zip(cpu["sequential"], wall["sequential"]))
    return row


def run_child(name: str, batch: int, rounds: int, interop: str | None) -> dict:
    """``measure`` in a subprocess with ``TF_NUM_INTEROP_THREADS`` set (None: TensorFlow's default)."""
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    # "0" is TensorFlow's default; unset, min_budget.py's import (the ViT) set it to 1.
    env["TF_NUM_INTEROP_THREADS"] = "0" if interop is None else interop
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--batch", str(batch),
               "--rounds", str(rounds)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | inter-op | plain ms | sequential/plain | ordered/plain | unordered/plain "
        "| CPU sequential, ordered /plain | cores plain / sequential / ordered "
        "| req/pred sequential, ordered, unordered, plain | extra ops (ordered) | control edges ordered / plain "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = ", ".join(f"{k} {v:+d}" for k, v in list(r["ordered_extra_ops"].items())[:5])
        lines.append(
            f"| {r['model']} (batch {r['batch']}) | {r['interop']} | {r['plain_ms']:.1f} "
            f"| {r['sequential_time_over_plain']:.3f} ({r['sequential_time_quartiles'][0]:.2f}-"
            f"{r['sequential_time_quartiles'][1]:.2f}) "
            f"| {r['ordered_time_over_plain']:.3f} ({r['ordered_time_quartiles'][0]:.2f}-"
            f"{r['ordered_time_quartiles'][1]:.2f}) "
            f"| {r['unordered_time_over_plain']:.3f} ({r['unordered_time_quartiles'][0]:.2f}-"
            f"{r['unordered_time_quartiles'][1]:.2f}) "
            f"| {r['sequential_cpu_over_plain']:.3f}, {r['ordered_cpu_over_plain']:.3f} "
            f"| {r['plain_cores_used']:.2f} / {r['sequential_cores_used']:.2f} / {r['ordered_cores_used']:.2f} "
            f"| {r['sequential_requested_over_predicted']:.3f}, {r['ordered_requested_over_predicted']:.3f}, "
            f"{r['unordered_requested_over_predicted']:.3f}, {r['plain_requested_over_predicted']:.3f} | {extra} "
            f"| {r['ordered_control_edges']} / {r['plain_control_edges']} "
            f"| {r['load_before']:.1f}-{r['load_after']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vit,transformer_encoder,zeropad_conv_chain,convmixer,bilstm_text")
    parser.add_argument("--batch", type=int, default=8, help="batch of the conformance models (the ViT: 32)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batch, args.rounds)))
        return
    sys.path.insert(0, HERE)
    from provenance import header

    rows = []
    for name in args.models.split(","):
        for interop in ("1", None):
            rows.append(run_child(name, args.batch, args.rounds, interop))
            print(table(rows)[-1], flush=True)
    text = ["# Compiled checkpoint-all step against plain Keras: where the time goes", "", header(), "",
            "Each row: one subprocess; `sequential`: the compiled step on TensorFlow's single-threaded executor "
            "(as `step(x, y)` runs it with several inter-op threads); `ordered`: the same step's tf.function called directly, on the default "
            "executor; `unordered`: that step without its "
            "statement tokens, weight-after-input gradient order and update ordering (diagnostic only); "
            "time ratios are medians of per-round ratios (quartiles); `cores`: process CPU seconds over wall "
            "seconds per step; `req/pred`: bytes requested over the checkpoint-all prediction; load: 1-minute "
            "load average before and after the timed rounds.", "", *table(rows), ""]
    with open(args.out, "w") as handle:
        handle.write("\n".join(text))


if __name__ == "__main__":
    main()
