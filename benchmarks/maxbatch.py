"""Batch-size search on a Keras model: profiling every batch tried against scaling few.

``tfremat.max_batch_size`` with ``method="search"`` extracts (profiles) the model's graph at
every batch size the doubling-then-bisection tries; ``method="scaled"`` profiles
``min_batch`` and the answers of a search on graphs scaled from few built ones
(:func:`tfremat.maxbatch._scaled`). ``scaled+sizes`` is ``scaled`` whose other graphs come
from an extraction that measures nothing (``cost_model="flops"``: shapes only, the
``sizes_for_batch`` argument of :func:`tfremat.maxbatch.max_batch_size`), wired here as
``tfremat.max_batch_size`` builds its graphs. Each method runs in its own process with its
own empty cache directory, one after the other; the table gives the answer, the wall and CPU
seconds and the batches profiled. Profiled costs vary between runs, so near the boundary a
batch can fit in one run and not in the other.

Run: ``python benchmarks/maxbatch.py [--methods search,scaled,scaled+sizes]`` (writes
``benchmarks/results/maxbatch.md``).
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
started, cpu = time.perf_counter(), time.process_time()
if {method!r} == "scaled+sizes":
    from tfremat.extract.extractor import extract
    from tfremat.maxbatch import max_batch_size
    from tfremat.model_planning import loss_and_optimizer, synthetic_batch
    from tfremat.planner import BatchProgress, strategy_options
    training = loss_and_optimizer(model, None, None)

    def builder(cost_model):
        def graph_for_batch(batch):
            sample = synthetic_batch(model, batch, loss=training["loss"])
            return extract(model, sample_batch=sample, cost_model=cost_model, **training).graph
        return graph_for_batch

    result = max_batch_size(builder("profile"), {budget!r}, strategy={strategy!r},
                            max_batch=4096, method="scaled", sizes_for_batch=builder("flops"),
                            batch_progress=BatchProgress("tfremat max_batch_size " + {strategy!r}),
                            **strategy_options({strategy!r}))
else:
    result = tfremat.max_batch_size(model, {budget!r}, strategies=[{strategy!r}], method={method!r},
                                    verbose=1)[{strategy!r}]
print(json.dumps({{"batch": result.batch_size, "seconds": time.perf_counter() - started,
                  "cpu": time.process_time() - cpu, "cost_ratio": result.cost / result.graph.total_cost,
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
    parser.add_argument("--methods", default="search,scaled,scaled+sizes")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxbatch.md"))
    args = parser.parse_args(argv)
    rows = {}
    for method in args.methods.split(","):
        rows[method] = run(method, args)
        print(method, rows[method], flush=True)
    shape = ",".join(map(str, args.input_shape))
    lines = [
        "# Batch-size search: every batch profiled, or few scaled", "", header(argv), "",
        f"{args.model} at {shape}, budget {args.budget}, strategy {args.strategy}, the default overhead cap "
        "(one extra forward pass), 60 s per solve, cold caches.", "",
        "| method | largest batch | its cost / no-remat cost | wall s | CPU s | batches profiled | profiled |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, row in rows.items():
        lines.append(f"| {method} | {row['batch']} | {row['cost_ratio']:.3f} | {row['seconds']:.0f} | "
                     f"{row['cpu']:.0f} | {len(row['extracted'])} | {', '.join(map(str, row['extracted']))} |")
    lines += ["", f"Load average when it ended: {os.getloadavg()[0]:.1f} (wall seconds on a shared machine are noisy)."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
