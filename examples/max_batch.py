"""The largest batch a model can train with in a fixed memory budget, per strategy.

Checkmate's criterion: the schedule may cost at most one extra forward pass.

The model is deep and narrow (16 convolutions of 16 channels) and the budget 128 MiB, so
that activations, which rematerialization can drop, decide the batch. On a CPU a
convolution's backward also asks for a scratch buffer (30-45 MiB here) that hardly grows with
the batch; with a shallow net or a budget near that size the scratch alone would bound
every strategy alike. For each strategy the script prints the batch, its compute cost,
and the least any schedule of that batch can peak at (one node with its inputs, output
and scratch, :func:`tfremat.ilp.memory_lower_bound`), well under the budget.

Run: python examples/max_batch.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfremat  # noqa: E402  (before TensorFlow: it selects the BFC CPU allocator, which reports memory)
from tfremat.ilp import memory_lower_bound  # noqa: E402


def convnet(seed: int = 0, depth: int = 16, channels: int = 16) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for _ in range(depth):
        h = layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(h), name="convnet")


def main(budget: str = "128MiB") -> None:
    model = convnet()
    results = tfremat.max_batch_size(model, budget, strategies=["checkpoint_all", "chen_greedy", "optimal"],
                                     loss="categorical_crossentropy", optimizer=keras.optimizers.SGD(), time_limit=10)
    for name, result in results.items():
        print(f"{name:>15}: batch {result.batch_size:5d}  (cost {result.cost / result.graph.total_cost:.3f}x of a "
              f"plain step; no schedule of this batch peaks below {memory_lower_bound(result.graph) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
