"""SPACE inside HF ``generate()`` and ``pipeline``: a ``custom_generate`` decoding loop.

Two ways in (transformers 5.x):

* ``model.generate(**inputs, custom_generate=space_generate, mask_num=3, max_new_tokens=64)``:
  transformers prepares the generation config, logits processors and stopping criteria, then calls
  :func:`space_generate` instead of its own greedy / sampling loop.
* ``model.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, ...)``: the
  repo's ``custom_generate/generate.py`` re-exports :func:`generate`, which receives every argument
  of ``generate`` and goes the first way.

What is honoured: max_new_tokens / max_length, EOS ids, stopping criteria (stop strings, max_time,
custom ones: checked after every emitted token, so generation ends exactly where HF's loop ends;
``stop_strings=..., tokenizer=...`` through :func:`generate` only: transformers drops the tokenizer
given with a callable ``custom_generate`` and fails before calling it),
the streamer, and logits processors (but ``prefix_allowed_tokens_fn``'s, which asks per batch row:
it is refused). Processors (with sampling, HF's temperature / top-k / top-p
warpers among them; greedy or not) are applied once, by ``SpaceDecoder``, to every verification row
with the row's own prefix and to the draft rows, and sampling then draws from softmax(processed
scores) as HF does: in fp32, greedy output equals plain ``generate`` token for token and sampled
output has its distribution. A verification step scores several rows in one forward, whose
rounding differs from one-row AR steps (about 1e-7 of a logit in fp32, far more in bf16 / fp16),
so a near-tie closer than that can flip a token: in fp32 no run here has met one.
The mask tokens are never emitted (nor by plain ``generate``: ``space.tokens.suppress_in_generate``).
Sampling is seeded from torch's global RNG, so ``torch.manual_seed`` makes a call reproducible, as
with plain ``generate``.

SPACE settings (``mask_num``, ``num_groups``, ``lookup_tokens``, ``tree``) come from the keyword
arguments of ``generate``, else from the generation config (``GenerationConfig(mask_num=2)``, also
the model's ``generation_config.json``), else from the model's recorded layout.

A batch is decoded row by row (SPACE is batch-1), with a warning; each row samples with a seed of
its own, and ``max_time`` is split evenly over the rows (each share from its row's start), so
the call still ends within it. Each row's processors and
stopping criteria see the row as HF's batched loop holds it, left padding included, so
length-dependent ones (``min_length``, ``min_new_tokens``, ``forced_eos_token_id``,
``exponential_decay_length_penalty``) fire at the same step; rows are then right-padded with
``pad_token_id`` as HF pads finished rows. Without an EOS criterion HF pads none: a row whose
criteria are met decodes on until the last row stops, and so it does here (every row decodes past
its criteria, then all are cut where the last one stopped). A streamer takes one prompt (a batch
is refused).

Near the end of the context, where plain ``generate`` warns and goes on past the model's
``max_position_embeddings``, SPACE warns and stops each row at the context.

On CPU, load with ``load_space(..., kernels="fast")``: plain ``generate`` and SPACE then both use
the faster of MKL's stock and packed GEMM per row count, SPACE's many-row steps cost little more than one-row
steps, and a dynamic tree is priced by the adapter's step-cost curve for those kernels.
Flash attention takes no 4-D mask: models loaded with it are refused (use ``sdpa``).
"""
from __future__ import annotations

import inspect
import sys
import warnings
from copy import deepcopy
from dataclasses import dataclass

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import (LogitsProcessorList, PrefixConstrainedLogitsProcessor,
                                                   RepetitionPenaltyLogitsProcessor,
                                                   SuppressTokensLogitsProcessor, SynthIDTextWatermarkLogitsProcessor,
                                                   UnbatchedClassifierFreeGuidanceLogitsProcessor)
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                       StoppingCriteriaList, StopStringCriteria)
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from .decoding import DecodeConfig, SamplingConfig, SpaceDecoder
from .decoding.decoder import check_attention
from .decoding.result import DecodeResult, StopDecoding
from .decoding.tree import tree_flag
from .tokens import mask_spec

# model inputs a decoder-only text model gets from generate(); anything else (inputs_embeds,
# pixel_values, a filled cache, ...) is refused rather than silently ignored
# transformers 5.24 renamed the cache model input ``past_key_values`` to ``cache``; both are known
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "logits_to_keep",
                       "cache_position"}
_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__


@dataclass
class SpaceGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` with SPACE statistics, one list entry per batch row.

    Attributes:
        accept_lengths: per step, drafts accepted (0..k), bonus token not counted.
        step_tokens: per step, tokens emitted (1..k+1).
        tokens_per_step: new tokens / steps (target forward passes), first step counted.
        wall_time: generation time in s (prefill included).
    """

    accept_lengths: list[list[int]] | None = None
    step_tokens: list[list[int]] | None = None
    tokens_per_step: list[float] | None = None
    wall_time: list[float] | None = None


def space_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                   synced_gpus: bool = False, streamer=None, mask_num: int | None = None,
                   num_groups: int | None = None, lookup_tokens: int | None = None, tree=None, **model_kwargs):
    """The decoding loop for ``model.generate(..., custom_generate=space_generate)``.

    In fp32, greedy output equals plain ``generate`` token for token (multi-row verification
    rounds otherwise: a near-tie closer than that can flip, in bf16 / fp16 often); sampled output
    has plain ``generate``'s distribution.

    Args:
        model: a causal LM with SPACE mask tokens (``space.loader.load_space``).
        input_ids: (batch, seq) prompts, left-padded when batch > 1 (``attention_mask`` says where).
        logits_processor, stopping_criteria, generation_config: prepared by ``generate``.
        streamer: receives the new tokens as they are accepted, then ``end()`` (``generate`` has
            already put the prompt).
        mask_num, num_groups, lookup_tokens, tree: override the model's recorded decode layout
            (``DecodeConfig.of_model``); tree: ``"chain"``, ``"auto"``, ``"dynamic"`` or paths of ranks. Unset
            ones are read from ``generation_config`` when it has them.
        **model_kwargs: ``attention_mask`` and the cache ``generate`` prepared; nothing else.

    Returns:
        (batch, seq + new) LongTensor, or a :class:`SpaceGenerateOutput` when
        ``return_dict_in_generate`` (no scores, no cache).

    Warns:
        UserWarning: a batch (decoded row by row); prompt + max_new_tokens over the context (each
            row stops at the context, where plain ``generate`` would go on past it).

    Raises:
        ValueError: an unsupported option (named in the message), a flash-attention model, a model
            without mask tokens, a prompt that fills the whole context, right padding, a streamer
            with a batch (SPACE streams one row after another, HF a (batch,) tensor per step).
        Whatever it raises, the streamer is ended first: ``generate`` has put the prompt, and a
        ``TextIteratorStreamer`` reader would wait for the end forever.
    """
    outer = _generate_locals()  # why: see _generate_locals
    streamer = streamer if streamer is not None else outer.get("streamer")
    try:
        return _space_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus or _synced_gpus(model, outer.get("synced_gpus")), streamer,
                               outer.get("assistant_model"), (mask_num, num_groups, lookup_tokens, tree), model_kwargs)
    finally:
        if streamer is not None:
            streamer.end()


def _synced_gpus(model, given: bool | None) -> bool:
    """``generate``'s ``synced_gpus`` as it decides it when not given (ZeRO-3 or FSDP over several
    processes), which a callable ``custom_generate`` never receives (``_generate_locals``)."""
    if given is not None:
        return bool(given)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and world > 1


def _space_generate(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus: bool,
                    streamer, assistant_model, settings: tuple, model_kwargs: dict):
    """:func:`space_generate`'s loop; ``settings``: its (mask_num, num_groups, lookup_tokens, tree)."""
    mask_num, num_groups, lookup_tokens, tree = settings
    check_supported(generation_config, logits_processor, model_kwargs, assistant_model, synced_gpus)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_attention(base, "space_generate")
    spec = mask_spec(base)
    # generate() hands over its keyword arguments; GenerationConfig(mask_num=...) keeps them as attributes
    mask_num, num_groups, lookup_tokens, tree = (given if given is not None else getattr(generation_config, name, None)
                                                 for name, given in (("mask_num", mask_num), ("num_groups", num_groups),
                                                                     ("lookup_tokens", lookup_tokens), ("tree", tree)))
    layout = DecodeConfig.of_model(base, spec.mask_num).override(
        mask_num=mask_num, num_groups=num_groups, lookup_tokens=lookup_tokens, tree=tree_flag(tree, mask_num))
    decoder = SpaceDecoder(model, spec, layout)
    logits_processor = _without_mask_suppression(logits_processor, spec.token_ids)
    # the criteria generate hands over: a user's EosTokenCriteria / MaxLengthCriteria takes the place
    # of the one it would build from the config (ignored here, SPACE decoded past them); several stop
    # at the first one met, as HF's loop does
    eos_criteria = [c for c in stopping_criteria or [] if isinstance(c, EosTokenCriteria)]
    eos = generation_config._eos_token_tensor
    stop_ids = (sorted({int(i) for c in eos_criteria for i in c.eos_token_id.flatten().tolist()}) if eos_criteria
                else [] if eos is None else eos.flatten().tolist())
    lengths = [c.max_length for c in stopping_criteria or [] if isinstance(c, MaxLengthCriteria)]
    # HF's max_length counts the (padded) prompt; HF's loop emits at least one token
    max_new = max(1, min(lengths or [generation_config.max_length]) - input_ids.shape[1])
    rows = _prompt_rows(input_ids, model_kwargs.get("attention_mask"))
    check_positions(model_kwargs.get("position_ids"), rows, input_ids.shape[1])
    if len(rows) > 1 and streamer is not None:  # HF's own streamers refuse a batch when given the prompt
        raise ValueError(f"space_generate streams one prompt at a time: a streamer with a batch of {len(rows)} rows "
                         "would get each row's tokens after the other's, where generate gives it a (batch,) tensor a step")
    if len(rows) > 1:
        warnings.warn(f"space_generate decodes the {len(rows)} prompts of a batch one after another "
                      "(SPACE is batch-1)", stacklevel=3)
    room = _room(rows, max_new, decoder.context)
    # without an EOS criterion HF pads no row: one that met its criteria decodes on until the last row
    # stops, so each row decodes on past its criteria (its first stop recorded), all cut at the last
    # row's stop afterwards (a second decode of the row with a shorter budget planned other dynamic
    # trees, whose sampled draws differ)
    decode_on = len(rows) > 1 and not eos_criteria and eos is None
    results, stops = [], []
    for b, ids in enumerate(rows):
        sampling = SamplingConfig()
        if generation_config.do_sample:  # temperature/top-k/top-p are HF warpers among the processors
            # a seed per row: rows drawn with one seed were copies of each other for equal prompts
            sampling = SamplingConfig(temperature=1.0, seed=int(torch.randint(2**62, (1,))))
        pad = input_ids[b, : input_ids.shape[1] - len(ids)]  # the row's left padding
        met: list[int] = []
        watch = _watcher(input_ids[b].tolist(), _row_criteria(stopping_criteria, len(rows)), streamer,
                         input_ids.device, met if decode_on else None)
        results.append(decoder.generate(ids, min(max_new, room[b]), sampling, stop_ids, on_tokens=watch,
                                        logits_processor=_padded(logits_processor, pad, b)))
        stops.append(met[0] if met else len(results[-1].new_ids))
    lengths = [min(len(r.new_ids), max(stops)) for r in results] if decode_on else None
    sequences = _pad_outputs(input_ids, results, generation_config._pad_token_tensor, lengths)
    if not generation_config.return_dict_in_generate:
        return sequences
    return SpaceGenerateOutput(sequences=sequences, accept_lengths=[r.accept_lengths for r in results],
                               step_tokens=[r.step_tokens for r in results],
                               tokens_per_step=[r.tokens_per_step for r in results],
                               wall_time=[r.wall_time for r in results])


def generate(model, *args, stop_strings: str | list[str] | None = None, tokenizer=None, **kwargs):
    """``generate`` with SPACE, taking every argument of ``model.generate``: what a
    ``custom_generate/generate.py`` folder must define (``custom_generate="<repo>"``).

    It also makes ``stop_strings=..., tokenizer=...`` work: transformers does not hand the
    tokenizer to a callable ``custom_generate``, so the stop strings (given, in a passed
    ``GenerationConfig``, or in the model's own) become a ``StopStringCriteria`` here. Other arguments go to ``model.generate`` unchanged.

    Raises:
        ValueError: stop strings without a tokenizer, and whatever :func:`space_generate` raises.
    """
    kwargs.pop("custom_generate", None)
    config, own = kwargs.get("generation_config"), getattr(model, "generation_config", None)
    if config is not None and config.stop_strings is not None:  # move them out of the config too
        stop_strings = stop_strings or config.stop_strings
        kwargs["generation_config"] = config = deepcopy(config)
        config.stop_strings = None
    if own is not None and own.stop_strings is not None:
        # the model's own config: generate fills every unset field from it, so clear them as an argument
        stop_strings = stop_strings or own.stop_strings
        kwargs["stop_strings"] = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    return GenerationMixin.generate(model, *args, custom_generate=space_generate, **kwargs)


def check_supported(config, processors, model_kwargs: dict, assistant_model=None, synced_gpus=False) -> None:
    """Raise ValueError naming what SPACE cannot do: beam search and other modes, several
    sequences per prompt, assistants, per-step outputs, stateful guidance, a prefix constraint
    (``prefix_allowed_tokens_fn``), non-text inputs."""
    mode = config.get_generation_mode(assistant_model)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        what = {GenerationMode.ASSISTED_GENERATION: "assisted generation (assistant_model / prompt_lookup_num_tokens"
                                                    "; use mask_num / lookup_tokens instead)",
                GenerationMode.BEAM_SEARCH: f"beam search (num_beams={config.num_beams})",
                GenerationMode.BEAM_SAMPLE: f"beam sampling (num_beams={config.num_beams})"}.get(mode, mode.value)
        raise ValueError(f"space_generate does not support {what}: it replaces greedy search and sampling only")
    unsupported = [f"{name}=True" for name in ("output_scores", "output_logits", "output_attentions",
                                               "output_hidden_states") if getattr(config, name, False)]
    if (config.num_return_sequences or 1) > 1:
        unsupported.append(f"num_return_sequences={config.num_return_sequences} (one sequence per prompt)")
    if any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in processors or []):
        unsupported.append(f"guidance_scale={config.guidance_scale} (the guidance processor keeps a per-step cache)")
    if any(isinstance(p, SynthIDTextWatermarkLogitsProcessor) for p in processors or []):
        # it keeps state from call to call, one call per step: SPACE scores a step's rows in one call
        unsupported.append("a SynthID watermark (its processor keeps a state per generated token)")
    if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in processors or []):
        # it asks its function per batch row; SPACE scores each prompt's tree and draft rows as a batch of their own
        unsupported.append("prefix_allowed_tokens_fn (it takes the batch row of each scored row)")
    if synced_gpus:
        unsupported.append("synced_gpus=True")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        unsupported.append("a filled cache (past_key_values / cache: SPACE prefills its own)")
    others = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if others:
        unsupported.append(f"the model inputs {others} (text input_ids only)")
    if unsupported:
        raise ValueError(f"space_generate does not support {', '.join(unsupported)}")


def check_positions(position_ids: torch.Tensor | None, rows: list[torch.Tensor], width: int) -> None:
    """Refuse ``position_ids`` other than generate's own (each row's real tokens at 0, 1, ...):
    SPACE places every row itself, so other positions would be ignored, not honoured.

    Raises:
        ValueError: a row whose real tokens do not sit at positions 0..n-1.
    """
    if position_ids is None:
        return
    for b, ids in enumerate(rows):
        given = position_ids[min(b, position_ids.shape[0] - 1), width - len(ids):]
        if not torch.equal(given.cpu(), torch.arange(len(ids))):
            raise ValueError(f"space_generate does not support position_ids other than 0..n-1 over each row's "
                             f"tokens (row {b} has {given.tolist()[:8]}...): SPACE sets the positions itself")


def _row_criteria(criteria, num_rows: int) -> list:
    """The stopping criteria of one row of a batch decoded row by row, made when the row starts:
    ``max_time`` split evenly over the rows, each share from its row's start (one clock for the
    batch gave the first row all of it and each later row one token); the others as they are."""
    return [MaxTimeCriteria(c.max_time / num_rows) if isinstance(c, MaxTimeCriteria) else c for c in criteria or []]


def _room(rows: list[torch.Tensor], max_new: int, context: int) -> list[int]:
    """New tokens each row can get: ``max_new``, or fewer where the row would pass the model's
    context (positions count from the row's first real token, as with HF's left padding).

    Warns:
        UserWarning: some row stops at the context before ``max_new`` tokens.

    Raises:
        ValueError: a row that fills the whole context.
    """
    room = [min(max_new, context - len(ids)) for ids in rows]
    full = [b for b, r in enumerate(room) if r < 1]
    if full:
        raise ValueError(f"prompt row {full[0]} has {len(rows[full[0]])} tokens and the model context is {context}: "
                         "no room for a new token")
    if min(room) < max_new:
        warnings.warn(f"prompt + max_new_tokens ({max_new}) exceeds the model context {context}: space_generate stops "
                      f"at the context ({min(room)} new tokens for the longest prompt), where plain generate "
                      "would go on past it", stacklevel=4)
    return room


def _without_mask_suppression(processors, mask_ids: tuple[int, ...]):
    """``processors`` without the suppression of the mask tokens that ``space.tokens.suppress_in_generate``
    puts in a SPACE model's generation config: the decoder never emits them anyway, and any
    processor sends every step down the per-row path (the rows' contexts built on the host, one
    call per verification row). A suppression of other ids keeps them."""
    kept = LogitsProcessorList()
    for p in processors or []:
        if isinstance(p, SuppressTokensLogitsProcessor):
            ids = sorted(set(p.suppress_tokens.flatten().tolist()) - set(mask_ids))
            if not ids:
                continue
            p = SuppressTokensLogitsProcessor(ids, device=p.suppress_tokens.device)
        kept.append(p)
    return kept


def _padded(processors, pad: torch.Tensor, row: int = 0):
    """``processors`` fed the ids as HF's batched loop holds them: the row's left padding ``pad``
    (pad,) first, so length-dependent processors (``min_length``, ``forced_eos_token_id``, ...)
    count what HF counts. ``row``: the row's index in the batch. None when there are no processors."""
    if not processors:
        return None
    # a repetition penalty skipping a (batch,) tensor of ids per row (HF's own: the padding; a user's:
    # the prompt too) refuses ids of any other row count (SPACE scores a row's verification and draft
    # rows as a batch of their own): this row's value, as the int the processor also takes
    processors = LogitsProcessorList(
        RepetitionPenaltyLogitsProcessor(p.penalty, prompt_ignore_length=int(
            p.prompt_ignore_length.flatten()[row if p.prompt_ignore_length.numel() > 1 else 0]))
        if isinstance(p, RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor) else p
        for p in processors)
    if pad.numel() == 0:
        return processors

    def processor(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # ids (rows, seq)
        return processors(torch.cat([pad.to(ids.device).expand(ids.shape[0], -1), ids], dim=1), scores)

    return processor


def _generate_locals() -> dict:
    """The local variables of the ``GenerationMixin.generate`` call that called us, or {}.

    Why: transformers (5.x up to 5.23 at least) hands a callable ``custom_generate`` only the
    keyword arguments its signature adds to ``_sample``'s, so ``streamer``, ``assistant_model``
    and ``synced_gpus`` never reach it, although ``generate`` has already put the prompt into
    the streamer. They are still locals of that ``generate`` frame, two frames up.
    """
    frame = sys._getframe(2)
    try:
        for _ in range(3):
            if frame is None:
                break
            if frame.f_code is _GENERATE_CODE:
                return dict(frame.f_locals)
            frame = frame.f_back
        return {}
    finally:
        del frame  # frames reference their locals: do not keep a cycle alive


def _prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """(batch, seq) -> each row's real tokens (seq_b,), left padding removed.

    Raises:
        ValueError: a row whose attention mask is not one run of ones reaching the last column
            (holes, or right padding, which HF's own loop mis-decodes too).
    """
    if attention_mask is None:  # generate drops an all-ones mask
        return list(input_ids)
    rows = []
    for b, (ids, mask) in enumerate(zip(input_ids, attention_mask.bool())):
        where = mask.nonzero().flatten()
        if where.numel() and (where.numel() != int(where[-1] - where[0]) + 1 or int(where[-1]) != len(mask) - 1):
            raise ValueError(f"row {b} of attention_mask is not left padding (holes or right padding): "
                             "pad on the left only (tokenizer.padding_side = 'left')")
        rows.append(ids[mask])
    return rows


def _watcher(prompt: list[int], criteria, streamer, device: torch.device | str = "cpu", met: list | None = None):
    """The ``on_tokens`` callback of one row: checks the stopping criteria after every new token
    (HF's loop checks them after each token it appends) and streams the tokens it keeps.
    ``prompt``: the row as HF holds it, left padding included; ``device``: the input ids' (a
    criterion compares on the model's device, as in HF's loop); ``met``: given, the row decodes on
    past its criteria and the new-token count where they were first met is appended to it (only
    ``max_time`` still stops it).

    EOS and max length are left to the decoder, which cuts a step at them (``space_generate`` reads
    them from these criteria); only other criteria (stop strings, max_time, user ones) are
    evaluated, each on (1, seq) ids.
    """
    extra = [c for c in criteria or [] if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    seq = list(prompt)

    def on_tokens(tokens: list[int]) -> None:
        keep, stop = len(tokens), False
        for i, t in enumerate(tokens if extra else ()):
            seq.append(t)
            ids = torch.tensor([seq], device=device)  # (1, seq): criteria look at the tail they need
            # once met, a row that decodes on asks the clock alone
            asked = [c for c in extra if isinstance(c, MaxTimeCriteria)] if met else extra
            # a criterion may return a bool, as HF's StoppingCriteriaList broadcasts it
            hit = [c for c in asked if bool(torch.as_tensor(c(ids, None)).any())]
            if hit and met is not None and not met:
                met.append(len(seq) - len(prompt))
            if hit and (met is None or any(isinstance(c, MaxTimeCriteria) for c in hit)):
                keep, stop = i + 1, True  # HF keeps the token that met the criterion
                break
        if streamer is not None:
            streamer.put(torch.tensor(tokens[:keep]))
        if stop:
            raise StopDecoding(keep)

    return on_tokens


def _pad_outputs(input_ids: torch.Tensor, results: list[DecodeResult], pad: torch.Tensor | None,
                 lengths: list[int] | None = None) -> torch.Tensor:
    """Each row = its input row (padding kept) + new tokens (the first ``lengths[b]`` of row b's,
    None: all), right-padded to the longest, as HF pads finished rows. Returns (batch, seq + max
    new) on ``input_ids.device``."""
    new = [r.new_ids if lengths is None else r.new_ids[:n] for r, n in zip(results, lengths or results)]
    longest = max(map(len, new))
    if pad is None and any(len(ids) < longest for ids in new):
        raise ValueError("rows finished at different lengths and there is no pad_token_id to pad them with")
    fill = int(pad.flatten()[0]) if pad is not None else 0
    out = torch.full((input_ids.shape[0], input_ids.shape[1] + longest), fill, dtype=input_ids.dtype,
                     device=input_ids.device)
    out[:, : input_ids.shape[1]] = input_ids
    for b, ids in enumerate(new):
        out[b, input_ids.shape[1]: input_ids.shape[1] + len(ids)] = torch.tensor(ids, dtype=input_ids.dtype)
    return out
