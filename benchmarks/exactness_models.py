"""Issue 33: is a model's drift from plain ``model.fit`` tfremat's, or how its training amplifies rounding?

user_check_5 found EfficientNetV2B0 (images in [0, 1)) 3.4e-4 from plain Keras after one step and 0.43
after nine, and a Perceiver-style model 1.2e-4 after nine. A difference in rounding alone can grow
that much where training is ill-conditioned. This trains the same model from the same seeds three
times, ``model.fit`` traced (the reference), ``model.fit`` with ``run_eagerly=True`` (the same
mathematics, no Grappler rewrites: another plain rounding) and ``tfremat.fit``, and prints the
weights' error (:func:`tfremat.numerics.closeness`, largest per-tensor) against the reference after
every step. A tfremat error within the eager run's is rounding, not a wrong step; a tfremat error far
above it is a real difference (a mask, a statistic, a flag). Results: results/exactness_models.md.

``--first_step`` compares one step's gradients instead, at checkpoint-all and at ``--budget``
(``--strategy``): how many of them differ from a plain traced tape's at all and the largest
per-tensor error, and the most the step requests at any statement against the simulator's
prediction there (:func:`tfremat.measure.requested_ledger`); ``--no_grappler`` runs both steps
with Grappler's meta optimizer off, which tells how the step sums apart from how Grappler
rewrites it (its canonical order of a commutative operation's inputs follows their names).

Run: ``python benchmarks/exactness_models.py --model efficientnetv2b0 --scale 1 --budget 80%
--strategy eviction`` (``--scale 255``: images in [0, 255), the range the model's ``Rescaling``
expects); ``--model perceiver --budget min``; ``--model cct --first_step --budget 80%``.
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


def _cct():
    from user_check_5 import _cct as cct

    return cct(), (32, 32, 3), 10, 16


MODELS = {"efficientnetv2b0": _efficientnetv2b0, "perceiver": _perceiver, "cct": _cct}


def first_step(args, x, y) -> None:
    """Prints, per schedule, one step's gradients against a plain traced tape's and the
    step's requested bytes against the prediction, statement by statement."""
    import keras

    from tfremat.extract import extract
    from tfremat.measure import _gradient_pairs, requested_ledger
    from tfremat.numerics import closeness
    from tfremat.static_graph.compile import compile_step
    from tfremat.strategies import get_strategy

    keras.utils.set_random_seed(0)
    model = MODELS[args.model]()[0]
    extraction = extract(model, (x, y), optimizer=keras.optimizers.SGD(), loss="sparse_categorical_crossentropy",
                         cost_model="profile", repeats=1, use_cache=False)
    saved = [v.numpy() for v in model.variables]
    for strategy, budget in (("checkpoint_all", None), (args.strategy, None if args.budget == "none" else args.budget)):
        schedule = get_strategy(strategy)(extraction.graph, budget)
        pairs = _gradient_pairs(model, extraction, schedule, x, y, saved)
        differing = sum(not np.array_equal(ours, plain) for _, ours, plain in pairs)
        error = closeness([ours for _, ours, _ in pairs], [plain for _, _, plain in pairs]).max_tensor_error
        optimizer = keras.optimizers.SGD()
        optimizer.build(model.trainable_variables)
        step = compile_step(extraction, schedule, optimizer=optimizer)
        rows = [r for r in requested_ledger(extraction, schedule, step, x, y,
                                            list(model.variables) + list(optimizer.variables))
                if r["requested_bytes"] is not None]
        for variable, value in zip(model.variables, saved):
            variable.assign(value)
        worst = max(rows, key=lambda r: r["requested_bytes"] - r["predicted_bytes"])
        mib = 2.0 ** 20
        print(f"  {strategy} ({budget or 'no budget'}, {schedule.recompute_count} recomputations): "
              f"{differing} of {len(pairs)} gradients differ, largest per-tensor error {error:.1e}; "
              f"requested peak {max(r['requested_bytes'] for r in rows) / mib:.2f} MiB against predicted "
              f"{max(r['predicted_bytes'] for r in rows) / mib:.2f} MiB; most over: {worst['scope']} "
              f"({worst['name']}) {(worst['requested_bytes'] - worst['predicted_bytes']) / 1024:+.1f} KiB; "
              f"statements over by more than 4 KiB: "
              f"{sum(r['requested_bytes'] > r['predicted_bytes'] + 4096 for r in rows)}", flush=True)


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
    parser.add_argument("--budget", default="80%", help='"none": the strategy\'s own schedule (chen_sqrtn)')
    parser.add_argument("--strategy", default="eviction")
    parser.add_argument("--cost_model", default="flops")
    parser.add_argument("--first_step", action="store_true",
                        help="compare one step's gradients and requested bytes at checkpoint-all and --budget")
    parser.add_argument("--no_grappler", action="store_true", help="with --first_step: Grappler's meta optimizer off")
    args = parser.parse_args()
    if args.first_step:
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

    from tfremat.numerics import closeness

    _, shape, classes, batch = MODELS[args.model]()
    rng = np.random.default_rng(0)
    x = rng.random((batch * args.steps, *shape), dtype=np.float32) * np.float32(args.scale)
    y = rng.integers(0, classes, batch * args.steps)
    if args.first_step:
        import tensorflow as tf

        if args.no_grappler:
            tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
        print(f"{args.model}, batch {batch}, inputs uniform in [0, {args.scale:g}), Grappler "
              f"{'off' if args.no_grappler else 'on'}, one step against a plain traced tape:")
        first_step(args, tf.constant(x[:batch]), tf.constant(y[:batch]))
        return
    reference = weights_per_step("plain", args, x, y, batch)
    print(f"{args.model}, batch {batch}, inputs uniform in [0, {args.scale:g}), tfremat at {args.budget!r} ({args.strategy}); "
          f"weights' largest per-tensor error against traced model.fit, steps 1..{args.steps}:")
    for kind in ("eager", "tfremat"):
        errors = [closeness(a, b).max_tensor_error for a, b in zip(weights_per_step(kind, args, x, y, batch), reference)]
        print(f"  {kind:8s}", " ".join(f"{e:.1e}" for e in errors), flush=True)


if __name__ == "__main__":
    main()
