"""Losses as ``model.compile`` takes them -> one function the step differentiates.

:func:`resolve_loss` turns a loss (an object, a name, a callable, or a list or dict of them
per output) and its weights into ``fn(labels, preds, sample_weight=None) -> scalar``, the
weighted sum that ``model.fit`` trains on; :func:`loss_cache_name` names it for the profile
cache.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from tfremat.errors import ExtractionError
from tfremat.extract.profile_cache import code_fingerprint
from tfremat.runtime.internals import LossFunctionWrapper

__all__ = ["resolve_loss", "per_output", "loss_cache_name"]


def _one_loss(loss, where: str) -> Callable:
    """A Keras loss object, its name or a callable, as a Keras ``Loss``.

    Names and plain functions are wrapped in Keras's ``LossFunctionWrapper`` (not exported
    by ``keras.losses``; ``model.compile`` wraps them in the same class): the wrapper
    applies the output's Keras mask (an ``Embedding(mask_zero=True)`` upstream) and
    Keras's mean over the batch, so the loss equals the one ``model.fit`` trains on.
    """
    if isinstance(loss, str):
        try:
            function = keras.losses.get(loss)
        except ValueError as err:
            raise ExtractionError(
                f"{where} {loss!r} is not a Keras loss name ({err}); pass a keras.losses object or a callable",
                layer="loss",
            ) from None
        name = loss
    elif callable(loss):
        # TensorFlow name scopes take [A-Za-z0-9_.\\/>-]: a lambda's "<lambda>" is refused.
        function, name = loss, re.sub(r"[^A-Za-z0-9_.-]", "_", getattr(loss, "__name__", "") or "").strip("_") or "loss"
    else:
        raise ExtractionError(
            f"{where} must be a Keras loss, its name or a callable, got {type(loss).__name__}", layer="loss"
        )
    if isinstance(function, keras.losses.Loss):
        if function.reduction in (None, "none"):
            raise ExtractionError(
                f"{where} {function.name!r} has reduction=None (one loss per sample, which Keras differentiates "
                "as their sum); give it reduction='sum' for that, or the default 'sum_over_batch_size'",
                layer="loss",
            )
        return function
    return LossFunctionWrapper(function, name=name)


def per_output(value, output_names: Sequence[str], what: str, default) -> list:
    """``value`` given as in ``model.compile`` (one for all outputs, a list with one per
    output, or a dict keyed by output name) as a list with one entry per output: the
    extraction's losses and weights, and the labels :func:`tfremat.model_planning.synthetic_batch`
    makes for them.

    Raises:
        ExtractionError: a dict names no output, or a list's length is not the number of
            outputs.
    """
    count = len(output_names)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(output_names))
        if unknown:
            raise ExtractionError(f"{what} names no model output {unknown}; the outputs are {list(output_names)}",
                                  layer="loss")
        return [value.get(name, default) for name in output_names]
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ExtractionError(f"{what} has {len(value)} entries for a model with {count} outputs", layer="loss")
        return list(value)
    return [value] * count


def resolve_loss(loss, num_outputs: int, output_names: Sequence[str] = (), loss_weights=None) -> Callable:
    """Turns a loss as ``model.compile`` takes it into ``fn(labels, preds, sample_weight=None)
    -> scalar``.

    ``labels`` and ``preds`` are lists with one tensor per model output; ``sample_weight``
    (one weight per sample, or None) weights every output's loss, as Keras's compiled loss
    does with one array of sample weights.
    ``loss`` is a Keras loss object, its name or a callable applied to every output, or a
    list (one per output, None for an output without loss) or a dict keyed by output name;
    ``loss_weights`` likewise a number, a list or a dict (None: 1 each). The result is
    the weighted sum over outputs of each loss's mean, which is what Keras trains on.

    Raises:
        ExtractionError: a name is not a Keras loss, or the structure does not match the
            model's outputs.
    """
    names = list(output_names) or [f"output_{k}" for k in range(num_outputs)]
    if len(names) != num_outputs:
        raise ExtractionError(f"{len(names)} output names for a model with {num_outputs} outputs", layer="loss")
    losses = [None if item is None else _one_loss(item, "loss")
              for item in per_output(loss, names, "loss", None)]
    if all(item is None for item in losses):
        raise ExtractionError("no loss for any model output", layer="loss")
    weights = per_output(1.0 if loss_weights is None else loss_weights, names, "loss_weights", 1.0)
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights):
        raise ExtractionError(f"loss_weights must be numbers, got {loss_weights!r}", layer="loss")
    terms = [(k, fn, float(w)) for k, (fn, w) in enumerate(zip(losses, weights)) if fn is not None]

    def loss_fn(labels, preds, sample_weight=None):
        total = None
        for k, fn, weight in terms:
            term = tf.reduce_mean(fn(labels[k], preds[k], sample_weight))
            term = term if weight == 1.0 else term * weight
            total = term if total is None else total + term
        return total

    return loss_fn


def loss_cache_name(loss, loss_weights) -> str:
    """A stable name of a loss (and its weights) for the profile cache's key; a callable's
    name comes with its code's fingerprint, so editing ``def my_loss`` is a new key."""
    def name(item):
        if item is None or isinstance(item, str):
            return repr(item)
        if isinstance(item, Mapping):
            return "{" + ", ".join(f"{k!r}: {name(v)}" for k, v in sorted(item.items())) + "}"
        if isinstance(item, (list, tuple)):
            return "[" + ", ".join(map(name, item)) + "]"
        named = getattr(item, "name", None) or getattr(item, "__name__", None) or repr(item)
        return f"{named}#{code_fingerprint(item)}"

    named = name(loss)
    return named if loss_weights is None else f"{named} weighted {name(loss_weights)}"
