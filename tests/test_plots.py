"""Plots: files are written as PNGs, and the rows behind the overhead plot are honest."""

import subprocess
import sys

import pytest
from graph_factories import random_training_graph, with_alternatives

from tfremat import plots
from tfremat.errors import TfrematError
from tfremat.plan.simulator import simulate
from tfremat.strategies import get_strategy

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HEURISTICS = ["checkpoint_all", "chen_sqrtn", "chen_sqrtn_ap", "chen_greedy", "griewank_logn", "hong"]


@pytest.fixture(scope="module")
def graph():
    return random_training_graph(seed=3, num_forward=10)


@pytest.fixture(scope="module")
def reference_peak(graph):
    return simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > len(PNG_MAGIC)
    assert data.startswith(PNG_MAGIC)


def test_importing_plots_does_not_import_matplotlib():
    # matplotlib is optional: only drawing may need it.
    code = "import sys, tfremat, tfremat.plots; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_memory_traces_writes_png(graph, reference_peak, tmp_path):
    budget = int(0.8 * reference_peak)
    schedules = {"checkpoint_all": get_strategy("checkpoint_all")(graph)}
    schedules.update({name: get_strategy(name)(graph) for name in ("chen_sqrtn", "chen_sqrtn_ap", "hong")})
    path = tmp_path / "memory.png"
    assert plots.plot_memory_traces(graph, schedules, path, budget_bytes=budget, title="traces") == path
    assert_png(path)


def test_memory_traces_rejects_bad_arguments(graph, tmp_path):
    with pytest.raises(ValueError, match="schedules"):
        plots.plot_memory_traces(graph, {}, tmp_path / "empty.png")
    schedules = {"checkpoint_all": get_strategy("checkpoint_all")(graph)}
    with pytest.raises(ValueError, match="budget_bytes"):
        plots.plot_memory_traces(graph, schedules, tmp_path / "bad.png", budget_bytes=0)
    assert not (tmp_path / "bad.png").exists()


def test_overhead_vs_budget_rows(graph, reference_peak, tmp_path):
    budgets = [1, int(0.5 * reference_peak), int(0.75 * reference_peak), reference_peak]
    calls = []
    path, rows = plots.plot_overhead_vs_budget(
        graph, HEURISTICS, budgets, tmp_path / "overhead.png", progress=lambda done, total: calls.append((done, total))
    )
    assert path == tmp_path / "overhead.png"
    assert_png(path)
    total = len(HEURISTICS) * len(budgets)
    assert calls == [(done, total) for done in range(1, total + 1)]
    assert len(rows) == total
    assert {(row["strategy"], row["budget_bytes"]) for row in rows} == {(s, b) for s in HEURISTICS for b in budgets}
    for row in rows:
        assert set(row) == {"strategy", "budget_bytes", "peak_bytes", "time_ratio", "seconds"}
        assert row["seconds"] >= 0
        if row["budget_bytes"] == 1:
            # No plan fits in one byte: every strategy must report the point as infeasible.
            assert row["peak_bytes"] is None and row["time_ratio"] is None
        elif row["time_ratio"] is not None:
            assert row["peak_bytes"] <= row["budget_bytes"]
            assert row["time_ratio"] >= 1.0 - 1e-12
        else:
            assert row["peak_bytes"] is None
    at_full = {row["strategy"]: row for row in rows if row["budget_bytes"] == reference_peak}
    assert at_full["checkpoint_all"]["time_ratio"] == pytest.approx(1.0)
    assert at_full["checkpoint_all"]["peak_bytes"] == reference_peak
    assert any(row["time_ratio"] is not None and row["budget_bytes"] < reference_peak for row in rows)
    below = {row["strategy"]: row for row in rows if row["budget_bytes"] == int(0.5 * reference_peak)}
    assert below["checkpoint_all"]["time_ratio"] is None


def test_overhead_vs_budget_all_infeasible_still_plots(graph, tmp_path):
    path, rows = plots.plot_overhead_vs_budget(graph, ["checkpoint_all", "chen_sqrtn"], [1, 2], tmp_path / "none.png")
    assert_png(path)
    assert all(row["time_ratio"] is None for row in rows)


@pytest.mark.parametrize(
    ("strategies", "budgets", "error", "match"),
    [
        ([], [100], ValueError, "strategies"),
        (["chen_sqrtn", "chen_sqrtn"], [100], ValueError, "repeats"),
        (["chen_sqrtn"], [], ValueError, "budgets_bytes"),
        (["chen_sqrtn"], [0], ValueError, "budgets_bytes"),
        (["chen_sqrtn"], [1.5], ValueError, "budgets_bytes"),
        (["no_such_strategy"], [100], TfrematError, "unknown strategy"),
    ],
)
def test_overhead_vs_budget_rejects_bad_arguments(graph, tmp_path, strategies, budgets, error, match):
    with pytest.raises(error, match=match):
        plots.plot_overhead_vs_budget(graph, strategies, budgets, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_overhead_vs_budget_takes_options_per_strategy(graph, reference_peak, tmp_path):
    """Each strategy gets its own options: the MILP's time limit, an offloading strategy's
    link; a name not plotted or an option a strategy does not take is refused."""
    budgets = [int(0.8 * reference_peak), reference_peak]
    options = {"approx_lp": {"time_limit": 10, "threads": 1}, "pofo": {"bandwidth": 1e9}}
    _, rows = plots.plot_overhead_vs_budget(graph, ["approx_lp", "pofo", "chen_sqrtn"], budgets,
                                            tmp_path / "options.png", strategy_options=options)
    assert any(row["strategy"] == "pofo" and row["time_ratio"] is not None for row in rows)
    with pytest.raises(TfrematError, match="not among"):
        plots.plot_overhead_vs_budget(graph, ["chen_sqrtn"], budgets, tmp_path / "x.png", strategy_options=options)
    with pytest.raises(TfrematError, match="time_limit"):
        plots.plot_overhead_vs_budget(graph, ["chen_sqrtn"], budgets, tmp_path / "x.png",
                                      strategy_options={"chen_sqrtn": {"time_limit": 10}})


def test_checkmate_and_monet_curves_in_one_figure(tmp_path):
    """``optimal`` and ``monet`` on one overhead-vs-budget figure: at every budget monet's
    overhead is at most optimal's (it chooses implementations too), and it fits every
    budget optimal fits."""
    graph = with_alternatives(random_training_graph(seed=5, num_forward=6), seed=5, count=3)
    peak = simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes
    budgets = [int(share * peak) for share in (0.6, 0.8, 1.0)]
    options = {"threads": 1, "mip_gap": 0.0}
    path, rows = plots.plot_overhead_vs_budget(graph, ["optimal", "monet"], budgets, tmp_path / "monet.png",
                                               strategy_options={"optimal": options, "monet": options})
    assert_png(path)
    by = {(row["strategy"], row["budget_bytes"]): row["time_ratio"] for row in rows}
    for budget in budgets:
        if by["optimal", budget] is not None:
            assert by["monet", budget] is not None and by["monet", budget] <= by["optimal", budget] + 1e-9
    assert by["monet", peak] is not None
