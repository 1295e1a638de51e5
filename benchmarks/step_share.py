"""How steady the step share is, before and after (issue 33 item 2, ``PlanResult.step_share``).

The predicted time over plain is ``(1 + overhead * step_share) * plain_overlap``. Before:
``step_share = min(1, total_cost / S)``, S the plain step's least run from Python over the
overlap's rounds; after: ``total_cost / (total_cost + U)``, U the optimizer update's least
traced seconds (:class:`tfremat.extract.overlap._UpdateTiming`). Each row is a fresh process:
an uncached extraction and plan through :func:`tfremat.measure.measure_model` (Adam), whose
planned and plain steps are timed in turns in that process; both shares come from the same
extraction, so before and after see the same costs, overlap and measured time.

Run: ``python benchmarks/step_share.py --models transformer_encoder,gpt2_hub,convmixer --repeats 2
--out benchmarks/results/step_share.md`` (TensorFlow's default inter-op threads).
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


def child(name: str, batch: int, plan: str, steps: int) -> dict:
    """One model's row in this process."""
    sys.path[:0] = [os.path.join(ROOT, "tests"), HERE, ROOT]
    import keras

    import conformance
    import tfremat.extract.extractor as extractor
    from tfremat.measure import measure_model

    extractions = []
    extract = extractor.extract

    def kept(*args, **kwargs):
        extractions.append(extract(*args, **kwargs))
        return extractions[-1]

    extractor.extract = kept
    model = conformance.build(name)
    model.compile(optimizer=keras.optimizers.Adam(), loss="categorical_crossentropy")
    strategy, budget = plan.split(":")
    started = time.perf_counter()
    row = measure_model(model, budget, batch_size=batch, strategy=strategy, steps=steps, cache=False, verbose=0)
    extraction = extractions[0]
    total = extraction.graph.total_cost
    step, update = extraction.plain_step_seconds, extraction.plain_update_seconds
    overlap = row["plain_overlap"]
    before = min(1.0, total / step)
    after = total / (total + update)
    return {"model": name, "load": round(os.getloadavg()[0], 1), "costs_ms": 1e3 * total, "step_ms": 1e3 * step,
            "update_ms": 1e3 * update, "share_before": before, "share_after": after,
            "overhead": row["predicted_overhead"], "overlap": overlap,
            "predicted_before": (1 + row["predicted_overhead"] * before) * overlap,
            "predicted_after": row["predicted_time_over_plain"], "measured": row["time_over_plain"],
            "extract_s": extraction.seconds, "seconds": time.perf_counter() - started}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer_encoder,gpt2_hub,convmixer")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per model, in turns")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--plan", default="chen_sqrtn:50% of activations", help="strategy:budget")
    parser.add_argument("--steps", type=int, default=40, help="rounds of planned and plain steps")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.stdout.write(RESULT + json.dumps(child(args.child, args.batch, args.plan, args.steps)) + "\n")
        return
    sys.path.insert(0, HERE)
    from provenance import header, load_line, write_report

    rows = []
    for _ in range(args.repeats):
        for name in args.models.split(","):
            found = subprocess.run([sys.executable, __file__, "--child", name, "--batch", str(args.batch), "--plan",
                                    args.plan, "--steps", str(args.steps)], capture_output=True, text=True)
            lines = [line for line in found.stdout.splitlines() if line.startswith(RESULT)]
            if not lines:
                sys.stderr.write(found.stderr[-3000:])
                continue
            rows.append(json.loads(lines[-1][len(RESULT):]))
            sys.stderr.write(json.dumps(rows[-1]) + "\n")
    text = "\n".join([
        header(argv), "", f"Batch {args.batch}, Adam, plan `{args.plan}`, {args.steps} rounds in turns, inter-op "
        "threads 0 (TensorFlow's default); one fresh process per row, uncached.", "",
        "| model | load | costs ms | plain step ms (S) | update ms (U) | share before | share after | overhead | "
        "overlap | predicted before | predicted after | measured | measured/before | measured/after | extract s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['model']} | {r['load']} | {r['costs_ms']:.1f} | {r['step_ms']:.1f} | {r['update_ms']:.2f} | "
          f"{r['share_before']:.3f} | {r['share_after']:.3f} | {r['overhead']:+.3f} | {r['overlap']:.3f} | "
          f"{r['predicted_before']:.3f} | {r['predicted_after']:.3f} | {r['measured']:.3f} | "
          f"{r['measured'] / r['predicted_before']:.3f} | {r['measured'] / r['predicted_after']:.3f} | "
          f"{r['extract_s']:.1f} |" for r in rows),
        "", load_line()])
    write_report(text, args.out)


if __name__ == "__main__":
    main()
