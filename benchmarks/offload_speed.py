"""Planning time of the offloading strategies (issue 34): this checkout against an earlier
commit, budget by budget, with their answers.

Usage: python benchmarks/offload_speed.py [--strategy pofo_ap|autocapper] [--graph LABEL]
[--budgets 90%,50%] [--link slow|fast] [--before COMMIT] [--out FILE]

Each case runs in a fresh Python process (no planning cache carried over), this checkout's
``tfremat`` and, with ``--before``, the ``tfremat`` of that commit (``git archive`` into a
temporary folder) in turns, on the same graph (its JSON). A case reports the CPU seconds of its
process for the strategy call (the machine may be shared: wall seconds are noisy), the
predicted overhead (simulated makespan / no-remat cost - 1) and a digest of the schedule
(R, S and H), so that "the same answer" is checked, not assumed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfremat, not an installed one

from chains import BUDGETS, DEFAULT_GRAPHS, LINKS, link_bandwidth, load_graphs  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.plan import offload  # noqa: E402
from tfremat.plan.registry import parse_graph_budget  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "offload_speed.md"

# One case in a fresh process: argv = tree, graph JSON, strategy, budget, bandwidth, limits.
_WORKER = """
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from tfremat.errors import InfeasibleBudgetError
from tfremat.graph import load_graph
from tfremat.plan import offload
from tfremat.plan.simulator import simulate
graph = load_graph(sys.argv[2])
strategy, budget, bandwidth, limits = sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
extra = {"limits": limits} if strategy == "autocapper" else {}
began = time.process_time()
try:
    schedule = getattr(offload, strategy)(graph, budget, bandwidth=bandwidth, **extra)
except InfeasibleBudgetError:
    print(json.dumps({"cpu": time.process_time() - began, "overhead": None}))
    sys.exit(0)
cpu = time.process_time() - began
result = simulate(graph, schedule)
digest = hashlib.sha1(b"".join(m.tobytes() for m in (schedule.R, schedule.S, schedule.H) if m is not None))
print(json.dumps({"cpu": cpu, "overhead": result.makespan / graph.total_cost - 1,
                  "fits": bool(result.peak_bytes <= budget), "digest": digest.hexdigest()[:12]}))
"""


def run_case(tree: Path, graph_file: Path, strategy: str, budget: int, bandwidth: float, limits: int) -> dict:
    """One strategy call with ``tree``'s tfremat, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", _WORKER, str(tree), str(graph_file), strategy, str(budget),
                           repr(bandwidth), str(limits)], capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"the case failed with {tree}'s tfremat:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["overhead"] is None:
        return f"none fits, {row['cpu']:.1f} s"
    return f"{100 * row['overhead']:+.2f}%{'' if row['fits'] else ' (over!)'}, {row['cpu']:.1f} s"


def same(now: dict, before: dict | None) -> str:
    if before is None:
        return "-"
    if now["overhead"] is None or before["overhead"] is None:
        return "yes" if now["overhead"] is before["overhead"] else "no"
    return "yes" if now["digest"] == before["digest"] else f"no ({100 * (now['overhead'] - before['overhead']):+.2f}%)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("pofo_ap", "autocapper"), default="pofo_ap")
    parser.add_argument("--graph", default=None, help="graph label (default MobileNet for pofo_ap, ResNet50 for "
                        "autocapper)")
    parser.add_argument("--budgets", default=",".join(BUDGETS))
    parser.add_argument("--link", choices=("slow", "fast"), default="slow")
    parser.add_argument("--limits", type=int, default=offload.AUTOCAPPER_LIMITS, help="autocapper's limits")
    parser.add_argument("--before", default=None, help="a commit whose tfremat runs each case too, in turns")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown to append to (e.g. {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    label = args.graph or ("MobileNet" if args.strategy == "pofo_ap" else "ResNet50")
    (_, graph), = load_graphs(DEFAULT_GRAPHS, [label])
    bandwidth = link_bandwidth(graph, LINKS[f"{args.link} link"])
    reference = checkpoint_all_peak(graph)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        graph_file = folder / "graph.json"
        graph.to_json(graph_file)
        before_tree = None
        if args.before is not None:
            before_tree = folder / "before"
            before_tree.mkdir()
            archive = subprocess.run(["git", "archive", args.before, "tfremat"], cwd=ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive, check=True)
        what = f"{args.limits} limits, " if args.strategy == "autocapper" else ""
        load = os.getloadavg()[0]
        lines = [f"## {args.strategy} on {label}, {what}{args.link} link\n", header(argv) + "\n",
                 f"| budget | now: overhead, CPU s | {args.before or 'before'}: overhead, CPU s | same schedule |",
                 "| --- | --- | --- | --- |"]
        totals = {"now": 0.0, "before": 0.0}
        for k, share in enumerate(args.budgets.split(",")):
            budget = parse_graph_budget(graph, share, reference)
            case = (graph_file, args.strategy, budget, bandwidth, args.limits)
            # In turns, each first every other budget, so that load drifts hit both alike.
            order = ["now", "before"] if k % 2 == 0 else ["before", "now"]
            rows = {}
            for which in order:
                if which == "before" and before_tree is None:
                    rows[which] = None
                    continue
                rows[which] = run_case(ROOT if which == "now" else before_tree, *case)
                totals[which] += rows[which]["cpu"]
            lines.append(f"| {share} | {cell(rows['now'])} | {cell(rows['before'])} | "
                         f"{same(rows['now'], rows['before'])} |")
            print(lines[-1], flush=True)
    lines.append(f"\nCPU seconds in all: now {totals['now']:.1f}"
                 + (f", {args.before} {totals['before']:.1f}" if args.before else "")
                 + f". Load average (1 min) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(text + "\n")
    return 0 if math.isfinite(totals["now"]) else 1


if __name__ == "__main__":
    sys.exit(main())
