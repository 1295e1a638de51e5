"""keras-hub causal language models with rotary embeddings in ``tfremat.fit`` (issue 33, session 31).

keras-hub's Gemma attention reshapes to the shape it reads from its query, whose sequence axis
its ``EinsumDense`` leaves unknown when recorded; tfremat replayed that ``None`` and crashed
(user_check_7.md, finding 2; ``tfremat.extract.opening``, "Shapes"). The checks, each as
:mod:`user_check_7`'s rows (``fit_compared``: exactness against plain ``model.fit``, allocator
reads against the budget, time against a plain step over the planned ratio):

- ``gemma_hub``: :mod:`user_check_7`'s own check, unchanged (2-layer tiny ``GemmaCausalLM``, ``"70%"``);
- ``llama_hub``: keras-hub's ``LlamaCausalLM`` around a tiny random ``LlamaBackbone`` (2 layers,
  hidden 64, 4 query heads / 1 KV head), the same tokens, ``"70%"``;
- ``mistral_hub``: the same with ``MistralCausalLM`` / ``MistralBackbone`` (sliding window 512).

Run: ``python benchmarks/rope_hub_check.py`` (rows to ``benchmarks/results/gemma_opening.json``);
``--only``, ``--list``, ``--timeout``, ``--from_json`` as :mod:`user_check_7`.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's tfremat

import user_check_6  # noqa: E402
import user_check_7  # noqa: E402
from user_check_3 import child_row, json_rows_main  # noqa: E402
from user_check_4 import _nbytes  # noqa: E402
from user_check_5 import TRAIN_STEPS, fit_compared  # noqa: E402

DEFAULT_JSON = os.path.join(HERE, "results", "gemma_opening.json")
BATCH, LENGTH, VOCABULARY = 8, 64, 512

CHECKS = {
    "gemma_hub": user_check_7.CHECKS["gemma_hub"],
    "llama_hub": ("70%", "keras-hub LlamaCausalLM, tiny random LlamaBackbone, its compile() defaults"),
    "mistral_hub": ("70%", "keras-hub MistralCausalLM, tiny random MistralBackbone, its compile() defaults"),
}


def _causal_lm(family: str):
    import keras_hub

    backbone_class = getattr(keras_hub.models, f"{family}Backbone")
    backbone = backbone_class(vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4, num_key_value_heads=1,
                              hidden_dim=64, intermediate_dim=128)
    model = getattr(keras_hub.models, f"{family}CausalLM")(backbone=backbone, preprocessor=None)
    model.compile()  # keras-hub's defaults, as user_check_7's Gemma
    return model


def _causal_lm_check(family: str, budget):
    """:func:`user_check_7.check_gemma_hub`'s data and comparison for another family."""
    import tensorflow as tf

    tokens, padding = user_check_7._token_rows(BATCH * TRAIN_STEPS, LENGTH + 1, VOCABULARY)
    x = {"token_ids": tokens[:, :-1], "padding_mask": padding[:, :-1]}
    y, weights = tokens[:, 1:], padding[:, 1:].astype("float32")
    fit_kwargs = {"x": x, "y": y, "sample_weight": weights, "batch_size": BATCH, "epochs": 1, "shuffle": False}
    timing = ({k: tf.constant(v[:BATCH]) for k, v in x.items()}, tf.constant(y[:BATCH]))
    return fit_compared(lambda: _causal_lm(family), fit_kwargs, budget, timing,
                        _nbytes(x["token_ids"][:BATCH], x["padding_mask"][:BATCH], y[:BATCH], weights[:BATCH]))


def check_gemma_hub(budget, work):
    return user_check_7.check_gemma_hub(budget, work)


def check_llama_hub(budget, work):
    return _causal_lm_check("Llama", budget)


def check_mistral_hub(budget, work):
    return _causal_lm_check("Mistral", budget)


def child(check: str) -> None:
    child_row(globals()[f"check_{check}"], CHECKS[check][0], "rope_hub_check_")


def main(argv=None) -> int:
    return json_rows_main(argv, __doc__, __file__, CHECKS, child, user_check_6.render, DEFAULT_JSON,
                          "tfremat_rope_hub_check_")


if __name__ == "__main__":
    sys.exit(main())
