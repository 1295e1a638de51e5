"""Arbitrary valid schedules of a small ViT train exactly like plain Keras.

The strategies' schedules are a few points of the schedule space; a MILP incumbent at its
time limit (which one a run gets depends on the profile and the machine's load) can
recompute more than any strategy does: a node whose value is never read again, a backward
node or the loss twice, a forward node after its own backward. The schedules here are
random ones: a random subset of checkpoint-all's keep matrix completed by
:func:`~tfremat.plan.schedule.schedule_from_keep_matrix`, plus random redundant
recomputations wherever their inputs are resident. The model has what made a
benchmarks/min_budget.py ViT schedule suspect: dropout inside the opened
``MultiHeadAttention`` and in the MLPs, a custom patch layer, an ``Embedding`` added to a
projection, a softmax output read through its logits by the cross-entropy.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
from models import keras_io_vit  # noqa: E402
from training_case import TrainingCase  # noqa: E402

from tfremat.plan.schedule import Schedule, checkpoint_all_s, schedule_from_keep_matrix, validate_schedule  # noqa: E402


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFREMAT_CACHE_DIR", str(tmp_path / "cache"))


def _small_vit():
    """benchmarks/min_budget.py's keras.io ViT, shrunk to test size."""
    return keras_io_vit(image_size=8, patch_size=4, dim=8, heads=2, blocks=1, block_units=(8,), head=(16,),
                        classes=4, name="small_vit")


@pytest.fixture(scope="module")
def vit_case():
    return TrainingCase(_small_vit, batch=4)


def _random_schedule(graph, seed: int, drop: float = 0.3, extra: float = 0.1) -> Schedule:
    """A valid schedule: each keep of checkpoint-all dropped with probability ``drop``, the
    recomputations that needs, and each further node whose inputs are resident in a stage
    recomputed there with probability ``extra`` (its value freed within the stage)."""
    rng = np.random.default_rng(seed)
    keep = checkpoint_all_s(graph) & (rng.random((graph.size, graph.size)) >= drop)
    completed = schedule_from_keep_matrix(graph, keep, "random")
    R, S = completed.R.copy(), completed.S
    for t in range(graph.size):
        for i in range(t):
            if (not R[t, i] and not S[t, i] and rng.random() < extra
                    and all(S[t, k] or R[t, k] for k in graph.predecessors[i])):
                R[t, i] = True
    schedule = Schedule(R, S, "random")
    validate_schedule(graph, schedule)
    return schedule


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_of_a_vit_train_like_plain_keras(vit_case, seed):
    graph = vit_case.extraction.graph
    schedule = _random_schedule(graph, seed)
    backward = [i for i in range(graph.size) if graph.names[i].endswith("_backward")]
    # The schedule exercises what the strategies rarely do.
    assert schedule.R[:, backward].sum() > len(backward)
    vit_case.assert_trains_like_plain(schedule, f"random schedule {seed}", steps=3)
