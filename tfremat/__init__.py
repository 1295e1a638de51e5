"""tfremat: optimal rematerialization for TensorFlow/Keras training.

The planning core (graph, schedules, simulator, strategies) imports no TensorFlow.
"""

from tfremat.errors import InfeasibleBudgetError, TfrematError
from tfremat.graph import DFGraph, load_graph

__version__ = "0.1.0"

__all__ = ["DFGraph", "load_graph", "TfrematError", "InfeasibleBudgetError", "__version__"]
