"""The immutable data-flow graph every strategy plans over.

A :class:`DFGraph` is the training step at the granularity tfremat schedules: one node
per forward layer call, the loss node, and one node per backward (gradient) computation.
Nodes are numbered ``0..n-1`` in a topological order that is also a valid execution
order, so an edge ``(u, v)`` always has ``u < v``; Checkmate's frontier-advancing stages
(stage ``t`` computes node ``t`` for the first time) rely on that numbering.

The graph carries numbers only. Framework objects (Keras layers, tensors) live in a side
table kept by the extraction package, so the planning core never imports TensorFlow.

JSON: :meth:`DFGraph.to_json` / :func:`load_graph` use tfremat's own format, and
:func:`load_graph` also reads the two networkx node-link formats of ``shared/graphs``
(Checkmate's ``*_train.json`` and the random layered graphs of Moccasin).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import networkx as nx

from tfremat.errors import ArgumentError, GraphError

__all__ = ["DFGraph", "load_graph", "graph_format", "file_node_ids", "GRAPH_FORMAT", "LOAD_ORDERS"]

GRAPH_FORMAT = "tfremat.graph/1"


class DFGraph:
    """An immutable, validated data-flow graph.

    Args:
        names: one name per node, in execution order.
        edges: data dependencies ``(source, target)``; ``source < target``.
        cost: compute cost of each node (any consistent unit, e.g. seconds).
        output_bytes: bytes of each node's output value.
        workspace_bytes: transient bytes a node needs only while it runs (default 0).
        is_backward: True for the loss node and every gradient node (default all False).
        loss_node: id of the loss node, or None for a graph without a loss.
        forward_of: maps a backward node to the forward node whose gradient it computes.
        fixed_bytes: memory resident for the whole step (parameters, their gradients,
            optimizer slots, the input batch), counted in every peak.
        name: a label for reports.

    Raises:
        GraphError: naming the node, for a cycle, an edge against the order, a dangling
            edge, a negative or non-finite cost or size, or inconsistent lengths.
    """

    __slots__ = (
        "names",
        "edges",
        "cost",
        "output_bytes",
        "workspace_bytes",
        "is_backward",
        "loss_node",
        "forward_of",
        "fixed_bytes",
        "name",
        "__dict__",
    )

    def __init__(
        self,
        names: Sequence[str],
        edges: Iterable[tuple[int, int]],
        cost: Sequence[float],
        output_bytes: Sequence[int],
        workspace_bytes: Sequence[int] | None = None,
        is_backward: Sequence[bool] | None = None,
        loss_node: int | None = None,
        forward_of: Mapping[int, int] | None = None,
        fixed_bytes: int = 0,
        name: str = "graph",
    ):
        n = len(names)
        set_ = object.__setattr__
        set_(self, "names", tuple(str(x) for x in names))
        set_(self, "edges", tuple(sorted({(int(u), int(v)) for u, v in edges})))
        set_(self, "cost", tuple(float(c) for c in cost))
        set_(self, "output_bytes", tuple(int(b) for b in output_bytes))
        set_(self, "workspace_bytes", tuple(int(b) for b in (workspace_bytes if workspace_bytes is not None else [0] * n)))
        set_(self, "is_backward", tuple(bool(b) for b in (is_backward if is_backward is not None else [False] * n)))
        set_(self, "loss_node", None if loss_node is None else int(loss_node))
        set_(self, "forward_of", MappingProxyType({int(k): int(v) for k, v in (forward_of or {}).items()}))
        set_(self, "fixed_bytes", int(fixed_bytes))
        set_(self, "name", str(name))
        self._validate()

    def __setattr__(self, key, value):
        raise AttributeError(f"DFGraph is immutable; cannot set {key!r}")

    def _validate(self) -> None:
        n = self.size
        if n == 0:
            raise GraphError("a graph needs at least one node")
        for field in ("cost", "output_bytes", "workspace_bytes", "is_backward"):
            if len(getattr(self, field)) != n:
                raise GraphError(f"{field} has {len(getattr(self, field))} entries but the graph has {n} nodes")
        for i in range(n):
            for field in ("cost", "output_bytes", "workspace_bytes"):
                value = getattr(self, field)[i]
                if not math.isfinite(value) or value < 0:
                    raise GraphError(f"node {i} ({self.names[i]}): {field} must be finite and >= 0, got {value}", node=i)
        if self.fixed_bytes < 0:
            raise GraphError(f"fixed_bytes must be >= 0, got {self.fixed_bytes}")
        for u, v in self.edges:
            for end in (u, v):
                if not 0 <= end < n:
                    raise GraphError(f"edge ({u}, {v}) is dangling: node {end} does not exist (nodes are 0..{n - 1})", node=end)
            if u == v:
                raise GraphError(f"node {u} ({self.names[u]}) has a self-loop", node=u)
        backwards = [(u, v) for u, v in self.edges if u > v]
        if backwards:
            digraph = nx.DiGraph(self.edges)
            try:
                cycle = nx.find_cycle(digraph)
            except nx.NetworkXNoCycle:
                u, v = backwards[0]
                raise GraphError(
                    f"edge ({u}, {v}) goes against the node order: nodes must be numbered in a "
                    f"topological order (use DFGraph.from_unordered to renumber)",
                    node=v,
                ) from None
            path = " -> ".join(f"{a} ({self.names[a]})" for a, _ in cycle)
            raise GraphError(f"the graph has a cycle: {path} -> {cycle[0][0]}", node=cycle[0][0])
        if self.loss_node is not None and not 0 <= self.loss_node < n:
            raise GraphError(f"loss_node {self.loss_node} does not exist", node=self.loss_node)
        for b, f in self.forward_of.items():
            if not (0 <= b < n and 0 <= f < n):
                raise GraphError(f"forward_of maps {b} -> {f}, outside 0..{n - 1}", node=b)
            if not self.is_backward[b] or self.is_backward[f]:
                raise GraphError(f"forward_of maps {b} ({self.names[b]}) -> {f} ({self.names[f]}): must map a backward node to a forward node", node=b)
        if self.loss_node is not None and not self.is_backward[self.loss_node]:
            raise GraphError(f"loss node {self.loss_node} must be flagged backward (Checkmate's convention)", node=self.loss_node)

    @classmethod
    def from_unordered(
        cls, node_ids: Sequence, edges: Iterable[tuple], order: Sequence | None = None, **fields
    ) -> "DFGraph":
        """Builds a graph from arbitrary node ids, renumbering them in an execution order.

        ``fields`` holds the per-node sequences (``cost``, ``output_bytes``, ...) indexed
        like ``node_ids``. ``order`` lists the node ids in the execution order to number
        them by; it must hold every id once and respect every edge. Without it the order is
        ``networkx.topological_sort`` of the input. The order matters beyond numbering:
        Checkmate's stages compute the nodes for the first time in this order, and the
        checkpoint-all peak (the reference of percentage budgets) is measured in it.
        """
        digraph = nx.DiGraph()
        digraph.add_nodes_from(node_ids)
        digraph.add_edges_from(edges)
        if order is None:
            try:
                order = list(nx.topological_sort(digraph))
            except nx.NetworkXUnfeasible:
                cycle = nx.find_cycle(digraph)
                raise GraphError(f"the graph has a cycle through {cycle[0][0]!r}") from None
        else:
            order = list(order)
            _check_order(order, digraph)
        position = {node: i for i, node in enumerate(order)}
        source_index = {node: i for i, node in enumerate(node_ids)}
        per_node = ("names", "cost", "output_bytes", "workspace_bytes", "is_backward")
        reordered = {}
        for key, value in fields.items():
            if key in per_node and value is not None:
                reordered[key] = [value[source_index[node]] for node in order]
            else:
                reordered[key] = value
        reordered.setdefault("names", [str(node) for node in order])
        if reordered.get("loss_node") is not None:
            reordered["loss_node"] = position[node_ids[reordered["loss_node"]]]
        if reordered.get("forward_of"):
            reordered["forward_of"] = {
                position[node_ids[b]]: position[node_ids[f]] for b, f in reordered["forward_of"].items()
            }
        return cls(edges=[(position[u], position[v]) for u, v in digraph.edges], **reordered)

    # ----- derived views (cached) -----

    @property
    def size(self) -> int:
        """Number of nodes."""
        return len(self.names)

    @functools.cached_property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        """``predecessors[v]``: the nodes whose values node v reads, ascending."""
        preds: list[list[int]] = [[] for _ in range(self.size)]
        for u, v in self.edges:
            preds[v].append(u)
        return tuple(tuple(p) for p in preds)

    @functools.cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """``successors[u]``: the nodes that read u's value, ascending."""
        succs: list[list[int]] = [[] for _ in range(self.size)]
        for u, v in self.edges:
            succs[u].append(v)
        return tuple(tuple(s) for s in succs)

    @functools.cached_property
    def forward_nodes(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.size) if not self.is_backward[i])

    @functools.cached_property
    def backward_nodes(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.size) if self.is_backward[i])

    @functools.cached_property
    def backward_of(self) -> Mapping[int, int]:
        """Forward node -> the backward node computing its gradient (inverse of forward_of)."""
        return MappingProxyType({f: b for b, f in self.forward_of.items()})

    @functools.cached_property
    def total_cost(self) -> float:
        """Sum of node costs: the cost of running every node once (no rematerialization)."""
        return float(sum(self.cost))

    @functools.cached_property
    def forward_articulation_points(self) -> tuple[int, ...]:
        """Forward nodes whose removal disconnects the (undirected) forward graph.

        These are the candidate checkpoints of Checkmate's "AP" generalization of the
        chain heuristics: every path from the inputs to the loss passes through each of
        them, so the forward graph splits into independent segments at them.
        """
        forward = set(self.forward_nodes)
        undirected = nx.Graph()
        undirected.add_nodes_from(forward)
        undirected.add_edges_from((u, v) for u, v in self.edges if u in forward and v in forward)
        return tuple(sorted(nx.articulation_points(undirected)))

    def to_networkx(self) -> nx.DiGraph:
        """A fresh networkx view with node attributes, for analysis and plotting."""
        digraph = nx.DiGraph()
        for i in range(self.size):
            digraph.add_node(
                i,
                name=self.names[i],
                cost=self.cost[i],
                output_bytes=self.output_bytes[i],
                workspace_bytes=self.workspace_bytes[i],
                backward=self.is_backward[i],
            )
        digraph.add_edges_from(self.edges)
        return digraph

    # ----- serialization -----

    def to_dict(self) -> dict:
        """The graph in tfremat's JSON format (``GRAPH_FORMAT``)."""
        return {
            "format": GRAPH_FORMAT,
            "name": self.name,
            "fixed_bytes": self.fixed_bytes,
            "loss_node": self.loss_node,
            "nodes": [
                {
                    "id": i,
                    "name": self.names[i],
                    "cost": self.cost[i],
                    "output_bytes": self.output_bytes[i],
                    "workspace_bytes": self.workspace_bytes[i],
                    "backward": self.is_backward[i],
                    "forward_of": self.forward_of.get(i),
                }
                for i in range(self.size)
            ],
            "edges": [list(e) for e in self.edges],
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """Serializes to JSON; also writes it to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable hash of everything a schedule depends on (not the name)."""
        payload = self.to_dict()
        payload.pop("name")
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def __eq__(self, other) -> bool:
        return isinstance(other, DFGraph) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return (
            f"DFGraph(name={self.name!r}, nodes={self.size}, edges={len(self.edges)}, "
            f"backward={len(self.backward_nodes)}, fixed_bytes={self.fixed_bytes})"
        )


class _OrderError(GraphError):
    """A given execution order that does not fit its graph (so a loader can say where the
    order came from, and other graph errors keep their own message)."""


def _check_order(order: list, digraph: nx.DiGraph) -> None:
    """Raises _OrderError unless ``order`` lists every node of ``digraph`` once, edges forward."""
    if len(order) != digraph.number_of_nodes() or set(order) != set(digraph.nodes):
        missing = sorted(set(digraph.nodes) - set(order), key=str)[:3]
        extra = sorted(set(order) - set(digraph.nodes), key=str)[:3]
        raise _OrderError(
            f"the execution order lists {len(order)} ids for {digraph.number_of_nodes()} nodes "
            f"(missing {missing}, unknown {extra}, or repeated ids); it must list every node once"
        )
    position = {node: i for i, node in enumerate(order)}
    for u, v in digraph.edges:
        if position[u] > position[v]:
            raise _OrderError(
                f"the execution order puts node {v!r} before its input {u!r}; it must be a "
                f"topological order of the graph"
            )


def _from_tfremat_dict(data: dict) -> DFGraph:
    nodes = sorted(data["nodes"], key=lambda node: node["id"])
    if [node["id"] for node in nodes] != list(range(len(nodes))):
        raise GraphError("node ids must be exactly 0..n-1")
    return DFGraph(
        names=[node["name"] for node in nodes],
        edges=[tuple(e) for e in data["edges"]],
        cost=[node["cost"] for node in nodes],
        output_bytes=[node["output_bytes"] for node in nodes],
        workspace_bytes=[node.get("workspace_bytes", 0) for node in nodes],
        is_backward=[node.get("backward", False) for node in nodes],
        loss_node=data.get("loss_node"),
        forward_of={node["id"]: node["forward_of"] for node in nodes if node.get("forward_of") is not None},
        fixed_bytes=data.get("fixed_bytes", 0),
        name=data.get("name", "graph"),
    )


def _from_checkmate_dict(data: dict, name: str) -> DFGraph:
    """Checkmate's training graphs: ``X_backward`` is the gradient of ``X``; ``Loss`` is the loss."""
    nodes = sorted(data["nodes"], key=lambda node: node["id"])
    names = [node["name"] for node in nodes]
    index = {n: i for i, n in enumerate(names)}
    forward_of = {}
    for i, n in enumerate(names):
        if n.endswith("_backward") and n[: -len("_backward")] in index:
            forward_of[i] = index[n[: -len("_backward")]]
    loss = [i for i, n in enumerate(names) if n == "Loss"]
    return DFGraph(
        names=names,
        edges=[(link["source"], link["target"]) for link in data["links"]],
        cost=[node["cost_cpu"] for node in nodes],
        output_bytes=[node["cost_ram"] for node in nodes],
        is_backward=[node["backward"] for node in nodes],
        loss_node=loss[0] if loss else None,
        forward_of=forward_of,
        name=data.get("graph", {}).get("name", name),
    )


def _from_moccasin_dict(data: dict, name: str, order: str) -> DFGraph:
    """Moccasin's random layered DAGs: arbitrary ids, every node "forward", no loss.

    Their documents carry the execution order they were published with (``graph.order``);
    Moccasin's evaluation runs them in it and takes its budgets from the peak in it.
    """
    ids = [node["name"] for node in data["nodes"]]
    edges = [(link["0"], link["1"]) for link in data["links"]]
    stored = data.get("graph", {}).get("order") if order == "file" else None
    try:
        if stored is not None and (
            not isinstance(stored, list) or not all(isinstance(node, (int, str)) for node in stored)
        ):
            raise _OrderError(f"it must be a list of node ids, got {str(stored)[:60]}")
        return DFGraph.from_unordered(
            ids,
            edges,
            order=stored,
            names=[str(i) for i in ids],
            cost=[node["duration"] for node in data["nodes"]],
            output_bytes=[node["out_cost"] for node in data["nodes"]],
            fixed_bytes=sum(node.get("param_cost", 0) for node in data["nodes"]),
            name=data.get("graph", {}).get("name", name),
        )
    except _OrderError as exc:
        raise GraphError(
            f"{name}: graph.order: {exc}; load it with order='topological' (--order=topological "
            f"on the command line) to number the nodes by networkx.topological_sort instead"
        ) from None


LOAD_ORDERS = ("file", "topological")


def load_graph(source: str | os.PathLike | dict, order: str = "file") -> DFGraph:
    """Reads a graph from a JSON file (or an already parsed dict).

    Accepts tfremat's own format and the two node-link formats of ``shared/graphs``.

    Args:
        source: a path, or a parsed document.
        order: the execution order to number the nodes in (Checkmate's stages follow it,
            and percentage budgets are taken from the checkpoint-all peak in it). "file":
            the document's own order, which is its node numbering for tfremat's and
            Checkmate's formats and, for a Moccasin graph, its ``graph.order`` (the order
            Moccasin's evaluation uses; ``networkx.topological_sort`` when it has none).
            "topological": ``networkx.topological_sort`` of a Moccasin graph even where
            it stores an order (the other formats are numbered topologically already).

    Raises:
        GraphError: the document is none of the known formats, the graph is invalid, or
            a Moccasin graph's stored order is not an execution order of it.
        ValueError: ``order`` is not one of ``LOAD_ORDERS``.
    """
    if order not in LOAD_ORDERS:
        raise ArgumentError(f"order={order!r}: must be one of {', '.join(map(repr, LOAD_ORDERS))}")
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            data = json.load(f)
        label = os.path.splitext(os.path.basename(os.fspath(source)))[0]
    else:
        data, label = source, "graph"
    if not isinstance(data, dict):
        raise GraphError(f"{label}: a graph document is a JSON object, got a JSON {type(data).__name__}")
    kind = graph_format(data)
    if kind == "tfremat":
        return _from_tfremat_dict(data)
    if kind == "checkmate":
        return _from_checkmate_dict(data, label)
    if kind == "moccasin":
        return _from_moccasin_dict(data, label, order)
    raise GraphError(
        f"{label}: unknown graph format; expected {GRAPH_FORMAT!r}, a Checkmate node-link graph "
        "(cost_cpu/cost_ram) or a Moccasin node-link graph (duration/out_cost)"
    )


def graph_format(data: dict) -> str | None:
    """Which known format a parsed graph document is: "tfremat", "checkmate", "moccasin" or None."""
    if data.get("format") == GRAPH_FORMAT:
        return "tfremat"
    nodes = data.get("nodes") or []
    if nodes and "cost_cpu" in nodes[0]:
        return "checkmate"
    if nodes and "duration" in nodes[0]:
        return "moccasin"
    return None


def file_node_ids(graph: DFGraph, data: dict) -> list:
    """The source document's node id at each execution position of ``graph`` (loaded from ``data``).

    Moccasin graphs are renumbered in an execution order on load and keep their file ids
    as node names; the other formats are already numbered in execution order.
    """
    if graph_format(data) == "moccasin":
        return [int(name) if name.lstrip("-").isdigit() else name for name in graph.names]
    return list(range(graph.size))
