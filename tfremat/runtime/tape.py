"""How the step records a layer call on a gradient tape, decided from its traced forward.

Extraction measures a layer's backward with the same rule the compiled step runs it by,
so both import it from here.
"""

from __future__ import annotations

__all__ = ["runs_loop", "takes_one_gradient_call"]

_LOOP_OPS = frozenset({"While", "StatelessWhile"})


def runs_loop(ops) -> bool:
    """Whether the traced operations ``ops`` run a ``tf.while_loop`` (a Keras RNN with
    ``unroll=False``), directly or inside a function they call (``tf.function``, ``tf.cond``
    branches), looked up in the graph's function library."""
    seen: set[str] = set()

    def function_names(attrs):
        for value in attrs.values():
            if value.HasField("func"):
                yield value.func.name
            elif value.HasField("list"):
                yield from (f.name for f in value.list.func)

    def in_function(graph, name: str) -> bool:
        if name in seen:
            return False
        seen.add(name)
        function = graph._get_function(name)  # pylint: disable=protected-access
        if function is None:
            return False
        return any(node.op in _LOOP_OPS or any(in_function(graph, f) for f in function_names(node.attr))
                   for node in function.definition.node_def)

    return any(op.type in _LOOP_OPS or any(in_function(op.graph, f) for f in function_names(op.node_def.attr))
               for op in ops)


_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


def takes_one_gradient_call(forward_ops) -> bool:
    """Whether a layer call whose forward (traced alone) is ``forward_ops`` is recorded on
    a non-persistent tape and asked for its input and weight gradients in one
    ``gradient`` call; otherwise a persistent tape is asked twice.

    A forward that calls a function (Keras runs a grouped ``Conv2D`` on TensorFlow as a
    nested ``tf.function``) takes one call too: the gradient of a function call is one call
    of its backward function, which computes every gradient of the function whichever were
    asked for, so two calls ran the whole backward twice (a ConvMixer-style net with
    grouped convolutions: benchmarks/conformance.py).

    Two calls (input gradients, then weight gradients under a control dependency) keep
    TensorFlow from running e.g. a convolution's input and filter gradients together, each
    with its own scratch buffer, which the memory model does not count. A
    ``tf.while_loop`` (a Keras RNN with ``unroll=False``) needs the other way: each call
    builds a whole backward loop of its own, and a persistent tape can be differentiated
    again, so TensorFlow wraps the loop for higher-order gradients and its backward keeps
    every iteration's intermediates as well; plain training uses a non-persistent tape
    (docs/compiled-step.md, "Evidence").
    :func:`tfremat.extract.analysis.analyze_call` measures the backward with the same rule.
    """
    return runs_loop(forward_ops) or any(op.type in _CALL_OPS for op in forward_ops)
