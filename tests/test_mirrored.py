"""tfremat.fit and RematCallback under tf.distribute (issue 35 items 1, 4 and 5).

MirroredStrategy needs several devices, made here as two logical CPU devices
(``tf.config.set_logical_device_configuration``), which must happen before TensorFlow
initializes its devices: those checks run in one subprocess (:data:`_SCRIPT`, run once by
the module fixture) that prints its findings as JSON. OneDeviceStrategy and the refused
strategies need no extra device and run in the test process.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import small_convnet
import tfremat
from tfremat.errors import TfrematError
from tfremat.keras import RematCallback, check_distribute_strategy, is_distributed, replica_allocators
from tfremat.numerics import closeness

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.path[:0] = [{tests!r}, {root!r}]
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from models import small_convnet
    import tfremat
    from tfremat.keras import replica_allocators
    from tfremat.numerics import closeness

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("tfremat").addHandler(handler)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    # 20 samples in batches of 8: the last global batch (4) is 2 per replica.
    x = rng.standard_normal((20, 16, 16, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, 20)]
    w = rng.uniform(0.5, 1.5, 20).astype("float32")  # sample weights, split over the replicas too

    def build():
        with strategy.scope():
            model = small_convnet(input_shape=(16, 16, 3), channels=8)
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="categorical_crossentropy",
                          metrics=["accuracy"])
        return model

    plain = build()
    expected = plain.fit(x, y, sample_weight=w, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    callbacks = []

    class FindRemat(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            callbacks.append(self.model.train_function.__self__)  # RematCallback._train_function

    # Called inside the scope, where Keras's own fit trains too (the extraction once failed
    # there: a mirrored variable's gradient needs a replica context).
    model = build()
    with strategy.scope():
        history = tfremat.fit(model, "80% of activations", x, y, sample_weight=w, batch_size=8, epochs=2,
                              shuffle=False, verbose=0, strategy="optimal", time_limit=20, cost_model="flops",
                              cache=False, allocator_check=True, callbacks=[FindRemat()])
    close = closeness([v.numpy() for v in model.variables], [v.numpy() for v in plain.variables])

    # A custom loop over the same global batches with compile_step(strategy=...), extracted
    # outside the scope with transient weight gradients (a warning says the all-reduce
    # keeps them together). Keras losses divide by the replicas in a replica context; the
    # step once divided again (half the gradients and the loss).
    from tfremat.extract import extract
    from tfremat.static_graph import compile_step
    from tfremat.strategies import get_strategy
    loop = build()
    with strategy.scope():
        loop.optimizer.build(loop.trainable_variables)  # its slots mirrored, as model.fit builds them
    ex = extract(loop, (x[:4], y[:4]), optimizer=loop.optimizer, cost_model="flops", use_cache=False,
                 weight_grads="transient")
    step = compile_step(ex, get_strategy("chen_sqrtn")(ex.graph), strategy=strategy)
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8).repeat(2)
    loop_losses = [float(step(a, b, c)) for a, b, c in strategy.experimental_distribute_dataset(data)]
    loop_close = closeness([v.numpy() for v in loop.variables], [v.numpy() for v in plain.variables])

    # Every replica's traced step recomputes what its plan says: replica 1's operations are
    # traced under the name scope replica_1/ (statements under step/).
    recomputed = {{}}
    for key, train in callbacks[0]._steps.items():
        batch = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(2 * key[0][0]).take(1)
        traced = train.function.get_concrete_function(*next(iter(strategy.experimental_distribute_dataset(batch))))
        names = [op.name for op in traced.graph.get_operations()]
        counts = [len({{n.split("/")[2] for n in names if n.startswith("replica_1/step/reforward_")}}),
                  len({{n.split("/")[1] for n in names if n.startswith("step/reforward_")}})]
        recomputed[str(key[0][0])] = counts
    plans = {{str(key[0][0]): dict(weight_grads=plan.extraction.side_table.weight_grads, budget=plan.budget_bytes,
                                  predicted=plan.predicted_peak_bytes, recomputations=plan.schedule.recompute_count,
                                  fixed=plan.graph.fixed_bytes,
                                  parts=dict(plan.extraction.side_table.fixed_bytes_breakdown))
             for key, plan in history.plans.items()}}

    # Planned inside the scope (a cross-replica context, where the extraction once failed:
    # DistributedVariable.handle), then each replica's requested bytes against the plan. A
    # plain SGD on a weight-heavy MLP: the gradients and the all-reduce's buffers outweigh
    # the activations, and the update needs no buffer of its own.
    from tfremat.runtime.memory import requested_peak

    def mlp():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((128,))
        hidden = inputs
        for _ in range(3):
            hidden = keras.layers.Dense(128, activation="relu")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
        return model

    xm = rng.standard_normal((8, 128)).astype("float32")
    ym = np.eye(10, dtype="float32")[rng.integers(0, 10, 8)]

    def requested(step, batch):
        run = lambda: tf.nest.flatten(step(*batch))[0].numpy()
        run()
        run()
        return max(requested_peak(run, "CPU:0") for _ in range(3))

    with strategy.scope():
        dense = mlp()
        scoped = tfremat.plan_model(dense, None, xm, ym, batch_size=4, strategy="checkpoint_all", cost_model="flops",
                                    cache=False, verbose=0)
    mirrored_step = compile_step(scoped.extraction, scoped.schedule, strategy=strategy)
    both = requested(mirrored_step, next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((xm, ym))))))
    alone = mlp()
    single = extract(alone, (xm[:4], ym[:4]), optimizer=alone.optimizer, cost_model="flops", use_cache=False,
                     weight_grads="fixed")
    single_step = compile_step(single, get_strategy("checkpoint_all")(single.graph))
    parts = dict(scoped.extraction.side_table.fixed_bytes_breakdown)
    resident = sum(parts[name] for name in ("params", "optimizer_slots", "non_trainable", "inputs", "labels"))
    scoped_plan = dict(weight_grads=scoped.extraction.side_table.weight_grads, parts=parts,
                       fixed=scoped.graph.fixed_bytes, moving=scoped.predicted_peak_bytes - resident,
                       per_replica=both / 2, single=requested(single_step, (tf.constant(xm[:4]), tf.constant(ym[:4]))),
                       single_parts=dict(single.side_table.fixed_bytes_breakdown))
    print("RESULT", json.dumps(dict(
        expected=expected, history=history.history, close=[close.max_tensor_error, close.global_error, close.equal],
        loop_close=[loop_close.max_tensor_error, loop_close.global_error, loop_close.equal], loop_losses=loop_losses,
        plans=plans, scoped=scoped_plan, recomputed=recomputed, warnings=warnings,
        allocators=replica_allocators(strategy),
        replicas=strategy.num_replicas_in_sync)))
    """
)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    """What :data:`_SCRIPT` found, run once on two logical CPU devices."""
    folder = tmp_path_factory.mktemp("mirrored")
    script = folder / "mirrored.py"
    script.write_text(_SCRIPT.format(tests=HERE, root=ROOT))
    env = dict(os.environ, TFREMAT_CACHE_DIR=str(folder / "cache"))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_fit_under_mirrored_strategy_trains_as_model_fit(mirrored):
    assert mirrored["replicas"] == 2
    # The closeness rule for the weights; losses and metrics as floats the kernels may
    # reorder (oneDNN on or off).
    max_tensor_error, global_error, equal = mirrored["close"]
    assert equal, (max_tensor_error, global_error)
    assert mirrored["history"].keys() == mirrored["expected"].keys()
    for name, values in mirrored["expected"].items():
        np.testing.assert_allclose(mirrored["history"][name], values, rtol=1e-4, err_msg=name)


def test_compile_step_with_strategy_in_a_custom_loop_trains_as_model_fit(mirrored):
    max_tensor_error, global_error, equal = mirrored["loop_close"]
    assert equal, (max_tensor_error, global_error)
    # Keras's epoch loss is the mean over the epoch's batches (8, 8 and 4 samples) weighted by size.
    losses = np.reshape(mirrored["loop_losses"], (2, 3))
    np.testing.assert_allclose(losses @ [8, 8, 4] / 20, mirrored["expected"]["loss"], rtol=1e-4)
    assert any("all-reduce every gradient" in w for w in mirrored["warnings"]), mirrored["warnings"]


def test_the_plan_is_per_replica_batch_with_resident_gradients(mirrored):
    # Global batches of 8 and 4 (the last) on two replicas: planned for 4 and 2 samples.
    plans = mirrored["plans"]
    assert sorted(plans) == ["2", "4"]
    for batch, plan in plans.items():
        assert plan["weight_grads"] == "fixed", batch  # the all-reduce holds every gradient
        assert plan["predicted"] <= plan["budget"], (batch, plan)
        # Both replicas' traced steps recompute forward nodes, the same number.
        replica_1, replica_0 = mirrored["recomputed"][batch]
        assert replica_0 == replica_1, (batch, mirrored["recomputed"])
    assert plans["4"]["recomputations"] > 0 and mirrored["recomputed"]["4"][0] > 0, plans["4"]
    # The last batch keeps at least the bytes the share gave the full one (budget.share_floor),
    # so it may recompute nothing (with oneDNN off its checkpoint-all peak fits them).
    assert plans["2"]["budget"] >= plans["4"]["budget"], plans


def test_the_replica_plan_counts_the_all_reduce_buffers(mirrored):
    """Each replica receives the reduced gradients in new buffers while its own are still
    resident: one gradient copy per replica in the fixed bytes (tfremat.extract.assembly)."""
    for batch, plan in mirrored["plans"].items():
        parts = plan["parts"]
        # The replica's own gradients are held from their backward nodes (DFGraph.weight_grads_to_end).
        assert parts["all_reduce"] == parts["params"] > 0 and parts["param_grads"] == 0, (batch, parts)
        assert plan["fixed"] == sum(parts.values()) <= plan["predicted"], (batch, plan)


def test_planning_inside_the_scope_counts_what_each_replica_requests(mirrored):
    """plan_model in a MirroredStrategy scope (a cross-replica context) extracts as replica
    0 with resident gradients and the all-reduce term. The two logical CPU devices share one
    allocator, so the requested bytes of both replicas' step are measured and halved: within
    the prediction, and beyond what it would be without the all-reduce term; one replica's
    step alone (extracted without a strategy: no term) requests less."""
    scoped = mirrored["scoped"]
    parts = scoped["parts"]
    assert scoped["weight_grads"] == "fixed"
    assert parts["all_reduce"] == parts["params"] > 0 and scoped["fixed"] == sum(parts.values())
    assert scoped["single_parts"]["all_reduce"] == 0
    assert scoped["moving"] - parts["all_reduce"] < scoped["per_replica"] <= scoped["moving"], scoped
    assert scoped["single"] < scoped["per_replica"], scoped


def test_allocator_check_on_logical_cpus_says_it_holds_requested_bytes(mirrored):
    assert mirrored["allocators"] is None  # one allocator for both logical CPU devices
    skipped = [w for w in mirrored["warnings"] if w.startswith("allocator_check skipped")]
    assert skipped and "share one allocator" in skipped[0] and "requested bytes" in skipped[0], mirrored["warnings"]


def _data(n=12):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 16, 16, 3)).astype("float32")
    return x, np.eye(10, dtype="float32")[rng.integers(0, 10, n)]


def _compiled(strategy):
    with strategy.scope():
        model = small_convnet(input_shape=(16, 16, 3), channels=8)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def test_one_device_strategy_trains_as_model_fit():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert is_distributed(strategy) and replica_allocators(strategy) == ["CPU:0"]
    assert not is_distributed(tf.distribute.get_strategy())
    x, y = _data()
    plain = _compiled(strategy)
    expected = plain.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    model = _compiled(strategy)
    history = tfremat.fit(model, "90%", x, y, batch_size=6, epochs=2, shuffle=False, verbose=0, strategy="chen_greedy",
                          cost_model="flops", cache=False, allocator_check=False)
    (plan,) = history.plans.values()
    assert plan.extraction.side_table.weight_grads == "fixed" and plan.schedule.recompute_count > 0
    close = closeness([v.numpy() for v in model.variables], [v.numpy() for v in plain.variables])
    assert close.equal, close
    for name, values in expected.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-4, err_msg=name)


def test_allocator_check_runs_on_a_cpu_replica_only_when_asked():
    """As the README says: a strategy's CPU replica shares its allocator with the input
    pipeline's prefetched batches. MirroredStrategy on one CPU was held by default and
    re-planned from +11.4% to +35.1% for steps that used 17.5 of 29.2 MiB (user_check_5)."""
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    result = types.SimpleNamespace(budget_bytes=100, checkpoint_all_peak_bytes=200)
    assert not RematCallback("70%")._checks_allocator(result, strategy)
    assert RematCallback("70%", allocator_check=True)._checks_allocator(result, strategy)
    assert RematCallback("70%")._checks_allocator(result)  # one device: held by default


def test_central_storage_strategy_is_refused_before_any_work(caplog):
    model = _compiled(tf.distribute.experimental.CentralStorageStrategy())
    callback = RematCallback("90%", strategy="chen_greedy", cost_model="flops", cache=False, verbose=0)
    x, y = _data(4)
    with caplog.at_level(logging.INFO, logger="tfremat"), pytest.raises(TfrematError) as raised:
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
    message = str(raised.value)
    assert "\n" not in message and "CentralStorageStrategy" in message and "MirroredStrategy" in message
    assert callback.plans == {} and not caplog.records  # nothing extracted or planned


@pytest.mark.parametrize("name", ["TPUStrategy", "TPUStrategyV2", "ParameterServerStrategyV2"])
def test_strategies_that_cannot_be_built_here_are_refused_by_class_name(name):
    strategy = type(name, (), {})()
    with pytest.raises(TfrematError, match=f"under {name}: .*MirroredStrategy"):
        check_distribute_strategy(strategy)
    check_distribute_strategy(tf.distribute.OneDeviceStrategy("/cpu:0"))  # accepted


def test_allocator_peak_of_a_replica_puts_back_the_state():
    """allocator_check under a strategy runs the step on every replica with one replica's
    batch and reads each replica device's allocator (here the one CPU device)."""
    from tfremat.extract import extract
    from tfremat.keras import allocator_peak
    from tfremat.static_graph import compile_step
    from tfremat.strategies import get_strategy

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    model = _compiled(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    x, y = (tf.constant(a) for a in _data(4))
    extraction = extract(model, (x, y), optimizer=model.optimizer, cost_model="flops", use_cache=False,
                         weight_grads="fixed")
    step = compile_step(extraction, get_strategy("chen_sqrtn")(extraction.graph), strategy=strategy,
                        return_outputs=True)
    before = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    (device,) = replica_allocators(strategy)
    assert allocator_peak(step, model, x, y, device=device) > extraction.graph.fixed_bytes
    after = [v.numpy() for v in list(model.variables) + list(model.optimizer.variables)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def _dense_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(keras.layers.Dense(32)(inputs)))


def test_replicas_put_the_all_reduce_buffers_in_the_fixed_bytes():
    from tfremat.extract import extract

    model = _dense_model()
    batch = (np.zeros((8, 16), "float32"), np.eye(4, dtype="float32")[np.zeros(8, int)])
    gradients = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    alone = extract(model, batch, cost_model="flops", use_cache=False)  # the default strategy: one replica
    two = extract(model, batch, cost_model="flops", use_cache=False, replicas=2)
    assert alone.side_table.weight_grads == "transient" and alone.side_table.fixed_bytes_breakdown["all_reduce"] == 0
    # "auto" gradients are resident: the all-reduce waits for all of them.
    assert two.side_table.weight_grads == "fixed"
    parts = two.side_table.fixed_bytes_breakdown
    assert parts["all_reduce"] == two.graph.weight_grads_to_end_bytes == gradients and parts["param_grads"] == 0
    assert two.graph.fixed_bytes == alone.graph.fixed_bytes + gradients
    for bad in (0, True, 1.5):
        with pytest.raises(TfrematError, match=r"^replicas must be a positive int .*got"):
            extract(model, batch, cost_model="flops", use_cache=False, replicas=bad)


def test_plan_model_inside_a_one_device_strategy_scope():
    """Inside a strategy's scope the extraction runs as replica 0; one replica all-reduces nothing."""
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    model = _compiled(strategy)
    x, y = _data(4)
    with strategy.scope():
        result = tfremat.plan_model(model, None, x, y, batch_size=4, strategy="checkpoint_all", cost_model="flops",
                                    cache=False, verbose=0)
        assert tf.distribute.in_cross_replica_context()  # the replica context was left
    parts = result.extraction.side_table.fixed_bytes_breakdown
    assert parts["all_reduce"] == 0 and parts["params"] > 0 and model.optimizer.built
