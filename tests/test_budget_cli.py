"""Budget parsing and the planning commands of the tfremat command line."""

import json
import subprocess
import sys

import numpy as np
import pytest
from cli_output import one_error_line
from graph_factories import random_training_graph

from tfremat.budget import parse_budget
from tfremat.errors import BudgetFormatError


@pytest.mark.parametrize("text, expected", [
    (1000, 1000), ("1000", 1000), ("3.5GiB", int(3.5 * 2**30)), ("800MB", 800 * 10**6),
    ("2 KiB", 2048), ("50%", 500), (0.25, 250), ("1e3", 1000), (2000.0, 2000), (np.float32(0.5), 500),
    (np.int64(700), 700),
])
def test_budget_forms(text, expected):
    assert parse_budget(text, reference_bytes=1000) == expected


@pytest.mark.parametrize("bad", ["", "lots", "12 parsecs", "-5GB", "0", 0, -1, True, None, [1], "50%%", float("nan"),
                                 "1e400", "12.5"])
def test_bad_budgets_name_the_accepted_forms(bad):
    with pytest.raises(BudgetFormatError, match="budget="):
        parse_budget(bad, reference_bytes=1000)


def test_a_unitless_fraction_string_points_to_the_share_forms():
    with pytest.raises(BudgetFormatError, match="write '50%'"):
        parse_budget("0.5", reference_bytes=1000)


def test_decimal_budgets_are_read_exactly():
    """int() of float products lost a byte: "57%" of 100 was 56 (also 29% and 58%), and
    "2.01MB" was 2009999 (20 of "0.01MB".."9.99MB" were a byte short)."""
    for hundredths in range(1, 1000):
        assert parse_budget(f"{hundredths // 100}.{hundredths % 100:02d}MB") == hundredths * 10**4
    for reference in (100, 1000, 12_345, 2**33 + 7):
        for percent in range(1, 101):
            assert parse_budget(f"{percent}%", reference) == percent * reference // 100
    assert parse_budget("33.3%", 1000) == 333 and parse_budget("0.5KiB") == 512 and parse_budget("1.5e3B") == 1500
    assert parse_budget("1%", 199) == 1 and parse_budget("2.0001KB") == 2000  # floored: never above what was written


def test_float_shares_do_not_lose_a_byte_to_binary_rounding():
    """0.57 * 100 is 56.99999999999999 in floats: a product within a float's rounding of
    an integer is that integer; one further from it is floored."""
    for reference in (100, 1000, 12_345, 2**33 + 7):
        for percent in range(1, 101):
            assert parse_budget(percent / 100, reference) == percent * reference // 100
    assert parse_budget(1 / 3, 300) == 100 and parse_budget(0.1234, 1000) == 123 and parse_budget(0.999, 10) == 9
    with pytest.raises(BudgetFormatError, match="less than one byte of the reference peak"):
        parse_budget(1e-12, 1000)


def test_relative_budget_needs_reference():
    with pytest.raises(BudgetFormatError, match="relative"):
        parse_budget("50%")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tfremat.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_strategies_lists_names():
    out = run_cli("strategies", "--json")
    assert out.returncode == 0, out.stderr
    assert {"checkpoint_all", "chen_sqrtn", "griewank_logn_ap", "hong", "pofo", "autocapper"} <= set(json.loads(out.stdout))


def test_cli_solve_json_and_schedule_out(tmp_path):
    graph_path = tmp_path / "g.json"
    random_training_graph(2, 8).to_json(graph_path)
    schedule_path = tmp_path / "s.json"
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=chen_greedy", "--budget=90%", "--json",
                  f"--schedule_out={schedule_path}")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    for key in ("strategy", "status", "budget_bytes", "peak_bytes", "cost", "cost_ratio", "cost_lower_bound", "gap",
                "seconds"):
        assert key in record
    assert "lower_bound" not in record and record["cost_lower_bound"] is None  # a heuristic proves no bound
    assert record["peak_bytes"] <= record["budget_bytes"]
    assert record["cost_ratio"] >= 1.0
    schedule = json.loads(schedule_path.read_text())
    assert schedule["order"] == list(range(17)) and schedule["graph_fingerprint"]


def test_cli_order_flag_picks_a_moccasin_graphs_execution_order(tmp_path):
    document = {
        "directed": True, "multigraph": False, "graph": {"name": "tiny", "order": [5, 7, 6]},
        "nodes": [{"name": v, "duration": 1, "out_cost": 10, "param_cost": 0} for v in (5, 7, 6)],
        "links": [{"0": 5, "1": 6}, {"0": 5, "1": 7}],
    }
    graph_path = tmp_path / "g.json"
    graph_path.write_text(json.dumps(document))
    orders = {}
    for order in ("file", "topological"):
        schedule_path = tmp_path / f"{order}.json"
        out = run_cli("solve", f"--graph={graph_path}", "--strategy=checkpoint_all", f"--order={order}",
                      f"--schedule_out={schedule_path}", "--json")
        assert out.returncode == 0, out.stderr
        orders[order] = json.loads(schedule_path.read_text())["order"]
    assert orders == {"file": [5, 7, 6], "topological": [5, 6, 7]}
    document["graph"]["order"] = [6, 5, 7]
    graph_path.write_text(json.dumps(document))
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=checkpoint_all")
    assert out.returncode == 1
    assert "graph.order" in out.stderr and "--order=topological" in out.stderr


def test_cli_infeasible_budget_reports_smallest_peak(tmp_path):
    graph_path = tmp_path / "g.json"
    random_training_graph(2, 8).to_json(graph_path)
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=chen_sqrtn", "--budget=10", "--json")
    assert out.returncode == 1
    record = json.loads(out.stdout)
    assert record["status"] == "infeasible" and record["min_feasible_bytes"] > 10


def test_cli_solve_names_its_bounds_by_what_they_bound(tmp_path):
    """"lower_bound" held a cost bound on success and a byte count on an infeasible budget."""
    graph = random_training_graph(2, 8)
    graph_path = tmp_path / "g.json"
    graph.to_json(graph_path)
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=optimal", "--budget=90%", "--time_limit=5", "--json")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert "lower_bound" not in record
    assert graph.total_cost <= record["cost_lower_bound"] <= record["cost"]
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=optimal", "--budget=10", "--time_limit=5", "--json")
    assert out.returncode == 1
    record = json.loads(out.stdout)
    assert "lower_bound" not in record and record["cost_lower_bound"] is None
    assert record["peak_lower_bound_bytes"] > 10 and record["status"] == "infeasible"


def test_cli_budget_errors_suggest_what_a_command_line_can_write(tmp_path):
    """--budget=0.5 was refused with a hint to pass "the number 0.5", which no flag can."""
    graph_path = tmp_path / "g.json"
    random_training_graph(2, 8).to_json(graph_path)
    for args in (["solve", f"--graph={graph_path}", "--strategy=hong", "--budget=0.5"],
                 ["plan", "--model=resnet50", "--input_shape=32,32,3", "--batch=2", "--budget=0.5"]):
        out = run_cli(*args)
        assert out.returncode == 1 and one_error_line(out.stderr), out.stderr
        assert "--budget=0.5" in out.stderr and "'50%'" in out.stderr and "(or the number" not in out.stderr
    out = run_cli("plot", f"--graph={graph_path}", f"--out={tmp_path}", "--budgets=0.25,50%")
    assert out.returncode == 1 and "--budgets=0.25" in out.stderr and "'25%'" in out.stderr
    assert "(or the number" not in out.stderr
    with pytest.raises(BudgetFormatError, match=r"or the number 0.5"):
        parse_budget("0.5", 1000)  # in Python, the number is a way to write it


def test_cli_solve_refuses_a_malformed_graph_in_one_line(tmp_path):
    """A node without its cost, or with fractional bytes, was a KeyError traceback."""
    for field, value in (("cost", None), ("output_bytes", 2.7), ("output_bytes", float("inf"))):
        document = random_training_graph(2, 8).to_dict()
        if value is None:
            del document["nodes"][3][field]
        else:
            document["nodes"][3][field] = value
        graph_path = tmp_path / "g.json"
        graph_path.write_text(json.dumps(document))
        out = run_cli("solve", f"--graph={graph_path}", "--strategy=hong")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert one_error_line(out.stderr) and "node 3" in out.stderr and field in out.stderr


def test_python_dash_m_tfremat_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "tfremat", "strategies", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "optimal" in json.loads(out.stdout)


def test_help_lists_every_flag_a_command_reads():
    """solve and plot read --solver (for the MILP strategies) without listing it."""
    for command in ("solve", "plot"):
        out = run_cli(command, "--help")
        assert out.returncode == 0 and "--solver" in out.stdout, command


def test_compare_table_shows_the_smallest_peak_of_strategies_that_do_not_fit():
    """Infeasible rows showed only "infeasible" and dashes; the smallest peak they reached
    was in --json alone."""
    from tfremat.cli import _compare_table

    rows = [
        {"strategy": "optimal", "status": "optimal", "predicted_peak_bytes": 900, "budget_bytes": 1000,
         "overhead": 0.05, "solve_seconds": 0.1},
        {"strategy": "chen_sqrtn", "status": "infeasible", "budget_bytes": 1000, "min_feasible_bytes": 3 * 2**20},
    ]
    header, fitting, infeasible = _compare_table(rows).splitlines()
    assert "min_feasible_bytes" in header
    assert "infeasible" in infeasible and "3.00 MiB" in infeasible
    assert "min_feasible_bytes" not in _compare_table(rows[:1])


def test_cli_bad_flags_give_one_line_errors(tmp_path):
    for args in (["solve", "--nonsense=1"], ["frobnicate"], ["solve", "--strategy=x"],
                 ["solve", f"--graph={tmp_path / 'missing.json'}", "--strategy=hong"]):
        out = run_cli(*args)
        assert out.returncode == 2, args
        assert one_error_line(out.stderr), out.stderr
    out = run_cli("solve", "--help")
    assert out.returncode == 0 and "--budget" in out.stdout and "--schedule_out" in out.stdout


def test_cli_plot_names_a_middle_budget_nothing_fits(tmp_path):
    graph_path = tmp_path / "g.json"
    random_training_graph(3, 10).to_json(graph_path)
    out = run_cli("plot", f"--graph={graph_path}", f"--out={tmp_path / 'plots'}", "--budgets=10%,20%,30%",
                  "--strategies=eviction")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "fits the middle budget" in out.stderr.strip().splitlines()[-1]


def test_integer_like_budgets_are_bytes():
    """NumPy integers (a budget computed with NumPy) are bytes, as a Python int is."""
    import numpy as np

    assert parse_budget(np.int64(123_456)) == 123_456
    assert parse_budget(np.uint32(1024)) == 1024
    with pytest.raises(BudgetFormatError):
        parse_budget(True)


def test_sizes_that_read_the_same_show_their_bytes():
    """"budget of 1.50 MiB is infeasible; the smallest peak reached is 1.50 MiB" hid a
    difference of a few bytes."""
    from tfremat.cli import _compare_table
    from tfremat.units import format_bytes_apart

    assert format_bytes_apart(1572864, 1572870, 1024) == [
        "1.50 MiB (1572864 bytes)", "1.50 MiB (1572870 bytes)", "1.00 KiB"]
    assert format_bytes_apart(1572864, 1572864, None) == ["1.50 MiB", "1.50 MiB", None]
    row = {"strategy": "hong", "status": "infeasible", "budget_bytes": 1572864, "min_feasible_bytes": 1572870}
    assert "1.50 MiB (1572864 bytes)" in _compare_table([row]) and "1.50 MiB (1572870 bytes)" in _compare_table([row])


def test_compare_table_says_why_a_strategy_has_no_schedule():
    from tfremat.cli import _compare_table

    rows = [
        {"strategy": "optimal", "status": "no schedule", "budget_bytes": 1000, "error": "highs found no schedule "
         "within time_limit=4s; raise time_limit or the budget"},
        {"strategy": "eviction", "status": "optimal", "predicted_peak_bytes": 900, "budget_bytes": 1000,
         "overhead": 0.05, "solve_seconds": 0.1},
    ]
    header, stopped, fitting, note = _compare_table(rows).splitlines()
    assert "no schedule" in stopped and note == f"optimal: {rows[0]['error']}"


def test_cli_solve_json_reports_a_milp_without_schedule_and_every_error_as_json(tmp_path):
    """With --json, a MILP stopped without a schedule printed a plain-text error."""
    graph_path = tmp_path / "g.json"
    random_training_graph(3, 10).to_json(graph_path)
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=optimal", "--budget=60%", "--time_limit=1e-9", "--json")
    assert out.returncode == 1, out.stderr
    record = json.loads(out.stdout)
    assert record["status"] == "no schedule" and "time_limit" in record["error"] and record["peak_bytes"] is None
    for args, code in (([f"--graph={graph_path}", "--strategy=nope"], 1), (["--strategy=hong"], 2),
                       ([f"--graph={graph_path}", "--strategy=optimal", "--time_limit=-1"], 1)):
        out = run_cli("solve", *args, "--json")
        assert out.returncode == code, out.stderr
        assert set(json.loads(out.stdout)) == {"error"} and json.loads(out.stdout)["error"] in out.stderr
    out = run_cli("solve", "--strategy=hong")  # without --json, stderr alone
    assert out.returncode == 2 and not out.stdout


def test_labels_fit_a_sparse_loss_in_measure_and_the_command_line():
    """measure_model and the command line built one-hot labels for every loss, which
    sparse_categorical_crossentropy refused with a Keras rank error."""
    pytest.importorskip("tensorflow")
    from absl.testing import flagsaver

    from tests.test_cache_api import dense_classifier
    from tfremat import cli
    from tfremat.measure import measure_model, synthetic_batch

    model = dense_classifier()
    x, y = synthetic_batch(model, 6, loss="sparse_categorical_crossentropy", seed=0)
    assert x.shape == (6, 8) and y.shape == (6,) and y.dtype == np.int32 and 0 <= y.min() and y.max() < 4
    _, y = synthetic_batch(model, 6, loss="categorical_crossentropy", seed=0)
    assert y.shape == (6, 4) and np.array_equal(y.sum(axis=1), np.ones(6))
    _, y = synthetic_batch(model, 6, loss="bce", seed=0)
    assert set(np.unique(y)) <= {0.0, 1.0}
    _, y = synthetic_batch(model, 64, loss="mse", seed=0)
    assert y.shape == (64, 4) and y.min() < 0  # real values, not a distribution
    x, y = synthetic_batch(model, 10**6, loss="sparse_categorical_crossentropy")  # zeros that take no memory
    assert x.shape == (10**6, 8) and x.strides == (0, 0) and y.shape == (10**6,)

    record = measure_model(model, "100%", batch_size=4, strategy="checkpoint_all", steps=1,
                           loss="sparse_categorical_crossentropy", optimizer="sgd", cost_model="flops", verbose=0)
    assert record["gradients_match"], record
    with flagsaver.as_parsed(loss="sparse_categorical_crossentropy", cost_model="flops", granularity="sublayer",
                             optimizer="sgd"):
        extraction = cli._extraction(model, 4)
    assert [tuple(spec.shape) for spec in extraction.side_table.label_specs] == [(4,)]


def test_plain_step_peak_reports_requested_bytes_next_to_the_allocator_peak():
    """measure_plain_step_peak read only the BFC allocator's peak, whose chunk rounding moves
    by several percent between runs; count="requested" gives the bytes the step's operations
    request (what the prediction models), through the compiled step's measurement."""
    pytest.importorskip("tensorflow")
    from tests.test_cache_api import dense_classifier
    from tfremat.errors import ExtractionError
    from tfremat.extract import extract, measure_plain_step_peak
    from tfremat.model_planning import synthetic_batch
    from tfremat.plan.simulator import checkpoint_all_peak

    model = dense_classifier()
    x, y = synthetic_batch(model, 256, seed=0)
    extraction = extract(model, sample_batch=(x, y), loss="categorical_crossentropy", cost_model="flops")
    table = extraction.side_table
    before = [v.numpy() for v in model.variables]
    requested = measure_plain_step_peak(model, x, y, table.loss_fn, table.optimizer, count="requested")
    allocator = measure_plain_step_peak(model, x, y, table.loss_fn, table.optimizer)
    fixed = extraction.graph.fixed_bytes
    assert requested > fixed and allocator > fixed
    assert abs(requested / checkpoint_all_peak(extraction.graph) - 1) < 0.1
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))  # weights restored
    with pytest.raises(ExtractionError, match="count"):
        measure_plain_step_peak(model, x, y, table.loss_fn, table.optimizer, count="bytes")


def test_cli_refuses_another_commands_flag_and_an_unwritable_output_before_any_work(tmp_path):
    """``solve --budgets 50%`` solved without a budget (--budgets is plot's flag), and an
    output in a missing directory failed only after the work."""
    graph_path = tmp_path / "g.json"
    random_training_graph(2, 8).to_json(graph_path)
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=hong", "--budgets=50%")
    assert out.returncode == 2 and one_error_line(out.stderr), out.stderr
    assert "--budgets is not a flag of `tfremat solve`" in out.stderr and "--budget," in out.stderr
    missing = tmp_path / "missing" / "s.json"
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=hong", "--budget=90%", f"--schedule_out={missing}")
    assert out.returncode == 1 and one_error_line(out.stderr), out.stderr
    assert "--schedule_out" in out.stderr and "does not exist" in out.stderr and not missing.parent.exists()
    # A model command fails on its output path before extracting the model (seconds, not minutes).
    out = run_cli("graph", "--model=resnet50", "--input_shape=32,32,3", "--batch=2", f"--out={missing}")
    assert out.returncode == 1 and "--out" in out.stderr and "does not exist" in out.stderr, out.stderr
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=hong", "--budget=90%", f"--schedule_out={tmp_path}")
    assert out.returncode == 1 and "is a directory" in out.stderr, out.stderr


def _with_fixed_bytes(graph, fixed_bytes):
    from tfremat.graph import DFGraph

    return DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes,
                   graph.is_backward, graph.loss_node, dict(graph.forward_of), fixed_bytes, graph.name)


def test_budget_forms_shares_of_activations_and_min():
    from tfremat.budget import budget_kind, check_budget, is_share

    assert [budget_kind(b) for b in ("50%", 0.5, "50% of activations", "50% activations", " MIN ", "3GiB", 10)] == \
        ["share", "share", "activations", "activations", "min", "bytes", "bytes"]
    assert parse_budget("50% of activations", 1000, fixed_bytes=600) == 800
    assert parse_budget("100% of activations", 1000, fixed_bytes=600) == 1000
    for bad in ("0.5 of activations", "3GiB of activations"):
        with pytest.raises(BudgetFormatError, match="a share of activations is a percentage"):
            check_budget(bad)
    with pytest.raises(BudgetFormatError, match="no graph is known"):
        parse_budget("50% of activations", 1000)
    with pytest.raises(BudgetFormatError, match="least memory a schedule reaches, which the planner finds"):
        parse_budget("min", 1000)
    check_budget("min")
    assert is_share("min") and is_share("50% of activations") and not is_share("3GiB")


def test_an_infeasible_budget_is_told_in_the_form_it_was_given():
    """A share's error gave bytes only, and blamed "some node" when the fixed memory
    (weights, gradients, optimizer state, the batch) was already over the budget."""
    import math

    from tfremat.errors import InfeasibleBudgetError
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.strategies import get_strategy

    graph = random_training_graph(4, 8)
    activations = checkpoint_all_peak(graph)
    graph = _with_fixed_bytes(graph, 3 * activations)
    reference = checkpoint_all_peak(graph)
    chen = get_strategy("chen_sqrtn")
    with pytest.raises(InfeasibleBudgetError) as info:
        chen(graph, "80%")
    message = str(info.value)
    smallest = info.value.min_feasible_bytes
    assert "budget of '80%' (" in message and f"found is {math.ceil(100 * smallest / reference)}% (" in message
    assert "fixed (weights, gradients, optimizer state, the batch) and" in message
    assert "the fixed memory alone" not in message  # 80% of the peak is above the fixed 75%
    with pytest.raises(InfeasibleBudgetError) as info:
        chen(graph, "50%")
    assert "the fixed memory alone (weights, gradients, optimizer state, the batch)" in str(info.value)
    assert "some node" not in str(info.value) and "smaller batch" in str(info.value)
    with pytest.raises(InfeasibleBudgetError) as info:
        chen(graph, "10% of activations")
    assert "% of activations (" in str(info.value).split("found is", 1)[1]
    with pytest.raises(InfeasibleBudgetError) as info:
        chen(graph, int(0.8 * reference))
    assert "%" not in str(info.value) and "fixed (weights" in str(info.value)


def test_min_budget_plans_at_the_least_peak_a_heuristic_reaches(tmp_path):
    from tfremat.plan.simulator import checkpoint_all_peak
    from tfremat.planner import plan_graph
    from tfremat.strategies import least_peak

    graph = random_training_graph(4, 8)
    least = least_peak(graph)
    assert least < checkpoint_all_peak(graph)
    result = plan_graph(graph, "absolute min", "eviction", cache=False, verbose=0)
    assert result.budget_bytes == least and result.predicted_peak_bytes <= least
    graph_path = tmp_path / "g.json"
    graph.to_json(graph_path)
    for budget in ("min", "60% of activations"):
        out = run_cli("solve", f"--graph={graph_path}", "--strategy=eviction", f"--budget={budget}", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["peak_bytes"] <= json.loads(out.stdout)["budget_bytes"]


_BLOCK_MODULE = '''
import keras


@keras.saving.register_keras_serializable(package="tfremat_granularity_test")
class TwoDenseBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16, activation="relu")
        self.second = keras.layers.Dense(8)

    def call(self, x):
        return self.second(self.first(x))
'''


def test_cli_granularity_flag_chooses_the_graph_nodes_and_refuses_an_unknown_level(tmp_path):
    """--granularity reaches the extraction: a custom block is one node at "layer" and its
    sublayer calls at the default "sublayer"; an unknown level is a flag error (exit 2)."""
    import importlib.util

    keras = pytest.importorskip("keras")
    from tfremat.cli import FLAGS
    from tfremat.extract.opening import GRANULARITIES

    assert tuple(FLAGS["granularity"].parser.enum_values) == GRANULARITIES and FLAGS["granularity"].default == "sublayer"
    source = tmp_path / "blocks.py"
    source.write_text(_BLOCK_MODULE)
    spec = importlib.util.spec_from_file_location("blocks", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(module.TwoDenseBlock()(inputs)))
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    path = tmp_path / "block.keras"
    model.save(path)
    common = ["graph", f"--model={path}", f"--custom_objects={source}", "--batch=2", "--cost_model=flops", "--json"]
    summaries = {}
    for name, extra in (("layer", ["--granularity", "layer"]), ("sublayer", [])):
        out = run_cli(*common, f"--out={tmp_path / (name + '.json')}", *extra)
        assert out.returncode == 0, out.stderr[-2000:]
        summaries[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert summaries["layer"]["granularity"] == "layer" and summaries["sublayer"]["granularity"] == "sublayer"
    assert summaries["layer"]["nodes"] < summaries["sublayer"]["nodes"], summaries
    out = run_cli(*common, f"--out={tmp_path / 'bogus.json'}", "--granularity=bogus")
    assert out.returncode == 2 and one_error_line(out.stderr) and "granularity" in out.stderr, out.stderr
    out = run_cli("plan", "--help")
    assert out.returncode == 0 and "--granularity" in out.stdout


def test_cli_plan_writes_a_schedule_only_to_schedule_out(tmp_path, monkeypatch, capsys):
    """Without --schedule_out, plan wrote <model path>_optimal_schedule.json into the
    current directory, which neither --help nor the README said (issue 34). Run in this
    process, as the flags parse for the tool."""
    pytest.importorskip("tensorflow")
    from tests.test_cache_api import dense_classifier
    from tfremat import cli

    model_path = tmp_path / "dense.keras"
    dense_classifier().save(model_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "_catch_sigint", lambda: None)  # leaves pytest's Ctrl-C handler alone
    common = ["tfremat", "plan", f"--model={model_path}", "--batch=2", "--budget=100%", "--strategy=checkpoint_all",
              "--cost_model=flops", "--nocache", "--json"]
    records = []
    for extra in ([], [f"--schedule_out={tmp_path / 'out' / 's.json'}"]):
        (tmp_path / "out").mkdir(exist_ok=True)
        try:
            cli.main(cli._parse(common + extra))
        finally:
            cli.FLAGS.unparse_flags()
        records.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        if not extra:
            assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.keras", "out"]
            assert not any((tmp_path / "out").iterdir())
    assert "schedule_out" not in records[0] and records[1]["schedule_out"] == str(tmp_path / "out" / "s.json")
    assert {"R", "S"} <= set(json.loads((tmp_path / "out" / "s.json").read_text()))
    assert records[0]["predicted_peak_bytes"] == records[1]["predicted_peak_bytes"]
    assert "without it nothing is written" in cli._command_help("plan")
