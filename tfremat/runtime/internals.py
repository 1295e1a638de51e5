"""Every private TensorFlow and Keras name tfremat uses, imported in one place.

None of these is public API; when an upgrade moves one, the import fails here, by name,
instead of deep inside extraction or a compiled step.

* ``LossFunctionWrapper``: the wrapper Keras puts around a loss given by name or as a plain
  function (``model.compile`` uses it; keras exports no equivalent).
* ``node_flops``: TensorFlow's registered FLOP count of a graph node (with TensorFlow's
  deprecation warnings silenced: the Conv2D and profiler FLOP functions call a deprecated
  helper, whose 3-line warning the user can do nothing about).
* ``resource_handle_data``: the shapes and dtypes a resource handle (a ``TensorList``,
  a variable) carries.
* ``keras_global_attribute`` / ``set_keras_global_attribute`` and
  ``GLOBAL_SEED_GENERATOR``: Keras's global state, where the seed generator of unseeded
  ``keras.random`` calls lives.
* ``CallContext``: what an outer layer call hands its sublayers (``training``); Keras keeps
  the active one in the global attribute ``"current_call_ctx"``.
* ``CallSpec``: a layer call's arguments bound to its ``call`` signature, as
  ``Layer.__call__`` binds them to fill in mask arguments (``mask=``, ``value_mask=``).
* ``get_keras_mask`` / ``set_keras_mask``: the Keras mask a tensor carries (``_keras_mask``,
  set by ``Embedding(mask_zero=True)`` or ``Masking``), read and replaced the way Keras does.
* ``onednn_enabled``: whether TensorFlow rewrites CPU graphs to oneDNN's kernels (built with
  them and ``TF_ENABLE_ONEDNN_OPTS`` not 0).
"""

from keras.src.backend.common.global_state import (
    get_global_attribute as keras_global_attribute,
)
from keras.src.backend.common.global_state import (
    set_global_attribute as set_keras_global_attribute,
)
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.layers.layer import CallContext, CallSpec
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
from tensorflow.python.framework.ops import get_stats_for_node_def
from tensorflow.python.ops.handle_data_util import (
    get_resource_handle_data as resource_handle_data,
)
from tensorflow.python.util._pywrap_util_port import IsMklEnabled as onednn_enabled
from tensorflow.python.util.deprecation import silence as silence_deprecation

__all__ = [
    "LossFunctionWrapper", "node_flops", "resource_handle_data", "keras_global_attribute",
    "set_keras_global_attribute", "GLOBAL_SEED_GENERATOR", "CallContext", "CallSpec", "get_keras_mask",
    "set_keras_mask", "onednn_enabled",
]


def node_flops(graph, node_def) -> float | None:
    """TensorFlow's FLOP count of ``node_def`` in ``graph``; None when none is registered
    or it cannot be computed (unknown shapes).

    Several FLOP functions call ``tensor_shape_from_node_def_name``, deprecated, whose
    warning would print on the first extraction of any conv model: silenced here. The
    errors are caught inside the silence, which restores the setting only on a normal exit.
    """
    with silence_deprecation():
        try:
            stats = get_stats_for_node_def(graph, node_def, "flops")
        except (ValueError, TypeError):
            stats = None
    return float(stats.value) if stats is not None and stats.value else None
