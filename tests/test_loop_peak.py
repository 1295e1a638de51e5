"""A loop's profiled peak on the single-threaded executor counts one more loop variable.

There the executor runs each iteration of a ``While`` body on an inter-op thread, and in a
few traces in ten one more buffer of a loop variable was live at the peak (a small LSTM's
backward: +16 KiB, its recurrent kernel's gradient accumulator; the compiled step the same
in a few processes per hundred). ``tfremat.extract.analysis._loop_peak`` counts it above
the least traced peak, so that a trace with the buffer and one without give one number,
and keeps the largest over the call's profiles (tests/test_default_threads_memory.py runs
the step).
"""

import pytest
import tensorflow as tf

from tfremat.extract import analysis


def _loop_record():
    """A trace record (as ``_CallTracer`` keeps) whose forward runs a While over a 32x128
    float32 loop variable (16,384 B) and a counter."""

    def body(i, x):
        return i + 1, x * 0.5

    def run(x):
        return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), x))[1]

    graph = tf.function(run, autograph=False).get_concrete_function(tf.TensorSpec([32, 128])).graph
    return {"forward_ops": graph.get_operations(), "backward_ops": []}


def test_the_largest_loop_variable_is_its_bytes():
    record = _loop_record()
    assert analysis._loop_variable_bytes(record["forward_ops"]) == 32 * 128 * 4
    assert analysis._loop_variable_bytes(record["backward_ops"]) == 0


def test_a_trace_with_and_one_without_the_buffer_give_one_peak(monkeypatch):
    monkeypatch.setattr(analysis.executor, "sequential_ops", lambda: False)  # the single-threaded executor
    monkeypatch.setattr(analysis, "_LOOP_PEAKS", {})
    record = _loop_record()
    without, with_buffer = 100_000, 100_000 + 32 * 128 * 4
    assert analysis._loop_peak(record, "forward", [without, without]) == with_buffer
    assert analysis._loop_peak(record, "forward", [with_buffer, without]) == with_buffer
    # A later profile whose traces all read less keeps the largest so far.
    assert analysis._loop_peak(record, "forward", [without - 512]) == with_buffer
    # A part without a loop is its largest trace.
    assert analysis._loop_peak(record, "backward", [without, without - 512]) == without


@pytest.mark.parametrize("peaks", [[100_000], [90_000, 100_000]])
def test_one_inter_op_thread_keeps_the_largest_trace(monkeypatch, peaks):
    monkeypatch.setattr(analysis.executor, "sequential_ops", lambda: True)  # the default executor
    monkeypatch.setattr(analysis, "_LOOP_PEAKS", {})
    assert analysis._loop_peak(_loop_record(), "forward", peaks) == max(peaks)
