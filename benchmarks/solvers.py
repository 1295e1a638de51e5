"""Solver benchmark for tfremat.ilp: Checkmate's MILP and its LP rounding on the benchmark graphs.

Cases: every ``*_train.json`` and ``random_layered_n*.json`` in ``shared/graphs``, at 90%
and 80% of the checkpoint-all peak (Moccasin's budgets) and at a sweep down to 1.1x the
smallest feasible budget found (the smallest peak any baseline reaches, where
recomputation really costs); a graph whose 80% is already below 1.1x that (VGG16 at
1.08x, VGG19 at 1.04x) gets no sweep, its fixed budgets being its tight cases. The random layered graphs run in the execution order their
files store (``--order file``, the order Moccasin's evaluation uses, so budgets and costs
compare with its published ones) or renumbered by ``networkx.topological_sort``
(``--order topological``, a different and harder instance). Each case runs in its own process with a hard wall-clock
limit. Per case and strategy the table reports status, cost / no-remat cost, the gap to
the best proven lower bound (the largest of the MILP's bound, the LP bound and the
no-remat cost) and seconds.

Usage::

    python benchmarks/solvers.py --time-limit 60 --threads 2 \
        --out benchmarks/results/solvers.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.graph import load_graph  # noqa: E402
from tfremat.ilp.formulation import last_descendants  # noqa: E402
from tfremat.ilp.strategies import best_baseline, solve_approx_lp, solve_optimal  # noqa: E402
from tfremat.plan.registry import get_strategy, strategy_names  # noqa: E402
from tfremat.plan.simulator import simulate  # noqa: E402

logger = logging.getLogger("benchmarks.solvers")

ORDER_HELP = {
    "file": "each file's stored execution order (the random layered graphs' graph.order, as Moccasin evaluates them).",
    "topological": "the random layered graphs renumbered by networkx.topological_sort (not Moccasin's instances).",
}
DEFAULT_MAX_COLUMNS = 1_000_000
DEFAULT_GRAPHS = Path(os.environ.get("TFREMAT_GRAPHS", ROOT.parent / "shared" / "graphs"))


def estimated_columns(graph) -> int:
    """Columns of the MILP (R, S, U and FREE) counted without building it."""
    last = last_descendants(graph)
    total = 0
    for i in range(graph.size):
        span = int(last[i]) - i
        total += 2 * (span + 1) + (span if graph.successors[i] else 0)
        for k in graph.successors[i]:
            total += max(0, min(int(last[i]), int(last[k])) - k + 1)
    return total


def baseline_facts(graph):
    """Checkpoint-all peak, and the smallest peak any baseline reaches."""
    peak_all = simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes
    smallest = peak_all
    for name in strategy_names():
        if name in ("optimal", "approx_lp"):
            continue
        smallest = min(smallest, simulate(graph, get_strategy(name)(graph)).peak_bytes)
    return peak_all, smallest


def run_case(case: dict) -> dict:
    """One graph, one budget, one strategy; returns a JSON-ready row."""
    graph = load_graph(case["path"], order=case["order"])
    began = time.perf_counter()
    row = {"strategy": case["strategy"]}
    try:
        if case["strategy"] == "optimal":
            schedule = solve_optimal(graph, case["budget"], time_limit=case["time_limit"], threads=case["threads"])
        else:
            schedule = solve_approx_lp(graph, case["budget"], time_limit=case["time_limit"], threads=case["threads"])
    except InfeasibleBudgetError as exc:
        # approx_lp also raises it when no rounding of a feasible LP fits the budget.
        row.update(status="no rounding fits" if "no rounding" in str(exc) else "infeasible", detail=str(exc))
    except SolverTimeLimitError as exc:
        row.update(status="no schedule", detail=str(exc))
    else:
        facts = schedule.facts
        row.update(
            status=facts["status"], cost=schedule.cost(graph) / graph.total_cost,
            bound=(facts["best_bound"] or graph.total_cost) / graph.total_cost,
            peak_ok=simulate(graph, schedule).peak_bytes <= case["budget"],
            num_vars=facts.get("num_vars"), warm_start=facts.get("warm_start"),
        )
    row["seconds"] = time.perf_counter() - began
    return row


def cases_for(path: Path, sweep: int, order: str):
    graph = load_graph(path, order=order)
    peak_all, smallest = baseline_facts(graph)
    budgets = [("90%", int(0.9 * peak_all)), ("80%", int(0.8 * peak_all))]
    low = 1.1 * smallest
    if low < 0.8 * peak_all:
        for b in np.geomspace(low, 0.8 * peak_all, sweep + 1)[:-1]:
            budgets.append((f"{b / smallest:.2f}x min", int(b)))
    return graph, budgets


def markdown(rows, args) -> str:
    lines = [
        "# tfremat.ilp solver benchmark",
        "",
        f"`python benchmarks/solvers.py --time-limit {args.time_limit} --threads {args.threads}"
        + (f" --only {args.only}" if args.only else "") + (f" --sweep {args.sweep}" if args.sweep != 1 else "")
        + (f" --order {args.order}" if args.order != "file" else "")
        + (f" --max-columns {args.max_columns}" if args.max_columns != DEFAULT_MAX_COLUMNS else "")
        + "` "
        f"(per-case wall limit {args.case_limit} s; {os.cpu_count()} CPUs; HiGHS; commit {_commit()}).",
        "Cost = total cost / no-remat cost. Gap = (cost - best proven bound) / cost, where the bound is the",
        "largest of the MILP's bound, the LP bound and the no-remat cost. 'min' = smallest peak any",
        "baseline reaches (eviction included). 'bound' = that best proven bound / no-remat cost.",
        "'skipped' = model above --max-columns. Seconds are the whole strategy call.",
        f"Node order: {ORDER_HELP[args.order]}",
        "",
        "| graph (nodes) | budget | optimal: status | cost | gap | s | approx_lp: status | cost | gap | s | bound | best baseline cost |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        bound = max([x.get("bound") or 1.0 for x in (r["optimal"], r["approx_lp"]) if x.get("status") in ("optimal", "feasible", "time_limit")] or [1.0])
        cells = []
        for key in ("optimal", "approx_lp"):
            x = r[key]
            if "cost" in x:
                # The strategies promise a schedule within the budget; a breach must show.
                status = x["status"] if x.get("peak_ok", True) else f"{x['status']}, OVER BUDGET"
                cells += [status, f"{x['cost']:.4f}", f"{100 * max(0.0, (x['cost'] - bound) / x['cost']):.2f}%", f"{x['seconds']:.1f}"]
            else:
                cells += [x["status"], "-", "-", f"{x.get('seconds', 0):.1f}"]
        base = "-" if r["baseline"] is None else f"{r['baseline']:.4f}"
        lines.append(f"| {r['graph']} ({r['nodes']}) | {r['budget_label']} | " + " | ".join(cells) + f" | {bound:.4f} | {base} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def best_baseline_cost(graph, budget):
    """Cost of the schedule ``optimal`` warm-starts from (repair only when nothing else fits)."""
    schedule, _ = best_baseline(graph, budget)
    return None if schedule is None else schedule.cost(graph) / graph.total_cost


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=Path, default=DEFAULT_GRAPHS)
    parser.add_argument("--only", default="", help="substring a graph file name must contain")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case-limit", type=float, default=None, help="hard wall limit per case (default time limit + 90)")
    parser.add_argument("--sweep", type=int, default=1, help="budgets between 1.1x min and 80%%")
    parser.add_argument("--order", choices=sorted(ORDER_HELP), default="file", help="execution order of the random layered graphs")
    parser.add_argument("--max-columns", type=int, default=DEFAULT_MAX_COLUMNS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "solvers.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.case_limit = args.case_limit or args.time_limit + 90
    paths = sorted(args.graphs.glob("*_train.json")) + sorted(
        args.graphs.glob("random_layered_n*.json"), key=lambda p: int(p.stem.rsplit("n", 1)[1])
    )
    rows = []
    for path in paths:
        if args.only not in path.name:
            continue
        graph, budgets = cases_for(path, args.sweep, args.order)
        columns = estimated_columns(graph)
        for label, budget in budgets:
            row = {"graph": path.stem, "nodes": graph.size, "budget_label": label,
                   "baseline": best_baseline_cost(graph, budget)}
            for strategy in ("optimal", "approx_lp"):
                if columns > args.max_columns:
                    row[strategy] = {"status": f"skipped ({columns} columns)"}
                    continue
                case = {"path": str(path), "order": args.order, "budget": budget, "strategy": strategy,
                        "time_limit": args.time_limit, "threads": args.threads}
                try:
                    done = subprocess.run(
                        [sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                        timeout=args.case_limit,
                    )
                    row[strategy] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                        "status": f"crashed ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})"}
                except subprocess.TimeoutExpired:
                    row[strategy] = {"status": "killed at case limit", "seconds": args.case_limit}
                logger.info("%s %s %s: %s", path.stem, label, strategy, row[strategy])
            rows.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(markdown(rows, args))


if __name__ == "__main__":
    main()
