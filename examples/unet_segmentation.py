"""A U-Net on synthetic segmentation data (discs on noise), trained within 80% of its memory.

On a CPU a U-Net cannot go much lower: its full-resolution convolutions, with their input,
output and the convolution's scratch buffer, need about 72% of the checkpoint-all peak on
their own (tfremat reports this lower bound when a budget is infeasible).

Run: python examples/unet_segmentation.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402  (before TensorFlow: it selects the BFC CPU allocator, which reports memory)


def unet(size: int = 64, base: int = 16, depth: int = 3, seed: int = 0) -> keras.Model:
    """Encoder-decoder with a skip connection (Concatenate) at every level."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((size, size, 1))
    h, skips = inputs, []
    for level in range(depth):
        h = layers.Conv2D(base * 2**level, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(base * 2**depth, 3, padding="same", activation="relu")(h)
    for level in reversed(range(depth)):
        h = layers.UpSampling2D()(h)
        h = layers.Concatenate()([h, skips[level]])
        h = layers.Conv2D(base * 2**level, 3, padding="same", activation="relu")(h)
    outputs = layers.Conv2D(2, 1, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="unet")


def discs(count: int, size: int = 64, seed: int = 0):
    """Images of one noisy disc each, and the one-hot mask of the disc."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    images = np.empty((count, size, size, 1), "float32")
    masks = np.empty((count, size, size, 2), "float32")
    for k in range(count):
        cy, cx, r = rng.uniform(8, size - 8), rng.uniform(8, size - 8), rng.uniform(3, 8)
        inside = ((yy - cy) ** 2 + (xx - cx) ** 2) < r**2
        images[k, ..., 0] = inside + rng.normal(0, 0.3, (size, size))
        masks[k, ..., 1] = inside
        masks[k, ..., 0] = ~inside
    return images, masks


def main(epochs: int = 3, batch_size: int = 32) -> None:
    x, y = discs(512)
    model = unet()
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    result = tfremat.plan_model(model, "80%", x, y, batch_size=batch_size, strategy="optimal", time_limit=60)
    print(f"checkpoint-all peak {result.checkpoint_all_peak_bytes / 2**20:.1f} MiB -> planned peak "
          f"{result.predicted_peak_bytes / 2**20:.1f} MiB at {100 * result.overhead:.1f}% extra compute")
    history = tfremat.fit(model, "80%", x, y, batch_size=batch_size, epochs=epochs, verbose=2, time_limit=60)
    print(f"final pixel accuracy {history.history['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
