"""One gradient call for a layer's input and weight gradients, the weight gradients after.

A layer's backward takes its input gradients first and its weight gradients after them
(a convolution's input and filter gradients would otherwise run together, each with its
own scratch buffer, which the memory model does not count). Two ``tape.gradient`` calls
did that, but the second call rebuilds every gradient operation the two share (a Dense
layer's activation gradient, an attention's softmax and projections' gradients) under a
control dependency that keeps TensorFlow from merging the copies: the keras-hub GPT-2 step
(2 layers, hidden 64) built 52 batch matmuls where plain training builds 36, and its
checkpoint-all step ran about 10% slower than plain training's, time that no plan counts
(``benchmarks/fidelity.py``, results/fidelity_hub_batch8.md).

:func:`input_then_weight_gradients` takes all gradients in one call and makes the
operations only the weight gradients need wait for the input gradients: the order of two
calls, with the shared work done once. The profiler (:mod:`tfremat.extract.analysis`) and
the compiled step (:mod:`tfremat.static_graph.interpreter`) both use it, so the measured
backward is the one the step runs.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["input_then_weight_gradients", "needed_ops", "wait_for"]


def _ops_of(values) -> list:
    ops = []
    for value in values:
        if value is None:
            continue
        if isinstance(value, tf.IndexedSlices):
            ops += [value.values.op, value.indices.op]
        else:
            ops.append(value.op)
    return ops


def needed_ops(roots: list, created: set[int]) -> dict[int, object]:
    """The operations among ``created`` (ids) that ``roots`` depend on, by data or control edges."""
    needed: dict[int, object] = {}
    stack = list(roots)
    while stack:
        op = stack.pop()
        if id(op) in needed or id(op) not in created:
            continue
        needed[id(op)] = op
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return needed


def wait_for(first: list, then: list, since: int) -> int:
    """Makes the operations created at or after position ``since`` of the current graph
    that ``then`` needs and ``first`` does not wait for ``first`` (control edges on the
    earliest of them); returns how many were made to wait. Tensors may be None or
    ``tf.IndexedSlices``."""
    first_ops, then_ops = _ops_of(first), _ops_of(then)
    if not first_ops or not then_ops:
        return 0
    graph = tf.compat.v1.get_default_graph()
    created = {id(op) for op in graph.get_operations()[since:]}
    before = needed_ops(first_ops, created)
    only = {key: op for key, op in needed_ops(then_ops, created).items() if key not in before}
    earliest = [op for op in only.values()
                if not any(id(t.op) in only for t in op.inputs) and not any(id(c) in only for c in op.control_inputs)]
    if not earliest:
        return 0
    with tf.control_dependencies(None):
        gate = tf.group(*first_ops)
    for op in earliest:
        op._add_control_input(gate)  # pylint: disable=protected-access
    return len(earliest)


def input_then_weight_gradients(gradient: Callable[[list], list], sources: list, variables: list) -> tuple[list, list]:
    """``gradient(sources + variables)`` split into the sources' and the variables'
    gradients, the operations that only the variables' need made to wait for the sources'
    (:func:`wait_for`). ``gradient`` takes a list of tensors and variables and returns their
    gradients in order (a ``tape.gradient`` call with its targets bound)."""
    if not sources or not variables:
        grads = gradient(list(sources) + list(variables)) if sources or variables else []
        return list(grads[:len(sources)]), list(grads[len(sources):])
    since = len(tf.compat.v1.get_default_graph().get_operations())
    grads = list(gradient(list(sources) + list(variables)))
    input_part, weight_part = grads[:len(sources)], grads[len(sources):]
    wait_for(input_part, weight_part, since)
    return input_part, weight_part
