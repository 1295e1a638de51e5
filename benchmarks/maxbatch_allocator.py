"""The batch ``tfremat.max_batch_size`` answers, trained: is ``fit`` at it held within the budget?

Runs ``tfremat.max_batch_size(model, budget)`` (the default ``scaled`` search with ``optimal``)
with ``allocator_check=False`` (the answer held for the bytes its step requests, the behaviour
before session 31) and with the default ``allocator_check=True`` (the answer's step run and held
on the allocator as ``fit`` holds it, stepping down until one holds), in turns, each in a fresh
process with a fresh profile and schedule cache. Then ``model.fit`` with
:class:`tfremat.keras.RematCallback` trains a few steps at the answer's batch under the same
budget (the same cache, so it finds the search's profiles and plans): whether its allocator
check holds the budget or refuses it, the peak it held and the overhead of the plan it trains.
Memory does not depend on the machine's load; the search's seconds do (load recorded).

Run: ``python benchmarks/maxbatch_allocator.py`` (writes
``benchmarks/results/maxbatch_allocator.md``; ``--rounds 2`` for two turns of each).
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
import numpy as np
import tfremat
from tfremat.applications import build_application
from tfremat.errors import InfeasibleBudgetError
from tfremat.keras import RematCallback
from tfremat.maxbatch import one_extra_forward_cap
model = build_application({model!r}, {shape!r}, num_classes=10)
model.compile(optimizer="sgd", loss="categorical_crossentropy")
load, started = os.getloadavg()[0], time.perf_counter()
result = tfremat.max_batch_size(model, {budget!r}, allocator_check={check}, verbose=0)["optimal"]
searched = time.perf_counter() - started
row = {{"batch": result.batch_size, "built": list(result.built), "search_s": searched, "load": load,
        "load_after": os.getloadavg()[0], "allocator_peak": result.allocator_peak,
        "tried": [[b, ok] for b, ok in result.allocator_tried.items()],
        "cost_ratio": result.cost / result.graph.total_cost,
        "cap_ratio": result.cost_cap / result.graph.total_cost}}
rng = np.random.default_rng(0)
batch = result.batch_size
x = rng.standard_normal((3 * batch, *{shape!r})).astype("float32")
y = np.eye(10, dtype="float32")[rng.integers(0, 10, 3 * batch)]
remat = RematCallback({budget!r}, verbose=0)
try:
    model.fit(x, y, batch_size=batch, epochs=1, callbacks=[remat], verbose=0)
    (key, plan), = remat.plans.items()
    row.update(fit="trained", fit_held=remat.allocator_peaks.get(key), fit_predicted=plan.predicted_peak_bytes,
               fit_cost_ratio=plan.schedule.cost(plan.graph) / plan.graph.total_cost,
               fit_cap_ratio=one_extra_forward_cap(plan.graph) / plan.graph.total_cost)
except InfeasibleBudgetError as error:
    row.update(fit="refused", fit_error=str(error).splitlines()[0][:300])
print(json.dumps(row))
"""


def _run(args, check: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        code = _RUN.format(root=ROOT, model=args.model, shape=tuple(args.input_shape), budget=args.budget, check=check)
        env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"run failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"allocator_check": check, **row}), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--input_shape", default="32,32,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--budget", default="64MB")
    parser.add_argument("--rounds", type=int, default=1, help="turns of (without the check, with it)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxbatch_allocator.md"))
    args = parser.parse_args(argv)
    rows = [(check, _run(args, check)) for _ in range(args.rounds) for check in (False, True)]
    mb = lambda n: "-" if n is None else f"{n / 1e6:.1f}"  # noqa: E731
    lines = [
        "## Session 31 (M): the answer held on the allocator", "", header(argv), "",
        f"{args.model} at {','.join(map(str, args.input_shape))}, budget {args.budget} "
        f"({mb(parse_budget(args.budget))} MB), `optimal`, the default overhead cap, in turns, each in a fresh process "
        "and cache. `fit`: `model.fit` with `RematCallback` at the answer's batch and the budget, 3 steps.",
        "",
        "| allocator_check | answer | batches run on the allocator | graphs built | search s | load before / after | "
        "answer's held peak MB | answer's cost / cap | fit | fit: held peak MB / predicted MB | fit: cost / cap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for check, row in rows:
        tried = ", ".join(f"{b}{'' if ok else ' (over)'}" for b, ok in row["tried"]) or "-"
        fit_costs = (f"{row['fit_cost_ratio']:.3f} / {row['fit_cap_ratio']:.3f}" if row["fit"] == "trained" else "-")
        fit_peaks = (f"{mb(row['fit_held'])} / {mb(row['fit_predicted'])}" if row["fit"] == "trained" else "-")
        fit = row["fit"] if row["fit"] == "trained" else f"refused: {row['fit_error']}"
        lines.append(
            f"| {check} | {row['batch']} | {tried} | {', '.join(map(str, row['built']))} | {row['search_s']:.0f} | "
            f"{row['load']:.1f} / {row['load_after']:.1f} | {mb(row['allocator_peak'])} | "
            f"{row['cost_ratio']:.3f} / {row['cap_ratio']:.3f} | {fit} | {fit_peaks} | {fit_costs} |")
    with open(args.out, "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
