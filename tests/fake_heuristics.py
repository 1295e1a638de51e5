"""Fake planning heuristics that take a set number of seconds on a fake clock, for the
portfolio's deadline and gate tests: only the heuristics advance the clock, so no load on
the machine can move a test's verdict."""

from __future__ import annotations

import types

from tfremat.ilp import portfolio
from tfremat.plan import baselines
from tfremat.plan.baselines import cheapest_fitting, schedule_for_checkpoints
from tfremat.plan.registry import as_strategy


def fake_clock(monkeypatch) -> list[float]:
    """Puts a fake ``perf_counter`` into the baselines and the portfolio; returns its time,
    a one-element list the heuristics of :func:`timed_heuristic` advance."""
    now = [100.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(baselines, "time", clock)
    monkeypatch.setattr(portfolio, "time", clock)
    return now


def timed_heuristic(name: str, now: list[float], calls: list[str], seconds: float):
    """A strategy named ``name`` that appends its name to ``calls`` when run, and advances
    the fake clock ``now`` by ``seconds`` while producing its one candidate (every forward
    node checkpointed)."""

    @as_strategy(name)
    def run(graph, budget=None):
        calls.append(name)

        def candidates():
            now[0] += seconds
            yield schedule_for_checkpoints(graph, graph.forward_nodes, name)

        return cheapest_fitting(graph, candidates(), budget, name)

    return run
