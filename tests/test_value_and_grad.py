"""tfremat.value_and_grad: the gradients of a GradientTape block, under a budget.

Each case plans at 60% of the activation memory, so the step recomputes, and compares with tf.GradientTape by the closeness rule (tfremat.numerics); batch-norm
statistics and dropout seeds must be exactly those of one tape step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat.errors import ArgumentError, ExtractionError
from tfremat.extract.checks import refuse_unmodelled_training
from tfremat.numerics import closeness

BUDGET = "60% of activations"
# These nets are so small that the allocator's chunks exceed the activations a plan saves:
# the budget is held for requested bytes (tests/test_value_and_grad_allocator.py holds it for the allocator).
FAST = {"cost_model": "flops", "cache": False, "verbose": 0, "allocator_check": False}


def _conv_trunk(shape, channels=8):
    """Four convolutions (batch norm and dropout among them): activations dominate memory."""
    x = keras.Input(shape)
    h = x
    for k in range(4):
        h = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
        if k == 1:
            h = keras.layers.BatchNormalization()(h)
        if k == 2:
            h = keras.layers.Dropout(0.25, seed=3)(h)
    return x, keras.layers.GlobalAveragePooling2D()(h)


def _two_loss_model():
    x, h = _conv_trunk((16, 16, 3))
    return keras.Model(x, [keras.layers.Dense(1, name="value")(h), keras.layers.Dense(5, name="logits")(h)])


def _two_loss(model):
    mse = keras.losses.MeanSquaredError()
    cce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fn(x, value, label):
        predicted, logits = model(x, training=True)
        return mse(value, predicted) + 0.5 * cce(label, logits)

    return fn


def _gan(latent=8):
    """A keras.io DCGAN in small: 16x16 images."""
    z = keras.Input((latent,))
    h = keras.layers.Dense(8 * 8 * 8)(z)
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Reshape((8, 8, 8))(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2DTranspose(8, 4, strides=2, padding="same")(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(8, 3, padding="same")(h))
    generator = keras.Model(z, keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")(h), name="generator")
    image = keras.Input((16, 16, 1))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(8, 3, padding="same")(image))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(8, 3, strides=2, padding="same")(h))
    h = keras.layers.Dropout(0.2, seed=5)(keras.layers.Flatten()(h))
    discriminator = keras.Model(image, keras.layers.Dense(1)(h), name="discriminator")
    return generator, discriminator


def _discriminator_loss(generator, discriminator):
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def fn(real, noise):
        fake = generator(noise, training=True)
        real_logits = discriminator(real, training=True)
        fake_logits = discriminator(fake, training=True)  # the same layers, called a second time
        return bce(keras.ops.ones_like(real_logits), real_logits) + bce(keras.ops.zeros_like(fake_logits), fake_logits)

    return fn


def _encoder():
    x, h = _conv_trunk((16, 16, 3))
    return keras.Model(x, keras.layers.Dense(8)(h))


def _contrastive(encoder, temperature=0.5):
    """SimCLR's NT-Xent in one direction: view k of one sample against view k of all."""
    def fn(view1, view2):
        z1 = keras.ops.normalize(encoder(view1, training=True), axis=-1)
        z2 = keras.ops.normalize(encoder(view2, training=True), axis=-1)
        logits = keras.ops.matmul(z1, keras.ops.transpose(z2)) / temperature
        labels = keras.ops.arange(keras.ops.shape(z1)[0])
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

    return fn


def _batch(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype("float32") for shape in shapes]


def _assert_like_tape(g, fn, models, args, call=None):
    """``g`` (through ``call``) gives the tape's loss and gradients, and leaves every
    variable of ``models`` (batch-norm statistics, dropout seeds) as one tape step does."""
    call = call or g
    variables = [v for model in models for v in model.variables]
    before = [v.numpy() for v in variables]
    with tf.GradientTape() as tape:
        expected_loss = fn(*[tf.constant(a) for a in args])
    expected = tape.gradient(expected_loss, g.trainable_variables)
    after_tape = [v.numpy() for v in variables]
    for variable, value in zip(variables, before):
        variable.assign(value)
    loss, gradients = call(*args)
    assert len(gradients) == len(g.trainable_variables)
    assert all(a is not None for a in gradients)
    assert closeness([loss], [expected_loss]).equal
    assert closeness([np.asarray(a) for a in gradients], [np.asarray(e) for e in expected]).equal
    for variable, value in zip(variables, after_tape):
        np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after_tape))  # a state did move


def test_two_loss_model_eager():
    keras.utils.set_random_seed(1)
    model = _two_loss_model()
    fn = _two_loss(model)
    x, value = _batch((32, 16, 16, 3), (32, 1))
    label = np.arange(32) % 5
    g = tfremat.value_and_grad(fn, BUDGET, x, value, label, **FAST)
    assert g.plan.predicted_peak_bytes < g.plan.checkpoint_all_peak_bytes
    assert [id(v) for v in g.trainable_variables] == [id(v) for v in model.trainable_variables]
    _assert_like_tape(g, fn, [model], [x, value, label])
    assert g._steps[g._example_key].recomputed_layer_calls > 0


def test_gan_discriminator_called_twice_eager_and_in_tf_function():
    keras.utils.set_random_seed(2)
    generator, discriminator = _gan()
    fn = _discriminator_loss(generator, discriminator)
    real, noise = _batch((32, 16, 16, 1), (32, 8))
    g = tfremat.value_and_grad(fn, BUDGET, real, noise, **FAST)
    assert {id(v) for v in g.trainable_variables} == {
        id(v) for v in generator.trainable_variables + discriminator.trainable_variables}
    _assert_like_tape(g, fn, [generator, discriminator], [real, noise])
    _assert_like_tape(g, fn, [generator, discriminator], [real, noise], call=tf.function(g))


def test_contrastive_encoder_called_on_two_views():
    keras.utils.set_random_seed(3)
    encoder = _encoder()
    fn = _contrastive(encoder)
    view1, view2 = _batch((32, 16, 16, 3), (32, 16, 16, 3))
    g = tfremat.value_and_grad(fn, BUDGET, view1, view2, **FAST)
    _assert_like_tape(g, fn, [encoder], [view1, view2])


@pytest.mark.parametrize("activation, loss", [
    ("softmax", keras.losses.CategoricalCrossentropy()),
    ("sigmoid", keras.losses.BinaryCrossentropy()),
])
def test_a_cross_entropy_on_a_softmax_or_sigmoid_output(activation, loss):
    """Keras's cross-entropies read the logits the activation attaches to its output; the
    gradient then reaches the model through them (it was zero before)."""
    keras.utils.set_random_seed(5)
    x, h = _conv_trunk((16, 16, 3))
    model = keras.Model(x, keras.layers.Dense(5, activation=activation)(h))

    def fn(images, targets):
        return loss(targets, model(images, training=True))

    images, = _batch((32, 16, 16, 3))
    targets = np.eye(5, dtype="float32")[np.arange(32) % 5]
    g = tfremat.value_and_grad(fn, BUDGET, images, targets, **FAST)
    _assert_like_tape(g, fn, [model], [images, targets])
    assert g._steps[g._example_key].recomputed_layer_calls > 0


def test_a_new_batch_shape_plans_again():
    keras.utils.set_random_seed(4)
    encoder = _encoder()
    fn = _contrastive(encoder)
    g = tfremat.value_and_grad(fn, BUDGET, *_batch((32, 16, 16, 3), (32, 16, 16, 3)), **FAST)
    _assert_like_tape(g, fn, [encoder], _batch((24, 16, 16, 3), (24, 16, 16, 3), seed=1))
    assert sorted(key[1][0][0][0] for key in g.plans) == [24, 32]
    assert g.plan.extraction.side_table.batch_size == 32


class _TapeGan(keras.Model):
    """The keras.io DCGAN's train_step with a plain tape (noise fed in with the batch)."""

    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator
        self.loss_fn = _discriminator_loss(generator, discriminator)

    def train_step(self, data):
        real, noise = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(real, noise)
        variables = self.discriminator.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


class _RematGan(_TapeGan):
    def train_step(self, data):
        real, noise = data
        if not hasattr(self, "remat"):
            self.remat = tfremat.value_and_grad(self.loss_fn, BUDGET, real, noise, **FAST)
        loss, gradients = self.remat(real, noise)
        own = {id(v) for v in self.discriminator.trainable_variables}
        self.optimizer.apply_gradients(
            [(g, v) for g, v in zip(gradients, self.remat.trainable_variables) if id(v) in own])
        return {"loss": loss}


def test_inside_train_step_trains_like_the_tape():
    real, noise = _batch((64, 16, 16, 1), (64, 8))
    weights = []
    for cls in (_TapeGan, _RematGan):
        keras.utils.set_random_seed(5)
        gan = cls(*_gan())
        gan.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5))
        history = gan.fit(real, noise, batch_size=32, epochs=2, shuffle=False, verbose=0)
        weights.append((history.history["loss"], gan.generator.get_weights() + gan.discriminator.get_weights()))
    (tape_losses, tape_weights), (remat_losses, remat_weights) = weights
    assert closeness(remat_losses, tape_losses).equal
    assert closeness(remat_weights, tape_weights).equal


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_untraceable_functions_are_refused_in_one_line():
    keras.utils.set_random_seed(6)
    encoder = _encoder()
    x = _batch((8, 16, 16, 3))[0]

    def py_function(v):
        return keras.ops.mean(tf.py_function(lambda t: t, [encoder(v, training=True)], tf.float32))

    def python_if(v):
        h = encoder(v, training=True)
        return keras.ops.mean(h) if keras.ops.mean(h) > 0 else keras.ops.mean(-h)

    for fn in (py_function, python_if):
        with pytest.raises(ExtractionError) as error:
            tfremat.value_and_grad(fn, "50%", x, **FAST)
        assert "cannot be traced on symbolic inputs" in _one_line(error)


def test_what_the_step_would_freeze_or_change_is_refused():
    keras.utils.set_random_seed(7)
    encoder = _encoder()
    x = _batch((8, 16, 16, 3))[0]
    seeds = keras.random.SeedGenerator(1)
    cases = {
        "without training=True": lambda v: keras.ops.mean(encoder(v)),
        "reads variable": lambda v: keras.ops.mean(encoder(v, training=True)) + keras.ops.sum(encoder.weights[0]),
        "random numbers": lambda v: keras.ops.mean(encoder(v + keras.random.normal((8, 16, 16, 3), seed=seeds),
                                                           training=True)),
        "scalar loss": lambda v: encoder(v, training=True),
    }
    for cause, fn in cases.items():
        with pytest.raises(ExtractionError) as error:
            tfremat.value_and_grad(fn, "50%", x, **FAST)
        assert cause in _one_line(error)


def test_bad_arguments_and_unknown_shapes_are_refused():
    keras.utils.set_random_seed(8)
    encoder = _encoder()
    fn = _contrastive(encoder)
    view1, view2 = _batch((16, 16, 16, 3), (16, 16, 16, 3))
    with pytest.raises(ArgumentError, match="budget=None"):
        tfremat.value_and_grad(fn, None, view1, view2)
    with pytest.raises(ArgumentError, match="example arguments"):
        tfremat.value_and_grad(fn, "50%")
    g = tfremat.value_and_grad(fn, BUDGET, view1, view2, **FAST)
    spec = tf.TensorSpec((None, 16, 16, 3), tf.float32)
    # Raised while the function traces: TensorFlow wraps it in its StagingError.
    with pytest.raises(Exception, match=r"shape \(None, 16, 16, 3\) while a tf.function traced"):
        tf.function(g, input_signature=[spec, spec]).get_concrete_function()


def test_the_train_step_refusal_points_to_value_and_grad():
    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    x = keras.Input((4,))
    model = OwnStep(x, keras.layers.Dense(2)(x))
    with pytest.raises(ExtractionError, match="overrides train_step.*tfremat.value_and_grad") as error:
        refuse_unmodelled_training(model)
    _one_line(error)
