"""Does timing under TensorFlow's profiler over-cost the small pointwise nodes? (issue 33)

Session 29's hypothesis (benchmarks/results/step_share.md, "Not tested here"): the profiled
costs are each call's seconds read off the profiler's trace
(:mod:`tfremat.extract.call_timing`), and the profiler records an event per allocation
while the measured step runs without it; that would weigh most on allocation-heavy cheap
nodes (layer norm, softmax, dropout, GELU), the ones plans recompute.

Two measurements, each in one process, the timers taking turns (their order rotating by
round) so that a change of load falls on all of them, the 1-minute load recorded:

* ``nodes``: every profiled call of a model (the extraction's own timed functions, captured
  from its :class:`~tfremat.extract.call_timing.TimingPasses`): the function that computes
  nothing, the forward and the forward-plus-backward, each timed three ways, least over
  ``--rounds`` rounds of each timer: ``traced`` (as the profile times it,
  ``call_timing._kernel_seconds``), ``wall`` (from Python, no profiler running,
  ``call_timing._least_seconds``) and ``wall+prof`` (from Python while the profiler traces
  the host with the profile's options). A node's forward is its function less the one that
  computes nothing, its backward the forward-plus-backward less the forward, as
  :func:`~tfremat.extract.call_timing.call_costs` takes them (without the grid). The
  profiler's overhead on a node is ``wall+prof - wall`` of its part; allocations are the
  allocator events of one run (``AllocationWindows``).
* ``allocations``: functions of ``n`` tiny ``sin`` operations whose outputs are all kept
  (``kept``: one allocation each) or chained (``chained``: each output takes its input's
  buffer), timed the same three ways: the profiler's cost per allocation event is the
  difference of their overheads over the difference of their events.

Run: ``python benchmarks/pointwise_costs.py --models gpt2_hub,transformer_encoder,token_mlp_net
--json benchmarks/results/pointwise_costs.json --out benchmarks/results/pointwise_costs.md``; ``--from_json``
renders saved rows without timing anything.
"""

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"), HERE]

import profile_agreement  # noqa: E402
from provenance import header  # noqa: E402

from tfremat.extract import call_timing, extract, timing  # noqa: E402
from tfremat.runtime import executor  # noqa: E402
from tfremat.runtime.memory import AllocationWindows, default_device, synchronize  # noqa: E402
from tfremat.runtime.profiler import profiler_trace  # noqa: E402

TIMERS = ("traced", "wall", "wall+prof")
SIZES = (16, 64, 256)  # tiny operations per function in the allocations measurement
TINY = 8  # elements of each tiny tensor


def timed_three_ways(calls, rounds: int) -> dict[str, list[float]]:
    """Per timer, the least seconds of each function of ``calls`` over ``rounds`` rounds of
    every timer, the timers' order rotating by round."""
    least = {name: [np.inf] * len(calls) for name in TIMERS}
    for round_ in range(rounds):
        for name in TIMERS[round_ % 3:] + TIMERS[:round_ % 3]:
            if name == "traced":
                seconds = call_timing._kernel_seconds(calls, 5, 1)
            elif name == "wall":
                seconds = call_timing._least_seconds(calls, 5, 1)
            else:
                with tempfile.TemporaryDirectory() as logdir, \
                        profiler_trace(logdir, tf.profiler.experimental.ProfilerOptions(**timing._OPTIONS)):
                    seconds = call_timing._least_seconds(calls, 5, 1)
            least[name] = [min(a, b) for a, b in zip(least[name], seconds)]
    return least


def allocations(calls) -> list[int]:
    """The allocation events of one run of each function of ``calls`` (after a warm-up run)."""
    with executor.step_executor():
        for fn, args in calls:
            synchronize(fn(*args))
        with AllocationWindows(default_device()) as windows:
            indices = [windows.run(lambda fn=fn, args=args: synchronize(fn(*args))) for fn, args in calls]
    return [sum(1 for event in windows.events(index) if event[1]) for index in indices]


def layer_classes(model) -> dict[str, str]:
    """Layer name -> class name, nested layers included."""
    return {layer.name: type(layer).__name__ for layer in model._flatten_layers(include_self=False)}


def node_rows(name: str, rounds: int) -> list[dict]:
    """One row per profiled call of model ``name``: its parts' seconds by each timer."""
    captured = []
    final = call_timing.TimingPasses.final

    def capturing(self, analysis):
        if not captured or captured[-1] is not self:
            captured.append(self)
        return final(self, analysis)

    call_timing.TimingPasses.final = capturing
    try:
        model, batch = profile_agreement.build(name)
        extract(model, batch, cost_model="profile", use_cache=False)
    finally:
        call_timing.TimingPasses.final = final
    classes = layer_classes(model)
    timings = list({id(t): t for _, t, _ in captured[-1]._timings.values()}.values())
    rows = []
    for timing_ in timings:
        calls = timing_.make_calls()
        load = os.getloadavg()[0]
        least = timed_three_ways(calls, rounds)
        counts = allocations(calls)
        own_name = timing_.layer_name.rsplit("/", 1)[-1]  # a nested layer's calls are named by their path
        kind = "loss" if timing_.layer_name == "loss" else classes.get(own_name, "keras op")
        row = {"model": name, "layer": timing_.layer_name, "class": kind,
               "load": load, "allocations": counts}
        for timer, seconds in least.items():
            parts = {"forward": seconds[1] - seconds[0]}
            if len(seconds) == 3:
                parts["backward"] = seconds[2] - seconds[1]
            row[timer] = parts
        row["dispatch"] = {timer: least[timer][0] for timer in TIMERS}
        rows.append(row)
        logging.info("%s %s %s", name, timing_.layer_name, json.dumps(row["traced"]))
    return rows


def tiny_functions(n: int):
    """``kept``: ``n`` sin operations whose outputs all live until an add_n; ``chained``: ``n``
    sin operations each taking its input's buffer."""
    spec = tf.TensorSpec([TINY], tf.float32)

    def kept(x):
        outputs, y = [], x
        for _ in range(n):
            y = tf.sin(y)
            outputs.append(y)
        return tf.add_n(outputs)

    def chained(x):
        y = x
        for _ in range(n):
            y = tf.sin(y)
        return y

    return (tf.function(kept, autograph=False).get_concrete_function(spec),
            tf.function(chained, autograph=False).get_concrete_function(spec))


def allocation_rows(rounds: int) -> list[dict]:
    rows = []
    x = tf.ones([TINY])
    for n in SIZES:
        kept, chained = tiny_functions(n)
        calls = [(call_timing.dispatch_only((x,)), (x,)), (kept, (x,)), (chained, (x,))]
        load = os.getloadavg()[0]
        least = timed_three_ways(calls, rounds)
        counts = allocations(calls)
        rows.append({"n": n, "load": load, "allocations": counts, **least})
        logging.info("n=%d %s %s", n, counts, json.dumps(least))
    return rows


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:.1f}"


def per_allocation_seconds(allocation_table: list[dict]) -> float:
    """The profiler's seconds per allocation: the median over the larger sizes (``n >= 64``; at
    16 the difference is within the timing's noise) of the kept functions' overhead less the
    chained ones', over their difference in allocations."""
    per = []
    for row in allocation_table:
        _, kept, chained = row["allocations"]
        if row["n"] >= 64:
            over = [row["wall+prof"][k] - row["wall"][k] for k in (1, 2)]
            per.append((over[0] - over[1]) / (kept - chained))
    return float(np.median(per))


def render(node_table: list[dict], allocation_table: list[dict]) -> str:
    per_allocation = per_allocation_seconds(allocation_table)
    lines = [header(), "",
             "# The profiler's overhead on node costs (issue 33, session 29's hypothesis)", ""]
    lines += ["## Allocations: n tiny sin operations, outputs kept (one allocation each) or chained", "",
              "Least seconds (us) per timer; `overhead` = wall+prof - wall; per allocation: (kept - chained) "
              "overhead over (kept - chained) allocations (each an allocation and a deallocation event).", "",
              "| n | load | allocations kept / chained | traced kept / chained | wall kept / chained | "
              "wall+prof kept / chained | overhead kept / chained | us per allocation |",
              "|---|---|---|---|---|---|---|---|"]
    for row in allocation_table:
        _, kept, chained = row["allocations"]
        over = [row["wall+prof"][k] - row["wall"][k] for k in (1, 2)]
        per_event = (over[0] - over[1]) / max(1, kept - chained)
        lines.append(f"| {row['n']} | {row['load']:.1f} | {kept} / {chained} | "
                     + " | ".join(f"{_us(row[t][1])} / {_us(row[t][2])}" for t in TIMERS)
                     + f" | {_us(over[0])} / {_us(over[1])} | {1e6 * per_event:.3f} |")
    lines += ["", f"Per allocation (median, n >= 64): {1e6 * per_allocation:.3f} us.", "",
              "## Nodes: profiled (traced) against wall clock without the profiler, per layer class", "",
              "Sums over each class's parts (forward and backward) of the least seconds (us). `traced`: as the "
              "profile times them; `wall`: from Python without the profiler, less the function that computes "
              "nothing; `overhead`: wall+prof - wall of the part, measured (Python's jitter is tens of us per "
              "part); `allocs`: allocations of one run; `est.`: allocs x the per-allocation cost above, and its "
              "share of traced.", "",
              "| model | class | parts | allocs | traced us | wall us | traced/wall | overhead us | "
              "overhead/traced | est. us | est./traced |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(row["model"] for row in node_table):
        sums = collections.defaultdict(lambda: np.zeros(5))
        for row in (r for r in node_table if r["model"] == model):
            counts = row["allocations"]
            events = {"forward": counts[1], "backward": counts[2] - counts[1] if len(counts) == 3 else 0}
            for part, traced in row["traced"].items():
                overhead = row["wall+prof"][part] - row["wall"][part]
                sums[row["class"]] += [1, events[part], traced, row["wall"][part], overhead]
        total = sum(sums.values())
        for name, (parts, events, traced, wall, overhead) in sorted(sums.items(), key=lambda kv: -kv[1][2]) + \
                [("all", total)]:
            estimate = events * per_allocation
            lines.append(f"| {model} | {name} | {parts:.0f} | {events:.0f} | {_us(traced)} | {_us(wall)} | "
                         f"{traced / wall:.2f} | {_us(overhead)} | {overhead / traced:+.3f} | {_us(estimate)} | "
                         f"{estimate / traced:.3f} |")
    lines += ["", f"Load average over the last 1 / 5 / 15 minutes at the end: "
              f"{' / '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2_hub,transformer_encoder,token_mlp_net")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every timer per node (least kept)")
    parser.add_argument("--out", default=None, help="results markdown (default: print)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--from_json", default=None, help="render the rows a run wrote with --json; time nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        allocation_table, node_table = saved["allocations"], saved["nodes"]
    else:
        allocation_table = allocation_rows(args.rounds)
        node_table = [row for name in args.models.split(",") for row in node_rows(name, args.rounds)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"allocations": allocation_table, "nodes": node_table}, f)
    text = render(node_table, allocation_table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
