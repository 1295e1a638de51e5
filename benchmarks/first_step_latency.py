"""What the plain-overlap measurement costs the first step: extraction before and after a change.

The first ``tfremat.fit`` step waits for an uncached extraction, whose plain-overlap measurement
(:mod:`tfremat.extract.overlap`) traces and times a plain step on both executors. For each model
this runs ``extract(..., cost_model="profile", use_cache=False)`` ``--repeats`` times with the
measurement as it is in this checkout ("after") and ``--repeats`` times with it as it was at the
git revision ``--before`` ("before", its ``overlap.py`` and ``plain_step.py`` loaded from git), in turns (before,
after, after, before, ...), each on a freshly built model, and gives each extraction's seconds,
the overlap measurement's seconds, the factor it found and its rounds. It runs with TensorFlow's
default inter-op threads (``TF_NUM_INTEROP_THREADS=0`` unless set; with one, nothing is measured).

Run: ``python benchmarks/first_step_latency.py --only transformer_encoder,convmixer,bilstm_text
--repeats 3 --out benchmarks/results/first_step_latency.md``
"""

import os

os.environ.setdefault("TF_NUM_INTEROP_THREADS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
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
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

import conformance  # noqa: E402
from provenance import header  # noqa: E402

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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="conformance model names, comma separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="extractions per model and variant")
    parser.add_argument("--before", default="c3bbd0b", help="git revision of the measurement before the change")
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args(argv)
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
    lines += ["", "Load average over the last 1 / 5 / 15 minutes at the end: "
              + " / ".join(f"{load:.1f}" for load in os.getloadavg()) + f" on {os.cpu_count()} CPUs."]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
