"""Verification of candidates: pure tensor functions, no model, no state (DESIGN §3.4).

Convention (as in the paper and HF): ``p`` is the TARGET distribution (the model's verification
rows), ``q`` the DRAFT distribution the candidates were drawn from (mask rows of the previous step).
Both functions stay on the tensors' device and return tensors, so a decode step can move
everything the host needs in one copy.
"""
from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept candidates while they equal the target argmax.

    Args:
        target_logits: (m+1, vocab) verification rows; row i scores candidate i+1.
        candidates: (m,) candidate ids c_1..c_m, on the logits' device.

    Returns:
        (a, bonus): 0-d long tensors; a in 0..m accepted candidates, bonus = argmax of row a (the
        auto-correct token).
    """
    pred = target_logits.argmax(dim=-1)  # (m+1,)
    m = candidates.numel()
    a = (pred[:m] == candidates).long().cumprod(0).sum()  # length of the leading run of matches
    return a, pred.gather(0, a.view(1))[0]


def verify_rejection(p: torch.Tensor, q: torch.Tensor, candidates: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    Accept c_i with probability min(1, p_{i-1}(c_i) / q_i(c_i)); at the first rejection draw the
    bonus from norm(max(0, p_{i-1} - q_i)); if all m are accepted draw it from p_m. The emitted
    tokens are then distributed exactly as sampling from p one token at a time: the first token
    is c_1 with probability q(c) min(1, p(c)/q(c)) = min(q(c), p(c)), else drawn from the residual
    with total mass 1 - Σ min(p, q), which adds max(0, p(c) - q(c)); together p(c). Given c_1
    accepted, the same argument holds for c_2 under p_1, and so on.

    Args:
        p: (..., m+1, vocab) target probabilities; row i is the distribution of the token after c_i.
        q: (..., m, vocab) draft probabilities; row i-1 is the distribution c_i was drawn from.
        candidates: (..., m) drafted ids.
        generator: a torch.Generator on the tensors' device, for the uniforms and the bonus draw.

    Returns:
        (a, bonus): long tensors of shape (...): accepted count 0..m and the bonus token id.
    """
    m, vocab = candidates.shape[-1], p.shape[-1]
    u = torch.rand(candidates.shape, generator=generator, device=p.device)
    idx = candidates[..., None]
    ratio = p[..., :m, :].gather(-1, idx)[..., 0] / q.gather(-1, idx)[..., 0]  # q(c_i) > 0: drawn from q
    a = (u < ratio).long().cumprod(-1).sum(-1)  # (...,) accepted before the first rejection
    residual = (p[..., :m, :] - q).clamp_min(0)
    # p == q up to rounding leaves no residual mass: then any draw from p is exact
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[..., :m, :])
    bonus_dist = torch.cat([residual, p[..., m:, :]], dim=-2)  # (..., m+1, vocab): row a is used
    row = bonus_dist.gather(-2, a[..., None, None].expand(*a.shape, 1, vocab))[..., 0, :]
    bonus = torch.multinomial(row.reshape(-1, vocab), 1, generator=generator).view(a.shape)
    return a, bonus
