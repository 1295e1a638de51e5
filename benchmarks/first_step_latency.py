"""Where an uncached first step's seconds go (``--phases``), and what the plain-overlap measurement costs.

``--phases``: for each model (:data:`PHASE_MODELS`: user_check_3's small CNN at batch 32,
the conformance ``transformer_encoder`` and ``bilstm_text`` at batch 8, user_check_3's
keras-hub DistilBert at batch 8; with ``--only``, also :data:`APPLICATIONS`' EfficientNetV2B0 and
ResNet50) one ``tfremat.fit`` of one batch with an empty cache, in a
fresh process, its phases timed by wrapping the functions that do them (:data:`PHASES`:
extraction and its parts, planning and its parts, compiling, the allocator check; and each
compiled step's first call, its trace and instantiation, apart from its later calls:
:data:`STEP_CALLS`), wall and CPU seconds, with the graph's memory fields recorded. With ``--trees before=DIR,after=.``
each model runs on each checkout ``--repeats`` times in turns (before, after, after,
before, ...), and the table says whether the memory fields agree bit for bit.

Without ``--phases``: the plain-overlap measurement before and after a change.

The first ``tfremat.fit`` step waits for an uncached extraction, whose plain-overlap measurement
(:mod:`tfremat.extract.overlap`) traces and times a plain step on both executors. For each model
this runs ``extract(..., cost_model="profile", use_cache=False)`` ``--repeats`` times with the
measurement as it is in this checkout ("after") and ``--repeats`` times with it as it was at the
git revision ``--before`` ("before", its ``overlap.py`` and ``plain_step.py`` loaded from git), in turns (before,
after, after, before, ...), each on a freshly built model, and gives each extraction's seconds,
the overlap measurement's seconds, the factor it found and its rounds. It runs with TensorFlow's
default inter-op threads (``TF_NUM_INTEROP_THREADS=0`` unless set; with one, nothing is measured).

Run: ``python benchmarks/first_step_latency.py --phases --trees before=/tmp/before,after=. --repeats 3
--out benchmarks/results/first_step_latency.md`` (``git archive <rev> | tar -x -C /tmp/before`` makes
the before tree; ``--only efficientnetv2b0,resnet50`` for the larger models); ``python benchmarks/first_step_latency.py --only transformer_encoder,convmixer,bilstm_text
--repeats 3 --out benchmarks/results/first_step_latency.md``.
"""

import os

os.environ.setdefault("TF_NUM_INTEROP_THREADS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, HERE)  # user_check_3's models
# This checkout's tfremat, not an installed one; a --phases child that names another checkout, that one's.
sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else ROOT)

import conformance  # noqa: E402
from provenance import header, load_line, write_report  # noqa: E402

_ROUNDS = re.compile(r"median of (\d+) rounds")


class _Rounds(logging.Handler):
    """Keeps the rounds the last plain-overlap log line names."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.rounds = None

    def emit(self, record):
        found = _ROUNDS.search(record.getMessage())
        if found:
            self.rounds = int(found.group(1))


def old_module(revision: str, name: str):
    """``tfremat/extract/<name>.py`` as it was at ``revision``, as a module."""
    path = f"tfremat/extract/{name}.py"
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(f"tfremat.extract.{name}_before")
    exec(compile(source, f"{revision}:{path}", "exec"), module.__dict__)  # noqa: S102
    return module


def before_module(revision: str):
    """The overlap measurement as it was at ``revision``: its ``overlap.py``, with the plain
    step of its ``plain_step.py``."""
    module = old_module(revision, "overlap")
    module.plain_train_step = old_module(revision, "plain_step").plain_train_step
    return module


def timed_rounds(module, spent: list):
    """Makes ``module``'s ``time_in_turns`` add the seconds of its calls without a warm-up to
    ``spent``: the overlap's timed rounds, apart from the traces and the executors' first
    calls (before the change, a first call with a warm-up also timed one round to size the
    others; it is left out)."""
    original = module.time_in_turns

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if kwargs.get("warmup", 1) == 0:
                spent.append(time.perf_counter() - began)

    module.time_in_turns = timed


def one_extraction(name: str, batch: int, measure, rounds: _Rounds, rounds_spent: list) -> dict:
    """Extracts a fresh ``name`` with ``measure`` as the plain-overlap measurement."""
    import tfremat.extract.extractor as extractor
    from tfremat.extract import extract
    from tfremat.model_planning import synthetic_batch

    spent = []

    def timed(*args):
        began = time.perf_counter()
        factor = measure(*args)
        spent.append(time.perf_counter() - began)
        return factor

    model = conformance.build(name)
    x, y = synthetic_batch(model, batch, loss="categorical_crossentropy", seed=0)
    original = extractor.measure_plain_overlap
    extractor.measure_plain_overlap = timed
    rounds.rounds = None
    rounds_spent.clear()
    try:
        began = time.perf_counter()
        extraction = extract(model, (x, y), loss="categorical_crossentropy", cost_model="profile", use_cache=False)
        seconds = time.perf_counter() - began
    finally:
        extractor.measure_plain_overlap = original
    return {"extract_s": seconds, "overlap_s": sum(spent), "rounds_s": sum(rounds_spent),
            "overlap": extraction.plain_overlap,
            "rounds": rounds.rounds, "load": os.getloadavg()[0]}


# ---------------------------------------------------------------- phases of the first step (--phases)

# (label, module, attribute): each wrapped function's seconds count under its label; a label
# nested in another (its function called while the other's runs) counts under the path of
# the labels open, so "allocator check / planning" is the re-planning inside the check.
# A class attribute is written "Class.method". Missing modules and attributes (another checkout) are skipped.
PHASES = (
    ("extraction", "tfremat.extract.extractor", "_extract"),
    ("walk", "tfremat.extract.extractor", "walk_model"),
    ("layer analysis", "tfremat.extract.extractor", "_analyze_calls"),
    ("layer analysis", "tfremat.extract.extractor", "_analyze_alternatives"),
    ("traces", "tfremat.extract.analysis", "_CallTracer.trace"),
    ("traces", "tfremat.extract.analysis", "_trace_forward"),
    ("requested peaks", "tfremat.extract.analysis", "_requested_peak"),
    ("requested peaks", "tfremat.extract.analysis", "_requested_peaks"),
    ("hidden residuals", "tfremat.extract.analysis", "_hidden_residual_bytes"),
    ("loop bytes", "tfremat.extract.analysis", "_held_bytes"),
    ("dispatch functions", "tfremat.extract.analysis", "dispatch_only"),
    ("loss analysis", "tfremat.extract.extractor", "analyze_loss"),
    ("timing passes", "tfremat.extract.call_timing", "TimingPasses.final"),
    ("plain overlap", "tfremat.extract.extractor", "measure_plain_overlap"),
    ("plain step trace", "tfremat.extract.overlap", "_traced_steps"),
    ("first calls", "tfremat.extract.overlap", "_first_calls"),
    ("step trace passes", "tfremat.extract.overlap", "_StepTrace.run_pass"),
    ("timed rounds", "tfremat.extract.overlap", "time_in_turns"),
    ("assembly", "tfremat.extract.extractor", "assemble"),
    ("optimizer update probe", "tfremat.extract.assembly", "update_temporaries"),
    ("planning", "tfremat.planner", "plan_graph"),
    ("planning", "tfremat.keras", "plan_graph"),
    ("heuristics", "tfremat.ilp.milp", "best_baseline"),
    ("LP and its rounding", "tfremat.ilp.milp", "relaxed_lp_start"),
    ("RINS", "tfremat.ilp.milp", "_rins"),
    ("MILP", "tfremat.ilp.milp", "_solve_with_stage_rows"),
    ("compile", "tfremat.static_graph.compile", "compile_step"),
    ("allocator check", "tfremat.keras", "hold_allocator_peak"),
    ("allocator check", "tfremat.keras", "allocator_peak"),
)
# A compiled step's calls, timed apart from PHASES: each step's first call (its trace and its
# instantiation: Grappler, then the executor's setup) under one label, its later calls (the
# check's reads, training's steps) under another, so that the check's row says how much of it
# is the trace training would pay anyway and how much the reads.
STEP_CALLS = ("tfremat.static_graph.compile", "CompiledStep.__call__", "step first call", "step runs")
# Rows of the phase table: (path, label shown), in this order.
PHASE_ROWS = (
    (("extraction",), "extraction"),
    (("extraction", "walk"), "- walk the layer calls"),
    (("extraction", "layer analysis"), "- layer analysis"),
    (("extraction", "layer analysis", "traces"), "  - traces"),
    (("extraction", "layer analysis", "requested peaks"), "  - requested peaks (runs + profiler)"),
    (("extraction", "layer analysis", "hidden residuals"), "  - hidden residuals"),
    (("extraction", "layer analysis", "loop bytes"), "  - loop accumulators"),
    (("extraction", "layer analysis", "dispatch functions"), "  - dispatch-only functions"),
    (("extraction", "loss analysis"), "- loss analysis"),
    (("extraction", "timing passes"), "- timing passes"),
    (("extraction", "plain overlap"), "- plain overlap (overlap.py)"),
    (("extraction", "plain overlap", "plain step trace"), "  - plain step trace"),
    (("extraction", "plain overlap", "first calls"), "  - each executor's first call"),
    (("extraction", "plain overlap", "step trace passes"), "  - step trace passes (profiler)"),
    (("extraction", "plain overlap", "timed rounds"), "  - timed rounds"),
    (("extraction", "assembly"), "- assembly"),
    (("extraction", "assembly", "optimizer update probe"), "  - optimizer update probe"),
    (("planning",), "planning"),
    (("planning", "heuristics"), "- heuristics"),
    (("planning", "LP and its rounding"), "- LP and its rounding"),
    (("planning", "RINS"), "- RINS"),
    (("planning", "MILP"), "- MILP"),
    (("compile",), "compile"),
    (("allocator check",), "allocator check (allocator_check.py)"),
    (("allocator check", "planning"), "- re-planning"),
    (("allocator check", "compile"), "- compiling again"),
    (("allocator check", "step first call"), "- each plan's step: trace + instantiation (first call)"),
    (("allocator check", "step runs"), "- the step's reads (later calls)"),
    (("step first call",), "step's first call outside the check (trace + instantiation)"),
    (("step runs",), "training's step (later calls)"),
)
PHASE_MODELS = ("cnn", "transformer_encoder", "bilstm_text", "distilbert")
# Larger models for --only (keras.applications at 64x64, batch 8, Adam, as user_check_5's
# efficientnetv2b0): name -> (constructor, budget). ResNet50's weights, gradients and Adam's
# slots are 88% of its checkpoint-all peak at this batch, so "80%" is infeasible there.
APPLICATIONS = {"efficientnetv2b0": ("EfficientNetV2B0", "80%"), "resnet50": ("ResNet50", "95%")}


class PhaseClock:
    """Wall and CPU seconds of the wrapped functions, by the path of phases open when each ran."""

    def __init__(self):
        self.open: list[str] = []
        self.seconds: dict[tuple, list[float]] = {}

    def wrap(self, label: str, function):
        clock = self

        def timed(*args, **kwargs):
            if label in clock.open:  # counted by the outer call already
                return function(*args, **kwargs)
            clock.open.append(label)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                path = tuple(clock.open)
                clock.open.pop()
                spent = clock.seconds.setdefault(path, [0.0, 0.0, 0])
                spent[0] += time.perf_counter() - wall
                spent[1] += time.process_time() - cpu
                spent[2] += 1

        timed.__wrapped__ = function
        return timed

    def wrap_step_calls(self, first_label: str, later_label: str, function):
        """``function`` (a step's ``__call__``) timed under ``first_label`` on each step's
        first call and under ``later_label`` on the others."""
        first, later = self.wrap(first_label, function), self.wrap(later_label, function)
        called = {}  # by id, each step kept alive so that no later step takes its id

        def timed(step, *args, **kwargs):
            if id(step) in called:
                return later(step, *args, **kwargs)
            called[id(step)] = step
            return first(step, *args, **kwargs)

        return timed

    def install(self) -> None:
        import importlib

        module_name, attribute, first_label, later_label = STEP_CALLS
        owner, _, name = attribute.partition(".")
        holder = getattr(importlib.import_module(module_name), owner)
        setattr(holder, name, self.wrap_step_calls(first_label, later_label, getattr(holder, name)))
        wrapped = {}
        for label, module_name, attribute in PHASES:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                continue
            owner, _, name = attribute.rpartition(".")
            holder = getattr(module, owner) if owner else module
            original = getattr(holder, name, None)
            if original is None:
                continue
            # One wrapper per function, wherever it is imported (plan_graph in tfremat.keras).
            key = id(getattr(original, "__wrapped__", original))
            if key not in wrapped:
                wrapped[key] = self.wrap(label, original)
            setattr(holder, name, wrapped[key])

    def rows(self) -> dict:
        """Seconds by path, every path also counting what ran under longer paths below it
        only through its own entry (each entry is inclusive)."""
        return {" / ".join(path): spent for path, spent in self.seconds.items()}


def _phase_model(name: str):
    """``(model, x, y, batch, budget)`` for ``name`` (:data:`PHASE_MODELS`), compiled."""
    import numpy as np

    import user_check_3 as users
    from tfremat.model_planning import synthetic_batch

    if name == "cnn":
        model = users._cnn()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        x, y = users._images(32)
        return model, x, y, 32, "70% of activations"
    if name == "distilbert":
        model = users._distilbert()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 500, (8, 64)).astype("int32")
        mask = np.ones((8, 64), dtype="int32")
        for row, keep in enumerate(rng.integers(16, 64, 8)):
            tokens[row, keep:], mask[row, keep:] = 0, 0
        return model, {"token_ids": tokens, "padding_mask": mask}, rng.integers(0, 3, 8), 8, "60% of activations"
    if name in APPLICATIONS:
        import keras

        constructor, budget = APPLICATIONS[name]
        model = getattr(keras.applications, constructor)(input_shape=(64, 64, 3), weights=None, classes=10)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        return model, rng.random((8, 64, 64, 3), dtype="float32"), rng.integers(0, 10, 8), 8, budget
    model = conformance.build(name)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x, y = synthetic_batch(model, 8, loss="categorical_crossentropy", seed=0)
    return model, x, y, 8, "70% of activations"


def phase_child(name: str, out: str) -> None:
    """One ``tfremat.fit`` of one batch of ``name`` with an empty cache, its phases timed;
    writes JSON to ``out``: the phases, the seconds to the first batch's end, the plan and
    the graph's memory fields (to compare two checkouts bit for bit)."""
    import keras

    import tfremat

    clock = PhaseClock()
    clock.install()
    keras.utils.set_random_seed(0)
    model, x, y, batch, budget = _phase_model(name)

    class FirstStep(keras.callbacks.Callback):
        began = seconds = remat = None

        def on_train_begin(self, logs=None):
            self.began = time.perf_counter()
            self.remat = getattr(self.model.train_function, "__self__", None)

        def on_train_batch_end(self, index, logs=None):
            if self.seconds is None:
                self.seconds = time.perf_counter() - self.began

    first = FirstStep()
    load = os.getloadavg()[0]
    cpu = time.process_time()
    tfremat.fit(model, budget, x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[first])
    cpu = time.process_time() - cpu
    plan = next(iter(first.remat.plans.values()))
    graph = plan.extraction.graph
    memory = {field: [int(v) for v in getattr(graph, field)] for field in
              ("output_bytes", "workspace_bytes", "residual_bytes", "weight_grad_bytes") if hasattr(graph, field)}
    memory["fixed_bytes"] = int(graph.fixed_bytes)
    record = {"model": name, "first_step_s": first.seconds, "first_step_cpu_s": cpu, "load": load,
              "load_after": os.getloadavg()[0], "phases": clock.rows(), "nodes": graph.size,
              "memory": memory, "cost": [float(c) for c in graph.cost],
              "predicted": plan.predicted_peak_bytes, "budget": plan.budget_bytes,
              "status": str(plan.schedule.facts.status) if plan.schedule.facts else None,
              "plan_cost": plan.schedule.cost(graph)}
    with open(out, "w") as f:
        json.dump(record, f)


def run_phase_child(name: str, tree: str, keep: str | None = None) -> dict:
    """:func:`phase_child` in a fresh process on the checkout ``tree`` (its tfremat first on the
    path); its record is also appended to the JSON-lines file ``keep`` when given."""
    with tempfile.TemporaryDirectory(prefix="tfremat_first_step_") as work:
        out = os.path.join(work, "phases.json")
        env = dict(os.environ, TFREMAT_CACHE_DIR=os.path.join(work, "cache"), PYTHONPATH=tree)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--child_out", out,
                        "--tree", tree], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            record = json.load(f)
    record["tree"] = tree
    if keep:
        with open(keep, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def _median(values) -> float:
    return statistics.median(values) if values else 0.0


def phase_report(names, trees: dict, repeats: int, keep: str | None = None) -> list[str]:
    """Runs every model on every tree (``{variant: checkout}``) ``repeats`` times in turns
    and renders the per-phase medians, the memory comparison and the runs (each record
    also appended to ``keep``)."""
    runs: dict = {(name, variant): [] for name in names for variant in trees}
    log = []
    for name in names:
        for repeat in range(repeats):
            for variant in (list(trees) if repeat % 2 == 0 else list(trees)[::-1]):
                record = run_phase_child(name, trees[variant], keep)
                record["variant"] = variant
                runs[(name, variant)].append(record)
                log.append(_run_line(record))
                sys.stderr.write(log[-1] + "\n")
    return render_phases(runs, names, list(trees), log)


def _run_line(record: dict) -> str:
    return (f"| {record['model']} | {record['variant']} | {record['first_step_s']:.1f} | "
            f"{record['first_step_cpu_s']:.1f} | {record['phases'].get('extraction', [0])[0]:.1f} | "
            f"{record['phases'].get('planning', [0])[0]:.1f} | {record['status']} | {record['plan_cost']:.6g} | "
            f"{record['load']:.1f} |")


def kept_runs(path: str, trees: dict) -> tuple[dict, list[str], list[str], list[str]]:
    """``(runs, names, variants, log)`` of the records a ``--keep`` file holds, each run's
    variant the one of ``trees`` (``{variant: checkout}``) it ran on."""
    variant_of = {tree: variant for variant, tree in trees.items()}
    runs: dict = {}
    log = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            record["variant"] = variant_of[record["tree"]]
            runs.setdefault((record["model"], record["variant"]), []).append(record)
            log.append(_run_line(record))
    names = list(dict.fromkeys(name for name, _ in runs))
    variants = [v for v in trees if any(key[1] == v for key in runs)]
    names = [n for n in names if all((n, v) in runs for v in variants)]
    return runs, names, variants, log


def render_phases(runs: dict, names, variants, log) -> list[str]:
    """The per-phase medians, the memory comparison and the runs, as markdown lines."""
    lines = []
    for name in names:
        lines += ["", f"### {name}", "",
                  "Median seconds over the runs, wall (CPU: the process's, all threads); each row includes "
                  "the rows indented under it.", "",
                  "| phase | " + " | ".join(f"{v} wall s | {v} CPU s" for v in variants) + " |",
                  "|---|" + "---|---|" * len(variants)]
        first = [f"{_median([r['first_step_s'] for r in runs[(name, v)]]):.1f} | "
                 f"{_median([r['first_step_cpu_s'] for r in runs[(name, v)]]):.1f}" for v in variants]
        lines.append("| **first step** (fit start to the first batch's end; CPU: the whole fit) | "
                     + " | ".join(first) + " |")
        for path, shown in PHASE_ROWS:
            key = " / ".join(path)
            cells = []
            for v in variants:
                spent = [r["phases"].get(key, [0.0, 0.0, 0]) for r in runs[(name, v)]]
                cells.append(f"{_median([s[0] for s in spent]):.2f} | {_median([s[1] for s in spent]):.2f}")
            if any(r["phases"].get(key) for v in variants for r in runs[(name, v)]):
                lines.append(f"| {shown} | " + " | ".join(cells) + " |")
        lines += ["", f"{runs[(name, variants[0])][0]['nodes']} nodes. " + _memory_comparison(runs, name, variants)]
    return lines + ["", "Runs, in the order they ran:", "",
                    "| model | variant | first step s | fit CPU s | extraction s | planning s | status | plan cost | "
                    "load (1 min) |", "|---|---|---|---|---|---|---|---|---|", *log]


def _memory_comparison(runs, name, variants) -> str:
    """Whether the graph's memory fields agree over the runs: per node and field, the values
    each variant's runs gave. Some backward workspaces differ from one process to the next
    in one checkout (the executor's order of a backward's operations, docs/memory-model.md),
    so a variant agrees with the first when each of its values is one the first gave."""
    fields = runs[(name, variants[0])][0]["memory"]
    seen = {v: {(field, i): set() for field, values in fields.items()
                for i in range(len(values) if isinstance(values, list) else 1)} for v in variants}
    for v in variants:
        for record in runs[(name, v)]:
            for field, values in record["memory"].items():
                for i, value in enumerate(values if isinstance(values, list) else [values]):
                    seen[v][(field, i)].add(value)
    varying = {v: sorted(key for key, values in seen[v].items() if len(values) > 1) for v in variants}
    first = variants[0]
    outside = {v: sorted(key for key, values in seen[v].items() if not values <= seen[first][key])
               for v in variants[1:]}
    text = ("The graph's memory fields (output, workspace, residual, weight-gradient bytes per node, fixed "
            "bytes): ")
    if not any(varying.values()) and not any(outside.values()):
        return text + f"**identical** in all {sum(len(runs[(name, v)]) for v in variants)} runs."
    parts = [f"{v}'s {len(runs[(name, v)])} runs differ among themselves at {len(varying[v])} entries"
             + (f" (e.g. {_entries(seen[v], varying[v][:3])})" if varying[v] else "") for v in variants]
    parts += [f"{v} gave a value {first} never gave at {len(keys)} entries"
              + (f" ({_entries(seen[v], keys[:4])}; {first}: {_entries(seen[first], keys[:4])})" if keys else "")
              for v, keys in outside.items()]
    return text + "; ".join(parts) + "."


def _entries(seen: dict, keys) -> str:
    return ", ".join(f"{field}[{i}] {sorted(seen[(field, i)])}" for field, i in keys)


def compare_peaks(names) -> list[str]:
    """In one process, every requested peak the layer profiles measure in one profiler
    session (``analysis._requested_peaks``, this checkout) against the same function's peak
    in a session of its own (``analysis._requested_peak``, as before sessions were shared),
    on ``extract(..., use_cache=False)`` of each model: the per-process spread of the graph's
    workspaces (the executor's order) cannot hide a difference here. The separate sessions
    run before the shared one for every other call, after it for the others."""
    from tfremat.extract import analysis, extract

    in_session = analysis._requested_peaks
    pairs = []

    def both(runs, warmup, may_cycle=None, held=None, shared=True):
        def alone():
            return {position: analysis._requested_peak(fn, args, warmup) for position, (fn, args) in enumerate(runs)
                    if position not in (held, may_cycle)}

        first = len(pairs) % 2 == 0
        separate = alone() if first else None
        events = in_session(runs, warmup, may_cycle=may_cycle, held=held, shared=shared)
        separate = separate if first else alone()
        pairs.extend((peak, analysis._replayed_peak(events[position])[0]) for position, peak in separate.items())
        return events

    analysis._requested_peaks = both
    lines = ["| model | functions compared | peaks that differ |", "|---|---|---|"]
    for name in names:
        model, x, y, _, _ = _phase_model(name)
        pairs.clear()
        extract(model, (x, y), loss=model.loss, optimizer=model.optimizer, use_cache=False)
        lines.append(f"| {name} | {len(pairs)} | {sum(a != b for a, b in pairs)} |")
        sys.stderr.write(lines[-1] + "\n")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", action="store_true", help="time the first step's phases (module docstring)")
    parser.add_argument("--trees", default=f"after={ROOT}",
                        help="with --phases: variant=checkout pairs, comma separated (default: this checkout)")
    parser.add_argument("--from_keep", help="with --phases: render the records of a --keep file instead of running")
    parser.add_argument("--compare_peaks", action="store_true",
                        help="with --phases: compare shared and separate profiler sessions' peaks (compare_peaks)")
    parser.add_argument("--keep", help="with --phases: append each run's record to this JSON-lines file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child_out", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="model names, comma separated (--phases: default all of PHASE_MODELS)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="extractions per model and variant")
    parser.add_argument("--before", default="c3bbd0b", help="git revision of the measurement before the change")
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    if args.child:
        phase_child(args.child, args.child_out)
        return
    if args.phases and args.compare_peaks:
        os.environ.setdefault("TFREMAT_CACHE_DIR", tempfile.mkdtemp())
        lines = [header(argv), "", *compare_peaks(args.only.split(",") if args.only else list(PHASE_MODELS))]
        sys.stdout.write("\n".join(lines) + "\n")
        return
    if args.phases:
        trees = dict(pair.split("=", 1) for pair in args.trees.split(","))
        trees = {variant: os.path.abspath(tree) for variant, tree in trees.items()}
        names = args.only.split(",") if args.only else list(PHASE_MODELS)
        lines = [header(argv), "", "Uncached `tfremat.fit` of one batch per fresh process, TensorFlow's default "
                 "inter-op threads, oneDNN on; checkouts: " + ", ".join(f"{v} `{t}`" for v, t in trees.items()),
                 *(render_phases(*kept_runs(args.from_keep, trees)) if args.from_keep
                   else phase_report(names, trees, args.repeats, args.keep)), "",
                 load_line()]
        write_report("\n".join(lines), args.out)
        return
    if not args.only:
        parser.error("--only is required without --phases")
    os.environ.setdefault("TFREMAT_CACHE_DIR", tempfile.mkdtemp())
    import tfremat.extract.overlap as after

    rounds = _Rounds()
    logging.getLogger("tfremat.extract").addHandler(rounds)
    logging.getLogger("tfremat.extract").setLevel(logging.INFO)
    before = before_module(args.before)
    rounds_spent = []
    for module in (before, after):
        timed_rounds(module, rounds_spent)
    variants = {"before": before.measure_plain_overlap, "after": after.measure_plain_overlap}
    lines = [header(argv), "", f"Batch {args.batch}, SGD, categorical cross-entropy, `cost_model=\"profile\"`, "
             f"uncached, inter-op threads {os.environ['TF_NUM_INTEROP_THREADS']} (0: TensorFlow's default); "
             f"before: `overlap.py` and `plain_step.py` at {args.before}, after: this checkout; in turns, a fresh model each.", "",
             "| model | variant | extract s | overlap s | of which rounds s | overlap | rounds | load (1 min) |",
             "|---|---|---|---|---|---|---|---|"]
    summary = ["", "| model | variant | median extract s | median overlap s | median rounds s | overlaps found |",
               "|---|---|---|---|---|---|"]
    for name in args.only.split(","):
        rows = {"before": [], "after": []}
        for repeat in range(args.repeats):
            order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            for variant in order:
                row = one_extraction(name, args.batch, variants[variant], rounds, rounds_spent)
                rows[variant].append(row)
                lines.append(f"| {name} | {variant} | {row['extract_s']:.1f} | {row['overlap_s']:.2f} | "
                             f"{row['rounds_s']:.2f} | {row['overlap']:.3f} | {row['rounds']} | {row['load']:.1f} |")
                sys.stderr.write(lines[-1] + "\n")
        for variant, measured in rows.items():
            summary.append(f"| {name} | {variant} | {statistics.median(r['extract_s'] for r in measured):.1f} | "
                           f"{statistics.median(r['overlap_s'] for r in measured):.2f} | "
                           f"{statistics.median(r['rounds_s'] for r in measured):.2f} | "
                           f"{', '.join(format(r['overlap'], '.3f') for r in measured)} |")
    lines += summary
    lines += ["", load_line()]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
