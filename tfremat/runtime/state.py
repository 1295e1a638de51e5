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

import tensorflow as tf

from tfremat.runtime.internals import (
    GLOBAL_SEED_GENERATOR,
    keras_global_attribute,
    set_keras_global_attribute,
)

__all__ = [
    "StateSnapshot", "stateful_variables", "call_with_snapshot", "call_replaying", "stateful_random_ops",
    "reads_global_seed_generator", "global_seed_generator", "forget_global_seed_generator", "state_restored",
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


@contextlib.contextmanager
def state_restored(variables: Sequence):
    """Puts back, on exit, the values of ``variables``, Python's ``random`` state and Keras's
    global seed generator: its state, or, when the block created it, its absence (so the
    next unseeded ``keras.random`` call creates it as plain training would)."""
    saved = [v.numpy() for v in variables]
    python_random = random.getstate()
    generator = global_seed_generator()
    generator_state = None if generator is None else generator.state.numpy()
    try:
        yield
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)
        random.setstate(python_random)
        if generator is not None:
            generator.state.assign(generator_state)
        elif global_seed_generator() is not None:
            forget_global_seed_generator()
