"""Does the budget a refusal names hold in a fresh process? (issue 33, session 30 task A3)

A refusal under ``fit``'s allocator check names a budget read from the allocator in the
process that refused (``tfremat.allocator_check.planner_refusal_read``, ``_refusal_figure``).
The user copies it back, most often in a new process, where the same plan's step may read
other bytes (one plan read 10.10 MiB in one allocator state and 10.81 in another, five_conv_net,
more than the check's 3% slack). Per model: process 1 fits at the budget and is refused; processes
2..5 fit at the figure it named, each fresh: "uncached" with an empty tfremat cache (nothing
known of process 1's reads), "cached" with process 1's cache directory (its schedules, its plans'
held peaks and accepted planning budgets), in turns. Per process: the outcome (trained, or refused
again and the figure it names), every allocator read of the check (the plan's prediction, whether
it recomputes, the held peak) and the allocator's peak of each training step the callback watched,
with the load at its start; each read's single runs (plain, then in perturbed states).

Models: keras.io's masked text transformer of ``user_check_5`` (``text_mask``, "75%", a
``tf.data.Dataset`` of ``(x, y, sample_weight)``) and ``five_conv_net`` of tests/models.py
("50%", arrays), both through ``model.fit`` with ``RematCallback`` (what ``tfremat.fit`` runs),
``cost_model="flops"`` so that every process plans the same graph (the profiler's costs would
move the schedule between processes, which is not what is measured).

Run: ``python benchmarks/refusal_fresh_processes.py [--only text_mask,five_conv_net] [--copies 4]
[--json FILE]``; ``--from_json FILE`` prints the table of saved rows
(benchmarks/results/refusal_fresh_processes.json: the runs of benchmarks/results/user_check_5.md,
"Session 30 (A3)").
"""

import argparse
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/models.py

from user_check import run_child  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "refusal_fresh_processes.json")
BUDGETS = {"text_mask": "75%", "five_conv_net": "50%"}
NAMED = re.compile(r'smallest feasible budget found is "?([\d.]+(?: ?[KMG]i?B|%)(?: of activations)?)')
MIB = 2 ** 20


def _model_and_data(name: str):
    """``(compiled model, model.fit keyword arguments)`` of ``name``, the same in every process."""
    import keras
    import numpy as np

    if name == "text_mask":
        from user_check_5 import _compiled, _text_mask_data, _text_transformer

        keras.utils.set_random_seed(0)
        _, _, dataset = _text_mask_data()
        return _compiled(_text_transformer(64)), {"x": dataset}
    from models import five_conv_net

    rng = np.random.default_rng(0)
    x = rng.standard_normal((9 * 16, 32, 32, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 9 * 16)]
    return five_conv_net(), {"x": x, "y": y, "batch_size": 16, "shuffle": False}


def child(name: str, budget: str) -> None:
    """One process: ``name`` fitted for one epoch at ``budget``; its row printed for
    :func:`user_check.run_child`."""
    import tfremat.keras as remat_keras
    from tfremat import allocator_check
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.plan.simulator import simulate

    row = {"model": name, "budget": budget, "load": os.getloadavg()[0], "reads": [], "step_peaks": []}
    read, watched, held_peak = remat_keras.allocator_peak, remat_keras.training_step_peak, allocator_check.held_peak
    runs = []

    def recorded_held_peak(peaks, resident=0):  # the check's single reads, plain then perturbed
        runs.append({"peaks": list(peaks), "resident": resident})
        return held_peak(peaks, resident)

    def recorded_read(step, *args, **kwargs):
        runs.clear()
        peak = read(step, *args, **kwargs)
        row["reads"].append({"predicted": simulate(step.graph, step.schedule).peak_bytes,
                             "recomputes": step.schedule.recompute_count, "held": peak,
                             "single": runs[-1] if runs else None})
        return peak

    def recorded_step(run, device, resident):
        result, peak = watched(run, device, resident)
        row["step_peaks"].append(peak)
        return result, peak

    remat_keras.allocator_peak, remat_keras.training_step_peak = recorded_read, recorded_step
    allocator_check.held_peak = recorded_held_peak
    model, fit_kwargs = _model_and_data(name)
    callback = remat_keras.RematCallback(budget, cost_model="flops", cache=True, verbose=0)
    try:
        model.fit(**fit_kwargs, epochs=1, verbose=0, callbacks=[callback])
        (key, plan), = callback.plans.items()
        row.update(outcome="trained", budget_bytes=plan.budget_bytes, predicted=plan.predicted_peak_bytes,
                   checkpoint_all=plan.checkpoint_all_peak_bytes, recomputes=plan.schedule.recompute_count,
                   accepted_held=callback.allocator_peaks.get(key))
    except InfeasibleBudgetError as error:
        named = NAMED.search(str(error))
        row.update(outcome="refused", named=named.group(1) if named else None, budget_bytes=error.budget_bytes,
                   named_bytes=error.min_feasible_bytes, as_amount=error.smallest_as_amount, message=str(error))
    print("USER_CHECK_ROW " + json.dumps(row, default=float), flush=True)


def _mib(n) -> str:
    return "" if n is None else f"{n / MIB:.2f}"


def render(rows) -> str:
    out = ["| model | process | cache | budget | outcome | check's reads, MiB held (predicted; r: recomputes) | "
           "watched steps MiB (max) | load |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        reads = ", ".join(f"{_mib(r['held'])} ({_mib(r['predicted'])}{'; r' if r['recomputes'] else ''})"
                          for r in row.get("reads", []))
        if row.get("outcome") == "trained":
            outcome = (f"trains at {_mib(row['budget_bytes'])}: accepted {_mib(row['accepted_held'])} held, "
                       f"{'recomputes' if row['recomputes'] else 'nothing recomputed'}")
        elif row.get("outcome") == "refused":
            outcome = f"refused, names {row['named']}" + (" (an amount)" if row.get("as_amount") else "")
        else:
            outcome = row.get("error", "?")[:120]
        steps = row.get("step_peaks") or []
        model = row["model"] + (f" (run {row['run']})" if "run" in row else "")
        out.append(f"| {model} | {row['process']} | {row['cache']} | {row['budget']} | {outcome} | {reads} | "
                   f"{_mib(max(steps)) if steps else ''} | {row.get('load', 0):.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(BUDGETS), help="models, comma separated (default: all)")
    parser.add_argument("--copies", type=int, default=4, help="fresh copy-back processes per cache mode")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process")
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--from_json")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    if args.from_json:
        with open(args.from_json) as handle:
            print(render(json.load(handle)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="refusal_fresh_") as work:
        for name in args.only.split(","):
            shared = os.path.join(work, name, "shared")

            def run(budget, process, cache, directory):
                row = run_child(__file__, [name, budget], args.timeout, directory, sample=10)
                row.update(model=name, process=process, cache=cache, budget=budget)
                rows.append(row)
                with open(args.json, "w") as handle:
                    json.dump(rows, handle, indent=1, default=float)
                print(render([row]).splitlines()[-1], flush=True)
                return row

            first = run(BUDGETS[name], 1, "empty", shared)
            figure = first.get("named")
            if figure is None:
                continue
            process = 2
            for copy in range(args.copies):  # in turns: the load and the machine's state alike for both
                run(figure, process, "empty", os.path.join(work, name, f"fresh{copy}"))
                run(figure, process + 1, "process 1's", shared)
                process += 2
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
