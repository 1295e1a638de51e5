"""Refusals: what the extracted graph cannot model is refused, naming the layer.

The compiled step trains on one loss node and may run a layer's call more than once
(a recomputation), so a model must not train on anything but its compiled loss and weight
regularizers (:func:`refuse_unmodelled_training`), and a layer call must be a pure function
of its inputs: no state carried across batches (:func:`check_layer`), no Python attribute
changed and no loss added when called (:func:`analyze_checked`, which watches the profiling
call for those and leaves the layer's variables and every random state as it found them).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfremat.errors import ExtractionError, TfrematError
from tfremat.extract.analysis import CallAnalysis, analyze_call
from tfremat.extract.layer_graph import (
    LayerCall,
    functional_view,
    regularized_variables,
    trainable_variables,
)
from tfremat.extract.side_table import TensorRef
from tfremat.runtime.layer_variants import running
from tfremat.runtime.state import state_restored, stateful_variables

__all__ = ["refuse_unmodelled_training", "check_layer", "analyze_checked"]


def refuse_unmodelled_training(model) -> None:
    """Refuses a model that ``model.fit`` trains on more than its compiled loss.

    The step's graph has one loss node, computed from the outputs and labels with the
    compiled loss, and would silently train without the rest:
    - a ``train_step``, ``compute_loss`` or ``call`` of the model's own class (custom
      training logic, an added penalty, a forward pass other than the layer graph; the
      ``call`` of a subclassed model without a layer graph is its forward pass, which
      :func:`~tfremat.extract.layer_graph.functional_model` wraps);
    - ``add_loss`` terms. (Activity regularizers appear only once a layer is called; the
      extraction's per-call check refuses those.)

    Weight regularizers (``kernel_regularizer``, ``bias_regularizer``, ...) read only
    their variable: the compiled step adds their penalties and gradients
    (:class:`tfremat.static_graph.compile.CompiledStep`), so they are not refused.

    Raises:
        ExtractionError: naming the overriding method, or the first layer that adds a
            loss and listing all of them.
    """
    for method in ("train_step", "compute_loss", "call"):
        if method == "call" and functional_view(model) is None:
            continue  # a subclassed model's call is its forward pass, extracted through a wrapper
        if not getattr(type(model), method).__module__.startswith("keras."):
            way_in = ("or keep it and take its gradients from tfremat.value_and_grad(loss_fn, budget, ...) in "
                      "place of tf.GradientTape" if method != "call" else "or train this model without tfremat")
            raise ExtractionError(
                f"model {model.name!r} overrides {method}; the rematerialized step runs the layer graph with the "
                "compiled loss alone and would silently skip it. Express the model as layers and the loss "
                f"through model.compile(loss=...), {way_in}",
                layer=model.name,
            )
    if len(model.losses) == len(regularized_variables(model)):
        return
    leaves = [layer for layer in model._flatten_layers(include_self=False) if not layer._layers and layer._losses]
    names = [layer.name for layer in leaves] or [model.name]
    raise ExtractionError(
        f"layers {names} add losses to the model; the rematerialized step trains on the compiled loss and the "
        f"weight regularizers alone and would drop them. {_added_loss_remedy(leaves[0] if leaves else model)}",
        layer=names[0],
    )


def _added_loss_remedy(layer) -> str:
    """What a user whose ``layer`` adds a loss in ``call`` can do instead.

    A Keras loss function sees only ``y_true`` and ``y_pred``, so a term computed from an
    inner activation cannot move into ``model.compile(loss=...)``; it can move into the loss
    function of :func:`tfremat.value_and_grad` once the model returns that activation. Keras
    divides an activity penalty by the batch size (``keras.src.layers.layer.Layer.__call__``);
    the advice repeats it so that training is unchanged.
    """
    if getattr(layer, "activity_regularizer", None) is not None:
        return (f"{layer.name!r} has an activity_regularizer=, whose penalty a Keras loss cannot compute (it sees "
                "only y_true and y_pred): remove activity_regularizer=, return the layer's output as a second model "
                "output, and train with tfremat.value_and_grad in a custom loop or train_step "
                '(README, "Custom training loops"): pred, h = model(x, training=True); loss = loss_fn(y, pred) + '
                "regularizer(h) / batch_size, with the layer's regularizer divided by the batch size as Keras does")
    return ("Compute the term in the loss function from tensors the model returns (a second output for an inner "
            "activation), with model.compile(loss=...) when it needs only y_true and y_pred, else with "
            'tfremat.value_and_grad in a custom loop or train_step (README, "Custom training loops"); or express '
            "a term on a weight as a weight regularizer (kernel_regularizer=)")


def check_layer(layer, name: str) -> None:
    """Refuses layers whose recomputation would not be a pure function of its inputs."""
    if getattr(layer, "stateful", False):
        raise ExtractionError(
            f"layer {name!r} is stateful (state carried across batches); recomputing it would advance its "
            "state twice. Use stateful=False, or keep the layer outside the rematerialized model.",
            layer=name,
        )


def analyze_checked(call: LayerCall, takes_training: bool, specs, grads, batch, cost_model, repeats,
                    implementation: str | None = None) -> CallAnalysis:
    """Analyzes one call (:func:`~tfremat.extract.analysis.analyze_call`), refusing Python
    side effects and added losses, and restoring non-trainable state and random state.
    With ``implementation``, the call runs that alternative of its layer
    (:func:`tfremat.runtime.layer_variants.running`).

    Profiling must leave every random state as it found it: an unseeded ``keras.random``
    call advances Keras's global seed generator, or creates it with a seed drawn from
    Python's ``random``, and plain training would then draw other numbers than tfremat's
    step.

    Raises:
        ExtractionError: the call changed a plain Python attribute of a user layer, or the
            layer added losses (``activity_regularizer=``, ``add_loss``) in ``call``, with
            the route that keeps the term (:func:`_added_loss_remedy`); or the call fails
            to trace on tensors of ``specs`` with a ``TypeError`` or ``ValueError`` (what
            Keras and TensorFlow raise for an argument they cannot take), naming the call
            and the way around it, not as the bare Keras error.
    """
    layer = call.layer
    user_layer = not type(layer).__module__.startswith("keras")
    before = _python_state(layer) if user_layer else None
    try:
        with state_restored(stateful_variables(layer)):
            analysis = analyze_call(
                _make_caller(call, takes_training, implementation), call.name, specs, grads,
                list(trainable_variables(layer)), batch,
                profile=cost_model == "profile", repeats=repeats, input_masks=call.input_masks,
            )
    except TfrematError:
        raise
    except (TypeError, ValueError) as error:
        shapes = ", ".join(str(tuple(spec.shape)) for spec in specs)
        raise ExtractionError(
            f"layer call {call.name!r} fails when traced on tensors of shapes {shapes}: {type(error).__name__}: "
            f"{' '.join(str(error).split())[:400]}. tfremat replays each call with the arguments it was recorded with; "
            "where the call is inside a layer tfremat opened (granularity \"sublayer\", the default), pass "
            "granularity=\"layer\" to keep layers whole, and report the layer",
            layer=call.name,
        ) from error
    if user_layer:
        after = _python_state(layer)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if changed:
            raise ExtractionError(
                f"layer {call.name!r} changes its Python attributes {changed} when called; a recomputation "
                "would repeat that side effect. Keep such state in tf.Variables or outside call().",
                layer=call.name,
            )
    if len(getattr(layer, "losses", ())) > len(regularized_variables(layer)):
        source = "activity_regularizer=" if getattr(layer, "activity_regularizer", None) is not None else "add_loss"
        raise ExtractionError(
            f"layer {call.name!r} adds losses in call() ({source}); tfremat's graph has one loss node, the "
            f"compiled loss, and would drop them. {_added_loss_remedy(layer)}",
            layer=call.name,
        )
    return analysis


def _python_state(layer) -> dict:
    """A snapshot of a user layer's plain Python attributes, to catch side effects in ``call``."""
    state = {}
    for key, value in vars(layer).items():
        if isinstance(value, (bool, int, float, str, type(None))):
            state[key] = value
        elif isinstance(value, (list, dict, set)) and not key.startswith("_"):
            state[key] = len(value)
    return state


def _make_caller(call: LayerCall, takes_training: bool, implementation: str | None) -> Callable[[list], object]:
    """``run(flat_inputs)``: the layer call with its tensor arguments replaced by
    ``flat_inputs`` in order (and ``training=True`` when the layer takes it), running
    ``implementation`` of the layer (None: its own)."""
    def run(flat_inputs):
        it = iter(flat_inputs)

        def swap(value):
            return next(it) if isinstance(value, TensorRef) else value

        args = tf.nest.map_structure(swap, call.call_args)
        kwargs = tf.nest.map_structure(swap, dict(call.call_kwargs))
        if takes_training:
            kwargs["training"] = True
        # Inside a scope, as in a model's call and in the step: TensorFlow refuses a root
        # name scope that starts with "_", which Keras names a layer of a class like
        # ``_Block`` ("__block"). The name also orders the ops: Grappler's reassociation
        # of a gradient's products breaks ties in name order, and a forward scope that sorts
        # before ``gradient_tape/`` let it pair mixed-precision attention's scale constant
        # with the forward softmax, a product computed in the forward and kept to the
        # backward (tests/test_mixed_precision.py); "profile" sorts after it.
        with tf.name_scope("profile"), running(call.layer, implementation):
            return call.layer(*args, **kwargs)

    return run
