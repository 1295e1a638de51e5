"""A backward split into a weight-gradient node and an input-gradient node (MONeT appendix
D, issue 23): the graph, every strategy on it, the extraction and the compiled step."""

from __future__ import annotations

import pytest

from tfremat.errors import GraphError
from tfremat.graph import DFGraph, load_graph
from tfremat.plan.schedule import validate_schedule
from tfremat.plan.simulator import checkpoint_all_peak, simulate
from tfremat.strategies import (
    get_strategy,
    offloading_strategy_names,
    solver_strategy_names,
    strategy_names,
)

# a -> conv -> relu -> loss, with gradients larger than the activations. The convolution
# reads its input a (its weight gradient does), the ReLU its output. Unsplit, conv's
# backward holds a, the upstream gradient and its input gradient at once; split, a is freed
# after the weight gradient.
NAMES = ["a", "conv", "relu", "loss", "relu_backward"]
FORWARD_EDGES = [(0, 1), (1, 2), (2, 3), (2, 4), (3, 4)]


def _graph(split: bool, **extra) -> DFGraph:
    if split:
        names = NAMES + ["conv_weight_backward", "conv_backward", "a_backward"]
        edges = FORWARD_EDGES + [(0, 5), (4, 5), (4, 6), (5, 6), (6, 7)]
        forward_of = {4: 2, 5: 1, 6: 1, 7: 0}
        output = [40, 40, 40, 4, 100, 0, 100, 40]
        cost = [1, 4, 1, 1, 1, 4, 4, 2]
    else:
        names = NAMES + ["conv_backward", "a_backward"]
        edges = FORWARD_EDGES + [(0, 5), (4, 5), (5, 6)]
        forward_of = {4: 2, 5: 1, 6: 0}
        output = [40, 40, 40, 4, 100, 100, 40]
        cost = [1, 4, 1, 1, 1, 8, 2]
    is_backward = [i >= 3 for i in range(len(names))]
    return DFGraph(names, edges, cost, output, is_backward=is_backward, loss_node=3, forward_of=forward_of,
                   name="split" if split else "unsplit", **extra)


SPLIT, UNSPLIT = _graph(True), _graph(False)


def test_a_forward_node_may_have_two_backward_nodes():
    assert SPLIT.backward_nodes_of[1] == (5, 6) and SPLIT.backward_of[1] == 6
    assert SPLIT.backward_nodes_of[2] == (4,) and SPLIT.backward_of[2] == 4
    assert load_graph(SPLIT.to_dict()) == SPLIT
    # The input is freed between the two parts: the split lowers the checkpoint-all peak
    # by exactly a's 40 bytes (the unsplit peak holds a, relu's gradient and conv's: 240).
    assert (checkpoint_all_peak(UNSPLIT), checkpoint_all_peak(SPLIT)) == (240, 200)


def test_a_split_node_keeps_no_residuals():
    with pytest.raises(GraphError, match="2 backward nodes"):
        DFGraph(SPLIT.names, SPLIT.edges + ((1, 5),), SPLIT.cost, SPLIT.output_bytes, is_backward=SPLIT.is_backward,
                loss_node=3, forward_of=dict(SPLIT.forward_of), residual_bytes=[0, 10, 0, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("name", strategy_names(offloading=True))
def test_every_strategy_plans_a_split_backward(name):
    budget = checkpoint_all_peak(SPLIT)
    options = {"bandwidth": 40.0} if name in offloading_strategy_names() else {}
    if name in solver_strategy_names():
        options["time_limit"] = 20
    schedule = get_strategy(name)(SPLIT, budget, **options)
    validate_schedule(SPLIT, schedule)
    assert simulate(SPLIT, schedule).peak_bytes <= budget
