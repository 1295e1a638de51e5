"""Fidelity on keras.applications (issue 33 items 1 and 5): what made a compiled step
request more than its prediction, reproduced on small models, and the account
(:func:`tfremat.measure.explain_requested_peak`) that finds such a cause.
benchmarks/fidelity.py measures the applications themselves
(benchmarks/results/fidelity_applications.md).
"""

import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.measure import measure_model  # noqa: E402

BATCH = 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _conv_chain(depth=6, side=16, channels=8):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Conv2D(channels, 3, padding="same", activation="relu") for _ in range(depth)]
    model = keras.Sequential([keras.Input((side, side, 3)), *layers, keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    return model


def test_the_account_charges_gradient_ops_to_backward_nodes():
    """The requested peak of a conv chain falls in a backward statement (its gradient ops
    are named ``gradient_tape/forward_<n>/...``, charged to n's backward node), and the
    account sees the bytes the step requests and the simulator's at that statement."""
    measured = measure_model(_conv_chain(), "100%", batch_size=BATCH, steps=1, verbose=0, explain=True,
                             cost_model="flops")
    account = measured["requested_explained"]
    assert account["at"].startswith("backward_") and account["at"].endswith("_backward)"), account
    # The same replay as the measured requested peak (another run: a few scalars apart).
    assert abs(account["requested_bytes"] - measured["requested_peak_bytes"]) <= 1024, account
    assert account["predicted_bytes"] is not None and account["predicted_bytes"] <= account["predicted_peak_bytes"]
    requested = sum(r for _, r, _ in account["differences"])
    assert 0 < requested <= account["requested_bytes"]
    names = [label for label, _, _ in account["differences"]]
    assert any(name.endswith("_backward") for name in names), names
