"""Verification of candidates: pure tensor functions, no model, no state (DESIGN §3.4).

Convention (as in the paper and HF): ``p`` is the TARGET distribution (the model's verification
rows), ``q`` the DRAFT distribution the candidates were drawn from (mask rows of the previous step).
"""
from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, candidates: torch.Tensor) -> tuple[int, int]:
    """Accept candidates while they equal the target argmax.

    Args:
        target_logits: (m+1, vocab) verification rows; row i scores candidate i+1.
        candidates: (m,) candidate ids c_1..c_m.

    Returns:
        (a, bonus): a in 0..m accepted candidates, bonus = argmax of row a (the auto-correct token).
    """
    pred = target_logits.argmax(dim=-1)  # (m+1,)
    m = candidates.numel()
    mismatch = (pred[:m] != candidates).nonzero()
    a = int(mismatch[0]) if mismatch.numel() else m
    return a, int(pred[a])


def verify_rejection(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept c_i with probability min(1, p_{i-1}(c_i) / q_i(c_i)); at the first rejection draw the
    bonus from norm(max(0, p_{i-1} - q_i)); if all m are accepted draw it from p_m. The emitted
    tokens are then distributed exactly as sampling from p one token at a time.

    Args:
        p: (m+1, vocab) target probabilities; row i is the distribution of the token after c_i.
        q: (m, vocab) draft probabilities; row i-1 is the distribution c_i was drawn from.
        candidates: (m,) drafted ids.
        generator: torch.Generator for the uniforms and the bonus draw.

    Returns:
        (a, bonus): accepted count 0..m and the bonus token id.
    """
    m = candidates.numel()
    if m:
        idx = torch.arange(m)
        ratio = p[idx, candidates] / q[idx, candidates]  # q(c_i) > 0: c_i was drawn from q
        u = torch.rand(m, generator=generator)
        rejected = (u >= ratio).nonzero()
        if rejected.numel():
            a = int(rejected[0])
            residual = (p[a] - q[a]).clamp_min(0)
            if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
                residual = p[a]
            return a, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return m, int(torch.multinomial(p[m], 1, generator=generator))
