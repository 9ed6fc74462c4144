"""KV-cache plumbing shared by decoding, training and evaluation: the name under which a cache goes
into a model's forward (on both sides of a transformers rename), cropping it, the full-attention
cache plus per-layer attention windows that SPACE steps need on sliding-window models, and the
one-tensor caches eager decoding and captured steps use (:class:`SlabCache`, :class:`StaticSlabCache`).

transformers 5.24 renamed the forward input ``past_key_values`` to ``cache``; the old name still works
there with a FutureWarning on every call and goes away in 5.40. We support transformers 5.x from 5.0
(requirements.txt), so every forward that takes our cache passes it through ``cache_input``.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect

import torch
from transformers import Cache, DynamicCache, LlamaModel
from transformers.cache_utils import CacheLayerMixin, StaticLayer

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
    sync), and compaction moves entries inside the same tensors. transformers' attention reads
    all ``max_len`` slots, so a step's 4-D mask must hide the slots past the block (the decoder's
    ``with_cache(..., slots=max_len)``); shapes then repeat, which a compiled forward needs. An
    attention that reads only the mask's width (``space.decoding.backends.SDPA_GQA``) takes a mask over
    the cached tokens and the block alone (``decoder.mask_slots``), a size a compiled trunk keeps
    symbolic.

    Raises:
        ValueError: max_len < 1.
    """
    if max_len < 1:
        raise ValueError(f"a static cache needs at least 1 slot, got {max_len}")
    return Cache(layers=[StaticLayer(max_cache_len=max_len) for _ in range(num_layers)])


class Slab:
    """The tensor behind a :class:`SlabCache`: (layers, 2, batch, kv_heads, slots, head_dim), keys
    at [:, 0], values at [:, 1]; allocated at the first write (the shapes, dtype and device are the
    first layer's keys'). A model whose cached keys and values differ in shape (multi-head latent
    attention: DeepSeek-V2/V3, MiniCPM3 and Mistral 4 cache a latent and a rotary key of other
    widths) gets two tensors, keys (layers, batch, heads, slots, key_dim) and values (layers, batch,
    heads, slots, value_dim): a grow or a gather then takes two ops where it takes one.

    Attributes:
        keys, values: (layers, batch, heads, slots, dim) views (None before the first write).
        parts: the tensors a grow or a gather touches, their slots at dim -2.
    """

    def __init__(self, num_layers: int, slots: int):
        self.num_layers, self.slots = num_layers, slots
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.parts: list[torch.Tensor] = []

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate for keys and values shaped as ``keys`` and ``values`` (batch, heads, tokens, dim).

        Raises:
            ValueError: keys and values of another batch or dtype."""
        if keys.shape[0] != values.shape[0] or keys.dtype != values.dtype:
            raise ValueError(f"a slab cache needs keys and values of one batch and dtype, got {tuple(keys.shape)} "
                             f"{keys.dtype} and {tuple(values.shape)} {values.dtype}")
        if keys.shape == values.shape:
            b, h, _, d = keys.shape
            self._hold([keys.new_zeros(self.num_layers, 2, b, h, self.slots, d)])
        else:
            self._hold([t.new_zeros(self.num_layers, *t.shape[:2], self.slots, t.shape[-1]) for t in (keys, values)])

    def _hold(self, parts: list[torch.Tensor]) -> None:
        self.parts, self.slots = parts, parts[0].shape[-2]
        self.keys, self.values = (parts[0][:, 0], parts[0][:, 1]) if len(parts) == 1 else parts

    def grow(self, slots: int) -> None:
        """At least ``slots`` slots, the held tokens kept (a copy of the whole slab: a caller that
        sized it right never pays it). Every layer grows at once, so it is called by the first
        layer a forward writes, before any other layer has written its block."""
        new = []
        for t in self.parts:
            bigger = t.new_zeros(*t.shape[:-2], max(slots, 2 * self.slots), t.shape[-1])
            bigger[..., : self.slots, :] = t
            new.append(bigger)
        self._hold(new)

    def gather(self, start: int, index: torch.Tensor) -> None:
        """Write slots ``index`` (a (n,) long tensor on the slab's device) of every layer to slots
        ``start..start+n``: one gather and one copy per part."""
        for t in self.parts:
            t[..., start: start + index.numel(), :] = t.index_select(-2, index)


class SlabLayer(CacheLayerMixin):
    """One layer of a :class:`SlabCache`: its keys and values are views of the slab, its length a
    host integer (a crop costs nothing). ``update`` writes the block at the length (one copy for
    the keys, one for the values) and returns views of slots ``0..length``."""

    is_croppable = True
    is_sliding = False

    def __init__(self, slab: Slab, index: int):  # not the mixin's: its keys and values are properties here
        self.slab, self.index, self.length, self.is_initialized = slab, index, 0, False

    @property
    def keys(self) -> torch.Tensor:
        return self.slab.keys[self.index, ..., : self.length, :]

    @property
    def values(self) -> torch.Tensor:
        return self.slab.values[self.index, ..., : self.length, :]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.slab.keys is None:
            self.slab.allocate(key_states, value_states)
        self.device, self.is_initialized = self.slab.keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self.length + q > self.slab.slots:  # every layer holds `length` tokens: this is the forward's first write
            self.slab.grow(self.length + q)
        self.slab.keys[self.index, ..., self.length: self.length + q, :] = key_states
        self.slab.values[self.index, ..., self.length: self.length + q, :] = value_states
        self.length += q
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.slab.slots

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as transformers' crop)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


class SlabCache(Cache):
    """A growing cache whose every layer lives in one preallocated tensor (issue 58; eager
    decoding's cache on one device): a step writes 2 copies per layer, as ``DynamicCache``'s
    concatenations, but writes only the block instead of the whole cache; a crop is free; and
    moving an accepted tree path (:meth:`gather`) is one gather and one copy for every layer
    together, where a cache of separate tensors takes 4 ops per layer (120 on SmolLM2). Keys and
    values a step sees are slots ``0..length`` of its layer (full attention on every layer, slot i
    holding position i, as :func:`full_cache`).

    Args:
        num_layers: the model's decoder layers (all on one device).
        slots: most tokens it is expected to hold (prompt + new tokens + a step's block); a
            write past them grows the slab (:meth:`Slab.grow`), a copy of it.

    Raises:
        ValueError: slots < 1; at the first write, keys and values of another batch or dtype.
    """

    def __init__(self, num_layers: int, slots: int):
        if slots < 1:
            raise ValueError(f"a slab cache needs at least 1 slot, got {slots}")
        self.slab = Slab(num_layers, slots)
        super().__init__(layers=[SlabLayer(self.slab, i) for i in range(num_layers)])

    @property
    def device(self) -> torch.device:
        return self.slab.keys.device

    def gather(self, start: int, index: torch.Tensor) -> None:
        """Write slots ``index`` (a (n,) long tensor on the slab's device) of every layer to slots
        ``start..start+n``, in one gather and one copy (two where keys and values differ in shape)."""
        self.slab.gather(start, index)


class _SlabStaticLayer(StaticLayer):
    """One layer of a :class:`StaticSlabCache`: a transformers ``StaticLayer`` (a step writes its
    block with ``index_copy_`` at its length and advances the length on the device, as a captured
    graph records it) whose keys, values and length are views of its cache's slab and lengths."""

    def __init__(self, owner: StaticSlabCache, index: int):
        super().__init__(max_cache_len=owner.slots)
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slab = self.owner.allocate(key_states, value_states)
        self.device = slab.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = self.v_head_dim = key_states.shape[-1]
        self.dtype = slab.dtype
        self.keys, self.values = slab[self.index, 0], slab[self.index, 1]
        self.cumulative_length = self.owner.lengths[self.index]
        self.is_initialized = True


class StaticSlabCache(Cache):
    """The captured steps' cache (``space.decoding.graphs.StepGraphs``, issue 58): a static cache
    whose layers' keys and values are views of one slab (layers, 2, batch, kv_heads, slots,
    head_dim) and whose lengths are the elements of one (layers,) long tensor on the device. Inside
    a graph each layer updates as a ``StaticLayer`` does; what a decode step does to the cache
    outside the graph touches every layer in one op: a crop is one ``sub_`` of the lengths, and
    moving an accepted tree path (:meth:`gather`) one gather and one copy. Separate
    ``StaticLayer``s take 30 ``sub_`` a step and 120 gathers and copies a compacted step on
    SmolLM2: 86 ops outside the graph a shipped-layout SPACE step against AR's 8 (counted on the
    CPU, ``results/op_budget``), each a kernel launch and a Python loop turn on a GPU. Every layer holds the same number
    of tokens (one decoder's cache).

    Args:
        num_layers: the trunk's decoder layers; slots: tokens each holds.

    Raises:
        ValueError: slots < 1; at the first write (``early_initialization``), keys and values of
            different shapes.
    """

    def __init__(self, num_layers: int, slots: int):
        if slots < 1:
            raise ValueError(f"a static cache needs at least 1 slot, got {slots}")
        self.slots, self.slab = slots, None
        self.lengths = torch.zeros(num_layers, dtype=torch.long)
        super().__init__(layers=[_SlabStaticLayer(self, i) for i in range(num_layers)])

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The slab, allocated at the first layer's initialization (its shapes, dtype, device)."""
        if self.slab is None:
            if keys.shape[:2] != values.shape[:2] or keys.shape[-1] != values.shape[-1]:
                raise ValueError(f"captured steps need cached keys and values of one shape; this model caches "
                                 f"{tuple(keys.shape)} and {tuple(values.shape)} (multi-head latent attention, "
                                 f"say): decode it eagerly, without --capture")
            b, h, _, d = keys.shape
            self.slab = keys.new_zeros(len(self.layers), 2, b, h, self.slots, d)
            self.lengths = self.lengths.to(keys.device)
        return self.slab

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every layer, on the device (a negative
        count, as transformers' crop)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.lengths.sub_(-tokens_to_remove)

    def gather(self, start: int, index: torch.Tensor) -> None:
        """Write slots ``index`` (a (n,) long tensor on the slab's device) of every layer to slots
        ``start..start+n``, in one gather and one copy."""
        self.slab[..., start: start + index.numel(), :] = self.slab.index_select(-2, index)

    def _refused(self, *args, **kwargs):
        # transformers' versions assign each layer a new keys / values tensor: the layer would then
        # read a copy while crops, compaction and the captured graphs go on writing the slab
        raise NotImplementedError("a StaticSlabCache holds one sequence in one slab: reordering, repeating, "
                                  "selecting or offloading its batch is not supported")

    reorder_cache = batch_repeat_interleave = batch_select_indices = offload = prefetch = _refused


def one_slab(trunk: torch.nn.Module) -> bool:
    """Whether a slab (:class:`SlabCache`, :class:`StaticSlabCache`) can hold ``trunk``'s cache:
    every parameter on one device, and every decoder layer's attention with parameters of the same
    names and shapes, so that each caches keys (and values) of one shape. Gemma 4's full-attention
    layers have other head dims than its sliding ones; a model spread over devices has layers on
    several."""
    if len({p.device for p in trunk.parameters()}) != 1:
        return False
    kinds = {tuple((name, p.shape) for name, p in getattr(layer, "self_attn", layer).named_parameters())
             for layer in getattr(trunk, "layers", ())}  # GPT-2's blocks are .h: AR decodes it, SPACE does not
    return len(kinds) <= 1


def eager_cache(trunk: torch.nn.Module, slots: int) -> Cache:
    """The cache an eager decode step runs on: a :class:`SlabCache` of ``slots`` where one slab
    holds it (:func:`one_slab`; ``trunk`` is the decoder module, with its ``layers``), else
    :func:`full_cache`, a tensor per layer."""
    return SlabCache(len(trunk.layers), slots) if one_slab(trunk) else full_cache()


def attention_windows(config) -> dict[str, int | None]:
    """The model's kinds of attention layer, ``{layer type: sliding window in tokens, or None}``.

    ``{"full_attention": None}`` for a model without a sliding window (Llama); Mistral with
    ``sliding_window`` set slides on every layer, even where its config lists ``layer_types``
    (Ministral-8B), which its forward does not read; Qwen2 with ``use_sliding_window`` lists its kinds
    in ``config.layer_types`` (``max_window_layers``). A query at position p sees a key at
    position p' only when ``p - p' < window``, as transformers' ``sliding_window_overlay``.

    Raises:
        ValueError: a layer type other than full or sliding attention (chunked attention, ...).
    """
    if hasattr(config, "get_text_config"):  # a multimodal model's (Gemma 3 4B+) windows are its text model's
        config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    listed = getattr(config, "layer_types", None) or []
    unknown = sorted(set(listed) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"SPACE (SAR-SFT, the probe and decoding) supports full and sliding-window attention layers, "
                         f"this model has {unknown}")
    types = (listed if reads_layer_types(config) else None) or [FULL if window is None else SLIDING]
    return {kind: window if kind == SLIDING else None for kind in dict.fromkeys(types)}


def reads_layer_types(config) -> bool:
    """Whether the model reads ``config.layer_types``: where its config class declares the field.
    A class that does not keeps a listed one unread: Mistral slides on every layer whatever
    Ministral-8B's config lists (transformers warns), and its forward takes one mask. A config that
    is no dataclass (transformers before its dataclass configs) is taken at its word."""
    return not dataclasses.is_dataclass(config) or "layer_types" in {f.name for f in dataclasses.fields(config)}


def sliding_cache(config) -> DynamicCache:
    """transformers' own cache for a sliding-window model, its layers sliding as the model's
    forward slides (``DynamicCache(config=...)`` keeps an unread ``layer_types`` list's full layers,
    and the forward's sliding masks then stop fitting past the window)."""
    text = config.get_text_config(decoder=True)
    if getattr(text, "layer_types", None) is not None and not reads_layer_types(text):
        text = copy.copy(text)
        text.layer_types = [FULL if text.sliding_window is None else SLIDING] * text.num_hidden_layers
    return DynamicCache(config=text)


def longrope_switch(config) -> int | None:
    """Where a LongRoPE model (Phi-3/3.5-mini-128k, Phi-4-mini, any config with ``rope_type="longrope"``)
    switches from its short to its long rotary factors, or None for any other RoPE.

    transformers picks the factors once per forward, from the largest position id in it: long when
    ``max(position_ids) + 1 > original_max_position_embeddings``, for every row of that forward. AR's
    step holds one row, so the token after a sequence of n tokens is scored with the short factors
    while n <= this value; a SPACE block also holds candidates and mask rows further ahead, which
    would switch every row of the block, the verification rows included, earlier than AR does.
    (``dynamic`` NTK scaling grows only past ``max_position_embeddings``, which no step reaches.)

    Returns:
        ``original_max_position_embeddings`` of the longrope entry (the smallest, per layer kind), or None.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return None
    entries = list(params.values()) if params and all(isinstance(v, dict) for v in params.values()) else [params]
    found = [e.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
             for e in entries if (e.get("rope_type") or e.get("type")) == "longrope"]
    found = [int(f) for f in found if f]
    return min(found) if found else None


# model types whose generate() recomputes the whole KV cache the first time the sequence passes
# config.original_max_position_embeddings (transformers' prepare_inputs_for_generation of Phi-3,
# PhiMoE and Phi-4-multimodal), so that every cached key holds the long LongRoPE factors from then on
REBUILD_AT_SWITCH = ("phi3", "phimoe", "phi4_multimodal")


def cache_rebuild_at(config) -> int | None:
    """The cache length at which transformers' generate drops the cache of this model and
    forwards the whole sequence again (:data:`REBUILD_AT_SWITCH`), or None. AR and SPACE decoding
    do the same there, so their tokens stay ``generate``'s past the LongRoPE switch."""
    if getattr(config, "model_type", None) not in REBUILD_AT_SWITCH:
        return None
    at = getattr(config, "original_max_position_embeddings", None)
    return int(at) if at else None


def refuse_sliding_window(config, what: str, length: int) -> None:
    """Refuse a sliding-window model where ``what`` keeps transformers' plain 4-D masks without the
    window (the step-cost curve) and its sequences reach ``length`` tokens: shorter ones never reach
    past the window. SAR-SFT, the acceptance probe and decoding apply the window in their masks.

    Raises:
        ValueError: the model slides over at most ``length`` tokens, naming its window.
    """
    windows = [w for w in attention_windows(config).values() if w is not None]
    # a window-w cache keeps w - 1 past tokens: a length of w already loses one
    if windows and length >= min(windows):
        raise ValueError(f"{what} does not apply a sliding window (this model slides over {min(windows)} tokens, "
                         f"sequences here reach {length}); SPACE decoding and space-eval do")


def attention_dtype(decoder) -> torch.dtype:
    """The dtype attention computes in, which the step's additive 4-D mask must have (SDPA takes a
    float mask only in the query's dtype): that of the first floating-point parameter of the first
    decoder layer's attention, else of the input embedding. Not the LM head's, which is often kept
    in fp32 under a bf16 / fp16 trunk."""
    layers = getattr(decoder, "layers", None)
    first = layers[0] if layers is not None and len(layers) else None
    attn = getattr(first, "self_attn", first)
    for module in (attn, decoder.get_input_embeddings()):
        for p in module.parameters() if module is not None else ():
            if p.is_floating_point():
                return p.dtype
    return torch.get_default_dtype()
