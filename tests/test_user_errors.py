"""Models and data that crashed with a raw Python error get one line naming the cause and
the fix (issue 34, item 3), and the cases ``model.fit`` handles are handled the same way."""

import json
import re

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402
from cli_output import one_error_line  # noqa: E402

import tfremat  # noqa: E402
from tfremat.errors import ArgumentError, ExtractionError  # noqa: E402
from tfremat.measure import measure_model  # noqa: E402
from tfremat.model_planning import synthetic_batch  # noqa: E402
from tfremat.numerics import closeness  # noqa: E402

QUICK = {"cost_model": "flops", "cache": False, "verbose": 0}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _arrays(count=16, features=5, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((count, features)).astype("float32"),
            rng.standard_normal((count, outputs)).astype("float32"))


def _dense_model():
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _token_model(length=None):
    """A keras-hub task model's shape: token ids whose sequence axis is ``length`` (None as built)."""
    ids = keras.Input((length,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(ids))
    model = keras.Model(ids, keras.layers.Dense(3, activation="softmax")(pooled))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_an_unknown_sequence_axis_is_named_where_a_batch_is_made_up():
    """measure_model and max_batch_size failed in synthetic_batch with "unsupported operand
    type(s) for *: 'int' and 'NoneType'" (numpy's "'<' not supported" for zeros)."""
    model = _token_model()
    for call in (lambda: synthetic_batch(model, 4, seed=0), lambda: synthetic_batch(model, 4),
                 lambda: measure_model(model, "100%", batch_size=4, strategy="checkpoint_all", **QUICK),
                 lambda: tfremat.max_batch_size(model, "1MiB", strategies=["checkpoint_all"], max_batch=8, **QUICK)):
        with pytest.raises(ArgumentError, match=r"model input 0 .* axis 1 is unknown \(None\)") as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and "keras.Input(shape=(128,)" in message and "plan_model(model, budget, x, y)" in message
    # Both fixes the message names work: a wrapper with a fixed length, and planning on data.
    inputs = keras.Input(shape=(128,), dtype="int32")
    x, _ = synthetic_batch(keras.Model(inputs, model(inputs)), 4)
    assert x.shape == (4, 128)
    ids, labels = np.ones((8, 12), "int32"), np.zeros((8,), "int32")
    result = tfremat.plan_model(model, "100%", ids, labels, batch_size=4, strategy="checkpoint_all", **QUICK)
    assert [tuple(spec.shape) for spec in result.extraction.side_table.input_specs] == [(4, 12)]


class SubNet(keras.Model):
    """Layers in __init__, logic in call: no layer graph until it is called."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1))
        self.out = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(2))

    def call(self, x):
        return self.out(keras.ops.tanh(self.hidden(x)))


class BranchingNet(SubNet):
    """A call with Python control flow on a tensor's value, which no symbolic call can run."""

    def call(self, x):
        if keras.ops.mean(x) > 0:
            return self.out(self.hidden(x))
        return self.out(self.hidden(-x))


def test_a_subclassed_model_is_planned_on_its_batch_and_trains_as_model_fit_does():
    """plan_model, compare and fit refused a subclassed model and told the user to wrap it;
    they wrap it from the batch now, with its layer calls as nodes, and fit trains it as
    model.fit does. Made-up batches (measure_model) have no shapes to wrap it with: one line
    that says to plan on data."""
    x, y = _arrays()
    model = SubNet()
    model.compile(optimizer="sgd", loss="mse")
    result = tfremat.plan_model(model, "100%", x, y, batch_size=8, strategy="checkpoint_all", **QUICK)
    forward = [name for name in result.extraction.graph.names if not name.endswith("_backward")]
    # keras.ops.tanh's node takes the name Keras gave its operation, numbered past the tanh
    # operations made earlier in the process ("tanh", "tanh_4").
    assert len(forward) == 4 and re.fullmatch(f"{model.name}/tanh(_[0-9]+)?", forward[1]), forward
    assert [forward[0], forward[2], forward[3]] == [f"{model.name}/{model.hidden.name}",
                                                    f"{model.name}/{model.out.name}", "loss"], forward
    assert [tuple(spec.shape) for spec in result.extraction.side_table.input_specs] == [(8, 5)]
    assert tfremat.compare(model, "100%", x, y, batch_size=8, strategies=["checkpoint_all"], **QUICK)
    with pytest.raises(ExtractionError, match="subclassed model without a functional graph") as caught:
        measure_model(model, "100%", batch_size=8, **QUICK)
    assert "\n" not in str(caught.value) and "tfremat.plan_model(model, budget, x, y)" in str(caught.value)

    trained = []
    for use_tfremat in (False, True):
        subnet = SubNet()
        subnet.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        if use_tfremat:
            tfremat.fit(subnet, "100%", x, y, batch_size=8, shuffle=False, strategy="checkpoint_all",
                        allocator_check=False, **QUICK)
        else:
            subnet.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        trained.append(subnet.get_weights())
    assert closeness(trained[1], trained[0]).equal


def test_a_subclassed_call_that_cannot_run_symbolically_is_refused_naming_its_line():
    """Python control flow on a tensor's value: one line naming the cause and the line of
    the model's call, pointing to tfremat.value_and_grad; the model is left as it was."""
    x, y = _arrays()
    model = BranchingNet()
    model.compile(optimizer="sgd", loss="mse")
    model(x[:2])
    before = model.get_weights()
    for call in (lambda: tfremat.plan_model(model, "100%", x, y, batch_size=8, **QUICK),
                 lambda: tfremat.fit(model, "100%", x, y, batch_size=8, **QUICK)):
        with pytest.raises(ExtractionError, match="call cannot run on symbolic inputs") as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and "tfremat.value_and_grad" in message, message
        assert "OperatorNotAllowedInGraphError" in message and "if keras.ops.mean(x) > 0:" in message, message
    assert closeness(model.get_weights(), before).equal and model.built


def _unbuilt_sequential():
    return keras.Sequential([
        keras.layers.Dense(8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1)),
        keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(2)),
    ])


def test_a_sequential_model_without_input_is_built_from_the_batch_as_model_fit_does():
    """plan_model and fit failed with "Sequential model ... has no defined inputs yet",
    although model.fit trains such a model (it builds it on the first batch)."""
    x, y = _arrays()
    plain, remat = _unbuilt_sequential(), _unbuilt_sequential()
    for model in (plain, remat):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    tfremat.fit(remat, "100%", x, y, batch_size=8, shuffle=False, strategy="checkpoint_all", allocator_check=False,
                **QUICK)
    assert closeness(remat.get_weights(), plain.get_weights()).equal
    fresh = _unbuilt_sequential()
    fresh.compile(optimizer="sgd", loss="mse")
    result = tfremat.plan_model(fresh, "100%", x, y, batch_size=4, strategy="checkpoint_all", **QUICK)
    assert [tuple(spec.shape) for spec in result.extraction.side_table.input_specs] == [(4, 5)]
    # Without a batch to build from (measure makes its batch up from the inputs), one line.
    with pytest.raises(ExtractionError, match="is not built; start it with a keras.Input"):
        measure_model(_unbuilt_sequential(), "100%", batch_size=4, loss="mse", optimizer="sgd", **QUICK)


def test_empty_data_is_named():
    """An empty dataset was a bare StopIteration."""
    x, y = _arrays()
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0)
    for call in (lambda: tfremat.plan_model(_dense_model(), "100%", empty, **QUICK),
                 lambda: tfremat.compare(_dense_model(), "100%", empty, strategies=["checkpoint_all"], **QUICK)):
        with pytest.raises(ArgumentError, match="the tf.data.Dataset yields no batch"):
            call()
    with pytest.raises(ArgumentError, match=r"x is empty \(an array of shape \(0, 5\)\)"):
        tfremat.plan_model(_dense_model(), "100%", x[:0], y[:0], batch_size=4, **QUICK)


def test_an_unbatched_dataset_is_told_to_be_batched_in_fit_and_plan():
    """In tfremat.fit the rank check came after the sample counts: a rank-1 sample of 5
    features was taken for a batch of 5, and the error blamed y's 3 "samples"."""
    x, y = _arrays()
    single_samples = tf.data.Dataset.from_tensor_slices((x, y))
    for call in (lambda: tfremat.fit(_dense_model(), "100%", single_samples, **QUICK),
                 lambda: tfremat.plan_model(_dense_model(), "100%", single_samples, **QUICK)):
        with pytest.raises(ArgumentError, match=r"single samples of shape \(5,\) .* batch the dataset"):
            call()


def test_the_command_line_names_an_unknown_axis_of_a_saved_model(tmp_path, monkeypatch, capsys):
    """The command line makes its batch up too: one line, as JSON under --json (run in this
    process; the subprocess runs of the other command-line tests show the exit path)."""
    from tfremat import cli

    path = tmp_path / "tokens.keras"
    _token_model().save(path)
    monkeypatch.setattr(cli, "_catch_sigint", lambda: None)  # leaves pytest's Ctrl-C handler alone
    argv = cli._parse(["tfremat", "plan", f"--model={path}", "--batch=2", "--budget=100%", "--strategy=checkpoint_all",
                       "--cost_model=flops", "--nocache", "--json"])
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
    finally:
        cli.FLAGS.unparse_flags()
    out = capsys.readouterr()
    assert exited.value.code == 1 and one_error_line(out.err), out.err
    assert "axis 1 is unknown" in json.loads(out.out)["error"]
