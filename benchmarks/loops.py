"""Custom training loops: ``tfremat.value_and_grad`` against the plain ``tf.GradientTape`` step (issue 36 item 4).

Two models written as their users write them, at sizes where activations dominate memory:
a keras.io-style DCGAN on 32x32 RGB images (its discriminator update, which calls the
discriminator on real and on generated images, and its generator update, through the
discriminator) and a SimCLR-style contrastive model (one conv encoder with batch norm called
on two augmented views, NT-Xent loss in ``keras.ops``). Each update is planned at
checkpoint-all ("100%", ``checkpoint_all``) and at "50% of activations" (``optimal``).

The step measured is what a ``train_step`` runs: a ``tf.function`` wrapping ``g(*args)``;
the reference is the same loss under a ``tf.GradientTape`` in a ``tf.function``, returning the
gradients of the same variables. Both peaks come from
:func:`tfremat.runtime.memory.measure_step_peak` in the graph's convention (the model
variables and the arguments counted as resident): the bytes the step's operations request
(what the plan predicts) and the BFC allocator's peak. Times are taken in turns with the
plain step (:func:`tfremat.measure.time_in_turns`): the median per-round ratio and its
quartiles. The gradients are compared with the tape's once (:mod:`tfremat.numerics`).

Run: ``python benchmarks/loops.py`` (writes ``benchmarks/results/loops.md``; ``--only gan``
or ``--only simclr`` then needs ``--out``). Ops run one at a time
(``TF_NUM_INTEROP_THREADS=1``), as the simulator models.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's tfremat, not an installed one

from provenance import header  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import InfeasibleBudgetError, SolverTimeLimitError  # noqa: E402
from tfremat.measure import time_in_turns  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.runtime.memory import measure_step_peak  # noqa: E402

logger = logging.getLogger("benchmarks.loops")

DEFAULT_OUT = os.path.join(HERE, "results", "loops.md")
PLANS = (("checkpoint_all", "100%"), ("optimal", "50% of activations"))
BATCH = 32
SIZE = 32
LATENT = 64
MiB = 2**20


def build_gan(seed: int = 0):
    """The keras.io DCGAN's generator and discriminator for 32x32 RGB images."""
    keras.utils.set_random_seed(seed)
    noise = keras.Input((LATENT,))
    h = keras.layers.Dense(8 * 8 * 64)(noise)
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Reshape((8, 8, 64))(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2DTranspose(64, 4, strides=2, padding="same")(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same")(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(32, 3, padding="same")(h))
    generator = keras.Model(noise, keras.layers.Conv2D(3, 3, padding="same", activation="sigmoid")(h),
                            name="generator")
    image = keras.Input((SIZE, SIZE, 3))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(32, 3, padding="same")(image))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(64, 4, strides=2, padding="same")(h))
    h = keras.layers.LeakyReLU(0.2)(keras.layers.Conv2D(64, 4, strides=2, padding="same")(h))
    h = keras.layers.Dropout(0.2, seed=seed)(keras.layers.Flatten()(h))
    discriminator = keras.Model(image, keras.layers.Dense(1)(h), name="discriminator")
    return generator, discriminator


def gan_updates(seed: int = 0) -> list[tuple]:
    """``(update, loss function, its arguments, the models it reads)`` for both GAN updates."""
    generator, discriminator = build_gan(seed)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    def discriminator_loss(real, noise):
        fake = generator(noise, training=True)
        real_logits = discriminator(real, training=True)
        fake_logits = discriminator(fake, training=True)
        return bce(keras.ops.ones_like(real_logits), real_logits) + bce(keras.ops.zeros_like(fake_logits), fake_logits)

    def generator_loss(noise):
        fake_logits = discriminator(generator(noise, training=True), training=True)
        return bce(keras.ops.ones_like(fake_logits), fake_logits)

    rng = np.random.default_rng(seed)
    real = tf.constant(rng.uniform(size=(BATCH, SIZE, SIZE, 3)).astype("float32"))
    noise = tf.constant(rng.standard_normal((BATCH, LATENT)).astype("float32"))
    models = [generator, discriminator]
    return [("discriminator", discriminator_loss, (real, noise), models),
            ("generator", generator_loss, (noise,), models)]


def build_encoder(seed: int = 0):
    """A SimCLR-style encoder: a conv trunk with batch norm, then a projection head."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((SIZE, SIZE, 3))
    h = image
    for channels, strides in ((32, 1), (32, 1), (64, 2), (64, 1), (128, 2)):
        h = keras.layers.Conv2D(channels, 3, strides=strides, padding="same", use_bias=False)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    return keras.Model(image, keras.layers.Dense(32)(h), name="encoder")


def simclr_updates(seed: int = 0, temperature: float = 0.5) -> list[tuple]:
    """The contrastive update: NT-Xent over both views (SimCLR, Chen et al. 2020, eq. 1),
    each view's positive is the other view of the same image, the negatives the other 2B-2."""
    encoder = build_encoder(seed)

    def contrastive_loss(view1, view2):
        z = keras.ops.normalize(keras.ops.concatenate([encoder(view1, training=True), encoder(view2, training=True)],
                                                      axis=0), axis=-1)
        logits = keras.ops.matmul(z, keras.ops.transpose(z)) / temperature
        logits = logits - 1e9 * keras.ops.eye(2 * BATCH)  # a view is no negative of itself
        labels = keras.ops.concatenate([keras.ops.arange(BATCH, 2 * BATCH), keras.ops.arange(0, BATCH)])
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))

    rng = np.random.default_rng(seed)
    images = rng.uniform(size=(BATCH, SIZE, SIZE, 3)).astype("float32")
    # Two augmentations: a horizontal flip and brightness jitter, drawn outside the loss.
    view1 = tf.constant(np.clip(images[:, :, ::-1] * rng.uniform(0.8, 1.2, (BATCH, 1, 1, 1)), 0, 1).astype("float32"))
    view2 = tf.constant(np.clip(images + rng.normal(0, 0.05, images.shape), 0, 1).astype("float32"))
    return [("encoder", contrastive_loss, (view1, view2), [encoder])]


MODELS = {"gan": gan_updates, "simclr": simclr_updates}


def plain_step(fn, variables):
    """The ``tf.GradientTape`` block ``g`` replaces, as a ``tf.function``."""
    @tf.function
    def step(*args):
        with tf.GradientTape() as tape:
            loss = fn(*args)
        return loss, tape.gradient(loss, variables)

    return step


def measure_update(model: str, update: str, fn, args: tuple, models: list, strategy: str, budget: str, rounds: int,
                   time_limit: float) -> dict:
    """One row: ``fn`` planned under ``budget`` and measured against its plain tape step."""
    row = {"model": model, "update": update, "strategy": strategy, "budget": budget}
    options = {"time_limit": time_limit} if strategy == "optimal" else {}
    variables = [v for m in models for v in m.variables]
    saved = [v.numpy() for v in variables]
    try:
        g = tfremat.value_and_grad(fn, budget, *args, strategy=strategy, verbose=0, **options)
    except (InfeasibleBudgetError, SolverTimeLimitError) as error:
        row["error"] = str(error).splitlines()[0]
        return row
    remat = tf.function(g)
    plain = plain_step(fn, g.trainable_variables)

    def restore():
        for variable, value in zip(variables, saved):
            variable.assign(value)

    try:
        loss, gradients = remat(*args)
        restore()
        plain_loss, plain_gradients = plain(*args)
        row["gradients_match"] = closeness([loss, *gradients], [plain_loss, *plain_gradients]).equal
        restore()
        # measure_step_peak calls step(x, y): x is the argument tuple, y empty.
        measured = measure_step_peak(lambda x, _: remat(*x), args, (), resident=variables)
        requested = measure_step_peak(lambda x, _: remat(*x), args, (), resident=variables, warmup=0,
                                      count="requested")
        plain_measured = measure_step_peak(lambda x, _: plain(*x), args, (), resident=variables)
        plain_requested = measure_step_peak(lambda x, _: plain(*x), args, (), resident=variables, warmup=0,
                                            count="requested")
        timing = time_in_turns(lambda: remat(*args), lambda: plain(*args), rounds)
    finally:
        restore()
    plan = g.plan
    row.update({
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "checkpoint_all_peak_bytes": plan.checkpoint_all_peak_bytes,
        "budget_bytes": plan.budget_bytes,
        "measured_over_budget": measured / plan.budget_bytes,
        "predicted_overhead": plan.overhead,
        "requested_over_predicted": requested / plan.predicted_peak_bytes,
        "measured_over_predicted": measured / plan.predicted_peak_bytes,
        "requested_over_plain": requested / plain_requested,
        "peak_over_plain": measured / plain_measured,
        "plain_peak_bytes": plain_measured,
        "time_over_plain": timing.ratio,
        "time_over_plain_quartiles": timing.ratio_quartiles,
        "step_seconds": timing.seconds,
        "plain_step_seconds": timing.reference_seconds,
    })
    return row


def _cells(row: dict) -> str:
    first = f"| {row['model']} | {row['update']} | {row['strategy']} {row['budget']} |"
    if "error" in row:
        return first + f" | | | | | | | | | {row['error'][:240]} |"
    low, high = row["time_over_plain_quartiles"]
    return (first + f" {row['predicted_peak_bytes'] / MiB:.2f} | {row['requested_over_predicted']:.3f} | "
            f"{row['measured_over_predicted']:.3f} | {row['measured_over_budget']:.3f} | "
            f"{row['requested_over_plain']:.3f} | {row['peak_over_plain']:.3f} | "
            f"{1 + row['predicted_overhead']:.3f} | {row['time_over_plain']:.3f} ({low:.2f}-{high:.2f}) | "
            f"{row['plain_step_seconds'] * 1000:.0f} | {'' if row['gradients_match'] else 'gradients differ'} |")


def render(rows: list[dict], argv, rounds: int) -> str:
    return "\n".join([
        "# Custom training loops: value_and_grad against the GradientTape step",
        "",
        header(argv),
        "",
        f"Batch {BATCH}, {SIZE}x{SIZE}x3 images, `cost_model=\"profile\"`, CPU (2 cores shared with other jobs: time "
        f"ratios are medians of per-round ratios over {rounds} rounds timed in turns with the plain step, quartiles "
        "in brackets). The step is `tf.function(g)`; plain is the same loss under `tf.GradientTape` in a "
        "`tf.function`. `req/pred`: bytes the step requests over the prediction; `alloc/pred`: the allocator's "
        "peak over the prediction; `alloc/budget`: over the budget; `req/plain`, `alloc/plain`: the same count "
        "over the plain step's; `planned`: 1 + predicted overhead; `plain ms`: the plain step's median time.",
        "",
        "| model | update | plan | predicted MiB | req/pred | alloc/pred | alloc/budget | req/plain | alloc/plain "
        "| planned | time/plain | plain ms | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_cells(r) for r in rows),
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, choices=sorted(MODELS), help="one model only")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per row")
    parser.add_argument("--time_limit", type=float, default=20.0, help="seconds per optimal solve")
    parser.add_argument("--out", default=None, help=f"markdown file to write (default {DEFAULT_OUT}; "
                        "required with --only)")
    args = parser.parse_args(argv)
    if args.only is not None and args.out is None:
        parser.error(f"--only runs one model only; give --out (the default {DEFAULT_OUT} holds both)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tfremat").setLevel(logging.ERROR)
    # The checkpoint-all rows plan at 100% on purpose.
    warnings.filterwarnings("ignore", message=r"budget='100%'.*nothing will be recomputed")
    out = args.out or DEFAULT_OUT
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for name in [args.only] if args.only else list(MODELS):
        for update, fn, fn_args, models in MODELS[name]():
            for strategy, budget in PLANS:
                row = measure_update(name, update, fn, fn_args, models, strategy, budget, args.rounds,
                                     args.time_limit)
                logger.info("%s", row)
                rows.append(row)
                text = render(rows, argv, args.rounds)
                with open(out, "w") as f:  # after every row: a run cut short keeps what it measured
                    f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
