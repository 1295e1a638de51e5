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

Run: ``python benchmarks/planning_time.py --graphs benchmarks/graphs/first_step_*.json
--trees before=/tmp/before,after=. --repeats 3 --out benchmarks/results/planning_time.md``
(``git archive <rev> tfremat | tar -x -C /tmp/before`` makes the before tree).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
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


def child(path: str, stall: float | None) -> dict:
    """One timed ``plan_graph`` of the saved graph ``path`` with the tfremat first on the path."""
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
    with open(path) as f:
        saved = json.load(f)
    graph = load_graph(saved["graph"])
    options = dict(saved["options"])
    if stall is not None:
        options["stall_time"] = stall
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_graph(graph, saved["budget"], saved["strategy"], cache=False, verbose=0, **options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    facts = result.facts
    return {"model": saved["model"], "nodes": graph.size, "load": load, "wall": wall, "cpu": cpu,
            "phases": seconds, "cost": result.schedule.cost(graph), "status": str(facts.status),
            "gap": facts.gap, "warm_start": facts.warm_start}


def run_child(path: str, tree: str, stall: float | None) -> dict:
    """:func:`child` in a fresh process on the checkout ``tree``."""
    with tempfile.TemporaryDirectory(prefix="tfremat_planning_time_") as work:
        out = os.path.join(work, "run.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", path, "--child_out", out]
        if stall is not None:
            command += ["--stall", str(stall)]
        subprocess.run(command, check=True, env=dict(os.environ, PYTHONPATH=tree), cwd=work)
        with open(out) as f:
            return json.load(f)


def report(paths, variants: dict, repeats: int, keep: str | None) -> list[str]:
    """Every run's row, then per graph and variant the medians."""
    runs: dict[tuple[str, str], list[dict]] = {}
    lines = ["| graph | variant | load | wall s | CPU s | heuristics CPU s | LP+rounding CPU s | RINS CPU s | "
             "MILP CPU s | cost | status | gap |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    names = list(variants)
    for path in paths:
        for repeat in range(repeats):
            for variant in (names if repeat % 2 == 0 else names[::-1]):
                tree, stall = variants[variant]
                record = run_child(path, tree, stall)
                record["variant"] = variant
                if keep:
                    with open(keep, "a") as f:
                        f.write(json.dumps(record) + "\n")
                runs.setdefault((record["model"], variant), []).append(record)
                phase = record["phases"]
                lines.append(f"| {record['model']} | {variant} | {record['load']:.1f} | {record['wall']:.2f} | "
                             f"{record['cpu']:.2f} | "
                             + " | ".join(f"{phase.get(label, [0.0, 0.0])[1]:.2f}" for label, _, _ in PHASES)
                             + f" | {record['cost']:.9g} | {record['status']} | "
                             f"{'' if record['gap'] is None else format(100 * record['gap'], '.2f') + '%'} |")
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
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="folder to write the phase models' graphs to (needs TensorFlow)")
    parser.add_argument("--models", default=",".join(SAVE_MODELS), help="with --save: models, comma separated")
    parser.add_argument("--graphs", nargs="*", default=[], help="saved graphs (--save's JSON files)")
    parser.add_argument("--trees", default=f"after={ROOT}", help="variant=checkout pairs, comma separated")
    parser.add_argument("--stall", help="stall_time values (CPU s), comma separated: extra variants on the first tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", help="append each run's record to this JSON-lines file")
    parser.add_argument("--out", help="markdown file to write")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = child(args.child, float(args.stall) if args.stall else None)
        with open(args.child_out, "w") as f:
            json.dump(record, f)
        return
    if args.save:
        save_graphs(args.save, args.models.split(","))
        return
    if not args.graphs:
        parser.error("give --graphs (saved graphs) or --save")
    trees = {variant: (os.path.abspath(tree), None) for variant, tree in
             (pair.split("=", 1) for pair in args.trees.split(","))}
    first = next(iter(trees.values()))[0]
    for stall in (args.stall.split(",") if args.stall else []):
        trees[f"stall={stall}"] = (first, float(stall))
    lines = [header(argv), "", "Fresh process per run; `plan_graph(graph, budget, \"optimal\")` with fit's options (time_limit 60, "
             "stall_time 5 unless the variant says); variants: "
             + ", ".join(f"{v} `{t}`" + ("" if s is None else f" stall_time={s}") for v, (t, s) in trees.items())
             + f"; {os.cpu_count()} CPUs.", "", *report([os.path.abspath(p) for p in args.graphs], trees, args.repeats,
                                                        args.keep), "",
             load_line()]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
