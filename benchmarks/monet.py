"""MONeT benchmark: the smallest peak within a compute-overhead cap, ``monet`` against ``optimal``.

MONeT (Shah et al. 2021) chooses each layer's operator implementation (a ReLU's sign mask,
a max pooling's window index, regenerated dropout, output-activated batch norm, a GELU or
layer norm recomputed inside its backward) together with the checkpoints, on a graph whose
convolution and Dense backward nodes are split into weight and input gradients; ``optimal`` (Checkmate) chooses the checkpoints with every layer's own
implementation. For each model and each overhead cap (a share of the no-remat cost,
``graph.total_cost``), each strategy's budget is searched by bisection on bytes, between
the proven memory lower bound and the checkpoint-all peak: a schedule is accepted when
its cost is at most ``(1 + cap) * graph.total_cost``, and the smallest simulated peak of
an accepted schedule is the answer. Every solve of a strategy on a model is kept, so the
caps share them (a failed solve bounds the search of every tighter cap). The chosen
schedules are compiled and run: predicted peak (the simulator), the step's requested
bytes and the BFC allocator's peak, and the median step time against plain Keras training
(``model.train_on_batch``) in the same process.

Run: ``python benchmarks/monet.py`` (writes ``benchmarks/results/monet.md``); ``--quick``
runs one small model at two caps with short solves and writes nothing unless ``--out`` is
given. ``--monet-stand-in checkpoint_all_lean`` replaces ``monet`` by checkpoint-all with
every node's leanest implementation, for trying the script without the ``monet`` strategy.
Ops run one at a time (``TF_NUM_INTEROP_THREADS=1``), the execution the simulator models.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the test models
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from models import small_convnet, token_mlp_net, unet, vgg_block_net  # noqa: E402
from provenance import header  # noqa: E402
from training_case import training_batch  # noqa: E402

from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError, failure_status  # noqa: E402
from tfremat.extract import extract  # noqa: E402
from tfremat.ilp.formulation import memory_lower_bound  # noqa: E402
from tfremat.ilp.monet import leanest_implementations  # noqa: E402
from tfremat.plan import simulate  # noqa: E402
from tfremat.plan.schedule import Schedule  # noqa: E402
from tfremat.plan.simulator import checkpoint_all_peak  # noqa: E402
from tfremat.static_graph import compile_step, measure_step_peak  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402

logger = logging.getLogger("benchmarks.monet")

MiB = 2**20
DEFAULT_OUT = os.path.join(HERE, "results", "monet.md")
CAPS = (0.0, 0.05, 0.10, 0.20)
QUICK_CAPS = (0.0, 0.10)
QUICK_MODELS = ("small_convnet",)
QUICK_TIME_LIMIT = 5.0
DEFAULT_TIME_LIMIT = 20.0
RESNET50_TIME_LIMIT = 60.0
STAND_INS = ("checkpoint_all_lean",)
# Float rounding of summed profiled costs must not turn a no-recomputation schedule away at 0%.
COST_SLACK = 1e-9


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmarked model: its label in the tables, a builder, the batch size, and the
    seconds per solve when ``--time-limit`` is not given (None: the default)."""

    label: str
    build: object
    batch: int
    time_limit: float | None = None


def resnet50():
    keras.utils.set_random_seed(0)
    return keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)


MODELS = {
    "small_convnet": Model("small_convnet, 32 ch (64x64, batch 16)",
                           lambda: small_convnet(input_shape=(64, 64, 3), channels=32), 16),
    "vgg_block_net": Model("vgg_block_net, 16 ch (64x64, batch 32)",
                           lambda: vgg_block_net(input_shape=(64, 64, 3), channels=16), 32),
    "unet": Model("unet depth 3, base 16 (64x64, batch 8)",
                  lambda: unet(input_shape=(64, 64, 3), base=16, depth=3), 8),
    # 20 s per solve leaves monet's three warm starts (half the limit) a few seconds each.
    "resnet50": Model("ResNet50 (64x64, batch 8)", resnet50, 8, time_limit=RESNET50_TIME_LIMIT),
    "token_mlp_net": Model("token_mlp_net, 128 tokens x 128 (batch 32)",
                           lambda: token_mlp_net(tokens=128, width=128), 32),
}


@dataclasses.dataclass(frozen=True)
class Solve:
    """One strategy call at one budget: the schedule (None when it had none), its cost and
    simulated peak, the solver status, whether the time limit stopped it, and its seconds."""

    budget: int
    schedule: Schedule | None
    cost: float | None
    peak: int | None
    status: str
    hit_limit: bool
    seconds: float


@dataclasses.dataclass(frozen=True)
class Search:
    """A strategy's answer at one cap: the accepted solve with the smallest peak (None: no
    schedule within the cap), the bracket the bisection ended with, and the solves it made."""

    best: Solve | None
    lower: int
    solves: int
    at_limit: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Run:
    """A chosen schedule compiled and run: requested and allocator peaks, median seconds."""

    requested: int
    allocator: int
    seconds: float


def make_strategy(name, graph, time_limit, mip_gap, threads):
    """``budget -> Schedule`` for ``name``: ``optimal``, ``monet`` or a stand-in for ``monet``."""
    if name == "checkpoint_all_lean":
        lean = leanest_implementations(graph)
        return lambda budget: get_strategy("checkpoint_all")(graph, budget, implementations=lean)
    strategy = get_strategy(name)
    return lambda budget: strategy(graph, budget, time_limit=time_limit, mip_gap=mip_gap, threads=threads)


def solve(run, graph, budget):
    """``run(budget)`` as a :class:`Solve`; a strategy with no schedule at the budget gives one without."""
    began = time.perf_counter()
    try:
        schedule = run(budget)
    except (InfeasibleBudgetError, SolverTimeLimitError) as error:  # outcomes at this budget, not faults
        return Solve(budget, None, None, None, failure_status(error), False, time.perf_counter() - began)
    facts = schedule.facts
    status = str(facts.status) if facts is not None else "heuristic"
    return Solve(budget, schedule, schedule.cost(graph), simulate(graph, schedule).peak_bytes, status,
                 status == "time_limit", time.perf_counter() - began)


def search_caps(run, graph, caps, lower, upper, tolerance, max_solves):
    """The smallest peak within each cap, by bisection on the budget in ``(lower, upper]``.

    The loosest cap goes first; every solve is kept, so a budget that failed a looser cap
    starts a tighter one's bracket, and an accepted schedule's peak (at most its budget)
    closes it from above.
    """
    solves: dict[int, Solve] = {}

    def at(budget):
        if budget not in solves:
            solves[budget] = solve(run, graph, budget)
            s = solves[budget]
            logger.info("    budget %.2f MiB: %s, cost %s, peak %s, %.1f s", budget / MiB, s.status,
                        "-" if s.cost is None else f"{s.cost / graph.total_cost - 1:+.2%}",
                        "-" if s.peak is None else f"{s.peak / MiB:.2f} MiB", s.seconds)
        return solves[budget]

    at(upper)
    results, made = {}, 0
    for cap in sorted(caps, reverse=True):
        limit = (1 + cap) * graph.total_cost * (1 + COST_SLACK)
        accepted = [s for s in solves.values() if _fits(s, limit)]
        best = min(accepted, key=lambda s: (s.peak, s.cost), default=None)
        hi = best.peak if best is not None else upper
        lo = max([s.budget for s in solves.values() if not _fits(s, limit) and s.budget < hi], default=lower)
        while best is not None and hi - lo > tolerance and len(solves) - made < max_solves:
            s = at((lo + hi) // 2)
            if _fits(s, limit):
                if (s.peak, s.cost) < (best.peak, best.cost):
                    best = s
                hi = min(hi, s.peak, s.budget)
            else:
                lo = s.budget
        tried = list(solves.values())[made:]
        made = len(solves)
        results[cap] = Search(best, lo, len(tried), sum(s.hit_limit for s in tried), sum(s.seconds for s in tried))
    return results


def _fits(solve, limit):
    return solve.schedule is not None and solve.cost <= limit


def step_seconds(step, x, y, repeats):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        tf.nest.flatten(step(x, y))[0].numpy()
        times.append(time.perf_counter() - began)
    return times


def measure(step, x, y, variables, repeats):
    requested = measure_step_peak(step, x, y, resident=variables, count="requested")
    allocator = measure_step_peak(step, x, y, resident=variables)
    return Run(requested, allocator, float(np.median(step_seconds(step, x, y, repeats))))


def plain_keras(model, x, y, loss, repeats):
    """``model.train_on_batch`` (what ``model.fit`` runs per batch) and its step times."""
    optimizer = keras.optimizers.SGD(0.01)
    model.compile(optimizer=optimizer, loss=loss)
    optimizer.build(model.trainable_variables)
    step = lambda a, b: tf.constant(model.train_on_batch(a, b))  # noqa: E731
    variables = list(model.variables) + list(optimizer.variables)
    requested = measure_step_peak(step, x, y, resident=variables, count="requested")
    allocator = measure_step_peak(step, x, y, resident=variables)
    return requested, allocator, step, step_seconds(step, x, y, repeats)


def implementation_summary(schedule):
    counts = collections.Counter((schedule.implementations or {}).values())
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "defaults"


def solve_seconds(spec, args) -> float:
    """The time limit of each solve on ``spec``: ``--time-limit`` if given, else the model's own."""
    return args.time_limit or spec.time_limit or DEFAULT_TIME_LIMIT


def bench_model(key, args, monet_name):
    spec = MODELS[key]
    logger.info("%s", spec.label)
    loss = "categorical_crossentropy"
    plain_model = spec.build()
    x, y = training_batch(plain_model, spec.batch)
    plain_requested, plain_allocator, plain_step, plain_times = plain_keras(plain_model, x, y, loss, args.repeats)

    model = spec.build()
    optimizer = keras.optimizers.SGD(0.01)
    began = time.perf_counter()
    extraction = extract(model, (x, y), loss=loss, optimizer=optimizer, cost_model="profile", implementations=True,
                         use_cache=False)
    extract_seconds = time.perf_counter() - began
    graph = extraction.graph
    reference = checkpoint_all_peak(graph)
    lean = leanest_implementations(graph)
    lean_schedule = get_strategy("checkpoint_all")(graph, None, implementations=lean)
    lean_peak = simulate(graph, lean_schedule).peak_bytes
    bounds = {"optimal": memory_lower_bound(graph), monet_name: memory_lower_bound(graph, choose_implementations=True)}
    facts = {
        "nodes": graph.size, "alternatives": len(graph.implementations), "fixed": graph.fixed_bytes,
        "checkpoint_all": reference, "lean_peak": lean_peak, "lean_overhead": lean_schedule.cost(graph) / graph.total_cost - 1,
        "bounds": bounds, "extract_seconds": extract_seconds,
    }
    logger.info("  %d nodes, %d with alternatives; checkpoint-all %.2f MiB, leanest %.2f MiB; bounds %s",
                graph.size, len(graph.implementations), reference / MiB, lean_peak / MiB,
                {k: round(v / MiB, 2) for k, v in bounds.items()})

    searches = {}
    for name in ("optimal", monet_name):
        logger.info("  %s", name)
        run = make_strategy(name, graph, solve_seconds(spec, args), args.mip_gap, args.threads)
        searches[name] = search_caps(run, graph, args.caps, bounds[name] - 1, reference,
                                     args.tolerance * reference, args.max_solves)

    variables = list(model.variables) + list(optimizer.variables)
    initial = [v.numpy() for v in variables]
    runs: dict[int, Run] = {}
    for name, by_cap in searches.items():
        for cap, found in by_cap.items():
            if found.best is None or id(found.best) in runs:
                continue
            for variable, value in zip(variables, initial):
                variable.assign(value)
            step = compile_step(extraction, found.best.schedule, optimizer=optimizer)
            runs[id(found.best)] = measure(step, x, y, variables, args.repeats)
            r = runs[id(found.best)]
            logger.info("  %s %d%%: predicted %.2f requested %.2f allocator %.2f MiB, %.3f s", name, round(cap * 100),
                        found.best.peak / MiB, r.requested / MiB, r.allocator / MiB, r.seconds)
    # Plain Keras timed again after the compiled steps, so a slow phase of the shared machine
    # weighs on both sides of the ratio.
    plain_times += step_seconds(plain_step, x, y, args.repeats)
    plain = Run(plain_requested, plain_allocator, float(np.median(plain_times)))
    return {"spec": spec, "graph": graph, "facts": facts, "searches": searches, "runs": runs, "plain": plain}


def _mib(value):
    return "" if value is None else f"{value / MiB:.2f}"


def render(results, args, monet_name, argv=None):
    caps = sorted(args.caps)
    limits = ", ".join(f"{MODELS[m].label.split(' (')[0]}: {solve_seconds(MODELS[m], args):g} s" for m in args.models)
    lines = [
        "# MONeT: operator implementations chosen with the checkpoints",
        "",
        header(argv),
        "",
        f"Keras {keras.__version__}, CPU, `TF_NUM_INTEROP_THREADS=1`, `TF_CPU_ALLOCATOR_USE_BFC=true`, SGD, "
        f"costs profiled in this run (no cache). Solves: time limit {limits}, mip_gap {args.mip_gap:g}, "
        f"{args.threads} threads; the budget bisection stops at {args.tolerance:.1%} of the checkpoint-all "
        f"peak or after {args.max_solves} solves per cap. Step time: median of {args.repeats} steps; plain Keras "
        f"(`train_on_batch`) median of {2 * args.repeats}, before and after the compiled steps.",
        "",
    ]
    if monet_name != "monet":
        lines += [f"**Stand-in run:** the `monet` column is `{monet_name}`, not the `monet` strategy.", ""]
    lines += [
        "Peaks are in the graph's convention (the step's peak above what was allocated before it, plus "
        "weights, gradients, optimizer state and the batch). Predicted = the simulator's peak of the "
        "schedule; requested = the bytes the compiled step's operations request; allocator = the BFC "
        "allocator's peak. Overhead = schedule cost / no-remat cost - 1 (profiled costs). Search = solves "
        "the cap's bisection added (caps run loosest first and reuse earlier solves; the first also solves at the checkpoint-all peak), how many stopped at the time limit, and "
        "their seconds; status = the chosen schedule's solver status.",
        "",
        "## Smallest peak within the cap",
        "",
        "| model | cap | strategy | predicted MiB | requested MiB | error | allocator MiB | overhead | "
        "time / plain | implementations | status | search |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for result in results.values():
        graph, plain = result["graph"], result["plain"]
        label = result["spec"].label
        for cap in caps:
            best = {}
            for name, by_cap in result["searches"].items():
                found = by_cap[cap]
                search = f"{found.solves} solves, {found.at_limit} at limit, {found.seconds:.0f} s"
                s = found.best
                if s is None:
                    lines.append(f"| {label} | {cap:.0%} | {name} | none | | | | | | | | {search} |")
                    continue
                r = result["runs"][id(s)]
                best[name] = (s, r)
                gap = s.schedule.facts.gap if s.schedule.facts is not None else None
                status = s.status + ("" if gap is None or s.status == "optimal" else f", gap {gap:.1%}")
                lines.append(
                    f"| {label} | {cap:.0%} | {name} | {_mib(s.peak)} | {_mib(r.requested)} | "
                    f"{r.requested / s.peak - 1:+.1%} | {_mib(r.allocator)} | {s.cost / graph.total_cost - 1:+.1%} | "
                    f"{r.seconds / plain.seconds:.2f} | {implementation_summary(s.schedule)} | {status} | {search} |")
            ratios.append((label, cap, best.get("optimal"), best.get(monet_name), graph.fixed_bytes))
    lines += [
        "",
        "## optimal / monet",
        "",
        "Peak of `optimal` over peak of `" + monet_name + "` at the same cap: predicted, requested, and "
        "predicted without the fixed bytes (activations only).",
        "",
        "| model | cap | optimal MiB | monet MiB | predicted ratio | requested ratio | activation ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, cap, opt, mon, fixed in ratios:
        if opt is None or mon is None:
            lines.append(f"| {label} | {cap:.0%} | {_mib(opt and opt[0].peak)} | {_mib(mon and mon[0].peak)} | | | |")
            continue
        lines.append(f"| {label} | {cap:.0%} | {_mib(opt[0].peak)} | {_mib(mon[0].peak)} | "
                     f"{opt[0].peak / mon[0].peak:.2f} | {opt[1].requested / mon[1].requested:.2f} | "
                     f"{(opt[0].peak - fixed) / (mon[0].peak - fixed):.2f} |")
    lines += [
        "",
        "## Models",
        "",
        "| model | nodes | with alternatives | fixed MiB | checkpoint-all MiB | leanest checkpoint-all MiB | "
        "its overhead | lower bound MiB (default / chosen) | plain requested MiB | plain allocator MiB | "
        "plain step s | extract s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results.values():
        f, plain = result["facts"], result["plain"]
        lines.append(
            f"| {result['spec'].label} | {f['nodes']} | {f['alternatives']} | {_mib(f['fixed'])} | "
            f"{_mib(f['checkpoint_all'])} | {_mib(f['lean_peak'])} | {f['lean_overhead']:+.1%} | "
            f"{_mib(f['bounds']['optimal'])} / {_mib(f['bounds'][monet_name])} | {_mib(plain.requested)} | "
            f"{_mib(plain.allocator)} | {plain.seconds:.3f} | {f['extract_seconds']:.0f} |")
    lines += [
        "",
        "- Leanest checkpoint-all: no recomputation, every node with alternatives under the one whose "
        "backward reads the fewest bytes (`tfremat.ilp.monet.leanest_implementations`, what `monet` also "
        "warm-starts from); its overhead is those implementations' profiled cost.",
        "- Lower bounds: `memory_lower_bound` of the default graph, and with each node under its leanest "
        "implementation (`choose_implementations=True`); the bisection starts there.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, type=lambda s: s.split(","),
                        help=f"comma-separated, from {', '.join(MODELS)} (default all; --quick: {QUICK_MODELS[0]})")
    parser.add_argument("--caps", default=None, type=lambda s: [float(v.rstrip("%")) / 100 for v in s.split(",")],
                        help="overhead caps in percent of the no-remat cost (default 0,5,10,20; --quick: 0,10)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help=f"seconds per solve (default {DEFAULT_TIME_LIMIT:g}, ResNet50 {RESNET50_TIME_LIMIT:g}; "
                             f"--quick: {QUICK_TIME_LIMIT:g})")
    parser.add_argument("--mip-gap", type=float, default=1e-3, help="relative MILP gap to stop at")
    parser.add_argument("--threads", type=int, default=2, help="solver threads")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="stop the bisection when its bracket is this share of the checkpoint-all peak")
    parser.add_argument("--max-solves", type=int, default=8, help="solves per cap at most")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per schedule (default 5; --quick: 2)")
    parser.add_argument("--monet-stand-in", default=None, choices=STAND_INS,
                        help="run this instead of the monet strategy (for trying the script without it)")
    parser.add_argument("--quick", "--dry-run", action="store_true",
                        help="a fast smoke run: one small model, two caps, short solves; writes only with --out")
    parser.add_argument("--out", default=None, help=f"markdown file to write (default {DEFAULT_OUT}; required "
                        "with --models, --caps or --monet-stand-in, so a partial run does not replace the table)")
    args = parser.parse_args(argv)
    partial = args.models is not None or args.caps is not None or args.monet_stand_in is not None
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.caps = args.caps or list(QUICK_CAPS)
        args.time_limit = args.time_limit or QUICK_TIME_LIMIT
        args.repeats = args.repeats or 2
    elif partial and args.out is None:
        parser.error(f"a partial or stand-in run needs --out (the default {DEFAULT_OUT} holds the full table)")
    args.models = args.models or list(MODELS)
    args.caps = args.caps or list(CAPS)
    args.repeats = args.repeats or 5
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown --models {unknown}; choose from {', '.join(MODELS)}")
    if any(cap < 0 for cap in args.caps):
        parser.error(f"--caps must be 0 or more percent, got {args.caps}")
    out = args.out if args.out is not None else (None if args.quick else DEFAULT_OUT)
    monet_name = args.monet_stand_in or "monet"
    get_strategy(monet_name if monet_name not in STAND_INS else "checkpoint_all")  # fail before any work
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    began = time.perf_counter()
    results = {key: bench_model(key, args, monet_name) for key in args.models}
    text = render(results, args, monet_name, argv)
    logger.info("total %.0f s", time.perf_counter() - began)
    if out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
