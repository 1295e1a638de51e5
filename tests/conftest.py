"""Test-wide environment, set before TensorFlow is imported.

* ``TF_CPU_ALLOCATOR_USE_BFC``: TensorFlow's CPU allocator counts bytes only with BFC.
* ``TF_NUM_INTEROP_THREADS=1``: ops run one at a time, the execution the memory model
  describes; with parallel inter-op threads sibling gradient ops overlap and measured
  peaks rise above any sequential prediction.
"""

import os

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
