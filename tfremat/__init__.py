"""tfremat: optimal rematerialization for TensorFlow/Keras training.

The planning core (graph, schedules, simulator, strategies) imports no TensorFlow; the
names that need it (``fit``, ``plan_model``, ``compare``, ``max_batch_size``, ``compile_step``,
``value_and_grad``)
and the submodules ``tfremat.keras`` (the callback) and ``tfremat.measure`` (the planned
step measured against plain Keras) import it on first use; the extraction is
``tfremat.extract.extract``.

Example:
    >>> import tfremat
    >>> history = tfremat.fit(model, "50%", x, y, batch_size=32, epochs=3)
"""

import importlib
import os

# TensorFlow's CPU allocator reports memory statistics (which extraction and measurement
# read) only with BFC, and chooses its allocator when it is imported: set it before that.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from tfremat.errors import InfeasibleBudgetError, TfrematError
from tfremat.graph import DFGraph, load_graph
from tfremat.plan.schedule import Schedule
from tfremat.plan.simulator import simulate

__version__ = "0.1.0"

_LAZY = {
    "plan_model": "tfremat.model_planning",
    "fit": "tfremat.api",
    "compare": "tfremat.api",
    "max_batch_size": "tfremat.api",
    "compile_step": "tfremat.static_graph.compile",
    "value_and_grad": "tfremat.custom_loops",
}

__all__ = ["DFGraph", "load_graph", "Schedule", "simulate", "TfrematError", "InfeasibleBudgetError", *_LAZY, "__version__"]


# Submodules that import TensorFlow, reachable as attributes (``tfremat.measure``) without
# importing them here; a plain ``import tfremat`` stays free of TensorFlow.
_LAZY_SUBMODULES = ("keras", "measure")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"tfremat.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfremat' has no attribute {name!r}")
