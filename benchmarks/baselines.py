"""Baseline strategies on the Checkmate benchmark graphs: peak and cost relative to checkpoint all.

Usage: python benchmarks/baselines.py [--graphs DIR] [--only REGEX --out FILE]

For every ``*_train.json`` in the shared graph folder, runs each baseline without a budget
(its memory-saving default), simulates it, and writes a markdown table of peak bytes and
compute cost as ratios of checkpoint all, plus the slowest simulation of one schedule
(default output ``benchmarks/results/baselines.md``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfremat, not an installed one

from checkmate_graphs import (  # noqa: E402
    add_graph_options,
    graph_label,
    selected_graphs,
    write_results,
)
from provenance import header  # noqa: E402

from tfremat.graph import load_graph  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402
from tfremat.strategies import get_strategy, strategy_names  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "baselines.md"
BASELINES = [
    "checkpoint_all", "checkpoint_all_ap", "chen_sqrtn", "chen_sqrtn_ap", "chen_greedy",
    "chen_greedy_ap", "griewank_logn", "griewank_logn_ap", "hong",
]


def baseline_table(graph_paths: list[Path]) -> str:
    """A markdown table: one row per graph, one 'peak / cost' cell per strategy."""
    missing = set(BASELINES) - set(strategy_names())
    if missing:
        raise SystemExit(f"strategies missing from the registry: {sorted(missing)}")
    lines = ["| graph (nodes) | " + " | ".join(BASELINES) + " | simulate ms |", "|" + " --- |" * (len(BASELINES) + 2)]
    for path in graph_paths:
        graph = load_graph(path)
        # Checkpoint all computes every node once: its cost is the graph's no-remat cost.
        reference_peak, reference_cost = checkpoint_all_peak(graph), graph.total_cost
        cells = []
        slowest = 0.0
        for name in BASELINES:
            schedule = get_strategy(name)(graph)
            started = time.perf_counter()
            result = simulate(graph, schedule)
            slowest = max(slowest, time.perf_counter() - started)
            cells.append(f"{result.peak_bytes / reference_peak:.2f} / {result.cost / reference_cost:.2f}")
        lines.append(f"| {graph_label(path)} ({graph.size}) | " + " | ".join(cells) + f" | {slowest * 1000:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_graph_options(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    paths = selected_graphs(parser, args, DEFAULT_OUT)
    if not paths:
        sys.stderr.write(f"no *_train.json graphs{'' if args.only is None else f' matching {args.only!r}'} in {args.graphs}\n")
        return 2
    table = baseline_table(paths)
    text = (
        "# Baselines on the Checkmate graphs\n\n" + header(argv) + "\n\n"
        "Each cell: peak memory / compute cost, both as a ratio of checkpoint all (no budget: each "
        "strategy's default). Simulate ms: the slowest simulation of one of the row's schedules.\n\n"
        + table + "\n"
    )
    write_results(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
