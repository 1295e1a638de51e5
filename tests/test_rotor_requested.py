"""rotor's plan of keras.io's ViT requests at most its predicted peak on TensorFlow's
single-threaded executor (issue 33, item 1).

benchmarks/results/vjp_rebuilds.md had rotor at 45% request 1.062x its prediction, the
only non-offloading schedule above it. The schedule was not the cause: its peak falls at
the backward node of the 2048x64 head kernel, and the executor's fixed order ran that
kernel's Adam update before the statement's token released the gradient, so the update
held a second kernel-sized buffer (``Sub`` beside ``Square``) where the memory model
counts one (docs/memory-model.md, "Optimizer update temporaries"). The step is called on
that executor explicitly, as ``step(x, y)`` runs it with several inter-op threads (the
test process has one, :mod:`conftest`).
"""

import keras
import tensorflow as tf
from models import keras_io_vit

from tfremat.extract import extract
from tfremat.model_planning import synthetic_batch
from tfremat.plan import simulate
from tfremat.runtime import executor
from tfremat.static_graph import compile_step, measure_step_peak
from tfremat.strategies import get_strategy


def test_rotor_vit_requests_at_most_its_prediction_on_the_single_threaded_executor():
    model = keras_io_vit(image_size=32, patch_size=4, dim=32, heads=2, blocks=2, head=(64,))
    x, y = (tf.constant(v) for v in synthetic_batch(model, 16, loss="categorical_crossentropy", seed=0))
    extraction = extract(model, sample_batch=(x, y), loss="categorical_crossentropy", cost_model="flops",
                         use_cache=False, optimizer=keras.optimizers.Adam())
    schedule = get_strategy("rotor")(extraction.graph, "45%")
    predicted = simulate(extraction.graph, schedule).peak_bytes
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    step = compile_step(extraction, schedule, optimizer=optimizer)
    assert step.report.recompute_statements > 0  # a plan that recomputes, not checkpoint-all

    def on_single_threaded_executor(x, y):
        with executor.sequential():
            return step.function(x, y)

    requested = measure_step_peak(on_single_threaded_executor, x, y,
                                  resident=list(model.variables) + list(optimizer.variables), count="requested")
    assert requested <= predicted, requested / predicted
