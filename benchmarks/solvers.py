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

The "best baseline cost" column is the cheapest heuristic schedule that fits
(:func:`tfremat.ilp.portfolio.best_baseline`, what ``optimal`` warm-starts from), run in
its own process with the time share, deadline and threads ``optimal`` gives it.

Usage::

    python benchmarks/solvers.py --only '.*_train' --time-limit 60 --threads 2 \
        --out benchmarks/results/solvers.md

``--only`` is a regular expression matched against a graph file's whole stem
(``random_layered_n100`` selects that graph only, ``'random_layered_n\d+'`` all of them);
with ``--only`` the output file must be named, so a partial run never replaces a full table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfremat, not an installed one

from provenance import header  # noqa: E402

from tfremat.budget import parse_budget  # noqa: E402
from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.graph import load_graph  # noqa: E402
from tfremat.ilp.approx_lp import solve_approx_lp  # noqa: E402
from tfremat.ilp.formulation import r_column_count  # noqa: E402
from tfremat.ilp.milp import MAX_R_COLUMNS, solve_optimal  # noqa: E402
from tfremat.ilp.portfolio import FALLBACK_TIME_SHARE, best_baseline  # noqa: E402
from tfremat.plan.simulator import (
    checkpoint_all_peak,  # noqa: E402
    simulate,  # noqa: E402
)
from tfremat.strategies import get_strategy, strategy_names  # noqa: E402

logger = logging.getLogger("benchmarks.solvers")

ORDER_HELP = {
    "file": "each file's stored execution order (the random layered graphs' graph.order, as Moccasin evaluates them).",
    "topological": "the random layered graphs renumbered by networkx.topological_sort (not Moccasin's instances).",
}
DEFAULT_GRAPHS = Path(os.environ.get("TFREMAT_GRAPHS", ROOT.parent / "shared" / "graphs"))
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "solvers.md"
# The strategies' own rules for a time-limited call (tfremat.ilp.milp): above this
# many R columns the MILP is not built and the heuristics get the whole time limit, else
# they get this share of it. The baseline column follows them to show what optimal started from.
LIBRARY_MAX_R_COLUMNS = MAX_R_COLUMNS
BASELINE_TIME_SHARE = FALLBACK_TIME_SHARE


def baseline_facts(graph):
    """Checkpoint-all peak, and the smallest peak any baseline reaches."""
    peak_all = checkpoint_all_peak(graph)
    smallest = peak_all
    for name in strategy_names():
        if name in ("optimal", "approx_lp"):
            continue
        smallest = min(smallest, simulate(graph, get_strategy(name)(graph)).peak_bytes)
    return peak_all, smallest


def baseline_case(graph, case: dict) -> dict:
    """The cheapest fitting heuristic, found as ``optimal`` finds its warm start: the same
    share of the time limit (all of it where the MILP is too large to build), the same
    deadline and threads."""
    began = time.perf_counter()
    limit = case["time_limit"]
    share = limit if r_column_count(graph) > LIBRARY_MAX_R_COLUMNS else BASELINE_TIME_SHARE * limit
    schedule, _ = best_baseline(graph, case["budget"], share, began + limit, case["threads"])
    row = {"strategy": "baseline", "seconds": time.perf_counter() - began}
    if schedule is None:
        return {**row, "status": "none fits"}
    return {**row, "status": schedule.strategy, "cost": schedule.cost(graph) / graph.total_cost}


def run_case(case: dict) -> dict:
    """One graph, one budget, one strategy (or the baselines); returns a JSON-ready row."""
    graph = load_graph(case["path"], order=case["order"])
    if case["strategy"] == "baseline":
        return baseline_case(graph, case)
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
            status=facts.status.value, cost=schedule.cost(graph) / graph.total_cost,
            bound=(facts.best_bound or graph.total_cost) / graph.total_cost,
            peak_ok=simulate(graph, schedule).peak_bytes <= case["budget"],
            num_vars=facts.num_vars, warm_start=facts.warm_start,
        )
    row["seconds"] = time.perf_counter() - began
    return row


def cases_for(path: Path, sweep: int, order: str):
    graph = load_graph(path, order=order)
    peak_all, smallest = baseline_facts(graph)
    budgets = [(share, parse_budget(share, peak_all)) for share in ("90%", "80%")]
    low = 1.1 * smallest
    if low < 0.8 * peak_all:
        for b in np.geomspace(low, 0.8 * peak_all, sweep + 1)[:-1]:
            budgets.append((f"{b / smallest:.2f}x min", int(b)))
    return graph, budgets


def markdown(rows, args) -> str:
    lines = [
        "# tfremat.ilp solver benchmark",
        "",
        header(args.argv) + f" Per-case wall limit {args.case_limit} s; {os.cpu_count()} CPUs; HiGHS.",
        "Cost = total cost / no-remat cost. Gap = (cost - best proven bound) / cost, where the bound is the",
        "largest of the MILP's bound, the LP bound and the no-remat cost. 'min' = smallest peak any",
        "baseline reaches (eviction included). 'bound' = that best proven bound / no-remat cost.",
        "'skipped' = model above --max-r-columns R columns. Seconds are the whole strategy call.",
        "Best baseline cost: the cheapest fitting heuristic (best_baseline, with optimal's time share).",
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
        known = r["baseline"]
        base = f"{known['cost']:.4f}" if "cost" in known else "-" if known["status"] == "none fits" else known["status"]
        lines.append(f"| {r['graph']} ({r['nodes']}) | {r['budget_label']} | " + " | ".join(cells) + f" | {bound:.4f} | {base} |")
    return "\n".join(lines) + "\n"


def run_in_child(case: dict, case_limit: float) -> dict:
    """``run_case(case)`` in a fresh process, killed at ``case_limit`` seconds."""
    try:
        done = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                              timeout=case_limit)
    except subprocess.TimeoutExpired:
        return {"status": "killed at case limit", "seconds": case_limit}
    if done.returncode != 0:
        return {"status": f"crashed ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=Path, default=DEFAULT_GRAPHS)
    parser.add_argument("--only", default=None, help="regular expression a graph file's stem must match in full "
                        "(random_layered_n100 is that graph only; '.*_train' the Checkmate graphs)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case-limit", type=float, default=None, help="hard wall limit per case (default time limit + 90)")
    parser.add_argument("--sweep", type=int, default=1, help="budgets between 1.1x min and 80%%")
    parser.add_argument("--order", choices=sorted(ORDER_HELP), default="file", help="execution order of the random layered graphs")
    parser.add_argument("--max-r-columns", type=int, default=None,
                        help="skip graphs whose MILP has more R columns (tfremat.ilp.formulation.r_column_count; "
                        f"default none: under a time limit optimal itself builds no model above {LIBRARY_MAX_R_COLUMNS})")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown file to write (default {DEFAULT_OUT}; "
                        "required with --only, so a partial run does not replace a full table)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    if args.only is not None and args.out is None:
        parser.error(f"--only benchmarks some graphs only; give --out (the default {DEFAULT_OUT} is a full run's)")
    args.out = args.out or DEFAULT_OUT
    args.argv = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.case_limit = args.case_limit or args.time_limit + 90
    paths = sorted(args.graphs.glob("*_train.json")) + sorted(
        args.graphs.glob("random_layered_n*.json"), key=lambda p: int(p.stem.rsplit("n", 1)[1])
    )
    paths = [p for p in paths if args.only is None or re.fullmatch(args.only, p.stem)]
    if not paths:
        parser.error(f"no graph in {args.graphs} matches --only={args.only!r}")
    rows = []
    for path in paths:
        graph, budgets = cases_for(path, args.sweep, args.order)
        columns = r_column_count(graph)
        skipped = args.max_r_columns is not None and columns > args.max_r_columns
        for label, budget in budgets:
            row = {"graph": path.stem, "nodes": graph.size, "budget_label": label}
            for strategy in ("optimal", "approx_lp", "baseline"):
                if skipped:
                    row[strategy] = {"status": f"skipped ({columns} R columns)"}
                    continue
                case = {"path": str(path), "order": args.order, "budget": budget, "strategy": strategy,
                        "time_limit": args.time_limit, "threads": args.threads}
                row[strategy] = run_in_child(case, args.case_limit)
                logger.info("%s %s %s: %s", path.stem, label, strategy, row[strategy])
            rows.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(markdown(rows, args))


if __name__ == "__main__":
    main()
