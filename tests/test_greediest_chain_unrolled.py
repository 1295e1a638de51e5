"""The greediest order of an unrolled GELU's backward leaves Grappler a sortable graph.

``TimeDistributed(Dense(activation="gelu"))`` unrolls its Dense once per time step; the
profiler's greediest order (``tfremat.extract.analysis._run_greediest``) ran every step's
``Exp`` before the first step's ``(x * c) * exp`` product, so once constant folding swapped
that product with its constant operand the chained function had a cycle: TensorFlow logged
"arithmetic_optimizer failed ... The graph couldn't be sorted in topological order" and
three more such lines per profile, and skipped its passes on that function.
TensorFlow logs from C++, so the model is extracted in a subprocess whose stderr is read.
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
    sys.path[:0] = [{root!r}]
    import keras, numpy as np
    from tfremat.extract import extract

    keras.utils.set_random_seed(0)
    x = keras.Input((8, 16))
    h = keras.layers.TimeDistributed(keras.layers.Dense(32, activation="gelu"))(x)
    model = keras.Model(x, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h)))
    xs = np.random.default_rng(0).standard_normal((4, 8, 16)).astype("float32")
    graph = extract(model, (xs, np.zeros((4, 4), "float32")), loss="mse", cost_model="profile", timing=False,
                    use_cache=False).graph
    print("PROFILED", [name for name in graph.names if name.endswith("_backward")])
    """
)


def test_time_distributed_gelu_profiles_without_unsortable_graph(tmp_path):
    script = tmp_path / "greediest_unrolled.py"
    script.write_text(_SCRIPT.format(root=ROOT))
    env = dict(os.environ, TFREMAT_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # errors logged, as users see them
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # The TimeDistributed layer was profiled, its backward included.
    assert "'time_distributed_backward'" in result.stdout, result.stdout
    unsortable = [line for line in result.stderr.splitlines() if "topological" in line]
    assert not unsortable, unsortable[:4]
