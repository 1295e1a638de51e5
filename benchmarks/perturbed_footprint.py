"""How wide a spread of allocator peaks the check's perturbed reads find, and what they keep
allocated during a read: this checkout's :func:`tfremat.allocator_check.perturbed_state`
against another version's (``--baseline``, an ``allocator_check.py`` file), in turns on one
compiled step.

One worker process per model (``--worker``) plans its budget (benchmarks/allocator_check.py's
models and budgets, the check off), compiles the step, reads it :data:`ALLOCATOR_READS` times
in the allocator's state as found, then ``--rounds`` times each of the
:data:`PERTURBED_READS` states of both versions, alternating (this one, the baseline, this
one, ...; the same seeds). It records each read and, per perturbed read, the bytes allocated
inside the state over the step's own bytes (the perturbation's footprint during the read).

    python benchmarks/perturbed_footprint.py --baseline /tmp/old/tfremat/allocator_check.py \\
        --only multi_io,accum_lr_schedule,gru_text,unet_seg --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def worker(name: str, baseline: str, rounds: int) -> dict:
    import importlib.util

    import tfremat  # noqa: F401 - before TensorFlow: the CPU allocator keeps statistics
    import tensorflow as tf

    from allocator_check import MODELS, build
    from tfremat import allocator_check
    from tfremat.keras import RematCallback
    from tfremat.model_planning import synthetic_batch
    from tfremat.runtime.memory import measure_step_peak, resident_bytes

    spec = importlib.util.spec_from_file_location("baseline_allocator_check", baseline)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    budget, batch, _ = MODELS[name]
    model, loss = build(name)
    x, y = synthetic_batch(model, batch, loss=loss, seed=0)
    x, y = tf.nest.map_structure(tf.constant, (x, y))
    callback = RematCallback(budget, cache=False, verbose=0, allocator_check=False, time_limit=20)
    callback.set_model(model)
    step = callback._step_for(x, y)
    callback._tracing.close()
    model.optimizer.build(model.trainable_variables)
    variables = list(model.variables) + list(model.optimizer.variables)
    resident = resident_bytes([*variables, *tf.nest.flatten((x, y))])
    sizes = allocator_check.perturbing_sizes(step.graph)

    def run_step(a, b):
        return step(a, b, None)

    def read(warmup=0):
        return measure_step_peak(run_step, x, y, resident=variables, warmup=warmup)

    plain = [read(1 if n == 0 else 0) for n in range(allocator_check.ALLOCATOR_READS)]
    own = max(max(plain) - resident, 0)
    reads = {"this": [], "baseline": []}
    footprint = {"this": [], "baseline": []}
    for _ in range(rounds):
        for seed in range(allocator_check.PERTURBED_READS):
            for label, module in (("this", allocator_check), ("baseline", old)):
                start = tf.config.experimental.get_memory_info("CPU:0")["current"]
                with module.perturbed_state(None, own, sizes, seed=seed):
                    footprint[label].append((tf.config.experimental.get_memory_info("CPU:0")["current"] - start) / own)
                    reads[label].append(read())
    return {"model": name, "budget": budget, "resident": resident, "own": own, "plain": plain, "reads": reads,
            "footprint": footprint, "load": os.getloadavg()[0]}


def render(rows: list[dict]) -> str:
    table = ["| model | own MiB | plain reads MiB | perturbed reads MiB (this) | (baseline) | largest over plain: "
             "this / baseline | kept during a read, share of own: this / baseline | load |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        plain, this, base = row["plain"], row["reads"]["this"], row["reads"]["baseline"]

        def mib(values):
            return f"{min(values) / 2**20:.2f}-{max(values) / 2**20:.2f}"

        def share(values):
            return f"{min(values):.3f}-{max(values):.3f}"

        over = f"{max(this) / max(plain):.3f} / {max(base) / max(plain):.3f}"
        kept = f"{share(row['footprint']['this'])} / {share(row['footprint']['baseline'])}"
        table.append(f"| {row['model']} {row['budget']} | {row['own'] / 2**20:.2f} | {mib(plain)} | {mib(this)} | "
                     f"{mib(base)} | {over} | {kept} | {row['load']:.1f} |")
    return "\n".join(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="an allocator_check.py whose perturbed_state is compared")
    parser.add_argument("--only", default="multi_io,accum_lr_schedule,gru_text,unet_seg")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, os.path.abspath(args.baseline), args.rounds)), flush=True)
        return
    rows = []
    for name in args.only.split(","):
        env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true")
        done = subprocess.run([sys.executable, __file__, "--worker", name, "--baseline", args.baseline,
                               "--rounds", str(args.rounds)], env=env, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{name}: worker failed")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    print(render(rows))


if __name__ == "__main__":
    main()
