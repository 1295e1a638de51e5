"""Log lines that stay off the user's terminal: the profiler's session lines
(tfremat.runtime.profiler) and TensorFlow's deprecation warning of a FLOP count."""

import os
import tempfile
import textwrap

import tensorflow as tf

from subprocess_result import run_script
from tfremat.runtime.profiler import profiler_trace, without_profiler_chatter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


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


_DEPRECATION_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tempfile
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.path[:0] = [{tests!r}, {root!r}]
    import numpy as np, tensorflow as tf, keras
    from models import small_convnet
    from tfremat.extract import analysis, extract
    from tfremat.runtime.internals import get_stats_for_node_def, node_flops

    counted = []  # the FLOP counts of convolutions the extraction asked for

    def counting(graph, node_def):
        flops = node_flops(graph, node_def)
        if node_def.op == "Conv2D" and flops:
            counted.append(flops)
        return flops

    analysis.node_flops = counting

    def stderr_of(work):
        # TensorFlow's warnings go to file descriptor 2 (its Python logger's handler).
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                result = work()
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            return result, captured.read().decode(errors="replace")

    model = small_convnet(input_shape=(16, 16, 3), channels=8)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    x = np.zeros((4, 16, 16, 3), "float32")
    y = np.eye(10, dtype="float32")[[0, 1, 2, 3]]
    extraction, during = stderr_of(lambda: extract(model, (x, y), cost_model="flops", use_cache=False))

    # The same FLOP function called unsilenced afterwards: the warning (printed once a
    # process) was still to come, so the capture would have seen it.
    @tf.function
    def conv(a, w):
        return tf.nn.conv2d(a, w, 1, "SAME")

    graph = conv.get_concrete_function(tf.TensorSpec((2, 8, 8, 3)), tf.TensorSpec((3, 3, 3, 4))).graph
    node = next(n for n in graph.as_graph_def().node if n.op == "Conv2D")
    _, after = stderr_of(lambda: get_stats_for_node_def(graph, node, "flops"))
    print("RESULT", json.dumps(dict(during=during, after=after, counted=len(counted))))
    """
)


def test_extracting_a_conv_model_prints_no_deprecation_warning(tmp_path):
    """The FLOP count of a Conv2D calls TensorFlow's deprecated
    ``tensor_shape_from_node_def_name``, whose 3-line warning every run printed
    (user_check_3 finding 7a); node_flops silences it."""
    found = run_script(tmp_path / "deprecation.py", _DEPRECATION_SCRIPT.format(tests=HERE, root=ROOT), timeout=300)
    assert found["counted"] > 0  # the extraction counted convolutions' FLOPs
    assert "is deprecated" not in found["during"], found["during"][-2000:]
    assert "tensor_shape_from_node_def_name" in found["after"], found["after"][-2000:]
