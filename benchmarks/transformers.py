"""Transformers at sublayer granularity: how low their training memory goes, and at what cost.

Models whose peak is mostly activations (issue 22): a keras-hub ``GPT2Backbone``-shaped
decoder and a ``BertBackbone`` encoder (no pretrained weights) with a per-token softmax
head, the keras.io-style text transformer (a custom ``TransformerBlock`` layer holding
MultiHeadAttention) and a ViT, each in its own process with its own profile cache:

* the graph at ``layer`` granularity (a block is one node) and at ``sublayer`` granularity
  (blocks and attention opened, :mod:`tfremat.extract.opening`): nodes, the share of the
  checkpoint-all peak that is activations, and the smallest feasible budget (the least peak
  a heuristic reaches, :func:`tfremat.strategies.least_peak`) as a share of that peak;
* at each budget share: ``optimal`` (HiGHS, ``--time_limit``) planning seconds, its status
  and gap, the predicted overhead, then the compiled step measured against plain Keras
  training in the same process (:func:`tfremat.measure_model`): requested and allocator
  peaks against the budget, step time against the plain step's, gradients compared;
* plain training of the same model built under ``keras.RematScope(mode="full")`` (every
  layer call rematerialized through ``tf.recompute_grad``): allocator peak and step time
  against plain training;
* plain training with each block's call wrapped in ``tf.recompute_grad``
  (:mod:`recompute_baseline`): allocator peak, step time and how far its gradients are from
  plain training's.

Run: ``python benchmarks/transformers.py`` (writes ``benchmarks/results/transformers.md``;
needs keras-hub, which ``make test`` installs). Costs are profiled on this machine; its
cores are shared, so compare ratios measured in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from provenance import header  # noqa: E402

MODELS = {
    # name: (builder in conformance.py, keyword arguments, batch size, what it is)
    "gpt2": ("_gpt2_hub", {"seq_len": 512, "layers_count": 12, "hidden": 256, "heads": 4}, 4,
             "keras-hub GPT2Backbone, 12 blocks, hidden 256, 4 heads, 512 tokens"),
    "bert": ("_bert_hub", {"seq_len": 512, "layers_count": 12, "hidden": 256, "heads": 4}, 4,
             "keras-hub BertBackbone, 12 blocks, hidden 256, 4 heads, 512 tokens"),
    "text_transformer": ("_transformer_encoder", {"maxlen": 512, "embed_dim": 128, "num_heads": 4, "ff_dim": 512,
                                                   "blocks": 6}, 8,
                         "keras.io text transformer (custom TransformerBlock), 6 blocks, dim 128, 512 tokens"),
    "vit": ("_vit", {"image_size": 64, "patch_size": 4, "projection_dim": 128, "num_heads": 4, "layers_count": 6}, 8,
            "ViT, 6 blocks, dim 128, 64x64 images in 4x4 patches (257 tokens)"),
}

# One model, in a fresh process.
_RUN = """
import json, os, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
import keras, numpy as np
import conformance
import recompute_baseline
import tfremat
from tfremat.extract import extract
from tfremat.extract.plain_step import plain_train_step
from tfremat.measure import measure_model
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import plan_graph
from tfremat.runtime.memory import measure_step_peak
from tfremat.strategies import least_peak

def build():
    keras.utils.set_random_seed(0)
    model = getattr(conformance, {builder!r})(**{kwargs!r})
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    return model

model = build()
x, y = conformance.sample_batch(model, {batch})
row = {{"model": {name!r}, "batch": {batch}, "granularities": {{}}, "budgets": []}}
for granularity in ("layer", "sublayer"):
    started = time.perf_counter()
    ex = extract(model, (x, y), loss="categorical_crossentropy", optimizer=keras.optimizers.Adam(),
                 granularity=granularity)
    graph = ex.graph
    reference = checkpoint_all_peak(graph)
    row["granularities"][granularity] = {{
        "nodes": graph.size, "extract_s": time.perf_counter() - started, "checkpoint_all": reference,
        "fixed": graph.fixed_bytes, "least_peak": least_peak(graph)}}
for share in {budgets!r}:
    started = time.perf_counter()
    try:
        result = plan_graph(graph, int(share * reference), "optimal", verbose=0, time_limit={time_limit})
    except tfremat.errors.InfeasibleBudgetError as error:
        row["budgets"].append({{"share": share, "infeasible": str(error).splitlines()[0]}})
        continue
    facts = result.schedule.facts
    entry = {{"share": share, "plan_s": time.perf_counter() - started, "status": str(facts.status) if facts else "",
             "gap": facts.gap if facts else None, "predicted_overhead": result.overhead}}
    measured = measure_model(model, int(share * reference), batch_size={batch}, strategy="optimal", steps={steps},
                             loss="categorical_crossentropy", optimizer="adam", granularity="sublayer", verbose=0,
                             time_limit={time_limit})
    entry.update({{k: measured[k] for k in ("budget_bytes", "predicted_peak_bytes", "requested_peak_bytes",
                                           "measured_peak_bytes", "plain_peak_bytes", "step_seconds",
                                           "plain_step_seconds", "time_over_plain", "gradients_match")}})
    row["budgets"].append(entry)
try:
    with keras.RematScope(mode="full"):
        remat_model = build()
    optimizer = keras.optimizers.Adam()
    step = plain_train_step(remat_model, keras.losses.CategoricalCrossentropy(), optimizer)
    resident = list(remat_model.variables) + list(optimizer.variables)
    peak = measure_step_peak(step, x, y, resident=resident)
    started = time.perf_counter()
    for _ in range({steps}):
        float(step(x, y))
    row["remat_scope"] = {{"peak": peak, "step_seconds": (time.perf_counter() - started) / {steps}}}
except Exception as error:
    message = [line for line in str(error).splitlines() if "custom_gradient" in line or "support" in line]
    row["remat_scope"] = {{"error": type(error).__name__ + ": " + (message[0] if message else str(error)[:200])}}
def timed_peak(model):
    optimizer = keras.optimizers.Adam()
    step = plain_train_step(model, keras.losses.CategoricalCrossentropy(), optimizer)
    peak = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables))
    seconds = []
    for _ in range({steps}):
        started = time.perf_counter()
        float(step(x, y))
        seconds.append(time.perf_counter() - started)
    return peak, float(np.median(seconds))
try:
    plain_peak, plain_seconds = timed_peak(build())
    recomputing = build()
    blocks = recompute_baseline.recompute_per_block(recomputing)
    peak, seconds = timed_peak(recomputing)
    recomputing = build()
    recompute_baseline.recompute_per_block(recomputing)
    row["recompute_grad"] = {{
        "blocks": blocks, "peak_over_plain": peak / plain_peak, "time_over_plain": seconds / plain_seconds,
        "gradient_difference": recompute_baseline.gradient_difference(
            build(), recomputing, x, y, keras.losses.CategoricalCrossentropy())}}
except Exception as error:
    row["recompute_grad"] = {{"error": type(error).__name__ + ": " + str(error).splitlines()[0][:200]}}
print("RESULT " + json.dumps(row, default=str))
"""


def run_model(name: str, args) -> dict:
    builder, kwargs, batch, _ = MODELS[name]
    code = _RUN.format(root=ROOT, here=HERE, builder=builder, kwargs=kwargs, batch=args.batch or batch, name=name,
                       budgets=tuple(args.budgets), time_limit=args.time_limit, steps=args.steps)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_CPU_ALLOCATOR_USE_BFC": "true",
               "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if line[:1].isalpha() and "Error" in line.split(":")[0]]
        return {"model": name, "error": errors[-1] if errors else f"exit status {done.returncode}, no result",
                "stderr_tail": done.stderr.splitlines()[-40:], "seconds": time.perf_counter() - started}
    row = json.loads(lines[-1][len("RESULT "):])
    row["seconds"] = time.perf_counter() - started
    return row


def _mib(value) -> str:
    return f"{value / 2**20:.0f}"


def render(rows: list[dict], args, argv) -> str:
    lines = ["# Transformers at sublayer granularity", "", header(argv), "",
             "Each model in its own process; profiled costs; `TF_NUM_INTEROP_THREADS=1`; optimizer Adam. "
             "Shares are of the checkpoint-all peak at sublayer granularity. `smallest` = least peak a heuristic "
             "reaches (`tfremat.strategies.least_peak`). Peaks in MiB; `requested` = bytes the step's operations "
             "request (what the prediction counts), `allocator` = the BFC allocator's peak; times are the median "
             f"of {args.steps} steps against plain Keras training in the same process.", "",
             "| model | batch | granularity | nodes | activations share | smallest feasible |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | - | - | - | - | failed: {row['error'][:120]} |")
            continue
        for granularity, g in row["granularities"].items():
            activations = 1 - g["fixed"] / g["checkpoint_all"]
            lines.append(f"| {row['model']} | {row['batch']} | {granularity} | {g['nodes']} | {activations:.0%} | "
                         f"{g['least_peak'] / g['checkpoint_all']:.0%} ({_mib(g['least_peak'])} of "
                         f"{_mib(g['checkpoint_all'])}) |")
    lines += ["", "| model | budget | plan s | status (gap) | predicted overhead | predicted | requested | allocator "
              "| plain allocator | time / plain | gradients |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for b in row.get("budgets", []):
            if "infeasible" in b:
                lines.append(f"| {row['model']} | {b['share']:.0%} | - | infeasible: {b['infeasible'][:100]} "
                             "| | | | | | | |")
                continue
            gap = "" if b["gap"] is None else f" ({b['gap']:.1%})"
            lines.append(
                f"| {row['model']} | {b['share']:.0%} ({_mib(b['budget_bytes'])}) | {b['plan_s']:.0f} | "
                f"{b['status'].split('.')[-1].lower()}{gap} | {b['predicted_overhead']:+.1%} | "
                f"{_mib(b['predicted_peak_bytes'])} | {_mib(b['requested_peak_bytes'])} | "
                f"{_mib(b['measured_peak_bytes'])} | {_mib(b['plain_peak_bytes'])} | {b['time_over_plain']:.2f}x | "
                f"{'match' if b['gradients_match'] else 'DIFFER'} |")
    lines += ["", "Plain training of the model built under `keras.RematScope(mode=\"full\")`:", "",
              "| model | allocator peak / plain | step time / plain |", "| --- | --- | --- |"]
    for row in rows:
        remat = row.get("remat_scope")
        plain = next((b for b in row.get("budgets", []) if "plain_peak_bytes" in b), None)
        if remat and "error" in remat:
            lines.append(f"| {row['model']} | fails: {remat['error'].strip()[:160]} | |")
        elif remat and plain:
            lines.append(f"| {row['model']} | {remat['peak'] / plain['plain_peak_bytes']:.2f} | "
                         f"{remat['step_seconds'] / plain['plain_step_seconds']:.2f}x |")
    lines += ["", "Plain training with each block's call wrapped in `tf.recompute_grad` "
              "(benchmarks/recompute_baseline.py; its own plain step measured alongside). `gradients` = the "
              "largest gradient difference from plain training, relative to the largest gradient: the "
              "recomputed forward draws new dropout masks.", "",
              "| model | blocks wrapped | allocator peak / plain | step time / plain | gradients |",
              "| --- | --- | --- | --- | --- |"]
    for row in rows:
        baseline = row.get("recompute_grad")
        if baseline and "error" in baseline:
            lines.append(f"| {row['model']} | | fails: {baseline['error'][:160]} | | |")
        elif baseline:
            lines.append(f"| {row['model']} | {baseline['blocks']} | {baseline['peak_over_plain']:.2f} | "
                         f"{baseline['time_over_plain']:.2f}x | differ by {baseline['gradient_difference']:.1%} |")
    lines += ["", "Models: " + "; ".join(f"`{name}`: {MODELS[name][3]}" for name in MODELS) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), type=lambda s: s.split(","))
    parser.add_argument("--batch", type=int, default=None, help="override every model's batch size")
    parser.add_argument("--budgets", default="0.5,0.3", type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--time_limit", type=float, default=60.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "transformers.md"))
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    rows = []
    for name in args.models:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(run_model(name, args))
        print(f"{name}: {rows[-1].get('error') or 'done'} in {rows[-1]['seconds']:.0f} s", file=sys.stderr, flush=True)
        with open(args.out, "w") as handle:
            handle.write(render(rows, args, argv))
        with open(os.path.splitext(args.out)[0] + ".json", "w") as handle:
            json.dump(rows, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
