"""The user API on Keras models: tfremat.fit, the callback, plan, infeasible budgets, the CLI."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from cli_output import one_error_line  # noqa: E402
from models import small_convnet  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import (  # noqa: E402
    ArgumentError,
    CompileError,
    ExtractionError,
    InfeasibleBudgetError,
    TfrematError,
)
from tfremat.keras import RematCallback  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402
from tfremat.plan.simulator import simulate  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def compiled_convnet(seed=0):
    model = small_convnet(seed=seed)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def data(count=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 32, 32, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, count)]
    return x, y


def max_weight_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def weight_closeness(plain, remat):
    """How close ``remat``'s weights are to ``plain``'s (:mod:`tfremat.numerics`): model.fit
    and tfremat run different graphs, whose fusions round differently under oneDNN."""
    return closeness(remat.get_weights(), plain.get_weights())


def test_fit_with_recomputation_matches_plain_fit_and_plans_the_last_batch():
    x, y = data()
    plain = compiled_convnet()
    keras.utils.set_random_seed(1)
    plain_history = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    remat = compiled_convnet()
    keras.utils.set_random_seed(1)
    callback = RematCallback("100%", strategy="chen_sqrtn", verbose=0)
    history = remat.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    # 40 samples in batches of 16: the last batch of 8 gets its own schedule.
    assert sorted(k[0][0] for k in callback.plans) == [8, 16]
    assert any(p.schedule.recompute_count > 0 for p in callback.plans.values())
    assert weight_closeness(plain, remat).equal
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)
    assert history.history["accuracy"] == plain_history.history["accuracy"]
    # The model's own train function is back after fit.
    assert remat.train_function is not callback._train_function


def test_tfremat_fit_equals_the_callback_path_and_accepts_tf_data():
    x, y = data(32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    via_callback = compiled_convnet()
    keras.utils.set_random_seed(2)
    via_callback.fit(dataset, epochs=1, verbose=0, callbacks=[RematCallback("100%", strategy="chen_greedy", verbose=0)])
    via_fit = compiled_convnet()
    keras.utils.set_random_seed(2)
    history = tfremat.fit(via_fit, "100%", dataset, epochs=1, strategy="chen_greedy", verbose=0)
    assert max_weight_difference(via_callback, via_fit) == 0.0
    # The History carries the plans it trained with, by batch shapes.
    assert [k[0][0] for k in history.plans] == [16]
    assert all(plan.strategy == "chen_greedy" for plan in history.plans.values())


def test_a_cold_profile_leaves_the_model_as_it_found_it():
    """The extraction's timing passes run every call again after its state was restored:
    on a cold profile cache they moved the dropout seed by 18 draws (and batch-norm
    statistics), so the callback's first fit trained on other masks than a second fit
    with a warm cache (weights 0.16-0.33 apart) and than model.fit."""
    from tfremat.extract import extract

    x, y = data(16)
    model = compiled_convnet()
    before = [v.numpy() for v in model.variables]
    extraction = extract(model, (x, y), optimizer=model.optimizer, cost_model="profile", repeats=1)
    assert not extraction.cache_hit  # measured here, timing passes included
    after = [v.numpy() for v in model.variables]
    changed = [v.path for v, b, a in zip(model.variables, before, after) if not np.array_equal(b, a)]
    assert not changed


def test_plan_reports_prediction_and_infeasible_budget_reports_smallest_peak():
    x, y = data(8)
    model = compiled_convnet()
    result = tfremat.plan_model(model, "100%", x, y, batch_size=8, strategy="hong", cost_model="flops", verbose=0)
    assert result.predicted_peak_bytes <= result.budget_bytes == result.checkpoint_all_peak_bytes
    assert result.overhead >= 0
    with pytest.raises(InfeasibleBudgetError) as info:
        tfremat.plan_model(model, "1MB", x, y, batch_size=8, strategy="chen_greedy", cost_model="flops", verbose=0)
    # Below the weights and Adam's slots it is refused before the extraction, with that bound;
    # otherwise the strategy's smallest peak is reported.
    error = info.value
    assert (error.min_feasible_bytes if error.min_feasible_bytes is not None else error.lower_bound_bytes) > 10**6


def test_the_callback_refuses_a_bad_budget_or_strategy_at_once():
    from tfremat.errors import BudgetFormatError

    with pytest.raises(BudgetFormatError, match="budget='abc'"):
        RematCallback("abc")
    with pytest.raises(TfrematError, match="unknown strategy 'nope'"):
        RematCallback("50%", strategy="nope")
    # Options the strategy does not take were dropped in silence; bad ones failed at the first step.
    with pytest.raises(ArgumentError, match="time_limit"):
        RematCallback("50%", strategy="checkpoint_all", time_limit=20)
    with pytest.raises(ArgumentError, match="cost_model"):
        RematCallback("50%", strategy="checkpoint_all", cost_model="exact")
    with pytest.raises(ArgumentError, match="unknown solver 'bogus'"):
        RematCallback("50%", solver="bogus")
    # A budget changed after the first fit was ignored: the steps were keyed by batch shape.
    with pytest.raises(AttributeError, match="budget is fixed"):
        RematCallback("50%").budget = "90%"


def test_the_callback_takes_a_host_link_only_for_offloading(monkeypatch):
    """An offloading strategy needs the link in bytes per second, so profiled costs, and
    a bandwidth where no GPU's link can be measured; the others refuse one."""
    import tensorflow as tf

    import tfremat.keras as remat_keras
    from tfremat.runtime.host_link import host_link_bandwidth

    measured = host_link_bandwidth(size_bytes=1 << 20, repeats=2)
    if tf.config.list_logical_devices("GPU"):
        assert measured > 0
        assert RematCallback("50%", strategy="pofo", verbose=0).bandwidth > 0
    else:
        assert measured is None
        with pytest.raises(ArgumentError, match="pass bandwidth="):
            RematCallback("50%", strategy="pofo")
    # Without bandwidth= the callback takes the measured link (compared with a second
    # measurement it would depend on the load and on the copy size: 1 MiB against 64 MiB).
    with monkeypatch.context() as patched:
        patched.setattr(remat_keras, "host_link_bandwidth", lambda: 7e9)
        assert RematCallback("50%", strategy="pofo", verbose=0).bandwidth == 7e9
    assert RematCallback("50%", strategy="pofo", bandwidth=12e9).bandwidth == 12e9
    with pytest.raises(ArgumentError, match="cost_model='profile'"):
        RematCallback("50%", strategy="autocapper", bandwidth=12e9, cost_model="flops")
    with pytest.raises(ArgumentError, match="does not offload"):
        RematCallback("50%", strategy="eviction", bandwidth=12e9)
    with pytest.raises(ArgumentError, match="size_bytes"):
        host_link_bandwidth(size_bytes=0)


def test_fit_needs_a_compiled_model():
    with pytest.raises(TfrematError, match="compile"):
        tfremat.fit(small_convnet(), "50%", *data(8), batch_size=8)


def run_cli(*args, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "tfremat.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "tiny.keras"
    small_convnet(channels=4).save(path)
    return folder, path


def test_cli_graph_then_solve(saved_model):
    folder, path = saved_model
    common = [f"--model={path}", "--input_shape=32,32,3", "--batch=2", "--cost_model=flops"]
    out = run_cli("graph", *common, "--out=g.json", "--json", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["nodes"] == 25
    out = run_cli("solve", "--graph=g.json", "--strategy=approx_lp", "--budget=100%", "--json", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["peak_bytes"] <= record["budget_bytes"]


def test_cli_plan_compare_and_measure(saved_model):
    folder, path = saved_model
    # "profile" measures each node's workspace (CPU convolution gradients need scratch);
    # "flops" leaves it at 0 and would under-predict the measured peak.
    common = [f"--model={path}", "--input_shape=32,32,3", "--batch=4", "--cost_model=profile", "--budget=100%"]
    out = run_cli("plan", *common, "--strategy=chen_greedy", "--schedule_out=s.json", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "predicted_peak_bytes" in out.stdout and (folder / "s.json").exists()
    out = run_cli("compare", *common, "--strategies=checkpoint_all,chen_sqrtn,optimal", "--time_limit=20", "--json", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["strategy"] for r in rows] == ["checkpoint_all", "chen_sqrtn", "optimal"]
    out = run_cli("measure", *common, "--strategy=chen_sqrtn", "--steps=2", "--json", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "requested_peak_bytes", "step_seconds",
                "plain_peak_bytes", "plain_step_seconds", "grad_error", "grad_global_error"):
        assert record[key] is not None, key
    assert record["gradients_match"], record
    assert record["measured_peak_bytes"] <= 1.1 * record["predicted_peak_bytes"] + 4 * 2**20
    assert record["requested_peak_bytes"] <= 1.02 * record["predicted_peak_bytes"] + 2**20


def test_cli_maxbatch_and_plot(saved_model):
    folder, path = saved_model
    out = run_cli("maxbatch", f"--model={path}", "--input_shape=32,32,3", "--budget=40MiB",
                  "--strategies=checkpoint_all,chen_greedy", "--cost_model=flops", "--noallocator_check", "--json",
                  cwd=folder)  # the plumbing; the allocator's hold is tests/test_cli_maxbatch.py's
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["strategy"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert rows["chen_greedy"]["batch_size"] >= rows["checkpoint_all"]["batch_size"] >= 1
    out = run_cli("plot", f"--model={path}", "--input_shape=32,32,3", "--batch=16", "--cost_model=flops",
                  "--strategies=checkpoint_all,chen_sqrtn,chen_greedy", "--out=plots", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in ("memory.png", "overhead.png"):
        assert (folder / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_model_commands_reject_bad_flags(saved_model):
    folder, path = saved_model
    out = run_cli("plan", f"--model={path}", "--input_shape=32,x,3", "--batch=2", "--budget=50%", cwd=folder)
    assert out.returncode == 2 and "input_shape" in out.stderr and one_error_line(out.stderr), out.stderr
    out = run_cli("plan", f"--model={path}", "--input_shape=32,32,3", "--batch=2", "--budget=lots", cwd=folder)
    assert out.returncode == 1 and "budget" in out.stderr
    # A saved model has its own input shape: a different one is refused, none is fine.
    out = run_cli("plan", f"--model={path}", "--input_shape=16,16,3", "--batch=2", "--budget=100%",
                  "--strategy=checkpoint_all", "--cost_model=flops", cwd=folder)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "32,32,3" in out.stderr.strip().splitlines()[-1]
    out = run_cli("plan", f"--model={path}", "--batch=2", "--budget=100%", "--strategy=checkpoint_all",
                  "--cost_model=flops", cwd=folder)
    assert out.returncode == 0, out.stderr[-2000:]
    # Values and files the library refuses are one line too, not a traceback.
    (folder / "list.json").write_text("[1, 2]")
    out = run_cli("solve", "--graph=list.json", "--strategy=eviction", "--budget=90%", cwd=folder)
    assert out.returncode == 1 and "JSON object" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("graph", f"--model={path}", "--batch=2", "--cost_model=flops", "--out=/nonexistent/g.json",
                  cwd=folder)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("tfremat: error:") and "/nonexistent/g.json" in out.stderr


def _train_both(plain, remat, x, y, strategy="chen_sqrtn", cost_model="flops"):
    """Trains two compiled copies of a model, with model.fit and tfremat.fit from the same
    seed; returns how close their weights are (:func:`weight_closeness`) and both histories."""
    keras.utils.set_random_seed(1)
    expected = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    keras.utils.set_random_seed(1)
    history = tfremat.fit(remat, "100%", x, y, batch_size=8, epochs=2, shuffle=False, strategy=strategy,
                          cost_model=cost_model, verbose=0)
    return weight_closeness(plain, remat), expected.history, history.history


def _fit_both(build, compile_kwargs, x, y, strategy="chen_sqrtn"):
    """:func:`_train_both` on two copies of ``build()`` compiled with ``compile_kwargs()``."""
    plain, remat = build(), build()
    plain.compile(**compile_kwargs())
    remat.compile(**compile_kwargs())
    return _train_both(plain, remat, x, y, strategy)


def two_output_model(loss, loss_weights=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    a = keras.layers.Dense(1, activation="sigmoid", name="a")(hidden)
    b = keras.layers.Dense(3, activation="softmax", name="b")(hidden)
    model = keras.Model(inputs, [a, b])
    model.compile(keras.optimizers.SGD(0.1), loss, loss_weights=loss_weights)
    return model


@pytest.mark.parametrize("loss, loss_weights", [
    (["mse", "categorical_crossentropy"], [1.0, 0.5]),
    ({"a": "mae", "b": "categorical_crossentropy"}, {"a": 2.0, "b": 1.0}),
    ("mse", 3.0),
    (["mse", None], None),
])
def test_fit_trains_like_keras_for_every_way_to_compile_a_loss(loss, loss_weights):
    """Lists and dicts of losses, loss weights, an output without loss, and losses that
    read a sigmoid/softmax output itself rather than its logits (mse, mae) all train to
    the same weights as plain Keras (each once failed or trained on another loss)."""
    rng = np.random.default_rng(0)
    x = rng.random((16, 16)).astype("float32")
    y = [rng.random((16, 1)).astype("float32"), np.eye(3, dtype="float32")[rng.integers(0, 3, 16)]]
    difference, expected, history = _train_both(two_output_model(loss, loss_weights),
                                                two_output_model(loss, loss_weights), x, y, "checkpoint_all")
    assert difference.equal, difference
    assert history["loss"] == expected["loss"]


@pytest.mark.parametrize("weighting", ["sample_weight", "class_weight", "dataset"])
def test_fit_with_sample_and_class_weights_trains_like_keras(weighting):
    """Sample weights (an array, Keras's class_weight, or a dataset's third element) were
    refused; the step passes them to every output's loss as Keras's compiled loss does,
    and the weighted metrics see them: same weights, losses and metrics as model.fit."""
    rng = np.random.default_rng(0)
    x = rng.random((32, 16)).astype("float32")
    labels = rng.integers(0, 3, 32)
    y = np.eye(3, dtype="float32")[labels]
    weights = rng.random(32).astype("float32") * 2
    if weighting == "sample_weight":
        data_kwargs = {"x": x, "y": y, "sample_weight": weights, "batch_size": 8}
    elif weighting == "class_weight":
        data_kwargs = {"x": x, "y": y, "class_weight": {0: 0.2, 1: 1.0, 2: 3.0}, "batch_size": 8}
    else:
        data_kwargs = {"x": tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(8)}
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
        model.compile(keras.optimizers.Adam(0.01), "categorical_crossentropy", weighted_metrics=["accuracy"])
        models.append(model)
    plain, remat = models
    keras.utils.set_random_seed(1)
    expected = plain.fit(**data_kwargs, epochs=2, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(1)
    history = tfremat.fit(remat, "100%", **data_kwargs, epochs=2, shuffle=False, strategy="chen_sqrtn",
                          cost_model="flops", verbose=0).history
    assert weight_closeness(plain, remat).equal
    assert history == expected
    unweighted = keras.losses.CategoricalCrossentropy()(y, plain(x)).numpy()
    assert abs(expected["loss"][-1] - unweighted) > 1e-3  # the weights changed the loss


def test_sample_weights_per_output_are_refused_naming_the_fix():
    rng = np.random.default_rng(0)
    x = rng.random((16, 16)).astype("float32")
    y = [rng.random((16, 1)).astype("float32"), np.eye(3, dtype="float32")[rng.integers(0, 3, 16)]]
    model = two_output_model(["mse", "categorical_crossentropy"])
    with pytest.raises(CompileError, match="one array of sample weights"):
        tfremat.fit(model, "100%", x, y, sample_weight=[np.ones(16, "float32")] * 2, batch_size=8,
                    strategy="checkpoint_all", cost_model="flops", verbose=0)


def test_a_callback_reused_on_another_model_trains_that_model():
    x, y = data(16)
    first, second = compiled_convnet(seed=0), compiled_convnet(seed=1)
    callback = RematCallback("100%", strategy="chen_sqrtn", cost_model="flops", verbose=0)
    first.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    first_weights = first.get_weights()
    second_before = second.get_weights()
    second.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert all(np.array_equal(u, v) for u, v in zip(first_weights, first.get_weights()))
    assert any(not np.array_equal(u, v) for u, v in zip(second_before, second.get_weights()))


def test_a_failed_fit_gives_the_model_its_own_train_step_back():
    x, y = data(16)
    model = compiled_convnet()
    with pytest.raises(InfeasibleBudgetError):
        tfremat.fit(model, "1MB", x, y, batch_size=8, strategy="chen_greedy", cost_model="flops", verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_plan_takes_an_optimizer_name():
    x, y = data(8)
    result = tfremat.plan_model(compiled_convnet(), "100%", x, y, batch_size=8, optimizer="adam", strategy="chen_sqrtn",
                          cost_model="flops", verbose=0)
    assert result.extraction.side_table.optimizer.__class__.__name__ == "Adam"
    with pytest.raises(TfrematError, match="optimizer='nope'"):
        tfremat.plan_model(compiled_convnet(), "100%", x, y, batch_size=8, optimizer="nope", cost_model="flops", verbose=0)


def test_missing_labels_and_unbatched_datasets_are_refused_by_name():
    """fit without labels ended in an AttributeError inside the callback, and an unbatched
    dataset in a Keras shape error about its first sample axis taken for the batch."""
    import tensorflow as tf

    x, y = data(16)
    model = compiled_convnet()
    with pytest.raises(ArgumentError, match="y=None"):
        tfremat.fit(model, "60%", x, None, batch_size=8, verbose=0)
    with pytest.raises(ArgumentError, match="no labels"):
        model.fit(x, None, batch_size=8, verbose=0, callbacks=[RematCallback("60%", cost_model="flops", verbose=0)])
    with pytest.raises(ArgumentError, match=r"single samples .*dataset\.batch"):
        tfremat.plan_model(model, "100%", tf.data.Dataset.from_tensor_slices((x, y)), cost_model="flops", verbose=0)
    batched = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    assert tfremat.plan_model(model, "100%", batched, cost_model="flops", verbose=0).schedule is not None


def test_plan_refuses_a_batch_size_its_data_cannot_fill():
    x, y = data(8)
    for bad in (0, -1, 8.0, "8"):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            tfremat.plan_model(compiled_convnet(), "100%", x, y, batch_size=bad, cost_model="flops", verbose=0)
    with pytest.raises(ValueError, match="fewer than batch_size=16"):
        tfremat.plan_model(compiled_convnet(), "100%", x, y, batch_size=16, cost_model="flops", verbose=0)


def test_measure_names_a_bad_argument_before_any_work():
    from tfremat.errors import ArgumentError
    from tfremat.measure import measure_model

    model = compiled_convnet()
    for arguments, name in (({"steps": "2"}, "steps"), ({"steps": 1.5}, "steps"), ({"batch_size": 0}, "batch_size"),
                            ({"optimizer": "nope"}, "optimizer=.nope.")):
        options = {"batch_size": 4, **arguments}
        with pytest.raises(ArgumentError, match=name):
            measure_model(model, "100%", cost_model="flops", verbose=0, **options)


_PATCHES_MODULE = """
import keras


@keras.saving.register_keras_serializable(package="tfremat_test")
class Patches(keras.layers.Layer):
    \"\"\"Splits images into flattened patches, as the Keras examples' ViT does.\"\"\"

    def __init__(self, patch_size, **kwargs):
        super().__init__(**kwargs)
        self.patch_size = patch_size

    def call(self, images):
        size = self.patch_size
        height, width, channels = images.shape[1:]
        patches = keras.ops.reshape(images, (-1, height // size, size, width // size, size, channels))
        patches = keras.ops.transpose(patches, (0, 1, 3, 2, 4, 5))
        return keras.ops.reshape(patches, (-1, (height // size) * (width // size), size * size * channels))

    def get_config(self):
        return {**super().get_config(), "patch_size": self.patch_size}
"""


def _patches_model(module):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    tokens = keras.layers.Dense(8, activation="relu")(module.Patches(4)(inputs))
    outputs = keras.layers.Dense(5, activation="softmax")(keras.layers.GlobalAveragePooling1D()(tokens))
    return keras.Model(inputs, outputs)


def test_measure_trains_the_model_as_compiled_and_needs_no_clone(tmp_path):
    """measure_model ran categorical cross-entropy and SGD whatever the model was compiled
    with, and built its plain reference with keras.models.clone_model, which fails on a
    custom layer whose constructor takes arguments it does not serialize."""
    import importlib.util

    from tfremat.measure import measure_model

    source = tmp_path / "patches_layers.py"
    # A config that forgets the constructor's argument, as user layers often do.
    source.write_text(_PATCHES_MODULE.replace('{**super().get_config(), "patch_size": self.patch_size}',
                                              "super().get_config()"))
    spec = importlib.util.spec_from_file_location("patches_unserializable", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = _patches_model(module)
    with pytest.raises(TypeError):
        keras.models.clone_model(model)  # what measure_model used to do
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    before = [v.numpy() for v in model.variables]
    record = measure_model(model, "100%", batch_size=4, strategy="checkpoint_all", cost_model="flops", steps=1,
                           verbose=0)
    assert record["optimizer"] == "Adam" and record["loss"] == "mse" and record["gradients_match"], record
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))
    record = measure_model(model, "100%", batch_size=4, strategy="checkpoint_all", cost_model="flops", steps=1,
                           loss="categorical_crossentropy", optimizer="sgd", verbose=0)
    assert record["optimizer"] == "SGD" and record["loss"] == "categorical_crossentropy"
    with pytest.raises(TfrematError, match="no loss"):
        measure_model(_patches_model(module), "100%", batch_size=4, cost_model="flops", verbose=0)


def test_cli_loads_a_saved_model_with_custom_layers_through_custom_objects(tmp_path):
    """A saved Keras-examples model with a custom layer did not load on the command line."""
    import importlib.util

    source = tmp_path / "my_layers.py"
    source.write_text(_PATCHES_MODULE)
    spec = importlib.util.spec_from_file_location("my_layers", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = _patches_model(module)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    path = tmp_path / "vit_like.keras"
    model.save(path)
    args = ["plan", f"--model={path}", "--batch=2", "--budget=100%", "--strategy=checkpoint_all",
            "--cost_model=flops", "--json"]
    out = run_cli(*args, cwd=tmp_path / "..")
    assert out.returncode == 1 and "--custom_objects" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = run_cli(*args, f"--custom_objects={source}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_cli(*args, f"--custom_objects={tmp_path / 'missing.py'}", cwd=tmp_path)
    assert out.returncode == 1 and "missing.py" in out.stderr and "does not exist" in out.stderr, out.stderr


def _named_inputs_model():
    keras.utils.set_random_seed(0)
    zeta, alpha = keras.Input((16,), name="zeta"), keras.Input((4,), name="alpha")
    hidden = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(zeta), keras.layers.Dense(4)(alpha)])
    return keras.Model([zeta, alpha], [keras.layers.Dense(2, name="zout")(hidden), keras.layers.Dense(3, name="aout")(hidden)])


def _operations_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    summed = keras.layers.Dense(8, activation="relu")(inputs) + keras.layers.Dense(8)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(keras.ops.relu(summed) * 2.0))


def _shared_embedding_model():
    keras.utils.set_random_seed(0)
    first, second = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
    embed = keras.layers.Embedding(20, 8)
    flat = keras.layers.Concatenate()([keras.layers.Flatten()(embed(first)), keras.layers.Flatten()(embed(second))])
    return keras.Model([first, second], keras.layers.Dense(3, activation="softmax")(flat))


def _masked_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Embedding(20, 8, mask_zero=True)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _sgd_with(loss, **kwargs):
    return lambda: dict(optimizer=keras.optimizers.SGD(0.05), loss=loss, **kwargs)


def test_dict_inputs_and_labels_are_matched_by_name_and_per_output_losses_are_recorded():
    """A dict of inputs or labels whose names are not in sorted order once trained on
    swapped tensors (tf.nest.flatten sorts keys); the per-output losses Keras records
    (``zout_loss``) were missing from the history."""
    rng = np.random.default_rng(0)
    x = {"zeta": rng.random((16, 16)).astype("float32"), "alpha": 5 * rng.random((16, 4)).astype("float32")}
    y = {"zout": rng.random((16, 2)).astype("float32"), "aout": 100 + rng.random((16, 3)).astype("float32")}
    difference, expected, history = _fit_both(_named_inputs_model, _sgd_with({"zout": "mse", "aout": "mae"}), x, y)
    assert difference.equal, difference
    assert history == expected and "zout_loss" in history


@pytest.mark.parametrize("build, loss, integer_inputs", [
    (_operations_model, "categorical_crossentropy", False),
    (_shared_embedding_model, "categorical_crossentropy", True),
    (_masked_model, "mse", True),
], ids=["keras-operations", "shared-embedding", "masked-string-loss"])
def test_fit_trains_like_keras_on_operations_shared_embeddings_and_masks(build, loss, integer_inputs):
    """``x + y`` and ``keras.ops`` in a functional model crashed extraction; an Embedding
    called twice crashed on adding sparse gradients; a loss given by name ignored the
    Keras mask (Keras wraps names in a LossFunctionWrapper that applies it)."""
    rng = np.random.default_rng(0)
    model = build()
    if integer_inputs:
        x = [rng.integers(1, 20, (16, 6)).astype("int32") for _ in model.inputs]
        for part in x:
            part[:, 4:] = 0
    else:
        x = [rng.random((16, 16)).astype("float32")]
    x = x[0] if len(x) == 1 else x
    out_shape = tuple(model.outputs[0].shape[1:])
    y = (np.eye(3, dtype="float32")[rng.integers(0, 3, 16)] if loss != "mse"
         else rng.standard_normal((16, *out_shape)).astype("float32"))
    difference, expected, history = _fit_both(build, _sgd_with(loss), x, y)
    assert difference.equal, difference
    assert history == expected


def test_mixed_float16_applies_the_loss_scale_like_keras():
    """Under mixed_float16 Keras's LossScaleOptimizer divides the gradients by its loss
    scale; the step did not multiply the loss by it, so training barely moved."""
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax", dtype="float32")(hidden))

    rng = np.random.default_rng(0)
    x = rng.random((16, 16)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 16)]
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        difference, expected, history = _fit_both(build, _sgd_with("categorical_crossentropy"), x, y)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert difference.equal, difference
    assert history == expected


def _regularized_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(12, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05),
                                bias_regularizer="l1")(inputs)
    hidden = keras.layers.Dense(12, activation="relu", kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02))(hidden)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


@pytest.mark.parametrize("optimizer, strategy, policy", [
    ("sgd", "checkpoint_all", "float32"),
    ("adam", "chen_sqrtn", "float32"),
    ("adam", "chen_sqrtn", "mixed_float16"),
])
def test_weight_regularizers_train_like_keras(optimizer, strategy, policy):
    """Kernel and bias regularizers were refused; the step now adds their penalties to the
    loss and their gradients to the weight gradients as Keras's train_step does (under
    mixed_float16 through the loss scale), and trains to the same weights and losses as
    model.fit, also when layers are recomputed."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        plain, remat = _regularized_model(), _regularized_model()
        for model in (plain, remat):
            model.compile(keras.optimizers.get(optimizer), "categorical_crossentropy")
        difference, expected, history = _train_both(plain, remat, x, y, strategy=strategy)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert difference.equal, difference
    assert history == expected
    assert expected["loss"][0] > keras.losses.CategoricalCrossentropy()(y, plain(x)).numpy()  # penalties counted


def test_weight_regularizers_are_counted_and_the_step_stays_under_its_prediction():
    """A penalty's gradient adds weight-sized buffers beside its variable's gradient, which
    the backward node's workspace counts; and the penalty's value, not on the update's
    path, once ran after the update, whose write then copied every regularized variable
    (requested bytes 11.2 MiB against 9.2 predicted on this MLP; now 7.2)."""
    from tfremat.extract import extract
    from tfremat.plan.simulator import simulate
    from tfremat.static_graph import compile_step, measure_step_peak
    from tfremat.strategies import get_strategy

    def build(regularizer):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        hidden = inputs
        for _ in range(4):
            hidden = keras.layers.ReLU()(keras.layers.Dense(512, kernel_regularizer=regularizer)(hidden))
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))

    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((2, 64)).astype("float32"))
    y = tf.constant(np.eye(10, dtype="float32")[rng.integers(0, 10, 2)])
    peaks = {}
    for regularizer in (None, "l2"):
        model, optimizer = build(regularizer), keras.optimizers.SGD(0.01)
        extraction = extract(model, (x, y), optimizer=optimizer, cost_model="flops")
        schedule = get_strategy("checkpoint_all")(extraction.graph)
        step = compile_step(extraction, schedule, optimizer=optimizer)
        requested = measure_step_peak(step, x, y, resident=list(model.variables) + list(optimizer.variables),
                                      count="requested")
        peaks[regularizer] = (simulate(extraction.graph, schedule).peak_bytes, requested)
    kernel = 512 * 512 * 4
    (plain_predicted, plain_requested), (predicted, requested) = peaks[None], peaks["l2"]
    assert predicted >= plain_predicted + kernel
    assert requested <= predicted
    assert requested <= plain_requested + 1.5 * kernel


class _AddsLoss(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.mean(inputs))
        return inputs


def test_add_loss_is_refused_naming_the_layer_and_one_callback_is_accepted():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = _AddsLoss(name="adds_loss")(keras.layers.Dense(3, kernel_regularizer="l2")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")
    with pytest.raises(ExtractionError, match="adds_loss"):
        tfremat.fit(model, "100%", x, y, batch_size=4, strategy="checkpoint_all", cost_model="flops", verbose=0)
    plain = _operations_model()
    plain.compile(keras.optimizers.SGD(0.1), "categorical_crossentropy")
    seen = keras.callbacks.History()
    tfremat.fit(plain, "100%", np.zeros((8, 16), "float32"), np.eye(3, dtype="float32")[[0, 1] * 4], batch_size=4,
                strategy="checkpoint_all", cost_model="flops", verbose=0, callbacks=seen)
    assert len(seen.history["loss"]) == 1


class UnseededNoise(keras.layers.Layer):
    """Draws from Keras's global seed generator (no seed=)."""

    def call(self, inputs):
        return inputs + keras.random.normal(keras.ops.shape(inputs), stddev=0.5)


def _noisy_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,))
    hidden = UnseededNoise()(keras.layers.Dense(16, activation="relu")(inputs))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Dense(16, activation="relu")(hidden))
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(hidden))


def test_unseeded_keras_random_trains_like_keras_and_is_not_recomputed():
    """Profiling advanced Keras's global seed generator, so even a step that recomputes
    nothing drew other noise than model.fit; recomputing such a layer cannot replay it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 10)).astype("float32")
    y = np.eye(4, dtype="float32")[rng.integers(0, 4, 16)]
    plain, remat = _noisy_model(), _noisy_model()
    for model in (plain, remat):
        model.compile(keras.optimizers.SGD(0.1), "categorical_crossentropy")
    difference, expected, history = _train_both(plain, remat, x, y, "checkpoint_all", cost_model="profile")
    assert difference.equal, difference
    assert history == expected
    recomputing = _noisy_model()
    recomputing.compile(keras.optimizers.SGD(0.1), "categorical_crossentropy")
    with pytest.raises(CompileError, match="global seed generator"):
        tfremat.fit(recomputing, "100%", x, y, batch_size=8, strategy="chen_sqrtn", cost_model="flops", verbose=0)


def _sequence_classifier(kind):
    """A small model over (6, 4) sequences in which one tensor reaches a call twice."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    hidden = keras.layers.Dense(8)(inputs)
    if kind == "output_twice":
        output = keras.layers.Dense(3, activation="softmax")(keras.layers.Flatten()(hidden))
        return keras.Model(inputs, [output, output])
    if kind == "self_attention":
        mixed = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(hidden, hidden)
    else:
        mixed = keras.layers.Add()([hidden, hidden])
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(keras.layers.Flatten()(mixed)))


@pytest.mark.parametrize("kind", ["self_attention", "add_twice", "output_twice"])
def test_a_tensor_passed_twice_gets_its_gradient_once(kind):
    """``mha(h, h)``, ``Add()([h, h])`` and a model listing one output twice hand the tape
    one tensor in two places; its whole gradient came back at each place and was summed:
    every upstream weight's gradient was doubled (weights 0.03-0.09 away from Keras)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 6, 4)).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 16)]
    twice = kind == "output_twice"
    difference, expected, history = _fit_both(
        lambda: _sequence_classifier(kind),
        lambda: {"optimizer": keras.optimizers.SGD(0.1),
                 "loss": ["categorical_crossentropy"] * 2 if twice else "categorical_crossentropy"},
        x, [y, y] if twice else y,
    )
    assert difference.equal, difference
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)


class _BlockWithoutTrainingArgument(keras.layers.Layer):
    """A custom block whose ``call`` takes no ``training``: Keras hands the training flag
    to its BatchNormalization and Dropout through its call context."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16)
        self.norm = keras.layers.BatchNormalization()
        self.drop = keras.layers.Dropout(0.5, seed=3)

    def call(self, x):
        return self.drop(self.norm(self.dense(x)))


def test_sublayers_of_a_layer_without_training_argument_train():
    """The step called such a block without ``training=True``: its Dropout and
    BatchNormalization ran in inference mode (moving statistics never updated, weights
    0.9 away from Keras after two epochs)."""
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(_BlockWithoutTrainingArgument()(inputs)))

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((32, 8)) * 3 + 2).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    plain, remat = build(), build()
    for model in (plain, remat):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy")
    difference, _, _ = _train_both(plain, remat, x, y, strategy="checkpoint_all")
    assert difference.equal, difference
    moving_mean = remat.layers[1].norm.moving_mean.numpy()
    assert np.abs(moving_mean).max() > 0.01
    np.testing.assert_allclose(moving_mean, plain.layers[1].norm.moving_mean.numpy(), atol=1e-6)


def test_a_model_with_its_own_train_step_or_compute_loss_is_refused():
    """All three were silently ignored: the step runs the layer graph and the compiled
    loss alone. A loss with reduction=None (Keras differentiates the per-sample losses'
    sum; the step took their mean) is refused as well."""
    class PenalizedLoss(keras.Model):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs) + 0.1

    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    class OwnCall(keras.Model):
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) * 0.5

    x, y = data(16)
    for cls, method in ((PenalizedLoss, "compute_loss"), (OwnStep, "train_step"), (OwnCall, "call")):
        base = compiled_convnet()
        model = cls(base.inputs, base.outputs)
        model.compile(optimizer="sgd", loss="categorical_crossentropy")
        with pytest.raises(ExtractionError, match=f"overrides {method}"):
            tfremat.fit(model, "100%", x, y, batch_size=8, epochs=1, cost_model="flops", verbose=0)
    model = compiled_convnet()
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(reduction=None))
    with pytest.raises(ExtractionError, match="reduction=None"):
        tfremat.fit(model, "100%", x, y, batch_size=8, epochs=1, cost_model="flops", verbose=0)


def test_a_train_step_override_compiled_without_a_loss_is_told_the_way_in():
    """keras.io's VAE overrides train_step, compiles with an optimizer alone and trains on x:
    fit answered "pass y", then "compile the model first", never the refusal naming
    value_and_grad (the fifth user check, benchmarks/results/user_check_5.md)."""
    class OwnStep(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    x, _ = data(16)
    base = compiled_convnet()
    model = OwnStep(base.inputs, base.outputs)
    model.compile(optimizer="adam")
    with pytest.raises(ExtractionError, match="overrides train_step.*tfremat.value_and_grad"):
        tfremat.fit(model, "70%", x, batch_size=8, epochs=1, cost_model="flops", verbose=0)
    with pytest.raises(ExtractionError, match="overrides train_step.*tfremat.value_and_grad"):
        model.fit(x, x, batch_size=8, epochs=1, verbose=0, callbacks=[RematCallback("70%", cost_model="flops")])


def _dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu", name="first")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))


def test_a_reused_callback_plans_again_after_model_compile():
    """Its steps were kept while the model, optimizer and loss were the same objects, so
    after a recompile with a frozen layer or new loss weights it kept training the frozen
    layer and the old loss weights."""
    x, y = data(32)
    x = x.reshape(32, -1)[:, :8]
    results = []
    for callbacks in ([], [RematCallback("100%", strategy="checkpoint_all", cost_model="flops", verbose=0)]):
        model = _dense_model()
        optimizer = keras.optimizers.SGD(0.1)
        model.compile(optimizer=optimizer, loss="categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        model.get_layer("first").trainable = False
        model.compile(optimizer=optimizer, loss="categorical_crossentropy", loss_weights=0.1)
        frozen = model.get_layer("first").get_weights()
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        assert all(np.array_equal(a, b) for a, b in zip(frozen, model.get_layer("first").get_weights()))
        results.append((model, history.history["loss"]))
    (plain, plain_loss), (remat, remat_loss) = results
    assert weight_closeness(plain, remat).equal
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)


def test_a_callback_left_on_the_model_by_a_failed_fit_does_not_run_in_a_plain_fit(caplog):
    """When another callback raised between steps, on_train_end did not run and the model
    kept the callback's train function: a later plain model.fit trained through tfremat.
    run_eagerly=True, which the step cannot apply, is warned about."""
    class Failing(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("user callback failed")

    x, y = data(32)
    x = x.reshape(32, -1)[:, :8]
    model = _dense_model()
    model.compile(optimizer="sgd", loss="categorical_crossentropy", run_eagerly=True)
    callback = RematCallback("100%", strategy="checkpoint_all", cost_model="flops", verbose=0)
    with caplog.at_level("WARNING", logger="tfremat.keras"), pytest.raises(RuntimeError, match="user callback"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback, Failing()])
    assert "run_eagerly=True is not applied" in caplog.text
    assert list(callback.plans) == [((16, 8), (16, 10))]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert list(callback.plans) == [((16, 8), (16, 10))]  # no plan for the plain fit's batch of 8
    assert model.train_function is not callback._train_function


def test_measure_compares_sparse_gradients_and_refuses_models_without_a_layer_graph():
    """An Embedding's IndexedSlices gradient crashed measure_model (no .numpy()); a
    subclassed model reached ``model.inputs`` in measure_model and max_batch_size and
    failed there with an AttributeError."""
    from tfremat.measure import measure_model

    keras.utils.set_random_seed(0)
    ids = keras.Input((12,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    model = keras.Model(ids, keras.layers.Dense(4, activation="softmax")(pooled))
    record = measure_model(model, "100%", batch_size=8, strategy="checkpoint_all", cost_model="flops", steps=1,
                           loss="categorical_crossentropy", optimizer="sgd", verbose=0)
    assert record["gradients_match"], record

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4, activation="softmax")

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.zeros((2, 8), "float32"))
    subclassed.compile(optimizer="sgd", loss="categorical_crossentropy")
    for call in (lambda: measure_model(subclassed, "100%", batch_size=4, cost_model="flops", verbose=0),
                 lambda: tfremat.max_batch_size(subclassed, "1MiB", verbose=0)):
        with pytest.raises(ExtractionError, match="subclassed model without a functional graph"):
            call()
    with pytest.raises(ExtractionError, match="Sequential model .* is not built"):
        measure_model(keras.Sequential([keras.layers.Dense(4)]), "100%", batch_size=4, cost_model="flops",
                      loss="mse", optimizer="sgd", verbose=0)


class _TrainingOnlyScale(keras.layers.Layer):
    """A layer with a weight that only inference uses."""

    def build(self, shape):
        self.train_scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="train_scale")
        self.infer_scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="infer_scale")

    def call(self, x, training=None):
        return x * (self.train_scale if training else self.infer_scale)


def test_a_weight_the_training_forward_does_not_use_gets_no_gradient():
    """It crashed the extraction (a zero gradient for a Keras variable); a zero gradient
    would also let weight decay change it where model.fit leaves it alone."""
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = _TrainingOnlyScale()(keras.layers.Dense(8, activation="relu")(inputs))
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))

    x, y = data(16)
    x = x.reshape(16, -1)[:, :8]
    difference, _, _ = _fit_both(build, lambda: {"optimizer": keras.optimizers.AdamW(0.05, weight_decay=0.5),
                                                 "loss": "categorical_crossentropy"}, x, y)
    assert difference.equal, difference


def test_allocator_check_holds_every_budget_that_asks_for_recomputation():
    """By default amounts of memory and shares below the checkpoint-all peak are held for
    the allocator's peak; "min" and shares that recompute nothing are not."""
    def checks(budget, budget_bytes, **options):
        result = types.SimpleNamespace(budget_bytes=budget_bytes, checkpoint_all_peak_bytes=1000)
        return RematCallback(budget, verbose=0, **options)._checks_allocator(result)

    assert checks("4GiB", 4 * 2**30)  # an amount, even above the checkpoint-all peak
    assert checks(2**30, 2**30)
    assert checks("50%", 500)
    assert checks("70% of activations", 800)
    assert not checks("100%", 1000)
    assert not checks("min", 600)
    assert not checks("50%", 500, allocator_check=False)
    assert checks("100%", 1000, allocator_check=True)
    with pytest.raises(ArgumentError, match="allocator_check"):
        RematCallback("4GiB", allocator_check="yes")


def test_allocator_peak_puts_back_the_state_the_runs_change():
    import tfremat.keras as remat_keras

    x, y = data(8)
    model = compiled_convnet()
    callback = RematCallback("100%", strategy="checkpoint_all", cost_model="flops", verbose=0)
    callback.set_model(model)
    step = callback._step_for(tf.constant(x), tf.constant(y))
    model.optimizer.build(model.trainable_variables)
    before = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    peak = remat_keras.allocator_peak(step, model, tf.constant(x), tf.constant(y))
    assert peak > 0
    after = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_allocator_check_plans_again_under_the_excess(monkeypatch):
    """The allocator's chunks above the requested bytes are what runs out on a device: a
    step whose allocator peak exceeds the budget is planned again under the budget less
    the excess, and refused when nothing fits that."""
    import tfremat.keras as remat_keras

    x, y = tf.constant(data(8)[0]), tf.constant(data(8)[1])
    model = compiled_convnet()
    reference = tfremat.plan_model(model, None, x, y, batch_size=8, strategy="checkpoint_all", cost_model="flops", verbose=0)
    budget = reference.checkpoint_all_peak_bytes
    excess = (budget - reference.graph.fixed_bytes) // 5
    planned = []

    def chunky_peak(step, *_args, **_kwargs):
        planned.append(step.schedule)
        return simulate(step.graph, step.schedule).peak_bytes + excess

    monkeypatch.setattr(remat_keras, "allocator_peak", chunky_peak)
    callback = RematCallback(budget, strategy="chen_greedy", cost_model="flops", verbose=0)
    callback.set_model(model)
    callback._step_for(x, y)
    (result,) = callback.plans.values()
    assert len(planned) >= 2 and planned[0].recompute_count < planned[-1].recompute_count
    assert result.budget_bytes == budget and result.predicted_peak_bytes + excess <= budget

    monkeypatch.setattr(remat_keras, "allocator_peak", lambda step, *_a, **_k: budget + budget)
    refusing = RematCallback(budget, strategy="chen_greedy", cost_model="flops", verbose=0)
    refusing.set_model(model)
    with pytest.raises(InfeasibleBudgetError, match="allocator's peak"):
        refusing._step_for(x, y)


class _TwoDenseBlock(keras.layers.Layer):
    """A custom block holding two Dense sublayers: one node at granularity "layer", opened
    into its sublayer calls at the default "sublayer"."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, activation="relu")
        self.second = keras.layers.Dense(8)

    def call(self, x):
        return self.second(self.first(x))


def _block_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(_TwoDenseBlock()(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    return model


def _block_data(count=8):
    rng = np.random.default_rng(0)
    return rng.standard_normal((count, 8)).astype("float32"), np.eye(3, dtype="float32")[rng.integers(0, 3, count)]


def test_granularity_reaches_the_extraction_from_plan_compare_and_the_callback():
    model, (x, y) = _block_model(), _block_data()
    sizes = {
        granularity: tfremat.plan_model(model, "100%", x, y, batch_size=8, strategy="checkpoint_all",
                                        cost_model="flops", verbose=0, **kwargs).extraction.graph.size
        for granularity, kwargs in (("layer", {"granularity": "layer"}), ("sublayer", {}))
    }
    assert sizes["layer"] < sizes["sublayer"], sizes
    with pytest.raises(ExtractionError, match="granularity must be one of"):
        tfremat.compare(model, "100%", x, y, strategies=["checkpoint_all"], batch_size=8, cost_model="flops",
                        granularity="bogus", verbose=0)
    callback = RematCallback("100%", strategy="checkpoint_all", cost_model="flops", granularity="layer", verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert [plan.extraction.graph.size for plan in callback.plans.values()] == [sizes["layer"]]


def test_the_callback_refuses_an_unknown_granularity_and_fixes_it():
    with pytest.raises(ArgumentError, match="granularity must be one of layer, sublayer, op, got 'bogus'"):
        RematCallback("50%", granularity="bogus")
    assert RematCallback("50%", verbose=0).granularity == "sublayer"
    with pytest.raises(AttributeError, match="granularity is fixed"):
        RematCallback("50%", granularity="op", verbose=0).granularity = "layer"
