"""The SAR-SFT loss (DESIGN §3.2): CE(AR rows) + lambda * CE(mask rows), each averaged over its rows.

Mask rows learn either the next tokens (``mask_target: token``, the paper) or the frozen base's
own distribution (``teacher``): mask j anchored at e gets the base's top-K softmax at real row
e+j, the row whose LM head predicts the same token e+j+1 (DESIGN §3.1, §3.6). The teacher's soft
cross-entropy with a one-hot top-1 teacher equals the token loss.

Two acceptance-aware options (issue 30) train for accept length rather than per-offset accuracy:

* **chain weighting** (PARD-2's idea): mask j's loss is weighted by the probability that a chain
  of drafts reaches offset j, the product of the probabilities of the true tokens at offsets
  0..j-1 of its group (the teacher's, or the model's own, detached: :func:`chain_weights`);
  ``chain_weight`` alpha mixes it in, ``(1 - alpha) + alpha * chain``, so alpha = 0 is the plain loss;
* **hidden-state consistency** (the latent consistency loss of Samragh et al. 2025, arXiv
  2507.11851): mask j anchored at e is pulled towards the frozen base's last hidden state at real
  row e+j, which the frozen-base no-grad pass already computes (:func:`consistency_loss`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masking import IGNORE_INDEX


def soft_cross_entropy(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Per-row soft CE against a sparse teacher: -sum_i p_i log softmax(logits)[id_i].

    Args:
        logits: (rows, vocab) student logits.
        teacher_ids: (rows, K) token ids of the teacher's top K.
        teacher_probs: (rows, K) their probabilities (each row sums to 1).

    Returns:
        (rows,) losses.
    """
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, teacher_ids)  # (rows, K)
    return -(teacher_probs * logp).sum(-1)


def offset_hits(logits: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor, mask_num: int):
    """Top-1 hits of mask rows against their token labels, per offset j.

    Args:
        logits: (rows, vocab); labels, offsets: (rows,) of valid mask rows.

    Returns:
        (hits (mask_num,), rows (mask_num,)) float tensors.
    """
    hit = (logits.argmax(-1) == labels).float()
    sel = F.one_hot(offsets.clamp(max=mask_num - 1), mask_num).float() * (offsets < mask_num)[:, None]
    return hit @ sel, sel.sum(0)


def space_loss(logits: torch.Tensor, labels: torch.Tensor, mask_offset: torch.Tensor, weight: float,
               mask_num: int, teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
               mask_rows_total: int | torch.Tensor | None = None, chain_weight: float = 0.0,
               ar_rows_total: int | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss, and the sums and counts its metrics come from, of a SAR-SFT batch (or one chunk of
    its mask rows). Reads nothing back to the host: the sums stay on the device until the log step
    adds them up (``space.train.metrics``, STYLE item 20).

    Args:
        logits: (batch, rows, vocab).
        labels: (batch, rows) per-row targets, already aligned (no shift), IGNORE_INDEX = none.
        mask_offset: (batch, rows) offset j of mask rows, -1 on real rows.
        weight: lambda, the mask-loss weight (a float, unlike the official code's int cast).
        mask_num: k, for the per-offset accuracy.
        teacher: None (token targets), or (ids, probs), each (batch, rows, K): the soft target of
            every row (read on valid mask rows only).
        mask_rows_total: divide the mask loss by this many rows instead of this call's count (a
            chunk of the batch's mask rows, or a micro-batch of an optimizer step: the parts'
            losses then add up to the whole's).
        ar_rows_total: the same for the AR loss.
        chain_weight: alpha in [0, 1]: weight each mask row's loss by ``(1 - alpha) + alpha *
            chain`` (:func:`chain_weights`, from the teacher's probabilities of the true tokens when
            there is a teacher, else the model's own, detached). Groups must be whole in ``rows``.

    Returns:
        (loss, stats): the loss is CE(AR rows) summed over them / ``ar_rows_total`` (else their
        count) + lambda * the mask loss summed / ``mask_rows_total`` (else the mask rows' count). ``stats`` holds detached float
        tensors on the logits' device, the same keys for every batch of a run: ``ar_loss_sum``,
        ``ar_rows``, ``mask_loss_sum`` (the loss optimized on mask rows: token CE or teacher soft
        CE, chain-weighted), ``mask_rows``, ``mask_hits`` and ``mask_offset_rows`` ((mask_num,)
        top-1 hits against the token label and rows per offset j, the predictor of acceptance),
        with a teacher ``mask_token_ce_sum``, with chain weighting ``chain_weight_sum``.
    """
    valid = labels != IGNORE_INDEX
    is_mask = mask_offset >= 0
    ar_rows, mask_rows = valid & ~is_mask, valid & is_mask
    ar_ce = F.cross_entropy(logits[ar_rows].float(), labels[ar_rows], reduction="sum")  # 0 for no row
    n_ar = ar_rows.sum().float()
    loss = ar_ce / _at_least_one(n_ar if ar_rows_total is None else ar_rows_total)
    mask_logits, mask_labels = logits[mask_rows].float(), labels[mask_rows]
    token_ce = F.cross_entropy(mask_logits, mask_labels, reduction="none")  # (rows,)
    per_row = token_ce if teacher is None else soft_cross_entropy(mask_logits, teacher[0][mask_rows], teacher[1][mask_rows])
    stats = {}
    if chain_weight:
        p_true = torch.zeros(labels.shape, device=logits.device)
        p_true[mask_rows] = (true_token_prob(mask_logits, mask_labels) if teacher is None
                             else ((teacher[0][mask_rows] == mask_labels[:, None]) * teacher[1][mask_rows]).sum(-1))
        chain = chain_weights(p_true, mask_offset)[mask_rows]
        per_row = per_row * ((1 - chain_weight) + chain_weight * chain)
        stats["chain_weight_sum"] = chain.sum()
    n_mask = mask_rows.sum().float()
    # an empty selection keeps the graph: a batch without a scored row steps with zero gradients
    loss = loss + weight * per_row.sum() / _at_least_one(n_mask if mask_rows_total is None else mask_rows_total)
    hits, rows = offset_hits(mask_logits, mask_labels, mask_offset[mask_rows], mask_num)
    stats.update(ar_loss_sum=ar_ce, ar_rows=n_ar, mask_loss_sum=per_row.sum(), mask_rows=n_mask,
                 mask_hits=hits, mask_offset_rows=rows)
    if teacher is not None:
        stats["mask_token_ce_sum"] = token_ce.sum()
    return loss, {k: v.detach().float() for k, v in stats.items()}


def _at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    """A row count as a divisor (no rows: a zero sum stays zero), on the device for a tensor."""
    return count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)


@torch.no_grad()
def true_token_prob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own probability of the true token, without gradient: (rows, vocab), (rows,) -> (rows,)."""
    return torch.softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


@torch.no_grad()
def chain_weights(p_true: torch.Tensor, mask_offset: torch.Tensor) -> torch.Tensor:
    """The probability that a chain of drafts reaches each mask row: 1 at offset 0, and at offset j
    the product of ``p_true`` at offsets 0..j-1 of the same group (without gradient).

    Args:
        p_true: (batch, rows) probability of each row's true token (0 where a row has no target,
            which stops the chain there).
        mask_offset: (batch, rows) offset j of mask rows, -1 on real rows; a group is a run of
            rows with offsets 0, 1, .., g-1 (``space.masking``'s layout).

    Returns:
        (batch, rows) weights in [0, 1], 0 on real rows.
    """
    is_mask = mask_offset >= 0
    logp = torch.where(is_mask, p_true.float().clamp_min(1e-30).log(), 0.0)
    before = logp.cumsum(-1) - logp  # sum of log p over every earlier row
    cols = torch.arange(mask_offset.shape[-1], device=mask_offset.device).expand_as(mask_offset)
    start = torch.where(mask_offset == 0, cols, 0).cummax(-1).values  # column of the row's group start
    return torch.where(is_mask, (before - before.gather(-1, start)).exp(), 0.0)


def consistency_loss(mask_hidden: torch.Tensor, base_hidden: torch.Tensor) -> torch.Tensor:
    """Mean squared distance between mask rows' last hidden states and the frozen base's, per
    hidden unit: (rows, hidden), (rows, hidden) -> scalar (0 when they are equal; the base's
    side takes no gradient)."""
    return (mask_hidden.float() - base_hidden.detach().float()).pow(2).mean()


@torch.no_grad()
def teacher_targets(head, hidden: torch.Tensor, inputs: dict, topk: int, suppress_ids=(),
                    rows_per_call: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen base's top-K distribution for every scored mask row of a two-pass batch.

    Mask j anchored at e sits at position e+j, and real row e+j is the row whose LM head predicts
    the mask's target e+j+1, so the teacher of a mask row is the head at the real row given by
    its position id (cache_len 0: position = real row; efficient layout only).

    Args:
        head: the base's LM head, (batch, hidden) -> (batch, vocab).
        hidden: (batch, T, hidden) last hidden states of the real rows (the no-grad pass).
        inputs: the SpaceCollator batch (``num_real`` = T, mask columns T:).
        topk: K; the teacher is the softmax over the base's top-K logits (renormalized over K).
        suppress_ids: tokens the teacher never proposes (the mask tokens).
        rows_per_call: LM-head rows per call, which bounds the (rows, vocab) logits in memory.

    Returns:
        (ids, probs), each (batch, M, K) for the M mask columns; zero on unscored rows.

    Raises:
        ValueError: a teacher row outside the real rows (the truncate layout has none for j >= 1).
    """
    T = inputs["num_real"]
    labels, offsets, pos = (inputs[key][:, T:] for key in ("labels", "mask_offset", "position_ids"))
    b, m = ((labels != IGNORE_INDEX) & (offsets >= 0)).nonzero(as_tuple=True)  # (N,) scored mask rows
    src = pos[b, m]  # (N,) real row e+j
    if src.numel() and int(src.max()) >= T:
        raise ValueError("teacher targets need every mask row's real row e+j in the sample (efficient layout)")
    ids = torch.zeros(*labels.shape, topk, dtype=torch.long, device=labels.device)
    probs = torch.zeros(*labels.shape, topk, dtype=torch.float32, device=labels.device)
    for start in range(0, src.numel(), rows_per_call):
        sl = slice(start, start + rows_per_call)
        logits = head(hidden[b[sl], src[sl]]).float()  # (rows, vocab)
        logits[:, list(suppress_ids)] = float("-inf")
        top, idx = logits.topk(topk, dim=-1)  # (rows, K)
        ids[b[sl], m[sl]], probs[b[sl], m[sl]] = idx, torch.softmax(top, dim=-1)
    return ids, probs
