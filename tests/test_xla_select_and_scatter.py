"""XLA's CPU rewrite of a max pool's gradient is counted (user_check_3.md finding 4).

Under ``compile(jit_compile=True)`` XLA's CPU backend replaces the select-and-scatter of a
max pool's gradient with a reduce-window over the input and one ``iota`` of the input's
shape per dimension, returning the selected positions, which a scatter reads in the
backward. A CNN with a 2x2 max pool of a 4 MiB map requested 10.00 MiB more than its
plan predicted; with the iotas counted as the pool's forward workspace and the positions as
its residual it requested 35.53 MiB against 35.78 predicted.
"""

import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.extract import analysis  # noqa: E402
from tfremat.runtime import executor  # noqa: E402

_HLO = """
%wrapped_iota_computation () -> s32[2,4,4,3] {
  ROOT %iota.4 = s32[2,4,4,3]{3,2,1,0} iota(), iota_dimension=0
}
%wrapped_iota_computation.1 () -> s32[2,4,4,3] {
  ROOT %iota.5 = s32[2,4,4,3]{3,2,1,0} iota(), iota_dimension=1
}
%small () -> s32[7] {
  ROOT %iota.6 = s32[7]{0} iota(), iota_dimension=0
}
ENTRY %main (arg0.1: f32[2,4,4,3]) -> f32[2,4,4,3] {
  %w = (f32[2,2,2,3]{3,2,1,0}, s32[2,2,2,3]{3,2,1,0}, s32[2,2,2,3]{3,2,1,0}) reduce-window(%a, %b, %c), window={size=1x2x2x1}
}
"""


def test_the_iotas_and_positions_are_read_off_the_hlo():
    workspace, indices = analysis._select_and_scatter_bytes(_HLO, [2 * 4 * 4 * 3])
    # Two input-shaped iotas (the 7-element one is not the input's), the window's three outputs.
    assert workspace == 2 * 96 * 4 + 3 * 24 * 4
    assert indices == 2 * 24 * 4
    assert analysis._select_and_scatter_bytes(_HLO.replace("reduce-window", "add"), [96]) == (0, 0)


def test_a_max_pool_under_xla_counts_the_rewrite():
    shape = (4, 8, 8, 4)
    pool = keras.layers.MaxPooling2D()
    spec = tf.TensorSpec(shape, tf.float32)
    with executor.step_executor(), analysis.memory_only():
        plain = analysis.analyze_call(lambda xs: pool(xs[0]), "max_pooling2d", [spec], [True], [], shape[0],
                                      profile=True)
        with analysis.xla_layouts():
            compiled = analysis.analyze_call(lambda xs: pool(xs[0]), "max_pooling2d", [spec], [True], [], shape[0],
                                             profile=True)
    input_bytes = 4 * 8 * 8 * 4 * 4
    output_elements = 4 * 4 * 4 * 4
    assert compiled.forward_workspace >= plain.forward_workspace + 4 * input_bytes
    assert compiled.residual_bytes >= 4 * output_elements * 4
