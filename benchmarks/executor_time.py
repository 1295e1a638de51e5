"""Predicted against measured time over plain, by the executor the compiled step runs on
(benchmarks/results/executor_time.md).

``convnext``: ConvNeXt-like blocks (7x7 depthwise convolution, LayerNorm, Dense 4C with GELU,
Dense C, residual). With ``--depthwise grouped`` the depthwise convolution is
``Conv2D(groups=C)``, which Keras runs on CPU as a call of its ``jit_compile=True``
``_conv_xla``: the step runs on TensorFlow's default executor. With ``--depthwise layer`` it is
``DepthwiseConv2D``: the step runs on the single-threaded one. The extraction measures the
plain overlap as before this change (its ``blocking_call`` test off), so the row gives the
prediction before ``(1 + overhead) * overlap`` and after (the overlap only on the
single-threaded executor), against the step timed in turns with a plain tape step.

``gru``: the plain overlap of user_check.py's ``gru_text`` (batch 16), timed in ``--blocks``
blocks of ``--rounds`` rounds on the two executors, each block's median and quartiles, and
the factor the overlap's stopping rule (2% or 1.5 s, :mod:`tfremat.extract.overlap`) would have
taken from each block's first rounds.

``loops``: where the time over plain of a loop model goes (issue 33 item 2). One process
extracts ``--model`` (``gru_text``: user_check.py's, batch 16; ``bilstm_text`` or a non-loop
control such as ``transformer_encoder``: conformance.py's, batch ``--batch``) uncached, plans
``--budget`` with ``--strategy`` and compiles that step and the checkpoint-all step. Then, in
``--blocks_timed`` blocks of ``--rounds`` rounds, it times four steps in turns (order reversed
every other round): the two compiled steps, the plain tape step on the single-threaded
executor (``plain_seq``) and on the default one (``plain_def``). Per block: the medians and
quartiles of per-round ``step/plain_seq`` (what ``1 + overhead`` predicts), ``plain_seq/plain_def``
(the overlap at that moment) and ``step/plain_def`` (what ``predicted_time_over_plain`` and its
range predict, from the overlap the extraction measured at its own load). With ``--trace N``
it then traces the checkpoint-all step and ``plain_seq`` N times each under TensorFlow's
profiler and splits the ``WhileOp-StartBody`` events into loops of the sequence's length (one
loop at a time on the single-threaded executor): each loop's span inside the step, against
the profiled costs of the loop nodes. With ``--attribute N`` it traces each compiled step N
times and cuts the trace into the plan's statements by the operations its allocations name:
per kind (forward, recomputed forward, backward, loss, the optimizer's updates, other), the
step's ms against the graph's costs. The row also gives the ms of each step (least and
median), the recomputation's ms (planned less checkpoint-all, per round) against the plan's,
and the prediction before and after the step share (:attr:`tfremat.planner.PlanResult.step_share`).

    python benchmarks/executor_time.py convnext --depthwise grouped
    python benchmarks/executor_time.py gru --blocks 4 --rounds 25
    python benchmarks/executor_time.py loops --model gru_text --budget min --blocks_timed 3 --rounds 15 --trace 3
    python benchmarks/executor_time.py loops --model transformer_encoder --budget min --rounds 20 --attribute 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import types

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat.extract.overlap as overlap_module  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.extract.plain_step import plain_train_step  # noqa: E402
from tfremat.planner import plan_graph  # noqa: E402
from tfremat.runtime import executor  # noqa: E402
from tfremat.runtime.timing import time_in_turns  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402


def _convnext(depthwise: str, blocks: int, size: int, channels: int):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(channels, 4, strides=4)(inputs)
    for i in range(blocks):
        shortcut = h
        if depthwise == "grouped":
            h = keras.layers.Conv2D(channels, 7, padding="same", groups=channels, name=f"block_{i}_depthwise_conv")(h)
        else:
            h = keras.layers.DepthwiseConv2D(7, padding="same", name=f"block_{i}_depthwise_conv")(h)
        h = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        h = keras.layers.Dense(4 * channels, activation="gelu")(h)
        h = keras.layers.Dense(channels)(h)
        h = keras.layers.Add()([shortcut, h])
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs, name=f"convnext_like_{depthwise}")
    model.compile(optimizer="adam", loss="mse")
    return model


def _old_overlap():
    """The extraction measures the plain overlap as before: no blocking_call test."""
    overlap_module.executor = types.SimpleNamespace(blocking_call=lambda graph: None,
                                                    sequential_ops=executor.sequential_ops)


def convnext(args) -> dict:
    _old_overlap()
    model = _convnext(args.depthwise, args.blocks, args.size, args.channels)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((args.batch, args.size, args.size, 3)), tf.float32)
    y = tf.constant(rng.random((args.batch, 10)), tf.float32)
    extraction = extract(model, (x, y), cost_model="profile", use_cache=False)
    result = plan_graph(extraction.graph, args.budget, args.strategy, cache=False, verbose=0)
    result = dataclasses.replace(result, extraction=extraction)
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, result.schedule, optimizer=optimizer)
    step(x, y)  # decides the executor
    after = dataclasses.replace(result, step_sequential=step.sequential)
    plain_optimizer = keras.optimizers.Adam()
    plain = plain_train_step(model, extraction.side_table.loss_fn, plain_optimizer)
    blocks = []
    for _ in range(args.blocks_timed):
        load = os.getloadavg()[0]
        timing = time_in_turns(lambda: step(x, y), lambda: plain(x, [y]), args.rounds)
        blocks.append({"load": round(load, 2), "ratio": round(timing.ratio, 4),
                       "quartiles": [round(q, 4) for q in timing.ratio_quartiles]})
    measured = statistics.median(b["ratio"] for b in blocks)
    return {
        "model": model.name, "nodes": extraction.graph.size, "budget": args.budget, "strategy": args.strategy,
        "step_executor": "single-threaded" if step.sequential else "default",
        "overhead": round(result.overhead, 4), "measured_overlap": round(extraction.plain_overlap, 4),
        "predicted_before": round((1 + result.overhead) * extraction.plain_overlap, 4),
        "predicted_after": round(after.predicted_time_over_plain, 4),
        "measured": blocks, "measured_median": round(measured, 4),
        "before_ratio": round(measured / ((1 + result.overhead) * extraction.plain_overlap), 4),
        "after_ratio": round(measured / after.predicted_time_over_plain, 4),
    }


def gru(args) -> dict:
    from user_check import _gru_text  # this script's folder is on the path

    keras.utils.set_random_seed(0)
    model = _gru_text()
    x = tf.zeros((16, 200), tf.int32)
    y = [tf.zeros((16, 1), tf.float32)]
    loss = lambda labels, preds: tf.reduce_mean(keras.losses.binary_crossentropy(labels[0], preds[0]))  # noqa: E731
    default_step = plain_train_step(model, loss, keras.optimizers.Adam())
    sequential_step = plain_train_step(model, loss, keras.optimizers.Adam())

    def run_sequential():
        with executor.sequential():
            out = sequential_step(x, y)
            out.numpy()
        return out

    run_sequential()
    default_step(x, y).numpy()
    blocks = []
    for _ in range(args.blocks):
        load = os.getloadavg()[0]
        ratios = []

        def keep(r):
            ratios[:] = r
            return False

        began = time.perf_counter()
        timing = time_in_turns(run_sequential, lambda: default_step(x, y), args.rounds, warmup=0, enough=keep)
        seconds = time.perf_counter() - began
        # The 2% rule on the rounds so far.
        taken = next((n for n in range(1, len(ratios) + 1) if n >= overlap_module.MIN_ROUNDS and
                      overlap_module._median_error(ratios[:n]) <= overlap_module.PRECISION), None)
        # The 1.5 s bound: rounds that fit in TARGET_SECONDS at this block's pace.
        per_round = seconds / len(ratios)
        by_time = max(overlap_module.MIN_ROUNDS, int(np.ceil(overlap_module.TARGET_SECONDS / per_round)))
        first = min(n for n in (taken, by_time) if n is not None)
        blocks.append({
            "load": round(load, 2), "rounds": len(ratios), "median": round(timing.ratio, 4),
            "quartiles": [round(q, 4) for q in timing.ratio_quartiles],
            "round_seconds": round(per_round, 3),
            "rule_rounds": first, "rule_factor": round(statistics.median(ratios[:first]), 4),
        })
    return {"model": model.name, "blocks": blocks}


def _loop_model(name: str, batch: int):
    """``(model, x, y, loss)`` for ``loops``: gru_text at batch 16 as user_check.py runs it, else
    a conformance.py model at ``batch``."""
    from tfremat.model_planning import synthetic_batch

    if name == "gru_text":
        from user_check import _gru_text

        keras.utils.set_random_seed(0)
        return _gru_text(), tf.zeros((16, 200), tf.int32), tf.zeros((16, 1), tf.float32), "binary_crossentropy"
    import conformance

    model = conformance.build(name)
    x, y = synthetic_batch(model, batch, loss="categorical_crossentropy", seed=0)
    return model, tf.nest.map_structure(tf.constant, x), tf.constant(y), "categorical_crossentropy"


def _quartiles(values: list[float]) -> dict:
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": round(statistics.median(values), 4), "quartiles": [round(low, 4), round(high, 4)]}


def _host_events(run) -> list[tuple[str, int, int, str]]:
    """``run()`` once under TensorFlow's profiler: its host events as ``(name, start ps,
    duration ps, tf_op)``, the last the operation an allocation names (empty for other events)."""
    import glob
    import tempfile

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="executor_time_")
    tf.profiler.experimental.start(logdir, tf.profiler.experimental.ProfilerOptions(host_tracer_level=2))
    run()
    tf.profiler.experimental.stop()
    events = []
    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:"):
                continue
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            stat_names = {key: meta.name for key, meta in plane.stat_metadata.items()}
            for line in plane.lines:
                base = line.timestamp_ns * 1000
                for event in line.events:
                    op = next((stat.str_value or stat_names.get(stat.ref_value, "") for stat in event.stats
                               if stat_names.get(stat.metadata_id) == "tf_op"), "")
                    events.append((names[event.metadata_id], base + event.offset_ps, event.duration_ps, op))
    return events


def _loop_spans(run, iterations: int) -> tuple[float, list[float]]:
    """``(ms of the traced call, ms of each loop in it)``: ``run()`` once under TensorFlow's
    profiler (:func:`_host_events`), its ``WhileOp-StartBody`` events in time order cut into
    loops of ``iterations``."""
    bodies, total = [], 0.0
    for name, start, duration, _ in _host_events(run):
        if name == "WhileOp-StartBody":
            bodies.append((start, start + duration))
        elif name == "KernelAndDeviceFunc::Run":
            total = max(total, duration * 1e-9)
    bodies.sort()
    loops_ = [bodies[i:i + iterations] for i in range(0, len(bodies), iterations)]
    return round(total, 2), [round((loop[-1][1] - loop[0][0]) * 1e-9, 2) for loop in loops_]


def _statement_times(run) -> dict[tuple, float]:
    """Seconds of each part of one traced ``run()`` of a compiled step: TensorFlow's host trace
    has no event per operation on the single-threaded executor, but each allocation names its
    operation (``tf_op``), and the step's names carry the statement (``step/<layer>/forward_<node>/``,
    ``step/reforward_<node>/``, ``step/loss_<node>/``; a gradient ``gradient_tape/step/forward_<node>/``,
    the optimizer ``adam...``). A part runs from its first allocation to the next part's, so
    an operation that allocates nothing counts in the part before it. Keys: ``(kind, node)``
    with kind forward, reforward, backward (node: its forward's), loss, or ``("other", name)``."""
    import re

    statement = re.compile(r"^(?:gradient_tape/)?step/(?:.*?/)?(re)?(forward|loss)_(\d+)/")
    allocations, call = [], None
    for name, start, duration, op in _host_events(run):
        if name == "KernelAndDeviceFunc::Run":
            call = (start, start + duration)
        elif name == "MemoryAllocation":
            allocations.append((start, op))
    parts = []
    for time_, op in sorted(a for a in allocations if call[0] <= a[0] <= call[1]):
        match = statement.match(op)
        if match is None:
            key = ("other", op.split("/")[0])
        elif op.startswith("gradient_tape/"):
            key = ("backward", int(match.group(3)))
        else:
            key = (("re" if match.group(1) else "") + match.group(2), int(match.group(3)))
        if not parts or parts[-1][0] != key:
            parts.append((key, time_))
    parts.append((None, call[1]))
    seconds = {("other", "before the first allocation"): (parts[0][1] - call[0]) * 1e-12}
    for (key, start), (_, end) in zip(parts, parts[1:]):
        seconds[key] = seconds.get(key, 0.0) + (end - start) * 1e-12
    return seconds


def _attributed(run, graph, side_table, traces: int) -> dict:
    """Per kind of statement, the least over ``traces`` traced runs of the ms the step spent
    in it (:func:`_statement_times`) against the graph's costs of those statements' nodes.
    The trace's allocation events slow both the step and the profile's calls."""
    backward_of = {entry.forward_node: entry.node for entry in side_table.entries if entry.kind == "backward"}
    _statement_times(run)  # the process's first trace ran 2-3x slower
    runs = [_statement_times(run) for _ in range(traces)]
    kinds: dict[str, list[float]] = {}
    costs: dict[str, float] = {}
    for k, seconds in enumerate(runs):
        for (kind, node), value in seconds.items():
            label = node if kind == "other" else kind
            kinds.setdefault(label, [0.0] * len(runs))[k] += value
            # A forward whose gradient the tape computes inside another node's backward (a view
            # the side table folds away) has no backward node: its time counts, its cost is the other's.
            cost_node = backward_of.get(node) if kind == "backward" else node
            if kind != "other" and k == 0 and cost_node is not None:
                costs[kind] = costs.get(kind, 0.0) + graph.cost[cost_node]
    return {label: {"step_ms": round(1e3 * min(values), 2),
                    **({"cost_ms": round(1e3 * costs[label], 2)} if label in costs else {})}
            for label, values in sorted(kinds.items(), key=lambda item: -min(item[1]))}


def loops(args) -> dict:
    from tfremat.plan.baselines import checkpoint_all

    model, x, y, loss = _loop_model(args.model, args.batch)
    began = time.perf_counter()
    extraction = extract(model, (x, y), loss=loss, optimizer=keras.optimizers.Adam(), use_cache=False)
    extract_seconds = time.perf_counter() - began
    graph = extraction.graph
    result = dataclasses.replace(plan_graph(graph, args.budget, args.strategy, cache=False, verbose=0),
                                 extraction=extraction)
    steps = {}
    for name, schedule in (("all", checkpoint_all(graph)), ("planned", result.schedule)):
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        steps[name] = compile_step(extraction, schedule, optimizer=optimizer)
    loss_fn = extraction.side_table.loss_fn
    plain_seq_step = plain_train_step(model, loss_fn, keras.optimizers.Adam())
    plain_def_step = plain_train_step(model, loss_fn, keras.optimizers.Adam())

    def plain_seq():
        with executor.sequential():
            out = plain_seq_step(x, [y])
            out.numpy()
        return out

    runs = {"all": lambda: steps["all"](x, y), "planned": lambda: steps["planned"](x, y), "plain_seq": plain_seq,
            "plain_def": lambda: plain_def_step(x, [y])}
    for run in runs.values():  # traces, instantiates, decides the compiled steps' executor
        tf.nest.flatten(run())[0].numpy()
    order = list(runs)
    blocks = []
    for _ in range(args.blocks_timed):
        load = os.getloadavg()[0]
        seconds = {name: [] for name in order}
        for round_ in range(args.rounds):
            for name in order if round_ % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                tf.nest.flatten(runs[name]())[0].numpy()
                seconds[name].append(time.perf_counter() - started)

        def ratio(a, b):
            return _quartiles([p / q for p, q in zip(seconds[a], seconds[b])])

        blocks.append({
            "load": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            "plain_seq_ms": round(1e3 * statistics.median(seconds["plain_seq"]), 1),
            "all_ms": round(1e3 * statistics.median(seconds["all"]), 1),
            "least_ms": {name: round(1e3 * min(seconds[name]), 2) for name in order},
            "recompute_ms": round(1e3 * statistics.median(
                planned - all_ for planned, all_ in zip(seconds["planned"], seconds["all"])), 2),
            "all/plain_seq": ratio("all", "plain_seq"), "planned/plain_seq": ratio("planned", "plain_seq"),
            "plain_seq/plain_def": ratio("plain_seq", "plain_def"), "planned/plain_def": ratio("planned", "plain_def"),
        })
    low, high = result.predicted_time_over_plain_range
    measured = statistics.median(b["planned/plain_def"]["median"] for b in blocks)
    return {
        "model": model.name, "nodes": graph.size, "budget": args.budget, "strategy": args.strategy,
        "extract_s": round(extract_seconds, 1), "step_sequential": steps["planned"].sequential,
        "total_cost_ms": round(1e3 * graph.total_cost, 1), "overhead": round(result.overhead, 4),
        "predicted_recompute_ms": round(1e3 * result.overhead * graph.total_cost, 2),
        "overlap": round(extraction.plain_overlap, 4),
        "overlap_range": [round(v, 4) for v in extraction.plain_overlap_range],
        "overlap_load": None if extraction.plain_overlap_load is None else round(extraction.plain_overlap_load, 2),
        "plain_step_ms": (None if extraction.plain_step_seconds is None
                          else round(1e3 * extraction.plain_step_seconds, 2)),
        "step_share": round(result.step_share, 4),
        "predicted_before": round((1 + result.overhead) * result.plain_overlap, 4),
        "predicted": round(result.predicted_time_over_plain, 4), "predicted_range": [round(low, 4), round(high, 4)],
        "blocks": blocks, "measured": round(measured, 4),
        "measured/predicted": round(measured / result.predicted_time_over_plain, 4),
        "measured/predicted_before": round(measured / ((1 + result.overhead) * result.plain_overlap), 4),
        "in_range": bool(low <= measured <= high),
        "in_band": bool(0.87 * low <= measured <= 1.15 * high),
        "loop_nodes_ms": {graph.names[i]: round(1e3 * graph.cost[i], 2) for i in range(graph.size)
                          if 1e3 * graph.cost[i] >= 1.0},
        "traces": [{"load": round(os.getloadavg()[0], 2),
                    "all": _loop_spans(runs["all"], int(x.shape[1])),
                    "plain_seq": _loop_spans(plain_seq, int(x.shape[1]))} for _ in range(args.trace)],
        "attributed": (_attributed(runs["all"], graph, extraction.side_table, args.attribute)
                       if args.attribute else None),
        "attributed_planned": (_attributed(runs["planned"], graph, extraction.side_table, args.attribute)
                               if args.attribute else None),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["convnext", "gru", "loops"])
    parser.add_argument("--model", default="gru_text", help="loops: gru_text or a conformance.py model name")
    parser.add_argument("--depthwise", choices=["grouped", "layer"], default="grouped")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="90% of activations")
    parser.add_argument("--strategy", default="optimal")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--blocks_timed", type=int, default=3)
    parser.add_argument("--trace", type=int, default=0, help="loops: profiler traces of the step and plain_seq")
    parser.add_argument("--attribute", type=int, default=0,
                        help="loops: profiler traces of each compiled step, cut into statements by their allocations")
    args = parser.parse_args()
    print(json.dumps({"convnext": convnext, "gru": gru, "loops": loops}[args.kind](args)))


if __name__ == "__main__":
    main()
