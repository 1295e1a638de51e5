"""Hong et al.'s checkpoint-selection DPs (Alg. 3, 5, 6) against brute force, and the
``hong`` / ``hong_ap`` strategies on training graphs."""

import itertools
import time

import numpy as np
import pytest
from graph_factories import SHARED_GRAPHS, random_training_graph, training_graph

from tfremat.errors import ArgumentError, InfeasibleBudgetError
from tfremat.graph import load_graph
from tfremat.plan import simulate, validate_schedule
from tfremat.plan.baselines import heuristic_deadline, schedule_for_checkpoints
from tfremat.plan.hong import (
    CLASSIC_MAX_LAYERS,
    _classic_queue,
    _classic_sweep,
    _segment_memories,
    classic_checkpoints,
    classic_peak,
    eager_checkpoints,
    eager_checkpoints_quadratic,
    eager_peak,
    hong_prediction,
)
from tfremat.plan.simulator import checkpoint_all_peak
from tfremat.strategies import get_strategy

DPS = {"classic": [classic_checkpoints], "eager": [eager_checkpoints_quadratic, eager_checkpoints]}
PEAK = {"classic": classic_peak, "eager": eager_peak}


def random_chains(seed, count, longest=10):
    """Short chains d_0..d_n (some with many zeros and ties), half with a candidate mask."""
    rng = np.random.default_rng(seed)
    for k in range(count):
        length = int(rng.integers(1, longest + 1))
        high = 3 if k % 3 == 0 else 10
        sizes = rng.integers(0, high, size=length).astype(float)
        mask = rng.random(length) < 0.6 if k % 2 else None
        yield sizes, mask


def brute_force(sizes, mask, peak):
    """The least modeled peak over every subset of the allowed interior positions."""
    interior = [p for p in range(1, len(sizes) - 1) if mask is None or mask[p]]
    return min(peak(sizes, subset) for r in range(len(interior) + 1)
               for subset in itertools.combinations(interior, r))


def test_the_peak_functions_follow_eq_6_and_eqs_9_to_12():
    """d = (1, 2, 3, 4), C = {0, 2, 3}: one segment {d_1}, one empty.
    Eq. 6: 1 + 3 + 4 + 2 = 10. Eq. 9: m(2) = (1 + 3) + 2 + max(1, 2) = 8,
    m(3) = (1 + 3 + 4) + 0 + max(3) = 11; the peak is 11. The ends count even when unlisted."""
    assert classic_peak([1, 2, 3, 4], [2]) == 10
    assert eager_peak([1, 2, 3, 4], [0, 2, 3]) == 11
    assert eager_peak([1, 2, 3, 4], [2]) == 11
    # No interior checkpoint: m(3) = (1 + 4) + (2 + 3) + max(1, 2, 3) = 13.
    assert eager_peak([1, 2, 3, 4], []) == 13
    assert classic_peak([5], []) == eager_peak([5], []) == 5


@pytest.mark.parametrize("model", ["classic", "eager"])
def test_each_dp_finds_the_least_modeled_peak_of_any_subset(model):
    """Every DP of the model against brute force over all subsets (n <= 10): the same
    least peak, and the subset it returns has that peak, holds both ends and only
    allowed positions."""
    for sizes, mask in random_chains(seed=3, count=300):
        least = brute_force(sizes, mask, PEAK[model])
        for dp in DPS[model]:
            found = dp(sizes, mask)
            assert found.peak == least, (dp.__name__, sizes, mask)
            assert PEAK[model](sizes, found.positions) == least, (dp.__name__, sizes, mask)
            assert found.positions[0] == 0 and found.positions[-1] == len(sizes) - 1
            assert list(found.positions) == sorted(set(found.positions))
            assert mask is None or all(mask[p] for p in found.positions[1:-1])


def test_the_linear_and_quadratic_dps_agree_on_long_chains():
    """Alg. 6 (O(n)) and Alg. 5 (O(n^2)) give the same optimum on chains of up to 400
    positions, zeros and candidate masks included, and Alg. 6's subset reaches it."""
    rng = np.random.default_rng(11)
    for k in range(60):
        length = int(rng.integers(2, 400))
        sizes = rng.integers(0, 1000, size=length).astype(float)
        if k % 3 == 0:
            sizes[rng.random(length) < 0.5] = 0
        mask = rng.random(length) < 0.4 if k % 2 else None
        linear, quadratic = eager_checkpoints(sizes, mask), eager_checkpoints_quadratic(sizes, mask)
        assert linear.peak == quadratic.peak
        assert eager_peak(sizes, linear.positions) == linear.peak


def test_alg_3_queue_and_the_vectorized_sweep_give_the_same_checkpoint_memory():
    """For every segment memory s, Alg. 3's monotone queue and the range-minimum sweep give
    the same least checkpoint memory c_s = d_n + M(n - 1, s) (inf where none fits)."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        length = int(rng.integers(2, 40))
        sizes = rng.integers(0, 20, size=length).astype(float)
        allowed = rng.random(length) < 0.7
        allowed[0] = allowed[-1] = True
        memories = _segment_memories(sizes, allowed)
        swept = _classic_sweep(sizes, allowed, memories)
        queued = [sizes[-1] + _classic_queue(sizes, allowed, s)[0][-1] for s in memories]
        assert np.array_equal(swept, queued)


def test_the_classic_dp_refuses_chains_longer_than_its_cap():
    with pytest.raises(ArgumentError, match="memory_model='eager'"):
        classic_checkpoints(np.ones(CLASSIC_MAX_LAYERS + 2))


@pytest.mark.parametrize("bad", [[], [[1, 2]], [1, -1], [1, float("nan")], "abc"])
def test_bad_sizes_raise_argument_errors(bad):
    with pytest.raises(ArgumentError, match="sizes must be"):
        eager_checkpoints(bad)


def test_a_mask_of_the_wrong_length_raises():
    with pytest.raises(ArgumentError, match="candidates must be a boolean mask"):
        classic_checkpoints([1, 2, 3], [True, False])


def chain_and_dags():
    """A chain, two random DAGs, and VGG16's benchmark graph where the shared graphs are
    present (CI's clean clone has none)."""
    vgg16 = SHARED_GRAPHS / "VGG16_256_224_224_3_train.json"
    return [
        training_graph([(j, j + 1) for j in range(11)], sizes=[4, 9, 2, 7, 7, 1, 8, 3, 3, 6, 2, 5],
                       reads_output=set(range(12)), fixed_bytes=3),
        random_training_graph(4, 12),
        random_training_graph(8, 16, skip_probability=0.6),
        *([load_graph(vgg16)] if vgg16.is_file() else []),
    ]


@pytest.mark.parametrize("name", ["hong", "hong_ap"])
@pytest.mark.parametrize("model", ["eager", "classic"])
def test_strategies_return_valid_schedules_that_fit_their_budget(name, model):
    """Without a budget: a valid schedule at least as low as keeping everything. With the
    checkpoint-all peak: nothing recomputed. With the paper's subset's simulated peak: a
    schedule within it. Below every candidate: InfeasibleBudgetError with the least peak."""
    strategy = get_strategy(name)
    for graph in chain_and_dags():
        full = checkpoint_all_peak(graph)
        schedule = strategy(graph, memory_model=model)
        validate_schedule(graph, schedule)
        lowest = simulate(graph, schedule).peak_bytes
        assert lowest <= full, graph.name

        generous = strategy(graph, full, memory_model=model)
        assert simulate(graph, generous).peak_bytes <= full
        assert generous.cost(graph) == pytest.approx(graph.total_cost), graph.name

        subset, _ = hong_prediction(graph, model, articulation=name == "hong_ap")
        subset_peak = simulate(graph, schedule_for_checkpoints(graph, subset, name)).peak_bytes
        tight = strategy(graph, subset_peak, memory_model=model)
        validate_schedule(graph, tight)
        assert simulate(graph, tight).peak_bytes <= subset_peak

        with pytest.raises(InfeasibleBudgetError) as info:
            strategy(graph, lowest - 1, memory_model=model)
        assert info.value.min_feasible_bytes == lowest


def test_the_strategy_saves_memory_on_a_chain():
    """On a uniform 16-layer chain the paper's subset beats keeping everything."""
    g = training_graph([(j, j + 1) for j in range(15)], sizes=[10] * 16, reads_output=set(range(16)))
    full = simulate(g, get_strategy("checkpoint_all")(g))
    for name in ("hong", "hong_ap"):
        for model in ("eager", "classic"):
            result = simulate(g, get_strategy(name)(g, memory_model=model))
            assert result.peak_bytes < full.peak_bytes and result.cost > full.cost, (name, model)


def test_hong_prediction_is_the_models_peak_of_its_subset_plus_fixed_bytes():
    """The chain behind the prediction: a 0-byte input, then every forward output; the
    subset is what the DP picks on it, and hong_ap's holds only articulation points."""
    graph = random_training_graph(6, 14)
    order = list(graph.forward_nodes)
    sizes = [0.0] + [graph.output_bytes[i] for i in order]
    for model, dp, peak in (("eager", eager_checkpoints, eager_peak), ("classic", classic_checkpoints, classic_peak)):
        checkpoints, predicted = hong_prediction(graph, model)
        positions = [0] + [order.index(i) + 1 for i in checkpoints]
        assert positions == list(dp(sizes).positions)
        assert predicted == graph.fixed_bytes + peak(sizes, positions)
    checkpoints, _ = hong_prediction(graph, "eager", articulation=True)
    assert set(checkpoints) <= set(graph.forward_articulation_points) | {order[-1]}


@pytest.mark.parametrize("bad", ["lazy", "EAGER", None, ["eager"]])
def test_a_bad_memory_model_names_the_argument_and_the_choices(bad):
    graph = random_training_graph(1, 6)
    for name in ("hong", "hong_ap"):
        with pytest.raises(ArgumentError, match="memory_model must be 'eager' .* or 'classic'"):
            get_strategy(name)(graph, memory_model=bad)
    with pytest.raises(ArgumentError, match="memory_model must be"):
        hong_prediction(graph, bad)


def test_the_classic_strategy_stops_at_the_deadline():
    graph = random_training_graph(2, 30)
    with heuristic_deadline(time.perf_counter() - 1):
        for name in ("hong", "hong_ap"):
            with pytest.raises(InfeasibleBudgetError, match="time limit ran out"):
                get_strategy(name)(graph, checkpoint_all_peak(graph) // 2, memory_model="classic")
