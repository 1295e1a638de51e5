"""A forward's order-free peak does not depend on which small operations forwarded a buffer
or when a small buffer from before the run was freed (no TensorFlow needed).

A dropout's forward in transformer_encoder measured 16,452 or 16,468 B of workspace by
extraction: its seed's ``FloorMod`` allocated 16 B in some orders and took its input's
buffer in others, and the seed variable's old 16-byte value, which the assignment frees, was
freed before or after the peak (:func:`tfremat.runtime.memory.order_free_peak`,
benchmarks/results/workspace_repeatability.md, "Session 30 (W2)").
"""

from tfremat.runtime.memory import _replayed_peak, order_free_peak

_OUTPUT = (0, True, "out", 1000, {"op": "Mul"})


def _small(time, addr, size, op):
    """A small allocation at ``time`` freed right after."""
    return [(time, True, addr, size, {"op": op}), (time + 1, False, addr, size, {"op": op})]


def test_an_operation_that_forwarded_its_buffer_counts_its_outputs():
    sizes = {"Add": 16, "FloorMod": 16}
    allocated = [_OUTPUT, *_small(1, "a", 16, "Add"), *_small(3, "b", 16, "FloorMod")]
    forwarded = [_OUTPUT, *_small(1, "a", 16, "Add")]  # FloorMod wrote into its input's buffer
    peaks = {order_free_peak(events, 100, small_sizes=sizes) for events in (allocated, forwarded)}
    assert peaks == {1000 + 32}
    # What the graph cannot size counts what the run allocated (a random op's key, 24 B).
    assert order_free_peak([*forwarded, *_small(5, "k", 24, "KeyCounter")], 100, small_sizes=sizes) == 1000 + 56


def test_a_small_buffer_from_before_the_run_counts_as_held_to_its_end():
    old_value_freed = (2, False, "old", 16, {"op": ""})
    early = [(0, False, "old", 16, {"op": ""}), (1, True, "out", 1000, {"op": "Mul"})]
    late = [_OUTPUT, old_value_freed]
    assert _replayed_peak(early)[0] != _replayed_peak(late)[0]  # -16 before the peak, or after it
    assert order_free_peak(early, 100) == order_free_peak(late, 100) == 1000
    # A large buffer from before the run (a slot's old value) still frees its bytes.
    big = [(0, False, "slot", 400, {"op": ""}), (1, True, "out", 1000, {"op": "Mul"})]
    assert order_free_peak(big, 100) == 600
