"""Side-effect-free recomputation of stateful layers by replaying their variable state.

A recomputed layer must leave every non-trainable variable as one forward pass would:
batch normalization updates its moving statistics in a ``training=True`` call, and Keras 3
dropout draws its mask from a ``SeedGenerator`` whose state variable advances on every
call. Both are functions of the layer's non-trainable variables, so one mechanism covers
them and any other Keras layer built the same way:

* at the first forward call of a node in the step, read the variables just before the
  call (``before``);
* a recomputation reads the variables as they are now, assigns ``before``, calls the layer
  (which then computes exactly what the first call computed: the same batch statistics,
  the same dropout seed, hence the same mask) and assigns the values it read back.

Restoring the values read just before the replay, rather than those right after the first
call, stays exact when a layer called twice in the model (two forward nodes sharing the
state) has advanced its state in between. The reads and assigns are ordered by
``tf.function``'s automatic control dependencies, which serialize the operations on one
resource in program order; the restore is a copy, not an inverse update, so moving
statistics stay bit-identical to plain training. The snapshots are per-channel statistics
and seeds: a few bytes, held for the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfremat.runtime.internals import (
    GLOBAL_SEED_GENERATOR,
    keras_global_attribute,
    set_keras_global_attribute,
)

__all__ = [
    "StateSnapshot", "stateful_variables", "call_with_snapshot", "call_replaying", "stateful_random_ops",
    "reads_global_seed_generator", "global_seed_generator", "forget_global_seed_generator", "state_restored",
    "restore",
]

# Random ops whose state lives outside any Keras variable (TensorFlow's global or
# op-level generators): a second call draws new numbers and nothing here can replay them.
_STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "ParameterizedTruncatedNormal",
    "Multinomial", "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "RandomCrop",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial", "RngSkip", "RngReadAndSkip",
})


@dataclasses.dataclass(frozen=True)
class StateSnapshot:
    """The non-trainable state of one layer just before a node's first forward call.

    Attributes:
        variables: the layer's non-trainable variables.
        before: their values just before the first call.
    """

    variables: tuple
    before: tuple


def stateful_variables(layer: Any) -> tuple:
    """The variables a layer call may write: its non-trainable variables.

    Trainable variables are only read during a call (the optimizer writes them after the
    step), so replaying them is unnecessary.
    """
    return tuple(getattr(layer, "non_trainable_variables", ()))


def _read(variables: Sequence) -> tuple:
    # tf.identity forces a copy-on-read snapshot that a later assign cannot alias.
    return tuple(tf.identity(tf.convert_to_tensor(v)) for v in variables)


def call_with_snapshot(layer: Any, call: Callable[[], Any]) -> tuple[Any, StateSnapshot | None]:
    """Runs a node's first forward call of the step, recording the layer's state before it.

    Args:
        layer: the Keras layer.
        call: zero-argument function that calls the layer and returns its outputs.

    Returns:
        ``(outputs, snapshot)``; ``snapshot`` is None for a layer without state.
    """
    variables = stateful_variables(layer)
    if not variables:
        return call(), None
    before = _read(variables)
    return call(), StateSnapshot(variables, before)


def call_replaying(snapshot: StateSnapshot | None, call: Callable[[], Any]) -> Any:
    """Recomputes a layer call with the state of its first call and no net state change.

    Args:
        snapshot: what :func:`call_with_snapshot` recorded (None: stateless layer).
        call: zero-argument function that calls the layer.

    Returns:
        The layer's outputs, equal to those of the first call for the same inputs.
    """
    if snapshot is None:
        return call()
    current = _read(snapshot.variables)
    for variable, value in zip(snapshot.variables, snapshot.before):
        variable.assign(value)
    outputs = call()
    for variable, value in zip(snapshot.variables, current):
        variable.assign(value)
    return outputs


def stateful_random_ops(operations) -> list[str]:
    """Types of the operations among ``operations`` that draw from a generator no variable holds.

    Layers built on Keras' ``SeedGenerator`` use stateless random ops seeded from a variable,
    which :func:`call_replaying` replays; anything found here would draw a different sample
    when a recomputation calls the layer again.
    """
    return sorted({op.type for op in operations if op.type in _STATEFUL_RANDOM_OPS})


def global_seed_generator():
    """Keras's global ``SeedGenerator`` (behind unseeded ``keras.random`` calls), or None
    while nothing has created it. Reading it never creates it: creating it draws its seed
    from Python's ``random``, which plain training would then see advanced."""
    return keras_global_attribute(GLOBAL_SEED_GENERATOR)


def forget_global_seed_generator() -> None:
    """Drops Keras's global seed generator, so the next unseeded call creates it anew (from
    Python's ``random``, which the caller restores), as if it had never been created."""
    set_keras_global_attribute(GLOBAL_SEED_GENERATOR, None)


def reads_global_seed_generator(graph, operations) -> bool:
    """Whether any of ``operations`` (traced in ``graph``, a ``tf.function``'s graph) reads
    the state of Keras's global seed generator.

    An unseeded ``keras.random`` call in a custom layer advances that state, shared by the
    whole program: calling the layer again draws other numbers, and replaying the layer's
    own variables (:func:`call_replaying`) does not restore it.
    """
    generator = global_seed_generator()
    if generator is None:
        return False
    handle = generator.state.handle
    captured = [inner for outer, inner in graph.captures if outer is handle]
    return any(tensor is inner for op in operations for tensor in op.inputs for inner in captured)


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _restored_in_place(variable, value: np.ndarray) -> bool:
    """Writes ``value`` into ``variable``'s existing buffer; whether it now holds ``value`` bit for bit.

    ``assign`` hands the variable the assigned tensor's buffer and frees its own
    (TensorFlow's ``AssignVariableOp`` never copies: every later write copies on write
    instead), so a restore by ``assign`` moves every variable's buffer and leaves the
    allocator's chunks other than the reads before it saw them. ``AssignSubVariableOp`` and
    ``AssignAddVariableOp`` write into the variable's buffer while nothing else holds it:
    subtracting the current value (a separate tensor, allocated and freed again) leaves
    zeros, adding ``value`` leaves ``value``. That is exact except where the current value
    is infinite or NaN, ``value`` is -0.0 (0.0 + -0.0 is 0.0), or ``value`` is subnormal
    (TensorFlow's CPU kernels flush them to zero), hence the comparison of the bits read
    back. A variable that already holds ``value`` is not written at all: a write copies a
    buffer that something else still shares (a learning rate's, its initial value's) into a
    new one. A variable of a tf.distribute strategy (one buffer per replica) or of a dtype
    without those kernels (bool) is left as it was: False.
    """
    inner = variable if isinstance(variable, tf.Variable) else variable.value  # a Keras variable's tf.Variable
    dtype = tf.as_dtype(value.dtype)
    if isinstance(inner, tf.distribute.DistributedValues) or not (dtype.is_floating or dtype.is_integer
                                                                   or dtype.is_complex):
        return False
    current = inner.numpy()
    if _same_bits(current, value):
        return True
    with tf.device(inner.device):
        tf.raw_ops.AssignSubVariableOp(resource=inner.handle, value=tf.constant(current))
        tf.raw_ops.AssignAddVariableOp(resource=inner.handle, value=tf.constant(value))
    return _same_bits(inner.numpy(), value)


def restore(variable, value: np.ndarray) -> None:
    """Sets ``variable`` to ``value`` (a copy read with ``numpy()``) bit for bit, in the
    buffer it already has where that is exact (:func:`_restored_in_place`), else by
    ``assign``: a restore then leaves the allocator's chunks where the variable's own
    updates left them, as a training step does (its optimizer updates write in place)."""
    if not _restored_in_place(variable, value):
        variable.assign(value)


@contextlib.contextmanager
def state_restored(variables: Sequence):
    """Puts back, on exit, the values of ``variables`` (each in its own buffer where that is
    exact: :func:`restore`), Python's ``random`` state and Keras's global seed generator: its
    state, or, when the block created it, its absence (so the next unseeded ``keras.random``
    call creates it as plain training would)."""
    saved = [v.numpy() for v in variables]
    python_random = random.getstate()
    generator = global_seed_generator()
    generator_state = None if generator is None else generator.state.numpy()
    try:
        yield
    finally:
        for variable, value in zip(variables, saved):
            restore(variable, value)
        random.setstate(python_random)
        if generator is not None:
            restore(generator.state, generator_state)
        elif global_seed_generator() is not None:
            forget_global_seed_generator()
