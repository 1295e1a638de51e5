"""The stall rule that ends a MILP early, and the progress lines a user waits with (issue 34)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
from graph_factories import random_training_graph

from tfremat.errors import ArgumentError
from tfremat.ilp import build_milp, memory_lower_bound, solve_model
from tfremat.ilp.milp import solve_optimal
from tfremat.ilp.portfolio import best_baseline
from tfremat.ilp.solvers import Progress, _StallClock
from tfremat.plan.schedule import relative_gap
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.planner import (
    DEFAULT_STALL_TIME,
    DEFAULT_TIME_LIMIT,
    PhaseProgress,
    _SolverProgress,
    plan_graph,
    plan_summary,
    strategy_options,
)


def tight_case():
    """A 41-node training graph at 30% of the way from its memory lower bound to its
    checkpoint-all peak: HiGHS needs several seconds and many nodes to prove it."""
    graph = random_training_graph(0, 20)
    low, high = memory_lower_bound(graph), checkpoint_all_peak(graph)
    return graph, int(low + 0.3 * (high - low))


def test_stall_clock_counts_from_the_start_or_the_first_solution():
    assert _StallClock(0.0, started=True).stalled()
    waiting = _StallClock(0.0, started=False)
    assert not waiting.stalled()  # no solution yet: a search is never stopped before its first
    waiting.improved(3.0)
    assert waiting.stalled() and waiting.stopped
    never = _StallClock(None, started=True)
    never.improved(1.0)
    assert not never.stalled()
    patient = _StallClock(3600.0, started=True)
    assert not patient.stalled()


def test_a_stalled_milp_stops_with_its_best_solution():
    graph, budget = tight_case()
    start, _ = best_baseline(graph, budget, 0.0)
    model = build_milp(graph, budget, exact_stages=())
    result = solve_model(model, start=model.encode(start), threads=1, stall_time=1e-3, time_limit=60)
    assert result.stalled
    assert result.status == "feasible"
    assert result.x is not None
    assert result.objective <= start.cost(graph) * (1 + 1e-9)
    assert result.seconds < 30


def test_stall_time_ends_optimal_early_never_worse_than_the_best_heuristic():
    graph, budget = tight_case()
    schedule = solve_optimal(graph, budget, threads=1, time_limit=60, stall_time=1e-3)
    facts = schedule.facts
    best, _ = best_baseline(graph, budget, 0.0)
    assert schedule.cost(graph) <= best.cost(graph) * (1 + 1e-9)
    assert facts.seconds < 30
    assert facts.status in ("optimal", "feasible")  # never "time_limit": the stall ended it
    assert facts.gap == pytest.approx(relative_gap(facts.objective, facts.best_bound))
    if facts.status == "feasible":
        assert facts.gap > 1e-4


@pytest.mark.parametrize("stall_time, milp_runs", [(1e-3, False), (2.0, True)])
def test_the_milp_is_skipped_when_its_root_lp_would_outlast_the_stall_rule(monkeypatch, stall_time, milp_runs):
    """With stall_time, an LP that took half of it in CPU seconds means the MILP's root LP
    (not interruptible) would too, and the rule would stop the search right after it: the
    best start comes back with the LP's bound and the relaxation's size."""
    import tfremat.ilp.milp as milp

    solves = []
    solve = milp.solve_model
    monkeypatch.setattr(milp, "solve_model", lambda *a, **k: solves.append(k) or solve(*a, **k))
    graph, budget = tight_case()
    schedule = solve_optimal(graph, budget, threads=1, time_limit=60, stall_time=stall_time)
    facts = schedule.facts
    assert bool(solves) == milp_runs
    assert facts.num_vars == build_milp(graph, budget, exact_stages=()).num_vars
    assert facts.best_bound > graph.total_cost  # the LP's bound, above the no-remat floor
    best, _ = best_baseline(graph, budget, 0.0)
    assert schedule.cost(graph) <= best.cost(graph) * (1 + 1e-9)


def test_stall_time_inf_runs_the_milp_however_long_its_lp_took(monkeypatch):
    """``stall_time=math.inf`` is no rule at all: neither of the MILP skips that the rule
    makes applies (it read as a rule, and the "no stall" plans skipped the MILP)."""
    import tfremat.ilp.milp as milp

    solves = []
    solve = milp.solve_model
    monkeypatch.setattr(milp, "solve_model", lambda *a, **k: solves.append(k) or solve(*a, **k))
    monkeypatch.setattr(milp, "ROOT_STALL_SHARE", 0.0)  # every LP would skip the MILP under a rule
    graph, budget = tight_case()
    solve_optimal(graph, budget, threads=1, time_limit=10, stall_time=math.inf)
    assert solves and all(k["stall_time"] is None for k in solves)


def test_stall_time_is_checked_and_defaulted_by_the_high_level_api():
    with pytest.raises(ArgumentError, match="stall_time must be a positive number"):
        solve_optimal(random_training_graph(0, 4), None, stall_time=0)
    assert strategy_options("optimal") == {"time_limit": DEFAULT_TIME_LIMIT, "stall_time": DEFAULT_STALL_TIME}
    assert strategy_options("optimal", stall_time=math.inf)["stall_time"] == math.inf
    assert "stall_time" not in strategy_options("approx_lp")


def test_solver_progress_prints_only_what_is_known(capsys):
    progress = _SolverProgress("tfremat optimal", total_cost=2.0)
    progress(Progress(1.5, 2.5, None, None))
    progress(Progress(2.5, 2.5, 2.2, 0.12))
    progress.close()
    err = capsys.readouterr().err
    first, second = err.split("\r")[1:]
    assert first.strip() == "tfremat optimal: 1.5s, best schedule +25.0%"
    assert second.strip() == "tfremat optimal: 2.5s, best schedule +25.0%, bound +10.0%, gap 12.00%"
    assert " -" not in err and err.endswith("\n")


def test_phase_progress_writes_one_line_per_phase_and_nothing_when_disabled(capsys):
    phases = PhaseProgress("tfremat batch (8, 64)")
    phases.start("extracting the training graph")
    phases.done("89 nodes")
    phases.start("planning with optimal")
    phases.solver_progress(2.0)(Progress(0.5, 3.0, 2.0, 1 / 3))
    phases.done("3 recomputations")
    err = capsys.readouterr().err
    assert err.endswith("\n")
    lines = [line.split("\r")[-1].rstrip() for line in err[:-1].split("\n")]
    assert len(lines) == 2
    assert lines[0].startswith("tfremat batch (8, 64): extracting the training graph: 89 nodes, ")
    assert lines[1].startswith("tfremat batch (8, 64): planning with optimal: 3 recomputations, ")
    assert all(line.endswith("s") for line in lines)
    quiet = PhaseProgress("tfremat batch (8, 64)", enabled=False)
    quiet.start("extracting the training graph")
    quiet.update("anything")
    quiet.done("89 nodes")
    assert capsys.readouterr().err == ""


def test_a_warning_or_log_record_starts_its_own_line_while_a_phase_is_open():
    """A warning written while a phase's line was open continued it ("gap 34.30%schedule
    repair is not ...", the fifth user check); the progress now goes on below it. In a
    subprocess: Python's own stderr handlers, not pytest's captures."""
    script = textwrap.dedent("""
        import logging, warnings
        from tfremat.planner import PhaseProgress
        phases = PhaseProgress("tfremat batch (8, 4)")
        phases.start("planning")
        phases.update("gap 34.30%")
        logging.getLogger("tfremat.ilp.milp").warning("schedule repair is not a solution")
        phases.update("gap 10.00%")
        warnings.warn("a Python warning")
        phases.done("3 recomputations")
        logging.getLogger("tfremat").warning("after the phase")
    """)
    # bytes: text mode's universal newlines would turn each "\r" into a line break
    err = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True).stderr.decode()
    lines = [line.split("\r")[-1].rstrip() for line in err.rstrip("\n").split("\n")]
    assert lines[0] == "tfremat batch (8, 4): planning: gap 34.30%"
    assert lines[1] == "schedule repair is not a solution"
    assert lines[2] == "tfremat batch (8, 4): planning: gap 10.00%"
    assert lines[3].endswith("UserWarning: a Python warning")
    assert lines[-2].startswith("tfremat batch (8, 4): planning: 3 recomputations, ")
    assert lines[-1] == "after the phase"


def test_plan_graph_verbose_zero_is_silent_and_the_summary_says_what_the_plan_gives(capfd):
    graph, budget = tight_case()
    result = plan_graph(graph, budget, "optimal", cache=False, verbose=0, time_limit=30, threads=1)
    assert capfd.readouterr().err == ""
    summary = plan_summary(result)
    assert f"{result.schedule.recompute_count} recomputations" in summary
    assert "predicted peak" in summary and "predicted overhead" in summary
    assert "proven optimal" in summary or "of optimal" in summary


@pytest.mark.parametrize("verbose", [1, 0])
def test_fit_prints_one_line_per_phase_and_nothing_with_verbose_zero(capfd, verbose):
    import numpy as np
    from models import small_convnet

    import tfremat

    model = small_convnet(input_shape=(8, 8, 3), channels=4)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 3)).astype("float32")
    y = np.eye(10, dtype="float32")[np.arange(4)]
    capfd.readouterr()
    tfremat.fit(model, "90%", x, y, batch_size=4, strategy="chen_sqrtn", cost_model="flops", cache=False,
                allocator_check=False, verbose=verbose)
    err = capfd.readouterr().err
    # A phase's line ends where its result overwrote its announcement ("\r"); TensorFlow's own
    # warnings may come between the two.
    lines = [line.split("\r")[-1] for line in err.split("\n") if line.split("\r")[-1].startswith("tfremat")]
    if not verbose:
        assert "tfremat" not in err
        return
    assert [line.split(": ")[1] for line in lines] == [
        "extracting the training graph and profiling its layers", "planning with chen_sqrtn", "compiling the step"]
    assert "recomputations, predicted peak" in lines[1] and "predicted overhead" in lines[1]
    assert "traced and ran the first step" in lines[2]
    assert all(line.rstrip().endswith("s") for line in lines)
    assert "backward node" not in err
