"""Fidelity: what the plan predicts against what the compiled step does (issue 33 item 5).

For each conformance model (:mod:`conformance`: the ``keras.applications`` constructors, the
user-style models and, with keras-hub installed, GPT-2 and BERT backbones built from their
configs with random weights) at checkpoint-all and at 60% and 40% of activations
(``optimal``), :func:`tfremat.measure.measure_model` plans, compiles and runs the step:
the predicted peak against the bytes the step requests and the allocator's peak, and the
predicted time over plain (1 + overhead) against the measured one, timed in turns with
plain steps (median per-round ratio, quartiles beside it). A budget no schedule meets is
a row that says so.

Run: ``python benchmarks/fidelity.py`` (writes ``benchmarks/results/fidelity.md``; ``--only``
takes model names, exact, or substrings, comma separated, and then needs ``--out``).
``--batch`` and ``--image_size`` change the conformance batch and the applications' input
(never below an application's smallest); ``--explain`` logs, for each row requesting more
than 1.02x its prediction, :func:`tfremat.measure.explain_requested_peak`'s account: the
statement at the requested peak and the nodes whose live buffers differ most from the
simulator's at that statement.

``--threads default`` runs with TensorFlow's default inter-op threads (``TF_NUM_INTEROP_THREADS=0``;
the default is one), where the planned time includes the plain overlap (:mod:`tfremat.extract.overlap`).
``--plans`` replaces the three plans with ``strategy:budget`` pairs (comma separated; e.g.
``optimal:50%,monet:50%``); ``--mixed`` builds the models under Keras's ``mixed_float16``
policy. Besides the conformance models, ``--only`` takes ``llama_hub`` (keras-hub
LlamaBackbone at the GPT-2/BERT sizes) and ``token_mlp_net`` (tests/models.py; the layers
whose ``monet`` alternatives differ).
"""

import os
import sys

if "--threads=default" in sys.argv or any(a == "--threads" and b == "default" for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ["TF_NUM_INTEROP_THREADS"] = "0"  # TensorFlow's default; read when TensorFlow is imported
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import logging  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

import conformance  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.measure import measure_model  # noqa: E402

logger = logging.getLogger("benchmarks.fidelity")

DEFAULT_OUT = os.path.join(HERE, "results", "fidelity.md")
PLANS = (("checkpoint_all", "100%"), ("optimal", "60% of activations"), ("optimal", "40% of activations"))
MiB = 2**20


EXPLAIN_ABOVE = 1.02  # requested over predicted above which --explain accounts for the peak
EXTRA_MODELS = ("llama_hub", "token_mlp_net")  # run only when --only names them


def _llama_hub(seq_len=64, layers_count=2, hidden=64, heads=2):
    """keras-hub's LlamaBackbone at the conformance GPT-2/BERT sizes, with their head."""
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=conformance.VOCAB, num_layers=layers_count, num_query_heads=heads,
        num_key_value_heads=heads, hidden_dim=hidden, intermediate_dim=hidden * 4)
    return conformance._hub_backbone_head(backbone, seq_len)


def parse_plans(text: str) -> tuple[tuple[str, str], ...]:
    """``"optimal:50%,monet:50%"`` as ``(("optimal", "50%"), ("monet", "50%"))``."""
    plans = []
    for item in text.split(","):
        strategy, sep, budget = item.partition(":")
        if not sep or not strategy or not budget:
            raise ValueError(f"--plans item {item!r} is not strategy:budget (e.g. optimal:50%)")
        plans.append((strategy.strip(), budget.strip()))
    return tuple(plans)


def build(name: str, image_size: int | None):
    """The conformance model ``name``; an application at ``image_size`` (at least its smallest)."""
    import keras

    if name == "llama_hub":
        keras.utils.set_random_seed(0)
        return _llama_hub()
    if name == "token_mlp_net":
        import models

        return models.token_mlp_net(tokens=64, width=64)
    if image_size is None or name not in conformance.APPLICATIONS:
        return conformance.build(name)
    keras.utils.set_random_seed(0)
    size = max(image_size, conformance.APPLICATION_SIZES.get(name, 32))
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=conformance.CLASSES)


def measure_rows(name: str, steps: int, time_limit: float, batch: int = conformance.BATCH,
                 image_size: int | None = None, explain: bool = False, plans=PLANS, mixed: bool = False) -> list[dict]:
    """One row per ``(strategy, budget)`` of ``plans`` for the model ``name`` (under
    ``mixed_float16`` when ``mixed``)."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16" if mixed else "float32")
    try:
        model = build(name, image_size)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    size = model.inputs[0].shape[1] if name in conformance.APPLICATIONS else None
    label = (name if size is None else f"{name} {size}x{size}") + (" fp16" if mixed else "")
    rows = []
    for strategy, budget in plans:
        row = {"model": label, "strategy": strategy, "budget": budget}
        options = {"time_limit": time_limit} if strategy in ("optimal", "monet") else {}
        try:
            row.update(measure_model(model, budget, batch_size=batch, strategy=strategy, steps=steps,
                                     verbose=0, explain=explain, **options))
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            row["error"] = conformance.first_line(error)
        explained = row.pop("requested_explained", None)
        row["model"] = label
        logger.info("%s", row)
        if explained and row["requested_over_predicted"] > EXPLAIN_ABOVE:
            logger.info("requested peak of %s %s at %s: %s", row["model"], budget, explained.pop("at"), explained)
        rows.append(row)
    return rows


def _cells(row: dict) -> str:
    if "error" in row:
        return f"| {row['model']} | {row['strategy']} | {row['budget']} | | | | | | | | | | {row['error'][:240]} |"
    predicted = row["predicted_peak_bytes"]
    planned = row["predicted_time_over_plain"]
    low, high = row["time_over_plain_quartiles"]
    return (f"| {row['model']} | {row['strategy']} | {row['budget']} | {predicted / MiB:.2f} | "
            f"{row['requested_over_predicted']:.3f} | {row['measured_over_predicted']:.3f} | "
            f"{row['measured_peak_bytes'] / row['budget_bytes']:.3f} | {row['plain_overlap']:.3f} | {planned:.3f} | "
            f"{row['time_over_plain']:.3f} ({low:.2f}-{high:.2f}) | {row['time_over_plain'] / planned:.3f} | "
            f"{row['time_over_plain'] / (1 + row['predicted_overhead']):.3f} | "
            f"{_notes(row)} |")


def _notes(row: dict) -> str:
    """The gradients' verdict, the chosen implementations that change rounding with
    their measured gradient error (``measure_model``'s ``inexact_implementations``), and
    the gradients the step rebuilds by repeating forward work the plan does not count."""
    notes = [] if row["gradients_match"] in (True, None) else ["gradients differ"]
    notes += [f"{r['implementation']} x{len(r['nodes'])}: {r['grad_error']:.1e}"
              for r in row.get("inexact_implementations") or ()]
    if row.get("costly_vjp_rebuilds"):
        notes.append(f"{row['costly_vjp_rebuilds']} gradients rebuilt by repeating forward work")
    return "; ".join(notes)


def render(rows: list[dict], argv, batch: int = conformance.BATCH) -> str:
    measured = [r for r in rows if "error" not in r]
    worst = []
    for key, label in (("requested_over_predicted", "requested / predicted"),
                       ("measured_over_predicted", "allocator / predicted")):
        if measured:
            top = max(measured, key=lambda r: r[key])
            worst.append(f"- Worst {label}: {top[key]:.3f}, {top['model']} {top['strategy']} at {top['budget']}.")
    if measured:
        top = max(measured, key=lambda r: abs(r["time_over_plain"] / r["predicted_time_over_plain"] - 1))
        worst.append(f"- Furthest time from the plan: {top['time_over_plain'] / top['predicted_time_over_plain']:.3f} "
                     f"of it, {top['model']} {top['strategy']} at {top['budget']}.")
    return "\n".join([
        "# Fidelity: predicted against measured",
        "",
        header(argv),
        "",
        f"Batch {batch}, SGD, categorical cross-entropy, `cost_model=\"profile\"`, CPU "
        "(2 cores shared with other jobs: time ratios are per-round ratios of steps timed in turns "
        "with plain steps, quartiles in brackets). `req/pred`: bytes the step requests over the "
        "prediction; `alloc/pred`: the allocator's peak over the prediction; `alloc/budget`: over "
        "the budget; `overlap`: the plain overlap (plain step on the single-threaded executor over the "
        "default one; 1 with one inter-op thread); `planned`: (1 + predicted overhead) x overlap; "
        "`time/plain`: measured; `time/planned`: measured over planned; `time/(1+ovh)`: measured over "
        "1 + predicted overhead (the plan without the overlap). Inter-op threads: "
        f"{os.environ.get('TF_NUM_INTEROP_THREADS', 'default')} (0: TensorFlow's default).",
        "",
        *worst,
        "",
        "| model | strategy | budget | predicted MiB | req/pred | alloc/pred | alloc/budget | overlap | planned "
        "| time/plain | time/planned | time/(1+ovh) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_cells(r) for r in rows),
        "",
        "Load average over the last 1 / 5 / 15 minutes when the table was written: "
        + " / ".join(f"{load:.1f}" for load in os.getloadavg()) + f" on {os.cpu_count()} CPUs.",
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="model names or substrings, comma separated")
    parser.add_argument("--steps", type=int, default=7, help="timed rounds per measurement")
    parser.add_argument("--time_limit", type=float, default=30.0, help="seconds per optimal solve")
    parser.add_argument("--batch", type=int, default=conformance.BATCH, help="batch size")
    parser.add_argument("--image_size", type=int, default=None,
                        help="the applications' input side (default: the smallest each accepts)")
    parser.add_argument("--plans", type=parse_plans, default=PLANS,
                        help="strategy:budget pairs, comma separated (default: checkpoint_all:100%%, optimal at "
                        "60%% and 40%% of activations)")
    parser.add_argument("--threads", choices=("one", "default"), default="one",
                        help="inter-op threads: one (TF_NUM_INTEROP_THREADS=1, unless set) or TensorFlow's default "
                        "(read before TensorFlow is imported)")
    parser.add_argument("--mixed", action="store_true", help="build the models under mixed_float16")
    parser.add_argument("--explain", action="store_true",
                        help=f"log the account of each requested peak above {EXPLAIN_ABOVE}x its prediction")
    parser.add_argument("--out", default=None, help=f"markdown file to write (default {DEFAULT_OUT}; "
                        "required with --only)")
    args = parser.parse_args(argv)
    if args.only is not None and args.out is None:
        parser.error(f"--only runs some models only; give --out (the default {DEFAULT_OUT} holds all of them)")
    names = conformance.model_names()
    if args.only:
        wanted = args.only.split(",")
        # An exact model name means that model only (ResNet50, not also ResNet50V2).
        names = [n for n in names if any(w == n or (w not in names and w in n) for w in wanted)]
        names += [n for n in EXTRA_MODELS if n in wanted]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    out = args.out or DEFAULT_OUT
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for name in names:
        rows += measure_rows(name, args.steps, args.time_limit, args.batch, args.image_size, args.explain,
                             args.plans, args.mixed)
        text = render(rows, argv, args.batch)
        with open(out, "w") as f:  # after every model: a run cut short keeps what it measured
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
