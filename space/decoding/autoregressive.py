"""The fair baseline: a plain cached AR loop with the same conventions as the SPACE decoder."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch

from .cache import (SlabCache, attention_dtype, attention_windows, cache_input, cache_rebuild_at, crop_cache, one_slab,
                    sliding_cache, static_cache as preallocated)
from .compiled import eager, is_compiled
from .decoder import mask_slots, with_cache
from .result import DecodeResult, check_prompt, clock
from .sampling import SamplingConfig, check_sampling, logit_transform, logits_to_probs, sample


@torch.inference_mode()
def ar_generate(model, input_ids, max_new_tokens: int = 256, sampling: SamplingConfig = SamplingConfig(),
                stop_token_ids: Iterable[int] | int = (), suppress_ids: Iterable[int] = (),
                on_tokens: Callable[[list[int]], None] | None = None,
                logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                static_cache: bool | None = None, graphs=None) -> DecodeResult:
    """Greedy or sampled generation, one token per forward pass, LM head on 1 row.

    Args:
        model: a HF causal LM.
        input_ids: (seq,) or (1, seq) prompt ids.
        max_new_tokens: most tokens to generate.
        sampling: greedy when temperature is 0.
        stop_token_ids: generation ends after the first of these.
        suppress_ids: ids never emitted (the mask tokens).
        on_tokens: streaming callback, called with each step's new tokens.
        logits_processor: HF convention ``(input_ids (1, seq), scores (1, vocab)) -> scores``,
            applied to each step's logits with every token so far.
        static_cache: a preallocated KV cache of prompt + max_new_tokens slots
            (``cache.static_cache``: one shape per step, for a compiled trunk); False: a growing
            one, ``cache.SlabCache`` as ``SpaceDecoder``'s on one device (a step writes its token
            in place where ``DynamicCache`` concatenates the whole cache in every layer), else
            (a device map, a sliding window) transformers' ``DynamicCache``; None: static when the
            trunk is compiled (``compiled.compile_trunk``), as ``SpaceDecoder`` decides.
        graphs: run each step's trunk through captured steps (``graphs.StepGraphs``: a CUDA
            graph of one row on a GPU), over their static cache, the LM head after it, as
            ``SpaceDecoder(graphs=...)`` does. None: the model's forward.

    Raises:
        ValueError: see ``check_prompt``; a prompt and max_new_tokens that overflow ``graphs``'s cache;
            ``graphs`` captured from another model.
        TypeError: ``sampling`` that is not a SamplingConfig; ``stop_token_ids`` given as text or
            holding non-integers (``result.DecodeResult``).
    """
    check_sampling(sampling)
    ids = check_prompt(input_ids, max_new_tokens, model.config.max_position_embeddings,
                       model.get_output_embeddings().weight.shape[0])
    device = model.device
    res = DecodeResult(ids.numel(), max_new_tokens, stop_token_ids, on_tokens)
    suppress = torch.tensor(list(suppress_ids), dtype=torch.long, device=device)
    gen = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
    slots = ids.numel() + max_new_tokens
    static = False  # the preallocated cache's steps pass their own mask (below)
    if graphs is not None:
        graphs.check_model(model)
        graphs.check_fits(slots, 1)
        graphs.reset()
        cache, head, transform = graphs.cache, model.get_output_embeddings(), logit_transform(model.config)
    elif is_compiled(model) if static_cache is None else static_cache:
        cache = preallocated(model.config.num_hidden_layers, slots)
        # each step's 4-D mask and position, as SpaceDecoder passes them: transformers' own mask
        # reads the slot count as a Python int, so a compiled step held it fixed, a graph per prompt length
        static, windows = True, attention_windows(model.config)
        # in the trunk's dtype, as SpaceDecoder's mask (not model.dtype: a bf16 frozen-base model's
        # first parameter is its fp32 mask rows)
        one_row = torch.zeros(1, 1, 1, 1, dtype=attention_dtype(model.get_decoder()), device=device)
        row_pos = torch.zeros(1, dtype=torch.long, device=device)
    elif one_slab(model.get_decoder()) and set(attention_windows(model.config).values()) == {None}:
        cache = SlabCache(model.config.num_hidden_layers, slots)
    else:  # a sliding window needs transformers' own sliding layers here (AR builds no mask of its own)
        cache = sliding_cache(model.config)
    step_in, seen, cached = ids[None].to(device), None, 0  # seen: every token so far, for logits_processor
    # transformers' generate of a Phi-3 forwards the whole sequence again once the cache holds this many
    # tokens (LongRoPE's switch, cache.cache_rebuild_at), as here
    rebuild_at = cache_rebuild_at(model.config)
    rebuild_at = rebuild_at if rebuild_at is not None and ids.numel() <= rebuild_at else None
    while True:
        t0 = clock(device)
        if cached == rebuild_at:
            crop_cache(cache, 0, cached)
            step_in, seen, cached = torch.tensor([ids.tolist() + res.new_ids], device=device), None, 0
        if graphs is not None and step_in.shape[1] == 1:  # a captured step, then the head on its row
            logits = head(graphs.step(step_in[0], None, None, cached, None))  # (1, vocab)
            if transform is not None:  # what the model's own forward does after its head (Gemma 2's soft-capping, ...)
                logits = transform(logits)
        else:
            step = ({"position_ids": torch.full((1, 1), cached, device=device),
                     "attention_mask": with_cache(one_row, row_pos, cached, windows, mask_slots(model, slots))}
                    if static and step_in.shape[1] == 1 else {})
            with eager() if step_in.shape[1] > 1 else nullcontext():  # the prompt: as SpaceDecoder's prefill
                logits = model(input_ids=step_in, **step, **cache_input(cache), use_cache=True,
                               logits_to_keep=1).logits[0]  # (1, vocab)
        cached += step_in.shape[1]  # tokens in the cache, counted on the host
        if suppress.numel():  # index_fill_, not logits[:, ids] = -inf: on CUDA that uploads the scalar (a sync)
            logits.index_fill_(1, suppress, float("-inf"))
        if logits_processor is not None:
            seen = step_in[0] if seen is None else torch.cat([seen, step_in[0]])
            logits = logits_processor(seen[None], logits)
        token = logits.argmax(-1) if sampling.greedy else sample(logits_to_probs(logits, sampling), gen)
        if res.emit(token.tolist(), clock(device) - t0):  # the step's one host copy
            return res
        step_in = token.view(1, 1)
