"""Operator implementations on the graph (MONeT, issue 23): alternatives carried by the
graph, the graph under a choice, and schedules planned and simulated under it (no TensorFlow)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from graph_factories import training_graph

from tfremat.errors import ArgumentError, GraphError, ScheduleError
from tfremat.graph import DFGraph, Implementation, load_graph
from tfremat.plan.schedule import (
    Schedule,
    checkpoint_all_s,
    schedule_from_keep_matrix,
    validate_schedule,
)
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import get_strategy

# Node 1 is ReLU-like (its default gradient reads its 40-byte output); its "mask" keeps a
# 10-byte mask instead. Node 2's "no_inputs" gradient reads none of its inputs (an Add).
MASK = Implementation("mask", residual_bytes=10, reads_output=False, reads_inputs=False, cost=1.5, backward_cost=2.0)
NO_INPUTS = Implementation("no_inputs", residual_bytes=0, reads_output=True, reads_inputs=False, cost=1.0,
                           backward_cost=2.0)


def _graph(**extra) -> DFGraph:
    base = training_graph([(j, j + 1) for j in range(3)], [40] * 4, reads_output=(1, 2))
    return DFGraph(base.names, base.edges, base.cost, base.output_bytes, base.workspace_bytes, base.is_backward,
                   base.loss_node, dict(base.forward_of), base.fixed_bytes, base.name,
                   implementations={1: [MASK], 2: [NO_INPUTS]}, **extra)


GRAPH = _graph()
LEAN = {1: "mask", 2: "no_inputs"}


def test_alternatives_round_trip_through_json_and_change_the_fingerprint():
    again = load_graph(json.loads(GRAPH.to_json()))
    assert again == GRAPH and again.implementations[1] == (MASK,)
    plain = training_graph([(j, j + 1) for j in range(3)], [40] * 4, reads_output=(1, 2))
    assert plain.fingerprint != GRAPH.fingerprint and "implementations" not in json.dumps(plain.to_dict())


def test_the_graph_under_a_choice():
    lean = GRAPH.with_implementations(LEAN)
    backward_1, backward_2 = GRAPH.backward_of[1], GRAPH.backward_of[2]
    # The mask is a part of node 1's value that only its backward reads; its input is not read.
    assert lean.output_bytes[1] == 50 and lean.residual_bytes[1] == 10 and lean.part_read_by(1, backward_1) == "residual"
    assert (0, backward_1) not in lean.edges and (1, backward_2) not in lean.edges and (2, backward_2) in lean.edges
    assert lean.cost[1] == 1.5 and not lean.implementations
    assert GRAPH.with_implementations({}) is GRAPH and GRAPH.with_implementations({1: "default"}) is GRAPH
    with pytest.raises(GraphError, match="no implementation 'bits'"):
        GRAPH.with_implementations({1: "bits"})


def test_alternatives_are_validated():
    with pytest.raises(GraphError, match="'default'"):
        Implementation("default", 0, True, True, 1.0, 1.0)
    with pytest.raises(GraphError, match="whole number of bytes"):
        Implementation("half", 0.5, True, True, 1.0, 1.0)
    base = training_graph([(0, 1)], [8, 8])
    with pytest.raises(GraphError, match="not a forward node"):
        DFGraph(base.names, base.edges, base.cost, base.output_bytes, is_backward=base.is_backward,
                loss_node=base.loss_node, forward_of=dict(base.forward_of), implementations={2: [MASK]})
    with pytest.raises(GraphError, match="repeats"):
        DFGraph(base.names, base.edges, base.cost, base.output_bytes, is_backward=base.is_backward,
                loss_node=base.loss_node, forward_of=dict(base.forward_of), implementations={0: [MASK, MASK]})


def test_the_one_simulator_counts_a_schedule_under_its_implementations():
    """A schedule records its choice, and simulating it on the graph equals simulating it
    on the graph under the choice: the implementation choice alone lowers the peak of
    keeping everything, since node 1's output is freed once node 2 has read it."""
    lean = GRAPH.with_implementations(LEAN)
    keep_all = schedule_from_keep_matrix(lean, checkpoint_all_s(lean), "checkpoint_all").with_implementations(LEAN)
    validate_schedule(GRAPH, keep_all)
    result = simulate(GRAPH, keep_all)
    assert result.peak_bytes == simulate(lean, schedule_from_keep_matrix(lean, checkpoint_all_s(lean), "x")).peak_bytes
    assert result.peak_bytes < checkpoint_all_peak(GRAPH)
    assert keep_all.cost(GRAPH) == pytest.approx(lean.total_cost)
    again = Schedule.from_dict(json.loads(json.dumps(keep_all.to_dict(GRAPH))), GRAPH)
    assert dict(again.implementations) == LEAN
    # The plain graph's schedule does not fit the graph under the choice, and validation says so.
    plain = schedule_from_keep_matrix(GRAPH, checkpoint_all_s(GRAPH), "checkpoint_all")
    with pytest.raises(ScheduleError):
        validate_schedule(GRAPH, plain.with_implementations({1: "bits"}))


@pytest.mark.parametrize("name", ["checkpoint_all", "chen_sqrtn", "rotor", "eviction"])
def test_every_strategy_plans_under_an_implementation_choice(name):
    budget = checkpoint_all_peak(GRAPH)
    schedule = get_strategy(name)(GRAPH, budget, implementations=LEAN)
    assert dict(schedule.implementations) == LEAN
    validate_schedule(GRAPH, schedule)
    assert simulate(GRAPH, schedule).peak_bytes <= budget
    with pytest.raises(ArgumentError, match="implementations"):
        get_strategy(name)(GRAPH, budget, implementations={3: "mask"})


def test_the_choice_can_make_a_budget_feasible():
    lean_peak = simulate(GRAPH, get_strategy("checkpoint_all")(GRAPH, implementations=LEAN)).peak_bytes
    assert lean_peak < checkpoint_all_peak(GRAPH)
    assert np.isfinite(get_strategy("checkpoint_all")(GRAPH, lean_peak, implementations=LEAN).cost(GRAPH))
