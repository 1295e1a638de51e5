"""Profile agreement (issue 33 item 3): one model profiled twice on the same machine.

For each model the graph is extracted twice with ``cost_model="profile"`` and no profile
cache, in one process. Reported: the relative difference of each node's cost between the
two profiles (``|a - b| / min(a, b)``; median, 90th percentile and worst, over all nodes
and over the large nodes: the fewest, largest first, that make half the step), the largest difference as a share of the
step (what moves a plan), the ratio of the two steps' total costs, the profiling seconds,
whether ``optimal`` at 60% of activations picks the same schedule from both graphs, and
the share of the checkpoint-all peak that ``"min"`` resolves to on each. The large nodes are
also compared by their shares of each profile's step, which a load that slows a whole
profile does not move.

Run: ``python benchmarks/profile_agreement.py`` (writes
``benchmarks/results/profile_agreement.md``; ``--only`` takes model names, comma separated,
and then needs ``--out``; ``--passes 1 --window 0.1`` times as before the timing passes, and
then also needs ``--out``). TensorFlow's default inter-op threads: the calls are profiled on
its single-threaded executor, as the compiled step runs (``tfremat.extract.analysis._step_executor``).
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

import conformance  # noqa: E402
import models  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.extract import call_timing, extract  # noqa: E402
from tfremat.planner import plan_graph  # noqa: E402

logger = logging.getLogger("benchmarks.profile_agreement")

DEFAULT_OUT = os.path.join(HERE, "results", "profile_agreement.md")
TEST_MODELS = ("vgg_block_net", "token_mlp_net")  # tests/models.py, batch 8
CONFORMANCE_MODELS = ("transformer_encoder", "vit", "bilstm_text", "convmixer")  # batch 2
LARGE_SHARE = 0.5  # the large nodes: the fewest, largest first, whose costs make this share of the step
BUDGET = "60% of activations"
# How a profiled call is timed on CPU: from TensorFlow's trace (the library's way), or its
# least wall seconds from Python, less those of a call that computes nothing (before it):
# whether a timing is traced (call_timing._Timing.traced).
TIMERS = {"trace": call_timing._Timing.traced, "wall": False}


def build(name):
    """The model and a batch: a test model at batch 8, or a conformance model at its batch."""
    if name in TEST_MODELS:
        model = getattr(models, name)()
        x = tf.random.stateless_normal((8, *model.input.shape[1:]), seed=(0, 1))
        y = tf.one_hot(tf.range(8) % model.output.shape[-1], model.output.shape[-1])
        return model, (x, y)
    model = conformance.build(name)
    return model, conformance.sample_batch(model, conformance.BATCH)


def plan_facts(graph, time_limit):
    """The schedule ``optimal`` picks at :data:`BUDGET` (R and S as arrays, or why none)
    and the share of the checkpoint-all peak that ``"min"`` resolves to."""
    facts = {}
    for key, budget in (("schedule", BUDGET), ("min", "min")):
        try:
            result = plan_graph(graph, budget, "optimal", cache=False, verbose=0, time_limit=time_limit)
        except (InfeasibleBudgetError, SolverTimeLimitError) as error:
            facts[key] = type(error).__name__
            continue
        facts[key] = result.schedule if key == "schedule" else result.budget_bytes / result.checkpoint_all_peak_bytes
    return facts


def cross_costs(graphs, schedules):
    """How much each profile's schedule costs more than the other's, both costed under the other
    profile's costs (``cost_b(schedule_a) / cost_b(schedule_b) - 1`` and the same the other way):
    what a user pays for a schedule chosen on one profile when the other was right. None when
    either profile has no schedule."""
    if any(isinstance(s, str) for s in schedules):
        return None
    (a, b), (schedule_a, schedule_b) = graphs, schedules
    return (schedule_a.cost(b) / schedule_b.cost(b) - 1, schedule_b.cost(a) / schedule_a.cost(a) - 1)


def agreement(name, time_limit, timer="trace"):
    """One row: ``name`` profiled twice with ``timer`` (see :data:`TIMERS`)."""
    traced = call_timing._Timing.traced
    call_timing._Timing.traced = TIMERS[timer]
    try:
        return _agreement(name, time_limit) | {"timer": timer}
    finally:
        call_timing._Timing.traced = traced


def _agreement(name, time_limit):
    model, batch = build(name)
    graphs, seconds = [], []
    load = os.getloadavg()[0]
    for _ in range(2):
        extraction = extract(model, batch, cost_model="profile", use_cache=False)
        graphs.append(extraction.graph)
        seconds.append(extraction.profile_seconds)
    a, b = (np.asarray(g.cost, dtype=float) for g in graphs)
    rel = np.abs(a - b) / np.maximum(np.minimum(a, b), 1e-12)
    # The same on shares of each profile's step: what the solvers see (their choices do not
    # change when every cost is scaled by one factor, as a load that slows a whole profile does).
    share_a, share_b = a / a.sum(), b / b.sum()
    rel_share = np.abs(share_a - share_b) / np.maximum(np.minimum(share_a, share_b), 1e-12)
    order = np.argsort(-a)
    large = np.zeros(len(a), bool)
    large[order[:int(np.searchsorted(np.cumsum(a[order]), LARGE_SHARE * a.sum())) + 1]] = True
    plans = [plan_facts(g, time_limit) for g in graphs]
    schedules = [p["schedule"] for p in plans]
    same = schedules[0] == schedules[1] if isinstance(schedules[0], str) else (
        not isinstance(schedules[1], str)
        and all(np.array_equal(p, q) for p, q in ((schedules[0].R, schedules[1].R), (schedules[0].S, schedules[1].S))))
    mins = [p["min"] if isinstance(p["min"], str) else f"{100 * p['min']:.1f}%" for p in plans]
    row = {
        "model": name, "nodes": len(a), "median": np.median(rel), "p90": np.quantile(rel, 0.9), "worst": rel.max(),
        "worst_node": graphs[0].names[int(rel.argmax())], "large": int(large.sum()),
        "large_median": np.median(rel[large]), "large_worst": rel[large].max(),
        "share_median": np.median(rel_share[large]), "share_worst": rel_share[large].max(),
        "step_share": (np.abs(a - b) / a.sum()).max(), "totals": b.sum() / a.sum(), "seconds": seconds,
        "same_schedule": same, "cross": cross_costs(graphs, schedules), "min": mins, "load": (load, os.getloadavg()[0]),
    }
    logger.info("%s: %s", name, row)
    return row


def _cross_cell(cross) -> str:
    return "-" if cross is None else f"{100 * cross[0]:+.2f}% / {100 * cross[1]:+.2f}%"


def render(rows, argv):
    lines = [
        "# Profile agreement",
        "",
        header(argv),
        "",
        "Each model profiled twice in one process (`cost_model=\"profile\"`, no cache). `rel`: "
        "`|a - b| / min(a, b)` per node; `large`: the fewest nodes, largest first, that make "
        f"{100 * LARGE_SHARE:.0f}% of the step; `step`: the largest `|a - b|` as a share of the step; "
        "`totals`: second step's total cost over the first's; `schedule`: `optimal` at "
        f"{BUDGET} picks the same R and S from both; `cross`: each profile's schedule costed under the other "
        "profile's costs, over the other's own schedule, less 1 (first's schedule, second's): what choosing on the "
        "wrong profile costs; `large shares`: `rel` of the large nodes' "
        "shares of their profile's step (the solvers' choices do not change when every cost is scaled by "
        "one factor); `min`: the share of the checkpoint-all peak "
        "`\"min\"` resolves to, first and second profile; `load`: the 1-minute load average "
        "when the row started and finished (2 cores, shared with other jobs). Timing: every call timed in "
        f"{call_timing._TIMING_PASSES} passes of at least {call_timing._MIN_TIMING_SECONDS:g} s over all the calls, "
        f"then {2 * call_timing._TIMING_PASSES} more over the calls making {100 * call_timing._LARGE_CALLS_SHARE:.0f}% "
        "of the timed seconds, each timed function keeping the mean of its least half of the passes "
        "(`tfremat.extract.call_timing.timing_passes`); `timer`: "
        "`trace` reads each call's seconds off TensorFlow's profiler trace (`tfremat.extract.timing`, the "
        "library's), `wall` times it from Python less a call that computes nothing (before the trace). "
        "TensorFlow's default inter-op threads, so every call is traced and run on its single-threaded "
        "executor, as the step runs.",
        "",
        "| model | timer | nodes | rel median | rel p90 | rel worst (node) | large | large median | large worst "
        "| large shares median / worst | step | totals | profile s | schedule | cross | min | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['timer']} | {r['nodes']} | {100 * r['median']:.1f}% | {100 * r['p90']:.1f}% | "
            f"{100 * r['worst']:.0f}% ({r['worst_node']}) | {r['large']} | {100 * r['large_median']:.1f}% | "
            f"{100 * r['large_worst']:.1f}% | {100 * r['share_median']:.1f}% / {100 * r['share_worst']:.1f}% | "
            f"{100 * r['step_share']:.1f}% | {r['totals']:.3f} | "
            f"{r['seconds'][0]:.1f} / {r['seconds'][1]:.1f} | {'same' if r['same_schedule'] else 'differs'} | "
            f"{_cross_cell(r['cross'])} | "
            f"{r['min'][0]} / {r['min'][1]} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="model names, comma separated")
    parser.add_argument("--time_limit", type=float, default=20.0, help="seconds per optimal solve")
    parser.add_argument("--passes", type=int, default=None,
                        help=f"timing passes per extraction (default {call_timing._TIMING_PASSES}; 1: one window per call)")
    parser.add_argument("--window", type=float, default=None,
                        help=f"least seconds of one timing window (default {call_timing._MIN_TIMING_SECONDS:g})")
    parser.add_argument("--timers", default="trace",
                        help="timers to compare, comma separated, each model profiled with each in turns: trace "
                             "(TensorFlow's trace, the library's), wall (Python wall seconds less a call that "
                             "computes nothing, as before)")
    parser.add_argument("--out", default=None, help=f"markdown file to write (default {DEFAULT_OUT}; "
                        "required with --only)")
    args = parser.parse_args(argv)
    timers = args.timers.split(",")
    if any(t not in TIMERS for t in timers):
        parser.error(f"--timers takes {', '.join(TIMERS)}, got {args.timers!r}")
    if (any(v is not None for v in (args.only, args.passes, args.window)) or timers != ["trace"]) and args.out is None:
        parser.error(f"--only, --passes, --window and --timers need --out "
                     f"(the default {DEFAULT_OUT} holds the defaults)")
    if args.passes is not None:
        call_timing._TIMING_PASSES = args.passes
    if args.window is not None:
        call_timing._MIN_TIMING_SECONDS = args.window
    names = args.only.split(",") if args.only else [*TEST_MODELS, *CONFORMANCE_MODELS]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    text = render([agreement(name, args.time_limit, timer) for name in names for timer in timers], argv)
    out = args.out or DEFAULT_OUT
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
