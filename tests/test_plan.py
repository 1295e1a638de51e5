"""Planning core: graph validation, schedules, execution plans, the simulator."""

import json

import numpy as np
import pytest
from graph_factories import random_training_graph, training_graph, with_residuals
from hypothesis import given, settings
from hypothesis import strategies as st

from tfremat.errors import GraphError, InfeasibleBudgetError, ScheduleError
from tfremat.graph import DFGraph, load_graph
from tfremat.plan import (
    Op,
    Schedule,
    build_plan,
    checkpoint_all_s,
    schedule_from_keep_matrix,
    simulate,
    solve_r_given_s,
    validate_schedule,
)
from tfremat.strategies import get_strategy


def chain4():
    """A 4-node forward chain a -> b -> c -> d with distinct sizes, one workspace."""
    return DFGraph(names="abcd", edges=[(0, 1), (1, 2), (2, 3)], cost=[1, 2, 3, 4],
                   output_bytes=[10, 20, 30, 40], workspace_bytes=[0, 5, 0, 0], fixed_bytes=100)


def statements(plan):
    return [(s.op.value[0], s.node, s.stage) for s in plan]


def test_chain_checkpoint_all_plan_peak_and_cost():
    g = chain4()
    schedule = get_strategy("checkpoint_all")(g)
    plan = build_plan(g, schedule)
    assert statements(plan) == [
        ("a", 0, 0), ("c", 0, 0),
        ("a", 1, 1), ("c", 1, 1), ("d", 0, 1),
        ("a", 2, 2), ("c", 2, 2), ("d", 1, 2),
        ("a", 3, 3), ("c", 3, 3), ("d", 2, 3), ("d", 3, 3),
    ]
    result = simulate(g, plan)
    # peak while d runs: fixed 100 + c (30) + d (40); b's run: 100 + 10 + 20 + 5 workspace = 135.
    assert result.peak_bytes == 170
    assert result.cost == 10
    assert list(result.trace_bytes) == [110, 110, 130, 135, 120, 150, 150, 130, 170, 170, 140, 100]


def test_chain_recompute_from_checkpoint():
    g = chain4()
    S = np.zeros((4, 4), dtype=bool)
    S[1, 0] = S[2, 0] = S[3, 0] = True  # keep a throughout; b and c are recomputed each stage
    schedule = schedule_from_keep_matrix(g, S, "test")
    assert schedule.R.astype(int).tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    result = simulate(g, schedule)
    assert result.cost == 1 + 2 + (2 + 3) + (2 + 3 + 4)
    assert result.recompute_count == 3
    # stage 2 runs c with a (kept on), b and c live: 100 + 10 + 20 + 30 = 160; stage 3 frees a
    # after b and b after c, so d runs with c and d only: 100 + 30 + 40 = 170.
    assert result.peak_bytes == 170
    assert result.trace_bytes[build_plan(g, schedule).statements.index(next(
        s for s in build_plan(g, schedule) if s.op is Op.COMPUTE and s.node == 2 and s.stage == 2))] == 160


def test_diamond_frees_shared_input_after_last_reader():
    g = DFGraph(names=["x", "l", "r", "y"], edges=[(0, 1), (0, 2), (1, 3), (2, 3)], cost=[1] * 4,
                output_bytes=[8, 4, 2, 1])
    plan = build_plan(g, get_strategy("checkpoint_all")(g))
    frees = [(s.node, s.stage) for s in plan if s.op is Op.DEALLOCATE]
    assert frees == [(0, 2), (1, 3), (2, 3), (3, 3)]
    assert simulate(g, plan).peak_bytes == 8 + 4 + 2  # while r runs, x and l are live


def test_skip_connection_training_graph_checkpoint_all_and_sqrtn():
    # f0 -> f1 -> f2 -> f3 and a skip f0 -> f3.
    g = training_graph([(0, 1), (1, 2), (2, 3), (0, 3)], sizes=[4, 4, 4, 4], reads_output={1, 2})
    full = simulate(g, get_strategy("checkpoint_all")(g))
    assert full.cost == g.total_cost
    assert full.recompute_count == 0
    sqrtn = get_strategy("chen_sqrtn")(g)
    validate_schedule(g, sqrtn)
    result = simulate(g, sqrtn)
    assert result.recompute_count > 0
    assert result.cost > full.cost
    assert result.peak_bytes <= full.peak_bytes


def test_unused_cached_value_is_freed_at_stage_start():
    g = chain4()
    S = checkpoint_all_s(g)
    S[2, 0] = True  # keep a into stage 2 although nothing there reads it
    schedule = Schedule(np.eye(4, dtype=bool), S)
    validate_schedule(g, schedule)
    plan = statements(build_plan(g, schedule))
    assert plan[3:6] == [("c", 1, 1), ("d", 0, 2), ("a", 2, 2)]  # stage 2 starts by freeing a


@pytest.mark.parametrize("seed", range(6))
def test_every_strategy_valid_on_random_training_graphs(seed):
    from tfremat.strategies import solver_strategy_names, strategy_names

    g = random_training_graph(seed, num_forward=8 + seed)
    full = simulate(g, get_strategy("checkpoint_all")(g))
    assert full.cost == pytest.approx(g.total_cost)
    for name in strategy_names():
        if name in solver_strategy_names():
            continue
        schedule = get_strategy(name)(g)
        validate_schedule(g, schedule)
        result = simulate(g, schedule)
        assert result.cost >= full.cost - 1e-9, name
        assert result.peak_bytes == recount_peak(g, schedule), name


def recount_peak(g, schedule):
    """Peak memory straight from R and S, without the execution plan (an independent recount)."""
    R, S = schedule.R, schedule.S
    n = g.size
    peak = 0
    for t in range(n):
        keep_next = S[t + 1] if t + 1 < n else np.zeros(n, dtype=bool)
        last_use = np.full(n, -1)
        for k in np.flatnonzero(R[t]):
            last_use[k] = max(last_use[k], k)
            for i in g.predecessors[k]:
                last_use[i] = max(last_use[i], k)
        for k in np.flatnonzero(R[t]):
            live = g.fixed_bytes + g.output_bytes[k] + g.workspace_bytes[k]
            for i in range(n):
                if i == k:
                    continue
                present = S[t, i] or (R[t, i] and i < k)
                freed = not keep_next[i] and last_use[i] < k
                if present and not freed:
                    live += g.output_bytes[i]
            peak = max(peak, live)
    return peak


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), m=st.integers(2, 9), keep_density=st.floats(0, 1))
def test_random_keep_matrices_complete_to_valid_schedules(seed, m, keep_density):
    g = random_training_graph(seed, m)
    rng = np.random.default_rng(seed)
    S = np.tril(rng.random((g.size, g.size)) < keep_density, -1)
    schedule = schedule_from_keep_matrix(g, S, "random")
    validate_schedule(g, schedule)
    assert simulate(g, schedule).peak_bytes == recount_peak(g, schedule)
    assert schedule.cost(g) == pytest.approx(simulate(g, schedule).cost)


def test_solve_r_given_s_is_minimal_on_chain():
    g = chain4()
    R = solve_r_given_s(g, np.zeros((4, 4), dtype=bool))
    # nothing kept: every stage recomputes the whole prefix
    assert R.astype(int).tolist() == np.tril(np.ones((4, 4), dtype=int)).tolist()


# ----- bad input -----


def test_cycle_is_named():
    with pytest.raises(GraphError, match="cycle"):
        DFGraph(names="abc", edges=[(0, 1), (1, 2), (2, 0)], cost=[1] * 3, output_bytes=[1] * 3)


def test_order_violation_and_dangling_edge_and_bad_cost():
    with pytest.raises(GraphError, match="against the node order") as info:
        DFGraph(names="abc", edges=[(0, 2), (2, 1)], cost=[1] * 3, output_bytes=[1] * 3)
    assert info.value.node == 1
    with pytest.raises(GraphError, match="dangling"):
        DFGraph(names="ab", edges=[(0, 5)], cost=[1] * 2, output_bytes=[1] * 2)
    with pytest.raises(GraphError, match="node 1 .*cost"):
        DFGraph(names="ab", edges=[(0, 1)], cost=[1, float("nan")], output_bytes=[1] * 2)
    with pytest.raises(GraphError, match="output_bytes"):
        DFGraph(names="ab", edges=[(0, 1)], cost=[1, 1], output_bytes=[1, -3])


def test_byte_counts_beyond_any_device_are_refused_by_field():
    """A byte count like 1e30 ended in an OverflowError inside the simulator."""
    with pytest.raises(GraphError, match=r"node 1 \(b\): output_bytes is 1e\+30 bytes, more than any device"):
        DFGraph("ab", [(0, 1)], [1, 1], [1, 1e30])
    with pytest.raises(GraphError, match="fixed_bytes is .* more than any device"):
        DFGraph("ab", [(0, 1)], [1, 1], [1, 1], fixed_bytes=2**60)
    assert DFGraph("ab", [(0, 1)], [1, 1], [1, 2**48]).output_bytes[1] == 2**48


def test_sizes_and_costs_are_checked_before_they_are_converted():
    """int() of infinity raised OverflowError and of NaN a bare ValueError before the
    finiteness check ran, and 2.7 bytes became 2 without a word."""
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(GraphError, match=r"node 0 \(a\): output_bytes must be finite") as info:
            DFGraph(["a"], [], [1.0], [bad])
        assert info.value.node == 0
    with pytest.raises(GraphError, match=r"node 1 \(b\): output_bytes must be a whole number of bytes, got 2.7"):
        DFGraph("ab", [(0, 1)], [1, 1], [1, 2.7])
    with pytest.raises(GraphError, match=r"node 0 \(a\): workspace_bytes must be a whole number"):
        DFGraph("ab", [(0, 1)], [1, 1], [1, 1], workspace_bytes=[0.5, 0])
    with pytest.raises(GraphError, match="fixed_bytes must be a whole number"):
        DFGraph("ab", [(0, 1)], [1, 1], [1, 1], fixed_bytes=1.5)
    with pytest.raises(GraphError, match=r"node 1 \(b\): cost must be a number, got '3'"):
        DFGraph("ab", [(0, 1)], [1, "3"], [1, 1])
    with pytest.raises(GraphError, match=r"edge \(0, 1.5\)"):
        DFGraph("ab", [(0, 1.5)], [1, 1], [1, 1])
    with pytest.raises(GraphError, match="not a pair"):
        DFGraph("ab", [(0,)], [1, 1], [1, 1])
    g = DFGraph("ab", [(0, 1)], [1, 2.5], [8.0, np.int64(4)], fixed_bytes=2.0)
    assert g.output_bytes == (8, 4) and g.fixed_bytes == 2 and g.cost == (1.0, 2.5)
    assert all(type(b) is int for b in (*g.output_bytes, g.fixed_bytes))


def test_documents_missing_a_field_raise_graph_errors_naming_it():
    tfremat_format = chain4().to_dict()
    del tfremat_format["nodes"][2]["cost"]
    with pytest.raises(GraphError, match="node 2 has no 'cost' field"):
        load_graph(tfremat_format)
    checkmate = {"nodes": [{"id": 0, "name": "x", "cost_cpu": 1, "cost_ram": 4}], "links": []}
    with pytest.raises(GraphError, match="node 0 has no 'backward' field"):
        load_graph(checkmate)
    checkmate["nodes"][0]["backward"] = False
    checkmate["links"] = [{"source": 0}]
    with pytest.raises(GraphError, match=r"links\[0\] has no 'target' field"):
        load_graph(checkmate)
    moccasin = _moccasin_document()
    del moccasin["nodes"][0]["out_cost"]
    with pytest.raises(GraphError, match="node 5 has no 'out_cost' field"):
        load_graph(moccasin)
    moccasin = _moccasin_document()
    moccasin["links"].append({"0": 5, "1": 9})
    with pytest.raises(GraphError, match="dangling: node 9 does not exist"):
        load_graph(moccasin)
    for nodes in ({"0": {}}, [5]):
        with pytest.raises(GraphError, match="nodes"):
            load_graph({**chain4().to_dict(), "nodes": nodes})


def test_from_unordered_renumbers_topologically():
    g = DFGraph.from_unordered(["c", "a", "b"], [("a", "b"), ("b", "c")], cost=[3, 1, 2], output_bytes=[30, 10, 20])
    assert g.names == ("a", "b", "c")
    assert g.cost == (1.0, 2.0, 3.0)
    assert g.edges == ((0, 1), (1, 2))


def test_from_unordered_follows_a_given_order_and_checks_it():
    ids, edges = ["c", "a", "b", "d"], [("a", "b"), ("b", "c"), ("a", "d")]
    fields = dict(cost=[3, 1, 2, 4], output_bytes=[30, 10, 20, 40])
    g = DFGraph.from_unordered(ids, edges, order=["a", "d", "b", "c"], **fields)
    assert g.names == ("a", "d", "b", "c")
    assert g.cost == (1.0, 4.0, 2.0, 3.0)
    with pytest.raises(GraphError, match="puts node 'b' before its input 'a'"):
        DFGraph.from_unordered(ids, edges, order=["b", "a", "c", "d"], **fields)
    with pytest.raises(GraphError, match="3 ids for 4 nodes"):
        DFGraph.from_unordered(ids, edges, order=["a", "b", "c"], **fields)
    with pytest.raises(GraphError, match="every node once"):
        DFGraph.from_unordered(ids, edges, order=["a", "b", "c", "c"], **fields)
    with pytest.raises(GraphError, match=r"unknown \['e'\]"):
        DFGraph.from_unordered(ids, edges, order=["a", "b", "c", "e"], **fields)


def _moccasin_document(order=None):
    graph = {"name": "tiny"} if order is None else {"name": "tiny", "order": order}
    return {
        "directed": True, "multigraph": False, "graph": graph,
        "nodes": [{"name": v, "duration": 1, "out_cost": 10 * (v + 1), "param_cost": 0} for v in (5, 7, 6)],
        "links": [{"0": 5, "1": 6}, {"0": 5, "1": 7}],
    }


def test_moccasin_documents_load_in_their_stored_order_unless_told_otherwise():
    """Moccasin's evaluation runs its random graphs in their stored ``graph.order``."""
    assert load_graph(_moccasin_document([5, 7, 6])).names == ("5", "7", "6")
    assert load_graph(_moccasin_document([5, 7, 6]), order="topological").names == ("5", "6", "7")
    assert load_graph(_moccasin_document()).names == ("5", "6", "7")
    with pytest.raises(GraphError, match="graph.order: .*before its input.*order='topological'"):
        load_graph(_moccasin_document([7, 5, 6]))
    for stored in (5, [[5], [7], [6]]):
        with pytest.raises(GraphError, match="graph.order: it must be a list of node ids"):
            load_graph(_moccasin_document(stored))
    broken = _moccasin_document([5, 7, 6])
    broken["nodes"][1]["duration"] = -1
    with pytest.raises(GraphError, match="cost must be finite") as info:
        load_graph(broken)
    assert "graph.order" not in str(info.value)
    with pytest.raises(ValueError, match="order='given'"):
        load_graph(_moccasin_document(), order="given")


def test_graph_is_immutable():
    g = chain4()
    with pytest.raises(AttributeError):
        g.fixed_bytes = 0


def test_schedule_using_unavailable_value_is_rejected():
    g = chain4()
    R = np.eye(4, dtype=bool)  # stage 2 computes c but b is neither kept nor recomputed
    with pytest.raises(ScheduleError) as info:
        validate_schedule(g, Schedule(R, np.zeros((4, 4), dtype=bool)))
    assert info.value.rule == "input-resident"
    assert (info.value.stage, info.value.node) == (1, 1)


def test_schedule_rules_named():
    g = chain4()
    good = get_strategy("checkpoint_all")(g)
    R = good.R.copy()
    R[2, 2] = False
    with pytest.raises(ScheduleError) as info:
        validate_schedule(g, Schedule(R, good.S))
    assert info.value.rule == "frontier"
    S = good.S.copy()
    S[3, 0] = True  # a was freed in stage 1 and is not resident in stage 2
    with pytest.raises(ScheduleError) as info:
        validate_schedule(g, Schedule(good.R, S))
    assert info.value.rule == "keep-source"


# ----- serialization -----


def test_graph_json_round_trip(tmp_path):
    g = random_training_graph(3, 6)
    path = tmp_path / "g.json"
    g.to_json(path)
    again = load_graph(path)
    assert again == g
    assert again.fingerprint == g.fingerprint
    assert again.forward_of == g.forward_of


def test_schedule_json_round_trip_checks_fingerprint():
    g = random_training_graph(4, 6)
    schedule = get_strategy("chen_sqrtn")(g)
    data = json.loads(json.dumps(schedule.to_dict(g)))
    again = Schedule.from_dict(data, g)
    assert np.array_equal(again.R, schedule.R) and np.array_equal(again.S, schedule.S)
    other = random_training_graph(5, 6)
    with pytest.raises(ScheduleError) as info:
        Schedule.from_dict(data, other)
    assert info.value.rule == "fingerprint"


@pytest.mark.parametrize("entry", [[-1, 0], [0, -2], [99, 0], [0.5, 0]])
def test_schedule_document_with_an_index_outside_the_graph_is_malformed(entry):
    """numpy wrapped a negative index around to the last stage or node."""
    g = random_training_graph(4, 6)
    data = json.loads(json.dumps(get_strategy("checkpoint_all")(g).to_dict(g)))
    data["S"].append(entry)
    with pytest.raises(ScheduleError) as info:
        Schedule.from_dict(data)
    assert info.value.rule == "format"


def test_fingerprint_ignores_names_and_sees_everything_else():
    """A rebuilt Keras model names its layers anew (dense, then dense_7); its schedule
    must still be found in the cache."""
    g = random_training_graph(4, 6)
    data = g.to_dict()
    for node in data["nodes"]:
        node["name"] = f"renamed_{node['id']}"
    renamed = load_graph(data)
    assert renamed.names != g.names and renamed.fingerprint == g.fingerprint
    data["nodes"][0]["cost"] += 1.0
    assert load_graph(data).fingerprint != g.fingerprint


# ----- a node's output and its residuals, freed apart (DFGraph.residual_bytes) -----


def _split_chain(residual: int = 30) -> DFGraph:
    """f0 -> f1 -> f2, f1 worth 100 bytes of which ``residual`` only f1's backward reads."""
    base = training_graph([(0, 1), (1, 2)], [10, 100, 10], reads_output={1})
    residual_bytes = [0] * base.size
    residual_bytes[1] = residual
    return DFGraph(base.names, base.edges, base.cost, base.output_bytes, base.workspace_bytes, base.is_backward,
                   base.loss_node, dict(base.forward_of), base.fixed_bytes, "split", residual_bytes=residual_bytes)


def _replay_parts(graph: DFGraph, plan) -> None:
    """Replays a plan part by part: every read finds the part it reads resident, every free
    frees a resident part, every computed value is freed by the end."""
    resident: dict[int, set] = {}
    for statement in plan:
        node = statement.node
        if statement.op is Op.COMPUTE:
            for i in graph.predecessors[node]:
                part = graph.part_read_by(i, node)
                assert part in resident.get(i, ()), f"{graph.names[node]} reads {part} of {graph.names[i]}, not resident"
            resident[node] = set(graph.value_parts(node))
        elif statement.op is Op.DEALLOCATE:
            parts = resident.get(node, set())
            freeing = set(graph.value_parts(node)) if statement.part is None else {statement.part}
            assert freeing <= parts, f"frees {freeing} of {graph.names[node]}, resident: {parts}"
            parts -= freeing
    assert not any(resident.values()), {graph.names[i]: p for i, p in resident.items() if p}


def test_a_split_node_frees_its_output_after_its_last_forward_reader_and_keeps_its_residual():
    graph = _split_chain(residual=30)
    plan = build_plan(graph, get_strategy("checkpoint_all")(graph))
    _replay_parts(graph, plan)
    frees = [(s.stage, s.part) for s in plan if s.op is Op.DEALLOCATE and s.node == 1]
    # The output part dies after its last reader, f2's backward (which reads f2's input); the
    # residual after f1's backward.
    assert frees == [(graph.backward_of[2], "output"), (graph.backward_of[1], "residual")]
    whole = _split_chain(residual=0)
    schedule = get_strategy("checkpoint_all")(whole)
    split_trace, whole_trace = simulate(graph, schedule).trace_bytes, simulate(whole, schedule).trace_bytes
    freed_at = next(k for k, s in enumerate(plan) if s.op is Op.DEALLOCATE and s.part == "output")
    # Until the output part is freed the two graphs hold the same bytes; freeing it releases
    # the 70 output bytes, and the whole-value graph holds them until f1's backward.
    np.testing.assert_array_equal(split_trace[:freed_at], whole_trace[:freed_at])
    assert split_trace[freed_at] == split_trace[freed_at - 1] - 70
    assert simulate(graph, schedule).peak_bytes <= simulate(whole, schedule).peak_bytes


def test_residual_bytes_are_validated_and_survive_json_and_leave_other_graphs_unchanged():
    graph = _split_chain()
    assert load_graph(json.loads(graph.to_json())) == graph
    assert "residual_bytes" not in json.dumps(training_graph([(0, 1)], [1, 2]).to_dict())
    with pytest.raises(GraphError, match="residual_bytes 200 > output_bytes"):
        DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, residual_bytes=[0, 200] + [0] * 5,
                is_backward=graph.is_backward, loss_node=graph.loss_node, forward_of=dict(graph.forward_of))
    with pytest.raises(GraphError, match="no backward node"):
        DFGraph(graph.names, graph.edges, graph.cost, graph.output_bytes, residual_bytes=[0, 0, 5] + [0] * 4,
                is_backward=graph.is_backward, loss_node=graph.loss_node)


def test_the_lower_bound_counts_only_the_part_a_backward_node_reads():
    from tfremat.ilp.formulation import memory_lower_bound

    split, whole = _split_chain(residual=30), _split_chain(residual=0)
    # f1's backward reads 30 residual bytes of f1 instead of all 100.
    assert memory_lower_bound(split) <= memory_lower_bound(whole)
    backward = split.backward_of[1]
    assert split.part_bytes(1, split.part_read_by(1, backward)) == 30
    assert split.part_bytes(1, split.part_read_by(1, 2)) == 70


@pytest.mark.parametrize("strategy", ["checkpoint_all", "chen_sqrtn", "griewank_logn", "eviction", "optimal"])
@pytest.mark.parametrize("seed", range(4))
def test_every_strategy_plans_graphs_with_split_nodes_part_by_part(strategy, seed):
    graph = with_residuals(random_training_graph(seed, 8), seed)
    assert any(graph.residual_bytes)
    budget = int(0.8 * simulate(graph, get_strategy("checkpoint_all")(graph)).peak_bytes)
    try:
        schedule = get_strategy(strategy)(graph, budget)
    except InfeasibleBudgetError:
        schedule = get_strategy(strategy)(graph)
    result = simulate(graph, schedule)
    _replay_parts(graph, result.plan)
    if schedule.facts is not None and schedule.facts.peak_bytes is not None:
        # The MILP counts a split node's value whole, so the plan never holds more than it says.
        assert result.peak_bytes <= schedule.facts.peak_bytes
