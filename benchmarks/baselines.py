"""Baseline strategies on the Checkmate benchmark graphs: peak and cost relative to checkpoint all.

Usage: python benchmarks/baselines.py [--graphs DIR] [--out benchmarks/results/baselines.md]

For every ``*_train.json`` in the shared graph folder, runs each baseline without a budget
(its memory-saving default), simulates it, and writes a markdown table of peak bytes and
compute cost as ratios of checkpoint all, plus the time to simulate one schedule.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from tfremat.graph import load_graph
from tfremat.plan import simulate
from tfremat.plan.registry import get_strategy, strategy_names

DEFAULT_GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"
BASELINES = [
    "checkpoint_all", "checkpoint_all_ap", "chen_sqrtn", "chen_sqrtn_ap", "chen_greedy",
    "chen_greedy_ap", "griewank_logn", "griewank_logn_ap", "hong",
]


def graph_label(path: Path) -> str:
    """``ResNet50_256_224_224_3_train.json`` -> ``ResNet50``."""
    return re.sub(r"(_\d+)+_train$", "", path.stem)


def baseline_table(graph_paths: list[Path]) -> str:
    """A markdown table: one row per graph, one 'peak / cost' cell per strategy."""
    missing = set(BASELINES) - set(strategy_names())
    if missing:
        raise SystemExit(f"strategies missing from the registry: {sorted(missing)}")
    header = "| graph (nodes) | " + " | ".join(BASELINES) + " | simulate ms |"
    lines = [header, "|" + " --- |" * (len(BASELINES) + 2)]
    for path in graph_paths:
        graph = load_graph(path)
        reference = simulate(graph, get_strategy("checkpoint_all")(graph))
        cells = []
        slowest = 0.0
        for name in BASELINES:
            schedule = get_strategy(name)(graph)
            started = time.perf_counter()
            result = simulate(graph, schedule)
            slowest = max(slowest, time.perf_counter() - started)
            cells.append(f"{result.peak_bytes / reference.peak_bytes:.2f} / {result.cost / reference.cost:.2f}")
        lines.append(f"| {graph_label(path)} ({graph.size}) | " + " | ".join(cells) + f" | {slowest * 1000:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=Path, default=DEFAULT_GRAPHS, help="folder with *_train.json graphs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "baselines.md")
    parser.add_argument("--only", default=None, help="substring: benchmark only matching graph files")
    args = parser.parse_args(argv)
    paths = sorted(p for p in args.graphs.glob("*_train.json") if args.only is None or args.only in p.name)
    if not paths:
        sys.stderr.write(f"no *_train.json graphs in {args.graphs}\n")
        return 2
    table = baseline_table(paths)
    text = (
        "Each cell: peak memory / compute cost, both as a ratio of checkpoint all (no budget: "
        "each strategy's default).\nProduced by `python benchmarks/baselines.py`.\n\n" + table + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
