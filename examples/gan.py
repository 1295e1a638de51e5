"""A keras.io-style DCGAN whose own train_step takes both gradients from tfremat.value_and_grad.

The GAN (generator and discriminator, a custom ``train_step``, compiled without a loss) is
the keras.io DCGAN made small (16x16 images). Each step makes two updates, each the
rematerialized counterpart of a ``tf.GradientTape`` block planned at 60% of its activation
memory: the discriminator on real and generated images (it is called twice), then the
generator through the discriminator. The noise is drawn outside the loss functions from a
seeded generator and passed in: a value drawn inside one would be frozen by the plan.

The same GAN trained with plain tapes from the same weights and noise must end with the
same weights (the closeness rule of :mod:`tfremat.numerics`). Runs in well under a minute
on a CPU: ``python examples/gan.py``.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # the CPU allocator counts bytes only with BFC
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")  # one op at a time, as the memory model assumes
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
from tfremat.budget import format_bytes  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

LATENT = 16
BUDGET = "60% of activations"


def build_gan(seed: int = 0):
    """The generator and the discriminator of the keras.io DCGAN, for 16x16 grey images."""
    keras.utils.set_random_seed(seed)
    noise = keras.Input((LATENT,))
    h = keras.layers.Dense(8 * 8 * 16)(noise)
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Reshape((8, 8, 16))(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same")(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(16, 3, padding="same")(h))
    generator = keras.Model(noise, keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")(h),
                            name="generator")
    image = keras.Input((16, 16, 1))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(16, 3, padding="same")(image))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(16, 3, strides=2, padding="same")(h))
    h = keras.layers.Dropout(0.2, seed=seed)(keras.layers.Flatten()(h))
    discriminator = keras.Model(image, keras.layers.Dense(1)(h), name="discriminator")
    return generator, discriminator


class GAN(keras.Model):
    """The keras.io DCGAN's training, with one tf.GradientTape per update."""

    def __init__(self, generator, discriminator, seed: int = 0):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator
        self.seeds = keras.random.SeedGenerator(seed)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def discriminator_loss(self, real, noise):
        fake = self.generator(noise, training=True)
        real_logits = self.discriminator(real, training=True)
        fake_logits = self.discriminator(fake, training=True)
        return (self.bce(keras.ops.ones_like(real_logits), real_logits)
                + self.bce(keras.ops.zeros_like(fake_logits), fake_logits))

    def generator_loss(self, noise):
        fake_logits = self.discriminator(self.generator(noise, training=True), training=True)
        return self.bce(keras.ops.ones_like(fake_logits), fake_logits)

    def draw_noise(self, real):
        return keras.random.normal((real.shape[0], LATENT), seed=self.seeds)

    def train_step(self, real):
        noise = self.draw_noise(real)
        with tf.GradientTape() as tape:
            d_loss = self.discriminator_loss(real, noise)
        d_vars = self.discriminator.trainable_variables
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, d_vars), d_vars))
        noise = self.draw_noise(real)
        with tf.GradientTape() as tape:
            g_loss = self.generator_loss(noise)
        g_vars = self.generator.trainable_variables
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, g_vars), g_vars))
        return {"d_loss": d_loss, "g_loss": g_loss}


class RematGAN(GAN):
    """The same training, each update's gradients from tfremat.value_and_grad.

    Both are planned on the first trace of train_step (each batch shape is planned once);
    each loss reads both models, so the update keeps the gradients of the model it trains.
    """

    def train_step(self, real):
        noise = self.draw_noise(real)
        if not hasattr(self, "remat_d"):
            self.remat_d = tfremat.value_and_grad(self.discriminator_loss, BUDGET, real, noise, cost_model="flops")
            self.remat_g = tfremat.value_and_grad(self.generator_loss, BUDGET, noise, cost_model="flops")
        d_loss, grads = self.remat_d(real, noise)
        self.d_optimizer.apply_gradients(own(grads, self.remat_d.trainable_variables, self.discriminator))
        noise = self.draw_noise(real)
        g_loss, grads = self.remat_g(noise)
        self.g_optimizer.apply_gradients(own(grads, self.remat_g.trainable_variables, self.generator))
        return {"d_loss": d_loss, "g_loss": g_loss}


def own(gradients, variables, model):
    """The (gradient, variable) pairs of ``model``'s trainable variables, picked by identity."""
    mine = {id(v) for v in model.trainable_variables}
    return [(g, v) for g, v in zip(gradients, variables) if id(v) in mine]


def train(cls, images, epochs: int):
    gan = cls(*build_gan())
    gan.compile(d_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5), g_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5))
    history = gan.fit(images, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return gan, history.history


def main():
    rng = np.random.default_rng(0)
    # Blurred squares as "real" images: any data does for checking that training matches.
    images = np.zeros((256, 16, 16, 1), np.float32)
    for image, (row, col) in zip(images, rng.integers(0, 10, size=(256, 2))):
        image[row:row + 6, col:col + 6] = 1.0
    tape_gan, tape_history = train(GAN, images, epochs=2)
    remat_gan, remat_history = train(RematGAN, images, epochs=2)
    for name, g in (("discriminator update", remat_gan.remat_d), ("generator update", remat_gan.remat_g)):
        plan = g.plan
        print(f"{name}: predicted peak {format_bytes(plan.predicted_peak_bytes)} against "
              f"{format_bytes(plan.checkpoint_all_peak_bytes)} without recomputation, overhead {plan.overhead:.1%}")
    print("losses (tape)  ", {k: [round(float(v), 4) for v in vs] for k, vs in tape_history.items()})
    print("losses (remat) ", {k: [round(float(v), 4) for v in vs] for k, vs in remat_history.items()})
    weights = closeness(remat_gan.generator.get_weights() + remat_gan.discriminator.get_weights(),
                        tape_gan.generator.get_weights() + tape_gan.discriminator.get_weights())
    print(f"final weights against the tape's: {weights}")
    if not weights.equal:
        raise SystemExit("the rematerialized GAN did not train like the plain one")


if __name__ == "__main__":
    main()
