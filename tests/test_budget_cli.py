"""Budget parsing and the planning commands of the tfremat command line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tfremat.budget import parse_budget
from tfremat.errors import BudgetFormatError

from graph_factories import random_training_graph


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


def test_relative_budget_needs_reference():
    with pytest.raises(BudgetFormatError, match="relative"):
        parse_budget("50%")


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tfremat.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_strategies_lists_names():
    out = run_cli("strategies", "--json")
    assert out.returncode == 0, out.stderr
    assert {"checkpoint_all", "chen_sqrtn", "griewank_logn_ap", "hong"} <= set(json.loads(out.stdout))


def test_cli_solve_json_and_schedule_out(tmp_path):
    graph_path = tmp_path / "g.json"
    random_training_graph(2, 8).to_json(graph_path)
    schedule_path = tmp_path / "s.json"
    out = run_cli("solve", f"--graph={graph_path}", "--strategy=chen_greedy", "--budget=90%", "--json",
                  f"--schedule_out={schedule_path}")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    for key in ("strategy", "status", "budget_bytes", "peak_bytes", "cost", "cost_ratio", "lower_bound", "gap", "seconds"):
        assert key in record
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


def test_cli_bad_flags_give_one_line_errors(tmp_path):
    for args in (["solve", "--nonsense=1"], ["frobnicate"], ["solve", "--strategy=x"],
                 ["solve", f"--graph={tmp_path / 'missing.json'}", "--strategy=hong"]):
        out = run_cli(*args)
        assert out.returncode == 2, args
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
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
