"""The per-batch SAR-SFT step (DESIGN §3.2, §3.6): the one forward path that the trainer, the
tests and ``scripts/bench_train.py`` all call.

* one pass (``full``, ``lora``): the whole collator batch in one forward, real rows then mask
  rows (``mask_rows(T)``), loss on both;
* frozen-base: the real tokens once without gradients and without the adapter into a
  :class:`~space.train.prefix_cache.PrefixCache`, then only the mask rows with gradients, chunk by
  chunk (``mask_chunk_rows``). Exact, since real tokens never see masks and the frozen base's
  real-token states do not depend on the trainable weights.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import SpaceSettings
from ..decoding.cache import attention_windows, cache_input
from ..decoding.decoder import check_attention
from ..decoding.sampling import logit_transform
from ..masking import IGNORE_INDEX, mask_rows, previous_ids, to_additive_4d, windowed
from ..sampler_head import sampler_head
from .loss import consistency_loss, space_loss, teacher_targets
from .prefix_cache import PrefixCache


@dataclass
class Step:
    """What a step returns.

    Attributes:
        loss: scalar to back-propagate (frozen-base with several chunks: the last chunk's, plus
            the earlier chunks' detached losses, which the step already back-propagated).
        stats: sums and counts for the metrics (``space_loss``'s, plus ``consistency_sum``),
            detached, on the device.
        logits: (batch, rows, vocab) of the scored columns (frozen-base: the last chunk's mask rows).
        labels, mask_offset: (batch, rows) of the same columns.
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]
    logits: torch.Tensor
    labels: torch.Tensor
    mask_offset: torch.Tensor


def sar_step(model, inputs: dict, settings: SpaceSettings, unwrapped=None,
             backward: Callable[[torch.Tensor], None] | None = None, no_sync=nullcontext,
             totals: torch.Tensor | None = None) -> Step:
    """One SpaceCollator batch: the frozen-base step when ``settings.frozen_base``, else one pass.

    Args:
        model: what to call with gradients (the DeepSpeed/DDP wrapper when there is one).
        unwrapped: the (peft) model inside it; None: ``model`` itself.
        backward: frozen-base with several chunks: back-propagates every chunk but the last
            (default ``loss.backward()``; the trainer scales it for gradient accumulation).
        no_sync: a function of ``model`` returning the context those chunks run in (DDP's no_sync).
        totals: (2,) the scored (AR, mask) rows the losses are averaged over (:func:`scored_rows`
            of a whole optimizer step: its micro-batches' losses then add up to the step's mean);
            None: this batch's own.
    """
    if settings.frozen_base:
        return frozen_base_step(model, inputs, settings, unwrapped, backward, no_sync, totals)
    return one_pass_step(model, inputs, settings, unwrapped, totals)


def scored_rows(inputs: dict) -> torch.Tensor:
    """(2,) float counts of a batch's scored rows, (AR, mask), on the batch's device."""
    scored, is_mask = inputs["labels"] != IGNORE_INDEX, inputs["mask_offset"] >= 0
    return torch.stack([(scored & ~is_mask).sum(), (scored & is_mask).sum()]).float()


def one_pass_step(model, inputs: dict, settings: SpaceSettings, unwrapped=None,
                  totals: torch.Tensor | None = None) -> Step:
    """Real rows ``:T`` and mask rows ``T:`` in one forward (the gate matters to a frozen-base LoRA only)."""
    unwrapped = model if unwrapped is None else unwrapped
    labels, offsets, T = inputs["labels"], inputs["mask_offset"], inputs["num_real"]
    pos = inputs["position_ids"]
    with mask_rows(T):
        out = model(input_ids=inputs["input_ids"], position_ids=pos,
                    attention_mask=forward_mask(inputs["attention_mask"], unwrapped, pos, pos))
    ar_total, mask_total = (None, None) if totals is None else totals
    loss, stats = space_loss(out.logits, labels, offsets, settings.mask_loss_weight, settings.mask_num,
                             mask_rows_total=mask_total, chain_weight=settings.chain_weight, ar_rows_total=ar_total)
    return Step(loss, stats, out.logits, labels, offsets)


def frozen_base_step(model, inputs: dict, settings: SpaceSettings, unwrapped=None,
                     backward: Callable[[torch.Tensor], None] | None = None, no_sync=nullcontext,
                     totals: torch.Tensor | None = None) -> Step:
    """A no-grad real pass, then the mask rows chunk by chunk (arguments as :func:`sar_step`).

    Each chunk's mask loss is divided by the batch's scored mask rows (or ``totals[1]``), so the
    chunks add up to the unchunked loss and gradients; activation memory is bounded by one chunk.
    Every chunk but the last is back-propagated here (when gradients are on), the last one by the
    caller.
    """
    unwrapped = model if unwrapped is None else unwrapped
    backward = backward or (lambda loss: loss.backward())
    T = inputs["num_real"]
    labels, offsets = inputs["labels"][:, T:], inputs["mask_offset"][:, T:]
    cache, hidden = real_pass(unwrapped, inputs)
    teacher = None
    if settings.mask_target == "teacher":
        teacher = teacher_targets(causal_lm_head(unwrapped), hidden, inputs, settings.teacher_topk,
                                  settings.suppress_ids)
    chunks = mask_chunks(offsets, settings.mask_chunk_rows)
    scored = (labels != IGNORE_INDEX) & (offsets >= 0)  # (batch, M)
    total = scored.sum() if totals is None else totals[1]  # on the device: no read back
    early = torch.is_grad_enabled() and model.training and len(chunks) > 1
    done, stats = 0.0, {}
    for i, rows in enumerate(chunks):
        last = i == len(chunks) - 1
        # DDP: forward and backward of all but the last chunk inside no_sync (one all-reduce)
        with no_sync(model) if early and not last else nullcontext():
            out = mask_pass(model, unwrapped, inputs, cache, rows, hidden_states=settings.consistency_weight > 0)
            tch = None if teacher is None else (teacher[0][:, rows], teacher[1][:, rows])
            loss, chunk = space_loss(out.logits, labels[:, rows], offsets[:, rows], settings.mask_loss_weight,
                                     settings.mask_num, tch, total, settings.chain_weight)
            if settings.consistency_weight:
                c, n = mask_consistency(out.hidden_states[-1], hidden, inputs, rows), scored[:, rows].sum()
                loss = loss + settings.consistency_weight * c * n / total.clamp(min=1)
                chunk["consistency_sum"] = (c * n).detach()
            if early and not last:
                backward(loss)
        if not last:
            done = done + loss.detach()
        stats = {k: stats[k] + v if k in stats else v for k, v in chunk.items()}
    return Step(loss + done, stats, out.logits, labels[:, chunks[-1]], offsets[:, chunks[-1]])


def forward_mask(allowed: torch.Tensor, model, query_pos: torch.Tensor,
                 key_pos: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The collator's boolean 4-D mask (True: may attend) in the form ``model``'s attention takes.

    On a sliding-window model each sliding layer gets the mask with its window applied by
    position (``space.masking.windowed``), as a decode step's mask has it: transformers passes a
    4-D mask to attention as it is, so the window is SPACE's to apply. SDPA takes the mask as it
    is (its memory-efficient kernel accepts a boolean mask in bf16 too); eager attention adds the
    mask to its scores, so it gets an additive mask in the compute dtype (the autocast dtype under
    mixed precision, else the weights'). Flash attention takes no 4-D mask.

    Args:
        allowed: (batch, 1, q, kv) the rows' mask over the keys.
        query_pos: (batch, q) the rows' position ids; key_pos: (batch, kv) the keys'.

    Returns:
        the mask, or ``{layer type: mask}`` for a model that mixes full and sliding layers.

    Raises:
        ValueError: a flash-attention model; a layer type other than full or sliding attention.
    """
    check_attention(model, "SAR-SFT training")
    impl = str(getattr(model.config, "_attn_implementation", "sdpa"))
    if impl != "sdpa" and allowed.dtype == torch.bool:
        kind = allowed.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else model.get_input_embeddings().weight.dtype
        allowed = to_additive_4d(allowed, dtype)
    return windowed(allowed, query_pos, key_pos, attention_windows(model.config))


def causal_lm_head(unwrapped) -> Callable[[torch.Tensor], torch.Tensor]:
    """The base's LM head as its causal-LM forward applies it, (..., hidden) -> (..., vocab): the
    head, then the model's own logit scaling or soft-capping (``sampling.logit_transform``:
    Granite, Cohere, Gemma 2+), which the decoders apply to every row they score. The teacher's
    targets and the sampler head's logits are made through it: without it a Granite teacher was 8x
    sharper than the model (logits_scaling 8), a distribution no mask row can reach or decode."""
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    head, transform = base.get_output_embeddings(), logit_transform(base.config)
    return head if transform is None else (lambda hidden: transform(head(hidden)))


def real_pass(unwrapped, inputs: dict) -> tuple[PrefixCache, torch.Tensor]:
    """The real columns ``:T`` without gradients and without the adapter (the frozen base), in eval
    mode: a base with dropout (OPT, GPT-2, Phi-2) would otherwise give the masks a random draw of
    the cache they attend to and of the teacher's targets, not the clean base that decoding runs.

    Returns:
        (frozen KV cache of the T real tokens, last hidden states (batch, T, hidden)).
    """
    T = inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    # full layers, as decoding's cache (``decoding.cache.full_cache``): a sliding-window model's
    # sliding layers would keep only its last window of tokens, which the mask's keys would outrun
    cache = PrefixCache()
    decoder = unwrapped.get_base_model().get_decoder()
    training = decoder.training
    try:
        decoder.eval()
        with torch.no_grad(), unwrapped.disable_adapter():
            hidden = decoder(input_ids=ids[:, :T], position_ids=pos[:, :T],
                             attention_mask=forward_mask(attn[:, :, :T, :T], unwrapped, pos[:, :T], pos[:, :T]),
                             **cache_input(cache), use_cache=True).last_hidden_state
    finally:
        decoder.train(training)
    cache.frozen = True
    return cache, hidden


def mask_pass(model, unwrapped, inputs: dict, cache: PrefixCache, rows: slice, hidden_states: bool = False):
    """Mask columns ``T + rows`` with gradients, after the real tokens' cache.

    ``rows`` must hold whole groups: a mask row sees the real tokens and its own group only, so
    the rows of other chunks are left out of the attention mask's columns. The cache is frozen:
    every chunk sees the real tokens alone, and no graph links two chunks. ``hidden_states``: also
    return every layer's hidden states (the consistency loss reads the last). With a sampler head
    (``space.sampler_head``), the logits are the LM head of the sampler head's output, given each
    mask's last hidden state and the true token before its target (efficient layout:
    ``space.masking.previous_ids``).
    """
    T = inputs["num_real"]
    ids, pos, attn = inputs["input_ids"], inputs["position_ids"], inputs["attention_mask"]
    q = slice(T + rows.start, T + rows.stop)
    mask = forward_mask(torch.cat([attn[:, :, q, :T], attn[:, :, q, q]], dim=-1), unwrapped,  # (batch, 1, rows, T + rows)
                        pos[:, q], torch.cat([pos[:, :T], pos[:, q]], dim=-1))
    head = sampler_head(unwrapped)
    # with a sampler head the model's own LM head is skipped (no logits kept): the head's output feeds it
    skip = {} if head is None else {"logits_to_keep": torch.empty(0, dtype=torch.long, device=ids.device)}
    with mask_rows(0):  # every row of this pass is a mask row (or padding nobody sees)
        out = model(input_ids=ids[:, q], position_ids=pos[:, q], attention_mask=mask, **cache_input(cache),
                    use_cache=True, output_hidden_states=hidden_states or head is not None, **skip)
    if head is not None:  # teacher-forced: the true token before each mask's target (issue 34)
        prev = unwrapped.get_input_embeddings()(previous_ids(ids[:, :T], pos[:, q]))
        out.logits = causal_lm_head(unwrapped)(head(out.hidden_states[-1], prev))
    return out


def mask_consistency(mask_hidden: torch.Tensor, hidden: torch.Tensor, inputs: dict, rows: slice) -> torch.Tensor:
    """Consistency loss of a chunk's scored mask rows: mask j anchored at e against the base's last
    hidden state at real row e+j, the row given by its position id (efficient layout, as for the
    teacher targets).

    Args:
        mask_hidden: (batch, rows, hidden) last hidden states of the chunk's mask rows.
        hidden: (batch, T, hidden) the no-grad real pass's last hidden states.
    """
    T = inputs["num_real"]
    cols = slice(T + rows.start, T + rows.stop)
    scored = (inputs["labels"][:, cols] != IGNORE_INDEX) & (inputs["mask_offset"][:, cols] >= 0)
    b, m = scored.nonzero(as_tuple=True)
    if not b.numel():
        return mask_hidden.sum() * 0.0
    return consistency_loss(mask_hidden[b, m], hidden[b, inputs["position_ids"][:, cols][b, m]])


def mask_chunks(mask_offset: torch.Tensor, chunk_rows: int) -> list[slice]:
    """Slices of the M mask columns, whole groups each (groups sit at multiples of the group size).

    Args:
        mask_offset: (batch, M) offsets of the mask columns (a group's rows have offsets 0..g-1).
        chunk_rows: rows per chunk, rounded down to whole groups (at least one); 0 = one chunk.
    """
    M = mask_offset.shape[1]
    if chunk_rows <= 0 or M <= chunk_rows:
        return [slice(0, M)]
    group = int(mask_offset.max()) + 1
    step = max(group, chunk_rows // group * group)
    return [slice(s, min(s + step, M)) for s in range(0, M, step)]
