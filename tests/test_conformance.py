"""A fast subset of the conformance benchmark (``benchmarks/conformance.py``, issue 19).

Models written the way Keras users write them, and one Keras application, at batch 2:
planned at the first feasible budget of 60% / 80% of the checkpoint-all peak (else the
smallest peak the strategy reaches) with a strategy that recomputes, the schedule compiles
(:func:`tfremat.static_graph.compile_step`), trains one step, and the gradients the
optimizer receives match a plain ``tf.GradientTape`` step's, norm-relative: per variable
``||a - e|| / max(||e||, 1e-2 * ||E||)`` and globally ``||A - E|| / ||E||``.

Layers that hold sublayers (the custom block, MultiHeadAttention, keras-hub's decoder and
encoder blocks) are opened (the default granularity), so the schedules recompute inside them.

Only what the math guarantees is asserted: the compiled step computes the plain step's
function, so the two differ by float rounding alone. As TensorFlow runs by default,
Grappler fuses different op groups in the two graphs, and where a gradient cancels (the
ConvMixer's patch-conv bias before GELU and batch norm) that rounding reaches 4e-4 of it, as
far as the plain step moves when the fusions are turned off: the bound is 1e-4 / 1e-5 or ten
times that noise, whichever is larger. With the fusing rewrites off in both steps they run
the same kernels and agree up to the order in which a value's gradient contributions are
added (0 to 4e-7 on these models, oneDNN on or off): 1e-4 per variable, 1e-5 globally.
"""

import os
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import conformance  # noqa: E402

VAR_TOL = 1e-4
GLOBAL_TOL = 1e-5
FRACTIONS = (0.6, 0.8)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _mobilenet():
    """MobileNet (v1) at width 0.25: ZeroPadding2D before each strided depthwise conv,
    batch norm and ReLU6, the layer pattern oneDNN's layout pass rewrites."""
    keras.utils.set_random_seed(0)
    return keras.applications.MobileNet(alpha=0.25, weights=None, input_shape=(32, 32, 3), classes=10)


# model, strategy: each model once, the two recomputing heuristic families both covered.
HUB = pytest.mark.skipif(not conformance.keras_hub_installed(), reason="keras-hub is not installed")
CASES = [
    ("zeropad_conv_chain", "eviction"),
    ("transformer_encoder", "chen_sqrtn_ap"),  # recomputes inside the opened TransformerBlock layers
    ("convmixer", "eviction"),
    ("mobilenet_0.25", "chen_sqrtn_ap"),
    pytest.param("gpt2_hub", "chen_sqrtn_ap", marks=HUB),  # keras-hub decoder blocks, opened
    pytest.param("bert_hub", "eviction", marks=HUB),
]


@pytest.mark.parametrize("name, strategy", CASES)
def test_recomputing_step_compiles_trains_and_matches_plain_gradients(name, strategy):
    model = _mobilenet() if name == "mobilenet_0.25" else conformance.build(name)
    case = conformance.ModelCheck(name, model=model)
    planned = case.plan(strategy, FRACTIONS, {})
    schedule = planned["result"].schedule
    assert schedule.recompute_count > 0, "the schedule recomputes nothing; the test would not test recomputation"

    # Once as TensorFlow runs by default (within the tolerances or ten times the plain
    # step's rounding noise), once with Grappler's fusing rewrites off in both steps (the
    # same kernels: within the tolerances); see the module docstring.
    default = case.check(schedule)
    strict = case.check(schedule, strict=True)
    problem = conformance.verdict(default, strict, case.noise, var_tol=VAR_TOL, global_tol=GLOBAL_TOL)
    assert not problem, f"{name} / {strategy} (noise {case.noise[0]:.1e} / {case.noise[1]:.1e}): {problem}"
    assert strict["max_var_error"] <= VAR_TOL, f"gradient of {strict['worst_variable']}: {strict['max_var_error']:.2e}"
    assert strict["global_error"] <= GLOBAL_TOL, f"global gradient error {strict['global_error']:.2e}"


def test_gradient_errors_are_norm_relative_with_a_global_floor():
    expected = [np.array([3.0, 4.0]), np.array([0.0, 1e-4])]
    # The tiny variable's error is measured against 1e-2 of the global norm (5), not its own.
    got = [np.array([3.0, 4.0]), np.array([0.0, 1e-4 + 5e-4])]
    worst, global_error, index = conformance.gradient_errors(got, expected)
    assert index == 1
    assert worst == pytest.approx(5e-4 / (1e-2 * np.sqrt(25 + 1e-8)))
    assert global_error == pytest.approx(5e-4 / np.sqrt(25 + 1e-8))
    # A NaN gradient is the worst error, not ignored.
    worst, _, index = conformance.gradient_errors([np.array([np.nan, 4.0]), expected[1]], expected)
    assert index == 0 and np.isnan(worst)
