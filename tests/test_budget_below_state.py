"""An amount of memory below the model's weights and optimizer state is refused before profiling."""

import keras
import numpy as np
import pytest

import tfremat
from tfremat.errors import InfeasibleBudgetError
from tfremat.extract import extractor


def _model():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _never_extracted(*_args, **_kwargs):
    raise AssertionError("the model was extracted")


@pytest.mark.parametrize("train", [False, True])
def test_a_budget_below_weights_and_adam_slots_is_refused_without_extracting(train, monkeypatch):
    model = _model()
    weights = (16 * 64 + 64 + 64 * 4 + 4) * 4
    x, y = np.zeros((8, 16), "float32"), np.zeros((8, 4), "float32")
    monkeypatch.setattr(extractor, "extract", _never_extracted)
    budget = 2 * weights  # above the weights, below weights + Adam's two slots
    with pytest.raises(InfeasibleBudgetError) as raised:
        if train:
            tfremat.fit(model, budget, x, y, batch_size=8, epochs=1, verbose=0)
        else:
            tfremat.plan_model(model, budget, x, y, batch_size=8, verbose=0)
    assert raised.value.proven and raised.value.lower_bound_bytes >= 3 * weights
    assert "optimizer's state" in str(raised.value)


def test_shares_are_not_judged_before_the_extraction(monkeypatch):
    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(extractor, "extract", recorded)
    x, y = np.zeros((8, 16), "float32"), np.zeros((8, 4), "float32")
    with pytest.raises(RuntimeError, match="stop here"):
        tfremat.plan_model(_model(), "1%", x, y, batch_size=8, verbose=0)
    assert calls
