"""Logits -> probabilities with temperature, top-k and top-p; seeded sampling (DESIGN §3.4).

The same ``logits_to_probs`` is applied to target rows (p) and draft rows (q), as exact
speculative sampling requires.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import check_int, check_real


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
        seed: seed of the torch.Generator that drives sampling and acceptance, 0..2**64-1.

    Raises:
        ValueError: a field out of range, NaN or inf, or a float where an integer is needed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_real("temperature", self.temperature, 0)
        check_real("top_p", self.top_p, 0, 1, min_open=True)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, 0, 2**64 - 1)  # the range torch.Generator.manual_seed takes

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits: (rows, vocab) -> probs (rows, vocab) in fp32 after temperature, top-k, top-p."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs: (rows, vocab) -> (rows,) token ids drawn with ``generator``."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
