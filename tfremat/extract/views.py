"""Which layer calls are views: their output shares an input's buffer (``DFGraph.view_of``).

TensorFlow's ``Reshape``, ``Squeeze``, ``ExpandDims`` and ``Identity`` forward their input's
buffer instead of allocating (a tensor is always contiguous, so a reshape never copies). A
``Flatten`` or ``Reshape`` layer, or one that returns its input, is a view of that input;
counted as a buffer of its own it made small_convnet's checkpoint-all prediction 12.7%
high (benchmarks/README.md, "Extraction"). The test is on the traced operations, so it is
conservative: any other operation that makes a tensor other than shape arithmetic (a
cast under a mixed-precision policy, a transpose, a dropout mask) means not a view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = ["view_input", "view_position"]

# Operations whose output is their first input's buffer.
_FORWARDING = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
                         "PreventGradient", "EnsureShape", "CheckNumerics"})
# Operations that make no data tensor: shape arithmetic on int32/int64 vectors, constants.
_BOOKKEEPING = frozenset({"Placeholder", "Const", "NoOp"})


def view_input(call_layer: Callable[[list], object], input_specs: Sequence[tf.TensorSpec]) -> int | None:
    """:func:`view_position` of the call traced on ``input_specs`` (``call_layer`` runs the
    layer on the flattened input tensors, as for
    :func:`tfremat.extract.analysis.analyze_call`)."""
    def forward(flat_inputs):
        return call_layer(list(flat_inputs))

    return view_position(tf.function(forward, autograph=False).get_concrete_function(list(input_specs)), input_specs)


def view_position(concrete, input_specs: Sequence[tf.TensorSpec]) -> int | None:
    """The position of the input whose buffer the call's one output shares, or None.

    Args:
        concrete: the call's forward trace, a concrete function of the flattened inputs
            (the analysis's forward-only trace).
        input_specs: the flattened inputs, batch included.

    Returns:
        The input position when the call has one output, reached from that input through
        buffer-forwarding operations only, with as many bytes, and every other operation
        of the call only computes shapes; None otherwise.
    """
    outputs = tf.nest.flatten(concrete.structured_outputs)
    if len(outputs) != 1 or not outputs[0].shape.is_fully_defined():
        return None
    placeholders = [id(t) for t in concrete.inputs[:len(input_specs)]]
    chain = set()
    tensor = concrete.outputs[0]
    while id(tensor) not in placeholders:
        op = tensor.op
        if op.type not in _FORWARDING or not op.inputs:
            return None
        chain.add(id(op))
        tensor = op.inputs[0] if op.type != "IdentityN" else op.inputs[tensor.value_index]
    position = placeholders.index(id(tensor))
    for op in concrete.graph.get_operations():
        if id(op) in chain or op.type in _BOOKKEEPING:
            continue
        if any(out.dtype not in (tf.int32, tf.int64) for out in op.outputs):
            return None
    source = input_specs[position]
    if not source.shape.is_fully_defined() or source.dtype != outputs[0].dtype:
        return None
    if source.shape.num_elements() != outputs[0].shape.num_elements():
        return None
    return position
