"""Small graphs for planning tests: hand-built shapes and random training DAGs (no TensorFlow)."""

from __future__ import annotations

import random
from pathlib import Path

from tfremat.graph import DFGraph, Implementation

SHARED_GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"


def training_graph(forward_edges, sizes, costs=None, reads_output=(), name="training", fixed_bytes=0, workspace=None):
    """A training graph in Checkmate's layout from a forward DAG.

    Forward nodes 0..m-1 (``forward_edges`` among them, ascending), a loss node reading the
    forward sinks, then one backward node per forward node in reverse order. The backward
    node of j reads the gradients of j's consumers (or the loss), j's inputs, and j's own
    output when j is in ``reads_output``.
    """
    m = len(sizes)
    consumers = {j: [v for u, v in forward_edges if u == j] for j in range(m)}
    producers = {j: [u for u, v in forward_edges if v == j] for j in range(m)}
    loss = m
    backward_id = {j: m + 1 + (m - 1 - j) for j in range(m)}
    edges = list(forward_edges)
    sinks = [j for j in range(m) if not consumers[j]]
    edges += [(j, loss) for j in sinks]
    for j in range(m):
        b = backward_id[j]
        upstream = [backward_id[c] for c in consumers[j]] or [loss]
        edges += [(u, b) for u in upstream]
        edges += [(p, b) for p in producers[j]]
        if j in reads_output or not producers[j]:
            edges.append((j, b))
    n = 2 * m + 1
    names = [f"f{j}" for j in range(m)] + ["loss"] + [f"f{m - 1 - k}_backward" for k in range(m)]
    output = list(sizes) + [1] + [sizes[m - 1 - k] for k in range(m)]
    cost = list(costs) if costs is not None else [1.0] * m
    cost = cost + [1.0] + [2.0 * cost[m - 1 - k] for k in range(m)]
    return DFGraph(
        names=names,
        edges=edges,
        cost=cost,
        output_bytes=output,
        workspace_bytes=workspace if workspace is not None else [0] * n,
        is_backward=[False] * m + [True] * (m + 1),
        loss_node=loss,
        forward_of={backward_id[j]: j for j in range(m)},
        fixed_bytes=fixed_bytes,
        name=name,
    )


def random_training_graph(seed: int, num_forward: int, skip_probability: float = 0.3) -> DFGraph:
    """A random training DAG: a chain with random skip connections, random sizes and costs."""
    rng = random.Random(seed)
    edges = [(j - 1, j) for j in range(1, num_forward)]
    for j in range(2, num_forward):
        for i in range(j - 1):
            if rng.random() < skip_probability / j:
                edges.append((i, j))
    sizes = [rng.randint(1, 20) for _ in range(num_forward)]
    costs = [float(rng.randint(1, 10)) for _ in range(num_forward)]
    reads_output = {j for j in range(num_forward) if rng.random() < 0.5}
    n = 2 * num_forward + 1
    workspace = [rng.choice([0, 0, 0, rng.randint(1, 10)]) for _ in range(n)]
    return training_graph(edges, sizes, costs, reads_output, name=f"random{seed}", fixed_bytes=rng.randint(0, 5), workspace=workspace)


def with_residuals(graph: DFGraph, seed: int) -> DFGraph:
    """``graph`` with a random share of some forward nodes' bytes made residual (read only by
    their backward node, the rest by their other successors): the output/residual split that
    extraction gives a node whose gradient does not read its output."""
    rng = random.Random(seed)
    residual = [0] * graph.size
    eligible = [node for node in graph.forward_nodes
                if graph.backward_of.get(node) in graph.successors[node] and len(graph.successors[node]) > 1]
    chosen = [node for node in eligible if rng.random() < 0.6] or eligible[:1]
    for node in chosen:
        residual[node] = rng.randint(1, graph.output_bytes[node])
    return DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes,
                   graph.is_backward, graph.loss_node, dict(graph.forward_of), graph.fixed_bytes,
                   f"{graph.name}+residuals", residual_bytes=residual)


def repeated_blocks(blocks: int, residual: bool = False) -> DFGraph:
    """``blocks`` identical residual blocks in a chain, as a transformer repeats its layers:
    block input x, then a (large, costly), b (large), c, and out = x + c. With ``residual``,
    half of a's bytes are residuals only its gradient reads (the output/residual split)."""
    per_block = 4
    edges, sizes, costs, reads_output = [], [2], [1.0], set()
    for block in range(blocks):
        x = block * per_block
        a, b, c, out = x + 1, x + 2, x + 3, x + 4
        edges += [(x, a), (a, b), (b, c), (c, out), (x, out)]
        sizes += [12, 8, 3, 2]
        costs += [4.0, 1.0, 2.0, 0.5]
        reads_output |= {a, b}
    graph = training_graph(edges, sizes, costs, reads_output, name=f"blocks{blocks}", fixed_bytes=3)
    if not residual:
        return graph
    residual_bytes = [0] * graph.size
    for block in range(blocks):
        residual_bytes[block * per_block + 1] = 6
    return DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes,
                   graph.is_backward, graph.loss_node, dict(graph.forward_of), graph.fixed_bytes,
                   f"{graph.name}+residuals", residual_bytes=residual_bytes)


def alternative(kind: str, size: int, cost: float, backward_cost: float) -> Implementation:
    """An alternative of a forward node of ``size`` output bytes, of one of MONeT's kinds
    (appendix D): a ReLU's mask (small residual, reads neither output nor inputs), an
    output-activated backward, a costlier but leaner one that reads nothing, an
    output-activated batch norm with its statistics (output and residual as one value), a
    backward that reads only the inputs."""
    return {
        "mask": Implementation("mask", max(1, size // 4), False, False, cost + 0.5, backward_cost),
        "output": Implementation("output", 0, True, False, cost, backward_cost + 0.5),
        "lean": Implementation("lean", 0, False, False, cost + 2.0, backward_cost + 3.0, backward_workspace_bytes=2),
        "stats": Implementation("stats", 2, True, False, cost, backward_cost + 0.25),
        "inputs": Implementation("inputs", 0, False, True, cost, backward_cost - 0.5, workspace_bytes=4),
    }[kind]


def with_alternatives(graph: DFGraph, seed: int, count: int) -> DFGraph:
    """``graph`` with two random alternatives on each of ``count`` random forward nodes."""
    rng = random.Random(seed)
    nodes = rng.sample(list(graph.backward_of), count)
    kinds = ["mask", "output", "lean", "stats", "inputs"]
    implementations = {
        f: [alternative(kind, graph.output_bytes[f], graph.cost[f], graph.cost[graph.backward_of[f]])
            for kind in rng.sample(kinds, 2)]
        for f in nodes
    }
    return DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, graph.workspace_bytes, graph.is_backward,
                   graph.loss_node, dict(graph.forward_of), graph.fixed_bytes, f"{graph.name}+alternatives",
                   residual_bytes=graph.residual_bytes, implementations=implementations)
