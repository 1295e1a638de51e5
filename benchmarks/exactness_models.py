"""Issue 33: is a model's drift from plain ``model.fit`` tfremat's, or how its training amplifies rounding?

user_check_5 found EfficientNetV2B0 (images in [0, 1)) 3.4e-4 from plain Keras after one step and 0.43
after nine, and a Perceiver-style model 1.2e-4 after nine. A difference in rounding alone can grow
that much where training is ill-conditioned. This trains the same model from the same seeds three
times, ``model.fit`` traced (the reference), ``model.fit`` with ``run_eagerly=True`` (the same
mathematics, no Grappler rewrites: another plain rounding) and ``tfremat.fit``, and prints the
weights' error (:func:`tfremat.numerics.closeness`, largest per-tensor) against the reference after
every step. A tfremat error within the eager run's is rounding, not a wrong step; a tfremat error far
above it is a real difference (a mask, a statistic, a flag). Results: results/exactness_models.md.

Run: ``python benchmarks/exactness_models.py --model efficientnetv2b0 --scale 1 --budget 80%
--strategy eviction`` (``--scale 255``: images in [0, 255), the range the model's ``Rescaling``
expects); ``--model perceiver --budget min``.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _efficientnetv2b0():
    import keras

    return keras.applications.EfficientNetV2B0(input_shape=(64, 64, 3), weights=None, classes=10), (64, 64, 3), 10, 8


def _perceiver():
    from user_check_5 import _perceiver as perceiver

    return perceiver(), (64, 16), 5, 16


MODELS = {"efficientnetv2b0": _efficientnetv2b0, "perceiver": _perceiver}


def weights_per_step(kind, args, x, y, batch):
    """The model's weights after every step of one epoch of ``kind`` training from seed 0."""
    import keras

    import tfremat

    class Weights(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps = []

        def on_train_batch_end(self, batch, logs=None):
            self.steps.append(self.model.get_weights())

    keras.utils.set_random_seed(0)
    model = MODELS[args.model]()[0]
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  run_eagerly=kind == "eager")
    weights = Weights()
    fit_kwargs = {"batch_size": batch, "epochs": 1, "shuffle": False, "callbacks": [weights], "verbose": 0}
    if kind == "tfremat":
        tfremat.fit(model, args.budget, x, y, strategy=args.strategy, cost_model=args.cost_model, **fit_kwargs)
    else:
        model.fit(x, y, **fit_kwargs)
    return weights.steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="efficientnetv2b0")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--scale", type=float, default=1.0, help="inputs are uniform in [0, scale)")
    parser.add_argument("--budget", default="80%")
    parser.add_argument("--strategy", default="eviction")
    parser.add_argument("--cost_model", default="flops")
    args = parser.parse_args()

    from tfremat.numerics import closeness

    _, shape, classes, batch = MODELS[args.model]()
    rng = np.random.default_rng(0)
    x = rng.random((batch * args.steps, *shape), dtype=np.float32) * np.float32(args.scale)
    y = rng.integers(0, classes, batch * args.steps)
    reference = weights_per_step("plain", args, x, y, batch)
    print(f"{args.model}, batch {batch}, inputs uniform in [0, {args.scale:g}), tfremat at {args.budget!r} ({args.strategy}); "
          f"weights' largest per-tensor error against traced model.fit, steps 1..{args.steps}:")
    for kind in ("eager", "tfremat"):
        errors = [closeness(a, b).max_tensor_error for a, b in zip(weights_per_step(kind, args, x, y, batch), reference)]
        print(f"  {kind:8s}", " ".join(f"{e:.1e}" for e in errors), flush=True)


if __name__ == "__main__":
    main()
