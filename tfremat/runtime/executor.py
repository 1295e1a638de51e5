"""Run a ``tf.function`` one operation at a time, whatever the inter-op thread setting.

The memory model (one simulator, :mod:`tfremat.plan.simulator`) and the profiled costs
assume that operations run one after another in the order the step's statements give
them. TensorFlow's default executor runs independent operations together on its inter-op
threads, so inside one statement several buffers can be live at once: a transformer's
ordered checkpoint-all step requested 1.21x its predicted peak with TensorFlow's default
threads and 0.99x with one (benchmarks/step_overhead.py). The inter-op thread count is
fixed for the process before TensorFlow runs anything, so it cannot be set for one step;
TensorFlow's single-threaded executor can: a function call traced or run inside
:func:`sequential` executes its operations synchronously on the calling thread, each
kernel still using the intra-op threads.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

__all__ = ["SEQUENTIAL_EXECUTOR", "sequential"]

# The name under which TensorFlow registers its single-threaded function executor.
SEQUENTIAL_EXECUTOR = "SINGLE_THREADED_EXECUTOR"


@contextlib.contextmanager
def sequential():
    """Function calls made (eagerly) or traced (into an enclosing graph) inside this
    context run on TensorFlow's single-threaded executor."""
    with tf.experimental.function_executor_type(SEQUENTIAL_EXECUTOR):
        yield
