"""The tfremat demo (`make demo`): plan a benchmark graph with every baseline and print the table.

Later stages extend it into the end-to-end job (extract a Keras model, plan, train, measure).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from baselines import DEFAULT_GRAPHS, baseline_table  # noqa: E402


def main() -> int:
    graph = DEFAULT_GRAPHS / "VGG16_256_224_224_3_train.json"
    if not graph.exists():
        sys.stderr.write(f"demo needs the shared benchmark graphs at {DEFAULT_GRAPHS}\n")
        return 2
    print("Peak memory / compute cost of each baseline, relative to checkpoint all:\n")
    print(baseline_table([graph]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
