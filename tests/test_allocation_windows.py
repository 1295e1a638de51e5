"""Requested peaks of several runs read off one profiler session
(:class:`tfremat.runtime.memory.AllocationWindows`, used by the layer profiles:
:func:`tfremat.extract.analysis._requested_peaks`) equal each run's own session's."""

import tensorflow as tf

from tfremat.runtime.memory import AllocationWindows, requested_peak, synchronize

_MIB = 1 << 20


def _functions():
    """Three functions whose requested peaks differ: a 1 MiB output, a 1 MiB temporary next
    to a 1 MiB output, and three 1 MiB buffers live at once."""
    spec = tf.TensorSpec([256, 1024], tf.float32)

    @tf.function(autograph=False)
    def one(x):
        return x * 2.0

    @tf.function(autograph=False)
    def two(x):
        return tf.reduce_sum(tf.exp(x) + x, axis=0, keepdims=True) + x

    @tf.function(autograph=False)
    def three(x):
        a, b, c = tf.exp(x), tf.sin(x), tf.cos(x)
        return a * b + c

    return [f.get_concrete_function(spec) for f in (one, two, three)]


def test_windows_read_each_run_as_its_own_session_does():
    x = tf.ones([256, 1024])
    functions = _functions()
    for fn in functions:  # first calls (instantiation) and warm-ups, as a profile does
        synchronize(fn(x))
    alone = [requested_peak(lambda fn=fn: synchronize(fn(x)), "CPU:0") for fn in functions]
    with AllocationWindows("CPU:0") as windows:
        indexes = []
        for fn in functions:
            synchronize(fn(x))  # between windows: not counted
            indexes.append(windows.run(lambda fn=fn: synchronize(fn(x))))
    together = [windows.peak(i) for i in indexes]
    assert together == alone
    # At least each function's output; the third holds more than one 1 MiB buffer at once.
    assert all(peak >= _MIB for peak in together)
    assert together[2] > together[0]
    assert all(windows.events(i) for i in indexes)


def test_a_run_that_allocates_nothing_has_peak_zero():
    with AllocationWindows("CPU:0") as windows:
        index = windows.run(lambda: None)
    assert windows.peak(index) == 0 and windows.events(index) == []
