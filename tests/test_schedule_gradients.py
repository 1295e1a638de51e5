"""Arbitrary valid schedules of a small ViT train exactly like plain Keras.

The strategies' schedules are a few points of the schedule space; a MILP incumbent at its
time limit (which one a run gets depends on the profile and the machine's load) can
recompute more than any strategy does: a node whose value is never read again, a backward
node or the loss twice, a forward node after its own backward. The schedules here are
random ones: a random subset of checkpoint-all's keep matrix completed by
:func:`~tfremat.plan.schedule.schedule_from_keep_matrix`, plus random redundant
recomputations wherever their inputs are resident. The model has what made a
benchmarks/min_budget.py ViT schedule suspect: dropout inside the opened
``MultiHeadAttention`` and in the MLPs, a custom patch layer, an ``Embedding`` added to a
projection, a softmax output read through its logits by the cross-entropy.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from training_case import TrainingCase  # noqa: E402

from tfremat.numerics import closeness  # noqa: E402
from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix, validate_schedule  # noqa: E402
from tfremat.static_graph import compile_step  # noqa: E402
from tfremat.static_graph.interpreter import interpret_plan  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _small_vit(image_size=8, patch_size=4, dim=8, heads=2, blocks=1, classes=4):
    """benchmarks/min_budget.py's keras.io ViT, shrunk to test size."""
    from keras import layers, ops

    class Patches(layers.Layer):
        def __init__(self, size, **kwargs):
            super().__init__(**kwargs)
            self.size = size

        def call(self, images):
            patches = ops.image.extract_patches(images, size=self.size)
            rows, cols, dims = patches.shape[1], patches.shape[2], patches.shape[3]
            return ops.reshape(patches, (ops.shape(images)[0], rows * cols, dims))

    class PatchEncoder(layers.Layer):
        def __init__(self, num_patches, dim, **kwargs):
            super().__init__(**kwargs)
            self.num_patches = num_patches
            self.projection = layers.Dense(dim)
            self.position_embedding = layers.Embedding(num_patches, dim)

        def call(self, patch):
            positions = ops.expand_dims(ops.arange(0, self.num_patches, 1), axis=0)
            return self.projection(patch) + self.position_embedding(positions)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((image_size, image_size, 3))
    encoded = PatchEncoder((image_size // patch_size) ** 2, dim)(Patches(patch_size)(inputs))
    for _ in range(blocks):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=heads, key_dim=dim, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = layers.Dropout(0.1)(layers.Dense(dim, activation=keras.activations.gelu)(x3))
        encoded = layers.Add()([x3, x2])
    representation = layers.Dropout(0.5)(layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded)))
    head = layers.Dropout(0.5)(layers.Dense(16, activation=keras.activations.gelu)(representation))
    outputs = layers.Dense(classes, activation="softmax")(head)
    return keras.Model(inputs, outputs, name="small_vit")


class _DenseGradients(TrainingCase):
    """TrainingCase with the Embedding's sparse gradient made dense for the comparison."""

    def plain_gradients(self):
        model, loss_fn = self.model, self.extraction.side_table.loss_fn

        @tf.function
        def grads(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn([y], [model(x, training=True)])
            return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

        return [g.numpy() for g in grads(self.x, self.y)]

    def assert_trains_like_plain(self, schedule, label: str):
        """One step's gradients, then three optimizer steps' losses and variables (dropout
        seeds included), against plain Keras."""
        graph, side_table = self.extraction.graph, self.extraction.side_table
        self.reset()
        expected = self.plain_gradients()
        self.reset()
        plan = compile_step(self.extraction, schedule, optimizer=self.optimizer()).plan

        @tf.function
        def compiled_gradients(x, y):
            _, _, weight_grads, _ = interpret_plan(graph, side_table, plan, x, y)
            return [tf.convert_to_tensor(weight_grads[id(v)][1]) for v in self.model.trainable_variables]

        gradients = closeness([g.numpy() for g in compiled_gradients(self.x, self.y)], expected)
        assert gradients.equal, (label, self.model.trainable_variables[gradients.worst_tensor].path, gradients)
        self.reset()
        plain_losses, plain_state = self.plain_training(3)
        self.reset()
        step = compile_step(self.extraction, schedule, optimizer=self.optimizer())
        losses = [float(step(x, y)) for x, y in self.batches[:3]]
        np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
        for variable, expected_value in zip(self.model.variables, plain_state):
            np.testing.assert_allclose(variable.numpy(), expected_value, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{label}: {variable.path}")


@pytest.fixture(scope="module")
def vit_case():
    return _DenseGradients(_small_vit, batch=4)


def _random_schedule(graph, seed: int, drop: float = 0.3, extra: float = 0.1) -> Schedule:
    """A valid schedule: each keep of checkpoint-all dropped with probability ``drop``, the
    recomputations that needs, and each further node whose inputs are resident in a stage
    recomputed there with probability ``extra`` (its value freed within the stage)."""
    rng = np.random.default_rng(seed)
    keep = checkpoint_all_s(graph) & (rng.random((graph.size, graph.size)) >= drop)
    completed = schedule_from_keep_matrix(graph, keep, "random")
    R, S = completed.R.copy(), completed.S
    for t in range(graph.size):
        for i in range(t):
            if (not R[t, i] and not S[t, i] and rng.random() < extra
                    and all(S[t, k] or R[t, k] for k in graph.predecessors[i])):
                R[t, i] = True
    schedule = Schedule(R, S, "random")
    validate_schedule(graph, schedule)
    return schedule


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_of_a_vit_train_like_plain_keras(vit_case, seed):
    graph = vit_case.extraction.graph
    schedule = _random_schedule(graph, seed)
    backward = [i for i in range(graph.size) if graph.names[i].endswith("_backward")]
    # The schedule exercises what the strategies rarely do.
    assert schedule.R[:, backward].sum() > len(backward)
    vit_case.assert_trains_like_plain(schedule, f"random schedule {seed}")
