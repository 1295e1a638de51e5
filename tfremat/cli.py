"""The ``tfremat`` command-line tool (absl flags).

Commands:
  strategies   list the strategy names
  solve        plan a graph file with one strategy and print the result as JSON
  graph        extract a Keras model's training graph to JSON
  plan         plan a Keras model with one strategy; print a table (the schedule with --schedule_out)
  compare      plan a Keras model with every strategy at one budget
  maxbatch     the largest batch that fits a budget, per strategy
  plot         memory-over-the-step and overhead-vs-budget PNGs
  measure      compile and run the planned step; measured vs predicted peak and time, vs plain Keras

Usage: ``tfremat COMMAND [--flags]`` (or ``python -m tfremat COMMAND``); ``tfremat COMMAND
--help`` lists every flag. Commands that need TensorFlow import it only when they run.

Errors are one line on stderr, exit code 2 for a usage error and 1 for the rest; with
``--json`` the command also prints them as a JSON object with an ``"error"`` field on stdout,
so that a script reading stdout gets JSON either way (flags that do not parse are reported
before ``--json`` is read, in text only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags
from absl import logging as absl_logging

from tfremat.budget import check_budget
from tfremat.errors import (
    InfeasibleBudgetError,
    SolverTimeLimitError,
    TfrematError,
    failure_status,
)

FLAGS = flags.FLAGS

flags.DEFINE_string("graph", None, "Graph JSON file: tfremat's format or a shared/graphs node-link file.")
flags.DEFINE_enum(
    "order", "file", ["file", "topological"],
    "Execution order of a --graph file's nodes: the document's own (a Moccasin graph's graph.order, "
    "as Moccasin evaluates it) or networkx.topological_sort.",
)
flags.DEFINE_string("strategy", None, "Strategy name (see `tfremat strategies`).")
flags.DEFINE_string(
    "budget", None,
    'Memory budget: bytes ("12000000000"), a size with unit ("12GiB", "800MB") or a share of the '
    'checkpoint-all peak ("80%"). Default: no budget.',
)
flags.DEFINE_float("time_limit", None, "Solver time limit in seconds for the MILP strategies (default 60; inf: none).")
flags.DEFINE_string("schedule_out", None, "Write the schedule (R, S, execution order, graph fingerprint) to this JSON "
                    "file; without it nothing is written.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of a human-readable summary.")
flags.DEFINE_string("model", None, "A Keras Applications constructor name (resnet50, mobilenet_v2, vgg16, ...; weights=None) or a saved .keras file.")
flags.DEFINE_string("input_shape", None, "Input shape without the batch, e.g. 128,128,3 (optional for a saved "
                    ".keras model, which has its own; checked against it when given).")
flags.DEFINE_integer("batch", None, "Batch size.")
flags.DEFINE_integer("num_classes", 10, "Classes of the head of a Keras Applications model.")
flags.DEFINE_enum("cost_model", "profile", ["profile", "flops"], "Per-node cost: timed on this device, or an analytic FLOP count.")
# tfremat.extract.opening.GRANULARITIES, written out: the command line imports TensorFlow only when a command runs.
flags.DEFINE_enum("granularity", "sublayer", ["layer", "sublayer", "op"],
                  "Graph node: a layer call, sublayer calls and ops inside blocks, or ops of op-composing layers too.")
flags.DEFINE_string("loss", None, "Loss name (default: a saved model's compiled loss, else categorical_crossentropy).")
flags.DEFINE_string("optimizer", None, "Optimizer name (default: a saved model's compiled optimizer, else sgd).")
flags.DEFINE_string("custom_objects", None, "A Python file or module defining a saved model's custom layers, losses "
                    "and functions (its custom_objects dict, else its public classes and functions).")
flags.DEFINE_string("out", None, "Output file (graph JSON for `graph`, PNG prefix folder for `plot`).")
flags.DEFINE_list("strategies", None, "Comma-separated strategy names (default: all).")
flags.DEFINE_list("budgets", None, "Comma-separated budgets for `plot` (default: 30%..100% of the checkpoint-all peak).")
flags.DEFINE_float("max_overhead", None, "maxbatch: allowed extra compute as a fraction (0.3 = 30%); default one extra forward pass.")
flags.DEFINE_integer("max_batch", None, "maxbatch: the largest batch size searched (default 4096).")
flags.DEFINE_enum("method", None, ["scaled", "search"],
                  "maxbatch: scaled (default: two graphs built, the rest judged on their line) or search (every batch "
                  "tried built and solved).")
flags.DEFINE_bool("allocator_check", True, "maxbatch: hold the answer for the device allocator's peak, running its "
                  "step as fit does and trying smaller batches until one holds; --noallocator_check holds it for "
                  "the bytes the step requests only.")
flags.DEFINE_string("solver", None, "MILP solver: highs (default) or gurobi (needs a licensed gurobipy).")
flags.DEFINE_float("bandwidth", None, "Host link in bytes per unit of the graph's cost (bytes per second for profiled "
                   "graphs) for the strategies that offload to host memory (pofo, pofo_ap, autocapper, opportunist); compare and plot "
                   "run them only with it.")
flags.DEFINE_bool("cache", True, "Read and write the on-disk schedule and profile caches ($TFREMAT_CACHE_DIR, else "
                  "~/.cache/tfremat); --nocache profiles and solves anew without reading or writing them.")
flags.DEFINE_integer("steps", 5, "measure: timed rounds, each a planned and a plain step in turn (after untimed runs).")

COMMANDS = {
    "strategies": "list the strategy names",
    "solve": "plan a graph file with one strategy",
    "graph": "extract a Keras model's training graph to JSON",
    "plan": "plan a Keras model with one strategy; print a table (and write the schedule with --schedule_out)",
    "compare": "plan a Keras model with every strategy at one budget",
    "maxbatch": "the largest batch that fits a budget, per strategy",
    "plot": "memory over the step per strategy, and overhead against budget (PNG)",
    "measure": "compile and run the planned step: measured vs predicted peak and time, vs plain Keras",
}
_MODEL_FLAGS = ["model", "input_shape", "batch", "num_classes", "cost_model", "granularity", "loss", "optimizer", "custom_objects"]
COMMAND_FLAGS = {
    "strategies": ["json"],
    "solve": ["graph", "order", "strategy", "budget", "solver", "time_limit", "bandwidth", "schedule_out", "json"],
    "graph": _MODEL_FLAGS + ["out", "cache", "json"],
    "plan": _MODEL_FLAGS + ["budget", "strategy", "solver", "time_limit", "bandwidth", "schedule_out", "cache", "json"],
    "compare": _MODEL_FLAGS + ["budget", "strategies", "solver", "time_limit", "bandwidth", "cache", "json"],
    "maxbatch": ["model", "input_shape", "num_classes", "cost_model", "granularity", "loss", "optimizer", "custom_objects", "budget", "strategies", "max_overhead", "max_batch", "method", "allocator_check", "solver", "time_limit", "bandwidth", "cache", "json"],
    "plot": ["graph", "order", "out", "strategies", "budgets", "solver", "time_limit", "bandwidth", "cache"] + _MODEL_FLAGS,
    "measure": _MODEL_FLAGS + ["budget", "strategy", "solver", "time_limit", "bandwidth", "steps", "cache", "json"],
}


def _usage() -> str:
    lines = ["usage: tfremat COMMAND [--flags]   (tfremat COMMAND --help for its flags)", "commands:"]
    lines += [f"  {name:<11} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def _command_help(command: str) -> str:
    lines = [f"usage: tfremat {command} [--flags]", f"  {COMMANDS[command]}", "flags:"]
    for name in COMMAND_FLAGS[command]:
        flag = FLAGS[name]
        default = "" if flag.default is None else f" (default: {flag.default})"
        lines.append(f"  --{name}: {flag.help}{default}")
    return "\n".join(lines)


def _fail(message: str, code: int = 2) -> None:
    sys.stderr.write(f"tfremat: error: {message}\n")
    if _json_requested():
        print(json.dumps({"error": message}))
    raise SystemExit(code)


def _json_requested() -> bool:
    """``--json`` was given to a command that takes it (once the flags are parsed)."""
    return FLAGS.is_parsed() and "json" in COMMAND_FLAGS.get(FLAGS.command, ()) and FLAGS.json


def _require(*names: str) -> None:
    missing = [f"--{n}" for n in names if getattr(FLAGS, n) is None]
    if missing:
        _fail(f"{FLAGS.command} needs {', '.join(missing)}")


def cmd_strategies() -> None:
    from tfremat.strategies import strategy_names

    names = strategy_names(offloading=True)  # every one; the offloading ones need --bandwidth
    print(json.dumps(names) if FLAGS.json else "\n".join(names))


def cmd_solve() -> None:
    from tfremat.graph import file_node_ids, load_graph
    from tfremat.plan.registry import in_user_terms, parse_graph_budget
    from tfremat.plan.simulator import checkpoint_all_peak, simulate
    from tfremat.planner import resolve_min_budget
    from tfremat.strategies import get_strategy

    _require("graph", "strategy")
    try:
        with open(FLAGS.graph) as f:
            document = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        _fail(f"--graph={FLAGS.graph}: {exc}")
    graph = load_graph(document, order=FLAGS.order)
    strategy = get_strategy(FLAGS.strategy)
    reference_peak = checkpoint_all_peak(graph)
    given = resolve_min_budget(graph, FLAGS.budget)
    budget = parse_graph_budget(graph, given, reference_peak)
    options = _milp_options(FLAGS.strategy)
    started = time.perf_counter()
    record = {"strategy": FLAGS.strategy, "graph": graph.name, "budget_bytes": budget}
    try:
        try:
            schedule = strategy(graph, budget, **options)
        except InfeasibleBudgetError as error:
            raise in_user_terms(error, graph, given, reference_peak) from None
    except (InfeasibleBudgetError, SolverTimeLimitError) as exc:
        # Bounds on the peak (bytes), not on the cost: keys of their own, so that no
        # reader takes one for the other.
        record.update(
            status=failure_status(exc), peak_bytes=None, cost=None, cost_ratio=None, time_ratio=None,
            cost_lower_bound=None,
            peak_lower_bound_bytes=getattr(exc, "lower_bound_bytes", None),
            min_feasible_bytes=getattr(exc, "min_feasible_bytes", None), gap=None,
            seconds=round(time.perf_counter() - started, 4), error=str(exc),
        )
        _emit(record)
        raise SystemExit(1)
    seconds = time.perf_counter() - started
    result = simulate(graph, schedule)
    facts = schedule.facts  # None for a heuristic: nothing proven, status "feasible"
    record.update(
        status=facts.status if facts is not None else "feasible",
        peak_bytes=result.peak_bytes,
        checkpoint_all_peak_bytes=reference_peak,
        cost=result.cost,
        cost_ratio=result.cost / graph.total_cost if graph.total_cost else 1.0,
        recomputations=result.recompute_count,
        # The step's time: the compute cost plus its waits for host copies (offloading).
        time_ratio=result.makespan / graph.total_cost if graph.total_cost else 1.0,
        cost_lower_bound=facts.best_bound if facts is not None else None,
        gap=facts.gap if facts is not None else None,
        seconds=round(seconds, 4),
    )
    if schedule.offloads:
        record.update(transfer_bytes=result.transfer_bytes, host_peak_bytes=result.host_peak_bytes)
    if FLAGS.schedule_out:
        with open(FLAGS.schedule_out, "w") as f:
            json.dump(schedule.to_dict(graph, file_node_ids(graph, document)), f)
        record["schedule_out"] = FLAGS.schedule_out
    _emit(record)


def _emit(record: dict) -> None:
    if FLAGS.json:
        print(json.dumps(record))
    else:
        width = max(len(k) for k in record)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in record.items()))


def _input_shape() -> tuple[int, ...] | None:
    """``--input_shape`` parsed; None when left out (a saved model has its own)."""
    if FLAGS.input_shape is None:
        return None
    try:
        shape = tuple(int(d) for d in FLAGS.input_shape.split(","))
    except (AttributeError, ValueError):
        _fail(f"--input_shape={FLAGS.input_shape!r}: write it as H,W,C, e.g. 128,128,3")
    if not shape or min(shape) <= 0:
        _fail(f"--input_shape={FLAGS.input_shape!r}: every dimension must be positive")
    return shape


def _batch() -> int:
    if FLAGS.batch is None or FLAGS.batch <= 0:
        _fail("--batch must be a positive integer")
    return FLAGS.batch


def _keras_model():
    from tfremat.applications import build_application, load_custom_objects

    _require("model")
    custom_objects = load_custom_objects(FLAGS.custom_objects) if FLAGS.custom_objects else None
    return build_application(FLAGS.model, _input_shape(), num_classes=FLAGS.num_classes, custom_objects=custom_objects)


def _training(model) -> dict:
    """The loss (and loss weights) and optimizer to plan ``model`` with: --loss and
    --optimizer, else what a saved model was compiled with, else categorical cross-entropy
    and SGD (an Applications model is not compiled)."""
    from tfremat.model_planning import keras_optimizer, loss_and_optimizer

    loss = FLAGS.loss or (None if getattr(model, "loss", None) is not None else "categorical_crossentropy")
    optimizer = (keras_optimizer(FLAGS.optimizer, "--optimizer") if FLAGS.optimizer
                 else None if getattr(model, "optimizer", None) is not None else keras_optimizer("sgd", "--optimizer"))
    return loss_and_optimizer(model, loss, optimizer)


def _extraction(model, batch: int, use_cache: bool = True, strategies: Sequence[str] = ()):
    """The model's extraction at ``batch``, with the operator implementations measured when
    one of ``strategies`` chooses among them."""
    from tfremat.extract.extractor import extract
    from tfremat.model_planning import synthetic_batch, wants_implementations

    training = _training(model)
    # Labels shaped for the loss (class ids for a sparse loss), as measure makes them.
    return extract(model, sample_batch=synthetic_batch(model, batch, loss=training["loss"]),
                   cost_model=FLAGS.cost_model, granularity=FLAGS.granularity, use_cache=use_cache,
                   implementations=wants_implementations(strategies), **training)


def _milp_options(name: str) -> dict:
    from tfremat.planner import strategy_options
    from tfremat.strategies import get_strategy

    if get_strategy(name).offloads:
        return {"bandwidth": FLAGS.bandwidth}
    if not get_strategy(name).takes_solver_options:
        return {}
    return strategy_options(name, time_limit=FLAGS.time_limit, solver=FLAGS.solver)


def _table(rows: list[dict], columns: list[str]) -> str:
    from tfremat.units import format_bytes_apart

    byte_columns = [c for c in columns if c.endswith("_bytes")]

    def cells(row: dict) -> list[str]:
        # A row's sizes are read against each other (a peak against the budget): those
        # that would read the same while they differ show their bytes.
        sizes = dict(zip(byte_columns, format_bytes_apart(*(row.get(c) for c in byte_columns))))
        shown = []
        for key in columns:
            value = row.get(key)
            if value is None:
                shown.append("-")
            elif key in sizes:
                shown.append(sizes[key])
            elif key == "overhead":
                shown.append(f"{100 * value:.1f}%")
            else:
                shown.append(str(value))
        return shown

    body = [cells(r) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


_PLAN_COLUMNS = ["strategy", "status", "predicted_peak_bytes", "budget_bytes", "overhead", "solve_seconds"]


def _compare_table(rows: list[dict]) -> str:
    """``compare``'s table: the plan columns, and where some strategy does not fit, the
    smallest peak each of those reached (what budget would do for it); under it, why each
    strategy with no schedule has none (its time limit, which a column cannot say)."""
    infeasible = any(row.get("status") == "infeasible" for row in rows)
    table = _table(rows, _PLAN_COLUMNS + (["min_feasible_bytes"] if infeasible else []))
    notes = [f"{row['strategy']}: {row['error']}" for row in rows if row.get("status") == "no schedule"]
    return "\n".join([table, *notes])


def cmd_graph() -> None:
    from tfremat.applications import graph_command

    _require("model", "out")
    model = _keras_model()
    training = _training(model)
    summary = graph_command(model, _input_shape(), _batch(), FLAGS.cost_model, FLAGS.out, loss=training["loss"],
                            optimizer=training["optimizer"], use_cache=FLAGS.cache, granularity=FLAGS.granularity)
    _emit(summary)


def cmd_plan() -> None:
    from tfremat.planner import plan_graph

    _require("budget")
    strategy = FLAGS.strategy or "optimal"
    extraction = _extraction(_keras_model(), _batch(), use_cache=FLAGS.cache, strategies=[strategy])
    result = plan_graph(extraction.graph, FLAGS.budget, strategy, cache=FLAGS.cache, **_milp_options(strategy))
    record = dataclasses.replace(result, extraction=extraction).summary()  # with the extraction's plain overlap
    if FLAGS.schedule_out:
        with open(FLAGS.schedule_out, "w") as f:
            json.dump(result.schedule.to_dict(extraction.graph, list(extraction.graph.names)), f)
        record["schedule_out"] = FLAGS.schedule_out
    written = f"\nschedule written to {FLAGS.schedule_out}" if FLAGS.schedule_out else ""
    print(json.dumps(record) if FLAGS.json else _table([record], _PLAN_COLUMNS) + written)


def cmd_compare() -> None:
    from tfremat.plan.registry import parse_graph_budget
    from tfremat.planner import compare_graph, resolve_min_budget, summary_row
    from tfremat.strategies import get_strategy, strategy_names

    _require("budget")
    names = FLAGS.strategies or strategy_names(offloading=FLAGS.bandwidth is not None)
    for name in names:
        get_strategy(name)  # before the extraction
    graph = _extraction(_keras_model(), _batch(), use_cache=FLAGS.cache, strategies=names).graph
    given = resolve_min_budget(graph, FLAGS.budget)
    budget = parse_graph_budget(graph, given)
    # --time_limit and --solver configure the MILP strategies; as solve and plot do,
    # compare ignores them when none is among --strategies.
    options = _given_milp_flags() if any(get_strategy(name).takes_solver_options for name in names) else {}
    if FLAGS.bandwidth is not None:
        options["bandwidth"] = FLAGS.bandwidth
    entries = compare_graph(graph, given, names, cache=FLAGS.cache, **options)
    rows = [summary_row(name, entry, budget) for name, entry in zip(names, entries)]
    print(json.dumps(rows) if FLAGS.json else _compare_table(rows))


def _given_milp_flags() -> dict:
    """``--time_limit`` and ``--solver`` where given, for the library's defaults elsewhere."""
    return {k: v for k, v in {"time_limit": FLAGS.time_limit, "solver": FLAGS.solver}.items() if v is not None}


def cmd_maxbatch() -> None:
    from tfremat.api import max_batch_size

    _require("budget")
    names = FLAGS.strategies or ["optimal"]
    bounds = {"max_batch": FLAGS.max_batch} if FLAGS.max_batch is not None else {}
    if FLAGS.method is not None:
        bounds["method"] = FLAGS.method
    model = _keras_model()
    training = _training(model)
    results = max_batch_size(model, FLAGS.budget, strategies=names, max_overhead=FLAGS.max_overhead,
                             loss=training["loss"], optimizer=training["optimizer"],
                             cost_model=FLAGS.cost_model, granularity=FLAGS.granularity, cache=FLAGS.cache,
                             allocator_check=FLAGS.allocator_check, **bounds, **_given_milp_flags())
    # Every answer's schedule was checked on the graph built at its batch (MaxBatchResult),
    # and with the allocator check its step held there.
    rows = [{"strategy": n, "batch_size": r.batch_size, "cost_ratio": round(r.cost / r.graph.total_cost, 4),
             "cost_cap_ratio": round(r.cost_cap / r.graph.total_cost, 4), "reached_max_batch": r.reached_max_batch,
             "certified_on": r.batch_size, "built": list(r.built), "allocator_peak_bytes": r.allocator_peak,
             "allocator_tried": {str(b): ok for b, ok in r.allocator_tried.items()}} for n, r in results.items()]
    if FLAGS.json:
        print(json.dumps(rows))
        return
    notes = [f"{row['strategy']}: batch {row['batch_size']} is the largest searched and fits; the largest batch may "
             "be larger: raise --max_batch" for row in rows if row["reached_max_batch"]]
    shown = [{**row, "built": ",".join(map(str, row["built"])),
              "allocator_tried": ",".join(f"{b}{'' if ok else '(over)'}" for b, ok in row["allocator_tried"].items())}
             for row in rows]
    if FLAGS.allocator_check:
        held = ("each answer's step held within the budget on the device allocator, as fit holds it "
                "(allocator_peak_bytes; allocator_tried: the batches run, '(over)' where none held)")
        columns = ["strategy", "batch_size", "cost_ratio", "cost_cap_ratio", "allocator_peak_bytes", "allocator_tried",
                   "built"]
    else:
        held = "the budget held for the bytes each step requests, not the allocator's peak (--noallocator_check)"
        columns = ["strategy", "batch_size", "cost_ratio", "cost_cap_ratio", "built"]
    print("\n".join([_table(shown, columns),
                     "each answer certified on a graph built at its batch "
                     "(built: the batches whose graphs were built, in order)", held, *notes]))


def cmd_plot() -> None:
    from tfremat.budget import format_bytes, parse_budget
    from tfremat.graph import load_graph
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.plots import plot_memory_traces, plot_overhead_vs_budget
    from tfremat.strategies import get_strategy, strategy_names

    _require("out")
    # The MILP strategies are slow at eight budgets: named ones only.
    names = FLAGS.strategies or [n for n in strategy_names(offloading=FLAGS.bandwidth is not None)
                                 if n not in ("optimal", "monet")]
    if FLAGS.graph:
        graph = load_graph(FLAGS.graph, order=FLAGS.order)
    else:
        graph = _extraction(_keras_model(), _batch(), use_cache=FLAGS.cache, strategies=names).graph
    reference = checkpoint_all_peak(graph)
    budgets = [parse_budget(b, reference, flag="--budgets")
               for b in (FLAGS.budgets or ["30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"])]
    out = Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    middle = budgets[len(budgets) // 2]
    schedules = {}
    for name in names:
        try:
            schedules[name] = get_strategy(name)(graph, middle, **_milp_options(name))
        except (InfeasibleBudgetError, SolverTimeLimitError) as exc:
            sys.stderr.write(f"tfremat: {name} is left out of memory.png: {str(exc).splitlines()[0]}\n")
    if not schedules:
        _fail(f"no strategy of {', '.join(names)} fits the middle budget {format_bytes(middle)} "
              f"({100 * middle / reference:.0f}% of the checkpoint-all peak), whose memory traces memory.png "
              "shows; give --budgets whose middle one is larger", code=1)
    traces = plot_memory_traces(graph, schedules, out / "memory.png", budget_bytes=middle)
    overhead, _ = plot_overhead_vs_budget(graph, names, budgets, out / "overhead.png",
                                          strategy_options={n: _milp_options(n) for n in names if _milp_options(n)})
    print(f"wrote {traces} and {overhead}")


def cmd_measure() -> None:
    from tfremat.measure import measure_model

    _require("budget")
    strategy = FLAGS.strategy or "optimal"
    model = _keras_model()
    training = _training(model)
    record = measure_model(model, FLAGS.budget, batch_size=_batch(), strategy=strategy, steps=FLAGS.steps,
                           loss=None if FLAGS.loss is None and model.loss is not None else training["loss"],
                           optimizer=training["optimizer"], cost_model=FLAGS.cost_model,
                           granularity=FLAGS.granularity, cache=FLAGS.cache,
                           **_milp_options(strategy))
    _emit(record)


_HANDLERS = {
    "strategies": cmd_strategies, "solve": cmd_solve, "graph": cmd_graph, "plan": cmd_plan, "compare": cmd_compare,
    "maxbatch": cmd_maxbatch, "plot": cmd_plot, "measure": cmd_measure,
}


def _parse(argv: list[str]) -> list[str]:
    """absl parsing with one-line errors for bad flags and a command word in argv[1]."""
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage())
        raise SystemExit(0 if len(argv) >= 2 else 2)
    command = argv[1]
    if command not in COMMANDS:
        _fail(f"unknown command {command!r}; commands: {', '.join(COMMANDS)}")
    if any(arg in ("-h", "--help", "--helpshort", "--helpfull") for arg in argv[2:]):
        print(_command_help(command))
        raise SystemExit(0)
    try:
        rest = FLAGS([argv[0]] + argv[2:])
    except flags.Error as exc:
        _fail(str(exc).splitlines()[0])
    if len(rest) > 1:
        _fail(f"unexpected argument {rest[1]!r}; flags are written --name=value")
    return [argv[0], command]


flags.DEFINE_string("command", None, "Set from the first argument; not a user flag.")


def _refuse_flags_of_other_commands(command: str) -> None:
    """Fails naming a flag given on the command line that ``command`` does not read (absl
    parses every command's flags, so ``solve --budgets 50%`` solved without a budget)."""
    ours = {name for names in COMMAND_FLAGS.values() for name in names}
    stray = sorted(name for name in ours if FLAGS[name].present and name not in COMMAND_FLAGS[command])
    if stray:
        _fail(f"--{stray[0]} is not a flag of `tfremat {command}`; its flags: "
              f"{', '.join('--' + name for name in COMMAND_FLAGS[command])}")


def _check_output_paths(command: str) -> None:
    """Fails, naming the flag, when an output cannot be written, before any work (a solve
    of minutes was lost to a missing directory). A file needs an existing, writable
    directory; ``plot --out`` is a folder, created later, so its nearest existing ancestor
    must be writable. Exit status 1, as when the write itself fails."""
    outputs = []
    if "schedule_out" in COMMAND_FLAGS[command] and FLAGS.schedule_out:
        outputs.append(("--schedule_out", Path(FLAGS.schedule_out), "file"))
    if "out" in COMMAND_FLAGS[command] and FLAGS.out:
        outputs.append(("--out", Path(FLAGS.out), "folder" if command == "plot" else "file"))
    for flag, path, kind in outputs:
        if kind == "file" and path.is_dir():
            _fail(f"{flag}={path} is a directory; give a file path", code=1)
        directory = path if kind == "folder" else path.parent
        existing = directory
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if kind == "file" and existing != directory:
            _fail(f"{flag}={path}: the directory {directory} does not exist; create it first", code=1)
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            _fail(f"{flag}={path}: {existing} is not a writable directory", code=1)


# Exit status on Ctrl-C (SIGINT), as shells report a process it ended: 128 + 2.
_INTERRUPTED_EXIT = 130
# Set by the SIGINT handler: the command is being interrupted.
_interrupted = False


def _catch_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual (the solvers stop within a second or two
    and the MILP strategies return their best schedule so far, status "interrupted") and
    is remembered, so that a command that still printed or wrote a schedule exits 130."""
    import signal
    import threading

    def on_sigint(signum, frame):
        global _interrupted
        _interrupted = True
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str]) -> None:
    # The allocator only counts CPU memory with BFC, which must be chosen before TF loads.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    # Sequential op execution: the memory model assumes one op at a time (with parallel
    # inter-op threads TF runs sibling gradient ops together, each with its own scratch).
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not FLAGS["verbosity"].present:
        # absl logs INFO by default: every module's solver and extraction notes would
        # interleave with the progress lines; --verbosity=0 brings them back.
        absl_logging.set_verbosity(absl_logging.WARNING)
    FLAGS.command = argv[1]
    _catch_sigint()
    try:
        if FLAGS.budget is not None and "budget" in COMMAND_FLAGS[argv[1]]:
            # Before any work (extracting a model takes minutes), and in the command line's
            # terms: the library's messages suggest forms only Python can pass.
            check_budget(FLAGS.budget, flag="--budget")
        _refuse_flags_of_other_commands(argv[1])
        _check_output_paths(argv[1])
        _HANDLERS[argv[1]]()
    except KeyboardInterrupt as exc:
        # Ctrl-C with nothing to show: one line (a JSON error under --json), exit 130.
        try:
            _fail(f"interrupted (Ctrl-C){': ' + str(exc).splitlines()[0] if str(exc) else ''}",
                  code=_INTERRUPTED_EXIT)
        except SystemExit:
            _exit_at_once(_INTERRUPTED_EXIT)
    except (TfrematError, ValueError, OSError) as exc:
        # The library's errors, values it refuses (they name the argument) and files it
        # cannot read or write: one line each, not a traceback.
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, code=1)
    if _interrupted:
        # The strategy stopped early and returned its best schedule, printed or written above.
        sys.stderr.write("tfremat: interrupted (Ctrl-C): the schedule shown is the best found before it "
                         "(status \"interrupted\")\n")
        _exit_at_once(_INTERRUPTED_EXIT)


def _exit_at_once(code: int) -> None:
    """Flushes the output and exits without the interpreter's teardown: a solve that Ctrl-C
    cut short can leave HiGHS's worker threads running, and destroying them at exit aborts
    the process ("terminate called without an active exception", exit -6 instead of 130;
    seen in a clean clone's test run)."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse)


if __name__ == "__main__":
    run()
