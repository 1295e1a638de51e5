"""Tests of batch-size maximization (tfremat.maxbatch)."""

from __future__ import annotations

import pytest

from tests.test_ilp import training_chain
from tfremat.errors import BudgetFormatError, InfeasibleBudgetError
from tfremat.maxbatch import max_batch_size, one_extra_forward_cap
from tfremat.plan.simulator import simulate


def fits_by_scan(batch, budget, strategy, cap_of):
    graph = training_chain(4, batch)
    from tfremat.strategies import get_strategy

    try:
        schedule = get_strategy(strategy)(graph, budget, threads=1)
    except InfeasibleBudgetError:
        return False
    return schedule.cost(graph) <= cap_of(graph)


@pytest.mark.parametrize("max_overhead", [None, 0.0, 0.2])
def test_max_batch_matches_a_linear_scan(max_overhead):
    budget = 16 + 4 * 12
    def cap_of(graph):
        return one_extra_forward_cap(graph) if max_overhead is None else (1 + max_overhead) * graph.total_cost

    result = max_batch_size(
        lambda b: training_chain(4, b), budget, max_overhead=max_overhead, max_batch=64, threads=1,
    )
    scan = [b for b in range(1, 17) if fits_by_scan(b, budget, "optimal", cap_of)]
    assert result.batch_size == max(scan)
    assert simulate(result.graph, result.schedule).peak_bytes <= budget
    assert result.cost <= result.cost_cap
    assert result.tried[result.batch_size] is True


def test_max_batch_raises_when_nothing_fits():
    from tfremat.ilp import memory_lower_bound

    lower_bound = memory_lower_bound(training_chain(3, 1))
    with pytest.raises(InfeasibleBudgetError) as info:
        max_batch_size(lambda b: training_chain(3, b), 20, threads=1)
    assert info.value.lower_bound_bytes == lower_bound and info.value.proven == (20 < lower_bound)
    with pytest.raises(InfeasibleBudgetError) as info:
        max_batch_size(lambda b: training_chain(3, b), 20, method="direct", max_batch=8, threads=1)
    assert info.value.min_feasible_bytes > 20


def test_max_batch_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_batch"):
        max_batch_size(lambda b: training_chain(3, b), 100, min_batch=0)


@pytest.mark.parametrize("max_overhead", [None, 0.0, 0.3])
@pytest.mark.parametrize("extra", [8, 12, 20])
def test_direct_formulation_matches_the_search(max_overhead, extra):
    budget = 16 + 4 * extra
    search = max_batch_size(lambda b: training_chain(4, b), budget, max_overhead=max_overhead, max_batch=64,
                            threads=1, mip_gap=0.0)
    direct = max_batch_size(lambda b: training_chain(4, b), budget, max_overhead=max_overhead, max_batch=64,
                            method="direct", threads=1, mip_gap=0.0)
    assert direct.method == "direct"
    assert direct.batch_size == search.batch_size
    assert direct.upper_bound == direct.batch_size
    assert simulate(direct.graph, direct.schedule).peak_bytes <= budget
    assert direct.cost <= direct.cost_cap


@pytest.mark.parametrize("seed", range(3))
def test_min_peak_within_cost_equals_brute_force(seed):
    from tests.test_ilp import brute_force_frontier, random_dag
    from tfremat.maxbatch import min_peak_within_cost

    graph = random_dag(5, 40 + seed)
    points = brute_force_frontier(graph)
    for cap in sorted({c for _, c in points})[:4]:
        best = min(p for p, c in points if c <= cap)
        schedule = min_peak_within_cost(graph, cap, threads=1, mip_gap=0.0)
        assert schedule.facts.peak_bytes == best == simulate(graph, schedule).peak_bytes
        assert schedule.cost(graph) <= cap + 1e-9
        assert schedule.facts.peak_bound_bytes <= best
    with pytest.raises(ValueError, match="no-remat cost"):
        min_peak_within_cost(graph, 0.5 * graph.total_cost)


def test_direct_formulation_refuses_graphs_that_do_not_scale():
    from tests.test_ilp import training_chain as chain
    from tfremat.graph import DFGraph

    def with_constant_scratch(batch):
        g = chain(4, batch)
        return DFGraph(names=g.names, edges=g.edges, cost=g.cost, output_bytes=g.output_bytes,
                       workspace_bytes=[32] * g.size, fixed_bytes=g.fixed_bytes)

    with pytest.raises(ValueError, match="method='search'"):
        max_batch_size(with_constant_scratch, 200, method="direct", threads=1)
    with pytest.raises(ValueError, match="method must be"):
        max_batch_size(lambda b: training_chain(3, b), 100, method="scan")
    with pytest.raises(ValueError, match="strategy="):
        max_batch_size(lambda b: training_chain(3, b), 100, method="direct", strategy="chen_greedy")


def test_max_batch_takes_a_budget_with_a_unit_but_not_a_share():
    budget = 16 + 4 * 12
    in_bytes = max_batch_size(lambda b: training_chain(4, b), budget, max_batch=64, threads=1)
    with_unit = max_batch_size(lambda b: training_chain(4, b), f"{budget}B", max_batch=64, threads=1)
    assert with_unit.batch_size == in_bytes.batch_size
    with pytest.raises(BudgetFormatError, match="80%"):
        max_batch_size(lambda b: training_chain(4, b), "80%", max_batch=64, threads=1)


def test_max_batch_warns_when_a_solver_error_decides_a_batch(caplog):
    """A batch whose solve stops without a schedule counts as not fitting, and says so."""
    with caplog.at_level("WARNING", logger="tfremat.maxbatch"), pytest.raises(InfeasibleBudgetError):
        max_batch_size(
            lambda b: training_chain(4, b), 16 + 4 * 12, max_batch=64, strategy="approx_lp", threads=1,
            time_limit=1e-9,
        )
    assert any("batch 1 counts as not fitting" in record.message and "time_limit" in record.message
               for record in caplog.records)


def test_max_batch_checks_solver_options_before_searching():
    """A bad option is an error, not "batch 1 does not fit"."""
    from tfremat.errors import ArgumentError

    with pytest.raises(ArgumentError, match="unknown solver 'cplex'"):
        max_batch_size(lambda b: training_chain(4, b), 16 + 4 * 12, max_batch=64, solver="cplex")


def test_max_batch_names_options_the_strategy_does_not_take():
    chain = lambda b: training_chain(4, b)  # noqa: E731
    with pytest.raises(ValueError, match="strategy 'chen_greedy' takes no option 'time_limit'"):
        max_batch_size(chain, 16 + 4 * 12, strategy="chen_greedy", max_batch=64, time_limit=5)
    with pytest.raises(ValueError, match="min_peak_within_cost.*takes no option 'warm_start'"):
        max_batch_size(chain, 16 + 4 * 12, method="direct", max_batch=64, warm_start=False)
    with pytest.raises(ValueError, match="max_overhead must be a number"):
        max_batch_size(chain, 16 + 4 * 12, max_overhead="0.3")
    with pytest.raises(ValueError, match="needs max_batch > min_batch"):
        max_batch_size(chain, 16 + 4 * 12, method="direct", min_batch=4, max_batch=4)


def test_max_batch_error_names_the_overhead_cap_when_it_is_the_cause():
    """Batch 1 fits in memory only by recomputing more than the cap allows."""
    from tfremat.ilp import memory_lower_bound

    graph = training_chain(4, 1)
    with pytest.raises(InfeasibleBudgetError, match="max_overhead") as info:
        max_batch_size(lambda b: training_chain(4, b), memory_lower_bound(graph) + 4, max_overhead=0.0, threads=1)
    assert not info.value.proven


def test_max_batch_refuses_bounds_that_are_no_ints():
    """min_batch="1" was a TypeError from a comparison, 1.5 a TensorFlow shape error."""
    from tfremat.errors import ArgumentError

    chain = lambda b: training_chain(3, b)  # noqa: E731
    for bounds, name in ((dict(min_batch="1"), "min_batch"), (dict(min_batch=1.5), "min_batch"),
                         (dict(max_batch="64"), "max_batch"), (dict(min_batch=True), "min_batch"),
                         (dict(max_batch=0), "max_batch")):
        with pytest.raises(ArgumentError, match=f"{name} must be an int >= 1, got"):
            max_batch_size(chain, 100, **bounds)
    with pytest.raises(ArgumentError, match="need min_batch <= max_batch"):
        max_batch_size(chain, 100, min_batch=8, max_batch=4)


def test_max_batch_reports_each_batch_and_says_when_it_reached_max_batch(caplog):
    """The search stopped at max_batch with nothing to tell that the answer was the cap."""
    chain = lambda b: training_chain(4, b)  # noqa: E731
    seen = []
    with caplog.at_level("WARNING", logger="tfremat.maxbatch"):
        capped = max_batch_size(chain, 10**6, strategy="checkpoint_all", max_batch=6,
                                batch_progress=lambda batch, fits: seen.append((batch, fits)))
    assert capped.batch_size == 6 and capped.reached_max_batch
    assert seen == [(1, True), (2, True), (4, True), (6, True)] and dict(seen) == dict(capped.tried)
    assert any("batch 6, the max_batch" in r.message and "raise max_batch" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tfremat.maxbatch"):
        found = max_batch_size(chain, 16 + 4 * 12, strategy="checkpoint_all", max_batch=64)
    assert found.batch_size < 64 and not found.reached_max_batch and not caplog.records
    with caplog.at_level("WARNING", logger="tfremat.maxbatch"):
        direct = max_batch_size(chain, 10**6, method="direct", max_batch=8, threads=1)
    assert direct.batch_size == 8 and direct.reached_max_batch
    assert any("raise max_batch" in r.message for r in caplog.records)


def test_keras_max_batch_size_labels_for_its_loss_shows_progress_and_checks_first(capsys):
    """A sparse loss got one-hot labels (a Keras rank error); each batch built is shown; an
    empty strategy list returned {} where compare_graph ran every strategy."""
    from tests.test_cache_api import dense_classifier
    from tfremat.api import max_batch_size as keras_max_batch_size
    from tfremat.errors import ArgumentError

    model = dense_classifier(loss="sparse_categorical_crossentropy")
    results = keras_max_batch_size(model, "1MiB", strategies=["checkpoint_all"], max_batch=4, cost_model="flops")
    assert results["checkpoint_all"].batch_size == 4 and results["checkpoint_all"].reached_max_batch
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("s ", 1)[1] for line in lines if "tfremat max_batch_size checkpoint_all:" in line] == [
        "batch 2 fits", "batch 4 fits"]  # the graphs built; the scaled search judges batch 3 on their line
    # The answer's step, then held on the allocator.
    assert [line.split("s ", 1)[1] for line in lines if "checkpoint_all on the allocator:" in line] == ["batch 4 fits"]
    keras_max_batch_size(model, "1MiB", strategies=["checkpoint_all"], max_batch=2, cost_model="flops", verbose=0)
    assert "tfremat max_batch_size" not in capsys.readouterr().err
    for bad, match in ((dict(strategies=[]), "strategies is empty"), (dict(min_batch="1"), "min_batch must be"),
                       (dict(max_batch=1.5), "max_batch must be")):
        with pytest.raises(ArgumentError, match=match):
            keras_max_batch_size(model, "1MiB", **bad)
    with pytest.raises(ArgumentError, match="model must be a keras.Model"):
        keras_max_batch_size(None, "1MiB")


def _irregular_chain(layers: int, batch: int):
    """A training chain whose sizes are affine in the batch plus a workspace that is not
    (a CPU convolution's scratch buffer grows in steps), so a line through two batches
    mispredicts some others."""
    from tfremat.graph import DFGraph

    chain = training_chain(layers, batch)
    workspace = [0] * chain.size
    workspace[chain.size - 1] = 8 * (batch // 5)
    return DFGraph(chain.names, chain.edges, chain.cost, [4 * batch + 2] * chain.size, workspace, chain.is_backward,
                   chain.loss_node, dict(chain.forward_of), 16 + 3 * batch, chain.name)


def _built_counting(factory, built):
    def graph_for_batch(batch):
        built.append(batch)
        return factory(4, batch)

    return graph_for_batch


@pytest.mark.parametrize("budget", [64, 150, 333, 900])
def test_the_scaled_search_finds_the_searchs_answer_from_two_graphs(budget):
    """Building a graph is what makes a search slow: ``scaled`` builds batches 2 and 4,
    judges the others on their affine extension, which on an affine family is the built
    graph, and builds only its answer to certify it, so it answers as ``search`` does."""
    built = {"search": [], "scaled": []}
    results = {}
    for method in ("search", "scaled"):
        try:
            results[method] = max_batch_size(_built_counting(training_chain, built[method]), budget, method=method,
                                             max_batch=512, strategy="chen_greedy")
        except InfeasibleBudgetError:
            results[method] = None
    answer = results["search"] and results["search"].batch_size
    assert (results["scaled"] and results["scaled"].batch_size) == answer
    if answer is not None and answer > 8:
        assert built["scaled"] == [2, 4, answer] == list(results["scaled"].built), built
        assert len(set(built["search"])) > 6 and list(results["search"].built) == list(dict.fromkeys(built["search"]))
        assert "scaled" not in results["scaled"].graph.name  # the graph built at the answer


def _stepped(batch):
    """A chain whose last node's scratch grows in steps of 5 batches: none at batches 2 and
    4, so the line through them underestimates every larger batch (CPU convolution scratch
    did so on ResNet50 at 64x64)."""
    chain = training_chain(4, batch)
    return chain.replaced(workspace_bytes=[0] * (chain.size - 1) + [64 * (batch // 5)])


@pytest.mark.parametrize("strategy", ["chen_greedy", "optimal"])
def test_the_scaled_search_certifies_its_answer_on_a_built_graph_and_steps_down(strategy, caplog):
    """The line through batches 2 and 4 says batch 19 fits; the graph built at 19 refutes
    it, and the line through the built graphs at 4 and 19 proposes 14, which its built graph
    certifies: the answer is the built graph's, as ``search`` finds, from one more build."""
    from tfremat.maxbatch import affine_graphs

    options = {"threads": 1, "mip_gap": 0.0} if strategy == "optimal" else {}
    line = affine_graphs(_stepped(2), 2, _stepped(4), 4)
    with caplog.at_level("INFO", logger="tfremat.maxbatch"):
        result = max_batch_size(_stepped, 333, method="scaled", max_batch=512, strategy=strategy, **options)
    search = max_batch_size(_stepped, 333, method="search", max_batch=512, strategy=strategy, **options)
    assert result.batch_size == search.batch_size == 14 and result.built == (2, 4, 19, 14)
    assert result.graph.workspace_bytes == _stepped(14).workspace_bytes != line(14).workspace_bytes
    assert simulate(result.graph, result.schedule).peak_bytes <= 333 and result.cost <= result.cost_cap
    assert result.tried[19] is False and result.tried[14] is True
    assert any("batch 19 does not fit on the graph built at it; next candidate 14" in r.message
               for r in caplog.records)
    assert any("answer: batch 14, certified on a graph built at batch 14" in r.message for r in caplog.records)


def test_the_scaled_search_bounds_its_builds_and_falls_back_to_a_built_batch(caplog):
    """Scratch that jumps right above the built batches makes every line below the truth:
    after three refuted builds the search stops and answers the largest built batch that
    fits, with a warning, rather than an answer no built graph certified."""
    def jump(batch):
        chain = training_chain(4, batch)
        return chain.replaced(workspace_bytes=[0] * (chain.size - 1) + [0 if batch <= 4 else 200])

    built = []
    with caplog.at_level("WARNING", logger="tfremat.maxbatch"):
        result = max_batch_size(_built_counting(lambda _, b: jump(b), built), 333, method="scaled", max_batch=512,
                                strategy="chen_greedy")
    assert result.batch_size == 4 and len(built) == 2 + 3 == len(result.built), built
    assert all(not result.tried[b] for b in built[2:])
    assert any("within 3 builds" in r.message and "answering batch 4" in r.message for r in caplog.records)


def test_affine_graphs_pass_through_both_graphs_and_refuse_other_structures():
    from tfremat.errors import ArgumentError
    from tfremat.maxbatch import affine_graphs

    at = affine_graphs(training_chain(4, 2), 2, training_chain(4, 6), 6)
    for batch in (2, 6, 40):
        assert at(batch).output_bytes == training_chain(4, batch).output_bytes
        assert at(batch).fixed_bytes == training_chain(4, batch).fixed_bytes
    with pytest.raises(ArgumentError, match="differ in nodes"):
        affine_graphs(training_chain(4, 2), 2, training_chain(5, 6), 6)


def test_the_scaled_search_draws_its_line_through_the_edges_both_graphs_have():
    """A gradient can read a forward output at a small batch alone (ResNet50's batch-norm
    gradients at batches 2 and 4, not at 142): the line keeps the edges both built graphs
    have, so a read seen at one small batch does not hold the answer down, and no graphs
    are built until two agree (six ResNet50 graphs, minutes each)."""
    from tfremat.graph import DFGraph

    built = []

    def graph_for_batch(batch):
        built.append(batch)
        chain = training_chain(4, batch)
        extra = [(0, chain.size - 2)] if batch == 2 else []
        return DFGraph(chain.names, [*chain.edges, *extra], chain.cost, chain.output_bytes, chain.workspace_bytes,
                       chain.is_backward, chain.loss_node, dict(chain.forward_of), chain.fixed_bytes, chain.name)

    search = max_batch_size(graph_for_batch, 900, method="search", max_batch=512, strategy="chen_greedy")
    built.clear()
    scaled = max_batch_size(graph_for_batch, 900, method="scaled", max_batch=512, strategy="chen_greedy")
    assert scaled.batch_size == search.batch_size
    assert built == [2, 4, scaled.batch_size]  # the line's two graphs, and the answer's to certify it
    assert (0, scaled.graph.size - 2) not in scaled.graph.edges


def test_offloading_fits_a_larger_batch_without_recomputation():
    """At zero overhead recomputation is out; a fast host link still lets values wait in host
    memory, so autocapper fits a larger batch than rotor (3 against 2 here), and it needs the link."""
    from tfremat.errors import ArgumentError

    budget = 16 + 4 * 12
    chain = lambda b: training_chain(4, b)  # noqa: E731
    rotor = max_batch_size(chain, budget, strategy="rotor", max_overhead=0.0, max_batch=64)
    offload = max_batch_size(chain, budget, strategy="autocapper", max_overhead=0.0, max_batch=64, bandwidth=1e9)
    assert offload.batch_size > rotor.batch_size and offload.schedule.offloads
    assert simulate(offload.graph, offload.schedule).makespan <= offload.cost_cap
    with pytest.raises(ArgumentError, match="bandwidth"):
        max_batch_size(chain, budget, strategy="autocapper", max_batch=64)


@pytest.mark.parametrize("budget", [64, 150, 333])
@pytest.mark.parametrize("factory", [training_chain, _irregular_chain])
def test_the_scaled_search_with_optimal_answers_as_the_search(factory, budget):
    """With ``optimal`` the scaled search brackets its estimates by the keep-everything
    schedule and the memory lower bound and skips the solver where keep-everything fits;
    only built graphs decide, so it answers as ``search`` does."""
    results, built = {}, {"search": set(), "scaled": set()}
    for method in ("search", "scaled"):
        def graph_for_batch(batch, method=method):
            built[method].add(batch)
            return factory(4, batch)

        results[method] = max_batch_size(graph_for_batch, budget, method=method, max_batch=512, threads=1,
                                         mip_gap=0.0)
    assert results["scaled"].batch_size == results["search"].batch_size
    best = results["scaled"]
    assert simulate(best.graph, best.schedule).peak_bytes <= budget and best.cost <= best.cost_cap
    if best.batch_size > 8:
        assert len(built["scaled"]) < len(built["search"]), built


def _counting_optimal(monkeypatch, solved):
    """Makes the search's ``optimal`` record the name of each graph it solves."""
    import tfremat.maxbatch as maxbatch

    real = maxbatch.get_strategy("optimal")

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, graph, budget, **options):
            solved.append((graph.name, options))
            return real(graph, budget, **options)

    monkeypatch.setattr(maxbatch, "get_strategy", lambda name: Counting())


def _batch_of(name: str) -> int:
    return int(name.split("batch ")[1].split(",")[0])


def test_the_scaled_search_does_not_solve_where_keeping_everything_fits(monkeypatch):
    """Keeping every value runs each node once, the least cost there is: a batch where it
    fits needs no solve (``optimal`` spent 18 s on such a ResNet50 batch)."""
    from tfremat.plan.simulator import checkpoint_all_peak

    solved = []
    _counting_optimal(monkeypatch, solved)
    budget = checkpoint_all_peak(training_chain(4, 10))  # keep-everything fits up to batch 10
    result = max_batch_size(lambda b: training_chain(4, b), budget, method="scaled", max_batch=512, threads=1,
                            mip_gap=0.0)
    assert all(result.tried[b] for b in (2, 4, 10))
    assert result.batch_size >= 10 and result.cost <= result.cost_cap
    assert simulate(result.graph, result.schedule).peak_bytes <= budget
    assert all("scaled" in name and _batch_of(name) > 10 for name, _ in solved), solved


@pytest.mark.parametrize("budget", [100, 150, 333])
def test_the_scaled_search_solves_only_above_the_heuristics_reach(monkeypatch, budget):
    """``optimal`` on the scaled graphs: the keep-everything and eviction schedules certify
    what they fit, the memory lower bound refuses what it can, and the MILP is asked only at
    the batch above the best certificate, capped in time and stopped at the first schedule
    within the overhead cap; on an affine family it answers as the search on built graphs."""
    from tfremat.maxbatch import affine_graphs
    from tfremat.plan.eviction import eviction

    solved = []
    _counting_optimal(monkeypatch, solved)
    result = max_batch_size(lambda b: training_chain(4, b), budget, method="scaled", max_batch=512, threads=1,
                            time_limit=600, probe_seconds=30)
    # The line is exact on an affine family: the line's schedule certifies the built answer, unsolved
    # (the solves on built graphs are the anchors', before the line's probes).
    assert result.built[-1] == result.batch_size and "scaled" in solved[-1][0], solved
    search = max_batch_size(lambda b: training_chain(4, b), budget, method="search", max_batch=512, threads=1,
                            mip_gap=0.0)
    assert result.batch_size == search.batch_size
    assert simulate(result.graph, result.schedule).peak_bytes <= budget and result.cost <= result.cost_cap
    probes = [(_batch_of(name), options) for name, options in solved if "scaled" in name]
    assert probes and probes[-1][0] == result.batch_size + 1, probes  # the last probe refused the next batch
    line = affine_graphs(training_chain(4, 2), 2, training_chain(4, 4), 4)
    for batch, options in probes:
        assert options["time_limit"] == 30 and options["mip_gap"] > 0
        assert result.tried[batch - 1]  # asked only above a batch that fits
        try:
            cheap = eviction(line(batch), budget).cost(line(batch))
        except InfeasibleBudgetError:
            cheap = None
        assert cheap is None or cheap > one_extra_forward_cap(line(batch))  # no heuristic certificate there


def test_the_scaled_search_refuses_a_bad_probe_time_and_the_old_quick_method():
    from tfremat.errors import ArgumentError

    with pytest.raises(ArgumentError, match="probe_seconds must be"):
        max_batch_size(lambda b: training_chain(4, b), 64, method="scaled", probe_seconds=0)
    with pytest.raises(ArgumentError, match="'search', 'scaled' or 'direct'"):
        max_batch_size(lambda b: training_chain(4, b), 64, method="quick")


def test_affine_graphs_keep_a_backward_nodes_workspace_above_its_weight_gradients():
    """A backward node's workspace counts its forward node's weight gradients, which do not
    grow with the batch; a line through two noisy profiles (less scratch at the larger
    batch) must not take it below them."""
    from tfremat.graph import DFGraph
    from tfremat.maxbatch import affine_graphs

    def chain(batch, scratch):
        base = training_chain(3, batch)
        workspace = [0] * base.size
        backward = base.size - 1  # the backward node of forward node 0
        workspace[backward] = 40 + scratch
        return DFGraph(base.names, base.edges, base.cost, base.output_bytes, workspace, base.is_backward,
                       base.loss_node, dict(base.forward_of), base.fixed_bytes, base.name,
                       weight_grad_bytes=[40] + [0] * (base.size - 1))

    at = affine_graphs(chain(2, 30), 2, chain(4, 10), 4)
    for batch in (3, 8, 100):
        graph = at(batch)
        assert graph.workspace_bytes[graph.size - 1] >= 40 and graph.weight_grad_bytes[0] == 40
    assert at(3).workspace_bytes[at(3).size - 1] == 60


@pytest.mark.parametrize("change", ["edge", "nodes"])
def test_the_scaled_search_certifies_a_built_graph_the_lines_schedule_cannot_run_on(change):
    """From batch 10 the built graphs read one more value (an edge the line does not have)
    or have another layer (other nodes): the line's schedule is not run on them; the
    strategy judges the built graph itself, and graphs of other nodes are stepped down on
    by bisection, not on a line through them."""
    from tfremat.graph import DFGraph

    def graph_for_batch(batch):
        if change == "nodes":
            return training_chain(4 if batch < 10 else 5, batch)
        chain = training_chain(4, batch)
        extra = [(0, chain.size - 2)] if batch >= 10 else []
        return DFGraph(chain.names, [*chain.edges, *extra], chain.cost, chain.output_bytes, chain.workspace_bytes,
                       chain.is_backward, chain.loss_node, dict(chain.forward_of), chain.fixed_bytes, chain.name)

    built = []
    result = max_batch_size(_built_counting(lambda _, b: graph_for_batch(b), built), 333, method="scaled",
                            max_batch=512, strategy="chen_greedy")
    assert result.built == tuple(built) and len(built) <= 2 + 3 and built[:2] == [2, 4]
    assert result.graph.edges == graph_for_batch(result.batch_size).edges
    assert simulate(result.graph, result.schedule).peak_bytes <= 333 and result.cost <= result.cost_cap
    assert all(not result.tried[b] for b in built if b > result.batch_size)
    search = max_batch_size(graph_for_batch, 333, method="search", max_batch=512, strategy="chen_greedy")
    assert result.batch_size <= search.batch_size and (change == "nodes" or result.batch_size == search.batch_size)
