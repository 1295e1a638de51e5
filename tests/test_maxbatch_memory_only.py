"""The scaled search's certifying builds measuring memory only (``memory_graph_for_batch``)."""

from __future__ import annotations

import pytest

from tests.test_ilp import training_chain
from tfremat.maxbatch import affine_graphs, max_batch_size
from tfremat.plan.simulator import simulate


def _stepped(batch):
    """A chain whose last node's scratch grows in steps of 5 batches (as in test_maxbatch):
    the line through batches 2 and 4 proposes 19, the graph built there refutes it, 14 fits."""
    chain = training_chain(4, batch)
    return chain.replaced(workspace_bytes=[0] * (chain.size - 1) + [64 * (batch // 5)])


def _memory_only(batch):
    """What a memory-only build gives: the same bytes, costs in another unit (FLOPs)."""
    graph = _stepped(batch)
    return graph.replaced(cost=[1000.0 * c + 7 for c in graph.cost])


@pytest.mark.parametrize("strategy", ["chen_greedy", "optimal"])
def test_the_certifying_builds_measure_memory_and_take_the_lines_costs(strategy):
    options = {"threads": 1, "mip_gap": 0.0} if strategy == "optimal" else {}
    profiled, memory = [], []

    def graph_for_batch(batch):
        profiled.append(batch)
        return _stepped(batch)

    def memory_graph_for_batch(batch):
        memory.append(batch)
        return _memory_only(batch)

    result = max_batch_size(graph_for_batch, 333, method="scaled", max_batch=512, strategy=strategy,
                            memory_graph_for_batch=memory_graph_for_batch, **options)
    plain = max_batch_size(_stepped, 333, method="scaled", max_batch=512, strategy=strategy, **options)
    assert result.batch_size == plain.batch_size == 14 and result.built == plain.built == (2, 4, 19, 14)
    assert profiled == [2, 4] and memory == [19, 14]
    # Bytes built at the answer, costs on the profiled line through batches 2 and 4.
    line = affine_graphs(_stepped(2), 2, _stepped(4), 4)
    assert result.graph.workspace_bytes == _stepped(14).workspace_bytes != line(14).workspace_bytes
    assert result.graph.cost == line(14).cost != _memory_only(14).cost
    assert result.cost_cap == pytest.approx(plain.cost_cap)
    assert simulate(result.graph, result.schedule).peak_bytes <= 333 and result.cost <= result.cost_cap


def test_a_memory_only_graph_of_other_nodes_is_certified_on_a_profiled_build(caplog):
    """No profiled cost fits a graph whose nodes differ from the line's: the profiled graph
    is built and certified instead, and the log says so."""
    profiled = []

    def graph_for_batch(batch):
        profiled.append(batch)
        return _stepped(batch)

    with caplog.at_level("INFO", logger="tfremat.maxbatch"):
        result = max_batch_size(graph_for_batch, 333, method="scaled", max_batch=512, strategy="chen_greedy",
                                memory_graph_for_batch=lambda batch: training_chain(5, batch))
    assert result.batch_size == 14 and profiled == [2, 4, 19, 14]
    assert result.graph == _stepped(14)
    assert any("differs in nodes from the profiled line's; building the profiled graph" in r.message
               for r in caplog.records)
