"""The offloading columns of benchmarks/chains.py alone (pofo_ap and autocapper, both links) on
a few graphs, as chains.py computes them (same budgets, links and per-case deadline), without
its MILP and recompute-only columns: a quick re-check of those cells after a change to the
offloading strategies, for merging into results/chains.md.

Usage: python benchmarks/offload_cells.py [--only REGEX] [--strategies pofo_ap,autocapper] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chains import BUDGETS, DEFAULT_GRAPHS, OFFLOADING, SYNTHETIC, graph_table, load_graphs, sweep  # noqa: E402
from checkmate_graphs import graph_label  # noqa: E402
from provenance import header  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="VGG16|vgg_chain|residual_chain|ResNet50",
                        help="regular expression a graph label must match in full")
    parser.add_argument("--strategies", default="pofo_ap,autocapper")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    wanted = args.strategies.split(",")
    columns = [c for c in OFFLOADING if c.strategy in wanted]
    labels = list(SYNTHETIC) + sorted(graph_label(p) for p in DEFAULT_GRAPHS.glob("*_train.json"))
    labels = [label for label in labels if re.fullmatch(args.only, label)]
    lines = [header(argv) + "\n", f"Load average (1 min) at the start: {os.getloadavg()[0]:.1f}.\n"]
    for label, graph in load_graphs(DEFAULT_GRAPHS, labels):
        result = sweep(label, graph, columns, BUDGETS)
        lines += [f"## {label}\n", graph_table(result, [c.label for c in columns]) + "\n"]
        print("\n".join(lines[-2:]), flush=True)
    lines.append(f"Load average (1 min) at the end: {os.getloadavg()[0]:.1f}.\n")
    if args.out is not None:
        args.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
