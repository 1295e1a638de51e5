"""Where two profiles' cost differences come from (issue 33 item 3): within a process or across.

One extraction of a model (``cost_model="profile"``, no cache) registers every profiled call's
timed functions; their timing passes (:class:`tfremat.extract.call_timing.TimingPasses`) are then
run ``--repeats`` times more on the same traced functions, each repeat a full profile's timing.
Each repeat gives every call's forward and backward seconds off the cost grid (the grid is
patched out, so a 1% change reads as 1%). Written as JSON lines (one per repeat), so that several
processes' files can be compared: ``--compare a.jsonl b.jsonl ...`` prints, over the large nodes
(the fewest, largest first, making half the step), the median relative difference of
successive repeats within each process and of the processes' medians, on seconds and on shares
of the repeat's total.

``--passes K`` with ``--compare`` pools each process's passes instead (every repeat's, per call),
cuts them into profiles of ``K`` passes and compares every pair of those profiles, within and
across processes, for several statistics over a call's passes (the least, the mean of the least
half or third, the median): what a profile of ``K`` passes with that statistic would agree to.

Run: ``python benchmarks/profile_spread.py --model vgg_block_net --repeats 10 --out a.jsonl``
(in several processes), then ``python benchmarks/profile_spread.py --compare a.jsonl b.jsonl``.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

LARGE_SHARE = 0.5


def profile_repeats(name, repeats, shares=(None,)):
    """Yields one dict per repeat: per timed call, its forward and backward seconds. The
    repeats take turns over ``shares``, each (when not None) set as
    ``call_timing._LARGE_CALLS_SHARE`` for its repeat (0: no call gets the extra passes, the
    timing before them), so that two settings meet the same load."""
    import profile_agreement
    from tfremat.extract import call_timing, extract

    captured = []
    final = call_timing.TimingPasses.final

    def capturing(self, a):
        if not captured or captured[-1] is not self:
            captured.append(self)
        return final(self, a)

    call_timing.TimingPasses.final = capturing
    grid, call_timing._on_grid = call_timing._on_grid, lambda seconds: seconds
    large_share = call_timing._LARGE_CALLS_SHARE
    try:
        model, batch = profile_agreement.build(name)
        extract(model, batch, cost_model="profile", use_cache=False)
        passes = captured[-1]
        entries = list(passes._timings.values())
        timings = list({id(t): t for _, t, _ in entries}.values())
        for repeat in range(repeats + 1):
            if repeat:
                for timing in timings:
                    timing.passes = []
                passes._done, passes._final = False, {}
            share = shares[repeat % len(shares)]
            if share is not None:
                call_timing._LARGE_CALLS_SHARE = share
            load = os.getloadavg()[0]
            began = time.perf_counter()
            costs = {}
            for k, (a, timing, _) in enumerate(entries):
                done = passes.final(a)
                key = f"{k}:{timing.layer_name}"
                costs[key + ":f"] = done.forward_seconds
                if done.backward_seconds:
                    costs[key + ":b"] = done.backward_seconds
            yield {"repeat": repeat, "share": share, "load": load, "seconds": time.perf_counter() - began, "costs": costs,
                   "passes": [timing.passes for timing in timings]}
    finally:
        call_timing.TimingPasses.final = final
        call_timing._on_grid = grid
        call_timing._LARGE_CALLS_SHARE = large_share


def _rel(a, b):
    return np.abs(a - b) / np.minimum(a, b)


def compare(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        runs.append([r for r in rows if r["repeat"] > 0])
    keys = sorted(runs[0][0]["costs"])
    first = np.array([runs[0][0]["costs"][k] for k in keys])
    order = np.argsort(-first)
    large = order[:int(np.searchsorted(np.cumsum(first[order]), LARGE_SHARE * first.sum())) + 1]
    print("large nodes:", [keys[i] for i in large])
    medians = []
    for path, rows in zip(paths, runs):
        costs = np.array([[r["costs"][k] for k in keys] for r in rows])
        shares = costs / costs.sum(axis=1, keepdims=True)
        succ = _rel(costs[1:, large], costs[:-1, large])
        succ_share = _rel(shares[1:, large], shares[:-1, large])
        cv = costs[:, large].std(axis=0) / costs[:, large].mean(axis=0)
        loads = [r["load"] for r in rows]
        secs = [r["seconds"] for r in rows]
        print(f"{path}: {len(rows)} repeats, load {min(loads):.1f}-{max(loads):.1f}, {np.median(secs):.2f} s each; "
              f"successive repeats, large nodes: rel median {100 * np.median(succ):.1f}% "
              f"p90 {100 * np.quantile(succ, 0.9):.1f}%; shares median {100 * np.median(succ_share):.1f}% "
              f"p90 {100 * np.quantile(succ_share, 0.9):.1f}%; cv per node {np.round(100 * cv, 1).tolist()}")
        medians.append((np.median(costs, axis=0), np.median(shares, axis=0)))
    for i in range(len(medians)):
        for j in range(i + 1, len(medians)):
            rel = _rel(medians[i][0][large], medians[j][0][large])
            rel_share = _rel(medians[i][1][large], medians[j][1][large])
            print(f"process {i} vs {j} medians, large nodes: rel {np.round(100 * rel, 1).tolist()} "
                  f"shares {np.round(100 * rel_share, 1).tolist()}")


STATISTICS = {
    "least": np.min,
    "mean of least half": lambda x: np.mean(np.sort(x)[:max(1, len(x) // 2)]),
    "mean of least third": lambda x: np.mean(np.sort(x)[:max(1, len(x) // 3)]),
    "median": np.median,
}


def _pooled_costs(passes, statistic):
    """Per timed call's passes (dispatch, forward[, forward and backward] seconds each), the
    forward and backward costs as :func:`tfremat.extract.analysis._profile_call` derives
    them from ``statistic`` of each function over the passes (off the grid)."""
    costs = []
    for per_pass in passes:
        values = [statistic(np.array(seconds)) for seconds in zip(*per_pass)]
        costs.append(max(values[1] - values[0], 0.05 * values[1]))
        if len(values) == 3:
            costs.append(max(values[2] - values[1], 0.05 * values[2]))
    return np.array(costs)


def compare_pooled(paths, passes):
    """Profiles of ``passes`` passes cut from each process's pooled passes, compared pairwise."""
    pooled = []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f][1:]
        pooled.append([[p for row in rows for p in row["passes"][t]] for t in range(len(rows[0]["passes"]))])
    first = _pooled_costs(pooled[0], np.min)
    order = np.argsort(-first)
    large = order[:int(np.searchsorted(np.cumsum(first[order]), LARGE_SHARE * first.sum())) + 1]
    for name, statistic in STATISTICS.items():
        profiles = [(k, _pooled_costs([p[c * passes:(c + 1) * passes] for p in process], statistic))
                    for k, process in enumerate(pooled) for c in range(min(len(p) for p in process) // passes)]
        rel = {True: [], False: []}
        rel_share = {True: [], False: []}
        for (i, a), (j, b) in itertools.combinations(profiles, 2):
            rel[i == j].append(_rel(a[large], b[large]))
            rel_share[i == j].append(_rel(a[large] / a.sum(), b[large] / b.sum()))

        def cell(values):
            if not values:
                return "-"
            values = np.concatenate(values)
            return f"{100 * np.median(values):.1f}% / {100 * np.quantile(values, 0.9):.1f}%"

        print(f"{passes} passes, {name}: large nodes within a process {cell(rel[True])}, across {cell(rel[False])}; "
              f"shares within {cell(rel_share[True])}, across {cell(rel_share[False])} (median / p90)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg_block_net")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    parser.add_argument("--shares", help="large-call shares taking turns, comma separated (0: no extra passes); "
                        "each writes OUT.<share>")
    parser.add_argument("--compare", nargs="+")
    parser.add_argument("--passes", type=int, help="with --compare: profiles of this many pooled passes")
    args = parser.parse_args()
    if args.compare and args.passes:
        compare_pooled(args.compare, args.passes)
        return
    if args.compare:
        compare(args.compare)
        return
    shares = [float(share) for share in args.shares.split(",")] if args.shares else [None]
    files = {share: open(args.out if len(shares) == 1 else f"{args.out}.{share:g}", "w") for share in shares}
    for row in profile_repeats(args.model, args.repeats * len(shares), shares):
        for share in shares if row["repeat"] == 0 else [row["share"]]:
            files[share].write(json.dumps(row) + "\n")
            files[share].flush()
    for f in files.values():
        f.close()


if __name__ == "__main__":
    main()
