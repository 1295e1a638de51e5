"""A schedule compiled into one static ``tf.function`` training step (imports TensorFlow).

:func:`compile_step` turns an extraction (:func:`tfremat.extract.extract`) and a schedule
from any strategy into a training step that follows the execution plan statement by
statement: forward calls recorded on per-layer tapes, explicit recomputation ordered by
control dependencies, deallocation where the plan frees, side-effect-free recomputation of
batch norm and dropout, and the optimizer update. :func:`measure_step_peak` reads the
allocator peak of one step.
"""

from tfremat.runtime.memory import measure_step_peak
from tfremat.static_graph.compile import CompiledStep, compile_step
from tfremat.static_graph.interpreter import TraceReport

__all__ = ["compile_step", "CompiledStep", "TraceReport", "measure_step_peak"]
