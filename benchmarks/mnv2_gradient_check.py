"""Is a gradient mismatch the schedule's or rounding's? MobileNetV2 after plain training steps.

The user check (benchmarks/results/user_check.md, finding 1) saw a MobileNetV2 schedule's
gradients 3.9e-3 from plain training's, measured after its fit had trained the model. This
replays schedules on MobileNetV2 (64x64, 10 classes, batch 8, Adam) after ``--steps``
``train_on_batch`` steps on one batch and compares each schedule's gradients, a traced
(``tf.function``) and an eager plain tape's with a float64 tape's on the same weights:
when the two plain tapes differ as much as the schedule does, the gradients are
ill-conditioned there and the difference is rounding (what
``tfremat.measure._judge_gradients`` decides on).

Run: ``python benchmarks/mnv2_gradient_check.py --steps 0,25 [--schedule DUMP/schedule.json]``
(results: benchmarks/results/mnv2_gradient_check.md).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfremat import measure  # noqa: E402
from tfremat.extract.extractor import extract  # noqa: E402
from tfremat.model_planning import synthetic_batch  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.plan.schedule import Schedule  # noqa: E402
from tfremat.strategies import get_strategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0,25", help="plain training steps before each comparison (ascending)")
    parser.add_argument("--schedule", help="a dumped schedule.json of this model's graph (mapped by position)")
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    x, y = tf.nest.map_structure(tf.constant, synthetic_batch(model, 8, loss="categorical_crossentropy", seed=0))
    extraction = extract(model, sample_batch=(x, y), cost_model="flops", use_cache=False,
                         optimizer=keras.optimizers.Adam())
    graph = extraction.graph
    schedules = {"checkpoint_all": get_strategy("checkpoint_all")(graph),
                 "chen_sqrtn": get_strategy("chen_sqrtn")(graph)}
    if args.schedule:
        with open(args.schedule) as f:
            schedules["dumped"] = Schedule.from_dict(json.load(f))
    keras.config.set_dtype_policy("float64")
    model64 = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3), classes=10)
    keras.config.set_dtype_policy("float32")
    done = 0
    for steps in (int(s) for s in args.steps.split(",")):
        for _ in range(steps - done):
            model.train_on_batch(x, y)
        done = steps
        saved = [v.numpy() for v in model.variables]
        for variable, value in zip(model64.variables, saved):
            variable.assign(value.astype(np.float64))
        with tf.GradientTape() as tape:
            loss = keras.losses.CategoricalCrossentropy()(tf.cast(y, tf.float64),
                                                           model64(tf.cast(x, tf.float64), training=True))
        exact = [g.numpy() for g in tape.gradient(loss, model64.trainable_variables)]
        table = extraction.side_table
        traced = measure._plain_gradients(model, table, x, y, saved, traced=True)
        eager = measure._plain_gradients(model, table, x, y, saved, traced=False)
        print(f"after {steps} steps (loss {float(loss):.3g}): traced vs eager {_err(closeness(traced, eager))}, "
              f"traced vs float64 {_err(closeness(traced, exact))}, eager vs float64 {_err(closeness(eager, exact))}")
        for name, schedule in schedules.items():
            pairs = measure._gradient_pairs(model, extraction, schedule, x, y, saved)
            planned = [p for _, p, _ in pairs]
            tolerances = measure.gradient_tolerances(model)
            judged = measure._judge_gradients(model, extraction, schedule, x, y, saved, tolerances)
            print(f"  {name} ({schedule.recompute_count} recomputes): vs traced {_err(closeness(planned, traced))}, "
                  f"vs eager {_err(closeness(planned, eager))}, vs float64 {_err(closeness(planned, exact))}, "
                  f"gradients_match {judged[1]}")


def _err(c) -> str:
    return f"{c.max_tensor_error:.2g} (global {c.global_error:.2g})"


if __name__ == "__main__":
    main()
