"""Where ``plan_graph(graph, budget, "optimal")`` spends its seconds on saved training graphs,
with one checkout against another, in turns, without TensorFlow.

``--save DIR`` (needs TensorFlow; keras-hub for DistilBert) runs ``tfremat.fit`` on
first_step_latency.py's phase models (the conformance ``transformer_encoder`` at "70% of
activations", user_check_3's DistilBert at "60% of activations", batch 8) up to the point where
it plans, and writes the graph, the budget and the options it plans with to
``DIR/<model>.json`` (``tfremat.graph.DFGraph.to_dict`` under "graph"). Copies are in
benchmarks/graphs/first_step_*.json.

Without ``--save``: each saved graph is planned with ``optimal`` (the options ``fit`` gives it:
time limit 60 s, stall rule 5 CPU s) in a fresh process per run, on each checkout of ``--trees``
in turns (before, after, after, before, ...), and the phases are timed by wrapping the functions
that do them (as first_step_latency.py does): heuristics, the LP and its rounding, RINS, the
MILP. Each run records wall and CPU seconds (the process's, all threads: HiGHS's included), the
load average when it started, the schedule's cost, status and gap, so two checkouts can be
compared on cost as well as time. ``--stall`` adds runs with other ``stall_time`` values
(variant ``stall=<s>``, on the first tree) to see what a shorter stall rule gives up.
``--graphs`` also takes graphs in any format :func:`tfremat.graph.load_graph` reads (the
Checkmate graphs of ``shared/graphs``), planned with no options but fit's; ``--budgets`` plans
every graph at each of the given budgets (``"50% of activations"``; a Checkmate graph's fixed
bytes are 0, so it is a share of its checkpoint-all peak) in place of its saved one. Each run
also records the plan's overhead (cost over the checkpoint-all cost, less one) and the bound,
and the report ends with, per graph and budget, each stall variant's median CPU seconds and
the overhead it gives up against ``stall_time=5`` (the default).

Run: ``python benchmarks/planning_time.py --graphs benchmarks/graphs/first_step_*.json
--trees before=/tmp/before,after=. --repeats 3 --out benchmarks/results/planning_time.md``
(``git archive <rev> tfremat | tar -x -C /tmp/before`` makes the before tree).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from provenance import header, load_line, write_report  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (label, module, function): the phases of an ``optimal`` solve, as first_step_latency.PHASES names them.
PHASES = (
    ("heuristics", "tfremat.ilp.milp", "best_baseline"),
    ("LP and its rounding", "tfremat.ilp.milp", "relaxed_lp_start"),
    ("RINS", "tfremat.ilp.milp", "_rins"),
    ("MILP", "tfremat.ilp.milp", "_solve_with_stage_rows"),
)
SAVE_MODELS = ("transformer_encoder", "distilbert")


def save_graphs(folder: str, models) -> None:
    """Writes ``folder/<model>.json`` for each model: ``fit`` runs until it plans, then stops."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]
    os.environ.setdefault("TFREMAT_CACHE_DIR", tempfile.mkdtemp())
    import first_step_latency
    import keras

    import tfremat
    import tfremat.keras

    class Planned(Exception):
        """Raised in place of planning: the graph is saved."""

    os.makedirs(folder, exist_ok=True)
    for name in models:
        def capture(graph, budget, strategy, *, cache=None, verbose=0, progress=None, **options):
            with open(os.path.join(folder, f"{name}.json"), "w") as f:
                json.dump({"model": name, "budget": budget, "strategy": strategy,
                           "options": {k: v for k, v in options.items() if v is not None},
                           "graph": graph.to_dict()}, f)
            raise Planned()

        tfremat.keras.plan_graph = capture
        keras.utils.set_random_seed(0)
        model, x, y, batch, budget = first_step_latency._phase_model(name)
        try:
            tfremat.fit(model, budget, x, y, batch_size=batch, epochs=1, verbose=0)
        except Planned:
            sys.stderr.write(f"saved {name}\n")


def load_case(path: str, budget) -> tuple[str, dict, object, dict]:
    """``(case name, saved document, budget, options)`` of the graph file ``path`` at ``budget``
    (None: the saved budget); a file that is not ``--save``'s is a graph of its own."""
    with open(path) as f:
        saved = json.load(f)
    if not {"model", "budget", "graph"} <= saved.keys():
        saved = {"model": os.path.splitext(os.path.basename(path))[0], "budget": None, "strategy": "optimal",
                 "options": {}, "graph": saved}
    budget = saved["budget"] if budget is None else budget
    name = saved["model"] if budget == saved["budget"] else f"{saved['model']} @ {budget}"
    return name, saved, budget, dict(saved["options"])


def child(path: str, stall: float | None, budget=None, time_limit: float | None = None) -> dict:
    """One timed ``plan_graph`` of the saved graph ``path`` (at ``budget``: None for the saved
    one) with the tfremat first on the path."""
    import importlib

    from tfremat.graph import load_graph
    from tfremat.planner import plan_graph

    seconds: dict[str, list[float]] = {}
    for label, module_name, attribute in PHASES:
        module = importlib.import_module(module_name)
        function = getattr(module, attribute)

        def timed(*args, _function=function, _label=label, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return _function(*args, **kwargs)
            finally:
                spent = seconds.setdefault(_label, [0.0, 0.0])
                spent[0] += time.perf_counter() - wall
                spent[1] += time.process_time() - cpu

        setattr(module, attribute, timed)
    name, saved, budget, options = load_case(path, budget)
    graph = load_graph(saved["graph"])
    if stall is not None:
        options["stall_time"] = stall
    if time_limit is not None:
        options["time_limit"] = time_limit
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_graph(graph, budget, saved["strategy"], cache=False, verbose=0, **options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    facts = result.facts
    cost = result.schedule.cost(graph)
    return {"model": name, "nodes": graph.size, "load": load, "wall": wall, "cpu": cpu,
            "phases": seconds, "cost": cost, "overhead": cost / graph.total_cost - 1, "bound": facts.best_bound,
            "status": str(facts.status), "gap": facts.gap, "warm_start": facts.warm_start}


def run_child(path: str, tree: str, stall: float | None, budget=None, time_limit: float | None = None) -> dict:
    """:func:`child` in a fresh process on the checkout ``tree``."""
    with tempfile.TemporaryDirectory(prefix="tfremat_planning_time_") as work:
        out = os.path.join(work, "run.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", path, "--child_out", out]
        if stall is not None:
            command += ["--stall", str(stall)]
        if budget is not None:
            command += ["--budgets", budget]
        if time_limit is not None:
            command += ["--time_limit", str(time_limit)]
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=tree), cwd=work)
        with open(out) as f:
            return json.load(f)


def _row(record: dict) -> str:
    phase = record["phases"]
    return (f"| {record['model']} | {record['variant']} | {record['load']:.1f} | {record['wall']:.2f} | "
            f"{record['cpu']:.2f} | "
            + " | ".join(f"{phase.get(label, [0.0, 0.0])[1]:.2f}" for label, _, _ in PHASES)
            + f" | {record['cost']:.9g} | {100 * record.get('overhead', math.nan):+.3f}% | {record['status']} | "
            f"{'' if record['gap'] is None else format(100 * record['gap'], '.2f') + '%'} |")


def stall_table(runs: dict, reference: str = "stall=5") -> list[str]:
    """Per graph and budget, each stall variant's median CPU seconds and median overhead, and
    the overhead it gives up against ``reference`` (percentage points of a step); then the
    worst and the median of what each variant gives up, and its total CPU seconds."""
    stalls = sorted({v for _, v in runs if v.startswith("stall=")}, key=lambda v: float(v.split("=")[1]))
    if reference not in stalls:
        return []
    lines = ["| graph and budget | " + " | ".join(f"{v} CPU s | {v} overhead" for v in stalls) + " | "
             + " | ".join(f"{v} gives up (points)" for v in stalls if v != reference) + " |",
             "|---|" + "---|---|" * len(stalls) + "---|" * (len(stalls) - 1)]
    given_up: dict[str, list[float]] = {v: [] for v in stalls}
    cpu_total: dict[str, float] = {v: 0.0 for v in stalls}
    for model in dict.fromkeys(m for m, _ in runs):
        if not all((model, v) in runs for v in stalls):
            continue
        cpu = {v: statistics.median(r["cpu"] for r in runs[model, v]) for v in stalls}
        over = {v: statistics.median(r["overhead"] for r in runs[model, v]) for v in stalls}
        for v in stalls:
            given_up[v].append(100 * (over[v] - over[reference]))
            cpu_total[v] += cpu[v]
        lines.append(f"| {model} | " + " | ".join(f"{cpu[v]:.2f} | {100 * over[v]:.3f}%" for v in stalls) + " | "
                     + " | ".join(f"{100 * (over[v] - over[reference]):+.3f}" for v in stalls if v != reference)
                     + " |")
    lines += ["", "| variant | cases | total of median CPU s | worst overhead given up (points) | "
              "median given up (points) |", "|---|---|---|---|---|"]
    for v in stalls:
        if given_up[v]:
            lines.append(f"| {v} | {len(given_up[v])} | {cpu_total[v]:.1f} | {max(given_up[v]):+.3f} | "
                         f"{statistics.median(given_up[v]):+.3f} |")
    return lines


def report(paths, variants: dict, repeats: int, keep: str | None, budgets=(None,), jobs: int = 1,
           from_keep: str | None = None, time_limit: float | None = None) -> list[str]:
    """Every run's row, then per graph and variant the medians, then the stall variants side by
    side (:func:`stall_table`). Runs go in turns (variants forwards, then backwards), ``jobs``
    child processes at a time; ``from_keep``: the records of an earlier ``--keep`` file instead."""
    runs: dict[tuple[str, str], list[dict]] = {}
    lines = ["| graph | variant | load | wall s | CPU s | heuristics CPU s | LP+rounding CPU s | RINS CPU s | "
             "MILP CPU s | cost | overhead | status | gap |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    names = list(variants)
    cases = [(path.split("=", 1)[0], budget) for path in paths
             for budget in (path.split("=", 1)[1].split(";") if "=" in path else budgets)]
    order = [(path, budget, variant) for repeat in range(repeats) for path, budget in cases
             for variant in (names if repeat % 2 == 0 else names[::-1])]

    def run(item):
        path, budget, variant = item
        tree, stall = variants[variant]
        try:
            record = run_child(path, tree, stall, budget, time_limit)
        except subprocess.CalledProcessError as error:  # an infeasible budget: its traceback is on stderr
            sys.stderr.write(f"{os.path.basename(path)} at {budget}, {variant}: failed ({error.returncode})\n")
            return None
        record["variant"] = variant
        return record

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        records = list(json.loads(line) for line in open(from_keep)) if from_keep else pool.map(run, order)
        for record in records:
            if record is None:
                continue
            if keep and not from_keep:
                with open(keep, "a") as f:
                    f.write(json.dumps(record) + "\n")
            runs.setdefault((record["model"], record["variant"]), []).append(record)
            lines.append(_row(record))
            sys.stderr.write(lines[-1] + "\n")
    lines += ["", "| graph | variant | runs | median wall s | median CPU s | "
              + " | ".join(f"median {label} CPU s" for label, _, _ in PHASES) + " | costs |",
              "|---|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for (model, variant), records in runs.items():
        lines.append(f"| {model} | {variant} | {len(records)} | {statistics.median(r['wall'] for r in records):.2f} | "
                     f"{statistics.median(r['cpu'] for r in records):.2f} | "
                     + " | ".join(f"{statistics.median(r['phases'].get(label, [0.0, 0.0])[1] for r in records):.2f}"
                                  for label, _, _ in PHASES)
                     + f" | {', '.join(sorted({format(r['cost'], '.9g') for r in records}))} |")
    table = stall_table(runs)
    return lines + ([""] + table if table else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="folder to write the phase models' graphs to (needs TensorFlow)")
    parser.add_argument("--models", default=",".join(SAVE_MODELS), help="with --save: models, comma separated")
    parser.add_argument("--graphs", nargs="*", default=[],
                        help="saved graphs (--save's JSON files, or any load_graph reads); PATH=B1;B2 plans that "
                        "graph at the budgets B1 and B2 in place of --budgets")
    parser.add_argument("--trees", help="variant=checkout pairs, comma separated (default: after=this checkout, "
                        "none with --stall)")
    parser.add_argument("--stall", help="stall_time values (CPU s), comma separated: extra variants on the first tree")
    parser.add_argument("--budgets", help="budgets to plan every graph at, separated by ';' (default: each saved one)")
    parser.add_argument("--jobs", type=int, default=1, help="child processes at a time (CPU seconds are each "
                        "process's own; wall seconds then include waiting for the other)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time_limit", type=float, help="wall seconds in place of fit's 60: on a loaded machine "
                        "60 wall seconds can end a search before its stall rule (CPU seconds) does")
    parser.add_argument("--from_keep", help="render the records of a --keep file instead of running")
    parser.add_argument("--keep", help="append each run's record to this JSON-lines file")
    parser.add_argument("--out", help="markdown file to write")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = child(args.child, float(args.stall) if args.stall else None, args.budgets, args.time_limit)
        with open(args.child_out, "w") as f:
            json.dump(record, f)
        return
    if args.save:
        save_graphs(args.save, args.models.split(","))
        return
    if not args.graphs and not args.from_keep:
        parser.error("give --graphs (saved graphs) or --save")
    given = args.trees or ("" if args.stall else f"after={ROOT}")
    trees = {variant: (os.path.abspath(tree), None) for variant, tree in
             (pair.split("=", 1) for pair in given.split(",") if pair)}
    first = next(iter(trees.values()))[0] if trees else ROOT
    for stall in (args.stall.split(",") if args.stall else []):
        trees[f"stall={stall}"] = (first, float(stall))
    lines = [header(argv), "", "Fresh process per run; `plan_graph(graph, budget, \"optimal\")` with fit's options (time_limit "
             f"{60 if args.time_limit is None else args.time_limit:g}, stall_time 5 unless the variant says); variants: "
             + ", ".join(f"{v} `{t}`" + ("" if s is None else f" stall_time={s}") for v, (t, s) in trees.items())
             + f"; {os.cpu_count()} CPUs.", "", *report([os.path.abspath(p) for p in args.graphs], trees, args.repeats,
                                                        args.keep,
                                                        args.budgets.split(";") if args.budgets else (None,),
                                                        args.jobs, args.from_keep, args.time_limit), "",
             load_line()]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
