"""Batch-size search on a Keras model: how long ``tfremat.max_batch_size`` takes and what it answers.

Each run is ``tfremat.max_batch_size(model, budget, strategies=[strategy], method=M)`` in a fresh
process, timed from the call (wall and process CPU seconds, solver threads included), with the
time spent building graphs (``extract``) and every batch the search judged, in order, with its
verdict, whether it was judged on a built graph or a scaled one, and the second it was settled;
the line's answer (before it is certified on a graph built at it) and the seconds the
certification took are read from the log. A run ``scaled:S`` is the careful reference: the same
search whose MILP probes (and time limit) get S seconds and HiGHS's default gap (1e-4), not
the cap's. Runs share one profile cache
directory (fresh unless ``--cache`` names one), so a later run reads the graphs the first one
profiled: the runs then differ in the search alone. The machine's load average is recorded
before and after each run.

Run: ``python benchmarks/maxbatch.py`` (the default ``scaled``, writes
``benchmarks/results/maxbatch.md``); ``--runs scaled,scaled:900`` adds the reference whose
probes get 900 s; ``--runs search`` builds every batch tried; ``--check`` profiles the answer's
batch again, cache off (a second profile of the graph that certified it), and runs the answer's
schedule on it.
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

# One run in a fresh process: extraction timed by wrapping it, judged batches read from the log.
_RUN = """
import json, logging, os, sys, time
sys.path.insert(0, {root!r})
import tfremat
import tfremat.extract.extractor as extractor
from tfremat.applications import build_application
model = build_application({model!r}, {shape!r}, num_classes=10)
model.compile(optimizer="sgd", loss="categorical_crossentropy")
built, judged, real = [], [], extractor.extract
def timed(*args, **kwargs):
    began = time.perf_counter()
    out = real(*args, **kwargs)
    built.append((int(kwargs["sample_batch"][0].shape[0]), time.perf_counter() - began))
    return out
extractor.extract = timed
line = {{}}
class Judged(logging.Handler):
    def emit(self, record):
        now = round(time.perf_counter() - started, 1)
        if record.msg == "batch %d: %s":
            on_built = record.args[0] in {{b for b, _ in built}}
            how = "L" if record.args[1].startswith("fits (the line's schedule") else ""
            judged.append((record.args[0], record.args[1].startswith("fits"), now, ("B" if on_built else "") + how))
        elif record.msg.startswith("batch %d fits on graphs scaled"):
            line.update(batch=record.args[0], at=now)
logging.getLogger("tfremat.maxbatch").addHandler(Judged())
logging.getLogger("tfremat.maxbatch").setLevel(logging.INFO)
options = {options!r}
if {probe!r} is not None:
    import tfremat.maxbatch
    tfremat.maxbatch._PROBE_SECONDS = {probe!r}  # tfremat.max_batch_size passes no probe_seconds
load = os.getloadavg()[0]
started, cpu = time.perf_counter(), time.process_time()
result = tfremat.max_batch_size(model, {budget!r}, strategies=[{strategy!r}], method={method!r}, verbose=0,
                                **options)[{strategy!r}]
out = {{"batch": result.batch_size, "seconds": time.perf_counter() - started,
       "cpu": time.process_time() - cpu, "load": load, "load_after": os.getloadavg()[0],
       "built": built, "judged": judged, "cost": result.cost / result.graph.total_cost,
       "cap": result.cost_cap / result.graph.total_cost, "line": line, "result_built": list(result.built)}}
if {check!r}:
    # The answer's schedule on a second profile of the answer's batch (after the timed search).
    from tfremat.maxbatch import one_extra_forward_cap
    from tfremat.model_planning import loss_and_optimizer, synthetic_batch
    from tfremat.plan.simulator import simulate
    training = loss_and_optimizer(model, None, None)
    graph = real(model, sample_batch=synthetic_batch(model, result.batch_size, loss=training["loss"]),
                 cost_model="profile", granularity="sublayer", use_cache=False, **training).graph
    out["check"] = {{"peak": simulate(graph, result.schedule).peak_bytes, "cost": result.schedule.cost(graph) /
                    graph.total_cost, "cap": one_extra_forward_cap(graph) / graph.total_cost}}
print(json.dumps(out))
"""


def run(spec: str, args, cache: str) -> dict:
    """``spec``: a method, or ``scaled:S`` for probes (and the time limit) of S seconds."""
    method, _, seconds = spec.partition(":")
    options = {"time_limit": float(seconds), "mip_gap": 1e-4} if seconds else {}
    probe = float(seconds) if seconds else args.probe_seconds
    code = _RUN.format(root=ROOT, model=args.model, shape=tuple(args.input_shape), budget=args.budget,
                       strategy=args.strategy, method=method, options=options, probe=probe,
                       check=args.check)
    env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--input_shape", default="64,64,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--budget", default="400MB")
    parser.add_argument("--strategy", default="optimal")
    parser.add_argument("--runs", default="scaled", type=lambda s: s.split(","),
                        help="methods to run in turn; scaled:S is scaled with S-second probes and time limit")
    parser.add_argument("--probe_seconds", type=float, default=None, help="probe seconds of plain scaled runs")
    parser.add_argument("--check", action="store_true",
                        help="after each run, profile the answer's batch again (cache off) and run the answer's schedule on it")
    parser.add_argument("--cache", default=None, help="profile cache directory (default: a fresh one)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "maxbatch.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as fresh:
        cache = args.cache or fresh
        rows = []
        for spec in args.runs:
            rows.append((spec, run(spec, args, cache)))
            print(spec, json.dumps(rows[-1][1]), flush=True)
    shape = ",".join(map(str, args.input_shape))
    lines = [
        "# Batch-size search: time and answer", "", header(argv), "",
        f"{args.model} at {shape}, budget {args.budget}, strategy {args.strategy}, the default overhead cap "
        "(one extra forward pass). Runs in turn, sharing one profile cache (the first run profiles cold).", "",
        "| run | line's answer | largest batch (certified) | wall s | CPU s | certifying s | load before / after | "
        "built (batch: s) | cost / cap (built graph) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, row in rows:
        built = ", ".join(f"{b}: {s:.0f}" for b, s in row["built"])
        certifying = row["seconds"] - row["line"]["at"] if row["line"] else 0.0
        lines.append(f"| {spec} | {row['line'].get('batch', '-')} | {row['batch']} | {row['seconds']:.0f} | "
                     f"{row['cpu']:.0f} | {certifying:.0f} | {row['load']:.1f} / {row['load_after']:.1f} | {built} | "
                     f"{row['cost']:.3f} / {row['cap']:.3f} |")
    checked = [(spec, row["check"]) for spec, row in rows if "check" in row]
    if checked:
        lines += ["", "The answer's schedule on a second profile of the answer's batch, cache off (`--check`):", "",
                  "| run | peak MB | cost / cap |", "|---|---|---|"]
        lines += [f"| {spec} | {c['peak'] / 1e6:.1f} | {c['cost']:.3f} / {c['cap']:.3f} |" for spec, c in checked]
    lines += ["", "Batches judged, in order (batch, fits, seconds into the run; B: on a graph built at it, BL: "
              "certified there by the schedule the line found):", ""]
    lines += [f"- {spec}: " + ", ".join(f"{b} {'y' if ok else 'n'}{' ' + mark if mark else ''} {s:g}"
                                         for b, ok, s, mark in row["judged"])
              for spec, row in rows]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
