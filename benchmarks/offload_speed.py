"""Planning time of the offloading strategies (issue 34): one DP for several limits, against
the former one DP per limit, with their answers.

Usage: python benchmarks/offload_speed.py [--strategy pofo_ap|autocapper] [--graph LABEL]
[--budgets 90%,50%] [--link slow|fast] [--former-budgets 90%,50%] [--out FILE]

``pofo_ap`` solved pofo's DP once per memory limit around the budget (six limits); it now
solves one table in slots of the budget's activation bytes and reads every limit from it
(:func:`tfremat.plan.pofo.solve_pofo_limits`). ``autocapper`` ran the ``rotor`` strategy
(its DP plus a search on the graph) at each of the paper's 40 limits; it now reads rotor's
sequence at every limit from one table (:func:`tfremat.plan.rotor.sequences_at_limits`),
as sec. 5.1 describes capper's start. The former paths are kept here only, to measure them
in the same run. Each case reports CPU seconds of this process (the machine may be shared:
wall seconds are noisy) and the predicted overhead (simulated makespan / no-remat cost - 1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfremat, not an installed one

from chains import BUDGETS, DEFAULT_GRAPHS, LINKS, link_bandwidth, load_graphs  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.errors import InfeasibleBudgetError  # noqa: E402
from tfremat.plan import offload, rotor  # noqa: E402
from tfremat.plan.baselines import _forward_phase_end, cheapest_fitting, time_is_up  # noqa: E402
from tfremat.plan.pofo import solve_pofo  # noqa: E402
from tfremat.plan.registry import parse_graph_budget  # noqa: E402
from tfremat.plan.schedule import schedule_from_keep_matrix  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak, simulate  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "offload_speed.md"


def former_pofo_ap(graph, budget, bandwidth):
    """pofo_ap as it was: one DP per share of :data:`~tfremat.plan.offload.POFO_LIMITS`,
    each in 50 slots of its own limit."""
    mapped = rotor.graph_chain(graph, True)
    memory_slots = offload.POFO_SLOTS
    loss_stage = _forward_phase_end(graph)
    activations = budget - graph.fixed_bytes

    def schedule_of(ops):
        S = rotor.sequence_keep_matrix(graph, mapped, [op for op in ops if op.kind not in ("O", "P")])
        schedule = schedule_from_keep_matrix(graph, S, "pofo_ap")
        for op in ops:
            if op.kind == "O" and op.stage >= 2:
                for node in mapped.forward_units[op.stage - 2]:
                    moved = offload.offload_gap(graph, schedule, node, loss_stage)
                    if moved is not None:
                        schedule = offload._offloaded(graph, schedule, moved, "pofo_ap", bandwidth, settled=False)
        return schedule

    def candidates() -> Iterator:
        for share in offload.POFO_LIMITS:
            solution = solve_pofo(mapped.chain, share * activations, bandwidth, memory_slots)
            if solution is not None:
                yield from offload.capper(graph, schedule_of(solution.ops), budget, bandwidth, "pofo_ap")
        recompute_only = offload._base_schedule(graph, rotor.rotor_ap, budget)
        if recompute_only is not None:
            yield recompute_only.with_facts(None, "pofo_ap")

    return cheapest_fitting(graph, candidates(), budget, "pofo_ap")


def former_autocapper(graph, budget, bandwidth, limits=offload.AUTOCAPPER_LIMITS):
    """autocapper as it was: the ``rotor`` strategy (DP and search) at every limit."""
    import numpy as np

    def candidates() -> Iterator:
        high = checkpoint_all_peak(graph)
        started = set()
        for limit in np.unique(np.linspace(budget, max(high, budget), limits).astype(np.int64)):
            if time_is_up():
                return
            try:
                start = rotor.rotor(graph, int(limit))
            except InfeasibleBudgetError:
                continue
            if start.S.tobytes() in started:
                continue
            started.add(start.S.tobytes())
            yield from offload.capper(graph, start.with_facts(None, "autocapper"), budget, bandwidth, "autocapper")

    return cheapest_fitting(graph, candidates(), budget, "autocapper")


def run(solve, graph, budget) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        schedule = solve()
    except InfeasibleBudgetError:
        return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "overhead": None}
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    result = simulate(graph, schedule)
    return {"cpu": cpu, "wall": wall, "overhead": result.makespan / graph.total_cost - 1,
            "fits": result.peak_bytes <= budget}


def cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["overhead"] is None:
        return f"none fits, {row['cpu']:.1f} s"
    return f"{100 * row['overhead']:+.2f}%{'' if row['fits'] else ' (over!)'}, {row['cpu']:.1f} s"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("pofo_ap", "autocapper"), default="pofo_ap")
    parser.add_argument("--graph", default=None, help="graph label (default MobileNet for pofo_ap, ResNet50 for "
                        "autocapper)")
    parser.add_argument("--budgets", default=",".join(BUDGETS))
    parser.add_argument("--former-budgets", default=None, help="budgets at which the former path runs too "
                        "(default: all of --budgets)")
    parser.add_argument("--link", choices=("slow", "fast"), default="slow")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown to append to (e.g. {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    label = args.graph or ("MobileNet" if args.strategy == "pofo_ap" else "ResNet50")
    (_, graph), = load_graphs(DEFAULT_GRAPHS, [label])
    bandwidth = link_bandwidth(graph, LINKS[f"{args.link} link"])
    budgets = args.budgets.split(",")
    former_at = set(budgets if args.former_budgets is None else args.former_budgets.split(","))
    reference = checkpoint_all_peak(graph)
    new = getattr(offload, args.strategy)
    former = former_pofo_ap if args.strategy == "pofo_ap" else former_autocapper
    extra = {"limits": offload.AUTOCAPPER_LIMITS} if args.strategy == "autocapper" else {}
    lines = [f"## {args.strategy} on {label}, {args.link} link\n", header(argv) + "\n",
             "| budget | now: overhead, CPU s | former: overhead, CPU s |", "| --- | --- | --- |"]
    totals = {"now": 0.0, "former": 0.0}
    for share in budgets:
        budget = parse_graph_budget(graph, share, reference)
        now = run(lambda: new(graph, budget, bandwidth=bandwidth, **extra), graph, budget)
        totals["now"] += now["cpu"]
        then = None
        if share in former_at:
            then = run(lambda: former(graph, budget, bandwidth), graph, budget)
            totals["former"] += then["cpu"]
        lines.append(f"| {share} | {cell(now)} | {cell(then)} |")
        print(lines[-1], flush=True)
    lines.append(f"\nCPU seconds in all: now {totals['now']:.1f}, former {totals['former']:.1f} "
                 f"(former at {len(former_at & set(budgets))} of {len(budgets)} budgets).\n")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(text + "\n")
    return 0 if math.isfinite(totals["now"]) else 1


if __name__ == "__main__":
    sys.exit(main())
