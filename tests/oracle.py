"""A test planner that proposes chosen drafts: the decoder's own planner, fed the drafts a test
hook returns instead of the model's (``SpaceDecoder.generate(..., planner=...)``, issue 44's seam).
Tests use it to force accepts, rejects and sibling paths on a real model, greedy only."""
from __future__ import annotations

from collections.abc import Callable

import torch

from space.decoding.decoder import Drafts
from space.decoding.planner import Proposal, StepOutcome


class DraftOracle:
    """A StepPlanner: before each step after the first, ``override(tokens generated so far, the
    model's drafts)`` returns the drafts to verify next.

    The chain (no tree, no lookup): drafts (m,), returns <= k ids. Otherwise: drafts (r, R) (mask
    j's top-R tokens, r <= k; (0, R) when no group was left), returns (r' <= k, R), or for the
    dynamic tree optionally ``(ids, probs)``, the probabilities the planner prices them with (a row
    sums to at most 1; the planner calibrates its first entry as the top draft).
    """

    def __init__(self, decoder, override: Callable):
        self.decoder, self.override, self.inner = decoder, override, decoder.planner()
        self.generated: list[int] = []
        self.steps = 0

    def propose(self, drafts: Drafts, found: list[list[int]], cache_len: int) -> Proposal:
        if self.steps:
            drafts = self._chosen(drafts)
        self.steps += 1
        return self.inner.propose(drafts, found, cache_len)

    def observe(self, outcome: StepOutcome) -> None:
        self.generated += outcome.emitted
        self.inner.observe(outcome)

    def _chosen(self, drafts: Drafts) -> Drafts:
        dec = self.decoder
        chain = dec.config.tree is None and not dec.lookup
        out = self.override(list(self.generated), drafts.ids[:, 0].cpu() if chain else drafts.ids.cpu())
        probs = None
        if isinstance(out, tuple):
            out, probs = out
        ids = torch.as_tensor(out, dtype=torch.long)
        ids = (ids[:, None] if chain else ids)[: dec.config.mask_num, : dec.draft_ranks].to(dec.device)
        if not dec.dynamic:
            return Drafts(ids, offset=drafts.offset)
        if probs is None:  # keep the model's probabilities where the shapes agree, else uniform
            same = drafts.probs is not None and drafts.probs.shape == ids.shape
            probs = drafts.probs if same else torch.full(ids.shape, 1.0 / ids.shape[1], device=dec.device)
        probs = torch.as_tensor(probs, dtype=torch.float, device=dec.device)[: ids.shape[0], : ids.shape[1]]
        return Drafts(ids, probs=probs, offset=drafts.offset)


def oracle_generate(decoder, prompt, max_new_tokens: int, override: Callable, **kwargs):
    """``decoder.generate`` with a :class:`DraftOracle` as its planner (greedy)."""
    return decoder.generate(prompt, max_new_tokens, planner=DraftOracle(decoder, override), **kwargs)
