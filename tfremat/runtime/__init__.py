"""The TensorFlow runtime helpers that extraction and the compiled step share.

* :mod:`~tfremat.runtime.memory`: allocator peaks (requested bytes and BFC chunks), the
  device measured on, synchronization;
* :mod:`~tfremat.runtime.state`: snapshots and replay of batch-norm statistics and seeds, so
  a recomputation has no side effects;
* :mod:`~tfremat.runtime.tape`: how a layer call is recorded on a gradient tape;
* :mod:`~tfremat.runtime.internals`: every private TensorFlow/Keras import;
* :mod:`~tfremat.runtime.timing`: a step timed against a reference step in turns;
* :mod:`~tfremat.runtime.profiler`: TensorFlow's profiler traced without its session log lines.

It sits below :mod:`tfremat.extract` and :mod:`tfremat.static_graph` and above the
TensorFlow-free core; it imports neither of them.
"""
