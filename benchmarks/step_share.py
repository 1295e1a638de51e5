"""The step share and what the costs miss, checkout against checkout (issue 33 item 2,
``PlanResult.step_share``).

The predicted time over plain is ``(1 + overhead * step_share) * plain_overlap`` with
``step_share = total_cost / (total_cost + U)``, U the optimizer update's seconds
(``Extraction.plain_update_seconds``). Each row is a fresh process running one checkout of
tfremat (``--roots``, in turns, so that before and after see the same load): an uncached
extraction and plan through :func:`tfremat.measure.measure_model` (Adam), whose planned and
plain steps are timed in turns in that process. Per row: the summed costs, the plain step's
least run from Python (S), U, the share, the seconds the plain overlap's measurement took
(where U's timing is spent), the predicted and measured time over plain.

Where a checkout reads the plain step's parts off its trace
(:class:`tfremat.extract.overlap._StepTrace`), the row also holds each part's least
seconds: forward, backward, loss, update and other (operations outside them all), and the
traced step (their sum); nodes = forward + backward + loss, the part the graph's costs
stand for.

Run: ``python benchmarks/step_share.py --models gpt2_hub,transformer_encoder,convmixer,MobileNetV2
--roots /path/to/before,. --repeats 2 --out benchmarks/results/step_share.md`` (TensorFlow's
default inter-op threads).
"""

import os
import sys

os.environ["TF_NUM_INTEROP_THREADS"] = "0"  # TensorFlow's default: the overlap and the update are measured
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT = "STEP_SHARE_ROW "
PARTS = ("forward", "backward", "loss", "update", "other")


def child(name: str, root: str, batch: int, plan: str, steps: int) -> dict:
    """One model's row in this process, with the tfremat of checkout ``root``."""
    sys.path[:0] = [os.path.join(ROOT, "tests"), HERE, root]
    import keras

    import conformance
    import tfremat.extract.extractor as extractor
    import tfremat.extract.overlap as overlap
    from tfremat.measure import measure_model

    extractions, overlap_seconds, traces = [], [], []
    extract, measure_overlap = extractor.extract, extractor.measure_plain_overlap

    def kept(*args, **kwargs):
        extractions.append(extract(*args, **kwargs))
        return extractions[-1]

    def timed_overlap(*args):
        began = time.perf_counter()
        try:
            return measure_overlap(*args)
        finally:
            overlap_seconds.append(time.perf_counter() - began)

    extractor.extract, extractor.measure_plain_overlap = kept, timed_overlap
    step_trace = getattr(overlap, "_StepTrace", None)
    if step_trace is not None:
        init = step_trace.__init__

        def remembered(self, *args):
            init(self, *args)
            traces.append(self)

        step_trace.__init__ = remembered
    model = conformance.build(name)
    model.compile(optimizer=keras.optimizers.Adam(), loss="categorical_crossentropy")
    strategy, budget = plan.split(":")
    started = time.perf_counter()
    row = measure_model(model, budget, batch_size=batch, strategy=strategy, steps=steps, cache=False, verbose=0)
    extraction = extractions[0]
    total = extraction.graph.total_cost
    parts = {part: 1e3 * traces[0].least.get(part, 0.0) for part in PARTS} if traces else {}
    return {"model": name, "root": root, "load": round(os.getloadavg()[0], 1), "costs_ms": 1e3 * total,
            "step_ms": 1e3 * extraction.plain_step_seconds, "update_ms": 1e3 * extraction.plain_update_seconds,
            "share": row["step_share"], "overhead": row["predicted_overhead"], "overlap": row["plain_overlap"],
            "predicted": row["predicted_time_over_plain"], "measured": row["time_over_plain"],
            "overlap_s": overlap_seconds[0], "extract_s": extraction.seconds, "parts_ms": parts,
            "seconds": time.perf_counter() - started}


def _row(r: dict, labels: dict) -> str:
    parts = r["parts_ms"]
    nodes = sum(parts.get(p, 0.0) for p in ("forward", "backward", "loss"))
    traced = ("| " + " | ".join(f"{parts[p]:.2f}" for p in PARTS) + f" | {nodes / r['costs_ms']:.2f} | "
              f"{nodes / sum(parts.values()):.3f} |") if parts else "| " + " | ".join("-" * 7) + " |"
    return (f"| {r['model']} | {labels[r['root']]} | {r['load']} | {r['costs_ms']:.1f} | {r['step_ms']:.1f} | "
            f"{r['update_ms']:.2f} | {r['share']:.3f} | {r['overhead']:+.3f} | {r['overlap']:.3f} | "
            f"{r['predicted']:.3f} | {r['measured']:.3f} | {r['measured'] / r['predicted']:.3f} | "
            f"{r['overlap_s']:.1f} | {r['extract_s']:.1f} {traced}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2_hub,transformer_encoder,convmixer,MobileNetV2")
    parser.add_argument("--roots", default=ROOT, help="comma-separated tfremat checkouts, run in turns")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per model and checkout")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--plan", default="chen_sqrtn:50% of activations", help="strategy:budget")
    parser.add_argument("--steps", type=int, default=40, help="rounds of planned and plain steps")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row = child(args.child, args.root, args.batch, args.plan, args.steps)
        sys.stdout.write(RESULT + json.dumps(row) + "\n")
        return
    sys.path.insert(0, HERE)
    from provenance import header, load_line, write_report

    roots = [os.path.abspath(root) for root in args.roots.split(",")]
    labels = {root: _describe(root) for root in roots}
    rows = []
    for _ in range(args.repeats):
        for name in args.models.split(","):
            for root in roots:
                found = subprocess.run([sys.executable, __file__, "--child", name, "--root", root, "--batch",
                                        str(args.batch), "--plan", args.plan, "--steps", str(args.steps)],
                                       capture_output=True, text=True)
                lines = [line for line in found.stdout.splitlines() if line.startswith(RESULT)]
                if not lines:
                    sys.stderr.write(found.stderr[-3000:])
                    continue
                rows.append(json.loads(lines[-1][len(RESULT):]))
                sys.stderr.write(json.dumps(rows[-1]) + "\n")
    text = "\n".join([
        header(argv), "", f"Batch {args.batch}, Adam, plan `{args.plan}`, {args.steps} rounds in turns, inter-op "
        "threads 0 (TensorFlow's default); one fresh process per row, uncached. Checkouts: "
        + ", ".join(f"`{label}` = {root}" for root, label in labels.items()) + ". Parts: least ms per part of "
        "the traced plain step; nodes/costs = (forward + backward + loss) / costs; nodes/traced = their share "
        "of the traced step.", "",
        "| model | checkout | load | costs ms | S ms | U ms | share | overhead | overlap | predicted | measured | "
        "measured/predicted | overlap s | extract s | " + " | ".join(f"{p} ms" for p in PARTS)
        + " | nodes/costs | nodes/traced |",
        "|" + "---|" * 21,
        *(_row(r, labels) for r in rows),
        "", load_line()])
    write_report(text, args.out)


def _describe(root: str) -> str:
    """The checkout's commit (and ``-dirty`` with uncommitted changes), or its folder's name
    outside git (an exported tree)."""
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.split()
    if len(commit) < 2 or os.path.realpath(commit[0]) != os.path.realpath(root):
        return os.path.basename(root)
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return commit[1] + ("-dirty" if dirty else "")


if __name__ == "__main__":
    main()
