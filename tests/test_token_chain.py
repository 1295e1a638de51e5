"""A statement that creates no operation keeps the statement chain: what the statement
before it computed runs before the statements after it (issue 33, requested never above
predicted; benchmarks/results/gemma_opening.md, "Requested over predicted (Q)").

The backward node of an ``Add`` hands the upstream gradient on and creates no operation;
its token read only tensors made before, so nothing later waited for the rest of the
statement before it. A norm's scale gradient (a ``Sum`` over batch and time of an
activation-sized product) just before such a statement then ran where its optimizer update
needed it: with ``weight_grads="fixed"`` (updates after the backward pass) at the end of
the step, holding the product through every later statement, which the graph counts as the
scale's 256 bytes. keras-hub's tiny Gemma requested 0.9 MiB over its prediction that way.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfremat.extract.extractor import extract
from tfremat.measure import requested_ledger
from tfremat.static_graph.compile import compile_step
from tfremat.strategies import get_strategy

#: Bytes of scalars and shapes per statement that the memory model leaves out, as in
#: tests/test_requested_statements.py; the product held before the fix is 128 KiB.
SLACK = 4096


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path))


class ScaleNorm(keras.layers.Layer):
    """``x * (1 + scale)``, the scale part of Gemma's RMS norm: its weight gradient sums an
    input-sized product over batch and time."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="scale")

    def call(self, x):
        return x * (1.0 + self.scale)


def _residual_norm_model(width: int = 64):
    inputs = keras.Input((64, width))
    first = keras.layers.Dense(width, name="first")(inputs)
    second = keras.layers.Dense(width, name="second")(inputs)
    summed = keras.layers.Add(name="residual")([first, second])
    normed = ScaleNorm(name="norm")(summed)
    return keras.Model(inputs, keras.layers.Dense(width, name="head")(normed))


def test_a_norm_scale_gradient_before_an_add_backward_runs_before_the_next_statement():
    keras.utils.set_random_seed(0)
    model = _residual_norm_model()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 64, 64)), tf.float32)
    y = tf.constant(rng.standard_normal((8, 64, 64)), tf.float32)
    extraction = extract(model, sample_batch=(x, y), loss=keras.losses.MeanSquaredError(),
                         optimizer=keras.optimizers.SGD(), cost_model="flops", use_cache=False, weight_grads="fixed")
    graph = extraction.graph
    assert graph.weight_grads_to_end
    schedule = get_strategy("checkpoint_all")(graph, None)
    optimizer = keras.optimizers.SGD()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, schedule, optimizer=optimizer)
    rows = requested_ledger(extraction, schedule, step, x, y, list(model.variables) + list(optimizer.variables))

    scopes = [row["scope"] for row in rows]
    norm_backward = scopes.index(f"backward_{graph.backward_of[graph.names.index('norm')]}")
    residual_backward = scopes.index(f"backward_{graph.backward_of[graph.names.index('residual')]}")
    assert residual_backward == norm_backward + 1  # the Add's backward comes right after the norm's
    later = [row for row in rows[residual_backward + 1:] if row["requested_bytes"] is not None]
    assert later, "no statement after the Add's backward allocated anything"
    over = [f"{row['scope']} ({row['name']}): requested {row['requested_bytes']} > predicted {row['predicted_bytes']}"
            for row in later if row["requested_bytes"] > row["predicted_bytes"] + SLACK]
    assert not over, over
