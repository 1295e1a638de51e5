"""Planning a saved large graph at several budgets with ``optimal`` (issue 33: "min" on NASNetMobile's
1,541 nodes ran past 20 minutes, silently): seconds per budget, the "min" search's share of them, the
eviction runs and simulations inside, the load, and what the plan gives.

Run: ``python benchmarks/min_large_graph.py [--graph tests/data/nasnet_mobile_64x64_batch4.json]
[--budgets 'min,60%,50% of activations']`` (TensorFlow-free; one process, no schedule cache; the
progress lines go to stderr). Results: benchmarks/results/min_large_graph.md.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

# The functions whose cumulative seconds the table shows, by (module path end, name).
_PARTS = {"search": ("strategies.py", "least_budget_within"), "eviction runs": ("eviction.py", "eviction_keep_matrix"),
          "simulations": ("simulator.py", "simulate"), "optimal": ("milp.py", "solve_optimal")}


def _parts(profile: cProfile.Profile) -> dict[str, tuple[int, float]]:
    """Calls and cumulative seconds of each of :data:`_PARTS` in ``profile``."""
    found = {}
    for (path, _, name), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items():
        for part, (ending, wanted) in _PARTS.items():
            if name == wanted and path.endswith(ending):
                found[part] = (calls, cumulative)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--graph", default=os.path.join(ROOT, "tests", "data", "nasnet_mobile_64x64_batch4.json"))
    parser.add_argument("--budgets", default="min,60%,50% of activations")
    args = parser.parse_args()
    from tfremat.errors import TfrematError
    from tfremat.graph import load_graph
    from tfremat.planner import plan_graph

    graph = load_graph(args.graph)
    print(f"{graph.name}: {graph.size} nodes, {len(graph.forward_articulation_points)} forward articulation points")
    print("| budget | seconds | load at start | search (s) | eviction runs (calls, s) | simulations (calls, s) "
          "| optimal (s) | result |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for budget in args.budgets.split(","):
        load = os.getloadavg()[0]
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        try:
            result = plan_graph(graph, budget, "optimal", cache=False, verbose=1)
            outcome = (f"{result.budget_bytes} B budget, peak {result.predicted_peak_bytes} B, "
                       f"{100 * result.overhead:+.1f}%, {result.facts.status if result.facts else 'feasible'}")
        except TfrematError as error:
            outcome = f"{type(error).__name__}: {str(error)[:120]}"
        profile.disable()
        seconds = time.perf_counter() - started
        parts = _parts(profile)

        def shown(part: str, with_calls: bool = False) -> str:
            if part not in parts:
                return ""
            calls, cumulative = parts[part]
            return f"{calls}, {cumulative:.1f}" if with_calls else f"{cumulative:.1f}"

        print(f"| {budget} | {seconds:.1f} | {load:.1f} | {shown('search')} | {shown('eviction runs', True)} "
              f"| {shown('simulations', True)} | {shown('optimal')} | {outcome} |", flush=True)


if __name__ == "__main__":
    main()
