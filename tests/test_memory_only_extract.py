"""``extract(..., timing=False)``: a profile that measures bytes and times nothing (needs TensorFlow)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from tfremat.errors import ExtractionError  # noqa: E402
from tfremat.extract import call_timing, extractor  # noqa: E402
from tfremat.extract.extractor import extract  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _model():
    """Conv, max pooling (a oneDNN kernel residual with oneDNN on) and a Dense head. No batch
    norm: its per-channel residuals were sized 0, 32 or 64 bytes by extractions in one process,
    timed or not."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    x = keras.Input((16, 16, 3))
    h = layers.Conv2D(8, 3, padding="same")(x)
    h = layers.ReLU()(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Flatten()(h)
    return keras.Model(x, layers.Dense(4, activation="softmax")(h))


def _batch(batch=8):
    x = np.random.default_rng(0).standard_normal((batch, 16, 16, 3)).astype("float32")
    y = np.zeros((batch, 4), "float32")
    y[:, 0] = 1
    return x, y


def _no_timing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a memory-only extraction timed a call")

    monkeypatch.setattr(call_timing, "_least_seconds", refuse)
    monkeypatch.setattr(call_timing, "_kernel_seconds", refuse)
    monkeypatch.setattr(call_timing, "_compiled_least_seconds", refuse)
    monkeypatch.setattr(extractor, "measure_plain_overlap", refuse)


def test_memory_only_times_nothing_and_measures_the_profiled_bytes(monkeypatch):
    model = _model()
    profiled = extract(model, _batch(), cost_model="profile", use_cache=False).graph
    flops = extract(model, _batch(), cost_model="flops", use_cache=False).graph
    _no_timing(monkeypatch)
    memory = extract(model, _batch(), cost_model="profile", use_cache=False, timing=False)
    graph = memory.graph
    assert memory.plain_overlap == 1.0
    assert graph.names == profiled.names and graph.edges == profiled.edges
    assert graph.output_bytes == profiled.output_bytes
    assert graph.residual_bytes == profiled.residual_bytes
    assert graph.fixed_bytes == profiled.fixed_bytes
    # Workspaces are allocator measurements, measured the same way in both; the loss's moves
    # by a few dozen bytes between traces (benchmarks/results/workspace_repeatability.md).
    # The convolution's backward measured 912 or 13,232 bytes before its upstream gradient
    # waited for the forward in every traced order.
    assert any(graph.workspace_bytes)
    apart = [name for name, a, b in zip(graph.names, graph.workspace_bytes, profiled.workspace_bytes)
             if abs(a - b) > max(1024, 0.05 * max(a, b))]
    assert not apart, (apart, graph.workspace_bytes, profiled.workspace_bytes)
    # Costs are the FLOP model's, never zero seconds.
    assert graph.cost == flops.cost and graph.total_cost > 0


def test_memory_only_profile_is_cached_apart(monkeypatch):
    model = _model()
    with monkeypatch.context() as patched:
        _no_timing(patched)
        first = extract(model, _batch(), cost_model="profile", timing=False)
        again = extract(model, _batch(), cost_model="profile", timing=False)
    assert not first.cache_hit and again.cache_hit
    assert again.graph == first.graph
    # A timed request never reads the memory-only entry (its seconds are not there).
    timed = extract(model, _batch(), cost_model="profile")
    assert not timed.cache_hit
    assert timed.graph.cost != first.graph.cost


def test_timing_must_be_a_bool():
    with pytest.raises(ExtractionError, match="timing must be True or False"):
        extract(_model(), _batch(), timing="no")
