"""Train a small ResNet on scikit-learn's digits at 50% of the checkpoint-all memory.

The batch is large enough (256) that activations, not a convolution's CPU scratch buffer,
set the memory a step needs. The same model, seed and data are trained twice: with plain
``model.fit`` and with ``tfremat.fit`` under a budget of half the memory a plain step needs.

The rematerialized step computes the same gradients: a recomputed layer runs the same
kernels on the same inputs. Identical weights after many epochs are still not guaranteed
in general: wherever the planned step sums or orders operations differently, results
differ in the last bits, and Adam, dividing each update by the root of its second-moment
estimate, can turn last-bit differences on tiny gradients into visible ones over epochs.
The script prints the largest weight difference, so a run shows which case it is in;
the test accuracy is what to compare. ``--budget 100% --strategy checkpoint_all
--epochs 1`` trains with no recomputation at all.

Run: python examples/resnet_digits.py [--epochs 15] [--budget 50%] [--strategy optimal]
(a few minutes on a laptop CPU)
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfremat  # noqa: E402  (before TensorFlow: it selects the BFC CPU allocator, which reports memory)


def small_resnet(seed: int, blocks: int = 6, channels: int = 64) -> keras.Model:
    """Conv stem, ``blocks`` residual blocks (conv-BN-ReLU x2 + skip), global pooling, softmax."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(channels, 3, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        r = layers.Conv2D(channels, 3, padding="same")(h)
        r = layers.BatchNormalization(momentum=0.9)(r)
        r = layers.ReLU()(r)
        r = layers.Conv2D(channels, 3, padding="same")(r)
        r = layers.BatchNormalization(momentum=0.9)(r)
        h = layers.ReLU()(layers.Add()([h, r]))
    h = layers.GlobalAveragePooling2D()(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    return keras.Model(inputs, outputs, name="digits_resnet")


def compiled(seed: int) -> keras.Model:
    model = small_resnet(seed)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def main(epochs: int = 15, batch_size: int = 256, seed: int = 0, budget: str = "50%", strategy: str = "optimal") -> None:
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = keras.utils.to_categorical(digits.target, 10).astype("float32")
    split = 1500
    train, test = (x[:split], y[:split]), (x[split:], y[split:])
    # Drop the last partial batch so one schedule serves every step.
    usable = (split // batch_size) * batch_size
    train = (train[0][:usable], train[1][:usable])

    plain = compiled(seed)
    keras.utils.set_random_seed(seed)
    plain.fit(*train, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    plain_accuracy = plain.evaluate(*test, verbose=0)[1]

    remat = compiled(seed)
    keras.utils.set_random_seed(seed)
    tfremat.fit(remat, budget, *train, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                strategy=strategy)  # the MILP strategies get 60 s per batch shape by default
    remat_accuracy = remat.evaluate(*test, verbose=0)[1]

    difference = max(float(np.abs(a - b).max()) for a, b in zip(plain.get_weights(), remat.get_weights()))
    print(f"plain model.fit test accuracy:   {plain_accuracy:.4f}")
    print(f"tfremat.fit ({budget} budget, {strategy}) accuracy: {remat_accuracy:.4f}")
    print(f"largest weight difference after {epochs} epochs: {difference:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--budget", default="50%", help="a share of the checkpoint-all peak or a size (64MiB)")
    parser.add_argument("--strategy", default="optimal")
    args = parser.parse_args()
    main(epochs=args.epochs, budget=args.budget, strategy=args.strategy)
