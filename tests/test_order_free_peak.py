"""A forward's profiled workspace does not depend on the order the runtime drew for its trace.

The executor runs a function's independent operations in an order drawn per instantiation:
a batch norm's forward peaked with two to five of its per-channel vectors live, by trace,
so its workspace, and the graph's memory figures, differed between two extractions of one
model (benchmarks/results/profile_agreement.md, "Session 29 (W)"). The forward's peak now
counts its allocations up to one example's output as live throughout
(:func:`tfremat.runtime.memory.order_free_peak`).
"""

import os

import pytest

from tfremat.runtime.memory import _replayed_peak, order_free_peak


def _events(order):
    """Allocation events of a run: a 1000-byte output allocated first and kept, then the
    small allocations ``order`` names (bytes), each freed before the next one starts."""
    events = [(0, True, "out", 1000, {})]
    for step, (name, size) in enumerate(order):
        events += [(2 * step + 1, True, name, size, {}), (2 * step + 2, False, name, size, {})]
    return events


def test_small_allocations_count_whole_in_any_order():
    small = [("mean", 30), ("variance", 30), ("update", 20)]
    bounds = {order_free_peak(_events(order), small_bytes=100) for order in (small, small[::-1])}
    assert bounds == {1000 + 80}
    # An upper bound of what the run requested, whichever order it ran.
    assert order_free_peak(_events(small), small_bytes=100) >= _replayed_peak(_events(small))[0]
    # A free is matched to its allocation by address, not by the bytes it carries.
    unsized_frees = [(t, allocation, addr, size if allocation else 0, info)
                     for t, allocation, addr, size, info in _events(small)]
    assert order_free_peak(unsized_frees, small_bytes=100) == 1000 + 80
    # Bytes counted off the graph when the run allocated fewer (a forwarded buffer).
    assert order_free_peak(_events(small[:1]), small_bytes=100, small_total=80) == 1000 + 80
    # Nothing under the threshold: the replayed peak itself.
    assert order_free_peak(_events(small), small_bytes=10) == _replayed_peak(_events(small))[0]


tf = pytest.importorskip("tensorflow")

from subprocess_result import run_script  # noqa: E402

_SCRIPT = f"""
import json, sys
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
import tfremat
import keras
import tensorflow as tf
from tfremat.extract import analysis
from tfremat.runtime import executor

found = []
with executor.step_executor(), analysis.memory_only():
    # On a 1x1 map a per-channel vector is as large as one example's output.
    for spec in [tf.TensorSpec((4, 4, 4, 256), tf.float32)] * 4 + [tf.TensorSpec((4, 1, 1, 256), tf.float32)] * 4:
        layer = keras.layers.BatchNormalization()
        layer.build(spec.shape)
        result = analysis.analyze_call(lambda xs: layer(xs[0], training=True), "batch_normalization", [spec],
                                       [True], layer.trainable_variables, 4, profile=True)
        found.append(result.forward_workspace)
print("RESULT " + json.dumps(found))
"""


def test_a_batch_norm_forward_workspace_is_the_same_in_every_trace(tmp_path):
    workspaces = run_script(tmp_path / "forward.py", _SCRIPT, timeout=600)
    for one_shape in (workspaces[:4], workspaces[4:]):
        assert len(set(one_shape)) == 1, workspaces
        # At least the statistics and the two moving-average updates' vectors (1 KiB each).
        assert one_shape[0] >= 4 * 256 * 4, workspaces
