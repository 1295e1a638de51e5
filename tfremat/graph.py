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

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import networkx as nx

from tfremat.errors import ArgumentError, GraphError, is_int, is_number

__all__ = ["DFGraph", "Implementation", "load_graph", "graph_format", "file_node_ids", "GRAPH_FORMAT", "LOAD_ORDERS"]

GRAPH_FORMAT = "tfremat.graph/1"


@dataclasses.dataclass(frozen=True)
class Implementation:
    """Another way to run a forward node and its gradient (MONeT, Shah et al. 2021, sec. 4:
    implementations that keep different tensors for the backward pass and cost differently).

    The graph's own numbers are the node's default implementation; an alternative replaces
    them where a schedule chooses it (:meth:`DFGraph.with_implementations`).

    Attributes:
        name: its name, unique among the node's alternatives (not ``"default"``).
        residual_bytes: bytes the forward keeps that only the backward reads (a ReLU's
            1-byte mask, a pooling's window index), besides the node's output.
        reads_output: the backward reads the node's output (an output-activated batch norm).
        reads_inputs: the backward reads the node's inputs.
        cost, backward_cost: forward and backward compute cost.
        workspace_bytes, backward_workspace_bytes: transient bytes of each while it runs.
    """

    name: str
    residual_bytes: int
    reads_output: bool
    reads_inputs: bool
    cost: float
    backward_cost: float
    workspace_bytes: int = 0
    backward_workspace_bytes: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name == "default":
            raise GraphError(f"an implementation needs a name other than 'default', got {self.name!r}")
        where = f"implementation {self.name!r}"
        for field in ("residual_bytes", "workspace_bytes", "backward_workspace_bytes"):
            object.__setattr__(self, field, _amount(getattr(self, field), f"{where}: {field}", whole=True))
        for field in ("cost", "backward_cost"):
            object.__setattr__(self, field, _amount(getattr(self, field), f"{where}: {field}", whole=False))
        for field in ("reads_output", "reads_inputs"):
            if not isinstance(getattr(self, field), bool):
                raise GraphError(f"{where}: {field} must be True or False, got {getattr(self, field)!r}")


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
            A forward node may have two: a backward split into a weight-gradient node and
            an input-gradient node after it (MONeT, Shah et al. 2021, appendix D: the
            forward input can be freed once the weight gradient is taken). Such a node
            has neither residual bytes nor implementations.
        residual_bytes: per node, the part of ``output_bytes`` that only the node's
            backward node reads: the internal tensors a forward node's tape keeps for its
            gradient when the gradient does not read the output (default all 0). The rest,
            the output, is read by the node's other successors. The two parts are freed
            separately (:mod:`tfremat.plan.execution`), so a schedule keeps attention's
            softmax residual for its gradient without keeping the softmax's output, and
            computing the node makes both (Beaumont et al. 2021, sec. 3: a forward run
            with its checkpoints, F_ck, against one without, F_no).
        fixed_bytes: memory resident for the whole step (parameters, their gradients,
            optimizer slots, the input batch), counted in every peak.
        name: a label for reports.
        implementations: per forward node that has a backward node, its alternative
            :class:`Implementation` s (the graph's numbers are the default); none by default.
        weight_grad_bytes: per forward node, the bytes of the weight gradients its backward
            node makes, counted in that node's workspace (every backward node's, for a split
            backward); default all 0 (weight gradients counted in ``fixed_bytes``, or none).
            They live on after the backward node when the node or its backward nodes run
            again: the layer's optimizer update waits for the layer's last statement, since
            a later forward run must read the weights it was planned with
            (:func:`tfremat.static_graph.interpreter.order_updates`). The simulator counts
            them until then (:func:`tfremat.plan.simulator.simulate`).
        weight_grads_to_end: True when the optimizer updates all run after the backward pass
            (extraction's ``weight_grads="fixed"``: a loss-scale optimizer, gradient
            clipping, accumulation, a shared layer, several replicas): then each forward
            node's ``weight_grad_bytes``, made by its (first) backward node, stay from that
            node's first run to the end of the step, instead of being counted as fixed for
            the whole step. False (default): they live as described above.
        view_of: maps a view node to the node whose output buffer its output shares (a
            ``Flatten`` or ``Reshape``: TensorFlow's reshape allocates nothing). The view
            reads that node, has the size of its output part (the whole value when it has
            no residual bytes) and neither residual bytes nor implementations, nor does
            its source have implementations. A buffer counts once while any value sharing
            it is resident; a source computed again while an older view of it is resident
            makes a new buffer (:func:`tfremat.plan.simulator.simulate`). Default: none.

    Raises:
        GraphError: naming the node, for a cycle, an edge against the order, a dangling
            edge or one that is not a pair of ints, a cost or size that is not a finite
            number >= 0, a byte count that is not whole, or inconsistent lengths.
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
        "residual_bytes",
        "fixed_bytes",
        "name",
        "implementations",
        "weight_grad_bytes",
        "weight_grads_to_end",
        "view_of",
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
        residual_bytes: Sequence[int] | None = None,
        implementations: Mapping[int, Sequence[Implementation]] | None = None,
        weight_grad_bytes: Sequence[int] | None = None,
        view_of: Mapping[int, int] | None = None,
        weight_grads_to_end: bool = False,
    ):
        names = tuple(str(x) for x in names)
        n = len(names)
        set_ = object.__setattr__
        set_(self, "names", names)
        set_(self, "edges", _edge_pairs(edges))
        set_(self, "cost", _per_node("cost", cost, names, whole=False))
        set_(self, "output_bytes", _per_node("output_bytes", output_bytes, names, whole=True))
        set_(self, "workspace_bytes", _per_node(
            "workspace_bytes", workspace_bytes if workspace_bytes is not None else [0] * n, names, whole=True,
        ))
        is_backward = tuple(bool(b) for b in (is_backward if is_backward is not None else [False] * n))
        if len(is_backward) != n:
            raise GraphError(f"is_backward has {len(is_backward)} entries but the graph has {n} nodes")
        set_(self, "is_backward", is_backward)
        set_(self, "loss_node", None if loss_node is None else _node_id(loss_node, "loss_node"))
        set_(self, "forward_of", MappingProxyType({
            _node_id(k, "forward_of"): _node_id(v, "forward_of") for k, v in (forward_of or {}).items()
        }))
        set_(self, "residual_bytes", _per_node(
            "residual_bytes", residual_bytes if residual_bytes is not None else [0] * n, names, whole=True,
        ))
        set_(self, "fixed_bytes", _amount(fixed_bytes, "fixed_bytes", whole=True))
        set_(self, "name", str(name))
        set_(self, "implementations", MappingProxyType({
            _node_id(node, "implementations"): tuple(_implementation(i) for i in alternatives)
            for node, alternatives in (implementations or {}).items() if alternatives
        }))
        set_(self, "weight_grad_bytes", _per_node(
            "weight_grad_bytes", weight_grad_bytes if weight_grad_bytes is not None else [0] * n, names, whole=True,
        ))
        if not isinstance(weight_grads_to_end, bool):
            raise GraphError(f"weight_grads_to_end must be True or False, got {weight_grads_to_end!r}")
        set_(self, "weight_grads_to_end", bool(weight_grads_to_end))
        set_(self, "view_of", MappingProxyType({
            _node_id(k, "view_of"): _node_id(v, "view_of") for k, v in (view_of or {}).items()
        }))
        self._validate()

    def __setattr__(self, key, value):
        raise AttributeError(f"DFGraph is immutable; cannot set {key!r}")

    def _validate(self) -> None:
        n = self.size
        if n == 0:
            raise GraphError("a graph needs at least one node")
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
        for node, backwards in self.backward_nodes_of.items():
            if len(backwards) > 1 and (self.residual_bytes[node] or node in self.implementations):
                raise GraphError(f"node {node} ({self.names[node]}) has {len(backwards)} backward nodes "
                                 "(forward_of) and residual bytes or implementations: those need one", node=node)
        for i, residual in enumerate(self.residual_bytes):
            if not residual:
                continue
            if residual > self.output_bytes[i]:
                raise GraphError(f"node {i} ({self.names[i]}) has residual_bytes {residual} > output_bytes "
                                 f"{self.output_bytes[i]}", node=i)
            b = self.backward_of.get(i)
            if b is None or b not in self.successors[i]:
                raise GraphError(f"node {i} ({self.names[i]}) has residual bytes but no backward node that reads "
                                 "it (forward_of and an edge to it)", node=i)
        if self.loss_node is not None and not self.is_backward[self.loss_node]:
            raise GraphError(f"loss node {self.loss_node} must be flagged backward (Checkmate's convention)", node=self.loss_node)
        for node, grads in enumerate(self.weight_grad_bytes):
            if not grads:
                continue
            if node not in self.backward_nodes_of:
                raise GraphError(f"node {node} ({self.names[node]}) has weight_grad_bytes {grads} but is not a forward "
                                 "node with a backward node (forward_of)", node=node)
            nodes = self.backward_nodes_of[node]
            if len(nodes) > 1 and nodes != tuple(range(nodes[0], nodes[0] + len(nodes))):
                raise GraphError(f"node {node} ({self.names[node]}) has weight_grad_bytes and a split backward "
                                 f"{list(nodes)} whose nodes are not consecutive; number them one after the other",
                                 node=node)
            short = [b for b in nodes if self.workspace_bytes[b] < grads]
            if short:
                raise GraphError(f"node {node} ({self.names[node]}) has weight_grad_bytes {grads}, more than the "
                                 f"workspace_bytes {self.workspace_bytes[short[0]]} of its backward node {short[0]}, "
                                 "which counts them", node=node)
        for view, source in self.view_of.items():
            if not (0 <= view < n and 0 <= source < n) or source not in self.predecessors[view]:
                raise GraphError(f"view_of maps {view} -> {source}: a view must read the node it is a view of",
                                 node=view if 0 <= view < n else None)
            if self.residual_bytes[view] or view in self.implementations or source in self.implementations:
                raise GraphError(f"view_of: node {view} ({self.names[view]}) is a view of node {source}; a view has "
                                 "no residual bytes and neither it nor its source has implementations", node=view)
            shared = self.part_bytes(source, self.shared_part(source))
            if self.output_bytes[view] != shared:
                raise GraphError(f"view_of: node {view} ({self.names[view]}) has {self.output_bytes[view]} output "
                                 f"bytes, but the buffer of node {source} it shares has {shared}", node=view)
        for node, alternatives in self.implementations.items():
            if not (0 <= node < n) or self.is_backward[node] or node not in self.backward_of:
                raise GraphError(f"implementations: node {node} is not a forward node with a backward node", node=node)
            names = [i.name for i in alternatives]
            if len(set(names)) != len(names):
                raise GraphError(f"node {node} ({self.names[node]}) repeats an implementation name: {names}", node=node)

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
        known = set(node_ids)
        if len(known) != len(node_ids):
            repeated = sorted({node for node in node_ids if list(node_ids).count(node) > 1}, key=str)[:3]
            raise GraphError(f"node ids must be distinct; repeated: {repeated}")
        edges = list(edges)
        for u, v in edges:
            for end in (u, v):
                if end not in known:
                    raise GraphError(f"edge ({u!r}, {v!r}) is dangling: node {end!r} does not exist")
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
        per_node = ("names", "cost", "output_bytes", "workspace_bytes", "is_backward", "residual_bytes",
                    "weight_grad_bytes")
        reordered = {}
        for key, value in fields.items():
            if key in per_node and value is not None:
                reordered[key] = [value[source_index[node]] for node in order]
            else:
                reordered[key] = value
        reordered.setdefault("names", [str(node) for node in order])
        if reordered.get("loss_node") is not None:
            reordered["loss_node"] = position[node_ids[reordered["loss_node"]]]
        if reordered.get("implementations"):
            reordered["implementations"] = {
                position[node_ids[k]]: v for k, v in reordered["implementations"].items()
            }
        if reordered.get("forward_of"):
            reordered["forward_of"] = {
                position[node_ids[b]]: position[node_ids[f]] for b, f in reordered["forward_of"].items()
            }
        if reordered.get("view_of"):
            reordered["view_of"] = {
                position[node_ids[v]]: position[node_ids[u]] for v, u in reordered["view_of"].items()
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
    def backward_nodes_of(self) -> Mapping[int, tuple[int, ...]]:
        """Forward node -> its backward nodes (``forward_of`` inverted), in id order."""
        nodes: dict[int, list[int]] = {}
        for b, f in sorted(self.forward_of.items()):
            nodes.setdefault(f, []).append(b)
        return MappingProxyType({f: tuple(bs) for f, bs in nodes.items()})

    @functools.cached_property
    def backward_of(self) -> Mapping[int, int]:
        """Forward node -> the backward node computing its input gradients: its only one,
        or the last of a split backward (:attr:`backward_nodes_of`)."""
        return MappingProxyType({f: bs[-1] for f, bs in self.backward_nodes_of.items()})

    @functools.cached_property
    def inputs_read_with_forward(self) -> Mapping[int, tuple[int, ...]]:
        """Backward node -> the inputs of its forward node that it reads, for each backward
        node that also reads the forward node's value (output or residuals) and at least
        one of its inputs: a dense layer with an activation, a layer norm.

        The compiled step takes such a gradient on the tape that recorded the forward
        node's value, which read its inputs then; if an input was computed again (or
        brought back from the host) since, that tape reads a copy the plan has freed, and
        the gradient needs the forward node run again on the new copy
        (:func:`tfremat.plan.schedule.with_fresh_gradient_reads`)."""
        reads: dict[int, tuple[int, ...]] = {}
        for b, f in self.forward_of.items():
            if f not in self.predecessors[b]:
                continue
            inputs = tuple(x for x in self.predecessors[f] if not self.is_backward[x] and x in self.predecessors[b])
            if inputs:
                reads[b] = inputs
        return MappingProxyType(reads)

    def part_read_by(self, node: int, reader: int) -> str | None:
        """Which part of ``node``'s value ``reader`` reads: ``"residual"`` (the node's own
        backward node, when the node has residual bytes), ``"output"`` (any other reader of
        such a node), or None (the whole value of a node without residual bytes)."""
        if not self.residual_bytes[node]:
            return None
        return "residual" if self.backward_of.get(node) == reader else "output"

    def part_bytes(self, node: int, part: str | None) -> int:
        """Bytes of one part of ``node``'s value (None: the whole value)."""
        if part is None:
            return self.output_bytes[node]
        if part == "residual":
            return self.residual_bytes[node]
        return self.output_bytes[node] - self.residual_bytes[node]

    def shared_part(self, node: int) -> str | None:
        """The part of ``node``'s value that views of it share (:attr:`view_of`): its
        output part when it has residual bytes, else the whole value (None)."""
        return "output" if self.residual_bytes[node] else None

    def value_parts(self, node: int) -> tuple:
        """The parts of ``node``'s value that are freed separately: ``("output", "residual")``
        when it has residual bytes, else ``(None,)`` (the whole value)."""
        return ("output", "residual") if self.residual_bytes[node] else (None,)

    def replaced(self, **changes) -> "DFGraph":
        """The graph with the constructor arguments ``changes`` and every other field as it
        is, checked again: a rebuild that lists the fields by hand drops those it forgets
        (a test graph without ``view_of`` counted a view twice)."""
        fields = dict(
            names=self.names, edges=self.edges, cost=self.cost, output_bytes=self.output_bytes,
            workspace_bytes=self.workspace_bytes, is_backward=self.is_backward, loss_node=self.loss_node,
            forward_of=dict(self.forward_of), fixed_bytes=self.fixed_bytes, name=self.name,
            residual_bytes=self.residual_bytes, implementations=self.implementations,
            weight_grad_bytes=self.weight_grad_bytes, view_of=dict(self.view_of),
            weight_grads_to_end=self.weight_grads_to_end,
        )
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise GraphError(f"DFGraph has no field {', '.join(unknown)}")
        return DFGraph(**{**fields, **changes})

    def with_views(self, candidates: Mapping[int, int]) -> "DFGraph":
        """The graph with those of ``candidates`` (view node -> the node it may share the
        buffer of, e.g. from :func:`tfremat.extract.views.view_input`) that :attr:`view_of`
        allows: the view reads the node, has the bytes of its output part and no residual
        bytes, and neither has implementations. The others are left out, so their values
        keep buffers of their own (conservative)."""
        views = dict(self.view_of)
        for view, source in candidates.items():
            if (0 <= view < self.size and 0 <= source < self.size and source in self.predecessors[view]
                    and not self.residual_bytes[view] and view not in self.implementations
                    and source not in self.implementations
                    and self.output_bytes[view] == self.part_bytes(source, self.shared_part(source))):
                views[view] = source
        if views == dict(self.view_of):
            return self
        return self.replaced(view_of=views)

    def with_implementations(self, choice: Mapping[int, str] | None) -> "DFGraph":
        """The graph under ``choice`` (node -> implementation name; a node not named, or
        named ``"default"``, keeps the graph's own numbers), without alternatives.

        A chosen :class:`Implementation` sets the node's and its backward node's costs and
        workspaces. The node's value is its output part plus the implementation's residual
        bytes: a residual that the backward reads alone is a part of its own
        (:attr:`residual_bytes`); with ``reads_output`` the backward reads the whole value.
        The backward node reads the node only when it reads its output or a residual, and
        the node's inputs only with ``reads_inputs``.

        Raises:
            GraphError: a node without alternatives, or a name it does not have.
        """
        choice = {node: name for node, name in (choice or {}).items() if name != "default"}
        return self._derived(choice) if choice else self

    def _derived(self, choice: Mapping[int, str]) -> "DFGraph":
        cost, output, work = list(self.cost), list(self.output_bytes), list(self.workspace_bytes)
        residual = list(self.residual_bytes)
        edges = set(self.edges)
        for node, name in choice.items():
            alternatives = {i.name: i for i in self.implementations.get(node, ())}
            if name not in alternatives:
                raise GraphError(f"node {node} has no implementation {name!r}; it has "
                                 f"{['default', *alternatives] if node in self.implementations else ['default']}",
                                 node=node if is_int(node) and 0 <= node < self.size else None)
            chosen, backward = alternatives[name], self.backward_of[node]
            output_part = self.output_bytes[node] - self.residual_bytes[node]
            output[node] = output_part + chosen.residual_bytes
            residual[node] = 0 if chosen.reads_output else chosen.residual_bytes
            edges.discard((node, backward))
            if chosen.reads_output or chosen.residual_bytes:
                edges.add((node, backward))
            for source in self.predecessors[node]:
                if not self.is_backward[source]:
                    edges.discard((source, backward))
                    if chosen.reads_inputs:
                        edges.add((source, backward))
            cost[node], cost[backward] = chosen.cost, chosen.backward_cost
            work[node], work[backward] = chosen.workspace_bytes, chosen.backward_workspace_bytes
        return DFGraph(self.names, sorted(edges), cost, output, work, self.is_backward, self.loss_node,
                       dict(self.forward_of), self.fixed_bytes, self.name, residual_bytes=residual,
                       weight_grad_bytes=self.weight_grad_bytes, view_of=dict(self.view_of),
                       weight_grads_to_end=self.weight_grads_to_end)

    @functools.cached_property
    def weight_grads_to_end_bytes(self) -> int:
        """The weight-gradient bytes that stay to the end of the step once made (all of
        ``weight_grad_bytes`` with :attr:`weight_grads_to_end`, else 0): what planners that
        cannot follow their lifetime (the chain DPs) count as fixed, conservatively."""
        return int(sum(self.weight_grad_bytes)) if self.weight_grads_to_end else 0

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
            **({"weight_grads_to_end": True} if self.weight_grads_to_end else {}),
            "nodes": [
                {
                    "id": i,
                    "name": self.names[i],
                    "cost": self.cost[i],
                    "output_bytes": self.output_bytes[i],
                    "workspace_bytes": self.workspace_bytes[i],
                    "backward": self.is_backward[i],
                    "forward_of": self.forward_of.get(i),
                    **({"residual_bytes": self.residual_bytes[i]} if self.residual_bytes[i] else {}),
                    **({"implementations": [dataclasses.asdict(a) for a in self.implementations[i]]}
                       if i in self.implementations else {}),
                    **({"weight_grad_bytes": self.weight_grad_bytes[i]} if self.weight_grad_bytes[i] else {}),
                    **({"view_of": self.view_of[i]} if i in self.view_of else {}),
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
        """A stable hash of everything a schedule depends on: not the graph's name nor its
        nodes' names (Keras numbers auto-named layers anew on every rebuild, ``dense`` then
        ``dense_7``, and a rebuilt model must find its cached schedule)."""
        payload = self.to_dict()
        payload.pop("name")
        for node in payload["nodes"]:
            node.pop("name")
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


# The largest byte count a graph may hold: beyond any device, and small enough that the
# simulator's int64 sums over tens of thousands of values cannot overflow.
_MAX_BYTES = 2**48


def _amount(value, what: str, whole: bool, node: int | None = None) -> int | float:
    """``value`` as a cost (float) or a byte count (int, ``whole``), checked before it is
    converted: int() of infinity raises OverflowError and of NaN a bare ValueError, and of
    2.7 bytes gives 2, hiding what is more likely a unit mix-up than a rounding."""
    if not is_number(value):
        raise GraphError(f"{what} must be a number, got {value!r}", node=node)
    if not (is_int(value) or math.isfinite(value)) or value < 0:
        raise GraphError(f"{what} must be finite and >= 0, got {value!r}", node=node)
    if not whole:
        return float(value)
    if not (is_int(value) or float(value).is_integer()):
        raise GraphError(f"{what} must be a whole number of bytes, got {value!r}", node=node)
    if value > _MAX_BYTES:
        raise GraphError(f"{what} is {value!r} bytes, more than any device holds (2**48, 256 TiB): check the "
                         "unit the graph file was written in", node=node)
    return int(value)


def _per_node(field: str, values: Iterable, names: tuple[str, ...], whole: bool) -> tuple:
    """One checked :func:`_amount` per node, the message naming the node and ``field``."""
    values = list(values)
    if len(values) != len(names):
        raise GraphError(f"{field} has {len(values)} entries but the graph has {len(names)} nodes")
    return tuple(_amount(value, f"node {i} ({names[i]}): {field}", whole, node=i) for i, value in enumerate(values))


def _node_id(value, what: str) -> int:
    """A node id given as an int (numpy's included); a float id would be silently truncated."""
    if not is_int(value):
        raise GraphError(f"{what}: node ids are ints (0..n-1), got {value!r}")
    return int(value)


def _edge_pairs(edges: Iterable) -> tuple[tuple[int, int], ...]:
    """The edges as sorted, distinct ``(source, target)`` pairs of ints."""
    pairs = set()
    for edge in edges:
        try:
            u, v = edge
        except (TypeError, ValueError):
            raise GraphError(f"edge {edge!r} is not a pair (source, target) of node ids") from None
        pairs.add((_node_id(u, f"edge {edge!r}"), _node_id(v, f"edge {edge!r}")))
    return tuple(sorted(pairs))


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


def _records(data: dict, key: str, label: str) -> list[dict]:
    """``data[key]``, a list of JSON objects (nodes or links), or a GraphError saying what is wrong."""
    records = data.get(key)
    if not isinstance(records, list):
        raise GraphError(f"{label}: the document needs a list {key!r}, got {str(records)[:60]}")
    for position, record in enumerate(records):
        if not isinstance(record, dict):
            raise GraphError(f"{label}: {key}[{position}] is not a JSON object: {str(record)[:60]}")
    return records


def _field(record: dict, key: str, where: str):
    """``record[key]``, or a GraphError naming the record (``where``) and the missing field,
    rather than a bare KeyError from deep in a loader."""
    try:
        return record[key]
    except KeyError:
        raise GraphError(f"{where} has no {key!r} field") from None


def _implementation(value) -> Implementation:
    """An :class:`Implementation`, or one from its JSON object."""
    if isinstance(value, Implementation):
        return value
    if not isinstance(value, Mapping):
        raise GraphError(f"an implementation is an object of Implementation's fields, got {value!r:.80}")
    fields = {f.name for f in dataclasses.fields(Implementation)}
    unknown = set(value) - fields
    if unknown:
        raise GraphError(f"implementation {value.get('name')!r} has unknown fields {sorted(unknown)}")
    try:
        return Implementation(**value)
    except TypeError as exc:
        raise GraphError(f"implementation {value.get('name')!r}: {exc}") from None


def _numbered(nodes: list[dict], label: str) -> list[dict]:
    """The nodes sorted by their ``id``, which must be exactly 0..n-1 (the execution order)."""
    ids = [_field(node, "id", f"{label}: nodes[{position}]") for position, node in enumerate(nodes)]
    if not all(is_int(i) for i in ids) or sorted(ids) != list(range(len(nodes))):
        raise GraphError(f"{label}: node ids must be exactly 0..n-1")
    return sorted(nodes, key=lambda node: node["id"])


def _from_tfremat_dict(data: dict, label: str) -> DFGraph:
    nodes = _numbered(_records(data, "nodes", label), label)
    where = [f"{label}: node {node['id']}" for node in nodes]
    edges = data.get("edges")
    if not isinstance(edges, list):
        raise GraphError(f"{label}: the document needs a list 'edges' of [source, target] pairs")
    return DFGraph(
        names=[_field(node, "name", w) for node, w in zip(nodes, where)],
        edges=edges,
        cost=[_field(node, "cost", w) for node, w in zip(nodes, where)],
        output_bytes=[_field(node, "output_bytes", w) for node, w in zip(nodes, where)],
        workspace_bytes=[node.get("workspace_bytes", 0) for node in nodes],
        is_backward=[node.get("backward", False) for node in nodes],
        loss_node=data.get("loss_node"),
        forward_of={node["id"]: node["forward_of"] for node in nodes if node.get("forward_of") is not None},
        fixed_bytes=data.get("fixed_bytes", 0),
        name=data.get("name", "graph"),
        residual_bytes=[node.get("residual_bytes", 0) for node in nodes],
        implementations={node["id"]: node["implementations"] for node in nodes if node.get("implementations")},
        weight_grad_bytes=[node.get("weight_grad_bytes", 0) for node in nodes],
        view_of={node["id"]: node["view_of"] for node in nodes if node.get("view_of") is not None},
        weight_grads_to_end=data.get("weight_grads_to_end", False),
    )


def _from_checkmate_dict(data: dict, name: str) -> DFGraph:
    """Checkmate's training graphs: ``X_backward`` is the gradient of ``X``; ``Loss`` is the loss."""
    nodes = _numbered(_records(data, "nodes", name), name)
    where = [f"{name}: node {node['id']}" for node in nodes]
    names = [str(_field(node, "name", w)) for node, w in zip(nodes, where)]
    index = {n: i for i, n in enumerate(names)}
    forward_of = {}
    for i, n in enumerate(names):
        if n.endswith("_backward") and n[: -len("_backward")] in index:
            forward_of[i] = index[n[: -len("_backward")]]
    loss = [i for i, n in enumerate(names) if n == "Loss"]
    links = _records(data, "links", name)
    return DFGraph(
        names=names,
        edges=[(_field(link, "source", f"{name}: links[{p}]"), _field(link, "target", f"{name}: links[{p}]"))
               for p, link in enumerate(links)],
        cost=[_field(node, "cost_cpu", w) for node, w in zip(nodes, where)],
        output_bytes=[_field(node, "cost_ram", w) for node, w in zip(nodes, where)],
        is_backward=[_field(node, "backward", w) for node, w in zip(nodes, where)],
        loss_node=loss[0] if loss else None,
        forward_of=forward_of,
        name=data.get("graph", {}).get("name", name),
    )


def _from_moccasin_dict(data: dict, name: str, order: str) -> DFGraph:
    """Moccasin's random layered DAGs: arbitrary ids, every node "forward", no loss.

    Their documents carry the execution order they were published with (``graph.order``);
    Moccasin's evaluation runs them in it and takes its budgets from the peak in it.
    """
    nodes = _records(data, "nodes", name)
    ids = [_field(node, "name", f"{name}: nodes[{p}]") for p, node in enumerate(nodes)]
    where = [f"{name}: node {i!r}" for i in ids]
    links = _records(data, "links", name)
    edges = [(_field(link, "0", f"{name}: links[{p}]"), _field(link, "1", f"{name}: links[{p}]"))
             for p, link in enumerate(links)]
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
            cost=[_field(node, "duration", w) for node, w in zip(nodes, where)],
            output_bytes=[_field(node, "out_cost", w) for node, w in zip(nodes, where)],
            fixed_bytes=sum(_amount(node.get("param_cost", 0), f"{w}: param_cost", whole=True)
                            for node, w in zip(nodes, where)),
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
        return _from_tfremat_dict(data, label)
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
    nodes = data.get("nodes")
    first = nodes[0] if isinstance(nodes, list) and nodes and isinstance(nodes[0], dict) else {}
    if "cost_cpu" in first:
        return "checkmate"
    if "duration" in first:
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
