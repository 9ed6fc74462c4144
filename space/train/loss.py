"""The SAR-SFT loss (DESIGN §3.2): CE(AR rows) + lambda * CE(mask rows), each averaged over its rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masking import IGNORE_INDEX


def space_loss(logits: torch.Tensor, labels: torch.Tensor, mask_offset: torch.Tensor, weight: float,
               mask_num: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss and metrics of a SAR-SFT batch.

    Args:
        logits: (batch, rows, vocab).
        labels: (batch, rows) per-row targets, already aligned (no shift), IGNORE_INDEX = none.
        mask_offset: (batch, rows) offset j of mask rows, -1 on real rows.
        weight: lambda, the mask-loss weight (a float, unlike the official code's int cast).
        mask_num: k, for the per-offset accuracy.

    Returns:
        (loss, metrics): metrics has ``ar_loss`` (when the batch has AR rows), ``mask_loss`` and
        ``mask_acc_{j}`` = top-1 accuracy of mask offset j, the predictor of acceptance, plus the
        row counts used to average them across steps.
    """
    valid = labels != IGNORE_INDEX
    is_mask = mask_offset >= 0
    metrics: dict[str, float] = {}
    loss = logits.new_zeros(())
    ar_rows, mask_rows = valid & ~is_mask, valid & is_mask
    if ar_rows.any():
        ar = F.cross_entropy(logits[ar_rows].float(), labels[ar_rows])
        loss = loss + ar
        metrics["ar_loss"] = ar.item()
    if mask_rows.any():
        mask_logits, mask_labels = logits[mask_rows].float(), labels[mask_rows]
        ml = F.cross_entropy(mask_logits, mask_labels)
        loss = loss + weight * ml
        metrics["mask_loss"] = ml.item()
        hit = mask_logits.argmax(-1) == mask_labels
        offsets = mask_offset[mask_rows]
        for j in range(mask_num):
            sel = offsets == j
            if sel.any():
                metrics[f"mask_acc_{j}"] = hit[sel].float().mean().item()
    else:
        loss = loss + logits.sum() * 0.0  # keep the graph: a batch with no mask row still steps
    return loss, metrics
