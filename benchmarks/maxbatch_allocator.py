"""The batch ``tfremat.max_batch_size`` answers, trained: does its step stay under the budget?

Runs ``tfremat.max_batch_size(model, budget)`` (the default ``scaled`` search with ``optimal``,
its answer certified on a graph built at it) and then ``tfremat.measure.measure_model`` at the
answer's batch under the same budget: the step as compiled, the bytes its operations request
(what the plan bounds) and the TensorFlow allocator's peak (which can exceed them by whole
chunks, docs/memory-model.md). Memory does not depend on the machine's load; the step's time
against plain Keras does (load recorded). One fresh profile cache for both, so the step is
planned on the graph that certified the answer.

Run: ``python benchmarks/maxbatch_allocator.py`` (writes
``benchmarks/results/maxbatch_allocator.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from provenance import header  # noqa: E402
from tfremat.budget import parse_budget  # noqa: E402

_RUN = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import tfremat
from tfremat.applications import build_application
from tfremat.measure import measure_model
from tfremat.plan.simulator import simulate
model = build_application({model!r}, {shape!r}, num_classes=10)
model.compile(optimizer="sgd", loss="categorical_crossentropy")
load, started = os.getloadavg()[0], time.perf_counter()
result = tfremat.max_batch_size(model, {budget!r}, verbose=0)["optimal"]
searched = time.perf_counter() - started
row = measure_model(model, {budget!r}, batch_size=result.batch_size, strategy="optimal", steps={steps}, verbose=0)
print(json.dumps({{"batch": result.batch_size, "built": list(result.built), "search_s": searched, "load": load,
                  "load_after": os.getloadavg()[0],
                  "answer_peak": simulate(result.graph, result.schedule).peak_bytes,
                  **{{k: row[k] for k in ("predicted_peak_bytes", "requested_peak_bytes", "measured_peak_bytes",
                                          "plain_peak_bytes", "time_over_plain", "gradients_match", "grad_error",
                                          "grad_global_error")}}}}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--input_shape", default="32,32,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--budget", default="64MB")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds of measure_model")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxbatch_allocator.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        code = _RUN.format(root=ROOT, model=args.model, shape=tuple(args.input_shape), budget=args.budget,
                           steps=args.steps)
        env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(row))
    mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
    lines = [
        "# The answer of the batch-size search, trained", "", header(argv), "",
        f"{args.model} at {','.join(map(str, args.input_shape))}, budget {args.budget} "
        f"({mb(parse_budget(args.budget))} MB), `optimal`, the default "
        "overhead cap. `measure_model` plans the answer's batch under the same budget (the same profile) and runs it.",
        "",
        "| answer | graphs built | search s | load before / after | answer's schedule, built graph MB | "
        "step: predicted / requested / allocator MB | plain step allocator MB | time / plain | "
        "gradients match (largest per-variable / global error) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {row['batch']} | {', '.join(map(str, row['built']))} | {row['search_s']:.0f} | {row['load']:.1f} / "
        f"{row['load_after']:.1f} | {mb(row['answer_peak'])} | {mb(row['predicted_peak_bytes'])} / "
        f"{mb(row['requested_peak_bytes'])} / {mb(row['measured_peak_bytes'])} | {mb(row['plain_peak_bytes'])} | "
        f"{row['time_over_plain']:.2f} | {row['gradients_match']} ({row['grad_error']:.2g} / "
        f"{row['grad_global_error']:.2g}) |",
    ]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
