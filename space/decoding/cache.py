"""KV-cache plumbing shared by decoding, training and evaluation: the name under which a cache goes
into a model's forward (on both sides of a transformers rename), and cropping it.

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


def crop_cache(cache: Cache, keep: int) -> None:
    """Keep the first ``keep`` cached tokens (negative crop works on transformers 4.x and 5.x)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)
