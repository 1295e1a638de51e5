"""Keras model -> the planning core's graph plus a side table (TensorFlow is imported here).

``extract(model, ...)`` returns an :class:`Extraction`: the :class:`~tfremat.graph.DFGraph`
that strategies plan over and the :class:`SideTable` the compiled training step uses to run
each node.
"""

from tfremat.extract.extractor import Extraction, extract
from tfremat.extract.losses import resolve_loss
from tfremat.extract.plain_step import measure_plain_step_peak
from tfremat.extract.profile_cache import cache_dir
from tfremat.extract.side_table import GradRef, NodeEntry, SideTable, TensorRef

__all__ = [
    "extract",
    "Extraction",
    "resolve_loss",
    "cache_dir",
    "measure_plain_step_peak",
    "GradRef",
    "NodeEntry",
    "SideTable",
    "TensorRef",
]
