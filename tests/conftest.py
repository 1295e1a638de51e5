"""Test-wide environment, set before TensorFlow is imported.

* ``TF_CPU_ALLOCATOR_USE_BFC``: TensorFlow's CPU allocator counts bytes only with BFC.
* ``TF_NUM_INTEROP_THREADS=1``: ops run one at a time, the execution the memory model
  describes; with parallel inter-op threads sibling gradient ops overlap and measured
  peaks rise above any sequential prediction.
"""

import os

import pytest

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def parallel(monkeypatch):
    """As in a process with TensorFlow's default inter-op threads (the tests run with one):
    compile_step puts the step on the single-threaded executor and extraction measures the
    plain overlap; each test's executor warnings are new."""
    import tfremat.static_graph.compile as compile_module
    from tfremat.runtime import executor

    monkeypatch.setattr(executor, "sequential_ops", lambda: False)
    monkeypatch.setattr(compile_module, "_warned_parallel", set())
