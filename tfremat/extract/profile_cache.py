"""The on-disk profile cache: per-call measurements keyed by everything that changes them.

An entry is ``<cache_dir>/<key>.json`` holding ``{"calls": [CallAnalysis dict, ...],
"loss": CallAnalysis dict, "implementations": [{name: CallAnalysis dict}, ...], "plain_overlap":
PlainOverlap dict}`` (per call, its layer's alternatives when they were measured; the plain
overlap with the quartiles of its rounds, its load and the plain step's least seconds,
:mod:`tfremat.extract.overlap`). The key hashes the cache version, the TensorFlow version, the device, the inter-op thread setting, the cost model, whether
alternatives are measured, whether the calls were timed compiled by XLA
(``extract(..., xla=True)``), the loss, the input and label specs,
the dtype policy and every call's layer signature and wiring. A layer's signature includes
a fingerprint of its class's code (:func:`code_fingerprint`), so editing a user layer or
loss between two runs does not reuse the first run's numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import keras
import tensorflow as tf

from tfremat.cache import read_entry, warn_once, write_atomically
from tfremat.extract.analysis import CallAnalysis
from tfremat.extract.overlap import PlainOverlap

__all__ = ["cache_dir", "code_fingerprint", "layer_signature", "cache_key", "load_cache", "store_cache"]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 47  # 47: the loss keeps its requested peak (its order-free bound counted a per-pixel loss's temporaries at once); 46: backward workspaces from the greediest order with reductions chained and only what a trace returns kept (attention), the loss in the greediest order too, and forward small buffers counted per operation (order_free_peak small_sizes); 45: a forward's allocations up to one example's output counted live throughout (order_free_peak); 44: the largest calls timed in three times as many passes, the mean of the least half kept; 43: the plain overlap reads its update seconds off the plain step's trace; 42: nested layers' names left out of layer signatures; 41: the plain overlap keeps its optimizer update's seconds (update_seconds)
_SCALARS = (bool, int, float, str, type(None))
_LIBRARY_MODULES = ("keras", "tensorflow", "tf_keras", "builtins", "abc", "typing")


def cache_dir() -> str:
    """Where profiles are cached: ``$TFREMAT_CACHE_DIR``, else ``~/.cache/tfremat``."""
    return os.environ.get("TFREMAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfremat")


def layer_signature(layer) -> str:
    """A description of a layer that is equal for layers that behave identically: its
    class, the fingerprint of that class's code (a user layer edited between two runs
    must not reuse the first run's cached measurements) and its config.

    ``get_config`` may raise anything (Keras raises ``NotImplementedError`` for a layer it
    cannot serialize, a keras-hub decoder block ``AttributeError``); such a layer is
    described by its state instead (:func:`_layer_state`)."""
    kind = f"{type(layer).__module__}.{type(layer).__qualname__}#{code_fingerprint(type(layer))}"
    try:
        config = dict(layer.get_config())
    except Exception as error:  # noqa: BLE001 - any failure of user code means "no config"
        logger.debug("layer %s: get_config raised %s; fingerprinted by its state", layer.name, type(error).__name__)
        return f"{kind}~{json.dumps(_layer_state(layer), sort_keys=True, default=str)}"
    config.pop("name", None)
    return f"{kind}:{json.dumps(_unnamed(config), sort_keys=True, default=str)}"


def _unnamed(value):
    """``value`` (a layer's config) without the names of the layers serialized inside it: a
    ``TimeDistributed``'s or ``Bidirectional``'s inner layer carries Keras's automatic name
    (``"dense"`` in one model, ``"dense_6"`` in the next), which left every new model's layer
    out of the cache (benchmarks/results/user_check_4.md, finding 5). A dtype policy's name
    (``"mixed_float16"``) says how the layer computes and is kept."""
    if isinstance(value, dict):
        out = {key: _unnamed(item) for key, item in value.items()}
        inner = out.get("config")
        if isinstance(inner, dict) and "class_name" in out and "DTypePolicy" not in str(out["class_name"]):
            inner.pop("name", None)
        return out
    if isinstance(value, (list, tuple)):
        return [_unnamed(item) for item in value]
    return value


def _layer_state(layer) -> dict:
    """What distinguishes two instances of one layer class without ``get_config``: its
    plain attributes (numbers, strings, tuples of them; names left out, they differ
    between instances that behave alike), the shapes and dtypes of its weights, and the
    same for every sublayer, in tracking order."""

    def plain(value) -> bool:
        if isinstance(value, (tuple, list)):
            return all(plain(v) for v in value)
        return isinstance(value, _SCALARS)

    def describe(one) -> dict:
        attributes = {
            key: value for key, value in vars(one).items()
            if plain(value) and "name" not in key and "path" not in key
        }
        weights = [(list(w.shape), str(w.dtype)) for w in getattr(one, "_trainable_variables", [])
                   + getattr(one, "_non_trainable_variables", [])]
        return {"class": type(one).__qualname__, "attributes": attributes, "weights": weights}

    return {"layer": describe(layer), "sublayers": [describe(s) for s in getattr(layer, "_flatten_layers", lambda **_: [])(
        include_self=False, recursive=True)]}


def code_fingerprint(thing) -> str:
    """A digest of the Python code behind a user-defined class or callable.

    For a class: every function defined in it and in its base classes outside Keras and
    TensorFlow (whose code the TensorFlow version in the cache key covers); for a function
    or lambda: its code and default arguments; for another callable object: its class.
    Code objects are hashed with their bytecode, constants (nested functions included) and
    names, so any edit of a body changes the digest. "" when there is no user code.
    """
    if isinstance(thing, type):
        functions = [
            (f"{cls.__qualname__}.{name}", getattr(value, "__func__", value))
            for cls in thing.__mro__ if not _is_library(cls.__module__)
            for name, value in sorted(vars(cls).items())
        ]
    elif hasattr(thing, "__code__"):
        functions = [] if _is_library(getattr(thing, "__module__", None)) else [("", thing)]
    else:
        return code_fingerprint(type(thing))
    functions = [(name, function) for name, function in functions if hasattr(function, "__code__")]
    if not functions:
        return ""
    digest = hashlib.sha256()
    for name, function in functions:
        digest.update(name.encode())
        _hash_code(function.__code__, digest)
        digest.update(repr(getattr(function, "__defaults__", None)).encode())
    return digest.hexdigest()[:12]


def _is_library(module: str | None) -> bool:
    return (module or "").split(".")[0] in _LIBRARY_MODULES


def _hash_code(code, digest) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            _hash_code(constant, digest)
        else:
            digest.update(repr(constant).encode())


def cache_key(model, calls, in_specs, label_specs, loss_name, cost_model, device, implementations: bool = False,
              xla: bool = False) -> str:
    """The entry's name: a digest of everything the measurements depend on (module docstring)."""
    payload = {
        "version": _CACHE_VERSION,
        "tf": tf.__version__,
        "device": device,
        "inter_op_threads": (tf.config.threading.get_inter_op_parallelism_threads(), os.environ.get("TF_NUM_INTEROP_THREADS")),
        "cost_model": cost_model,
        "implementations": implementations,
        "xla": xla,
        "loss": loss_name,
        "inputs": [(list(s.shape), s.dtype.name) for s in in_specs],
        "labels": [(list(s.shape), s.dtype.name) for s in label_specs],
        "policy": keras.config.dtype_policy().name,
        # A call's Keras masks only where it has some: the keys of unmasked models stay as they were.
        "calls": [(layer_signature(c.layer), [(r.source, r.index, r.output_index) for r in c.inputs],
                   *([repr(c.input_masks)] if c.input_masks else [])) for c in calls],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load_cache(key: str, num_calls: int
               ) -> tuple[list[CallAnalysis], CallAnalysis, list[dict[str, CallAnalysis]], PlainOverlap] | None:
    """The cached measurements of every call, of the loss and of every call's alternatives,
    and the plain overlap, or None on a miss.

    A damaged entry (an edit by hand, another version's) is a miss: it is logged and
    measured again, and the next store overwrites it; it is never removed here (another
    process may have just written a good one). An unreadable directory is a miss, logged
    once (:func:`tfremat.cache.read_entry`).
    """
    path = os.path.join(cache_dir(), f"{key}.json")
    text = read_entry(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
        calls = [CallAnalysis.from_dict(d) for d in data["calls"]]
        loss = CallAnalysis.from_dict(data["loss"])
        alternatives = [{name: CallAnalysis.from_dict(d) for name, d in one.items()} for one in data["implementations"]]
        overlap = PlainOverlap.from_dict(data["plain_overlap"])
        if len(calls) != num_calls or len(alternatives) != num_calls:
            raise ValueError(f"{len(calls)} calls cached for a model with {num_calls}")
    except Exception as err:  # noqa: BLE001 - whatever an entry holds, it is a miss, never the user's error
        logger.warning("profile cache entry %s is damaged (%s: %s); measuring again", path, type(err).__name__,
                       str(err)[:300])
        return None
    return calls, loss, alternatives, overlap


def store_cache(key: str, calls: list[CallAnalysis], loss: CallAnalysis,
                alternatives: list[dict[str, CallAnalysis]], plain_overlap: PlainOverlap = PlainOverlap()) -> None:
    """Writes an entry atomically (:func:`tfremat.cache.write_atomically`: a temporary file
    with a unique name, then a rename). A directory that cannot be written is logged once
    and skipped: extraction goes on without caching."""
    data = {"calls": [a.to_dict() for a in calls], "loss": loss.to_dict(),
            "implementations": [{name: a.to_dict() for name, a in one.items()} for one in alternatives],
            "plain_overlap": plain_overlap.to_dict()}
    directory = cache_dir()
    try:
        write_atomically(os.path.join(directory, f"{key}.json"), json.dumps(data))
    except OSError as error:
        warn_once(directory, "written", error)
