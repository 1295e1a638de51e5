"""How close two sets of gradients (or weights) are, in terms float32 arithmetic can promise.

Two correct training steps need not agree bit for bit: oneDNN (on by default on x86 CPUs with
AVX-512) and Grappler's fusions reorder reductions, so a step that runs each layer on its
own and one that fuses layers differ in the last bits. An elementwise relative error is not
the measure either: a convolution bias that feeds batch normalization has an exact gradient
of zero, and its float value is rounding noise, so noise over noise reads as an error of
order one. The measure here is normwise, per tensor, with a floor taken from the whole set:

    error_k = ||a_k - e_k|| / max(||e_k||, FLOOR_SHARE * ||E||)

where ``||E||`` is the global norm of all expected tensors, and the global relative error
``||A - E|| / ||E||``. A reordered float32 sum is off by about ``n * 2**-24`` of the sum of
magnitudes, far below the tolerances; a gradient taken twice, a stale input or a wrong
dropout mask is off by order one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["FLOOR_SHARE", "TENSOR_TOLERANCE", "GLOBAL_TOLERANCE", "Closeness", "closeness"]

#: Share of the global norm below which a tensor's own norm is not used as its scale.
FLOOR_SHARE = 1e-2
#: Largest per-tensor error (see the module docstring) that counts as equal.
TENSOR_TOLERANCE = 1e-4
#: Largest global relative error that counts as equal.
GLOBAL_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Closeness:
    """How far ``actual`` is from ``expected`` (see the module docstring).

    Attributes:
        max_tensor_error: the largest per-tensor error.
        worst_tensor: the index of that tensor (None when there are none).
        global_error: the global relative error (0 when both are all zeros).
    """

    max_tensor_error: float
    worst_tensor: int | None
    global_error: float

    @property
    def equal(self) -> bool:
        """Whether both errors are within their tolerances."""
        return self.max_tensor_error <= TENSOR_TOLERANCE and self.global_error <= GLOBAL_TOLERANCE


def closeness(actual: Sequence, expected: Sequence) -> Closeness:
    """Compares two equally long sequences of arrays (gradients or weights, in the same order).

    Raises:
        ValueError: the sequences differ in length or a pair differs in shape.
    """
    if len(actual) != len(expected):
        raise ValueError(f"actual has {len(actual)} tensors, expected {len(expected)}")
    pairs = []
    for k, (a, e) in enumerate(zip(actual, expected)):
        a = np.asarray(a, dtype=np.float64)
        e = np.asarray(e, dtype=np.float64)
        if a.shape != e.shape:
            raise ValueError(f"tensor {k}: shape {a.shape} against {e.shape}")
        pairs.append((float(np.linalg.norm((a - e).ravel())), float(np.linalg.norm(e.ravel()))))
    global_norm = math.sqrt(sum(n * n for _, n in pairs))
    global_difference = math.sqrt(sum(d * d for d, _ in pairs))
    floor = FLOOR_SHARE * global_norm
    worst, worst_error = None, 0.0
    for k, (difference, norm) in enumerate(pairs):
        scale = max(norm, floor)
        error = difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)
        if worst is None or error > worst_error:
            worst, worst_error = k, error
    if global_norm > 0:
        global_error = global_difference / global_norm
    else:
        global_error = 0.0 if global_difference == 0 else math.inf
    return Closeness(worst_error, worst, global_error)
