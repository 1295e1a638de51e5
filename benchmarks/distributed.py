"""Per-replica memory and step time under MultiWorkerMirroredStrategy, 1 and 2 replicas (issue 35 items 4 and 7).

Each replica is a local worker process (``TF_CONFIG`` on 127.0.0.1) with its own CPU
allocator, so every number is per replica: what a budget per device must hold. Every
configuration trains a conv net with ``tfremat.fit`` at the same per-replica batch (weak
scaling: the global batch grows with the replicas) at checkpoint-all ("100%",
``checkpoint_all``) and at "50% of activations" (``optimal``), profiled costs by default
(the convolutions' scratch measured; ``--cost-model flops`` for analytic costs).

Per worker, over the second epoch (the first plans and traces), in the convention of the
prediction (:mod:`tfremat.runtime.memory`: above what the allocator held when the step
began, plus the variables, optimizer slots and this replica's batch):

* requested: the bytes the step's operations requested at their peak, from the profiler's
  allocation events of one step (the quantity the plan predicts);
* allocator: the allocator's peak over each step, the largest over the epoch (whole BFC chunks);
* outside the step: what the allocator held at a step's start beyond the variables and the
  batch (the data set's tensors and prefetched batches: not the step's, never planned);
* at the requested peak, the live buffers by the operation that allocated them, so that an
  excess over the prediction is named (``--detail``);
* with ``allocator_check``, the largest allocator peak over the workers that the check
  agreed on, or the error every worker raised. By default the multi-worker loop checks
  only GPU replicas (:func:`tfremat.multi_worker.allocator_checked`); the last
  configuration asks for the check on any device.

On a machine with a GPU every worker uses it (one process each, memory growth on) and the
numbers are its allocator's.

Run: ``python benchmarks/distributed.py`` (writes ``benchmarks/results/distributed.md``).
Ops run one at a time (``TF_NUM_INTEROP_THREADS=1``), as the simulator models.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Worker processes sharing one GPU each take only what they use.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PER_REPLICA_BATCH = 32
STEPS = 8  # per epoch
PROFILED_BATCH = 3  # the step of the second epoch whose allocations are replayed
#: (label, budget, strategy, allocator_check): by default (None) the multi-worker loop
#: checks the allocator only on GPU replicas and below the checkpoint-all peak.
CONFIGS = [("checkpoint-all", "100%", "checkpoint_all", None),
           ("50% of activations", "50% of activations", "optimal", None),
           ("50% of activations, allocator_check=True", "50% of activations", "optimal", True)]


def live_at_peak(logdir: str, device: str) -> tuple[int, list[tuple[str, int]]]:
    """The peak of the bytes requested from ``device``'s allocator in a profile
    (allocations before it ignored) and the buffers live at that peak, summed by
    (operation, region, shape)."""
    from tfremat.runtime.memory import allocation_events

    events = sorted(allocation_events(logdir, device), key=lambda e: (e[0], not e[1]))
    live, current, peak, at_peak = {}, 0, 0, {}
    for _, allocation, addr, requested, info in events:
        if allocation:
            live[addr] = (requested, info)
            current += requested
            if current > peak:
                peak, at_peak = current, dict(live)
        elif addr in live:
            current -= live.pop(addr)[0]
    groups: dict = {}
    for requested, info in at_peak.values():
        key = f"{info['op'] or '?'} {info['region']} {info['shape']}"
        groups[key] = groups.get(key, 0) + requested
    return peak, sorted(groups.items(), key=lambda kv: -kv[1])


def worker(budget: str, strategy_name: str, cost_model: str, allocator_check: bool | None) -> None:
    import tempfile

    import keras
    import numpy as np
    import tensorflow as tf

    import tfremat
    from tfremat.errors import InfeasibleBudgetError
    from tfremat.runtime.memory import default_device, resident_bytes

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    device = default_device()
    replicas = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((32, 32, 3))
        hidden = inputs
        for channels in (32,) * 12:
            hidden = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(hidden)
        hidden = keras.layers.GlobalAveragePooling2D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = PER_REPLICA_BATCH * replicas
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, batch * STEPS)
    # One replica's batch, as the step holds it (labels as int64, as the data set yields them).
    batch_bytes = PER_REPLICA_BATCH * (32 * 32 * 3 * 4 + 8)
    record = {"times": [], "allocator": [], "outside": [], "process": []}
    logdir = tempfile.mkdtemp(prefix="distributed_")

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, step, logs=None):
            if self.epoch == 1:
                info = tf.config.experimental.get_memory_info(device)
                self.start = info["current"]
                tf.config.experimental.reset_memory_stats(device)
                if step == PROFILED_BATCH:
                    tf.profiler.experimental.start(logdir)
            self.started = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            elapsed = time.perf_counter() - self.started
            if self.epoch == 1:
                if step == PROFILED_BATCH:
                    tf.profiler.experimental.stop()
                else:
                    record["times"].append(elapsed)
                resident = resident_bytes(model.variables) + resident_bytes(model.optimizer.variables)
                peak = tf.config.experimental.get_memory_info(device)["peak"]
                record["process"].append(peak)
                record["allocator"].append(peak - self.start + resident + batch_bytes)
                record["outside"].append(self.start - resident - batch_bytes)

    options = {"time_limit": 30} if strategy_name == "optimal" else {}
    try:
        history = tfremat.fit(model, budget, x, y, batch_size=batch, epochs=2, shuffle=False, strategy=strategy_name,
                              cost_model=cost_model, callbacks=[Probe()], verbose=0, allocator_check=allocator_check,
                              **options)
    except InfeasibleBudgetError as error:
        print("RESULT " + json.dumps({"error": str(error), "device": device}), flush=True)
        return
    plan = next(iter(history.plans.values()))
    resident = resident_bytes(model.variables) + resident_bytes(model.optimizer.variables) + batch_bytes
    requested, live = live_at_peak(logdir, device)
    print("RESULT " + json.dumps({
        "allocator": max(record["allocator"]), "requested": requested + resident,
        "outside": int(np.median(record["outside"])), "outside_range": [min(record["outside"]), max(record["outside"])],
        "process": max(record["process"]), "step": float(np.median(record["times"])),
        "predicted": plan.predicted_peak_bytes, "budget": plan.budget_bytes,
        "all_reduce": plan.extraction.side_table.fixed_bytes_breakdown.get("all_reduce", 0),
        "recomputations": plan.schedule.recompute_count, "checked": next(iter(history.allocator_peaks.values()), None),
        "device": device, "live": live[:24]}), flush=True)


def run(replicas: int, budget: str, strategy_name: str, cost_model: str, allocator_check) -> list[dict]:
    sockets = [socket.socket() for _ in range(replicas)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    processes = []
    try:
        for index in range(replicas):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            processes.append(subprocess.Popen([sys.executable, __file__, "--worker", budget, strategy_name, cost_model,
                                               str(allocator_check)],
                                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [process.communicate(timeout=900)[0] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    results = []
    for output in outputs:
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"a worker reported nothing:\n{output[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-model", default="profile", choices=("profile", "flops"))
    parser.add_argument("--detail", action="store_true", help="print the live buffers at each worker's requested peak")
    parser.add_argument("--only", help="run only the configuration with this label (e.g. checkpoint-all)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", default=os.path.join(HERE, "results", "distributed.md"))
    args = parser.parse_args()
    from tfremat.budget import format_bytes

    def mib(value):
        return format_bytes(value).replace(" MiB", "")

    rows, notes, devices = [], [], set()
    for label, budget, strategy_name, allocator_check in CONFIGS:
        if args.only and args.only != label:
            continue
        for replicas in args.replicas:
            results = run(replicas, budget, strategy_name, args.cost_model, allocator_check)
            for index, result in enumerate(results):
                if "error" in result:
                    notes.append(f"- {label}, {replicas} replica{'s' * (replicas > 1)}, worker {index}: "
                                 f"{result['error']}")
                    print(notes[-1], flush=True)
                    continue
                devices.add(result["device"])
                rows.append(f"| {label} | {replicas} | {index} | {result['recomputations']} | {mib(result['budget'])} | "
                            f"{mib(result['predicted'])} | {mib(result['all_reduce'])} | {mib(result['requested'])} | "
                            f"{result['requested'] / result['predicted']:.2f} | {mib(result['allocator'])} | "
                            f"{result['allocator'] / result['predicted']:.2f} | {mib(result['outside'])} | "
                            f"{result['step'] * 1000:.0f} |")
                if result["checked"] is not None:
                    notes.append(f"- {label}, {replicas} replica{'s' * (replicas > 1)}, worker {index}: "
                                 f"allocator_check agreed on a largest peak of {mib(result['checked'])} MiB")
                print(rows[-1], flush=True)
                if args.detail:
                    print(f"    process peak {mib(result['process'])}, outside the step "
                          f"{mib(result['outside_range'][0])} to {mib(result['outside_range'][1])}")
                    for key, value in result["live"]:
                        print(f"    {value / 2**20:8.2f} MiB  {key}")
    load = os.getloadavg()
    text = "\n".join(line for line in [
        "# Per-replica memory and step time under MultiWorkerMirroredStrategy",
        "",
        f"`python benchmarks/distributed.py{'' if args.cost_model == 'profile' else ' --cost-model flops'}`: "
        f"a 12-conv net (32 channels, 32x32x3 input), per-replica batch {PER_REPLICA_BATCH}, each replica a local "
        f"worker process with its own BFC allocator on {', '.join(sorted(devices))}, TF_NUM_INTEROP_THREADS=1, "
        f"{args.cost_model} cost model, "
        f"{STEPS} steps per epoch, measured over the second epoch. Memory in MiB, per worker, in the prediction's "
        "convention (above the allocator's state at the step's start, plus variables, optimizer slots and the "
        "replica's batch): requested from the profiler's allocation events of one step, allocator the largest "
        "peak over the epoch's steps; outside the step: what the allocator held at a step's start beyond "
        f"variables and batch (the data set). Load average at the end: {load[0]:.1f} (2 cores, shared machine: "
        "times are noisy).",
        "",
        "| budget | replicas | worker | recomputations | budget MiB | predicted | of which all_reduce | requested | "
        "requested / predicted | allocator | allocator / predicted | outside the step | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *notes,
        "" if notes else None,
    ] if line is not None)
    with open(args.output, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], {"None": None, "True": True, "False": False}[sys.argv[5]])
    else:
        main()
