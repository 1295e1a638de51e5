"""Adversarial check of the backward workspace measured with the upstream gradient dying
(``CallAnalysis.dying_backward_workspace``, used where ``assembly.sole_upstream`` says the
backward node is its upstream's only reader): small models where that could be wrong.

Each model is profiled once and assembled twice, "held" (``sole_upstream`` answering no call)
and "dying" (as tfremat does); each plan (checkpoint-all, ``chen_sqrtn``, ``eviction`` at ``"min"``)
is compiled and its requested peak (``measure_step_peak(..., count="requested")``) and least
statement margin (``requested_ledger``: the least ``predicted - requested`` over the step's
statements, and over the backward statements of the calls that take the dying workspace)
compared with the simulator's. Memory only: the load does not matter.

    .venv/bin/python benchmarks/dying_upstream_guard.py                       # one inter-op thread
    TF_NUM_INTEROP_THREADS=0 .venv/bin/python benchmarks/dying_upstream_guard.py   # TF's default
    TF_ENABLE_ONEDNN_OPTS=0 .venv/bin/python benchmarks/dying_upstream_guard.py

``--models a,b`` runs some of them. Results: benchmarks/results/dying_upstream_guard.md.
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
if os.environ["TF_NUM_INTEROP_THREADS"] == "0":
    del os.environ["TF_NUM_INTEROP_THREADS"]  # TensorFlow's default: one per core
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFREMAT_CACHE_DIR", tempfile.mkdtemp(prefix="tfremat_dying_guard_"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfremat.extract import assembly  # noqa: E402
from tfremat.measure import requested_ledger  # noqa: E402
from test_dying_upstream_guard import MODELS, run_case  # noqa: E402

MIB = 2.0 ** 20
SOLE = assembly.sole_upstream


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--held", action="store_true", help="also assemble with the held workspace")
    args = parser.parse_args()
    onednn = "off" if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" else "on"
    threads = os.environ.get("TF_NUM_INTEROP_THREADS", "default")
    print("| model | strategy | workspace | threads | oneDNN | sole readers | predicted MiB | requested MiB "
          "| requested/predicted | least statement margin (B) | least sole-backward margin (B) |")
    print("|---|---|---|---|---|---|--:|--:|--:|--:|--:|")
    for name in args.models.split(","):
        for mode in (("held", "dying") if args.held else ("dying",)):
            assembly.sole_upstream = SOLE if mode == "dying" else (lambda *a, **k: set())
            for row in run_case(name, ledger=requested_ledger):
                print(f"| {name} | {row['strategy']} | {mode} | {threads} | {onednn} | {','.join(row['sole']) or '-'} "
                      f"| {row['predicted'] / MIB:.3f} | {row['requested'] / MIB:.3f} "
                      f"| {row['requested'] / row['predicted']:.3f} | {row['margin']:+,d} | {row['sole_margin']:+,d} |",
                      flush=True)
    assembly.sole_upstream = SOLE


if __name__ == "__main__":
    keras.config.disable_interactive_logging()
    main()
