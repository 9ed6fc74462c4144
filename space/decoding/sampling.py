"""Logits -> probabilities with temperature, top-k and top-p; seeded sampling (DESIGN §3.4).

The same ``logits_to_probs`` is applied to target rows (p) and draft rows (q), as exact
speculative sampling requires. ``logit_transform`` gives the model's own logits from its LM
head's output, where the model's forward changes them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import check_int, check_real


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature); at most
            float32's largest value (3.4e38).
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
        if self.temperature > torch.finfo(torch.float32).max:  # inf in the float32 logits: NaN probabilities
            raise ValueError(f"temperature must be <= {torch.finfo(torch.float32).max:.4g} (float32's largest value: "
                             f"the logits are float32), got {self.temperature}")
        check_real("top_p", self.top_p, 0, 1, min_open=True)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, 0, 2**64 - 1)  # the range torch.Generator.manual_seed takes

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling(sampling) -> None:
    """Raise TypeError unless ``sampling`` is a :class:`SamplingConfig` (a bare temperature given
    in its place failed later, as an AttributeError)."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, e.g. SamplingConfig(temperature=0.7), got {sampling!r}")


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits: (rows, vocab) -> probs (rows, vocab) in fp32 after temperature, top-k, top-p.

    The row's largest logit is taken off before the temperature divides: ``logits / T`` overflowed
    to inf below T of about 1e-37 (NaN probabilities, a traceback from the draw), where the shifted
    logits only grow more negative, and the limit is the greedy one-hot."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / cfg.temperature
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


def logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's causal-LM forward does to its LM head's output, for the decoders, which
    call the head on chosen rows themselves: Granite's (and MiniCPM3's) division by
    ``logits_scaling``, HyperCLOVAX's multiplication by it, Cohere's ``logit_scale``, then Gemma
    2-4's ``final_logit_softcapping`` (cap * tanh(x / cap)). Without it greedy output is the same
    (each is increasing), but sampling drew from another distribution than the model's. Keyed by
    ``model_type``, as transformers applies each field: another model's field of the same name
    (MPT's ``logit_scale``) is not read. None when there is nothing to do (Llama, Qwen, ...).

    Args:
        config: the model's config (``model.config``).

    Returns:
        a function of (rows, vocab) logits, or None.
    """
    kind = str(getattr(config, "model_type", ""))
    scale = 1.0
    if kind.startswith("granite") or kind == "minicpm3":
        scale /= float(getattr(config, "logits_scaling", None) or 1.0)
    elif kind.startswith("hyperclovax"):
        scale *= float(getattr(config, "logits_scaling", None) or 1.0)
    elif kind.startswith("cohere"):
        scale *= float(getattr(config, "logit_scale", None) or 1.0)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale == 1.0 and not cap:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale != 1.0:
            logits = logits * scale
        return torch.tanh(logits / cap) * cap if cap else logits

    return transform
