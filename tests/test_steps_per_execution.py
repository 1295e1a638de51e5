"""``steps_per_execution`` above 1 is refused by name before anything is extracted: the
compiled step runs one batch per step (benchmarks/results/user_check_6.md)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import ArgumentError  # noqa: E402


def test_steps_per_execution_above_one_is_refused_naming_the_argument_and_the_fix():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    x, y = np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ArgumentError, match=r"steps_per_execution=3\).*steps_per_execution=1"):
        tfremat.fit(model, "50%", x, y, batch_size=4, epochs=1, verbose=0)
