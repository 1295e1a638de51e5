"""Random valid schedules of a small MobileNetV2-like net give plain Keras's gradients.

A MobileNetV2 schedule was once reported to change the gradients (benchmarks/results/user_check.md,
finding 1); it was the reference's rounding at an ill-conditioned point
(benchmarks/results/mnv2_gradient_check.md), but the layers it exercised are guarded here
class-wise: batch norm in training mode (its statistics recomputed with its input), ReLU6,
depthwise convolutions, a residual ``Add`` of a block's input and its projection, a strided
block, under random schedules that recompute more than any strategy
(tests/test_schedule_gradients.py's ``_random_schedule``, whose ViT test also checks
training steps). Beyond matching plain Keras within float32's tolerances, a recomputation
runs the same operations on the same values, so the step's gradients equal
checkpoint-all's to rounding far below them: within a tenth of the per-tensor tolerance.
Not bit for bit: first forward computations are chained for Grappler and recomputations are
not (tfremat.static_graph.interpreter._chained_computes), so with oneDNN off Grappler
regroups a sum at checkpoint-all that it leaves in a recomputation (1.8e-6 per tensor since
the chains came in).
"""

import keras
import pytest

tf = pytest.importorskip("tensorflow")
from test_schedule_gradients import _random_schedule  # noqa: E402
from training_case import TrainingCase  # noqa: E402

from tfremat.numerics import TENSOR_TOLERANCE, closeness  # noqa: E402
from tfremat.plan.execution import build_plan  # noqa: E402
from tfremat.static_graph.interpreter import interpret_plan  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _inverted_residual_net():
    """MobileNetV2's stem and three inverted-residual blocks (the middle one strided), 8x8 input."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    inputs = keras.Input((8, 8, 3))
    x = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)))
    for stride in (1, 2, 1):
        h = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(24, 1, use_bias=False)(x)))
        h = layers.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=False)(h)
        h = layers.ReLU(6.0)(layers.BatchNormalization()(h))
        h = layers.BatchNormalization()(layers.Conv2D(8, 1, use_bias=False)(h))
        x = layers.Add()([x, h]) if stride == 1 else h
    outputs = layers.Dense(4, activation="softmax")(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, outputs, name="inverted_residual_net")


@pytest.fixture(scope="module")
def case():
    return TrainingCase(_inverted_residual_net, batch=4)


def _gradients(case, schedule):
    graph, table = case.extraction.graph, case.extraction.side_table
    plan = build_plan(graph, schedule)

    @tf.function
    def gradients(x, y):
        _, _, grads, _ = interpret_plan(graph, table, plan, x, y)
        return [grads[id(v)][1] for v in case.model.trainable_variables]

    case.reset()
    result = [g.numpy() for g in gradients(case.x, case.y)]
    case.reset()
    return result


@pytest.fixture(scope="module")
def checkpoint_all_gradients(case):
    return _gradients(case, get_strategy("checkpoint_all")(case.extraction.graph, None))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_schedules_of_an_inverted_residual_net_give_plain_keras_gradients(case, checkpoint_all_gradients,
                                                                                 seed):
    graph = case.extraction.graph
    schedule = _random_schedule(graph, seed)
    assert schedule.recompute_count > graph.size // 4  # recomputes batch norms, depthwise convolutions, adds
    gradients = _gradients(case, schedule)
    case.reset()
    to_plain = closeness(gradients, case.plain_gradients())
    assert to_plain.equal, (seed, case.model.trainable_variables[to_plain.worst_tensor].path, to_plain)
    assert closeness(gradients, checkpoint_all_gradients).max_tensor_error <= TENSOR_TOLERANCE / 10
