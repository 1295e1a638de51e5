"""Chaining a backward's operations in the greediest order leaves Grappler a sortable graph.

The profiler runs each backward once with its operations chained by control edges
(``tfremat.extract.analysis._run_greediest``). Grappler's constant folding replaced a
chained shape read with a constant (every layer norm) and swapped a chained multiplication
by a constant with its reader (``Erf``'s gradient in every GELU Dense), each closing a
cycle: it logged "The graph couldn't be sorted in topological order" (four lines per GELU
Dense) and skipped its passes on that function. TensorFlow logs from C++, so the models
are extracted in a subprocess whose stderr is read.
"""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "1"  # errors logged, as users see them
    sys.path[:0] = [{root!r}]
    import keras, numpy as np
    from tfremat.extract import extract

    def gelu(x):
        return keras.layers.Dense(64, activation="gelu")(x)

    def layer_norm(x):
        return keras.layers.LayerNormalization()(keras.layers.Dense(64)(x))

    for body in (gelu, layer_norm):
        keras.utils.set_random_seed(0)
        x = keras.Input((16,))
        model = keras.Model(x, keras.layers.Dense(4)(body(x)))
        xs = np.random.default_rng(0).standard_normal((4, 16)).astype("float32")
        graph = extract(model, (xs, np.zeros((4, 4), "float32")), loss="mse", cost_model="profile", timing=False,
                        use_cache=False).graph
        print("BACKWARD", body.__name__, sum(name.endswith("_backward") for name in graph.names))
    """
)


def test_profiling_gelu_and_layer_norm_logs_no_unsortable_graph(tmp_path):
    script = tmp_path / "greediest_chain.py"
    script.write_text(_SCRIPT.format(root=ROOT))
    env = dict(os.environ, TFREMAT_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # Both models were profiled, backward nodes included (dense + body + head).
    assert "BACKWARD gelu 2" in result.stdout and "BACKWARD layer_norm 3" in result.stdout, result.stdout
    unsortable = [line for line in result.stderr.splitlines() if "topological" in line]
    assert not unsortable, unsortable[:4]
