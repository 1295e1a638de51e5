"""Models by name or file for the command line, and the ``tfremat graph`` command's work.

``build_application`` accepts any Keras Applications constructor (``resnet50``, ``mobilenet_v2``,
``vgg16``, ...; case and underscores are ignored, weights are never downloaded) or the path
of a saved ``.keras`` model.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os

import keras
import numpy as np

from tfremat.errors import ExtractionError
from tfremat.extract.extractor import extract
from tfremat.extract.opening import DEFAULT_GRANULARITY
from tfremat.plan.simulator import checkpoint_all_peak

__all__ = ["build_application", "graph_command", "application_names"]

logger = logging.getLogger(__name__)


def _normalize(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def application_names() -> dict[str, str]:
    """Normalized name -> Keras Applications constructor name, for every constructor."""
    names = {}
    for attr in dir(keras.applications):
        value = getattr(keras.applications, attr)
        if callable(value) and attr[:1].isupper():
            names[_normalize(attr)] = attr
    return names


def load_custom_objects(source: str) -> dict:
    """The custom objects a saved model needs, from a Python file or an importable module.

    Importing it registers what it decorates with ``keras.saving.register_keras_serializable``;
    its ``custom_objects`` dict, when it defines one, is returned, else every public class
    and function it defines, by name (what ``keras.models.load_model(custom_objects=...)``
    takes).

    Raises:
        ExtractionError: the file does not exist or the module does not import.
    """
    try:
        if source.endswith(".py"):
            if not os.path.exists(source):
                raise ExtractionError(f"custom objects file {source!r} does not exist")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(source))[0], source)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except ExtractionError:
        raise
    except Exception as error:  # whatever the user's module raises while importing
        raise ExtractionError(f"custom objects {source!r} do not import: {type(error).__name__}: {error}") from error
    if isinstance(getattr(module, "custom_objects", None), dict):
        return dict(module.custom_objects)
    return {
        name: value for name, value in vars(module).items()
        if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    }


def build_application(name_or_file: str, input_shape: tuple[int, ...] | None, num_classes: int = 1000,
                      custom_objects: dict | None = None):
    """Builds a model from a Keras Applications name or loads a ``.keras`` file.

    A file is loaded with its compile configuration (its loss and optimizer, which the
    command line uses unless ``--loss`` / ``--optimizer`` are given).

    Args:
        name_or_file: e.g. ``"resnet50"``, ``"MobileNetV2"``, or ``"path/model.keras"``.
        input_shape: ``(H, W, C)``, needed for an Applications model; a file's model
            carries its own shapes, which must then equal it (None: not checked).
        num_classes: classes of an Applications model's head.
        custom_objects: for a file, the custom layers, losses and functions it needs
            (:func:`load_custom_objects`).

    Returns:
        A built Keras model.

    Raises:
        ExtractionError: unknown name, missing file, a file that does not load (a custom
            layer without its custom objects), a missing input shape, or an input shape the
            model refuses or (for a file) does not have.
    """
    if name_or_file.endswith(".keras") or os.path.sep in name_or_file:
        if not os.path.exists(name_or_file):
            raise ExtractionError(f"model file {name_or_file!r} does not exist")
        try:
            model = keras.models.load_model(name_or_file, custom_objects=custom_objects)
        except Exception as error:  # Keras raises TypeError/ValueError/... for what it cannot rebuild
            raise ExtractionError(
                f"model file {name_or_file!r} does not load: {type(error).__name__}: {str(error).splitlines()[0]}. "
                "If it has custom layers, losses or functions, pass the module defining them "
                "(--custom_objects=my_layers.py; in Python, custom_objects= to keras.models.load_model)"
            ) from error
        if input_shape is not None:
            saved = [tuple(tensor.shape[1:]) for tensor in model.inputs]
            if saved != [tuple(input_shape)]:
                shapes = ", ".join(",".join(map(str, shape)) for shape in saved)
                raise ExtractionError(
                    f"model file {name_or_file!r} takes inputs of shape {shapes} (without the batch), not "
                    f"{','.join(map(str, input_shape))}; leave the input shape out for a saved model"
                )
        return model
    if input_shape is None:
        raise ExtractionError(f"model {name_or_file!r} needs an input shape (H, W, C; --input_shape=H,W,C on the "
                              "command line)")
    names = application_names()
    constructor = names.get(_normalize(name_or_file))
    if constructor is None:
        raise ExtractionError(
            f"unknown model {name_or_file!r}: give a Keras Applications name ({', '.join(sorted(names.values()))}) "
            "or a path to a saved .keras file"
        )
    try:
        return getattr(keras.applications, constructor)(
            weights=None, input_shape=tuple(input_shape), classes=num_classes
        )
    except ValueError as err:
        raise ExtractionError(f"{constructor} refuses input_shape={tuple(input_shape)}: {err}") from None


def graph_command(
    model,
    input_shape: tuple[int, ...],
    batch: int,
    cost_model: str,
    out: str,
    loss="categorical_crossentropy",
    optimizer=None,
    use_cache: bool = True,
    granularity: str = DEFAULT_GRANULARITY,
) -> dict:
    """Extracts a model's graph and writes it as the planning core's JSON.

    Args:
        model: a Keras model, or a name/file for :func:`build_application`.
        input_shape: ``(H, W, C)``, used when ``model`` is a name.
        batch: batch size.
        cost_model: ``"profile"`` or ``"flops"``.
        out: path of the JSON file to write.
        loss: loss name, object or callable (default categorical cross-entropy).
        optimizer: a Keras optimizer or its name (default SGD).
        use_cache: read and write the profile cache (``--nocache`` turns it off).
        granularity: what a graph node is, ``"layer"``, ``"sublayer"`` or ``"op"`` (see :mod:`tfremat.extract.opening`).

    Returns:
        A JSON-able summary: model, nodes, edges, fixed bytes, checkpoint-all peak,
        seconds, output path.
    """
    if isinstance(model, str):
        model = build_application(model, input_shape)
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    from tfremat.model_planning import synthetic_batch  # measure imports this package

    # Labels shaped for the loss (class ids for a sparse one), not like the outputs.
    extraction = extract(model, sample_batch=synthetic_batch(model, batch, loss=loss), loss=loss, optimizer=optimizer,
                         cost_model=cost_model, granularity=granularity, use_cache=use_cache)
    graph = extraction.graph
    graph.to_json(out)
    peak = checkpoint_all_peak(graph)
    summary = {
        "model": model.name,
        "nodes": graph.size,
        "edges": len(graph.edges),
        "fixed_bytes": graph.fixed_bytes,
        "checkpoint_all_peak_bytes": int(peak),
        "cost_model": cost_model,
        "granularity": granularity,
        "seconds": round(extraction.seconds, 3),
        "cache_hit": extraction.cache_hit,
        "out": os.fspath(out),
        "parameters": int(np.sum([np.prod(v.shape) for v in model.trainable_variables])),
    }
    logger.info("graph %s", summary)
    return summary
