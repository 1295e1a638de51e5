"""Batch-size search on a Keras model: extracting every batch tried against scaling two.

``tfremat.max_batch_size`` with ``method="search"`` extracts (profiles) the model's graph at
every batch size the doubling-then-bisection tries; ``method="scaled"`` extracts two, searches
on graphs scaled from them and extracts only the batches around the answer; ``"quick"``
extracts batches 2 and 4 and the answer, judging the batches above it on graphs scaled through
the answer's. Each method runs in its own process with its own empty cache directory, one
after the other, and the table gives the answer, the wall and CPU time (the process's, solver
threads included), the load average before the run and the batches extracted. Profiled costs
vary between runs, so near the boundary a batch can fit in one run and not in the other.

Run: ``python benchmarks/maxbatch.py`` (writes ``benchmarks/results/maxbatch.md``);
``--methods scaled,quick --out benchmarks/results/maxbatch_quick.md`` for the two fast ones.
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

# One run of one method, in a fresh process (its own profile cache, no warm state).
_RUN = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import tfremat
from tfremat.applications import build_application
model = build_application({model!r}, {shape!r}, num_classes=10)
model.compile(optimizer="sgd", loss="categorical_crossentropy")
load = os.getloadavg()[0]
started, cpu = time.perf_counter(), time.process_time()
result = tfremat.max_batch_size(model, {budget!r}, strategies=[{strategy!r}], method={method!r}, verbose=1)[{strategy!r}]
print(json.dumps({{"batch": result.batch_size, "seconds": time.perf_counter() - started,
                  "cpu": time.process_time() - cpu, "load": load,
                  "extracted": sorted(result.tried), "fits": [b for b, ok in sorted(result.tried.items()) if ok]}}))
"""


def run(method: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        code = _RUN.format(root=ROOT, model=args.model, shape=tuple(args.input_shape), budget=args.budget,
                           strategy=args.strategy, method=method)
        env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--input_shape", default="64,64,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--budget", default="400MB")
    parser.add_argument("--strategy", default="optimal")
    parser.add_argument("--methods", default="search,scaled,quick", type=lambda s: s.split(","))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxbatch.md"))
    args = parser.parse_args(argv)
    rows = {method: run(method, args) for method in args.methods}
    shape = ",".join(map(str, args.input_shape))
    lines = [
        "# Batch-size search: every batch extracted, or two scaled", "", header(argv), "",
        f"{args.model} at {shape}, budget {args.budget}, strategy {args.strategy}, the default overhead cap "
        "(one extra forward pass), 60 s per solve, cold caches.", "",
        "| method | largest batch | wall s | CPU s | load before | batches extracted | extracted |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in rows.items():
        lines.append(f"| {method} | {row['batch']} | {row['seconds']:.0f} | {row['cpu']:.0f} | {row['load']:.1f} | "
                     f"{len(row['extracted'])} | {', '.join(map(str, row['extracted']))} |")
    first = next(iter(rows))
    lines += [""] + [f"{method} / {first} wall time: {row['seconds'] / rows[first]['seconds']:.2f}."
                     for method, row in rows.items() if method != first]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
