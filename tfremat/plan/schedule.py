"""Schedules: Checkmate's stage matrices R and S, their validation, and ``solve R given S``.

The stage model (Checkmate, Jain et al. 2020, sec. 4): a step runs in ``T = n`` stages and
stage ``t`` computes node ``t`` for the first time (the frontier advances one node per
stage). ``R[t, i]`` says node ``i`` is (re)computed in stage ``t``; ``S[t, i]`` says the value
of node ``i`` is kept in memory from stage ``t-1`` into stage ``t``. Both are lower
triangular (``R[t, i] = 0`` for ``i > t``, ``S[t, i] = 0`` for ``i >= t``). Within a stage,
nodes run in increasing id order.

Offloading (Beaumont et al. 2021, sec. 3.1's operations ``O`` and ``P``) adds a third
matrix: ``H[t, i]`` says a copy of value i is in host memory during stage t. A host copy is
made by an offload issued right after the node is computed in stage t-1 (the first stage
of a run of ``H``), and a value kept into stage t may come from the host copy of stage t-1
(a prefetch) instead of the device. When and how fast the copies travel is the plan's
business (:mod:`tfremat.plan.execution`), over a host link of ``host_bandwidth`` bytes per
unit of the graph's cost.

Gradients that read an input computed again after their forward value. A backward node b
that reads its forward node f's value (output or residuals) and one of f's inputs x
(:attr:`tfremat.graph.DFGraph.inputs_read_with_forward`: a dense layer with an activation,
a layer norm) takes its gradient on the tape that recorded f's value. When x was computed
again (or prefetched from the host) after f last ran while f's value was kept, that tape
reads the old copy of x, which the plan has freed, so the compiled step ran f again on the
new x to rebuild the gradient: forward work and a transient copy of f's value that neither
the schedule's cost nor its peak counted (issue #33: a ViT's first feed-forward dense, whose
layer norm input was recomputed while the dense output was kept).
:func:`with_fresh_gradient_reads` makes that work part of the schedule: f is recomputed in
b's stage and its older copy is no longer kept into it. :func:`schedule_from_keep_matrix`
and :func:`tfremat.plan.execution.build_plan` apply it, so every plan, simulated peak and
budget check includes it, and strategies return the explicit schedule
(:class:`tfremat.plan.registry.Strategy`); the MILP excludes the pattern from its model
(:mod:`tfremat.ilp.formulation`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from tfremat.errors import GraphError, ScheduleError, is_int, is_number
from tfremat.graph import DFGraph

__all__ = [
    "SCHEDULE_FORMAT",
    "Schedule",
    "SolveStatus",
    "SolverFacts",
    "relative_gap",
    "solve_r_given_s",
    "prune_s",
    "schedule_from_keep_matrix",
    "checkpoint_all_s",
    "graph_under",
    "offloadable",
    "prefetch_stages",
    "prune_h",
    "validate_schedule",
    "check_facts_document",
    "stale_gradient_reads",
    "with_fresh_gradient_reads",
]


# Bumped when the document's layout or the meaning of a key changes.
SCHEDULE_FORMAT = "tfremat.schedule/4"
# Earlier layouts still read: /2 had no host matrix (no offloading); /3 schedules may run
# a gradient on a stale forward value, which their plans now recompute
# (with_fresh_gradient_reads), so their cached entries (keyed by the format) are not reused.
_READABLE_FORMATS = ("tfremat.schedule/2", "tfremat.schedule/3", SCHEDULE_FORMAT)


class SolveStatus(str, enum.Enum):
    """What a solver proved about a schedule (or a backend about a solve).

    A ``str`` enum: members compare, hash and print as their values (``"optimal"``, ...),
    so JSON output and comparisons with plain strings keep working.
    """

    OPTIMAL = "optimal"  # proven optimal within the requested gap
    FEASIBLE = "feasible"  # a schedule without proof of optimality
    TIME_LIMIT = "time_limit"  # stopped by the time limit: the best schedule so far
    INFEASIBLE = "infeasible"  # proven infeasible (a backend status; strategies raise instead)
    NO_SOLUTION = "no_solution"  # stopped without any solution (a backend status)
    INTERRUPTED = "interrupted"  # stopped by Ctrl-C (SIGINT): the best schedule found before it

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


def relative_gap(objective: float | None, bound: float | None) -> float | None:
    """``(objective - bound) / objective``, at least 0 (0 when the objective is 0); None
    without both. The gap every strategy reports in :attr:`SolverFacts.gap`."""
    if objective is None or bound is None:
        return None
    return max(0.0, (objective - bound) / objective) if objective else 0.0


@dataclasses.dataclass(frozen=True)
class SolverFacts:
    """What a solver strategy (``optimal``, ``approx_lp``, ``min_peak``) proved about its schedule.

    Heuristic schedules carry no facts (``Schedule.facts is None``): nothing is proven
    about them beyond fitting their budget. Fields a strategy does not know are None.

    Attributes:
        status: :class:`SolveStatus` (``optimal``, ``time_limit`` or ``feasible`` for a
            returned schedule; ``min_peak`` reports its backend's status).
        objective: the schedule's total compute cost.
        best_bound: a proven lower bound on the optimal compute cost.
        seconds: wall time of the whole call.
        solve_seconds: the part of it spent in the solver.
        num_vars, num_constraints: size of the (last) model solved; 0 when none was.
        solver: the backend (``highs``, ``gurobi``), None when no solver ran.
        warm_start: the strategy of the schedule the MILP started from.
        peak_bytes: the schedule's simulated peak.
        budget_bytes: the budget it was solved for (None: no budget).
        exact_stages: stages the stage-end relaxation accounted exactly (``optimal``).
        peak_bound_bytes: a proven lower bound on the peak of any schedule within
            ``cost_cap`` (``min_peak``).
        cost_cap: the compute cost the schedule had to stay within (``min_peak``).
    """

    status: SolveStatus
    objective: float | None = None
    best_bound: float | None = None
    seconds: float | None = None
    solve_seconds: float | None = None
    num_vars: int | None = None
    num_constraints: int | None = None
    solver: str | None = None
    warm_start: str | None = None
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    exact_stages: int | None = None
    peak_bound_bytes: int | None = None
    cost_cap: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "status", SolveStatus(self.status))

    @property
    def gap(self) -> float | None:
        """Relative gap between ``objective`` and ``best_bound`` (:func:`relative_gap`)."""
        return relative_gap(self.objective, self.best_bound)

    def to_dict(self) -> dict:
        """JSON-ready: every field, plus ``gap``."""
        data = {field.name: _json_value(getattr(self, field.name)) for field in dataclasses.fields(self)}
        data["status"] = self.status.value
        data["gap"] = self.gap
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> "SolverFacts":
        """Inverse of :meth:`to_dict` (``gap`` is recomputed; unknown keys are refused).

        Raises:
            ValueError: a key is unknown or the status is not a :class:`SolveStatus`.
        """
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = set(data) - names - {"gap"}
        if unknown:
            raise ValueError(f"unknown solver facts {sorted(unknown)}")
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """An immutable rematerialization schedule.

    Attributes:
        R: bool array (T, n); ``R[t, i]``: node i is computed in stage t.
        S: bool array (T, n); ``S[t, i]``: value i is kept from stage t-1 into stage t.
        strategy: name of the strategy that produced it.
        facts: what a solver proved (:class:`SolverFacts`); None for heuristics.
        H: bool array (T, n) or None; ``H[t, i]``: a copy of value i is in host memory
            during stage t (module docstring). None (or no entry set): no offloading.
        host_bandwidth: the host link the schedule was planned for, in bytes per unit of
            the graph's cost (bytes per second for profiled graphs); needed when H offloads
            anything, since the plan times its copies by it.
        implementations: node -> the :class:`~tfremat.graph.Implementation` it runs (MONeT);
            None or empty: every node's default. The schedule is for the graph under them
            (:func:`graph_under`), which validation, plans and the simulator use.
    """

    R: np.ndarray
    S: np.ndarray
    strategy: str = "unknown"
    facts: SolverFacts | None = None
    H: np.ndarray | None = None
    host_bandwidth: float | None = None
    implementations: Mapping[int, str] | None = None

    def __post_init__(self):
        R = np.array(self.R, dtype=bool)
        S = np.array(self.S, dtype=bool)
        R.setflags(write=False)
        S.setflags(write=False)
        object.__setattr__(self, "R", R)
        object.__setattr__(self, "S", S)
        if self.H is not None:
            H = np.array(self.H, dtype=bool)
            H.setflags(write=False)
            object.__setattr__(self, "H", H if H.any() else None)
        if self.facts is not None and not isinstance(self.facts, SolverFacts):
            raise TypeError(f"facts must be SolverFacts or None, got {type(self.facts).__name__}")
        chosen = {}
        for node, name in (self.implementations or {}).items():
            if not is_int(node) or not isinstance(name, str):
                raise ScheduleError(f"implementations maps node ids to implementation names, got {node!r}: {name!r}",
                                    rule="implementations")
            if name != "default":
                chosen[int(node)] = name
        object.__setattr__(self, "implementations", MappingProxyType(chosen) if chosen else None)
        if self.host_bandwidth is not None and not (
            is_number(self.host_bandwidth) and math.isfinite(self.host_bandwidth) and self.host_bandwidth > 0
        ):
            raise ScheduleError(f"host_bandwidth must be None or a finite number of bytes per unit of cost > 0, got "
                                f"{self.host_bandwidth!r}", rule="host-link")

    @property
    def offloads(self) -> bool:
        """Whether the schedule copies any value to host memory."""
        return self.H is not None

    @property
    def num_stages(self) -> int:
        return self.R.shape[0]

    @property
    def recompute_count(self) -> int:
        """Node evaluations beyond the first one of every node."""
        return int(self.R.sum()) - self.R.shape[1]

    def cost(self, graph: DFGraph) -> float:
        """Total compute cost: every evaluation of every node (under the schedule's
        implementations)."""
        return float(self.R.sum(axis=0) @ np.asarray(graph_under(graph, self).cost, dtype=float))

    def with_facts(self, facts: SolverFacts | None, strategy: str | None = None) -> "Schedule":
        """A copy carrying ``facts`` (and renamed to ``strategy`` when given)."""
        return Schedule(self.R, self.S, self.strategy if strategy is None else strategy, facts, self.H,
                        self.host_bandwidth, self.implementations)

    def with_implementations(self, implementations: Mapping[int, str] | None) -> "Schedule":
        """A copy for the graph under ``implementations`` (node -> implementation name)."""
        return Schedule(self.R, self.S, self.strategy, self.facts, self.H, self.host_bandwidth, implementations)

    def to_dict(self, graph: DFGraph | None = None, node_ids: list | None = None) -> dict:
        """JSON-ready form: R and S as lists of ``[t, i]`` pairs over execution positions.

        Args:
            graph: when given, its fingerprint is recorded so a stale file is detected.
            node_ids: the source file's node id at each execution position (default:
                the positions themselves).
        """
        n = self.R.shape[1]
        return {
            "format": SCHEDULE_FORMAT,
            "strategy": self.strategy,
            "facts": self.facts.to_dict() if self.facts is not None else None,
            "num_nodes": n,
            "order": list(node_ids) if node_ids is not None else list(range(n)),
            "graph_fingerprint": graph.fingerprint if graph is not None else None,
            "R": np.argwhere(self.R).tolist(),
            "S": np.argwhere(self.S).tolist(),
            "H": np.argwhere(self.H).tolist() if self.H is not None else [],
            "host_bandwidth": self.host_bandwidth,
            "implementations": {str(node): name for node, name in (self.implementations or {}).items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping, graph: DFGraph | None = None) -> "Schedule":
        """Inverse of :meth:`to_dict`; checks the fingerprint and validity against ``graph``.

        The document is checked before anything is built from it: ``num_nodes`` is an int
        and, with ``graph``, the graph's size (with ``graph``, the fingerprint too), else at
        most the pairs listed in R (a schedule computes every node once on its diagonal),
        so a damaged document cannot make it allocate more than its own size implies;
        every (stage, node) pair is in range; ``order`` lists ``num_nodes`` ids; the facts
        are typed and consistent (:func:`check_facts_document`).

        Raises:
            ScheduleError: the document is malformed, made for another graph, or invalid.
        """
        if not isinstance(data, Mapping):
            raise ScheduleError(f"malformed schedule document: a {type(data).__name__}, not a JSON object", rule="format")
        if graph is not None and data.get("graph_fingerprint") not in (None, graph.fingerprint):
            raise ScheduleError(
                f"schedule was made for graph {data.get('graph_fingerprint')}, not {graph.fingerprint}",
                rule="fingerprint",
            )
        try:
            if data.get("format") not in _READABLE_FORMATS:
                # Another version's document (its facts may mean other things): refused.
                raise ValueError(f"format {data.get('format')!r} is not one of {_READABLE_FORMATS}")
            n = data["num_nodes"]
            if not is_int(n) or n < 0:
                raise ValueError(f"num_nodes {n!r} is not a count of nodes")
            n = int(n)
            pairs = {key: data[key] for key in ("R", "S")}
            pairs["H"] = data.get("H", [])
            for key, listed in pairs.items():
                if not isinstance(listed, list):
                    raise ValueError(f"{key} is a {type(listed).__name__}, not a list of [stage, node] pairs")
            if graph is not None and n != graph.size:
                raise ScheduleError(f"the document has {n} nodes, the graph {graph.size}", rule="shape")
            if n > len(pairs["R"]):
                raise ValueError(f"num_nodes {n} exceeds the {len(pairs['R'])} pairs of R (every stage computes its node)")
            order = data.get("order")
            if order is not None and (not isinstance(order, list) or len(order) != n):
                raise ValueError(f"order must list {n} node ids")
            R = np.zeros((n, n), dtype=bool)
            S = np.zeros((n, n), dtype=bool)
            H = np.zeros((n, n), dtype=bool)
            for matrix, key in ((R, "R"), (S, "S"), (H, "H")):
                for pair in pairs[key]:
                    # numpy would wrap a negative index around to another stage or node
                    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(is_int(v) and 0 <= v < n for v in pair)):
                        raise ValueError(f"{key} entry {pair!r:.60} is not a (stage, node) pair in [0, {n})")
                    matrix[pair[0], pair[1]] = True
            facts_data = data.get("facts")
            facts = None
            if facts_data is not None:
                check_facts_document(facts_data)
                facts = SolverFacts.from_dict(facts_data)
            strategy = data.get("strategy", "unknown")
            if not isinstance(strategy, str):
                raise ValueError(f"strategy {strategy!r:.60} is not a name")
            chosen = data.get("implementations") or {}
            if not isinstance(chosen, Mapping):
                raise ValueError(f"implementations is a {type(chosen).__name__}, not an object of node ids")
            chosen = {int(node): name for node, name in chosen.items()}
            schedule = cls(R, S, strategy, facts, H, data.get("host_bandwidth"), chosen)
        except ScheduleError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ScheduleError(f"malformed schedule document: {exc!r}", rule="format") from exc
        if graph is not None:
            validate_schedule(graph, schedule)
        return schedule


# What each fact holds besides ``status`` and ``gap``: a non-negative finite number, a
# non-negative int, or a name (each may be None, unknown).
_FACT_KINDS = {
    "objective": "number", "best_bound": "number", "seconds": "number", "solve_seconds": "number",
    "cost_cap": "number", "num_vars": "count", "num_constraints": "count", "exact_stages": "count",
    "peak_bytes": "count", "budget_bytes": "count", "peak_bound_bytes": "count", "solver": "name",
    "warm_start": "name",
}


def check_facts_document(data) -> None:
    """Checks a facts document (:meth:`SolverFacts.to_dict`) before it is believed: an
    object of known fields, ``status`` a :class:`SolveStatus`, each other field of its
    kind (:data:`_FACT_KINDS`), ``best_bound`` at most ``objective`` (within 1e-6
    relative, a solver's tolerance) and ``gap``, when stated, in [0, 1] and equal to the
    gap of the objective and the bound.

    Raises:
        ValueError: naming the first fact that is wrong.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"facts are a {type(data).__name__}, not an object")
    names = {field.name for field in dataclasses.fields(SolverFacts)}
    unknown = set(data) - names - {"gap"}
    if unknown:
        raise ValueError(f"unknown solver facts {sorted(unknown)}")
    status = data.get("status")
    if not isinstance(status, str) or status not in {member.value for member in SolveStatus}:
        raise ValueError(f"status {status!r:.60} is not one of {', '.join(m.value for m in SolveStatus)}")
    for name, kind in _FACT_KINDS.items():
        value = data.get(name)
        if value is None:
            continue
        if kind == "name":
            good = isinstance(value, str)
        elif kind == "count":
            good = is_int(value) and value >= 0
        else:
            good = is_number(value) and math.isfinite(value) and value >= 0
        if not good:
            raise ValueError(f"{name} {value!r:.60} is not a {'non-negative ' if kind != 'name' else ''}{kind}")
    objective, bound = data.get("objective"), data.get("best_bound")
    if objective is not None and bound is not None and bound > objective + 1e-6 * max(1.0, abs(objective)):
        raise ValueError(f"best_bound {bound} exceeds the objective {objective}")
    if "gap" in data:
        gap, expected = data["gap"], relative_gap(objective, bound)
        if expected is None:
            if gap is not None:
                raise ValueError(f"gap {gap!r:.60} without an objective and a bound")
        elif not (is_number(gap) and 0 <= gap <= 1 and math.isclose(gap, expected, rel_tol=1e-9, abs_tol=1e-12)):
            raise ValueError(f"gap {gap!r:.60} is not in [0, 1] or not the objective's gap to the bound ({expected})")


def _json_value(value):
    """Numpy scalars and arrays as plain JSON values (solver facts may hold them)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def graph_under(graph: DFGraph, schedule: Schedule) -> DFGraph:
    """The graph ``schedule`` runs: ``graph`` under its implementations (MONeT), or
    ``graph`` itself when it chooses none."""
    return graph.with_implementations(schedule.implementations)


def offloadable(graph: DFGraph, node: int) -> bool:
    """Whether a schedule may copy ``node``'s value to host memory: a forward node (not the
    loss, not a gradient) that something reads and whose value holds no residual part. A
    residual part lives inside the layer's recorded tape in the compiled step, so only an
    output that is plain tensors can travel."""
    return (not graph.is_backward[node]) and bool(graph.successors[node]) and not graph.residual_bytes[node]


def prefetch_stages(R: np.ndarray, S: np.ndarray, H: np.ndarray | None) -> np.ndarray:
    """``P[t, i]``: stage t prefetches value i for stage t+1 (it is kept into stage t+1,
    neither computed nor kept on the device in stage t, and a host copy exists in t)."""
    P = np.zeros_like(R, dtype=bool)
    if H is not None:
        P[:-1] = S[1:] & H[:-1] & ~R[:-1] & ~S[:-1]
    return P


def validate_schedule(graph: DFGraph, schedule: Schedule) -> None:
    """Checks every rule of the stage model; raises on the first violated one.

    Rules, in the order checked: ``shape``, ``lower-triangular``, ``frontier`` (stage t
    computes node t), ``offload-kind`` (only :func:`offloadable` values go to the host),
    ``offload-source`` (a run of ``H`` starts in the stage after one that computes the
    value), ``host-link`` (a schedule that offloads names its ``host_bandwidth``),
    ``keep-source`` (a value kept into stage t was resident at the end of stage t-1, or
    has a host copy there to prefetch), ``input-resident`` (every input of a computed node
    is kept into the stage or computed earlier in it), ``recompute-while-resident`` (no
    node is recomputed while its value is already kept).

    Raises:
        ScheduleError: naming the rule, the stage and the node.
    """
    try:
        graph = graph_under(graph, schedule)
    except GraphError as exc:
        raise ScheduleError(f"the schedule's implementations do not fit the graph: {exc}", rule="implementations") from None
    n = graph.size
    R, S = schedule.R, schedule.S
    H = schedule.H if schedule.H is not None else np.zeros_like(R)
    if R.shape != (n, n) or S.shape != (n, n) or H.shape != (n, n):
        raise ScheduleError(f"R, S and H must be {n}x{n} for this graph, got {R.shape}, {S.shape} and {H.shape}",
                            rule="shape")
    upper_r = np.argwhere(np.triu(R, 1))
    if len(upper_r):
        t, i = upper_r[0]
        raise ScheduleError(f"R[{t}, {i}] is set above the diagonal: stage {t} cannot compute node {i} > {t}", rule="lower-triangular", stage=int(t), node=int(i))
    upper_s = np.argwhere(np.triu(S))
    if len(upper_s):
        t, i = upper_s[0]
        raise ScheduleError(f"S[{t}, {i}] is set on or above the diagonal: value {i} cannot be kept into stage {t} <= {i}", rule="lower-triangular", stage=int(t), node=int(i))
    upper_h = np.argwhere(np.triu(H))
    if len(upper_h):
        t, i = upper_h[0]
        raise ScheduleError(f"H[{t}, {i}] is set on or above the diagonal: value {i} has no host copy in stage {t} <= {i}", rule="lower-triangular", stage=int(t), node=int(i))
    missing = np.flatnonzero(~np.diag(R))
    if len(missing):
        t = int(missing[0])
        raise ScheduleError(f"stage {t} does not compute node {t} (frontier-advancing rule)", rule="frontier", stage=t, node=t)
    if schedule.H is not None:
        for i in np.flatnonzero(H.any(axis=0)):
            if not offloadable(graph, int(i)):
                t = int(np.argmax(H[:, i]))
                raise ScheduleError(
                    f"H[{t}, {i}]: value {i} ({graph.names[i]}) cannot go to host memory (only a forward value without "
                    "residual parts that something reads can)", rule="offload-kind", stage=t, node=int(i))
        starts = np.argwhere(H[1:] & ~H[:-1] & ~R[:-1])
        if len(starts):
            t, i = starts[0]
            raise ScheduleError(
                f"H[{t + 1}, {i}]: the host copy of value {i} ({graph.names[i]}) starts in stage {t + 1}, but stage {t} "
                "does not compute it (an offload is issued right after the node runs)", rule="offload-source",
                stage=int(t + 1), node=int(i))
        if schedule.host_bandwidth is None:
            raise ScheduleError("the schedule offloads values but names no host_bandwidth to time the copies by",
                                rule="host-link")
    resident_end = R[:-1] | S[:-1] | H[:-1]
    bad_keep = np.argwhere(S[1:] & ~resident_end)
    if len(bad_keep):
        t, i = bad_keep[0]
        raise ScheduleError(
            f"S[{t + 1}, {i}]: value {i} ({graph.names[i]}) is kept into stage {t + 1} but was not resident in stage {t} "
            "(on the device or in host memory)",
            rule="keep-source", stage=int(t + 1), node=int(i),
        )
    for t in range(n):
        for k in np.flatnonzero(R[t]):
            for i in graph.predecessors[k]:
                if not (S[t, i] or R[t, i]):
                    raise ScheduleError(
                        f"stage {t} computes node {k} ({graph.names[k]}) but its input {i} ({graph.names[i]}) "
                        f"is neither kept into stage {t} nor computed earlier in it",
                        rule="input-resident", stage=t, node=int(k),
                    )
    both = np.argwhere(R & S)
    if len(both):
        t, i = both[0]
        raise ScheduleError(f"stage {t} recomputes node {i} ({graph.names[i]}) although its value is kept into that stage", rule="recompute-while-resident", stage=int(t), node=int(i))


def solve_r_given_s(graph: DFGraph, S: np.ndarray, H: np.ndarray | None = None) -> np.ndarray:
    """The minimal recomputation matrix R that makes the keep matrix S feasible.

    Checkmate's ``solve_r_opt``: stage t computes node t; walking the stage backwards,
    a node is computed when a node computed later in the stage reads it, or when it
    must be kept into stage t+1 and neither its value is kept into stage t nor a host
    copy (``H``) can be prefetched in stage t, or when a host copy starts in stage t+1
    (an offload follows the node's computation). Every node is computed at most once per
    stage, so R is the cheapest completion of S (and H).

    Args:
        graph: the graph.
        S: bool (n, n) keep matrix, strictly lower triangular.
        H: bool (n, n) host matrix, or None (no offloading).

    Returns:
        bool (n, n) array R.
    """
    n = graph.size
    S = np.asarray(S, dtype=bool)
    # Row t: the nodes stage t computes because of stage t+1 (columns before t).
    R = np.zeros((n, n), dtype=bool)
    R[:-1] = S[1:] & ~S[:-1]
    if H is not None:
        H = np.asarray(H, dtype=bool)
        R[:-1] &= ~H[:-1]
        R[:-1] |= H[1:] & ~H[:-1]
    R = np.tril(R, -1)
    R[np.arange(n), np.arange(n)] = True
    # Then the inputs of computed nodes that are not kept, in every stage at once, until
    # none is added: inputs precede their readers, so this closure marks what Checkmate's
    # backward walk over each stage marks, visiting only the computed nodes.
    inputs = _input_table(graph)
    stages, nodes = np.nonzero(R)
    while len(nodes):
        stages, nodes = _inputs_of(inputs, stages, nodes)
        new = ~S[stages, nodes] & ~R[stages, nodes]
        stages, nodes = stages[new], nodes[new]
        if len(nodes):
            flat = np.unique(stages * n + nodes)
            stages, nodes = flat // n, flat % n
            R[stages, nodes] = True
    return R


def _input_table(graph: DFGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The graph's inputs as flat arrays: per node its in-degree and the position of its
    first input in the concatenation of every node's inputs, and that concatenation."""
    in_degree = np.fromiter((len(p) for p in graph.predecessors), dtype=np.int64, count=graph.size)
    inputs = np.fromiter((i for p in graph.predecessors for i in p), dtype=np.int64, count=int(in_degree.sum()))
    return in_degree, np.cumsum(in_degree) - in_degree, inputs


def _inputs_of(table, stages: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(stage, input of node)`` pair of the ``(stage, node)`` pairs given, as two
    arrays (an input read by two nodes of a stage appears twice)."""
    in_degree, first_input, inputs = table
    per_pair = in_degree[nodes]
    pair = np.repeat(np.arange(len(nodes)), per_pair)
    offset = np.arange(len(pair)) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
    return stages[pair], inputs[first_input[nodes][pair] + offset]


def prune_s(graph: DFGraph, R: np.ndarray, S: np.ndarray) -> np.ndarray:
    """Drops keeps that no later stage reads, so memory is not held for nothing.

    ``S[t, i]`` survives only when value i is read in stage t by a node computed there
    (and i itself is not recomputed in stage t), or when it must survive into stage t+1
    for the same reason. Also drops R-redundant keeps created by heuristics.
    """
    n = graph.size
    R = np.asarray(R, dtype=bool)
    read = np.zeros((n, n), dtype=bool)
    stages, inputs = _inputs_of(_input_table(graph), *np.nonzero(R))
    read[stages, inputs] = True
    read &= ~R
    pruned = np.zeros((n, n), dtype=bool)
    needed_next = np.zeros(n, dtype=bool)
    for t in range(n - 1, -1, -1):
        pruned[t] = S[t] & (read[t] | needed_next)
        needed_next = pruned[t]
    return pruned


def prune_h(R: np.ndarray, S: np.ndarray, H: np.ndarray | None) -> np.ndarray | None:
    """Drops host copies held past their last prefetch (and runs no prefetch reads), so the
    host holds nothing for nothing; None when nothing is left."""
    if H is None:
        return None
    P = prefetch_stages(R, S, H)
    kept = np.zeros_like(P)
    after = np.zeros(P.shape[1], dtype=bool)
    for t in range(P.shape[0] - 1, -1, -1):
        after = H[t] & (P[t] | after)
        kept[t] = after
    return kept if kept.any() else None


def schedule_from_keep_matrix(graph: DFGraph, S: np.ndarray, strategy: str, H: np.ndarray | None = None,
                              host_bandwidth: float | None = None) -> Schedule:
    """Completes a keep matrix (and a host matrix) with :func:`solve_r_given_s` and prunes
    unused keeps (:func:`prune_s`) and host copies (:func:`prune_h`).

    Recomputation happens in the stage before a value must be kept, so pruning an unread
    keep can make that recomputation unnecessary; the loop runs to a fixed point. A
    gradient that would read an input computed again after its forward value gets its
    forward node recomputed in its stage instead (:func:`with_fresh_gradient_reads`).
    """
    H = None if H is None else np.asarray(H, dtype=bool)
    R, S, H = _completed(graph, np.asarray(S, dtype=bool), H)
    return Schedule(R, S, strategy, None, H, host_bandwidth if H is not None else None)


def _completed(graph: DFGraph, S: np.ndarray, H: np.ndarray | None):
    """``(R, S, H)``: the fixed point of completing S and H (:func:`solve_r_given_s`),
    pruning them, and dropping the keeps of forward values a gradient would read stale
    (:func:`stale_gradient_reads`; the completion then recomputes them in that stage).
    Every round only drops keeps or host copies, so it ends."""
    while True:
        R = solve_r_given_s(graph, S, H)
        pruned = prune_s(graph, R, S)
        pruned_h = prune_h(R, pruned, H)
        same_h = (pruned_h is None and H is None) or (
            pruned_h is not None and H is not None and np.array_equal(pruned_h, H))
        if np.array_equal(pruned, S) and same_h:
            stale = stale_gradient_reads(graph, R, S, H)
            if not stale:
                return R, S, H
            S = S.copy()
            for t, _, f in stale:
                S[t, f] = False
            continue
        S, H = pruned, pruned_h


def checkpoint_all_s(graph: DFGraph) -> np.ndarray:
    """Keep matrix that holds every value from its computation until its last reader runs:
    the eager-free keep-everything pattern of frameworks (no recomputation)."""
    n = graph.size
    S = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if graph.successors[i]:
            S[i + 1 : max(graph.successors[i]) + 1, i] = True
    return S


def stale_gradient_reads(graph: DFGraph, R: np.ndarray, S: np.ndarray,
                         H: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """The computations of a backward node whose forward value is older than an input
    the gradient reads (module docstring, "Gradients that read an input"), as ``(stage,
    backward node, forward node)``.

    Stage t computes b without computing f, f last ran in stage t' < t, and some input x of
    f that b reads was computed, or prefetched, in a stage after t' up to t (within a
    stage, x runs before f, and a prefetched copy lands before the stage begins).

    Args:
        graph: the graph the matrices are for (under the schedule's implementations).
        R, S, H: the schedule's matrices (H None: no host copies).
    """
    reads = graph.inputs_read_with_forward
    if not reads:
        return []
    R = np.asarray(R, dtype=bool)
    n = R.shape[0]
    columns = sorted({x for inputs in reads.values() for x in inputs})
    events = R[:, columns].astype(np.int32)
    if H is not None:
        arrivals = prefetch_stages(R, np.asarray(S, dtype=bool), np.asarray(H, dtype=bool))[:, columns]
        events[1:] += arrivals[:-1]
    # renewed[t, j]: computations and arrivals of input columns[j] in stages 0..t.
    renewed = np.cumsum(events, axis=0)
    column = {x: j for j, x in enumerate(columns)}
    stages = np.arange(n)
    stale = []
    for b, inputs in reads.items():
        runs = np.flatnonzero(R[:, b])
        f = graph.forward_of[b]
        last_run = np.maximum.accumulate(np.where(R[:, f], stages, -1))[runs]
        later = (last_run >= 0) & (last_run < runs)
        if not later.any():
            continue
        runs, last_run = runs[later], last_run[later]
        js = [column[x] for x in inputs]
        renewed_since = (renewed[runs][:, js] - renewed[last_run][:, js]).any(axis=1)
        stale.extend((int(t), b, f) for t in runs[renewed_since])
    return sorted(stale)


def with_fresh_gradient_reads(graph: DFGraph, schedule: Schedule) -> Schedule:
    """``schedule`` with the forward node of every :func:`stale_gradient_reads`
    computation recomputed in that stage (module docstring, "Gradients that read an
    input"); the schedule itself when it has none.

    The forward value is no longer kept into that stage, and the schedule is completed
    again from its keeps (:func:`schedule_from_keep_matrix`'s fixed point): the stage then
    computes the forward node and whatever inputs of it the stage does not hold, and keeps
    and computations that only served the older copy are dropped. Recomputed inputs may
    make other gradients stale, so it repeats until none is. Solver facts get the new cost
    as their objective, and an optimality claim becomes ``feasible`` (the solver did not
    see this schedule).
    """
    under = graph_under(graph, schedule)
    if not under.inputs_read_with_forward or not stale_gradient_reads(under, schedule.R, schedule.S, schedule.H):
        return schedule
    R, S, H = _completed(under, schedule.S, schedule.H)
    fresh = Schedule(R, S, schedule.strategy, None, H, schedule.host_bandwidth if H is not None else None,
                     schedule.implementations)
    facts = schedule.facts
    if facts is not None and facts.objective is not None:
        cost = fresh.cost(graph)
        bound = None if facts.best_bound is None else min(facts.best_bound, cost)
        status = SolveStatus.FEASIBLE if facts.status == SolveStatus.OPTIMAL else facts.status
        facts = dataclasses.replace(facts, status=status, objective=cost, best_bound=bound)
    return fresh.with_facts(facts)
