"""Hong et al.'s memory models against the simulator on the Checkmate benchmark graphs.

Usage: python benchmarks/hong.py [--graphs DIR] [--only REGEX --out FILE]

For every ``*_train.json`` in the shared graph folder and both of the paper's memory models
(eager: Alg. 6 on Eqs. 9-12; classic: Alg. 3 on Eq. 6), picks the paper's optimal checkpoint
subset of the linearized forward chain (:func:`tfremat.plan.hong.hong_prediction`), and
reports the peak the model predicts for it, the simulated peak of the same subset, and the
relative error ``|predicted - simulated| / simulated`` (default output
``benchmarks/results/hong.md``). Hong et al. report 2.8% average error of the eager model
against PyTorch (sec. 5.2).
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
from tfremat.plan.baselines import schedule_for_checkpoints  # noqa: E402
from tfremat.plan.hong import MEMORY_MODELS, hong_prediction  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "hong.md"
GIB = 2**30


def prediction_table(graph_paths: list[Path]) -> str:
    """A markdown table: one row per graph and memory model, then the mean error per model."""
    lines = [
        ("| graph (nodes) | chain n | model | checkpoints | predicted GiB | simulated GiB | error | "
         "simulated / checkpoint all | DP ms |"),
        "|" + " --- |" * 9,
    ]
    errors = {model: [] for model in MEMORY_MODELS}
    for path in graph_paths:
        graph = load_graph(path)
        full = checkpoint_all_peak(graph)
        for model in MEMORY_MODELS:
            started = time.perf_counter()
            checkpoints, predicted = hong_prediction(graph, model)
            seconds = time.perf_counter() - started
            simulated = simulate(graph, schedule_for_checkpoints(graph, checkpoints, "hong")).peak_bytes
            error = abs(predicted - simulated) / simulated
            errors[model].append(error)
            lines.append(
                f"| {graph_label(path)} ({graph.size}) | {len(graph.forward_nodes)} | {model} | {len(checkpoints)} | "
                f"{predicted / GIB:.2f} | {simulated / GIB:.2f} | {100 * error:.1f}% | {simulated / full:.2f} | "
                f"{1000 * seconds:.1f} |"
            )
    means = ", ".join(f"{model} {100 * sum(e) / len(e):.1f}%" for model, e in errors.items())
    return "\n".join(lines) + f"\n\nMean error: {means}."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_graph_options(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    paths = selected_graphs(parser, args, DEFAULT_OUT)
    if not paths:
        sys.stderr.write(f"no *_train.json graphs{'' if args.only is None else f' matching {args.only!r}'} in {args.graphs}\n")
        return 2
    table = prediction_table(paths)
    text = (
        "# Hong et al.'s memory models against the simulator\n\n" + header(argv) + "\n\n"
        "Per graph and memory model: the length n of the linearized forward chain, the size of the "
        "paper's optimal checkpoint subset, the peak the model predicts for it (fixed bytes plus Eq. 12 "
        "or Eq. 6), the simulator's peak for the same subset, the relative error |predicted - simulated| "
        "/ simulated, the simulated peak as a share of checkpoint all, and the time of the DP.\n\n"
        + table + "\n"
    )
    write_results(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
