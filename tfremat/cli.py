"""The ``tfremat`` command-line tool (absl flags).

Commands:
  strategies   list the strategy names
  solve        plan a graph file with one strategy and print the result as JSON

Usage: ``tfremat COMMAND [--flags]``; ``tfremat COMMAND --help`` lists every flag.
Commands that need TensorFlow import it only when they run.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from tfremat.errors import InfeasibleBudgetError, TfrematError

FLAGS = flags.FLAGS

flags.DEFINE_string("graph", None, "Graph JSON file: tfremat's format or a shared/graphs node-link file.")
flags.DEFINE_string("strategy", None, "Strategy name (see `tfremat strategies`).")
flags.DEFINE_string(
    "budget", None,
    'Memory budget: bytes ("12000000000"), a size with unit ("12GiB", "800MB") or a share of the '
    'checkpoint-all peak ("80%"). Default: no budget.',
)
flags.DEFINE_float("time_limit", None, "Solver time limit in seconds (MILP strategies).")
flags.DEFINE_string("schedule_out", None, "Write the schedule (R, S, execution order, graph fingerprint) to this JSON file.")
flags.DEFINE_bool("json", False, "Print one JSON object instead of a human-readable summary.")

COMMANDS = {
    "strategies": "list the strategy names",
    "solve": "plan a graph file with one strategy",
}
COMMAND_FLAGS = {
    "strategies": ["json"],
    "solve": ["graph", "strategy", "budget", "time_limit", "schedule_out", "json"],
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
    raise SystemExit(code)


def _require(*names: str) -> None:
    missing = [f"--{n}" for n in names if getattr(FLAGS, n) is None]
    if missing:
        _fail(f"{FLAGS.command} needs {', '.join(missing)}")


def cmd_strategies() -> None:
    from tfremat.plan.registry import strategy_names

    names = strategy_names()
    print(json.dumps(names) if FLAGS.json else "\n".join(names))


def cmd_solve() -> None:
    from tfremat.budget import parse_budget
    from tfremat.graph import file_node_ids, load_graph
    from tfremat.plan import simulate
    from tfremat.plan.baselines import checkpoint_all
    from tfremat.plan.registry import get_strategy

    _require("graph", "strategy")
    try:
        with open(FLAGS.graph) as f:
            document = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        _fail(f"--graph={FLAGS.graph}: {exc}")
    graph = load_graph(document)
    strategy = get_strategy(FLAGS.strategy)
    reference_peak = simulate(graph, checkpoint_all(graph)).peak_bytes
    budget = parse_budget(FLAGS.budget, reference_peak) if FLAGS.budget is not None else None
    options = {"time_limit": FLAGS.time_limit} if FLAGS.time_limit is not None else {}
    started = time.perf_counter()
    record = {"strategy": FLAGS.strategy, "graph": graph.name, "budget_bytes": budget}
    try:
        schedule = strategy(graph, budget, **options)
    except InfeasibleBudgetError as exc:
        record.update(
            status="infeasible", peak_bytes=None, cost=None, cost_ratio=None,
            lower_bound=exc.lower_bound_bytes, min_feasible_bytes=exc.min_feasible_bytes, gap=None,
            seconds=round(time.perf_counter() - started, 4), message=str(exc),
        )
        _emit(record)
        raise SystemExit(1)
    seconds = time.perf_counter() - started
    result = simulate(graph, schedule)
    record.update(
        status=schedule.facts.get("status", "feasible"),
        peak_bytes=result.peak_bytes,
        checkpoint_all_peak_bytes=reference_peak,
        cost=result.cost,
        cost_ratio=result.cost / graph.total_cost if graph.total_cost else 1.0,
        recomputations=result.recompute_count,
        lower_bound=schedule.facts.get("best_bound"),
        gap=schedule.facts.get("gap"),
        seconds=round(seconds, 4),
    )
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


_HANDLERS = {"strategies": cmd_strategies, "solve": cmd_solve}


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


def main(argv: list[str]) -> None:
    FLAGS.command = argv[1]
    try:
        _HANDLERS[argv[1]]()
    except TfrematError as exc:
        _fail(str(exc), code=1)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse)


if __name__ == "__main__":
    run()
