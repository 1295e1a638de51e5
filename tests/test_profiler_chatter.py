"""The profiler's session log lines stay off the user's terminal (tfremat.runtime.profiler)."""

import os
import tempfile

import tensorflow as tf

from tfremat.runtime.profiler import profiler_trace, without_profiler_chatter


def test_chatter_is_dropped_and_other_lines_pass_in_order(capfd):
    with without_profiler_chatter():
        os.write(2, b"I0000 00:00:1.0   17 profiler_session.cc:117] Profiler session initializing.\n")
        os.write(2, b"W0000 00:00:1.0   17 some_kernel.cc:12] a real warning\n")
        os.write(2, b"I0000 00:00:1.0   17 save_profile.cc:150] Collecting XSpace to repository: /tmp/x\n")
        os.write(2, b"W0000 00:00:1.0   17 session_manager.cc:55] host_tracer_level expects an i value.\n")
        os.write(2, b"second line\n")
    err = capfd.readouterr().err
    assert "Profiler session" not in err and "Collecting XSpace" not in err and "expects an" not in err
    assert err.index("a real warning") < err.index("second line")


def test_profiler_trace_records_and_prints_no_session_lines(capfd):
    with tempfile.TemporaryDirectory() as logdir:
        with profiler_trace(logdir, tf.profiler.experimental.ProfilerOptions(host_tracer_level=1)):
            tf.reduce_sum(tf.ones([8, 8])).numpy()
        written = [name for _, _, names in os.walk(logdir) for name in names if name.endswith(".xplane.pb")]
    assert written
    err = capfd.readouterr().err
    assert "profiler_session.cc" not in err and "save_profile.cc" not in err and "session_manager.cc" not in err
