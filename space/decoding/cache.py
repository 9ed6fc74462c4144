"""The name under which a KV cache goes into a model's forward, on both sides of a transformers rename.

transformers 5.24 renamed the forward input ``past_key_values`` to ``cache``; the old name still works
there with a FutureWarning on every call and goes away in 5.40. We support transformers 5.x from 5.0
(requirements.txt), so every forward that takes our cache passes it through ``cache_input``.
"""
from __future__ import annotations

import inspect

from transformers import Cache, LlamaModel

# the stock Llama forward stands for the installed version: the rename covered every model class at once
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_input(cache: Cache) -> dict[str, Cache]:
    """``{name: cache}`` to splat into a model or decoder forward: ``model(ids, **cache_input(cache))``."""
    return {CACHE_ARG: cache}
