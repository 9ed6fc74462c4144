"""The SAR-SFT collator (DESIGN §3.2): pad a batch and add mask groups via the layout core.

Batch layout, for both training passes: ``[real tokens, right-padded to T][mask rows, padded to M]``.
The frozen-base trainer runs columns ``:T`` without gradients into a KV cache and then the mask
rows ``T:`` with gradients; the other modes run the whole block in one forward pass.
A mask row's position id (e + j) is also the real row whose LM head predicts the same target
(e + j + 1): the frozen-base teacher (``mask_target: teacher``) reads the base's distribution there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..masking import IGNORE_INDEX, targets, train_layout, truncate_layout


@dataclass
class SpaceCollator:
    """Collate tokenized samples (``input_ids``, ``prompt_len``, ``idx``) into a SAR-SFT batch.

    Args (the paper's names):
        mask_ids: (1,) or (k,) mask token ids (``MaskSpec.ids_for(k)``).
        mask_num: k, masks per group.
        pad_id: id used for padding rows (never a target).
        mask_prob: probability that a sample gets mask groups this epoch (else AR loss only).
        spans_per_sample: G, mask groups per sample in the efficient layout.
        layout: "efficient" (default) or "truncate" (the paper's, one span, sample cut at it).
        seed: spans are drawn from (seed, epoch, sample idx): fresh every epoch, repeatable.
        span_density: dense supervision (efficient layout): when > 0, a sample with A eligible
            anchors (answer positions s with a target, see ``draw_spans``) gets
            ceil(span_density * A) groups instead of ``spans_per_sample``; 1.0 anchors a group at
            every answer position. 0 (default): off.

    Returns (``__call__``), with B samples, T real and M mask columns (M >= 1: a padding column when
    no sample drew a group, so the frozen-base mask pass always has a row):
        input_ids, position_ids, labels, mask_offset: (B, T+M) long; labels are per-row targets
        (already aligned, no shift), mask_offset is j on mask rows and -1 elsewhere;
        attention_mask: (B, 1, T+M, T+M) bool, True where a row may attend (each sample's layout
        ``allowed`` placed at its rows; padding rows see only themselves). Models that add the mask
        to the scores need ``masking.to_additive_4d(mask, dtype)``; SDPA takes the bool as is.
        num_real: T; num_short: samples with no room for a span (kept for the AR loss).
    """

    mask_ids: torch.Tensor
    mask_num: int
    pad_id: int
    mask_prob: float = 1.0
    spans_per_sample: int = 4
    layout: str = "efficient"
    seed: int = 0
    epoch: int = field(default=0)
    span_density: float = 0.0

    def __post_init__(self):
        if self.layout not in ("efficient", "truncate"):
            raise ValueError(f"layout must be 'efficient' or 'truncate', got {self.layout!r}")
        if self.mask_num < 1:
            raise ValueError(f"mask_num (k) must be >= 1, got {self.mask_num}")
        if not 0 <= self.mask_prob <= 1 or self.spans_per_sample < 1:
            raise ValueError("need 0 <= mask_prob <= 1 and spans_per_sample >= 1")
        if not 0 <= self.span_density <= 1:
            raise ValueError(f"span_density must lie in [0, 1] (0 = off, 1 = every answer position), got {self.span_density}")
        if self.span_density and self.layout != "efficient":
            raise ValueError("span_density needs the efficient layout (the truncate layout has one span per sample)")

    def draw_spans(self, length: int, prompt_len: int, idx: int) -> list[int]:
        """Span starts s for one sample: s in [max(prompt_len, 1), length-2], so mask 0's target
        x_{s+1} is a response token; [] when the sample is too short or loses the mask_prob draw."""
        # mod 2**64, the generator's seed range: unchanged below it, and a seed past about 1.8e7 (a
        # date such as 20240101) no longer overflows at the first batch
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + idx) % 2**64)
        lo, hi = max(prompt_len, 1), length - 2
        if hi < lo or torch.rand(1, generator=gen).item() >= self.mask_prob:
            return []
        if self.span_density:
            n = math.ceil(self.span_density * (hi - lo + 1))
        else:
            n = min(self.spans_per_sample if self.layout == "efficient" else 1, hi - lo + 1)
        return sorted((lo + torch.randperm(hi - lo + 1, generator=gen)[:n]).tolist())

    def __call__(self, features: list[dict]) -> dict:
        parts, num_short = [], 0
        for f in features:
            ids = torch.as_tensor(f["input_ids"], dtype=torch.long)
            spans = self.draw_spans(ids.numel(), int(f["prompt_len"]), int(f.get("idx", 0)))
            num_short += not spans and ids.numel() - 2 < max(int(f["prompt_len"]), 1)
            if self.layout == "truncate" and spans:
                lay = truncate_layout(spans[0], self.mask_num)
                tgt = targets(lay, ids, first_target=int(f["prompt_len"]), drop_offset=self.mask_num)
                real_ids = ids[: spans[0]]
                mask_ids = torch.cat([self.mask_ids.expand(self.mask_num) if self.mask_ids.numel() == 1
                                      else self.mask_ids, self.mask_ids[-1:]])  # dummy mask k+1
            else:
                lay = train_layout(ids.numel(), spans, self.mask_num)
                tgt = targets(lay, ids, first_target=int(f["prompt_len"]))
                real_ids, mask_ids = ids, self.mask_ids
            parts.append((lay, lay.input_ids(real_ids, mask_ids), tgt))
        T = max(p[0].num_real for p in parts)
        # at least one mask column, padding when no sample drew a group (mask_prob < 1, short
        # samples): a frozen-base step's loss is its mask pass's, which needs a row to run
        M = max(1, max(p[0].num_rows - p[0].num_real for p in parts))
        B, Q = len(parts), T + M
        input_ids = torch.full((B, Q), self.pad_id, dtype=torch.long)
        labels = torch.full((B, Q), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((B, Q), dtype=torch.long)
        mask_offset = torch.full((B, Q), -1, dtype=torch.long)
        allowed = torch.zeros((B, 1, Q, Q), dtype=torch.bool)
        for b, (lay, ids, tgt) in enumerate(parts):
            # real rows keep their index (:n), mask rows move behind the real padding (T:T+m):
            # block copies of the layout, no (Q, Q) index tensors
            n, m = lay.num_real, lay.num_rows - lay.num_real
            for out, row in ((input_ids, ids), (labels, tgt), (position_ids, lay.position_ids),
                             (mask_offset, lay.mask_offset)):
                out[b, :n], out[b, T:T + m] = row[:n], row[n:]
            a, src = allowed[b, 0], lay.allowed
            a[:n, :n], a[:n, T:T + m] = src[:n, :n], src[:n, n:]
            a[T:T + m, :n], a[T:T + m, T:T + m] = src[n:, :n], src[n:, n:]
            pad = torch.cat([torch.arange(n, T), torch.arange(T + m, Q)])
            a[pad, pad] = True  # padding rows see only themselves (a finite softmax)
        return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": allowed,
                "labels": labels, "mask_offset": mask_offset, "num_real": T, "num_short": num_short}
