"""Seconds from ``tfremat.fit`` to the first rematerialized step, by phase (issue 34).

Each model runs in its own process, with the profile and schedule caches off (a new batch
shape's cost): plain Keras's first ``train_on_batch`` (tracing included), then the phases
:class:`tfremat.keras.RematCallback` runs for a new batch shape, timed one by one with the
same calls: extraction (of which profiling), planning with ``optimal`` at the high-level
defaults (``tfremat.planner.strategy_options``: time limit and stall rule), compiling the
step and its first run (which traces it). The allocator check, which runs a new step
twice more, is left out; the re-plan it makes when the allocator's peak exceeds the
budget is timed instead: the graph planned again under 98% of the planning budget with
:func:`tfremat.allocator_check.replan_strategy`'s choice (the heuristic whose schedule
``optimal`` returned unimproved, or ``optimal``), as :class:`tfremat.keras.RematCallback`
and the multi-worker check plan it; with ``--full-replan`` also with ``optimal`` itself (what
the multi-worker check ran before). With ``--compare`` the same graph is planned again
without the stall rule (``stall_time=math.inf``, the time limit alone), for the schedule
quality the stall rule gives up.

Run: ``python benchmarks/latency.py`` (writes ``benchmarks/results/latency.md``; the
keras-hub models need keras-hub). Timings depend on the machine's load: compare the
columns of one row, measured in one process.
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
    # name: (builder in conformance.py or "llama_hub", keyword arguments, batch, budget, what it is)
    "transformer_encoder": ("_transformer_encoder", {}, 8, "50%", "keras.io text transformer, 6 blocks, 64 tokens"),
    "vit": ("_vit", {}, 8, "50%", "ViT, 3 blocks, 32x32 images"),
    "unet_transpose": ("_unet_transpose", {}, 8, "50%", "U-Net with transposed convolutions, 32x32"),
    "convmixer": ("_convmixer", {}, 8, "50%", "ConvMixer, depth 4, 32x32"),
    # "55%": no schedule of the current graph fits under 52% (HiGHS proves it).
    "gpt2_hub": ("_gpt2_hub", {}, 8, "55%", "keras-hub GPT2Backbone, 2 layers, hidden 64, 64 tokens"),
    "bert_hub": ("_bert_hub", {}, 8, "50%", "keras-hub BertBackbone, 2 layers, hidden 64, 64 tokens"),
    "llama_hub": ("llama_hub", {}, 8, "50%", "keras-hub LlamaBackbone, 2 layers, hidden 64, 64 tokens"),
    "gpt2_hub_6": ("_gpt2_hub", {"seq_len": 256, "layers_count": 6, "hidden": 128}, 4, "30%",
                   "keras-hub GPT2Backbone, 6 layers, hidden 128, 256 tokens"),
    # The first-step case of issue 33 (543 nodes): eviction's schedule comes back from optimal.
    "efficientnetv2b0": ("application", {"name_or_file": "EfficientNetV2B0", "input_shape": (64, 64, 3)}, 8,
                         "50% of activations", "keras.applications EfficientNetV2B0, 64x64 images"),
}
HUB = ("gpt2_hub", "bert_hub", "llama_hub", "gpt2_hub_6")

_RUN = """
import json, math, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
import keras
import conformance
from tfremat.model_planning import extract_model
from tfremat.planner import plan_graph
from tfremat.static_graph.compile import compile_step
from tfremat.allocator_check import replan_strategy
from tfremat.errors import InfeasibleBudgetError
from tfremat.applications import build_application

def llama_hub(seq_len=64, layers_count=2, hidden=64, heads=2):
    import keras_hub
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=conformance.VOCAB, num_layers=layers_count, num_query_heads=heads,
        num_key_value_heads=heads, hidden_dim=hidden, intermediate_dim=hidden * 4)
    return conformance._hub_backbone_head(backbone, seq_len)

def build():
    keras.utils.set_random_seed(0)
    if {builder!r} == "application":
        model = build_application(**{kwargs!r}, num_classes=10)
    else:
        builder = llama_hub if {builder!r} == "llama_hub" else getattr(conformance, {builder!r})
        model = builder(**{kwargs!r})
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    return model

row = {{"model": {name!r}, "batch": {batch}, "budget": {budget!r}}}
model = build()
x, y = conformance.sample_batch(model, {batch})
started = time.perf_counter()
model.train_on_batch(x, y)
row["keras_first_s"] = time.perf_counter() - started
model = build()
started = time.perf_counter()
extraction = extract_model(model, x, y, batch_size={batch}, loss=None, optimizer=None, cost_model="profile",
                           cache=False)
row.update(extract_s=time.perf_counter() - started, profile_s=extraction.profile_seconds,
           nodes=extraction.graph.size)
started, cpu = time.perf_counter(), time.process_time()
result = plan_graph(extraction.graph, {budget!r}, "optimal", cache=False, verbose=0)
facts = result.facts
row.update(plan_s=time.perf_counter() - started, plan_cpu_s=time.process_time() - cpu, status=str(facts.status),
           gap=facts.gap, overhead=result.overhead, recomputations=result.schedule.recompute_count)
started = time.perf_counter()
step = compile_step(extraction, result.schedule, optimizer=model.optimizer, return_outputs=True)
step(x, y)
row["compile_first_step_s"] = time.perf_counter() - started

def replanned(name):
    started, cpu = time.perf_counter(), time.process_time()
    if name == "choice":
        name = replan_strategy(result, "optimal")
    try:
        again = plan_graph(extraction.graph, int(0.98 * result.budget_bytes), name, cache=False, verbose=0)
    except InfeasibleBudgetError:  # the heuristic finds none: the check plans with optimal
        name = "optimal"
        again = plan_graph(extraction.graph, int(0.98 * result.budget_bytes), name, cache=False, verbose=0)
    return {{"s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, "with": name,
            "overhead": again.overhead}}

row["replan"] = replanned("choice")
if {full_replan!r}:
    row["full_replan"] = replanned("optimal")
if {compare!r}:
    started = time.perf_counter()
    longer = plan_graph(extraction.graph, {budget!r}, "optimal", cache=False, verbose=0, stall_time=math.inf)
    row["no_stall"] = {{"plan_s": time.perf_counter() - started, "status": str(longer.facts.status),
                       "gap": longer.facts.gap, "overhead": longer.overhead}}
print("RESULT " + json.dumps(row))
"""


def run_model(name: str, compare: bool, full_replan: bool = False) -> dict:
    builder, kwargs, batch, budget, _ = MODELS[name]
    code = _RUN.format(root=ROOT, here=HERE, builder=builder, kwargs=kwargs, batch=batch, budget=budget, name=name,
                       compare=compare, full_replan=full_replan)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TFREMAT_CACHE_DIR": cache, "TF_CPP_MIN_LOG_LEVEL": "2"}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if "Error" in line.split(":")[0]]
        return {"model": name, "error": errors[-1] if errors else f"exit status {done.returncode}, no result",
                "seconds": time.perf_counter() - started}
    return json.loads(lines[-1][len("RESULT "):])


def _gap(row: dict) -> str:
    return "" if row["gap"] is None else f" ({row['gap']:.1%})"


def render(rows: list[dict], argv) -> str:
    lines = ["# Seconds to the first rematerialized step", "", header(argv), "",
             "Each model in its own process, caches off, profiled costs, `optimal` at the high-level defaults. "
             "`first step` = compiling the step and its first run (tracing included); `to first step` = "
             "extraction + planning + that. `Keras` = plain `train_on_batch`'s first call (tracing included). "
             "`CPU s` = the planning process's CPU seconds (the stall rule's clock; wall seconds grow with the "
             "machine's load, CPU seconds barely). "
             "`no stall` = the same graph planned with the time limit alone (`stall_time=math.inf`). "
             "`re-plan` = planned again under 98% of the budget as the allocator check plans (`replan_strategy`'s "
             "choice); `optimal re-plan` = the same with `optimal` itself (`--full-replan`).", "",
             "| model | nodes | budget | extraction s (profiling) | planning s (CPU s) | first step s "
             "| to first step s | Keras s | status (gap) | overhead | re-plan: s (CPU s), with, overhead "
             "| optimal re-plan: s (CPU s), overhead | no stall: s, status (gap), overhead |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | | | failed: {row['error'][:120]} | | | | | | | | | |")
            continue
        total = row["extract_s"] + row["plan_s"] + row["compile_first_step_s"]
        longer = row.get("no_stall")
        other = "" if longer is None else (
            f"{longer['plan_s']:.1f}, {longer['status']}{_gap(longer)}, {longer['overhead']:+.1%}")
        again, full = row["replan"], row.get("full_replan")
        replan = f"{again['s']:.1f} ({again['cpu_s']:.1f}), {again['with']}, {again['overhead']:+.1%}"
        full = "" if full is None else f"{full['s']:.1f} ({full['cpu_s']:.1f}), {full['overhead']:+.1%}"
        lines.append(
            f"| {row['model']} | {row['nodes']} | {row['budget']} | {row['extract_s']:.1f} ({row['profile_s']:.1f}) | "
            f"{row['plan_s']:.1f} ({row['plan_cpu_s']:.1f}) | {row['compile_first_step_s']:.1f} | {total:.1f} | "
            f"{row['keras_first_s']:.1f} | {row['status']}{_gap(row)} | {row['overhead']:+.1%} | {replan} | {full} "
            f"| {other} |")
    lines += ["", "Models: " + "; ".join(f"`{name}`: {MODELS[name][4]}, batch {MODELS[name][2]}" for name in MODELS)
              + ".", "", "Load average over the last 1 / 5 / 15 minutes when the run ended: "
              + " / ".join(f"{load:.1f}" for load in os.getloadavg()) + f" on {os.cpu_count()} CPUs."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--compare", nargs="*", default=list(HUB), choices=list(MODELS),
                        help="models also planned without the stall rule (default: the keras-hub ones)")
    parser.add_argument("--full-replan", nargs="*", default=["efficientnetv2b0"], choices=list(MODELS),
                        help="models also planned again with optimal itself (default: efficientnetv2b0)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "latency.md"))
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        row = run_model(name, name in args.compare, name in args.full_replan)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    with open(args.out, "w") as out:
        out.write(render(rows, argv))


if __name__ == "__main__":
    main()
