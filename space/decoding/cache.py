"""KV-cache plumbing shared by decoding, training and evaluation: the name under which a cache goes
into a model's forward (on both sides of a transformers rename), cropping it, and the full-attention
cache plus per-layer attention windows that SPACE steps need on sliding-window models.

transformers 5.24 renamed the forward input ``past_key_values`` to ``cache``; the old name still works
there with a FutureWarning on every call and goes away in 5.40. We support transformers 5.x from 5.0
(requirements.txt), so every forward that takes our cache passes it through ``cache_input``.
"""
from __future__ import annotations

import inspect

from transformers import Cache, DynamicCache, LlamaModel
from transformers.cache_utils import StaticLayer

# the stock Llama forward stands for the installed version: the rename covered every model class at once
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' names in config.layer_types


def cache_input(cache: Cache) -> dict[str, Cache]:
    """``{name: cache}`` to splat into a model or decoder forward: ``model(ids, **cache_input(cache))``."""
    return {CACHE_ARG: cache}


def crop_cache(cache: Cache, keep: int, length: int | None = None) -> None:
    """Keep the first ``keep`` cached tokens (a negative crop: transformers 4.x and 5.x, dynamic and
    static layers). ``length``: the tokens cached now, when the caller knows it (a static cache
    counts its length on the device, so asking it would be a host sync)."""
    drop = (cache.get_seq_length() if length is None else length) - keep
    if drop > 0:
        cache.crop(-drop)


def full_cache() -> DynamicCache:
    """An empty DynamicCache whose every layer keeps all tokens, in position order (slot i holds
    position i), so a decode step can crop it and move entries inside it.

    ``DynamicCache(config=...)`` would give a sliding-window model sliding layers that keep only the
    last window of tokens and cannot be cropped: SPACE keeps full layers and applies the window in
    its 4-D mask instead (:func:`attention_windows`).
    """
    return DynamicCache()


def static_cache(num_layers: int, max_len: int) -> Cache:
    """A preallocated cache (gpt-fast style, issue 43): every layer a transformers ``StaticLayer``
    of ``max_len`` slots, slot i holding position i, full attention on every layer like
    :func:`full_cache`. Its tensors are allocated at the first write and never again: a step
    writes its block at the cache's length, a crop only lowers the length (on the device, no
    sync), and compaction moves entries inside the same tensors. The model attends over all
    ``max_len`` slots, so a step's 4-D mask must hide the slots past the block (the decoder's
    ``with_cache(..., slots=max_len)``); shapes then repeat, which a compiled forward needs.

    Raises:
        ValueError: max_len < 1.
    """
    if max_len < 1:
        raise ValueError(f"a static cache needs at least 1 slot, got {max_len}")
    return Cache(layers=[StaticLayer(max_cache_len=max_len) for _ in range(num_layers)])


def attention_windows(config) -> dict[str, int | None]:
    """The model's kinds of attention layer, ``{layer type: sliding window in tokens, or None}``.

    ``{"full_attention": None}`` for a model without a sliding window (Llama); Mistral with
    ``sliding_window`` set slides on every layer; Qwen2 with ``use_sliding_window`` lists its kinds
    in ``config.layer_types`` (``max_window_layers``). A query at position p sees a key at
    position p' only when ``p - p' < window``, as transformers' ``sliding_window_overlay``.

    Raises:
        ValueError: a layer type other than full or sliding attention (chunked attention, ...).
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or [FULL if window is None else SLIDING]
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"SPACE decoding supports full and sliding-window attention layers, "
                         f"this model has {unknown}")
    return {kind: window if kind == SLIDING else None for kind in dict.fromkeys(types)}


def refuse_sliding_window(config, what: str, length: int | None = None) -> None:
    """Refuse a sliding-window model where ``what`` keeps transformers' plain 4-D masks without the
    window (the acceptance probe, the step-cost curve, SAR-SFT training). With ``length``, only
    sequences as long as the window are refused: shorter ones never reach past it.

    Raises:
        ValueError: the model has a sliding window (of at most ``length`` tokens), naming it.
    """
    windows = [w for w in attention_windows(config).values() if w is not None]
    # a window-w cache keeps w - 1 past tokens: a length of w already loses one
    if windows and (length is None or length >= min(windows)):
        raise ValueError(f"{what} does not apply a sliding window (this model slides over {min(windows)} tokens"
                         + (f", sequences here reach {length}" if length is not None else "")
                         + "); SPACE decoding and space-eval do")
