"""The largest batch a model can train with in a fixed memory budget, per strategy.

Checkmate's criterion: the schedule may cost at most one extra forward pass.
Run: python examples/max_batch.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfremat  # noqa: E402  (before TensorFlow: it selects the BFC CPU allocator, which reports memory)
import keras  # noqa: E402



def convnet(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for channels in (32, 32, 64, 64):
        h = layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="convnet")


def main(budget: str = "64MiB") -> None:
    model = convnet()
    results = tfremat.max_batch_size(model, budget, strategies=["checkpoint_all", "chen_greedy", "optimal"],
                                     loss="categorical_crossentropy", optimizer=keras.optimizers.SGD(), time_limit=10)
    for name, result in results.items():
        print(f"{name:>15}: batch {result.batch_size:5d}  (cost {result.cost / result.graph.total_cost:.3f}x of a plain step)")


if __name__ == "__main__":
    main()
