"""A model, its extraction and plain Keras training to compare a compiled step with
(shared by the compiled-step tests)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat.extract import assembly, extract
from tfremat.numerics import closeness
from tfremat.static_graph import compile_step
from tfremat.static_graph.interpreter import interpret_plan


def training_batch(model, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *model.input.shape[1:])).astype("float32")
    classes = model.output.shape[-1]
    labels = rng.integers(0, classes, size=(batch, *model.output.shape[1:-1]))
    y = np.eye(classes, dtype="float32")[labels]
    return tf.constant(x), tf.constant(y)


def extract_with_sole_readers(model, x, y, optimizer):
    """The profiled extraction of ``model`` on ``(x, y)`` (mse, no cache) and the names of the
    calls whose backward node is its upstream gradient's sole reader, which take the
    workspace measured with that gradient dying (:func:`tfremat.extract.assembly.sole_upstream`,
    which the graph does not record)."""
    found = []
    sole_upstream = assembly.sole_upstream

    def spy(*args, **kwargs):
        found.append(sole_upstream(*args, **kwargs))
        return found[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(assembly, "sole_upstream", spy)
        extraction = extract(model, (x, y), loss="mse", optimizer=optimizer, cost_model="profile", repeats=1,
                             use_cache=False)
    return extraction, {extraction.graph.names[position] for position in found[-1]}



class TrainingCase:
    """A model, its extraction and its initial state, restorable between tests."""

    def __init__(self, build, batch, implementations: bool = False):
        self.model = build()
        self.x, self.y = training_batch(self.model, batch)
        # Five different batches, so five steps do not just memorize one.
        self.batches = [training_batch(self.model, batch, seed) for seed in range(1, 6)]
        self.extraction = extract(self.model, (self.x, self.y), cost_model="flops", use_cache=False,
                                  implementations=implementations)
        self.initial = [v.numpy() for v in self.model.variables]

    def reset(self):
        for variable, value in zip(self.model.variables, self.initial):
            variable.assign(value)

    def optimizer(self):
        optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.5)
        optimizer.build(self.model.trainable_variables)
        return optimizer

    def plain_gradients(self):
        model, loss_fn = self.model, self.extraction.side_table.loss_fn

        @tf.function
        def grads(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn([y], [model(x, training=True)])
            # An Embedding's gradient is IndexedSlices, which has no .numpy().
            return [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

        return [g.numpy() for g in grads(self.x, self.y)]

    def plain_training(self, steps):
        model, loss_fn, optimizer = self.model, self.extraction.side_table.loss_fn, self.optimizer()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn([y], [model(x, training=True)])
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        losses = [float(step(x, y)) for x, y in self.batches[:steps]]
        return losses, [v.numpy() for v in model.variables]

    def assert_trains_like_plain(self, schedule, label: str, steps: int = 5):
        """The schedule's step gives one plain GradientTape step's gradients, and ``steps``
        optimizer steps (at most the five batches) give the same losses, weights, batch-norm
        statistics and dropout seeds as plain training. Returns the compiled step (after them)."""
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
        plain_losses, plain_state = self.plain_training(steps)
        self.reset()
        step = compile_step(self.extraction, schedule, optimizer=self.optimizer())
        losses = [float(step(x, y)) for x, y in self.batches[:steps]]
        np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
        for variable, expected_value in zip(self.model.variables, plain_state):
            np.testing.assert_allclose(variable.numpy(), expected_value, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{label}: {variable.path}")
        return step
