"""The Checkmate benchmark graphs as the graph benchmarks take them: the shared folder,
short labels, and the ``--graphs`` / ``--only`` / ``--out`` options they share."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GRAPHS = ROOT.parent / "shared" / "graphs"


def graph_label(path: Path) -> str:
    """``ResNet50_256_224_224_3_train.json`` -> ``ResNet50``."""
    return re.sub(r"(_\d+)+_train$", "", path.stem)


def add_graph_options(parser: argparse.ArgumentParser, default_out: Path) -> None:
    """``--graphs``, ``--out`` and ``--only``, as :func:`selected_graphs` reads them."""
    parser.add_argument("--graphs", type=Path, default=DEFAULT_GRAPHS, help="folder with *_train.json graphs")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown file to write (default {default_out}; "
                        "required with --only, so a partial run does not replace the full table)")
    parser.add_argument("--only", default=None, help="regular expression a graph file's stem must match in full "
                        "(e.g. ResNet50_256_224_224_3_train or 'VGG.*')")


def selected_graphs(parser: argparse.ArgumentParser, args: argparse.Namespace, default_out: Path) -> list[Path]:
    """The graph files the options select, sorted (empty when none matches); sets
    ``args.out`` to its default when the run covers every graph, and stops the parser when
    ``--only`` comes without ``--out``."""
    if args.only is not None and args.out is None:
        parser.error(f"--only benchmarks some graphs only; give --out (the default {default_out} holds every graph)")
    args.out = args.out or default_out
    return sorted(p for p in args.graphs.glob("*_train.json") if args.only is None or re.fullmatch(args.only, p.stem))


def write_results(out: Path, text: str) -> None:
    """Writes a results file (its folder made if missing) and prints it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
