"""The temporaries of an optimizer's update, measured on probe variables.

A Keras optimizer's update of one variable requests weight-sized buffers beyond the
variable, its gradient and its slots: SGD with momentum and Adam one (``m * momentum`` or
``g - m`` before it is assigned), RMSprop two, RMSprop with momentum three, plain SGD none
(its ``g * lr`` takes the gradient's buffer). Updates of several variables whose gradients
all exist run one after the other in TensorFlow's executor (one inter-op thread), except
for Lion, which computes one more weight-sized product of every other variable's momentum
first. ``benchmarks/optimizer_update.py`` holds the table for the common optimizers.

:func:`update_temporaries` measures the optimizer the user gave: a copy of it (same config,
its own variables, so the user's optimizer state does not move) updates one, then two probe
variables whose gradients exist before the update starts, in a ``tf.function`` traced as
the compiled step applies gradients (no all-reduce), and the profiler's requested bytes
above the gradients give the two ratios of :class:`UpdateTemporaries`, the largest over
:data:`_RUNS` runs of each of :data:`_TRACES` traces.

The probe runs on the executor the compiled step runs on
(:func:`~tfremat.runtime.executor.step_executor`): with several inter-op threads the step's
updates run one op at a time on the single-threaded executor, and a probe on the default
one counted Adam at 2 buffers and RMSprop at 3 where the
step holds 1 and 2 (predictions 10-23% high under TensorFlow's default threads). On the
default executor with several threads an
update's independent operations overlap differently from run to run: Adam's single-variable
update read 1 weight-sized buffer in 10 of 40 runs and 2 in 30, RMSprop with momentum 3 or 4. A probe of a few runs
then gave each process its own count, so the same model's graph (its backward workspaces,
fingerprint and share budgets) differed between processes and no cached schedule was found
(``benchmarks/results/allocator_check.md``). Hence the largest over many runs, and the
result is stored with the profiles (``<cache dir>/optimizer_update/``, keyed by the
optimizer's class, code and config, TensorFlow, the device and the inter-op setting): a
later process reads the first one's count.

The probe is measured where no ``tf.distribute`` strategy is active: under one (``fit``
extracts as replica 0 inside the model's strategy scope) its variables would be made by the
strategy's variable creator and the clone's slots refused as not of its scope.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os

import keras
import numpy as np
import tensorflow as tf

from tfremat.cache import read_entry, warn_once, write_atomically
from tfremat.errors import CompileError
from tfremat.extract.profile_cache import cache_dir, code_fingerprint
from tfremat.runtime.executor import calls_functions, step_executor
from tfremat.runtime.memory import default_device, requested_peak
from tfremat.runtime.optimizer import apply_gated

__all__ = ["UpdateTemporaries", "update_temporaries"]

logger = logging.getLogger(__name__)

# A probe variable of 512 x 512 float32 (1 MiB): the update's scalars (learning rate,
# iteration count) are then below 0.1% of it. Two dimensions, so that optimizers that treat
# matrices apart (factored second moments) take the matrix path.
_PROBE_SHAPE = (512, 512)
# Used when the profiler records nothing (no BFC allocator): the most any optimizer of the
# table needs (RMSprop with momentum: three weight-sized buffers).
_UNMEASURED = 3.0

# Independent traces of each probe, the largest kept: the executor's order of an update's
# operations can differ between traces, and the step's own trace may take either (AdamW read
# 1 or 2 buffers until :func:`~tfremat.runtime.optimizer.apply_gated` ordered its decay first).
_TRACES = 2
# Runs of each trace, each read on its own: with several inter-op threads the overlap of an
# update's operations differs from run to run (module docstring); Adam's larger count came
# in 3 of 4 runs, RMSprop with momentum's in 7 of 40.
_RUNS = 24
# Part of the on-disk key: a change of the probe gives every stored count a new key
# (3: an update that calls functions runs on the default executor; 4: measured outside any
# tf.distribute strategy, whose scope changed the count).
_PROBE_VERSION = 4

_cache: dict[str, "UpdateTemporaries"] = {}


@dataclasses.dataclass(frozen=True)
class UpdateTemporaries:
    """Bytes an update requests beyond the variables, gradients and slots, per variable byte.

    Attributes:
        first: for the variable whose update peaks (the largest).
        concurrent: for every other variable updated at the same time (its gradient exists
            when the updates start), held while the first one peaks.
    """

    first: float
    concurrent: float

    def bytes_for(self, sizes) -> int:
        """The temporaries of updating variables of ``sizes`` bytes together."""
        sizes = [int(s) for s in sizes if s]
        if not sizes:
            return 0
        largest = max(sizes)
        return int(math.ceil(self.first * largest + self.concurrent * (sum(sizes) - largest)))


def update_temporaries(optimizer, *, use_cache: bool = True) -> UpdateTemporaries:
    """The update temporaries of ``optimizer`` (module docstring): measured once per class
    and config in a process, and with ``use_cache`` (``extract``'s) read from and stored on
    disk, so that every process counts the same."""
    key = _config_key(optimizer)
    if key not in _cache:
        stored = _load(key) if use_cache else None
        if stored is not None:
            _cache[key] = stored
        else:
            measured = _outside_strategy(_measure, optimizer)
            if measured is not None and use_cache:
                _store(key, measured)
            _cache[key] = measured if measured is not None else UpdateTemporaries(_UNMEASURED, 0.0)
        logger.info("optimizer %s: its update requests %.2fx the largest variable + %.2fx the others%s",
                    type(optimizer).__name__, _cache[key].first, _cache[key].concurrent,
                    " (stored)" if stored is not None else "")
    return _cache[key]


def _config_key(optimizer) -> str:
    """What the count depends on: the optimizer's class, its code and config (the inner
    optimizer's with a loss-scale wrapper) but not its name, the probe, and where and how
    it runs."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    payload = {
        "probe": _PROBE_VERSION,
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "code": [code_fingerprint(type(optimizer)), code_fingerprint(type(inner)), code_fingerprint(apply_gated)],
        "config": _without_names(keras.optimizers.serialize(optimizer)),
        "tf": tf.__version__,
        "keras": keras.__version__,
        "device": default_device(),
        "inter_op_threads": (tf.config.threading.get_inter_op_parallelism_threads(),
                             os.environ.get("TF_NUM_INTEROP_THREADS")),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _without_names(config):
    """``config`` less the optimizers' names, which Keras numbers per process ("sgd",
    "sgd_1") and which change nothing in the update."""
    if isinstance(config, dict):
        return {k: _without_names(v) for k, v in config.items() if k != "name"}
    if isinstance(config, list):
        return [_without_names(v) for v in config]
    return config


def _path(key: str) -> str:
    return os.path.join(cache_dir(), "optimizer_update", f"{key}.json")


def _load(key: str) -> UpdateTemporaries | None:
    """The stored count, or None (none stored, or an entry that does not parse: logged,
    measured again and overwritten)."""
    text = read_entry(_path(key))
    if text is None:
        return None
    try:
        data = json.loads(text)
        stored = UpdateTemporaries(float(data["first"]), float(data["concurrent"]))
        if not (stored.first >= 0 and stored.concurrent >= 0):
            raise ValueError(f"negative count {stored}")
    except Exception as error:  # noqa: BLE001 - whatever an entry holds, it is a miss, never the user's error
        logger.warning("optimizer update entry %s is damaged (%s: %s); measuring again", _path(key),
                       type(error).__name__, str(error)[:300])
        return None
    return stored


def _store(key: str, temporaries: UpdateTemporaries) -> None:
    """Writes the count atomically; a directory that cannot be written is logged once."""
    path = _path(key)
    try:
        write_atomically(path, json.dumps(dataclasses.asdict(temporaries)))
    except OSError as error:
        warn_once(os.path.dirname(path), "written", error)


def _outside_strategy(work, *args):
    """``work(*args)`` where no ``tf.distribute`` strategy or replica context is active.

    A strategy's scope and replica context live on the thread's default graph, and
    TensorFlow refuses to enter the default strategy's scope inside another strategy's, so
    under a strategy the work runs in a thread of its own (which also has no trace and no
    gradient tape of the caller's). Without one it runs here, in the caller's thread.
    """
    if not tf.distribute.has_strategy():
        return work(*args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfremat-update-probe") as pool:
        return pool.submit(work, *args).result()


def _measure(optimizer) -> UpdateTemporaries | None:
    """The probe's count, or None where the profiler records nothing (logged; the caller
    counts :data:`_UNMEASURED` buffers in this process and stores nothing)."""
    variable_bytes = int(np.prod(_PROBE_SHAPE)) * 4
    try:
        one = max(_probe(optimizer, 1) for _ in range(_TRACES)) / variable_bytes
        two = max(_probe(optimizer, 2) for _ in range(_TRACES)) / variable_bytes
    except CompileError as error:
        logger.warning("could not measure %s's update temporaries (%s); counting %.0f weight-sized buffers",
                       type(optimizer).__name__, error, _UNMEASURED)
        return None
    # To 1/100 of a variable: the update's scalars are a few hundred bytes.
    return UpdateTemporaries(round(one, 2), round(max(two - one, 0.0), 2))


def _probe(optimizer, count: int) -> int:
    """Bytes ``count`` probe updates request above their gradients, all updated at once:
    the most of :data:`_RUNS` runs of one trace."""
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    variables = [keras.Variable(np.zeros(_PROBE_SHAPE, "float32"), name=f"probe_{i}") for i in range(count)]
    clone.build(variables)
    seeds = [tf.constant(np.full(_PROBE_SHAPE, 0.5, "float32")) for _ in range(count)]

    def update(seeds):
        # Fresh gradients (not held by the caller, as in the training step), all made
        # before the update starts.
        gradients = [seed * 2.0 for seed in seeds]
        with tf.control_dependencies(gradients):
            gradients = [tf.identity(g) for g in gradients]
        _apply(clone, list(zip(gradients, variables)))
        return tf.constant(0.0)

    step = tf.function(update, autograph=False)
    with step_executor():  # traced and run as the step's updates are
        graph = step.get_concrete_function(seeds).graph
    # As the step: an update that calls functions (a loss scale's tf.cond) is traced again
    # and run on the default executor (executor.calls_functions).
    blocked = calls_functions(graph)
    if blocked:
        step = tf.function(update, autograph=False)
    with contextlib.nullcontext() if blocked else step_executor():
        step(seeds)
        peak = max(requested_peak(lambda: step(seeds).numpy(), default_device()) for _ in range(_RUNS))
    return max(peak - count * int(np.prod(_PROBE_SHAPE)) * 4, 0)


def _apply(optimizer, pairs) -> None:
    """The update as the compiled step applies gradients on one replica (its
    ``_apply_without_barrier``): :func:`~tfremat.runtime.optimizer.apply_gated` where the
    optimizer has Keras's TensorFlow all-reduce to skip, else unchanged."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(inner, "_all_reduce_sum_gradients"):
        apply_gated(optimizer, pairs)
    else:
        optimizer.apply_gradients(pairs)
